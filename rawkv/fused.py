"""Fused NVFP4 producers and MoE input staging (docs/fused.md).

    qa = rawkv.fused.rmsnorm_quantize(x, weight, eps=1e-6)          # (..., N)
    qa = rawkv.fused.mhc_rmsnorm_quantize(X, A, weight, eps=1e-6)   # X (..., n_hc, N), A (..., n_hc)
    qa = rawkv.fused.swiglu_quantize(h, granularity=8)              # h (..., 2I) interleaved gate/up
    st = rawkv.fused.moe_stage(hidden, topk_ids, topk_weights)      # one-level NVFP4 + top-k copy

Each reads its input once and writes NVFP4 once, in one kernel launch (two
for scope='tensor'), with no intermediate tensor and no host sync. Results
are `QuantizedActivation(q, sf, gs, inv_rms)` / `MoEStaged(q, sf, topk_ids,
topk_weights)` named tuples; `out=` takes the same tuple (entries may be None
to allocate them) so that a captured CUDA graph needs no allocation.

Global scale (`scope`): 'row' (default: one gs per row, computed on the
device), 'tensor' (one gs for the tensor, computed on the device: two
launches), 'given' (`gs`: a number, finite and > 0 as a float32, or a
1-element float32 device tensor, read on the device) or 'none' (one-level
NVFP4, gs = 1). rawkv.nvfp4.dequantize(qa) decodes a result.

CUDA inputs are bfloat16 or float16; numpy arrays and CPU tensors run
rawkv.reference.fused, which defines every op (float32 numpy arrays: no
rounding of the intermediates; see docs/fused.md).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _tensors as T
from .reference import fused as ref
from .reference import nvfp4 as ref_nvfp4
from .nvfp4.activation import QuantizedActivation  # noqa: F401  (re-exported)
from .runtime import get_runtime, register_kernels

_FILE = "fused.cu"
_CT = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
# Register-held chunks per thread (fused.cu REG). 2 measured best on an H100:
# 4 (fewer, fatter threads) was as fast for RMSNorm and 28% slower for SwiGLU.
_REG = 2
_MAX_BLOCK = 1536 // _REG   # fused.cu kMaxThreads / REG on every arch (sm_100+: 1536)
register_kernels(_FILE, [f"rkv_fused_rms<{c}, {m}, {_REG}>" for c in _CT.values() for m in ("false", "true")]
                 + ["rkv_fused_set_gs"]
                 + [f"rkv_fused_swiglu<{c}, {v}, {_REG}>" for c in _CT.values() for v in ("true", "false")]
                 + [f"rkv_moe_stage<{c}, {i}>" for c in _CT.values() for i in ("int", "long long")])

_MODE_ROW, _MODE_AMAX, _MODE_TENSOR, _MODE_FIXED = 0, 1, 2, 3
_SCOPES = ("row", "tensor", "given", "none")
_MAX_HC = 4


class MoEStaged(NamedTuple):
    """MoE inputs: q (M, K/2) uint8 one-level NVFP4 codes, sf (M, K/64) int32
    (UE4M3 scale of block 4i+j in byte j), topk_ids (M, k) int64, topk_weights."""
    q: Any
    sf: Any
    topk_ids: Any
    topk_weights: Any


# ---- helpers -------------------------------------------------------------------------
def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


# CPU dtypes, checked as the CUDA path checks (float32 inputs are the
# reference's own precision: the intermediates are not rounded)
_CPU_X = ("bfloat16", "float16", "float32")     # x, h, hidden on CPU (CUDA: bfloat16, float16)
_PARAM = ("float32", "bfloat16", "float16")     # weight, mix, topk_weights


def _shape(x):
    return tuple(x.shape)


def _resolve_scope(scope, gs):
    """(scope, gs). A number gs comes back as a Python float, checked: the
    kernels read it as a float32, and 0, a negative, NaN or Inf would give
    all-zero codes or sign-bit scales instead of an error."""
    if scope is None:
        scope = "given" if gs is not None else "row"
    if scope not in _SCOPES:
        raise ValueError(f"scope: expected one of {_SCOPES}, got {scope!r}")
    if scope == "given" and gs is None:
        raise ValueError("gs: scope 'given' needs a global scale (a float or a 1-element tensor)")
    if scope != "given" and gs is not None:
        raise ValueError(f"gs: a global scale is only used with scope='given' (got scope={scope!r})")
    if T.is_number(gs) or isinstance(gs, (bool, np.bool_)):
        gs = T.check_scale_value(gs, "gs")       # bool: TypeError
    elif gs is not None:
        n = int(np.prod(_shape(gs))) if hasattr(gs, "shape") else -1
        if n != 1:
            raise ValueError(f"gs: expected a float or a 1-element tensor, got shape {_shape(gs)}")
    return scope, gs


def _check_eps(eps) -> float:
    """eps as a Python float: any real number (numpy scalars too) that is
    finite and >= 0 as the float32 the kernel and the reference use."""
    if T.is_number(eps):
        with np.errstate(over="ignore"):
            if np.isfinite(np.float32(eps)) and eps >= 0:
                return float(eps)
    raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")


def _check_width(n, name):
    """The last dimension: a positive multiple of 16 (N == 0 has no row to
    normalize and would leave gs / inv_rms unwritten on CUDA)."""
    if n == 0:
        raise ValueError(f"{name}: the last dimension is 0; expected a positive multiple of 16")
    ref_nvfp4.check_last_dim(n, name)


def _cpu_gs(gs):
    """A given gs for the reference: a float32 0-d array (or None). CPU
    arrays must be float32, as on CUDA."""
    if gs is None or isinstance(gs, float):
        return None if gs is None else np.asarray(gs, np.float32)
    T.check_cpu_array(gs, "gs", ("float32",))
    return np.asarray(T.to_numpy(gs, "gs"), np.float32).reshape(())


def _split_out(out):
    """(q, sf, gs, inv_rms) from out=: None, or a tuple / QuantizedActivation
    of 3 or 4 entries, each None (allocate it) or a tensor."""
    if out is None:
        return (None,) * 4
    if not isinstance(out, (tuple, list)) or len(out) not in (3, 4):
        raise TypeError("out: expected a tuple (q, sf, gs[, inv_rms]) or a QuantizedActivation, "
                        f"got {type(out).__name__}")
    return tuple(out) + (None,) * (4 - len(out))


def _cpu_put(arr, like, out, torch_dtype=None):
    """`arr` as the library of `like` (numpy, or CPU torch with `torch_dtype`),
    or copied into `out`. Keeps 0-d shapes."""
    arr = np.array(arr)                                    # a copy; 0-d stays 0-d
    if out is not None and isinstance(out, np.ndarray):
        if out.shape != arr.shape:
            raise ValueError(f"out: expected shape {arr.shape}, got {out.shape}")
        out[...] = arr
        return out
    if out is None and not T.is_torch(like):
        return arr
    import torch
    t = torch.from_numpy(arr)
    if torch_dtype is not None and t.dtype != torch_dtype:
        t = t.view(torch_dtype) if t.dtype == torch.uint8 else t.to(torch_dtype)
    if out is None:
        return t
    if tuple(out.shape) != tuple(t.shape):
        raise ValueError(f"out: expected shape {tuple(t.shape)}, got {tuple(out.shape)}")
    if out.dtype != t.dtype and out.element_size() == t.element_size() == 1:
        out.view(torch.uint8).copy_(t.view(torch.uint8))
    else:
        out.copy_(t)
    return out


def _block_for(rt, rows: int, chunks: int, max_block: int = _MAX_BLOCK) -> int:
    """Threads per row CTA: one 16-element chunk per thread when rows are few
    (latency), else up to REG chunks per thread (fewer, fuller threads)."""
    r32 = lambda v: max(32, -(-v // 32) * 32)  # noqa: E731
    if rows < 2 * rt.sm_count:
        return min(max_block, r32(chunks))
    return min(max_block, max(r32(-(-chunks // _REG)), min(r32(chunks), 64)))


def _torch_dt(name):
    import sys
    t = sys.modules.get("torch")
    return getattr(t, name) if t is not None else None


def _check_cpu_outs(specs):
    """Check every out= buffer's dtype and shape before any is written:
    specs are (name, result array, out or None, allowed dtype names)."""
    for name, arr, o, dts in specs:
        if o is None:
            continue
        T.check_cpu_array(o, name, dts, np.shape(arr))


_OUT_Q = ("uint8", "float4_e2m1fn_x2")
_OUT_SF = ("uint8", "float8_e4m3fn")


def _cpu_result(like, q, sf, g, inv, out_q, out_sf, out_gs, out_inv):
    u8 = _torch_dt("uint8")
    fp4 = _torch_dt("float4_e2m1fn_x2") or u8
    fp8 = _torch_dt("float8_e4m3fn") or u8
    _check_cpu_outs((("out.q", q, out_q, _OUT_Q), ("out.sf", sf, out_sf, _OUT_SF),
                     ("out.gs", g, out_gs, ("float32",)), ("out.inv_rms", inv, out_inv, ("float32",))))
    return QuantizedActivation(_cpu_put(q, like, out_q, fp4), _cpu_put(sf, like, out_sf, fp8),
                               _cpu_put(g, like, out_gs),
                               None if inv is None else _cpu_put(inv, like, out_inv))


def _as_view(t, name):
    """uint8 tensor viewed as torch.<name> where this torch has that dtype."""
    import torch
    dt = getattr(torch, name, None)
    return t.view(dt) if dt is not None else t


def _check_out_tensor(t, name, dtypes, shape, device, align=1):
    t = T.as_cuda_tensor(t, name)
    T.check_tensor(t, name, dtypes, shape=shape, device=getattr(device, "index", device))
    if t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
    return t


def _check_aligned(t, name, align=16):
    if t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned (got an offset view); "
                         "call .clone() first")


def _gs_arg(gs, device):
    """(pointer, value) for a given gs: a device float32 tensor or a float."""
    import torch
    if isinstance(gs, float):
        return 0, float(gs)
    g = T.as_cuda_tensor(gs, "gs")
    if g.dtype != torch.float32:
        raise TypeError(f"gs: dtype {_dtype_name(g.dtype)} is not supported (expected float32)")
    if g.device != device:
        raise ValueError(f"gs: is on {g.device} but the op runs on {device}")
    return g.data_ptr(), 0.0


def _quant_outputs(rt, lead, n, scope, device, out_q, out_sf, out_gs, out_inv, want_inv, stream):
    """Validate or allocate q, sf, gs (and inv_rms) for rows `lead` of width n."""
    import torch
    byte = T.byte_dtypes(torch)
    qdt = tuple(d for d in byte if d != getattr(torch, "float8_e4m3fn", None))
    sfdt = tuple(d for d in byte if d != getattr(torch, "float4_e2m1fn_x2", None))
    gshape = lead if scope == "row" else ()
    checked = []
    for t, name, dts, shp, align in ((out_q, "out.q", qdt, (*lead, n // 2), 8),
                                     (out_sf, "out.sf", sfdt, (*lead, n // 16), 1),
                                     (out_gs, "out.gs", (torch.float32,), gshape, 4),
                                     (out_inv, "out.inv_rms", (torch.float32,), lead, 4)):
        if name == "out.inv_rms" and not want_inv:
            if t is not None:
                raise ValueError("out.inv_rms: this op has no inv_rms output")
            checked.append(None)
            continue
        if t is not None:
            if name == "out.gs" and scope != "row" and tuple(t.shape) == (1,):
                shp = (1,)
            checked.append(_check_out_tensor(t, name, dts, shp, device, align))
        else:
            checked.append(None)
    q, sf, gs, inv = checked
    if q is None:                # the dtypes rawkv.nvfp4.quantize returns
        q = _as_view(rt.empty((*lead, n // 2), torch.uint8, stream), "float4_e2m1fn_x2")
    if sf is None:
        sf = _as_view(rt.empty((*lead, n // 16), torch.uint8, stream), "float8_e4m3fn")
    if gs is None:
        gs = rt.empty(gshape, torch.float32, stream)
    if want_inv and inv is None:
        inv = rt.empty(lead, torch.float32, stream)
    return q, sf, gs, inv


def _run_rows(rt, fn, rows, chunks, scope, gs_given, gs_t, args_pre, args_post, stream,
              max_block=_MAX_BLOCK):
    """Launch a row kernel with the gs mode(s) of `scope`. args_pre end just
    before gs_out; args_post is what follows gs_out up to gs_in."""
    if rows == 0:
        # No row CTA runs, and the row kernel is what writes gs: one thread
        # writes it on `stream` (a torch fill_ would run on torch's current
        # stream, out of order with the caller's `stream`). Scope 'row': no gs.
        if scope != "row":
            gin, gval = _gs_arg(gs_given, gs_t.device) if scope == "given" else (0, 1.0)
            fn = rt.function(_FILE, "rkv_fused_set_gs", stream=stream)
            rt.launch_args(fn, (1,), (1,), (gs_t.data_ptr(), gin, gval), stream)
        return
    block = _block_for(rt, rows, chunks, max_block)
    gptr = gs_t.data_ptr()
    if scope == "row":
        modes, gin, gval = (_MODE_ROW,), 0, 0.0
    elif scope == "tensor":
        modes, gin, gval = (_MODE_AMAX, _MODE_TENSOR), 0, 0.0
        rt.memset(gptr, 0, 4, stream)
    elif scope == "none":
        modes, gin, gval = (_MODE_FIXED,), 0, 1.0
    else:
        gin, gval = _gs_arg(gs_given, gs_t.device)
        modes = (_MODE_FIXED,)
    for mode in modes:
        rt.launch_args(fn, (rows,), (block,), (*args_pre, gptr, *args_post, gin, gval, mode), stream)


# ---- RMSNorm (+ mHC) + quantize ---------------------------------------------------------
def rmsnorm_quantize(x, weight, eps=1e-6, *, scope=None, gs=None, out=None, stream=None):
    """NVFP4 of y = round_x.dtype((x * inv_rms) * weight), inv_rms = 1/sqrt(mean(x^2) + eps).

    x (..., N) bfloat16/float16, N % 16 == 0; weight (N,) float32/bfloat16/float16.
    Returns QuantizedActivation(q, sf, gs, inv_rms); gs per row by default."""
    return _rms_common(x, None, weight, eps, scope, gs, out, stream, mixed=False)


def mhc_rmsnorm_quantize(x, mix, weight, eps=1e-6, *, scope=None, gs=None, out=None, stream=None):
    """mHC pre-block + RMSNorm + NVFP4: m = round(sum_h mix[..., h] * x[..., h, :])
    (h order, float32), then rmsnorm_quantize(m, weight, eps).

    x (..., n_hc, N) bfloat16/float16 with n_hc <= 4; mix (..., n_hc)
    float32/bfloat16/float16; weight (N,). Returns QuantizedActivation."""
    return _rms_common(x, mix, weight, eps, scope, gs, out, stream, mixed=True)


def _rms_common(x, mix, weight, eps, scope, gs, out, stream, mixed):
    out_q, out_sf, out_gs, out_inv = _split_out(out)
    eps = _check_eps(eps)
    scope, gs = _resolve_scope(scope, gs)
    where = T.placement(("x", x), ("mix", mix), ("weight", weight), ("out.q", out_q),
                        ("out.sf", out_sf), ("out.gs", out_gs), ("out.inv_rms", out_inv),
                        ("gs", gs if not isinstance(gs, float) else None))
    # shape checks, common to both placements
    xs = _shape(x)
    if mixed:
        if len(xs) < 2:
            raise ValueError(f"x: expected (..., n_hc, N), got shape {xs}")
        lead, n_hc, n = xs[:-2], xs[-2], xs[-1]
        if not 1 <= n_hc <= _MAX_HC:
            raise ValueError(f"x: n_hc = x.shape[-2] = {n_hc} must be in 1..{_MAX_HC}")
        if _shape(mix) != (*lead, n_hc):
            raise ValueError(f"mix: expected shape {(*lead, n_hc)}, got {_shape(mix)}")
    else:
        if len(xs) < 1:
            raise ValueError("x: expected (..., N), got a 0-d array")
        lead, n_hc, n = xs[:-1], 1, xs[-1]
    _check_width(n, "x")
    if _shape(weight) != (n,):
        raise ValueError(f"weight: expected shape ({n},), got {_shape(weight)}")

    if where == "cpu":
        dt = T.check_cpu_array(x, "x", _CPU_X)
        T.check_cpu_array(weight, "weight", _PARAM)
        if mixed:
            T.check_cpu_array(mix, "mix", _PARAM)
        gsv = _cpu_gs(gs)
        xn = T.to_numpy(x, "x")
        wn = T.to_numpy(weight, "weight")
        if mixed:
            m = int(np.prod(lead)) if lead else 1
            X = xn.reshape(m, n_hc, n)
            A = T.to_numpy(mix, "mix").reshape(m, n_hc)
            q, sf, g, inv = ref.mhc_rmsnorm_quantize(X, A, wn, eps, scope, gsv, dt)
        else:
            q, sf, g, inv = ref.rmsnorm_quantize(xn.reshape(-1, n), wn, eps, scope, gsv, dt)
        q, sf, inv = q.reshape(*lead, n // 2), sf.reshape(*lead, n // 16), inv.reshape(lead)
        g = np.asarray(g, np.float32).reshape(lead if scope == "row" else ())
        return _cpu_result(x, q, sf, g, inv, out_q, out_sf, out_gs, out_inv)

    import torch
    x = T.as_cuda_tensor(x, "x")
    T.check_tensor(x, "x", (torch.bfloat16, torch.float16))
    _check_aligned(x, "x")
    weight = T.as_cuda_tensor(weight, "weight")
    T.check_tensor(weight, "weight", (torch.float32, torch.bfloat16, torch.float16), device=x.get_device())
    _check_aligned(weight, "weight")
    kinds = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
    if mixed:
        mix = T.as_cuda_tensor(mix, "mix")
        T.check_tensor(mix, "mix", (torch.float32, torch.bfloat16, torch.float16), device=x.get_device())
    if gs is not None and not isinstance(gs, float):
        _gs_arg(gs, x.device)
    rt = get_runtime(x.device)
    q, sf, g, inv = _quant_outputs(rt, lead, n, scope, x.device, out_q, out_sf, out_gs, out_inv, True, stream)
    rows = x.numel() // (n_hc * n)
    fn = rt.function(_FILE, f"rkv_fused_rms<{_CT[_dtype_name(x.dtype)]}, {'true' if mixed else 'false'}, {_REG}>",
                     stream=stream)
    pre = (x.data_ptr(), mix.data_ptr() if mixed else 0, kinds[mix.dtype] if mixed else 0, n_hc,
           weight.data_ptr(), kinds[weight.dtype], float(eps), n, q.data_ptr(), sf.data_ptr())
    _run_rows(rt, fn, rows, n // 16, scope, gs, g, pre, (inv.data_ptr(),), stream)
    return QuantizedActivation(q, sf, g, inv)


# ---- SwiGLU + quantize ---------------------------------------------------------------------
def swiglu_quantize(h, granularity=8, *, scope=None, gs=None, out=None, stream=None):
    """NVFP4 of y = round_h.dtype(silu(gate) * up), gate/up de-interleaved from
    h (..., 2I) whose columns alternate `granularity` gate then `granularity`
    up columns; I % 16 == 0 and I % granularity == 0. silu uses rawkv's
    deterministic float32 exp (rawkv.reference.fused.exp_f32).
    Returns QuantizedActivation(q, sf, gs, None); gs per row by default."""
    out_q, out_sf, out_gs, out_inv = _split_out(out)
    if out_inv is not None:
        raise ValueError("out.inv_rms: swiglu_quantize has no inv_rms output")
    scope, gs = _resolve_scope(scope, gs)
    if isinstance(granularity, bool) or not isinstance(granularity, (int, np.integer)) or granularity < 1:
        raise ValueError(f"granularity: expected a positive int, got {granularity!r}")
    g_int = int(granularity)
    where = T.placement(("h", h), ("out.q", out_q), ("out.sf", out_sf), ("out.gs", out_gs),
                        ("gs", gs if not isinstance(gs, float) else None))
    hs = _shape(h)
    if len(hs) < 1:
        raise ValueError("h: expected (..., 2I), got a 0-d array")
    lead, two_i = hs[:-1], hs[-1]
    if two_i == 0:          # no row to quantize (CUDA would leave gs unwritten)
        raise ValueError("h: the last dimension is 0; expected 2I with I a positive multiple of 16")
    if two_i % 2:
        raise ValueError(f"h: the fused width {two_i} must be even (gate and up halves)")
    inter = two_i // 2
    ref_nvfp4.check_last_dim(inter, "h (the intermediate width h.shape[-1] / 2)")
    if inter % g_int:
        raise ValueError(f"granularity: {g_int} must divide the intermediate width {inter}")
    if two_i >= 2 ** 31:
        raise ValueError(f"h: the fused width {two_i} must be < 2^31")

    if where == "cpu":
        dt = T.check_cpu_array(h, "h", _CPU_X)
        gsv = _cpu_gs(gs)
        q, sf, gg = ref.swiglu_quantize(T.to_numpy(h, "h").reshape(-1, two_i), g_int, scope, gsv, dt)
        q, sf = q.reshape(*lead, inter // 2), sf.reshape(*lead, inter // 16)
        gg = np.asarray(gg, np.float32).reshape(lead if scope == "row" else ())
        return _cpu_result(h, q, sf, gg, None, out_q, out_sf, out_gs, None)

    import torch
    h = T.as_cuda_tensor(h, "h")
    T.check_tensor(h, "h", (torch.bfloat16, torch.float16))
    vec = g_int % 8 == 0
    _check_aligned(h, "h", 16 if vec else 2)
    if gs is not None and not isinstance(gs, float):
        _gs_arg(gs, h.device)
    rt = get_runtime(h.device)
    q, sf, g, _ = _quant_outputs(rt, lead, inter, scope, h.device, out_q, out_sf, out_gs, None, False, stream)
    rows = h.numel() // two_i
    fn = rt.function(_FILE, f"rkv_fused_swiglu<{_CT[_dtype_name(h.dtype)]}, {'true' if vec else 'false'}, {_REG}>",
                     stream=stream)
    pre = (h.data_ptr(), inter, g_int, q.data_ptr(), sf.data_ptr())
    _run_rows(rt, fn, rows, inter // 16, scope, gs, g, pre, (), stream)
    return QuantizedActivation(q, sf, g, None)


# ---- MoE input staging ----------------------------------------------------------------------
def moe_stage(hidden, topk_ids, topk_weights, *, out=None, stream=None):
    """Stage MoE inputs in one launch: hidden (M, K) bfloat16/float16 with
    K % 128 == 0 -> one-level NVFP4 (gs = 1, RNE) codes (M, K/2) uint8 and
    UE4M3 scales packed four per int32 (M, K/64); topk_ids (M, k)
    int32/int64 -> int64 copy; topk_weights (M, k) copied (same dtype).
    Returns MoEStaged(q, sf, topk_ids, topk_weights)."""
    names = ("q", "sf", "topk_ids", "topk_weights")
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 4):
        raise TypeError(f"out: expected a tuple ({', '.join(names)})")
    out_q, out_sf, out_ids, out_w = out if out is not None else (None,) * 4
    where = T.placement(("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                        ("out.q", out_q), ("out.sf", out_sf), ("out.topk_ids", out_ids),
                        ("out.topk_weights", out_w))
    hs = _shape(hidden)
    if len(hs) != 2:
        raise ValueError(f"hidden: expected (M, K), got shape {hs}")
    m, k = hs
    if k % 128 or k == 0:
        raise ValueError(f"hidden: K = {k} must be a positive multiple of 128 for MoE staging "
                         "(NVFP4 blocks of 16, scales packed four per int32, 128-wide tiles)")
    ids_s = _shape(topk_ids)
    if len(ids_s) != 2 or ids_s[0] != m:
        raise ValueError(f"topk_ids: expected shape ({m}, top_k), got {ids_s}")
    if _shape(topk_weights) != ids_s:
        raise ValueError(f"topk_weights: expected shape {ids_s} (as topk_ids), got {_shape(topk_weights)}")

    if where == "cpu":          # the dtypes the kernel takes (hidden: float32 too, unrounded)
        T.check_cpu_array(hidden, "hidden", _CPU_X)
        T.check_cpu_array(topk_ids, "topk_ids", ("int32", "int64"))
        w_dt = T.check_cpu_array(topk_weights, "topk_weights", _PARAM)
        q, sf, ids, w = ref.moe_stage(T.to_numpy(hidden, "hidden"), T.to_numpy(topk_ids, "topk_ids"),
                                      T.to_numpy(topk_weights, "topk_weights"))
        torch_w = topk_weights.dtype if T.is_torch(topk_weights) else None
        _check_cpu_outs((("out.q", q, out_q, _OUT_Q), ("out.sf", sf, out_sf, ("int32",)),
                         ("out.topk_ids", ids, out_ids, ("int64",)), ("out.topk_weights", w, out_w, (w_dt,))))
        return MoEStaged(_cpu_put(q, hidden, out_q, _torch_dt("uint8")),
                         _cpu_put(sf, hidden, out_sf), _cpu_put(ids, hidden, out_ids),
                         _cpu_put(w, hidden, out_w, torch_w))

    import torch
    hidden = T.as_cuda_tensor(hidden, "hidden")
    T.check_tensor(hidden, "hidden", (torch.bfloat16, torch.float16))
    _check_aligned(hidden, "hidden")
    topk_ids = T.as_cuda_tensor(topk_ids, "topk_ids")
    T.check_tensor(topk_ids, "topk_ids", (torch.int32, torch.int64), device=hidden.get_device())
    topk_weights = T.as_cuda_tensor(topk_weights, "topk_weights")
    T.check_tensor(topk_weights, "topk_weights", (torch.float32, torch.bfloat16, torch.float16),
                   device=hidden.get_device())
    rt = get_runtime(hidden.device)
    qdt = tuple(d for d in T.byte_dtypes(torch) if d != getattr(torch, "float8_e4m3fn", None))
    specs = ((out_q, "out.q", qdt, (m, k // 2), 16), (out_sf, "out.sf", (torch.int32,), (m, k // 64), 4),
             (out_ids, "out.topk_ids", (torch.int64,), ids_s, 8),
             (out_w, "out.topk_weights", (topk_weights.dtype,), ids_s, 1))
    chk = [None if t is None else _check_out_tensor(t, nm, dts, shp, hidden.device, al)
           for t, nm, dts, shp, al in specs]
    q = chk[0] if chk[0] is not None else rt.empty((m, k // 2), torch.uint8, stream)
    sf = chk[1] if chk[1] is not None else rt.empty((m, k // 64), torch.int32, stream)
    ids = chk[2] if chk[2] is not None else rt.empty(ids_s, torch.int64, stream)
    w = chk[3] if chk[3] is not None else rt.empty(ids_s, topk_weights.dtype, stream)
    units = m * k // 64
    n_ids = topk_ids.numel()
    w_bytes = topk_weights.numel() * topk_weights.element_size()
    work = max(units, n_ids, w_bytes)
    if work:
        id_t = "int" if topk_ids.dtype == torch.int32 else "long long"
        fn = rt.function(_FILE, f"rkv_moe_stage<{_CT[_dtype_name(hidden.dtype)]}, {id_t}>", stream=stream)
        grid, block = rt.grid_stride(work, block=256)
        rt.launch_args(fn, (grid,), (block,), (hidden.data_ptr(), units, q.data_ptr(), sf.data_ptr(),
                                          topk_ids.data_ptr(), n_ids, ids.data_ptr(),
                                          topk_weights.data_ptr(), w_bytes, w.data_ptr()), stream)
    return MoEStaged(q, sf, ids, w)
