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

from .. import _dispatch as D
from .. import _plan
from .._opdecl import OpDecl
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import checks as C
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
    C.check_pool(pool)
    if D.compiling():
        import torch
        if out is None:
            out = torch.empty(tuple(topk_ids.shape), dtype=torch.int32, device=pool.device)
        V.call(KVCACHE_INDICES_OP, **V.pool_args(pool, errors), slots=slots, topk_ids=topk_ids,
               n_entries=n_entries, valid_mask=valid_mask, out=out)
        return out
    dev = pool.device_index
    ids, s, ne, v = C.topk_args(slots, topk_ids, n_entries, valid_mask, dev)
    B, Kk = ids.shape
    if out is not None:
        out_arr = C.arg(out, "out", C.I32, dev, shape=(B, Kk))
    err = C.errors_arg(errors, pool.errors, dev)
    C.check_outputs((("out", out), ("errors", C.counter(errors, pool))),
                    (("slots", s), ("topk_ids", ids), ("n_entries", ne), ("valid_mask", v)), C.owned(pool, "pool"))
    C.check_launch_rows("topk_ids", B * Kk)
    if dev is None:
        res, n = ref.paged_kvcache_indices(pool.reference_view(), s, ids, ne, v)
        C.add_errors(err, n)
        return D.from_numpy(res, topk_ids, out=out)
    rt = get_runtime(dev)
    if out is None:
        out_arr = rt.empty((B, Kk), C.torch_dtype("int32"), stream=stream)
    _plan.run(rt, P.kvcache_indices(rt, pool, ids, s, ne, v, out_arr, err), stream)
    return out_arr


def _kvcache_indices_op(slots, topk_ids, n_entries, valid_mask, out, **pool):
    kvcache_indices(V.pool_view(**pool), slots, topk_ids, n_entries=n_entries, valid_mask=valid_mask, out=out)


KVCACHE_INDICES_OP = OpDecl("kv_kvcache_indices", _kvcache_indices_op, V.schema(
    V.pool_schema(False), "Tensor slots, Tensor topk_ids, Tensor? n_entries, Tensor? valid_mask, Tensor(!) out"))
