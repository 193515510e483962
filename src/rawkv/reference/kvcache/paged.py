"""The paged pool as the kernels address it: by request slot.

The kernels of rawkv/cu/kv_cache.cu and kv_compress.cu take slot ids and
read the pool's block table and written[] on the device. These functions
define what they do, on a PagedPoolRef that carries its request table
(`block_table`, `written`; PagedPoolRef.create(..., max_requests=,
max_blocks_per_request=), or PagedKVPool.reference_view()):

* Block-table bounds. A slot outside [0, max_requests) has no blocks: it
  acts as a block-table row of -1, so each of its rows is skipped and
  counted. Entry ids past the row and block ids outside [0, num_blocks)
  are skipped and counted (pool._locate).
* written[slot] is the high-water mark of the entries the slot's current
  request has written: every entry a flush writes raises it to e + 1 (the
  kernels' atomicMax), and every gather treats an id >= written[slot] as out
  of range (zero row, one error). Freed blocks keep their bytes and are
  reused, so without this bound a gather would return an earlier request's
  entry as if it were valid (docs/kvcache.md, "Stale entries").
* written[slot] alone does not make an entry readable: an id below the mark
  that this request never wrote (compress_prefill starting at entry 3 of a
  fresh request leaves 0..2 unwritten) still holds a previous owner's bytes.
  pool.marks holds one written flag per entry: the writers set it, block
  allocation clears it (reset_marks; PagedKVPool.prepare_step), and every
  gather returns only marked entries (zero row, one error otherwise).
* Page ownership (pool.request_ids, pool.owners; docs/kvcache.md, "Page
  ownership"): marks are cleared when a block is assigned, which only
  prepare_step did, while an engine may write block-table rows itself.
  So each block records the id of the request it was assigned to
  (assign_pages stamps it and clears the block's marks), each slot the id
  of its request, and a slot's row names only the blocks whose owner is
  its request: any other block acts as -1 (table_rows), for every writer
  and every reader alike. A block handed over without assign_pages is
  skipped and counted, never read: a mark on a block owned by request X
  was set by a write of X after the block was assigned to X.
* Duplicates: two valid rows of one batch aimed at the same physical entry
  -> the lowest row writes it, the others are skipped and counted.
* Every function returns the number of rows it skipped and counted; the
  ops add it to their error counter.
"""
from __future__ import annotations

import numpy as np

from ._checks import _ints, _mask
from .pool import PagedPoolRef, _flush, _located, gather_dense, gather_index_keys, gather_topk


def _request_table(pool: PagedPoolRef):
    if pool.block_table is None or pool.written is None:
        raise ValueError("pool: has no request table (block_table, written); create it with "
                         "max_requests= and max_blocks_per_request=")
    return pool.block_table, pool.written


def table_rows(pool: PagedPoolRef, slots) -> np.ndarray:
    """(B, max_blocks) int64 block-table rows of `slots` (B,); a slot out of
    range gets a row of -1 (every entry of it is then skipped and counted).
    With page ownership (pool.owners) a block not owned by the slot's
    request (owners[block] != request_ids[slot], or the slot has no
    request) is -1 as well."""
    table, _ = _request_table(pool)
    slots = _ints("slots", slots, ndim=1)
    ok = (slots >= 0) & (slots < table.shape[0])
    rows = np.full((slots.shape[0], table.shape[1]), -1, np.int64)
    rows[ok] = table[slots[ok]]
    if pool.owners is not None:
        rid = request_ids_of(pool, slots)[:, None]
        inside = (rows >= 0) & (rows < pool.owners.shape[0])
        owner = np.where(inside, pool.owners[np.where(inside, rows, 0)], 0)
        rows[(owner != rid) | (rid <= 0)] = -1
    return rows


def request_ids_of(pool: PagedPoolRef, slots) -> np.ndarray:
    """(B,) int64 request_ids of `slots`; 0 (no request) for a slot out of
    range."""
    slots = _ints("slots", slots, ndim=1)
    ok = (slots >= 0) & (slots < pool.request_ids.shape[0])
    rid = np.zeros(slots.shape[0], np.int64)
    rid[ok] = pool.request_ids[slots[ok]]
    return rid


