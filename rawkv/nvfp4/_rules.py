"""Argument rules of the NVFP4 ops (the generic ones, one function per kind
of argument, are rawkv._args): one function per op takes the operator's
arguments and returns the op's placement and its checked arrays, on CPU and
CUDA alike; the body then only chooses the reference or the launch. Every
rule raises before anything is launched or written, naming the argument."""
from __future__ import annotations

import math
import operator

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from ..reference import layouts as ref_layouts
from ..reference import nvfp4 as ref

BLOCK = ref.BLOCK
SCOPES = ref.SCOPES

# rkv_nvfp4_gather loads the codes of q as 4-byte words; q rows are n/2
# bytes (a multiple of 8) apart, so the data pointer decides. sf is read
# byte by byte (any address).
Q_ALIGN = 4


# ---- result views ------------------------------------------------------------------
def as_q(t):
    """q bytes as torch.float4_e2m1fn_x2 where torch has it (numpy: uint8)."""
    d = None if isinstance(t, np.ndarray) else A.dtypes().e2m1x2
    return t if d is None or t.dtype is d else t.view(d)


def as_sf(t):
    """Scale bytes as torch.float8_e4m3fn where torch has it (numpy: uint8)."""
    d = None if isinstance(t, np.ndarray) else A.dtypes().e4m3
    return t if d is None or t.dtype is d else t.view(d)


# ---- x and (q, sf) -------------------------------------------------------------------
def row_view(x, name):
    """(M, N, ldx) of an array whose rows (all leading dims flattened) are
    evenly strided, 16 bytes apart at a multiple, with a contiguous last dim
    of N % 16 == 0 elements; else ValueError naming it."""
    n = x.shape[-1]
    ref.check_last_dim(n, name)
    m = math.prod(x.shape[:-1])
    if A.is_dense(x):
        return m, n, n
    ldx = None
    st = A.strides(x)
    if st[-1] == 1:
        # leading dims that collapse into one evenly strided row index
        lead = [(s, t) for s, t in zip(x.shape[:-1], st[:-1]) if s != 1]
        ok = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
        if ok and (not lead or lead[-1][1] >= n):
            ldx = lead[-1][1] if lead else n
    if ldx is None:
        raise ValueError(f"{name}: unsupported strides {st} for shape {tuple(x.shape)}: "
                         "the last dimension must be contiguous and the rows evenly strided "
                         "(e.g. a row slice of a 2-D tensor); call .contiguous() first")
    if m > 1 and (ldx * A.itemsize(x)) % 16:
        raise ValueError(f"{name}: rows are {ldx * A.itemsize(x)} bytes apart, not a multiple of 16 "
                         "(the kernels load rows 16 bytes at a time; a view starting mid-row?); "
                         "call .clone() first")
    return m, n, ldx


