"""Grouped FP4 GEMM benchmarks (issue 11): DeepSeek-V4 wo_a (batched) at the
Flash, Pro and seed-004 shapes, and the DeepSeek-V4-Flash MoE experts
(ragged), beside torch's BF16 einsum / grouped matmul and FP8 _scaled_mm
timed in the same run.

floor_us: the bytes that must move (E2M1 codes, block scales, activations,
output; for MoE only the experts the tokens touch) at the copy bandwidth of
the same run. Weights rotate over several copies when they would fit in L2.

Entry point: run(rt, results, quick=False) (called by tools/bench.py)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WO_A = {"flash": (8, 4096, 1024), "pro": (16, 4096, 1024), "seed004": (8, 8192, 1536)}
MOE = {"gate_up": (4096, 4096), "down": (4096, 2048)}     # (N, K) per expert
EXPERTS, TOP_K = 256, 6


def _random_weight(torch, g, n, k, dev):
    from rawkv.gemm import Fp4Weight
    from rawkv.reference.gemm import padded_sizes
    npad, chunks = padded_sizes(n, k)
    codes = torch.randint(0, 256, (g, npad // 16, chunks, 32, 16), dtype=torch.uint8, device=dev)
    scales = torch.randint(0x20, 0x50, (g, npad // 16, chunks, 32, 2), dtype=torch.uint8, device=dev)
    gs = torch.full((g,), 1e-3, device=dev)
    return Fp4Weight("nvfp4", n, k, codes, scales, gs)


def _fp8_loop(torch, x, w8, scale):
    """wo_a as G FP8 GEMMs (torch._scaled_mm, per-tensor scales)."""
    return [torch._scaled_mm(x[:, g], w8[g].t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
            for g in range(w8.shape[0])]


def run(rt, results, quick=False):
    import torch
    import rawkv
    from bench import copy_bandwidth_GBps, cuda_time_us, entry, rotation
    copy = copy_bandwidth_GBps()
    dev = "cuda"
    reps = 10 if quick else 40
    ms = (1, 16, 4096) if quick else (1, 8, 16, 64, 512, 4096)
    for name, (g, k, n) in WO_A.items():
        wbytes = g * n * k // 2 + g * n * k // 16
        sets = min(8, rotation(wbytes, rt.l2_bytes))
        ws = [_random_weight(torch, g, n, k, dev) for _ in range(sets)]
        wb = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16)
        w8 = wb.to(torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None
        for m in ms:
            x = torch.randn(m, g, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, g, n, device=dev, dtype=torch.bfloat16)
            us = cuda_time_us(lambda i: rawkv.gemm.grouped_linear(x, ws[i % sets], out=out), reps=reps)
            base = cuda_time_us(lambda i: torch.einsum("sgd,grd->sgr", x, wb), reps=reps)
            nbytes = wbytes + m * g * k * 2 + m * g * n * 2
            flops = 2 * m * g * n * k
            extra = {"floor_us": round(nbytes / copy / 1e3, 2), "TFLOPs": round(flops / us / 1e6, 1),
                     "baseline_TFLOPs": round(flops / base / 1e6, 1)}
            extra["frac_of_floor"] = round(extra["floor_us"] / us, 3)
            if w8 is not None and m % 16 == 0:
                try:
                    x8 = x.to(torch.float8_e4m3fn)
                    one = torch.ones((), device=dev)
                    extra["fp8_scaled_mm_us"] = round(cuda_time_us(lambda i: _fp8_loop(torch, x8, w8, one),
                                                                   reps=reps), 2)
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    extra["fp8_scaled_mm_us"] = f"unavailable: {type(exc).__name__}"
            results.append(entry(f"grouped_linear/wo_a-{name}", (m, g, k, n), "nvfp4xbf16", us, nbytes, copy,
                                 baseline="torch-einsum-bf16", baseline_us=base, **extra))
            print(f"[gemm] wo_a {name} M={m}: {us:.1f} us ({extra['frac_of_floor']:.0%} of floor "
                  f"{extra['floor_us']} us, {extra['TFLOPs']} TFLOP/s); einsum {base:.1f} us", flush=True)
        ws = wb = w8 = None  # free before the next shape
        torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in MOE.items():
        w = _random_weight(torch, EXPERTS, n, k, dev)
        wb = None
        for tokens in ((1, 4096) if quick else (1, 64, 4096)):
            choice = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
            counts = torch.bincount(choice.reshape(-1), minlength=EXPERTS)
            offsets = torch.zeros(EXPERTS + 1, dtype=torch.int32)
            offsets[1:] = torch.cumsum(counts, 0)
            rows = tokens * TOP_K
            offs = offsets.to(dev)
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            us = cuda_time_us(lambda i: rawkv.gemm.moe_linear(x, w, offs, out=out), reps=reps)
            touched = int((counts > 0).sum())
            nbytes = touched * (n * k // 2 + n * k // 16) + rows * (k + n) * 2
            flops = 2 * rows * n * k
            extra = {"floor_us": round(nbytes / copy / 1e3, 2), "TFLOPs": round(flops / us / 1e6, 1),
                     "experts_touched": touched}
            extra["frac_of_floor"] = round(extra["floor_us"] / us, 3)
            base = None
            if hasattr(torch, "_grouped_mm"):
                try:
                    if wb is None:
                        wb = torch.randn(EXPERTS, k, n, device=dev, dtype=torch.bfloat16)
                    ends = offs[1:].contiguous()
                    base = cuda_time_us(lambda i: torch._grouped_mm(x, wb, offs=ends), reps=reps)
                    extra["baseline_TFLOPs"] = round(flops / base / 1e6, 1)
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    extra["baseline_error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                    base = None
            results.append(entry(f"moe_linear/{name}", (tokens, EXPERTS, TOP_K, k, n), "nvfp4xbf16", us, nbytes,
                                 copy, **({"baseline": "torch-grouped_mm-bf16", "baseline_us": base}
                                          if base else {}), **extra))
            print(f"[gemm] moe {name} tokens={tokens}: {us:.1f} us ({extra['frac_of_floor']:.0%} of floor "
                  f"{extra['floor_us']} us, {extra['TFLOPs']} TFLOP/s); grouped_mm "
                  f"{'-' if base is None else f'{base:.1f} us'}", flush=True)
        w = wb = None
        torch.cuda.empty_cache()
