"""The paged pool (entry storage) and the entry-level flush and gathers,
addressed by block-table rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import bf16_round
from . import layouts as L
from ._checks import _f32, _ints, _mask
from .constants import HEAD_DIM, INDEX_HEAD_DIM, NVFP4_BLOCK, ROPE_DIM
from .quant import (
    fp8_entry_dequantize, fp8_entry_quantize, indexer_key_dequantize, indexer_key_quantize,
)


@dataclass
class PagedPoolRef:
    """Paged pool of one compressed layer: `num_blocks` physical blocks of
    `entries_per_block` entries. Entry e of a request lives in physical block
    block_table[e // entries_per_block], slot e % entries_per_block, and
    e = position // m.

    kv_fp8   (num_blocks, epb, 448) uint8    E4M3 codes of the non-RoPE dims
    kv_scale (num_blocks, epb)      float32  FP8 decode scale
    kv_rope  (num_blocks, epb, 64)  float32  BF16 values of the RoPE dims
    idx_q    (num_blocks, epb, 64)  uint8    CSA only: indexer key E2M1 pairs
    idx_sf   (num_blocks, epb, 8)   uint8    CSA only: indexer UE4M3 scales
    marks    (num_blocks, epb)      uint8    1: the entry was written since its
             block was last allocated (reset_marks); every gather returns only
             marked entries, so a reused block never shows its previous
             owner's bytes (None: no marks, every located entry is read)

    The request table, for the slot-addressed functions of .paged (None
    when only the block-table-row functions here are used):

    block_table (max_requests, max_blocks) int32  -1 = no block
    written     (max_requests,)            int32  entries the slot's request
                has written (high-water mark, .paged)

    Page ownership (.paged; None: not checked, every block of a slot's
    row is its own):

    request_ids (max_requests,) int32  the id of the request in each slot
                (> 0; 0: no request)
    owners      (num_blocks,)   int32  the id of the request each block is
                assigned to (assign_pages; 0: none). A slot uses a block of
                its block-table row only when owners[block] ==
                request_ids[slot] > 0; any other block acts as -1 (skipped
                and counted), so no request writes or reads a block that
                was not assigned to it

    Layout "model1" (the ecosystem's, .layouts; docs/kvcache.md "Pool
    layouts"): the fields above that hold entries are None, and a block is a
    page of entries_per_block records:

    pages       (num_blocks, MODEL1 page bytes) uint8  FlashMLA MODEL1_FP8Sparse
                entries: entry (blk, o) is record o of page blk, i.e.
                FlashMLA index blk * epb + o
    index_pages (num_blocks, key page bytes) uint8  CSA only: the indexer
                keys in DeepGEMM's paged layout, `index_layout` 'fp8' (SM90
                and SM100), 'mxfp4' or 'mxfp8' (SM100), record o of page blk
    """
    m: int
    kv_fp8: np.ndarray | None
    kv_scale: np.ndarray | None
    kv_rope: np.ndarray | None
    idx_q: np.ndarray | None = None
    idx_sf: np.ndarray | None = None
    block_table: np.ndarray | None = None
    written: np.ndarray | None = None
    marks: np.ndarray | None = None
    pages: np.ndarray | None = None
    index_pages: np.ndarray | None = None
    index_layout: str | None = None
    page_size: int | None = None
    request_ids: np.ndarray | None = None
    owners: np.ndarray | None = None

    @classmethod
    def create(cls, num_blocks: int, entries_per_block: int, m: int,
               head_dim: int = HEAD_DIM, rope_dim: int = ROPE_DIM,
               index_head_dim: int | None = None, *, max_requests: int | None = None,
               max_blocks_per_request: int | None = None, layout: str = "rawkv",
               index_layout: str | None = None) -> "PagedPoolRef":
        """Zero-filled pool; pass index_head_dim=128 for a CSA layer, and
        max_requests, max_blocks_per_request for a request table (every
        block-table entry -1, written 0). layout 'model1': MODEL1 pages
        (head_dim 512, rope_dim 64) and, with index_head_dim 128, indexer-key
        pages of `index_layout` ('fp8', 'mxfp4' or 'mxfp8'); 'rawkv': NVFP4 keys
        (index_layout 'nvfp4'). index_layout None: the layout's own (the
        first of INDEX_LAYOUTS_OF[layout]); another value is a ValueError
        naming it, as PagedKVPool's (it was ignored for 'rawkv')."""
        if num_blocks <= 0 or entries_per_block <= 0 or m <= 0:
            raise ValueError("num_blocks, entries_per_block, m: expected positive sizes")
        if layout not in INDEX_LAYOUTS_OF:
            raise ValueError(f"layout: expected 'rawkv' or 'model1', got {layout!r}")
        index_layout = index_layout_of(layout, index_layout)
        shp = (num_blocks, entries_per_block)
        if layout == "model1":
            check_model1_geometry(head_dim, rope_dim, index_head_dim, index_layout)
            pool = cls(m=m, kv_fp8=None, kv_scale=None, kv_rope=None, marks=np.zeros(shp, np.uint8),
                       pages=L.new_cache(L.MODEL1, num_blocks, entries_per_block),
                       page_size=entries_per_block)
            if index_head_dim is not None:
                pool.index_layout = index_layout
                pool.index_pages = L.new_cache(INDEX_LAYOUTS[index_layout], num_blocks, entries_per_block)
        else:
            pool = cls(m=m,
                       kv_fp8=np.zeros(shp + (head_dim - rope_dim,), np.uint8),
                       kv_scale=np.zeros(shp, np.float32),
                       kv_rope=np.zeros(shp + (rope_dim,), np.float32),
                       marks=np.zeros(shp, np.uint8))
        if index_head_dim is not None and layout == "rawkv":
            if index_head_dim % NVFP4_BLOCK:
                raise ValueError(f"index_head_dim: expected a multiple of 16, got {index_head_dim}")
            pool.idx_q = np.zeros(shp + (index_head_dim // 2,), np.uint8)
            pool.idx_sf = np.zeros(shp + (index_head_dim // NVFP4_BLOCK,), np.uint8)
        if (max_requests is None) != (max_blocks_per_request is None):
            raise ValueError("max_requests, max_blocks_per_request: give both or neither")
        if max_requests is not None:
            if max_requests <= 0 or max_blocks_per_request <= 0:
                raise ValueError("max_requests, max_blocks_per_request: expected positive sizes")
            pool.block_table = np.full((max_requests, max_blocks_per_request), -1, np.int32)
            pool.written = np.zeros(max_requests, np.int32)
        return pool

    @property
    def layout(self) -> str:
        """'rawkv' (per-entry FP32 scale, NVFP4 key) or 'model1' (pages)."""
        return "rawkv" if self.pages is None else "model1"

    @property
    def num_blocks(self) -> int:
        return (self.kv_fp8 if self.pages is None else self.pages).shape[0]

    @property
    def entries_per_block(self) -> int:
        return self.kv_fp8.shape[1] if self.pages is None else self.page_size

    @property
    def rope_dim(self) -> int:
        return L.ROPE_DIM if self.pages is not None else self.kv_rope.shape[2]

    @property
    def head_dim(self) -> int:
        return L.ENTRY_DIM if self.pages is not None else self.kv_fp8.shape[2] + self.kv_rope.shape[2]

    @property
    def index_head_dim(self) -> int | None:
        if self.pages is not None:
            return None if self.index_pages is None else L.INDEX_DIM
        return None if self.idx_q is None else self.idx_q.shape[2] * 2

    def copy(self) -> "PagedPoolRef":
        c = lambda a: None if a is None else a.copy()  # noqa: E731
        return PagedPoolRef(self.m, c(self.kv_fp8), c(self.kv_scale), c(self.kv_rope),
                            c(self.idx_q), c(self.idx_sf), c(self.block_table), c(self.written),
                            c(self.marks), c(self.pages), c(self.index_pages), self.index_layout,
                            self.page_size, c(self.request_ids), c(self.owners))


#: the indexer-key page layouts of a 'model1' pool, by index_layout
INDEX_LAYOUTS = {"fp8": L.INDEX_FP8, "mxfp4": L.INDEX_MXFP4, "mxfp8": L.INDEX_MXFP8}
#: the index_layout values each pool layout takes, its own first
INDEX_LAYOUTS_OF = {"rawkv": ("nvfp4",), "model1": tuple(INDEX_LAYOUTS)}


def index_layout_of(layout: str, index_layout) -> str:
    """The indexer keys' format of a pool of `layout` ('rawkv' or
    'model1'): `index_layout` when the layout stores it, None the layout's
    own (INDEX_LAYOUTS_OF's first); anything else a ValueError naming
    index_layout and what the layout takes (a format the layout does not
    store was silently replaced by its own)."""
    takes = INDEX_LAYOUTS_OF[layout]
    if index_layout is None:
        return takes[0]
    if not isinstance(index_layout, str) or index_layout not in takes:
        raise ValueError(f"index_layout: the {layout!r} layout takes {list(takes)} (or None), "
                         f"got {index_layout!r}")
    return index_layout


def check_model1_geometry(head_dim, rope_dim, index_head_dim, index_layout) -> None:
    """A 'model1' pool holds DeepSeek-V4's entries as the ecosystem stores
    them: 512 dims (448 FP8 + 64 RoPE) and 128-dim indexer keys."""
    if head_dim != L.ENTRY_DIM or rope_dim != L.ROPE_DIM:
        raise ValueError(f"head_dim: the 'model1' layout stores {L.ENTRY_DIM}-dim entries with "
                         f"{L.ROPE_DIM} RoPE dims, got {head_dim} and {rope_dim}")
    if index_head_dim not in (None, INDEX_HEAD_DIM):
        raise ValueError(f"index_head_dim: the 'model1' layout's indexer keys have {INDEX_HEAD_DIM} "
                         f"dims, got {index_head_dim}")
    if index_layout not in INDEX_LAYOUTS:
        raise ValueError(f"index_layout: expected one of {sorted(INDEX_LAYOUTS)}, got {index_layout!r}")


def reset_marks(pool: PagedPoolRef, blocks) -> None:
    """Blocks `blocks` change owner (allocated to a request): none of their
    entries is written by the new owner yet, so every gather reads them as
    unwritten (zero row, counted) until a flush writes them."""
    if pool.marks is not None:
        pool.marks[_ints("blocks", np.asarray(blocks, np.int64).reshape(-1), ndim=1)] = 0


def _locate(pool: PagedPoolRef, table_row: np.ndarray, entry_id: int):
    """(physical block, slot) of entry `entry_id`, or None when the entry id,
    the logical block or the physical block id is out of range."""
    if entry_id < 0:
        return None
    lb, slot = divmod(int(entry_id), pool.entries_per_block)
    if lb >= table_row.shape[0]:
        return None
    blk = int(table_row[lb])
    if blk < 0 or blk >= pool.num_blocks:
        return None
    return blk, slot


def flush_write(pool: PagedPoolRef, entries, valid_mask, positions, block_table,
                index_keys=None) -> int:
    """Quantize and scatter one finished entry per batch row into the pool.

    entries:     (B, head_dim) float32 (finish_entry output)
    valid_mask:  (B,) bool; rows with False are skipped silently (no flush
                 this step)
    positions:   (B,) int; entry id = position // m (any position inside the
                 window, normally its last token)
    block_table: (B, max_blocks) int; row b is the block table of the request
                 in batch row b
    index_keys:  (B, index_head_dim) float32, required iff the pool is CSA
                 (finish_index_key output)
    Returns the number of valid rows skipped because the position is
    negative, the logical block is past the block table, or the physical
    block id is outside [0, num_blocks): nothing is written for them.
    Two valid rows aimed at one entry (the same physical entry): the lowest
    row writes it, every other is skipped and counted (the kernels do the
    same, so the result does not depend on the order rows run in).
    """
    return _flush(pool, entries, valid_mask, positions, block_table, index_keys)[0]


def _flush(pool: PagedPoolRef, entries, valid_mask, positions, block_table, index_keys):
    """flush_write, returning (errors, entry ids written: (B,) int64, -1 for
    a row that wrote nothing)."""
    entries = _f32("entries", entries, last=pool.head_dim, ndim=2)
    B = entries.shape[0]
    valid_mask = _mask("valid_mask", valid_mask, B)
    positions = _ints("positions", positions, ndim=1)
    if positions.shape != (B,):
        raise ValueError(f"positions: expected shape ({B},), got {positions.shape}")
    block_table = _ints("block_table", block_table, ndim=2)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows, got shape {block_table.shape}")
    if (pool.index_head_dim is None) != (index_keys is None):
        raise ValueError("index_keys: required for a CSA pool (with indexer) and only for it")
    if index_keys is not None:
        index_keys = _f32("index_keys", index_keys, last=pool.index_head_dim, ndim=2)
        if index_keys.shape[0] != B:
            raise ValueError(f"index_keys: expected {B} rows, got shape {index_keys.shape}")
    errors = 0
    done = np.full(B, -1, np.int64)
    taken = {}                                 # target -> the row that writes it
    for b in range(B):
        if not valid_mask[b]:
            continue
        pos = int(positions[b])
        loc = _locate(pool, block_table[b], pos // pool.m) if pos >= 0 else None
        if loc is None or loc in taken:        # bad target, or a lower row's entry
            errors += 1
            continue
        taken[loc] = b
        done[b] = pos // pool.m
    rows = np.fromiter(taken.values(), np.int64, len(taken))
    if rows.size:
        _store(pool, list(taken), entries[rows], None if index_keys is None else index_keys[rows])
    return errors, done


def _store(pool: PagedPoolRef, locs: list, entries: np.ndarray, index_keys) -> None:
    """Quantize entries (n, head_dim) (and keys) and store them at the
    distinct targets `locs` [(block, row)], marking them written."""
    blk, row = (np.asarray(a, np.int64) for a in zip(*locs))
    if pool.marks is not None:
        pool.marks[blk, row] = 1
    if pool.pages is not None:
        slots = blk * pool.page_size + row
        L.page_write(L.MODEL1, pool.pages, pool.page_size, *L.records(L.MODEL1, entries), slots)
        if index_keys is not None:
            lay = INDEX_LAYOUTS[pool.index_layout]
            L.page_write(lay, pool.index_pages, pool.page_size, *L.records(lay, index_keys), slots)
        return
    # (float32 values stand for BF16 ones, as in the page layouts' quantizers
    # and on the GPU, which takes BF16 entries: rounded first)
    pool.kv_fp8[blk, row], pool.kv_scale[blk, row], pool.kv_rope[blk, row] = \
        fp8_entry_quantize(bf16_round(entries), pool.rope_dim)
    if index_keys is not None:
        pool.idx_q[blk, row], pool.idx_sf[blk, row] = indexer_key_quantize(bf16_round(index_keys))


def _located(pool: PagedPoolRef, table_row, ids, n_entries, pad_ok: bool):
    """Where entries `ids` (k,) of one request are readable -> (j, blk, row)
    int64 arrays of the readable ones, errors: an id that is out of range
    (>= n_entries when given, or not located) or not marked written is not
    readable and counts one error; with pad_ok, -1 is padding (not
    readable, not counted)."""
    found, errors = [], 0
    for j, e in enumerate(ids):
        e = int(e)
        if pad_ok and e == -1:
            continue
        loc = None if (n_entries is not None and e >= n_entries) else _locate(pool, table_row, e)
        if loc is not None and pool.marks is not None and not pool.marks[loc]:
            loc = None                           # not written since the block was allocated
        if loc is None:
            errors += 1
            continue
        found.append((j, *loc))
    j, blk, row = (np.asarray(a, np.int64) for a in (zip(*found) if found else ((), (), ())))
    return j, blk, row, errors


def _read_entries(pool: PagedPoolRef, table_row, ids, n_entries, pad_ok: bool, dtype: str,
                  index: bool = False):
    """Decode entries `ids` (k,) of one request; unreadable rows (_located)
    are zero. Returns (rows (k, width), errors)."""
    width = pool.index_head_dim if index else pool.head_dim
    out = np.zeros((ids.shape[0], width), np.float32)
    j, blk, row, errors = _located(pool, table_row, ids, n_entries, pad_ok)
    if j.size == 0:
        return out, errors
    if pool.pages is not None:
        lay, cache = (INDEX_LAYOUTS[pool.index_layout], pool.index_pages) if index else (L.MODEL1, pool.pages)
        data, scales, _, _ = L.page_read(lay, cache, pool.page_size, blk * pool.page_size + row)
        out[j] = L.decode_records(lay, data, scales, dtype)
    elif index:
        out[j] = indexer_key_dequantize(pool.idx_q[blk, row], pool.idx_sf[blk, row], dtype)
    else:
        out[j] = fp8_entry_dequantize(pool.kv_fp8[blk, row], pool.kv_scale[blk, row],
                                      pool.kv_rope[blk, row], dtype)
    return out, errors


def gather_dense(pool: PagedPoolRef, block_table_row, n_entries: int,
                 dtype: str = "bfloat16", *, written: int | None = None):
    """HCA reader: entries 0 .. n_entries-1 of one request -> (rows, errors).

    block_table_row: (max_blocks,) int. rows: (n_entries, head_dim) float32
    holding `dtype` values (BF16 by default). An entry whose block is out of
    range is a zero row and counts one error. written: the number of entries
    the request has written (None: no bound); entry ids >= written would read
    bytes the request never wrote (a previous owner's, after block reuse), so
    they are zero rows and count one error each. So is an entry not marked
    written since its block was allocated (pool.marks): below the high-water
    mark, a request may have skipped entries (a prefill starting mid-request)
    whose bytes are still a previous owner's.
    """
    row = _ints("block_table_row", block_table_row, ndim=1)
    if n_entries < 0:
        raise ValueError(f"n_entries: expected >= 0, got {n_entries}")
    return _read_entries(pool, row, np.arange(n_entries), written, False, dtype)


def gather_topk(pool: PagedPoolRef, block_table, topk_ids, n_entries=None,
                dtype: str = "bfloat16"):
    """CSA reader: selected entry ids -> (rows, errors).

    block_table: (..., max_blocks) int; topk_ids: (..., k) int with the same
    leading shape (one row per request / query); n_entries: (...,) int or
    None, the number of entries each request has written.
    rows: (..., k, head_dim) float32 (`dtype` values). id -1 is padding: zero
    row, no error. Any other id that is negative, >= n_entries, or maps to an
    out-of-range block, or is not marked written (pool.marks), gives a zero
    row and counts one error.
    """
    table = _ints("block_table", block_table)
    ids = _ints("topk_ids", topk_ids)
    if table.ndim < 1 or ids.ndim < 1 or table.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"block_table, topk_ids: leading shapes differ: {table.shape}, {ids.shape}")
    lead = ids.shape[:-1]
    ne = None
    if n_entries is not None:
        ne = _ints("n_entries", n_entries)
        if ne.shape != lead:
            raise ValueError(f"n_entries: expected shape {lead}, got {ne.shape}")
    rows = np.zeros(ids.shape + (pool.head_dim,), np.float32)
    errors = 0
    for idx in np.ndindex(*lead):
        rows[idx], e = _read_entries(pool, table[idx], ids[idx],
                                     None if ne is None else int(ne[idx]), True, dtype)
        errors += e
    return rows, errors


def gather_index_keys(pool: PagedPoolRef, block_table_row, n_entries: int,
                      dtype: str = "bfloat16", *, written: int | None = None):
    """CSA indexer reader: the indexer keys of entries 0 .. n_entries-1 of one
    request -> (keys (n_entries, 128), errors); same rules as gather_dense."""
    if pool.index_head_dim is None:
        raise ValueError("pool: has no indexer keys (not a CSA pool)")
    row = _ints("block_table_row", block_table_row, ndim=1)
    if n_entries < 0:
        raise ValueError(f"n_entries: expected >= 0, got {n_entries}")
    return _read_entries(pool, row, np.arange(n_entries), written, False, dtype, index=True)
