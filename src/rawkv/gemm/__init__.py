"""Grouped FP4 GEMM (docs/gemm.md): FP4 weights packed for the kernel.

    w = rawkv.gemm.Fp4Weight.from_float(weight)          # NVFP4, ModelOpt's bytes
    w = rawkv.gemm.Fp4Weight.from_nvfp4(weight, weight_scale, weight_scale_2, groups=G)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scale)

Modules: weights (Fp4Weight, load-time checks), pack (the packed layout in
torch; rawkv.reference.gemm defines it), w4a8 (w4a8_weight: the W4A8 form of an MXFP4 weight; the W4A8
GEMM's operators, which grouped_linear / moe_linear call for a W4a8Weight),
linear (grouped_linear, moe_linear: the kernel launch or, on CPU, the
reference), layer (Fp4GroupedLinear).
"""
from __future__ import annotations

from .pack import pack_codes, pack_scales, unpack_codes, unpack_scales
from .weights import FORMATS, MX_WINDOW, MX_WINDOW_FP16, NV_SCALE_MAX, Fp4Weight
from .linear import grouped_linear, moe_linear, operator_args
from .layer import Fp4GroupedLinear
from .w4a8 import W4a8Weight, w4a8_weight

__all__ = ["Fp4Weight", "Fp4GroupedLinear", "grouped_linear", "moe_linear", "operator_args", "FORMATS", "MX_WINDOW",
           "MX_WINDOW_FP16", "NV_SCALE_MAX", "pack_codes", "pack_scales", "unpack_codes", "unpack_scales",
           "W4a8Weight", "w4a8_weight"]
