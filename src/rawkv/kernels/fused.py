"""rawkv/cu/fused.cu: fused NVFP4 producers (RMSNorm / mHC + RMSNorm / SwiGLU
+ quantize) and MoE input staging (docs/fused.md).

The constants below are the only copy of the values fused.cu also uses: the
runtime hands them to NVRTC as -D options and fused.cu refuses to compile
without them.
"""
from ._decl import KernelFile, TParam

#: The row kernels' run-time `mode` (the global scale of the row).
MODE_ROW = 0          # gs per row, from the row's amax
MODE_AMAX = 1         # scope 'tensor', launch 1: atomicMax of the tensor amax into gs
MODE_TENSOR = 2       # scope 'tensor', launch 2: quantize with that amax's gs
MODE_FIXED = 3        # gs given (device pointer or value; 1 for one-level)

#: Run-time dtype codes of the small parameters (mix, weight) the row kernels
#: read element by element.
PARAM_KIND = {"float32": 0, "bfloat16": 1, "float16": 2}

#: Most hyper-connection streams mhc_rmsnorm_quantize mixes (x.shape[-2]).
MAX_HC = 4

#: 16-element chunks each row-kernel thread holds in registers (template REG).
#: 2 measured best on an H100: 4 (fewer, fatter threads) was as fast for
#: RMSNorm and 28% slower for SwiGLU.
REG = 2

#: A row CTA of MAX_THREADS / REG threads fits an SM at each arch's register
#: caps (fused.cu asserts it): below sm_100 the row kernels are capped at 56
#: or 64 registers a thread (fused.cu's __maxnreg__, kRowRegs /
#: kRowRegsWide), so 1024 threads at REG 2; sm_100 / sm_120 code needs about
#: 80 registers (ptxas spills in 64), hence 768 threads there.
MAX_THREADS = 2048
MAX_THREADS_SM100 = 1536

#: The most threads the host gives a row CTA, on every arch: within every
#: arch's bound, and one launch geometry (so one float64 summation order of
#: the RMSNorm) wherever rawkv runs.
MAX_BLOCK = min(MAX_THREADS, MAX_THREADS_SM100) // REG

#: Threads per CTA of rkv_moe_stage (its __launch_bounds__ and the launch).
MOE_BLOCK = 256

FILE = KernelFile("fused.cu", constants={
    "RKV_FUSED_MODE_ROW": MODE_ROW, "RKV_FUSED_MODE_AMAX": MODE_AMAX,
    "RKV_FUSED_MODE_TENSOR": MODE_TENSOR, "RKV_FUSED_MODE_FIXED": MODE_FIXED,
    "RKV_FUSED_KIND_F32": PARAM_KIND["float32"], "RKV_FUSED_KIND_BF16": PARAM_KIND["bfloat16"],
    "RKV_FUSED_KIND_F16": PARAM_KIND["float16"],
    "RKV_FUSED_MAX_HC": MAX_HC,
    "RKV_FUSED_MAX_THREADS": MAX_THREADS, "RKV_FUSED_MAX_THREADS_SM100": MAX_THREADS_SM100,
    "RKV_FUSED_MOE_BLOCK": MOE_BLOCK,
})

_T = TParam("typename", "T", ("bfloat16", "float16"))
_REG = TParam("int", "REG", (REG,))

# [mHC mix +] RMSNorm + quantize; MIX = the mHC form (x is (rows, n_hc, N)).
RMS = FILE.kernel(
    "rkv_fused_rms",
    (_T, TParam("bool", "MIX", (False, True)), _REG), pdl=True)

# gs of an op with no rows (scopes tensor / given / none): one thread.
SET_GS = FILE.kernel("rkv_fused_set_gs", pdl=True)

# SwiGLU de-interleave + silu * up + quantize; VEC: granularity % 8 == 0 (16-byte loads).
SWIGLU = FILE.kernel(
    "rkv_fused_swiglu",
    (_T, TParam("bool", "VEC", (True, False)), _REG), pdl=True)

# One-level NVFP4 + scales packed four per int32 + top-k copy, one grid-stride launch.
MOE_STAGE = FILE.kernel(
    "rkv_moe_stage",
    (_T, TParam("typename", "ID", ("int32", "int64"))), pdl=True)

# The FP8 block outputs (fp8_blocks.cuh's rule on the T-rounded y): the block
# (32, 64, 128) and sbyte (E8M0 bytes or float32 scales) are run-time
# arguments; UE8M0 (power-of-two scales, or any float32 scale: the first of
# rawkv.kernels.fp8_blocks's SCALE_* pairs) is a template constant, so an
# instance holds one quotient path (the multiply or Markstein's correction).
_UE8M0 = TParam("bool", "UE8M0", (True, False))
RMS_FP8 = FILE.kernel(
    "rkv_fused_rms_fp8",
    (_T, TParam("bool", "MIX", (False, True)), _REG, _UE8M0), pdl=True)
SWIGLU_FP8 = FILE.kernel(
    "rkv_fused_swiglu_fp8",
    (_T, TParam("bool", "VEC", (True, False)), _REG, _UE8M0), pdl=True)
MOE_STAGE_FP8 = FILE.kernel(
    "rkv_moe_stage_fp8",
    (_T, TParam("typename", "ID", ("int32", "int64")), _UE8M0), pdl=True)
