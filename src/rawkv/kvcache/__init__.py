"""DeepSeek-V4 compressed KV cache (CSA / HCA): paged pool, decode state,
format kernels and the compressor (docs/kvcache.md).

    pool = PagedKVPool("csa", num_blocks, entries_per_block, max_requests, max_blocks_per_request)
    state = DecodeState("csa", max_requests)
    slot = pool.add_request(); pool.prepare_step([slot], [T - 1])
    compress_prefill(pool, kv, z, ape, w, slot, index=...)   # the prompt
    state_seed(state, slot, kv, z, ape=ape)                   # admission: the decode tail
    flush_write(pool, entries, valid_mask, slots, positions, index_keys=keys)
    csa_rotate(state, valid_mask, slots)
    rows = gather_topk(pool, slots, topk_ids, out=buf)

On a CUDA pool / state every op is one kernel launch (kernels declared in
rawkv.kernels.kv_cache and .kv_compress) on torch's current stream, with no
allocation when out= is given, no host synchronization and no host branch on
device data, so a decode step captures into one CUDA graph. On a CPU pool /
state (device="cpu") the ops run the numpy reference, rawkv.reference.kvcache,
which defines every result. Every argument is checked (rules in ._rules,
the same on CPU and CUDA) before anything is launched or written; the error
names the argument.
Device-side indices are bounds-checked: a bad row is skipped and counted in
`errors` (default: pool.errors for pool ops, state.errors for state ops).

Every op is written once as a rawkv:: custom operator on the pool's /
state's buffers (rawkv._op.op; torch.ops.rawkv.kv_*; views): an eager call
runs its body on the objects, torch.compile records the operator.

Modules: pool, state (the objects); flush, gather, state_ops (format ops);
prefill, decode, compressor (the compressor); bridge (top-k ids -> the
pool's FlashMLA indices); assign (page ownership: blocks handed to
requests); _rules (the argument rules); views (the operators' schemas and the
pool / state views they run on); traced (the memory rules of a call
torch.compile traces: checked on its real tensors, guarded); layouts (the
ecosystem layouts as standalone ops).

A pool stores its entries in one of two layouts (PagedKVPool(layout=)):
"model1" (the default), the pages FlashMLA / DeepGEMM read (MODEL1_FP8Sparse entries,
FP8, MXFP4 or MXFP8 indexer keys), or "rawkv", rawkv's own field-by-field layout
(an FP32 scale per entry, NVFP4 keys); every op above works on both.
"""
from .pool import PagedKVPool
from .state import DecodeState
from .flush import flush_write
from .gather import (
    gather_dense, gather_dense_batch, gather_index_keys, gather_index_keys_batch, gather_topk,
)
from .state_ops import csa_rotate, hca_reset, state_append, state_clear, state_seed
from .compressor import DecodeIndex, PrefillIndex, rope_table
from .prefill import compress_prefill
from .decode import compress_decode
from .bridge import kvcache_indices
from .assign import assign_pages
from ..reference.kvcache import reference_prefill
from .layouts import (  # noqa: F401  (ecosystem layouts: FlashMLA MODEL1, DeepGEMM indexer keys)
    deepgemm_view, flashmla_view, index_fp8_store, index_mxfp4_store, index_mxfp8_store, layout_page_bytes,
    model1_gather, model1_store, model1_window_insert, new_layout_cache, topk_to_kvcache_indices,
)

__all__ = ["PagedKVPool", "DecodeState", "flush_write", "gather_topk", "gather_dense",
           "gather_dense_batch", "gather_index_keys", "gather_index_keys_batch", "state_seed",
           "state_append", "csa_rotate", "hca_reset", "state_clear", "compress_prefill",
           "compress_decode", "rope_table", "PrefillIndex", "DecodeIndex", "reference_prefill",
           "kvcache_indices", "assign_pages"]
