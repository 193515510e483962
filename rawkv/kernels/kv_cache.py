"""rawkv/cu/kv_cache.cu: the format kernels of the DeepSeek-V4 compressed KV
cache (flush into the paged pool, gathers out of it, decode-state append and
reset). Launched by rawkv.kvcache (flush.py, gather.py, state_ops.py)."""
from ._decl import KernelFile, TParam
from .kv_layouts import LAYOUT_CONSTANTS

# Threads per CTA of the gathers and the state kernels (their
# __launch_bounds__): the ops launch at most this many.
BLOCK = 256
# rkv_kv_flush_write: one warp per batch row, this many rows per CTA.
FLUSH_ROWS = 4
# rkv_kv_state_reset<MODE>: what the reset does.
RESET_HCA, RESET_CSA, RESET_CLEAR = 0, 1, 2

FILE = KernelFile("kv_cache.cu", constants={
    "RKV_KV_BLOCK": BLOCK, "RKV_KV_FLUSH_ROWS": FLUSH_ROWS,
    "RKV_KV_RESET_HCA": RESET_HCA, "RKV_KV_RESET_CSA": RESET_CSA, "RKV_KV_RESET_CLEAR": RESET_CLEAR,
    **LAYOUT_CONSTANTS,          # the pool's "model1" layout uses kv_layouts.cuh
})

_ROWS_IN = ("float32", "bfloat16")                 # kv / z rows of state_append
_TO = TParam("typename", "TO", ("bfloat16", "float16", "float32"))
_IDS = ("int32", "int64")

FLUSH_WRITE = FILE.kernel(
    "rkv_kv_flush_write",
    "const __nv_bfloat16* entries, const __nv_bfloat16* index_keys, const bool* valid, "
    "const int* slots, const int* positions, const int* table, const int* request_ids, const int* owners, "
    "u8* fp8, float* scale, __nv_bfloat16* rope, u8* idx_q, u8* idx_sf, int* written, u8* marks, "
    "int* errors, "
    "i64 B, i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 m, "
    "i64 nope_dim, i64 rope_dim, i64 index_dim",
    (TParam("bool", "HAS_INDEX", (True, False)),))

STATE_APPEND = FILE.kernel(
    "rkv_kv_state_append",
    "const TKV* kv, const TZ* z, const float* ape, const bool* valid, const int* slots, "
    "float* a_kv, float* a_z, int* count, int* errors, i64 S, i64 m, i64 w",
    (TParam("typename", "TKV", _ROWS_IN), TParam("typename", "TZ", _ROWS_IN)))

STATE_RESET = FILE.kernel(
    "rkv_kv_state_reset",
    "const bool* valid, const int* slots, float* a_kv, float* a_z, float* b_kv, float* b_z, "
    "int* count, int* errors, i64 S, i64 m, i64 d, i64 w",
    (TParam("int", "MODE", (RESET_HCA, RESET_CSA, RESET_CLEAR)),))

# DENSE gathers take their entry ids from the row index: int ids only.
GATHER = FILE.kernel(
    "rkv_kv_gather",
    "const u8* fp8, const float* scale, const __nv_bfloat16* rope, const int* table, "
    "const int* request_ids, const int* owners, const int* slots, const TID* ids, const int* n_entries, "
    "const bool* valid, "
    "const int* written, const u8* marks, TO* out, int* errors, i64 B, i64 K, i64 slot0, i64 n0, "
    "i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 nope_dim, i64 rope_dim",
    (_TO, TParam("typename", "TID", _IDS), TParam("bool", "DENSE", (False, True))),
    instances=[(o, i, False) for o in _TO.values for i in _IDS] + [(o, "int32", True) for o in _TO.values])

GATHER_INDEX = FILE.kernel(
    "rkv_kv_gather_index",
    "const u8* idx_q, const u8* idx_sf, const int* table, const int* request_ids, const int* owners, "
    "const int* slots, const int* n_entries, "
    "const bool* valid, const int* written, const u8* marks, TO* out, int* errors, i64 B, i64 K, "
    "i64 slot0, i64 n0, "
    "i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 index_dim",
    (_TO,))

# The pool's "model1" layout (MODEL1 pages, DeepGEMM key pages).
_MXFP4 = TParam("bool", "MXFP4", (False, True))
FLUSH_PAGES = FILE.kernel(
    "rkv_kv_flush_pages",
    "const __nv_bfloat16* entries, const __nv_bfloat16* index_keys, const bool* valid, "
    "const int* slots, const int* positions, const int* table, const int* request_ids, const int* owners, "
    "u8* pages, u8* index_pages, "
    "int* written, u8* marks, int* errors, i64 B, i64 num_requests, i64 max_blocks, i64 num_blocks, "
    "i64 epb, i64 m, i64 page_bytes, i64 index_page_bytes",
    (TParam("bool", "HAS_INDEX", (True, False)), _MXFP4),
    instances=[(False, False), (True, False), (True, True)])

GATHER_PAGES = FILE.kernel(
    "rkv_kv_gather_pages",
    "const u8* pages, const int* table, const int* request_ids, const int* owners, const int* slots, "
    "const TID* ids, const int* n_entries, "
    "const bool* valid, const int* written, const u8* marks, TO* out, int* errors, i64 B, i64 K, "
    "i64 slot0, i64 n0, i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 page_bytes",
    (_TO, TParam("typename", "TID", _IDS), TParam("bool", "DENSE", (False, True))),
    instances=[(o, i, False) for o in _TO.values for i in _IDS] + [(o, "int32", True) for o in _TO.values])

GATHER_INDEX_PAGES = FILE.kernel(
    "rkv_kv_gather_index_pages",
    "const u8* index_pages, const int* table, const int* request_ids, const int* owners, const int* slots, "
    "const int* n_entries, const bool* valid, "
    "const int* written, const u8* marks, TO* out, int* errors, i64 B, i64 K, i64 slot0, i64 n0, "
    "i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 index_page_bytes",
    (_TO, _MXFP4))

# The bridge on a pool (either layout): top-k ids -> pool rows.
TOPK_INDICES = FILE.kernel(
    "rkv_kv_topk_indices",
    "const int* table, const int* request_ids, const int* owners, const int* slots, const TID* ids, "
    "const int* n_entries, const bool* valid, "
    "const int* written, const u8* marks, int* out, int* errors, i64 B, i64 K, i64 num_requests, "
    "i64 max_blocks, i64 num_blocks, i64 epb",
    (TParam("typename", "TID", _IDS),))

# A block handed to a request (page ownership): owners[block] = request_ids[slot], marks cleared.
ASSIGN_PAGES = FILE.kernel(
    "rkv_kv_assign_pages",
    "const int* slots, const int* blocks, const int* request_ids, int* owners, u8* marks, int* errors, "
    "i64 B, i64 num_requests, i64 num_blocks, i64 epb")
