"""The pool's gathers: gather_topk, gather_dense, gather_dense_batch, gather_index_keys,
gather_index_keys_batch (rawkv/kvcache/gather.py, rawkv/cu/kv_cache.cu): the
reference's bounds (n_entries, written[], marks) and counts, batches, the
output rules, the kernels against the reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv import _args as dispatch  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from rawkv.reference.formats import bf16_round  # noqa: E402
from support.kvcache import (  # noqa: E402
    F32, assert_pool_equal, assert_same, bf16_values, _cpu_pool_with_requests, _fill_pool_random,
    _gpu_pool, _random_rows, _slot_pool, _small_hca_pool, table_rows, _torch,
)
from support.kvcache_properties import (  # noqa: E402
    BAD_ERRORS, BAD_SLOTS, batches, counted, _errors, errors_ok, faults, good_slots, kv_kinds, _owned_view,
    pick, picks, pool_layouts, _rows, _scene, slot_array,
)
from support.outputs import _refused, _ro  # noqa: E402
from support.properties import SETTINGS, dtype_of, host, judge, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def test_gather_out_of_range_skipped_and_counted(rng):
    m, epb, nb = 4, 2, 6
    pool = ref.PagedPoolRef.create(nb, epb, m, index_head_dim=128)
    table = np.array([4, 1, -1], np.int64)              # entries 0-3 real, 4-5 unmapped
    entries = bf16_round(_random_rows(rng, 4, 512))
    ref.flush_write(pool, entries, np.ones(4, bool), np.arange(4) * m, np.tile(table, (4, 1)),
                    bf16_round(_random_rows(rng, 4, 128)))
    want = ref.fp8_entry_dequantize(*ref.fp8_entry_quantize(entries))
    rows, err = ref.gather_dense(pool, table, 4)
    assert err == 0 and np.array_equal(rows, want)
    rows, err = ref.gather_dense(pool, table, 7)               # 4, 5: block -1; 6: past table
    assert err == 3 and np.array_equal(rows[:4], want) and not rows[4:].any()
    ids = np.array([[3, -1, 0, -2, 5, 2, 9]])
    rows, err = ref.gather_topk(pool, table[None], ids)
    assert err == 3                                            # -2, 5 (block -1), 9
    assert np.array_equal(rows[0, [0, 2, 5]], want[[3, 0, 2]])
    assert not rows[0, [1, 3, 4, 6]].any()
    rows, err = ref.gather_topk(pool, table[None], np.array([[3, 2, 1]]), n_entries=np.array([2]))
    assert err == 2 and np.array_equal(rows[0, 2], want[1]) and not rows[0, :2].any()
    # written: entries past what the request wrote are zero rows, one error each
    for fn, w in ((ref.gather_dense, want), (ref.gather_index_keys, None)):
        rows, err = fn(pool, table, 4, written=2)
        assert err == 2 and not rows[2:].any()
        if w is not None:
            assert np.array_equal(rows[:2], w[:2])
    with pytest.raises(ValueError, match="n_entries"):
        ref.gather_index_keys(pool, table, -1)


def test_paged_gathers_are_bounded_by_written(rng):
    pool = _slot_pool(rng)
    pool.written[:] = [3, 1, 0]
    table = pool.block_table.astype(np.int64)
    slots = np.array([0, 1, 2, 7], np.int32)
    ids = np.array([[0, 1, 2, 3, -1], [0, 1, 2, -1, -1], [0, -1, -1, -1, -1], [0, -1, -1, -1, -1]])
    rows, err = ref.paged_gather_topk(pool, slots, ids)
    # slot 0: id 3 >= written 3; slot 1: ids 1, 2 >= written 1; slot 2: written 0; slot 7: no slot
    assert err == 5
    want, _ = ref.gather_topk(pool, table[[0, 1]], ids[:2], np.array([3, 1]))
    assert np.array_equal(rows[:2], want, equal_nan=True) and not rows[2:].any()
    rows, err = ref.paged_gather_topk(pool, slots, ids, n_entries=np.array([2, 9, 9, 9], np.int32),
                                      valid_mask=np.array([True, True, False, True]))
    assert err == 2 + 2 + 1                                    # min(n_entries, written); slot 2 masked
    assert not rows[2].any()
    rows, err = ref.paged_gather_dense(pool, 0, 3)
    want, _ = ref.gather_dense(pool, table[0], 3)
    assert err == 0 and np.array_equal(rows, want, equal_nan=True)
    rows, err = ref.paged_gather_dense(pool, 1, 2, index=True)
    assert err == 1 and not rows[1].any()                      # entry 1: not written


def test_paged_gather_dense_batch_rules(rng):
    pool = _slot_pool(rng)
    pool.written[:] = [4, 1, 0]
    slots = np.array([0, 0, 0, 1, 5], np.int32)
    n = np.array([2, -1, 9, 1, 1], np.int32)
    rows, err = ref.paged_gather_dense_batch(pool, slots, n, 3)
    # n = -1 and n = 9 > K each count once (9: then 3 entries, 0..2, are gathered); slot 5: 1
    assert err == 3
    want, _ = ref.gather_dense(pool, pool.block_table[0], 3)
    assert np.array_equal(rows[0, :2], want[:2], equal_nan=True) and not rows[0, 2:].any()
    assert not rows[1].any() and np.array_equal(rows[2], want, equal_nan=True)
    rows, err = ref.paged_gather_dense_batch(pool, slots, n, 3, valid_mask=np.array([1, 0, 0, 1, 0], bool))
    assert err == 0 and not rows[[1, 2, 4]].any()
    keys, err = ref.paged_gather_dense_batch(pool, slots[:1], n[:1], 3, index=True)
    assert keys.shape == (1, 3, 128) and err == 0


def test_cpu_batch_gathers():
    rng = np.random.default_rng(5)
    p, slots = _cpu_pool_with_requests("csa", rng)
    ents = bf16_values(rng, (8, 512))
    keys = bf16_values(rng, (8, 128))
    p.prepare_step(slots[:2], [15, 15])
    kc.flush_write(p, ents, np.ones(8, bool), np.array(slots[:2] * 4, np.int32),
                   np.array([0, 0, 4, 4, 8, 8, 12, 12], np.int32), index_keys=keys)
    assert p.read_errors() == 0
    np.testing.assert_array_equal(p.written[slots[:2]], [4, 4])
    sl = np.array([slots[0], slots[1], -3], np.int32)
    ne = np.array([3, 7, 1], np.int32)
    out = kc.gather_dense_batch(p, sl, ne, max_entries=5, valid_mask=np.array([True, True, True]))
    assert out.shape == (3, 5, 512)
    assert_same(out[0, :3], kc.gather_dense(p, slots[0], 3))
    assert_same(out[1, :4], kc.gather_dense(p, slots[1], 4))
    assert (out[0, 3:] == 0).all() and (out[2] == 0).all() and (out[1, 4] == 0).all()
    # errors: n=7 > K=5 (1), slot -3 -> 1 entry (1), entry 4 of slots[1] not written (1)
    assert p.read_errors() == 3
    with pytest.raises(ValueError, match="n_entries"):
        kc.gather_dense(p, slots[1], 5)                # more than the slot holds: host-known
    ko = kc.gather_index_keys_batch(p, sl[:2], ne[:2], max_entries=4)
    assert_same(ko[1], kc.gather_index_keys(p, slots[1], 4))


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
def test_gathers_refuse_read_only_or_overlapping_outputs():
    p, s = _small_hca_pool()
    kc.flush_write(p, np.ones((1, p.head_dim), np.float32), np.ones(1, bool), np.array([s], np.int32),
                   np.array([0], np.int32))
    ids = np.zeros((1, 2), np.int32)
    slots = np.array([s], np.int32)
    out = np.zeros((1, 2, p.head_dim), np.float32)
    _refused("out", None, lambda: kc.gather_topk(p, slots, ids, dtype="float32", out=_ro(out.copy())))
    _refused("errors", None, lambda: kc.gather_topk(p, slots, ids, dtype="float32", errors=_ro(np.zeros(1, np.int32))))
    _refused("errors", "out", lambda: kc.gather_topk(p, slots, ids, dtype="float32", out=out,
                                                     errors=out.reshape(-1)[7:8].view(np.int32)))
    ids_in_out = out.reshape(-1)[:2].view(np.int32).reshape(1, 2)
    _refused("out", "topk_ids", lambda: kc.gather_topk(p, slots, ids_in_out, dtype="float32", out=out))
    dense = np.zeros((1, p.head_dim), np.float32)
    _refused("errors", "out", lambda: kc.gather_dense(p, s, 1, dtype="float32", out=dense,
                                                      errors=dense[0, :1].view(np.int32)))
    batch = np.zeros((1, 1, p.head_dim), np.float32)
    _refused("out", None, lambda: kc.gather_dense_batch(p, slots, np.ones(1, np.int32), dtype="float32",
                                                        out=_ro(batch)))
    idx = np.zeros((1, 2), np.int32)
    _refused("out", "topk_ids", lambda: kc.kvcache_indices(p, slots, idx, out=idx))
    assert not out.any() and not dense.any()


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
DENSE_OPS = {"dense": (kc.gather_dense, False), "index_keys": (kc.gather_index_keys, True),
             "dense_batch": (kc.gather_dense_batch, False), "index_keys_batch": (kc.gather_index_keys_batch, True)}


OUT_DTYPES = [None, None, "bfloat16", "float16", "float32"]


def test_outputs_in_another_objects_buffers_are_refused():
    """An out= or errors= in the buffers of another pool or decode state than
    the one the op works on is refused by name before anything is written:
    the eager ops took one (gather_topk(a, ..., errors=b.request_ids) added
    its count to b's request ids), where the operators' path refused it
    (pool.check_counter_owner). Another object's counter, whole, is a
    counter; the layout ops, which work on no object, refuse any buffer."""
    a, s = _small_hca_pool()
    b, _ = _small_hca_pool()
    st = kc.DecodeState("hca", 2, device="cpu")
    kc.flush_write(a, np.ones((1, a.head_dim), np.float32), np.ones(1, bool), np.array([s], np.int32),
                   np.array([0], np.int32))
    ids, slots = np.zeros((1, 2), np.int32), np.array([s], np.int32)
    before = [np.array(x).copy() for x in (b.request_ids, b.written, st.count, b.block_table)]
    for errors, role in ((b.request_ids, "request_ids"), (b.written[:1], "written"), (st.count[:1], "count")):
        with pytest.raises(ValueError, match=rf"^errors: lies in the {role} buffer of another "):
            kc.gather_topk(a, slots, ids, dtype="float32", errors=errors)
    with pytest.raises(ValueError, match=r"^out: lies in the block_table buffer of another PagedKVPool"):
        kc.kvcache_indices(a, slots, ids, out=b.block_table[:1, :2])
    with pytest.raises(ValueError, match=r"^out: lies in the block_table buffer of a PagedKVPool"):
        kc.topk_to_kvcache_indices(ids, a.block_table, page_size=a.entries_per_block, num_pages=a.num_blocks,
                                   out=b.block_table[:1, :2])
    with pytest.raises(ValueError, match=r"^errors: lies in the written buffer of a PagedKVPool"):
        kc.topk_to_kvcache_indices(ids, a.block_table, page_size=a.entries_per_block, num_pages=a.num_blocks,
                                   errors=b.written[:1])
    assert all(np.array_equal(np.array(x), y) for x, y in
               zip((b.request_ids, b.written, st.count, b.block_table), before))
    e = b.read_errors()
    kc.gather_topk(a, slots, ids, dtype="float32", errors=b.errors)    # another pool's counter: taken
    assert b.read_errors() == e


def _out(fault, i, seed, shape, name, lib, ok, pool):
    """A gather's out=: None, or (ok) one of `shape` and dtype `name` (a
    numpy float32 for bfloat16 when lib is numpy); fault 'out': of another
    shape or dtype, read-only, or a view of the pool's float32 buffer (the
    RoPE dims of a 'rawkv' pool on the CPU)."""
    if fault == "out":
        kind = pick(["shape", "dtype", "read-only", "number", "owned"], i)
        if kind == "owned" and pool.rope is not None:
            return _owned_view(pool.rope, shape, lib)
        if kind == "read-only":
            o = np.zeros(shape, np.float32 if name in ("bfloat16", "float32") else np.float16)
            o.flags.writeable = False
            return o
        if kind == "number":
            return 0.0
        dt = name if kind == "shape" else ("float64" if name != "float16" else "float32")
        return _rows(seed, shape[:-1] + (shape[-1] + (kind == "shape"),), dt, lib)
    return _rows(seed, shape, name if name != "bfloat16" or lib == "torch" else "float32", lib) if ok else None


@settings(SETTINGS, max_examples=200)
@given(seed=seeds, op=st.sampled_from(sorted(DENSE_OPS)), kind=kv_kinds, layout=pool_layouts,
       slot=good_slots, n=st.sampled_from([4, 4, 3, 2, 1, 0]), b=batches, max_entries=st.sampled_from([None, 0, 3, 5]),
       lib=libs, dtype=st.sampled_from(OUT_DTYPES), out=st.booleans(), errors=errors_ok,
       fault=faults("slot", "n_entries", "slots", "max_entries", "dtype", "out", "out", "errors"), i=picks)
def test_kvcache_gather_dense(seed, op, kind, layout, slot, n, b, max_entries, lib, dtype, out, errors, fault, i):
    """gather_dense / gather_index_keys (host slot and length; more than the
    slot's prepared entries is refused) and their batched forms (device
    slots and lengths) on a CPU pool, against the reference on a copy:
    entries past written[], the unwritten entry 2 of slot 0 and free slots
    are zero rows and counted errors."""
    from rawkv.reference import kvcache as RKV
    fn, index = DENSE_OPS[op]
    p, _, _ = _scene(seed, kind, layout)
    batch = op.endswith("batch")
    width = p.index_head_dim if index and p.has_index else p.head_dim
    if not batch:
        n = min(n, p._n_entries[slot] if isinstance(slot, (int, np.integer)) and 0 <= slot < 3 else 0)
    slot = pick(BAD_SLOTS, i) if fault == "slot" else slot
    n = pick([-1, True, 2.0, None, 7], i) if fault == "n_entries" else n
    slots = slot_array(seed + 1, b, pick(["int64", "float32"], i) if fault == "slots" else "int32", lib)
    ne = make(seed + 2, (b,), "int32", lib, lo=-1, hi=6)
    if max_entries is None and not out:
        max_entries = 3
    max_entries = pick([-1, 2.0, True], i) if fault == "max_entries" else max_entries
    dtype = pick(["float64", "int32", np.float32, "bf16"], i) if fault == "dtype" else dtype
    name = dtype if isinstance(dtype, str) and fault != "dtype" else "bfloat16"
    k = max_entries if isinstance(max_entries, int) and not isinstance(max_entries, bool) and max_entries >= 0 else 3
    ln = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0
    o = _out(fault, i, seed + 3, (b, k, width) if batch else (ln, width), name, lib, out, p)
    err = _errors(pick(BAD_ERRORS, i) if fault == "errors" else errors, seed + 4, lib, p)
    if fault in (("slot", "n_entries") if batch else ("slots", "max_entries")):
        fault = None                                # not this op's argument
    want, errors0 = p.to_reference(), p.read_errors()
    if batch:
        call = lambda: fn(p, slots, ne, max_entries=max_entries, out=o, dtype=dtype, errors=err)  # noqa: E731
    else:
        call = lambda: fn(p, slot, n, out=o, dtype=dtype, errors=err)  # noqa: E731

    def reference():
        dt = dtype or (dtype_of(o) if dispatch.is_torch(o) else "bfloat16")
        if batch:
            kk = max_entries if max_entries is not None else o.shape[1]
            rows, ne_ = RKV.paged_gather_dense_batch(want, host(slots), host(ne), kk, None, dt, index=index)
        else:
            rows, ne_ = RKV.paged_gather_dense(want, int(slot), int(n), dt, index=index)
        got = counted(err, p, errors0)
        assert got == ne_, f"errors: {got} counted, the reference {ne_}"
        return rows
    judge(call, ("pool", "slot", "n_entries", "slots", "max_entries", "out", "dtype", "errors"), reference, fault)


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
def _table(pool):
    return pool.block_table.cpu().numpy().astype(np.int64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_gpu_gather_topk_bit_exact(cuda, dtype, id_dtype, rng):
    torch = _torch()
    p, slots = _gpu_pool("csa", rng)
    _fill_pool_random(p, rng)
    tab = _table(p)
    B, K = 7, 37
    sl = np.array(slots + [-1, p.max_requests, slots[1]], np.int32)[:B]
    hi = p.max_blocks_per_request * p.entries_per_block + 3
    ids = rng.integers(-3, hi, size=(B, K)).astype(np.int64)
    ids[rng.random((B, K)) < 0.15] = -1
    ids[0, :3] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max, 0]
    if id_dtype == "int64":
        ids[1, :2] = [1 << 40, -(1 << 40)]
    ne = rng.integers(0, hi, size=B).astype(np.int32)
    ne[0] = -1
    valid = rng.random(B) < 0.8
    # entries written per slot: ids at or past it are errors (stale bytes)
    wr = rng.integers(0, hi, size=p.max_requests).astype(np.int32)
    wr[slots[1]] = hi
    p.written.copy_(torch.from_numpy(wr))
    wr_b = np.array([wr[x] if 0 <= x < p.max_requests else 0 for x in sl], np.int64)
    want = p.to_reference()
    for use_ne in (True, False):
        for use_valid in (True, False):
            vm = valid if use_valid else np.ones(B, bool)
            sel = np.flatnonzero(vm)
            exp = np.zeros((B, K, 512), F32)
            lim = np.minimum(ne[sel], wr_b[sel]) if use_ne else wr_b[sel]
            r, nerr = ref.gather_topk(want, table_rows(tab, sl[sel]), ids[sel], lim, dtype=dtype)
            exp[sel] = r
            out = torch.full((B, K, 512), float("nan"), dtype=getattr(torch, dtype), device="cuda")
            p.reset_errors()
            res = kc.gather_topk(p, torch.from_numpy(sl).cuda(), torch.from_numpy(ids.astype(id_dtype)).cuda(),
                                 n_entries=torch.from_numpy(ne).cuda() if use_ne else None,
                                 valid_mask=torch.from_numpy(vm).cuda() if use_valid else None, out=out)
            assert res is out
            assert_same(out.float().cpu().numpy(), exp, f"gather_topk ne={use_ne} valid={use_valid}")
            assert p.read_errors() == nerr
    # new output, dtype inferred
    res = kc.gather_topk(p, torch.from_numpy(sl).cuda(), torch.from_numpy(ids.astype(id_dtype)).cuda(),
                         dtype=getattr(torch, dtype))
    assert res.dtype == getattr(torch, dtype) and res.shape == (B, K, 512)
    assert_pool_equal(p.to_reference(), want, "pool after gathers")


def _cpu_twin(pool):
    """A CPU pool holding the same bytes as a GPU pool (the CPU ops run the
    reference, so GPU == twin is GPU == reference)."""
    ihd = pool.index_head_dim
    c = kc.PagedKVPool(pool.kind, pool.num_blocks, pool.entries_per_block, pool.max_requests,
                       pool.max_blocks_per_request, head_dim=pool.head_dim, rope_dim=pool.rope_dim,
                       index_head_dim=ihd, layout="rawkv", device="cpu")
    r = pool.to_reference()
    c.fp8[...], c.scale[...], c.rope[...] = r.kv_fp8, r.kv_scale, r.kv_rope
    if ihd:
        c.index_q[...], c.index_sf[...] = r.idx_q, r.idx_sf
    c.block_table[...] = pool.block_table.cpu().numpy()
    c.written[...] = pool.written.cpu().numpy()
    c.marks[...] = pool.marks.cpu().numpy()
    c.request_ids[...] = pool.request_ids.cpu().numpy()
    c.owners[...] = pool.owners.cpu().numpy()
    c._n_entries[...] = pool._n_entries      # the host counts the dense gathers check
    c._active[...] = pool._active
    return c


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_gather_dense_and_index_keys(cuda, dtype, rng):
    torch = _torch()
    p, slots = _gpu_pool("csa", rng)
    _fill_pool_random(p, rng)
    # written: some slots below what they hold (their tail is an error), some at it
    hold = np.array([p._n_entries[s] for s in range(p.max_requests)], np.int64)
    wr = np.minimum(hold, rng.integers(0, hold.max() + 1, size=p.max_requests)).astype(np.int32)
    wr[slots[0]] = hold[slots[0]]
    p.written.copy_(torch.from_numpy(wr))
    twin = _cpu_twin(p)
    tdt = getattr(torch, dtype)
    # single request: every slot (the last one free), lengths up to what it holds
    for s in slots + [p.max_requests - 1]:
        have = int(hold[s])
        for fn in (kc.gather_dense, kc.gather_index_keys):
            with pytest.raises(ValueError, match="n_entries"):
                fn(p, s, have + 1)
        for n in sorted({0, min(1, have), min(7, have), have}):
            for index in (False, True):
                fn = kc.gather_index_keys if index else kc.gather_dense
                p.reset_errors()
                twin.reset_errors()
                got = fn(p, s, n, dtype=dtype)
                want = fn(twin, s, n, dtype=dtype)
                assert got.dtype == tdt
                assert_same(got.float().cpu().numpy(), want, f"{fn.__name__} slot {s} n {n}")
                assert p.read_errors() == twin.read_errors()
                out = torch.full(tuple(got.shape), 7.0, dtype=tdt, device="cuda")
                assert fn(p, s, n, out=out) is out
                assert_same(out.float().cpu().numpy(), want)
    # batched, device lengths
    B, K = 6, 9
    sl = np.array(slots + [-2, slots[0]], np.int32)
    ne = np.array([3, K, 12, 20, 4, -1], np.int32)
    valid = np.array([True, True, False, True, True, True])
    for index in (False, True):
        fn = kc.gather_index_keys_batch if index else kc.gather_dense_batch
        width = 128 if index else 512
        for vm in (None, valid):
            p.reset_errors()
            twin.reset_errors()
            out = torch.full((B, K, width), float("nan"), dtype=tdt, device="cuda")
            fn(p, torch.from_numpy(sl).cuda(), torch.from_numpy(ne).cuda(), out=out,
               valid_mask=None if vm is None else torch.from_numpy(vm).cuda())
            want = fn(twin, sl, ne, max_entries=K, valid_mask=vm, dtype=dtype)
            assert_same(out.float().cpu().numpy(), want, f"{fn.__name__}")
            assert p.read_errors() == twin.read_errors() > 0


# ---------------------------------------------------------------------------
# the operators: kv_gather_dense / kv_gather_index_keys
# ---------------------------------------------------------------------------
def test_compiled_and_operator_dense_gathers_bound_n_entries_as_eagerly():
    """gather_dense(pool, slot, n) with n past pool.n_entries(slot) is refused
    under torch.compile and through torch.ops.rawkv.* on the pool's buffers as
    eagerly (docs/kvcache.md, "What a view cannot check"). Before, the
    operator's view of the buffers had no host count: compiled
    gather_dense(p, 0, 9) on a slot of 8 prepared entries returned 9 rows."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("rawkv.library")         # (torch.ops.rawkv.*)
    from rawkv.kvcache import views as V
    p = kc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    p.add_request()
    p.prepare_step([0], [8 * p.m - 1])
    rule = "^n_entries: 9 entries asked of slot 0, which holds 8 after the steps prepared so far"
    for fn, width in ((kc.gather_dense, p.head_dim), (kc.gather_index_keys, p.index_head_dim)):
        with pytest.raises(ValueError, match=rule):
            fn(p, 0, 9)
        torch._dynamo.reset()
        step = torch.compile(lambda n: fn(p, 0, n), fullgraph=True, backend="eager")
        assert np.array_equal(step(8).float().numpy(), fn(p, 0, 8))
        # (refused while dynamo traces the call, n now symbolic: the eager error
        # inside torch's TorchRuntimeError; rawkv.kvcache.traced)
        with pytest.raises(Exception, match=rule[1:]):
            step(9)
        op = getattr(torch.ops.rawkv, "kv_gather_index_keys" if fn is kc.gather_index_keys else "kv_gather_dense")
        out = torch.full((9, width), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rule):
            op(*V.pool_operands(p), 0, 9, out)
        assert (out == 7).all()
    # the count is the pool's as it is now, not as it was when the step was traced
    p.prepare_step([0], [12 * p.m - 1])
    assert step(9).shape == (9, p.index_head_dim)
    with pytest.raises(ValueError, match="^n_entries: 13 entries asked of slot 0, which holds 12"):
        step(13)
    # a view over an engine's own buffers (no pool's) has no host count: the kernel's bound alone
    mine = {k: t.clone() if hasattr(t, "clone") else t for k, t in V.pool_args(p).items() if k != "kind"}
    mine["errors"].zero_()
    out = torch.full((13, p.head_dim), 7.0, dtype=torch.bfloat16)
    torch.ops.rawkv.kv_gather_dense(p.kind, **mine, slot=0, n_entries=13, out=out)
    assert (out == 0).all() and int(mine["errors"][0]) == 13


