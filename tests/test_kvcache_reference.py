"""Tests of the numpy reference of the DeepSeek-V4 compressed KV cache
(rawkv/reference/kvcache/, docs/kvcache.md).

Every test draws a fresh seed; it is printed (pytest shows it for a failing
test). Rerun one with RAWKV_TEST_SEED=<seed>.
"""
from __future__ import annotations

import math
import os
import secrets

import numpy as np
import pytest

from rawkv.reference import kvcache as kc
from rawkv.reference.formats import E2M1_VALUES, bf16_round, e4m3_decode

F32, F64 = np.float32, np.float64


@pytest.fixture
def rng():
    seed = int(os.environ.get("RAWKV_TEST_SEED", secrets.randbits(63)))
    print(f"seed={seed}  (rerun: RAWKV_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def _rows(rng, t, w, scale=1.0):
    return (rng.standard_normal((t, w)) * scale).astype(F32)


def _bits(a):
    """Bit pattern view, so -inf / NaN / -0.0 compare exactly."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == F32 else a


def _cos(a, b):
    a, b = np.asarray(a, F64), np.asarray(b, F64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# ---------------------------------------------------------------------------
# float64 ground truth, written independently of kvcache.py
# ---------------------------------------------------------------------------
def _pool_f64(vals, scores):
    vals, scores = np.asarray(vals, F64), np.asarray(scores, F64)
    w = np.exp(scores - scores.max(0))
    return (w / w.sum(0) * vals).sum(0)


def _csa_rows_f64(kv, z, i, m, d):
    """Rows entry i pools: b-half of window i-1, a-half of window i."""
    vals = [kv[t, d:] for t in range(i * m, (i + 1) * m)]
    scs = [z[t, d:] for t in range(i * m, (i + 1) * m)]
    if i > 0:
        vals += [kv[t, :d] for t in range((i - 1) * m, i * m)]
        scs += [z[t, :d] for t in range((i - 1) * m, i * m)]
    return np.array(vals), np.array(scs)


def _entry_f64(kv, z, ape, weight, i, m, overlap, hadamard=False):
    """One compressed entry in float64: pool, RMSNorm, RoPE (complex pairs),
    optional Hadamard."""
    z = z.astype(F64) + ape.astype(F64)[np.arange(z.shape[0]) % m]
    d = weight.shape[0]
    if overlap:
        vals, scs = _csa_rows_f64(kv.astype(F64), z, i, m, d)
    else:
        vals, scs = kv[i * m:(i + 1) * m].astype(F64), z[i * m:(i + 1) * m]
    c = _pool_f64(vals, scs)
    y = c / np.sqrt(np.mean(c * c) + 1e-6) * weight.astype(F64)
    r = y[d - 64:]
    cplx = (r[0::2] + 1j * r[1::2]) * np.exp(1j * (i * m) * kc.rope_inv_freq().astype(F64))
    y[d - 64::2], y[d - 63::2] = cplx.real, cplx.imag
    if hadamard:
        n = y.shape[0]
        h = np.array([[1.0]])
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        y = h @ y / math.sqrt(n)
    return y


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


def _e2m1_brute(v):
    idx = _nearest_even(E2M1_VALUES[:8], v.ravel())
    return (idx | (np.signbit(v.ravel()) << 3)).astype(np.uint8).reshape(v.shape)


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------
def test_hca_pooling_matches_float64(rng):
    m, d = kc.HCA_RATIO, 64
    T = 3 * m + int(rng.integers(0, m))
    kv, z = _rows(rng, T, d), _rows(rng, T, d, 3.0)
    ape = _rows(rng, m, d)
    got = kc.compress_hca(kv, z, ape)
    assert got.shape == (3, d) and got.dtype == F32
    zz = z.astype(F64) + ape.astype(F64)[np.arange(T) % m]
    for i in range(3):
        want = _pool_f64(kv[i * m:(i + 1) * m], zz[i * m:(i + 1) * m])
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-6)


def test_csa_pooling_matches_float64(rng):
    m, d = kc.CSA_RATIO, kc.HEAD_DIM
    n = int(rng.integers(2, 12))
    T = n * m + int(rng.integers(0, m))
    kv, z = _rows(rng, T, 2 * d), _rows(rng, T, 2 * d, 3.0)
    ape = _rows(rng, m, 2 * d)
    got = kc.compress_csa(kv, z, ape)
    assert got.shape == (n, d)
    zz = z.astype(F64) + ape.astype(F64)[np.arange(T) % m]
    for i in range(n):
        vals, scs = _csa_rows_f64(kv.astype(F64), zz, i, m, d)
        np.testing.assert_allclose(got[i], _pool_f64(vals, scs), rtol=2e-5, atol=2e-6)


def test_pooled_entry_is_a_convex_combination(rng):
    # softmax weights are positive and sum to 1: each channel lies between the
    # min and max of the pooled values (a real bound, not a tautology).
    m, d, n = 4, 32, 6
    kv, z = _rows(rng, n * m, 2 * d), _rows(rng, n * m, 2 * d, 5.0)
    got = kc.compress_csa(kv, z)
    for i in range(n):
        vals, _ = _csa_rows_f64(kv.astype(F64), z.astype(F64), i, m, d)
        assert np.all(got[i] >= vals.min(0) - 1e-6) and np.all(got[i] <= vals.max(0) + 1e-6)


def test_csa_overlap_dependencies(rng):
    m, d, n = 4, 64, 5
    kv, z = _rows(rng, n * m, 2 * d), _rows(rng, n * m, 2 * d)
    base = kc.compress_csa(kv, z)
    i = int(rng.integers(1, n))
    prev = slice((i - 1) * m, i * m)
    # the a-half of window i-1 feeds entry i-1 only
    kv2, z2 = kv.copy(), z.copy()
    kv2[prev, d:] += 1.0
    z2[prev, d:] += 2.0
    out = kc.compress_csa(kv2, z2)
    assert np.array_equal(out[i], base[i])
    assert not np.allclose(out[i - 1], base[i - 1])
    # the b-half of window i-1 feeds entry i only
    kv3, z3 = kv.copy(), z.copy()
    kv3[prev, :d] += 1.0
    z3[prev, :d] += 2.0
    out = kc.compress_csa(kv3, z3)
    assert np.array_equal(out[i - 1], base[i - 1])
    assert not np.allclose(out[i], base[i])
    # the b-half of the last window feeds no finished entry
    kv4 = kv.copy()
    kv4[(n - 1) * m:, :d] = 1e6
    assert np.array_equal(kc.compress_csa(kv4, z), base)


def test_csa_first_window_is_masked(rng):
    m, d = 4, 128
    kv, z = _rows(rng, 3 * m, 2 * d), _rows(rng, 3 * m, 2 * d)
    ape = _rows(rng, m, 2 * d)
    got = kc.compress_csa(kv, z, ape)
    # entry 0 pools only the a-half of window 0: exactly the one-stream pooling
    only_a = kc.compress_hca(kv[:m, d:], z[:m, d:], ape[:, d:], m=m)
    assert np.array_equal(got[0], only_a[0])
    # huge gate on the b-half of window 0 must not leak into entry 0
    z2 = z.copy()
    z2[:m, :d] = 80.0
    assert np.array_equal(kc.compress_csa(kv, z2, ape)[0], got[0])


def test_partial_window_not_pooled_and_bad_shapes(rng):
    kv, z = _rows(rng, 3, 16), _rows(rng, 3, 16)
    assert kc.compress_csa(kv, z).shape == (0, 8)
    with pytest.raises(ValueError, match="z"):
        kc.compress_csa(kv, z[:, :8])
    with pytest.raises(ValueError, match="ape"):
        kc.compress_hca(_rows(rng, 8, 16), _rows(rng, 8, 16), ape=np.zeros((3, 16)), m=4)
    with pytest.raises(TypeError, match="kv"):
        kc.compress_hca(np.zeros((4, 4), bool), np.zeros((4, 4)), m=4)


# ---------------------------------------------------------------------------
# RMSNorm, RoPE, Hadamard
# ---------------------------------------------------------------------------
def test_rmsnorm(rng):
    x = _rows(rng, 7, 512, 3.0)
    w = (1 + 0.1 * rng.standard_normal(512)).astype(F32)
    got = kc.rmsnorm(x, w)
    x64 = x.astype(F64)
    want = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    ones = kc.rmsnorm(x, np.ones(512, F32))
    np.testing.assert_allclose(np.mean(ones.astype(F64) ** 2, -1), 1.0, rtol=1e-5)
    assert np.array_equal(kc.rmsnorm(np.zeros((2, 512), F32), w), np.zeros((2, 512), F32))
    # eps matters for small rows: mean(x^2) = 1e-6 halves the squared norm
    small = np.full((1, 512), 1e-3, F32)
    np.testing.assert_allclose(kc.rmsnorm(small, np.ones(512, F32)), 1e-3 / math.sqrt(2e-6), rtol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        kc.rmsnorm(x, w[:100])


def test_rope_position_zero_is_identity_and_nope_untouched(rng):
    x = _rows(rng, 5, 512)
    assert np.array_equal(kc.apply_rope(x, np.zeros(5, np.int64)), x)
    y = kc.apply_rope(x, rng.integers(0, 1 << 20, 5))
    assert np.array_equal(y[:, :448], x[:, :448])
    assert not np.allclose(y[:, 448:], x[:, 448:])


def test_rope_preserves_pair_norms_and_composes(rng):
    x = _rows(rng, 9, 512)
    p = rng.integers(0, 5000, 9)
    q = rng.integers(0, 5000, 9)
    y = kc.apply_rope(x, p)
    norms = lambda a: np.hypot(a[:, 448::2].astype(F64), a[:, 449::2].astype(F64))  # noqa: E731
    np.testing.assert_allclose(norms(y), norms(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kc.apply_rope(y, q), kc.apply_rope(x, p + q), rtol=0, atol=2e-5)


def test_rope_is_interleaved_pairs(rng):
    p = int(rng.integers(1, 1000))
    x = np.zeros((1, 512), F32)
    x[0, 448] = 1.0                          # first RoPE pair, even element
    y = kc.apply_rope(x, np.array([p]))
    # inv_freq[0] == 1: pair (448, 449) turns by p radians
    np.testing.assert_allclose(y[0, 448:450], [math.cos(p), math.sin(p)], atol=1e-6)
    assert np.count_nonzero(y[0, 450:]) == 0     # half-split RoPE would write dim 480


def test_rope_yarn_frequencies():
    plain = kc.rope_inv_freq(yarn=None).astype(F64)
    np.testing.assert_allclose(plain, 160000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-7)
    yarn = kc.rope_inv_freq().astype(F64)
    # DSV4: correction range [15, 25] for dim 64, base 160000, 65536 tokens
    np.testing.assert_allclose(yarn[:15], plain[:15], rtol=1e-7)
    np.testing.assert_allclose(yarn[25:], plain[25:] / 16, rtol=1e-7)
    mid = slice(16, 25)
    assert np.all(yarn[mid] < plain[mid]) and np.all(yarn[mid] > plain[mid] / 16)


def test_hadamard(rng):
    h = kc.hadamard_matrix(128)
    assert np.array_equal(h @ h.T, 128 * np.eye(128))
    assert np.array_equal(h[:64, :64], kc.hadamard_matrix(64))
    assert np.array_equal(h[64:, 64:], -kc.hadamard_matrix(64))       # Sylvester order
    x = _rows(rng, 6, 128)
    y = kc.hadamard_rotate(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(kc.hadamard_rotate(y), x, atol=2e-6)
    e0 = np.zeros(128, F32)
    e0[0] = 1
    np.testing.assert_allclose(kc.hadamard_rotate(e0), np.full(128, 128 ** -0.5), rtol=1e-7)
    with pytest.raises(ValueError):
        kc.hadamard_matrix(96)


# ---------------------------------------------------------------------------
# FP8 entry
# ---------------------------------------------------------------------------
def test_fp8_entry_round_trip_bound(rng):
    n = 64
    mag = np.exp(rng.uniform(-12, 8, (n, 1)))             # entries of very different size
    x = (rng.standard_normal((n, 512)) * mag).astype(F32)
    x[:, :448][rng.random((n, 448)) < 0.05] = 0.0
    codes, s, rope = kc.fp8_entry_quantize(x)
    assert codes.shape == (n, 448) and codes.dtype == np.uint8
    assert s.shape == (n,) and s.dtype == F32
    amax = np.abs(x[:, :448]).max(1)
    assert np.array_equal(s, amax / F32(448.0))
    # codes are the RNE E4M3 of x / s (float32 division), by brute force
    assert np.array_equal(codes, _e4m3_brute(x[:, :448] / s[:, None]))
    y = kc.fp8_entry_dequantize(codes, s, rope, dtype="float32")
    err = np.abs(y[:, :448].astype(F64) - x[:, :448])
    bound = 2.0 ** -4 * np.abs(x[:, :448]) + 2.0 ** -10 * s[:, None] + 2.0 ** -22 * np.abs(x[:, :448])
    assert np.all(err <= bound)
    assert np.array_equal(rope, bf16_round(x[:, 448:]))
    assert np.all(np.abs(y[:, 448:] - x[:, 448:]) <= 2.0 ** -8 * np.abs(x[:, 448:]))
    yb = kc.fp8_entry_dequantize(codes, s, rope)
    assert np.array_equal(yb, bf16_round(y))


def test_fp8_entry_exact_for_representable_inputs(rng):
    n = 16
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = rng.choice(finite, (n, 448))
    codes[np.arange(n), rng.integers(0, 448, n)] = 0x7E | (rng.integers(0, 2, n) << 7).astype(np.uint8)
    scale = (2.0 ** rng.integers(-20, 10, n)).astype(F32)      # amax = 448 * 2^k
    rope = bf16_round(_rows(rng, n, 64))
    x = np.concatenate([e4m3_decode(codes) * scale[:, None], rope], axis=1)
    q, s, r = kc.fp8_entry_quantize(x)
    assert np.array_equal(s, scale)
    assert np.array_equal(q, codes)
    assert np.array_equal(_bits(kc.fp8_entry_dequantize(q, s, r, "float32")), _bits(x))


def test_fp8_entry_zero_and_nonfinite(rng):
    x = np.zeros((3, 512), F32)
    x[1, 448:] = _rows(rng, 1, 64)[0]                    # zero non-RoPE part, RoPE set
    x[2, 5] = np.nan
    x[2, 448] = 3.0
    codes, s, rope = kc.fp8_entry_quantize(x)
    assert s[0] == 1.0 and s[1] == 1.0 and np.isnan(s[2])
    assert np.count_nonzero(codes) == 0
    y = kc.fp8_entry_dequantize(codes, s, rope)
    assert np.array_equal(y[:2, :448], np.zeros((2, 448)))
    assert np.all(np.isnan(y[2, :448])) and y[2, 448] == 3.0
    x[2, 5] = -np.inf
    assert np.isnan(kc.fp8_entry_quantize(x)[1][2])


def test_fp8_entry_scale_that_underflows_is_one(rng):
    """amax ~1e-44 (a float32 subnormal): amax / 448 rounds to 0, so the scale
    is 1 rather than 0 (a 0 scale would turn x / s into Inf/NaN and decode to
    NaN or 0 * Inf). Codes are e4m3(x / 1) = 0 and the entry decodes to
    finite (signed) zeros: the true values are far below E4M3's 2^-9."""
    x = np.zeros((2, 512), F32)
    x[0, :448] = (rng.choice([-1, 1], 448) * rng.integers(1, 8, 448) * 1.4e-45).astype(F32)
    x[0, 3] = F32(1e-44)
    x[1, :448] = F32(-1e-44)
    x[:, 448:] = _rows(rng, 2, 64)
    amax = np.abs(x[:, :448]).max(1)
    assert np.all(amax > 0) and np.all(amax / F32(448.0) == 0)     # the case: it underflows
    codes, s, rope = kc.fp8_entry_quantize(x)
    assert np.array_equal(s, np.ones(2, F32))
    assert not (codes & 0x7F).any()                                  # +-0 (the sign is kept)
    assert np.array_equal(codes >> 7, (x[:, :448] < 0).astype(np.uint8))
    y = kc.fp8_entry_dequantize(codes, s, rope, "float32")
    assert np.all(np.isfinite(y)) and not y[:, :448].any()
    assert np.array_equal(y[:, 448:], bf16_round(x[:, 448:]))


# ---------------------------------------------------------------------------
# indexer key: one-level NVFP4
# ---------------------------------------------------------------------------
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
    q, sf = kc.indexer_key_quantize(x)
    assert q.shape == (n, 64) and sf.shape == (n, 8)
    blk = x.reshape(n, 8, 16)
    bmax = np.abs(blk).max(-1)
    # ModelOpt's scale rule: r == 0 -> 1.0 (0x38), else at least 2^-9
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
    y = kc.indexer_key_dequantize(q, sf, "float32")
    big = np.abs(v.reshape(n, 128)) > 0.25
    assert np.all(np.sign(y[big]) == np.sign(x[big]))


def test_indexer_nvfp4_rounding_and_packing():
    # bmax = 6 -> sf = e4m3(1.0) = 0x38, es = 1: codes are E2M1 of x itself
    vals = [6.0, 2.6, -2.6, 2.5, 0.75, 1.75, 0.25, 5.0, 3.5, -0.1, 1.25, 7.0 / 8, -6.0, 0.0, 4.0, 1.0]
    x = np.array([vals], F32)
    q, sf = kc.indexer_key_quantize(np.concatenate([x] * 8, 1))
    assert sf[0, 0] == 0x38
    want = [0x7, 0x5, 0xD, 0x4, 0x2, 0x4, 0x0, 0x6, 0x6, 0x8, 0x2, 0x2, 0xF, 0x0, 0x6, 0x2]
    assert list(_unpack(q)[0, :16]) == want
    assert q[0, 0] == (want[0] | want[1] << 4)                # element 0 low nibble


def test_indexer_nvfp4_nonfinite_block(rng):
    x = _rows(rng, 2, 128)
    x[0, 20] = np.inf
    x[1, 127] = np.nan
    q, sf = kc.indexer_key_quantize(x)
    assert sf[0, 1] == 0x7F and sf[1, 7] == 0x7F
    assert np.count_nonzero(_unpack(q)[0, 16:32]) == 0 and np.count_nonzero(_unpack(q)[1, 112:]) == 0
    clean = x.copy()
    clean[0, 16:32] = 0
    clean[1, 112:] = 0
    q2, sf2 = kc.indexer_key_quantize(clean)
    assert np.array_equal(np.delete(sf, [1], 1)[0], np.delete(sf2, [1], 1)[0])
    y = kc.indexer_key_dequantize(q, sf)
    assert np.all(np.isnan(y[0, 16:32])) and np.all(np.isfinite(y[0, :16]))


# ---------------------------------------------------------------------------
# paged pool: flush and gather
# ---------------------------------------------------------------------------
def _noisy_pool(rng, num_blocks, epb, m, index=True):
    pool = kc.PagedPoolRef.create(num_blocks, epb, m, index_head_dim=128 if index else None)
    pool.kv_fp8[:] = rng.integers(0, 256, pool.kv_fp8.shape)
    pool.kv_scale[:] = rng.standard_normal(pool.kv_scale.shape)
    pool.kv_rope[:] = rng.standard_normal(pool.kv_rope.shape)
    if index:
        pool.idx_q[:] = rng.integers(0, 256, pool.idx_q.shape)
        pool.idx_sf[:] = rng.integers(0, 256, pool.idx_sf.shape)
    pool.marks[:] = 1         # every entry counts as written (the bounds tests' subject is elsewhere)
    return pool


def _pool_arrays(pool):
    return [a for a in (pool.kv_fp8, pool.kv_scale, pool.kv_rope, pool.idx_q, pool.idx_sf)
            if a is not None]


def _changed(before, after):
    """Set of (block, slot) whose bytes differ in any pool array."""
    out = set()
    for a, b in zip(_pool_arrays(before), _pool_arrays(after)):
        diff = _bits(a) != _bits(b)
        diff = diff.reshape(diff.shape[0], diff.shape[1], -1).any(-1)
        out |= set(map(tuple, np.argwhere(diff)))
    return out


def test_flush_writes_only_its_entries(rng):
    m, epb, nb = 4, 4, 12
    pool = _noisy_pool(rng, nb, epb, m)
    blocks = rng.permutation(nb)[:9].reshape(3, 3)            # 3 requests, 3 blocks each
    B = 6
    req = rng.integers(0, 3, B)
    ent = rng.integers(0, 3 * epb, B)
    # distinct (request, entry) pairs so no two rows hit one entry
    pairs = list({(int(r), int(e)) for r, e in zip(req, ent)})
    req = np.array([p[0] for p in pairs])
    ent = np.array([p[1] for p in pairs])
    B = len(pairs)
    valid = rng.random(B) < 0.7
    entries = bf16_round(_rows(rng, B, 512))
    keys = bf16_round(_rows(rng, B, 128))
    pos = ent * m + rng.integers(0, m, B)
    before = pool.copy()
    err = kc.flush_write(pool, entries, valid, pos, blocks[req], keys)
    assert err == 0
    want = {(int(blocks[r, e // epb]), int(e % epb)) for r, e, v in zip(req, ent, valid) if v}
    assert _changed(before, pool) == want
    codes, s, rope = kc.fp8_entry_quantize(entries)
    iq, isf = kc.indexer_key_quantize(keys)
    for b in np.flatnonzero(valid):
        loc = (blocks[req[b], ent[b] // epb], ent[b] % epb)
        assert np.array_equal(pool.kv_fp8[loc], codes[b]) and pool.kv_scale[loc] == s[b]
        assert np.array_equal(pool.kv_rope[loc], rope[b])
        assert np.array_equal(pool.idx_q[loc], iq[b]) and np.array_equal(pool.idx_sf[loc], isf[b])


def test_flush_out_of_range_skipped_and_counted(rng):
    m, epb, nb = 4, 2, 5
    pool = _noisy_pool(rng, nb, epb, m)
    table = np.array([[0, 1],            # good
                      [-1, 2],           # entry 0 -> block -1
                      [nb, 3],           # entry 0 -> block nb
                      [10 ** 9, 4],      # entry 0 -> huge block id
                      [3, 4],            # position past the table (logical block 2)
                      [2, 2],            # negative position
                      [-1, -1]],         # invalid row: not counted
                     np.int64)
    pos = np.array([1, 2, 3, 0, 2 * epb * m, -1, 0])
    valid = np.array([True] * 6 + [False])
    before = pool.copy()
    err = kc.flush_write(pool, bf16_round(_rows(rng, 7, 512)), valid, pos, table,
                         bf16_round(_rows(rng, 7, 128)))
    assert err == 5
    assert _changed(before, pool) == {(0, 0)}


def test_flush_rejects_bad_arguments_and_writes_nothing(rng):
    pool = _noisy_pool(rng, 4, 2, 4)
    before = pool.copy()
    e, k = _rows(rng, 2, 512), _rows(rng, 2, 128)
    args = dict(valid_mask=np.ones(2, bool), positions=np.zeros(2, np.int64),
                block_table=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="entries"):
        kc.flush_write(pool, e[:, :500], index_keys=k, **args)
    with pytest.raises(ValueError, match="index_keys"):
        kc.flush_write(pool, e, **args)
    with pytest.raises(TypeError, match="valid_mask"):
        kc.flush_write(pool, e, index_keys=k, **{**args, "valid_mask": np.ones(2)})
    with pytest.raises(TypeError, match="block_table"):
        kc.flush_write(pool, e, index_keys=k, **{**args, "block_table": np.zeros((2, 2))})
    assert _changed(before, pool) == set()


def test_gather_out_of_range_skipped_and_counted(rng):
    m, epb, nb = 4, 2, 6
    pool = kc.PagedPoolRef.create(nb, epb, m, index_head_dim=128)
    table = np.array([4, 1, -1], np.int64)              # entries 0-3 real, 4-5 unmapped
    entries = bf16_round(_rows(rng, 4, 512))
    kc.flush_write(pool, entries, np.ones(4, bool), np.arange(4) * m, np.tile(table, (4, 1)),
                   bf16_round(_rows(rng, 4, 128)))
    want = kc.fp8_entry_dequantize(*kc.fp8_entry_quantize(entries))
    rows, err = kc.gather_dense(pool, table, 4)
    assert err == 0 and np.array_equal(rows, want)
    rows, err = kc.gather_dense(pool, table, 7)               # 4, 5: block -1; 6: past table
    assert err == 3 and np.array_equal(rows[:4], want) and not rows[4:].any()
    ids = np.array([[3, -1, 0, -2, 5, 2, 9]])
    rows, err = kc.gather_topk(pool, table[None], ids)
    assert err == 3                                            # -2, 5 (block -1), 9
    assert np.array_equal(rows[0, [0, 2, 5]], want[[3, 0, 2]])
    assert not rows[0, [1, 3, 4, 6]].any()
    rows, err = kc.gather_topk(pool, table[None], np.array([[3, 2, 1]]), n_entries=np.array([2]))
    assert err == 2 and np.array_equal(rows[0, 2], want[1]) and not rows[0, :2].any()
    # written: entries past what the request wrote are zero rows, one error each
    for fn, w in ((kc.gather_dense, want), (kc.gather_index_keys, None)):
        rows, err = fn(pool, table, 4, written=2)
        assert err == 2 and not rows[2:].any()
        if w is not None:
            assert np.array_equal(rows[:2], w[:2])
    with pytest.raises(ValueError, match="n_entries"):
        kc.gather_index_keys(pool, table, -1)


# ---------------------------------------------------------------------------
# the pool addressed by slot (block-table bounds, written[], error counts)
# ---------------------------------------------------------------------------
def _slot_pool(rng, nb=8, epb=2, m=4, R=3, MB=3):
    pool = _noisy_pool(rng, nb, epb, m)
    pool.block_table, pool.written = kc.PagedPoolRef.create(
        1, 1, 1, max_requests=R, max_blocks_per_request=MB).block_table, np.zeros(R, np.int32)
    pool.block_table[0, :2] = [5, 1]
    pool.block_table[1, :3] = [2, nb, 0]          # logical block 1 maps outside the pool
    return pool


def test_paged_flush_write_bounds_and_written(rng):
    m, epb = 4, 2
    pool = _slot_pool(rng)
    slots = np.array([0, 0, 1, 1, 2, -1, 3, 0, 1, 0], np.int32)
    pos = np.array([1, 13, 2, 9, 0, 0, 0, -4, 4 * 3 * epb, 5], np.int32)
    valid = np.array([True] * 9 + [False])
    # row: 0 entry 0 ok; 1 entry 3 (block 1) ok; 2 entry 0 of slot 1 ok; 3 entry 2 -> block nb:
    # counted; 4 slot 2 has no block: counted; 5, 6 slots out of range: counted; 7 negative
    # position: counted; 8 past the table: counted; 9 invalid: silent
    before = pool.copy()
    err = kc.paged_flush_write(pool, bf16_round(_rows(rng, 10, 512)), valid, slots, pos,
                               bf16_round(_rows(rng, 10, 128)))
    assert err == 6
    assert _changed(before, pool) == {(5, 0), (1, 1), (2, 0)}
    np.testing.assert_array_equal(pool.written, [4, 1, 0])     # 1 + highest entry written
    kc.paged_flush_write(pool, bf16_round(_rows(rng, 1, 512)), np.ones(1, bool), np.zeros(1, np.int32),
                         np.zeros(1, np.int32), bf16_round(_rows(rng, 1, 128)))
    np.testing.assert_array_equal(pool.written, [4, 1, 0])     # a high-water mark: never lowered
    with pytest.raises(ValueError, match="pool: has no request table"):
        kc.paged_flush_write(_noisy_pool(rng, 2, 2, 4), np.zeros((1, 512), np.float32), np.ones(1, bool),
                             np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 128), np.float32))


def test_paged_gathers_are_bounded_by_written(rng):
    pool = _slot_pool(rng)
    pool.written[:] = [3, 1, 0]
    table = pool.block_table.astype(np.int64)
    slots = np.array([0, 1, 2, 7], np.int32)
    ids = np.array([[0, 1, 2, 3, -1], [0, 1, 2, -1, -1], [0, -1, -1, -1, -1], [0, -1, -1, -1, -1]])
    rows, err = kc.paged_gather_topk(pool, slots, ids)
    # slot 0: id 3 >= written 3; slot 1: ids 1, 2 >= written 1; slot 2: written 0; slot 7: no slot
    assert err == 5
    want, _ = kc.gather_topk(pool, table[[0, 1]], ids[:2], np.array([3, 1]))
    assert np.array_equal(rows[:2], want, equal_nan=True) and not rows[2:].any()
    rows, err = kc.paged_gather_topk(pool, slots, ids, n_entries=np.array([2, 9, 9, 9], np.int32),
                                     valid_mask=np.array([True, True, False, True]))
    assert err == 2 + 2 + 1                                    # min(n_entries, written); slot 2 masked
    assert not rows[2].any()
    rows, err = kc.paged_gather_dense(pool, 0, 3)
    want, _ = kc.gather_dense(pool, table[0], 3)
    assert err == 0 and np.array_equal(rows, want, equal_nan=True)
    rows, err = kc.paged_gather_dense(pool, 1, 2, index=True)
    assert err == 1 and not rows[1].any()                      # entry 1: not written


def test_paged_gather_dense_batch_rules(rng):
    pool = _slot_pool(rng)
    pool.written[:] = [4, 1, 0]
    slots = np.array([0, 0, 0, 1, 5], np.int32)
    n = np.array([2, -1, 9, 1, 1], np.int32)
    rows, err = kc.paged_gather_dense_batch(pool, slots, n, 3)
    # n = -1 and n = 9 > K each count once (9: then 3 entries, 0..2, are gathered); slot 5: 1
    assert err == 3
    want, _ = kc.gather_dense(pool, pool.block_table[0], 3)
    assert np.array_equal(rows[0, :2], want[:2], equal_nan=True) and not rows[0, 2:].any()
    assert not rows[1].any() and np.array_equal(rows[2], want, equal_nan=True)
    rows, err = kc.paged_gather_dense_batch(pool, slots, n, 3, valid_mask=np.array([1, 0, 0, 1, 0], bool))
    assert err == 0 and not rows[[1, 2, 4]].any()
    keys, err = kc.paged_gather_dense_batch(pool, slots[:1], n[:1], 3, index=True)
    assert keys.shape == (1, 3, 128) and err == 0


def test_compress_decode_flush_rule(rng):
    """The compressor's flush decision, row by row (paged_compress_decode,
    the rule kv_compress.cu follows)."""
    m, d = 4, 512
    pool = kc.PagedPoolRef.create(8, 2, m, index_head_dim=128, max_requests=4, max_blocks_per_request=2)
    pool.block_table[:, 0] = [0, 1, 2, 3]
    st = _random_state(rng, "csa", 4, d)
    ist = _random_state(rng, "csa", 4, 128)
    st.count[:] = [m, m, 1, m]
    ist.count[:] = [m, 2, 1, m]
    nw, iw = np.ones(d, np.float32), np.ones(128, np.float32)
    slots = np.array([0, 1, 2, 3, 9, 0], np.int32)
    pos = np.array([3, 3, 3, -1, 3, 7], np.int32)
    valid = np.array([True, True, True, True, True, False])
    before = pool.copy()
    err = kc.paged_compress_decode(pool, st, nw, valid, slots, pos, index=(ist, iw))
    # slot 0 flushes; slot 1: only the entry's window is complete (out of step): counted, nothing
    # written; slot 2: neither complete, silent; slot 3: negative position, counted; slot 9: counted
    assert err == 3
    assert _changed(before, pool) == {(0, 0)}
    np.testing.assert_array_equal(pool.written, [1, 0, 0, 0])
    e = kc.finish_entry(kc.state_pool(st, [0]), nw, [0], m)
    k = kc.finish_index_key(kc.state_pool(ist, [0]), iw, [0], m)
    codes, scale, _ = kc.fp8_entry_quantize(e)
    assert np.array_equal(pool.kv_fp8[0, 0], codes[0]) and pool.kv_scale[0, 0] == scale[0]
    assert np.array_equal(pool.idx_q[0, 0], kc.indexer_key_quantize(k)[0][0])
    # HCA (no indexer): the entry's window alone decides
    hp = kc.PagedPoolRef.create(4, 2, 128, head_dim=128, max_requests=2, max_blocks_per_request=1)
    hp.block_table[:, 0] = [0, 1]
    hs = _random_state(rng, "hca", 2, 128)
    hs.count[:] = [128, 5]
    assert kc.paged_compress_decode(hp, hs, np.ones(128, np.float32), np.ones(2, bool),
                                    np.array([0, 1]), np.array([127, 127])) == 0
    np.testing.assert_array_equal(hp.written, [1, 0])


def test_compress_prefill_into_the_pool(rng):
    m, T = 4, 5 * 4 + 2
    kv, z = _rows(rng, T, 1024), _rows(rng, T, 1024)
    nw = np.ones(512, np.float32)
    pool = kc.PagedPoolRef.create(8, 2, m, max_requests=2, max_blocks_per_request=2)
    pool.block_table[1] = [3, 6]                   # 4 entries; entry 4 is past the table
    n, err = kc.paged_compress_prefill(pool, "csa", 1, kv, z, None, nw)
    assert (n, err) == (5, 1)
    np.testing.assert_array_equal(pool.written, [0, 4])
    ids, ent, _ = kc.reference_prefill("csa", kv, z, None, nw)
    codes, _, _ = kc.fp8_entry_quantize(ent)
    assert np.array_equal(pool.kv_fp8[6, 1], codes[3]) and np.array_equal(ids, np.arange(5))


def test_state_ops_duplicate_slots_lowest_row_wins(rng):
    """Duplicate slots (a caller error): the lowest valid row of a slot acts,
    every other valid row of it is skipped and counted (kv_cache.cu does the
    same, so the state never depends on the order CTAs run in)."""
    st = kc.DecodeStateRef.create("csa", 2, 8)
    st.count[0] = 1
    B = 9
    kv, z = _rows(rng, B, 16), _rows(rng, B, 16)
    valid = np.ones(B, bool)
    valid[0] = False                              # an invalid row owns nothing
    err = kc.state_append(st, kv, z, valid, np.zeros(B, np.int32))
    assert err == B - 2 and st.count[0] == 2 and st.count[1] == 0
    assert np.array_equal(st.a_kv[0, 1], kv[1]) and np.array_equal(st.a_z[0, 1], z[1])
    before = st.copy()
    # rotate: rows 1 and 3 duplicate slot 0 of row 0; row 2 is out of range
    err = kc.csa_rotate(st, np.ones(4, bool), np.array([0, 0, 5, 0], np.int32))
    assert err == 3 and st.count[0] == 0
    assert np.array_equal(st.b_kv[0], before.a_kv[0, :, :8])
    h = kc.DecodeStateRef.create("hca", 2, 8)
    h.count[:] = [3, 2]
    assert kc.hca_reset(h, np.ones(3, bool), np.array([1, 1, 1], np.int32)) == 2
    assert list(h.count) == [3, 0]
    assert kc.state_clear(h, np.array([0, 1, 0, 1], np.int32)) == 2


def test_state_clear_valid_mask(rng):
    st = _random_state(rng, "csa", 4, 8)
    before = st.copy()
    err = kc.state_clear(st, np.array([0, 2, 9, 3]), valid_mask=np.array([True, False, True, False]))
    assert err == 1 and st.count[0] == 0 and np.all(st.a_z[0] == -np.inf)
    assert _unchanged_slots(before, st, [1, 2, 3])


# ---------------------------------------------------------------------------
# decode state
# ---------------------------------------------------------------------------
def _random_state(rng, kind, S, d):
    st = kc.DecodeStateRef.create(kind, S, d)
    st.a_kv[:] = rng.standard_normal(st.a_kv.shape)
    st.a_z[:] = rng.standard_normal(st.a_z.shape)
    st.count[:] = rng.integers(0, st.m + 1, S)
    if st.overlap:
        st.b_kv[:] = rng.standard_normal(st.b_kv.shape)
        st.b_z[:] = rng.standard_normal(st.b_z.shape)
    return st


def _state_arrays(st):
    return [a for a in (st.a_kv, st.a_z, st.count, st.b_kv, st.b_z) if a is not None]


def _unchanged_slots(before, after, slots):
    return all(np.array_equal(_bits(a[slots]), _bits(b[slots]))
               for a, b in zip(_state_arrays(before), _state_arrays(after)))


def test_initial_state_is_empty():
    st = kc.DecodeStateRef.create("csa", 3, 8)
    assert st.a_kv.shape == (3, 4, 16) and st.b_kv.shape == (3, 4, 8)
    assert np.all(st.a_z == -np.inf) and np.all(st.b_z == -np.inf)
    assert not st.a_kv.any() and not st.b_kv.any() and not st.count.any()
    h = kc.DecodeStateRef.create("hca", 2, 8)
    assert h.a_kv.shape == (2, 128, 8) and h.b_kv is None


def test_csa_rotate_exact_state(rng):
    S, d = 7, 16
    st = _random_state(rng, "csa", S, d)
    before = st.copy()
    slots = np.array([5, 1, 9, 3, -1, 0])
    valid = np.array([True, True, True, False, True, False])
    err = kc.csa_rotate(st, valid, slots)
    assert err == 2                                  # 9 and -1
    for s in (5, 1):
        assert np.array_equal(st.b_kv[s], before.a_kv[s, :, :d])
        assert np.array_equal(st.b_z[s], before.a_z[s, :, :d])
        assert not st.a_kv[s].any() and np.all(st.a_z[s] == -np.inf) and st.count[s] == 0
    assert _unchanged_slots(before, st, [0, 2, 3, 4, 6])
    with pytest.raises(ValueError, match="state"):
        kc.hca_reset(st, valid, slots)


def test_hca_reset_exact_state(rng):
    S, d = 5, 8
    st = _random_state(rng, "hca", S, d)
    before = st.copy()
    err = kc.hca_reset(st, np.array([True, True, False]), np.array([2, 5, 4]))
    assert err == 1
    assert not st.a_kv[2].any() and np.all(st.a_z[2] == -np.inf) and st.count[2] == 0
    assert _unchanged_slots(before, st, [0, 1, 3, 4])
    with pytest.raises(ValueError, match="state"):
        kc.csa_rotate(st, np.array([True]), np.array([0]))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_state_seed_equals_token_by_token(rng, kind):
    """state_seed(prompt) leaves exactly the state that state_clear followed by
    state_append of every prompt row and csa_rotate / hca_reset after every
    full window leaves, on a slot that held garbage; other slots untouched."""
    d, S = 16, 4
    m = kc.CSA_RATIO if kind == "csa" else kc.HCA_RATIO
    w = 2 * d if kind == "csa" else d
    ape = _rows(rng, m, w)
    for T in sorted({0, 1, m - 1, m, m + 1, 2 * m, 3 * m + m // 2}):
        kv, z = _rows(rng, T, w), _rows(rng, T, w, 2.0)
        for use_ape in (True, False):
            a = ape if use_ape else None
            seeded = _random_state(rng, kind, S, d)
            slow = seeded.copy()
            kc.state_seed(seeded, 2, kv, z, a)
            assert kc.state_clear(slow, np.array([2])) == 0
            one = np.ones(1, bool)
            for t in range(T):
                assert kc.state_append(slow, kv[t:t + 1], z[t:t + 1], one, np.array([2]), a) == 0
                if slow.count[2] == m:
                    rot = kc.csa_rotate if kind == "csa" else kc.hca_reset
                    assert rot(slow, one, np.array([2])) == 0
            for x, y in zip(_state_arrays(seeded), _state_arrays(slow)):
                assert np.array_equal(_bits(x), _bits(y)), (T, use_ape)
    st = kc.DecodeStateRef.create(kind, S, d)
    with pytest.raises(ValueError, match="slot"):
        kc.state_seed(st, S, kv, z)
    with pytest.raises(TypeError, match="slot"):
        kc.state_seed(st, 1.0, kv, z)
    with pytest.raises(ValueError, match="kv"):
        kc.state_seed(st, 0, kv[:, :-1], z)
    with pytest.raises(ValueError, match="ape"):
        kc.state_seed(st, 0, kv, z, ape[:-1])


def test_state_append_and_clear(rng):
    S, d, m = 4, 8, 4
    st = kc.DecodeStateRef.create("csa", S, d)
    ape = _rows(rng, m, 2 * d)
    st.count[2] = m                                        # full window, flush missed
    kv, z = _rows(rng, 4, 2 * d), _rows(rng, 4, 2 * d)
    before = st.copy()
    err = kc.state_append(st, kv, z, np.array([True, True, True, False]),
                          np.array([0, 2, 7, 1]), ape)
    assert err == 2                                        # slot 2 full, slot 7 out of range
    assert st.count[0] == 1 and np.array_equal(st.a_kv[0, 0], kv[0])
    assert np.array_equal(st.a_z[0, 0], z[0] + ape[0])
    assert _unchanged_slots(before, st, [1, 2, 3])
    kc.state_append(st, kv, z, np.array([True, False, False, False]), np.array([0, 0, 0, 0]), ape)
    assert st.count[0] == 2 and np.array_equal(st.a_z[0, 1], z[0] + ape[1])
    st.b_z[3] = 1.0
    assert kc.state_clear(st, np.array([3, 0, 11])) == 1
    for s in (0, 3):
        assert st.count[s] == 0 and np.all(st.a_z[s] == -np.inf) and np.all(st.b_z[s] == -np.inf)


# ---------------------------------------------------------------------------
# multi-request decode simulation
# ---------------------------------------------------------------------------
def _simulate(rng, kind, lengths, epb=4):
    m = kc.CSA_RATIO if kind == "csa" else kc.HCA_RATIO
    d, R = kc.HEAD_DIM, len(lengths)
    cw = 2 * d if kind == "csa" else d
    S = R + 3
    slots = rng.permutation(S)[:R]
    n_ent = [L // m for L in lengths]
    need = [-(-n // epb) for n in n_ent]
    width = max(need) + 1
    nb = sum(need) + 3                                   # 3 blocks nobody owns
    perm = rng.permutation(nb)
    table = np.full((R, width), -1, np.int64)
    k = 0
    for r in range(R):
        table[r, :need[r]] = perm[k:k + need[r]]
        k += need[r]
    kv = [_rows(rng, L, cw) for L in lengths]
    z = [_rows(rng, L, cw, 2.0) for L in lengths]
    ape = _rows(rng, m, cw)
    w = (1 + 0.2 * rng.standard_normal(d)).astype(F32)
    idx = kind == "csa"
    if idx:
        ikv = [_rows(rng, L, 256) for L in lengths]
        iz = [_rows(rng, L, 256, 2.0) for L in lengths]
        iape = _rows(rng, m, 256)
        iw = (1 + 0.2 * rng.standard_normal(128)).astype(F32)
        ist = kc.DecodeStateRef.create("csa", S, 128)
    pool = _noisy_pool(rng, nb, epb, m, index=idx)
    before = pool.copy()
    st = kc.DecodeStateRef.create(kind, S, d)
    assert kc.state_clear(st, slots) == 0
    pooled = [[] for _ in range(R)]
    for t in range(max(lengths)):
        act = np.array([t < L for L in lengths])
        pick = lambda rows: np.stack([rows[r][t] if t < lengths[r]  # noqa: E731
                                      else np.zeros(rows[r].shape[1], F32) for r in range(R)])
        assert kc.state_append(st, pick(kv), pick(z), act, slots, ape) == 0
        if idx:
            assert kc.state_append(ist, pick(ikv), pick(iz), act, slots, iape) == 0
        ready = act & (st.count[slots] == m)
        if not ready.any():
            continue
        p = kc.state_pool(st, slots)
        for r in np.flatnonzero(ready):
            pooled[r].append(p[r])
        eid = np.full(R, t // m)
        entries = kc.finish_entry(p, w, eid, m)
        keys = kc.finish_index_key(kc.state_pool(ist, slots), iw, eid) if idx else None
        snap = pool.copy()
        assert kc.flush_write(pool, entries, ready, np.full(R, t), table, keys) == 0
        # each ready request wrote its own entry t // m in its own block, and
        # nothing else changed (a write into another request's block fails here)
        e = t // m
        assert _changed(snap, pool) == {(int(table[r, e // epb]), e % epb) for r in np.flatnonzero(ready)}
        if idx:
            assert kc.csa_rotate(st, ready, slots) == 0
            assert kc.csa_rotate(ist, ready, slots) == 0
        else:
            assert kc.hca_reset(st, ready, slots) == 0
    # over the whole run, request r changed exactly its entries 0 .. n_ent[r]-1
    want = {(int(table[r, e // epb]), e % epb) for r in range(R) for e in range(n_ent[r])}
    assert _changed(before, pool) == want
    comp = kc.compress_csa if idx else kc.compress_hca
    for r in range(R):
        n = n_ent[r]
        # decode-path pooling is bit-identical to the prefill pooling
        pre = comp(kv[r], z[r], ape)
        assert pre.shape == (n, d)
        if n:
            assert np.array_equal(np.stack(pooled[r]), pre)
        rows, err = kc.gather_dense(pool, table[r], n)
        assert err == 0
        ent = kc.finish_entry(pre, w, np.arange(n), m)
        assert np.array_equal(rows, kc.fp8_entry_dequantize(*kc.fp8_entry_quantize(ent)))
        for i in range(n):
            ref = _entry_f64(kv[r], z[r], ape, w, i, m, idx)
            assert _cos(rows[i], ref) >= 0.999, (r, i, _cos(rows[i], ref))
        if idx and n:
            ids = rng.integers(-1, n, (1, 5))
            got, err = kc.gather_topk(pool, table[r][None], ids, n_entries=np.array([n]))
            assert err == 0
            for j, e in enumerate(ids[0]):
                assert np.array_equal(got[0, j], rows[e] if e >= 0 else np.zeros(d))
            keys, err = kc.gather_index_keys(pool, table[r], n)
            assert err == 0
            want = kc.finish_index_key(comp(ikv[r], iz[r], iape), iw, np.arange(n))
            assert np.array_equal(keys, kc.indexer_key_dequantize(*kc.indexer_key_quantize(want)))
            for i in range(n):
                ref = _entry_f64(ikv[r], iz[r], iape, iw, i, m, True, hadamard=True)
                assert _cos(keys[i], ref) >= 0.99, (r, i, _cos(keys[i], ref))


def test_decode_simulation_csa(rng):
    lengths = [int(x) for x in rng.integers(0, 90, 5)] + [4, 3]
    _simulate(rng, "csa", lengths)


def test_decode_simulation_hca(rng):
    lengths = [int(x) for x in rng.integers(100, 700, 4)] + [128, 127]
    _simulate(rng, "hca", lengths, epb=2)
