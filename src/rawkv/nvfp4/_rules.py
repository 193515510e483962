"""Argument rules shared by the NVFP4 ops (the generic ones, one function
per kind of argument, are rawkv._args). Each op's own rules are one
function beside its body (`_arguments` in encode, activation, decode;
scales has one per op), which takes the operator's arguments and returns
the op's placement and its checked arrays, on CPU and CUDA alike; the body
then only chooses the reference or the launch. Every rule raises before
anything is launched or written, naming the argument."""
from __future__ import annotations

import math
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


# ---- result views ------------------------------------------------------------------
def as_q(t):
    """q bytes (uint8 or float8_e4m3fn) as torch.float4_e2m1fn_x2 where
    torch has it; anything else as it is (numpy arrays; what the op then
    checks and refuses), so the public op views its outputs before the op
    writes them."""
    torch = A._torch or A._torch_or_none()          # (no call once torch is bound: the hot path)
    if torch is None or not isinstance(t, torch.Tensor):
        return t
    dt = A.dtypes()
    return t.view(dt.e2m1x2) if dt.e2m1x2 is not None and t.dtype in dt.fp8 else t


def as_sf(t):
    """Scale bytes (uint8 or float4_e2m1fn_x2) as torch.float8_e4m3fn where
    torch has it; anything else as it is (see as_q)."""
    torch = A._torch or A._torch_or_none()
    if torch is None or not isinstance(t, torch.Tensor):
        return t
    dt = A.dtypes()
    return t.view(dt.e4m3) if dt.e4m3 is not None and t.dtype in dt.sf_views else t


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
    g = np.asarray(A.to_numpy(gs, "gs"), np.float32).reshape(())
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
