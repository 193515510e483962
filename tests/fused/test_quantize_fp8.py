"""The fused producers' FP8 block outputs (rmsnorm_quantize_fp8,
mhc_rmsnorm_quantize_fp8, swiglu_quantize_fp8, moe_stage_fp8): bit for bit
rawkv.fp8.quantize_blocks of the BF16 (FP16) tensor the unfused op stores,
so DeepSeek's act_quant of it (docs/fused.md, "FP8 block outputs"). The
reference, argument errors, the launch plans as data, the CUDA kernels
against the reference bit for bit (GPU tests skip without one; RMSNorm's
float64 sum of squares as tests/support/fused.py states), the operators.
opcheck and the compiled steps are tests/guards/test_library.py's
(tests/support/library_samples_fused.py); the CPU / CUDA agreement cases
are in tests/guards/test_cpu_cuda_agreement.py."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv.library  # noqa: E402,F401
from fp8.test_quantize_blocks import deepseek_v4_act_quant  # noqa: E402
from rawkv import fp8  # noqa: E402
from rawkv import fused as F  # noqa: E402
from rawkv._plan import Device, grid_stride  # noqa: E402
from rawkv.fused import _rules as RU  # noqa: E402
from rawkv.fused import plans  # noqa: E402
from rawkv.kernels import fp8_blocks as KB  # noqa: E402
from rawkv.kernels import fused as K  # noqa: E402
from rawkv.reference import fp8_blocks as B  # noqa: E402
from rawkv.reference import fused as R  # noqa: E402
from rawkv.reference.formats import round_to_dtype  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.fused import _LONG, _names, _plant, _prefill_rows, _with_edges  # noqa: E402

F32, U8, BF16 = np.float32, torch.uint8, torch.bfloat16
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCKS, FORMATS = B.BLOCKS, B.SCALE_FORMATS
OPS = ("rms", "mhc", "swiglu", "moe")


def _u8(t):
    """The bytes of a result part (float32 scales as their float32 values)."""
    if t.dtype == torch.float32:
        return t.cpu().numpy()
    return t.cpu().view(U8).numpy() if t.dtype != U8 else t.cpu().numpy()


def _eq(a, b) -> bool:
    """Same dtype, shape and bytes (NaN scales included)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# ---- the op under test, the unfused output it must equal --------------------------------------
def _inputs(rng, op, rows, width, dtype, scale=1.0):
    """float32 numpy inputs of `op` whose values are exact in `dtype`: the
    quantized width is `width` (h is (rows, 2 * width))."""
    def t(*shape, s=scale):
        return round_to_dtype((rng.standard_normal(shape) * s).astype(F32), dtype).astype(F32)
    w = (rng.random(width) + 0.5).astype(F32)
    if op == "rms":
        return t(rows, width), w
    if op == "mhc":
        return t(rows, 3, width), rng.random((rows, 3)).astype(F32), w
    if op == "swiglu":
        return (t(rows, 2 * width), 8 if width % 8 == 0 else 3)
    return t(rows, width), rng.integers(0, 64, (rows, 4)).astype(np.int32), rng.random((rows, 4)).astype(F32)


def _torch(args, dtype):
    """The inputs as CPU tensors: the first in `dtype`, arrays as they are, ints kept."""
    first = torch.from_numpy(args[0]).to(DT[dtype])
    return (first, *(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args[1:]))


def _call(op, args, **kw):
    """The public FP8 op on `args` -> (codes, scales, inv_rms or None)."""
    if op == "rms":
        r = F.rmsnorm_quantize_fp8(*args, **kw)
    elif op == "mhc":
        r = F.mhc_rmsnorm_quantize_fp8(*args, **kw)
    elif op == "swiglu":
        r = F.swiglu_quantize_fp8(*args, **kw)
    else:
        st = F.moe_stage_fp8(*args, **kw)
        return st.codes, st.scales, None
    return r.codes, r.scales, r.inv_rms


def _unfused(op, args, dtype):
    """The unfused op's output y (rows, width): the tensor an unfused BF16
    (FP16) pipeline stores, whose quantize_blocks the fused op must give."""
    if op == "rms":
        return R.rmsnorm(args[0], args[1], 1e-6, dtype)[0]
    if op == "mhc":
        return R.rmsnorm(R.mhc_mix(args[0], args[1], dtype), args[2], 1e-6, dtype)[0]
    if op == "swiglu":
        return R.swiglu(args[0], args[1], dtype)
    return args[0]


