"""Page ownership (issue 21, item 3): no request reads another's entries on
any path an engine takes, including torch.ops.rawkv.kv_* with a block
table the engine writes itself (docs/kvcache.md, "Page ownership").
assign_pages itself: tests/kvcache/test_assign_pages.py.

Each scenario runs on a CPU pool (the reference) and, with the `cuda`
fixture, on a CUDA pool, where it must give the same bytes, owners, marks,
written[] and counts (the compressor's entries within its tolerance, which
tests/kvcache/test_compress_prefill.py and test_compress_decode.py cover:
here only which rows are zero)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv.kvcache as kc  # noqa: E402
import rawkv.library  # noqa: E402,F401
from rawkv.kvcache import views as V  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from support.kvcache import D, DI, F32  # noqa: E402
from support.kvcache_ownership import _assert_same, _state, _t  # noqa: E402


# ---------------------------------------------------------------------------
# the case, through the operators
# ---------------------------------------------------------------------------
OPS = torch.ops.rawkv


def _rows(rng, n, w, device):
    return _t(rng.standard_normal((n, w)).astype(F32), device).bfloat16()


def _flush_op(pool, slot, entries, device, rng):
    """kv_flush_write of entries `entries` of the request in `slot`, one row
    each, random BF16 rows."""
    n = len(entries)
    keys = _rows(rng, n, DI, device) if pool.has_index else None
    OPS.kv_flush_write(**V.pool_args(pool), entries=_rows(rng, n, D, device),
                       valid_mask=_t(np.ones(n, bool), device), slots=_t(np.full(n, slot, np.int32), device),
                       positions=_t(np.asarray(entries, np.int32) * pool.m, device), index_keys=keys)


def _gather_op(pool, slot, n, device):
    out = torch.empty((1, n, D), dtype=torch.float32, device=device)
    OPS.kv_gather_topk(**V.pool_args(pool), slots=_t(np.array([slot], np.int32), device),
                       topk_ids=_t(np.arange(n, dtype=np.int32)[None], device), n_entries=None,
                       valid_mask=None, out=out)
    return out[0].cpu().numpy()


def _errors(pool):
    n = pool.read_errors()
    pool.reset_errors()
    return n


def _engine_hands_a_freed_page(device, seed, layout):
    """Request A writes entries 0..3 of its page and is freed; the engine
    hands A's page to the next request of A's slot (s2) and to another
    request (b) by writing block-table rows in place (no prepare_step).
    Returns what each step observed: (name, rows as uint32, errors) and the
    pool's buffers after some steps."""
    rng = np.random.default_rng(seed)
    pool = kc.PagedKVPool("csa", 4, 4, 3, 2, layout=layout, device=device)
    seen = []

    def look(name, slot, n):
        rows = _gather_op(pool, slot, n, device)
        seen.append((name, rows.view(np.uint32), _errors(pool)))
        return rows

    a = pool.add_request()
    pool.prepare_step([a], [4 * pool.m - 1])
    _flush_op(pool, a, [0, 1, 2, 3], device, rng)
    assert _errors(pool) == 0
    theirs = look("A", a, 4)
    assert np.abs(theirs).sum(axis=-1).all()
    page = pool.blocks_of(a)[0]
    pool.free_request(a)
    s2 = pool.add_request()
    b = pool.add_request()
    assert s2 == a and b != a                            # A's slot, with a new request id
    before = _state(pool)
    # handed over in place, without assign_pages: the write is skipped and counted
    pool.block_table[s2, 0] = page
    _flush_op(pool, s2, [3], device, rng)
    seen.append(("unassigned flush", None, _errors(pool)))
    after = _state(pool)
    for n in before:
        if n != "block_table":
            np.testing.assert_array_equal(after[n], before[n], err_msg=n)
    # even with written[] raised by hand, nothing of A's is read
    pool.written[s2] = 4
    look("unassigned read", s2, 4)
    # assigned: the page is s2's, empty until s2 writes it
    kc.assign_pages(pool, _t(np.array([s2], np.int32), device), _t(np.array([page], np.int32), device))
    seen.append(("assign", None, _errors(pool)))
    pool.written[s2] = 0
    _flush_op(pool, s2, [3], device, rng)
    seen.append(("assigned flush", None, _errors(pool)))
    mine = look("assigned read", s2, 4)
    idx = kc.kvcache_indices(pool, _t(np.array([s2], np.int32), device),
                             _t(np.arange(4, dtype=np.int32)[None], device))
    seen.append(("bridge", idx.cpu().numpy() if device != "cpu" else np.asarray(idx), _errors(pool)))
    # the page, owned by s2, handed to b in place: b neither writes nor reads it
    pool.block_table[b, 0] = page
    pool.written[b] = 4
    _flush_op(pool, b, [0], device, rng)
    seen.append(("other's flush", None, _errors(pool)))
    look("other's read", b, 4)
    dense = torch.empty((1, 4, D), dtype=torch.float32, device=device)
    OPS.kv_gather_dense_batch(**V.pool_args(pool), slots=_t(np.array([b], np.int32), device),
                              n_entries=_t(np.array([4], np.int32), device), valid_mask=None, out=dense)
    seen.append(("other's dense read", dense.cpu().numpy().view(np.uint32), _errors(pool)))
    np.testing.assert_array_equal(_gather_op(pool, s2, 4, device).view(np.uint32), mine.view(np.uint32))
    _errors(pool)
    return seen, _state(pool), page


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_cpu_operator_path_never_reads_a_previous_owners_entries(seed, layout):
    seen, final, page = _engine_hands_a_freed_page("cpu", seed, layout)
    got = {name: (rows, err) for name, rows, err in seen}
    assert got["unassigned flush"][1] == 1
    rows, err = got["unassigned read"]
    assert not rows.any() and err == 4                    # A's entries are not returned
    assert got["assign"][1] == 0 and got["assigned flush"][1] == 0
    rows, err = got["assigned read"]
    assert not rows[:3].any() and rows[3].any() and err == 3
    idx, err = got["bridge"]
    np.testing.assert_array_equal(idx, [[-1, -1, -1, page * 4 + 3]])
    assert err == 3
    assert got["other's flush"][1] == 1
    for name in ("other's read", "other's dense read"):
        rows, err = got[name]
        assert not rows.any() and err == 4, name
    assert final["owners"][page] == final["request_ids"][0] > 0


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_gpu_operator_path_matches_the_reference(cuda, seed, layout):
    cpu, cpu_final, _ = _engine_hands_a_freed_page("cpu", seed, layout)
    gpu, gpu_final, _ = _engine_hands_a_freed_page("cuda", seed, layout)
    for (name, a, ea), (_, b, eb) in zip(cpu, gpu):
        assert ea == eb, f"{name}: errors"
        if a is not None:
            np.testing.assert_array_equal(b, a, err_msg=name)
    _assert_same(cpu_final, gpu_final, "pool")


