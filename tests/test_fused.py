"""CPU tests of rawkv.fused: the numpy reference against float64 compositions,
the CPU dispatch of the public ops, and argument errors (docs/fused.md)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from rawkv import fused as F
from rawkv.fused import plans as _rows
from rawkv.kernels import fused as K
from rawkv import nvfp4 as N
from rawkv.reference import fused as R
from rawkv.reference import nvfp4 as RN
from rawkv.reference.formats import bf16_round

torch = pytest.importorskip("torch")

F32 = np.float32


def _names(msg: str, arg: str) -> bool:
    """The message starts with the argument's name (then ':', ' ' or '(')."""
    return re.match(rf"{re.escape(arg)}[:\s(]", msg) is not None


def _ulps(a, b):
    """|a - b| in float32 ulps of b (a, b float32, finite)."""
    a = np.asarray(a, np.float64)
    b32 = np.asarray(b, np.float32)
    return np.abs(a - b32.astype(np.float64)) / np.spacing(np.abs(b32)).astype(np.float64)


# ---- reference building blocks ---------------------------------------------------------
def test_exp_f32_accuracy_and_constants():
    assert R.EXP_COEF == tuple(F32(1.0 / k) for k in (5040, 720, 120, 24, 6))
    assert R.EXP_LOG2E == F32(np.log2(np.e))
    assert R.EXP_LN2_HI + np.float64(R.EXP_LN2_LO) == pytest.approx(np.log(2), abs=1e-12)
    x = np.linspace(-87.0, 88.7, 400_001).astype(F32)
    e = R.exp_f32(x)
    # the bound docs/fused.md and the reference state (measured here: 1 ulp)
    assert _ulps(e, np.exp(x.astype(np.float64)).astype(F32)).max() <= 2.0
    sp = R.exp_f32(np.array([np.inf, -np.inf, 89.0, -104.0, 0.0, np.nan], F32))
    assert sp[0] == np.inf and sp[1] == 0 and sp[2] == np.inf and sp[3] == 0 and sp[4] == 1
    assert np.isfinite(sp[5])          # NaN -> -104 (NaN-ignoring clamp, as CUDA fmaxf)


def test_silu_matches_float64(rng):
    a = (rng.standard_normal(100_000) * 8).astype(F32)
    s = R.silu(a)
    s64 = a.astype(np.float64) / (1 + np.exp(-a.astype(np.float64)))
    ok = np.abs(s64) > 1e-30
    assert np.max(np.abs(s[ok] - s64[ok]) / np.abs(s64[ok])) < 5e-7
    sp = R.silu(np.array([np.nan, np.inf, -np.inf, -0.0, 1000.0, -1000.0], F32))
    assert np.isnan(sp[0]) and sp[1] == np.inf and np.isnan(sp[2])
    assert sp[3] == 0 and np.signbit(sp[3]) and sp[4] == 1000 and sp[5] == 0


def test_rms_inv_matches_float64(rng):
    x = bf16_round(rng.standard_normal((64, 7168)).astype(F32) * rng.uniform(0.01, 100, (64, 1)))
    inv = R.rms_inv(x, 1e-6)
    exact = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1) + np.float64(F32(1e-6)))
    # Four float32 roundings after the float64 sum, each <= 2^-24 relative: the mean and the
    # + eps (both halved by the sqrt), the sqrt and the division: <= 3 * 2^-24 in all.
    # (An ulp bound on the float32-rounded exact value is not rigorous: seen at 2 ulps.)
    assert (np.abs(inv - exact) / exact).max() <= 3 * 2.0**-24


def test_rmsnorm_matches_float64(rng):
    x = bf16_round(rng.standard_normal((33, 2048)).astype(F32))
    w = (rng.standard_normal(2048) * 0.5 + 1).astype(F32)
    y, inv = R.rmsnorm(x, w, 1e-6, "bfloat16")
    x64 = x.astype(np.float64)
    y64 = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6) * w
    # y is BF16: within one BF16 rounding (2^-8 relative) plus float32 noise
    assert np.all(np.abs(y - y64) <= np.abs(y64) * 2.0 ** -8 * 1.001 + 1e-30)
    assert np.array_equal(y, bf16_round(y))
    y32, _ = R.rmsnorm(x, w, 1e-6, "float32")
    assert np.all(np.abs(y32 - y64) <= np.abs(y64) * 4e-7 + 1e-30)


