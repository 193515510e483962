"""rawkv/cu/nvfp4.cu: NVFP4 quantize / dequantize / gather / scale swizzle.

The constants below are what the host and the kernels both know; the `.cu`
file reads them as -D macros (RKV_NVFP4_*), so each value is written here
only."""
from ._decl import KernelFile, TParam

# rkv_nvfp4_quantize's MODE: where the decode global scale comes from.
#: gs = *gs_ptr (a device tensor) or gs_val (scopes 'given' and 'none'),
#: checked in the kernel (an unusable one flags every block and is counted).
MODE_GIVEN = 0
#: *gs_ptr holds the tensor's amax (from rkv_nvfp4_amax): gs derived from it.
MODE_AMAX = 1

#: 8-element units each gather thread keeps in flight; the host sizes a
#: row's thread group for units / GATHER_UNROLL.
GATHER_UNROLL = 4

#: Threads per CTA at most for the one-launch kernels (quantize_small,
#: quantize_rows): their __launch_bounds__, and the host's cap on a row
#: group (rows of up to this many units stay in registers).
MAX_BLOCK_THREADS = 1024

FILE = KernelFile("nvfp4.cu", constants={
    "RKV_NVFP4_MODE_GIVEN": MODE_GIVEN,
    "RKV_NVFP4_MODE_AMAX": MODE_AMAX,
    "RKV_NVFP4_GATHER_UNROLL": GATHER_UNROLL,
    "RKV_NVFP4_MAX_BLOCK_THREADS": MAX_BLOCK_THREADS,
})

FLOATS = ("float32", "float16", "bfloat16")
_T = TParam("typename", "T", FLOATS)
# blocks of 16 per work unit: 2 when N % 32 == 0 (16-byte code stores), else 1
_BPT = TParam("int", "BPT", (1, 2))

# The quantize kernels are producers of a GEMM's activations: programmatic
# dependent launches (common.cuh's pdl_producer_start; docs/runtime.md).
AMAX = FILE.kernel("rkv_nvfp4_amax", (_T,), pdl=True)
QUANTIZE = FILE.kernel(
    "rkv_nvfp4_quantize",
    (_T, _BPT, TParam("int", "MODE", (MODE_GIVEN, MODE_AMAX))), pdl=True)
FINALIZE_GS = FILE.kernel("rkv_nvfp4_finalize_gs", pdl=True)
QUANTIZE_SMALL = FILE.kernel("rkv_nvfp4_quantize_small", (_T, _BPT), pdl=True)
# R = 1: the row stays in registers (one unit per thread); 0: read twice
QUANTIZE_ROWS = FILE.kernel("rkv_nvfp4_quantize_rows", (_T, _BPT, TParam("int", "R", (0, 1))), pdl=True)
GATHER = FILE.kernel(
    "rkv_nvfp4_gather",
    (TParam("typename", "OutT", FLOATS), TParam("typename", "IdxT", ("int32", "int64")),
     TParam("bool", "ROWGS", (False, True))))
SWIZZLE = FILE.kernel("rkv_nvfp4_swizzle")
UNSWIZZLE = FILE.kernel("rkv_nvfp4_unswizzle")
