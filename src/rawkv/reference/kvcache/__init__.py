"""DeepSeek-V4 compressed KV cache (CSA and HCA): the numpy reference.

This package *defines* what the compressed-KV kernels compute (docs/format.md
and docs/kvcache.md; the latter gives the public sources the equations were
checked against and every decision taken where the sources are silent).

Pipeline of one compressed entry (one layer, one request):

    kv_t, z_t  (per token, width coff*d)            caller's GEMMs
      -> softmax pooling over the window             compress_csa / compress_hca   (.pooling)
         (decode: tail state, state_pool)                                          (.state)
      -> RMSNorm(weight, eps=1e-6)                   rmsnorm                       (.finish)
      -> RoPE on the last 64 dims at position i*m    apply_rope
      -> (indexer key only) Hadamard rotation        hadamard_rotate
      -> BF16                                        finish_entry / finish_index_key
      -> quantize                                    fp8_entry_quantize,           (.quant)
                                                     indexer_key_quantize
      -> write into the paged pool                   flush_write                   (.pool)
      -> read back as BF16 rows                      gather_dense / gather_topk

The kernels address the pool by request slot; .paged defines that layer
(block-table bounds, the written[] high-water mark, error counts) and
.compressor the compressor end to end, with its flush rule.

Conventions: float arrays are float32; "BF16" arrays are float32 arrays that
hold exactly BF16-representable values (numpy has no bfloat16); codes and
scale bytes are uint8. Functions that take device-style indices (block
tables, slot ids, top-k ids) never read or write out of bounds: they skip the
row and return an error count, like the kernels' error counters.
"""
from .constants import (  # noqa: F401
    COMPRESS_ROPE_THETA, CSA_RATIO, DSV4_YARN, FP8_MAX, HCA_RATIO, HEAD_DIM, INDEX_HEAD_DIM,
    NOPE_DIM, NVFP4_BLOCK, RMS_EPS, ROPE_DIM, Z_EMPTY, YarnConfig,
)
from .pooling import compress_csa, compress_hca  # noqa: F401
from .finish import (  # noqa: F401
    apply_rope, check_rope, entry_position, finish_entry, finish_index_key, hadamard_matrix,
    hadamard_rotate, rmsnorm, rope_cos_sin, rope_inv_freq,
)
from .quant import (  # noqa: F401
    fp8_entry_dequantize, fp8_entry_quantize, indexer_key_dequantize, indexer_key_quantize,
)
from .pool import (  # noqa: F401
    INDEX_LAYOUTS, INDEX_LAYOUTS_OF, PagedPoolRef, check_model1_geometry, flush_write, gather_dense,
    gather_index_keys, gather_topk, index_layout_of, reset_marks,
)
from .state import (  # noqa: F401
    DecodeStateRef, csa_rotate, hca_reset, state_append, state_clear, state_pool, state_seed,
)
from .paged import (  # noqa: F401
    assign_pages, paged_flush_write, paged_gather_dense, paged_gather_dense_batch, paged_gather_topk,
    paged_kvcache_indices, raise_written, request_ids_of, table_rows, written_of,
)
from .compressor import (  # noqa: F401
    paged_compress_decode, paged_compress_prefill, reference_prefill,
)
from .layouts import (  # noqa: F401,E402
    index_fp8_dequantize, index_fp8_gather, index_fp8_quantize, index_fp8_write, index_mxfp4_dequantize,
    index_mxfp4_gather, index_mxfp4_quantize, index_mxfp4_write, index_mxfp8_dequantize, index_mxfp8_gather,
    index_mxfp8_quantize, index_mxfp8_write, model1_dequantize, model1_gather,
    model1_quantize, model1_write, topk_to_kvcache_indices,
)
