"""NVFP4 numpy reference and CPU op paths (no GPU): element conversions
checked exhaustively against independent brute-force searches, the encoding
steps of docs/format.md, gather and the scale swizzle."""
from __future__ import annotations

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
def spec_block(v, gs):
    """Spec section 2 steps 2-5 for one block, written with Python scalars and
    float32 numpy scalars one operation at a time (independent of R.quantize)."""
    f = np.float32
    v = [f(a) for a in v]
    if not all(np.isfinite(a) for a in v):
        return [0] * 16, 0x7F
    bmax = max(abs(a) for a in v)
    sf = int(F.e4m3_encode(f(bmax) / (f(gs) * f(6.0))))
    es = f(F.e4m3_decode(sf)) * f(gs)
    if es == 0:
        return [0] * 16, sf
    return [int(F.e2m1_encode(a / es)) for a in v], sf


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
            g = gs[r] if scope == "row" else gs
            for b in range(4):
                want_c, want_sf = spec_block(x[r, b * 16:(b + 1) * 16], g)
                assert sf[r, b] == want_sf and list(codes[r, b * 16:(b + 1) * 16]) == want_c


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
    x[0, 32:48] = 2.6 * 0.5                      # seed 001 rounded 2.6 to 2; RNE gives 3
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
def test_gather_reference_skips_and_counts(rng, idx_dtype):
    x = rng.standard_normal((9, 64)).astype(np.float32)
    q, sf, gs = R.quantize(x, "row")
    idx = np.array([3, -1, 8, 9, 0, 1 << 30, 3], idx_dtype)
    out = np.full((7, 64), 7.0, np.float32)
    y, nerr = L.gather(q, sf, gs, idx, "float32", out=out)
    assert nerr == 3
    full = R.dequantize(q, sf, gs, "float32")
    for o, i in enumerate(idx):
        assert np.array_equal(y[o], full[i]) if 0 <= i < 9 else (y[o] == 7.0).all()
    err = np.zeros(1, np.int32)
    y2 = rawkv.nvfp4.gather(q, sf, gs, idx, dtype="float32", errors=err)
    assert err[0] == 3 and (y2[1] == 0).all() and np.array_equal(y2[0], full[3])


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