def _quantize_blocks_of(y, dtype, block, fmt):
    """rawkv.fp8.quantize_blocks of the unfused output, as bytes / float32."""
    c, s = fp8.quantize_blocks(torch.from_numpy(y).to(DT[dtype]), block=block, scale_format=fmt)
    return _u8(c), _u8(s)


# ---- the reference and the CPU ops: quantize_blocks of the unfused output ----------------------
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", list(DT))
def test_cpu_ops_equal_quantize_blocks_of_the_unfused_output(rng, seed, op, dtype):
    """Random inputs, every block and scale format, widths with a partial
    last block (144) and whole ones (512; MoE: K % 128 == 0)."""
    print("seed", seed)
    for width in ((256, 384) if op == "moe" else (144, 512, 96)):
        args = _inputs(rng, op, 7, width, dtype, rng.uniform(0.01, 100))
        y = _unfused(op, args, dtype)
        for block in BLOCKS:
            for fmt in FORMATS:
                c, s, _ = _call(op, _torch(args, dtype), block=block, scale_format=fmt)
                wc, ws = _quantize_blocks_of(y, dtype, block, fmt)
                assert _eq(_u8(c), wc) and _eq(_u8(s), ws), (op, width, block, fmt, seed)


@pytest.mark.parametrize("op", OPS)
def test_bf16_outputs_equal_deepseek_v4_act_quant(rng, seed, op):
    """DeepSeek-V4's act_quant (restated in tests/fp8/test_quantize_blocks.py,
    with its source and commit) of the unfused BF16 output, both formats."""
    print("seed", seed)
    args = _inputs(rng, op, 16, 1024, "bfloat16")
    y = torch.from_numpy(_unfused(op, args, "bfloat16")).bfloat16()
    for fmt, scale_fmt, sdt in (("fp32", None, torch.float32), ("ue8m0", "ue8m0", torch.float8_e8m0fnu)):
        c, s, _ = _call(op, _torch(args, "bfloat16"), scale_format=fmt)
        dc, ds = deepseek_v4_act_quant(y, 128, scale_fmt, sdt)
        assert torch.equal(c.view(U8), dc.view(U8)) and torch.equal(s.view(U8), ds.view(U8)), (fmt, seed)


def test_reference_composes_the_unfused_steps(rng, seed):
    print("seed", seed)
    x, w = _inputs(rng, "rms", 5, 256, "bfloat16")
    c, s, inv = R.rmsnorm_quantize_fp8(x, w, 1e-6, 64, "ue8m0")
    y, inv2 = R.rmsnorm(x, w, 1e-6, "bfloat16")
    wc, ws = B.quantize_blocks(y, 64, "ue8m0")
    assert np.array_equal(c, wc) and np.array_equal(s, ws) and np.array_equal(inv, inv2)
    # float32 (numpy) input: no rounding of y, as the NVFP4 producers
    c32, _, _ = R.rmsnorm_quantize_fp8(x, w, 1e-6, 128, "fp32", "float32")
    assert np.array_equal(c32, B.quantize_blocks(R.rmsnorm(x, w, 1e-6, "float32")[0], 128, "fp32")[0])
    ids, wts = np.zeros((5, 2), np.int32), np.ones((5, 2), F32)
    mc, ms, mi, mw = R.moe_stage_fp8(x, ids, wts, 32, "fp32")
    assert np.array_equal(mc, B.quantize_blocks(x, 32, "fp32")[0]) and mi.dtype == np.int64
    with pytest.raises(ValueError, match="^hidden: expected"):
        R.moe_stage_fp8(x[:, :144], ids, wts)