def test_compiled_batch_gathers_refuse_an_out_that_is_not_max_entries_wide():
    """gather_dense_batch / gather_index_keys_batch with max_entries= and an
    out= of another K are refused under torch.compile as eagerly, before
    anything is written. The operator has no max_entries (the body's rule
    saw it only from an eager call), so a compiled call took out's K: a
    (2, 4, width) out with max_entries=3 gathered 4 entries per row where
    the eager op refused it. Found by a review."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("rawkv.library")         # (torch.ops.rawkv.*)
    p = kc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    p.add_request()
    p.prepare_step([0], [8 * p.m - 1])
    sl, ne = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([2, 5], dtype=torch.int32)
    rule = r"out: expected shape \(2, 3, {}\), got \(2, 4, {}\)"
    for fn, width in ((kc.gather_dense_batch, p.head_dim), (kc.gather_index_keys_batch, p.index_head_dim)):
        out = torch.full((2, 4, width), 7.0, dtype=torch.bfloat16)
        p.reset_errors()
        with pytest.raises(ValueError, match="^" + rule.format(width, width)):
            fn(p, sl, ne, max_entries=3, out=out)
        torch._dynamo.reset()
        step = torch.compile(lambda s, n, o: fn(p, s, n, max_entries=3, out=o), fullgraph=True,
                             backend="aot_eager")
        # (raised while dynamo traces: fullgraph reports it as an "Observed exception")
        with pytest.raises(Exception, match=rule.format(width, width)):
            step(sl, ne, out)
        assert (out == 7).all() and p.read_errors() == 0
        good = torch.empty((2, 3, width), dtype=torch.bfloat16)
        assert torch.equal(step(sl, ne, good), fn(p, sl, ne, max_entries=3))
