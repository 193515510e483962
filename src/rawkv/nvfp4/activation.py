"""The NVFP4 activation a producer returns (rawkv.nvfp4.quantize's parts
plus, from the RMSNorm producers, the row's 1/rms), and its decode,
rawkv.nvfp4.dequantize. They share this module because each uses the
other: QuantizedActivation.dequantize calls dequantize, which takes one."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from . import _rules as C
from .decode import host_gs, launch_decode
from .. import _args as A
from .._op import empty, op
from ..reference import nvfp4 as ref
from ..runtime import get_runtime

__all__ = ["QuantizedActivation", "dequantize"]       # the family's API (rawkv.nvfp4 exports it)


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
    name = A.decode_dtype(dtype, out, "bfloat16")
    if out is None:
        sq = A.out_lead(q, "q")        # (a layout the op refuses: it names q before out is sized)
        out = empty(q, (*sq[:-1], sq[-1] * 2 if sq else 0), name, stream)
    gs_t, gs_v = A.split_number(gs)
    _dequantize(q, sf, gs_t, gs_v, out, stream, name)
    return out


@op("nvfp4_dequantize", "Tensor q, Tensor sf, Tensor? gs, Scalar? gs_value, Tensor(a!) out",
    host=C.decode_scalars)
def _dequantize(q, sf, gs, gs_value, out, stream=None, dtype=None):
    """rawkv::nvfp4_dequantize: (q, sf) decoded into out, in out's dtype
    (`dtype`, the public op's, when out is a numpy float32 array holding
    bfloat16 values); a gs is a tensor `gs` or a number `gs_value`."""
    where, q, sf, n, kind, gs, out, name = _arguments(q, sf, gs, gs_value, out, dtype)
    if where == "cpu":
        y = ref.dequantize(A.to_numpy(q, "q"), A.to_numpy(sf, "sf"), _lead_gs(kind, gs, q), name)
        A.from_numpy(y, q, torch_dtype=name, out=out)
        return
    m = math.prod(q.shape[:-1])
    launch_decode(get_runtime(q.get_device()), q, sf, kind, gs, None, out, None, m, m, n, stream)


def _arguments(q, sf, gs, gs_value, out, dtype):
    """(where, q, sf, N, gs kind, gs, out, dtype name) of rawkv::nvfp4_dequantize."""
    gs = C.decode_scale(gs, gs_value)
    where = A.placement(("q", q), ("sf", sf), ("gs", gs), ("out", out))
    A.check_outputs((("out", out),), (("q", q), ("sf", sf), ("gs", gs)))
    q, sf, n = C.q_sf(q, sf, where)
    dev, lead = A.device_of(q), tuple(q.shape[:-1])
    kind, gs = C.decode_gs(gs, lead, where, dev)
    out, name = A.decoded(out, dtype, where, (*lead, n), dev, align=16)
    return where, q, sf, n, kind, gs, out, name


def _lead_gs(kind, gs, q):
    """The reference's gs: 0-d, or one per row in q's leading shape."""
    g = host_gs(kind, gs)
    return g.reshape(q.shape[:-1]) if kind == "row" else g


def _activation_parts(q, sf, gs):
    """(q, sf, gs) for dequantize(qa): a QuantizedActivation, sf and gs left out."""
    if not isinstance(q, QuantizedActivation):
        A.require_array(q, "q")
    if not isinstance(q, QuantizedActivation) or sf is not None or gs is not None:
        raise TypeError("sf, gs: both required, unless q is a rawkv.nvfp4.QuantizedActivation "
                        f"(then neither); got q of type {type(q).__name__}")
    return q.q, q.sf, q.gs
