"""assign_pages: hand pool blocks to requests (page ownership,
rkv_kv_assign_pages; docs/kvcache.md, "Page ownership").

Every writer and reader uses a block of a slot's block-table row only when
the block is assigned to the slot's request (pool.owners[block] ==
pool.request_ids[slot]); anything else is skipped and counted. Blocks get
their owner here: PagedKVPool.prepare_step does it for the blocks it
allocates, and an engine that writes block-table rows itself (in place into
pool.block_table, or its own table passed to torch.ops.rawkv.kv_*) calls
this op for every block it hands to a request.
"""
from __future__ import annotations

from .. import _args as A
from .._op import op
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
from . import plans as P
from . import views as V


def assign_pages(pool, slots, blocks, *, errors=None, stream=None):
    """Block blocks[i] now belongs to the request in slots[i]:
    pool.owners[block] = pool.request_ids[slot], and the block's marks are
    cleared (none of its entries is written by the new owner yet, so the
    previous owner's bytes are never read). Call it after the block is in
    the request's block-table row (or in the same step, before the
    request's first write to it) (reference.assign_pages).

    slots, blocks (B,) int32 on the pool's device. blocks[i] == -1 is
    padding (nothing, not counted). A block outside [0, num_blocks), a slot
    out of range or holding no request (request_ids[slot] <= 0), or a block
    a lower row assigns (the lowest row wins): nothing, and 1 added to
    errors (pool.errors by default). One launch, no allocation, no host
    synchronization: capturable."""
    C.pool(pool)
    _assign_pages(*V.pool_operands(pool, errors), slots, blocks, stream=stream, pool=pool)


@op("kv_assign_pages", V.schema(V.pool_schema(False, owners=True), "Tensor slots, Tensor blocks"))
def _assign_pages(*args, stream=None, pool=None, checks_only=False):
    """rawkv::kv_assign_pages: the pool's buffers (V.pool_of), then slots
    and blocks (`checks_only`: the checks alone, rawkv.kvcache.traced)."""
    pool, errors, (slots, blocks) = V.pool_of(args, pool)
    where, s, b, err = C.assign_pages(pool, errors, slots, blocks)
    if checks_only:
        return
    if where == "cpu":
        C.add_errors(err, ref.assign_pages(pool.reference_view(), *A.host(s, b)))
        return
    if s.shape[0]:
        rt = get_runtime(pool.device_index)
        rt.run(P.assign_pages(rt, pool, s, b, err), stream)
