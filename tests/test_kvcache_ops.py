"""Tests of the paged KV pool, the decode state and the format kernels of the
DeepSeek-V4 compressed KV cache (rawkv.kvcache: pool.py, state.py, flush.py,
gather.py, state_ops.py, checks.py; rawkv/cu/kv_cache.cu).

CPU tests: pool bookkeeping (add/free/prepare_step, out-of-blocks before any
write, block reuse), argument errors (the rules CPU and CUDA share), the CPU
ops against direct reference
calls, no stale entries after free + block reuse (pool.written), a small
decode simulation. GPU tests (fixture `cuda`): every op
against rawkv.reference.kvcache bit for bit (NaN: both NaN), poisoned
buffers to prove that skipped rows and untouched regions are not written,
device-side indices out of range skipped and counted, a multi-request decode
simulation, and a CUDA-graph capture of a decode step.

Random tests take `rng` (conftest): the seed is printed on failure; replay
with RAWKV_TEST_SEED=<seed>.
"""
from __future__ import annotations

import numpy as np
import pytest

import rawkv
from rawkv import kvcache as kc
from rawkv.errors import CaptureError
from rawkv.reference import kvcache as ref
from rawkv.reference.formats import bf16_round

F32 = np.float32


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def assert_same(got, want, what=""):
    """Bit-for-bit equality of float arrays (signed zeros included); NaN
    matches NaN whatever its payload."""
    got = np.ascontiguousarray(np.asarray(got, F32))
    want = np.ascontiguousarray(np.asarray(want, F32))
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    gn, wn = np.isnan(got), np.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(np.uint32) != want.view(np.uint32)))
    if bad.any():
        idx = np.argwhere(bad)[:5]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} differ, e.g. at "
                             f"{idx.tolist()}: got {got[tuple(idx[0])]} want {want[tuple(idx[0])]}")


def assert_pool_equal(a: ref.PagedPoolRef, b: ref.PagedPoolRef, what="pool"):
    np.testing.assert_array_equal(a.kv_fp8, b.kv_fp8, err_msg=f"{what}.fp8")
    assert_same(a.kv_scale, b.kv_scale, f"{what}.scale")
    assert_same(a.kv_rope, b.kv_rope, f"{what}.rope")
    if a.idx_q is not None or b.idx_q is not None:
        np.testing.assert_array_equal(a.idx_q, b.idx_q, err_msg=f"{what}.index_q")
        np.testing.assert_array_equal(a.idx_sf, b.idx_sf, err_msg=f"{what}.index_sf")
    if a.marks is not None and b.marks is not None:
        np.testing.assert_array_equal(a.marks, b.marks, err_msg=f"{what}.marks")


def assert_state_equal(a: ref.DecodeStateRef, b: ref.DecodeStateRef, what="state"):
    assert_same(a.a_kv, b.a_kv, f"{what}.kv_a")
    assert_same(a.a_z, b.a_z, f"{what}.z_a")
    np.testing.assert_array_equal(a.count, b.count, err_msg=f"{what}.count")
    if a.b_kv is not None or b.b_kv is not None:
        assert_same(a.b_kv, b.b_kv, f"{what}.kv_b")
        assert_same(a.b_z, b.b_z, f"{what}.z_b")


def table_rows(table: np.ndarray, slots) -> np.ndarray:
    """Block-table rows of `slots`; all -1 for a slot out of range."""
    slots = np.asarray(slots, np.int64)
    ok = (slots >= 0) & (slots < table.shape[0])
    rows = np.full((slots.size, table.shape[1]), -1, np.int64)
    rows[ok] = table[slots[ok]]
    return rows


def bf16_values(rng, shape, scale=1.0):
    return bf16_round((rng.standard_normal(shape) * scale).astype(F32))


def special_entries(rng, B, hd, rope_dim=64):
    """BF16-valued entries with the edge cases of FP8 entries (docs/kvcache.md decision 8)."""
    e = bf16_values(rng, (B, hd), 2.0)
    nope = hd - rope_dim
    specials = [
        lambda r: r.__setitem__(slice(0, nope), 0.0),                    # amax 0 -> s = 1
        lambda r: r.__setitem__(5, np.nan),                              # NaN -> s NaN, codes 0
        lambda r: r.__setitem__(7, np.inf),
        lambda r: r.__setitem__(nope + 3, np.nan),                       # NaN in RoPE dims only
        lambda r: r.__setitem__(slice(0, nope), bf16_round(r[:nope] * F32(1e-30))),
        lambda r: r.__setitem__(slice(0, nope), bf16_round(r[:nope] * F32(1e37))),
        lambda r: r.__setitem__(slice(0, nope, 3), -0.0),
        lambda r: r.__setitem__(slice(0, nope), bf16_round(r[:nope] * F32(3e-39))),  # subnormals
    ]
    for i, f in enumerate(specials[:B]):
        f(e[i])
    return e


