"""rawkv/cu/fp8_blocks.cu: FP8 block activations, E4M3 codes with one scale
per row per BLOCK channels (rawkv.fp8.quantize_blocks / dequantize_blocks).

A block scale is FP32 amax * FP32(1/448) (UE8M0 false) or that rounded up to
a power of two (UE8M0 true), stored as float32 or, with SBYTE, as its E8M0
byte; SBYTE needs UE8M0 (the instances below)."""
from ._decl import KernelFile, TParam

FILE = KernelFile("fp8_blocks.cu")
_FLOATS = ("float32", "float16", "bfloat16")

#: Block sizes (channels per scale) the quantize kernel is built for.
BLOCKS = (32, 64, 128)
#: (UE8M0, SBYTE) of each scale format and storage.
SCALE_FP32 = (False, False)
SCALE_UE8M0_F32 = (True, False)
SCALE_UE8M0 = (True, True)

QUANTIZE = FILE.kernel(
    "rkv_fp8_quantize_blocks",
    (TParam("typename", "T", _FLOATS), TParam("int", "BLOCK", BLOCKS), TParam("bool", "UE8M0", (False, True)),
     TParam("bool", "SBYTE", (False, True))),
    instances=[(t, b, *f) for t in _FLOATS for b in BLOCKS for f in (SCALE_FP32, SCALE_UE8M0_F32, SCALE_UE8M0)],
    pdl=True)    # (a producer: common.cuh's pdl_producer_start)
DEQUANTIZE = FILE.kernel(
    "rkv_fp8_dequantize_blocks", (TParam("typename", "OutT", _FLOATS), TParam("bool", "UE8M0", (False, True))))
#: Channels per lane of the quantizer (fp8_blocks.cuh's fp8_quantize_rows,
#: also moe_stage_fp8's): a unit (row, block) is BLOCK / QUANTIZE_LANE lanes.
QUANTIZE_LANE = 16


def quantize_threads(rows: int, k: int, block: int) -> int:
    """Threads of fp8_quantize_rows' grid-stride loop with nothing to stride:
    one per QUANTIZE_LANE channels of each unit (row, block), the last
    block's lanes past K included (they idle)."""
    return rows * -(-k // block) * (block // QUANTIZE_LANE)


#: Codes per thread of rkv_fp8_dequantize_blocks.
DEQUANTIZE_UNIT = 8
