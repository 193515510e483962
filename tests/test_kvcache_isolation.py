"""No request reads another's entries (pool.marks; docs/kvcache.md, "Stale
entries").

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
    pool = kc.PagedKVPool(kind, 4, 2, 2, 4, device=device)
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
    pool = kc.PagedKVPool("csa", R * MB, epb, R, MB, device=device)
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
    pools = {d: kc.PagedKVPool("csa", 6, 2, 3, 3, device=d) for d in ("cpu", "cuda")}
    for step in range(12):
        rows, keys = _bf16_rows(rng, 3, D), _bf16_rows(rng, 3, DI)
        for dev, p in pools.items():
            dv = _Dev(dev)
            if step % 4 == 3:
                for s in p.active_slots()[:1]:
                    p.free_request(s)
            while len(p.active_slots()) < 3:
                p.add_request()
            slots = np.array(p.active_slots(), np.int32)
            pos = np.array([(step * 5 + 3 * i) % 24 for i in range(slots.size)], np.int32)
            p.prepare_step(slots, pos)
            kc.flush_write(p, dv.bf(rows[:slots.size]), dv.t(np.ones(slots.size, bool)), dv.t(slots),
                           dv.t(pos), index_keys=dv.bf(keys[:slots.size]))
        a, b = pools["cpu"].to_reference(), pools["cuda"].to_reference()
        np.testing.assert_array_equal(a.marks, b.marks, err_msg=f"step {step}")
        np.testing.assert_array_equal(a.kv_fp8, b.kv_fp8)
        np.testing.assert_array_equal(a.written, b.written)
