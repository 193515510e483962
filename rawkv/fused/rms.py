"""RMSNorm + NVFP4 and the mHC pre-block + RMSNorm + NVFP4 (docs/fused.md):
one launch of rkv_fused_rms per call (memset + two for scope 'tensor')."""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import fused as K
from ..nvfp4.activation import QuantizedActivation
from ..reference import fused as ref
from ..runtime import get_runtime
from . import _cpu as C
from . import _rows
from . import _rules as R
from . import _traced as T


def rmsnorm_quantize(x, weight, eps=1e-6, *, scope=None, gs=None, out=None, stream=None):
    """NVFP4 of y = round_x.dtype((x * inv_rms) * weight), inv_rms = 1/sqrt(mean(x^2) + eps).

    x (..., N) bfloat16/float16, N % 16 == 0; weight (N,) float32/bfloat16/float16;
    eps a finite number > 0. Returns QuantizedActivation(q, sf, gs, inv_rms);
    gs per row by default."""
    return _rms(x, None, weight, eps, scope, gs, out, stream, mixed=False)


def mhc_rmsnorm_quantize(x, mix, weight, eps=1e-6, *, scope=None, gs=None, out=None, stream=None):
    """mHC pre-block + RMSNorm + NVFP4: m = round(sum_h mix[..., h] * x[..., h, :])
    (h order, float32), then rmsnorm_quantize(m, weight, eps).

    x (..., n_hc, N) bfloat16/float16 with n_hc <= 4; mix (..., n_hc)
    float32/bfloat16/float16; weight (N,). Returns QuantizedActivation."""
    return _rms(x, mix, weight, eps, scope, gs, out, stream, mixed=True)


def _rms(x, mix, weight, eps, scope, gs, out, stream, mixed):
    if D.compiling():
        if mixed:
            return T.activation(MHC_RMSNORM_QUANTIZE_OP, x, x.shape[:-2], x.shape[-1], scope, gs, out, True,
                                x=x, mix=mix, weight=weight, eps=A.traced_number(eps))
        return T.activation(RMSNORM_QUANTIZE_OP, x, x.shape[:-1], x.shape[-1], scope, gs, out, True,
                            x=x, weight=weight, eps=A.traced_number(eps))
    out_q, out_sf, out_gs, out_inv = R.split_out(out)
    eps = A.check_eps(eps)
    scope, gs = R.scope_gs(scope, gs)
    R.require_arrays(("x", x), ("weight", weight))
    if mixed:
        R.require_arrays(("mix", mix))
    where = D.placement(("x", x), ("mix", mix), ("weight", weight), ("out.q", out_q),
                        ("out.sf", out_sf), ("out.gs", out_gs), ("out.inv_rms", out_inv),
                        ("gs", None if gs is None or gs.__class__ is float else gs))
    # shapes, common to both placements
    xs = tuple(x.shape)
    if mixed:
        if len(xs) < 2:
            raise ValueError(f"x: expected (..., n_hc, N), got shape {xs}")
        lead, n_hc, n = xs[:-2], xs[-2], xs[-1]
        if not 1 <= n_hc <= K.MAX_HC:
            raise ValueError(f"x: n_hc = x.shape[-2] = {n_hc} must be in 1..{K.MAX_HC}")
        if tuple(mix.shape) != (*lead, n_hc):
            raise ValueError(f"mix: expected shape {(*lead, n_hc)}, got {tuple(mix.shape)}")
    else:
        if len(xs) < 1:
            raise ValueError("x: expected (..., N), got a 0-d array")
        lead, n_hc, n = xs[:-1], 1, xs[-1]
    R.check_width(n, "x")
    if tuple(weight.shape) != (n,):
        raise ValueError(f"weight: expected shape ({n},), got {tuple(weight.shape)}")
    A.check_outputs((("out.q", out_q), ("out.sf", out_sf), ("out.gs", out_gs), ("out.inv_rms", out_inv)),
                    (("x", x), ("mix", mix), ("weight", weight), ("gs", gs)))
    if where == "cpu":
        return _rms_cpu(x, mix, weight, eps, scope, gs, lead, n_hc, n, out_q, out_sf, out_gs, out_inv)

    dt = _rows.dtypes()
    x = _rows.cuda_arg(x, "x", dt.x, align=16)
    dev = x.get_device()
    weight = _rows.cuda_arg(weight, "weight", dt.param, dev, 16)
    if mixed:
        mix = _rows.cuda_arg(mix, "mix", dt.param, dev)
    gs_in, gs_val = (None, 0.0) if gs is None else _rows.gs_arg(gs, x.dtype, dev)
    rt = get_runtime(dev)
    q, sf, gs_t, inv = _rows.outputs(rt, lead, n, scope, dev, out_q, out_sf, out_gs, out_inv, True, stream)
    _rows.launch_rows(rt, K.RMS.instance(x.dtype, mixed, K.REG), x.numel() // (n_hc * n), n // 16, scope,
                      gs_in, gs_val, gs_t, stream, x=x, mix=mix, mix_kind=dt.kind[mix.dtype] if mixed else 0,
                      n_hc=n_hc, w=weight, w_kind=dt.kind[weight.dtype], eps=eps, n=n, q=q, sf=sf,
                      inv_out=inv)
    return QuantizedActivation(q, sf, gs_t, inv)


