"""E4M3 (float8_e4m3fn) encode and decode of whole tensors (docs/format.md, 1).

    codes = rawkv.fp8.e4m3_encode(x)            # float32/float16/bfloat16 -> E4M3 bytes
    y = rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)

CUDA tensors run the kernels of rawkv/cu/fp8.cu; numpy arrays and CPU tensors
run rawkv.reference.formats, which defines the result bit for bit.
"""
from __future__ import annotations

from . import _tensors as T
from .reference import formats as ref
from .runtime import get_runtime, register_kernels

_FILE = "fp8.cu"
_CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
# (op, dtype name, vectorized) -> kernel name, built once (no f-strings per call)
_KERNEL = {(op, d, vec): f"rkv_e4m3_{op}<{c}, {'true' if vec else 'false'}>"
           for op in ("encode", "decode") for d, c in _CTYPES.items() for vec in (True, False)}
register_kernels(_FILE, _KERNEL.values())

_VEC_BYTES = 16   # one 16-byte store of codes per thread per iteration
_FLOATS = tuple(_CTYPES)                  # what x / decoded values may be
_CODES = ("uint8", "float8_e4m3fn")       # what codes may be


def _dtype_name(torch_dtype) -> str:
    return T.dtypes().name[torch_dtype]


def _name_of(dtype) -> str:
    """'float32' for torch.float32, numpy's float32 dtype or 'float32'."""
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def _decode_dtype(dtype, out) -> str:
    """Name of the decoded dtype: `dtype`, else out's when it is a float
    dtype (out itself is checked against it), else float32."""
    if dtype is not None:
        name = _name_of(dtype)
        if name not in _FLOATS:
            raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
        return name
    out_name = _name_of(getattr(out, "dtype", None))
    return out_name if out_name in _FLOATS else "float32"


# (device, x dtype, out dtype) -> (Runtime, (unaligned, vector) kernel keys,
# the device's _GRIDS dict); filled by the checked path, read by the fast path.
_ENCODE_FAST: dict = {}
# device -> {n: grid}: launch geometry depends only on the device and n.
_GRIDS: dict = {}
_BLOCK = 256


def _grid(rt, grids, n) -> int:
    """rt.grid_stride's grid for n elements (one 16-byte chunk of codes per
    thread per iteration), remembered per n so the fast path does no
    arithmetic; the dict is dropped if it ever grows large."""
    if len(grids) > 4096:
        grids.clear()
    g = grids[n] = rt.grid_stride(-(-n // _VEC_BYTES), _BLOCK)[0]
    return g


def e4m3_encode(x, *, out=None, stream=None):
    """E4M3 codes of `x` (float32/float16/bfloat16, any shape): RNE, satfinite
    to +-448, NaN -> 0x7F. Returns a float8_e4m3fn tensor (or `out`, uint8 or
    float8_e4m3fn, of x's shape)."""
    # Fast path (a decode step: CUDA tensors, out= given): the same checks as
    # below, inlined; whatever fails them takes the checked path, which
    # raises the error naming the argument.
    try:
        fast = out is not None and x.is_cuda is True and out.is_cuda is True
    except AttributeError:
        fast = False
    if fast and x.is_contiguous() and out.is_contiguous():
        dev = x.get_device()
        ent = _ENCODE_FAST.get((dev, x.dtype, out.dtype))
        if ent is not None and out.get_device() == dev and out.shape == x.shape:
            n = x.numel()
            if n:
                rt, keys, grids = ent
                xp, op = x.data_ptr(), out.data_ptr()
                key = keys[((xp | op) & 15) == 0]
                # not cached: rt.function raises CaptureError while capturing
                fn = rt._functions.get(key) or rt.function(*key, stream=stream)
                g = grids.get(n) or _grid(rt, grids, n)
                rt.launch(fn, (g,), (_BLOCK,), (xp, op, n), stream)
            return out
    if not T.is_cuda_tensor(x):
        if T.placement(("x", x), ("out", out)) == "cpu":
            T.check_cpu_array(x, "x", _FLOATS)
            if out is not None:
                T.check_cpu_array(out, "out", _CODES, shape=x.shape)
            codes = ref.e4m3_encode(T.to_numpy(x, "x"))
            return T.from_numpy(codes, x, torch_dtype="float8_e4m3fn", out=out)
        x = T.as_cuda_tensor(x, "x")
    dt = T.dtypes()
    T.check_tensor(x, "x", dt.floats)
    dev = x.get_device()
    if out is None:
        out = get_runtime(dev).empty(x.shape, dt.fp8[-1], stream=stream)
    else:
        if not T.is_cuda_tensor(out):
            out = T.as_cuda_tensor(out, "out")
        T.check_tensor(out, "out", dt.fp8, shape=x.shape, device=dev)
    _launch("encode", x.dtype, x, out, x.numel(), stream)
    if (dev, x.dtype, out.dtype) not in _ENCODE_FAST:
        rt = get_runtime(dev)
        name = _dtype_name(x.dtype)
        _ENCODE_FAST[dev, x.dtype, out.dtype] = (
            rt, ((_FILE, _KERNEL["encode", name, False]), (_FILE, _KERNEL["encode", name, True])),
            _GRIDS.setdefault(dev, {}))
    return out


def e4m3_decode(codes, *, dtype=None, out=None, stream=None):
    """Values of E4M3 `codes` (uint8 or float8_e4m3fn) as `dtype`
    (float32 default, else out's dtype; float16 or bfloat16 are exact since
    every E4M3 value is)."""
    name = _decode_dtype(dtype, out)
    if not T.is_cuda_tensor(codes):
        if T.placement(("codes", codes), ("out", out)) == "cpu":
            T.check_cpu_array(codes, "codes", _CODES)
            if out is not None:
                T.check_cpu_array(out, "out", (name,), shape=codes.shape)
            vals = ref.round_to_dtype(ref.e4m3_decode(T.to_numpy(codes, "codes")), name)
            return T.from_numpy(vals, codes, torch_dtype=name, out=out)
        codes = T.as_cuda_tensor(codes, "codes")
    import torch
    dt = T.dtypes()
    T.check_tensor(codes, "codes", dt.fp8)
    dev = codes.get_device()
    tdtype = getattr(torch, name)
    if out is None:
        out = get_runtime(dev).empty(codes.shape, tdtype, stream=stream)
    else:
        if not T.is_cuda_tensor(out):
            out = T.as_cuda_tensor(out, "out")
        T.check_tensor(out, "out", (tdtype,), shape=codes.shape, device=dev)
    _launch("decode", tdtype, codes, out, codes.numel(), stream)
    return out


def _launch(op, float_dtype, src, dst, n, stream):
    if n == 0:
        return
    dev = src.get_device()
    rt = get_runtime(dev)
    sp, dp = src.data_ptr(), dst.data_ptr()
    fn = rt.function(_FILE, _KERNEL[op, _dtype_name(float_dtype), (sp | dp) & 15 == 0], stream=stream)
    grids = _GRIDS.setdefault(dev, {})
    rt.launch(fn, (grids.get(n) or _grid(rt, grids, n),), (_BLOCK,), (sp, dp, n), stream)