def test_mhc_mix_matches_float64(rng):
    X = bf16_round(rng.standard_normal((17, 4, 256)).astype(F32))
    A = rng.random((17, 4)).astype(F32)
    m = R.mhc_mix(X, A, "bfloat16")
    m64 = np.einsum("mh,mhn->mn", A.astype(np.float64), X.astype(np.float64))
    assert np.all(np.abs(m - m64) <= np.abs(m64) * 2.0 ** -8 * 1.001 + 1e-6)
    # h == 0 is a product, not 0 + product: -0 stays -0
    z = R.mhc_mix(np.full((1, 1, 16), -0.0, F32), np.ones((1, 1), F32), "float32")
    assert np.all(np.signbit(z))


@pytest.mark.parametrize("g", [1, 2, 3, 4, 6, 8, 12, 16, 32])
def test_deinterleave_indexing(g):
    inter = 96
    h = np.arange(2 * inter, dtype=F32)[None, :]
    gate, up = R.deinterleave(h, g)
    for i in range(inter):
        assert gate[0, i] == (i // g) * 2 * g + i % g
        assert up[0, i] == (i // g) * 2 * g + g + i % g


@pytest.mark.parametrize("g", [3, 6, 8, 12])      # 3, 6, 12: groups straddle 16-element chunks
def test_swiglu_matches_float64(rng, g):
    h = bf16_round(rng.standard_normal((9, 2 * 480)).astype(F32) * 3)
    y = R.swiglu(h, g, "bfloat16")
    cols = np.arange(480)
    gate = h[:, (cols // g) * 2 * g + cols % g].astype(np.float64)       # docs/fused.md indexing
    up = h[:, (cols // g) * 2 * g + g + cols % g].astype(np.float64)
    y64 = gate / (1 + np.exp(-gate)) * up
    assert np.all(np.abs(y - y64) <= np.abs(y64) * 2.0 ** -8 * 1.001 + 1e-30)


def test_rmsnorm_quantize_composes_reference(rng):
    x = bf16_round(rng.standard_normal((7, 512)).astype(F32))
    w = rng.random(512).astype(F32) + 0.5
    q, sf, gs, inv = R.rmsnorm_quantize(x, w, 1e-6, "row")
    y, inv2 = R.rmsnorm(x, w, 1e-6, "bfloat16")
    q2, sf2, gs2 = RN.quantize(y, "row")
    assert np.array_equal(q, q2) and np.array_equal(sf, sf2) and np.array_equal(gs, gs2)
    assert np.array_equal(inv, inv2)
    # and the decoded values approximate the float64 RMSNorm: NVFP4 error bound
    # per element <= (half the widest E2M1 gap = 1) * es, and es <= bmax / 6 * (1 + 2^-4)
    deq = RN.dequantize(q, sf, gs, "float32")
    bmax = np.abs(y).reshape(7, 32, 16).max(-1, keepdims=True)
    err = np.abs(deq - y).reshape(7, 32, 16)
    assert np.all(err <= bmax / 6 * (1 + 2.0 ** -4) + 1e-30)


def test_pack_scales_layout():
    sf = np.arange(16, dtype=np.uint8).reshape(2, 8)
    w = R.pack_scales_i32(sf)
    assert w.dtype == np.int32 and w.shape == (2, 2)
    assert w.view(np.uint32)[0, 0] == 0x03020100 and w.view(np.uint32)[1, 1] == 0x0F0E0D0C
    assert np.array_equal(R.unpack_scales_i32(w), sf)


def test_moe_stage_reference(rng):
    x = bf16_round(rng.standard_normal((5, 256)).astype(F32))
    x[1, 16:32] = np.nan
    ids = rng.integers(0, 64, (5, 6)).astype(np.int32)
    wts = rng.random((5, 6)).astype(F32)
    q, sf32, ids64, w = R.moe_stage(x, ids, wts)
    q2, sf2, _ = RN.quantize(x, "none")
    assert np.array_equal(q, q2) and np.array_equal(R.unpack_scales_i32(sf32), sf2)
    assert sf2[1, 1] == 0x7F and np.all(RN.unpack_nibbles(q)[1, 16:32] == 0)
    assert ids64.dtype == np.int64 and np.array_equal(ids64, ids) and np.array_equal(w, wts)
    # RNE ties (not rounding up): 0.25 * es -> 0, 2.5 * es -> 2
    t = np.zeros((1, 128), F32)
    t[0, :3] = [6.0, 0.25, 2.5]                     # bmax 6 -> sf = 1.0, es = 1
    codes = RN.unpack_nibbles(R.moe_stage(t, ids[:1], wts[:1])[0])
    assert list(codes[0, :3]) == [7, 0, 4]


# ---- public ops on CPU -------------------------------------------------------------------
def test_ops_cpu_dispatch_torch_and_numpy(rng):
    xn = bf16_round(rng.standard_normal((3, 5, 64)).astype(F32))
    w = rng.random(64).astype(F32)
    xt = torch.from_numpy(xn).bfloat16()
    qa = F.rmsnorm_quantize(xt, torch.from_numpy(w))
    q, sf, gs, inv = R.rmsnorm_quantize(xn.reshape(15, 64), w, 1e-6, "row", None, "bfloat16")
    assert isinstance(qa, F.QuantizedActivation)
    assert qa.q.shape == (3, 5, 32) and qa.sf.shape == (3, 5, 4) and qa.gs.shape == (3, 5)
    assert np.array_equal(qa.q.view(torch.uint8).numpy().reshape(15, 32), q)
    assert np.array_equal(qa.inv_rms.numpy().reshape(15), inv)
    # numpy float32 input: no rounding of the intermediate (dtype float32)
    qn = F.rmsnorm_quantize(xn[0], w, scope="tensor")
    q2, sf2, gs2, _ = R.rmsnorm_quantize(xn[0], w, 1e-6, "tensor", None, "float32")
    assert isinstance(qn.q, np.ndarray) and np.array_equal(qn.q, q2) and qn.gs.shape == ()
    # dequantize through the result object
    d = qa.dequantize()
    assert d.dtype == torch.bfloat16 and d.shape == (3, 5, 64)
    # out= (torch CPU buffers, fp8 view for sf) is filled and returned
    out = (torch.empty(3, 5, 32, dtype=torch.uint8), torch.empty(3, 5, 4, dtype=torch.float8_e4m3fn),
           torch.empty(3, 5), torch.empty(3, 5))
    r = F.rmsnorm_quantize(xt, torch.from_numpy(w), out=out)
    assert r.q is out[0] and r.sf is out[1]
    assert np.array_equal(out[1].view(torch.uint8).numpy().reshape(15, 4), sf)


def test_mhc_and_swiglu_and_moe_cpu(rng):
    X = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    A = torch.rand(4, 3)
    qa = F.mhc_rmsnorm_quantize(X, A, torch.ones(32))
    ref = R.mhc_rmsnorm_quantize(X.float().numpy(), A.numpy(), np.ones(32, F32))
    assert np.array_equal(qa.q.view(torch.uint8).numpy(), ref[0])
    assert np.array_equal(qa.sf.view(torch.uint8).numpy(), ref[1])
    assert np.array_equal(qa.gs.numpy(), ref[2]) and np.array_equal(qa.inv_rms.numpy(), ref[3])
    h = torch.randn(2, 3, 192).half()
    for g in (8, 4, 3, 6, 12):
        qs = F.swiglu_quantize(h, g, scope="given", gs=0.01)
        rs = R.swiglu_quantize(h.float().numpy().reshape(6, 192), g, "given", 0.01, "float16")
        assert np.array_equal(qs.q.view(torch.uint8).numpy().reshape(6, 48), rs[0]) and qs.inv_rms is None
        assert float(qs.gs) == float(F32(0.01))
    hid, ids, wts = torch.randn(3, 256).bfloat16(), torch.randint(0, 8, (3, 2), dtype=torch.int32), \
        torch.rand(3, 2).bfloat16()
    st = F.moe_stage(hid, ids, wts)
    assert st.q.dtype == torch.uint8 and st.sf.dtype == torch.int32 and st.sf.shape == (3, 4)
    assert st.topk_ids.dtype == torch.int64 and st.topk_weights.dtype == torch.bfloat16
    q, sf, ids64, _ = R.moe_stage(hid.float().numpy(), ids.numpy(), wts.float().numpy())
    assert np.array_equal(st.q.numpy(), q) and np.array_equal(st.sf.numpy(), sf)
    assert np.array_equal(st.topk_ids.numpy(), ids64) and torch.equal(st.topk_weights, wts)


def test_zero_rows_and_empty():
    qa = F.rmsnorm_quantize(np.zeros((2, 32), F32), np.ones(32, F32))
    assert np.all(qa.q == 0) and np.all(qa.sf == 0x38) and np.all(qa.gs == 1)   # zero blocks: scale 1.0
    assert np.allclose(qa.inv_rms, 1 / np.sqrt(F32(1e-6)))
    qe = F.swiglu_quantize(np.zeros((0, 64), F32))
    assert qe.q.shape == (0, 16) and qe.gs.shape == (0,)


@pytest.mark.parametrize("scope, gs, want", [("row", None, None), ("tensor", None, 1.0), ("none", None, 1.0),
                                             ("given", 0.5, 0.5)])
def test_no_rows_every_output_defined(scope, gs, want):
    """M == 0 (any leading dim 0): empty codes / scales / inv_rms, and a defined gs."""
    kw = dict(scope=scope, gs=gs)
    w = torch.ones(64)
    for qa, lead, has_inv in ((F.rmsnorm_quantize(torch.zeros(2, 0, 64).bfloat16(), w, **kw), (2, 0), True),
                              (F.mhc_rmsnorm_quantize(torch.zeros(0, 3, 64).half(), torch.ones(0, 3), w, **kw),
                               (0,), True),
                              (F.swiglu_quantize(torch.zeros(0, 128).bfloat16(), **kw), (0,), False)):
        assert qa.q.shape == (*lead, 32) and qa.sf.shape == (*lead, 4)
        if want is None:
            assert qa.gs.shape == lead
        else:
            assert qa.gs.shape == () and float(qa.gs) == want
        assert qa.inv_rms.shape == lead if has_inv else qa.inv_rms is None
    st = F.moe_stage(torch.zeros(0, 128).bfloat16(), torch.zeros(0, 8, dtype=torch.int32), torch.zeros(0, 8))
    assert st.q.shape == (0, 64) and st.sf.shape == (0, 2) and st.topk_ids.shape == (0, 8)


@pytest.mark.parametrize("call, arg", [
    (lambda: F.rmsnorm_quantize(_x(2, 0), _x(0)), "x"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 3, 0), _x(2, 3), _x(0)), "x"),
    (lambda: F.swiglu_quantize(_x(2, 0)), "h"),
    (lambda: F.moe_stage(_x(2, 0), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: R.rmsnorm_quantize(_x(2, 0), _x(0)), "x"),
    (lambda: R.swiglu_quantize(_x(2, 0)), "h"),
])
def test_empty_last_dim_is_an_error(call, arg):
    """N == 0: a ValueError naming the input (CUDA would leave gs / inv_rms unwritten)."""
    with pytest.raises(ValueError) as ei:
        call()
    assert _names(str(ei.value), arg), str(ei.value)


# ---- a number gs: checked as the float32 the kernels read ---------------------------------
_OPS_GS = [lambda **kw: F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), **kw),
           lambda **kw: F.mhc_rmsnorm_quantize(np.ones((2, 2, 32), F32), np.ones((2, 2), F32), np.ones(32, F32), **kw),
           lambda **kw: F.swiglu_quantize(np.ones((2, 64), F32), **kw)]


@pytest.mark.parametrize("op", range(3))
@pytest.mark.parametrize("gs", [-1.0, 0.0, float("nan"), float("inf"), 1e39, 1e-50, True, np.float32(-2.0)])
def test_bad_number_gs_is_refused(op, gs):
    with pytest.raises((ValueError, TypeError)) as ei:
        _OPS_GS[op](gs=gs)
    assert _names(str(ei.value), "gs"), str(ei.value)
    assert type(ei.value) is (TypeError if gs is True else ValueError)


@pytest.mark.parametrize("op", range(3))
def test_host_gs_array_value_is_checked(op):
    """A host gs array's value is already on the host: refused as a number
    would be; a good one gives the number's bits."""
    for bad in (-1.0, 0.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="^gs:"):
            _OPS_GS[op](gs=np.array([bad], F32))
    want = _OPS_GS[op](gs=0.5)
    for gs in (np.array([0.5], F32), np.array(0.5, F32), torch.tensor([0.5])):
        got = _OPS_GS[op](gs=gs)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want) if a is not None)


@pytest.mark.parametrize("op", range(3))
def test_numpy_scalar_gs_and_eps_accepted(op):
    want = _OPS_GS[op](gs=0.5)
    for gs in (np.float32(0.5), np.float64(0.5)):
        got = _OPS_GS[op](gs=gs)
        assert all(np.array_equal(a, b) for a, b in zip(got, want) if a is not None)
    if op == 0:      # eps: numpy real scalars too, as the float32 the kernel uses
        a = F.rmsnorm_quantize(np.ones((2, 32), F32) * 1e-3, np.ones(32, F32), eps=np.float32(1e-6))
        b = F.rmsnorm_quantize(np.ones((2, 32), F32) * 1e-3, np.ones(32, F32), eps=float(F32(1e-6)))
        assert np.array_equal(a.inv_rms, b.inv_rms) and np.array_equal(a.q, b.q)
        for bad in (True, np.float32(np.nan), -1e-6, 1e39, 0.0, 0, np.float64(0.0)):
            with pytest.raises(ValueError, match="^eps"):
                F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), eps=bad)


