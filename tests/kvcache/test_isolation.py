"""No request reads another's entries (pool.marks, written[]): not after free and
block reuse, not when a prefill starts mid request, not with many requests
churning, and a reused slot carries no decode state (docs/kvcache.md,
"Stale entries"). Duplicate targets: each op's file.

Each case runs on a CPU pool (the reference) and, with the `cuda` fixture,
on a CUDA pool, where it must give the same bytes and the same counts."""

from __future__ import annotations

import numpy as np
import pytest

from rawkv import kvcache as kc
from rawkv.reference import kvcache as ref
from support.kvcache import (
    D, DI, F32, _Dev, assert_same, _bf16_rows, bf16_values, _churn_step, _decoded, _torch,
)


def _stale_after_reuse(device, rng):
    """Request A writes 4 entries and is freed; B gets A's block back (LIFO)
    with A's bytes still in it. No gather may return them as B's entries:
    every one is a zero row and counted, until B writes its own."""
    cuda = device != "cpu"
    if cuda:
        torch = _torch()
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
        bf = lambda a: t(a).bfloat16()  # noqa: E731
        host = lambda x: x.float().cpu().numpy()  # noqa: E731
    else:
        t = bf = host = lambda a: a  # noqa: E731
    p = kc.PagedKVPool("csa", 4, 4, 2, 2, layout="rawkv", device=device)
    a = p.add_request()
    p.prepare_step([a], [15])                                  # entries 0..3: one block
    ents, keys = bf16_values(rng, (4, 512)), bf16_values(rng, (4, 128))
    kc.flush_write(p, bf(ents), t(np.ones(4, bool)), t(np.full(4, a, np.int32)),
                   t(np.arange(4, dtype=np.int32) * 4), index_keys=bf(keys))
    mine = host(kc.gather_topk(p, t(np.array([a], np.int32)), t(np.array([[1, 2, 3]], np.int32))))
    assert mine.any() and p.read_errors() == 0                 # A reads its own entries
    blocks = p.blocks_of(a)
    p.free_request(a)
    b = p.add_request()
    p.prepare_step([b], [0])
    assert p.blocks_of(b) == blocks                            # A's bytes are still there
    sl = t(np.array([b], np.int32))
    rows = host(kc.gather_topk(p, sl, t(np.array([[1, 2, 3]], np.int32))))
    assert not rows.any() and p.read_errors() == 3
    p.reset_errors()
    rows = host(kc.gather_dense_batch(p, sl, t(np.array([4], np.int32)), max_entries=4))
    assert not rows.any() and p.read_errors() == 4
    p.reset_errors()
    rows = host(kc.gather_index_keys_batch(p, sl, t(np.array([4], np.int32)), max_entries=4))
    assert not rows.any() and p.read_errors() == 4
    p.reset_errors()
    for fn in (kc.gather_dense, kc.gather_index_keys):         # host-known length: refused
        with pytest.raises(ValueError, match="n_entries"):
            fn(p, b, 1)
    # B writes entry 0: exactly that one becomes readable
    p.prepare_step([b], [3])
    kc.flush_write(p, bf(ents[3:]), t(np.ones(1, bool)), sl, t(np.array([3], np.int32)),
                   index_keys=bf(keys[3:]))
    rows = host(kc.gather_topk(p, sl, t(np.array([[0, 1]], np.int32))))
    assert_same(rows[0, 0], mine[0, 2], "B's entry 0")         # A's entry 3 had the same input
    assert not rows[0, 1].any() and p.read_errors() == 1
    assert_same(host(kc.gather_dense(p, b, 1)), mine[0, 2:], "gather_dense of B")


def test_cpu_no_stale_entries_after_free_and_reuse(rng):
    _stale_after_reuse("cpu", rng)


def test_gpu_no_stale_entries_after_free_and_reuse(cuda, rng):
    _stale_after_reuse("cuda", rng)


