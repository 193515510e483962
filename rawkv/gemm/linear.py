"""The grouped FP4-weight GEMM (docs/gemm.md): rawkv.gemm.grouped_linear
(every token to every group: DeepSeek-V4 wo_a) and rawkv.gemm.moe_linear
(rows sorted by expert). On CUDA tensors one launch of rawkv/cu/gemm_fp4.cu;
on CPU tensors the numpy reference (exact dequantization, float64 product,
one rounding to BF16)."""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import gemm_fp4 as K
from ..nvfp4 import counters
from ..reference import formats as F
from ..reference import gemm as ref
from ..runtime import get_runtime
from .weights import MX_WINDOW_FP16


def grouped_linear(x, weight, *, out=None, stream=None):
    """out (T, G, N) BF16 = x[t, g, :] . weight[g, n, :] for every token t
    and group g, accumulated in FP32.

    x: (T, G, K) bfloat16 / float16, or a rawkv.nvfp4.QuantizedActivation of
    such an x (q (T, G, K/2), sf (T, G, K/16), gs a float32 tensor of shape
    () / (1,) or (T, G)). weight: a rawkv.gemm.Fp4Weight of G groups."""
    if D.compiling():
        return _traced(GROUPED_OP, x, weight, out, 3)
    act = _activation(x, weight, "x", 3)
    t, g = act.lead
    if g != weight.groups:
        raise ValueError(f"x: has {g} groups, the weight {weight.groups}")
    shape = (t, g, weight.n)
    if act.where == "cpu":
        _check_cpu_out(out, shape)
        return _cpu_out(ref.grouped(act.values(), _weight_values(weight)), out)
    out = _check_out(out, shape, act.device)
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
    if D.compiling():
        return _traced(MOE_OP, x, weight, out, 2, offsets=offsets, errors=errors)
    act = _activation(x, weight, "x", 2)
    (r,) = act.lead
    shape = (r, weight.n)
    experts = weight.groups
    if act.where == "cpu":
        offs = _cpu_offsets(offsets, experts)
        _check_cpu_out(out, shape)
        if errors is not None:
            A.require_array(errors, "errors")
        y, bad = ref.ragged(act.values(), _weight_values(weight), offs)
        if errors is not None:
            errors[0] += bad
        else:
            counters.add_cpu(counters.GEMM_OFFSETS, bad)
        return _cpu_out(y, out)
    dev = act.device
    if not D.is_cuda_tensor(offsets):
        A.require_array(offsets, "offsets")
        raise ValueError("offsets: must be a CUDA tensor on the device of x (the kernel reads it)")
    A.check_tensor(offsets, "offsets", (_torch().int32,), shape=(experts + 1,), device=dev)
    if experts + 1 > K.MAX_SEGMENTS:
        raise ValueError(f"weight: {experts} experts; the ragged kernel takes at most {K.MAX_SEGMENTS - 1}")
    if errors is not None:
        A.check_tensor(errors, "errors", (_torch().int32,), device=dev)
        if errors.numel() < 1:
            raise ValueError("errors: needs at least one int32 slot")
    out = _check_out(out, shape, dev)
    if r and weight.n:
        rt = get_runtime(dev)
        err_ptr = errors.data_ptr() if errors is not None else counters.address(rt, counters.GEMM_OFFSETS, stream)
        kern, targs, block, tile_rows, tile_tokens = _plan(rt, weight, -(-r // max(1, min(experts, r))))
        slots = min(r, -(-r // tile_tokens) + experts + 2)
        grid = (-(-weight.n // tile_rows), slots, 1)
        _launch(rt, kern, targs, block, act, weight, out, grid, r, offsets, experts, err_ptr, stream)
    return out


# ---- activations ------------------------------------------------------------

class _Act:
    """One activation argument, checked: kind (0 BF16, 1 FP16, 2 NVFP4),
    its tensors and the element strides the kernel walks."""
    __slots__ = ("kind", "where", "device", "lead", "x", "sf", "gs", "strides", "gs_strides")

    def values(self) -> np.ndarray:
        """The activation as float64, exactly (CPU path)."""
        if self.kind != 2:
            return D.to_numpy(self.x, "x").astype(np.float64)
        codes = ref.unpack_nibbles(D.to_numpy(self.x, "x.q").astype(np.uint8))
        sf = F.e4m3_decode(D.to_numpy(self.sf, "x.sf").astype(np.uint8)).astype(np.float64)
        gs = D.to_numpy(self.gs, "x.gs").astype(np.float64)
        gs = gs.reshape(()) if gs.size == 1 else gs[..., None]
        v = F.e2m1_decode(codes).astype(np.float64) * np.repeat(sf, 16, axis=-1)
        return v * gs


def _activation(x, weight, name, ndim) -> _Act:
    a = _Act()
    k = weight.k
    if hasattr(x, "q") and hasattr(x, "sf") and hasattr(x, "gs"):
        q, sf, gs = x.q, x.sf, x.gs
        A.require_array(q, f"{name}.q")
        A.require_array(sf, f"{name}.sf")
        A.require_array(gs, f"{name}.gs")
        a.where = D.placement((f"{name}.q", q), (f"{name}.sf", sf), (f"{name}.gs", gs), ("weight", weight.codes))
        a.kind = 2
        if tuple(q.shape[-1:]) != (k // 2,) or q.dim() != ndim:
            raise ValueError(f"{name}.q: expected shape (..., {k // 2}) with {ndim} dimensions for K = {k}, "
                             f"got {tuple(q.shape)}")
        lead = tuple(q.shape[:-1])
        if tuple(sf.shape) != (*lead, k // 16):
            raise ValueError(f"{name}.sf: expected shape {(*lead, k // 16)}, got {tuple(sf.shape)}")
        if gs.numel() != 1 and tuple(gs.shape) != lead:
            raise ValueError(f"{name}.gs: expected one value or shape {lead}, got {tuple(gs.shape)}")
        a.lead, a.x, a.sf, a.gs = lead, q, sf, gs
        if a.where == "cpu":
            for part, v in ((f"{name}.q", q), (f"{name}.sf", sf)):
                if D.is_torch(v) and v.dtype not in A.dtypes().bytes:
                    raise TypeError(f"{part}: dtype {str(v.dtype).replace('torch.', '')} is not supported "
                                    "(expected uint8 bytes or their float4 / float8 views)")
        else:
            dt = A.dtypes()
            a.device = q.get_device()
            A.check_tensor(q, f"{name}.q", dt.bytes, device=a.device, contiguous=False)
            A.check_tensor(sf, f"{name}.sf", dt.bytes, device=a.device, contiguous=False)
            A.check_tensor(gs, f"{name}.gs", (_torch().float32,), device=a.device, contiguous=False)
            _check_weight_device(weight, a.device)
            a.x = _rows_aligned(q, 8)
            a.sf = sf if sf.stride(-1) == 1 else sf.contiguous()
            a.strides = _lead_strides(a.x) + _lead_strides(a.sf)
            a.gs_strides = (0, 0) if gs.numel() == 1 else (tuple(gs.stride()) + (0,))[:2]
        return a
    A.require_array(x, name)
    a.where = D.placement((name, x), ("weight", weight.codes))
    if a.where == "cpu":
        name_dt = A.cpu_dtype_name(x, name) if not D.is_torch(x) else str(x.dtype).replace("torch.", "")
        if name_dt not in ("bfloat16", "float16"):
            raise TypeError(f"{name}: dtype {name_dt} is not supported (expected bfloat16, float16)")
        a.kind = 1 if name_dt == "float16" else 0
    else:
        t = _torch()
        a.device = x.get_device()
        A.check_tensor(x, name, (t.bfloat16, t.float16), device=a.device, contiguous=False)
        _check_weight_device(weight, a.device)
        a.kind = 1 if x.dtype == t.float16 else 0
    if x.dim() != ndim or x.shape[-1] != k:
        raise ValueError(f"{name}: expected shape (..., {k}) with {ndim} dimensions for K = {k}, "
                         f"got {tuple(x.shape)}")
    if a.kind == 1 and weight.fmt == "mxfp4":
        lo, hi = weight.exp_range
        if lo < MX_WINDOW_FP16[0] or hi > MX_WINDOW_FP16[1]:
            raise ValueError(f"{name}: FP16 activations need MXFP4 scale bytes in {list(MX_WINDOW_FP16)} "
                             f"(this weight's span [{lo}, {hi}]); pass BF16 activations")
    a.lead, a.x, a.sf, a.gs = tuple(x.shape[:-1]), x, None, None
    if a.where == "cuda":
        a.x = _rows_aligned(x, 16)
        a.strides = _lead_strides(a.x) + (0, 0)
        a.gs_strides = (0, 0)
    return a


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


def _check_out(out, shape, dev):
    t = _torch()
    if out is None:
        return t.empty(shape, dtype=t.bfloat16, device=f"cuda:{dev}")
    A.require_array(out, "out")
    A.check_tensor(out, "out", (t.bfloat16,), shape=shape, device=dev, contiguous=False)
    if out.stride(-1) != 1:
        raise ValueError("out: the last dimension must be contiguous")
    return out


def _config(tokens: int) -> tuple:
    for tt in (8, 16, 32, 64):
        if tokens <= tt:
            return K.CONFIGS[tt]
    return K.CONFIGS["large"]


#: Which kernel serves a launch: "auto" (the plan below), or "mma" / "sm90"
#: to force one (tests compare the two paths on the same inputs).
KERNEL_PATH = "auto"
#: Tokens per group (or per expert, on average) from which an sm_90 device
#: takes the wgmma kernel (rawkv/cu/gemm_fp4_sm90.cu); below it the
#: mma.sync kernel streams the weights faster (docs/gemm.md, "Dispatch").
SM90_MIN_TOKENS = 256


def _plan(rt, weight, tokens: int) -> tuple:
    """(kernel, template arguments without ACT / MX, block, output features
    per block, tokens per block) for `tokens` tokens per group or expert."""
    path = KERNEL_PATH
    if path == "auto":
        path = "sm90" if rt.arch == "sm_90" and tokens >= SM90_MIN_TOKENS else "mma"
    if path == "sm90":
        if rt.arch != "sm_90":
            raise ValueError(f"x: the wgmma GEMM kernel runs on sm_90 devices, this one is {rt.arch}")
        bn, stages = K.SM90_CONFIGS[64] if tokens <= 64 else K.SM90_CONFIGS["large"]
        return K.GEMM_SM90, (bn, stages), (K.SM90_THREADS,), K.SM90_BM, bn
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


def _cpu_offsets(offsets, experts) -> np.ndarray:
    A.require_array(offsets, "offsets")
    o = D.to_numpy(offsets, "offsets")
    if o.dtype.kind not in "iu" or o.shape != (experts + 1,):
        raise ValueError(f"offsets: expected int32 shape ({experts + 1},), got {o.dtype} {o.shape}")
    return o.astype(np.int64)


def _check_cpu_out(out, shape) -> None:
    if out is None:
        return
    A.require_array(out, "out")
    if out.dtype != _torch().bfloat16 or tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected bfloat16 {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")


def _cpu_out(y: np.ndarray, out):
    """The reference's float64 result rounded once to BF16, into `out`
    (checked before anything ran) when given."""
    t = _torch()
    bits = ref.round_to_bf16(y).astype(np.uint16)
    res = t.from_numpy(bits.view(np.int16).copy()).view(t.bfloat16)
    if out is None:
        return res
    out.copy_(res)
    return out


def _torch():
    import torch
    return torch