def test_cpu_in_place_block_table_write_keeps_the_free_list():
    """The docs allow in-place writes to pool.block_table; on a CPU pool it
    was the host's own record of which blocks a slot holds, so free_request
    returned the wrong block to the free list and two requests got one
    block."""
    pool = kc.PagedKVPool("hca", 4, 2, 3, 2, layout="rawkv", device="cpu")
    a = pool.add_request()
    pool.prepare_step([a], [0])
    assert pool.blocks_of(a) == [0]
    pool.block_table[a, 0] = 1                          # an engine's write, in place
    pool.free_request(a)
    b, c = pool.add_request(), pool.add_request()
    pool.prepare_step([b, c], [0, 0])
    assert pool.blocks_of(b) != pool.blocks_of(c)
    assert sorted(pool.blocks_of(b) + pool.blocks_of(c)) == [0, 1]
    assert pool.free_blocks() == 2


# ---------------------------------------------------------------------------
# the compressor writes only assigned blocks
# ---------------------------------------------------------------------------
def _compressor_case(device, seed, layout):
    """compress_prefill and compress_decode (CSA, no indexer keys) into a
    block handed over in place, then after assign_pages. Returns the
    counts, written[], marks and which gathered rows are nonzero."""
    rng = np.random.default_rng(seed)
    m = ref.CSA_RATIO
    pool = kc.PagedKVPool("csa", 4, 4, 2, 2, index_head_dim=None, layout=layout, device=device)
    st = kc.DecodeState("csa", 2, device=device)
    pool.attach(st)
    a, b = pool.add_request(), pool.add_request()
    pool.prepare_step([a], [8 * m - 1])                  # blocks 0, 1 to A; 2, 3 stay free
    nw = _t((1 + 0.1 * rng.standard_normal(D)).astype(F32), device)
    kv = _t(rng.standard_normal((4 * m, 2 * D)).astype(F32), device)
    z = _t(rng.standard_normal((4 * m, 2 * D)).astype(F32), device)
    out = []
    pool.block_table[b, 0] = 0                           # A's block, in place
    out.append(kc.compress_prefill(pool, kv, z, None, nw, b))
    out.append(_errors(pool))
    pool.block_table[b, 0] = 2                           # a free block nobody assigned
    out.append(kc.compress_prefill(pool, kv, z, None, nw, b))
    out.append(_errors(pool))
    kc.assign_pages(pool, _t(np.array([b], np.int32), device), _t(np.array([2], np.int32), device))
    out.append(kc.compress_prefill(pool, kv, z, None, nw, b))
    out.append(_errors(pool))
    # decode: slot b's window 4 completes; its block (logical 1) is handed over in place
    kc.state_seed(st, b, kv[: 2 * m - 1], z[: 2 * m - 1])
    kc.state_append(st, kv[:1], z[:1], _t(np.ones(1, bool), device), _t(np.array([b], np.int32), device))
    dec = dict(valid_mask=_t(np.ones(1, bool), device), slots=_t(np.array([b], np.int32), device),
               positions=_t(np.array([5 * m - 1], np.int32), device))
    pool.block_table[b, 1] = 3
    kc.compress_decode(pool, st, nw, **dec)
    out.append(_errors(pool))
    kc.assign_pages(pool, _t(np.array([b], np.int32), device), _t(np.array([3], np.int32), device))
    kc.compress_decode(pool, st, nw, **dec)
    out.append(_errors(pool))
    r = pool.to_reference()
    dense = torch.empty((1, 8, D), dtype=torch.float32, device=device)
    OPS.kv_gather_dense_batch(**V.pool_args(pool), slots=_t(np.array([b], np.int32), device),
                              n_entries=_t(np.array([8], np.int32), device), valid_mask=None, out=dense)
    rows = dense[0].cpu().numpy()
    out.append(_errors(pool))
    return out, r.written.copy(), r.marks.copy(), r.owners.copy(), np.abs(rows).sum(axis=-1) > 0


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_cpu_compressor_writes_only_assigned_blocks(seed, layout):
    out, written, marks, owners, nonzero = _compressor_case("cpu", seed, layout)
    # prefill of 4 entries into A's block, then into an unassigned one: all 4 skipped and counted;
    # assigned: written; decode into an unassigned block: counted; assigned: written
    assert out == [4, 4, 4, 4, 4, 0, 1, 0, 3]
    assert written[1] == 5
    np.testing.assert_array_equal(marks[2], [1, 1, 1, 1])
    np.testing.assert_array_equal(marks[3], [1, 0, 0, 0])
    np.testing.assert_array_equal(nonzero, [1, 1, 1, 1, 1, 0, 0, 0])   # 5..7: past written, counted
    assert owners[0] == owners[1] != owners[2] == owners[3]


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_gpu_compressor_writes_only_assigned_blocks(cuda, seed, layout):
    want = _compressor_case("cpu", seed, layout)
    got = _compressor_case("cuda", seed, layout)
    assert got[0] == want[0]
    for name, x, y in zip(("written", "marks", "owners", "nonzero rows"), got[1:], want[1:]):
        np.testing.assert_array_equal(x, y, err_msg=name)


