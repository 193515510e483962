"""flush_write: finished entries -> the paged pool (rkv_kv_flush_write)."""
from __future__ import annotations

from .. import _args as A
from .._op import op
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
from . import plans as P
from . import views as V


def flush_write(pool, entries, valid_mask, slots, positions, *, index_keys=None, errors=None,
                stream=None):
    """Quantize finished entries and scatter them into the pool: one row per
    batch row, entry e = positions[b] // m of the request in slots[b], at
    block_table[slot, e // epb], row e % epb (reference.paged_flush_write).

    entries (B, head_dim) bfloat16 (RMSNormed + RoPEd); valid_mask (B,) bool
    (False: skipped silently); slots, positions (B,) int32; index_keys
    (B, index_head_dim) bfloat16, required exactly for a pool with indexer
    keys. Layout "rawkv": the non-RoPE dims become E4M3 with one FP32
    decode scale (docs/format.md; NaN/Inf -> scale NaN, codes 0), the RoPE
    dims are stored as BF16, the indexer key as one-level NVFP4. Layout
    "model1": a MODEL1_FP8Sparse record in pool.pages and the key as
    DeepGEMM's FP8 / MXFP4 / MXFP8 record in pool.index_pages (the rules of
    layouts.model1_store / index_*_store). pool.written[slot]
    becomes at least e + 1 and the entry is marked written (pool.marks). A
    valid row whose slot, position or block is out of range writes nothing
    and adds 1 to errors. Two valid rows aimed at one entry: the lowest
    writes it, the others write nothing and add 1 each. One launch."""
    C.pool(pool)
    _flush_write(*V.pool_operands(pool, errors), entries, valid_mask, slots, positions, index_keys,
                 stream=stream, pool=pool)


@op("kv_flush_write", V.schema(V.pool_schema(True), "Tensor entries, Tensor valid_mask, Tensor slots, "
                                                    "Tensor positions", "Tensor? index_keys"))
def _flush_write(*args, stream=None, pool=None, checks_only=False):
    """rawkv::kv_flush_write: the pool's buffers (V.pool_of; `pool`: the
    object of an eager call), then the entries and their addresses.
    `checks_only`: the checks alone (rawkv.kvcache.traced: a traced call's
    real tensors, which the operator's fake implementation checks)."""
    pool, errors, (entries, valid_mask, slots, positions, index_keys) = V.pool_of(args, pool)
    where, e, v, s, p, k, err = C.flush_write(pool, errors, entries, valid_mask, slots, positions, index_keys)
    if checks_only:
        return
    if where == "cpu":
        C.add_errors(err, ref.paged_flush_write(pool.reference_view(), *A.host(e, v, s, p, k)))
        return
    if e.shape[0]:
        get_runtime(pool.device_index).run(P.flush_write(pool, e, k, v, s, p, err), stream)