@pytest.mark.parametrize("kind", ["zero_row", "nan", "huge", "tiny"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", list(DT))
def test_cpu_edge_rows(rng, seed, op, kind, dtype):
    """Zero rows, NaN / Inf, huge and tiny rows (tests/support/fused.py
    plants them): still quantize_blocks of the unfused output; a non-finite
    y flags its block (NaN scale, codes 0: a NaN in RMSNorm's x makes the
    row's inv_rms NaN, so the whole row)."""
    print("seed", seed)
    args = list(_inputs(rng, op, 6, 256, dtype))
    args[0] = _with_edges(torch.from_numpy(args[0]).to(DT[dtype]), kind).float().numpy()
    y = _unfused(op, args, dtype)
    for fmt in FORMATS:
        c, s, _ = _call(op, _torch(args, dtype), scale_format=fmt)
        wc, ws = _quantize_blocks_of(y, dtype, 128, fmt)
        assert _eq(_u8(c), wc) and _eq(_u8(s), ws), (fmt, seed)
        flagged = (ws == B.UE8M0_NAN) if fmt == "ue8m0" else np.isnan(ws)
        assert flagged.any() == (not np.isfinite(y).all()), fmt
        assert flagged.any() or kind != "nan"
        assert np.all(wc.reshape(*ws.shape, -1)[flagged] == 0)
        if kind == "zero_row" and op != "mhc" and fmt == "fp32":     # (mHC: one stream of a row is zero)
            assert np.all(ws[0] == np.float32(1e-4) * np.float32(1 / 448)) and not wc[0].any()


# ---- argument errors ------------------------------------------------------------------------------
class _A:
    def __init__(self):
        self.x = torch.ones(4, 128, dtype=BF16)
        self.w = torch.ones(128)
        self.X = torch.ones(4, 2, 128, dtype=BF16)
        self.mix = torch.ones(4, 2)
        self.h = torch.ones(4, 256, dtype=BF16)
        self.hid = torch.ones(2, 256, dtype=BF16)
        self.ids = torch.zeros(2, 4, dtype=torch.int32)
        self.wts = torch.ones(2, 4)


_rms, _mhc, _sw, _moe = F.rmsnorm_quantize_fp8, F.mhc_rmsnorm_quantize_fp8, F.swiglu_quantize_fp8, F.moe_stage_fp8
u8 = dict(dtype=U8)

# (id, exception, argument named first, call)
REFUSED = [
    ("block-96", ValueError, "block", lambda a: _rms(a.x, a.w, block=96)),
    ("block-True", ValueError, "block", lambda a: _sw(a.h, block=True)),
    ("block-128.0", ValueError, "block", lambda a: _moe(a.hid, a.ids, a.wts, block=128.0)),
    ("scale_format-e8m0", ValueError, "scale_format", lambda a: _rms(a.x, a.w, scale_format="e8m0")),
    ("scale_format-None", ValueError, "scale_format", lambda a: _moe(a.hid, a.ids, a.wts, scale_format=None)),
    ("eps-0", ValueError, "eps", lambda a: _rms(a.x, a.w, eps=0.0)),
    ("x-float64", TypeError, "x", lambda a: _rms(a.x.double(), a.w)),
    ("x-width-24", ValueError, "x", lambda a: _rms(torch.ones(4, 24, dtype=BF16), torch.ones(24))),
    ("x-transposed", ValueError, "x", lambda a: _rms(torch.ones(128, 4, dtype=BF16).t(), a.w)),
    ("weight-shape", ValueError, "weight", lambda a: _rms(a.x, torch.ones(64))),
    ("out-not-a-tuple", TypeError, "out", lambda a: _rms(a.x, a.w, out=torch.empty(4, 128, **u8))),
    ("out-4-entries", TypeError, "out", lambda a: _rms(a.x, a.w, out=(None,) * 4)),
    ("out.codes-shape", ValueError, "out.codes", lambda a: _rms(a.x, a.w, out=(torch.empty(4, 64, **u8), None))),
    ("out.codes-float32", TypeError, "out.codes", lambda a: _rms(a.x, a.w, out=(torch.empty(4, 128), None))),
    ("out.codes-unaligned", ValueError, "out.codes",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(torch.empty(2 * 256 + 1, **u8)[1:].view(2, 256), None, None, None))),
    ("out.codes-over-x", ValueError, "out.codes", lambda a: _rms(a.x, a.w, out=(a.x.view(-1).view(U8)[:512].view(4, 128), None))),
    ("out.scales-uint8-for-fp32", TypeError, "out.scales", lambda a: _rms(a.x, a.w, out=(None, torch.empty(4, 1, **u8)))),
    ("out.scales-shape", ValueError, "out.scales",
     lambda a: _sw(a.h, block=64, scale_format="ue8m0", out=(None, torch.empty(4, 1, **u8)))),
    ("out.scales-int32", TypeError, "out.scales",
     lambda a: _rms(a.x, a.w, scale_format="ue8m0", out=(None, torch.empty(4, 1, dtype=torch.int32)))),
    ("out.inv_rms-shape", ValueError, "out.inv_rms", lambda a: _rms(a.x, a.w, out=(None, None, torch.empty(5)))),
    ("out.inv_rms-swiglu", ValueError, "out.inv_rms", lambda a: _sw(a.h, out=(None, None, torch.empty(4)))),
    ("mix-None", TypeError, "mix", lambda a: _mhc(a.X, None, a.w)),
    ("x-n_hc-5", ValueError, "x", lambda a: _mhc(torch.ones(4, 5, 128, dtype=BF16), torch.ones(4, 5), a.w)),
    ("granularity-3", ValueError, "granularity", lambda a: _sw(a.h, 3)),
    ("h-odd", ValueError, "h", lambda a: _sw(torch.ones(4, 258, dtype=BF16))),
    ("hidden-K-192", ValueError, "hidden", lambda a: _moe(torch.ones(2, 192, dtype=BF16), a.ids, a.wts)),
    ("topk_ids-float32", TypeError, "topk_ids", lambda a: _moe(a.hid, a.ids.float(), a.wts)),
    ("out.topk_ids-int32", TypeError, "out.topk_ids",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, torch.empty(2, 4, dtype=torch.int32), None))),
    ("out.topk_weights-float16", TypeError, "out.topk_weights",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, None, torch.empty(2, 4, dtype=torch.float16)))),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_arguments_are_refused_by_name(case):
    _, exc, name, call = case
    with pytest.raises(exc) as ei:
        call(_A())
    assert _names(str(ei.value), name), str(ei.value)


