"""The fused producers' FP8 block outputs (rmsnorm_quantize_fp8,
mhc_rmsnorm_quantize_fp8, swiglu_quantize_fp8, moe_stage_fp8): bit for bit
rawkv.fp8.quantize_blocks of the BF16 (FP16) tensor the unfused op stores,
so DeepSeek's act_quant of it (docs/fused.md, "FP8 block outputs"). The
reference, argument errors (and the ops' CPU/CUDA agreement cases,
AGREEMENT), the launch plans as data, the operators (and their opcheck
samples, opcheck_samples: tests/support/library.py collects both; the
compiled step is tests/support/library_samples_fused.py's). The CUDA
kernels against the reference: test_quantize_fp8_gpu.py."""
from __future__ import annotations

import math

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
from support.fused import _LONG, _names, _with_edges, same_result  # noqa: E402

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
    if op == "swiglu":          # short rows: granularity 3 (scalar loads, groups across chunks)
        return (t(rows, 2 * width), 3 if width % 3 == 0 and width < 1024 else 8)
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
    ("block-True", TypeError, "block", lambda a: _sw(a.h, block=True)),
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


def test_e8m0_scales_for_fp32_are_refused_by_their_own_dtype():
    """A float8_e8m0fnu out.scales with scale_format 'fp32' reached the
    operator as its uint8 bytes and was refused as 'out.scales: dtype uint8
    is not supported': a dtype the caller never passed. Each producer now
    names the buffer's own dtype, as quantize_blocks does
    (rawkv.fp8.scales_bytes), and writes nothing."""
    a = _A()
    codes = torch.full((4, 128), 0xAB, **u8)
    e8 = lambda rows: torch.empty(rows, 1, dtype=torch.float8_e8m0fnu)      # noqa: E731
    calls = [lambda: _rms(a.x, a.w, out=(codes, e8(4))),
             lambda: _mhc(a.X, a.mix, a.w, out=(codes, e8(4))),
             lambda: _sw(a.h, out=(codes, e8(4))),
             lambda: _moe(a.hid, a.ids, a.wts, out=(None, e8(2), None, None))]
    for call in calls:
        with pytest.raises(TypeError, match="^out.scales: dtype float8_e8m0fnu is not supported for scale_format "
                                            "'fp32'"):
            call()
    assert (codes == 0xAB).all()
    with pytest.raises(TypeError, match="^scales: dtype float8_e8m0fnu is not supported for scale_format 'fp32'"):
        fp8.quantize_blocks(a.x, out=(None, e8(4)))


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


# CPU / CUDA agreement cases (tests/guards/test_cpu_cuda_agreement.py runs them through
# tests/support/library.py): each call on CPU tensors, then on the same memory seen as CUDA
# tensors (the CUDA path up to the launch), must be accepted by both or refused alike.
F16, I32, I64 = torch.float16, torch.int32, torch.int64


