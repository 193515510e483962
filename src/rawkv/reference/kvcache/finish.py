"""From a pooled row to a finished (BF16) cache entry or indexer key:
RMSNorm, RoPE at the entry's position, the indexer's Hadamard rotation."""
from __future__ import annotations

import math

import numpy as np

from ..formats import bf16_round
from ._checks import _f32, _ints
from .constants import (
    COMPRESS_ROPE_THETA, CSA_RATIO, DSV4_YARN, INDEX_HEAD_DIM, RMS_EPS, ROPE_DIM, YarnConfig,
)


def rmsnorm(x, weight, eps: float = RMS_EPS) -> np.ndarray:
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last axis.

    x: (..., d); weight: (d,). The mean of squares is accumulated in float64
    and the reciprocal root rounded once to float32; the two products are
    float32, in the order (x * r) * weight, as in the DeepSeek-V4 reference.
    """
    x = _f32("x", x)
    weight = _f32("weight", weight, last=x.shape[-1], ndim=1)
    ms = np.mean(np.square(x.astype(np.float64)), axis=-1, keepdims=True)
    r = (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    return (x * r) * weight


def _real(name: str, v) -> float:
    """A real number (Python or numpy; not a bool, a string or an array), as
    a Python float."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:       # a Python int beyond the double range
        return math.inf


def _finite_at_least(name: str, v, lo: float, strict: bool, why: str) -> float:
    f = _real(name, v)
    # (comparisons only, NaN failing them: under torch.compile(dynamic=True)
    # a number is a SymFloat, which math.isfinite cannot take, a graph break)
    if not (lo <= f < math.inf) or (strict and f == lo):
        raise ValueError(f"{name}: expected a finite number {'>' if strict else '>='} {lo:g} ({why}), "
                         f"got {v!r}")
    return f


def check_rope(theta, yarn):
    """The RoPE parameters of the compressor, checked (docs/kvcache.md,
    "RoPE parameters"): every path (the reference, the CPU and CUDA ops, the
    operators) calls this before anything is computed or written. Returns
    (theta as a float, yarn as given).

    theta: finite and > 1 (inv_freq = theta^(-2k/d) must fall with k; YaRN
        divides by ln theta). yarn: None (plain RoPE) or a YarnConfig with
        factor finite and >= 1 (a context extension: frequencies are divided
        by it), original_seq_len a positive integer, beta_fast >= beta_slow
        > 0, both finite (rotation counts: corr_dim takes their log).
    A bool is not a number here. TypeError / ValueError naming the field."""
    t = _finite_at_least("theta", theta, 1.0, True, "the RoPE base")
    if yarn is None:
        return t, None
    if not isinstance(yarn, YarnConfig):
        raise TypeError(f"yarn: expected a rawkv.reference.kvcache.YarnConfig or None, got "
                        f"{type(yarn).__name__}")
    _finite_at_least("yarn.factor", yarn.factor, 1.0, False, "the context extension factor")
    n = yarn.original_seq_len
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"yarn.original_seq_len: expected an int, got {type(n).__name__}")
    if n <= 0:
        raise ValueError(f"yarn.original_seq_len: expected a positive int, got {n}")
    slow = _finite_at_least("yarn.beta_slow", yarn.beta_slow, 0.0, True, "a rotation count")
    _finite_at_least("yarn.beta_fast", yarn.beta_fast, slow, False, "at least beta_slow")
    return t, yarn          # as given: no new object (torch.compile traces this check)