# ---- a given gs: rawkv.nvfp4's rule, bounded by the input dtype (docs/format.md) ----------
def _op_dt(op, dtype, **kw):
    """Producer `op` (0 rms, 1 mhc, 2 swiglu) on CPU tensors of `dtype`."""
    t = lambda *s: torch.linspace(-3, 3, int(np.prod(s))).reshape(s).to(dtype)  # noqa: E731
    if op == 0:
        return F.rmsnorm_quantize(t(2, 32), torch.ones(32), **kw)
    if op == 1:
        return F.mhc_rmsnorm_quantize(t(2, 2, 32), torch.ones(2, 2), torch.ones(32), **kw)
    return F.swiglu_quantize(t(2, 64), **kw)


def _ref_dt(op, dtype, gs):
    """The reference's (q, sf, gs) of _op_dt's inputs under scope 'given'."""
    name = str(dtype).replace("torch.", "")
    t = lambda *s: torch.linspace(-3, 3, int(np.prod(s))).reshape(s).to(dtype).float().numpy()  # noqa: E731
    if op == 0:
        return R.rmsnorm_quantize(t(2, 32), np.ones(32, F32), 1e-6, "given", gs, name)[:3]
    if op == 1:
        return R.mhc_rmsnorm_quantize(t(2, 2, 32), np.ones((2, 2), F32), np.ones(32, F32), 1e-6, "given",
                                      gs, name)[:3]
    return R.swiglu_quantize(t(2, 64), 8, "given", gs, name)


