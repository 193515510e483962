"""Gathers: pool entries (or CSA indexer keys) back to rows
(rkv_kv_gather, rkv_kv_gather_index).

Every gather bounds entry ids by pool.written[slot] (reference.paged_*): an
id at or past it is a zero row and one error, so bytes an earlier request
left in a reused block are never returned.
"""
from __future__ import annotations

from .. import _args as A
from .._op import empty, op
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
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
    C.pool(pool)
    name = C.out_dtype(dtype, out)
    operands = V.pool_operands(pool, errors)
    if out is None:
        # (the width of the pool's buffers, not pool.head_dim: V.widths)
        out = empty(topk_ids, (*A.out_lead(topk_ids, "topk_ids"), V.widths(operands)[0]), name, stream)
    _gather_topk(*operands, slots, topk_ids, n_entries, valid_mask, out, stream=stream, pool=pool, dtype=name)
    return out


def gather_dense(pool, slot, n_entries, *, out=None, dtype=None, errors=None, stream=None):
    """Entries 0 .. n_entries-1 of the request in `slot` (host ints) as rows
    (n_entries, head_dim) of `dtype` (HCA reader; reference.paged_gather_dense).
    n_entries > pool.n_entries(slot) (more than the prepared steps make; 0
    for a free slot) is a ValueError. An entry >= pool.written[slot] (not
    flushed yet) or whose block is out of range is a zero row and adds 1 to
    errors. One launch, capturable with out=."""
    return _dense_one(_gather_dense, pool, slot, n_entries, out, dtype, errors, stream, False)


def gather_dense_batch(pool, slots, n_entries, *, max_entries=None, out=None, valid_mask=None,
                       dtype=None, errors=None, stream=None):
    """Batched gather_dense with device-side lengths: out[b, j] = entry j of
    the request in slots[b] for j < n_entries[b], zero rows (not counted) for
    j >= n_entries[b]. slots, n_entries (B,) int32 on the device; out
    (B, K, head_dim) (or max_entries=K for a new one). n_entries[b] < 0 or
    > K adds 1 to errors and gathers the first min(n, K) entries; entries
    j >= pool.written[slot] and bad slots/blocks: zero rows, 1 error each.
    valid_mask False: zero rows (reference.paged_gather_dense_batch)."""
    return _dense_batch(_gather_dense_batch, pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors,
                        stream, False)


def gather_index_keys(pool, slot, n_entries, *, out=None, dtype=None, errors=None, stream=None):
    """CSA indexer keys of entries 0 .. n_entries-1 of the request in `slot`:
    (n_entries, index_head_dim) of `dtype` (rules of gather_dense)."""
    return _dense_one(_gather_index_keys, pool, slot, n_entries, out, dtype, errors, stream, True)


def gather_index_keys_batch(pool, slots, n_entries, *, max_entries=None, out=None,
                            valid_mask=None, dtype=None, errors=None, stream=None):
    """Batched gather_index_keys, rules of gather_dense_batch:
    out (B, K, index_head_dim)."""
    return _dense_batch(_gather_index_keys_batch, pool, slots, n_entries, max_entries, valid_mask, out, dtype,
                        errors, stream, True)


def _width(operands, index: bool):
    """The row width of a dense gather, from the pool's buffers (V.widths;
    None: the pool has no indexer keys, which the op refuses by name)."""
    return V.widths(operands)[1 if index else 0]


def _dense_one(call, pool, slot, n_entries, out, dtype, errors, stream, index):
    """gather_dense / gather_index_keys (`call`, their op): a new out (a
    numpy array for a CPU pool, as the reference returns) unless given."""
    C.pool(pool)
    name = C.out_dtype(dtype, out)
    operands = V.pool_operands(pool, errors)
    width = _width(operands, index)
    n_entries = A.as_number(n_entries)     # (a NumPy int sizes out as the int it holds)
    if out is None and width is not None and C.is_size(n_entries):
        # before allocating (10**8 was a MemoryError): at most what a request
        # can hold (static sizes only: traced by torch.compile, the count of
        # the slot's entries, a tensor, would be data-dependent; the op checks it)
        C.host_int("n_entries", n_entries, 0, pool.max_blocks_per_request * pool.entries_per_block + 1)
        out = empty(pool.block_table, (n_entries, width), name, stream)
    call(*operands, slot, n_entries, out, stream=stream, pool=pool, dtype=name)
    return out


