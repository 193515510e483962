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

from .. import _dispatch as D
from .. import _plan
from .._opdecl import OpDecl
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import checks as C
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
    C.check_pool(pool)
    if D.compiling():
        return V.call(ASSIGN_PAGES_OP, **V.pool_args(pool, errors), slots=slots, blocks=blocks)
    dev = pool.device_index
    s = C.arg(slots, "slots", C.I32, dev, ndim=1)
    B = s.shape[0]
    b = C.arg(blocks, "blocks", C.I32, dev, shape=(B,))
    err = C.errors_arg(errors, pool.errors, dev)
    C.check_outputs((("errors", C.counter(errors, pool)),), (("slots", s), ("blocks", b)), C.owned(pool, "pool"))
    C.check_launch_rows("blocks", B)
    if dev is None:
        C.add_errors(err, ref.assign_pages(pool.reference_view(), s, b))
        return
    if B:
        rt = get_runtime(dev)
        _plan.run(rt, P.assign_pages(rt, pool, s, b, err), stream)


def _assign_pages_op(slots, blocks, **pool):
    assign_pages(V.pool_view(**pool), slots, blocks)


ASSIGN_PAGES_OP = OpDecl("kv_assign_pages", _assign_pages_op, V.schema(
    V.pool_schema(False, owners=True), "Tensor slots, Tensor blocks"))