def assign_pages(pool: PagedPoolRef, slots, blocks) -> int:
    """Hand block blocks[i] to the request in slots[i]: owners[block] =
    request_ids[slot] and the block's marks are cleared (none of its
    entries is written by the new owner yet). The one way a block changes
    owner: PagedKVPool.prepare_step does it for the blocks it allocates, an
    engine that writes block-table rows itself calls it for every block it
    hands out (docs/kvcache.md, "Page ownership").

    slots, blocks (B,) int. blocks[i] == -1 is padding (nothing, not
    counted). A block outside [0, num_blocks), or a slot out of range or
    holding no request (request_ids <= 0), is skipped and counts one error;
    so is a row naming a block a lower row assigns (the lowest row wins).
    Returns the errors."""
    if pool.owners is None or pool.request_ids is None:
        raise ValueError("pool: has no page ownership (request_ids, owners)")
    slots = _ints("slots", slots, ndim=1)
    blocks = _ints("blocks", blocks, ndim=1)
    if blocks.shape != slots.shape:
        raise ValueError(f"blocks: expected shape {slots.shape} (one per slot), got {blocks.shape}")
    rid = request_ids_of(pool, slots)
    errors, taken = 0, set()
    for b, r in zip(blocks.tolist(), rid.tolist()):
        if b == -1:
            continue
        if r <= 0 or not 0 <= b < pool.owners.shape[0] or b in taken:
            errors += 1
            continue
        taken.add(b)
        pool.owners[b] = r
        if pool.marks is not None:
            pool.marks[b] = 0
    return errors


def written_of(pool: PagedPoolRef, slots) -> np.ndarray:
    """(B,) int64 written[] of `slots`; 0 for a slot out of range (it has
    written nothing)."""
    _, written = _request_table(pool)
    slots = _ints("slots", slots, ndim=1)
    ok = (slots >= 0) & (slots < written.shape[0])
    w = np.zeros(slots.shape[0], np.int64)
    w[ok] = written[slots[ok]]
    return w


def raise_written(pool: PagedPoolRef, slots, entry_ids) -> None:
    """written[slots[b]] = max(written[slots[b]], entry_ids[b] + 1) for every
    row whose entry was written (entry id >= 0; -1 marks a row that wrote
    nothing). The slots of written rows are in range (their entry was
    located through their block-table row)."""
    _, written = _request_table(pool)
    for s, e in zip(_ints("slots", slots, ndim=1).tolist(), _ints("entry_ids", entry_ids).tolist()):
        if e >= 0:
            written[s] = max(int(written[s]), e + 1)


def paged_flush_write(pool: PagedPoolRef, entries, valid_mask, slots, positions,
                      index_keys=None) -> int:
    """flush_write addressed by slot: row b writes entry positions[b] // m of
    the request in slots[b] through its block-table row and raises
    written[slots[b]]. Returns the rows skipped and counted (bad slot,
    negative position, entry past the block table, bad block)."""
    rows = table_rows(pool, slots)
    errors, done = _flush(pool, entries, valid_mask, positions, rows, index_keys)
    raise_written(pool, slots, done)
    return errors


def paged_gather_topk(pool: PagedPoolRef, slots, topk_ids, n_entries=None, valid_mask=None,
                      dtype: str = "bfloat16"):
    """gather_topk addressed by slot -> (rows (B, K, head_dim), errors).

    slots (B,); topk_ids (B, K); n_entries (B,) or None: ids are bounded by
    min(n_entries[b], written[slots[b]]). valid_mask (B,) or None: rows with
    False are zero rows, not counted. Id -1 is padding (zero row, not
    counted); any other id out of range is a zero row and one error."""
    ids = _ints("topk_ids", topk_ids, ndim=2)
    B, K = ids.shape
    slots = _ints("slots", slots, ndim=1)
    valid = np.ones(B, bool) if valid_mask is None else _mask("valid_mask", valid_mask, B)
    lim = written_of(pool, slots)
    if n_entries is not None:
        lim = np.minimum(lim, _ints("n_entries", n_entries, ndim=1))
    rows = np.zeros((B, K, pool.head_dim), np.float32)
    sel = np.flatnonzero(valid)
    errors = 0
    if sel.size:
        rows[sel], errors = gather_topk(pool, table_rows(pool, slots[sel]), ids[sel], lim[sel],
                                        dtype=dtype)
    return rows, errors


