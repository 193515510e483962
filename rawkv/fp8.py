"""E4M3 (float8_e4m3fn) encode and decode of whole tensors (docs/format.md, 1).

    codes = rawkv.fp8.e4m3_encode(x)            # float32/float16/bfloat16 -> E4M3 bytes
    y = rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)

CUDA tensors run the kernels declared in rawkv.kernels.fp8; numpy arrays and
CPU tensors run rawkv.reference.formats, which defines the result bit for bit.
"""
from __future__ import annotations

from . import _args as A
from . import _dispatch as D
from ._op import dims, empty, op
from .kernels import fp8 as K
from .reference import formats as ref
from .runtime import get_runtime

_BLOCK = 256
_CODES = ("uint8", "float8_e4m3fn")            # what codes may be


def e4m3_encode(x, *, out=None, stream=None):
    """E4M3 codes of `x` (float32/float16/bfloat16, any shape, contiguous):
    RNE, satfinite to +-448, NaN -> 0x7F. Returns a float8_e4m3fn tensor (a
    uint8 numpy array for numpy input), or `out` (uint8 or float8_e4m3fn,
    contiguous, x's shape)."""
    if out is None:
        out = empty(x, dims(x), "float8_e4m3fn", stream)
    _encode(x, out, stream)
    return out


def e4m3_decode(codes, *, dtype=None, out=None, stream=None):
    """Values of E4M3 `codes` (uint8 or float8_e4m3fn, contiguous) as `dtype`
    (float32 default, else out's dtype; float16 or bfloat16 are exact since
    every E4M3 value is; numpy output holds bfloat16 values in float32)."""
    name = A.decode_dtype(dtype, out, "float32")
    if out is None:
        out = empty(codes, dims(codes), name, stream)
    _decode(codes, out, stream, name)
    return out


# ---- arguments --------------------------------------------------------------------------------
def _encode_args(x, out):
    """(placement, x, out) of an encode, checked."""
    where = D.placement(("x", x), ("out", out))
    A.check_outputs((("out", out),), (("x", x),))
    x = A.tensor(x, "x", A.FLOATS, where)
    out = A.tensor(out, "out", _CODES, where, shape=x.shape, device=A.device_of(x))
    return where, x, out


def _decode_args(codes, out, dtype):
    """(placement, codes, out, decoded dtype name) of a decode, checked."""
    where = D.placement(("codes", codes), ("out", out))
    A.check_outputs((("out", out),), (("codes", codes),))
    codes = A.tensor(codes, "codes", _CODES, where)
    out, name = A.decoded(out, dtype, where, codes.shape, A.device_of(codes))
    return where, codes, out, name


# ---- the ops ------------------------------------------------------------------------------------
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


# (device, x dtype, out dtype) -> (Runtime, {vector?: Instance}, the device's
# grids): filled by the checked path, read by the fast path of a decode step.
_ENCODE_FAST: dict = {}


@op("e4m3_encode", "Tensor x, Tensor(a!) out")
def _encode(x, out, stream=None):
    """rawkv::e4m3_encode: the codes of x into out."""
    # Fast path (CUDA tensors, a combination the checked path has accepted
    # before): the same checks, inlined; whatever fails them takes the
    # checked path, which raises the error naming the argument.
    try:
        ent = _ENCODE_FAST.get((x.get_device(), x.dtype, out.dtype)) if x.is_cuda is out.is_cuda is True else None
    except AttributeError:
        ent = None
    if ent is not None and out.shape == x.shape and x.is_contiguous() and out.is_contiguous() \
            and out.get_device() == ent[0].device_index:
        n = x.numel()
        xp, op_ = x.data_ptr(), out.data_ptr()
        if not n:
            return
        if op_ + n <= xp or xp + n * x.element_size() <= op_:      # apart (else: the checked path refuses)
            rt = ent[0]
            ent[1][(xp | op_) & 15 == 0].launch(rt, ent[2].get(n) or _grid(rt, n), (_BLOCK,),
                                                stream=stream, x=xp, out=op_, n=n)
            return
    where, x, out = _encode_args(x, out)
    if where == "cpu":
        D.from_numpy(ref.e4m3_encode(D.to_numpy(x, "x")), x, torch_dtype="float8_e4m3fn", out=out)
        return
    n = x.numel()
    if n:
        rt = get_runtime(x.get_device())
        K.ENCODE.launch(rt, _grid(rt, n), (_BLOCK,), x.dtype, A.aligned16(x, out), stream=stream,
                        x=x, out=out, n=n)
        _ENCODE_FAST.setdefault((rt.device_index, x.dtype, out.dtype), (
            rt, {v: K.ENCODE.instance(x.dtype, v) for v in (False, True)}, _GRIDS[rt.device_index]))


@op("e4m3_decode", "Tensor codes, Tensor(a!) out")
def _decode(codes, out, stream=None, dtype=None):
    """rawkv::e4m3_decode: the values of codes into out, in out's dtype
    (`dtype`, the public op's, when out is a numpy float32 array holding
    bfloat16 values)."""
    where, codes, out, name = _decode_args(codes, out, dtype)
    if where == "cpu":
        D.from_numpy(ref.round_to_dtype(ref.e4m3_decode(D.to_numpy(codes, "codes")), name), codes,
                     torch_dtype=name, out=out)
        return
    n = codes.numel()
    if n:
        rt = get_runtime(codes.get_device())
        K.DECODE.launch(rt, _grid(rt, n), (_BLOCK,), out.dtype, A.aligned16(codes, out), stream=stream,
                        codes=codes, out=out, n=n)
