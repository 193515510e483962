"""SwiGLU + NVFP4 (docs/fused.md): one launch of rkv_fused_swiglu per call
(memset + two for scope 'tensor')."""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import fused as K
from ..nvfp4.activation import QuantizedActivation
from ..reference import fused as ref
from ..reference import nvfp4 as ref_nvfp4
from ..runtime import get_runtime
from . import _cpu as C
from . import _rows
from . import _rules as R
from . import _traced as T


def swiglu_quantize(h, granularity=8, *, scope=None, gs=None, out=None, stream=None):
    """NVFP4 of y = round_h.dtype(silu(gate) * up), gate/up de-interleaved from
    h (..., 2I) whose columns alternate `granularity` gate then `granularity`
    up columns; I % 16 == 0 and I % granularity == 0. silu uses rawkv's
    deterministic float32 exp (rawkv.reference.fused.exp_f32).
    Returns QuantizedActivation(q, sf, gs, None); gs per row by default."""
    if D.compiling():
        return T.activation(SWIGLU_QUANTIZE_OP, h, h.shape[:-1], h.shape[-1] // 2, scope, gs, out, False,
                            h=h, granularity=granularity)
    out_q, out_sf, out_gs, out_inv = R.split_out(out)
    if out_inv is not None:
        raise ValueError("out.inv_rms: swiglu_quantize has no inv_rms output")
    scope, gs = R.scope_gs(scope, gs)
    if isinstance(granularity, bool) or not isinstance(granularity, (int, np.integer)) or granularity < 1:
        raise ValueError(f"granularity: expected a positive int, got {granularity!r}")
    g_int = int(granularity)
    R.require_arrays(("h", h))
    where = D.placement(("h", h), ("out.q", out_q), ("out.sf", out_sf), ("out.gs", out_gs),
                        ("gs", None if gs is None or gs.__class__ is float else gs))
    hs = tuple(h.shape)
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

    A.check_outputs((("out.q", out_q), ("out.sf", out_sf), ("out.gs", out_gs)), (("h", h), ("gs", gs)))
    if where == "cpu":
        dt = A.check_cpu_array(h, "h", R.CPU_X)
        gsv = R.given_gs_host(scope, gs, dt)
        q, sf, gg = ref.swiglu_quantize(D.to_numpy(h, "h").reshape(-1, two_i), g_int, scope, gsv, dt)
        return C.activation(h, scope, q.reshape(*lead, inter // 2), sf.reshape(*lead, inter // 16), gg, None,
                            out_q, out_sf, out_gs, None)

    vec = g_int % 8 == 0            # runs of 8 gate / up columns: 16-byte loads
    h = _rows.cuda_arg(h, "h", _rows.dtypes().x, align=16 if vec else 2)
    dev = h.get_device()
    gs_in, gs_val = (None, 0.0) if gs is None else _rows.gs_arg(gs, h.dtype, dev)
    rt = get_runtime(dev)
    q, sf, gs_t, _ = _rows.outputs(rt, lead, inter, scope, dev, out_q, out_sf, out_gs, None, False, stream)
    _rows.launch_rows(rt, K.SWIGLU.instance(h.dtype, vec, K.REG), h.numel() // two_i, inter // 16, scope,
                      gs_in, gs_val, gs_t, stream, h=h, inter=inter, g=g_int, q=q, sf=sf)
    return QuantizedActivation(q, sf, gs_t, None)


# ---- torch custom operator (rawkv.library): the mutating form -----------------------------
def _swiglu_quantize_op(h, granularity, scope, gs, gs_value, q, sf, gs_out):
    swiglu_quantize(h, granularity, scope=scope, gs=A.op_gs(gs, gs_value), out=(q, sf, gs_out))


SWIGLU_QUANTIZE_OP = OpDecl(
    "swiglu_quantize", _swiglu_quantize_op,
    "Tensor h, int granularity, str scope, Tensor? gs, float? gs_value, Tensor(a!) q, Tensor(b!) sf, "
    "Tensor(c!) gs_out")