def paged_gather_dense(pool: PagedPoolRef, slot: int, n_entries: int, dtype: str = "bfloat16", *,
                       index: bool = False):
    """Entries 0 .. n_entries-1 of the request in `slot` (its entries, or
    with index=True its CSA indexer keys) -> (rows, errors): gather_dense /
    gather_index_keys with written = written[slot]."""
    row = table_rows(pool, [slot])[0]
    written = int(written_of(pool, [slot])[0])
    fn = gather_index_keys if index else gather_dense
    return fn(pool, row, n_entries, dtype, written=written)


def paged_gather_dense_batch(pool: PagedPoolRef, slots, n_entries, max_entries: int,
                             valid_mask=None, dtype: str = "bfloat16", *, index: bool = False):
    """Batched paged_gather_dense with per-row lengths -> (rows (B, K, width),
    errors), K = max_entries: rows[b, j] = entry j of the request in
    slots[b] for j < n_entries[b], zero rows (not counted) past it.
    n_entries[b] < 0 or > K counts one error and gathers the first
    min(max(n, 0), K) entries. valid_mask False: zero rows, not counted.
    K = 0: nothing is gathered and nothing counted (on a GPU no kernel
    runs)."""
    slots = _ints("slots", slots, ndim=1)
    B, K = slots.shape[0], int(max_entries)
    ne = _ints("n_entries", n_entries, ndim=1)
    if ne.shape != (B,):
        raise ValueError(f"n_entries: expected shape ({B},), got {ne.shape}")
    valid = np.ones(B, bool) if valid_mask is None else _mask("valid_mask", valid_mask, B)
    width = pool.index_head_dim if index else pool.head_dim
    rows = np.zeros((B, K, width), np.float32)
    if K == 0:
        return rows, 0
    table = table_rows(pool, slots)
    written = written_of(pool, slots)
    fn = gather_index_keys if index else gather_dense
    errors = 0
    for b in np.flatnonzero(valid):
        n = int(ne[b])
        errors += n < 0 or n > K
        nn = min(max(n, 0), K)
        rows[b, :nn], e = fn(pool, table[b], nn, dtype, written=int(written[b]))
        errors += e
    return rows, errors


def paged_kvcache_indices(pool: PagedPoolRef, slots, topk_ids, n_entries=None, valid_mask=None):
    """The bridge to the attention kernels on a pool: each request's logical
    top-k entry ids -> (indices (B, K) int32, errors), where index =
    block * entries_per_block + row, the entry's record in the pool (for a
    'model1' pool FlashMLA's indices_in_kvcache into pool.pages).

    Rules of paged_gather_topk: -1 -> -1, not counted; an id that is out of
    range (negative, >= min(n_entries[b], written[slots[b]]), past the block
    table, on a bad block) or not marked written -> -1 and one error; rows
    with valid_mask False -> all -1, not counted. So an index points only at
    an entry the request wrote since its block was allocated."""
    ids = _ints("topk_ids", topk_ids, ndim=2)
    B, K = ids.shape
    slots = _ints("slots", slots, ndim=1)
    if slots.shape != (B,):
        raise ValueError(f"slots: expected shape ({B},), got {slots.shape}")
    valid = np.ones(B, bool) if valid_mask is None else _mask("valid_mask", valid_mask, B)
    lim = written_of(pool, slots)
    if n_entries is not None:
        lim = np.minimum(lim, _ints("n_entries", n_entries, ndim=1))
    table = table_rows(pool, slots)
    out = np.full((B, K), -1, np.int32)
    errors = 0
    for b in np.flatnonzero(valid):
        j, blk, row, e = _located(pool, table[b], ids[b], int(lim[b]), True)
        out[b, j] = blk * pool.entries_per_block + row
        errors += e
    return out, errors
