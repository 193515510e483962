"""rawkv.nvfp4.quantize: the reference against the encoding steps of
docs/format.md, the argument rules, the launch plans and the operator (the
GPU bit-exactness tests are in test_quantize_gpu.py, the byte identity with
ModelOpt in test_quantize_modelopt.py, the scopes' plans in test_scopes.py).

The launch-plan tests run the CUDA path on a CPU: CPU tensors that report
is_cuda and a runtime that records launches instead of making them
(tests/nvfp4/conftest.py). Every launch goes through its declaration
(rawkv.kernels.nvfp4), so a wrong keyword, a scalar of the wrong C type or a
missing argument fails there; the tests also check which buffer each pointer
parameter receives."""
from __future__ import annotations

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import formats as F  # noqa: E402
from rawkv.reference import nvfp4 as R  # noqa: E402
from rawkv import _args as A  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
from rawkv.kernels import nvfp4 as K  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.nvfp4 import names  # noqa: E402
from support.properties import (  # noqa: E402
    FLOATS, GS, SETTINGS, _gs, _gs_ref, host, judge, layouts, leads, libs, make, seeds, widths)


# ---- the reference ----------------------------------------------------------------------------------
def spec_gs(values, scope_gs=None):
    """docs/format.md NVFP4 encoding step 1 for one scope's values, with Python scalars
    (independent of R.global_scale): amax over the finite elements, gs =
    amax / 2688 in float32, 1 where that is 0. scope_gs: a given gs."""
    f = np.float32
    if scope_gs is not None:
        return f(scope_gs)
    amax = max((abs(float(a)) for a in np.ravel(values) if math.isfinite(a)), default=0.0)
    with np.errstate(under="ignore"):
        g = f(amax) / f(2688.0)
    return f(1.0) if g == 0 else g


def spec_block(v, gs):
    """docs/format.md NVFP4 encoding steps 2-5 for one block, with Python scalars and
    float32 numpy scalars one operation at a time (independent of R.quantize).
    Step 2 with ModelOpt's scale rule (r == 0 -> 1.0, else clamp to >= 2^-9);
    step 3 as docs/format.md decides: codes only for a positive finite es;
    step 4's sign bit iff the quotient is < 0."""
    f = np.float32
    v = [f(a) for a in v]
    if not all(np.isfinite(a) for a in v):
        return [0] * 16, 0x7F
    bmax = max(abs(a) for a in v)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        r = f(bmax) / (f(gs) * f(6.0))
        sf = 0x38 if r == 0 else int(F.e4m3_encode(f(2.0 ** -9) if r < 2.0 ** -9 else r))
        es = f(F.e4m3_decode(sf)) * f(gs)
        if not (es > 0 and np.isfinite(es)):
            return [0] * 16, sf
        t = [a / es for a in v]
    return [int(F.e2m1_encode(abs(a))) | (8 if a < 0 else 0) for a in t], sf


def test_quantize_matches_blockwise_spec(rng):
    x = (rng.standard_normal((5, 64)) * rng.uniform(0.001, 100, (5, 1))).astype(np.float32)
    x[1, :16] = 0
    x[2, 16] = np.nan
    x[3, 40] = -np.inf
    for scope in R.SCOPES:
        gs_in = 0.0371 if scope == "given" else None
        q, sf, gs = R.quantize(x, scope, gs_in)
        codes = R.unpack_nibbles(q)
        for r in range(5):
            # step 1 computed here, not taken from R.quantize
            if scope == "row":
                g = spec_gs(x[r])
            elif scope == "tensor":
                g = spec_gs(x)
            else:
                g = spec_gs(None, gs_in if scope == "given" else 1.0)
            assert (gs[r] if scope == "row" else gs) == g
            for b in range(4):
                want_c, want_sf = spec_block(x[r, b * 16:(b + 1) * 16], g)
                assert sf[r, b] == want_sf and list(codes[r, b * 16:(b + 1) * 16]) == want_c


