"""The numpy reference of the compressor's parts (rawkv/reference/kvcache/,
docs/kvcache.md): HCA / CSA pooling against float64, the CSA overlap and
first window, RMSNorm, RoPE (interleaved pairs, YaRN), the Hadamard
transform, the FP8 entry and the NVFP4 indexer key against brute force.
The composed ops: tests/kvcache/test_compress_prefill.py, test_compress_decode.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rawkv.reference import kvcache as ref
from rawkv.reference.formats import E2M1_VALUES, bf16_round, e4m3_decode
from support.kvcache import F32, F64, _bits, _csa_rows_f64, _pool_f64, _random_rows


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------
def test_hca_pooling_matches_float64(rng):
    m, d = ref.HCA_RATIO, 64
    T = 3 * m + int(rng.integers(0, m))
    kv, z = _random_rows(rng, T, d), _random_rows(rng, T, d, 3.0)
    ape = _random_rows(rng, m, d)
    got = ref.compress_hca(kv, z, ape)
    assert got.shape == (3, d) and got.dtype == F32
    zz = z.astype(F64) + ape.astype(F64)[np.arange(T) % m]
    for i in range(3):
        want = _pool_f64(kv[i * m:(i + 1) * m], zz[i * m:(i + 1) * m])
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-6)


def test_csa_pooling_matches_float64(rng):
    m, d = ref.CSA_RATIO, ref.HEAD_DIM
    n = int(rng.integers(2, 12))
    T = n * m + int(rng.integers(0, m))
    kv, z = _random_rows(rng, T, 2 * d), _random_rows(rng, T, 2 * d, 3.0)
    ape = _random_rows(rng, m, 2 * d)
    got = ref.compress_csa(kv, z, ape)
    assert got.shape == (n, d)
    zz = z.astype(F64) + ape.astype(F64)[np.arange(T) % m]
    for i in range(n):
        vals, scs = _csa_rows_f64(kv.astype(F64), zz, i, m, d)
        np.testing.assert_allclose(got[i], _pool_f64(vals, scs), rtol=2e-5, atol=2e-6)


def test_pooled_entry_is_a_convex_combination(rng):
    # softmax weights are positive and sum to 1: each channel lies between the
    # min and max of the pooled values (a real bound, not a tautology).
    m, d, n = 4, 32, 6
    kv, z = _random_rows(rng, n * m, 2 * d), _random_rows(rng, n * m, 2 * d, 5.0)
    got = ref.compress_csa(kv, z)
    for i in range(n):
        vals, _ = _csa_rows_f64(kv.astype(F64), z.astype(F64), i, m, d)
        assert np.all(got[i] >= vals.min(0) - 1e-6) and np.all(got[i] <= vals.max(0) + 1e-6)


def test_csa_overlap_dependencies(rng):
    m, d, n = 4, 64, 5
    kv, z = _random_rows(rng, n * m, 2 * d), _random_rows(rng, n * m, 2 * d)
    base = ref.compress_csa(kv, z)
    i = int(rng.integers(1, n))
    prev = slice((i - 1) * m, i * m)
    # the a-half of window i-1 feeds entry i-1 only
    kv2, z2 = kv.copy(), z.copy()
    kv2[prev, d:] += 1.0
    z2[prev, d:] += 2.0
    out = ref.compress_csa(kv2, z2)
    assert np.array_equal(out[i], base[i])
    assert not np.allclose(out[i - 1], base[i - 1])
    # the b-half of window i-1 feeds entry i only
    kv3, z3 = kv.copy(), z.copy()
    kv3[prev, :d] += 1.0
    z3[prev, :d] += 2.0
    out = ref.compress_csa(kv3, z3)
    assert np.array_equal(out[i - 1], base[i - 1])
    assert not np.allclose(out[i], base[i])
    # the b-half of the last window feeds no finished entry
    kv4 = kv.copy()
    kv4[(n - 1) * m:, :d] = 1e6
    assert np.array_equal(ref.compress_csa(kv4, z), base)


def test_csa_first_window_is_masked(rng):
    m, d = 4, 128
    kv, z = _random_rows(rng, 3 * m, 2 * d), _random_rows(rng, 3 * m, 2 * d)
    ape = _random_rows(rng, m, 2 * d)
    got = ref.compress_csa(kv, z, ape)
    # entry 0 pools only the a-half of window 0: exactly the one-stream pooling
    only_a = ref.compress_hca(kv[:m, d:], z[:m, d:], ape[:, d:], m=m)
    assert np.array_equal(got[0], only_a[0])
    # huge gate on the b-half of window 0 must not leak into entry 0
    z2 = z.copy()
    z2[:m, :d] = 80.0
    assert np.array_equal(ref.compress_csa(kv, z2, ape)[0], got[0])


def test_partial_window_not_pooled_and_bad_shapes(rng):
    kv, z = _random_rows(rng, 3, 16), _random_rows(rng, 3, 16)
    assert ref.compress_csa(kv, z).shape == (0, 8)
    with pytest.raises(ValueError, match="z"):
        ref.compress_csa(kv, z[:, :8])
    with pytest.raises(ValueError, match="ape"):
        ref.compress_hca(_random_rows(rng, 8, 16), _random_rows(rng, 8, 16), ape=np.zeros((3, 16)), m=4)
    with pytest.raises(TypeError, match="kv"):
        ref.compress_hca(np.zeros((4, 4), bool), np.zeros((4, 4)), m=4)


# ---------------------------------------------------------------------------
# RMSNorm, RoPE, Hadamard
# ---------------------------------------------------------------------------
def test_rmsnorm(rng):
    x = _random_rows(rng, 7, 512, 3.0)
    w = (1 + 0.1 * rng.standard_normal(512)).astype(F32)
    got = ref.rmsnorm(x, w)
    x64 = x.astype(F64)
    want = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    ones = ref.rmsnorm(x, np.ones(512, F32))
    np.testing.assert_allclose(np.mean(ones.astype(F64) ** 2, -1), 1.0, rtol=1e-5)
    assert np.array_equal(ref.rmsnorm(np.zeros((2, 512), F32), w), np.zeros((2, 512), F32))
    # eps matters for small rows: mean(x^2) = 1e-6 halves the squared norm
    small = np.full((1, 512), 1e-3, F32)
    np.testing.assert_allclose(ref.rmsnorm(small, np.ones(512, F32)), 1e-3 / math.sqrt(2e-6), rtol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        ref.rmsnorm(x, w[:100])


def test_rope_position_zero_is_identity_and_nope_untouched(rng):
    x = _random_rows(rng, 5, 512)
    assert np.array_equal(ref.apply_rope(x, np.zeros(5, np.int64)), x)
    y = ref.apply_rope(x, rng.integers(0, 1 << 20, 5))
    assert np.array_equal(y[:, :448], x[:, :448])
    assert not np.allclose(y[:, 448:], x[:, 448:])


def test_rope_preserves_pair_norms_and_composes(rng):
    x = _random_rows(rng, 9, 512)
    p = rng.integers(0, 5000, 9)
    q = rng.integers(0, 5000, 9)
    y = ref.apply_rope(x, p)
    norms = lambda a: np.hypot(a[:, 448::2].astype(F64), a[:, 449::2].astype(F64))  # noqa: E731
    np.testing.assert_allclose(norms(y), norms(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ref.apply_rope(y, q), ref.apply_rope(x, p + q), rtol=0, atol=2e-5)


def test_rope_is_interleaved_pairs(rng):
    p = int(rng.integers(1, 1000))
    x = np.zeros((1, 512), F32)
    x[0, 448] = 1.0                          # first RoPE pair, even element
    y = ref.apply_rope(x, np.array([p]))
    # inv_freq[0] == 1: pair (448, 449) turns by p radians
    np.testing.assert_allclose(y[0, 448:450], [math.cos(p), math.sin(p)], atol=1e-6)
    assert np.count_nonzero(y[0, 450:]) == 0     # half-split RoPE would write dim 480


def test_rope_yarn_frequencies():
    plain = ref.rope_inv_freq(yarn=None).astype(F64)
    np.testing.assert_allclose(plain, 160000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-7)
    yarn = ref.rope_inv_freq().astype(F64)
    # DSV4: correction range [15, 25] for dim 64, base 160000, 65536 tokens
    np.testing.assert_allclose(yarn[:15], plain[:15], rtol=1e-7)
    np.testing.assert_allclose(yarn[25:], plain[25:] / 16, rtol=1e-7)
    mid = slice(16, 25)
    assert np.all(yarn[mid] < plain[mid]) and np.all(yarn[mid] > plain[mid] / 16)


def test_hadamard(rng):
    h = ref.hadamard_matrix(128)
    assert np.array_equal(h @ h.T, 128 * np.eye(128))
    assert np.array_equal(h[:64, :64], ref.hadamard_matrix(64))
    assert np.array_equal(h[64:, 64:], -ref.hadamard_matrix(64))       # Sylvester order
    x = _random_rows(rng, 6, 128)
    y = ref.hadamard_rotate(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(ref.hadamard_rotate(y), x, atol=2e-6)
    e0 = np.zeros(128, F32)
    e0[0] = 1
    np.testing.assert_allclose(ref.hadamard_rotate(e0), np.full(128, 128 ** -0.5), rtol=1e-7)
    with pytest.raises(ValueError):
        ref.hadamard_matrix(96)


# ---------------------------------------------------------------------------
# the FP8 entry
# ---------------------------------------------------------------------------
def _nearest_even(mags: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Index into `mags` (ascending, non-negative) nearest to |v|; ties go to
    the even index; values past the end saturate."""
    dist = np.abs(mags[None, :].astype(F64) - np.abs(v.astype(F64))[:, None])
    cand = dist == dist.min(1, keepdims=True)
    pref = np.where(cand, np.arange(mags.size)[None, :] & 1, 2)
    return np.argmin(pref, axis=1)


