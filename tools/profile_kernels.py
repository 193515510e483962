#!/usr/bin/env python3
"""Run the main large-size kernels a few times each, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats -k regex:rkv_ -c 12 python3 tools/profile_kernels.py

(no timing here: ncu measures; see tools/bench.py for the benchmarks)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import rawkv  # noqa: E402


def main():
    rawkv.warmup()
    M, N = 16384, 7168
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(N, device="cuda", dtype=torch.float32) + 0.5
    for scope in ("none", "row"):
        q, sf, gs = rawkv.nvfp4.quantize(x, scope=scope)
    y = rawkv.nvfp4.dequantize(q, sf, gs)
    rawkv.fused.rmsnorm_quantize(x, w)
    h = torch.randn(M, 2 * 3584, device="cuda", dtype=torch.bfloat16)
    rawkv.fused.swiglu_quantize(h)
    torch.cuda.synchronize()
    print("done", y.shape)


if __name__ == "__main__":
    main()
