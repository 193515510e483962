"""NVFP4 quantize / dequantize / gather and the tensor-core scale layout
(docs/format.md, "NVFP4").

    q, sf, gs = rawkv.nvfp4.quantize(x)                  # scope="tensor"
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row")     # gs: one per row
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=g)   # float or device tensor
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="none")    # one-level NVFP4, gs = 1
    y = rawkv.nvfp4.dequantize(q, sf, gs)                # bfloat16 (float16 / float32)
    y = rawkv.nvfp4.gather(q, sf, gs, idx, errors=err)   # rows idx of q, bounds-checked
    sw = rawkv.nvfp4.swizzle_scales(sf); sf2 = rawkv.nvfp4.unswizzle_scales(sw, sf.shape)
    errs = rawkv.nvfp4.error_counts()                    # bad inputs the kernels met
    torch.ops.rawkv.nvfp4_quantize(x, "row", None, None, q, sf, gs, None)   # mutating form

CUDA tensors run rawkv/cu/nvfp4.cu (declared in rawkv.kernels.nvfp4) on
torch's current stream (or `stream`); numpy arrays and CPU tensors run
rawkv.reference (nvfp4.py, layouts.py), which defines every result bit for
bit. Each op is written once, as its rawkv::nvfp4_* torch operator (the
mutating form engines call, rawkv._op): the functions here allocate what
they return and call it (docs/format.md, "NVFP4: torch custom operators").
Every argument is checked, by the same rules on CPU and CUDA, before
anything is launched or written. Every
op takes out= buffers, so a CUDA-graph-captured step allocates nothing;
nothing here synchronizes with the host.

Modules (each one's __all__ is what rawkv.nvfp4 exports of it): encode
(quantize), activation (QuantizedActivation, dequantize),
decode (gather and the decode launch), scales (swizzle), counters (error
counters), _rules (the argument rules its ops share; each op's own sit beside it),
_geometry (launch shapes).
"""
from __future__ import annotations

from . import activation, counters, decode, encode, scales
from .activation import *  # noqa: F401,F403  (each module's __all__: its public ops)
from .counters import *  # noqa: F401,F403
from .decode import *  # noqa: F401,F403
from .encode import *  # noqa: F401,F403
from .scales import *  # noqa: F401,F403

__all__ = [*encode.__all__, *activation.__all__, *decode.__all__, *scales.__all__, *counters.__all__]
