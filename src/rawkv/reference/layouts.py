"""NVFP4 layouts reference (docs/format.md, "NVFP4: gather" and "NVFP4: scale
swizzle"): gather-dequantize of selected rows, and the 128x4 tensor-core
scale-factor layout of Blackwell block-scaled GEMMs.

Swizzled layout (cuBLAS "1D block scaling factors layout"; torchao
`to_blocked`; CUTLASS sm100_blockscaled_layout.hpp SfKMajorAtom, shape
((32,4),(16,4)) stride ((16,4),(0,1))): the (rows, cols) linear scale matrix is
zero-padded to (128*ceil(rows/128), 4*ceil(cols/4)) and cut into 128x4 tiles,
stored tile after tile in row-major tile order (tile (rb, cb) is number
rb * ceil(cols/4) + cb); inside a tile, scale (r, c) sits at byte
    (r % 32) * 16 + (r // 32) % 4 * 4 + c % 4.
"""
from __future__ import annotations

import math

import numpy as np

from .nvfp4 import BLOCK, F32, dequantize

TILE_ROWS = 128
TILE_COLS = 4
TILE_BYTES = TILE_ROWS * TILE_COLS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the swizzled layout of a (rows, cols) scale matrix."""
    return _cdiv(rows, TILE_ROWS) * _cdiv(cols, TILE_COLS) * TILE_BYTES


def swizzle_offsets(rows: int, cols: int) -> np.ndarray:
    """(rows, cols) int64: the byte offset of each linear scale in the swizzled buffer."""
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    ncb = _cdiv(cols, TILE_COLS)
    tile = (r // TILE_ROWS) * ncb + c // TILE_COLS
    rr = r % TILE_ROWS
    return tile * TILE_BYTES + (rr % 32) * 16 + (rr // 32) * 4 + c % TILE_COLS


def swizzle_scales(sf) -> np.ndarray:
    """Linear (..., cols) scales (leading dims flattened into rows) -> 1-D
    swizzled uint8 buffer of swizzled_size(rows, cols) bytes; padding is 0."""
    sf = np.asarray(sf, dtype=np.uint8)
    if sf.ndim < 1:
        raise ValueError("sf: expected at least 1 dimension")
    sf2 = sf.reshape(math.prod(sf.shape[:-1]), sf.shape[-1])     # (-1, 0) is ambiguous to numpy
    rows, cols = sf2.shape
    out = np.zeros(swizzled_size(rows, cols), dtype=np.uint8)
    out[swizzle_offsets(rows, cols)] = sf2
    return out


def unswizzle_scales(sw, rows: int, cols: int) -> np.ndarray:
    """Swizzled buffer -> linear (rows, cols) uint8 scales (padding dropped)."""
    sw = np.asarray(sw, dtype=np.uint8).reshape(-1)
    if sw.size != swizzled_size(rows, cols):
        raise ValueError(f"sf: expected {swizzled_size(rows, cols)} swizzled bytes for "
                         f"({rows}, {cols}) scales, got {sw.size}")
    return sw[swizzle_offsets(rows, cols)]


def gather(q, sf, gs, indices, dtype: str = "bfloat16"):
    """Dequantize the rows `indices` of a 2-D NVFP4 tensor (q (M, N/2),
    sf (M, N/16), gs scalar or (M,)) -> (out (len(indices), N), errors).

    An index outside [0, M) (negative ones included: there is no Python-style
    wrap-around) is not read: that output row is zeros, and it is counted in
    `errors` (an int). With N = 0 nothing is read and nothing counted (on a
    GPU no kernel runs for an empty output)."""
    q = np.asarray(q, dtype=np.uint8)
    sf = np.asarray(sf, dtype=np.uint8)
    idx = np.asarray(indices).astype(np.int64).reshape(-1)
    m, n = q.shape[0], q.shape[1] * 2
    g = np.asarray(gs, dtype=F32)
    out = np.zeros((idx.size, n), dtype=np.float16 if dtype == "float16" else F32)
    ok = (idx >= 0) & (idx < m)
    if n == 0:
        return out, 0
    sel = idx[ok]
    if sel.size:
        gsel = g[sel] if g.ndim else g
        out[ok] = dequantize(q[sel], sf[sel], gsel, dtype)
    return out, int((~ok).sum())


__all__ = ["BLOCK", "TILE_ROWS", "TILE_COLS", "swizzled_size", "swizzle_offsets",
           "swizzle_scales", "unswizzle_scales", "gather"]