def _e4m3_brute(v):
    mags = e4m3_decode(np.arange(0x7F, dtype=np.uint8))     # 0 .. 448, ascending
    idx = _nearest_even(mags, v.ravel())
    return (idx | (np.signbit(v.ravel()) << 7)).astype(np.uint8).reshape(v.shape)


def test_fp8_entry_round_trip_bound(rng):
    n = 64
    mag = np.exp(rng.uniform(-12, 8, (n, 1)))             # entries of very different size
    x = (rng.standard_normal((n, 512)) * mag).astype(F32)
    x[:, :448][rng.random((n, 448)) < 0.05] = 0.0
    codes, s, rope = ref.fp8_entry_quantize(x)
    assert codes.shape == (n, 448) and codes.dtype == np.uint8
    assert s.shape == (n,) and s.dtype == F32
    amax = np.abs(x[:, :448]).max(1)
    assert np.array_equal(s, amax / F32(448.0))
    # codes are the RNE E4M3 of x / s (float32 division), by brute force
    assert np.array_equal(codes, _e4m3_brute(x[:, :448] / s[:, None]))
    y = ref.fp8_entry_dequantize(codes, s, rope, dtype="float32")
    err = np.abs(y[:, :448].astype(F64) - x[:, :448])
    bound = 2.0 ** -4 * np.abs(x[:, :448]) + 2.0 ** -10 * s[:, None] + 2.0 ** -22 * np.abs(x[:, :448])
    assert np.all(err <= bound)
    assert np.array_equal(rope, bf16_round(x[:, 448:]))
    assert np.all(np.abs(y[:, 448:] - x[:, 448:]) <= 2.0 ** -8 * np.abs(x[:, 448:]))
    yb = ref.fp8_entry_dequantize(codes, s, rope)
    assert np.array_equal(yb, bf16_round(y))


