#!/usr/bin/env python3
"""Moved into the package: rawkv/bench/compare.py (python -m rawkv.bench.compare
OLD_DIR NEW_DIR [--group nvfp4]). Runs it from a source checkout."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from rawkv.bench.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
