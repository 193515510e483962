"""Argument rules of the NVFP4 ops (the generic ones are rawkv._args): row
views, q / sf pairs, decode and given global scales, output dtypes. Every
rule raises before anything is launched or written, naming the argument."""
from __future__ import annotations

import math
import sys

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from ..kernels.nvfp4 import FLOATS                          # x, decoded values
from ..reference import nvfp4 as ref

BLOCK = ref.BLOCK
SCOPES = ref.SCOPES
BYTES = ("uint8", "float8_e4m3fn", "float4_e2m1fn_x2")       # q, sf, sw as CPU arrays


# ---- result dtypes -----------------------------------------------------------------
def as_q(t):
    """q bytes as torch.float4_e2m1fn_x2, where torch has it."""
    d = A.dtypes().e2m1x2
    return t if d is None or t.dtype is d else t.view(d)


def as_sf(t):
    """Scale bytes as torch.float8_e4m3fn, where torch has it."""
    d = A.dtypes().e4m3
    return t if d is None or t.dtype is d else t.view(d)


def cpu_result(t, view):
    """A CPU path's q / sf result as the CUDA path returns it: a torch tensor
    through `view` (as_q, as_sf: an out= buffer of uint8 too), a numpy
    array as it is."""
    return view(t) if D.is_torch(t) else t


def cpu_byte_dtype(name: str):
    """The torch dtype name CPU results of kind `name` take ('q' or 'sf'), or
    None where torch (or its FP4 / FP8 dtype) is missing."""
    t = sys.modules.get("torch")
    dt = "float4_e2m1fn_x2" if name == "q" else "float8_e4m3fn"
    return dt if t is not None and hasattr(t, dt) else None


_DECODE_DTYPES: dict = {}      # dtype as given -> (name, torch dtype or None)


def decode_dtype(dtype, out):
    """(name, torch dtype or None) of a decode's output: `dtype`, else out's,
    else bfloat16."""
    if dtype is None and out is not None:
        dtype = getattr(out, "dtype", None)
    try:
        hit = _DECODE_DTYPES.get(dtype)
    except TypeError:           # unhashable: refused below
        hit = None
    if hit is not None:
        return hit
    name = "bfloat16" if dtype is None else dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if name not in FLOATS:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype!r}")
    t = sys.modules.get("torch")
    hit = (name, getattr(t, name) if t is not None else None)
    # Remembered once the torch dtype is known, for None, names and torch
    # dtypes only: torch.compile traces this lookup, and dynamo cannot hash
    # a numpy dtype key anywhere in the dict.
    if t is not None and (dtype is None or isinstance(dtype, (str, t.dtype))):
        _DECODE_DTYPES[dtype] = hit
    return hit


# ---- CUDA arguments ------------------------------------------------------------------
_INTS = None


def int_dtypes():
    """(torch.int32, torch.int64): index and counter dtypes, built once."""
    global _INTS
    if _INTS is None:
        import torch
        _INTS = (torch.int32, torch.int64)
    return _INTS


def row_view(x, name):
    """(M, N, ldx) of a CUDA tensor whose rows (all leading dims flattened)
    are evenly strided, 16 bytes apart at a multiple, with a contiguous last
    dim of N % 16 == 0 elements; else ValueError naming it."""
    if x.dim() == 0:
        raise ValueError(f"{name}: expected at least 1 dimension, got a 0-d tensor")
    n = x.shape[-1]
    ref.check_last_dim(n, name)
    m = math.prod(x.shape[:-1])
    if x.is_contiguous():
        return m, n, n
    ldx = None
    if x.stride(-1) == 1 and x.dim() == 2:
        ldx = x.stride(0)
    elif x.stride(-1) == 1:
        # leading dims that collapse into one evenly strided row index
        lead = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
        ok = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
        if ok and (not lead or lead[-1][1] >= n):
            ldx = lead[-1][1] if lead else n
    if ldx is None:
        raise ValueError(f"{name}: unsupported strides {tuple(x.stride())} for shape {tuple(x.shape)}: "
                         "the last dimension must be contiguous and the rows evenly strided "
                         "(e.g. a row slice of a 2-D tensor); call .contiguous() first")
    if m > 1 and (ldx * x.element_size()) % 16:
        raise ValueError(f"{name}: rows are {ldx * x.element_size()} bytes apart, not a multiple of 16 "
                         "(the kernels load rows 16 bytes at a time; a view starting mid-row?); "
                         "call .clone() first")
    return m, n, ldx