def _duplicate_block_case(device, seed, layout, has_index, start_entry, dup):
    """compress_prefill of entries start_entry .. start_entry + 7 of request
    A, which holds blocks 0..2 (4 entries each); with `dup`, logical block
    1 names A's block 0 too (an engine's write in place), so two entries of
    the launch aim at each record of block 0 that both reach. Returns
    (errors, written, marks, block bytes (blk, name) -> array)."""
    rng = np.random.default_rng(seed)
    m = ref.CSA_RATIO
    pool = kc.PagedKVPool("csa", 4, 4, 2, 3, index_head_dim=DI if has_index else None, layout=layout,
                          device=device)
    a = pool.add_request()
    pool.prepare_step([a], [12 * m - 1])
    blocks = pool.blocks_of(a)
    if dup:
        pool.block_table[a, 1] = blocks[0]
    rows = (8 + (1 if start_entry else 0)) * m       # CSA: the window before the first entry too
    t = (lambda x: _t(x, device))
    kv, z = (t(rng.standard_normal((rows, 2 * D)).astype(F32)) for _ in range(2))
    nw = t((1 + 0.1 * rng.standard_normal(D)).astype(F32))
    idx = None
    if has_index:
        idx = kc.PrefillIndex(t(rng.standard_normal((rows, 2 * DI)).astype(F32)),
                              t(rng.standard_normal((rows, 2 * DI)).astype(F32)), None,
                              t((1 + 0.1 * rng.standard_normal(DI)).astype(F32)))
    kc.compress_prefill(pool, kv, z, None, nw, a, start_entry=start_entry, index=idx)
    errors = _errors(pool)
    state = _state(pool)
    data = {(i, n): v[b] for n, v in state.items() if n not in ("written", "marks", "owners", "request_ids",
                                                             "block_table") for i, b in enumerate(blocks)}
    return errors, state["written"][a], state["marks"][blocks], data


