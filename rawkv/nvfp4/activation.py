"""The NVFP4 activation a producer returns (rawkv.nvfp4.quantize's parts
plus, from the RMSNorm producers, the row's 1/rms)."""
from __future__ import annotations

from typing import Any, NamedTuple


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
        from .. import nvfp4     # transitional: a cycle until dequantize has its own module
        return nvfp4.dequantize(self.q, self.sf, self.gs, dtype=dtype)