# rkv_nvfp4_gather loads the codes of q as 4-byte words; q rows are n/2
# bytes (a multiple of 8) apart, so the data pointer decides. sf is read
# byte by byte (any address).
Q_ALIGN = 4


def cuda_array(t, name):
    """`t` as a torch CUDA tensor (a DLPack device array wrapped); a number or
    None is a TypeError naming it."""
    if D.is_cuda_tensor(t):
        return t
    return D.as_cuda_tensor(A.require_array(t, name), name)


def check_q_sf(q, sf):
    """(q, sf) as uint8 views and N, for a decode on CUDA."""
    dt = A.dtypes()
    q = cuda_array(q, "q")
    sf = cuda_array(sf, "sf")
    A.check_tensor(q, "q", dt.bytes)
    if q.dim() == 0:
        raise ValueError("q: expected at least 1 dimension, got a 0-d tensor")
    n = q.shape[-1] * 2
    ref.check_last_dim(n, "q (2 elements per byte)")
    A.check_tensor(sf, "sf", dt.bytes, shape=(*q.shape[:-1], n // BLOCK), device=q.get_device())
    if q.numel():
        A.check_aligned("q", q, Q_ALIGN)
    u8 = dt.bytes[0]
    return q.view(u8), sf.view(u8), n


def check_out(t, name, dtypes, shape, device, align=1):
    """A CUDA out= buffer of `shape`, one of `dtypes`, on `device` (an
    index), `align`-byte aligned when it holds anything."""
    t = cuda_array(t, name)
    A.check_tensor(t, name, dtypes, shape=shape, device=device)
    if align > 1 and t.numel():
        A.check_aligned(name, t, align)
    return t


def cuda_errors(errors, device):
    """An errors= counter on CUDA: int32, at least 1 element, on the op's
    device (an index); the kernels add to errors[0]."""
    errors = cuda_array(errors, "errors")
    A.check_tensor(errors, "errors", int_dtypes()[:1], device=device)
    if errors.numel() < 1:
        raise ValueError("errors: expected an int32 tensor with at least 1 element")
    return errors


def float32_gs(gs, device):
    """A gs tensor on CUDA: float32, on the op's device (an index)."""
    gs = cuda_array(gs, "gs")
    A.check_tensor(gs, "gs", (A.dtypes().floats[0],), device=device, contiguous=False)
    return gs


def decode_gs_cuda(gs, lead_shape, device):
    """Classify a decode gs on CUDA: ('value', float) | ('scalar', tensor) | ('row', tensor)."""
    if gs.__class__ is float:
        return "value", gs
    gs = float32_gs(gs, device)
    if tuple(gs.shape) == tuple(lead_shape) and gs.numel() != 1:
        if not gs.is_contiguous():
            raise ValueError(f"gs: must be contiguous (got strides {tuple(gs.stride())})")
        return "row", gs
    if gs.numel() == 1:
        return "scalar", gs
    raise ValueError(f"gs: expected a scalar (1 element) or one scale per row, shape "
                     f"{tuple(lead_shape)}; got shape {tuple(gs.shape)}")


# ---- global scales ---------------------------------------------------------------------
def decode_gs(gs):
    """A decode gs: a number (Python or numpy) as a Python float, an array as
    it is; None, a bool or anything else is a TypeError naming gs."""
    if D.is_cuda_tensor(gs):
        return gs
    if A.is_number(gs):
        return float(gs)
    if gs is None or isinstance(gs, (bool, np.bool_)):
        raise TypeError(f"gs: expected a float or a float32 tensor, got {gs!r}")
    return A.require_array(gs, "gs")


def check_given_gs_number(g: float, dtype: str) -> None:
    """A given gs number (already finite and > 0 as a float32) against the
    bound of `dtype` inputs (docs/format.md, "a given global scale")."""
    limit = ref.given_gs_limit(dtype)
    if not np.float32(g) < limit:
        raise ValueError(f"gs: {g!r} is too large for {dtype} input: from {limit:.9g} up, even the "
                         f"largest {dtype} value falls below the range of the E4M3 block scale "
                         "(docs/format.md)")


def given_gs_host(gs, dtype: str) -> np.ndarray:
    """A given gs on the CPU path (a checked Python float, or a host array of
    one float32 element, whose value is here to check) as a float32 0-d
    array, refused (ValueError naming gs) where the reference's rule
    (given_gs_ok) would not use it."""
    if isinstance(gs, float):
        check_given_gs_number(gs, dtype)
        return np.asarray(gs, np.float32)
    A.check_cpu_array(gs, "gs", ("float32",))
    g = np.asarray(D.to_numpy(gs, "gs"), np.float32).reshape(())
    if not 0 < g < ref.given_gs_limit(dtype):
        raise ValueError(f"gs: {float(g)!r} is not a usable global scale for {dtype} input (expected "
                         f"0 < gs < {ref.given_gs_limit(dtype):.9g}; docs/format.md)")
    return g


def cpu_decode_gs(gs, lead_shape) -> np.ndarray:
    """A decode gs on the CPU path: a float32 0-d array, or one per row."""
    if isinstance(gs, float):
        return np.asarray(gs, np.float32)
    A.check_cpu_array(gs, "gs", ("float32",))
    g = np.asarray(D.to_numpy(gs, "gs"), np.float32)
    if g.size == 1:
        return g.reshape(())
    if g.shape != tuple(lead_shape):
        raise ValueError(f"gs: expected 1 element or shape {tuple(lead_shape)}, got {g.shape}")
    return g


# ---- CPU arguments ---------------------------------------------------------------------
def cpu_q_sf(q, sf):
    """(q, sf) as numpy uint8 arrays and N, checked as check_q_sf checks them on CUDA."""
    A.check_cpu_array(A.require_array(q, "q"), "q", BYTES)
    A.check_cpu_array(A.require_array(sf, "sf"), "sf", BYTES)
    qa, sfa = D.to_numpy(q, "q"), D.to_numpy(sf, "sf")
    if qa.ndim == 0:
        raise ValueError("q: expected at least 1 dimension, got a 0-d array")
    n = qa.shape[-1] * 2
    ref.check_last_dim(n, "q (2 elements per byte)")
    if sfa.shape != (*qa.shape[:-1], n // BLOCK):
        raise ValueError(f"sf: expected shape {(*qa.shape[:-1], n // BLOCK)}, got {sfa.shape}")
    return qa, sfa, n


def check_cpu_out(t, name, allowed, shape) -> None:
    """A CPU out= buffer: a numpy array or CPU torch tensor of `shape`, one
    of the dtype names `allowed`."""
    if t is None:
        return
    if not (isinstance(t, np.ndarray) or D.is_torch(t)):
        raise TypeError(f"{name}: expected a numpy array or a CPU torch tensor, got {type(t).__name__}")
    A.check_cpu_array(t, name, allowed, shape)


def cpu_decode_out(out, name, shape) -> None:
    """A CPU decode's out=: dtype `name` (numpy, which has no bfloat16, holds
    BF16 values in float32)."""
    allowed = (name, "float32") if name == "bfloat16" and isinstance(out, np.ndarray) else (name,)
    check_cpu_out(out, "out", allowed, shape)


def check_cpu_errors(errors) -> None:
    """A CPU errors= counter: an int32 array with at least one element."""
    if not (isinstance(errors, np.ndarray) or D.is_torch(errors)):
        raise TypeError(f"errors: expected an int32 numpy array or CPU torch tensor, got "
                        f"{type(errors).__name__}")
    A.check_cpu_array(errors, "errors", ("int32",))
    if math.prod(errors.shape) < 1:
        raise ValueError("errors: expected an int32 array with at least 1 element")

