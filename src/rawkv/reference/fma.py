"""A correctly rounded float32 fused multiply-add in numpy (which has none).

fma_f32(a, b, c) = the float32 nearest a * b + c computed exactly (ties to
even): the bits of CUDA's fmaf / __fmaf_rn, so a reference written with it
and a kernel written with fmaf give the same bits.

How: a * b of two float32 values is exact in float64 (at most 48 significant
bits, exponents far inside float64's range). The sum with c is then one
float64 addition, whose exact error TwoSum recovers. Rounding that sum to
float64 and then to float32 could round twice (a float32 tie broken the wrong
way), so the float64 sum is taken rounded to odd (the truncated sum with its
last bit set when it is inexact): with at least two more bits than float32,
a round-to-odd intermediate rounds to float32 as the exact value would
(Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
algorithms using rounding to odd", IEEE Trans. Computers 57(4), 2008).
Infinities and NaN propagate as IEEE fma does for finite a * b; a * b
infinite (an infinite operand) is computed as float64 a * b + c, which is
what fma gives there too (no finite product can overflow float64).
"""
from __future__ import annotations

import numpy as np


def fma_f32(a, b, c) -> np.ndarray:
    """float32 round-to-nearest-even of a * b + c, exact (see the module)."""
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    b64 = np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        p = a64 * b64                                  # exact (finite operands)
        s = p + c64                                    # float64, rounded to nearest
        bb = s - p                                     # TwoSum (Knuth): p + c = s + err exactly
        err = (p - (s - bb)) + (c64 - bb)
        inexact = np.isfinite(s) & (err != 0)
        # s truncated toward zero: s itself where the exact sum lies beyond it
        # (err of s's sign), else the float64 next to s toward zero.
        trunc = np.where(np.signbit(err) == np.signbit(s), s, np.nextafter(s, 0.0))
        odd = (np.asarray(trunc, dtype=np.float64).view(np.int64) | 1).view(np.float64)
        return np.where(inexact, odd, s).astype(np.float32)
