"""The tensor-core scale layout: rawkv.nvfp4.swizzle_scales and
unswizzle_scales (docs/format.md, "NVFP4: scale swizzle")."""
from __future__ import annotations

import math

import numpy as np

from . import _rules as C
from ._geometry import BLOCK_THREADS
from .. import _args as A
from .._op import empty, op
from ..kernels import nvfp4 as K
from ..reference import layouts as ref_layouts
from ..runtime import get_runtime

__all__ = ["swizzle_scales", "unswizzle_scales", "swizzled_size"]       # the family's API (rawkv.nvfp4 exports it)


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the 128x4-tile layout of (rows, cols) scales: non-negative
    ints (-200 gave -1024 and 1.5 gave 1024.0)."""
    return ref_layouts.swizzled_size(C.size(rows, "rows"), C.size(cols, "cols"))


def swizzle_scales(sf, *, out=None, stream=None):
    """Linear scales (..., cols) (leading dims flattened into rows;
    contiguous) -> the 1-D tensor-core layout of swizzled_size(rows, cols)
    bytes (zero padding)."""
    if out is None:
        s = A.out_lead(sf, "sf")      # (as the rules read sf: a layout they refuse names sf before out is sized)
        out = empty(sf, (ref_layouts.swizzled_size(math.prod(s[:-1]), s[-1]) if s else 0,), "uint8", stream)
    _swizzle(sf, out, stream)
    return A.as_sf(out)


def unswizzle_scales(sw, shape, *, out=None, stream=None):
    """Tensor-core layout (contiguous, 16-byte aligned) -> linear scales of
    `shape` (..., cols)."""
    shape = C.linear_shape(shape, out)
    if out is None:
        _check_size(sw, shape)        # before allocating: (10**13, 4) was a MemoryError
        out = empty(sw, shape, "uint8", stream)
    _unswizzle(sw, out, stream)
    return A.as_sf(out)


@op("nvfp4_swizzle_scales", "Tensor sf, Tensor(a!) out")
def _swizzle(sf, out, stream=None):
    """rawkv::nvfp4_swizzle_scales: sf in the tensor-core layout, into out."""
    where, sf, rows, cols, out = _swizzle_arguments(sf, out)
    if where == "cpu":
        A.from_numpy(ref_layouts.swizzle_scales(A.to_numpy(sf, "sf")), sf, out=out)
        return
    size = out.numel()
    if size:
        rt = get_runtime(sf.get_device())
        nwords = size // 4
        grid, block = rt.grid_stride(nwords, BLOCK_THREADS)
        K.SWIZZLE.launch(rt, (grid,), (block,), stream=stream, sf=sf, out=out, rows=rows, cols=cols,
                         ncb=-(-cols // 4), nwords=nwords)


@op("nvfp4_unswizzle_scales", "Tensor sw, Tensor(a!) out")
def _unswizzle(sw, out, stream=None):
    """rawkv::nvfp4_unswizzle_scales: the linear scales of sw into out,
    whose shape is the linear shape."""
    where, sw, rows, cols, out = _unswizzle_arguments(sw, out)
    if where == "cpu":
        A.from_numpy(ref_layouts.unswizzle_scales(A.to_numpy(sw, "sw"), rows, cols).reshape(out.shape), sw,
                     out=out)
        return
    if rows * cols:
        rt = get_runtime(sw.get_device())
        ncb = -(-cols // 4)
        grid, block = rt.grid_stride(rows * ncb, BLOCK_THREADS)
        K.UNSWIZZLE.launch(rt, (grid,), (block,), stream=stream, sw=sw, sf=out, rows=rows, cols=cols, ncb=ncb)


def _swizzle_arguments(sf, out):
    """(where, sf, rows, cols, out) of rawkv::nvfp4_swizzle_scales."""
    where = A.placement(("sf", sf), ("out", out))
    A.check_outputs((("out", out),), (("sf", sf),))
    sf = A.tensor(sf, "sf", A.BYTES, where, min_ndim=1)
    rows, cols = math.prod(sf.shape[:-1]), sf.shape[-1]
    size = ref_layouts.swizzled_size(rows, cols)
    out = A.tensor(out, "out", A.BYTES, where, shape=(size,), device=A.device_of(sf), align=16)
    return where, sf, rows, cols, out


def _check_size(sw, shape) -> None:
    """sw holds the swizzled bytes of linear scales of `shape` (a sw
    without a size is left to the op's own checks)."""
    n = A.numel(sw) if isinstance(sw, np.ndarray) or A.is_torch(sw) else None
    size = ref_layouts.swizzled_size(math.prod(shape[:-1]), shape[-1])
    if n is not None and n != size:
        raise ValueError(f"sw: expected {size} bytes for scales of shape {tuple(shape)}, got {n}")


def _unswizzle_arguments(sw, out):
    """(where, sw, rows, cols, out) of rawkv::nvfp4_unswizzle_scales: the
    linear shape is out's."""
    where = A.placement(("sw", sw), ("out", out))
    A.check_outputs((("out", out),), (("sw", sw),))
    sw = A.tensor(sw, "sw", A.BYTES, where, align=16)
    out = A.tensor(out, "out", A.BYTES, where, min_ndim=1, device=A.device_of(sw))
    _check_size(sw, tuple(out.shape))
    return where, sw, math.prod(out.shape[:-1]), out.shape[-1], out
