"""The NVFP4 activation a producer returns (rawkv.nvfp4.quantize's parts
plus, from the RMSNorm producers, the row's 1/rms), and its decode,
rawkv.nvfp4.dequantize. They share this module because each uses the
other: QuantizedActivation.dequantize calls dequantize, which takes one."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from . import _checks as C
from .decode import launch_decode, traced_decode
from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..reference import nvfp4 as ref
from ..runtime import get_runtime


class QuantizedActivation(NamedTuple):
    """An NVFP4 activation: q (..., N/2) codes (torch.float4_e2m1fn_x2 view of
    uint8 bytes where torch has it; numpy: uint8), sf (..., N/16) UE4M3 scales
    (torch.float8_e4m3fn view; numpy: uint8), gs (the decode global scale: shape (...) for scope 'row', () else)
    and, from the RMSNorm producers, inv_rms (...) float32."""
    q: Any
    sf: Any
    gs: Any
    inv_rms: Any = None

    def dequantize(self, dtype=None):
        """x ~ e2m1[q] * (float(sf) * gs), rounded to `dtype` (bfloat16
        default), through rawkv.nvfp4.dequantize (kernel on CUDA, reference
        on CPU). rawkv.nvfp4.dequantize(qa) is the same call."""
        return dequantize(self.q, self.sf, self.gs, dtype=dtype)


def dequantize(q, sf=None, gs=None, *, dtype=None, out=None, stream=None):
    """y (..., N) = e2m1[q] * (float(sf) * gs), rounded to `dtype` (bfloat16
    default, float16, float32). gs: a float, a 1-element float32 tensor, or
    one per row (shape q.shape[:-1]). q may instead be a
    rawkv.nvfp4.QuantizedActivation, with sf and gs left out."""
    if sf is None or gs is None:
        q, sf, gs = _activation_parts(q, sf, gs)
    name, tdt = C.decode_dtype(dtype, out)
    if D.compiling():
        return traced_decode(DEQUANTIZE_OP, out, (*q.shape[:-1], q.shape[-1] * 2), tdt, gs, q=q, sf=sf)
    gs = C.decode_gs(gs)
    where = D.placement(("q", q), ("sf", sf), ("gs", gs), ("out", out))
    A.check_outputs((("out", out),), (("q", q), ("sf", sf), ("gs", gs)))
    if where == "cpu":
        qa, sfa, n = C.cpu_q_sf(q, sf)
        ga = C.cpu_decode_gs(gs, qa.shape[:-1])
        C.cpu_decode_out(out, name, (*qa.shape[:-1], n))
        return D.from_numpy(ref.dequantize(qa, sfa, ga, name), q, torch_dtype=tdt, out=out)
    q8, sf8, n = C.check_q_sf(q, sf)
    dev = q8.get_device()
    lead = tuple(q8.shape[:-1])
    kind, gsv = C.decode_gs_cuda(gs, lead, dev)
    if out is not None:
        out = C.check_out(out, "out", (tdt,), (*lead, n), dev, align=16)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty((*lead, n), tdt, stream=stream)
    m = math.prod(lead)
    launch_decode(rt, q8, sf8, kind, gsv, None, out, None, m, m, n, stream)
    return out


def _activation_parts(q, sf, gs):
    """(q, sf, gs) for dequantize(qa): a QuantizedActivation, sf and gs left out."""
    if not isinstance(q, QuantizedActivation):
        A.require_array(q, "q")
    if not isinstance(q, QuantizedActivation) or sf is not None or gs is not None:
        raise TypeError("sf, gs: both required, unless q is a rawkv.nvfp4.QuantizedActivation "
                        f"(then neither); got q of type {type(q).__name__}")
    return q.q, q.sf, q.gs


def _dequantize_op(q, sf, gs, gs_value, out):
    """rawkv::nvfp4_dequantize: out's dtype is the decode dtype."""
    dequantize(q, sf, A.op_gs(gs, gs_value, required=True), out=out)


DEQUANTIZE_OP = OpDecl("nvfp4_dequantize", _dequantize_op,
                       "Tensor q, Tensor sf, Tensor? gs, float? gs_value, Tensor(a!) out")
