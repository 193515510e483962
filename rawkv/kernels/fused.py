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

#: The row kernels are compiled with __launch_bounds__(MAX_THREADS / REG, 1),
#: which is what sets their register budget: below sm_100 1024 threads at
#: REG 2, so 64 registers a thread; sm_100 / sm_120 code needs about 80
#: registers (ptxas spills in 64), hence 768 threads there.
MAX_THREADS = 2048
MAX_THREADS_SM100 = 1536

#: The most threads the host gives a row CTA, on every arch: within every
#: arch's bound, and one launch geometry (so one float64 summation order of
#: the RMSNorm) wherever rawkv runs.
MAX_BLOCK = min(MAX_THREADS, MAX_THREADS_SM100) // REG

#: Threads per CTA of rkv_moe_stage (its __launch_bounds__ and the launch).
MOE_BLOCK = 256

#: 16-byte pieces of one 16-element chunk in the pipelined row kernels (PIPE):
#: RMSNorm's raw row (32 bytes), SwiGLU's gate and up runs (64 bytes).
RMS_RAW = 2
SWIGLU_RAW = 4

#: The pipelined form of the row kernels (PIPE = True: a CTA loops over rows and
#: prefetches the next row into shared memory while it quantizes the current
#: one; rawkv/fused/_rows.py pipe_layout says when). False: every call takes
#: the one-row-per-CTA form, as before issue 14.
PIPE = True
#: Most dynamic shared memory a pipelined CTA takes (two row buffers), so that
#: static + dynamic stay within the 48 KB every arch gives without an opt-in.
PIPE_SMEM_MAX = 45056
#: Most rows one pipelined CTA quantizes (the first row's load is the one not
#: overlapped), and the fewest CTAs per SM the grid keeps (waves, for the tail).
PIPE_ROWS = 8
PIPE_CTAS_PER_SM = 4

FILE = KernelFile("fused.cu", constants={
    "RKV_FUSED_MODE_ROW": MODE_ROW, "RKV_FUSED_MODE_AMAX": MODE_AMAX,
    "RKV_FUSED_MODE_TENSOR": MODE_TENSOR, "RKV_FUSED_MODE_FIXED": MODE_FIXED,
    "RKV_FUSED_KIND_F32": PARAM_KIND["float32"], "RKV_FUSED_KIND_BF16": PARAM_KIND["bfloat16"],
    "RKV_FUSED_KIND_F16": PARAM_KIND["float16"],
    "RKV_FUSED_MAX_HC": MAX_HC,
    "RKV_FUSED_MAX_THREADS": MAX_THREADS, "RKV_FUSED_MAX_THREADS_SM100": MAX_THREADS_SM100,
    "RKV_FUSED_MOE_BLOCK": MOE_BLOCK,
    "RKV_FUSED_RMS_RAW": RMS_RAW, "RKV_FUSED_SWIGLU_RAW": SWIGLU_RAW,
})

_T = TParam("typename", "T", ("bfloat16", "float16"))
_REG = TParam("int", "REG", (REG,))

_PIPE = TParam("bool", "PIPE", (False, True))

# [mHC mix +] RMSNorm + quantize; MIX = the mHC form (x is (rows, n_hc, N));
# PIPE = the pipelined form (not with MIX).
RMS = FILE.kernel(
    "rkv_fused_rms",
    "const T* x, const void* mix, long long mix_kind, long long n_hc, const void* w, long long w_kind, "
    "double eps, long long n, u8* q, u8* sf, float* gs_out, float* inv_out, const float* gs_in, "
    "double gs_val, long long mode, int* errors, long long rows",
    (_T, TParam("bool", "MIX", (False, True)), _REG, _PIPE),
    instances=[(t, mix, REG, pipe) for t in _T.values for mix in (False, True) for pipe in (False, True)
               if not (mix and pipe)])

# gs of an op with no rows (scopes tensor / given / none): one thread.
SET_GS = FILE.kernel("rkv_fused_set_gs", "float* gs_out, const float* gs_in, double gs_val")

# SwiGLU de-interleave + silu * up + quantize; VEC: granularity % 8 == 0 (16-byte loads);
# PIPE = the pipelined form (VEC only).
SWIGLU = FILE.kernel(
    "rkv_fused_swiglu",
    "const T* h, long long inter, long long g, u8* q, u8* sf, float* gs_out, const float* gs_in, "
    "double gs_val, long long mode, int* errors, long long rows",
    (_T, TParam("bool", "VEC", (True, False)), _REG, _PIPE),
    instances=[(t, vec, REG, pipe) for t in _T.values for vec in (True, False) for pipe in (False, True)
               if vec or not pipe])

# One-level NVFP4 + scales packed four per int32 + top-k copy, one grid-stride launch.
MOE_STAGE = FILE.kernel(
    "rkv_moe_stage",
    "const T* x, long long n_units, u8* q, u32* sf, const ID* ids, long long n_ids, long long* ids_out, "
    "const u8* wts, long long w_bytes, u8* wts_out",
    (_T, TParam("typename", "ID", ("int32", "int64"))))