@pytest.mark.parametrize("scope", ["tensor", "row"])
def test_tiny_amax_gives_gs_one_and_zero_magnitudes(scope):
    # amax ~1e-43 (float32 subnormal): amax / 2688 underflows to 0, so gs
    # must become 1 (a zero gs would make a zero block's sf 0/0 = NaN).
    # Under gs = 1 the tiny blocks get the smallest scale 2^-9 (0x01), the
    # zero blocks 1.0 (0x38); every magnitude rounds to 0 and the negative
    # value keeps its sign (its quotient -1e-43 * 2^9 is < 0).
    x = np.zeros((3, 32), np.float32)
    x[0, 0] = 1e-43
    x[1, 20] = -1e-43                  # rows 0/1: a tiny block and a zero block
    x[2, :] = 0                        # row 2: all zero (amax == 0)
    assert np.float32(1e-43) / np.float32(2688) == 0
    q, sf, gs = R.quantize(x, scope)
    assert (gs == 1).all() and gs.shape == (() if scope == "tensor" else (3,))
    assert np.array_equal(sf, [[0x01, 0x38], [0x38, 0x01], [0x38, 0x38]])
    codes = R.unpack_nibbles(q)
    assert not (codes & 7).any() and np.array_equal(codes >> 3, (x < 0).astype(np.uint8))
    y = R.dequantize(q, sf, gs, "float32")
    assert np.isfinite(y).all() and not y.any()
    got = rawkv.nvfp4.quantize(x, scope=scope)         # the CPU op path
    assert np.array_equal(got[0], q) and np.array_equal(got[1], sf) and np.array_equal(got[2], gs)


@pytest.mark.parametrize("g", [0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 6e37])
def test_unusable_given_gs_flags_every_block(g):
    """A given gs that given_gs_ok refuses is never used (its sign bit
    included): the reference flags every block (sf 0x7F, codes 0) before
    ModelOpt's scale rules, so the zero blocks get 0x7F, not 0x38, and the
    tiny one (0.01) not the clamp's 0x01; the kernels do the same for a
    device gs; the ops refuse it as a host tensor."""
    torch = pytest.importorskip("torch")
    x = np.zeros((2, 32), np.float32)
    x[0, :16] = np.linspace(-3, 3, 16)
    x[1, 16:] = 0.01
    assert not R.given_gs_ok(g)
    q, sf, gs = R.quantize(x, "given", np.float32(g))
    assert not q.any() and (sf == 0x7F).all()
    assert np.array_equal(gs.view(np.uint32), np.float32(g).view(np.uint32))   # returned as given
    with np.errstate(invalid="ignore"):
        assert np.isnan(R.dequantize(q, sf, gs, "float32")).all()
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(torch.from_numpy(x), scope="given", gs=torch.tensor(g))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=np.array([g], np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_given_gs_bound(dtype):
    """given_gs_limit is the exact float32 bound of the rule: just below it
    the largest finite input of the dtype still gets a non-zero scale and
    code, at it its scale ratio rounds to 0 before ModelOpt's clamp (so
    step 2 would give every block one scale whatever its data); numbers and
    host arrays at the bound are refused, just below accepted, on the op's
    CPU path."""
    torch = pytest.importorskip("torch")
    limit = np.float32(R.given_gs_limit(dtype))
    below = np.nextafter(limit, np.float32(0))
    assert R.given_gs_ok(below, dtype) and not R.given_gs_ok(limit, dtype)
    big = np.float32(R.MAX_FINITE[dtype])
    with np.errstate(over="ignore"):
        assert F.e4m3_encode(big / (limit * np.float32(6))) == 0           # below every E4M3 scale
        assert F.e4m3_encode(big / (below * np.float32(6))) != 0           # a scale of its own
    blk = np.full(16, big, np.float32)
    codes, sf = spec_block(blk, below)
    assert sf != 0 and all(c != 0 for c in codes)
    # documented values (docs/format.md)
    assert float(limit) == {"float16": 11179349.0}.get(dtype, float.fromhex("0x1.555556p+125"))
    # the rule is monotonic: a sample of positive float32s on each side
    for g in np.geomspace(1e-45, float(limit) * 0.999, 50, dtype=np.float32):
        assert R.given_gs_ok(g, dtype)
    for g in np.geomspace(float(limit), 3e38, 20, dtype=np.float32):
        assert not R.given_gs_ok(g, dtype)
    x = torch.ones((2, 16), dtype=getattr(torch, dtype))
    for g in (limit, float(limit), torch.tensor(limit)):
        with pytest.raises(ValueError, match="^gs:"):
            rawkv.nvfp4.quantize(x, scope="given", gs=g)
    for g in (below, float(below), torch.tensor(below)):
        q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=g)
        assert np.array_equal(as_bytes(q), R.quantize(np.ones((2, 16), np.float32), "given", below, dtype)[0])


