"""The W4A8 form of an MXFP4 Fp4Weight (issue 23; docs/gemm.md "W4A8 (issue
23)"), built once at load, what the W4A8 kernel is to read beside the
weight's packed codes:

    w8 = rawkv.gemm.w4a8_weight(w)          # w: an MXFP4 Fp4Weight
    w8.shifts                               # uint8, the packed scale layout
    w8.row_scale                            # float32 (G, NP): 2^r per row

The rule is rawkv.reference.gemm_w4a8's (this runs it on the host: load
time, a host sync for a CUDA weight, as Fp4Weight.dequantize does). No op
takes it yet: the op lands with its kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..reference import gemm as ref
from ..reference import gemm_w4a8 as ref8
from . import pack
from .weights import Fp4Weight


class W4a8Weight(NamedTuple):
    """weight: the Fp4Weight (its packed codes are the kernel's, unchanged);
    shifts: uint8 (G, NP/16, C, 32, 2), the biased block shifts e_b +
    SHIFT_BIAS in the packed scale layout (padding ZERO_SHIFT), the row of
    rawkv.reference.gemm_w4a8.SHIFT_TABLE that converts the block's codes to
    E4M3; row_scale: float32 (G, NP), 2^r of each row (padding rows 1), for
    the epilogue. All on the weight's device."""
    weight: Fp4Weight
    shifts: object
    row_scale: object


def w4a8_weight(weight) -> W4a8Weight:
    """The W4A8 form of an MXFP4 `weight`, or a ValueError naming the MXFP4
    blocks no per-row power of two holds exactly in E4M3 (the reference's
    rule). NVFP4 weights are refused: e2m1 times an E4M3 scale needs up to 5
    significant bits, E4M3 has 4."""
    if not isinstance(weight, Fp4Weight):
        raise TypeError(f"weight: expected a rawkv.gemm.Fp4Weight, got {type(weight).__name__}")
    if weight.fmt != "mxfp4":
        raise ValueError(f"weight: W4A8 takes MXFP4 weights only, got {weight.fmt}: an NVFP4 element "
                         "(e2m1 x E4M3 scale, up to 5 significant bits) is not an E4M3 value; "
                         "use the W4A16 path")
    import torch
    codes, scales, _ = (t.cpu().numpy() for t in weight.unpack())
    shifts, rebase = ref8.w4a8_form(codes, scales, name="weight")
    dev = weight.device
    packed = pack.pack_scales(torch.from_numpy(shifts), ref8.W_BLOCK, pad=ref8.ZERO_SHIFT).to(dev)
    npad, _ = ref.padded_sizes(weight.n, weight.k)
    row = np.ones((weight.groups, npad), np.float32)
    row[:, :weight.n] = np.ldexp(np.float32(1.0), rebase)     # 2^r >= 2^-136: an FP32 value exactly
    return W4a8Weight(weight, packed, torch.from_numpy(row).to(dev))