def test_refused_call_writes_nothing():
    a = _A()
    codes, inv = torch.full((4, 128), 0xAB, **u8), torch.full((4,), 7.0)
    with pytest.raises(ValueError, match="^out.scales: expected shape"):
        _rms(a.x, a.w, out=(codes, torch.empty(4, 2), inv))
    hid_codes = torch.full((2, 256), 0xAB, **u8)
    with pytest.raises(TypeError, match="^out.topk_ids"):
        _moe(a.hid, a.ids, a.wts, out=(hid_codes, None, torch.empty(2, 4, dtype=torch.int32), None))
    assert (codes == 0xAB).all() and (inv == 7.0).all() and (hid_codes == 0xAB).all()


def test_out_buffers_are_written_and_returned():
    """out= entries are the result's (float32 'ue8m0' scales hold the powers
    of two; float8_e8m0fnu ones their bytes); the others are allocated."""
    a = _A()
    x = torch.randn(4, 128).bfloat16()
    codes, scales = torch.empty(4, 128, **u8), torch.empty(4, 2)
    r = _rms(x, a.w, block=64, scale_format="ue8m0", out=(codes, scales))
    c, s = fp8.quantize_blocks(torch.from_numpy(R.rmsnorm(x.float().numpy(), a.w.numpy())[0]).bfloat16(),
                               block=64, scale_format="ue8m0")
    assert r.codes is codes and r.scales is scales and r.inv_rms.shape == (4,)
    assert torch.equal(codes, c.view(U8)) and torch.equal(scales, torch.from_numpy(B.ue8m0_value(_u8(s))))
    e8 = torch.empty(4, 1, dtype=torch.float8_e8m0fnu)
    r = _sw(a.h, scale_format="ue8m0", out=[None, e8])
    assert r.scales is e8 and r.codes.dtype == torch.float8_e4m3fn and r.inv_rms is None
    n = _rms(x.float().numpy(), a.w.numpy(), scale_format="ue8m0")          # numpy in, numpy out
    assert n.codes.dtype == np.uint8 and n.scales.dtype == np.uint8 and n.scales.shape == (4, 1)


def test_no_rows_is_an_empty_result():
    a = _A()
    r = _rms(torch.ones(0, 128, dtype=BF16), a.w, scale_format="ue8m0")
    assert r.codes.shape == (0, 128) and r.scales.shape == (0, 1) and r.inv_rms.shape == (0,)
    st = _moe(torch.ones(0, 256, dtype=BF16), torch.zeros(0, 4, dtype=torch.int32), torch.ones(0, 4))
    assert st.codes.shape == (0, 256) and st.scales.shape == (0, 2)