def test_fp8_entry_exact_for_representable_inputs(rng):
    n = 16
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = rng.choice(finite, (n, 448))
    codes[np.arange(n), rng.integers(0, 448, n)] = 0x7E | (rng.integers(0, 2, n) << 7).astype(np.uint8)
    scale = (2.0 ** rng.integers(-20, 10, n)).astype(F32)      # amax = 448 * 2^k
    rope = bf16_round(_random_rows(rng, n, 64))
    x = np.concatenate([e4m3_decode(codes) * scale[:, None], rope], axis=1)
    q, s, r = ref.fp8_entry_quantize(x)
    assert np.array_equal(s, scale)
    assert np.array_equal(q, codes)
    assert np.array_equal(_bits(ref.fp8_entry_dequantize(q, s, r, "float32")), _bits(x))


def test_fp8_entry_zero_and_nonfinite(rng):
    x = np.zeros((3, 512), F32)
    x[1, 448:] = _random_rows(rng, 1, 64)[0]                    # zero non-RoPE part, RoPE set
    x[2, 5] = np.nan
    x[2, 448] = 3.0
    codes, s, rope = ref.fp8_entry_quantize(x)
    assert s[0] == 1.0 and s[1] == 1.0 and np.isnan(s[2])
    assert np.count_nonzero(codes) == 0
    y = ref.fp8_entry_dequantize(codes, s, rope)
    assert np.array_equal(y[:2, :448], np.zeros((2, 448)))
    assert np.all(np.isnan(y[2, :448])) and y[2, 448] == 3.0
    x[2, 5] = -np.inf
    assert np.isnan(ref.fp8_entry_quantize(x)[1][2])