def _assert_lowest_entries(got, clean, start_entry):
    """Each record of block 0 of a named-twice case holds the bytes of the
    launch's lowest entry at it, as the clean case (logical block 1 on A's
    block 1) wrote them; block 2 the same bytes."""
    for (blk, name), v in got[3].items():
        if blk == 2:
            np.testing.assert_array_equal(v, clean[3][(2, name)], err_msg=name)
        elif blk == 0 and name in ("kv_fp8", "kv_scale", "kv_rope", "idx_q", "idx_sf"):
            # (the rawkv layout's arrays hold a block's records in order, as bytes: record r's
            # lowest entry is r from entry 0, else entry 4 + r of logical block 1)
            for r in range(4):
                mine = clean[3][(0 if r >= start_entry else 1, name)].reshape(4, -1)[r]
                np.testing.assert_array_equal(v.reshape(4, -1)[r], mine, err_msg=f"{name} record {r}")
        elif blk == 0 and start_entry == 0:
            np.testing.assert_array_equal(v, clean[3][(0, name)], err_msg=name)


@pytest.mark.parametrize("has_index", [False, True])
@pytest.mark.parametrize("layout", ["rawkv", "model1"])
@pytest.mark.parametrize("start_entry", [0, 2])
def test_cpu_prefill_into_a_block_named_twice(seed, layout, has_index, start_entry):
    """Entries 4..7 (logical block 1) aim at block 0's records: the lowest
    entry of the launch at a record writes it, the other is counted
    (reference.paged_flush_write's rule). From entry 2, entries 4 and 5 are
    the lowest at records 0 and 1 (entries 0, 1 are not in the launch)."""
    got = _duplicate_block_case("cpu", seed, layout, has_index, start_entry, True)
    errors, written, marks, _ = got
    assert errors == (4 if start_entry == 0 else 2)
    assert written == (4 if start_entry == 0 else 10)     # the highest entry written, + 1
    np.testing.assert_array_equal(marks, [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0] if start_entry else
                                          [0, 0, 0, 0]])
    _assert_lowest_entries(got, _duplicate_block_case("cpu", seed, layout, has_index, start_entry, False),
                           start_entry)


@pytest.mark.parametrize("has_index", [False, True])
@pytest.mark.parametrize("layout", ["rawkv", "model1"])
@pytest.mark.parametrize("start_entry", [0, 2])
def test_gpu_prefill_into_a_block_named_twice(cuda, seed, layout, has_index, start_entry):
    """The kernel counts and skips as the reference does, each record of
    block 0 holding the bytes of its lowest entry (those the same launch
    writes into A's own blocks 0 and 1 with logical block 1 not named
    twice). Until session 62 both entries wrote the record (torn), nothing
    was counted and written[] went past them."""
    want = _duplicate_block_case("cpu", seed, layout, has_index, start_entry, True)
    got = _duplicate_block_case("cuda", seed, layout, has_index, start_entry, True)
    assert got[:2] == want[:2]
    np.testing.assert_array_equal(got[2], want[2])
    _assert_lowest_entries(got, _duplicate_block_case("cuda", seed, layout, has_index, start_entry, False),
                           start_entry)