@pytest.mark.parametrize("g", [1e39, -1e39, 1e-46, 0.0, -0.0, -1.0, float("nan"), float("inf"),
                               np.float64(1e39), np.float32(0.0), np.float32(np.nan), np.int64(0)])
def test_number_gs_checked_as_float32(g):
    x = np.ones((2, 16), np.float32)
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=g)


def as_bytes(t):
    """uint8 numpy bytes of a numpy array or a CPU torch byte tensor."""
    if isinstance(t, np.ndarray):
        return t
    import torch
    return t.view(torch.uint8).numpy()


def test_number_gs_bool_refused_and_numpy_scalars_accepted():
    torch = pytest.importorskip("torch")
    x = np.linspace(-5, 5, 32, dtype=np.float32).reshape(2, 16)
    for b in (True, np.bool_(True)):
        with pytest.raises(TypeError, match="^gs:"):
            rawkv.nvfp4.quantize(x, scope="given", gs=b)
    want = R.quantize(x, "given", np.float32(0.1))
    for g in (np.float32(0.1), float(np.float32(0.1)), np.float64(np.float32(0.1))):
        for xs in (x, torch.from_numpy(x)):
            q, sf, gs = rawkv.nvfp4.quantize(xs, scope="given", gs=g)
            q, sf = as_bytes(q), as_bytes(sf)
            assert np.array_equal(q, want[0]) and np.array_equal(sf, want[1])
            assert np.asarray(gs, np.float32) == np.float32(0.1)
    # 1e-45 is a float32 (the smallest subnormal): accepted
    assert R.quantize(x, "given", np.float32(1e-45))[2] == rawkv.nvfp4.quantize(x, scope="given", gs=1e-45)[2]
    # decode gs as numpy scalars too
    y = rawkv.nvfp4.dequantize(want[0], want[1], np.float32(0.1), dtype="float32")
    assert np.array_equal(y, R.dequantize(want[0], want[1], np.float32(0.1), "float32"))
    y = rawkv.nvfp4.gather(want[0], want[1], np.float32(0.1), np.array([1, 0], np.int32), dtype="float32")
    assert np.array_equal(y, R.dequantize(want[0], want[1], np.float32(0.1), "float32")[::-1])


TIE_CODES = np.array([0, 2, 2, 4, 4, 6, 6, 7], np.uint8)   # the even neighbour; 6 is bmax


TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])


def tie_blocks(scales):
    """One 16-block per E4M3 value s in `scales`: [+-t * s for t in TIES]
    (times gs, by the caller); bmax = 6 * s * gs, so sf = s exactly and
    x / es = +-t exactly, an E2M1 tie for every t but 6. t and s have at most
    3 significant bits and gs at most 2, so every value is exact in BF16
    (8 bits) and FP16."""
    t = np.concatenate([TIES, -TIES])
    return np.stack([t * s for s in scales]).astype(np.float32)


TIE_SCALES = [1.0, 0.5, 1.5, 0.875, 3.5, 448.0, 2.0 ** -9, 7 * 2.0 ** -9]   # E4M3 values


@pytest.mark.parametrize("gs", [None, 0.375, 1.25])      # given gs: es is not a power of two
def test_quantize_ties_go_to_even(gs):
    x = tie_blocks(TIE_SCALES) * np.float32(gs if gs else 1.0)
    # exact in BF16 and FP16 (the GPU test sends these through 16-bit inputs)
    assert np.array_equal(F.round_to_dtype(x, "bfloat16"), x)
    assert np.array_equal(x.astype(np.float16).astype(np.float32), x)
    q, sf, _ = R.quantize(x, "none" if gs is None else "given", gs)
    assert np.array_equal(F.e4m3_decode(sf[:, 0]), np.float32(TIE_SCALES))
    want = np.concatenate([TIE_CODES, TIE_CODES | 8])
    assert (R.unpack_nibbles(q) == want).all()


