"""Argument rules of the KV-cache ops, on CPU and CUDA pools alike.

An op checks each argument with one call, whatever the device of its pool /
state: `dev` is the pool's CUDA device index, or None for a CPU pool. On a
CUDA pool an array argument must be a CUDA tensor on that device (checked by
rawkv._args.check_tensor) and comes back as a torch tensor; on a CPU pool it
must be a host array (numpy, CPU tensor, DLPack CPU array) and comes back
as numpy. Dtypes are named as torch spells them and are the same on both;
numpy has no bfloat16, so on the host float32 stands for it (the reference's
convention: float32 holding BF16 values). Errors name the argument and are
raised before anything is launched or written.
"""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from .pool import PagedKVPool
from .state import DecodeState

BOOL = ("bool",)
I32 = ("int32",)
IDS = ("int32", "int64")
F32 = ("float32",)
BF16 = ("bfloat16",)
ROWS = ("float32", "bfloat16")
OUT = ("bfloat16", "float16", "float32")

_TORCH: dict = {}
check_outputs = A.check_outputs      # outputs writable and apart from the inputs (rawkv._args)


def _torch_dtypes(names: tuple) -> tuple:
    t = _TORCH.get(names)
    if t is None:
        import torch
        t = _TORCH[names] = tuple(getattr(torch, n) for n in names)
    return t


def torch_dtype(name: str):
    """The torch dtype called `name` ('bfloat16', ...)."""
    return _torch_dtypes((name,))[0]


def check_pool(pool) -> None:
    """The one test of "is this a pool" of every op taking one."""
    if not isinstance(pool, PagedKVPool):
        raise TypeError(f"pool: expected a rawkv.kvcache.PagedKVPool, got {type(pool).__name__}")


def check_state(state, name: str = "state") -> None:
    if not isinstance(state, DecodeState):
        raise TypeError(f"{name}: expected a rawkv.kvcache.DecodeState, got {type(state).__name__}")


def arg(x, name: str, dtypes: tuple, dev, *, shape=None, ndim=None, aligned: bool = False):
    """Array argument `name` of an op on device `dev` (module doc): checked,
    as a CUDA tensor (dev an index) or a numpy array (dev None). `aligned`:
    the kernel loads it in 16-byte words."""
    if dev is None:
        return _host(x, name, dtypes, shape, ndim)
    if getattr(x, "is_cuda", False) is not True:
        A.require_array(x, name)
        if D.placement((name, x)) == "cpu":
            raise ValueError(f"{name}: is on cpu but the pool/state is on cuda:{dev}; "
                             "rawkv does not move data")
        x = D.as_cuda_tensor(x, name)
    A.check_tensor(x, name, _TORCH.get(dtypes) or _torch_dtypes(dtypes), shape=shape, ndim=ndim,
                   device=dev)
    if aligned:
        A.check_aligned(name, x)
    return x


def opt(x, name: str, dtypes: tuple, dev, **kw):
    """arg() for an optional argument: None stays None."""
    return None if x is None else arg(x, name, dtypes, dev, **kw)


def _host(x, name, dtypes, shape, ndim) -> np.ndarray:
    A.require_array(x, name)
    if D.placement((name, x)) != "cpu":
        raise ValueError(f"{name}: is on cuda but the pool/state is on the CPU; rawkv does not move data")
    allowed = dtypes + F32 if "bfloat16" in dtypes and "float32" not in dtypes else dtypes
    A.check_cpu_array(x, name, allowed)
    a = D.to_numpy(x, name)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if shape is not None and a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")
    return a


def errors_arg(errors, default, dev):
    """The error counter an op adds to: `errors` (an int32 array of at least
    one element, on the pool's device) or the pool's / state's own."""
    if errors is None:
        return default
    e = arg(errors, "errors", I32, dev)
    if (e.numel() if dev is not None else e.size) < 1:
        raise ValueError("errors: expected an int32 array with at least 1 element")
    check_outputs((("errors", e),))
    return e if dev is not None else errors


def owned(obj, name: str) -> tuple:
    """check_outputs' `owned` for a pool / state (`name`: 'pool' or 'state'):
    the spans of its buffers, named 'pool.written' etc. The buffers are
    fixed when the object is built (ErrorCounter.__setattr__), so their
    spans are made once per object, not on every call."""
    sp = obj.__dict__.get("_owned")
    if sp is None:
        sp = A.spans((f"{name}.{b}", getattr(obj, b)) for b in obj.BUFFERS)
        obj._owned = sp
    return sp


def counter(errors, obj):
    """errors= as an output to check against obj's buffers (owned): None
    when it is obj's own counter, the op's default given explicitly."""
    if errors is None or errors is obj.errors or A.same_memory(errors, obj.errors):
        return None
    return errors


def add_errors(errors, n: int) -> None:
    """errors[0] += n on a host counter (numpy array or CPU tensor)."""
    if n:
        errors[(0,) * errors.ndim] += int(n)


# torch dtype -> name, of the output dtypes seen (the hot path reads out.dtype)
_OUT_NAMES: dict = {}


def out_dtype(dtype, out) -> str:
    """Name of a gather's output dtype: `dtype`, else a torch out's dtype,
    else bfloat16."""
    if dtype is None:
        if out is None:
            return "bfloat16"
        name = _OUT_NAMES.get(getattr(out, "dtype", None))
        if name is not None:
            return name
        if not D.is_torch(out):
            return "bfloat16"
        dtype = out.dtype
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if name not in OUT:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype!r}")
    if not isinstance(dtype, str) and D.is_torch(out):
        _OUT_NAMES[dtype] = name
    return name


def check_out(out, name: str, dev, *, shape=None, ndim=None):
    """A gather's `out` (or None): `name` dtype, `shape` / `ndim`, on the
    pool's device. Returned as given on the host (the CPU path writes into
    it), as a tensor on CUDA."""
    if out is None:
        return None
    if dev is None:
        _host(out, "out", (name,), shape, ndim)
        return out
    return arg(out, "out", (name,), dev, shape=shape, ndim=ndim, aligned=True)


def host_int(name: str, v, lo: int, hi: int | None = None) -> int:
    """A host int argument in [lo, hi)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v >= hi):
        raise ValueError(f"{name}: {v} is out of range [{lo}, {hi if hi is not None else 'inf'})")
    return int(v)


def check_launch_rows(name: str, n: int) -> None:
    """The kernels index one launch's rows in 32 bits."""
    if n >= 2 ** 31:
        raise ValueError(f"{name}: {n} output rows/blocks; at most 2^31 - 1 per launch")


def topk_args(slots, topk_ids, n_entries, valid_mask, dev):
    """The top-k arguments of gather_topk and kvcache_indices, checked:
    (ids (B, K), slots (B,), n_entries or None, valid_mask or None)."""
    ids = arg(topk_ids, "topk_ids", IDS, dev, ndim=2)
    B = ids.shape[0]
    return (ids, arg(slots, "slots", I32, dev, shape=(B,)), opt(n_entries, "n_entries", I32, dev, shape=(B,)),
            opt(valid_mask, "valid_mask", BOOL, dev, shape=(B,)))
