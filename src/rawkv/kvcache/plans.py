"""The launch plans of the paged-pool ops: pure functions from the checked
arguments, the pool's (or decode state's) sizes and the device properties
(`dev`: a rawkv._plan.Device, or the Runtime) to the list of launches
(rawkv._plan.Launch). The ops check, plan and `rt.run`; the tests read the
plans as data (tests/kvcache/test_plans.py). An empty list: nothing to do.

Kernels: rawkv.kernels.kv_cache (flush, gathers, bridge, state ops, page
assignment) and rawkv.kernels.kv_compress (the compressor).
"""
from __future__ import annotations

from .._plan import Launch, grid_stride
from ..kernels import kv_cache as K
from ..kernels import kv_compress as KC
from .compressor import index_part, layout_targ, part, pool_args


def _warp_rows(dev, rows: int) -> tuple[tuple[int], tuple[int]]:
    """Grid and block of a kernel running one warp per row, grid-stride."""
    grid, block = grid_stride(dev, rows * 32, K.BLOCK)
    return (grid,), (block,)


def _table(pool) -> dict:
    """The block table and ownership arguments every pool kernel takes."""
    return dict(request_ids=pool.request_ids, owners=pool.owners, written=pool.written, marks=pool.marks,
                num_requests=pool.max_requests, max_blocks=pool.max_blocks_per_request,
                num_blocks=pool.num_blocks, epb=pool.entries_per_block)


def assign_pages(dev, pool, slots, blocks, errors) -> list[Launch]:
    """Blocks handed to the requests in `slots` (B,): one warp per row."""
    B = slots.shape[0]
    if B == 0:
        return []
    grid, block = _warp_rows(dev, B)
    return [Launch(K.ASSIGN_PAGES.instance(), grid, block, dict(
        slots=slots, blocks=blocks, request_ids=pool.request_ids, owners=pool.owners, marks=pool.marks,
        errors=errors, B=B, num_requests=pool.max_requests, num_blocks=pool.num_blocks,
        epb=pool.entries_per_block))]