def test_quantize_scopes_and_gs():
    x = np.array([[0, 1, -2, 3] * 4, [0, 10, 0, 0] * 4], np.float32)
    _, _, gs = R.quantize(x, "tensor")
    assert gs == np.float32(10) / np.float32(2688)
    _, _, gs = R.quantize(x, "row")
    assert gs.shape == (2,) and gs[0] == np.float32(3) / np.float32(2688)
    _, _, gs = R.quantize(np.zeros((2, 16), np.float32), "tensor")
    assert gs == 1.0
    _, _, gs = R.quantize(x, "none")
    assert gs == 1.0
    # NaN / Inf never enter amax
    y = x.copy(); y[0, 0] = np.inf; y[1, 0] = np.nan
    assert R.quantize(y, "tensor")[2] == np.float32(10) / np.float32(2688)


def test_quantize_extremes():
    g = np.float32(1.0)
    x = np.zeros((1, 48), np.float32)
    x[0, 0] = 448 * 6                            # full range: sf 448 (0x7E), code 6 (7)
    x[0, 16] = 1e-2                              # tiny block: E4M3-subnormal scale
    x[0, 32:48] = 2.6 * 0.5                      # double rounding gives 2; RNE gives 3
    x[0, 33] = 6 * 0.5
    q, sf, _ = R.quantize(x, "given", g)
    codes = R.unpack_nibbles(q)[0]
    assert sf[0, 0] == 0x7E and codes[0] == 7
    assert 0 < sf[0, 1] < 8                      # subnormal E4M3 scale
    assert sf[0, 2] == 0x30 and codes[32] == 5   # es = 0.5: 1.3/0.5 = 2.6 -> 3 (index 5)
    y = R.dequantize(q, sf, g, "float32")
    assert y[0, 0] == 448 * 6


def test_quantize_nan_inf_blocks_flagged():
    x = np.ones((2, 32), np.float32)
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    q, sf, gs = R.quantize(x, "tensor")
    assert sf[0, 0] == 0x7F and sf[1, 1] == 0x7F and sf[0, 1] != 0x7F
    codes = R.unpack_nibbles(q)
    assert not codes[0, :16].any() and not codes[1, 16:].any()
    y = R.dequantize(q, sf, gs, "bfloat16")
    assert np.isnan(y[0, :16]).all() and np.isfinite(y[0, 16:]).all()


def test_roundtrip_error_bound(rng):
    x = rng.standard_normal((7, 7168)).astype(np.float32)
    for scope in ("tensor", "row", "none"):
        q, sf, gs = R.quantize(x, scope)
        y = R.dequantize(q, sf, gs, "float32")
        es = (F.e4m3_decode(sf) * (gs[:, None] if np.ndim(gs) else gs)).astype(np.float32)
        # each element is within half an E2M1 step (<= 1 * es) of the input
        err = np.abs(y - x).reshape(7, -1, 16).max(-1)
        assert (err <= es * 1.0 + 1e-30).all()


def test_ops_numpy_and_torch_cpu(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((3, 5, 32)).astype(np.float32)
    q, sf, gs = rawkv.nvfp4.quantize(x)
    rq, rsf, rgs = R.quantize(x, "tensor")
    assert np.array_equal(q, rq) and np.array_equal(sf, rsf) and gs == rgs
    xt = torch.from_numpy(x).to(torch.bfloat16)
    q2, sf2, gs2 = rawkv.nvfp4.quantize(xt, scope="row")
    rq, rsf, rgs = R.quantize(xt.float().numpy(), "row")
    assert q2.dtype == torch.float4_e2m1fn_x2 and sf2.dtype == torch.float8_e4m3fn
    assert np.array_equal(q2.view(torch.uint8).numpy(), rq) and np.array_equal(gs2.numpy(), rgs)
    y = rawkv.nvfp4.dequantize(q2, sf2, gs2)
    assert y.dtype == torch.bfloat16
    assert np.array_equal(y.float().numpy(), R.dequantize(rq, rsf, rgs, "bfloat16"))
    outs = (torch.empty(3, 5, 16, dtype=torch.uint8), torch.empty(3, 5, 2, dtype=torch.uint8),
            torch.empty((), dtype=torch.float32))
    res = rawkv.nvfp4.quantize(xt, scope="given", gs=0.01, out=outs)
    assert res[0].data_ptr() == outs[0].data_ptr() and float(outs[2]) == np.float32(0.01)
    assert rawkv.nvfp4.quantize(xt)[2].shape == ()


nv = rawkv.nvfp4


def test_quantize_scope_none_is_the_documented_default():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    for a, b in ((nv.quantize(x, scope=None), R.quantize(x, "tensor")),
                 (nv.quantize(x, scope=None, gs=0.01), R.quantize(x, "given", 0.01))):
        assert all(np.array_equal(u, v) for u, v in zip(a, b))


# ---- argument errors --------------------------------------------------------------------------------
SCOPES = ("tensor", "row", "given", "none")


@pytest.mark.parametrize("default", ["tensor", "row"])
def test_scope_gs_parser(default):
    assert A.check_scope_gs(None, None, SCOPES, default) == (default, None)
    assert A.check_scope_gs(None, 0.5, SCOPES, default) == ("given", 0.5)
    assert A.check_scope_gs("none", None, SCOPES, default) == ("none", None)
    scope, g = A.check_scope_gs("given", np.float32(0.25), SCOPES, default)
    assert scope == "given" and g == 0.25 and type(g) is float
    arr = np.ones((1, 1), np.float32)
    assert A.check_scope_gs("given", arr, SCOPES, default)[1] is arr
    with pytest.raises(ValueError, match="^scope:"):
        A.check_scope_gs("col", None, SCOPES, default)
    with pytest.raises(ValueError, match="^gs:"):
        A.check_scope_gs("given", None, SCOPES, default)
    with pytest.raises(ValueError, match="^gs:"):
        A.check_scope_gs("row", 1.0, SCOPES, default)
    with pytest.raises(ValueError, match="^gs:"):
        A.check_scope_gs("given", np.ones(2, np.float32), SCOPES, default)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-46):
        with pytest.raises(ValueError, match="^gs:"):
            A.check_scope_gs("given", bad, SCOPES, default)
    for bad in (True, np.bool_(False), "0.5", b"x"):
        with pytest.raises(TypeError, match="^gs:"):
            A.check_scope_gs("given", bad, SCOPES, default)