def q_sf(q, sf, where):
    """(q, sf, N) of a decode: codes (..., N/2) and their scales (..., N/16)."""
    q = A.tensor(q, "q", A.BYTES, where, min_ndim=1, align=Q_ALIGN)
    n = q.shape[-1] * 2
    ref.check_last_dim(n, "q (2 elements per byte)")
    sf = A.tensor(sf, "sf", A.BYTES, where, shape=(*q.shape[:-1], n // BLOCK), device=A.device_of(q))
    return q, sf, n


# ---- global scales ---------------------------------------------------------------------
def check_given_gs_number(g: float, dtype: str) -> None:
    """A given gs number (already finite and > 0 as a float32) against the
    bound of `dtype` inputs (docs/format.md, "a given global scale")."""
    limit = ref.given_gs_limit(dtype)
    if not np.float32(g) < limit:
        raise ValueError(f"gs: {g!r} is too large for {dtype} input: from {limit:.9g} up, even the "
                         f"largest {dtype} value falls below the range of the E4M3 block scale "
                         "(docs/format.md)")


def given_gs_host(gs, dtype: str) -> np.ndarray:
    """A given gs whose value the host holds (a checked Python float, or a
    host array of one float32 element) as a float32 0-d array, refused
    (ValueError naming gs) where the reference's rule (given_gs_ok) would not
    use it. (A device gs is the kernel's to check: it flags the blocks and
    counts the call.)"""
    if isinstance(gs, float):
        check_given_gs_number(gs, dtype)
        return np.asarray(gs, np.float32)
    A.check_cpu_array(gs, "gs", ("float32",))
    g = np.asarray(D.to_numpy(gs, "gs"), np.float32).reshape(())
    if not 0 < g < ref.given_gs_limit(dtype):
        raise ValueError(f"gs: {float(g)!r} is not a usable global scale for {dtype} input (expected "
                         f"0 < gs < {ref.given_gs_limit(dtype):.9g}; docs/format.md)")
    return g


def decode_scale(gs, gs_value):
    """A decode gs from the operator's two arguments: a number as a Python
    float, anything else as it is (placement refuses what is not an array,
    decode_gs checks an array); None or a bool is a TypeError naming gs."""
    gs = A.op_gs(gs, gs_value)
    if A.is_number(gs):
        return float(gs)
    if gs is None or isinstance(gs, (bool, np.bool_)):
        raise TypeError(f"gs: expected a float or a float32 tensor, got {gs!r}")
    return gs


def decode_gs(gs, lead, where, device):
    """A decode gs as ('value', float) | ('scalar', 1-element float32
    tensor) | ('row', contiguous float32 tensor of shape `lead`)."""
    if isinstance(gs, float):
        return "value", gs
    gs = A.tensor(gs, "gs", ("float32",), where, device=device, dense=False)
    one = A.numel(gs) == 1
    if not one and tuple(gs.shape) != tuple(lead):
        raise ValueError(f"gs: expected a scalar (1 element) or one scale per row, shape "
                         f"{tuple(lead)}; got shape {tuple(gs.shape)}")
    if not one and not A.is_dense(gs):
        raise ValueError(f"gs: must be contiguous (got strides {A.strides(gs)})")
    return ("scalar" if one else "row"), gs


# ---- one function per op ----------------------------------------------------------------
def quantize(x, scope, gs, gs_value, q, sf, gs_out, errors):
    """(where, x, M, N, ldx, x's dtype name, scope, gs, q, sf, gs_out,
    errors) of rawkv::nvfp4_quantize. gs: None, a Python float (checked
    against x's dtype) or a float32 array of one element (its value is the
    CPU branch's to check, given_gs_host, or the kernel's)."""
    scope, gs = A.check_scope_gs(scope, A.op_gs(gs, gs_value), SCOPES, "tensor")
    where = D.placement(("x", x), ("gs", gs), ("out[0]", q), ("out[1]", sf), ("out[2]", gs_out),
                        ("errors", errors))
    A.check_outputs((("out[0]", q), ("out[1]", sf), ("out[2]", gs_out), ("errors", errors)),
                    (("x", x), ("gs", gs)))
    x = A.tensor(x, "x", A.FLOATS, where, min_ndim=1, dense=False, align=16)
    m, n, ldx = row_view(x, "x")
    xdt, dev, lead = A.dtype_name(x), A.device_of(x), tuple(x.shape[:-1])
    if isinstance(gs, float):
        check_given_gs_number(gs, xdt)
    elif gs is not None:
        gs = A.tensor(gs, "gs", ("float32",), where, device=dev, dense=False)
    q = A.tensor(q, "out[0]", A.BYTES, where, shape=(*lead, n // 2), device=dev, align=16)
    sf = A.tensor(sf, "out[1]", A.BYTES, where, shape=(*lead, n // BLOCK), device=dev, align=16)
    if gs_out is None and (gs is None or isinstance(gs, float)):
        raise ValueError("gs_out: required unless gs is a tensor (scope 'given'), which is then the gs")
    if gs_out is not None:
        gs_out = A.tensor(gs_out, "out[2]", ("float32",), where, shape=lead if scope == "row" else (),
                          device=dev)
    if errors is not None:
        errors = A.counter(errors, where, dev)
    return where, x, m, n, ldx, xdt, scope, gs, q, sf, gs_out, errors


def dequantize(q, sf, gs, gs_value, out, dtype):
    """(where, q, sf, N, gs kind, gs, out, dtype name) of rawkv::nvfp4_dequantize."""
    gs = decode_scale(gs, gs_value)
    where = D.placement(("q", q), ("sf", sf), ("gs", gs), ("out", out))
    A.check_outputs((("out", out),), (("q", q), ("sf", sf), ("gs", gs)))
    q, sf, n = q_sf(q, sf, where)
    dev, lead = A.device_of(q), tuple(q.shape[:-1])
    kind, gs = decode_gs(gs, lead, where, dev)
    out, name = A.decoded(out, dtype, where, (*lead, n), dev, align=16)
    return where, q, sf, n, kind, gs, out, name


def gather(q, sf, gs, gs_value, indices, out, errors, dtype):
    """(where, q, sf, N, gs kind, gs, indices, out, dtype name, errors) of
    rawkv::nvfp4_gather."""
    gs = decode_scale(gs, gs_value)
    where = D.placement(("q", q), ("sf", sf), ("gs", gs), ("indices", indices), ("out", out),
                        ("errors", errors))
    A.check_outputs((("out", out), ("errors", errors)), (("q", q), ("sf", sf), ("gs", gs), ("indices", indices)))
    q, sf, n = q_sf(q, sf, where)
    dev, lead = A.device_of(q), tuple(q.shape[:-1])
    kind, gs = decode_gs(gs, lead, where, dev)
    idx = A.tensor(indices, "indices", A.INDEX, where, device=dev)
    out, name = A.decoded(out, dtype, where, (*idx.shape, n), dev, align=16)
    if errors is not None:
        errors = A.counter(errors, where, dev)
    return where, q, sf, n, kind, gs, idx, out, name, errors


def swizzle(sf, out):
    """(where, sf, rows, cols, out) of rawkv::nvfp4_swizzle_scales."""
    where = D.placement(("sf", sf), ("out", out))
    A.check_outputs((("out", out),), (("sf", sf),))
    sf = A.tensor(sf, "sf", A.BYTES, where, min_ndim=1)
    rows, cols = math.prod(sf.shape[:-1]), sf.shape[-1]
    size = ref_layouts.swizzled_size(rows, cols)
    out = A.tensor(out, "out", A.BYTES, where, shape=(size,), device=A.device_of(sf), align=16)
    return where, sf, rows, cols, out


def unswizzle(sw, out):
    """(where, sw, rows, cols, out) of rawkv::nvfp4_unswizzle_scales: the
    linear shape is out's."""
    where = D.placement(("sw", sw), ("out", out))
    A.check_outputs((("out", out),), (("sw", sw),))
    sw = A.tensor(sw, "sw", A.BYTES, where, align=16)
    out = A.tensor(out, "out", A.BYTES, where, min_ndim=1, device=A.device_of(sw))
    rows, cols = math.prod(out.shape[:-1]), out.shape[-1]
    size = ref_layouts.swizzled_size(rows, cols)
    if A.numel(sw) != size:
        raise ValueError(f"sw: expected {size} bytes for scales of shape {tuple(out.shape)}, got {A.numel(sw)}")
    return where, sw, rows, cols, out


# ---- public-only arguments ---------------------------------------------------------------
def size(v, name: str) -> int:
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


def linear_shape(shape, out) -> tuple:
    """unswizzle_scales' `shape`: a sequence of sizes, at least one, which
    an out= given must have (the operator takes the shape from out)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape: expected a sequence of ints, got {shape!r}")
    shape = tuple(size(s, "shape") for s in shape)         # 2.5 was taken as 2
    if not shape:
        raise ValueError("shape: expected at least 1 dimension")
    if getattr(out, "shape", None) is not None and tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    return shape
