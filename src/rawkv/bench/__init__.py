"""python -m rawkv bench [--only GROUPS] [--quick] [--out DIR] [--peer]

rawkv's benchmarks on a CUDA GPU, from the installed package. Each group
prints a table (op, shape, device time in us, the baseline's time, the
fraction of the copy bandwidth or of the GEMM's byte floor, the peer's time
where there is one), writes <out>/<date>-<device>-<group>.json in the shape
docs/benchmarks.md describes ({device, torch, cupy, commit, copy_GBps,
results: [...]}) and, when matplotlib is installed, a figure beside it (.png).

Groups: core (copy bandwidth, host launch overhead, FP8), nvfp4, fused,
kvcache, gemm: one module each in rawkv.bench, exposing run(rt, results,
quick) and optionally plot(results, png_path).
Timing: kernels are captured into CUDA graphs and timed with CUDA events
(median over replays, after warm-up), so figures are device time; inputs are
rotated across several buffers when they would fit in L2. Host overhead per
call is measured separately (launch_overhead). Torch baselines always run;
--peer adds the peers that are installed (humming-kernels for gemm:
pip install 'rawkv[bench]').

The commit recorded is RAWKV_COMMIT when set, else git's HEAD when rawkv is
a git checkout's source tree, else rawkv's version (an installed wheel).
Without a CUDA GPU it exits with status 2 and one line saying what is missing.
"""

GROUPS = ("core", "nvfp4", "fused", "kvcache", "gemm")