def _dense_batch(call, pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors, stream, index):
    """gather_dense_batch / gather_index_keys_batch (`call`): out, or a new
    (B, max_entries, width) one (max_entries is the public op's)."""
    C.pool(pool)
    if out is None and max_entries is None:
        raise ValueError("max_entries: required when out is not given")
    name = C.out_dtype(dtype, out)
    if max_entries is not None:
        max_entries = C.host_int("max_entries", max_entries, 0)
    operands = V.pool_operands(pool, errors)
    width, s = _width(operands, index), A.dims(slots)
    o = A.dims(out) if out is not None else ()
    if max_entries is not None and len(o) == 3 and o[1] != max_entries:
        # (the operator has no max_entries: the body's rule tying out's K to
        # it sees it only from an eager call, so a compiled call took any K)
        raise ValueError(f"out: expected shape ({s[0] if len(s) == 1 else 'B'}, {max_entries}, "
                         f"{width if width is not None else 'width'}), got {o}")
    if out is None and width is not None and len(s) == 1:
        # before allocating (10**13 was a MemoryError): the op's own limit
        C.launch_rows("max_entries", s[0] * max_entries * (width // 16 if index else 1))
        out = empty(slots, (s[0], max_entries, width), name, stream)
    call(*operands, slots, n_entries, valid_mask, out, stream=stream, pool=pool, dtype=name, max_entries=max_entries)
    return out


# ---- the ops ----------------------------------------------------------------------------------
# A body takes the schema's arguments as *args (the pool's buffers first:
# V.pool_of) and, from an eager call, the pool itself and the public op's
# dtype name (a numpy float32 out holds bfloat16); with checks_only it
# checks them and stops (rawkv.kvcache.traced: the operator's fake
# implementation checks a traced call's real tensors that way).
_READ = V.pool_schema(False)


@op("kv_gather_topk", V.schema(_READ, "Tensor slots, Tensor topk_ids, Tensor? n_entries, Tensor? valid_mask, "
                                      "Tensor(!) out"))
def _gather_topk(*args, stream=None, pool=None, dtype=None, checks_only=False):
    """rawkv::kv_gather_topk: the selected entries into out."""
    pool, errors, (slots, topk_ids, n_entries, valid_mask, out) = V.pool_of(args, pool)
    where, ids, s, ne, v, out, name, err = C.topk(pool, errors, slots, topk_ids, n_entries, valid_mask, out,
                                                  dtype)
    if checks_only:
        return
    if where == "cpu":
        rows, n = ref.paged_gather_topk(pool.reference_view(), *A.host(s, ids, ne, v), dtype=name)
        C.add_errors(err, n)
        A.from_numpy(rows, out, torch_dtype=name, out=out)
        return
    B, Kk = ids.shape
    rt = get_runtime(pool.device_index)
    rt.run(P.gather(rt, pool, ids, s, ne, v, out, err, B, Kk), stream)


def _run_dense(pool, index, slots, n_entries, valid, slot0, n0, B, Kk, out, err, stream):
    """One dense launch: rows of `slots` (or of slot0 when None), lengths
    n_entries (or n0), entries or (index) indexer keys."""
    if B * Kk == 0:
        return
    rt = get_runtime(pool.device_index)
    plan = (P.gather_index(rt, pool, slots, n_entries, valid, out, err, B, Kk, slot0, n0) if index else
            P.gather(rt, pool, None, slots, n_entries, valid, out, err, B, Kk, slot0, n0))
    rt.run(plan, stream)


def _dense_op(name: str, index: bool):
    """rawkv::kv_gather_dense / kv_gather_index_keys: one body, the entries'
    or (index) the indexer keys' rows."""
    @op(name, V.schema(_READ, "Scalar slot, Scalar n_entries, Tensor(!) out"))
    def body(*args, stream=None, pool=None, dtype=None, checks_only=False):
        pool, errors, (slot, n_entries, out) = V.pool_of(args, pool)
        where, slot, n, out, dname, err = C.dense(pool, errors, slot, n_entries, out, dtype, index)
        if checks_only:
            return
        if where == "cpu":
            rows, ne = ref.paged_gather_dense(pool.reference_view(), slot, n, dname, index=index)
            C.add_errors(err, ne)
            A.from_numpy(rows, out, torch_dtype=dname, out=out)
            return
        _run_dense(pool, index, None, None, None, slot, n, 1, n, out, err, stream)
    body.__doc__ = f"rawkv::{name}: entries 0 .. n_entries-1 of a slot into out."
    return body


def _batch_op(name: str, index: bool):
    """rawkv::kv_gather_dense_batch / kv_gather_index_keys_batch."""
    @op(name, V.schema(_READ, "Tensor slots, Tensor n_entries, Tensor? valid_mask, Tensor(!) out"))
    def body(*args, stream=None, pool=None, dtype=None, max_entries=None, checks_only=False):
        pool, errors, (slots, n_entries, valid_mask, out) = V.pool_of(args, pool)
        where, s, ne, v, out, Kk, dname, err = C.dense_batch(pool, errors, slots, n_entries, valid_mask, out,
                                                            dtype, index, max_entries)
        if checks_only:
            return
        if where == "cpu":
            rows, n = ref.paged_gather_dense_batch(pool.reference_view(), *A.host(s, ne), Kk, *A.host(v), dname,
                                                   index=index)
            C.add_errors(err, n)
            A.from_numpy(rows, out, torch_dtype=dname, out=out)
            return
        _run_dense(pool, index, s, ne, v, 0, 0, s.shape[0], Kk, out, err, stream)
    body.__doc__ = f"rawkv::{name}: entries 0 .. n_entries[b]-1 of each row's slot into out."
    return body


_gather_dense = _dense_op("kv_gather_dense", False)
_gather_index_keys = _dense_op("kv_gather_index_keys", True)
_gather_dense_batch = _batch_op("kv_gather_dense_batch", False)
_gather_index_keys_batch = _batch_op("kv_gather_index_keys_batch", True)