def _prefill_starts_mid_request(device, rng, kind):
    """The issue's case: request A prefills 6 entries and is freed; B gets
    A's blocks back and prefills from entry 3 on. Entries 0..2 lie below B's
    high-water mark but B never wrote them: zero rows, counted, on every
    gather; entries 3..5 are B's."""
    dv = _Dev(device)
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    coff = 2 if kind == "csa" else 1
    pool = kc.PagedKVPool(kind, 4, 2, 2, 4, layout="rawkv", device=device)
    n = 6
    T = n * m
    kv = rng.standard_normal((T, coff * D)).astype(F32)
    z = rng.standard_normal((T, coff * D)).astype(F32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(F32)
    idx = None
    if kind == "csa":
        idx = kc.PrefillIndex(dv.t(rng.standard_normal((T, 2 * DI)).astype(F32)),
                              dv.t(rng.standard_normal((T, 2 * DI)).astype(F32)), None,
                              dv.t((1 + 0.1 * rng.standard_normal(DI)).astype(F32)))
    a = pool.add_request()
    pool.prepare_step([a], [T - 1])
    assert kc.compress_prefill(pool, dv.t(kv), dv.t(z), None, dv.t(nw), a, index=idx) == n
    ids = dv.t(np.arange(n, dtype=np.int32)[None])
    theirs = dv.host(kc.gather_topk(pool, dv.t(np.array([a], np.int32)), ids))
    assert pool.read_errors() == 0 and np.abs(theirs).sum(axis=-1).all()
    blocks = pool.blocks_of(a)
    pool.free_request(a)
    b = pool.add_request()
    pool.prepare_step([b], [T - 1])
    assert pool.blocks_of(b) == blocks                 # A's bytes are in B's blocks
    start = 3
    lo = (start - 1) * m if kind == "csa" else start * m   # CSA: the window before the first entry
    bidx = None if idx is None else kc.PrefillIndex(idx.kv[lo:], idx.z[lo:], None, idx.norm_weight)
    got = kc.compress_prefill(pool, dv.t(kv[lo:]), dv.t(z[lo:]), None, dv.t(nw), b, start_entry=start,
                              index=bidx)
    assert got == n - start and int(dv.buf(pool.written)[b]) == n
    sl = dv.t(np.array([b], np.int32))
    rows = dv.host(kc.gather_topk(pool, sl, ids))
    assert not rows[0, :start].any() and pool.read_errors() == start
    # the same inputs, from the same window on, make the same entries
    np.testing.assert_array_equal(rows[0, start:].view(np.uint32), theirs[0, start:].view(np.uint32))
    pool.reset_errors()
    dense = dv.host(kc.gather_dense_batch(pool, sl, dv.t(np.array([n], np.int32)), max_entries=n))
    assert not dense[0, :start].any() and pool.read_errors() == start
    np.testing.assert_array_equal(dense[0, start:].view(np.uint32), rows[0, start:].view(np.uint32))
    if kind == "csa":
        pool.reset_errors()
        keys = dv.host(kc.gather_index_keys_batch(pool, sl, dv.t(np.array([n], np.int32)), max_entries=n))
        assert not keys[0, :start].any() and keys[0, start:].any() and pool.read_errors() == start
    pool.reset_errors()
    with pytest.raises(ValueError, match="n_entries"):
        kc.gather_dense(pool, b, n + 1)                 # host-known length (unchanged rule)
    d1 = dv.host(kc.gather_dense(pool, b, n))
    assert not d1[:start].any() and pool.read_errors() == start


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_prefill_starting_mid_request_reads_no_stale_entry(rng, kind):
    _prefill_starts_mid_request("cpu", rng, kind)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_prefill_starting_mid_request_reads_no_stale_entry(cuda, rng, kind):
    _prefill_starts_mid_request("cuda", rng, kind)


def _many_requests(device, rng, steps=60):
    """Requests of random lengths come and go over many steps, each writing
    one entry per step at a random position (skipping entries now and then,
    rewriting one sometimes); blocks are reused as soon as they are freed.
    After every step each active request's gathers return exactly the
    entries it wrote (an independent model: entry id -> the row it wrote)
    and zero rows counted for every other id."""
    dv = _Dev(device)
    m, epb, R, MB = ref.CSA_RATIO, 2, 4, 4
    pool = kc.PagedKVPool("csa", R * MB, epb, R, MB, layout="rawkv", device=device)
    cap = MB * epb                                   # entries a request can hold
    model = {}                                       # slot -> {entry id: (row, key)}
    reused = 0
    for step in range(steps):
        for s in list(model):
            if rng.random() < 0.12:
                pool.free_request(s)
                del model[s]
        while len(model) < R and rng.random() < 0.7:
            model[pool.add_request()] = {}
        if not model:
            continue
        slots = np.array(sorted(model), np.int32)
        ents = []
        for s in slots:
            have = max(model[s], default=-1)
            e = int(rng.integers(max(have - 1, 0), min(have + 3, cap - 1) + 1))
            ents.append(e)
        ents = np.array(ents, np.int64)
        pos = (ents * m + rng.integers(0, m, ents.size)).astype(np.int32)
        before = set(pool.block_table_host().ravel().tolist())
        pool.prepare_step(slots, pos)
        reused += len(set(pool.block_table_host().ravel().tolist()) - before - {-1})
        rows, keys = _bf16_rows(rng, slots.size, D), _bf16_rows(rng, slots.size, DI)
        kc.flush_write(pool, dv.bf(rows), dv.t(np.ones(slots.size, bool)), dv.t(slots), dv.t(pos),
                       index_keys=dv.bf(keys))
        assert pool.read_errors() == 0
        for i, s in enumerate(slots):
            model[int(s)][int(ents[i])] = (rows[i], keys[i])
        # every active request, every id of its block table
        ids = np.tile(np.arange(cap, dtype=np.int32), (slots.size, 1))
        want = np.zeros((slots.size, cap, D), F32)
        wkey = np.zeros((slots.size, cap, DI), F32)
        for i, s in enumerate(slots):
            for e, (r, k) in model[int(s)].items():
                want[i, e], wkey[i, e] = (x[0] for x in _decoded(r[None], k[None]))
        missing = sum(cap - len(model[int(s)]) for s in slots)
        got = dv.host(kc.gather_topk(pool, dv.t(slots), dv.t(ids), dtype="float32"))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"step {step}")
        assert pool.read_errors() == missing, f"step {step}"
        pool.reset_errors()
        ne = np.array([max(model[int(s)]) + 1 for s in slots], np.int32)
        dense = dv.host(kc.gather_dense_batch(pool, dv.t(slots), dv.t(ne), max_entries=cap,
                                              dtype="float32"))
        mask = np.arange(cap)[None] < ne[:, None]
        np.testing.assert_array_equal(dense.view(np.uint32), np.where(mask[..., None], want, 0).view(np.uint32))
        assert pool.read_errors() == sum(int(n) - len(model[int(s)]) for s, n in zip(slots, ne))
        pool.reset_errors()
        k = dv.host(kc.gather_index_keys_batch(pool, dv.t(slots), dv.t(ne), max_entries=cap,
                                               dtype="float32"))
        np.testing.assert_array_equal(k.view(np.uint32), np.where(mask[..., None], wkey, 0).view(np.uint32))
        pool.reset_errors()
    assert reused > 0                                  # blocks did change owner


