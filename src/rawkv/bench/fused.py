"""Fused NVFP4 producer benchmarks (docs/fused.md): rmsnorm_quantize,
mhc_rmsnorm_quantize, swiglu_quantize (row and tensor scope), moe_stage, at
16384 x 7168 and decode sizes M = 1, 8, 64, each beside (timed in the same run):

* baseline: the unfused rawkv path, i.e. the pre-op in torch (RMSNorm / mHC
  mix / silu*up, BF16 out) followed by rawkv.nvfp4.quantize (when rawkv.nvfp4
  has it; else the all-torch quantize below);
* torch_baseline: all-torch, the same math op by op (pre-op, then docs/format.md's
  quantize steps as torch operations).

GBps counts the fewest bytes: inputs read once, outputs written once.
'launches' is the number of kernel launches (+ memsets) of one fused call.
At decode sizes (M <= 64) a call is host-bound (Python argument checks), so
those entries also carry 'graph_us': one replay of a CUDA graph holding the
call (what a captured decode step pays), and issue 14's latency floors beside
it (rawkv.bench.timing.latency: an empty kernel plus the bytes at copy bandwidth;
goal: ratio <= 1.5).

Entry point: run(rt, results, quick=False) (called by rawkv.bench.cli).
"""
from __future__ import annotations

from .timing import copy_GBps, cuda_time_us, latency, rotation


# ---- timing helpers (rawkv.bench.timing's) ------------------------------------------
def _time_us(fn, reps, warmup=5):
    return cuda_time_us(fn, reps=reps, warmup=warmup)


def _rotation(nbytes, l2):
    return rotation(nbytes, l2)


def _copy_gbps():
    return copy_GBps(1 << 28)


def _graph_us(fn, nbytes):
    """One replay of a CUDA graph holding fn() (no Python in it), and the
    call's time inside a graph, each beside its latency floor (timing.latency)."""
    return latency(fn, nbytes)


def _entry(op, shape, dtype, us, nbytes, copy, base_name, base_us, torch_us, launches):
    gbps = nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0
    return {"op": op, "shape": list(shape), "dtype": dtype, "us": round(us, 2), "GBps": round(gbps, 1),
            "frac_of_copy": round(gbps / copy, 3) if copy else None,
            "baseline": base_name, "baseline_us": round(base_us, 2),
            "speedup": round(base_us / us, 2) if us > 0 else None,
            "torch_baseline": "all-torch, same math", "torch_us": round(torch_us, 2),
            "torch_speedup": round(torch_us / us, 2) if us > 0 else None,
            "launches": launches}