def test_fp8_entry_scale_that_underflows_is_one(rng):
    """amax ~1e-44 (a float32 subnormal): amax / 448 rounds to 0, so the scale
    is 1 rather than 0 (a 0 scale would turn x / s into Inf/NaN and decode to
    NaN or 0 * Inf). Codes are e4m3(x / 1) = 0 and the entry decodes to
    finite (signed) zeros: the true values are far below E4M3's 2^-9."""
    x = np.zeros((2, 512), F32)
    x[0, :448] = (rng.choice([-1, 1], 448) * rng.integers(1, 8, 448) * 1.4e-45).astype(F32)
    x[0, 3] = F32(1e-44)
    x[1, :448] = F32(-1e-44)
    x[:, 448:] = _random_rows(rng, 2, 64)
    amax = np.abs(x[:, :448]).max(1)
    assert np.all(amax > 0) and np.all(amax / F32(448.0) == 0)     # the case: it underflows
    codes, s, rope = ref.fp8_entry_quantize(x)
    assert np.array_equal(s, np.ones(2, F32))
    assert not (codes & 0x7F).any()                                  # +-0 (the sign is kept)
    assert np.array_equal(codes >> 7, (x[:, :448] < 0).astype(np.uint8))
    y = ref.fp8_entry_dequantize(codes, s, rope, "float32")
    assert np.all(np.isfinite(y)) and not y[:, :448].any()
    assert np.array_equal(y[:, 448:], bf16_round(x[:, 448:]))


# ---------------------------------------------------------------------------
# the NVFP4 indexer key
# ---------------------------------------------------------------------------
def _e2m1_brute(v):
    idx = _nearest_even(E2M1_VALUES[:8], v.ravel())
    return (idx | (np.signbit(v.ravel()) << 3)).astype(np.uint8).reshape(v.shape)


def _unpack(q):
    return np.stack([q & 0xF, q >> 4], -1).reshape(*q.shape[:-1], q.shape[-1] * 2)


