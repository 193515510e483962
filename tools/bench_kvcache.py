#!/usr/bin/env python3
"""Moved into the package: rawkv/bench/kvcache.py. Runs that group from a source
checkout: python3 tools/bench_kvcache.py [--quick] [--out DIR] [--peer], the same as
python -m rawkv bench --only kvcache."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(group="kvcache"))