def flush_write(pool, entries, index_keys, valid, slots, positions, errors) -> list[Launch]:
    """B entries (and indexer keys) into the pool: one warp per row,
    K.FLUSH_ROWS rows per CTA; the "model1" layout writes its pages."""
    B = entries.shape[0]
    if B == 0:
        return []
    grid, block = (-(-B // K.FLUSH_ROWS),), (32 * K.FLUSH_ROWS,)
    rows = dict(entries=entries, index_keys=index_keys, valid=valid, slots=slots, positions=positions,
                table=pool.block_table, errors=errors, B=B, m=pool.m, **_table(pool))
    if pool.layout == "model1":
        return [Launch(K.FLUSH_PAGES.instance(pool.has_index, K.pool_key(pool.index_layout)), grid, block, dict(
            rows, pages=pool.pages, index_pages=pool.index_pages, page_bytes=pool.page_bytes,
            index_page_bytes=pool.index_page_bytes or 0))]
    return [Launch(K.FLUSH_WRITE.instance(pool.has_index), grid, block, dict(
        rows, fp8=pool.fp8, scale=pool.scale, rope=pool.rope, idx_q=pool.index_q, idx_sf=pool.index_sf,
        nope_dim=pool.nope_dim, rope_dim=pool.rope_dim, index_dim=pool.index_head_dim or 0))]


def gather(dev, pool, ids, slots, n_entries, valid, out, errors, B, Kk, slot0=0, n0=-1) -> list[Launch]:
    """Entries back to rows out (B, Kk, head_dim), one warp per row: by
    top-k ids (`ids` (B, Kk)), or dense (`ids` None: entries 0.. of the rows
    of `slots`, or of slot0 / n0 entries when slots is None)."""
    if B * Kk == 0:
        return []
    grid, block = _warp_rows(dev, B * Kk)
    dense = ids is None
    tid = "int32" if dense else ids.dtype
    common = dict(table=pool.block_table, slots=slots, ids=ids, n_entries=n_entries, valid=valid, out=out,
                  errors=errors, B=B, K=Kk, slot0=slot0, n0=n0, **_table(pool))
    if pool.layout == "model1":
        return [Launch(K.GATHER_PAGES.instance(out.dtype, tid, dense), grid, block,
                       dict(common, pages=pool.pages, page_bytes=pool.page_bytes))]
    return [Launch(K.GATHER.instance(out.dtype, tid, dense), grid, block, dict(
        common, fp8=pool.fp8, scale=pool.scale, rope=pool.rope, nope_dim=pool.nope_dim,
        rope_dim=pool.rope_dim))]


def gather_index(dev, pool, slots, n_entries, valid, out, errors, B, Kk, slot0=0, n0=-1) -> list[Launch]:
    """Dense CSA indexer keys back to rows out (B, Kk, index_head_dim): one
    warp per row of "model1" key pages, else one thread per 16 dims."""
    if B * Kk == 0:
        return []
    common = dict(table=pool.block_table, slots=slots, n_entries=n_entries, valid=valid, out=out,
                  errors=errors, B=B, K=Kk, slot0=slot0, n0=n0, **_table(pool))
    if pool.layout == "model1":
        grid, block = _warp_rows(dev, B * Kk)
        return [Launch(K.GATHER_INDEX_PAGES.instance(out.dtype, K.pool_key(pool.index_layout)), grid, block,
                       dict(common, index_pages=pool.index_pages, index_page_bytes=pool.index_page_bytes))]
    grid, block = grid_stride(dev, B * Kk * (pool.index_head_dim // 16), K.BLOCK)
    return [Launch(K.GATHER_INDEX.instance(out.dtype), (grid,), (block,), dict(
        common, idx_q=pool.index_q, idx_sf=pool.index_sf, index_dim=pool.index_head_dim))]


def kvcache_indices(dev, pool, ids, slots, n_entries, valid, out, errors) -> list[Launch]:
    """Top-k ids (B, Kk) -> pool rows out (B, Kk): one thread per id."""
    B, Kk = ids.shape
    if B * Kk == 0:
        return []
    grid, block = grid_stride(dev, B * Kk, K.BLOCK)
    return [Launch(K.TOPK_INDICES.instance(ids.dtype), (grid,), (block,), dict(
        table=pool.block_table, slots=slots, ids=ids, n_entries=n_entries, valid=valid, out=out,
        errors=errors, B=B, K=Kk, **_table(pool)))]


def state_block(w: int) -> int:
    """Threads of a state kernel's CTA: one float4 of `w` floats each, at most K.BLOCK."""
    return max(32, min(K.BLOCK, -(-(w // 4) // 32) * 32))


def state_append(state, kv, z, ape, valid, slots, errors) -> list[Launch]:
    """B rows appended to the decode state: one CTA per row."""
    B = kv.shape[0]
    if B == 0:
        return []
    return [Launch(K.STATE_APPEND.instance(kv.dtype, z.dtype), (B,), (state_block(state.width),), dict(
        kv=kv, z=z, ape=ape, valid=valid, slots=slots, a_kv=state.kv_a, a_z=state.z_a, count=state.count,
        errors=errors, S=state.max_requests, m=state.m, w=state.width))]


def state_reset(state, mode, valid, slots, errors) -> list[Launch]:
    """The decode state of the rows of `slots` reset (K.RESET_*): one CTA per row."""
    B = slots.shape[0]
    if B == 0:
        return []
    return [Launch(K.STATE_RESET.instance(mode), (B,), (state_block(state.m * state.width),), dict(
        valid=valid, slots=slots, a_kv=state.kv_a, a_z=state.z_a, b_kv=state.kv_b, b_z=state.z_b,
        count=state.count, errors=errors, S=state.max_requests, m=state.m, d=state.head_dim,
        w=state.width))]


def _compress_geometry(pool, rows: int, has_index: bool) -> tuple[tuple, tuple]:
    """A compressor CTA per entry (prefill) or batch row (decode) and part
    (the entry; the indexer key when has_index)."""
    return (rows, 2 if has_index else 1), (KC.CHANNEL_THREADS * KC.ROW_GROUPS[pool.kind],)


def prefill_entries(pool, tokens: int, start_entry: int) -> tuple[int, int]:
    """(entries, pre) of a prefill of `tokens` rows from entry `start_entry`:
    a CSA pool past entry 0 reads one window of context before the first
    entry (pre = 1), which makes no entry."""
    pre = 1 if (pool.kind == "csa" and start_entry > 0) else 0
    return tokens // pool.m - pre, pre


def compress_prefill(pool, kv, z, ape, norm_weight, index, slot, start_entry, tab, eps) -> list[Launch]:
    """Prefill: the T = kv.shape[0] token rows of the request in `slot`
    (host int), its first entry `start_entry`, into n entries (n <= 0:
    nothing). `index`: the checked PrefillIndex or None."""
    n, pre = prefill_entries(pool, kv.shape[0], start_entry)
    if n <= 0:
        return []
    part1 = index_part() if index is None else index_part(index.kv, index.z, None, None, index.ape,
                                                          index.norm_weight)
    return [Launch(KC.COMPRESS.instance(*KC.targs(pool.kind, kv.dtype, False, layout=layout_targ(pool))),
                   *_compress_geometry(pool, n, index is not None), dict(
        pool_args(pool, tab, pool.errors, eps), p0=part(pool.head_dim, kv, z, ape=ape, w=norm_weight), p1=part1,
        valid=None, slots=None, positions=None, n_slots=0, slot=slot, start_entry=start_entry, pre=pre))]


def compress_decode(pool, state, norm_weight, index_state, index_weight, valid, slots, positions, tab,
                    eps) -> list[Launch]:
    """Decode: the B batch rows' tails in `state` (and `index_state`, the
    indexer's, or None) into entries where a window completes."""
    B = valid.shape[0]
    if B == 0:
        return []
    ist = index_state
    part1 = index_part() if ist is None else index_part(ist.kv_a, ist.z_a, ist.kv_b, ist.z_b, None,
                                                        index_weight, ist.count)
    return [Launch(KC.COMPRESS.instance(*KC.targs(pool.kind, "float32", True, slots.dtype, layout_targ(pool))),
                   *_compress_geometry(pool, B, ist is not None), dict(
        pool_args(pool, tab, pool.errors, eps),
        p0=part(pool.head_dim, state.kv_a, state.z_a, state.kv_b, state.z_b, w=norm_weight, count=state.count),
        p1=part1, valid=valid, slots=slots, positions=positions, n_slots=state.max_requests, slot=0,
        start_entry=0, pre=0))]
