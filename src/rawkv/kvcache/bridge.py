"""kvcache_indices: the bridge from a request's top-k compressed-entry ids to
the entries' rows in the pool (rkv_kv_topk_indices); for a "model1" pool,
FlashMLA's indices_in_kvcache into pool.pages, so an engine hands the pool's
pages to FlashMLA's sparse decode without a gather to BF16.

Unlike layouts.topk_to_kvcache_indices (a bare block table), the pool knows
what each request wrote: an index points only at an entry the request wrote
since its block was allocated (written[] and marks, docs/kvcache.md "Stale
entries"); anything else is -1 and counted.
"""
from __future__ import annotations

from .. import _args as A
from .._op import empty, op
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
from . import plans as P
from . import views as V


def kvcache_indices(pool, slots, topk_ids, *, n_entries=None, valid_mask=None, out=None, errors=None,
                    stream=None):
    """out[b, j] = the pool row of entry topk_ids[b, j] of the request in
    slots[b]: block_table[slot, e // epb] * epb + e % epb, int32 (for a
    "model1" pool: FlashMLA's indices_in_kvcache into pool.pages, with
    page_block_size = pool.entries_per_block).

    slots (B,) int32; topk_ids (B, K) int32 or int64; n_entries (B,) int32
    or None (a tighter bound); valid_mask (B,) bool or None (False: a row of
    -1, not counted); out (B, K) int32. Rules of gather_topk
    (reference.paged_kvcache_indices): -1 stays -1, not counted; any other
    negative id, an id >= n_entries, an id >= pool.written[slot], an id past
    the block table or on a bad block, or an entry not marked written since
    its block was allocated -> -1 and errors += 1. One launch, capturable
    with out=."""
    C.pool(pool)
    if out is None:
        out = empty(topk_ids, A.out_lead(topk_ids, "topk_ids"), "int32", stream)
    _kvcache_indices(*V.pool_operands(pool, errors), slots, topk_ids, n_entries, valid_mask, out,
                     stream=stream, pool=pool)
    return out


@op("kv_kvcache_indices", V.schema(V.pool_schema(False), "Tensor slots, Tensor topk_ids, Tensor? n_entries, "
                                                        "Tensor? valid_mask, Tensor(!) out"))
def _kvcache_indices(*args, stream=None, pool=None, checks_only=False):
    """rawkv::kv_kvcache_indices: the pool's buffers (V.pool_of), then the
    top-k arguments; the rows into out (`checks_only`: the checks alone,
    rawkv.kvcache.traced)."""
    pool, errors, (slots, topk_ids, n_entries, valid_mask, out) = V.pool_of(args, pool)
    where, ids, s, ne, v, out, _, err = C.topk(pool, errors, slots, topk_ids, n_entries, valid_mask, out,
                                               rows=False)
    if checks_only:
        return
    if where == "cpu":
        res, n = ref.paged_kvcache_indices(pool.reference_view(), *A.host(s, ids, ne, v))
        C.add_errors(err, n)
        A.from_numpy(res, out, out=out)
        return
    rt = get_runtime(pool.device_index)
    rt.run(P.kvcache_indices(rt, pool, ids, s, ne, v, out, err), stream)
