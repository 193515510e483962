"""NVFP4 numpy reference and CPU op paths (no GPU): element conversions
checked exhaustively against independent brute-force searches, the encoding
steps of docs/format.md, gather and the scale swizzle."""
from __future__ import annotations

import math

import numpy as np
import pytest

import rawkv
from rawkv.reference import formats as F
from rawkv.reference import layouts as L
from rawkv.reference import nvfp4 as R

E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def all_bf16() -> np.ndarray:
    """Every BF16 bit pattern as float32 (NaNs included)."""
    return (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


def e4m3_positive_values() -> np.ndarray:
    """Values of E4M3 codes 0..0x7E, from the bit layout (independent of formats.py)."""
    out = []
    for c in range(0x7F):
        e, m = c >> 3, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


def brute_nearest_even(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of an increasing table to each a >= 0
    (float64 distances, exact here); ties go to the even index; beyond the
    last entry: the last index (saturation)."""
    d = np.abs(a[:, None] - table[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    idx = np.where(cand.sum(axis=1) > 1, np.argmax(cand & (np.arange(table.size) % 2 == 0), axis=1),
                   np.argmax(cand, axis=1))
    return np.where(a > table[-1], table.size - 1, idx)


# ---- element conversions, exhaustive over BF16 ---------------------------------
def test_e2m1_encode_all_bf16_vs_brute_force():
    x = all_bf16()
    fin = ~np.isnan(x)
    x = x[fin]
    a = np.minimum(np.abs(x.astype(np.float64)), 1e300)
    want = brute_nearest_even(a, E2M1_MAG).astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 3)
    got = F.e2m1_encode(x)
    assert np.array_equal(got, want)


def test_e4m3_encode_all_bf16_vs_brute_force():
    x = all_bf16()
    tab = e4m3_positive_values()
    nan = np.isnan(x)
    a = np.abs(np.where(nan, 0, x).astype(np.float64))
    a = np.where(np.isinf(a), 1e300, a)
    want = brute_nearest_even(a, tab).astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 7)
    want = np.where(nan, np.uint8(0x7F), want)
    assert np.array_equal(F.e4m3_encode(x), want)


def test_e4m3_encode_all_bf16_vs_torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch has no float8_e4m3fn")
    x = all_bf16()
    ok = ~np.isnan(x) & (np.abs(x) <= 448)      # torch does not saturate past 448
    t = torch.from_numpy(x[ok]).to(torch.bfloat16).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(F.e4m3_encode(x[ok]), t)


def test_e4m3_decode_all_bytes():
    vals = F.e4m3_decode(np.arange(256, dtype=np.uint8))
    tab = e4m3_positive_values()
    for c in range(256):
        if c & 0x7F == 0x7F:
            assert np.isnan(vals[c])
        else:
            v = tab[c & 0x7F] * (-1 if c & 0x80 else 1)
            assert vals[c] == v and np.signbit(vals[c]) == bool(c & 0x80)
    torch = pytest.importorskip("torch")
    if hasattr(torch, "float8_e4m3fn"):
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
        assert np.array_equal(vals, t, equal_nan=True)


def test_e2m1_decode_all_codes():
    got = F.e2m1_decode(np.arange(16, dtype=np.uint8))
    for c in range(16):
        assert got[c] == E2M1_MAG[c & 7] * (-1 if c & 8 else 1)
        assert np.signbit(got[c]) == bool(c & 8)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_every_tie_goes_to_even(sign):
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for t, code in ties.items():
        got = int(F.e2m1_encode(np.float32(sign * t)))
        assert got == code | (8 if sign < 0 else 0), t


def test_e4m3_every_tie_goes_to_even():
    tab = e4m3_positive_values()
    mids = (tab[:-1] + tab[1:]) / 2                  # exact in float32
    codes = F.e4m3_encode(mids.astype(np.float32))
    lo = np.arange(len(mids))
    want = np.where(lo % 2 == 0, lo, lo + 1)
    assert np.array_equal(codes, want.astype(np.uint8))
    assert np.array_equal(F.e4m3_encode(-mids.astype(np.float32)), (want | 0x80).astype(np.uint8))
    assert F.e4m3_encode(np.float32(464.0)) == 0x7E     # past the last tie: saturate


# ---- quantize: the steps of the spec -------------------------------------------------
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


TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
TIE_CODES = np.array([0, 2, 2, 4, 4, 6, 6, 7], np.uint8)   # the even neighbour; 6 is bmax


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


# ---- CPU op paths ----------------------------------------------------------------------
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


def test_row_view_refuses_rows_not_16_bytes_apart():
    # _rules.row_view is what quantize runs on CPU and CUDA arrays alike; it
    # only looks at shapes and strides
    torch = pytest.importorskip("torch")
    from rawkv.nvfp4 import _rules
    assert _rules.row_view(torch.zeros(12, 96, dtype=torch.bfloat16)[::2, 32:96], "x") == (6, 64, 192)
    assert _rules.row_view(torch.zeros(4, 20)[:, :16], "x") == (4, 16, 20)          # 80 bytes apart
    assert _rules.row_view(np.zeros((4, 20), np.float32)[:, :16], "x") == (4, 16, 20)
    with pytest.raises(ValueError, match="^x: rows are 36 bytes apart"):
        _rules.row_view(torch.zeros(4, 18, dtype=torch.float16)[:, :16], "x")
    with pytest.raises(ValueError, match="^x: rows are 36 bytes apart"):
        rawkv.nvfp4.quantize(np.zeros((4, 18), np.float16)[:, :16])              # on CPU too
    with pytest.raises(ValueError, match="^x:"):
        _rules.row_view(torch.zeros(2, 24)[:, :20], "x")                           # N % 16


def test_q_alignment_checked_on_cpu_as_on_cuda():
    # the kernels load q 4 bytes at a time: a q view at an odd address is
    # refused by dequantize and gather on CPU tensors as on CUDA ones
    torch = pytest.importorskip("torch")
    buf = torch.zeros(4 * 8 + 4, dtype=torch.uint8)
    sf = torch.zeros(4, 1, dtype=torch.uint8)
    assert buf.data_ptr() % 16 == 0
    for off in (1, 2, 3):
        with pytest.raises(ValueError, match="^q: data must be 4-byte aligned"):
            rawkv.nvfp4.dequantize(buf[off:off + 32].view(4, 8), sf, 1.0)
        with pytest.raises(ValueError, match="^q: data must be 4-byte aligned"):
            rawkv.nvfp4.gather(buf[off:off + 32].view(4, 8), sf, 1.0, torch.tensor([0]))
    y = rawkv.nvfp4.dequantize(buf[4:36].view(4, 8), buf[1:5].view(4, 1), 1.0)   # what the kernel needs
    assert y.shape == (4, 16)


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


def test_bad_arguments_cpu():
    x = np.ones((2, 24), np.float32)
    with pytest.raises(ValueError, match="^x:"):
        rawkv.nvfp4.quantize(x)
    with pytest.raises(ValueError, match="^scope:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), scope="col")
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), scope="given")
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), scope="given", gs=float("nan"))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), gs=1.0)
    with pytest.raises(TypeError, match="^dtype:"):
        rawkv.nvfp4.dequantize(np.zeros((1, 8), np.uint8), np.zeros((1, 1), np.uint8), 1.0, dtype="int8")


# ---- gather ------------------------------------------------------------------------------
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_gather_bad_index_row_is_zeros_and_counted(rng, idx_dtype):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((9, 64)).astype(np.float32)
    q, sf, gs = R.quantize(x, "row")
    idx = np.array([3, -1, 8, 9, 0, 1 << 30, 3], idx_dtype)
    bad = (idx < 0) | (idx >= 9)
    y, nerr = L.gather(q, sf, gs, idx, "float32")
    assert nerr == 3
    full = R.dequantize(q, sf, gs, "float32")
    assert np.array_equal(y[~bad], full[idx[~bad]])
    assert not y[bad].any() and not np.signbit(y[bad]).any()                   # +0.0
    # the op: errors= given is added to; an out= buffer's bad rows become zeros
    err = np.full(1, 5, np.int32)
    out = np.full((7, 64), 7.0, np.float32)
    counts = rawkv.nvfp4.error_counts("cpu")
    before = counts.copy()
    y2 = rawkv.nvfp4.gather(q, sf, gs, idx, dtype="float32", out=out, errors=err)
    assert y2 is out and err[0] == 8 and np.array_equal(out, y)
    errt = torch.zeros(2, dtype=torch.int32)
    rawkv.nvfp4.gather(torch.from_numpy(q), torch.from_numpy(sf), torch.from_numpy(gs),
                       torch.from_numpy(idx), errors=errt)
    assert errt.tolist() == [3, 0]
    assert np.array_equal(counts, before)
    # no errors=: kept in the CPU counter the caller reads
    rawkv.nvfp4.gather(q, sf, gs, idx, dtype="float32")
    assert counts[rawkv.nvfp4.GATHER_INDEX] - before[rawkv.nvfp4.GATHER_INDEX] == 3
    assert counts[rawkv.nvfp4.GIVEN_GS] == before[rawkv.nvfp4.GIVEN_GS]


# ---- swizzle -------------------------------------------------------------------------------
def swizzle_by_reshape(sf: np.ndarray) -> np.ndarray:
    """The block rearrangement written as reshapes (torchao to_blocked /
    cuBLAS 'block scaling factors layout'): pad to (128k, 4l), view as
    (rb, 128, cb, 4) -> (rb, cb, 128, 4) -> (tiles, 4, 32, 4) -> swap the
    4- and 32- axes -> flatten."""
    rows, cols = sf.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    p = np.zeros((pr, pc), np.uint8)
    p[:rows, :cols] = sf
    blocks = p.reshape(pr // 128, 128, pc // 4, 4).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (128, 4), (130, 448), (257, 9), (300, 1)])
def test_swizzle_matches_reshape_formula_and_round_trips(rng, shape):
    sf = rng.integers(0, 256, shape, dtype=np.uint8)
    sw = L.swizzle_scales(sf)
    assert sw.size == L.swizzled_size(*shape)
    assert np.array_equal(sw, swizzle_by_reshape(sf))
    assert np.array_equal(L.unswizzle_scales(sw, *shape), sf)
    assert np.array_equal(rawkv.nvfp4.unswizzle_scales(rawkv.nvfp4.swizzle_scales(sf), shape), sf)


def test_swizzle_known_offsets():
    off = L.swizzle_offsets(256, 8)
    assert off[0, 0] == 0 and off[0, 3] == 3 and off[1, 0] == 16 and off[32, 0] == 4
    assert off[31, 0] == 31 * 16 and off[127, 3] == 31 * 16 + 3 * 4 + 3
    assert off[0, 4] == 512 and off[128, 0] == 1024