def special_keys(rng, B, ihd=128):
    k = bf16_values(rng, (B, ihd), 1.5)
    if B > 0:
        k[0, 0:16] = 0.0                      # all-zero block
    if B > 1:
        k[1, 17] = np.nan                     # NaN block -> sf 0x7F, codes 0
    if B > 2:
        k[2, 40] = -np.inf
    if B > 3:
        k[3, 64:80] = bf16_round(k[3, 64:80] * F32(1e-5))   # tiny block: sf 0 -> codes 0
    if B > 4:
        k[4, :] = bf16_round(k[4] * F32(300.0))
    return k


# ---------------------------------------------------------------------------
# CPU: pool bookkeeping
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_pool_buffers_cpu(kind):
    p = kc.PagedKVPool(kind, 6, 4, 3, 5, layout="rawkv", device="cpu")
    assert p.m == (4 if kind == "csa" else 128)
    assert p.fp8.shape == (6, 4, 448) and p.fp8.dtype == np.uint8
    assert p.scale.shape == (6, 4) and p.scale.dtype == np.float32
    assert p.rope.shape == (6, 4, 64) and p.rope.dtype == np.float32
    if kind == "csa":
        assert p.index_q.shape == (6, 4, 64) and p.index_sf.shape == (6, 4, 8)
    else:
        assert p.index_q is None and p.index_sf is None and p.index_head_dim is None
    assert p.block_table.shape == (3, 5) and p.block_table.dtype == np.int32
    assert (p.block_table == -1).all()
    assert p.errors.shape == (1,) and p.read_errors() == 0
    assert p.capacity() == 24 and p.free_blocks() == 6
    s = kc.DecodeState(kind, 3, device="cpu")
    w = 1024 if kind == "csa" else 512
    assert s.kv_a.shape == (3, p.m, w) and np.isneginf(s.z_a).all() and (s.kv_a == 0).all()
    assert (s.count == 0).all() and s.count.dtype == np.int32
    if kind == "csa":
        assert s.kv_b.shape == (3, 4, 512) and np.isneginf(s.z_b).all()
    else:
        assert s.kv_b is None


def test_pool_constructor_errors():
    with pytest.raises(ValueError, match="kind"):
        kc.PagedKVPool("mla", 4, 4, 2, 2, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="num_blocks"):
        kc.PagedKVPool("csa", 0, 4, 2, 2, layout="rawkv", device="cpu")
    with pytest.raises(TypeError, match="entries_per_block"):
        kc.PagedKVPool("csa", 4, 4.0, 2, 2, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="index_head_dim"):
        kc.PagedKVPool("hca", 4, 4, 2, 2, index_head_dim=128, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="index_head_dim"):
        kc.PagedKVPool("csa", 4, 4, 2, 2, index_head_dim=120, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="head_dim"):
        kc.PagedKVPool("csa", 4, 4, 2, 2, head_dim=520, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="rope_dim"):
        kc.PagedKVPool("csa", 4, 4, 2, 2, rope_dim=60, layout="rawkv", device="cpu")
    with pytest.raises(ValueError, match="kind"):
        kc.DecodeState("x", 2, device="cpu")
    if _has_torch():
        with pytest.raises(ValueError, match="device"):
            kc.PagedKVPool("csa", 4, 4, 2, 2, layout="rawkv", device="meta")
    p = kc.PagedKVPool("csa", 4, 4, 2, 2, index_head_dim=None, layout="rawkv", device="cpu")
    assert not p.has_index


def test_add_free_prepare_reuse():
    p = kc.PagedKVPool("csa", 8, 2, 3, 4, layout="rawkv", device="cpu")     # m=4, epb=2: 8 tokens per block
    a, b = p.add_request(), p.add_request()
    assert (a, b) == (0, 1) and p.active_slots() == [0, 1]
    assert p.prepare_step([a, b], [0, 0]) == 2
    assert p.blocks_of(a) == [0] and p.blocks_of(b) == [1]
    assert p.n_entries(a) == 0
    assert p.prepare_step([a], [7]) == 0            # entry 1, still block 0
    assert p.n_entries(a) == 2
    assert p.prepare_step([a, b], [8, 20]) == 3     # a: entry 2 -> block 1; b: entry 5 -> blocks 1, 2
    assert p.blocks_of(a) == [0, 2] and p.blocks_of(b) == [1, 3, 4]
    assert p.n_entries(b) == 5 and p.free_blocks() == 3
    np.testing.assert_array_equal(p.block_table[:2], [[0, 2, -1, -1], [1, 3, 4, -1]])
    p.free_request(b)
    assert (p.block_table[b] == -1).all() and p.free_blocks() == 6
    with pytest.raises(ValueError, match="slot"):
        p.n_entries(b)
    c = p.add_request()
    assert c == 1                                    # lowest free slot
    p.prepare_step([c], [31])                        # entry 7 -> logical block 3: 4 blocks
    assert p.blocks_of(c)[:3] == [1, 3, 4]           # the freed blocks come back first (LIFO)
    assert p.free_blocks() == 2
    for s in (a, c):
        p.free_request(s)
    assert p.free_blocks() == 8 and (p.block_table == -1).all()
    assert sorted(p._free) == list(range(8))


