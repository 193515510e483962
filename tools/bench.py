#!/usr/bin/env python3
"""The benchmarks moved into the package: python -m rawkv bench (rawkv/bench/;
`python -m rawkv bench --help`). This entry point runs the same command from
a source checkout, with the same options:

    python3 tools/bench.py --out bench/results [--only core,nvfp4] [--quick] [--peer]

and keeps the timing helpers importable as `bench` for the scripts beside it
(tools/probe_gemm_paths.py: `from bench import cuda_time_us`)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from rawkv.bench.timing import (  # noqa: E402,F401  (re-exported for the tools' scripts)
    COPY, copy_bandwidth_GBps, cuda_time_us, entry, graph_time_us, host_us_interleaved, host_us_per_call,
    latency, rotation)

__all__ = ["COPY", "copy_bandwidth_GBps", "cuda_time_us", "entry", "graph_time_us", "host_us_interleaved",
           "host_us_per_call", "latency", "rotation", "main"]


def main(argv=None, group=None) -> int:
    """python -m rawkv bench with argv (default: this script's), only `group` when given."""
    from rawkv.__main__ import main as rawkv_main
    argv = list(sys.argv[1:] if argv is None else argv)
    return rawkv_main(["bench"] + (["--only", group] if group else []) + argv)


if __name__ == "__main__":
    sys.exit(main())
