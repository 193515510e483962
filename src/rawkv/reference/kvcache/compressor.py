"""The compressor, end to end: token rows (prefill) or the decode tail state
(decode) -> finished entries -> the paged pool, as rawkv/cu/kv_compress.cu
does it in one launch (docs/kvcache.md, "Compressor kernel"). The kernel
agrees with these functions within the tolerance stated there (expf for the
float64 exp; HCA: an online softmax); placement, written[] and error counts
are exact.
"""
from __future__ import annotations

import numpy as np

from ._checks import _f32, _ints, _mask
from .constants import COMPRESS_ROPE_THETA, CSA_RATIO, DSV4_YARN, HCA_RATIO, RMS_EPS, ROPE_DIM
from .finish import finish_entry, finish_index_key
from .paged import paged_flush_write
from .pool import PagedPoolRef
from .pooling import compress_csa, compress_hca
from .state import DecodeStateRef, _owner_rows, state_pool


def reference_prefill(kind, kv, z, ape, norm_weight, *, start_entry=0, index=None,
                      m=None, eps=RMS_EPS, theta=COMPRESS_ROPE_THETA, yarn=DSV4_YARN):
    """The composition that defines compress_prefill:
    compress_csa/compress_hca -> finish_entry (and for CSA with `index`
    = (kv, z, ape, norm_weight) of the indexer: compress_csa ->
    finish_index_key). Returns (entry_ids, entries (n, d) BF16 values,
    keys (n, 128) or None), all numpy. For CSA with start_entry > 0, kv/z
    begin one window earlier (the overlap context)."""
    m = m or (CSA_RATIO if kind == "csa" else HCA_RATIO)
    pre = 1 if (kind == "csa" and start_entry > 0) else 0
    pool_fn = compress_csa if kind == "csa" else compress_hca
    pooled = pool_fn(kv, z, ape, m)[pre:]
    ids = start_entry + np.arange(pooled.shape[0], dtype=np.int64)
    ent = finish_entry(pooled, norm_weight, ids, m, eps=eps, theta=theta, yarn=yarn)
    keys = None
    if index is not None:
        ikv, iz, iape, iw = index
        ip = compress_csa(ikv, iz, iape, m)[pre:]
        keys = finish_index_key(ip, iw, ids, m, eps=eps, theta=theta, yarn=yarn)
    return ids, ent, keys


def _rope_width(pool: PagedPoolRef) -> None:
    """The compressor ropes DeepSeek-V4's last 64 dims (finish_entry): a
    rawkv-layout pool storing another RoPE width would take entries of
    another layout than it holds (the public ops refuse such a pool by the
    same rule: rawkv.kvcache._rules.compressible; a model1 pool's pages
    hold 64)."""
    if pool.kv_rope is not None and pool.kv_rope.shape[-1] != ROPE_DIM:
        raise ValueError(f"pool: rope_dim must be {ROPE_DIM} for the compressor (DeepSeek-V4 ropes the last "
                         f"{ROPE_DIM} dims of each entry and indexer key), got {pool.kv_rope.shape[-1]}")


def paged_compress_prefill(pool: PagedPoolRef, kind: str, slot: int, kv, z, ape, norm_weight, *,
                           start_entry=0, index=None, eps=RMS_EPS, theta=COMPRESS_ROPE_THETA,
                           yarn=DSV4_YARN):
    """compress_prefill into a pool with its request table: the entries of
    reference_prefill written as entries start_entry.. of the request in
    `slot` (paged_flush_write: an entry past the block table or on a bad
    block is skipped and counted; written[slot] is raised).
    Returns (n entries, errors)."""
    _rope_width(pool)
    ids, ent, keys = reference_prefill(kind, kv, z, ape, norm_weight, start_entry=start_entry,
                                       index=index, m=pool.m, eps=eps, theta=theta, yarn=yarn)
    n = ids.shape[0]
    if n == 0:
        return 0, 0
    errors = paged_flush_write(pool, ent, np.ones(n, bool), np.full(n, slot, np.int64),
                               ids * pool.m, keys)
    return n, errors


def paged_compress_decode(pool: PagedPoolRef, state: DecodeStateRef, norm_weight, valid_mask,
                          slots, positions, *, index=None, eps=RMS_EPS,
                          theta=COMPRESS_ROPE_THETA, yarn=DSV4_YARN) -> int:
    """compress_decode: flush the complete windows of the decode state into
    the pool. index: (indexer DecodeStateRef, indexer norm_weight) or None.

    The flush rule, row by row, the first line that applies (rows with
    valid_mask False are skipped silently and own no slot):
      slot outside the state's or the block table's rows  -> counted
      a lower valid row names the same slot (a duplicate) -> counted
      neither window complete (count != m)                -> skipped silently
      exactly one of the entry's / key's windows complete -> nothing written,
          counted (an entry without its key, or a key without its entry,
          would pair new data with stale data)
      negative position                                   -> counted
      else entry positions[b] // m (and its key) pooled, finished and written
          through paged_flush_write (which counts bad blocks and raises
          written[]).
    Duplicate slots (docs/kvcache.md decision 11; the state ops' rule,
    state._owner_rows): among the valid rows with an in-range slot, the
    lowest row of a slot owns it and is the only one that may flush. Every
    other row of that slot writes nothing and counts one error, always:
    whether or not the owner flushes, whatever the row's own position. So
    a slot's window is pooled at most once and never written into two
    entries. Among the owners, paged_flush_write's rule for rows aimed at
    one pool entry (the lowest writes, the others are counted) still holds.
    Returns the rows counted."""
    _rope_width(pool)
    ist, iw = (None, None) if index is None else index
    slots = _ints("slots", slots, ndim=1)
    B = slots.shape[0]
    valid = _mask("valid_mask", valid_mask, B)
    pos = _ints("positions", positions, ndim=1)
    if pos.shape != (B,):
        raise ValueError(f"positions: expected shape ({B},), got {pos.shape}")
    m = pool.m
    # a state pools its own window: one of another m (an HCA state given a
    # CSA pool) would have rows of a partial window pooled as a full one
    if state.m != m:
        raise ValueError(f"state: has a window of m = {state.m} rows but the pool's m is {m}")
    if ist is not None and (ist.m != m or not ist.overlap):
        raise ValueError(f"index.state: expected a CSA (overlap) state of m = {m}, got m = {ist.m}"
                         f"{'' if ist.overlap else ' without overlap'}")
    n_rows = min(state.num_slots, pool.block_table.shape[0])
    owners, errors = _owner_rows(valid, slots, lambda s: 0 <= s < n_rows)
    rows = []
    for b in owners:
        s = int(slots[b])
        full0 = int(state.count[s]) == m
        full1 = int(ist.count[s]) == m if ist is not None else full0
        if not (full0 or full1):
            continue
        if full0 != full1 or pos[b] < 0:
            errors += 1
            continue
        rows.append(b)
    if rows:
        rows = np.asarray(rows)
        e = pos[rows] // m
        ent = finish_entry(state_pool(state, slots[rows]), _f32("norm_weight", norm_weight), e, m,
                           eps=eps, theta=theta, yarn=yarn)
        keys = None
        if ist is not None:
            keys = finish_index_key(state_pool(ist, slots[rows]), _f32("index.norm_weight", iw), e,
                                    m, eps=eps, theta=theta, yarn=yarn)
        errors += paged_flush_write(pool, ent, np.ones(len(rows), bool), slots[rows], pos[rows],
                                    keys)
    return errors
