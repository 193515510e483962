"""SwiGLU + NVFP4 (docs/fused.md): one launch of rkv_fused_swiglu per call
(memset + two for scope 'tensor'); SwiGLU + FP8 block output: one launch of
rkv_fused_swiglu_fp8."""
from __future__ import annotations

from . import _rules as R
from . import plans
from .._op import op
from ..reference import fused as ref
from ..runtime import get_runtime
from .. import _args as A
from .rms import activation, fp8_activation, given_counter, host_gs, put, put_fp8


def swiglu_quantize(h, granularity=8, *, scope=None, gs=None, out=None, stream=None):
    """NVFP4 of y = round_h.dtype(silu(gate) * up), gate/up de-interleaved from
    h (..., 2I) whose columns alternate `granularity` gate then `granularity`
    up columns; I % 16 == 0 and I % granularity == 0. silu uses rawkv's
    deterministic float32 exp (rawkv.reference.fused.exp_f32).
    Returns QuantizedActivation(q, sf, gs, None); gs per row by default."""
    s = A.out_lead(h, "h")        # (a layout the op refuses: it names h before the outputs are sized)
    g = int(granularity) if R.is_int(granularity) else granularity
    return activation(_swiglu_quantize, h, tuple(s[:-1]), (s[-1] if s else 0) // 2, scope, gs, out, stream,
                      h, g, inv=False)


@op("swiglu_quantize", "Tensor h, Scalar granularity, str scope, Tensor? gs, Scalar? gs_value, Tensor(a!) q, "
                       "Tensor(b!) sf, Tensor(c!) gs_out", host=R.swiglu_scalars)
def _swiglu_quantize(h, granularity, scope, gs, gs_value, q, sf, gs_out, stream=None, fresh=False):
    """rawkv::swiglu_quantize: writes q, sf and gs_out; a gs is a tensor
    `gs` or a number `gs_value`; fresh as for rmsnorm_quantize."""
    a, g, vec = R.swiglu(h, granularity, scope, gs, gs_value, q, sf, gs_out, fresh)
    if a.where == "cpu":
        put(a, *ref.swiglu_quantize(A.to_numpy(a.x, "h").reshape(a.rows, 2 * a.n), g, a.scope, host_gs(a), a.xdt))
        return
    rt = get_runtime(a.x.get_device())
    rt.run(plans.swiglu(rt, a, g, vec, given_counter(rt, a, stream)), stream)


def swiglu_quantize_fp8(h, granularity=8, *, block=128, scale_format="fp32", out=None, stream=None):
    """FP8 block activations of y = round_h.dtype(silu(gate) * up) (h and
    granularity as swiglu_quantize's): bit for bit
    rawkv.fp8.quantize_blocks(y, block=, scale_format=) of the BF16 (FP16) y
    the unfused SwiGLU stores. Returns rawkv.fp8.Fp8Activation(codes,
    scales, None); out= takes (codes, scales)."""
    s = A.out_lead(h, "h")        # (a layout the op refuses: it names h before the outputs are sized)
    g = int(granularity) if R.is_int(granularity) else granularity
    return fp8_activation(_swiglu_quantize_fp8, h, tuple(s[:-1]), (s[-1] if s else 0) // 2, block, scale_format,
                          out, stream, h, g, inv=False)


@op("swiglu_quantize_fp8", "Tensor h, Scalar granularity, Scalar block, str scale_format, Tensor(a!) codes, "
                           "Tensor(b!) scales")
def _swiglu_quantize_fp8(h, granularity, block, scale_format, codes, scales, stream=None, fresh=False):
    """rawkv::swiglu_quantize_fp8: writes codes and scales; fresh as for
    rmsnorm_quantize."""
    a, g, vec = R.swiglu_fp8(h, granularity, block, scale_format, codes, scales, fresh)
    if a.where == "cpu":
        put_fp8(a, *ref.swiglu_quantize_fp8(A.to_numpy(a.x, "h").reshape(a.rows, 2 * a.n), g, a.block,
                                            a.scale_format, a.xdt))
        return
    rt = get_runtime(a.x.get_device())
    rt.run(plans.swiglu_fp8(rt, a, g, vec), stream)
