"""The fused producers' FP8 block outputs on the GPU (the lead runs these):
the CUDA kernels against the reference bit for bit (RMSNorm: with the
kernel's inv_rms, which must be within 1 ulp of the reference's, as
tests/support/fused.py states for the NVFP4 forms), against
rawkv.fp8.quantize_blocks on the GPU and DeepSeek's act_quant restated, and
a captured step. The CPU tests are test_quantize_fp8.py."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from fp8.test_quantize_blocks import deepseek_v4_act_quant  # noqa: E402
from fused.test_quantize_fp8 import BLOCKS, DT, OPS, U8, _call, _eq, _inputs, _torch, _u8, _unfused  # noqa: E402
from rawkv import fp8  # noqa: E402
from rawkv import fused as F  # noqa: E402
from rawkv.reference import fp8_blocks as B  # noqa: E402
from rawkv.reference import fused as R  # noqa: E402
from support.fused import _LONG, _plant, _prefill_rows  # noqa: E402


# ---- GPU: bit for bit against the reference (the lead runs these on a GPU) ----------------------
def _gpu_rows(cuda, name):
    """(rows, width) cases: decode (one CTA per row, a chunk per thread),
    the prefill layout, partial last blocks, rows past the registers."""
    return {"decode": (1, 7168), "partial": (37, 144), "prefill": (_prefill_rows(cuda, 2064), 2064),
            "long": (3, _LONG)}[name]


def _gpu_call(op, args, dtype, block, fmt, scales_dtype):
    """The op on cuda:0 (out.scales of `scales_dtype` if given)."""
    cu = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in _torch(args, dtype))
    out = None
    if scales_dtype is not None:
        lead = cu[0].shape[:-2] if op == "mhc" else cu[0].shape[:-1]
        width = cu[0].shape[-1] // (2 if op == "swiglu" else 1)
        out = (None, torch.empty((*lead, -(-width // block)), dtype=scales_dtype, device="cuda"))
        out = out + (None, None) if op == "moe" else out
    return _call(op, cu, block=block, scale_format=fmt, out=out)


def _reference(op, args, dtype, block, fmt, inv=None):
    """The reference's (codes, scales, inv_rms): RMSNorm with the kernel's
    inv_rms when given (tests/support/fused.py: the float64 sum's order)."""
    if op == "rms":
        return R.rmsnorm_quantize_fp8(args[0], args[1], 1e-6, block, fmt, dtype, inv)
    if op == "mhc":
        return R.mhc_rmsnorm_quantize_fp8(args[0], args[1], args[2], 1e-6, block, fmt, dtype, inv)
    if op == "swiglu":
        return (*R.swiglu_quantize_fp8(args[0], args[1], block, fmt, dtype), None)
    return (*R.moe_stage_fp8(*args, block, fmt)[:2], None)


def _check(op, got, args, dtype, block, fmt, scales_f32):
    """Bit for bit against the reference; RMSNorm: evaluated with the kernel's
    inv_rms, which is within 1 ulp of the reference's (rows where it is equal
    must then equal the plain reference too)."""
    c, s, inv = got
    rows = args[0].shape[0]
    kinv = None if inv is None else inv.cpu().numpy()
    rc, rs, rinv = _reference(op, args, dtype, block, fmt, kinv)
    if scales_f32:
        rs = B.ue8m0_value(rs)
    assert _eq(_u8(c).reshape(rows, -1), rc.reshape(rows, -1)), (op, block, fmt)
    assert _eq(_u8(s).reshape(rows, -1), np.asarray(rs).reshape(rows, -1)), (op, block, fmt)
    if inv is not None:
        plain = _reference(op, args, dtype, block, fmt)[2]
        fin = np.isfinite(plain)
        assert np.array_equal(np.isfinite(kinv), fin)
        ulp = np.abs(kinv[fin].astype(np.float64) - plain[fin]) / np.spacing(plain[fin]).astype(np.float64)
        assert ulp.size == 0 or ulp.max() <= 1.0
        assert (kinv[fin] != plain[fin]).sum() <= max(1, rows // 100)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("shape", ["decode", "partial", "prefill", "long"])
def test_gpu_equals_the_reference(cuda, rng, seed, op, dtype, shape):
    """Every block and scale format (E8M0 bytes, FP32, the powers of two in
    a float32 out.scales), edges planted (NaN / Inf blocks, a zero row, a
    NaN in the last column)."""
    print("seed", seed)
    rows, width = _gpu_rows(cuda, shape)
    if op == "moe":
        width = -(-width // 128) * 128
    args = list(_inputs(rng, op, rows, width, dtype, rng.uniform(0.01, 10)))
    if rows >= 4:
        args[0] = _plant(torch.from_numpy(args[0]).to(DT[dtype])).float().numpy()
    for block in BLOCKS:
        for fmt, sdt in (("fp32", None), ("ue8m0", None), ("ue8m0", torch.float32)):
            got = _gpu_call(op, args, dtype, block, fmt, sdt)
            _check(op, got, args, dtype, block, fmt, sdt is not None)


@pytest.mark.parametrize("op", OPS)
def test_gpu_equals_quantize_blocks_on_the_gpu(cuda, rng, seed, op):
    """The fused op against rawkv.fp8.quantize_blocks (its own kernel) of the
    unfused BF16 output on the GPU, and DeepSeek's act_quant restated."""
    print("seed", seed)
    args = _inputs(rng, op, 64, 7168, "bfloat16")
    y = torch.from_numpy(_unfused(op, args, "bfloat16")).bfloat16()
    for fmt, scale_fmt, sdt in (("fp32", None, torch.float32), ("ue8m0", "ue8m0", torch.float8_e8m0fnu)):
        # bytes, on the host (few torch ops take FP8 / E8M0 tensors)
        c, s = (t.view(U8).cpu() for t in _gpu_call(op, args, "bfloat16", 128, fmt, None)[:2])
        qc, qs = (t.view(U8).cpu() for t in fp8.quantize_blocks(y.cuda(), scale_format=fmt))
        dc, ds = (t.view(U8) for t in deepseek_v4_act_quant(y, 128, scale_fmt, sdt))
        if op in ("rms", "mhc"):        # y is the plain reference's: a row whose inv_rms differs may differ (rare)
            same = (c == qc).all(dim=-1) & (s == qs).all(dim=-1)
            assert int((~same).sum()) <= 1, seed
            c, s, qc, qs, dc, ds = (t[same] for t in (c, s, qc, qs, dc, ds))
        assert torch.equal(c, qc) and torch.equal(s, qs), (fmt, seed)
        assert torch.equal(c, dc) and torch.equal(s, ds), (fmt, seed)


def test_gpu_is_bit_reproducible_and_graph_capturable(cuda, rng):
    """A captured step of every FP8 op on out= buffers: each replay writes
    the eager bits."""
    rawkv.warmup(0, files=["fused.cu"])
    m, n = 257, 7168
    x = torch.randn(m, n, device="cuda").bfloat16()
    X = torch.randn(m, 2, n, device="cuda").bfloat16()
    mix, w = torch.rand(m, 2, device="cuda"), torch.rand(n, device="cuda") + 0.5
    h = torch.randn(m, 2 * n, device="cuda").bfloat16()
    ids, wts = torch.zeros(m, 8, dtype=torch.int32, device="cuda"), torch.rand(m, 8, device="cuda")

    def bufs(lead, width, inv=True):
        b = (torch.empty(*lead, width, dtype=U8, device="cuda"), torch.empty(*lead, width // 128, dtype=U8,
                                                                            device="cuda"))
        return b + (torch.empty(*lead, device="cuda"),) if inv else b
    calls = [(lambda o: F.rmsnorm_quantize_fp8(x, w, scale_format="ue8m0", out=o), bufs((m,), n)),
             (lambda o: F.mhc_rmsnorm_quantize_fp8(X, mix, w, scale_format="ue8m0", out=o), bufs((m,), n)),
             (lambda o: F.swiglu_quantize_fp8(h, scale_format="ue8m0", out=o), bufs((m,), n, False)),
             (lambda o: F.moe_stage_fp8(x, ids, wts, scale_format="ue8m0", out=o),
              bufs((m,), n, False) + (torch.empty(m, 8, dtype=torch.int64, device="cuda"),
                                      torch.empty(m, 8, device="cuda")))]
    for call, o in calls:
        call(o)
    torch.cuda.synchronize()
    want = [[t.clone() for t in o] for _, o in calls]
    for _, o in calls:
        for t in o:
            t.zero_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for call, o in calls:
            call(o)
    g.replay()
    torch.cuda.synchronize()
    for (_, o), wl in zip(calls, want):
        assert all(torch.equal(t, wt) for t, wt in zip(o, wl))


@pytest.mark.parametrize("block", BLOCKS)
def test_gpu_moe_stage_on_small_grids_writes_every_unit_once(cuda, rng, seed, block):
    """moe_stage_fp8 launched on grids far smaller than its work (a few
    CTAs: every lane's grid-stride loop steps its (row, block) many times,
    carrying into the next rows), outputs prefilled with bytes no result has
    there: the reference's codes, scales and top-k copies exactly."""
    from rawkv._plan import Device
    from rawkv.fused import plans
    from rawkv.kernels import fp8_blocks as KB
    print("seed", seed)
    rows, width = 37, 2048
    args = _inputs(rng, "moe", rows, width, "bfloat16", 3.0)
    hidden, ids, wts = (a.cuda() for a in _torch(args, "bfloat16"))
    rc, rs, rids, rwts = R.moe_stage_fp8(*args, block, "ue8m0")
    for dev in (Device(sm_count=1, max_threads_per_sm=256), Device(sm_count=3, max_threads_per_sm=256)):
        codes = torch.full((rows, width), 0xAA, dtype=torch.uint8, device="cuda")
        scales = torch.full((rows, width // block), 0xAA, dtype=torch.uint8, device="cuda")
        ids_out = torch.full((rows, 4), -5, dtype=torch.int64, device="cuda")
        w_out = torch.full((rows, 4), -5.0, device="cuda")
        (launch,) = plans.moe_stage_fp8(dev, hidden, ids, wts, codes, scales, ids_out, w_out, block, KB.SCALE_UE8M0)
        assert launch.grid[0] * launch.block[0] < KB.quantize_threads(rows, width, block)
        rawkv.get_runtime().run([launch])
        assert np.array_equal(_u8(codes.cpu()), rc) and np.array_equal(_u8(scales.cpu()), rs), (dev, block, seed)
        assert np.array_equal(ids_out.cpu().numpy(), rids) and np.array_equal(w_out.cpu().numpy(), rwts)