def _many_blocks_case(device, seed, kind, layout, n, dups, start_entry):
    """compress_prefill of entries start_entry .. n - 1 of a request holding
    n blocks of one entry each, in the block table's second row (n words
    from the table's start: its vectors of four words do not start at the
    row's start unless n is a multiple of 4); for each (lo, hi) of `dups`,
    logical block hi names the request's block lo too. Far more blocks than
    a CTA has threads lie below the highest ones. Returns (errors, written,
    marks, block bytes (i, name) -> array) for the request's blocks in
    logical order."""
    rng = np.random.default_rng(seed)
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    pool = kc.PagedKVPool(kind, n, 1, 2, n, layout=layout, device=device)
    pool.add_request()                                   # row 0: no blocks
    a = pool.add_request()
    pool.prepare_step([a], [n * m - 1])
    blocks = pool.blocks_of(a)
    for lo, hi in dups:
        pool.block_table[a, hi] = blocks[lo]
    pre = 1 if kind == "csa" and start_entry else 0     # CSA: the window before the first entry too
    rows = (n - start_entry + pre) * m
    w = 2 * D if kind == "csa" else D
    if device == "cpu":
        def normal(*shape):
            return _t(rng.standard_normal(shape).astype(F32), device)
    else:                                                # (GB of rows: drawn on the device)
        gen = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape):
            return torch.randn(shape, generator=gen, device=device)
    kv, z = normal(rows, w), normal(rows, w)
    idx = None
    if kind == "csa":
        idx = kc.PrefillIndex(normal(rows, 2 * DI), normal(rows, 2 * DI), None, 1 + 0.1 * normal(DI))
    nw = 1 + 0.1 * normal(D)
    kc.compress_prefill(pool, kv, z, None, nw, a, start_entry=start_entry, index=idx)
    errors = _errors(pool)
    state = _state(pool)
    data = {(i, nm): v[b] for nm, v in state.items() if nm not in ("written", "marks", "owners", "request_ids",
                                                               "block_table") for i, b in enumerate(blocks)}
    return errors, state["written"][a], state["marks"][blocks].reshape(n), data


def _many_blocks_want(n, dups, start_entry):
    """The reference's rule, simulated: (errors, written, marks, writer)
    where writer[i] is the entry whose bytes the request's block i holds (the
    lowest entry of the launch naming it), every other entry of the launch
    naming a taken block counted."""
    table = list(range(n))
    for lo, hi in dups:
        table[hi] = lo
    writer = {}
    for e in range(start_entry, n):
        writer.setdefault(table[e], e)
    marks = np.zeros(n, np.uint8)
    marks[list(writer)] = 1
    return n - start_entry - len(writer), max(writer.values()) + 1, marks, writer


