"""rawkv/cu/gemm_w4a8_sm90.cu: the W4A8 grouped GEMM on Hopper's FP8 wgmma
(docs/gemm.md, "W4A8"): MXFP4 weights in their W4A8 form
(rawkv.reference.gemm_w4a8: packed codes and shifts, a power of two per
row), FP8 block activations (E4M3, one FP32 scale per token per 128
channels). Compiled for sm_90a on sm_90 devices only.

A block computes BM = 128 output features x BN tokens, STAGES pipeline
stages of 128 columns each (BN x 128 B of activations, 8 x (1024 + 64) B of
packed codes and shifts, BN x 4 B of scales)."""
from ..reference import gemm_w4a8 as ref8
from ._decl import KernelFile, TParam
from .gemm_fp4 import FILE as _FP4

BM = 128
THREADS = 384
#: The E4M3 table (SHIFT_TABLE) as little-endian words, two per shift row.
TABLE_WORDS = ref8.SHIFT_TABLE.reshape(-1).view("<u4")
FILE = KernelFile("gemm_w4a8_sm90.cu", targets={"sm_90": "sm_90a"},
                  constants={**_FP4.constants,
                             "RKV_W4A8_TABLE": ",".join(f"{int(w):#010x}u" for w in TABLE_WORDS),
                             "RKV_W4A8_SHIFT_BIAS": ref8.SHIFT_BIAS})
#: (BN, STAGES) by the most tokens per group (or per expert) each serves.
CONFIGS = {64: (64, 8), "large": (128, 6)}


def dynamic_smem(bn: int, stages: int) -> int:
    """Bytes of dynamic shared memory of one block: 1024 for aligning the
    swizzled B stages, the stages, the E4M3 table in shared memory (one
    8-byte row per shift byte, 2048 bytes: the exact rows, and zeros for the
    bytes past the table) and two mbarriers per stage."""
    return 1024 + stages * (bn * 128 + (BM // 16) * (ref8.LANE_BYTES * 32 + ref8.SHIFT_BYTES * 8) + bn * 4) \
        + 256 * 8 + 16 * stages


GEMM = FILE.kernel(
    "rkv_gemm_w4a8_sm90",
    (TParam("int", "BN", (64, 96, 112, 128)), TParam("int", "STAGES", (2, 3, 4, 5, 6, 7, 8))),
    instances=list(dict.fromkeys(CONFIGS.values())),
    dynamic_smem=dynamic_smem)