@pytest.mark.parametrize("op", range(3))
def test_given_gs_bound_of_the_input_dtype(op):
    """A number or host array gs at or above given_gs_limit(x's dtype) is a
    ValueError naming gs (every block scale would be 0); just below it, and
    2e7 for bfloat16 / float32 input (refused for float16: its bound is
    11179349), it is used. A value accepted for bfloat16 is still refused
    for float16."""
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        name = str(dtype).replace("torch.", "")
        limit = RN.given_gs_limit(name)
        below = float(np.nextafter(F32(limit), F32(0)))
        for good in (below, 2e7) if name != "float16" else (below,):
            for gs in (good, good, np.array([good], F32), torch.tensor(good)):
                got = _op_dt(op, dtype, gs=gs)
                want = _ref_dt(op, dtype, good)
                assert np.array_equal(got.q.view(torch.uint8).numpy(), want[0])
                assert np.array_equal(got.sf.view(torch.uint8).numpy(), want[1])
                assert not (want[1] == 0x7F).all()              # used, not flagged
        bad = (limit, 2e7) if name == "float16" else (limit,)
        for g in bad:
            for gs in (g, g, np.float32(g), np.array([g], F32), torch.tensor([g])):
                with pytest.raises(ValueError, match="^gs:"):
                    _op_dt(op, dtype, gs=gs)


