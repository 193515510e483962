"""Element formats (docs/format.md section 1): E2M1, E4M3, BF16 rounding.

All functions take and return numpy arrays. Values are float32; codes are
uint8. BF16 values are represented as float32 arrays holding exactly
BF16-representable numbers (numpy has no bfloat16).
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_NAN = 0x7F

#: Signed E2M1 value table indexed by the 4-bit code (sign << 3 | index).
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    vals = (sign * mag).astype(np.float32)
    vals[(codes & 0x7F) == 0x7F] = np.nan
    return vals


_E4M3_TABLE = _e4m3_table()


def e4m3_decode(codes) -> np.ndarray:
    """E4M3 (float8_e4m3fn) byte -> float32. 0x7F and 0xFF decode to NaN."""
    return _E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x) -> np.ndarray:
    """float32 -> E4M3 byte: round to nearest even, saturate finite and
    infinite values to +-448 (satfinite), keep subnormals, NaN -> 0x7F."""
    x = _f32(x)
    sign = np.signbit(x).astype(np.uint8) << 7
    # float64 holds every float32 exactly; the scalings below are by powers
    # of two, so np.rint (ties to even) sees the exact quotient.
    # NaN (signalling ones too) is replaced before the cast and patched to
    # 0x7F at the end.
    finite_or_inf = np.where(np.isnan(x), np.float32(0), x)
    a = np.minimum(np.abs(finite_or_inf.astype(np.float64)), E4M3_MAX)
    with np.errstate(invalid="ignore", divide="ignore"):
        # Subnormal range (a < 2^-6): code = a / 2^-9, and the rounded value 8
        # is exactly the first normal code (exponent 1, mantissa 0).
        sub = np.rint(a * 2.0 ** 9)
        _, k = np.frexp(np.where(a >= 2.0 ** -6, a, 1.0))
        e = k - 1                                   # a = 1.f * 2^e
        m = np.rint(a / np.ldexp(1.0, e - 3))       # 8..16
        carry = m >= 16
        e = np.where(carry, e + 1, e)
        m = np.where(carry, 8, m)
        normal = ((e + 7) << 3) | (m.astype(np.int64) - 8)
    code = np.where(a < 2.0 ** -6, sub, normal).astype(np.uint8)
    code = code | sign
    return np.where(np.isnan(x), np.uint8(E4M3_NAN), code).astype(np.uint8)


def e2m1_encode(v) -> np.ndarray:
    """float32 -> 4-bit E2M1 code (in a uint8), round to nearest even,
    saturating at 6. The sign is kept (-0.1 -> 0x8). NaN -> sign | 0 (the
    NVFP4 quantizer never encodes NaN: such blocks are flagged instead)."""
    v = _f32(v)
    a = np.abs(v)
    # Alternating strict / non-strict thresholds give ties-to-even: the
    # midpoints 0.25, 1.25, 2.5, 5 go down to the even code, 0.75, 1.75, 3.5 up.
    idx = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return (idx.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)).astype(np.uint8)


def e2m1_decode(codes) -> np.ndarray:
    """4-bit E2M1 code -> float32 value."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def bf16_bits(x) -> np.ndarray:
    """float32 -> BF16 bit pattern (uint16), round to nearest even.
    NaN stays NaN (quiet, sign kept)."""
    u = _f32(x).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(_f32(x))
    qnan = ((u >> 16) | 0x40).astype(np.uint16)
    return np.where(nan, qnan, r).astype(np.uint16)


def bf16_round(x) -> np.ndarray:
    """float32 -> float32 holding the nearest BF16 value (ties to even)."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def round_to_dtype(x, dtype: str) -> np.ndarray:
    """Round float32 values to the output dtype of a decode: 'bfloat16'
    (returned as float32 holding BF16 values), 'float16' or 'float32'."""
    x = _f32(x)
    if dtype == "bfloat16":
        return np.asarray(bf16_round(x))        # (a 0-d x: bf16_round's shift gives a NumPy scalar)
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "float32":
        return x
    raise ValueError(f"dtype: expected 'bfloat16', 'float16' or 'float32', got {dtype!r}")