def rope_inv_freq(rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
                  yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """(rope_dim // 2,) float32 inverse frequencies theta^(-2k/rope_dim),
    with YaRN interpolation when `yarn` is given (DeepSeek-V4
    precompute_freqs_cis: dims rotating faster than beta_fast turns over the
    original context keep their frequency, those slower than beta_slow are
    divided by `factor`, linear ramp between). Computed in float64, rounded
    once. theta and yarn: check_rope's rules."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim: expected a positive even number, got {rope_dim}")
    theta, yarn = check_rope(theta, yarn)
    k = np.arange(0, rope_dim, 2, dtype=np.float64)
    inv = 1.0 / (float(theta) ** (k / rope_dim))
    if yarn is not None:
        def corr_dim(n_rot):
            return (rope_dim * math.log(yarn.original_seq_len / (n_rot * 2 * math.pi))
                    / (2 * math.log(theta)))
        low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rope_dim // 2) - low) / (high - low), 0.0, 1.0)
        smooth = 1.0 - ramp
        inv = inv / yarn.factor * (1.0 - smooth) + inv * smooth
    return inv.astype(np.float32)


def rope_cos_sin(positions, rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
                 yarn: YarnConfig | None = DSV4_YARN):
    """cos, sin tables: (..., rope_dim // 2) float32 for integer positions
    (...). Angle = position * inv_freq (float32 inv_freq, product and cos/sin
    in float64, rounded once). Kernels should read this host-built table."""
    pos = _ints("positions", positions).astype(np.float64)
    ang = pos[..., None] * rope_inv_freq(rope_dim, theta, yarn).astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x, positions, rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
               yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """Rotate the last `rope_dim` dims of x (..., D) at `positions` (...).

    Interleaved pairs (GPT-J style, the DeepSeek reference's view_as_complex
    of (..., 32, 2)): pair k = dims (D - rope_dim + 2k, D - rope_dim + 2k + 1),
        even' = even*cos - odd*sin,  odd' = odd*cos + even*sin   (float32).
    Other dims are copied unchanged. Returns a new float32 array.
    """
    x = _f32("x", x)
    if rope_dim > x.shape[-1]:
        raise ValueError(f"x: last dimension {x.shape[-1]} is smaller than rope_dim {rope_dim}")
    pos = _ints("positions", positions)
    if pos.shape != x.shape[:-1]:
        raise ValueError(f"positions: expected shape {x.shape[:-1]}, got {pos.shape}")
    cos, sin = rope_cos_sin(pos, rope_dim, theta, yarn)
    y = x.copy()
    r = x[..., x.shape[-1] - rope_dim:]
    ev, od = r[..., 0::2], r[..., 1::2]
    y[..., x.shape[-1] - rope_dim::2] = ev * cos - od * sin
    y[..., x.shape[-1] - rope_dim + 1::2] = od * cos + ev * sin
    return y


def hadamard_matrix(n: int = INDEX_HEAD_DIM) -> np.ndarray:
    """Sylvester-ordered Walsh-Hadamard matrix H[i, j] = (-1)^popcount(i & j),
    float64, unnormalized (the ordering of fast_hadamard_transform)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return np.where(parity == 1, -1.0, 1.0)


def hadamard_rotate(x) -> np.ndarray:
    """Normalized Walsh-Hadamard transform over the last axis (power of two,
    128 for the indexer key): y = x @ H / sqrt(n). H is symmetric and
    orthonormal after scaling, so the transform is its own inverse.
    Computed in float64, rounded once to float32."""
    x = _f32("x", x)
    n = x.shape[-1]
    h = hadamard_matrix(n)
    return ((x.astype(np.float64) @ h) * (1.0 / math.sqrt(n))).astype(np.float32)


def entry_position(entry_ids, m: int) -> np.ndarray:
    """RoPE position of compressed entry i: i * m, the first token of its
    window (DeepSeek reference freqs_cis[start_pos + 1 - m]; vLLM
    (position // m) * m)."""
    return _ints("entry_ids", entry_ids) * m


def finish_entry(pooled, norm_weight, entry_ids, m: int, *, eps: float = RMS_EPS,
                 rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
                 yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """Pooled (n, 512) -> cache entry (n, 512) BF16 values: RMSNorm, RoPE on
    the last 64 dims at entry_position(entry_ids, m), one BF16 rounding."""
    y = rmsnorm(pooled, norm_weight, eps)
    y = apply_rope(y, entry_position(entry_ids, m), rope_dim, theta, yarn)
    return bf16_round(y)


def finish_index_key(pooled, norm_weight, entry_ids, m: int = CSA_RATIO, *,
                     eps: float = RMS_EPS, rope_dim: int = ROPE_DIM,
                     theta: float = COMPRESS_ROPE_THETA,
                     yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """Pooled (n, 128) indexer rows -> indexer key (n, 128) BF16 values:
    RMSNorm, RoPE (last 64 dims), Hadamard rotation of all 128 dims, BF16."""
    y = rmsnorm(pooled, norm_weight, eps)
    y = apply_rope(y, entry_position(entry_ids, m), rope_dim, theta, yarn)
    return bf16_round(hadamard_rotate(y))
