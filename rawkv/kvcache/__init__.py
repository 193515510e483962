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

Kernels: rawkv/cu/kv_cache.cu (format ops, declared in .ops) and
rawkv/cu/kv_compress.cu (compressor, .compress). The numpy reference is
rawkv.reference.kvcache.
"""
from .pool import PagedKVPool  # noqa: F401
from .state import DecodeState  # noqa: F401
from .ops import (  # noqa: F401
    csa_rotate, flush_write, gather_dense, gather_dense_batch, gather_index_keys,
    gather_index_keys_batch, gather_topk, hca_reset, state_append, state_clear, state_seed,
)
from . import ops as _ops
from .compress import *  # noqa: F401,F403
from . import compress as _compress

__all__ = ["PagedKVPool", "DecodeState", *_ops.__all__, *getattr(_compress, "__all__", [])]