def test_cpu_many_requests_read_only_their_entries(rng):
    _many_requests("cpu", rng)


def test_gpu_many_requests_read_only_their_entries(cuda, rng):
    _many_requests("cuda", rng)


def test_gpu_marks_match_the_reference_after_reuse(cuda, rng):
    """A CUDA pool and a CPU pool driven by the same calls hold the same
    marks (prepare_step's device reset, the writers' set) and bytes."""
    pools = {d: kc.PagedKVPool("csa", 9, 2, 3, 3, layout="rawkv", device=d) for d in ("cpu", "cuda")}
    for step in range(12):
        rows, keys = _bf16_rows(rng, 3, D), _bf16_rows(rng, 3, DI)
        for dev, p in pools.items():
            dv = _Dev(dev)
            slots, pos = _churn_step(p, step)
            kc.flush_write(p, dv.bf(rows[:slots.size]), dv.t(np.ones(slots.size, bool)), dv.t(slots),
                           dv.t(pos), index_keys=dv.bf(keys[:slots.size]))
        a, b = pools["cpu"].to_reference(), pools["cuda"].to_reference()
        np.testing.assert_array_equal(a.marks, b.marks, err_msg=f"step {step}")
        np.testing.assert_array_equal(a.kv_fp8, b.kv_fp8)
        np.testing.assert_array_equal(a.written, b.written)


