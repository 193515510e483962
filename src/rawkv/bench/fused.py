"""Fused NVFP4 producer benchmarks (docs/fused.md): rmsnorm_quantize,
mhc_rmsnorm_quantize, swiglu_quantize (row and tensor scope), moe_stage, at
16384 x 7168 and decode sizes M = 1, 8, 64, each beside (timed in the same run):

* baseline: the unfused rawkv path, i.e. the pre-op in torch (RMSNorm / mHC
  mix / silu*up, BF16 out) followed by rawkv.nvfp4.quantize (when rawkv.nvfp4
  has it; else the all-torch quantize below);
* torch_baseline: all-torch, the same math op by op (pre-op, then docs/format.md's
  quantize steps as torch operations).

And the FP8 block activations that feed the W4A8 GEMM (E4M3 codes, one
scale per row per 128 channels, scale_format 'ue8m0' unless named), at the
same sizes:

* quantize_blocks, quantize_blocks/fp32 (float32 scales): rawkv.fp8.quantize_blocks
  of BF16 x; baseline and torch_baseline both torch_act_quant, DeepSeek-V4's
  act_quant rule as torch operations ("torch act_quant (DeepSeek's rule)",
  timed once);
* rmsnorm_quantize_fp8, swiglu_quantize_fp8, moe_stage_fp8: baseline the torch
  pre-op (nothing for moe_stage_fp8; its top-k copies in torch) followed by
  rawkv.fp8.quantize_blocks; torch_baseline the pre-op followed by
  torch_act_quant.

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

from types import SimpleNamespace

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


def _entry(op, shape, dtype, us, nbytes, copy, base_name, base_us, torch_us, launches,
           torch_name="all-torch, same math"):
    gbps = nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0
    return {"op": op, "shape": list(shape), "dtype": dtype, "us": round(us, 2), "GBps": round(gbps, 1),
            "frac_of_copy": round(gbps / copy, 3) if copy else None,
            "baseline": base_name, "baseline_us": round(base_us, 2),
            "speedup": round(base_us / us, 2) if us > 0 else None,
            "torch_baseline": torch_name, "torch_us": round(torch_us, 2),
            "torch_speedup": round(torch_us / us, 2) if us > 0 else None,
            "launches": launches}


# ---- torch versions of the same math (for the baselines) ---------------------------
def torch_quantize(y, per_row=True):
    """The NVFP4 steps of docs/format.md as torch operations: gs per row
    (per_row True), per tensor (False) or, per_row None, gs = 1 without an
    amax pass (scope 'none': one-level NVFP4, what moe_stage writes)."""
    import torch
    yf = y.float()
    m, n = yf.shape
    if per_row is None:
        gs = torch.ones((1, 1), device=yf.device)
    else:
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
    # (a Python NaN, not a tensor made on the host: a host-to-device copy
    # cannot be captured in a CUDA graph, and the timing fell back to eager)
    sf = torch.where(bad, float("nan"), sf.float()).to(torch.float8_e4m3fn)
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


def torch_act_quant(x, block=128, ue8m0=True):
    """DeepSeek-V4's act_quant as torch operations (rawkv.reference.fp8_blocks
    states the rule and its source): x (..., K), K % block == 0 (V4's own
    assert) -> (codes float8_e4m3fn (..., K), scales (..., K/block): float32,
    or for ue8m0 the E8M0 bytes as uint8). The bytes of
    rawkv.reference.fp8_blocks.quantize_blocks for finite x; a block holding
    NaN or Inf is not flagged here and its bytes are not the reference's
    (codes 0 and a NaN scale there; here whatever the torch steps give, e.g.
    an E8M0 byte 0x00 and codes -448 for a NaN block: a timing baseline,
    not a quantizer)."""
    import torch
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"x: the last dimension ({k}) must be a multiple of block ({block})")
    xb = x.float().unflatten(-1, (k // block, block))
    # Python scalars meet a float32 tensor as float32: FP32(1e-4) and
    # FP32(1/448), the reference's constants; s is a product, not amax / 448
    amax = xb.abs().amax(-1).clamp(min=1e-4)
    s = amax * (1.0 / 448.0)
    scales = s
    if ue8m0:
        # 2^ceil(log2 s) from s's bits, exactly: s is normal and positive, so
        # its biased exponent, plus one when any mantissa bit is set
        bits = s.view(torch.int32)
        byte = (bits >> 23) + ((bits & 0x7FFFFF) != 0).int()
        s = (byte << 23).view(torch.float32)
        scales = byte.to(torch.uint8)
    # the rule's clamp (the reference's satfinite): torch's float8 conversion
    # would make NaN of a value past E4M3's range rather than saturate it
    codes = (xb / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.flatten(-2), scales


def torch_moe_stage(hidden, ids, wts):
    """moe_stage as torch operations (the moe_stage row's all-torch
    baseline): one-level NVFP4 of hidden (gs = 1, as the op: no amax pass),
    the scales packed four per int32, the top-k ids widened to int64 and the
    weights copied. The op's bytes for finite hidden without an all-zero
    block (torch_quantize writes scale 0 there, the op 1.0)."""
    import torch
    q, sf, _ = torch_quantize(hidden, None)
    return q, sf.view(torch.uint8).view(torch.int32), ids.long(), wts.clone()


def unfused_nvfp4(rq, pre, scope):
    """The NVFP4 rows' unfused baseline f(i): rq (rawkv.nvfp4.quantize) of
    pre(i), the torch pre-op on input set i, into buffers made before any
    capture (rawkv refuses to allocate while a graph is captured, and the
    timing would fall back to eager calls: their host time), or the
    all-torch quantize where rawkv.nvfp4 has none (rq None)."""
    if rq is None:
        return lambda i: torch_quantize(pre(i), scope == "row")
    out = rq(pre(0), scope=scope)
    return lambda i: rq(pre(i), scope=scope, out=out)


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
    bench = SimpleNamespace(copy=copy, reps=reps, l2=l2, dev=dev)

    def unfused(pre, scope):
        return unfused_nvfp4(rq, pre, scope)

    for m, n in sizes:
        # ---- rmsnorm_quantize ----
        nbytes_in = m * n * 2
        k = _rotation(nbytes_in, l2)
        xs = [torch.randn(m, n, device=dev, dtype=bf) for _ in range(k)]
        w = torch.rand(n, device=dev) + 0.5
        out = F.rmsnorm_quantize(xs[0], w)
        us = _time_us(lambda i: F.rmsnorm_quantize(xs[i % k], w, out=out), reps)
        base = _time_us(unfused(lambda i: torch_rmsnorm(xs[i % k], w)[0], "row"), reps)
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
        base = _time_us(unfused(lambda i: torch_rmsnorm(torch_mix(Xs[i % k], A), w)[0], "row"), reps)
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
            base = _time_us(unfused(lambda i: torch_swiglu(hs[i % k]), scope), reps)
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

        quantize_hidden = unfused(lambda i: hid[i % k], "none")

        def unfused_moe(i):
            quantize_hidden(i)
            ids.long()
            wts.clone()

        def torch_moe(i):
            torch_moe_stage(hid[i % k], ids, wts)
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
        results.extend(_fp8_rows(m, n, bench))
        torch.cuda.empty_cache()
    return results


# ---- the FP8 block-activation rows ---------------------------------------------------
_ACT_QUANT = "torch act_quant (DeepSeek's rule)"
_FP8_BASE = "torch pre-op + rawkv.fp8.quantize_blocks"
_FP8_TORCH = "torch pre-op + " + _ACT_QUANT
_FP8_BLOCK = 128


def _fp8_rows(m, n, bench):
    """The FP8 rows of size (m, n), each input set freed before the next is made."""
    return [*_quantize_blocks_rows(m, n, bench), _rmsnorm_fp8_row(m, n, bench), _swiglu_fp8_row(m, n, bench),
            _moe_stage_fp8_row(m, n, bench)]


def _fp8_out_bytes(m, n, scale_bytes=1):
    """What an FP8 block output of m rows of n channels writes: a byte per
    code, a scale (1 byte E8M0, 4 float32) per row per 128 channels."""
    return m * n + m * -(-n // _FP8_BLOCK) * scale_bytes


def _bf16_inputs(shape, bench):
    """Random BF16 inputs of `shape`, as many as make a rotation through
    them miss in L2 (timing.rotation)."""
    import math
    import torch
    k = _rotation(math.prod(shape) * 2, bench.l2)
    return [torch.randn(*shape, device=bench.dev, dtype=torch.bfloat16) for _ in range(k)]


def _fp8_baselines(pre, after=None):
    """(baseline, torch baseline) of an FP8 producer, each f(i): pre(i) (the
    torch pre-op on input set i), then rawkv.fp8.quantize_blocks or
    torch_act_quant of it, then after() (moe_stage's top-k copies)."""
    from rawkv import fp8
    # the baseline's output buffers, made before any capture: rawkv refuses to
    # allocate while a graph is being captured, and the timing would fall back
    # to eager calls (their host time)
    out = fp8.quantize_blocks(pre(0), scale_format="ue8m0")

    def unfused(i):
        fp8.quantize_blocks(pre(i), scale_format="ue8m0", out=out)
        if after is not None:
            after()

    def all_torch(i):
        torch_act_quant(pre(i))
        if after is not None:
            after()
    return unfused, all_torch


def _fp8_row(op, shape, calls, names, nbytes, bench):
    """A result row of an FP8 op: calls (fused, baseline, torch baseline),
    each f(i) on input set i, timed; names (baseline, torch baseline). A
    torch baseline that is the baseline is timed once. Decode sizes also
    carry _graph_us of the fused call."""
    fused, base, all_torch = calls
    us = _time_us(fused, bench.reps)
    base_us = _time_us(base, bench.reps)
    torch_us = base_us if all_torch is base else _time_us(all_torch, bench.reps)
    row = _entry(op, shape, "bfloat16", us, nbytes, bench.copy, names[0], base_us, torch_us, 1,
                 torch_name=names[1])
    if shape[0] <= 64:
        row.update(_graph_us(lambda: fused(0), nbytes))
    return row


def _quantize_blocks_rows(m, n, bench):
    """quantize_blocks (E8M0 byte scales) and quantize_blocks/fp32 (float32 scales)."""
    from rawkv import fp8
    xs = _bf16_inputs((m, n), bench)
    rows = []
    for fmt, op, scale_bytes in (("ue8m0", "quantize_blocks", 1), ("fp32", "quantize_blocks/fp32", 4)):
        out = fp8.quantize_blocks(xs[0], scale_format=fmt)

        def act_quant(i, ue8m0=fmt == "ue8m0"):
            return torch_act_quant(xs[i % len(xs)], ue8m0=ue8m0)
        calls = (lambda i: fp8.quantize_blocks(xs[i % len(xs)], scale_format=fmt, out=out), act_quant, act_quant)
        rows.append(_fp8_row(op, (m, n), calls, (_ACT_QUANT, _ACT_QUANT),
                             m * n * 2 + _fp8_out_bytes(m, n, scale_bytes), bench))
    return rows


def _rmsnorm_fp8_row(m, n, bench):
    """rmsnorm_quantize_fp8: reads x and the float32 weight, writes the FP8
    output and inv_rms (float32 per row)."""
    import torch
    from rawkv import fused as F
    xs = _bf16_inputs((m, n), bench)
    w = torch.rand(n, device=bench.dev) + 0.5
    out = F.rmsnorm_quantize_fp8(xs[0], w, scale_format="ue8m0")
    calls = (lambda i: F.rmsnorm_quantize_fp8(xs[i % len(xs)], w, scale_format="ue8m0", out=out),
             *_fp8_baselines(lambda i: torch_rmsnorm(xs[i % len(xs)], w)[0]))
    nbytes = m * n * 2 + n * 4 + _fp8_out_bytes(m, n) + 4 * m
    return _fp8_row("rmsnorm_quantize_fp8", (m, n), calls, (_FP8_BASE, _FP8_TORCH), nbytes, bench)


def _swiglu_fp8_row(m, n, bench):
    """swiglu_quantize_fp8 of h (m, n), the fused gate/up interleaved by 8
    columns: an FP8 output of I = n / 2 channels (no scope: FP8 scales are
    per block, so the row is the NVFP4 row-scope row's sibling)."""
    from rawkv import fused as F
    hs = _bf16_inputs((m, n), bench)
    out = F.swiglu_quantize_fp8(hs[0], scale_format="ue8m0")
    calls = (lambda i: F.swiglu_quantize_fp8(hs[i % len(hs)], scale_format="ue8m0", out=out),
             *_fp8_baselines(lambda i: torch_swiglu(hs[i % len(hs)])))
    nbytes = m * n * 2 + _fp8_out_bytes(m, n // 2)
    return _fp8_row("swiglu_quantize_fp8", (m, n), calls, (_FP8_BASE, _FP8_TORCH), nbytes, bench)


def _moe_stage_fp8_row(m, n, bench):
    """moe_stage_fp8 (top-k 8): the FP8 output and, as moe_stage counts
    them, int32 ids read and int64 written, float32 weights read and written."""
    import torch
    from rawkv import fused as F
    hid = _bf16_inputs((m, n), bench)
    ids = torch.randint(0, 256, (m, 8), device=bench.dev, dtype=torch.int32)
    wts = torch.rand(m, 8, device=bench.dev)
    out = F.moe_stage_fp8(hid[0], ids, wts, scale_format="ue8m0")

    def topk_copies():
        ids.long()
        wts.clone()
    calls = (lambda i: F.moe_stage_fp8(hid[i % len(hid)], ids, wts, scale_format="ue8m0", out=out),
             *_fp8_baselines(lambda i: hid[i % len(hid)], topk_copies))
    names = ("rawkv.fp8.quantize_blocks + torch copies", _ACT_QUANT + " + torch copies")
    nbytes = m * n * 2 + _fp8_out_bytes(m, n) + m * 8 * (4 + 8 + 4 + 4)
    return _fp8_row("moe_stage_fp8", (m, n), calls, names, nbytes, bench)