@pytest.mark.parametrize("op", range(3))
@pytest.mark.parametrize("g", [-0.5, -0.0, 0.0, np.nan, np.inf, -np.inf, "limit"])
def test_reference_flags_an_unusable_given_gs(op, g):
    """rawkv.reference.fused applies rawkv.reference.nvfp4's rule (what the
    kernels are compared with): a gs that given_gs_ok refuses for the input
    dtype is never used, sign bit included: every block is flagged (sf
    0x7F, codes 0) and gs is the given value. The ops refuse it on the host."""
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        gv = RN.given_gs_limit(name) if g == "limit" else g
        q, sf, gs = _ref_dt(op, dtype, gv)
        assert not q.any() and (sf == 0x7F).all()
        assert np.asarray(gs, F32).view(np.uint32) == np.asarray(gv, F32).view(np.uint32)
        with pytest.raises(ValueError, match="^gs:"):
            _op_dt(op, dtype, gs=np.array([gv], F32))


def test_scope_gs_number_keeps_the_rules():
    """A Python float gs accepted once is accepted again with scope None /
    'given' only; any other scope with it is still refused."""
    h = np.ones((2, 64), F32)
    want = F.swiglu_quantize(h, scope="given", gs=0.375)
    got = F.swiglu_quantize(h, gs=0.375)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3], want[:3]))
    for scope in ("row", "tensor", "none"):
        with pytest.raises(ValueError, match="^gs:"):
            F.swiglu_quantize(h, scope=scope, gs=0.375)
    with pytest.raises(ValueError, match="^scope:"):
        F.swiglu_quantize(h, scope="blocks", gs=0.375)


