"""Argument checks and CPU/GPU dispatch shared by every public op.

Every check runs before anything is launched or written and raises a
TypeError / ValueError whose message starts with the argument's name.
"""
from __future__ import annotations

import numpy as np

from .errors import GpuUnavailableError


def _torch_or_none():
    import sys
    return sys.modules.get("torch")   # torch tensors exist only if torch was imported


def is_torch(x) -> bool:
    t = _torch_or_none()
    return t is not None and isinstance(x, t.Tensor)


def placement(*named) -> str:
    """'cpu' if the arrays are numpy arrays / CPU tensors, 'cuda' if they are
    CUDA tensors or other DLPack device arrays; mixing the two is an error.
    `named` is pairs (name, array); None entries are ignored."""
    # Fast path (the hot path): only CUDA tensors, numbers and Nones.
    for _, x in named:
        if not (x is None or getattr(x, "is_cuda", False) is True or isinstance(x, (int, float))):
            break
    else:
        if any(getattr(x, "is_cuda", False) is True for _, x in named):
            return "cuda"
    where = None
    first = None
    for name, x in named:
        if x is None or is_number(x):      # scalars (numpy ones too) live nowhere
            continue
        if isinstance(x, np.ndarray):
            w = "cpu"
        elif is_torch(x):
            w = "cuda" if x.is_cuda else "cpu"
            if not x.is_cuda and x.device.type != "cpu":
                raise ValueError(f"{name}: rawkv runs on CPU or CUDA tensors, got device {x.device}")
        elif hasattr(x, "__dlpack_device__"):
            dev_type = x.__dlpack_device__()[0]
            w = "cpu" if dev_type == 1 else "cuda"
        else:
            raise TypeError(f"{name}: expected a torch tensor, numpy array or DLPack array, "
                            f"got {type(x).__name__}")
        if where is None:
            where, first = w, name
        elif w != where:
            raise ValueError(f"{name}: is on {w} but {first} is on {where}; rawkv does not move data")
    return where or "cpu"


def as_cuda_tensor(x, name: str):
    """A torch CUDA tensor for `x`: torch tensors as they are, any other DLPack
    device array (CuPy, JAX, ...) wrapped zero-copy."""
    if getattr(x, "is_cuda", False) is True or is_torch(x):
        return x
    try:
        import torch
    except ImportError as exc:
        raise GpuUnavailableError("rawkv GPU ops need PyTorch: pip install torch") from exc
    try:
        return torch.from_dlpack(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument name
        raise TypeError(f"{name}: could not be wrapped through DLPack: {exc}") from exc


def is_cuda_tensor(x) -> bool:
    """Fast test for the hot path: a torch CUDA tensor."""
    return getattr(x, "is_cuda", False) is True


def check_tensor(x, name: str, dtypes, *, shape=None, ndim=None, device=None,
                 contiguous: bool = True) -> None:
    """Check a CUDA tensor argument; `dtypes` is a tuple of torch dtypes,
    `device` the CUDA device index the op runs on."""
    if x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(x.dtype).replace('torch.', '')} is not supported "
                        f"(expected {allowed})")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if device is not None and x.get_device() != device:
        raise ValueError(f"{name}: is on {x.device} but the op runs on cuda:{device}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (got strides {tuple(x.stride())}); "
                         "call .contiguous() first")


def aligned16(*tensors) -> bool:
    """True if every tensor's data pointer is 16-byte aligned (vector path)."""
    acc = 0
    for t in tensors:
        acc |= t.data_ptr()
    return acc & 15 == 0