# (kind, entries, start entry, (lo, hi) pairs). The lower blocks lie at every
# range the kernel's scan treats apart, counted from the launch's lowest block
# at the offset: CSA (128 threads) 0-127, 128-255, 256-383, 384-511, 512 and
# past; HCA (512 threads) 0-511, ..., 1,536-2,047, 2,048 and past. Also a
# block named three times, a chain (7 names 5's block, 9 names 7's), a lower
# namesake not in the launch (below the start entry: the higher ones decide
# among themselves), and n not a multiple of 4 (the scan's vectors at the
# table's end).
_MANY_BLOCK_CASES = [
    ("csa", 301, 0, [(5, 7), (7, 9), (3, 140), (150, 290), (150, 299), (0, 130)]),
    ("csa", 301, 9, [(2, 200), (2, 250), (10, 11), (10, 270), (139, 268)]),
    ("csa", 703, 3, [(20, 690), (530, 702), (600, 640), (1, 650), (300, 660), (450, 680)]),
    ("hca", 41, 0, [(1, 40), (2, 3), (2, 30)]),
    ("hca", 41, 5, [(4, 6), (4, 7), (20, 21)]),
]
# the GPU's only (the reference takes long on thousands of HCA entries of 128 rows)
_MANY_BLOCK_GPU_CASES = _MANY_BLOCK_CASES + [
    ("hca", 2101, 1, [(3, 2100), (700, 1300), (1100, 1900), (1600, 2000), (2060, 2090)])]


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
@pytest.mark.parametrize("case", range(len(_MANY_BLOCK_CASES)))
def test_cpu_prefill_into_blocks_named_twice_far_apart(seed, layout, case):
    kind, n, s0, dups = _MANY_BLOCK_CASES[case]
    errors, written, marks, _ = _many_blocks_case("cpu", seed, kind, layout, n, dups, s0)
    want = _many_blocks_want(n, dups, s0)
    assert (errors, written) == want[:2]
    np.testing.assert_array_equal(marks, want[2])


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
@pytest.mark.parametrize("case", range(len(_MANY_BLOCK_GPU_CASES)))
def test_gpu_prefill_into_blocks_named_twice_far_apart(cuda, seed, layout, case):
    """The reference's counts and marks, and each block holds its writer's
    bytes (as the same launch writes them with no block named twice) or
    nothing."""
    kind, n, s0, dups = _MANY_BLOCK_GPU_CASES[case]
    got = _many_blocks_case("cuda", seed, kind, layout, n, dups, s0)
    *want, writer = _many_blocks_want(n, dups, s0)
    assert got[:2] == tuple(want[:2])
    np.testing.assert_array_equal(got[2], want[2])
    clean = _many_blocks_case("cuda", seed, kind, layout, n, [], s0)
    for (i, name), v in got[3].items():
        if i in writer:
            np.testing.assert_array_equal(v, clean[3][(writer[i], name)], err_msg=f"{name} of block {i}")
        else:
            assert not v.any(), (i, name)


# ---------------------------------------------------------------------------
# request ids: fresh per admission, renumbered when they run out
# ---------------------------------------------------------------------------
def _renumber_case(device, seed):
    """Requests admitted across the id wrap (2^31 - 1): the active ones keep
    their entries, a freed one's block is nobody's."""
    rng = np.random.default_rng(seed)
    pool = kc.PagedKVPool("csa", 6, 2, 3, 2, layout="rawkv", device=device)
    pool._next_id = 2 ** 31 - 2                          # two ids left
    a, b = pool.add_request(), pool.add_request()
    pool.prepare_step([a, b], [2 * pool.m - 1, 2 * pool.m - 1])
    _flush_op(pool, a, [0, 1], device, rng)
    _flush_op(pool, b, [0, 1], device, rng)
    mine = _gather_op(pool, b, 2, device)
    freed = pool.blocks_of(a)[0]
    pool.free_request(a)
    c = pool.add_request()                               # the ids ran out: renumbered
    res = {"ids": pool.request_ids.cpu().numpy() if device != "cpu" else pool.request_ids.copy(),
           "owners": pool.owners.cpu().numpy() if device != "cpu" else pool.owners.copy()}
    assert c == a
    res["b"] = _gather_op(pool, b, 2, device)
    np.testing.assert_array_equal(res["b"].view(np.uint32), mine.view(np.uint32))
    res["b errors"] = _errors(pool)
    pool.block_table[c, 0] = freed                       # A's block, in place, to the new request
    pool.written[c] = 2
    res["c"] = _gather_op(pool, c, 2, device)
    res["c errors"] = _errors(pool)
    return res, freed, b, c


def test_cpu_request_ids_renumbered_when_they_run_out(seed):
    res, freed, b, c = _renumber_case("cpu", seed)
    ids = res["ids"]
    assert sorted(ids.tolist()) == [0, 1, 2] and ids[b] == 1 and ids[c] == 2
    assert res["owners"][freed] == 0 and (res["owners"] == 1).sum() == 1
    assert res["b errors"] == 0
    assert not res["c"].any() and res["c errors"] == 2


def test_gpu_request_ids_renumbered_when_they_run_out(cuda, seed):
    want, *_ = _renumber_case("cpu", seed)
    got, *_ = _renumber_case("cuda", seed)
    for n in want:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), err_msg=n)


def test_add_request_gives_a_fresh_id_and_free_request_clears_it():
    pool = kc.PagedKVPool("hca", 4, 2, 2, 2, layout="rawkv", device="cpu")
    a = pool.add_request()
    first = int(pool.request_ids[a])
    pool.free_request(a)
    assert pool.request_ids[a] == 0
    assert pool.add_request() == a and pool.request_ids[a] not in (0, first)
