"""rawkv/cu/kv_cache.cu: the format kernels of the DeepSeek-V4 compressed KV
cache (flush into the paged pool, gathers out of it, decode-state append and
reset). Launched by rawkv.kvcache (flush.py, gather.py, state_ops.py)."""
from ._decl import KernelFile, TParam
from .kv_layouts import KEY, KEY_FP8, KEYS, LAYOUT_CONSTANTS

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

FLUSH_WRITE = FILE.kernel("rkv_kv_flush_write", (TParam("bool", "HAS_INDEX", (True, False)),))

STATE_APPEND = FILE.kernel(
    "rkv_kv_state_append",
    (TParam("typename", "TKV", _ROWS_IN), TParam("typename", "TZ", _ROWS_IN)))

STATE_RESET = FILE.kernel("rkv_kv_state_reset", (TParam("int", "MODE", (RESET_HCA, RESET_CSA, RESET_CLEAR)),))

# DENSE gathers take their entry ids from the row index: int ids only.
GATHER = FILE.kernel(
    "rkv_kv_gather",
    (_TO, TParam("typename", "TID", _IDS), TParam("bool", "DENSE", (False, True))),
    instances=[(o, i, False) for o in _TO.values for i in _IDS] + [(o, "int32", True) for o in _TO.values])

GATHER_INDEX = FILE.kernel("rkv_kv_gather_index", (_TO,))

# The pool's "model1" layout (MODEL1 pages, DeepGEMM key pages of template
# KEY: kv_layouts.KEYS, a pool's by its index_layout in pool_key).
FLUSH_PAGES = FILE.kernel(
    "rkv_kv_flush_pages",
    (TParam("bool", "HAS_INDEX", (True, False)), KEY),
    instances=[(False, KEY_FP8)] + [(True, k) for k in KEY.values])

GATHER_PAGES = FILE.kernel(
    "rkv_kv_gather_pages",
    (_TO, TParam("typename", "TID", _IDS), TParam("bool", "DENSE", (False, True))),
    instances=[(o, i, False) for o in _TO.values for i in _IDS] + [(o, "int32", True) for o in _TO.values])

GATHER_INDEX_PAGES = FILE.kernel("rkv_kv_gather_index_pages", (_TO, KEY))


def pool_key(index_layout) -> int:
    """Template KEY of a "model1" pool's key kernels from its index_layout
    ('fp8', 'mxfp4', 'mxfp8'); a pool without keys (None) instantiates the
    FP8 one, which writes no key."""
    return KEY_FP8 if index_layout is None else KEYS["index_" + index_layout]

# The bridge on a pool (either layout): top-k ids -> pool rows.
TOPK_INDICES = FILE.kernel("rkv_kv_topk_indices", (TParam("typename", "TID", _IDS),))

# A block handed to a request (page ownership): owners[block] = request_ids[slot], marks cleared.
ASSIGN_PAGES = FILE.kernel("rkv_kv_assign_pages")