# ---- QuantizedActivation into rawkv.nvfp4.dequantize ------------------------------------
def test_dequantize_takes_a_quantized_activation(rng):
    x = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(F32)).bfloat16()
    for qa in (F.rmsnorm_quantize(x, torch.ones(64)),                          # gs per row
               F.swiglu_quantize(x, scope="tensor"),                           # gs scalar
               F.rmsnorm_quantize(x.float().numpy(), np.ones(64, F32))):      # numpy
        for dt in (None, "float32"):
            want = N.dequantize(qa.q, qa.sf, qa.gs, dtype=dt)
            for got in (N.dequantize(qa, dtype=dt), qa.dequantize(dt)):
                assert type(got) is type(want) and got.dtype == want.dtype
                assert np.array_equal(_f32(got), _f32(want))
    with pytest.raises(TypeError, match="^sf, gs"):
        N.dequantize(qa.q)                              # a plain array needs sf and gs
    with pytest.raises(TypeError, match="^sf, gs"):
        N.dequantize(qa, qa.sf)                         # an activation takes neither


def _f32(a):
    return a.float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, F32)


# ---- moe_stage: one-level NVFP4 usable range (docs/fused.md) --------------------------------
def test_moe_stage_one_level_range():
    """gs = 1: a block's scale is e4m3(bmax / 6), never below 2^-9 (0x01,
    ModelOpt's clamp): a block whose scale would round to 0 keeps what E2M1
    times 2^-9 holds (|x| > 2^-11) instead of losing everything; normal
    scales (bmax >= 6 * 2^-6) keep the NVFP4 error bound; an all-zero block
    gets 1.0 (0x38)."""
    x = np.zeros((1, 128), F32)
    x[0, :16] = np.linspace(-1e-4, 1e-4, 16)                  # bmax 1e-4: scale 2^-9, |x| / 2^-9 < 0.25
    x[0, 16:32] = np.linspace(-1.0, 1.0, 16)                  # bmax 1.0
    x[0, 32:48] = np.linspace(-6 * 2.0**-10, 0, 16)           # bmax 6 * 2^-10: its tie rounded to 0 before
    x[0, 48:64] = np.linspace(0, 0.0078125, 16)               # bmax 2^-7: a subnormal scale, not lost
    q, sf32, _, _ = F.moe_stage(x, np.zeros((1, 1), np.int32), np.zeros((1, 1), F32))
    sf = R.unpack_scales_i32(sf32)
    codes = RN.unpack_nibbles(q)
    assert sf[0, 0] == 0x01 and np.all(codes[0, :16] & 7 == 0)
    assert np.array_equal(codes[0, :16] >> 3, (x[0, :16] < 0).astype(np.uint8))   # signed zeros
    assert sf[0, 2] == 0x01 and codes[0, 32] == 0x8 | 5                          # -3 * 2^-9: kept
    assert 0 < sf[0, 3] < 8 and np.any(codes[0, 48:64] & 7)
    assert np.all(sf[0, 4:] == 0x38) and not codes[0, 64:].any()
    d = RN.dequantize(q, sf, 1.0, "float32")
    assert d[0, 32] == -3 * 2.0**-9
    err = np.abs(d[0, 16:32] - x[0, 16:32])
    assert np.all(err <= 1.0 / 6 * (1 + 2.0**-4)), err.max()     # half the widest E2M1 gap x es


