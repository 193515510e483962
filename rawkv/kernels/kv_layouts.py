"""rawkv/cu/kv_layouts.cu: the ecosystem byte layouts of the DeepSeek-V4 KV
cache (FlashMLA MODEL1_FP8Sparse entries and window tokens, DeepGEMM FP8 /
MXFP4 indexer keys), the MODEL1 gather by FlashMLA indices and the top-k ->
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
}

FILE = KernelFile("kv_layouts.cu", constants=LAYOUT_CONSTANTS)

_TIN = TParam("typename", "TIN", ("float32", "bfloat16"))     # entry / key rows
_TID = TParam("typename", "TID", ("int32", "int64"))          # slot mappings, top-k ids
_STORE = ("const TIN* rows, const TID* slots, const int* offsets, u8* cache, int* errors, "
          "i64 N, i64 num_pages, i64 page_size, i64 page_bytes")

MODEL1_STORE = FILE.kernel("rkv_model1_store", _STORE, (_TIN, _TID))
# MXFP4 false: the FP8 key (DeepGEMM SM90); true: the MXFP4 key (SM100).
INDEX_STORE = FILE.kernel("rkv_index_store", _STORE, (_TIN, _TID, TParam("bool", "MXFP4", (False, True))))

MODEL1_GATHER = FILE.kernel(
    "rkv_model1_gather",
    "const u8* cache, const int* indices, TO* out, int* errors, i64 R, i64 num_pages, "
    "i64 page_size, i64 page_bytes",
    (TParam("typename", "TO", ("bfloat16", "float16", "float32")),))

TOPK_TO_KVCACHE = FILE.kernel(
    "rkv_topk_to_kvcache",
    "const TID* ids, const int* table, const int* slots, const int* n_entries, int* out, "
    "int* errors, i64 B, i64 per_row, i64 table_rows, i64 max_blocks, i64 num_pages, i64 page_size",
    (_TID,))
