"""flush_write: finished entries (and indexer keys) into the paged pool (rawkv/kvcache/flush.py,
rawkv/cu/kv_cache.cu; docs/kvcache.md): the reference's writes and counts, the
argument rules, the lowest row winning a duplicate target (issue 21, item 6),
the kernel against the reference bit for bit on a poisoned pool."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from rawkv.reference.formats import bf16_round  # noqa: E402
from support.kvcache import (  # noqa: E402
    D, DI, _Dev, assert_pool_equal, _bf16_rows, _changed, _decoded, _dup_flush_case, _gpu_pool,
    _noisy_pool, _poison_pool, _random_rows, _slot_pool, _small_hca_pool, special_entries, special_keys,
    _torch,
)
from support.outputs import _refused, _ro  # noqa: E402
from support.properties import SETTINGS, judge, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def test_flush_writes_only_its_entries(rng):
    m, epb, nb = 4, 4, 12
    pool = _noisy_pool(rng, nb, epb, m)
    blocks = rng.permutation(nb)[:9].reshape(3, 3)            # 3 requests, 3 blocks each
    B = 6
    req = rng.integers(0, 3, B)
    ent = rng.integers(0, 3 * epb, B)
    # distinct (request, entry) pairs so no two rows hit one entry
    pairs = list({(int(r), int(e)) for r, e in zip(req, ent)})
    req = np.array([p[0] for p in pairs])
    ent = np.array([p[1] for p in pairs])
    B = len(pairs)
    valid = rng.random(B) < 0.7
    entries = bf16_round(_random_rows(rng, B, 512))
    keys = bf16_round(_random_rows(rng, B, 128))
    pos = ent * m + rng.integers(0, m, B)
    before = pool.copy()
    err = ref.flush_write(pool, entries, valid, pos, blocks[req], keys)
    assert err == 0
    want = {(int(blocks[r, e // epb]), int(e % epb)) for r, e, v in zip(req, ent, valid) if v}
    assert _changed(before, pool) == want
    codes, s, rope = ref.fp8_entry_quantize(entries)
    iq, isf = ref.indexer_key_quantize(keys)
    for b in np.flatnonzero(valid):
        loc = (blocks[req[b], ent[b] // epb], ent[b] % epb)
        assert np.array_equal(pool.kv_fp8[loc], codes[b]) and pool.kv_scale[loc] == s[b]
        assert np.array_equal(pool.kv_rope[loc], rope[b])
        assert np.array_equal(pool.idx_q[loc], iq[b]) and np.array_equal(pool.idx_sf[loc], isf[b])


def test_flush_out_of_range_skipped_and_counted(rng):
    m, epb, nb = 4, 2, 5
    pool = _noisy_pool(rng, nb, epb, m)
    table = np.array([[0, 1],            # good
                      [-1, 2],           # entry 0 -> block -1
                      [nb, 3],           # entry 0 -> block nb
                      [10 ** 9, 4],      # entry 0 -> huge block id
                      [3, 4],            # position past the table (logical block 2)
                      [2, 2],            # negative position
                      [-1, -1]],         # invalid row: not counted
                     np.int64)
    pos = np.array([1, 2, 3, 0, 2 * epb * m, -1, 0])
    valid = np.array([True] * 6 + [False])
    before = pool.copy()
    err = ref.flush_write(pool, bf16_round(_random_rows(rng, 7, 512)), valid, pos, table,
                          bf16_round(_random_rows(rng, 7, 128)))
    assert err == 5
    assert _changed(before, pool) == {(0, 0)}


def test_flush_rejects_bad_arguments_and_writes_nothing(rng):
    pool = _noisy_pool(rng, 4, 2, 4)
    before = pool.copy()
    e, k = _random_rows(rng, 2, 512), _random_rows(rng, 2, 128)
    args = dict(valid_mask=np.ones(2, bool), positions=np.zeros(2, np.int64),
                block_table=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="entries"):
        ref.flush_write(pool, e[:, :500], index_keys=k, **args)
    with pytest.raises(ValueError, match="index_keys"):
        ref.flush_write(pool, e, **args)
    with pytest.raises(TypeError, match="valid_mask"):
        ref.flush_write(pool, e, index_keys=k, **{**args, "valid_mask": np.ones(2)})
    with pytest.raises(TypeError, match="block_table"):
        ref.flush_write(pool, e, index_keys=k, **{**args, "block_table": np.zeros((2, 2))})
    assert _changed(before, pool) == set()


def test_paged_flush_write_bounds_and_written(rng):
    m, epb = 4, 2
    pool = _slot_pool(rng)
    slots = np.array([0, 0, 1, 1, 2, -1, 3, 0, 1, 0], np.int32)
    pos = np.array([1, 13, 2, 9, 0, 0, 0, -4, 4 * 3 * epb, 5], np.int32)
    valid = np.array([True] * 9 + [False])
    # row: 0 entry 0 ok; 1 entry 3 (block 1) ok; 2 entry 0 of slot 1 ok; 3 entry 2 -> block nb:
    # counted; 4 slot 2 has no block: counted; 5, 6 slots out of range: counted; 7 negative
    # position: counted; 8 past the table: counted; 9 invalid: silent
    before = pool.copy()
    err = ref.paged_flush_write(pool, bf16_round(_random_rows(rng, 10, 512)), valid, slots, pos,
                                bf16_round(_random_rows(rng, 10, 128)))
    assert err == 6
    assert _changed(before, pool) == {(5, 0), (1, 1), (2, 0)}
    np.testing.assert_array_equal(pool.written, [4, 1, 0])     # 1 + highest entry written
    ref.paged_flush_write(pool, bf16_round(_random_rows(rng, 1, 512)), np.ones(1, bool), np.zeros(1, np.int32),
                          np.zeros(1, np.int32), bf16_round(_random_rows(rng, 1, 128)))
    np.testing.assert_array_equal(pool.written, [4, 1, 0])     # a high-water mark: never lowered
    with pytest.raises(ValueError, match="pool: has no request table"):
        ref.paged_flush_write(_noisy_pool(rng, 2, 2, 4), np.zeros((1, 512), np.float32), np.ones(1, bool),
                              np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros((1, 128), np.float32))


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
def test_flush_write_read_only_errors_writes_no_entry():
    """flush_write used to write the entry and then fail adding to errors."""
    p, s = _small_hca_pool()
    before = p.to_reference()
    ents = np.ones((1, p.head_dim), np.float32)
    args = (p, ents, np.ones(1, bool), np.array([s], np.int32), np.array([0], np.int32))
    _refused("errors", None, lambda: kc.flush_write(*args, errors=_ro(np.zeros(1, np.int32))))
    assert np.array_equal(p.reference_view().kv_fp8, before.kv_fp8) and not p.written.any()
    _refused("errors", "slots", lambda: kc.flush_write(*args[:3], args[3], args[4], errors=args[3]))


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
@settings(SETTINGS, max_examples=40)
@given(seed=seeds, kind=st.sampled_from(["csa", "hca"]), b=st.integers(0, 4), edt=st.sampled_from(("bfloat16", "float32", "float16")),
       sdt=st.sampled_from(("int32", "int64")), k=st.integers(0, 3), gdt=st.sampled_from([None, "float32", "float16"]),
       special=st.booleans(), layout=st.sampled_from(["rawkv", "model1"]))
def test_kvcache_pool_flush_and_gather(seed, kind, b, edt, sdt, k, gdt, special, layout):
    """flush_write then gather_topk on a CPU pool, against the reference on a copy of the pool."""
    p = kc.PagedKVPool(kind, 6, 2, 3, 4, layout=layout, device="cpu")
    slots_taken = [p.add_request() for _ in range(2)]
    p.prepare_step(slots_taken, [p.m * 3, p.m * 2])
    rng = np.random.default_rng(seed)
    ents = make(seed, (b, p.head_dim), edt, "torch", special=special)
    keys = make(seed + 1, (b, p.index_head_dim), "bfloat16", "torch") if p.has_index else None
    valid = make(seed + 2, (b,), "bool", "torch")
    slots = make(seed + 3, (b,), sdt, "torch", lo=-1, hi=4)
    pos = torch.from_numpy(rng.integers(0, p.m * 4, size=b).astype(np.int32))
    judge(lambda: kc.flush_write(p, ents, valid, slots, pos, index_keys=keys),
          ("pool", "entries", "valid_mask", "slots", "positions", "index_keys"), lambda: None)
    want = p.to_reference()
    ids = make(seed + 4, (2, k), "int32", "torch", lo=-2, hi=8)
    gslots = torch.tensor(slots_taken, dtype=torch.int32)

    def reference():
        from rawkv.reference import kvcache as RKV
        rows, _ = RKV.paged_gather_topk(want, gslots.numpy(), ids.numpy(), None, None, dtype=gdt or "bfloat16")
        return rows
    judge(lambda: kc.gather_topk(p, gslots, ids, dtype=gdt), ("pool", "slots", "topk_ids", "dtype"), reference)


# ---------------------------------------------------------------------------
# duplicates: the lowest row wins
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_flush_write_bit_exact(cuda, kind, rng):
    torch = _torch()
    p, slots = _gpu_pool(kind, rng)
    _poison_pool(p, rng)
    m, epb = p.m, p.entries_per_block
    rows = []   # (slot, position, valid)
    # valid rows aimed at distinct entries of good blocks
    for i, s in enumerate(slots[:3]):
        for e in rng.choice((i + 1) * epb, size=min(3, (i + 1) * epb), replace=False):
            rows.append((s, int(e) * m + int(rng.integers(0, m)), True))
    rows += [
        (slots[0], 1 * m, False),                   # valid_mask False: untouched
        (-1, 0, True), (p.max_requests, 0, True), (1 << 30, 0, True),   # bad slots
        (slots[1], -5, True),                       # negative position
        (slots[1], m * epb * p.max_blocks_per_request, True),          # past the table
        (slots[0], m * epb * 3, True),              # logical block with no block (-1)
        (slots[3], m * epb * 1, True),              # block id == num_blocks
        (slots[3], m * epb * 2 + 1, True),          # block id 2^30
        (slots[3], m * epb * 3 + 2, True),          # block id -7
        (slots[3], 0, True),                        # its good block 0
        (slots[2], 2 ** 31 - 1, True),              # int32 max position
    ]
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    B = len(rows)
    sl = np.array([r[0] for r in rows], np.int64).astype(np.int32)
    pos = np.array([r[1] for r in rows], np.int32)
    valid = np.array([r[2] for r in rows])
    ents = special_entries(rng, B, 512)
    ents = ents[rng.permutation(B)]
    keys = special_keys(rng, B)[rng.permutation(B)] if kind == "csa" else None
    want = p.to_reference()                  # with the block table and written[]
    nerr = ref.paged_flush_write(want, ents, valid, sl, pos, keys)
    assert nerr == 10
    kc.flush_write(p, torch.from_numpy(ents).cuda().bfloat16(), torch.from_numpy(valid).cuda(),
                   torch.from_numpy(sl).cuda(), torch.from_numpy(pos).cuda(),
                   index_keys=None if keys is None else torch.from_numpy(keys).cuda().bfloat16())
    assert p.read_errors() == nerr
    assert_pool_equal(p.to_reference(), want)
    # written[slot] = 1 + the highest entry a valid, in-range row wrote (the
    # kernel's atomicMax; the reference's raise_written)
    np.testing.assert_array_equal(p.written.cpu().numpy(), want.written)
    assert want.written.any()
    # errors= override and B = 0
    e2 = torch.zeros(1, dtype=torch.int32, device="cuda")
    kc.flush_write(p, torch.from_numpy(ents[:2]).cuda().bfloat16(), torch.ones(2, dtype=torch.bool, device="cuda"),
                   torch.tensor([-1, -1], dtype=torch.int32, device="cuda"), torch.zeros(2, dtype=torch.int32, device="cuda"),
                   index_keys=None if keys is None else torch.from_numpy(keys[:2]).cuda().bfloat16(), errors=e2)
    assert int(e2.item()) == 2 and p.read_errors() == nerr
    kc.flush_write(p, torch.zeros((0, 512), dtype=torch.bfloat16, device="cuda"),
                   torch.zeros(0, dtype=torch.bool, device="cuda"), torch.zeros(0, dtype=torch.int32, device="cuda"),
                   torch.zeros(0, dtype=torch.int32, device="cuda"),
                   index_keys=None if keys is None else torch.zeros((0, 128), dtype=torch.bfloat16, device="cuda"))
    assert_pool_equal(p.to_reference(), want)
