"""No request reads another's entries (pool.marks), duplicate targets are
deterministic (the lowest row wins), and a pool's buffers are checked once
and fixed (docs/kvcache.md, "Stale entries", "Duplicates", "Pool buffers").

Each case runs on a CPU pool (the reference) and, with the `cuda` fixture,
on a CUDA pool, where it must give the same bytes and the same counts.
"""
from __future__ import annotations

import numpy as np
import pytest

from rawkv.reference import kvcache as ref
from rawkv.reference.formats import bf16_round

kc = pytest.importorskip("rawkv.kvcache")

D, DI = ref.HEAD_DIM, ref.INDEX_HEAD_DIM
F32 = np.float32


class _Dev:
    """Host arrays -> the device's arguments, and results -> float32 numpy."""

    def __init__(self, device):
        self.cuda = device != "cpu"
        self.device = device
        if self.cuda:
            import torch
            self.torch = torch

    def t(self, a):
        a = np.ascontiguousarray(a)
        return self.torch.from_numpy(a).cuda() if self.cuda else a

    def bf(self, a):
        return self.t(np.asarray(a, F32)).bfloat16() if self.cuda else np.asarray(a, F32)

    def host(self, x):
        return x.float().cpu().numpy() if self.cuda else np.asarray(x, F32)

    def buf(self, x):
        return x.cpu().numpy() if self.cuda else np.array(x)


def _churn_step(p, step):
    """One step of the reuse scenario: every fourth step frees the oldest
    request, the pool is refilled to 3 requests, and positions scattered
    over 24 tokens are prepared. Returns (slots, positions)."""
    if step % 4 == 3:
        for s in p.active_slots()[:1]:
            p.free_request(s)
    while len(p.active_slots()) < 3:
        p.add_request()
    slots = np.array(p.active_slots(), np.int32)
    pos = np.array([(step * 5 + 3 * i) % 24 for i in range(slots.size)], np.int32)
    p.prepare_step(slots, pos)
    return slots, pos


def _bf16_rows(rng, n, w):
    return bf16_round((rng.standard_normal((n, w)) * 2).astype(F32))


def _decoded(ents, keys=None):
    """What a float32 gather returns for entries written from these rows."""
    codes, scale, rope = ref.fp8_entry_quantize(ents)
    rows = ref.fp8_entry_dequantize(codes, scale, rope, "float32")
    if keys is None:
        return rows, None
    return rows, ref.indexer_key_dequantize(*ref.indexer_key_quantize(keys), "float32")


# ---------------------------------------------------------------------------
# Item 4: only entries this request wrote
# ---------------------------------------------------------------------------
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


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_reused_slot_carries_no_state(rng, kind):
    _check_reused_slot("cpu", rng, kind)


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
def test_gpu_reused_slot_carries_no_state(cuda, rng, kind):
    """The CUDA pool empties the slot of its attached states on the stream
    (free_request): B's entries are the twin's, bit for bit (same kernel,
    same inputs), and nothing is counted."""
    _check_reused_slot("cuda", rng, kind)


def _free_empties_slot(device):
    """free_request empties the freed slot of every attached state (both
    streams, count) and no other slot."""
    dv = _Dev(device)
    pool = kc.PagedKVPool("csa", 8, 4, 2, 2, layout="rawkv", device=device)
    st, ist = kc.DecodeState("csa", 2, device=device), kc.DecodeState("csa", 2, DI, device=device)
    pool.attach(st, ist)
    for s in (pool.add_request(), pool.add_request()):
        for state in (st, ist):
            x = np.ones((6, state.width), F32)
            kc.state_seed(state, s, dv.t(x), dv.t(x))       # a b-stream and 2 rows
    pool.free_request(0)
    for state in (st, ist):
        r = state.to_reference()
        assert list(r.count) == [0, 2]
        assert not r.a_kv[0].any() and np.isneginf(r.a_z[0]).all()
        assert not r.b_kv[0].any() and np.isneginf(r.b_z[0]).all()
        assert r.b_kv[1].all() and r.a_kv[1, :2].all()


def test_cpu_free_request_empties_the_attached_states_slot():
    _free_empties_slot("cpu")


