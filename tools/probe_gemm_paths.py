"""Both GEMM kernel paths on one GPU, forced in turn (rawkv.gemm.linear.KERNEL_PATH):
the mma.sync kernel and, on sm_90, the wgmma kernel, beside torch's BF16 einsum, for
the wo_a shapes at the given M (tokens per group). Each time is the median of CUDA-graph
replays (tools/bench.py's cuda_time_us: device time, not the host's), over 4 weight copies; maxdiff is the largest difference between the paths relative to
the largest output. For choosing SM90_MIN_TOKENS; tools/bench_gemm.py is the benchmark.

    PYTHONPATH=src [RAWKV_MOE_TOKENS=64,4096] [RAWKV_SM90_BM=128|256] python3 tools/probe_gemm_paths.py [M ...]
"""
import os
import sys

SHAPES = {"flash": (8, 4096, 1024), "pro": (16, 4096, 1024), "seed004": (8, 8192, 1536)}   # (G, K, N)


def random_weight(torch, g, n, k):
    import rawkv
    from rawkv.reference.gemm import padded_sizes
    npad, chunks = padded_sizes(n, k)
    codes = torch.randint(0, 256, (g, npad // 16, chunks, 32, 16), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x20, 0x50, (g, npad // 16, chunks, 32, 2), dtype=torch.uint8, device="cuda")
    return rawkv.gemm.Fp4Weight("nvfp4", n, k, codes, scales, torch.full((g,), 1e-3, device="cuda"))


def median_us(torch, fn):
    """Device time of one fn(i) call: CUDA-graph replays (tools/bench.py), so
    the host's time per call is not counted."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench import cuda_time_us
    return cuda_time_us(fn)


def main(argv):
    import torch
    import rawkv
    from rawkv.gemm import linear
    if os.environ.get("RAWKV_SM90_BM"):     # the wgmma kernel's feature tile, else the plan's
        linear.SM90_FORCE_BM = int(os.environ["RAWKV_SM90_BM"])
    ms = [int(a) for a in argv] or [64, 128, 512, 2048, 4096]
    print(f"{'shape':8} {'M':>5} {'mma':>9} {'sm90':>9} {'bf16':>9} {'sm90 TF':>8} {'bf16 TF':>8} maxdiff")
    for name, (g, k, n) in SHAPES.items():
        ws = [random_weight(torch, g, n, k) for _ in range(4)]
        wb = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, g, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, g, n, device="cuda", dtype=torch.bfloat16)
            us, res = {}, {}
            for path in ("mma", "sm90"):
                linear.KERNEL_PATH = path
                us[path] = median_us(torch, lambda i: rawkv.gemm.grouped_linear(x, ws[i % 4], out=out))
                res[path] = rawkv.gemm.grouped_linear(x, ws[0]).float()
            linear.KERNEL_PATH = "auto"
            diff = ((res["mma"] - res["sm90"]).abs().max() / res["mma"].abs().max()).item()
            bf = median_us(torch, lambda i: torch.einsum("sgd,grd->sgr", x, wb))
            flops = 2 * m * g * n * k
            print(f"{name:8} {m:5d} {us['mma']:9.1f} {us['sm90']:9.1f} {bf:9.1f} {flops / us['sm90'] / 1e6:8.0f} "
                  f"{flops / bf / 1e6:8.0f} {diff:.2e}", flush=True)

    moe(torch, [int(t) for t in os.environ.get("RAWKV_MOE_TOKENS", "64,4096").split(",")])


MOE = {"flash_gate_up": (256, 6, 4096, 4096), "flash_down": (256, 6, 4096, 2048)}   # (E, top-k, N, K)


def moe(torch, token_counts, bns=(64, 128)):
    """The ragged (MoE) GEMM on both paths, random top-k routing, rows sorted by expert."""
    import rawkv
    from rawkv.gemm import linear
    print(f"{'moe':14} {'tokens':>6} {'mma':>9} " + " ".join(f"{'sm90/' + str(b):>9}" for b in bns) + " TF(best)")
    for name, (e, top, n, k) in MOE.items():
        ws = [random_weight(torch, e, n, k) for _ in range(2)]
        gen = torch.Generator().manual_seed(0)
        for tokens in token_counts:
            ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(tokens)]).flatten()
            counts = torch.bincount(ids, minlength=e)
            offsets = torch.zeros(e + 1, dtype=torch.int32)
            offsets[1:] = torch.cumsum(counts, 0)
            rows = int(offsets[-1])
            offs = offsets.cuda()
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            us = {}
            linear.KERNEL_PATH = "mma"
            us["mma"] = median_us(torch, lambda i: rawkv.gemm.moe_linear(x, ws[i % 2], offs, out=out))
            linear.KERNEL_PATH = "sm90"
            for b in bns:
                linear.SM90_FORCE_BN = b
                us[b] = median_us(torch, lambda i: rawkv.gemm.moe_linear(x, ws[i % 2], offs, out=out))
            linear.SM90_FORCE_BN = None
            linear.KERNEL_PATH = "auto"
            flops = 2 * rows * n * k
            print(f"{name:14} {tokens:6d} {us['mma']:9.1f} " + " ".join(f"{us[b]:9.1f}" for b in bns)
                  + f" {flops / min(us.values()) / 1e6:8.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
