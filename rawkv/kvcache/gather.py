"""Gathers: pool entries (or CSA indexer keys) back to rows
(rkv_kv_gather, rkv_kv_gather_index).

Every gather bounds entry ids by pool.written[slot] (reference.paged_*): an
id at or past it is a zero row and one error, so bytes an earlier request
left in a reused block are never returned.
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


def gather_topk(pool, slots, topk_ids, *, n_entries=None, valid_mask=None, out=None, dtype=None,
                errors=None, stream=None):
    """Decode the selected entries back to rows (CSA reader):
    out[b, j] = entry topk_ids[b, j] of the request in slots[b].

    slots (B,) int32; topk_ids (B, K) int32 or int64; n_entries (B,) int32 or
    None (an optional tighter bound: ids >= n_entries are errors);
    valid_mask (B,) bool or None (False: zero rows, not counted);
    out (B, K, head_dim) of `dtype` (bfloat16 default, float16, float32).
    Id -1 is padding: zero row, not counted. Any other negative id, an id
    >= n_entries, an id >= pool.written[slot] (not written by this request:
    a reused block may hold an earlier request's entry there), or an id
    mapped to an out-of-range slot/block gives a zero row and adds 1 to
    errors (reference.paged_gather_topk). One launch."""
    C.check_pool(pool)
    if D.compiling():
        return V.traced_out(GATHER_TOPK_OP, pool, out, dtype, (*topk_ids.shape, pool.head_dim), errors,
                            slots=slots, topk_ids=topk_ids, n_entries=n_entries, valid_mask=valid_mask)
    name = C.out_dtype(dtype, out)
    dev = pool.device_index
    ids, s, ne, v = C.topk_args(slots, topk_ids, n_entries, valid_mask, dev)
    B, Kk = ids.shape
    shape = (B, Kk, pool.head_dim)
    out = C.check_out(out, name, dev, shape=shape)
    err = C.errors_arg(errors, pool.errors, dev)
    C.check_outputs((("out", out), ("errors", C.counter(errors, pool))),
                    (("slots", s), ("topk_ids", ids), ("n_entries", ne), ("valid_mask", v)), C.owned(pool, "pool"))
    C.check_launch_rows("topk_ids", B * Kk)
    if dev is None:
        rows, n = ref.paged_gather_topk(pool.reference_view(), s, ids, ne, v, dtype=name)
        C.add_errors(err, n)
        return D.from_numpy(rows, topk_ids, torch_dtype=name, out=out)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty(shape, C.torch_dtype(name), stream=stream)
    _plan.run(rt, P.gather(rt, pool, ids, s, ne, v, out, err, B, Kk), stream)
    return out


def _dense_launch(pool, index, slots, n_entries, valid, slot0, n0, B, Kk, out, err, stream):
    """One dense launch: rows of `slots` (or of slot0 when None), lengths
    n_entries (or n0), entries or (index) indexer keys."""
    C.check_launch_rows("out", B * Kk * (pool.index_head_dim // 16 if index else 1))
    if B * Kk == 0:
        return
    rt = get_runtime(pool.device_index)
    plan = (P.gather_index(rt, pool, slots, n_entries, valid, out, err, B, Kk, slot0, n0) if index else
            P.gather(rt, pool, None, slots, n_entries, valid, out, err, B, Kk, slot0, n0))
    _plan.run(rt, plan, stream)


def _check_index(pool, index: bool) -> int:
    """Row width of a dense gather: head_dim, or the indexer key's."""
    if not index:
        return pool.head_dim
    if not pool.has_index:
        raise ValueError("pool: has no indexer keys (not a CSA pool with index_head_dim)")
    return pool.index_head_dim


def _dense_one(pool, slot, n_entries, out, dtype, errors, stream, index):
    C.check_pool(pool)
    width = _check_index(pool, index)
    if D.compiling():
        return V.traced_out(DENSE_OPS[index], pool, out, dtype, (n_entries, width), errors, slot=slot,
                            n_entries=n_entries)
    slot = C.host_int("slot", slot, 0, pool.max_requests)
    # n is a host int, so it is checked against the host's count of the slot's
    # entries (0 for a free slot; a view has no count: V.pool_view); the kernel
    # still bounds by pool.written, which also catches entries prepared but
    # not yet flushed.
    n = C.host_int("n_entries", n_entries, 0)
    have = n if pool._n_entries is None else int(pool._n_entries[slot])
    if n > have:
        raise ValueError(f"n_entries: {n} entries asked of slot {slot}, which holds {have} after the "
                         "steps prepared so far (pool.n_entries); the rest would be bytes this "
                         "request never wrote")
    name = C.out_dtype(dtype, out)
    dev = pool.device_index
    out = C.check_out(out, name, dev, shape=(n, width))
    err = C.errors_arg(errors, pool.errors, dev)
    C.check_outputs((("out", out), ("errors", C.counter(errors, pool))), (), C.owned(pool, "pool"))
    if dev is None:
        rows, ne = ref.paged_gather_dense(pool.reference_view(), slot, n, name, index=index)
        C.add_errors(err, ne)
        return D.from_numpy(rows, out, torch_dtype=name, out=out)
    if out is None:
        out = get_runtime(dev).empty((n, width), C.torch_dtype(name), stream=stream)
    _dense_launch(pool, index, None, None, None, slot, n, 1, n, out, err, stream)
    return out


def _dense_batch(pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors, stream, index):
    C.check_pool(pool)
    width = _check_index(pool, index)
    if out is None and max_entries is None:
        raise ValueError("max_entries: required when out is not given")
    if D.compiling():
        return V.traced_out(BATCH_OPS[index], pool, out, dtype, (slots.shape[0], max_entries, width), errors,
                            slots=slots, n_entries=n_entries, valid_mask=valid_mask)
    name = C.out_dtype(dtype, out)
    if max_entries is not None:
        max_entries = C.host_int("max_entries", max_entries, 0)
    dev = pool.device_index
    s = C.arg(slots, "slots", C.I32, dev, ndim=1)
    B = s.shape[0]
    ne = C.arg(n_entries, "n_entries", C.I32, dev, shape=(B,))
    v = C.opt(valid_mask, "valid_mask", C.BOOL, dev, shape=(B,))
    out = C.check_out(out, name, dev, ndim=3)
    Kk = max_entries if out is None else out.shape[1]
    if out is not None and (tuple(out.shape) != (B, Kk, width) or
                            (max_entries is not None and Kk != max_entries)):
        raise ValueError(f"out: expected shape ({B}, {max_entries if max_entries is not None else 'K'}, "
                         f"{width}), got {tuple(out.shape)}")
    err = C.errors_arg(errors, pool.errors, dev)
    C.check_outputs((("out", out), ("errors", C.counter(errors, pool))),
                    (("slots", s), ("n_entries", ne), ("valid_mask", v)), C.owned(pool, "pool"))
    if dev is None:
        rows, n = ref.paged_gather_dense_batch(pool.reference_view(), s, ne, Kk, v, name, index=index)
        C.add_errors(err, n)
        return D.from_numpy(rows, slots, torch_dtype=name, out=out)
    if out is None:
        out = get_runtime(dev).empty((B, Kk, width), C.torch_dtype(name), stream=stream)
    _dense_launch(pool, index, s, ne, v, 0, 0, B, Kk, out, err, stream)
    return out


def gather_dense(pool, slot, n_entries, *, out=None, dtype=None, errors=None, stream=None):
    """Entries 0 .. n_entries-1 of the request in `slot` (host ints) as rows
    (n_entries, head_dim) of `dtype` (HCA reader; reference.paged_gather_dense).
    n_entries > pool.n_entries(slot) (more than the prepared steps make; 0
    for a free slot) is a ValueError. An entry >= pool.written[slot] (not
    flushed yet) or whose block is out of range is a zero row and adds 1 to
    errors. One launch, capturable with out=."""
    return _dense_one(pool, slot, n_entries, out, dtype, errors, stream, index=False)


def gather_dense_batch(pool, slots, n_entries, *, max_entries=None, out=None, valid_mask=None,
                       dtype=None, errors=None, stream=None):
    """Batched gather_dense with device-side lengths: out[b, j] = entry j of
    the request in slots[b] for j < n_entries[b], zero rows (not counted) for
    j >= n_entries[b]. slots, n_entries (B,) int32 on the device; out
    (B, K, head_dim) (or max_entries=K for a new one). n_entries[b] < 0 or
    > K adds 1 to errors and gathers the first min(n, K) entries; entries
    j >= pool.written[slot] and bad slots/blocks: zero rows, 1 error each.
    valid_mask False: zero rows (reference.paged_gather_dense_batch)."""
    return _dense_batch(pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors,
                        stream, index=False)


def gather_index_keys(pool, slot, n_entries, *, out=None, dtype=None, errors=None, stream=None):
    """CSA indexer keys of entries 0 .. n_entries-1 of the request in `slot`:
    (n_entries, index_head_dim) of `dtype` (rules of gather_dense)."""
    return _dense_one(pool, slot, n_entries, out, dtype, errors, stream, index=True)


def gather_index_keys_batch(pool, slots, n_entries, *, max_entries=None, out=None,
                            valid_mask=None, dtype=None, errors=None, stream=None):
    """Batched gather_index_keys, rules of gather_dense_batch:
    out (B, K, index_head_dim)."""
    return _dense_batch(pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors,
                        stream, index=True)


def _gather_topk_op(slots, topk_ids, n_entries, valid_mask, out, **pool):
    gather_topk(V.pool_view(**pool), slots, topk_ids, n_entries=n_entries, valid_mask=valid_mask, out=out)


def _dense_op(index: bool):
    def op(slot, n_entries, out, **pool):
        _dense_one(V.pool_view(**pool), slot, n_entries, out, None, None, None, index)
    return op


def _batch_op(index: bool):
    def op(slots, n_entries, valid_mask, out, **pool):
        _dense_batch(V.pool_view(**pool), slots, n_entries, None, valid_mask, out, None, None, None, index)
    return op


_READ = V.pool_schema(False)
GATHER_TOPK_OP = OpDecl("kv_gather_topk", _gather_topk_op, V.schema(
    _READ, "Tensor slots, Tensor topk_ids, Tensor? n_entries, Tensor? valid_mask, Tensor(!) out"))
# {index?: declaration}: the entries' and the indexer keys' gathers share their code
DENSE_OPS = {index: OpDecl(name, _dense_op(index), V.schema(_READ, "int slot, int n_entries, Tensor(!) out"))
             for index, name in ((False, "kv_gather_dense"), (True, "kv_gather_index_keys"))}
BATCH_OPS = {index: OpDecl(name, _batch_op(index), V.schema(
    _READ, "Tensor slots, Tensor n_entries, Tensor? valid_mask, Tensor(!) out"))
    for index, name in ((False, "kv_gather_dense_batch"), (True, "kv_gather_index_keys_batch"))}