def test_prepare_out_of_blocks_is_all_or_nothing():
    p = kc.PagedKVPool("hca", 3, 1, 3, 4, layout="rawkv", device="cpu")     # 128 tokens per block
    a, b = p.add_request(), p.add_request()
    p.prepare_step([a], [0])
    before = (p.block_table.copy(), list(p._free), p.n_entries(a))
    with pytest.raises(RuntimeError, match=f"slot {b}"):
        p.prepare_step([a, b], [200, 300])           # a needs 1 more, b needs 3: 4 > 2 free
    assert (p.block_table == before[0]).all() and p._free == before[1]
    assert p.n_entries(a) == before[2] and p.n_entries(b) == 0
    assert p.prepare_step([a, b], [200, 0]) == 2     # exactly fits
    assert p.free_blocks() == 0


def test_prepare_errors_and_repeats():
    p = kc.PagedKVPool("csa", 4, 2, 3, 2, layout="rawkv", device="cpu")
    a = p.add_request()
    with pytest.raises(ValueError, match="slot 1"):
        p.prepare_step([1], [0])                     # not added
    with pytest.raises(ValueError, match="slot 7"):
        p.prepare_step([7], [0])
    with pytest.raises(ValueError, match="position"):
        p.prepare_step([a], [-1])
    with pytest.raises(ValueError, match="max_blocks_per_request"):
        p.prepare_step([a], [16])                    # entry 4 -> logical block 2 of 2
    with pytest.raises(ValueError, match="positions"):
        p.prepare_step([a, a], [1])
    with pytest.raises(TypeError, match="slots"):
        p.prepare_step(np.array([True]), [0])
    with pytest.raises(TypeError, match="positions"):
        p.prepare_step([a], [0.5])
    with pytest.raises(TypeError, match="positions"):
        p.prepare_step([], np.zeros(0))             # an empty float array is still a float array
    # an empty step is a no-op (before: "expected integers, got dtype float64")
    for empty in ([], (), np.zeros(0, np.int32)):
        assert p.prepare_step(empty, empty) == 0
    with pytest.raises(ValueError, match="positions"):
        p.prepare_step([], [0])
    assert p.free_blocks() == 4 and (p.block_table == -1).all()
    # a repeated slot (a prefill chunk): its highest position counts
    assert p.prepare_step(np.array([a, a, a]), np.array([3, 15, 9])) == 2
    assert p.n_entries(a) == 4
    with pytest.raises(ValueError, match="slot"):
        p.free_request(2)
    with pytest.raises(TypeError, match="slot"):
        p.free_request("0")


# ---------------------------------------------------------------------------
# CPU: ops against direct reference calls
# ---------------------------------------------------------------------------
def _cpu_pool_with_requests(kind, rng, n_req=3):
    p = kc.PagedKVPool(kind, 12, 2, 4, 4, layout="rawkv", device="cpu")
    slots = [p.add_request() for _ in range(n_req)]
    p.prepare_step(slots, [p.m * 2 * (i + 1) - 1 for i in range(n_req)])
    return p, slots


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


