"""rawkv.reference.fma.fma_f32, the correctly rounded float32 fused
multiply-add that rawkv's float32 exp is written with (the kernels' fmaf):
against exact rational arithmetic rounded once to float32 (ties to even),
on random bit patterns, near-ties where rounding the float64 sum first would
break the tie the wrong way, cancellations, and subnormal results."""
from fractions import Fraction

import numpy as np

from rawkv.reference.fma import fma_f32

F32 = np.float32


def _f32_of(q: Fraction) -> float:
    """q rounded to the nearest float32 (ties to even), as a Python float."""
    if q == 0:
        return 0.0
    neg, q = q < 0, abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    m = q / ulp
    whole, rest = divmod(m.numerator, m.denominator)
    if 2 * rest > m.denominator or (2 * rest == m.denominator and whole % 2):
        whole += 1
    v = whole * ulp
    r = float("inf") if v >= Fraction(2) ** 128 else float(v)
    return -r if neg else r


def _check(a, b, c):
    got = fma_f32(a, b, c)
    for x, y, z, g in zip(a, b, c, got):
        want = _f32_of(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        assert float(g) == want, (x, y, z, float(g), want)
        if want != 0:
            assert np.signbit(g) == (want < 0)


def _finite_bits(rng, n):
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    return np.where(np.isfinite(x), x, F32(1.5))


def test_random_bit_patterns(rng):
    _check(_finite_bits(rng, 3000), _finite_bits(rng, 3000), _finite_bits(rng, 3000))


def test_operands_of_similar_size(rng):
    n = 3000
    _check((rng.standard_normal(n) * 4).astype(F32), rng.standard_normal(n).astype(F32),
           (rng.standard_normal(n) * 4).astype(F32))


def test_near_ties_need_round_to_odd(rng):
    """(1 + i 2^-12)(1 + j 2^-12) = 1 + (i + j) 2^-12 + i j 2^-24 lies on a
    float32 tie whenever i j is odd; a c far below it must break the tie,
    which a float64 sum rounded to nearest then to float32 loses."""
    n = 3000
    i, j = rng.integers(1, 4096, n), rng.integers(1, 4096, n)
    a, b = (1 + i * 2.0**-12).astype(F32), (1 + j * 2.0**-12).astype(F32)
    tiny = (rng.choice([-1.0, 1.0], n) * 2.0 ** rng.integers(-140, -30, n)).astype(F32)
    _check(a, b, tiny)
    _check(a, b, np.zeros(n, F32))
    _check(a, b, -(a.astype(np.float64) * b).astype(F32))      # the product's rounding error
    # the naive double rounding really differs on such inputs (the test can fail)
    naive = (a.astype(np.float64) * b + tiny).astype(F32)
    assert (naive != fma_f32(a, b, tiny)).any()


def test_subnormal_results_and_special_values(rng):
    n = 2000
    _check((rng.standard_normal(n) * 1e-20).astype(F32), (rng.standard_normal(n) * 1e-20).astype(F32),
           (rng.standard_normal(n) * 1e-39).astype(F32))
    big = np.array([3e38, -3e38, 1.0, 0.0, -0.0], F32)
    out = fma_f32(big, np.array([2.0, 2.0, np.inf, 5.0, 5.0], F32), np.array([0, 0, 1, -0.0, -0.0], F32))
    assert out[0] == np.inf and out[1] == -np.inf and out[2] == np.inf
    assert out[3] == 0 and not np.signbit(out[3]) and out[4] == 0 and np.signbit(out[4])
    assert np.isnan(fma_f32(F32(np.nan), F32(1), F32(1))) and np.isnan(fma_f32(F32(np.inf), F32(0), F32(1)))
