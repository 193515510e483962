"""The CPU path's results: the reference's numpy arrays returned in the
library of the input (numpy, or CPU torch tensors of the dtypes the CUDA
path returns), or copied into out= buffers once every one is checked."""
from __future__ import annotations

import sys

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from ..nvfp4.activation import QuantizedActivation
from . import _rules as R


def torch_dtype(name):
    """torch.<name> when torch is imported and has it, else None."""
    t = sys.modules.get("torch")
    return getattr(t, name, None) if t is not None else None


def check_outs(specs) -> None:
    """Every out= buffer's dtype and shape, before any is written: specs
    are (name, result array, out or None, allowed dtype names)."""
    for name, arr, o, dts in specs:
        if o is not None:
            A.check_cpu_array(o, name, dts, np.shape(arr))


def put(arr, like, out, torch_dt=None):
    """`arr` in the library of `like` (numpy, or CPU torch with `torch_dt`),
    or copied into `out` (checked by check_outs). Keeps 0-d shapes."""
    arr = np.array(arr)                                    # a copy; 0-d stays 0-d
    if out is not None and isinstance(out, np.ndarray):
        out[...] = arr
        return out
    if out is None and not D.is_torch(like):
        return arr
    import torch
    t = torch.from_numpy(arr)
    if torch_dt is not None and t.dtype != torch_dt:
        t = t.view(torch_dt) if t.dtype == torch.uint8 else t.to(torch_dt)
    if out is None:
        return t
    if out.dtype != t.dtype and out.element_size() == t.element_size() == 1:
        out.view(torch.uint8).copy_(t.view(torch.uint8))
    else:
        out.copy_(t)
    return out


def activation(like, scope, q, sf, g, inv, out_q, out_sf, out_gs, out_inv) -> QuantizedActivation:
    """A producer's QuantizedActivation from the reference's (q, sf, gs,
    inv_rms) for rows `lead = q.shape[:-1]`."""
    lead = q.shape[:-1]
    g = np.asarray(g, np.float32).reshape(R.gs_shape(scope, lead, out_gs))
    check_outs((("out.q", q, out_q, R.OUT_Q), ("out.sf", sf, out_sf, R.OUT_SF),
                ("out.gs", g, out_gs, ("float32",)), ("out.inv_rms", inv, out_inv, ("float32",))))
    u8 = torch_dtype("uint8")
    return QuantizedActivation(put(q, like, out_q, torch_dtype("float4_e2m1fn_x2") or u8),
                               put(sf, like, out_sf, torch_dtype("float8_e4m3fn") or u8),
                               put(g, like, out_gs),
                               None if inv is None else put(inv, like, out_inv))
