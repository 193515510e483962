"""E4M3 (float8_e4m3fn) encode and decode of whole tensors (docs/format.md, 1),
and FP8 block activations (docs/format.md, "FP8 block activations"): E4M3
codes with one scale per token per block of channels, DeepSeek's act_quant.

    codes = rawkv.fp8.e4m3_encode(x)            # float32/float16/bfloat16 -> E4M3 bytes
    y = rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)
    codes, scales = rawkv.fp8.quantize_blocks(x, scale_format="ue8m0")
    y = rawkv.fp8.dequantize_blocks(codes, scales, dtype=torch.bfloat16)

CUDA tensors run the kernels declared in rawkv.kernels.fp8; numpy arrays and
CPU tensors run rawkv.reference.formats, which defines the result bit for bit.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _args as A
from ._op import empty, op
from ._plan import Launch, grid_stride
from .kernels import fp8 as K
from .kernels import fp8_blocks as KB
from .reference import formats as ref
from .reference import fp8_blocks as bref
from .runtime import get_runtime

_BLOCK = 256
CODES = ("uint8", "float8_e4m3fn")             # what codes may be


def e4m3_encode(x, *, out=None, stream=None):
    """E4M3 codes of `x` (float32/float16/bfloat16, any shape, contiguous):
    RNE, satfinite to +-448, NaN -> 0x7F. Returns a float8_e4m3fn tensor (a
    uint8 numpy array for numpy input), or `out` (uint8 or float8_e4m3fn,
    contiguous, x's shape)."""
    if out is None:
        # (as the rules read x: a DLPack array by its view, a layout they refuse
        # as (0,), which they name before out: A.out_lead)
        out = empty(x, A.out_lead(x, "x"), "float8_e4m3fn", stream)
    _encode(x, out, stream)
    return out


def e4m3_decode(codes, *, dtype=None, out=None, stream=None):
    """Values of E4M3 `codes` (uint8 or float8_e4m3fn, contiguous) as `dtype`
    (float32 default, else out's dtype; float16 or bfloat16 are exact since
    every E4M3 value is; numpy output holds bfloat16 values in float32)."""
    name = A.decode_dtype(dtype, out, "float32")
    if out is None:
        out = empty(codes, A.out_lead(codes, "codes"), name, stream)     # (as e4m3_encode sizes its out)
    _decode(codes, out, stream, name)
    return out


# ---- arguments --------------------------------------------------------------------------------
def _encode_args(x, out):
    """(placement, x, out) of an encode, checked."""
    where = A.placement(("x", x), ("out", out))
    A.check_outputs((("out", out),), (("x", x),))
    x = A.tensor(x, "x", A.FLOATS, where, align=A.ELEMENT)
    out = A.tensor(out, "out", CODES, where, shape=x.shape, device=A.device_of(x))
    return where, x, out


def _decode_args(codes, out, dtype):
    """(placement, codes, out, decoded dtype name) of a decode, checked."""
    where = A.placement(("codes", codes), ("out", out))
    A.check_outputs((("out", out),), (("codes", codes),))
    codes = A.tensor(codes, "codes", CODES, where)
    out, name = A.decoded(out, dtype, where, codes.shape, A.device_of(codes), align=A.ELEMENT)
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


# (x's device, out's device, x dtype, out dtype, n, both 16-byte aligned,
# the decode's `dtype` argument) -> the bound launch (Instance.bind) of that encode / decode: filled by the
# checked path when it launches on torch's current stream, read by the fast
# path of a decode step's repeated calls; emptied when it grows large.
_ENCODE_FAST: dict = {}
_DECODE_FAST: dict = {}


def _fast_key(a, out, n, ap, op_, dtype=None) -> tuple:
    # (the pointers' low four bits: their 16-byte alignment, which picks the
    # instance, and their element alignment; a negative bit, a zero pointer
    # holding elements or a pointer not aligned to its elements is a key the
    # checked path, which refuses them, never remembers: such a call takes it)
    return (a.get_device(), out.get_device(), a.dtype, out.dtype, n, ap & 15, op_ & 15, dtype,
            a.is_neg() or out.is_neg() or (n > 0 and not (ap and op_)))


def _remember(cache: dict, key: tuple, inst, rt, n) -> None:
    """Bind the launch of `key` once (inputs the fast path never takes, such
    as DLPack arrays, come through the checked path on every call)."""
    if key in cache:
        return
    if len(cache) > 4096:
        cache.clear()
    cache[key] = inst.bind(rt, _grid(rt, n), (_BLOCK,))


@op("e4m3_encode", "Tensor x, Tensor(a!) out")
def _encode(x, out, stream=None):
    """rawkv::e4m3_encode: the codes of x into out."""
    # Fast path (CUDA tensors on torch's stream, a combination the checked
    # path has launched before): the same checks, inlined; whatever fails
    # them takes the checked path, which raises the error naming the argument.
    if stream is None:
        go = None
        try:
            if x.is_cuda is out.is_cuda is True and out.shape == x.shape and x.is_contiguous() \
                    and out.is_contiguous() and not out.requires_grad and A.writable_here((out,)):
                xp, op_, n = x.data_ptr(), out.data_ptr(), x.numel()
                go = _ENCODE_FAST.get(_fast_key(x, out, n, xp, op_))
                if go is not None and not (op_ + n <= xp or xp + n * x.element_size() <= op_):   # apart
                    go = None
        except (AttributeError, RuntimeError):
            # (not a tensor, or a sparse / nested one: no sizes, strides or data
            # pointer to read, torch's RuntimeError; the checked path names it)
            go = None
        if go is not None:
            go(xp, op_, n)
            return
    where, x, out = _encode_args(x, out)
    if where == "cpu":
        A.from_numpy(ref.e4m3_encode(A.to_numpy(x, "x")), x, torch_dtype="float8_e4m3fn", out=out)
        return
    n = x.numel()
    if n:
        rt = get_runtime(x.get_device())
        inst = K.ENCODE.instance(x.dtype, A.aligned16(x, out))
        inst.launch(rt, _grid(rt, n), (_BLOCK,), stream=stream, x=x, out=out, n=n)
        if stream is None:
            _remember(_ENCODE_FAST, _fast_key(x, out, n, x.data_ptr(), out.data_ptr()), inst, rt, n)


@op("e4m3_decode", "Tensor codes, Tensor(a!) out")
def _decode(codes, out, stream=None, dtype=None):
    """rawkv::e4m3_decode: the values of codes into out, in out's dtype
    (`dtype`, the public op's, when out is a numpy float32 array holding
    bfloat16 values)."""
    # Fast path: as the encode's; `dtype` is part of the combination (the
    # checked path refuses one out's dtype contradicts).
    if stream is None:
        go = None
        try:
            if codes.is_cuda is out.is_cuda is True and out.shape == codes.shape and codes.is_contiguous() \
                    and out.is_contiguous() and not out.requires_grad and A.writable_here((out,)):
                cp, op_, n = codes.data_ptr(), out.data_ptr(), codes.numel()
                go = _DECODE_FAST.get(_fast_key(codes, out, n, cp, op_, dtype))
                if go is not None and not (op_ + n * out.element_size() <= cp or cp + n <= op_):  # apart
                    go = None
        except (AttributeError, RuntimeError):      # (as the encode's)
            go = None
        if go is not None:
            go(cp, op_, n)
            return
    where, codes, out, name = _decode_args(codes, out, dtype)
    if where == "cpu":
        A.from_numpy(ref.round_to_dtype(ref.e4m3_decode(A.to_numpy(codes, "codes")), name), codes,
                     torch_dtype=name, out=out)
        return
    n = codes.numel()
    if n:
        rt = get_runtime(codes.get_device())
        inst = K.DECODE.instance(out.dtype, A.aligned16(codes, out))
        inst.launch(rt, _grid(rt, n), (_BLOCK,), stream=stream, codes=codes, out=out, n=n)
        if stream is None:
            _remember(_DECODE_FAST, _fast_key(codes, out, n, codes.data_ptr(), out.data_ptr(), dtype), inst, rt, n)


# ---- FP8 block activations ----------------------------------------------------------------------
BLOCKS = bref.BLOCKS
SCALE_FORMATS = bref.SCALE_FORMATS
#: x's last dimension must be a multiple of this: the quantizer's lanes hold
#: 16 channels each (whole 16-byte vectors of x and of the codes), so a
#: partial last block is a whole number of lanes.
K_MULTIPLE = 16
UE8M0_SCALES = ("uint8", "float8_e8m0fnu", "float32")     # bytes, or the power of two as float32


def quantize_blocks(x, *, block: int = 128, scale_format: str = "fp32", out=None, stream=None):
    """E4M3 codes of x (..., K) with one scale per row per `block` channels
    (32, 64 or 128; K % 16 == 0, the last block may be partial) ->
    (codes (..., K), scales (..., ceil(K/block))), bytes equal to
    DeepSeek-V4's act_quant for finite input (rawkv.reference.fp8_blocks
    states the rule and its source). scale_format 'fp32': s = amax *
    FP32(1/448), float32 scales; 'ue8m0': s rounded up to a power of two,
    stored as its E8M0 byte (float8_e8m0fnu where torch has it, else uint8),
    or as that float32 when out's scales buffer is float32. code =
    E4M3(x / s). A block holding NaN or Inf gets codes 0 and a NaN scale
    (0xFF for E8M0). x: float32/float16/bfloat16, contiguous, 16-byte
    aligned. codes are float8_e4m3fn (numpy: uint8); out=(codes, scales)
    buffers (uint8 or float8_e4m3fn codes, 16-byte aligned; scales as
    above) are written and returned, both checked before either is."""
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise TypeError("out: expected a tuple (codes, scales) of buffers (entries may be None)")
    codes, scales = out if out is not None else (None, None)
    s = A.out_lead(x, "x")       # ((0,) for a layout the rules refuse before the buffers)
    if codes is None:
        codes = empty(x, s, "float8_e4m3fn", stream)
    new_bytes = scales is None and scale_format != "fp32"
    if scales is None:
        scales = new_scales(x, s, block, scale_format, stream)
    _quantize_blocks(x, block, scale_format, codes, scales_bytes(scales, scale_format, "scales"), stream)
    return codes, (as_e8m0(scales) if new_bytes else scales)


def dequantize_blocks(codes, scales, *, block: int = 128, dtype=None, out=None, stream=None):
    """The values code * scale (one FP32 product each, rounded to `dtype`:
    float32 default, else out's; numpy output holds bfloat16 values in
    float32) of quantize_blocks' codes (..., K) and scales (..., ceil(K/block)):
    float32 scales, or E8M0 bytes (uint8 / float8_e8m0fnu). NaN codes and
    NaN scales give NaN."""
    name = A.decode_dtype(dtype, out, "float32")
    if out is None:
        out = empty(codes, A.out_lead(codes, "codes"), name, stream)     # (as e4m3_encode sizes its out)
    _dequantize_blocks(codes, e8m0_bytes(scales), block, out, stream, name)
    return out


class Fp8Activation(NamedTuple):
    """FP8 block activations written by a producer (rawkv.fused's *_fp8 ops;
    docs/fused.md): `codes` (..., K) E4M3 (float8_e4m3fn; numpy: uint8),
    `scales` (..., ceil(K/block)) as quantize_blocks returns them (float32,
    or for 'ue8m0' E8M0 bytes, or their float32 powers of two where out=
    gave a float32 buffer), `inv_rms` (...) float32 of an RMSNorm, else None.
    dequantize_blocks(codes, scales, block=...) decodes them."""
    codes: Any
    scales: Any
    inv_rms: Any = None


# ---- the block format's rules, shared with the fused producers' FP8 outputs -------------------
def check_block(block) -> None:
    """block: one of BLOCKS (a Python int, as the op's body gets a NumPy
    one: rawkv._op; a bool is a TypeError, A.refuse_bool; a float is
    refused)."""
    A.refuse_bool(block, "block", "an int")
    if block.__class__ is not int or block not in BLOCKS:
        raise ValueError(f"block: expected one of {BLOCKS}, got {block!r}")


def check_scale_format(scale_format) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format: expected one of {SCALE_FORMATS}, got {scale_format!r}")


def check_scales(scales, name: str, scale_format: str, where: str, shape, device) -> tuple:
    """(scales, (UE8M0, SBYTE)): a scales buffer of `shape` to write,
    checked (float32 for 'fp32'; for 'ue8m0' E8M0 bytes or their float32
    values; any layout check_scale_layout takes), and the kernels' scale
    format (rawkv.kernels.fp8_blocks SCALE_*) it asks for."""
    scales = A.tensor(scales, name, ("float32",) if scale_format == "fp32" else UE8M0_SCALES, where, shape=shape,
                      device=device, dense=False, align=A.ELEMENT)
    check_scale_layout(scales, name, write=True)
    return scales, scales_kind(scale_format, scales)


def check_scale_layout(scales, name: str, write: bool) -> None:
    """Scales (..., nb) are taken at any strides whose leading dimensions
    collapse into one evenly strided row index (scale (row, b) at
    row * s_row + b * s_blk: scale_strides), DeepSeek's row-major and
    DeepGEMM's MN-major layouts alike (docs/format.md, "Scale layouts"); to
    be written, no two of them may share memory (each is written once, by
    one thread). A ValueError names `name` otherwise."""
    if A.is_dense(scales):
        return                               # (the usual layout: nothing to work out)
    shape, st = tuple(scales.shape), A.strides(scales)
    lead = [(d, s) for d, s in zip(shape[:-1], st[:-1]) if d != 1]
    if any(s != s_in * d_in for (_, s), (d_in, s_in) in zip(lead, lead[1:])):
        raise ValueError(f"{name}: its leading dimensions {shape[:-1]} (strides {st[:-1]}) are not one evenly "
                         "strided row index; the FP8 kernels take scales (row, block) at two strides")
    if write and not A.apart(shape, st):
        raise ValueError(f"{name}: strides {st} make two scales share memory; "
                         "a scales buffer to write holds each scale once")


def scale_strides(scales) -> tuple:
    """(s_row, s_blk): the elements between a scales view's rows (its
    leading dimensions as one index, check_scale_layout) and between its
    blocks; the kernels read and write scale (row, b) at row * s_row +
    b * s_blk. (One row: its own stride, which nothing steps by.)"""
    shape, st = tuple(scales.shape), A.strides(scales)
    rows = [s for d, s in zip(shape[:-1], st[:-1]) if d != 1] or list(st[-2:-1]) or [0]
    return rows[-1], (st[-1] if st else 1)


def scales_kind(scale_format: str, scales) -> tuple:
    """(UE8M0, SBYTE) of a checked scales buffer: 'ue8m0' stored as bytes
    unless the buffer is float32."""
    if scale_format == "fp32":
        return KB.SCALE_FP32
    return KB.SCALE_UE8M0_F32 if A.itemsize(scales) == 4 else KB.SCALE_UE8M0


def new_scales(like, s: tuple, block, scale_format: str, stream=None):
    """A new scales buffer for x of shape s (..., K) where `like` lives:
    float32 for 'fp32', else uint8 E8M0 bytes (as_e8m0 views them for the
    caller); no columns for a block the op will refuse."""
    # (isinstance, not `__class__ is int`: dynamo evaluates the latter False
    # while torch.compile traces, giving a scales buffer of no columns; a
    # NumPy int is the int it holds, as the op takes it: rawkv._op)
    block = A.as_number(block)
    nb = bref.block_count(s[-1], block) if s and isinstance(block, int) and block in BLOCKS else 0
    # New E8M0 scales are written as uint8 and returned as a float8_e8m0fnu
    # view: torch.compile's inductor cannot functionalize an operator that
    # writes a float8_e8m0fnu buffer ("auto_functionalized_v2 was not
    # removed", torch 2.11 on the H200), while a dtype view of the result is fine.
    return empty(like, (*s[:-1], nb), "float32" if scale_format == "fp32" else "uint8", stream)


def as_e8m0(scales):
    """New E8M0 scale bytes as float8_e8m0fnu where torch has it (numpy and
    older torch: uint8)."""
    if _e8m0() != "uint8" and hasattr(scales, "view") and not isinstance(scales, np.ndarray):
        return scales.view(A._torch_or_none().float8_e8m0fnu)
    return scales


def e8m0_bytes(scales):
    """float8_e8m0fnu scales as their uint8 bytes (anything else as it is):
    what an operator takes, since torch.compile's inductor cannot
    functionalize an operator taking a float8_e8m0fnu tensor
    ("auto_functionalized_v2 was not removed", torch 2.11, H100)."""
    t = A._torch_or_none()
    if t is not None and getattr(scales, "dtype", None) is getattr(t, "float8_e8m0fnu", False):
        return scales.view(t.uint8)       # (a dtype test, not a string built per call)
    return scales


def scales_bytes(scales, scale_format, name: str):
    """A public op's scales buffer as its operator takes it (e8m0_bytes: a
    float8_e8m0fnu buffer as its uint8 bytes), for quantize_blocks and the
    fused producers' FP8 outputs alike. A float8_e8m0fnu buffer for
    scale_format 'fp32' is refused here, a TypeError naming `name` and its
    own dtype: the operator would see its bytes and name a uint8 buffer the
    caller never passed."""
    byte_scales = e8m0_bytes(scales)
    if byte_scales is not scales and scale_format == "fp32":
        raise TypeError(f"{name}: dtype float8_e8m0fnu is not supported for scale_format 'fp32' "
                        "(expected float32; E8M0 scales are scale_format 'ue8m0')")
    return byte_scales


def host_scales(scales, fmt):
    """The reference's scales (float32, or E8M0 bytes) as a buffer of
    format `fmt` stores them: E8M0 bytes as their float32 powers of two for
    SCALE_UE8M0_F32."""
    return bref.ue8m0_value(scales) if fmt == KB.SCALE_UE8M0_F32 else scales


def _e8m0() -> str:
    """The dtype of new E8M0 scales: float8_e8m0fnu where torch has it (2.7+),
    else uint8 (numpy: uint8 either way). Asked per call: `import rawkv`
    imports no torch. Through rawkv._args's global, not sys.modules:
    torch.compile copies sys.modules when traced code reads it, and a lazy
    import meanwhile fails the trace ('dictionary changed size during
    iteration': the first compiled quantize_blocks after hypothesis was
    imported)."""
    t = A._torch_or_none()
    return "float8_e8m0fnu" if t is None or hasattr(t, "float8_e8m0fnu") else "uint8"


def _block_rows(x, name: str, block):
    """(rows, K) of x (..., K): K % 16 == 0, and block one of BLOCKS."""
    check_block(block)
    k = x.shape[-1]
    if k % K_MULTIPLE:
        raise ValueError(f"{name}: the last dimension must be a multiple of {K_MULTIPLE} "
                         f"(whole 16-byte vectors), got {k}")
    return A.numel(x) // k if k else 0, k


def _quantize_blocks_args(x, block, scale_format, codes, scales):
    """(placement, x, rows, K, codes, scales, (UE8M0, SBYTE)) of a quantize_blocks, checked."""
    where = A.placement(("x", x), ("codes", codes), ("scales", scales))
    A.check_outputs((("codes", codes), ("scales", scales)), (("x", x),))
    x = A.tensor(x, "x", A.FLOATS, where, min_ndim=1, align=16)
    rows, k = _block_rows(x, "x", block)
    check_scale_format(scale_format)
    dev = A.device_of(x)
    codes = A.tensor(codes, "codes", CODES, where, shape=x.shape, device=dev, align=16)
    scales, fmt = check_scales(scales, "scales", scale_format, where, (*x.shape[:-1], bref.block_count(k, block)),
                               dev)
    return where, x, rows, k, codes, scales, fmt


def plan_quantize_blocks(dev, x, codes, scales, rows, k, block, fmt) -> list:
    """The launch of a quantize_blocks of rows x K > 0 elements on device
    `dev` (rawkv._plan.Device or a Runtime): one thread per 16 channels of
    a unit (row, block), the units of a warp consecutive."""
    grid, threads = grid_stride(dev, KB.quantize_threads(rows, k, block), _BLOCK)
    s_row, s_blk = scale_strides(scales)
    return [Launch(KB.QUANTIZE.instance(x.dtype, block, *fmt), (grid,), (threads,),
                   dict(x=x, codes=codes, scales=scales, s_row=s_row, s_blk=s_blk, rows=rows, K=k))]


@op("fp8_quantize_blocks", "Tensor x, Scalar block, str scale_format, Tensor(a!) codes, Tensor(b!) scales")
def _quantize_blocks(x, block, scale_format, codes, scales, stream=None):
    """rawkv::fp8_quantize_blocks: the codes and scales of x into codes and scales."""
    where, x, rows, k, codes, scales, fmt = _quantize_blocks_args(x, block, scale_format, codes, scales)
    if where == "cpu":
        rc, rs = bref.quantize_blocks(A.to_numpy(x, "x"), block, scale_format)
        A.from_numpy(rc, x, out=codes)
        A.from_numpy(host_scales(rs, fmt), x, out=scales)
        return
    if rows * k:
        rt = get_runtime(x.get_device())
        rt.run(plan_quantize_blocks(rt, x, codes, scales, rows, k, block, fmt), stream)


def _dequantize_blocks_args(codes, scales, block, out, dtype):
    """(placement, codes, scales, rows, K, out, dtype name) of a dequantize_blocks, checked."""
    where = A.placement(("codes", codes), ("scales", scales), ("out", out))
    A.check_outputs((("out", out),), (("codes", codes), ("scales", scales)))
    codes = A.tensor(codes, "codes", CODES, where, min_ndim=1, align=8)
    rows, k = _block_rows(codes, "codes", block)
    dev = A.device_of(codes)
    scales = A.tensor(scales, "scales", UE8M0_SCALES, where,
                      shape=(*codes.shape[:-1], bref.block_count(k, block)), device=dev, dense=False,
                      align=A.ELEMENT)
    check_scale_layout(scales, "scales", write=False)
    out, name = A.decoded(out, dtype, where, codes.shape, dev, align=16)
    return where, codes, scales, rows, k, out, name


def plan_dequantize_blocks(dev, codes, scales, out, rows, k, block) -> list:
    """The launch of a dequantize_blocks of rows x K > 0 codes: one thread
    per DEQUANTIZE_UNIT codes."""
    grid, threads = grid_stride(dev, rows * k // KB.DEQUANTIZE_UNIT, _BLOCK)
    s_row, s_blk = scale_strides(scales)
    return [Launch(KB.DEQUANTIZE.instance(out.dtype, scales.element_size() == 1), (grid,), (threads,),
                   dict(codes=codes, scales=scales, s_row=s_row, s_blk=s_blk, out=out, rows=rows, K=k, blk=block))]


@op("fp8_dequantize_blocks", "Tensor codes, Tensor scales, Scalar block, Tensor(a!) out")
def _dequantize_blocks(codes, scales, block, out, stream=None, dtype=None):
    """rawkv::fp8_dequantize_blocks: code * scale into out, in out's dtype
    (`dtype`, the public op's, when out is a numpy float32 array holding
    bfloat16 values)."""
    where, codes, scales, rows, k, out, name = _dequantize_blocks_args(codes, scales, block, out, dtype)
    if where == "cpu":
        v = bref.dequantize_blocks(A.to_numpy(codes, "codes"), A.to_numpy(scales, "scales"), block)
        A.from_numpy(ref.round_to_dtype(v, name), codes, torch_dtype=name, out=out)
        return
    if rows * k:
        rt = get_runtime(codes.get_device())
        rt.run(plan_dequantize_blocks(rt, codes, scales, out, rows, k, block), stream)