def ones(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


def buf(*shape, dtype=U8):
    return torch.zeros(shape, dtype=dtype)


def unaligned(*shape, dtype=torch.float32):
    """A contiguous view starting one element into a fresh buffer."""
    return torch.ones(int(np.prod(shape)) + 1, dtype=dtype)[1:].view(shape)


def strided_last(*shape, dtype=torch.float32):
    return torch.ones(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]


def stride0(*shape, dtype=torch.float32):
    return torch.ones(shape[-1], dtype=dtype).expand(*shape)


AGREEMENT = {
    "rmsnorm_quantize_fp8": [
        ("ok", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 144, dtype=BF16), ones(144)), {})),
        ("ok-ue8m0-f16-block32", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 64, dtype=F16), ones(64, dtype=F16)),
                                          {"block": 32, "scale_format": "ue8m0"})),
        ("ok-out-f32-powers", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)),
                                       {"scale_format": "ue8m0", "out": (buf(4, 128), ones(4, 1), ones(4))})),
        ("ok-empty", lambda: (F.rmsnorm_quantize_fp8, (ones(0, 128, dtype=BF16), ones(128)), {})),
        ("x-unaligned", lambda: (F.rmsnorm_quantize_fp8, (unaligned(4, 128, dtype=BF16), ones(128)), {})),
        ("x-strided", lambda: (F.rmsnorm_quantize_fp8, (strided_last(4, 128, dtype=BF16), ones(128)), {})),
        ("x-width-24", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 24, dtype=BF16), ones(24)), {})),
        ("block-96", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)), {"block": 96})),
        ("scale_format-bad", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)),
                                      {"scale_format": "e8m0"})),
        ("eps-0", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)), {"eps": 0.0})),
        ("out.codes-unaligned", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)),
                                         {"out": (unaligned(4, 128, dtype=U8), None)})),
        ("out.scales-uint8-for-fp32", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)),
                                               {"out": (None, buf(4, 1))})),
        ("out.scales-stride-0", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 256, dtype=BF16), ones(256)),
                                         {"out": (None, stride0(4, 2))})),
        ("out.inv_rms-shape", lambda: (F.rmsnorm_quantize_fp8, (ones(4, 128, dtype=BF16), ones(128)),
                                       {"out": (None, None, ones(5))})),
    ],
    "mhc_rmsnorm_quantize_fp8": [
        ("ok", lambda: (F.mhc_rmsnorm_quantize_fp8, (ones(4, 2, 128, dtype=BF16), ones(4, 2), ones(128)), {})),
        ("ok-bf16-mix-ue8m0", lambda: (F.mhc_rmsnorm_quantize_fp8, (ones(4, 2, 64, dtype=BF16), ones(4, 2, dtype=BF16),
                                                                     ones(64)), {"scale_format": "ue8m0"})),
        ("x-n_hc-5", lambda: (F.mhc_rmsnorm_quantize_fp8, (ones(4, 5, 128, dtype=BF16), ones(4, 5), ones(128)), {})),
        ("mix-transposed", lambda: (F.mhc_rmsnorm_quantize_fp8, (ones(4, 2, 128, dtype=BF16), ones(2, 4).t(),
                                                                  ones(128)), {})),
        ("out.scales-shape", lambda: (F.mhc_rmsnorm_quantize_fp8, (ones(4, 2, 128, dtype=BF16), ones(4, 2), ones(128)),
                                      {"block": 64, "out": (None, ones(4, 1))})),
    ],
    "swiglu_quantize_fp8": [
        ("ok", lambda: (F.swiglu_quantize_fp8, (ones(4, 256, dtype=BF16),), {})),
        ("ok-g1-2-byte-aligned", lambda: (F.swiglu_quantize_fp8, (unaligned(4, 64, dtype=BF16), 1),
                                          {"block": 32, "scale_format": "ue8m0"})),
        ("ok-out-e8m0-bytes", lambda: (F.swiglu_quantize_fp8, (ones(4, 64, dtype=F16), 4),
                                       {"scale_format": "ue8m0", "out": (buf(4, 32), buf(4, 1))})),
        ("h-unaligned-g8", lambda: (F.swiglu_quantize_fp8, (unaligned(4, 64, dtype=BF16),), {})),
        ("h-odd", lambda: (F.swiglu_quantize_fp8, (ones(4, 66, dtype=BF16),), {})),
        ("granularity-3", lambda: (F.swiglu_quantize_fp8, (ones(4, 64, dtype=BF16), 3), {})),
        ("block-True", lambda: (F.swiglu_quantize_fp8, (ones(4, 64, dtype=BF16),), {"block": True})),
        ("out.inv_rms", lambda: (F.swiglu_quantize_fp8, (ones(4, 64, dtype=BF16),), {"out": (None, None, ones(4))})),
        ("out.codes-strided", lambda: (F.swiglu_quantize_fp8, (ones(4, 64, dtype=BF16),),
                                       {"out": (strided_last(4, 32, dtype=U8), None)})),
    ],
    "moe_stage_fp8": [
        ("ok", lambda: (F.moe_stage_fp8, (ones(2, 128, dtype=BF16), buf(2, 4, dtype=I32), ones(2, 4)), {})),
        ("ok-out-ue8m0", lambda: (F.moe_stage_fp8, (ones(2, 256, dtype=F16), buf(2, 4, dtype=I64), ones(2, 4, dtype=BF16)),
                                  {"block": 64, "scale_format": "ue8m0",
                                   "out": (buf(2, 256), buf(2, 4), buf(2, 4, dtype=I64), ones(2, 4, dtype=BF16))})),
        ("hidden-unaligned", lambda: (F.moe_stage_fp8, (unaligned(2, 128, dtype=BF16), buf(2, 4, dtype=I32),
                                                         ones(2, 4)), {})),
        ("hidden-K-144", lambda: (F.moe_stage_fp8, (ones(2, 144, dtype=BF16), buf(2, 4, dtype=I32), ones(2, 4)), {})),
        ("topk_ids-transposed", lambda: (F.moe_stage_fp8, (ones(2, 128, dtype=BF16), buf(4, 2, dtype=I32).t(),
                                                            ones(2, 4)), {})),
        ("scale_format-bad", lambda: (F.moe_stage_fp8, (ones(2, 128, dtype=BF16), buf(2, 4, dtype=I32), ones(2, 4)),
                                      {"scale_format": "ue4m3"})),
        ("out.codes-unaligned", lambda: (F.moe_stage_fp8, (ones(2, 128, dtype=BF16), buf(2, 4, dtype=I32), ones(2, 4)),
                                         {"out": (unaligned(2, 128, dtype=U8), None, None, None)})),
        ("out.topk_ids-int32", lambda: (F.moe_stage_fp8, (ones(2, 128, dtype=BF16), buf(2, 4, dtype=I32), ones(2, 4)),
                                        {"out": (None, None, buf(2, 4, dtype=I32), None)})),
    ],
}


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
    of one warp), UE8M0 the instance's template
    constant and SBYTE a run-time flag, no global-scale pass."""
    w = _meta(n, dtype=torch.float32)
    a = _fp8_rows(rows, _meta(rows, n), n, block, fmt)
    (launch,) = plans.rms_fp8(H100, a, None, w, 1e-6, 1)
    threads = plans.block_for(H100, rows, n // 16)
    assert launch.kernel is K.RMS_FP8.instance(BF16, False, K.REG, bool(fmt[0]))
    assert launch.grid == (rows,) and launch.block == (threads,) and threads % 32 == 0
    assert launch.args == dict(x=a.x, mix=None, mix_kind=0, n_hc=1, w=w, w_kind=K.PARAM_KIND["float32"], eps=1e-6,
                               n=n, inv_out=a.inv, blk=block, sbyte=int(fmt[1]),
                               codes=a.codes, scales=a.scales, s_row=-(-n // block), s_blk=1)
    h = _fp8_rows(rows, _meta(rows, 2 * n), n, block, fmt, inv=False)
    (launch,) = plans.swiglu_fp8(H100, h, 4, False)
    assert launch.kernel is K.SWIGLU_FP8.instance(BF16, False, K.REG, bool(fmt[0])) and launch.grid == (rows,)
    assert launch.args == dict(h=h.x, inter=n, g=4, blk=block, sbyte=int(fmt[1]),
                               codes=h.codes, scales=h.scales, s_row=-(-n // block), s_blk=1)


def test_row_plans_with_no_rows_launch_nothing():
    """No row: nothing to write (no global scale to set, unlike NVFP4)."""
    assert plans.rms_fp8(H100, _fp8_rows(0, _meta(0, 128), 128), None, _meta(128), 1e-6, 1) == []
    assert plans.swiglu_fp8(H100, _fp8_rows(0, _meta(0, 256), 128, inv=False), 8, True) == []


@pytest.mark.parametrize("rows, k, top", [(1, 7168, 8), (4096, 7168, 8), (0, 256, 4), (3, 128, 0)])
def test_moe_plan_is_one_grid_stride_launch(rows, k, top):
    """A thread per 16 channels of hidden (fp8_blocks.cuh's quantizer) or
    per id / weight byte, whichever is more; nothing to do: no launch."""
    hid, ids, wts = _meta(rows, k), _meta(rows, top, dtype=torch.int32), _meta(rows, top, dtype=torch.float32)
    c, s, io, wo = _meta(rows, k, dtype=U8), _meta(rows, k // 128), _meta(rows, top, dtype=torch.int64), _meta(rows, top)
    plan = plans.moe_stage_fp8(H100, hid, ids, wts, c, s, io, wo, 128, KB.SCALE_FP32)
    work = max(rows * k // 16, rows * top, rows * top * 4)
    if not work:
        assert plan == []
        return
    (launch,) = plan
    assert launch.kernel is K.MOE_STAGE_FP8.instance(BF16, torch.int32, False)
    grid, block = grid_stride(H100, work, block=K.MOE_BLOCK)
    assert launch.grid == (grid,) and launch.block == (block,)
    assert launch.args == dict(x=hid, rows=rows, K=k, blk=128, sbyte=0, codes=c, scales=s,
                               s_row=k // 128, s_blk=1, ids=ids,
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
    got = [(fn, c["blk"], c["sbyte"]) for fn, _, _, c in rt.calls]
    assert got == [("rkv_fused_rms_fp8<__nv_bfloat16, false, 2, true>", 64, 1),
                   ("rkv_fused_rms_fp8<__nv_bfloat16, false, 2, true>", 128, 0),
                   ("rkv_fused_rms_fp8<__nv_bfloat16, true, 2, false>", 32, 0),
                   ("rkv_fused_swiglu_fp8<__half, false, 2, false>", 128, 0),
                   ("rkv_moe_stage_fp8<__nv_bfloat16, long long, false>", 128, 0)]


# ---- the operators ------------------------------------------------------------------------------
def opcheck_samples(rng, device="cpu"):
    """opcheck argument tuples of the four operators (tests/guards/test_library*.py):
    every block and scale format, E8M0 bytes and float32 powers of two. Outputs
    are uint8 where the op returns FP8 / E8M0 views (opcheck compares with
    allclose, which has no float8 kernel on CPU; no operator takes
    float8_e8m0fnu, which inductor cannot functionalize)."""
    def t(*shape, dtype=BF16, lo=None):
        a = rng.standard_normal(shape) if lo is None else rng.uniform(lo, lo + 1, shape)
        return torch.from_numpy(a.astype(F32)).to(dtype).to(device)

    def e(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=device)
    x, x3, w, w128 = t(3, 64), t(2, 3, 128, dtype=F16), t(64, dtype=torch.float32, lo=0.5), t(128, lo=0.5)
    X, mix = t(3, 2, 64), t(3, 2, dtype=torch.float32, lo=0.0)
    h, h16 = t(3, 128), t(2, 2, 192, dtype=F16)
    hid, wts = t(4, 256), t(4, 2, dtype=torch.float32, lo=0.0)
    ids = torch.from_numpy(rng.integers(0, 64, (4, 2), dtype=np.int32)).to(device)
    def mn_major(*shape):
        """float32 scales (..., nb) in DeepGEMM's MN-major layout (the rows adjacent)."""
        return e(shape[-1], math.prod(shape[:-1])).t().reshape(shape)
    return {
        "rmsnorm_quantize_fp8": [(x, w, 1e-6, 128, "fp32", e(3, 64, dtype=U8), e(3, 1), e(3)),
                                 (x3, w128, 1e-5, 32, "ue8m0", e(2, 3, 128, dtype=U8), e(2, 3, 4, dtype=U8), e(2, 3)),
                                 # scales written MN-major (E8M0 values as float32); no rows
                                 (x3, w128, 1e-6, 64, "ue8m0", e(2, 3, 128, dtype=U8), mn_major(2, 3, 2), e(2, 3)),
                                 (x[:0], w, 1e-6, 128, "fp32", e(0, 64, dtype=U8), e(0, 1), e(0))],
        "mhc_rmsnorm_quantize_fp8": [(X, mix, w, 1e-6, 64, "ue8m0", e(3, 64, dtype=U8), e(3, 1), e(3)),
                                     (X, mix.bfloat16(), w, 1e-5, 32, "fp32", e(3, 64, dtype=U8), e(3, 2), e(3)),
                                     (X[:0], mix[:0], w, 1e-6, 64, "fp32", e(0, 64, dtype=U8), e(0, 1), e(0)),
                                     # float16 streams and weight, E8M0 bytes
                                     (X.half(), mix, w.half(), 1e-6, 32, "ue8m0", e(3, 64, dtype=U8),
                                      e(3, 2, dtype=U8), e(3))],
        "swiglu_quantize_fp8": [(h, 8, 128, "ue8m0", e(3, 64, dtype=U8), e(3, 1, dtype=U8)),
                                (h16, 6, 32, "fp32", e(2, 2, 96, dtype=U8), e(2, 2, 3)),
                                (h16, 6, 32, "fp32", e(2, 2, 96, dtype=U8), mn_major(2, 2, 3)),
                                (h[:0], 8, 128, "ue8m0", e(0, 64, dtype=U8), e(0, 1, dtype=U8))],
        "moe_stage_fp8": [(hid, ids, wts, 128, "ue8m0", e(4, 256, dtype=U8), e(4, 2, dtype=U8), e(4, 2, dtype=I64),
                           e(4, 2)),
                          (hid.half(), ids.long(), wts.bfloat16(), 64, "fp32", e(4, 256, dtype=U8), e(4, 4),
                           e(4, 2, dtype=I64), e(4, 2, dtype=BF16)),
                          (hid, ids, wts, 32, "ue8m0", e(4, 256, dtype=U8), mn_major(4, 8), e(4, 2, dtype=I64),
                           e(4, 2)),
                          (hid[:0], ids[:0], wts[:0], 128, "fp32", e(0, 256, dtype=U8), e(0, 2), e(0, 2, dtype=I64),
                           e(0, 2))],
    }


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
    assert same_result(got, want)
    if out is not None:
        assert all(g is o for g, o in zip(got, out) if o is not None)

