"""E4M3 (float8_e4m3fn) encode and decode of whole tensors (docs/format.md, 1).

    codes = rawkv.fp8.e4m3_encode(x)            # float32/float16/bfloat16 -> E4M3 bytes
    y = rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)

CUDA tensors run the kernels declared in rawkv.kernels.fp8; numpy arrays and
CPU tensors run rawkv.reference.formats, which defines the result bit for bit.
"""
from __future__ import annotations

from . import _args as A
from . import _dispatch as D
from ._opdecl import OpDecl
from .kernels import fp8 as K
from .reference import formats as ref
from .runtime import get_runtime

_BLOCK = 256
_FLOATS = ("float32", "float16", "bfloat16")   # what x / decoded values may be
_CODES = ("uint8", "float8_e4m3fn")            # what codes may be


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


# device -> {n: grid}: launch geometry depends only on the device and n.
_GRIDS: dict = {}


def _grid(rt, n) -> tuple:
    """rt.grid_stride's grid for n elements (one chunk of codes per thread
    per iteration), remembered per n; the dict is dropped if it grows large."""
    grids = _GRIDS.get(rt.device_index)
    if grids is None:
        grids = _GRIDS[rt.device_index] = {}
    g = grids.get(n)
    if g is None:
        if len(grids) > 4096:
            grids.clear()
        g = grids[n] = (rt.grid_stride(-(-n // K.CHUNK_BYTES), _BLOCK)[0],)
    return g


def _vector(*tensors) -> bool:
    """The 16-byte vector path: every pointer 16-byte aligned."""
    acc = 0
    for t in tensors:
        acc |= t.data_ptr()
    return acc & 15 == 0


# (device, x dtype, out dtype) -> (Runtime, {vector?: Instance}, the device's
# grids): filled by
# the checked path, read by the fast path of a decode step.
_ENCODE_FAST: dict = {}


def _on_cpu(a, name, a_dtypes, out, out_dtypes, convert, torch_dtype):
    """The CPU path of encode and decode (the reference, `convert`), or None
    when `a` and `out` live on a device: the same argument rules either way."""
    A.require_array(a, name)
    if out is not None:
        A.require_array(out, "out")
    A.check_outputs((("out", out),), ((name, a),))
    if D.placement((name, a), ("out", out)) != "cpu":
        return None
    A.check_cpu_array(a, name, a_dtypes)
    if out is not None:
        A.check_cpu_array(out, "out", out_dtypes, shape=a.shape)
    return D.from_numpy(convert(D.to_numpy(a, name)), a, torch_dtype=torch_dtype, out=out)


def e4m3_encode(x, *, out=None, stream=None):
    """E4M3 codes of `x` (float32/float16/bfloat16, any shape): RNE, satfinite
    to +-448, NaN -> 0x7F. Returns a float8_e4m3fn tensor (or `out`, uint8 or
    float8_e4m3fn, of x's shape)."""
    # Fast path (CUDA tensors, out= given, a combination the checked path
    # has accepted before): the same checks, inlined; whatever fails them
    # takes the checked path, which raises the error naming the argument.
    if D.compiling():
        return _traced(ENCODE_OP, out, x.shape, "float8_e4m3fn", x, x=x)
    try:
        ent = _ENCODE_FAST.get((x.get_device(), x.dtype, out.dtype)) if x.is_cuda is out.is_cuda is True else None
    except AttributeError:
        ent = None
    if ent is not None and out.shape == x.shape and x.is_contiguous() and out.is_contiguous() \
            and out.get_device() == ent[0].device_index:
        n = x.numel()
        xp, op = x.data_ptr(), out.data_ptr()
        if not n:
            return out
        if op + n <= xp or xp + n * x.element_size() <= op:      # apart (else: the checked path refuses)
            rt = ent[0]
            ent[1][(xp | op) & 15 == 0].launch(rt, ent[2].get(n) or _grid(rt, n), (_BLOCK,),
                                               stream=stream, x=xp, out=op, n=n)
            return out
    if not D.is_cuda_tensor(x):
        res = _on_cpu(x, "x", _FLOATS, out, _CODES, ref.e4m3_encode, "float8_e4m3fn")
        if res is not None:
            return res
        x = D.as_cuda_tensor(x, "x")
    dt = A.dtypes()
    A.check_tensor(x, "x", dt.floats)
    dev = x.get_device()
    if out is None:
        out = get_runtime(dev).empty(x.shape, dt.fp8[-1], stream=stream)
    else:
        if not D.is_cuda_tensor(out):
            out = D.as_cuda_tensor(A.require_array(out, "out"), "out")
        A.check_tensor(out, "out", dt.fp8, shape=x.shape, device=dev)
        A.check_outputs((("out", out),), (("x", x),))
    n = x.numel()
    if n:
        rt = get_runtime(dev)
        K.ENCODE.launch(rt, _grid(rt, n), (_BLOCK,), x.dtype, _vector(x, out), stream=stream,
                        x=x, out=out, n=n)
        _ENCODE_FAST.setdefault((dev, x.dtype, out.dtype), (
            rt, {v: K.ENCODE.instance(x.dtype, v) for v in (False, True)}, _GRIDS[rt.device_index]))
    return out


def e4m3_decode(codes, *, dtype=None, out=None, stream=None):
    """Values of E4M3 `codes` (uint8 or float8_e4m3fn) as `dtype`
    (float32 default, else out's dtype; float16 or bfloat16 are exact since
    every E4M3 value is)."""
    name = _decode_dtype(dtype, out)
    if D.compiling():
        return _traced(DECODE_OP, out, codes.shape, name, codes, codes=codes)
    if not D.is_cuda_tensor(codes):
        res = _on_cpu(codes, "codes", _CODES, out, (name,),
                      lambda c: ref.round_to_dtype(ref.e4m3_decode(c), name), name)
        if res is not None:
            return res
        codes = D.as_cuda_tensor(codes, "codes")
    import torch
    dt = A.dtypes()
    A.check_tensor(codes, "codes", dt.fp8)
    dev = codes.get_device()
    tdtype = getattr(torch, name)
    if out is None:
        out = get_runtime(dev).empty(codes.shape, tdtype, stream=stream)
    else:
        if not D.is_cuda_tensor(out):
            out = D.as_cuda_tensor(A.require_array(out, "out"), "out")
        A.check_tensor(out, "out", (tdtype,), shape=codes.shape, device=dev)
        A.check_outputs((("out", out),), (("codes", codes),))
    n = codes.numel()
    if n:
        rt = get_runtime(dev)
        K.DECODE.launch(rt, _grid(rt, n), (_BLOCK,), tdtype, _vector(codes, out), stream=stream,
                        codes=codes, out=out, n=n)
    return out


def _traced(op, out, shape, dtype_name, like, **inputs):
    """Under torch.compile: allocate `out` if needed and call the rawkv::
    operator (rawkv.library), which dynamo can trace."""
    import torch
    if out is None:
        out = torch.empty(shape, dtype=getattr(torch, dtype_name), device=like.device)
    op.call(torch, **inputs, out=out)
    return out


ENCODE_OP = OpDecl("e4m3_encode", e4m3_encode, "Tensor x, Tensor(a!) out")
DECODE_OP = OpDecl("e4m3_decode", e4m3_decode, "Tensor codes, Tensor(a!) out")
