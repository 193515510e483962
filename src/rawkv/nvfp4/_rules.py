"""Argument rules shared by several NVFP4 ops (the generic ones, one
function per kind of argument, are rawkv._args; the format's own, N % 16
and a given gs's bound, rawkv.reference.nvfp4's). Each op's own rules are
one function beside its body (`_arguments` in encode, activation, decode;
scales has one per op), which takes the operator's arguments and returns
the op's placement and its checked arrays, on CPU and CUDA alike; the body
then only chooses the reference or the launch. Every rule raises before
anything is launched or written, naming the argument."""
from __future__ import annotations

import operator

import numpy as np

from .. import _args as A
from ..reference import nvfp4 as ref

BLOCK = ref.BLOCK
SCOPES = ref.SCOPES

# rkv_nvfp4_gather loads the codes of q as 4-byte words; q rows are n/2
# bytes (a multiple of 8) apart, so the data pointer decides. sf is read
# byte by byte (any address).
Q_ALIGN = 4


# ---- q and sf ------------------------------------------------------------------------
def q_sf(q, sf, where):
    """(q, sf, N) of a decode: codes (..., N/2) and their scales (..., N/16)."""
    q = A.tensor(q, "q", A.BYTES, where, min_ndim=1, align=Q_ALIGN)
    n = q.shape[-1] * 2
    ref.check_last_dim(n, "q (2 elements per byte)")
    sf = A.tensor(sf, "sf", A.BYTES, where, shape=(*q.shape[:-1], n // BLOCK), device=A.device_of(q))
    return q, sf, n


# ---- a decode's global scale -----------------------------------------------------------
def decode_scale(gs, gs_value):
    """A decode gs from the operator's two arguments: a number as a Python
    float, finite and > 0 as a float32 (check_gs_number, the rule quantize
    applies: 1e39 would decode to inf), anything else as it is (placement
    refuses what is not an array, decode_gs checks an array); None or a
    bool is a TypeError naming gs."""
    gs = A.op_gs(gs, gs_value)
    if A.is_number(gs):
        return A.check_gs_number(gs)
    if gs is None or isinstance(gs, (bool, np.bool_)):
        raise TypeError(f"gs: expected a float or a float32 tensor, got {gs!r}")
    return gs


def decode_scalars(a) -> None:
    """decode_scale of a decode op's schema arguments by name (the op
    wrapper's host rule: a compiled call's bool gs gets the eager error)."""
    decode_scale(a["gs"], a["gs_value"])


def decode_gs(gs, lead, where, device):
    """A decode gs as ('value', float) | ('scalar', 1-element float32
    tensor) | ('row', contiguous float32 tensor of shape `lead`)."""
    if isinstance(gs, float):
        return "value", gs
    gs = A.tensor(gs, "gs", ("float32",), where, device=device, dense=False, align=A.ELEMENT)
    one = A.numel(gs) == 1
    if not one and tuple(gs.shape) != tuple(lead):
        raise ValueError(f"gs: expected a scalar (1 element) or one scale per row, shape "
                         f"{tuple(lead)}; got shape {tuple(gs.shape)}")
    if not one and not A.is_dense(gs):
        raise ValueError(f"gs: must be contiguous (got strides {A.strides(gs)})")
    return ("scalar" if one else "row"), gs


# ---- public-only arguments ---------------------------------------------------------------
def size(v, name: str) -> int:
    """A size argument: an int (Python, numpy or anything with __index__,
    not a bool) >= 0, as a Python int."""
    if isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {v!r}")
    t = A._torch_or_none()
    if type(v) is not int and not (t is not None and isinstance(v, t.SymInt)):
        # (an int as it is: a dynamic size while torch.compile traces, e.g.
        # sf.shape of a token count marked dynamic, which dynamo takes for
        # an int, would be specialized to its value by operator.index, one
        # compile per token count; mark_dynamic: an error)
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"{name}: expected an int, got {v!r}") from None
    if v < 0:
        raise ValueError(f"{name}: expected a size >= 0, got {v}")
    return v


def linear_shape(shape, out) -> tuple:
    """unswizzle_scales' `shape`: a sequence of sizes, at least one, which
    an out= given must have (the operator takes the shape from out)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape: expected a sequence of ints, got {shape!r}")
    try:
        items = tuple(shape)          # (a 0-d array or tensor has __iter__ and raises here)
    except TypeError:
        raise TypeError(f"shape: expected a sequence of ints, got {shape!r}") from None
    shape = tuple(size(s, "shape") for s in items)         # 2.5 was taken as 2
    if not shape:
        raise ValueError("shape: expected at least 1 dimension")
    if getattr(out, "shape", None) is not None and tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    return shape
