"""rawkv.fused.rmsnorm_quantize: the reference against float64 compositions,
argument errors, the CUDA kernel against the reference, the operator.

GPU tolerances: tests/support/fused.py's docstring (the comparisons live there)."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import fused as F  # noqa: E402
from rawkv.fused import plans as _rows  # noqa: E402
from rawkv.kernels import fused as K  # noqa: E402
from rawkv.reference import fused as R  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
from rawkv.reference.formats import bf16_round  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import fused as RFU  # noqa: E402
import rawkv.library  # noqa: E402,F401
from support.fused import (  # noqa: E402
    _LONG, _PREFILL_N, _check_rms, _dt, _huge_weight, _np, _plant, _prefill_rows, _rand, _with_edges)
from support.properties import (  # noqa: E402
    SETTINGS, _activation_ref, _fused_gs, _gs, f_gs, f_scopes, host, judge, layouts, leads, libs, make,
    p_dtypes, seeds, widths, x_dtypes)


# ---- the reference ----------------------------------------------------------------------------------
F32 = np.float32


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


# ---- argument errors --------------------------------------------------------------------------------
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


def test_bad_out_writes_nothing():
    q = np.full((2, 16), 0xAB, np.uint8)
    sf = np.full((2, 3), 0xAB, np.uint8)        # wrong shape: (2, 2) expected
    gs = np.full((2,), 7.0, F32)
    with pytest.raises(ValueError, match="^out.sf"):
        F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), out=(q, sf, gs, None))
    assert np.all(q == 0xAB) and np.all(gs == 7.0)


def test_eps_zero_would_be_nan_on_a_zero_row():
    """Why eps = 0 is refused: the reference's inv_rms of an all-zero row is
    inf, y = 0 * inf is NaN, and every block is flagged (sf 0x7F)."""
    from rawkv.reference import fused as R
    q, sf, gs, inv = R.rmsnorm_quantize(np.zeros((1, 32), np.float32), np.ones(32, np.float32), 0.0,
                                        "row", None, "float32")
    assert np.isinf(inv[0]) and np.all(sf == 0x7F)
    with pytest.raises(ValueError, match="^eps"):
        F.rmsnorm_quantize(np.zeros((1, 32), np.float32), np.ones(32, np.float32), eps=0.0)


@pytest.mark.parametrize("part", range(4))
def test_read_only_out_refused_before_anything_is_written(part):
    """A read-only numpy out= part (issue 21, item 8) is refused by name
    before any part is written (numpy itself would raise at the first store
    into it, after the parts before it were written)."""
    x, w = np.ones((2, 32), np.float32), np.ones(32, np.float32)
    out = [np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8), np.zeros(2, np.float32),
           np.zeros(2, np.float32)]
    out[part].flags.writeable = False
    name = ("out.q", "out.sf", "out.gs", "out.inv_rms")[part]
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: is read-only"):
        F.rmsnorm_quantize(x, w, out=tuple(out))
    assert not any(o.any() for o in out)


EPS = [1e-6, 0.0, -1.0, float("nan"), 1, np.float32(1e-5), True, None]


@SETTINGS
@given(seed=seeds, lead=leads, n=widths, xdt=x_dtypes, wdt=p_dtypes, lib=libs, layout=layouts,
       special=st.booleans(), eps=st.sampled_from(EPS), scope=f_scopes, gs=f_gs)
def test_fused_rmsnorm_quantize(seed, lead, n, xdt, wdt, lib, layout, special, eps, scope, gs):
    x = make(seed, (*lead, n), xdt, lib, layout, special)
    w = make(seed + 1, (n,), wdt, lib)
    g = _gs(gs, seed, lib)

    def reference():
        sc, gv = _fused_gs(scope, g)
        q, sf, gg, inv = RFU.rmsnorm_quantize(host(x).reshape(-1, n), host(w), float(eps), sc, gv, xdt)
        return _activation_ref(lead, n, q, sf, gg, inv)
    judge(lambda: rawkv.fused.rmsnorm_quantize(x, w, eps, scope=scope, gs=g), ("x", "weight", "eps", "scope", "gs"),
          reference)


# ---- GPU: against the reference ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7168), (37, 2048), (5, 16), (3, 40960), (2, 3, 512)])
def test_rmsnorm_quantize_row(cuda, rng, dtype, shape):
    n = shape[-1]
    x = _rand(rng, shape, dtype, rng.uniform(0.1, 10))
    w = torch.from_numpy((rng.standard_normal(n) * 0.2 + 1).astype(F32)).cuda()
    qa = F.rmsnorm_quantize(x, w, 1e-6)
    lead = shape[:-1]
    rows = int(np.prod(lead))
    assert qa.q.shape == (*lead, n // 2) and qa.gs.shape == lead and qa.inv_rms.shape == lead

    def ref(inv):
        return R.rmsnorm_quantize(_np(x).reshape(rows, n), _np(w), 1e-6, "row", None, _dt(x),
                                  None if inv is None else inv.reshape(rows))
    _check_rms(qa, ref, rows, (rows,))


@pytest.mark.parametrize("edge", ["zero_row", "nan", "huge", "tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_edges(cuda, rng, edge, dtype):
    x = _with_edges(_rand(rng, (9, 256), dtype), edge)
    w = torch.from_numpy(rng.random(256).astype(F32) + 0.5).to(torch.bfloat16).cuda()
    qa = F.rmsnorm_quantize(x, w, 1e-5)
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-5, "row", None, _dt(x), inv), 9, (9,))


@pytest.mark.parametrize("scope", ["tensor", "given_float", "given_tensor", "none"])
def test_rmsnorm_quantize_scopes(cuda, rng, scope):
    x = _rand(rng, (65, 1024), torch.bfloat16)
    w = torch.from_numpy(rng.random(1024).astype(F32) + 0.5).cuda()
    gsv = 0.00123
    kw = {"tensor": dict(scope="tensor"), "given_float": dict(gs=gsv),
          "given_tensor": dict(gs=torch.tensor([gsv], device="cuda")), "none": dict(scope="none")}[scope]
    qa = F.rmsnorm_quantize(x, w, **kw)
    sc = {"given_float": "given", "given_tensor": "given"}.get(scope, scope)
    assert qa.gs.shape == ()
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, sc, gsv if sc == "given" else None,
                                                  "bfloat16", inv), 65, (65,), sc)


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_long_rows_inf_blocks(cuda, rng, dtype, scope):
    assert _rows.block_for(cuda, 3, _LONG // 16) * K.REG * 16 < 30000   # the recompute path runs
    x = _rand(rng, (3, _LONG), dtype)
    w = _huge_weight(rng, x, dtype)
    x[1, 35000] = float("inf")                      # row 1: inv 0, a NaN block, zeros elsewhere
    qa = F.rmsnorm_quantize(x, w, scope=scope)
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, scope, None, _dt(x), inv), 3, (3,),
               scope)
    sf = _np(qa.sf)
    assert sf[0, 6] == 0x7F and sf[0, 1875] == 0x7F and sf[0, 2559] == 0x7F and sf[0, 5] != 0x7F


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("n", _PREFILL_N)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_prefill_layout(cuda, rng, dtype, n, scope):
    rows = _prefill_rows(cuda, n)
    x = _plant(_rand(rng, (rows, n), dtype, rng.uniform(0.1, 10)))
    w = torch.from_numpy((rng.standard_normal(n) * 0.2 + 1).astype(F32)).cuda()
    qa = F.rmsnorm_quantize(x, w, scope=scope)
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, scope, None, _dt(x), inv),
               rows, (rows,), scope)


@pytest.mark.parametrize("scope", ["row", "none", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_modelopt_edge_rules(cuda, rng, scope, dtype):
    """Weight blocks of +0 and -0 give zero blocks holding signed zeros (the
    signs of x): scale 0x38, codes 0. Weight 2^-20 gives blocks far below
    every row's amax (and below 6 * 2^-10 for gs = 1): scale 0x01, the values
    kept under row / tensor scope."""
    n = 512
    w = (rng.random(n) + 0.5).astype(F32)
    w[:16], w[16:32], w[32:48] = 0.0, -0.0, 2.0 ** -20
    wt = torch.from_numpy(w).cuda()
    x = _rand(rng, (9, n), dtype)
    qa = F.rmsnorm_quantize(x, wt, scope=scope)

    def ref(inv):
        return R.rmsnorm_quantize(_np(x), w, 1e-6, scope, None, _dt(x), inv)
    _check_rms(qa, ref, 9, (9,), scope)
    q, sf, _, _ = ref(None)
    assert (sf[:, :2] == 0x38).all() and not RN.unpack_nibbles(q)[:, :32].any()
    assert (sf[:, 2] == 0x01).all()
    if scope != "none":
        assert (RN.unpack_nibbles(q)[:, 32:48] & 7).any()


# ---- the operator -----------------------------------------------------------------------------------
BF16, U8 = torch.bfloat16, torch.uint8


def test_traced_bad_argument_raises_when_the_operator_runs():
    """The traced branch checks nothing it cannot trace: a bad eps reaches
    the operator, which raises the eager op's error naming it."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: F.rmsnorm_quantize(x, w, 0.0), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="^eps"):
        f(torch.ones(2, 64, dtype=BF16), torch.ones(64))
