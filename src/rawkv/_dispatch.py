"""CPU/GPU dispatch shared by every public op: where the arguments live,
wrapping DLPack device arrays as torch tensors, and the numpy <-> torch
conversions of the CPU path (which runs rawkv.reference).
"""
from __future__ import annotations

import sys

import numpy as np

from .errors import GpuUnavailableError


_torch = None       # the torch module, once seen


def torch_loaded(torch) -> None:
    """Bind torch (rawkv.library calls this when it registers the operators):
    code torch.compile traces then reads a global, not sys.modules, which
    dynamo would copy while lazy imports change it ('dictionary changed size
    during iteration')."""
    global _torch
    _torch = torch


def _torch_or_none():
    global _torch
    if _torch is None:      # torch tensors exist only if torch was imported
        _torch = sys.modules.get("torch")
    return _torch


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
        if x is None or _is_scalar(x):      # scalars (numpy ones too) live nowhere
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
            raise TypeError(f"{name}: expected a tensor or array, got {type(x).__name__}")
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


def byte_dtypes(torch) -> tuple:
    """torch dtypes that are bytes of a packed format (uint8 and the FP8/FP4
    views; float8_e8m0fnu: block scales)."""
    out = [torch.uint8]
    for n in ("float8_e4m3fn", "float4_e2m1fn_x2", "float8_e8m0fnu"):
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
    # (np.ascontiguousarray would make a 0-d array 1-d)
    t = torch.from_numpy(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))
    if torch_dtype is None or t.dtype == torch_dtype:
        return t
    if t.dtype == torch.uint8 and torch_dtype.itemsize == 1:
        return t.view(torch_dtype)
    return t.to(torch_dtype)




def _is_scalar(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating, bool, np.bool_))
