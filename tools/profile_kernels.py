#!/usr/bin/env python3
"""Run the main large-size kernels once each, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats -k regex:rkv_ python3 tools/profile_kernels.py [group ...]

groups: nvfp4, fused, fp8, kvcache, compress, gemm (default: nvfp4 and fused). No timing here: ncu measures;
see python -m rawkv bench for the benchmarks."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import rawkv  # noqa: E402

M, N = 16384, 7168


def nvfp4():
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    for scope in ("none", "row", "tensor"):
        q, sf, gs = rawkv.nvfp4.quantize(x, scope=scope)
    rawkv.nvfp4.dequantize(q, sf, gs)


def fused():
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(N, device="cuda", dtype=torch.float32) + 0.5
    rawkv.fused.rmsnorm_quantize(x, w)
    x4 = torch.randn(M // 4, 4, N, device="cuda", dtype=torch.bfloat16)
    mix = torch.rand(M // 4, 4, device="cuda", dtype=torch.float32)
    rawkv.fused.mhc_rmsnorm_quantize(x4, mix, w)
    h = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    rawkv.fused.swiglu_quantize(h)
    rawkv.fused.swiglu_quantize(h, scope="tensor")
    ids = torch.randint(0, 256, (M, 8), device="cuda", dtype=torch.int32)
    rawkv.fused.moe_stage(x, ids, torch.rand(M, 8, device="cuda"))



def fp8():
    x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)
    codes = rawkv.fp8.e4m3_encode(x)
    rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)


def kvcache():
    """The top-k gather of bench kvcache: 64 requests, 2,048 of 16,384 entries each."""
    from rawkv.bench.kvcache import _fill_pool
    B, n, epb, topk = 64, 16384, 64, 2048
    pool = rawkv.kvcache.PagedKVPool("csa", B * (n // epb + 1), epb, B, n // epb + 1, device="cuda")
    _fill_pool(pool, B, n)
    slots = torch.arange(B, dtype=torch.int32, device="cuda")
    ids = torch.stack([torch.randperm(n, device="cuda")[:topk] for _ in range(B)]).to(torch.int32)
    rawkv.kvcache.gather_topk(pool, slots, ids)


def compress():
    """The prefill compression of bench kvcache: 128K tokens, CSA (with its indexer) and HCA."""
    from rawkv.bench.kvcache import D, DI
    kvc = rawkv.kvcache
    T = 131072
    for kind, m in (("csa", 4), ("hca", 128)):
        coff = 2 if kind == "csa" else 1
        n = T // m
        pool = kvc.PagedKVPool(kind, n // 64 + 1, 64, 1, n // 64 + 1, layout="rawkv", device="cuda")
        s0 = pool.add_request()
        pool.prepare_step([s0], [T - 1])
        kv, z = (torch.randn((T, coff * D), device="cuda") for _ in range(2))
        ape = torch.randn((m, coff * D), device="cuda")
        idx = None
        if kind == "csa":
            idx = (torch.randn((T, 2 * DI), device="cuda"), torch.randn((T, 2 * DI), device="cuda"),
                   torch.randn((m, 2 * DI), device="cuda"), torch.ones(DI, device="cuda"))
        kvc.compress_prefill(pool, kv, z, ape, torch.ones(D, device="cuda"), s0, index=idx)


def gemm():
    """The DeepSeek-V4-Pro wo_a GEMM (16 groups, K 4096, N 1024): prefill (4,096 tokens, the
    wgmma kernel on sm_90) and decode (1 token, the mma.sync kernel)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from probe_gemm_paths import random_weight
    g, k, n = 16, 4096, 1024
    w = random_weight(torch, g, n, k)
    for m in (4096, 1):
        x = torch.randn(m, g, k, device="cuda", dtype=torch.bfloat16)
        rawkv.gemm.grouped_linear(x, w)


def main():
    groups = sys.argv[1:] or ["nvfp4", "fused"]
    for g in groups:
        globals()[g]()
    torch.cuda.synchronize()
    print("done", groups)


if __name__ == "__main__":
    main()