# ---------------------------------------------------------------------------
# Issue 21, item 4: a reused slot carries no decode state into its next request
# ---------------------------------------------------------------------------
def _slot_reuse(device, rng, kind):
    """Request A leaves a partial window (and, for CSA, a b-stream) in slot 0
    and is freed; B gets slot 0, prefills a prompt of 2 windows and is NOT
    admitted with state_seed (for HCA with such a prompt, seeding only
    empties the slot), appends one window and flushes. A twin pool whose
    states never held A gets the same calls. Returns (pool, state, twin,
    twin state) with B's entries written. Before the fix, B's entry 2 was
    pooled from A's rows (only state.errors showed it)."""
    dv = _Dev(device)
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    w = (2 if kind == "csa" else 1) * D
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(F32)
    inw = (1 + 0.1 * rng.standard_normal(DI)).astype(F32)
    rows = lambda n, width: rng.standard_normal((n, width)).astype(F32)  # noqa: E731
    setups = []
    for _ in range(2):
        pool = kc.PagedKVPool(kind, 8, 4, 2, 2, layout="rawkv", device=device)
        st = kc.DecodeState(kind, 2, device=device)
        ist = kc.DecodeState("csa", 2, DI, device=device) if kind == "csa" else None
        pool.attach(*(x for x in (st, ist) if x is not None))
        setups.append((pool, st, ist))
    one, s0 = dv.t(np.ones(1, bool)), dv.t(np.zeros(1, np.int32))
    # A, in the first pool only: a prompt of m + m // 2 rows seeded (a b-stream for CSA and a
    # partial window), then m // 4 decode rows appended
    pool, st, ist = setups[0]
    a = pool.add_request()
    for state, width in ((st, w), (ist, 2 * DI)):
        if state is not None:
            kc.state_seed(state, a, dv.t(rows(m + m // 2, width)), dv.t(rows(m + m // 2, width)))
            x = rows(m // 4, width)
            for r in range(m // 4):
                kc.state_append(state, dv.t(x[r:r + 1]), dv.t(x[r:r + 1]), one, s0)
    assert int(dv.buf(st.count)[a]) == m // 2 + m // 4
    pool.free_request(a)
    # B, in both pools: slot 0 again
    T = 2 * m
    kv, z, ikv, iz = rows(T + m, w), rows(T + m, w), rows(T + m, 2 * DI), rows(T + m, 2 * DI)
    for pool, st, ist in setups:
        b = pool.add_request()
        assert b == a
        pool.prepare_step([b], [T + m - 1])
        idx = None if ist is None else kc.PrefillIndex(dv.t(ikv[:T]), dv.t(iz[:T]), None, dv.t(inw))
        assert kc.compress_prefill(pool, dv.t(kv[:T]), dv.t(z[:T]), None, dv.t(nw), b, index=idx) == 2
        for t in range(T, T + m):                     # one decode window, flushed at its last row
            kc.state_append(st, dv.t(kv[t:t + 1]), dv.t(z[t:t + 1]), one, s0)
            if ist is not None:
                kc.state_append(ist, dv.t(ikv[t:t + 1]), dv.t(iz[t:t + 1]), one, s0)
            kc.compress_decode(pool, st, dv.t(nw), one, s0, dv.t(np.array([t], np.int32)),
                               index=None if ist is None else kc.DecodeIndex(ist, dv.t(inw)))
    return setups


def _check_reused_slot(device, rng, kind):
    """B's entries in the reused slot are the twin's (a pool where B never
    shared a slot), bit for bit, and nothing is counted."""
    (pool, st, ist), (twin, tst, tist) = _slot_reuse(device, rng, kind)
    a, b = pool.to_reference(), twin.to_reference()
    for name in ("kv_fp8", "kv_scale", "kv_rope", "idx_q", "idx_sf", "written", "marks"):
        if getattr(a, name) is not None:
            np.testing.assert_array_equal(getattr(a, name).view(np.uint8), getattr(b, name).view(np.uint8),
                                          err_msg=name)
    assert int(a.written[0]) == 3
    for x in (st, ist, pool):
        assert x is None or x.read_errors() == 0


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_reused_slot_carries_no_state(rng, kind):
    _check_reused_slot("cpu", rng, kind)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_reused_slot_carries_no_state(cuda, rng, kind):
    """The CUDA pool empties the slot of its attached states on the stream
    (free_request): B's entries are the twin's, bit for bit (same kernel,
    same inputs), and nothing is counted."""
    _check_reused_slot("cuda", rng, kind)