def test_cpu_argument_errors():
    rng = np.random.default_rng(1)
    p, slots = _cpu_pool_with_requests("csa", rng)
    h, _ = _cpu_pool_with_requests("hca", rng)
    ents = bf16_values(rng, (2, 512))
    keys = bf16_values(rng, (2, 128))
    v, s, pos = np.ones(2, bool), np.array(slots[:2], np.int32), np.zeros(2, np.int32)
    before = p.to_reference()
    cases = [
        (ValueError, "index_keys", lambda: kc.flush_write(p, ents, v, s, pos)),
        (ValueError, "index_keys", lambda: kc.flush_write(h, ents, v, s, pos, index_keys=keys)),
        (ValueError, "entries", lambda: kc.flush_write(p, ents[:, :500], v, s, pos, index_keys=keys)),
        (ValueError, "valid_mask", lambda: kc.flush_write(p, ents, v[:1], s, pos, index_keys=keys)),
        (TypeError, "valid_mask", lambda: kc.flush_write(p, ents, s, s, pos, index_keys=keys)),
        (ValueError, "slots", lambda: kc.flush_write(p, ents, v, s[:1], pos, index_keys=keys)),
        (TypeError, "slots", lambda: kc.flush_write(p, ents, v, s.astype(F32), pos, index_keys=keys)),
        (ValueError, "positions", lambda: kc.flush_write(p, ents, v, s, pos[:1], index_keys=keys)),
        (TypeError, "pool", lambda: kc.flush_write(before, ents, v, s, pos, index_keys=keys)),
        (ValueError, "topk_ids", lambda: kc.gather_topk(p, s, np.zeros(3, np.int32))),
        (ValueError, "slots", lambda: kc.gather_topk(p, s[:1], np.zeros((2, 3), np.int32))),
        (TypeError, "dtype", lambda: kc.gather_topk(p, s, np.zeros((2, 3), np.int32), dtype="int8")),
        (ValueError, "slot", lambda: kc.gather_dense(p, 99, 3)),
        (ValueError, "n_entries", lambda: kc.gather_dense(p, 0, -1)),
        (ValueError, "n_entries", lambda: kc.gather_dense(p, 0, p.n_entries(0) + 1)),
        (ValueError, "n_entries", lambda: kc.gather_index_keys(p, 3, 1)),        # a free slot
        (ValueError, "slot", lambda: kc.state_seed(kc.DecodeState("csa", 4, device="cpu"), 4,
                                                    np.zeros((0, 1024), F32), np.zeros((0, 1024), F32))),
        (ValueError, "pool", lambda: kc.gather_index_keys(h, 0, 1)),
        (ValueError, "max_entries", lambda: kc.gather_dense_batch(p, s, s)),
    ]
    for exc, name, fn in cases:
        with pytest.raises(exc, match=name):
            fn()
    assert_pool_equal(p.reference_view(), before)
    assert p.read_errors() == 0
    st = kc.DecodeState("hca", 2, device="cpu")
    with pytest.raises(ValueError, match="state"):
        kc.csa_rotate(st, v, s)
    with pytest.raises(ValueError, match="kv"):
        kc.state_append(st, np.zeros((2, 100), F32), np.zeros((2, 100), F32), v, s)
    with pytest.raises(ValueError, match="slots"):
        kc.state_append(st, np.zeros((2, 512), F32), np.zeros((2, 512), F32), v, s[:1])
    assert (st.count == 0).all()


def _cpu_call_args(seed):
    """A CSA pool and state on the CPU and arguments of two rows for them:
    (pool, state, entries, index keys, valid_mask, slots, positions, kv)."""
    rng = np.random.default_rng(seed)
    p, slots = _cpu_pool_with_requests("csa", rng)
    st = kc.DecodeState("csa", 4, device="cpu")
    return (p, st, bf16_values(rng, (2, 512)), bf16_values(rng, (2, 128)), np.ones(2, bool),
            np.array(slots[:2], np.int32), np.zeros(2, np.int32), np.zeros((2, 1024), F32))


def test_cpu_scalars_and_none_passed_as_arrays_are_type_errors():
    """A number, None, a string or a list where an array belongs: TypeError
    naming the argument, before anything is written (the CUDA path runs the
    same rule, rawkv._args.require_array)."""
    p, st, ents, keys, v, s, pos, kv = _cpu_call_args(2)
    before, sbefore = p.to_reference(), st.to_reference()
    cases = [
        ("entries", lambda x: kc.flush_write(p, x, v, s, pos, index_keys=keys)),
        ("valid_mask", lambda x: kc.flush_write(p, ents, x, s, pos, index_keys=keys)),
        ("slots", lambda x: kc.flush_write(p, ents, v, x, pos, index_keys=keys)),
        ("positions", lambda x: kc.flush_write(p, ents, v, s, x, index_keys=keys)),
        ("index_keys", lambda x: kc.flush_write(p, ents, v, s, pos, index_keys=x)),
        ("topk_ids", lambda x: kc.gather_topk(p, s, x)),
        ("slots", lambda x: kc.gather_topk(p, x, np.zeros((2, 3), np.int32))),
        ("n_entries", lambda x: kc.gather_dense_batch(p, s, x, max_entries=3)),
        ("kv", lambda x: kc.state_append(st, x, kv, v, s)),
        ("z", lambda x: kc.state_seed(st, 0, kv, x)),
        ("slots", lambda x: kc.csa_rotate(st, v, x)),
        ("errors", lambda x: kc.state_clear(st, s, errors=x)),
    ]
    for name, fn in cases:
        # None means "absent" for the optional index_keys / errors
        for bad in (1.5, 3, "x", [0, 1]) + ((None,) if name not in ("index_keys", "errors") else ()):
            with pytest.raises(TypeError, match=f"^{name}"):
                fn(bad)
    assert_pool_equal(p.reference_view(), before)
    assert_state_equal(st.reference_view(), sbefore)
    assert p.read_errors() == 0 and st.read_errors() == 0


