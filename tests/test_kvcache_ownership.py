"""Page ownership (issue 21, item 3): no request reads another's entries on
any path an engine takes, including torch.ops.rawkv.kv_* with a block
table the engine writes itself (docs/kvcache.md, "Page ownership").

Each case runs on a CPU pool (the reference) and, with the `cuda` fixture,
on a CUDA pool, where it must give the same bytes and the same counts.
"""
from __future__ import annotations

import numpy as np
import pytest

from rawkv.reference import kvcache as ref

torch = pytest.importorskip("torch")
import rawkv.kvcache as kc  # noqa: E402
import rawkv.library  # noqa: E402,F401
from rawkv.kvcache import views as V  # noqa: E402

D, DI = ref.HEAD_DIM, ref.INDEX_HEAD_DIM
OPS = torch.ops.rawkv


def _t(a, device):
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _flush_op(pool, slot, entries, device, rng):
    """kv_flush_write of entries `entries` of the request in `slot`, one row
    each, random BF16 rows."""
    n = len(entries)
    ents = _t(rng.standard_normal((n, D)).astype(np.float32), device).bfloat16()
    keys = _t(rng.standard_normal((n, DI)).astype(np.float32), device).bfloat16() if pool.has_index else None
    OPS.kv_flush_write(**V.pool_args(pool), entries=ents, valid_mask=_t(np.ones(n, bool), device),
                       slots=_t(np.full(n, slot, np.int32), device),
                       positions=_t(np.asarray(entries, np.int32) * pool.m, device), index_keys=keys)


def _gather_op(pool, slot, n, device):
    out = torch.empty((1, n, D), dtype=torch.float32, device=device)
    OPS.kv_gather_topk(**V.pool_args(pool), slots=_t(np.array([slot], np.int32), device),
                       topk_ids=_t(np.arange(n, dtype=np.int32)[None], device), n_entries=None,
                       valid_mask=None, out=out)
    return out[0].cpu().numpy()


def _engine_hands_a_freed_page(device, rng, layout):
    """The issue's case: request A writes entries 0..3 of its page; A is
    freed; the engine hands A's page to request B by writing B's block-table
    row in place (no prepare_step) and B writes entry 3. Gathering B's
    entries 0..3 must not return A's entries 0..2."""
    pool = kc.PagedKVPool("csa", 4, 4, 2, 2, layout=layout, device=device)
    a = pool.add_request()
    pool.prepare_step([a], [4 * pool.m - 1])
    _flush_op(pool, a, [0, 1, 2, 3], device, rng)
    assert pool.read_errors() == 0
    assert np.abs(_gather_op(pool, a, 4, device)).sum(axis=-1).all()
    page = pool.blocks_of(a)[0]
    pool.free_request(a)
    pool.add_request()                                  # a request in the freed slot
    b = pool.add_request()
    assert b != a
    pool.block_table[b, 0] = page                      # the engine's in-place hand-out
    _flush_op(pool, b, [3], device, rng)
    pool.reset_errors()
    rows = _gather_op(pool, b, 3, device)
    assert not rows.any(), "B read A's entries"
    assert pool.read_errors() == 3


@pytest.mark.xfail(strict=True, reason="issue 21 item 3: marks are cleared only by prepare_step")
@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_cpu_operator_path_never_reads_a_previous_owners_entries(rng, layout):
    _engine_hands_a_freed_page("cpu", rng, layout)


def test_cpu_in_place_block_table_write_keeps_the_free_list():
    """The docs allow in-place writes to pool.block_table; on a CPU pool it
    was the host's own record of which blocks a slot holds, so free_request
    returned the wrong block to the free list and two requests got one
    block."""
    pool = kc.PagedKVPool("hca", 4, 2, 3, 2, layout="rawkv", device="cpu")
    a = pool.add_request()
    pool.prepare_step([a], [0])
    assert pool.blocks_of(a) == [0]
    pool.block_table[a, 0] = 1                          # an engine's write, in place
    pool.free_request(a)
    b, c = pool.add_request(), pool.add_request()
    pool.prepare_step([b, c], [0, 0])
    assert pool.blocks_of(b) != pool.blocks_of(c)
    assert sorted(pool.blocks_of(b) + pool.blocks_of(c)) == [0, 1]
    assert pool.free_blocks() == 2

