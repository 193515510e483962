#!/usr/bin/env python3
"""Run from a source checkout: python tools/nvrtc_check.py (see rawkv/tools/nvrtc_check.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from rawkv.tools.nvrtc_check import main  # noqa: E402

sys.exit(main())
