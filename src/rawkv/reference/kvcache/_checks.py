"""Argument checks of the reference functions (docs/format.md: name the argument,
write nothing)."""
from __future__ import annotations

import numpy as np


def _f32(name: str, x, last: int | None = None, ndim: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a real numeric array, got dtype {a.dtype}")
    a = a.astype(np.float32, copy=False)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if a.ndim == 0:
        raise ValueError(f"{name}: expected an array, got a scalar")
    if last is not None and a.shape[-1] != last:
        raise ValueError(f"{name}: last dimension must be {last}, got shape {a.shape}")
    return a


def _ints(name: str, x, ndim: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    return a.astype(np.int64)


def _mask(name: str, x, n: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.bool_:
        raise TypeError(f"{name}: expected a bool array, got dtype {a.dtype}")
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
    return a
