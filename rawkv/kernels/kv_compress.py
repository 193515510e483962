"""rawkv/cu/kv_compress.cu: the DeepSeek-V4 KV compressor, one launch from
token rows (prefill) or the decode tail state (decode) to quantized entries
in the paged pool. Launched by rawkv.kvcache (prefill.py, decode.py)."""
from ._decl import KernelFile, TParam
from .kv_layouts import LAYOUT_CONSTANTS

# Channel threads per row group; the CSA indexer part runs one channel per
# thread, so the indexer key width is this too.
CHANNEL_THREADS = 128
# Channels per thread: head_dim <= CHANNEL_THREADS * MAX_CHANNELS_PER_THREAD.
MAX_CHANNELS_PER_THREAD = 4
# Rows a thread holds in registers per pass: CSA pools its 2m rows in one.
CHUNK_ROWS = 8

MAX_HEAD_DIM = CHANNEL_THREADS * MAX_CHANNELS_PER_THREAD
INDEX_HEAD_DIM = CHANNEL_THREADS
# Row groups per CTA (template RG; block = CHANNEL_THREADS * RG): CSA holds
# its rows in registers (one group), HCA splits its m rows over four.
ROW_GROUPS = {"csa": 1, "hca": 4}

FILE = KernelFile("kv_compress.cu", constants={
    "RKV_KVC_CHANNEL_THREADS": CHANNEL_THREADS, "RKV_KVC_MAX_CPT": MAX_CHANNELS_PER_THREAD,
    "RKV_KVC_CHUNK": CHUNK_ROWS,
    **LAYOUT_CONSTANTS,          # the pool's "model1" layout uses kv_layouts.cuh
})

_ROWS = ("float32", "bfloat16")     # prefill token rows; decode reads the float32 state
_IDX = ("int32", "int64")           # decode slots / positions


# Template LAYOUT: what the launch writes. The pool's "rawkv" layout (FP8
# entry with an FP32 scale, NVFP4 key), or its "model1" layout (MODEL1
# records; the CSA indexer key as DeepGEMM's FP8 or MXFP4 key).
LAYOUTS = {("rawkv", None): 0, ("rawkv", "nvfp4"): 0, ("model1", None): 1, ("model1", "fp8"): 1,
           ("model1", "mxfp4"): 2}


def targs(kind: str, rows_dtype, decode: bool, index_dtype="int32", layout: int = 0) -> tuple:
    """Template arguments (T, I, DECODE, OVERLAP, RG, LAYOUT) of a launch on
    a pool of `kind` (layout: a LAYOUTS value)."""
    return (rows_dtype, index_dtype, decode, kind == "csa", ROW_GROUPS[kind], layout)


COMPRESS = FILE.kernel(
    "rkv_kv_compress",
    # part 0: attention entry
    "const T* kv0, const T* z0, const T* kvb0, const T* zb0, const float* ape0, const float* w0, "
    "const int* count0, u8* out_fp8, float* out_scale, __nv_bfloat16* out_rope, long long d0, "
    # part 1: CSA indexer key
    "const T* kv1, const T* z1, const T* kvb1, const T* zb1, const float* ape1, const float* w1, "
    "const int* count1, u8* out_iq, u8* out_isf, long long d1, "
    # RoPE table, pool geometry
    "const float* rope_tab, long long n_tab, long long rope_dim, const int* block_table, "
    "const int* request_ids, const int* owners, long long bt_rows, long long bt_stride, long long num_blocks, "
    "long long epb, long long m, "
    "int* written, u8* marks, "
    # decode batch rows; prefill slot / entries
    "const u8* valid, const I* slots, const I* positions, long long n_slots, "
    "long long slot, long long start_entry, long long pre, int* errors, double eps, "
    # the "model1" layout's pages
    "u8* out_pages, u8* out_index_pages, long long page_bytes, long long index_page_bytes",
    (TParam("typename", "T", _ROWS), TParam("typename", "I", _IDX), TParam("bool", "DECODE", (False, True)),
     TParam("bool", "OVERLAP", (True, False)), TParam("int", "RG", tuple(sorted(set(ROW_GROUPS.values())))),
     TParam("int", "LAYOUT", (0, 1, 2))),
    # MXFP4 keys (LAYOUT 2) exist for CSA only
    instances=[targs(k, t, False, layout=lay) for lay in (0, 1, 2) for t in _ROWS for k in ROW_GROUPS
               if lay < 2 or k == "csa"]
    + [targs(k, "float32", True, i, lay) for lay in (0, 1, 2) for i in _IDX for k in ROW_GROUPS
       if lay < 2 or k == "csa"])
