"""The grouped FP4-weight GEMM (docs/gemm.md): rawkv.gemm.grouped_linear
(every token to every group: DeepSeek-V4 wo_a) and rawkv.gemm.moe_linear
(rows sorted by expert). On CUDA tensors one launch of rawkv/cu/gemm_fp4.cu
(mma.sync), or on Hopper from SM90_MIN_TOKENS tokens of rawkv/cu/gemm_fp4_sm90.cu
(wgmma); on CPU tensors the numpy reference (exact dequantization, float64 product,
one rounding to BF16)."""
from __future__ import annotations

import math

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import gemm_fp4 as K
from ..nvfp4 import counters
from ..reference import formats as F
from ..reference import gemm as ref
from ..runtime import get_runtime
from .weights import MX_WINDOW_FP16, Fp4Weight


def grouped_linear(x, weight, *, out=None, stream=None):
    """out (T, G, N) BF16 = x[t, g, :] . weight[g, n, :] for every token t
    and group g, accumulated in FP32.

    x: (T, G, K) bfloat16 / float16, or a rawkv.nvfp4.QuantizedActivation of
    such an x (q (T, G, K/2), sf (T, G, K/16), gs a float32 tensor of shape
    () / (1,) or (T, G)); numpy arrays too (docs/gemm.md, "Arguments").
    weight: a rawkv.gemm.Fp4Weight of G groups."""
    _check_weight(weight)
    if D.compiling():
        return _traced(GROUPED_OP, x, weight, out, 3)
    act = _activation(x, weight, "x", 3, ("out", out))
    t, g = act.lead
    if g != weight.groups:
        raise ValueError(f"x: has {g} groups, the weight {weight.groups}")
    A.check_outputs((("out", out),), (("x", act.x), ("x.sf", act.sf), ("x.gs", act.gs)))
    out = _check_out(out, (t, g, weight.n), act)
    if act.where == "cpu":
        return _cpu_out(ref.grouped(act.values(), _weight_values(weight)), out, act.x)
    if t and weight.n:
        rt = get_runtime(act.device)
        kern, targs, block, tile_rows, tile_tokens = _plan(rt, weight, t)
        grid = (-(-weight.n // tile_rows), -(-t // tile_tokens), g)
        _launch(rt, kern, targs, block, act, weight, out, grid, t, None, 0, None, stream)
    return out


def moe_linear(x, weight, offsets, *, out=None, errors=None, stream=None):
    """out (R, N) BF16: row r of x times expert e's weight, for the rows
    offsets[e] <= r < offsets[e+1] (rows sorted by expert).

    x: (R, K) bfloat16 / float16, or a QuantizedActivation (q (R, K/2),
    sf (R, K/16), gs () / (1,) / (R,)). offsets: int32 (E+1,) on the
    device, E = weight.groups, read only by the kernel: out-of-order or
    out-of-range offsets are clamped (docs/gemm.md), rows no expert owns are
    written as zeros, and each clamp is counted in errors[0] (an int32
    tensor) or, with errors=None, in rawkv.nvfp4.error_counts()[GEMM_OFFSETS]."""
    _check_weight(weight)
    if D.compiling():
        return _traced(MOE_OP, x, weight, out, 2, offsets=offsets, errors=errors)
    act = _activation(x, weight, "x", 2, ("offsets", offsets), ("errors", errors), ("out", out))
    (r,) = act.lead
    experts = weight.groups
    A.check_outputs((("out", out), ("errors", errors)),
                    (("x", act.x), ("x.sf", act.sf), ("x.gs", act.gs), ("offsets", offsets)))
    if experts + 1 > K.MAX_SEGMENTS:
        raise ValueError(f"weight: {experts} experts; the ragged kernel takes at most {K.MAX_SEGMENTS - 1}")
    offsets = _int32_arg(offsets, "offsets", act, (experts + 1,))
    if errors is not None:
        errors = _int32_arg(errors, "errors", act)
        if math.prod(errors.shape) < 1:
            raise ValueError("errors: needs at least one int32 slot")
    out = _check_out(out, (r, weight.n), act)
    if act.where == "cpu":
        offs = D.to_numpy(offsets, "offsets").astype(np.int64)
        y, bad = ref.ragged(act.values(), _weight_values(weight), offs)
        if errors is not None:
            errors.reshape(-1)[0] += bad        # (contiguous: a view) the kernel's errors[0]
        else:
            counters.add_cpu(counters.GEMM_OFFSETS, bad)
        return _cpu_out(y, out, act.x)
    dev = act.device
    if r and weight.n:
        rt = get_runtime(dev)
        err_ptr = errors.data_ptr() if errors is not None else counters.address(rt, counters.GEMM_OFFSETS, stream)
        kern, targs, block, tile_rows, tile_tokens = _plan(rt, weight, -(-r // max(1, min(experts, r))), ragged=True)
        slots = min(r, -(-r // tile_tokens) + experts + 2)
        grid = (-(-weight.n // tile_rows), slots, 1)
        _launch(rt, kern, targs, block, act, weight, out, grid, r, offsets, experts, err_ptr, stream)
    return out


# ---- arguments ----------------------------------------------------------------
# One set of rules for CPU and CUDA (dtype names as torch spells them): each
# argument is checked here before the branch, and the CUDA path adds only the
# device (and what the kernel's raw reads need).

X_DTYPES = ("bfloat16", "float16")
#: numpy has no bfloat16: a numpy float32 x stands for one, holding BF16
#: values (rawkv's host convention; other values are refused), and a numpy
#: out is float32 holding the BF16 results.
X_DTYPES_NUMPY = ("float32", "float16")
OUT_DTYPES_NUMPY = ("float32",)
BYTE_DTYPES = ("uint8", "float8_e4m3fn", "float4_e2m1fn_x2")      # q and sf: bytes or their views


def _check_weight(weight) -> None:
    if not isinstance(weight, Fp4Weight):
        raise TypeError(f"weight: expected a rawkv.gemm.Fp4Weight, got {type(weight).__name__}")


def _dtype_name(v, name: str) -> str:
    """v's dtype as torch spells it (for torch tensors a dict lookup: the
    CUDA hot path)."""
    if D.is_torch(v):
        return A.dtypes().name.get(v.dtype) or str(v.dtype).replace("torch.", "")
    return A.cpu_dtype_name(v, name)


def _check_dtype(v, name: str, allowed) -> str:
    d = _dtype_name(v, name)
    if d not in allowed:
        raise TypeError(f"{name}: dtype {d} is not supported (expected {', '.join(allowed)})")
    return d


def _check_on(v, name: str, dev: int) -> None:
    """A CUDA path argument on the op's device."""
    if v.get_device() != dev:
        raise ValueError(f"{name}: is on {v.device} but the op runs on cuda:{dev}")


def _is_contiguous(v) -> bool:
    return v.flags.c_contiguous if isinstance(v, np.ndarray) else v.is_contiguous()


def _last_stride(v) -> int:
    """The last dimension's stride in elements."""
    return v.strides[-1] // v.itemsize if isinstance(v, np.ndarray) else v.stride(-1)


def _int32_arg(v, name: str, act, shape=None):
    """offsets / errors: an int32 array, contiguous (the kernel reads it by
    address), where x is; the CUDA tensor for the CUDA path."""
    A.require_array(v, name)
    if act.where == "cuda":
        v = D.as_cuda_tensor(v, name)
    _check_dtype(v, name, ("int32",))
    if shape is not None and tuple(v.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(v.shape)}")
    if not _is_contiguous(v):
        raise ValueError(f"{name}: must be contiguous; call .contiguous() first")
    if act.where == "cuda":
        _check_on(v, name, act.device)
    return v


def _check_out(out, shape, act):
    """out=: bfloat16 (a numpy out: float32 holding BF16 values), `shape`,
    last dimension contiguous, where x is. Returns out, or on CUDA a fresh
    one for None."""
    if out is None:
        if act.where == "cpu":
            return None
        t = _torch()
        return t.empty(shape, dtype=t.bfloat16, device=f"cuda:{act.device}")
    if act.where == "cuda":
        out = D.as_cuda_tensor(out, "out")
    _check_dtype(out, "out", OUT_DTYPES_NUMPY if isinstance(out, np.ndarray) else ("bfloat16",))
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if _last_stride(out) != 1:
        raise ValueError("out: the last dimension must be contiguous")
    if act.where == "cuda":
        _check_on(out, "out", act.device)
    return out


# ---- activations ------------------------------------------------------------

def _bytes(v, name: str) -> np.ndarray:
    """A CPU byte array (uint8 or an FP8 / FP4 view; checked) as uint8."""
    return D.to_numpy(v, name).view(np.uint8)


class _Act:
    """One activation argument, checked: kind (0 BF16, 1 FP16, 2 NVFP4),
    its tensors and the element strides the kernel walks."""
    __slots__ = ("kind", "where", "device", "lead", "x", "sf", "gs", "strides", "gs_strides")

    def values(self) -> np.ndarray:
        """The activation as float64, exactly (CPU path)."""
        if self.kind != 2:
            return D.to_numpy(self.x, "x").astype(np.float64)
        codes = ref.unpack_nibbles(_bytes(self.x, "x.q"))
        sf = F.e4m3_decode(_bytes(self.sf, "x.sf")).astype(np.float64)
        gs = D.to_numpy(self.gs, "x.gs").astype(np.float64)
        gs = gs.reshape(()) if gs.size == 1 else gs[..., None]
        v = F.e2m1_decode(codes).astype(np.float64) * np.repeat(sf, 16, axis=-1)
        return v * gs


def _activation(x, weight, name, ndim, *others) -> _Act:
    """x (an array, or a QuantizedActivation's q, sf, gs) checked against
    `weight`; `others` are (name, array or None) pairs that must live where
    x does (CPU: numpy arrays or CPU tensors; CUDA: one device)."""
    quantized = hasattr(x, "q") and hasattr(x, "sf") and hasattr(x, "gs")
    parts = ((f"{name}.q", x.q), (f"{name}.sf", x.sf), (f"{name}.gs", x.gs)) if quantized else ((name, x),)
    for part, v in parts:
        A.require_array(v, part)
    for part, v in others:
        if v is not None:
            A.require_array(v, part)
    a = _Act()
    a.where = D.placement(*parts, *others, ("weight", weight.codes))
    if a.where == "cuda":
        parts = tuple((part, D.as_cuda_tensor(v, part)) for part, v in parts)
    (_nvfp4_activation if quantized else _dense_activation)(a, parts, weight, ndim)
    return a


def _nvfp4_activation(a, parts, weight, ndim) -> None:
    (qn, q), (sfn, sf), (gsn, gs) = parts
    k = weight.k
    a.kind = 2
    if tuple(q.shape[-1:]) != (k // 2,) or len(q.shape) != ndim:
        raise ValueError(f"{qn}: expected shape (..., {k // 2}) with {ndim} dimensions for K = {k}, "
                         f"got {tuple(q.shape)}")
    lead = tuple(q.shape[:-1])
    if tuple(sf.shape) != (*lead, k // 16):
        raise ValueError(f"{sfn}: expected shape {(*lead, k // 16)}, got {tuple(sf.shape)}")
    if math.prod(gs.shape) != 1 and tuple(gs.shape) != lead:
        raise ValueError(f"{gsn}: expected one value or shape {lead}, got {tuple(gs.shape)}")
    _check_dtype(q, qn, BYTE_DTYPES)
    _check_dtype(sf, sfn, BYTE_DTYPES)
    _check_dtype(gs, gsn, ("float32",))
    a.lead, a.x, a.sf, a.gs = lead, q, sf, gs
    if a.where == "cuda":
        a.device = q.get_device()
        _check_on(sf, sfn, a.device)
        _check_on(gs, gsn, a.device)
        _check_weight_device(weight, a.device)
        a.x = _rows_aligned(q, 8)
        a.sf = sf if sf.stride(-1) == 1 else sf.contiguous()
        a.strides = _lead_strides(a.x) + _lead_strides(a.sf)
        a.gs_strides = (0, 0) if gs.numel() == 1 else (tuple(gs.stride()) + (0,))[:2]


def _dense_activation(a, parts, weight, ndim) -> None:
    ((name, x),) = parts
    k = weight.k
    d = _check_dtype(x, name, X_DTYPES_NUMPY if isinstance(x, np.ndarray) else X_DTYPES)
    if len(x.shape) != ndim or x.shape[-1] != k:
        raise ValueError(f"{name}: expected shape (..., {k}) with {ndim} dimensions for K = {k}, "
                         f"got {tuple(x.shape)}")
    if d == "float32":
        _check_bf16_values(x, name)
    a.kind = 1 if d == "float16" else 0
    if a.kind == 1 and weight.fmt == "mxfp4":
        lo, hi = weight.exp_range
        if lo < MX_WINDOW_FP16[0] or hi > MX_WINDOW_FP16[1]:
            raise ValueError(f"{name}: FP16 activations need MXFP4 scale bytes in {list(MX_WINDOW_FP16)} "
                             f"(this weight's span [{lo}, {hi}]); pass BF16 activations")
    a.lead, a.x, a.sf, a.gs = tuple(x.shape[:-1]), x, None, None
    if a.where == "cuda":
        a.device = x.get_device()
        _check_weight_device(weight, a.device)
        a.x = _rows_aligned(x, 16)
        a.strides = _lead_strides(a.x) + (0, 0)
        a.gs_strides = (0, 0)


def _check_bf16_values(x: np.ndarray, name: str) -> None:
    """A numpy float32 x stands for bfloat16: each value must be one (its
    low 16 bits zero), as a BF16 tensor's would be; rounding here would
    hide a caller's mistake."""
    low = x.view(np.uint32) & 0xFFFF
    if low.any():
        at = tuple(int(i) for i in np.argwhere(low)[0])
        raise ValueError(f"{name}: a numpy float32 x stands for bfloat16 (numpy has none) and must hold "
                         f"BF16 values; x{list(at)} = {x[at]!r} is not one")


def _rows_aligned(x, align):
    """x itself when each row (last dimension) starts `align`-byte aligned
    and is contiguous; else a fresh contiguous copy (an odd view costs one
    copy; a clone, since .contiguous() would keep a misaligned start)."""
    es = x.element_size()
    ok = x.stride(-1) == 1 and x.data_ptr() % align == 0 and all(
        (s * es) % align == 0 for s in x.stride()[:-1])
    return x if ok else x.clone(memory_format=_torch().contiguous_format)


def _lead_strides(x) -> tuple:
    """(token stride, group stride) in elements; 0 for a missing group axis."""
    st = x.stride()
    return (st[0], st[1]) if x.dim() == 3 else (st[0], 0)


def _check_weight_device(weight, dev) -> None:
    if weight.codes.get_device() != dev:
        raise ValueError(f"weight: is on {weight.codes.device}, x on cuda:{dev}; rawkv does not move data")


def _config(tokens: int) -> tuple:
    for tt in (8, 16, 32, 64):
        if tokens <= tt:
            return K.CONFIGS[tt]
    return K.CONFIGS["large"]


#: Which kernel serves a launch: "auto" (the plan below), or "mma" / "sm90"
#: to force one (tests compare the two paths on the same inputs).
KERNEL_PATH = "auto"
#: When an sm_90 device takes the wgmma kernel (rawkv/cu/gemm_fp4_sm90.cu)
#: instead of the mma.sync kernel, from tools/probe_gemm_paths.py on the H100
#: (docs/gemm.md, "Hopper kernel"). Batched: from SM90_MIN_TOKENS tokens per
#: group, or from SM90_MIN_TOKENS_SMALL when its grid has SM90_MIN_BLOCKS
#: blocks or more (at 128 tokens it wins with 48 and 64 blocks, loses with
#: 32). Ragged: from SM90_MIN_EXPERT_TOKENS tokens per expert on average (it
#: wins at 32 and 96, loses at 12).
SM90_MIN_TOKENS = 256
SM90_MIN_TOKENS_SMALL = 128
SM90_MIN_BLOCKS = 48
SM90_MIN_EXPERT_TOKENS = 24
#: The wgmma kernel's token tile (64 or 128) when set; None lets the plan choose.
SM90_FORCE_BN = None
#: The wgmma kernel's feature tile (128 or 256) when set; None lets the plan
#: choose: 128 when twice the grid of 256-feature blocks still fits in one
#: wave (the kernel runs one block per SM). On the H100 (132 SMs) 128-feature
#: blocks win with 48 and 64 blocks of 256 and lose with 96 and 128 (each of
#: them adds a pass over the activations).
SM90_FORCE_BM = None


def _takes_sm90(weight, tokens: int, ragged: bool) -> bool:
    """The dispatch rule above, for an sm_90 device."""
    if ragged:
        return tokens >= SM90_MIN_EXPERT_TOKENS
    blocks = _sm90_blocks(weight, tokens, K.SM90_BM, K.SM90_CONFIGS["large"][0])
    return tokens >= SM90_MIN_TOKENS or (tokens >= SM90_MIN_TOKENS_SMALL and blocks >= SM90_MIN_BLOCKS)


def _sm90_blocks(weight, tokens: int, bm: int, bn: int) -> int:
    """Blocks of a wgmma-kernel grid for `tokens` per group (ragged: per
    expert on average, so about)."""
    return weight.groups * -(-weight.n // bm) * -(-tokens // bn)


def _plan(rt, weight, tokens: int, ragged: bool = False) -> tuple:
    """(kernel, template arguments without ACT / MX, block, output features
    per block, tokens per block) for `tokens` tokens per group (batched) or
    per expert on average (ragged)."""
    path = KERNEL_PATH
    if path == "auto":
        path = "sm90" if rt.arch == "sm_90" and _takes_sm90(weight, tokens, ragged) else "mma"
    if path == "sm90":
        if rt.arch != "sm_90":
            raise ValueError(f"x: the wgmma GEMM kernel runs on sm_90 devices, this one is {rt.arch}")
        bn = SM90_FORCE_BN or (64 if tokens <= 64 else 128)
        bn, stages = K.SM90_CONFIGS[64] if bn == 64 else K.SM90_CONFIGS["large"]
        # (128-feature blocks have 128-token tiles only)
        bm = SM90_FORCE_BM or (128 if bn == 128 and 2 * _sm90_blocks(weight, tokens, K.SM90_BM, bn) <= rt.sm_count
                               else K.SM90_BM)
        if bm == 128:
            bn, stages = K.SM90_SMALL_CONFIG
        return K.GEMM_SM90, (bn, stages, bm), (K.SM90_THREADS,), bm, bn
    cfg = _config(tokens)
    mt, nt, ks, rw = cfg[:4]
    return K.GEMM, cfg, (32 * ks * rw,), 16 * mt * rw, 8 * nt


def _launch(rt, kern, targs, block, act, weight, out, grid, tokens, offsets, experts, err_ptr, stream):
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"x: {tokens} tokens x {weight.groups} groups is past the launch grid's limit")
    xs_t, xs_g, ss_t, ss_g = act.strides
    gs_t, gs_g = act.gs_strides
    os_ = out.stride()
    inst = kern.instance(act.kind, weight.fmt == "mxfp4", *targs)
    inst.launch(
        rt, grid, block, stream=stream, shared_mem=inst.smem,
        wq=weight.codes, wsf=weight.scales, wgs=weight.gs,
        x=act.x, xsf=act.sf, xgs=act.gs, xs_t=xs_t, xs_g=xs_g, ss_t=ss_t, ss_g=ss_g,
        gs_t=gs_t, gs_g=gs_g, out=out, os_t=os_[0], os_g=os_[1] if out.dim() == 3 else 0,
        n=weight.n, k=weight.k, tokens=tokens, offsets=offsets, experts=experts, errors=err_ptr)


# ---- custom operators (rawkv.library) ----------------------------------------
# The weight travels as its tensors and sizes; an NVFP4 activation as q (in
# x), sf and gs.

_WEIGHT_SCHEMA = "Tensor codes, Tensor scales, Tensor gs, str fmt, int n, int k, int exp_lo, int exp_hi"
_X_SCHEMA = "Tensor x, Tensor? x_sf, Tensor? x_gs"


def _op_weight(codes, scales, gs, fmt, n, k, exp_lo, exp_hi):
    from .weights import Fp4Weight
    return Fp4Weight(fmt, n, k, codes, scales, gs, exp_range=(exp_lo, exp_hi) if fmt == "mxfp4" else None)


def _op_x(x, x_sf, x_gs):
    if x_sf is None:
        return x
    from ..nvfp4 import QuantizedActivation
    return QuantizedActivation(x, x_sf, x_gs)


def operator_args(x, weight) -> dict:
    """The keyword arguments of torch.ops.rawkv.gemm_grouped_linear /
    gemm_moe_linear for activation x and weight (add out=, and offsets= /
    errors= for the MoE operator)."""
    lo, hi = weight.exp_range or (0, 0)
    q = hasattr(x, "q") and hasattr(x, "sf")
    return dict(x=x.q if q else x, x_sf=x.sf if q else None, x_gs=x.gs if q else None,
                codes=weight.codes, scales=weight.scales, gs=weight.gs, fmt=weight.fmt,
                n=weight.n, k=weight.k, exp_lo=lo, exp_hi=hi)


def _grouped_op(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out):
    grouped_linear(_op_x(x, x_sf, x_gs), _op_weight(codes, scales, gs, fmt, n, k, exp_lo, exp_hi), out=out)


def _moe_op(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, offsets, out, errors):
    moe_linear(_op_x(x, x_sf, x_gs), _op_weight(codes, scales, gs, fmt, n, k, exp_lo, exp_hi), offsets,
               out=out, errors=errors)


def _traced(op, x, weight, out, ndim, **extra):
    """Under torch.compile: allocate `out` if needed and call the rawkv::
    operator, which dynamo can trace."""
    import torch
    tokens = (x.q if hasattr(x, "q") else x).shape[0]
    if out is None:
        shape = (tokens, weight.groups, weight.n) if ndim == 3 else (tokens, weight.n)
        out = torch.empty(shape, dtype=torch.bfloat16, device=weight.codes.device)
    op.call(torch, **operator_args(x, weight), **extra, out=out)
    return out


GROUPED_OP = OpDecl("gemm_grouped_linear", _grouped_op, f"{_X_SCHEMA}, {_WEIGHT_SCHEMA}, Tensor(a!) out")
MOE_OP = OpDecl("gemm_moe_linear", _moe_op,
                f"{_X_SCHEMA}, {_WEIGHT_SCHEMA}, Tensor offsets, Tensor(a!) out, Tensor(b!)? errors")


# ---- CPU --------------------------------------------------------------------

def _weight_values(weight) -> np.ndarray:
    codes, scales, gs = weight.unpack()
    return ref.dequantize_weight(D.to_numpy(codes, "weight"), D.to_numpy(scales, "weight"),
                                 D.to_numpy(gs, "weight"), weight.fmt)


def _cpu_out(y: np.ndarray, out, like):
    """The reference's float64 result rounded once to BF16, into `out`
    (checked before anything ran) when given; else a bfloat16 tensor when
    `like` (x, or its q) is a torch tensor, a float32 array holding the BF16
    values otherwise."""
    bits = ref.round_to_bf16(y)
    if out is None and not D.is_torch(like) or isinstance(out, np.ndarray):
        vals = (bits.astype(np.uint32) << 16).view(np.float32)
        if out is None:
            return vals
        out[...] = vals
        return out
    t = _torch()
    res = t.from_numpy(bits.view(np.int16).copy()).view(t.bfloat16)
    if out is None:
        return res
    out.copy_(res)
    return out


def _torch():
    import torch
    return torch
