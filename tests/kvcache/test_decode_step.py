"""The KV-cache ops together, as a decode step runs them: the CPU ops against direct
reference calls, a reference simulation of requests decoded token by token,
the same simulation through the ops on a CPU and a CUDA pool (a host
reference alongside), and a decode step captured in one CUDA graph."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rawkv
from rawkv import kvcache as kc
from rawkv.errors import CaptureError
from rawkv.reference import kvcache as ref
from rawkv.reference.formats import bf16_round
from support.kvcache import (
    F32, F64, assert_pool_equal, assert_same, assert_state_equal, bf16_values, _changed,
    _cpu_pool_with_requests, _csa_rows_f64, _fill_pool_random, _gpu_pool, _noisy_pool, _pool_f64,
    _random_rows, special_entries, special_keys, table_rows, _torch,
)


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def _cos(a, b):
    a, b = np.asarray(a, F64), np.asarray(b, F64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _entry_f64(kv, z, ape, weight, i, m, overlap, hadamard=False):
    """One compressed entry in float64: pool, RMSNorm, RoPE (complex pairs),
    optional Hadamard."""
    z = z.astype(F64) + ape.astype(F64)[np.arange(z.shape[0]) % m]
    d = weight.shape[0]
    if overlap:
        vals, scs = _csa_rows_f64(kv.astype(F64), z, i, m, d)
    else:
        vals, scs = kv[i * m:(i + 1) * m].astype(F64), z[i * m:(i + 1) * m]
    c = _pool_f64(vals, scs)
    y = c / np.sqrt(np.mean(c * c) + 1e-6) * weight.astype(F64)
    r = y[d - 64:]
    cplx = (r[0::2] + 1j * r[1::2]) * np.exp(1j * (i * m) * ref.rope_inv_freq().astype(F64))
    y[d - 64::2], y[d - 63::2] = cplx.real, cplx.imag
    if hadamard:
        n = y.shape[0]
        h = np.array([[1.0]])
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        y = h @ y / math.sqrt(n)
    return y


def _simulate(rng, kind, lengths, epb=4):
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    d, R = ref.HEAD_DIM, len(lengths)
    cw = 2 * d if kind == "csa" else d
    S = R + 3
    slots = rng.permutation(S)[:R]
    n_ent = [L // m for L in lengths]
    need = [-(-n // epb) for n in n_ent]
    width = max(need) + 1
    nb = sum(need) + 3                                   # 3 blocks nobody owns
    perm = rng.permutation(nb)
    table = np.full((R, width), -1, np.int64)
    k = 0
    for r in range(R):
        table[r, :need[r]] = perm[k:k + need[r]]
        k += need[r]
    kv = [_random_rows(rng, L, cw) for L in lengths]
    z = [_random_rows(rng, L, cw, 2.0) for L in lengths]
    ape = _random_rows(rng, m, cw)
    w = (1 + 0.2 * rng.standard_normal(d)).astype(F32)
    idx = kind == "csa"
    if idx:
        ikv = [_random_rows(rng, L, 256) for L in lengths]
        iz = [_random_rows(rng, L, 256, 2.0) for L in lengths]
        iape = _random_rows(rng, m, 256)
        iw = (1 + 0.2 * rng.standard_normal(128)).astype(F32)
        ist = ref.DecodeStateRef.create("csa", S, 128)
    pool = _noisy_pool(rng, nb, epb, m, index=idx)
    before = pool.copy()
    st = ref.DecodeStateRef.create(kind, S, d)
    assert ref.state_clear(st, slots) == 0
    pooled = [[] for _ in range(R)]
    for t in range(max(lengths)):
        act = np.array([t < L for L in lengths])
        pick = lambda rows: np.stack([rows[r][t] if t < lengths[r]  # noqa: E731
                                      else np.zeros(rows[r].shape[1], F32) for r in range(R)])
        assert ref.state_append(st, pick(kv), pick(z), act, slots, ape) == 0
        if idx:
            assert ref.state_append(ist, pick(ikv), pick(iz), act, slots, iape) == 0
        ready = act & (st.count[slots] == m)
        if not ready.any():
            continue
        p = ref.state_pool(st, slots)
        for r in np.flatnonzero(ready):
            pooled[r].append(p[r])
        eid = np.full(R, t // m)
        entries = ref.finish_entry(p, w, eid, m)
        keys = ref.finish_index_key(ref.state_pool(ist, slots), iw, eid) if idx else None
        snap = pool.copy()
        assert ref.flush_write(pool, entries, ready, np.full(R, t), table, keys) == 0
        # each ready request wrote its own entry t // m in its own block, and
        # nothing else changed (a write into another request's block fails here)
        e = t // m
        assert _changed(snap, pool) == {(int(table[r, e // epb]), e % epb) for r in np.flatnonzero(ready)}
        if idx:
            assert ref.csa_rotate(st, ready, slots) == 0
            assert ref.csa_rotate(ist, ready, slots) == 0
        else:
            assert ref.hca_reset(st, ready, slots) == 0
    # over the whole run, request r changed exactly its entries 0 .. n_ent[r]-1
    want = {(int(table[r, e // epb]), e % epb) for r in range(R) for e in range(n_ent[r])}
    assert _changed(before, pool) == want
    comp = ref.compress_csa if idx else ref.compress_hca
    for r in range(R):
        n = n_ent[r]
        # decode-path pooling is bit-identical to the prefill pooling
        pre = comp(kv[r], z[r], ape)
        assert pre.shape == (n, d)
        if n:
            assert np.array_equal(np.stack(pooled[r]), pre)
        rows, err = ref.gather_dense(pool, table[r], n)
        assert err == 0
        ent = ref.finish_entry(pre, w, np.arange(n), m)
        assert np.array_equal(rows, ref.fp8_entry_dequantize(*ref.fp8_entry_quantize(ent)))
        for i in range(n):
            want_row = _entry_f64(kv[r], z[r], ape, w, i, m, idx)
            assert _cos(rows[i], want_row) >= 0.999, (r, i, _cos(rows[i], want_row))
        if idx and n:
            ids = rng.integers(-1, n, (1, 5))
            got, err = ref.gather_topk(pool, table[r][None], ids, n_entries=np.array([n]))
            assert err == 0
            for j, e in enumerate(ids[0]):
                assert np.array_equal(got[0, j], rows[e] if e >= 0 else np.zeros(d))
            keys, err = ref.gather_index_keys(pool, table[r], n)
            assert err == 0
            want = ref.finish_index_key(comp(ikv[r], iz[r], iape), iw, np.arange(n))
            assert np.array_equal(keys, ref.indexer_key_dequantize(*ref.indexer_key_quantize(want)))
            for i in range(n):
                want_row = _entry_f64(ikv[r], iz[r], iape, iw, i, m, True, hadamard=True)
                assert _cos(keys[i], want_row) >= 0.99, (r, i, _cos(keys[i], want_row))


def test_decode_simulation_csa(rng):
    lengths = [int(x) for x in rng.integers(0, 90, 5)] + [4, 3]
    _simulate(rng, "csa", lengths)


def test_decode_simulation_hca(rng):
    lengths = [int(x) for x in rng.integers(100, 700, 4)] + [128, 127]
    _simulate(rng, "hca", lengths, epb=2)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_ops_match_reference(kind, rng):
    p, slots = _cpu_pool_with_requests(kind, rng)
    B = 6
    ents = special_entries(rng, B, 512)
    keys = special_keys(rng, B) if kind == "csa" else None
    sl = np.array([slots[0], slots[1], slots[2], -1, 9, slots[0]], np.int32)
    pos = np.array([0, p.m * 3 + 1, p.m, 0, 0, p.m * 100], np.int32)
    valid = np.array([True, True, True, True, True, False])
    want = p.to_reference()
    n = ref.flush_write(want, ents, valid, pos, table_rows(p.block_table, sl), keys)
    kc.flush_write(p, ents, valid, sl, pos, index_keys=keys)
    assert n == 2 and p.read_errors() == 2
    assert_pool_equal(p.reference_view(), want)
    # written: 1 + the highest entry each slot's valid, in-range rows wrote
    np.testing.assert_array_equal(p.written, [1, 4, 2, 0])
    # gathers: ids bound by min(n_entries, written)
    p.reset_errors()
    ids = np.array([[0, -1, 3, 1], [1, -2, 0, 5]], np.int64)
    rows = kc.gather_topk(p, np.array(slots[:2], np.int32), ids, n_entries=np.array([4, 4], np.int32))
    want_rows, werr = ref.gather_topk(want, table_rows(p.block_table, slots[:2]), ids, np.array([1, 4]))
    assert_same(rows, want_rows, "gather_topk")
    # slot 0: ids 3, 1 (past written); slot 1: -2, 5, and 1, 0 (below written[] = 4 but never
    # written: slot 1 wrote entry 3 only, so its block's marks are clear there)
    assert p.read_errors() == werr == 6
    d = kc.gather_dense(p, slots[1], 4, dtype="float32")
    wd, _ = ref.gather_dense(want, p.block_table[slots[1]], 4, dtype="float32")
    assert_same(d, wd, "gather_dense")
    if kind == "csa":
        k = kc.gather_index_keys(p, slots[1], 4)
        wk, _ = ref.gather_index_keys(want, p.block_table[slots[1]], 4)
        assert_same(k, wk, "gather_index_keys")
    # slot 2 wrote entry 1 only: entry 0 lies below the high-water mark but was
    # never written (its block's bytes may be a previous owner's): zero row, counted
    p.reset_errors()
    d = kc.gather_dense(p, slots[2], 3)
    wd, werr = ref.gather_dense(want, p.block_table[slots[2]], 3, written=2)
    assert werr == 2 and p.read_errors() == 2          # entry 0: not marked; entry 2: past written
    assert not np.asarray(d)[0].any() and np.asarray(d)[1].any()
    assert_same(d, wd, "gather_dense slot 2")
    # state
    st = kc.DecodeState(kind, 4, device="cpu")
    wst = ref.DecodeStateRef.create(kind, 4, 512)
    w = st.width
    for step in range(3):
        kv = rng.standard_normal((3, w)).astype(F32)
        z = rng.standard_normal((3, w)).astype(F32)
        ape = rng.standard_normal((p.m, w)).astype(F32)
        ss = np.array([0, 2, 5], np.int32)
        vm = np.array([True, step != 1, True])
        kc.state_append(st, kv, z, vm, ss, ape=ape)
        ref.state_append(wst, kv, z, vm, ss, ape=ape)
    assert st.read_errors() == 3
    if kind == "csa":
        kc.csa_rotate(st, np.array([True, False]), np.array([0, 2], np.int32))
        ref.csa_rotate(wst, np.array([True, False]), np.array([0, 2]))
    else:
        kc.hca_reset(st, np.array([True, True]), np.array([0, 4], np.int32))
        ref.hca_reset(wst, np.array([True, True]), np.array([0, 4]))
    kc.state_clear(st, np.array([2], np.int32))
    ref.state_clear(wst, np.array([2]))
    assert_state_equal(st.reference_view(), wst)


class _Sim:
    """Requests of different lengths decoded step by step through the ops;
    a host reference (PagedPoolRef + DecodeStateRef) runs alongside."""

    def __init__(self, kind, device, rng, *, head_dim, num_blocks, epb, max_requests, max_blocks,
                 lengths, check_every):
        self.kind, self.device, self.rng = kind, device, rng
        ihd = 128 if kind == "csa" else None
        self.pool = kc.PagedKVPool(kind, num_blocks, epb, max_requests, max_blocks,
                                   head_dim=head_dim, index_head_dim=ihd, layout="rawkv", device=device)
        self.state = kc.DecodeState(kind, max_requests, head_dim, device=device)
        self.rpool = ref.PagedPoolRef.create(num_blocks, epb, self.pool.m, head_dim, 64, ihd)
        self.rstate = ref.DecodeStateRef.create(kind, max_requests, head_dim)
        self.m, self.hd, self.w = self.pool.m, head_dim, self.state.width
        self.norm = (1.0 + 0.1 * rng.standard_normal(head_dim)).astype(F32)
        self.ape = (0.1 * rng.standard_normal((self.m, self.w))).astype(F32)
        self.pending = list(lengths)
        self.active = {}          # slot -> [request id, position, length]
        self.expect = {}          # request id -> list of decoded reference rows
        self.next_id = 0
        self.check_every = check_every
        self.cuda = device != "cpu"

    def t(self, a, dtype=None):
        if not self.cuda:
            return a
        import torch
        x = torch.from_numpy(np.ascontiguousarray(a)).cuda()
        return x.to(dtype) if dtype is not None else x

    def admit(self):
        while self.pending and self.pool.active_slots().__len__() < self.pool.max_requests:
            s = self.pool.add_request()
            kc.state_clear(self.state, self.t(np.array([s], np.int32)))
            ref.state_clear(self.rstate, np.array([s]))
            self.active[s] = [self.next_id, 0, self.pending.pop(0)]
            self.expect[self.next_id] = []
            self.next_id += 1

    def step(self, it):
        bf16 = _torch().bfloat16 if self.cuda else None
        self.admit()
        if not self.active:
            return False
        slots = np.array(sorted(self.active), np.int32)
        pos = np.array([self.active[s][1] for s in slots], np.int32)
        B = slots.size
        held = set(self.pool.block_table_host()[self.pool.block_table_host() >= 0].tolist())
        self.pool.prepare_step(slots, pos)
        # the blocks this step allocated change owner: the reference clears their marks too
        new = set(self.pool.block_table_host()[self.pool.block_table_host() >= 0].tolist()) - held
        ref.reset_marks(self.rpool, sorted(new))
        kv = (self.rng.standard_normal((B, self.w))).astype(F32)
        z = (self.rng.standard_normal((B, self.w))).astype(F32)
        use_bf16 = it % 3 == 1
        if use_bf16:
            kv, z = bf16_round(kv), bf16_round(z)
        ones = np.ones(B, bool)
        sl_t = self.t(slots)
        kv_t = self.t(kv, bf16 if use_bf16 else None)
        z_t = self.t(z, bf16 if use_bf16 else None)
        kc.state_append(self.state, kv_t, z_t, self.t(ones), sl_t, ape=self.t(self.ape))
        assert ref.state_append(self.rstate, kv, z, ones, slots, ape=self.ape) == 0
        # flush rows: windows that are complete (computed on the device, as a step would)
        full_ref = self.rstate.count[slots] == self.m
        if self.cuda:
            valid_t = self.state.count.index_select(0, sl_t.long()) == self.m
            np.testing.assert_array_equal(valid_t.cpu().numpy(), full_ref)
        else:
            valid_t = self.state.count[slots] == self.m
        pooled = ref.state_pool(self.rstate, slots)
        eids = pos // self.m
        ents = ref.finish_entry(pooled, self.norm, eids, self.m)
        ents = np.where(full_ref[:, None], ents, bf16_round(self.rng.standard_normal(ents.shape)
                                                            .astype(F32)))   # garbage, masked
        keys = bf16_values(self.rng, (B, 128)) if self.kind == "csa" else None
        kc.flush_write(self.pool, self.t(ents, bf16), valid_t, sl_t, self.t(pos),
                       index_keys=None if keys is None else self.t(keys, bf16))
        assert ref.flush_write(self.rpool, ents, full_ref, pos, table_rows(self.pool.block_table_host(), slots),
                               keys) == 0
        if self.kind == "csa":
            kc.csa_rotate(self.state, valid_t, sl_t)
            ref.csa_rotate(self.rstate, full_ref, slots)
        else:
            kc.hca_reset(self.state, valid_t, sl_t)
            ref.hca_reset(self.rstate, full_ref, slots)
        for b in np.flatnonzero(full_ref):
            rid = self.active[int(slots[b])][0]
            row, _ = ref.gather_dense(self.rpool, self.pool.block_table_host()[slots[b]], eids[b] + 1)
            self.expect[rid].append(row[-1])
            assert len(self.expect[rid]) == eids[b] + 1
        # top-k gather of every active request
        ne = np.array([self.pool.n_entries(int(s)) for s in slots], np.int32)
        K = 6
        ids = self.rng.integers(-1, np.maximum(ne, 1)[:, None] + 2, size=(B, K)).astype(np.int64)
        got = kc.gather_topk(self.pool, sl_t, self.t(ids), n_entries=self.t(ne))
        want, werr = ref.gather_topk(self.rpool, table_rows(self.pool.block_table_host(), slots),
                                     ids, ne)
        got = got.float().cpu().numpy() if self.cuda else got
        assert_same(got, want, f"step {it} gather_topk")
        assert self.pool.read_errors() == werr
        self.pool.reset_errors()
        if it % self.check_every == 0:
            self.check()
        for s in slots.tolist():
            a = self.active[s]
            a[1] += 1
            if a[1] == a[2]:
                self.check_request(s)
                self.pool.free_request(s)
                del self.active[s]
        return True

    def check_request(self, s):
        rid, _, _ = self.active[s]
        n = self.pool.n_entries(s)
        assert n == len(self.expect[rid])
        if n:
            got = kc.gather_dense(self.pool, s, n)
            got = got.float().cpu().numpy() if self.cuda else got
            assert_same(got, np.stack(self.expect[rid]), f"request {rid} entries")

    def check(self):
        got = self.pool.to_reference()
        assert_pool_equal(got, self.rpool)
        assert_state_equal(self.state.to_reference(), self.rstate)
        if self.cuda:
            np.testing.assert_array_equal(self.pool.block_table.cpu().numpy(), self.pool.block_table_host())
        for s in self.active:
            self.check_request(s)
        assert self.state.read_errors() == 0

    def run(self, max_steps=10_000):
        it = 0
        while self.step(it) and it < max_steps:
            it += 1
        self.check()
        assert self.pool.free_blocks() == self.pool.num_blocks
        return it


def test_cpu_decode_simulation(rng):
    sim = _Sim("csa", "cpu", rng, head_dim=512, num_blocks=10, epb=2, max_requests=3, max_blocks=4,
               lengths=[9, 30, 17, 4, 22], check_every=7)
    assert sim.run() > 30


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_decode_simulation(cuda, kind, rng):
    if kind == "csa":
        sim = _Sim("csa", "cuda", rng, head_dim=512, num_blocks=14, epb=3, max_requests=4,
                   max_blocks=6, lengths=[13, 40, 27, 5, 33, 61, 8, 19], check_every=9)
    else:   # m = 128: a smaller head_dim keeps the host reference fast
        sim = _Sim("hca", "cuda", rng, head_dim=128, num_blocks=6, epb=2, max_requests=3,
                   max_blocks=3, lengths=[300, 129, 520, 256], check_every=64)
    steps = sim.run()
    assert steps > 40
    assert sim.pool.read_errors() == 0


def test_gpu_graph_capture_decode_step(cuda, rng):
    """flush_write + csa_rotate + gather_topk captured in one CUDA graph and
    replayed give the bits of the eager step."""
    torch = _torch()
    rawkv.warmup(0, files=["kv_cache.cu"])
    p, slots = _gpu_pool("csa", rng, corrupt=False)
    _fill_pool_random(p, rng)
    st = kc.DecodeState("csa", p.max_requests, device="cuda")
    for t in (st.kv_a, st.z_a, st.kv_b, st.z_b):
        t.copy_(torch.from_numpy(rng.standard_normal(t.shape).astype(F32)))
    st.count.copy_(torch.tensor([4, 2, 4, 4, 0, 0], dtype=torch.int32))
    B, K = len(slots) + 1, 16
    sl = torch.tensor(slots + [-1], dtype=torch.int32, device="cuda")
    pos = torch.tensor([3, 6, 11, 15, 0], dtype=torch.int32, device="cuda")
    p.prepare_step(slots, pos[:-1].cpu().numpy())
    ents = torch.from_numpy(bf16_values(rng, (B, 512))).cuda().bfloat16()
    keys = torch.from_numpy(bf16_values(rng, (B, 128))).cuda().bfloat16()
    ids = torch.from_numpy(rng.integers(-1, 12, (B, K)).astype(np.int64)).cuda()
    ne = torch.tensor([4, 2, 8, 12, 0], dtype=torch.int32, device="cuda")
    p.written[:len(slots)].copy_(ne[:len(slots)])       # as if those entries had been flushed
    valid = torch.empty(B, dtype=torch.bool, device="cuda")
    out = torch.empty((B, K, 512), dtype=torch.bfloat16, device="cuda")
    idx = sl.clamp(min=0).long()

    def step():
        torch.eq(st.count.index_select(0, idx), 4, out=valid)
        kc.flush_write(p, ents, valid, sl, pos, index_keys=keys)
        kc.csa_rotate(st, valid, sl)
        kc.gather_topk(p, sl, ids, n_entries=ne, out=out)

    bufs = [p.fp8, p.scale, p.rope, p.index_q, p.index_sf, p.block_table, p.written, p.marks, p.errors,
            st.kv_a, st.z_a, st.kv_b, st.z_b, st.count, st.errors, out]
    snap = [b.clone() for b in bufs]

    def restore():
        for b, s in zip(bufs, snap):
            b.copy_(s)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):           # eager reference run, as torch's warm-up advice
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = [b.clone() for b in bufs]
    assert not torch.equal(eager[9], snap[9])          # the step did rotate something (kv_a)
    restore()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
        with pytest.raises(CaptureError):
            p.prepare_step(slots, [20] * len(slots))
        with pytest.raises(CaptureError):
            p.read_errors()
    torch.cuda.synchronize()
    for replay in range(2):
        restore()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for b, e in zip(bufs, eager):
            assert torch.equal(b.view(torch.uint8), e.view(torch.uint8)), f"replay {replay}"
