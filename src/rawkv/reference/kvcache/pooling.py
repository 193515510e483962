"""Softmax pooling of token rows into compressed entries (CSA with the
overlapping b-half of the previous window, HCA over one window)."""
from __future__ import annotations

import numpy as np

from ._checks import _f32
from .constants import CSA_RATIO, HCA_RATIO, Z_EMPTY


def _softmax_pool(values: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Per-channel softmax over the token axis (-2), then the weighted sum.

    values, scores: (..., R, d) float32 -> (..., d) float32.
    float32 throughout; exp is taken in float64 and rounded once so the
    result does not depend on numpy's SIMD/scalar exp paths; sums run over
    the R rows in order. A column whose scores are all -inf gives NaN
    (never happens for a full window: the a-stream is finite).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        mx = scores.max(axis=-2, keepdims=True)
        e = np.exp((scores - mx).astype(np.float64)).astype(np.float32)
        w = e / e.sum(axis=-2, keepdims=True, dtype=np.float32)
        return (w * values).sum(axis=-2, dtype=np.float32)


def _add_ape(z: np.ndarray, ape, m: int) -> np.ndarray:
    """z (T, w) + ape[t mod m]: the learned position bias of the gate."""
    if ape is None:
        return z
    ape = _f32("ape", ape, last=z.shape[-1], ndim=2)
    if ape.shape[0] != m:
        raise ValueError(f"ape: expected shape ({m}, {z.shape[-1]}), got {ape.shape}")
    return z + ape[np.arange(z.shape[0]) % m]


def _check_rows(kv, z):
    kv = _f32("kv", kv, ndim=2)
    z = _f32("z", z, ndim=2)
    if z.shape != kv.shape:
        raise ValueError(f"z: expected the shape of kv {kv.shape}, got {z.shape}")
    return kv, z


def compress_csa(kv, z, ape=None, m: int = CSA_RATIO) -> np.ndarray:
    """CSA pooling of a token sequence that starts at position 0.

    kv, z: (T, 2*d) per-token value and gate rows. Channel layout of a row:
        [:d]  b-half: pooled into the entry of the NEXT window (overlap)
        [d:]  a-half: pooled into the entry of its own window
    ape: (m, 2*d) or None; ape[t mod m] is added to z_t (pass None when z
        already holds it).
    Returns (T // m, d) float32 pooled entries, before RMSNorm. Entry i pools
    2m scores per channel with one softmax, in this row order:
        b-half of tokens of window i-1 (all -inf / 0 for i = 0), then
        a-half of tokens of window i.
    A trailing partial window (T % m tokens) is not pooled (it lives in the
    decode tail state).
    """
    kv, z = _check_rows(kv, z)
    if kv.shape[1] % 2:
        raise ValueError(f"kv: CSA rows have width 2*d, got odd width {kv.shape[1]}")
    T, w = kv.shape
    d = w // 2
    z = _add_ape(z, ape, m)
    n = T // m
    kv = kv[: n * m].reshape(n, m, w)
    z = z[: n * m].reshape(n, m, w)
    b_kv = np.zeros((n, m, d), np.float32)
    b_z = np.full((n, m, d), Z_EMPTY, np.float32)
    b_kv[1:] = kv[:-1, :, :d]
    b_z[1:] = z[:-1, :, :d]
    values = np.concatenate([b_kv, kv[:, :, d:]], axis=1)
    scores = np.concatenate([b_z, z[:, :, d:]], axis=1)
    return _softmax_pool(values, scores)


def compress_hca(kv, z, ape=None, m: int = HCA_RATIO) -> np.ndarray:
    """HCA pooling of a token sequence that starts at position 0.

    kv, z: (T, d); ape: (m, d) or None. Returns (T // m, d) float32: entry i
    is the per-channel softmax(z) weighted sum over the m tokens of window i.
    """
    kv, z = _check_rows(kv, z)
    T, d = kv.shape
    z = _add_ape(z, ape, m)
    n = T // m
    return _softmax_pool(kv[: n * m].reshape(n, m, d), z[: n * m].reshape(n, m, d))