def test_cpu_dtypes_are_the_cuda_dtypes():
    """A CPU pool refuses what a CUDA pool refuses: float64 rows, int64
    slots / positions, a float mask, an out of the wrong dtype, an errors
    counter that is not int32 (float32 stands for bfloat16 on the host:
    numpy has none)."""
    p, st, ents, keys, v, s, pos, kv = _cpu_call_args(3)
    ids = np.zeros((2, 3), np.int64)
    cases = [
        ("entries", lambda: kc.flush_write(p, ents.astype(np.float64), v, s, pos, index_keys=keys)),
        ("slots", lambda: kc.flush_write(p, ents, v, s.astype(np.int64), pos, index_keys=keys)),
        ("positions", lambda: kc.flush_write(p, ents, v, s, pos.astype(np.int64), index_keys=keys)),
        ("valid_mask", lambda: kc.gather_topk(p, s, ids, valid_mask=v.astype(np.uint8))),
        ("n_entries", lambda: kc.gather_topk(p, s, ids, n_entries=pos.astype(np.int64))),
        ("topk_ids", lambda: kc.gather_topk(p, s, ids.astype(np.int16))),
        ("out", lambda: kc.gather_topk(p, s, ids, dtype="float16", out=np.zeros((2, 3, 512), F32))),
        ("kv", lambda: kc.state_append(st, kv.astype(np.float64), kv, v, s)),
        ("ape", lambda: kc.state_append(st, kv, kv, v, s, ape=np.zeros((4, 1024), np.float16))),
        ("errors", lambda: kc.csa_rotate(st, v, s, errors=np.zeros(1, np.int64))),
    ]
    for name, fn in cases:
        with pytest.raises(TypeError, match=f"^{name}"):
            fn()
    assert p.read_errors() == 0 and st.read_errors() == 0
    # accepted: torch CPU tensors of the CUDA dtypes, BF16 included
    torch = pytest.importorskip("torch")
    kc.flush_write(p, torch.from_numpy(ents).bfloat16(), torch.from_numpy(v), torch.from_numpy(s),
                   torch.from_numpy(pos), index_keys=torch.from_numpy(keys).bfloat16())
    assert p.read_errors() == 0 and p.written[s[0]] == 1


def test_pool_and_state_check_is_the_same_for_every_op():
    """One "is this a pool" rule for the format ops and the compressor: an
    object with a pool's buffers (here the reference pool) is not one."""
    rng = np.random.default_rng(4)
    p, _ = _cpu_pool_with_requests("csa", rng)
    st = kc.DecodeState("csa", 4, device="cpu")
    fake_pool, fake_state = p.reference_view(), st.reference_view()
    z = np.zeros((2, 512), F32)
    calls = [
        lambda q: kc.flush_write(q, z, np.ones(2, bool), np.zeros(2, np.int32), np.zeros(2, np.int32)),
        lambda q: kc.gather_topk(q, np.zeros(2, np.int32), np.zeros((2, 1), np.int32)),
        lambda q: kc.gather_dense(q, 0, 0),
        lambda q: kc.compress_prefill(q, z, z, None, np.ones(512, F32), 0),
        lambda q: kc.compress_decode(q, st, np.ones(512, F32), np.ones(2, bool), np.zeros(2, np.int32),
                                     np.zeros(2, np.int32)),
    ]
    msgs = set()
    for call in calls:
        with pytest.raises(TypeError, match="^pool: expected a rawkv.kvcache.PagedKVPool") as e:
            call(fake_pool)
        msgs.add(str(e.value))
    assert msgs == {"pool: expected a rawkv.kvcache.PagedKVPool, got PagedPoolRef"}
    for call in (lambda q: kc.state_append(q, z, z, np.ones(2, bool), np.zeros(2, np.int32)),
                 lambda q: kc.csa_rotate(q, np.ones(2, bool), np.zeros(2, np.int32)),
                 lambda q: kc.compress_decode(p, q, np.ones(512, F32), np.ones(2, bool),
                                              np.zeros(2, np.int32), np.zeros(2, np.int32),
                                              index=(st, np.ones(128, F32)))):
        with pytest.raises(TypeError, match="^state: expected a rawkv.kvcache.DecodeState"):
            call(fake_state)


def _cpu_only_torch():
    try:
        import torch
    except ImportError:
        return False
    return not torch.cuda.is_available()


