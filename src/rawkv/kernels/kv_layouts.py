"""rawkv/cu/kv_layouts.cu: the ecosystem byte layouts of the DeepSeek-V4 KV
cache (FlashMLA MODEL1_FP8Sparse entries and window tokens, DeepGEMM FP8 /
MXFP4 / MXFP8 indexer keys), the MODEL1 gather by FlashMLA indices and the top-k ->
indices_in_kvcache bridge. Launched by rawkv.kvcache.layouts.

The layout values are the reference's (rawkv.reference.kvcache.layouts
defines the bytes); they reach the .cu file as -D constants from here."""
from ..reference.kvcache import layouts as _R
from ._decl import KernelFile, TParam

# Threads per CTA of every kernel of the file (its __launch_bounds__).
BLOCK = 256


def _f32_literal(x) -> str:
    """A float32 constant as an exact C hex literal."""
    return float(x).hex() + "f"


# Template KEY of the indexer-key kernels (kv_layouts.cuh kKeyFP8, ...): which
# DeepGEMM key record they write or read, by the reference layout's name.
KEY_FP8, KEY_MXFP4, KEY_MXFP8 = 0, 1, 2
KEYS = {_R.INDEX_FP8.name: KEY_FP8, _R.INDEX_MXFP4.name: KEY_MXFP4, _R.INDEX_MXFP8.name: KEY_MXFP8}
# the kernels map an MX block to 8 lanes of 4 dims, for MXFP4 and MXFP8 alike
assert _R.MXFP8_BLOCK == _R.MXFP4_BLOCK

# The constants of rawkv/cu/kv_layouts.cuh: every file that includes it
# (kv_layouts.cu, kv_cache.cu, kv_compress.cu) passes them.
LAYOUT_CONSTANTS = {
    "RKV_LAY_BLOCK": BLOCK,
    "RKV_LAY_NOPE": _R.NOPE_DIM, "RKV_LAY_ROPE": _R.ROPE_DIM, "RKV_LAY_TILE": _R.FP8_TILE,
    "RKV_LAY_M1_DATA": _R.MODEL1.data_bytes, "RKV_LAY_M1_SCALE": _R.MODEL1.scale_bytes,
    "RKV_LAY_INDEX_DIM": _R.INDEX_DIM, "RKV_LAY_MX_BLOCK": _R.MXFP4_BLOCK,
    "RKV_LAY_FP8_FLOOR": _f32_literal(_R.FP8_AMAX_FLOOR),
    "RKV_LAY_MX_FLOOR": _f32_literal(_R.MXFP4_AMAX_FLOOR),
    "RKV_LAY_UE8M0_BIAS": _R.UE8M0_BIAS,
    "RKV_LAY_KEY_FP8": KEY_FP8, "RKV_LAY_KEY_MXFP4": KEY_MXFP4, "RKV_LAY_KEY_MXFP8": KEY_MXFP8,
}

FILE = KernelFile("kv_layouts.cu", constants=LAYOUT_CONSTANTS)

_TIN = TParam("typename", "TIN", ("float32", "bfloat16"))     # entry / key rows
_TID = TParam("typename", "TID", ("int32", "int64"))          # slot mappings, top-k ids

MODEL1_STORE = FILE.kernel("rkv_model1_store", (_TIN, _TID))
# KEY: the FP8 key (DeepGEMM SM90 / SM100), the MXFP4 or the MXFP8 key (SM100): KEYS.
KEY = TParam("int", "KEY", (KEY_FP8, KEY_MXFP4, KEY_MXFP8))
INDEX_STORE = FILE.kernel("rkv_index_store", (_TIN, _TID, KEY))

MODEL1_GATHER = FILE.kernel("rkv_model1_gather", (TParam("typename", "TO", ("bfloat16", "float16", "float32")),))

TOPK_TO_KVCACHE = FILE.kernel("rkv_topk_to_kvcache", (_TID,))