# ---- torch versions of the same math (for the baselines) ---------------------------
def torch_quantize(y, per_row=True):
    """The NVFP4 steps of docs/format.md as torch operations (gs per row or per tensor)."""
    import torch
    yf = y.float()
    m, n = yf.shape
    a = torch.where(torch.isfinite(yf), yf.abs(), 0.0)
    amax = a.amax(-1, keepdim=True) if per_row else a.amax().reshape(1, 1)
    gs = torch.where(amax == 0, 1.0, amax / 2688.0)
    b = yf.view(m, n // 16, 16)
    bmax = b.abs().amax(-1)
    sf = (bmax / (gs * 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn)
    es = sf.float() * gs
    v = b / es[..., None]
    av = v.abs()
    idx = ((av > 0.25).to(torch.uint8) + (av >= 0.75) + (av > 1.25) + (av >= 1.75)
           + (av > 2.5) + (av >= 3.5) + (av > 5.0))
    codes = idx | (torch.signbit(v).to(torch.uint8) << 3)
    bad = ~torch.isfinite(b).all(-1)
    codes = torch.where((es == 0)[..., None] | bad[..., None], 0, codes).to(torch.uint8).view(m, n)
    sf = torch.where(bad, torch.tensor(float("nan"), device=y.device).to(torch.float8_e4m3fn).float(),
                     sf.float()).to(torch.float8_e4m3fn)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return q, sf, gs.reshape(-1)


def torch_rmsnorm(x, w, eps=1e-6):
    import torch
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * w).to(x.dtype), inv


def torch_mix(X, A):
    return (A.float()[..., None] * X.float()).sum(-2).to(X.dtype)


def torch_swiglu(h, g=8):
    import torch
    m, two_i = h.shape
    v = h.view(m, two_i // (2 * g), 2, g)
    gate, up = v[:, :, 0, :].reshape(m, -1).float(), v[:, :, 1, :].reshape(m, -1).float()
    return (torch.nn.functional.silu(gate) * up).to(h.dtype)


def _rawkv_quantize():
    import rawkv
    q = getattr(rawkv.nvfp4, "quantize", None)
    if q is None:
        return None, "torch pre-op + all-torch quantize"
    return q, "torch pre-op + rawkv.nvfp4.quantize"


# ---- the benchmark -----------------------------------------------------------------
def run(rt, results, quick=False):
    import torch
    from rawkv import fused as F
    copy = _copy_gbps()
    rq, base_name = _rawkv_quantize()
    reps = 10 if quick else 50
    big = [(16384, 7168)] if not quick else [(4096, 7168)]
    sizes = [(1, 7168), (8, 7168), (64, 7168)] + big
    dev = "cuda"
    l2 = rt.l2_bytes
    bf = torch.bfloat16

    def unfused_q(y, scope):
        if rq is not None:
            return rq(y, scope=scope)
        return torch_quantize(y, scope == "row")

    for m, n in sizes:
        # ---- rmsnorm_quantize ----
        nbytes_in = m * n * 2
        k = _rotation(nbytes_in, l2)
        xs = [torch.randn(m, n, device=dev, dtype=bf) for _ in range(k)]
        w = torch.rand(n, device=dev) + 0.5
        out = F.rmsnorm_quantize(xs[0], w)
        us = _time_us(lambda i: F.rmsnorm_quantize(xs[i % k], w, out=out), reps)
        base = _time_us(lambda i: unfused_q(torch_rmsnorm(xs[i % k], w)[0], "row"), reps)
        tus = _time_us(lambda i: torch_quantize(torch_rmsnorm(xs[i % k], w)[0], True), reps)
        nbytes = nbytes_in + n * 4 + m * n // 2 + m * n // 16 + 8 * m
        results.append(_entry("rmsnorm_quantize", (m, n), "bfloat16", us, nbytes, copy, base_name, base,
                              tus, 1))
        if m <= 64:
            results[-1].update(_graph_us(lambda: F.rmsnorm_quantize(xs[0], w, out=out), nbytes))
        del xs

        # ---- mhc_rmsnorm_quantize (n_hc = 4) ----
        nbytes_in = m * 4 * n * 2
        k = _rotation(nbytes_in, l2)
        Xs = [torch.randn(m, 4, n, device=dev, dtype=bf) for _ in range(k)]
        A = torch.rand(m, 4, device=dev)
        out = F.mhc_rmsnorm_quantize(Xs[0], A, w)
        us = _time_us(lambda i: F.mhc_rmsnorm_quantize(Xs[i % k], A, w, out=out), reps)
        base = _time_us(lambda i: unfused_q(torch_rmsnorm(torch_mix(Xs[i % k], A), w)[0], "row"), reps)
        tus = _time_us(lambda i: torch_quantize(torch_rmsnorm(torch_mix(Xs[i % k], A), w)[0], True), reps)
        nbytes = nbytes_in + m * 16 + n * 4 + m * n // 2 + m * n // 16 + 8 * m
        results.append(_entry("mhc_rmsnorm_quantize", (m, 4, n), "bfloat16", us, nbytes, copy, base_name,
                              base, tus, 1))
        if m <= 64:
            results[-1].update(_graph_us(lambda: F.mhc_rmsnorm_quantize(Xs[0], A, w, out=out), nbytes))
        del Xs

        # ---- swiglu_quantize: h (m, n) fused gate/up, I = n / 2 ----
        nbytes_in = m * n * 2
        k = _rotation(nbytes_in, l2)
        hs = [torch.randn(m, n, device=dev, dtype=bf) for _ in range(k)]
        for scope, launches in (("row", 1), ("tensor", 3)):
            out = F.swiglu_quantize(hs[0], scope=scope)
            us = _time_us(lambda i: F.swiglu_quantize(hs[i % k], scope=scope, out=out), reps)
            base = _time_us(lambda i: unfused_q(torch_swiglu(hs[i % k]), scope), reps)
            tus = _time_us(lambda i: torch_quantize(torch_swiglu(hs[i % k]), scope == "row"), reps)
            nbytes = nbytes_in + m * n // 4 + m * n // 32 + (4 * m if scope == "row" else 4)
            results.append(_entry("swiglu_quantize" + ("/tensor" if scope == "tensor" else ""), (m, n),
                                  "bfloat16", us, nbytes, copy, base_name, base, tus, launches))
            if m <= 64:
                results[-1].update(_graph_us(lambda: F.swiglu_quantize(hs[0], scope=scope, out=out), nbytes))
        del hs

        # ---- moe_stage (top-k 8) ----
        nbytes_in = m * n * 2
        k = _rotation(nbytes_in, l2)
        hid = [torch.randn(m, n, device=dev, dtype=bf) for _ in range(k)]
        ids = torch.randint(0, 256, (m, 8), device=dev, dtype=torch.int32)
        wts = torch.rand(m, 8, device=dev)
        out = F.moe_stage(hid[0], ids, wts)

        def unfused_moe(i):
            x = hid[i % k]
            if rq is not None:
                q, sf, _ = rq(x, scope="none")
                sf.view(torch.uint8).view(torch.int32)
            else:
                torch_quantize(x, True)
            ids.long()
            wts.clone()

        def torch_moe(i):
            q, sf, _ = torch_quantize(hid[i % k], True)
            sf.view(torch.uint8).view(torch.int32)
            ids.long()
            wts.clone()
        us = _time_us(lambda i: F.moe_stage(hid[i % k], ids, wts, out=out), reps)
        base = _time_us(unfused_moe, reps)
        tus = _time_us(torch_moe, reps)
        nbytes = nbytes_in + m * n // 2 + m * n // 16 + m * 8 * (4 + 8 + 4 + 4)
        results.append(_entry("moe_stage", (m, n), "bfloat16", us, nbytes, copy,
                              base_name.replace("torch pre-op + ", "") + " (scope none) + torch copies",
                              base, tus, 1))
        if m <= 64:
            results[-1].update(_graph_us(lambda: F.moe_stage(hid[0], ids, wts, out=out), nbytes))
        del hid
        torch.cuda.empty_cache()
    return results