def test_gpu_free_request_empties_the_attached_states_slot(cuda):
    _free_empties_slot("cuda")


def test_attach_rules():
    """pool.attach takes empty DecodeStates of the pool's size and device,
    once per pool; compress_decode refuses a state that is not attached."""
    pool = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
    for bad in (pool.to_reference(), pool, None):
        with pytest.raises(TypeError, match="^state: "):
            pool.attach(bad)
    with pytest.raises(ValueError, match="^state: has 3 slots"):
        pool.attach(kc.DecodeState("hca", 3, device="cpu"))
    used = kc.DecodeState("hca", 2, device="cpu")
    kc.state_seed(used, 1, np.ones((5, D), F32), np.ones((5, D), F32))
    with pytest.raises(ValueError, match="^state: holds rows"):
        pool.attach(used)
    kc.state_clear(used, np.array([1], np.int32))
    pool.attach(used)
    pool.attach(used)                                   # again: nothing changes
    assert pool._states == [used]
    other = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="^state: is attached to another pool"):
        other.attach(used)
    csa = kc.PagedKVPool("csa", 8, 4, 2, 2, layout="rawkv", device="cpu")
    b_only = kc.DecodeState("csa", 2, device="cpu")
    b_only.z_b[0, 0] = 0.0                              # a b-stream row, count 0
    with pytest.raises(ValueError, match="^state: holds rows"):
        csa.attach(b_only)
    lone = kc.DecodeState("hca", 2, device="cpu")
    s = pool.add_request()
    pool.prepare_step([s], [127])
    with pytest.raises(ValueError, match="^state: is not attached to this pool"):
        kc.compress_decode(pool, lone, np.ones(D, F32), np.ones(1, bool), np.zeros(1, np.int32),
                           np.zeros(1, np.int32))
    assert pool.read_errors() == 0 and not pool.written.any()


# ---------------------------------------------------------------------------
# Item 6: duplicates, the lowest row wins
# ---------------------------------------------------------------------------
def _dup_flush_case(rng):
    """Rows aimed at 3 entries, several rows each, interleaved with good
    and bad rows. Returns the pool's shape and the batch."""
    m = ref.CSA_RATIO
    slots = np.array([0, 1, 0, 0, 1, 2, 0, 1, 9, 0], np.int32)
    ent = np.array([0, 2, 0, 1, 2, 3, 0, 2, 0, 1])
    pos = (ent * m + rng.integers(0, m, ent.size)).astype(np.int32)
    valid = np.array([False, True, True, True, True, True, True, True, True, True])
    return slots, pos, valid


def _dup_pool(device):
    p = kc.PagedKVPool("csa", 8, 2, 3, 2, layout="rawkv", device=device)
    for _ in range(3):
        p.add_request()
    p.prepare_step([0, 1, 2], [15, 15, 15])
    return p


def test_cpu_flush_duplicates_lowest_row_wins(rng):
    p = _dup_pool("cpu")
    slots, pos, valid = _dup_flush_case(rng)
    rows, keys = _bf16_rows(rng, slots.size, D), _bf16_rows(rng, slots.size, DI)
    kc.flush_write(p, rows, valid, slots, pos, index_keys=keys)
    # owners: (0, e0) row 2 (row 0 is invalid), (1, e2) row 1, (0, e1) row 3, (2, e3) row 5;
    # rows 4, 6, 7, 9 are duplicates and row 8's slot is out of range
    assert p.read_errors() == 5
    got = kc.gather_topk(p, np.array([0, 1, 2], np.int32), np.array([[0, 1], [2, -1], [3, -1]], np.int32),
                         dtype="float32")
    want, wkeys = _decoded(rows, keys)
    for (i, j), r in {(0, 0): 2, (0, 1): 3, (1, 0): 1, (2, 0): 5}.items():
        np.testing.assert_array_equal(got[i, j].view(np.uint32), want[r].view(np.uint32))
    k = kc.gather_index_keys(p, 0, 2, dtype="float32")
    np.testing.assert_array_equal(k[0].view(np.uint32), wkeys[2].view(np.uint32))