def test_rows_refuses_rows_not_16_bytes_apart():
    # _args.rows is what quantize runs on CPU and CUDA arrays alike; it
    # only looks at shapes and strides
    torch = pytest.importorskip("torch")

    def rows(x):
        return A.rows(x, "x", A.FLOATS, "cpu")[1:]
    assert rows(torch.zeros(12, 96, dtype=torch.bfloat16)[::2, 32:96]) == (6, 64, 192)
    assert rows(torch.zeros(4, 20)[:, :16]) == (4, 16, 20)          # 80 bytes apart
    assert rows(np.zeros((4, 20), np.float32)[:, :16]) == (4, 16, 20)
    with pytest.raises(ValueError, match="^x: rows are 36 bytes apart"):
        rows(torch.zeros(4, 18, dtype=torch.float16)[:, :16])
    with pytest.raises(ValueError, match="^x: rows are 36 bytes apart"):
        rawkv.nvfp4.quantize(np.zeros((4, 18), np.float16)[:, :16])              # on CPU too
    with pytest.raises(ValueError, match="^x: the last dimension"):
        rawkv.nvfp4.quantize(torch.zeros(2, 24)[:, :20])                         # N % 16: the format's


@pytest.mark.parametrize("bad", ["q_shape", "q_dtype", "sf_shape", "sf_dtype", "gs_shape", "gs_dtype"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_quantize_cpu_out_checked_before_any_write(bad, lib):
    torch = pytest.importorskip("torch")
    x = np.ones((4, 64), np.float32)
    shapes = {"q": (4, 32), "sf": (4, 4), "gs": ()}
    dtypes = {"q": np.uint8, "sf": np.uint8, "gs": np.float32}
    part, what = bad.split("_")
    if what == "shape":
        shapes[part] = (4, 3) if part != "gs" else (4,)
    else:
        dtypes[part] = np.float32 if part != "gs" else np.float64
    outs = [np.full(shapes[k], 0xAB if dtypes[k] == np.uint8 else 5.0, dtypes[k]) for k in ("q", "sf", "gs")]
    if lib == "torch":
        outs = [torch.from_numpy(o) for o in outs]
        x = torch.from_numpy(x)
    before = [o.numpy().copy() if lib == "torch" else o.copy() for o in outs]
    name = f"out[{['q', 'sf', 'gs'].index(part)}]"
    with pytest.raises(ValueError if what == "shape" else TypeError, match="^" + name.replace("[", r"\[")):
        rawkv.nvfp4.quantize(x, out=tuple(outs))
    for o, b in zip(outs, before):
        assert np.array_equal(o.numpy() if lib == "torch" else o, b)     # nothing written


@SETTINGS
@given(seed=seeds, lead=leads, n=widths, dt=st.sampled_from(FLOATS + ("float64", "int32")), lib=libs,
       layout=layouts, special=st.booleans(),
       scope=st.sampled_from([None, "tensor", "row", "given", "none", "rows"]), gs=st.sampled_from(GS))
def test_nvfp4_quantize(seed, lead, n, dt, lib, layout, special, scope, gs):
    x = make(seed, (*lead, n), dt, lib, layout, special)
    g = _gs(gs, seed, lib)

    def reference():
        sc = scope or ("given" if g is not None else "tensor")
        return RN.quantize(host(x).astype(np.float32), sc, _gs_ref(g) if sc == "given" else None, dt)
    judge(lambda: rawkv.nvfp4.quantize(x, scope=scope, gs=g), ("x", "scope", "gs"), reference)


# ---- launch plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [32, 48])
def test_quantize_scopes(rt, dtype, n):
    ct = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}[dtype]
    bpt = 2 if n % 32 == 0 else 1
    x = fake(torch.ones(3, n, dtype=dtype))
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row")
    (name, _, _, a), = rt.calls
    assert name == f"rkv_nvfp4_quantize_rows<{ct}, {bpt}, 1>"
    assert (a["x"], a["q"], a["sf"], a["gs_out"]) == (x.data_ptr(), q.data_ptr(), sf.data_ptr(), gs.data_ptr())
    assert (a["M"], a["upr"], a["ldx"]) == (3, n // (16 * bpt), n) and gs.shape == (3,)

    rt.calls.clear()
    q, sf, gs = rawkv.nvfp4.quantize(x)                               # small: one launch
    (name, grid, block, a), = rt.calls
    assert name == f"rkv_nvfp4_quantize_small<{ct}, {bpt}>" and a["gs_out"] == gs.data_ptr()

    rt.calls.clear()
    big = fake(torch.ones(rawkv.nvfp4.SMALL_NUMEL // n + 1, n, dtype=dtype))
    q, sf, gs = rawkv.nvfp4.quantize(big)
    assert names(rt) == ["memset", f"rkv_nvfp4_amax<{ct}>", f"rkv_nvfp4_quantize<{ct}, {bpt}, {K.MODE_AMAX}>",
                         "rkv_nvfp4_finalize_gs"]
    g = gs.data_ptr()
    assert rt.calls[0][1:] == (g, 0, 4)
    assert rt.calls[1][3]["amax_bits"] == g
    assert rt.calls[2][3]["gs_ptr"] == g and rt.calls[2][3]["gs_out"] == 0 and rt.calls[2][3]["errors"] == 0
    assert rt.calls[3][3] == {"gs": g}

    rt.calls.clear()
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=np.float32(0.25))
    (name, _, _, a), = rt.calls
    assert name == f"rkv_nvfp4_quantize<{ct}, {bpt}, {K.MODE_GIVEN}>"
    assert (a["gs_ptr"], a["gs_val"], a["gs_out"], a["errors"]) == (0, 0.25, gs.data_ptr(), 0)

    rt.calls.clear()
    gdev = fake(torch.full((1,), 0.5))
    counter = rt._counters.data_ptr()
    for ogs in (None, fake(torch.zeros(()))):
        q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=gdev, out=(None, None, ogs))
        a = rt.calls[-1][3]
        assert a["gs_ptr"] == gdev.data_ptr() and a["errors"] == counter + 4 * rawkv.nvfp4.GIVEN_GS
        if ogs is None:
            assert gs.data_ptr() == gdev.data_ptr() and a["gs_out"] == 0     # the given tensor is gs
        else:
            assert gs is ogs and a["gs_out"] == ogs.data_ptr()
    rt.calls.clear()
    rawkv.nvfp4.quantize(x, scope="none")
    assert rt.calls[0][3]["gs_val"] == 1.0 and rt.calls[0][3]["gs_ptr"] == 0


def test_quantize_errors_counter(rt):
    """errors= takes the place of the device counter for a device gs; the
    operator passes its buffers, the given gs is the gs (no gs_out)."""
    import rawkv.library  # noqa: F401  (registers torch.ops.rawkv)
    x = fake(torch.ones(2, 32))
    gdev = fake(torch.full((1,), 0.5))
    err = fake(torch.zeros(1, dtype=torch.int32))
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=gdev, errors=err)
    assert rt.calls[-1][3]["errors"] == err.data_ptr() and gs.data_ptr() == gdev.data_ptr()
    rawkv.nvfp4.quantize(x, scope="given", gs=0.5, errors=err)       # a number: checked on the host
    assert rt.calls[-1][3]["errors"] == 0
    qb, sfb = fake(torch.empty(2, 16, dtype=torch.uint8)), fake(torch.empty(2, 2, dtype=torch.uint8))
    torch.ops.rawkv.nvfp4_quantize(x, "given", gdev, None, qb, sfb, None, err)
    a = rt.calls[-1][3]
    assert (a["q"], a["sf"], a["gs_ptr"], a["gs_out"], a["errors"]) == (
        qb.data_ptr(), sfb.data_ptr(), gdev.data_ptr(), 0, err.data_ptr())
    n = len(rt.calls)
    for bad, exc in ((err.long(), TypeError), (fake(torch.zeros(0, dtype=torch.int32)), ValueError)):
        with pytest.raises(exc, match="^errors:"):
            rawkv.nvfp4.quantize(x, scope="given", gs=gdev, errors=bad)
    assert len(rt.calls) == n


def test_quantize_checks_the_format_last(rt):
    """Each array's own rules (the argument layer's) come before the
    format's (N % 16, a given gs's bound: the reference's), on CPU and CUDA
    alike: an x of 24 columns with an out q of the wrong dtype is refused
    for q."""
    for wrap in (lambda t: t, fake):
        x, q = wrap(torch.ones(2, 24)), wrap(torch.empty(2, 12, dtype=torch.float16))
        with pytest.raises(TypeError, match=r"^out\[0\]: dtype float16"):
            rawkv.nvfp4.quantize(x, out=(q, None, None))
        with pytest.raises(TypeError, match=r"^out\[0\]: dtype float16"):
            rawkv.nvfp4.quantize(wrap(torch.ones(2, 32)), scope="given", gs=1e38, out=(q, None, None))
        with pytest.raises(ValueError, match="^x: the last dimension"):
            rawkv.nvfp4.quantize(x)
        with pytest.raises(ValueError, match=r"^gs: 1e\+38 is too large for float32 input"):
            rawkv.nvfp4.quantize(wrap(torch.ones(2, 32)), scope="given", gs=1e38)
    assert rt.calls == []


def test_quantize_of_no_elements_writes_gs_alone(rt):
    """No element: no kernel and no counter; the plan's one Fill writes gs
    (the runtime's buffers start as 7s)."""
    for scope, gs, want in (("tensor", None, 1.0), ("given", 0.25, 0.25), ("row", None, 1.0)):
        q, sf, g = rawkv.nvfp4.quantize(fake(torch.ones(0, 32)), scope=scope, gs=gs)
        assert g.shape == ((0,) if scope == "row" else ()) and (g == want).all()
    _, _, g = rawkv.nvfp4.quantize(fake(torch.ones(3, 0)), scope="row")
    assert g.tolist() == [1.0, 1.0, 1.0]
    _, _, g = rawkv.nvfp4.quantize(fake(torch.ones(0, 32)), scope="given", gs=fake(torch.full((1,), 0.5)),
                                   out=(None, None, fake(torch.zeros(()))))
    assert float(g) == 0.5
    assert rt.calls == []


def test_quantize_long_rows_and_views(rt):
    x = fake(torch.ones(2, 16 * 2 * (K.MAX_BLOCK_THREADS + 1)))         # upr > MAX_BLOCK_THREADS: R = 0
    rawkv.nvfp4.quantize(x, scope="row")
    assert rt.calls[0][0] == "rkv_nvfp4_quantize_rows<float, 2, 0>"
    rt.calls.clear()
    base = fake(torch.ones(12, 96, dtype=torch.bfloat16))
    v = base[::2, 32:96]
    rawkv.nvfp4.quantize(v, scope="none")
    a = rt.calls[0][3]
    assert a["x"] == v.data_ptr() and a["ldx"] == 192 and a["M"] == 6


def test_quantize_refuses_unusable_numbers_before_launching(rt):
    x = fake(torch.ones(2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=2e7)               # the float16 bound
    rawkv.nvfp4.quantize(x.float(), scope="given", gs=2e7)         # usable for float32
    assert len(rt.calls) == 1