# ---- CPU dtype checks (as on CUDA) ------------------------------------------------------------
@pytest.mark.parametrize("call, arg", [
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(_x(2, 16), None, None)), "out.q"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(None, _x(2, 2), None)), "out.sf"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(None, None, np.zeros(2))), "out.gs"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(None, None, None, np.zeros(2, np.float16))),
     "out.inv_rms"),
    (lambda: F.swiglu_quantize(_x(2, 64), out=(np.zeros((2, 16), np.int8), None, None)), "out.q"),
    (lambda: F.rmsnorm_quantize(np.ones((2, 32), np.int32), _x(32)), "x"),
    (lambda: F.rmsnorm_quantize(np.ones((2, 32)), _x(32)), "x"),                     # float64
    (lambda: F.rmsnorm_quantize(_x(2, 32), np.ones(32, np.int32)), "weight"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 1, 32), np.ones((2, 1), np.int64), _x(32)), "mix"),
    (lambda: F.swiglu_quantize(np.ones((2, 64), np.int16)), "h"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), gs=np.ones(1)), "gs"),             # float64 tensor gs
    (lambda: F.moe_stage(np.ones((2, 128), np.int32), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.uint8), _x(2, 4)), "topk_ids"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32)), "topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), np.zeros((2, 4))), "topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(None, np.zeros((2, 8), np.uint8), None, None)), "out.sf"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(None, None, np.zeros((2, 4), np.int32), None)), "out.topk_ids"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(None, None, None, np.zeros((2, 4), np.float16))), "out.topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(_x(2, 64), None, None, None)), "out.q"),
])
def test_cpu_dtype_errors(call, arg):
    with pytest.raises(TypeError) as ei:
        call()
    assert _names(str(ei.value), arg), str(ei.value)


def test_bad_out_dtype_writes_nothing():
    q = np.full((2, 16), 0xAB, np.uint8)
    sf = np.full((2, 2), 7.0, F32)               # float32: refused, not cast
    gs = np.full((2,), 7.0, F32)
    with pytest.raises(TypeError, match="^out.sf"):
        F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), out=(q, sf, gs, None))
    assert np.all(q == 0xAB) and np.all(sf == 7.0) and np.all(gs == 7.0)
    ok = F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32),
                            out=(torch.zeros(2, 16, dtype=torch.float4_e2m1fn_x2), torch.zeros(2, 2, dtype=torch.uint8),
                                 None, None))
    assert ok.q.dtype == torch.float4_e2m1fn_x2 and ok.sf.dtype == torch.uint8


# ---- argument errors (shape checks run before any placement-specific work) ---------------
def _x(*s):
    return np.zeros(s, F32)


@pytest.mark.parametrize("call, arg", [
    (lambda: F.rmsnorm_quantize(_x(2, 24), _x(24)), "x"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(16)), "weight"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), eps=-1.0), "eps"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), scope="blocks"), "scope"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), scope="given"), "gs"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), scope="row", gs=1.0), "gs"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(_x(2, 16),)), "out"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(np.zeros((2, 8), np.uint8), None, None)), "out.q"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 5, 32), _x(2, 5), _x(32)), "x"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 3, 32), _x(2, 4), _x(32)), "mix"),
    (lambda: F.mhc_rmsnorm_quantize(_x(32), _x(1), _x(32)), "x"),
    (lambda: F.swiglu_quantize(_x(2, 40)), "h"),
    (lambda: F.swiglu_quantize(_x(2, 33)), "h"),
    (lambda: F.swiglu_quantize(_x(2, 64), 3), "granularity"),
    (lambda: F.swiglu_quantize(_x(2, 64), 0), "granularity"),
    (lambda: F.moe_stage(_x(2, 192), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: F.moe_stage(_x(2, 2, 128), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((3, 4), np.int32), _x(3, 4)), "topk_ids"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 3)), "topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), _x(2, 4), _x(2, 4)), "topk_ids"),
])
def test_argument_errors_name_the_argument(call, arg):
    with pytest.raises((ValueError, TypeError)) as ei:
        call()
    assert _names(str(ei.value), arg), str(ei.value)


def test_bad_out_writes_nothing():
    q = np.full((2, 16), 0xAB, np.uint8)
    sf = np.full((2, 3), 0xAB, np.uint8)        # wrong shape: (2, 2) expected
    gs = np.full((2,), 7.0, F32)
    with pytest.raises(ValueError, match="^out.sf"):
        F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), out=(q, sf, gs, None))
    assert np.all(q == 0xAB) and np.all(gs == 7.0)


