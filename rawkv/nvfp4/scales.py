"""The tensor-core scale layout: rawkv.nvfp4.swizzle_scales and
unswizzle_scales (docs/format.md, "NVFP4: scale swizzle")."""
from __future__ import annotations

import math
import operator

import numpy as np

from . import _checks as C
from ._geometry import BLOCK_THREADS
from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import nvfp4 as K
from ..reference import layouts as ref_layouts
from ..runtime import get_runtime


def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the 128x4-tile layout of (rows, cols) scales: non-negative
    ints (-200 gave -1024 and 1.5 gave 1024.0)."""
    return ref_layouts.swizzled_size(_size(rows, "rows"), _size(cols, "cols"))


def _size(v, name: str) -> int:
    """A size argument: an int (Python, numpy or anything with __index__,
    not a bool) >= 0, as a Python int."""
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {v!r}")
    try:
        v = operator.index(v)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {v!r}") from None
    if v < 0:
        raise ValueError(f"{name}: expected a size >= 0, got {v}")
    return v


def swizzle_scales(sf, *, out=None, stream=None):
    """Linear scales (..., cols) (leading dims flattened into rows) -> the 1-D
    tensor-core layout of swizzled_size(rows, cols) bytes (zero padding)."""
    if D.compiling():
        return _traced(SWIZZLE_OP, out, (ref_layouts.swizzled_size(math.prod(sf.shape[:-1]), sf.shape[-1]),),
                       sf=sf)
    where = D.placement(("sf", sf), ("out", out))
    A.check_outputs((("out", out),), (("sf", sf),))
    if where == "cpu":
        A.check_cpu_array(A.require_array(sf, "sf"), "sf", C.BYTES)
        sfa = D.to_numpy(sf, "sf")
        if sfa.ndim == 0:
            raise ValueError("sf: expected at least 1 dimension")
        C.check_cpu_out(out, "out", C.BYTES, (swizzled_size(math.prod(sfa.shape[:-1]), sfa.shape[-1]),))
        sw = ref_layouts.swizzle_scales(sfa)
        return C.cpu_result(D.from_numpy(sw, sf, torch_dtype=C.cpu_byte_dtype("sf"), out=out), C.as_sf)
    dt = A.dtypes()
    sf = C.cuda_array(sf, "sf")
    A.check_tensor(sf, "sf", dt.bytes)
    if sf.dim() == 0:
        raise ValueError("sf: expected at least 1 dimension")
    cols = sf.shape[-1]
    rows = math.prod(sf.shape[:-1])
    size = swizzled_size(rows, cols)
    dev = sf.get_device()
    if out is not None:
        out = C.check_out(out, "out", dt.bytes, (size,), dev, align=16)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty((size,), dt.bytes[0], stream=stream)
    if size:
        nwords = size // 4
        grid, block = rt.grid_stride(nwords, BLOCK_THREADS)
        K.SWIZZLE.launch(rt, (grid,), (block,), stream=stream, sf=sf, out=out, rows=rows, cols=cols,
                         ncb=-(-cols // 4), nwords=nwords)
    return C.as_sf(out)


def unswizzle_scales(sw, shape, *, out=None, stream=None):
    """Tensor-core layout -> linear scales of `shape` (..., cols)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape: expected a sequence of ints, got {shape!r}")
    shape = tuple(_size(s, "shape") for s in shape)         # 2.5 was taken as 2
    if not shape:
        raise ValueError("shape: expected at least 1 dimension")
    if D.compiling():
        return _traced(UNSWIZZLE_OP, out, shape, sw=sw)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    size = swizzled_size(rows, cols)
    where = D.placement(("sw", sw), ("out", out))
    A.check_outputs((("out", out),), (("sw", sw),))
    if where == "cpu":
        A.check_cpu_array(A.require_array(sw, "sw"), "sw", C.BYTES)
        swa = D.to_numpy(sw, "sw")
        if swa.size != size:
            raise ValueError(f"sw: expected {size} bytes for scales of shape {shape}, got {swa.size}")
        C.check_cpu_out(out, "out", C.BYTES, shape)
        lin = ref_layouts.unswizzle_scales(swa, rows, cols).reshape(shape)
        return C.cpu_result(D.from_numpy(lin, sw, torch_dtype=C.cpu_byte_dtype("sf"), out=out), C.as_sf)
    dt = A.dtypes()
    sw = C.cuda_array(sw, "sw")
    A.check_tensor(sw, "sw", dt.bytes)
    if sw.numel() != size:
        raise ValueError(f"sw: expected {size} bytes for scales of shape {shape}, got {sw.numel()}")
    if size:
        A.check_aligned("sw", sw)
    dev = sw.get_device()
    if out is not None:
        out = C.check_out(out, "out", dt.bytes, shape, dev)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty(shape, dt.bytes[0], stream=stream)
    if rows * cols:
        ncb = -(-cols // 4)
        grid, block = rt.grid_stride(rows * ncb, BLOCK_THREADS)
        K.UNSWIZZLE.launch(rt, (grid,), (block,), stream=stream, sw=sw, sf=out, rows=rows, cols=cols, ncb=ncb)
    return C.as_sf(out)


def _traced(op, out, shape, **inputs):
    """Under torch.compile: allocate out as the eager path does (uint8 bytes
    seen as FP8 scales) and call the rawkv:: operator, which dynamo can trace."""
    import torch
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=next(iter(inputs.values())).device)
    op.call(torch, **inputs, out=out)
    return C.as_sf(out)


def _unswizzle_op(sw, out):
    """rawkv::nvfp4_unswizzle_scales: the linear shape is out's."""
    unswizzle_scales(sw, out.shape, out=out)


SWIZZLE_OP = OpDecl("nvfp4_swizzle_scales", swizzle_scales, "Tensor sf, Tensor(a!) out")
UNSWIZZLE_OP = OpDecl("nvfp4_unswizzle_scales", _unswizzle_op, "Tensor sw, Tensor(a!) out")
