"""rawkv/cu/kv_compress.cu: the DeepSeek-V4 KV compressor, one launch from
token rows (prefill) or the decode tail state (decode) to quantized entries
in the paged pool. Launched by rawkv.kvcache (prefill.py, decode.py)."""
from ._decl import KernelFile, TParam
from .kv_layouts import KEYS, LAYOUT_CONSTANTS

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
# records; the CSA indexer key as DeepGEMM's FP8, MXFP4 or MXFP8 key: LAYOUT
# is 1 + the key kernels' KEY, kv_layouts.KEYS).
LAYOUTS = {("rawkv", None): 0, ("rawkv", "nvfp4"): 0, ("model1", None): 1,
           **{("model1", name.removeprefix("index_")): 1 + k for name, k in KEYS.items()}}


def targs(kind: str, rows_dtype, decode: bool, index_dtype="int32", layout: int = 0) -> tuple:
    """Template arguments (T, I, DECODE, OVERLAP, RG, LAYOUT) of a launch on
    a pool of `kind` (layout: a LAYOUTS value)."""
    return (rows_dtype, index_dtype, decode, kind == "csa", ROW_GROUPS[kind], layout)


# Its parameters (kv_compress.cu): part 0 (the attention entry) and part 1
# (the CSA indexer key), the RoPE table and pool geometry, the decode batch
# rows or the prefill slot / entries, and the "model1" layout's pages.
COMPRESS = FILE.kernel(
    "rkv_kv_compress",
    (TParam("typename", "T", _ROWS), TParam("typename", "I", _IDX), TParam("bool", "DECODE", (False, True)),
     TParam("bool", "OVERLAP", (True, False)), TParam("int", "RG", tuple(sorted(set(ROW_GROUPS.values())))),
     TParam("int", "LAYOUT", (0, 1, 2, 3))),
    # MXFP4 and MXFP8 keys (LAYOUT 2, 3) exist for CSA only
    instances=[targs(k, t, False, layout=lay) for lay in (0, 1, 2, 3) for t in _ROWS for k in ROW_GROUPS
               if lay < 2 or k == "csa"]
    + [targs(k, "float32", True, i, lay) for lay in (0, 1, 2, 3) for i in _IDX for k in ROW_GROUPS
       if lay < 2 or k == "csa"])