def test_gpu_flush_duplicates_deterministic_and_reference(cuda, rng):
    """20 launches of a batch full of duplicates: identical bytes every time
    (no torn entry), equal to the CPU pool's (the reference's rule)."""
    import torch
    slots, pos, valid = _dup_flush_case(rng)
    rows, keys = _bf16_rows(rng, slots.size, D), _bf16_rows(rng, slots.size, DI)
    cpu = _dup_pool("cpu")
    kc.flush_write(cpu, rows, valid, slots, pos, index_keys=keys)
    want = cpu.to_reference()
    dv = _Dev("cuda")
    args = (dv.bf(rows), dv.t(valid), dv.t(slots), dv.t(pos))
    for run in range(20):
        p = _dup_pool("cuda")
        kc.flush_write(p, *args, index_keys=dv.bf(keys))
        got = p.to_reference()
        for name in ("kv_fp8", "kv_scale", "kv_rope", "idx_q", "idx_sf", "written", "marks"):
            np.testing.assert_array_equal(getattr(got, name).view(np.uint8), getattr(want, name).view(np.uint8),
                                          err_msg=f"run {run}: {name}")
        assert p.read_errors() == cpu.read_errors() == 5
    torch.cuda.synchronize()


def _state_dups(device, rng, kind):
    """state_append / csa_rotate / hca_reset / state_clear with duplicate
    slots: the state after each op, and each op's count."""
    dv = _Dev(device)
    st = kc.DecodeState(kind, 3, 128, device=device)
    w = st.width
    slots = np.array([1, 0, 1, 1, 7, 0, 2, 1], np.int32)
    valid = np.array([False, True, True, True, True, True, True, True])
    out = []
    for step in range(st.m + 1):
        kv = rng.standard_normal((slots.size, w)).astype(F32)
        z = rng.standard_normal((slots.size, w)).astype(F32)
        st.reset_errors()
        kc.state_append(st, dv.t(kv), dv.t(z), dv.t(valid), dv.t(slots))
        out.append((st.to_reference().copy(), st.read_errors()))
    st.reset_errors()
    (kc.csa_rotate if kind == "csa" else kc.hca_reset)(st, dv.t(valid), dv.t(slots))
    out.append((st.to_reference().copy(), st.read_errors()))
    st.reset_errors()
    kc.state_clear(st, dv.t(slots))
    out.append((st.to_reference().copy(), st.read_errors()))
    return out


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_state_duplicates_lowest_row_wins(rng, kind):
    seed = int(rng.integers(1 << 30))
    res = _state_dups("cpu", np.random.default_rng(seed), kind)
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    # append: rows 2 (slot 1), 1 (slot 0), 6 (slot 2) own their slots; rows 3, 5, 7 are
    # duplicates, row 4 is out of range (rows 0: invalid)
    st, err = res[0]
    assert err == 4 and list(st.count) == [1, 1, 1]
    again = np.random.default_rng(seed)
    kv = again.standard_normal((8, res[0][0].a_kv.shape[2])).astype(F32)
    np.testing.assert_array_equal(st.a_kv[1, 0], kv[2])
    full, err = res[m]                                  # m appends: full windows
    assert list(full.count) == [m, m, m]
    st, err = res[m]
    assert err == 4 + 3                                 # the full windows refuse the owners too
    rot, err = res[m + 1]
    assert err == 4 and list(rot.count) == [0, 0, 0]
    clr, err = res[m + 2]
    assert err == 5                                     # no valid_mask: row 0 owns slot 1 now


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_state_duplicates_match_the_reference(cuda, rng, kind):
    """Repeated runs give the same state and counts, equal to the CPU's."""
    seed = int(rng.integers(1 << 30))
    want = _state_dups("cpu", np.random.default_rng(seed), kind)
    for run in range(5):
        got = _state_dups("cuda", np.random.default_rng(seed), kind)
        for i, ((a, ea), (b, eb)) in enumerate(zip(got, want)):
            assert ea == eb, f"run {run} op {i}: errors"
            for name in ("a_kv", "a_z", "b_kv", "b_z", "count"):
                x, y = getattr(a, name), getattr(b, name)
                if x is not None:
                    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8),
                                                  err_msg=f"run {run} op {i}: {name}")