def test_indexer_nvfp4_matches_brute_force(rng):
    n = 40
    mag = np.exp(rng.uniform(-14, 9, (n, 8, 1)))            # per-block magnitudes
    x = (rng.standard_normal((n, 8, 16)) * mag).astype(F32)
    x[0, 0] = 0.0                                           # bmax = 0: scale 1.0
    x[0, 1] = 1e-5                                          # bmax/6 below 2^-10: scale 2^-9
    x[0, 2] = np.linspace(-2.0**-8, 2.0**-8, 16)            # the same, values kept
    x = x.reshape(n, 128)
    q, sf = ref.indexer_key_quantize(x)
    assert q.shape == (n, 64) and sf.shape == (n, 8)
    blk = x.reshape(n, 8, 16)
    bmax = np.abs(blk).max(-1)
    # ModelOpt's scale rule: r == 0 -> 1.0 (0x38), else at least 2^-9 (NVIDIA/Model-Optimizer
    # modelopt/torch/quantization/qtensor/nvfp4_tensor.py at d0c01a4e9615eaaf0015ec0a5c7c54c5e41eda90,
    # get_weights_scaling_factor and _cast_per_block_scale_to_fp8; the rules of nvidia-modelopt 0.47.0)
    r = bmax / F32(6.0)
    want_sf = np.where(r == 0, np.uint8(0x38), _e4m3_brute(np.maximum(r, F32(2.0**-9))))
    assert np.array_equal(sf, want_sf)
    es = e4m3_decode(want_sf)
    v = blk / es[..., None]
    want = (_e2m1_brute(np.abs(v)) | ((v < 0) << 3)).reshape(n, 128)   # sign iff x / es < 0
    assert np.array_equal(_unpack(q), want)
    assert sf[0, 0] == 0x38 and sf[0, 1] == 0x01 and np.count_nonzero(_unpack(q)[0, :32]) == 0
    assert sf[0, 2] == 0x01 and _unpack(q)[0, 32] == 0x8 | 4          # -2^-8 / 2^-9 = -2
    # negative values keep their sign (clamping at 0 would lose them)
    y = ref.indexer_key_dequantize(q, sf, "float32")
    big = np.abs(v.reshape(n, 128)) > 0.25
    assert np.all(np.sign(y[big]) == np.sign(x[big]))


def test_indexer_nvfp4_rounding_and_packing():
    # bmax = 6 -> sf = e4m3(1.0) = 0x38, es = 1: codes are E2M1 of x itself
    vals = [6.0, 2.6, -2.6, 2.5, 0.75, 1.75, 0.25, 5.0, 3.5, -0.1, 1.25, 7.0 / 8, -6.0, 0.0, 4.0, 1.0]
    x = np.array([vals], F32)
    q, sf = ref.indexer_key_quantize(np.concatenate([x] * 8, 1))
    assert sf[0, 0] == 0x38
    want = [0x7, 0x5, 0xD, 0x4, 0x2, 0x4, 0x0, 0x6, 0x6, 0x8, 0x2, 0x2, 0xF, 0x0, 0x6, 0x2]
    assert list(_unpack(q)[0, :16]) == want
    assert q[0, 0] == (want[0] | want[1] << 4)                # element 0 low nibble


def test_indexer_nvfp4_nonfinite_block(rng):
    x = _random_rows(rng, 2, 128)
    x[0, 20] = np.inf
    x[1, 127] = np.nan
    q, sf = ref.indexer_key_quantize(x)
    assert sf[0, 1] == 0x7F and sf[1, 7] == 0x7F
    assert np.count_nonzero(_unpack(q)[0, 16:32]) == 0 and np.count_nonzero(_unpack(q)[1, 112:]) == 0
    clean = x.copy()
    clean[0, 16:32] = 0
    clean[1, 112:] = 0
    q2, sf2 = ref.indexer_key_quantize(clean)
    assert np.array_equal(np.delete(sf, [1], 1)[0], np.delete(sf2, [1], 1)[0])
    y = ref.indexer_key_dequantize(q, sf)
    assert np.all(np.isnan(y[0, 16:32])) and np.all(np.isfinite(y[0, :16]))
