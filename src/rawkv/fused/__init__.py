"""Fused NVFP4 producers and MoE input staging (docs/fused.md).

    qa = rawkv.fused.rmsnorm_quantize(x, weight, eps=1e-6)          # (..., N)
    qa = rawkv.fused.mhc_rmsnorm_quantize(X, A, weight, eps=1e-6)   # X (..., n_hc, N), A (..., n_hc)
    qa = rawkv.fused.swiglu_quantize(h, granularity=8)              # h (..., 2I) interleaved gate/up
    st = rawkv.fused.moe_stage(hidden, topk_ids, topk_weights)      # one-level NVFP4 + top-k copy

FP8 block outputs (E4M3 codes, one FP32 or UE8M0 scale per row per 32 / 64 /
128 channels: rawkv.fp8.quantize_blocks' format, DeepSeek's act_quant):

    fa = rawkv.fused.rmsnorm_quantize_fp8(x, weight, scale_format="ue8m0")   # Fp8Activation
    fa = rawkv.fused.mhc_rmsnorm_quantize_fp8(X, A, weight)
    fa = rawkv.fused.swiglu_quantize_fp8(h, granularity=8, block=128)
    st = rawkv.fused.moe_stage_fp8(hidden, topk_ids, topk_weights)         # MoEStagedFp8

each bit for bit quantize_blocks of the BF16 (FP16) tensor the unfused op
would store (docs/fused.md, "FP8 block outputs").

Each reads its input once and writes NVFP4 once, in one kernel launch (two
for scope='tensor'), with no intermediate tensor and no host sync. Results
are `QuantizedActivation(q, sf, gs, inv_rms)` (rawkv.nvfp4.activation) /
`MoEStaged(q, sf, topk_ids, topk_weights)` named tuples; `out=` takes the
same tuple (entries may be None to allocate them) so that a captured CUDA
graph needs no allocation.

Global scale (`scope`): 'row' (default: one gs per row, computed on the
device), 'tensor' (one gs for the tensor, computed on the device: two
launches), 'given' (`gs`: a number or a 1-element float32 tensor, read
on the device, under rawkv.nvfp4's rule: 0 < gs < the bound of the input
dtype, refused on the host for numbers and host arrays; a device gs outside
it flags every block and is counted in rawkv.nvfp4.error_counts()) or
'none' (one-level NVFP4, gs = 1). rawkv.nvfp4.dequantize(qa) decodes a result.

CUDA inputs are bfloat16 or float16 and run the kernels declared in
rawkv.kernels.fused; numpy arrays and CPU tensors run rawkv.reference.fused,
which defines every op (float32 numpy arrays: no rounding of the
intermediates; see docs/fused.md).

Each op is written once, as the body of its torch custom operator
torch.ops.rawkv.<op name> (rawkv._op; mutating form, docs/fused.md lists
the schemas); the public function allocates what out= does not give and
calls it.

Modules: rms (RMSNorm and mHC + RMSNorm, and the row producers' shared
public part), swiglu, moe; _rules (the family's argument rules, one function
per op, CPU and CUDA alike), plans (the launches as data; the global-scale
scopes are rawkv.nvfp4.encode's).
"""
from ..fp8 import Fp8Activation
from ..nvfp4.activation import QuantizedActivation
from .moe import MoEStaged, MoEStagedFp8, moe_stage, moe_stage_fp8
from .rms import mhc_rmsnorm_quantize, mhc_rmsnorm_quantize_fp8, rmsnorm_quantize, rmsnorm_quantize_fp8
from .swiglu import swiglu_quantize, swiglu_quantize_fp8

__all__ = ["QuantizedActivation", "MoEStaged", "rmsnorm_quantize", "mhc_rmsnorm_quantize",
           "swiglu_quantize", "moe_stage", "Fp8Activation", "MoEStagedFp8", "rmsnorm_quantize_fp8",
           "mhc_rmsnorm_quantize_fp8", "swiglu_quantize_fp8", "moe_stage_fp8"]