# ---- the kernel declarations (rawkv.kernels.fused): constants written once ------------------
def _fused_cu():
    from rawkv.kernels import _abi
    return (_abi.CU_DIR / "fused.cu").read_text()


def test_fused_cu_reads_every_shared_constant_from_the_declarations():
    src = _fused_cu()
    assert set(re.findall(r"\bRKV_FUSED_\w+", src)) == set(K.FILE.constants)
    guard = src[src.index("#if !defined("):src.index("#error")]
    assert set(re.findall(r"defined\((RKV_FUSED_\w+)\)", guard)) == set(K.FILE.constants)
    opts = K.FILE.options()
    for name, value in (("MAX_THREADS", K.MAX_THREADS), ("MAX_THREADS_SM100", K.MAX_THREADS_SM100),
                        ("MAX_HC", K.MAX_HC), ("MOE_BLOCK", K.MOE_BLOCK), ("MODE_TENSOR", K.MODE_TENSOR),
                        ("KIND_BF16", K.PARAM_KIND["bfloat16"])):
        assert f"-DRKV_FUSED_{name}={value}" in opts
    # the launch bounds are the declared ones, not literals
    assert src.count("__launch_bounds__(kMaxThreads / REG, 1)") == 2
    assert "__launch_bounds__(RKV_FUSED_MOE_BLOCK, kMoeMinBlocks)" in src
    assert len({K.MODE_ROW, K.MODE_AMAX, K.MODE_TENSOR, K.MODE_FIXED}) == 4
    assert sorted(K.PARAM_KIND.values()) == [0, 1, 2]


def test_fused_cu_compiles_only_with_its_constants():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")
    from rawkv import _nvrtc, runtime
    from rawkv.errors import CompileError
    with pytest.raises(CompileError, match="a shared constant is missing"):
        _nvrtc.compile_cu(_fused_cu(), "fused.cu", "sm_90", ["rkv_fused_set_gs"])
    res = _nvrtc.compile_cu(_fused_cu(), "fused.cu", "sm_90", ["rkv_fused_set_gs"],
                            runtime.kernel_options("fused.cu"))
    assert res.cubin[:4] == b"\x7fELF"


def test_nvrtc_check_compiles_with_the_files_constants(monkeypatch):
    import io
    from rawkv import _nvrtc
    from rawkv.errors import CompileError
    from rawkv.tools import nvrtc_check
    seen = {}

    def compile_cu(source, filename, arch, names, extra_options=(), verbose_ptxas=False):
        seen[filename] = tuple(extra_options)
        raise CompileError("not compiled here")
    monkeypatch.setattr(_nvrtc, "nvrtc_version", lambda: (12, 9))
    monkeypatch.setattr(_nvrtc, "cuda_include_dirs", lambda: ("/nowhere",))
    monkeypatch.setattr(_nvrtc, "compile_cu", compile_cu)
    assert nvrtc_check.check(("sm_90",), 0, files=["fused.cu"], out=io.StringIO()) == 1
    assert seen["fused.cu"] == K.FILE.options() and seen["fused.cu"]


class _FakeRt:
    def __init__(self, sm_count):
        self.sm_count = sm_count


@pytest.mark.parametrize("sm_count", [1, 80, 132, 148, 170])
def test_row_blocks_stay_within_every_arch_bound(sm_count):
    """The host launches at most K.MAX_BLOCK threads per row CTA, within the
    kernels' launch bound on every arch (below sm_100 and from sm_100 on),
    in whole warps; a prefill row fits its REG chunks per thread when it can."""
    rt = _FakeRt(sm_count)
    bound = min(K.MAX_THREADS, K.MAX_THREADS_SM100) // K.REG
    assert K.MAX_BLOCK == bound == 768           # the geometry the H100 numbers were measured with
    for rows in (1, 2 * sm_count - 1, 2 * sm_count, 10 ** 5):
        for chunks in (1, 16, 129, 448, 768, 1536, 1537, 2560, 10 ** 4):
            block = _rows.block_for(rt, rows, chunks)
            assert 32 <= block <= bound and block % 32 == 0, (rows, chunks, block)
            if rows < 2 * sm_count:              # decode: one chunk per thread, as far as it goes
                assert block == min(bound, -(-chunks // 32) * 32)
            elif chunks <= K.REG * bound:        # prefill: every chunk in registers
                assert chunks <= K.REG * block