def _decode_dups(device, rng, kind):
    """compress_decode with two rows on the same slot and position (the
    same entry) and one on the same slot at another entry's position."""
    dv = _Dev(device)
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    pool = kc.PagedKVPool(kind, 9, 2, 3, 3, layout="rawkv", device=device)
    st = kc.DecodeState(kind, 3, device=device)
    ist = kc.DecodeState("csa", 3, DI, device=device) if kind == "csa" else None
    pool.attach(*(x for x in (st, ist) if x is not None))
    for s in range(3):
        pool.add_request()
    pool.prepare_step([0, 1, 2], [5 * m - 1] * 3)
    for state in (st, ist):
        if state is None:
            continue
        for s in range(3):                             # m - 1 rows of window 1
            kv = rng.standard_normal((2 * m - 1, state.width)).astype(F32)
            kc.state_seed(state, s, dv.t(kv), dv.t(kv * 0.5))
        kv = rng.standard_normal((3, state.width)).astype(F32)
        kc.state_append(state, dv.t(kv), dv.t(kv), dv.t(np.ones(3, bool)),  # its last row: complete
                        dv.t(np.arange(3, dtype=np.int32)))
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(F32)
    slots = np.array([1, 0, 1, 1, 2], np.int32)
    pos = np.array([2 * m - 1, m - 1, 2 * m - 1, 3 * m - 1, 2 * m - 1], np.int32)
    index = None if ist is None else kc.DecodeIndex(ist, dv.t((1 + 0.1 * rng.standard_normal(DI)).astype(F32)))
    kc.compress_decode(pool, st, dv.t(nw), dv.t(np.ones(5, bool)), dv.t(slots), dv.t(pos), index=index)
    return pool


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_compress_decode_duplicates_counted(rng, kind):
    pool = _decode_dups("cpu", rng, kind)
    # row 2 repeats row 0's (slot 1, entry 1): skipped and counted; row 3 is entry 2
    assert pool.read_errors() == 1
    np.testing.assert_array_equal(pool.written, [1, 3, 2])
    rows = kc.gather_topk(pool, np.array([1], np.int32), np.array([[0, 1, 2]], np.int32))
    assert pool.read_errors() == 2 and np.asarray(rows)[0, 1:].any()   # entry 0 of slot 1: not written


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_compress_decode_duplicates_deterministic(cuda, rng, kind):
    """The kernel's bytes are those of the CPU run (compressor tolerance
    aside, which test_kvcache_compress covers): here the same marks,
    written[] and counts on every run, and identical bytes run to run."""
    seed = int(rng.integers(1 << 30))
    cpu = _decode_dups("cpu", np.random.default_rng(seed), kind).to_reference()
    first = None
    for run in range(10):
        p = _decode_dups("cuda", np.random.default_rng(seed), kind)
        got = p.to_reference()
        assert p.read_errors() == 1
        np.testing.assert_array_equal(got.written, cpu.written)
        np.testing.assert_array_equal(got.marks, cpu.marks)
        if first is None:
            first = got
        for name in ("kv_fp8", "kv_scale", "kv_rope"):
            np.testing.assert_array_equal(getattr(got, name).view(np.uint8), getattr(first, name).view(np.uint8),
                                          err_msg=f"run {run}: {name}")


# ---------------------------------------------------------------------------
# Item 5: the pool's buffers are checked once and fixed
# ---------------------------------------------------------------------------
def test_pool_buffers_are_fixed_after_construction():
    p = kc.PagedKVPool("csa", 4, 2, 2, 2, layout="rawkv", device="cpu")
    for name in p.BUFFERS:
        with pytest.raises(AttributeError, match=f"^{name}: "):
            setattr(p, name, getattr(p, name))
    st = kc.DecodeState("hca", 2, 128, device="cpu")
    with pytest.raises(AttributeError, match="^count: "):
        st.count = np.zeros(2, np.int64)
    p.kind_note = 1                                   # other attributes stay free
    p.fp8[...] = 0                                    # writing into a buffer is fine