# ---- the launch plans as data -------------------------------------------------------------------
H100 = Device(sm_count=132, max_threads_per_sm=2048, arch="sm_90")


def _meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _fp8_rows(rows, x, n, block=128, fmt=KB.SCALE_UE8M0, inv=True):
    """Checked arguments (rawkv.fused._rules.Fp8Rows) of meta tensors."""
    return RU.Fp8Rows("cuda", x, rows, n, "bfloat16", block, "fp32" if fmt == KB.SCALE_FP32 else "ue8m0", fmt,
                      _meta(rows, n, dtype=U8), _meta(rows, -(-n // block)),
                      _meta(rows, dtype=torch.float32) if inv else None)


@pytest.mark.parametrize("rows, n", [(1, 7168), (5, 144), (300, 2064), (3, _LONG), (4096, 7168)])
@pytest.mark.parametrize("block, fmt", [(128, KB.SCALE_UE8M0), (64, KB.SCALE_FP32), (32, KB.SCALE_UE8M0_F32)])
def test_row_plans_are_one_launch_of_one_cta_per_row(rows, n, block, fmt):
    """One CTA per row whose thread count is block_for's (the NVFP4 kernels'
    layout: a multiple of 32, so a block's chunks are on consecutive lanes
    of one warp), the format as run-time flags, no global-scale pass."""
    w = _meta(n, dtype=torch.float32)
    a = _fp8_rows(rows, _meta(rows, n), n, block, fmt)
    (launch,) = plans.rms_fp8(H100, a, None, w, 1e-6, 1)
    threads = plans.block_for(H100, rows, n // 16)
    assert launch.kernel is K.RMS_FP8.instance(BF16, False, K.REG)
    assert launch.grid == (rows,) and launch.block == (threads,) and threads % 32 == 0
    assert launch.args == dict(x=a.x, mix=None, mix_kind=0, n_hc=1, w=w, w_kind=K.PARAM_KIND["float32"], eps=1e-6,
                               n=n, inv_out=a.inv, blk=block, ue8m0=int(fmt[0]), sbyte=int(fmt[1]),
                               codes=a.codes, scales=a.scales)
    h = _fp8_rows(rows, _meta(rows, 2 * n), n, block, fmt, inv=False)
    (launch,) = plans.swiglu_fp8(H100, h, 4, False)
    assert launch.kernel is K.SWIGLU_FP8.instance(BF16, False, K.REG) and launch.grid == (rows,)
    assert launch.args == dict(h=h.x, inter=n, g=4, blk=block, ue8m0=int(fmt[0]), sbyte=int(fmt[1]),
                               codes=h.codes, scales=h.scales)


def test_row_plans_with_no_rows_launch_nothing():
    """No row: nothing to write (no global scale to set, unlike NVFP4)."""
    assert plans.rms_fp8(H100, _fp8_rows(0, _meta(0, 128), 128), None, _meta(128), 1e-6, 1) == []
    assert plans.swiglu_fp8(H100, _fp8_rows(0, _meta(0, 256), 128, inv=False), 8, True) == []


@pytest.mark.parametrize("rows, k, top", [(1, 7168, 8), (4096, 7168, 8), (0, 256, 4), (3, 128, 0)])
def test_moe_plan_is_one_grid_stride_launch(rows, k, top):
    """A thread per 16-byte vector of hidden (fp8_blocks.cuh's quantizer) or
    per id / weight byte, whichever is more; nothing to do: no launch."""
    hid, ids, wts = _meta(rows, k), _meta(rows, top, dtype=torch.int32), _meta(rows, top, dtype=torch.float32)
    c, s, io, wo = _meta(rows, k, dtype=U8), _meta(rows, k // 128), _meta(rows, top, dtype=torch.int64), _meta(rows, top)
    plan = plans.moe_stage_fp8(H100, hid, ids, wts, c, s, io, wo, 128, KB.SCALE_FP32)
    work = max(rows * k // 8, rows * top, rows * top * 4)
    if not work:
        assert plan == []
        return
    (launch,) = plan
    assert launch.kernel is K.MOE_STAGE_FP8.instance(BF16, torch.int32)
    grid, block = grid_stride(H100, work, block=K.MOE_BLOCK)
    assert launch.grid == (grid,) and launch.block == (block,)
    assert launch.args == dict(x=hid, rows=rows, K=k, blk=128, ue8m0=0, sbyte=0, codes=c, scales=s, ids=ids,
                               n_ids=rows * top, ids_out=io, wts=wts, w_bytes=rows * top * 4, wts_out=wo)


def test_ops_launch_their_plans(rt):
    """The CUDA path (the recording runtime, tests/fused/conftest.py) launches
    each op's plan: the scale format follows out.scales' dtype."""
    x, w = fake(torch.ones(3, 256, dtype=BF16)), fake(torch.ones(256))
    F.rmsnorm_quantize_fp8(x, w, block=64, scale_format="ue8m0")
    F.rmsnorm_quantize_fp8(x, w, scale_format="ue8m0", out=(None, fake(torch.empty(3, 2))))
    F.mhc_rmsnorm_quantize_fp8(fake(torch.ones(3, 2, 256, dtype=BF16)), fake(torch.ones(3, 2)), w, block=32)
    F.swiglu_quantize_fp8(fake(torch.ones(3, 512, dtype=torch.float16)), 4)
    F.moe_stage_fp8(x, fake(torch.zeros(3, 2, dtype=torch.int64)), fake(torch.ones(3, 2)))
    got = [(fn, c["blk"], c["ue8m0"], c["sbyte"]) for fn, _, _, c in rt.calls]
    assert got == [("rkv_fused_rms_fp8<__nv_bfloat16, false, 2>", 64, 1, 1),
                   ("rkv_fused_rms_fp8<__nv_bfloat16, false, 2>", 128, 1, 0),
                   ("rkv_fused_rms_fp8<__nv_bfloat16, true, 2>", 32, 0, 0),
                   ("rkv_fused_swiglu_fp8<__half, false, 2>", 128, 0, 0),
                   ("rkv_moe_stage_fp8<__nv_bfloat16, long long>", 128, 0, 0)]


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
        c, s, _ = _gpu_call(op, args, "bfloat16", 128, fmt, None)
        qc, qs = fp8.quantize_blocks(y.cuda(), scale_format=fmt)
        dc, ds = deepseek_v4_act_quant(y, 128, scale_fmt, sdt)
        if op in ("rms", "mhc"):        # y is the plain reference's: a row whose inv_rms differs may differ (rare)
            same = ((c.view(U8) == qc.view(U8)).all(dim=-1) & (s.view(U8) == qs.view(U8)).all(dim=-1)).cpu()
            assert int((~same).sum()) <= 1, seed
            c, s, qc, qs = c[same.cuda()], s[same.cuda()], qc[same.cuda()], qs[same.cuda()]
            dc, ds = dc[same], ds[same]
        assert torch.equal(c.view(U8), qc.view(U8)) and torch.equal(s.view(U8), qs.view(U8)), (fmt, seed)
        assert torch.equal(c.cpu().view(U8), dc.view(U8)) and torch.equal(s.cpu().view(U8), ds.view(U8)), (fmt, seed)


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


# ---- the operators ------------------------------------------------------------------------------
OPERATORS = torch.ops.rawkv


def test_operators_write_what_the_public_ops_return(rng):
    x, w = torch.randn(3, 144).bfloat16(), torch.rand(144) + 0.5
    X, mix = torch.randn(3, 2, 144).bfloat16(), torch.rand(3, 2)
    h, hid = torch.randn(3, 192).half(), torch.randn(2, 256).bfloat16()
    ids, wts = torch.tensor([[3, 1], [0, 7]]), torch.rand(2, 2)
    cases = [(F.rmsnorm_quantize_fp8(x, w, 1e-5, block=64, scale_format="ue8m0"), OPERATORS.rmsnorm_quantize_fp8,
              (x, w, 1e-5, 64, "ue8m0")),
             (F.mhc_rmsnorm_quantize_fp8(X, mix, w), OPERATORS.mhc_rmsnorm_quantize_fp8, (X, mix, w, 1e-6, 128, "fp32")),
             (F.swiglu_quantize_fp8(h, 8, block=32), OPERATORS.swiglu_quantize_fp8, (h, 8, 32, "fp32")),
             (F.moe_stage_fp8(hid, ids, wts, scale_format="ue8m0"), OPERATORS.moe_stage_fp8,
              (hid, ids, wts, 128, "ue8m0"))]
    for want, op, args in cases:
        parts = [t for t in want if t is not None]
        bufs = [torch.empty(t.shape, dtype=U8 if t.element_size() == 1 and t.dtype.is_floating_point else t.dtype)
                for t in parts]
        assert op(*args, *bufs) is None
        for b, t in zip(bufs, parts):
            assert torch.equal(b, t.view(U8) if b.dtype == U8 and t.dtype != U8 else t)


def test_operator_errors_name_the_argument():
    x, w = torch.ones(2, 128, dtype=BF16), torch.ones(128)
    bufs = (torch.empty(2, 128, **u8), torch.empty(2, 1, **u8), torch.empty(2))
    with pytest.raises(ValueError, match="^block"):
        OPERATORS.rmsnorm_quantize_fp8(x, w, 1e-6, 48, "ue8m0", *bufs)
    with pytest.raises(ValueError, match="^scale_format"):
        OPERATORS.rmsnorm_quantize_fp8(x, w, 1e-6, 128, "mx", *bufs)
    with pytest.raises(TypeError, match="^out.scales"):
        OPERATORS.rmsnorm_quantize_fp8(x, w, 1e-6, 128, "fp32", *bufs)          # uint8 scales for fp32
    with pytest.raises(ValueError, match="^out.codes"):
        OPERATORS.swiglu_quantize_fp8(torch.ones(2, 256, dtype=BF16), 8, 128, "ue8m0", torch.empty(2, 64, **u8),
                                      bufs[1])


def _same(a, b):
    """Same structure, types, shapes, dtypes and bits."""
    if isinstance(a, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(U8) if a.element_size() == 1 else a, b.view(U8) if b.element_size() == 1 else b))


def _rms_args(rng):
    return (torch.from_numpy(rng.standard_normal((3, 2, 256)).astype(F32)).bfloat16(),
            torch.from_numpy(rng.random(256).astype(F32) + 0.5))


# (id, call(args, out) -> result, args, out): traced and eager give the same result
TRACED = [
    ("rms-ue8m0", lambda a, o: F.rmsnorm_quantize_fp8(*a, scale_format="ue8m0", out=o), _rms_args, None),
    ("rms-fp32-block64", lambda a, o: F.rmsnorm_quantize_fp8(*a, block=64, out=o), _rms_args, None),
    ("rms-out-f32-powers", lambda a, o: F.rmsnorm_quantize_fp8(*a, scale_format="ue8m0", out=o), _rms_args,
     lambda: (torch.empty(3, 2, 256, dtype=U8), torch.empty(3, 2, 2), None)),
    ("mhc-out-e8m0", lambda a, o: F.mhc_rmsnorm_quantize_fp8(*a, scale_format="ue8m0", out=o),
     lambda rng: (torch.randn(2, 3, 128).bfloat16(), torch.rand(2, 3), torch.rand(128)),
     lambda: (None, torch.empty(2, 1, dtype=torch.float8_e8m0fnu))),
    ("swiglu-block32", lambda a, o: F.swiglu_quantize_fp8(*a, block=32, scale_format="ue8m0", out=o),
     lambda rng: (torch.randn(4, 192).half(), 3), None),
    ("moe-out-some", lambda a, o: F.moe_stage_fp8(*a, scale_format="ue8m0", out=o),
     lambda rng: (torch.randn(3, 256).bfloat16(), torch.zeros(3, 5, dtype=torch.int64), torch.rand(3, 5)),
     lambda: (None, None, torch.empty(3, 5, dtype=torch.int64), None)),
]


@pytest.mark.parametrize("case", TRACED, ids=[c[0] for c in TRACED])
def test_traced_results_are_the_eager_ones(rng, case):
    """Under torch.compile (fullgraph, aot_eager) the public op allocates
    what the eager path returns (float8_e4m3fn codes, E8M0 scales as a view
    of the uint8 bytes the operator writes) and the operator writes the same
    bits; out= entries are returned as given."""
    _, call, make_args, make_out = case
    args = make_args(rng)
    want = call(args, None if make_out is None else make_out())
    torch._dynamo.reset()
    out = None if make_out is None else make_out()
    got = torch.compile(lambda *a: call(a, out), fullgraph=True, backend="aot_eager")(*args)
    assert _same(got, want)
    if out is not None:
        assert all(g is o for g, o in zip(got, out) if o is not None)