@pytest.mark.skipif(not _cpu_only_torch(), reason="needs a torch without a usable CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_cuda_pool_without_cuda_raises_gpu_unavailable(device):
    """A CUDA pool or state on a machine whose torch has no CUDA: rawkv's
    GpuUnavailableError (as every op raises), not torch's bare AssertionError."""
    for make in (lambda: kc.PagedKVPool("csa", 4, 4, 2, 2, layout="rawkv", device=device),
                 lambda: kc.PagedKVPool("hca", 4, 4, 2, 2, layout="rawkv", device=device),
                 lambda: kc.DecodeState("csa", 2, device=device)):
        with pytest.raises(rawkv.GpuUnavailableError, match="CUDA"):
            make()


def test_device_argument_is_refused_by_name():
    for bad, exc in (("meta", ValueError), ("cuda:x", ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(exc, match="^device"):
            kc.PagedKVPool("csa", 4, 4, 2, 2, layout="rawkv", device=bad)
        with pytest.raises(exc, match="^device"):
            kc.DecodeState("csa", 2, device=bad)


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


# ---------------------------------------------------------------------------
# decode simulation (CPU pool and GPU pool share the driver)
# ---------------------------------------------------------------------------
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
def _torch():
    import torch
    return torch


def _poison_pool(pool, rng):
    """Random bytes everywhere (NaN/Inf scale and RoPE patterns included)."""
    torch = _torch()

    def fill(t):
        raw = rng.integers(0, 256, size=t.numel() * t.element_size(), dtype=np.uint8)
        t.view(torch.uint8).view(-1).copy_(torch.from_numpy(raw))
    for t in (pool.fp8, pool.scale, pool.rope, pool.index_q, pool.index_sf):
        if t is not None:
            fill(t)


def _gpu_pool(kind, rng, *, num_blocks=16, epb=4, R=6, MB=5, n_req=4, corrupt=True):
    torch = _torch()
    p = kc.PagedKVPool(kind, num_blocks, epb, R, MB, layout="rawkv", device="cuda")
    slots = [p.add_request() for _ in range(n_req)]
    # request i holds i+1 logical blocks
    p.prepare_step(slots, [p.m * epb * (i + 1) - 1 for i in range(n_req)])
    if corrupt:   # device-side corruption the kernels must survive: ids past the pool
        last = slots[-1]
        p.block_table[last, 1] = num_blocks
        p.block_table[last, 2] = 1 << 30
        p.block_table[last, 3] = -7
    torch.cuda.synchronize()
    return p, slots


def _table(pool):
    return pool.block_table.cpu().numpy().astype(np.int64)


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


def _fill_pool_random(pool, rng):
    """Plausible-but-adversarial pool contents for the gathers."""
    torch = _torch()
    nb, epb = pool.num_blocks, pool.entries_per_block
    pool.fp8.copy_(torch.from_numpy(rng.integers(0, 256, pool.fp8.shape, dtype=np.uint8)))
    sc = (np.exp(rng.standard_normal((nb, epb)) * 3)).astype(F32)
    flat = sc.reshape(-1)
    specials = np.array([0.0, -0.0, np.nan, np.inf, 1e-40, -2.5, 3e38], F32)
    flat[: specials.size] = specials
    rng.shuffle(flat)
    pool.scale.copy_(torch.from_numpy(sc))
    rope = bf16_values(rng, pool.rope.shape, 4.0)
    rope.reshape(-1)[rng.integers(0, rope.size, 5)] = np.nan
    rope.reshape(-1)[rng.integers(0, rope.size, 5)] = -np.inf
    pool.rope.copy_(torch.from_numpy(rope).bfloat16())
    if pool.index_q is not None:
        pool.index_q.copy_(torch.from_numpy(rng.integers(0, 256, pool.index_q.shape, dtype=np.uint8)))
        sf = rng.integers(0, 0x78, pool.index_sf.shape, dtype=np.uint8)
        sf.reshape(-1)[rng.integers(0, sf.size, 6)] = np.array([0x7F, 0xFF, 0, 0x80, 0x7E, 1], np.uint8)
        pool.index_sf.copy_(torch.from_numpy(sf))
    # most entries marked written by their block's owner; the others must read as unwritten
    pool.marks.copy_(torch.from_numpy((rng.random((nb, epb)) < 0.85).astype(np.uint8)))


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


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_state_ops_bit_exact(cuda, kind, rng):
    torch = _torch()
    R = 7
    st = kc.DecodeState(kind, R, device="cuda")
    m, w, d = st.m, st.width, st.head_dim

    def poison():
        for t in (st.kv_a, st.z_a, st.kv_b, st.z_b):
            if t is not None:
                v = rng.standard_normal(t.shape).astype(F32)
                v.reshape(-1)[rng.integers(0, v.size, 50)] = -np.inf
                v.reshape(-1)[rng.integers(0, v.size, 50)] = np.nan
                t.copy_(torch.from_numpy(v))
        st.count.copy_(torch.from_numpy(rng.integers(0, m, R).astype(np.int32)))
        st.count[2] = m                     # a full window: append skipped and counted
        st.count[3] = 0

    cu = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    for kv_dt in ("float32", "bfloat16"):
        for z_dt in ("float32", "bfloat16"):
            for with_ape in (False, True):
                poison()
                want = st.to_reference()
                sl = np.array([3, 2, -1, R, 5, 0, 6], np.int32)
                vm = np.array([True, True, True, True, True, False, True])
                B = sl.size
                kv = bf16_values(rng, (B, w)) if kv_dt == "bfloat16" else rng.standard_normal((B, w)).astype(F32)
                z = bf16_values(rng, (B, w)) if z_dt == "bfloat16" else rng.standard_normal((B, w)).astype(F32)
                z[0, :5] = [np.nan, np.inf, -np.inf, -0.0, 1e-40]
                if z_dt == "bfloat16":
                    z = bf16_round(z)          # what the kernel reads
                ape = rng.standard_normal((m, w)).astype(F32) if with_ape else None
                nerr = ref.state_append(want, kv, z, vm, sl, ape)
                st.reset_errors()
                kc.state_append(st, cu(kv).to(getattr(torch, kv_dt)), cu(z).to(getattr(torch, z_dt)),
                                cu(vm), cu(sl), ape=None if ape is None else cu(ape))
                assert st.read_errors() == nerr == 3
                assert_state_equal(st.to_reference(), want, f"append {kv_dt} {z_dt} ape={with_ape}")
    # rotate / reset / clear
    for op in ("rotate", "clear", "clear_masked"):
        poison()
        want = st.to_reference()
        sl = np.array([1, -4, 4, R + 2, 6], np.int32)
        vm = np.array([True, True, False, True, True])
        st.reset_errors()
        if op == "rotate":
            if kind == "csa":
                n = ref.csa_rotate(want, vm, sl)
                kc.csa_rotate(st, cu(vm), cu(sl))
            else:
                n = ref.hca_reset(want, vm, sl)
                kc.hca_reset(st, cu(vm), cu(sl))
        elif op == "clear":
            n = ref.state_clear(want, sl)
            kc.state_clear(st, cu(sl))
        else:
            n = ref.state_clear(want, sl[vm])
            kc.state_clear(st, cu(sl), valid_mask=cu(vm))
        assert st.read_errors() == n == 2
        assert_state_equal(st.to_reference(), want, op)
    with pytest.raises(ValueError, match="state"):
        (kc.hca_reset if kind == "csa" else kc.csa_rotate)(st, cu(vm), cu(sl))


def test_gpu_argument_errors_write_nothing(cuda, rng):
    torch = _torch()
    p, slots = _gpu_pool("csa", rng, corrupt=False)
    _poison_pool(p, rng)
    st = kc.DecodeState("csa", 4, device="cuda")
    dev = "cuda"
    B = 3
    ents = torch.randn(B, 512, device=dev).bfloat16()
    keys = torch.randn(B, 128, device=dev).bfloat16()
    v = torch.ones(B, dtype=torch.bool, device=dev)
    s = torch.tensor(slots[:B], dtype=torch.int32, device=dev)
    pos = torch.zeros(B, dtype=torch.int32, device=dev)
    ids = torch.zeros((B, 4), dtype=torch.int32, device=dev)
    big = torch.zeros(B * 512 + 8, dtype=torch.bfloat16, device=dev)
    misaligned = big[1:1 + B * 512].view(B, 512)
    kv = torch.zeros((B, 1024), device=dev)
    before = p.to_reference()
    sbefore = st.to_reference()
    cases = [
        (TypeError, "entries", lambda: kc.flush_write(p, ents.float(), v, s, pos, index_keys=keys)),
        (ValueError, "entries", lambda: kc.flush_write(p, ents[:, :256], v, s, pos, index_keys=keys)),
        (ValueError, "entries", lambda: kc.flush_write(p, ents.cpu(), v, s, pos, index_keys=keys)),
        (ValueError, "entries", lambda: kc.flush_write(p, misaligned, v, s, pos, index_keys=keys)),
        (ValueError, "entries", lambda: kc.flush_write(p, ents.t().contiguous().t(), v, s, pos, index_keys=keys)),
        (TypeError, "valid_mask", lambda: kc.flush_write(p, ents, v.int(), s, pos, index_keys=keys)),
        (ValueError, "valid_mask", lambda: kc.flush_write(p, ents, v[:2], s, pos, index_keys=keys)),
        (TypeError, "slots", lambda: kc.flush_write(p, ents, v, s.long(), pos, index_keys=keys)),
        (TypeError, "positions", lambda: kc.flush_write(p, ents, v, s, pos.long(), index_keys=keys)),
        (ValueError, "index_keys", lambda: kc.flush_write(p, ents, v, s, pos)),
        (ValueError, "index_keys", lambda: kc.flush_write(p, ents, v, s, pos, index_keys=keys[:, :64])),
        (TypeError, "errors", lambda: kc.flush_write(p, ents, v, s, pos, index_keys=keys,
                                                     errors=torch.zeros(1, device=dev))),
        (TypeError, "topk_ids", lambda: kc.gather_topk(p, s, ids.float())),
        (ValueError, "topk_ids", lambda: kc.gather_topk(p, s, ids[0])),
        (ValueError, "out", lambda: kc.gather_topk(p, s, ids, out=torch.empty((B, 3, 512), dtype=torch.bfloat16, device=dev))),
        (TypeError, "out", lambda: kc.gather_topk(p, s, ids, dtype=torch.bfloat16,
                                                  out=torch.empty((B, 4, 512), dtype=torch.float32, device=dev))),
        (ValueError, "n_entries", lambda: kc.gather_topk(p, s, ids, n_entries=s[:1])),
        (ValueError, "slot", lambda: kc.gather_dense(p, -1, 3)),
        (ValueError, "out", lambda: kc.gather_dense(p, 0, 3, out=torch.empty((4, 512), dtype=torch.bfloat16, device=dev))),
        (ValueError, "out", lambda: kc.gather_dense_batch(p, s, s, out=torch.empty((B, 4, 128), dtype=torch.bfloat16, device=dev))),
        (ValueError, "kv", lambda: kc.state_append(st, kv[:, :512], kv[:, :512], v, s)),
        (ValueError, "z", lambda: kc.state_append(st, kv, kv[:2], v, s)),
        (ValueError, "ape", lambda: kc.state_append(st, kv, kv, v, s, ape=torch.zeros((3, 1024), device=dev))),
        (TypeError, "valid_mask", lambda: kc.csa_rotate(st, None, s)),
        (ValueError, "valid_mask", lambda: kc.csa_rotate(st, v[:1], s)),
    ]
    for exc, name, fn in cases:
        with pytest.raises(exc, match=name):
            fn()
    torch.cuda.synchronize()
    assert_pool_equal(p.to_reference(), before)
    assert_state_equal(st.to_reference(), sbefore)
    assert p.read_errors() == 0 and st.read_errors() == 0


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


def test_gpu_no_stale_entries_after_free_and_reuse(cuda, rng):
    _stale_after_reuse("cuda", rng)


def test_gpu_state_append_duplicate_slots_terminates(cuda, rng):
    """Duplicate slots are a caller error; the rule is the reference's (the
    lowest valid row of a slot appends, every other is counted), so the
    state is the reference's bit for bit and the same on every run. Many
    CTAs name one slot (each scans the rows below it); a hang shows as a
    timeout."""
    import time
    torch = _torch()
    st = kc.DecodeState("csa", 3, device="cuda")          # 256 threads per CTA
    m, B = st.m, 8192
    kv = torch.randn((B, st.width), device="cuda")
    z = torch.randn((B, st.width), device="cuda")
    valid = torch.ones(B, dtype=torch.bool, device="cuda")
    dup = torch.zeros(B, dtype=torch.int32, device="cuda")
    dup[B // 2] = 1                                       # one row of slot 1, late in the batch
    kv_h, z_h = kv.cpu().numpy(), z.cpu().numpy()
    for start in (0, 1, m):                               # an empty window, one row in it, full
        for run in range(3):
            st.count.zero_()
            st.count[0] = start
            before = st.to_reference()
            want = before.copy()
            nerr = ref.state_append(want, kv_h, z_h, np.ones(B, bool), dup.cpu().numpy())
            assert nerr == B - 2 + (start == m)
            st.reset_errors()
            kc.state_append(st, kv, z, valid, dup)
            done = torch.cuda.Event()
            done.record()
            deadline = time.monotonic() + 30
            while not done.query():
                assert time.monotonic() < deadline, "state_append with duplicate slots did not finish"
                time.sleep(0.005)
            assert st.read_errors() == nerr
            assert_state_equal(st.to_reference(), want, f"start {start} run {run}")


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_state_seed_bit_exact_and_capturable(cuda, kind, rng):
    torch = _torch()
    hd = 512 if kind == "csa" else 128
    st = kc.DecodeState(kind, 3, hd, device="cuda")
    m, w = st.m, st.width
    cu = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731

    def poison():
        for t in (st.kv_a, st.z_a, st.kv_b, st.z_b):
            if t is not None:
                t.copy_(torch.from_numpy(rng.standard_normal(t.shape).astype(F32)))
        st.count.copy_(torch.from_numpy(rng.integers(0, m + 1, 3).astype(np.int32)))

    ape = rng.standard_normal((m, w)).astype(F32)
    for T in (0, 1, m - 1, m, 3 * m + 2):
        for dt in ("float32", "bfloat16"):
            for with_ape in (True, False):
                kv = rng.standard_normal((T, w)).astype(F32)
                z = rng.standard_normal((T, w)).astype(F32)
                if dt == "bfloat16":
                    kv, z = bf16_round(kv), bf16_round(z)
                poison()
                want = st.to_reference()
                ref.state_seed(want, 1, kv, z, ape if with_ape else None)
                kc.state_seed(st, 1, cu(kv).to(getattr(torch, dt)), cu(z).to(getattr(torch, dt)),
                              ape=cu(ape) if with_ape else None)
                assert_state_equal(st.to_reference(), want, f"state_seed T={T} {dt} ape={with_ape}")
    # captured in a CUDA graph and replayed: the same bits
    T = 2 * m + 1
    kv = rng.standard_normal((T, w)).astype(F32)
    z = rng.standard_normal((T, w)).astype(F32)
    kvt, zt, apet = cu(kv), cu(z), cu(ape)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kc.state_seed(st, 2, kvt, zt, ape=apet)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kc.state_seed(st, 2, kvt, zt, ape=apet)
    poison()
    torch.cuda.synchronize()
    want = st.to_reference()
    ref.state_seed(want, 2, kv, z, ape)
    g.replay()
    torch.cuda.synchronize()
    assert_state_equal(st.to_reference(), want, "replayed state_seed")