# ---- CPU side: numpy in, numpy or CPU torch out ------------------------------
def to_numpy(x, name: str) -> np.ndarray:
    """numpy view/copy of a CPU array; BF16 becomes float32 (exact), FP8/FP4
    tensor dtypes become their uint8 bytes."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        import torch
        if x.dtype == torch.bfloat16:
            return x.detach().float().numpy()
        if x.dtype in byte_dtypes(torch):
            return x.detach().view(torch.uint8).numpy()
        return x.detach().numpy()
    return np.from_dlpack(x)


class _TorchDtypes:
    """torch dtype groups and names, built once (rebuilding them per call
    costs microseconds on the launch path)."""

    def __init__(self, torch):
        self.floats = (torch.float32, torch.float16, torch.bfloat16)
        self.bytes = byte_dtypes(torch)
        self.fp8 = tuple(d for d in self.bytes[:2])          # uint8, float8_e4m3fn
        self.e4m3 = getattr(torch, "float8_e4m3fn", None)      # typed views, where torch has them
        self.e2m1x2 = getattr(torch, "float4_e2m1fn_x2", None)
        self.name = {d: str(d).replace("torch.", "") for d in (*self.floats, *self.bytes)}


_DTYPES = None


def dtypes() -> _TorchDtypes:
    global _DTYPES
    if _DTYPES is None:
        import torch
        _DTYPES = _TorchDtypes(torch)
    return _DTYPES


def byte_dtypes(torch) -> tuple:
    """torch dtypes that are bytes of a packed format (uint8 and the FP8/FP4 views)."""
    out = [torch.uint8]
    for n in ("float8_e4m3fn", "float4_e2m1fn_x2"):
        if hasattr(torch, n):
            out.append(getattr(torch, n))
    return tuple(out)


def from_numpy(arr: np.ndarray, like, *, torch_dtype=None, out=None):
    """Return `arr` in the library of `like` (numpy or CPU torch). If `out` is
    given, copy into it and return it. `torch_dtype` (a torch dtype or its
    name, resolved only when torch is involved) converts float32 holding BF16
    values to torch.bfloat16 (exactly) or bytes to FP8/FP4 views."""
    if out is not None:
        if isinstance(out, np.ndarray):
            if out.shape != arr.shape:
                raise ValueError(f"out: expected shape {arr.shape}, got {out.shape}")
            out[...] = arr.astype(out.dtype, copy=False)
            return out
        t = _as_torch(arr, torch_dtype)
        if tuple(out.shape) != tuple(t.shape):
            raise ValueError(f"out: expected shape {tuple(t.shape)}, got {tuple(out.shape)}")
        if out.dtype != t.dtype and t.dtype.itemsize == out.dtype.itemsize == 1:
            out.view(t.dtype).copy_(t)
        else:
            out.copy_(t)
        return out
    if is_torch(like):
        return _as_torch(arr, torch_dtype)
    return arr


def _as_torch(arr: np.ndarray, torch_dtype):
    import torch
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if torch_dtype is None or t.dtype == torch_dtype:
        return t
    if t.dtype == torch.uint8 and torch_dtype.itemsize == 1:
        return t.view(torch_dtype)
    return t.to(torch_dtype)


def cpu_dtype_name(a, name: str) -> str:
    """dtype of a CPU array (numpy, CPU torch tensor or DLPack array) as torch
    spells it ('float32', 'bfloat16', 'float8_e4m3fn'); numpy arrays need no torch."""
    if isinstance(a, np.ndarray):
        return str(a.dtype)
    if is_torch(a):
        return str(a.dtype).replace("torch.", "")
    return str(to_numpy(a, name).dtype)


def check_cpu_array(a, name: str, allowed, shape=None) -> str:
    """The CUDA path's dtype (and shape) checks for a CPU argument, before
    the reference runs or anything is written; returns the dtype name."""
    d = cpu_dtype_name(a, name)
    if d not in allowed:
        raise TypeError(f"{name}: dtype {d} is not supported (expected {', '.join(allowed)})")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    return d


def is_number(v) -> bool:
    """A Python or numpy real scalar (not a bool, not an array)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def check_scale_value(gs, name: str = "gs") -> float:
    """A global decode scale given as a number: the kernels read it as float32,
    so it must be finite and > 0 *as a float32* (1e39 would become inf, 1e-46
    would become 0). Returns it as a Python float."""
    if isinstance(gs, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float, got {gs!r}")
    with np.errstate(over="ignore", under="ignore"):
        g32 = np.float32(gs)
    if not (np.isfinite(g32) and g32 > 0):
        raise ValueError(f"{name}: must be a finite positive float32 "
                         f"(between {np.finfo(np.float32).smallest_subnormal:.3g} and "
                         f"{np.finfo(np.float32).max:.4g}), got {gs!r}")
    return float(gs)