def test_ops_take_only_a_pool():
    """A look-alike carrying the pool's buffer names is not a pool."""
    from types import SimpleNamespace
    p = kc.PagedKVPool("hca", 4, 2, 2, 2, layout="rawkv", device="cpu")
    fake = SimpleNamespace(**{n: getattr(p, n) for n in p.BUFFERS}, kind="hca", m=128)
    with pytest.raises(TypeError, match="^pool: "):
        kc.flush_write(fake, np.zeros((1, D), F32), np.ones(1, bool), np.zeros(1, np.int32),
                       np.zeros(1, np.int32))
    with pytest.raises(TypeError, match="^pool: "):
        kc.gather_topk(fake, np.zeros(1, np.int32), np.zeros((1, 1), np.int32))
    kv = np.zeros((128, D), F32)
    with pytest.raises(TypeError, match="^pool: "):
        kc.compress_prefill(fake, kv, kv, None, np.ones(D, F32), 0)
    st = kc.DecodeState("hca", 2, device="cpu")
    with pytest.raises(TypeError, match="^pool: "):
        kc.compress_decode(fake, st, np.ones(D, F32), np.ones(1, bool), np.zeros(1, np.int32),
                           np.zeros(1, np.int32))


def _view_args(kind="csa"):
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import views as V
    p = kc.PagedKVPool(kind, 4, 2, 3, 2, layout="rawkv", device="cpu")
    args = dict(V.pool_args(p))
    return torch, V, p, args


@pytest.mark.parametrize("name, make", [
    ("block_table", lambda t, a: a["block_table"].to(t.int64)),
    ("scale", lambda t, a: a["scale"][:, :1].contiguous()),
    ("scale", lambda t, a: a["scale"][:3].contiguous()),
    ("rope", lambda t, a: a["rope"][:, :1].contiguous()),
    ("index_sf", lambda t, a: a["index_sf"][..., :4].contiguous()),
    ("index_q", lambda t, a: a["index_q"][:2].contiguous()),
    ("written", lambda t, a: a["written"][:2].contiguous()),
    ("written", lambda t, a: a["written"].to(t.int64)),
    ("marks", lambda t, a: a["marks"][:, :1].contiguous()),
    ("marks", lambda t, a: a["marks"].to(t.int32)),
    ("request_ids", lambda t, a: a["request_ids"][:2].contiguous()),
    ("request_ids", lambda t, a: a["request_ids"].to(t.int64)),
    ("owners", lambda t, a: a["owners"][:3].contiguous()),
    ("owners", lambda t, a: a["owners"].to(t.uint8)),
    ("fp8", lambda t, a: a["fp8"].to(t.int8)),
    ("errors", lambda t, a: a["errors"].to(t.int64)),
])
def test_pool_view_refuses_bad_buffers_naming_them(name, make):
    """What torch.ops.rawkv.kv_* receive is rebuilt into a pool by
    views.pool_view, which checks it as the constructor would: a wrong dtype
    (an int64 block table) or an undersized buffer is refused, named."""
    torch, V, p, args = _view_args()
    args[name] = make(torch, args)
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        V.pool_view(**args)
    # and through the operator
    import rawkv.library  # noqa: F401
    ents = torch.zeros((1, D), dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=f"{name}: "):
        torch.ops.rawkv.kv_flush_write(**args, entries=ents, valid_mask=torch.ones(1, dtype=torch.bool),
                                       slots=torch.zeros(1, dtype=torch.int32),
                                       positions=torch.zeros(1, dtype=torch.int32),
                                       index_keys=torch.zeros((1, DI), dtype=torch.bfloat16))
    assert not p.fp8.any() and not p.written.any()     # nothing written


def test_gpu_pool_view_refuses_buffers_on_another_device(cuda):
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import views as V
    p = kc.PagedKVPool("csa", 4, 2, 3, 2, layout="rawkv", device="cuda")
    for name in ("block_table", "marks", "scale"):
        args = dict(V.pool_args(p))
        args[name] = args[name].cpu()
        with pytest.raises(ValueError, match=f"^{name}: "):
            V.pool_view(**args)
    args = dict(V.pool_args(p))
    args["block_table"] = args["block_table"].long()
    with pytest.raises(TypeError, match="^block_table: "):
        V.pool_view(**args)