def _rms_cpu(x, mix, weight, eps, scope, gs, lead, n_hc, n, out_q, out_sf, out_gs, out_inv):
    """The reference on numpy arrays / CPU tensors, checked as the CUDA path checks."""
    dt = A.check_cpu_array(x, "x", R.CPU_X)
    A.check_cpu_array(weight, "weight", R.PARAM)
    if mix is not None:
        A.check_cpu_array(mix, "mix", R.PARAM)
    gsv = R.given_gs_host(scope, gs, dt)
    xn = D.to_numpy(x, "x")
    wn = D.to_numpy(weight, "weight")
    if mix is not None:
        m = int(np.prod(lead)) if lead else 1
        a = D.to_numpy(mix, "mix").reshape(m, n_hc)
        q, sf, g, inv = ref.mhc_rmsnorm_quantize(xn.reshape(m, n_hc, n), a, wn, eps, scope, gsv, dt)
    else:
        q, sf, g, inv = ref.rmsnorm_quantize(xn.reshape(-1, n), wn, eps, scope, gsv, dt)
    return C.activation(x, scope, q.reshape(*lead, n // 2), sf.reshape(*lead, n // 16), g, inv.reshape(lead),
                        out_q, out_sf, out_gs, out_inv)


# ---- torch custom operators (rawkv.library): the mutating forms -------------------------
def _rmsnorm_quantize_op(x, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms):
    rmsnorm_quantize(x, weight, eps, scope=scope, gs=A.op_gs(gs, gs_value), out=(q, sf, gs_out, inv_rms))


def _mhc_rmsnorm_quantize_op(x, mix, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms):
    mhc_rmsnorm_quantize(x, mix, weight, eps, scope=scope, gs=A.op_gs(gs, gs_value),
                         out=(q, sf, gs_out, inv_rms))


_OUTS = "Tensor(a!) q, Tensor(b!) sf, Tensor(c!) gs_out, Tensor(d!) inv_rms"
RMSNORM_QUANTIZE_OP = OpDecl(
    "rmsnorm_quantize", _rmsnorm_quantize_op,
    f"Tensor x, Tensor weight, float eps, str scope, Tensor? gs, float? gs_value, {_OUTS}")
MHC_RMSNORM_QUANTIZE_OP = OpDecl(
    "mhc_rmsnorm_quantize", _mhc_rmsnorm_quantize_op,
    f"Tensor x, Tensor mix, Tensor weight, float eps, str scope, Tensor? gs, float? gs_value, {_OUTS}")
