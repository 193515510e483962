"""The paged pool and the decode state as objects (rawkv/kvcache/pool.py, state.py):
buffers, the constructor's rules, add / free / prepare_step bookkeeping (out of
blocks before any write, block reuse), the device argument, attach, the
buffers fixed after construction and the pool views the operators build
(docs/kvcache.md, "Pool buffers")."""

from __future__ import annotations

import re

import numpy as np
import pytest

import rawkv
from rawkv import kvcache as kc
from support.kvcache import D, DI, F32, _Dev


# ---------------------------------------------------------------------------
# CPU: buffers and bookkeeping
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


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


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


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_index_layout_is_checked_for_every_layout(kind):
    """index_layout names how the layout stores its indexer keys: 'nvfp4'
    for 'rawkv', 'fp8' / 'mxfp4' / 'mxfp8' for 'model1', or None for the layout's own
    (nvfp4 / fp8). Anything else is a ValueError naming index_layout and
    listing what the layout takes, also for an HCA pool (no keys: the
    engine's one setting for its layers): 'rawkv' accepted any value and
    stored NVFP4 keys whatever was asked."""
    keys = kind == "csa"
    for layout, good in (("rawkv", ["nvfp4"]), ("model1", ["fp8", "mxfp4", "mxfp8"])):
        for il in [None] + good:
            p = kc.PagedKVPool(kind, 4, 4, 2, 2, layout=layout, index_layout=il, device="cpu")
            assert p.index_layout == ((il or good[0]) if keys else None)
        bad = {"rawkv": ["fp8", "mxfp4", "mxfp8"], "model1": ["nvfp4"]}[layout] + ["bogus", "FP8", 7, True, ["fp8"]]
        for il in bad:
            want = f"index_layout: the '{layout}' layout takes {good} (or None), got {il!r}"
            with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
                kc.PagedKVPool(kind, 4, 4, 2, 2, layout=layout, index_layout=il, device="cpu")


def test_the_reference_pool_checks_index_layout_as_the_pool_does():
    """reference.PagedPoolRef.create takes index_layout by the same rule
    (reference.INDEX_LAYOUTS_OF): it ignored the value for 'rawkv'."""
    from rawkv.reference import kvcache as ref
    for layout, good in (("rawkv", ["nvfp4"]), ("model1", ["fp8", "mxfp4", "mxfp8"])):
        d = 512 if layout == "model1" else 128
        for il in [None] + good:
            ref.PagedPoolRef.create(4, 4, 4, head_dim=d, index_head_dim=128, layout=layout, index_layout=il)
        for il in {"rawkv": ["fp8", "mxfp4", "mxfp8"], "model1": ["nvfp4"]}[layout] + ["bogus", 7]:
            want = f"index_layout: the '{layout}' layout takes {good} (or None), got {il!r}"
            with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
                ref.PagedPoolRef.create(4, 4, 4, head_dim=d, index_head_dim=128, layout=layout, index_layout=il)
    p = ref.PagedPoolRef.create(4, 4, 4, head_dim=512, index_head_dim=128, layout="model1")
    assert p.index_layout == "fp8"


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


def _prepare_keeps_rows_written_in_place(device):
    """prepare_step writes only the block-table cells it allocates: an
    engine's in-place writes survive, in a row of a slot between two stepped
    slots (the upload of the host rows [min slot, max slot] set it back to
    the host's record) and in a stepped slot's cell the step does not
    allocate. The allocated blocks still get their owner."""
    dv = _Dev(device)
    p = kc.PagedKVPool("csa", 8, 2, 3, 3, layout="rawkv", device=device)    # m=4, epb=2: 8 tokens per block
    a, b, c = p.add_request(), p.add_request(), p.add_request()
    assert p.prepare_step([a, b, c], [0, 0, 0]) == 3                         # blocks 0, 1, 2
    p.block_table[b, 0], p.block_table[b, 1] = 5, 6                          # an engine's writes, in place
    p.block_table[a, 0] = 7
    assert p.prepare_step([a, c], [8, 8]) == 2                               # logical block 1 of a and c
    table = dv.buf(p.block_table)
    np.testing.assert_array_equal(table[b], [5, 6, -1], err_msg="the row of a slot not in the step")
    np.testing.assert_array_equal(table[a], [7, 3, -1], err_msg="a stepped slot's other cells")
    np.testing.assert_array_equal(table[c], [2, 4, -1])
    assert p.blocks_of(a) == [0, 3] and p.blocks_of(c) == [2, 4]               # the host's record
    owners, ids = dv.buf(p.owners), dv.buf(p.request_ids)
    assert owners[3] == ids[a] and owners[4] == ids[c]


def test_prepare_step_names_an_unsigned_value_past_int64():
    """A uint64 host position or slot past the int64 range is refused with
    its own value. Before, the cast to int64 wrapped it: position 2^64 - 1
    was refused as "position -1 of slot 0 is negative", slot 2^64 - 1 as
    slot -1."""
    p = kc.PagedKVPool("csa", 4, 2, 3, 2, layout="rawkv", device="cpu")
    a = p.add_request()
    big = np.array([2 ** 64 - 1], np.uint64)
    with pytest.raises(ValueError, match=r"^positions: 18446744073709551615 is past the int64 range"):
        p.prepare_step(np.array([a], np.uint64), big)
    with pytest.raises(ValueError, match=r"^slots: 18446744073709551615 is past the int64 range"):
        p.prepare_step(big, np.array([0], np.uint64))
    assert p.prepare_step(np.array([a], np.uint64), np.array([3], np.uint64)) == 1


def test_cpu_prepare_step_keeps_rows_written_in_place():
    _prepare_keeps_rows_written_in_place("cpu")


def test_gpu_prepare_step_keeps_rows_written_in_place(cuda):
    _prepare_keeps_rows_written_in_place("cuda")


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


# ---------------------------------------------------------------------------
# attach: a pool's decode states
# ---------------------------------------------------------------------------
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


def test_attach_refuses_a_state_of_another_kind_or_width():
    """attach takes only the states compress_decode can use with the pool:
    its kind, and the head_dim of its entries or (CSA) indexer keys. Before,
    an HCA state (or a CSA state of head_dim 256) was bound to a CSA pool,
    which compress_decode then refused by kind, and the state's own pool
    refused it as attached to another pool."""
    csa = kc.PagedKVPool("csa", 8, 4, 2, 2, layout="rawkv", device="cpu")
    hca = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
    for pool, bad in ((csa, kc.DecodeState("hca", 2, device="cpu")), (csa, kc.DecodeState("csa", 2, 256, device="cpu")),
                      (hca, kc.DecodeState("csa", 2, device="cpu")), (hca, kc.DecodeState("hca", 2, DI, device="cpu"))):
        with pytest.raises(ValueError, match="^state: is a '(csa|hca)' state of head_dim"):
            pool.attach(bad)
        assert bad._pool is None and pool._states == []
    hca.attach(kc.DecodeState("hca", 2, device="cpu"))
    csa.attach(kc.DecodeState("csa", 2, device="cpu"), kc.DecodeState("csa", 2, DI, device="cpu"))
    assert len(csa._states) == 2 and len(hca._states) == 1


def test_a_view_of_another_pools_state_is_not_attached():
    """A view over a DecodeState's own buffers (views.state_view) is that
    state for attach and compress_decode, as on the operators' path: a view
    of pool Q's attached state is refused by pool P (a state belongs to one
    pool), and a view of P's own attached state is taken. Before, P.attach
    took the view, compress_decode(P, view) pooled Q's request's window into
    P's request's entry with no error, and P.free_request emptied Q's
    request's window."""
    from rawkv.kvcache import views
    pool = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
    other = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
    theirs, mine = kc.DecodeState("hca", 2, device="cpu"), kc.DecodeState("hca", 2, device="cpu")
    other.attach(theirs)
    view = views.state_view(**views.state_args(theirs))
    with pytest.raises(ValueError, match="^state: is attached to another pool"):
        pool.attach(view)
    assert pool._states == [] and view._pool is None
    a, b = pool.add_request(), other.add_request()
    pool.prepare_step([a], [127])
    kc.state_seed(theirs, b, np.ones((127, D), F32), np.ones((127, D), F32))
    kc.state_append(theirs, np.ones((1, D), F32), np.ones((1, D), F32), np.ones(1, bool), np.array([b], np.int32))
    args = (np.ones(D, F32), np.ones(1, bool), np.array([a], np.int32), np.array([127], np.int32))
    with pytest.raises(ValueError, match="^state: is not attached to this pool"):
        kc.compress_decode(pool, view, *args)
    assert pool.read_errors() == 0 and not pool.written.any() and not pool.marks.any()
    pool.free_request(a)
    assert list(theirs.count) == [128, 0]                # Q's request keeps its window
    pool.attach(mine)
    a = pool.add_request()
    pool.prepare_step([a], [127])
    kc.state_seed(mine, a, np.ones((127, D), F32), np.ones((127, D), F32))
    kc.state_append(mine, np.ones((1, D), F32), np.ones((1, D), F32), np.ones(1, bool), np.array([a], np.int32))
    pool.attach(views.state_view(**views.state_args(mine)))          # its own state again: nothing changes
    assert pool._states == [mine]
    kc.compress_decode(pool, views.state_view(**views.state_args(mine)), *args)
    assert pool.read_errors() == 0 and list(pool.written) == [1, 0]


def test_compress_decode_takes_a_pool_view_with_its_pools_state_object():
    """compress_decode over a view of pool P's own buffers is P: the
    DecodeState object attached to P is taken with it, as with P itself or
    with a view of that state, and writes the same entry; another pool's
    attached state is refused. Before, the view with the state object was
    refused (`state: is not attached to this pool`)."""
    pytest.importorskip("torch")
    from rawkv.kvcache import views
    pools, states = [], []
    for _ in range(2):
        pool = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
        st = kc.DecodeState("hca", 2, device="cpu")
        pool.attach(st)
        s = pool.add_request()
        pool.prepare_step([s], [127])
        kc.state_seed(st, s, np.ones((127, D), F32), np.ones((127, D), F32))
        kc.state_append(st, np.ones((1, D), F32), np.ones((1, D), F32), np.ones(1, bool), np.array([s], np.int32))
        pools.append(pool)
        states.append(st)
    args = (np.ones(D, F32), np.ones(1, bool), np.array([0], np.int32), np.array([127], np.int32))
    view = views.pool_view(**views.pool_args(pools[1]))
    with pytest.raises(ValueError, match="^state: is not attached to this pool"):
        kc.compress_decode(view, states[0], *args)
    assert not pools[1].written.any()
    kc.compress_decode(pools[0], states[0], *args)
    kc.compress_decode(view, states[1], *args)
    assert pools[1].read_errors() == 0 and list(pools[1].written) == [1, 0]
    assert (pools[1].fp8 == pools[0].fp8).all() and (pools[1].scale == pools[0].scale).all()
    assert pools[1].marks[0, 0] == 1


def test_a_pool_view_is_its_pool_for_host_bookkeeping():
    """A pool view (views.pool_view) has no host bookkeeping of its own.
    Over a pool's own buffers it is that pool (as for compress_decode's
    attachment rule and gather_dense's count): attach, add_request,
    prepare_step, free_request and the host queries act on the pool. Over
    an engine's own buffers each is a ValueError naming pool, before
    anything changes. Before, every one raised a bare TypeError /
    AttributeError, and attach did so after binding the state to the view:
    the pool then refused that state as attached to another pool, and no
    free_request ever emptied its slots."""
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import views
    pool = kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu")
    view = views.pool_view(**views.pool_args(pool))
    st = kc.DecodeState("hca", 2, device="cpu")
    view.attach(st)
    assert st._pool is pool and pool._states == [st]
    pool.attach(st)                                     # its own pool: nothing changes
    s = view.add_request()
    assert pool.active_slots() == view.active_slots() == [s]
    assert view.prepare_step([s], [4 * 128 - 1]) == 1
    assert view.n_entries(s) == pool.n_entries(s) == 4 and view.blocks_of(s) == pool.blocks_of(s) == [0]
    assert view.free_blocks() == pool.free_blocks() == 7
    assert (view.block_table_host() == pool.block_table_host()).all()
    kc.state_seed(st, s, np.ones((5, D), F32), np.ones((5, D), F32))
    view.free_request(s)
    assert pool.active_slots() == [] and pool.free_blocks() == 8 and list(st.count) == [0, 0]

    own = {n: (t.clone() if hasattr(t, "clone") else t) for n, t in views.pool_args(pool).items()}
    engines = views.pool_view(**own)
    other = kc.DecodeState("hca", 2, device="cpu")
    calls = {"attach": lambda: engines.attach(other), "add_request": engines.add_request,
             "free_request": lambda: engines.free_request(0), "prepare_step": lambda: engines.prepare_step([0], [0]),
             "n_entries": lambda: engines.n_entries(0), "blocks_of": lambda: engines.blocks_of(0),
             "free_blocks": engines.free_blocks, "active_slots": engines.active_slots,
             "block_table_host": engines.block_table_host}
    for name, call in calls.items():
        with pytest.raises(ValueError, match="^pool: is a view over an engine's own buffers"):
            call()
    assert other._pool is None
    kc.PagedKVPool("hca", 8, 4, 2, 2, layout="rawkv", device="cpu").attach(other)     # still attachable


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


def _add_empties_slot(device):
    """A row appended into a free slot (a stale step still naming the slot
    after free_request: the state ops do not know which slots hold a
    request, so it is accepted and not counted) does not reach the next
    request in that slot: add_request empties the slot of every attached
    state, as free_request does. Before, the new request's first window
    started with the freed request's row, and its first entry pooled it."""
    dv = _Dev(device)
    pool = kc.PagedKVPool("csa", 8, 4, 2, 2, layout="rawkv", device=device)
    st, ist = kc.DecodeState("csa", 2, device=device), kc.DecodeState("csa", 2, DI, device=device)
    pool.attach(st, ist)
    keep = pool.add_request()
    s = pool.add_request()
    pool.free_request(s)
    for state in (st, ist):
        x = np.ones((2, state.width), F32)
        kc.state_append(state, dv.t(x), dv.t(x), dv.t(np.ones(2, bool)), dv.t(np.array([s, keep], np.int32)))
        x6 = np.ones((6, state.width), F32)
        kc.state_seed(state, keep, dv.t(x6), dv.t(x6))      # the other slot: a b-stream and 2 rows
        assert list(state.to_reference().count) == [2, 1]
    assert pool.add_request() == s
    for state in (st, ist):
        r = state.to_reference()
        assert list(r.count) == [2, 0]
        assert not r.a_kv[s].any() and np.isneginf(r.a_z[s]).all()
        assert not r.b_kv[s].any() and np.isneginf(r.b_z[s]).all()
        assert r.b_kv[keep].all() and r.a_kv[keep, :2].all()      # no other slot


def test_cpu_add_request_empties_the_attached_states_slot():
    _add_empties_slot("cpu")


def test_gpu_add_request_empties_the_attached_states_slot(cuda):
    _add_empties_slot("cuda")


def _built_under_inference_mode(device):
    """A layer's pool and decode states built under torch.inference_mode (as
    serving code builds its layers), then used outside it: their buffers are
    plain tensors, as Fp4GroupedLinear's output is (torch lets nothing write
    an inference tensor outside inference_mode). Before, every op counting
    into the pool's or state's own counter was refused (`errors: is an
    inference tensor`, an argument the caller never passed), and
    compress_prefill, which does not check its counter, wrote its entries
    and then raised torch's RuntimeError adding its count; on CUDA the
    lifecycle calls (prepare_step, free_request) raised it after changing
    the host's bookkeeping."""
    torch = pytest.importorskip("torch")
    dv = _Dev(device)
    with torch.inference_mode():
        pool = kc.PagedKVPool("hca", 8, 2, 2, 2, layout="rawkv", device=device)
        st = kc.DecodeState("hca", 2, device=device)
        pool.attach(st)
    for obj in (pool, st):
        assert not any(t is not None and t.is_inference() for t in obj.torch_buffers().values())
    s = pool.add_request()
    pool.prepare_step([s], [4 * 128 - 1])                   # 2 blocks: entries 0..3
    x = np.ones((1, D), F32)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)   # noqa: E731
    kc.state_append(st, t(x), t(x), t(np.ones(1, bool)), t(np.array([s], np.int32)))
    kc.state_append(st, t(x), t(x), t(np.ones(1, bool)), t(np.array([5], np.int32)))    # counted
    assert st.read_errors() == 1
    rows = np.ones((5 * 128, D), F32)
    assert kc.compress_prefill(pool, t(rows), t(rows), None, t(np.ones(D, F32)), s) == 5   # entry 4: counted
    assert pool.read_errors() == 1
    assert dv.buf(pool.written)[s] == 4
    out = kc.gather_dense(pool, s, 4, dtype="float32")
    assert pool.read_errors() == 1 and dv.host(out).all()
    pool.free_request(s)
    assert pool.add_request() == s and pool.free_blocks() == 8


def test_cpu_pool_built_under_inference_mode_is_used_outside_it():
    _built_under_inference_mode("cpu")


def test_gpu_pool_built_under_inference_mode_is_used_outside_it(cuda):
    _built_under_inference_mode("cuda")


# ---------------------------------------------------------------------------
# the pool's buffers are checked once and fixed (issue 21, item 5)
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


def test_pool_and_layout_ops_refuse_element_misaligned_indices():
    """The pool's and the layout ops' kernels load (or store) their int32 /
    int64 indices one element at a time: an index array at an odd byte
    offset (a DLPack array or torch.frombuffer) faults on the GPU (a sticky
    error). It was taken on CPU and launched on CUDA (the state ops' and
    compress_decode's were mended first); each is refused by name, nothing
    written."""
    torch = pytest.importorskip("torch")
    from support.views import off_element
    pool = kc.PagedKVPool("csa", 4, 4, 2, 2, index_head_dim=None, layout="model1", device="cpu")
    a = pool.add_request()
    pool.prepare_step([a], [3])
    i32 = (lambda v: torch.tensor(v, dtype=torch.int32))
    bad = (lambda v: off_element(i32(v)))
    rows = torch.ones((1, pool.head_dim), dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.bool)
    cache = kc.new_layout_cache("model1", 2, 4, device="cpu")
    before = {n: np.copy(getattr(pool.to_reference(), n)) for n in ("pages", "written", "marks", "owners")}
    calls = [
        ("slots", lambda: kc.flush_write(pool, rows, one, bad([a]), i32([0]))),
        ("positions", lambda: kc.flush_write(pool, rows, one, i32([a]), bad([0]))),
        ("slots", lambda: kc.assign_pages(pool, bad([a]), i32([2]))),
        ("blocks", lambda: kc.assign_pages(pool, i32([a]), bad([2]))),
        ("slots", lambda: kc.gather_topk(pool, bad([a]), i32([[0]]))),
        ("topk_ids", lambda: kc.gather_topk(pool, i32([a]), bad([[0]]))),
        ("n_entries", lambda: kc.gather_topk(pool, i32([a]), i32([[0]]), n_entries=bad([1]))),
        ("slots", lambda: kc.gather_dense_batch(pool, bad([a]), i32([1]), max_entries=1)),
        ("n_entries", lambda: kc.gather_dense_batch(pool, i32([a]), bad([1]), max_entries=1)),
        ("slots", lambda: kc.model1_store(cache, rows, bad([0]), page_size=4)),
        ("indices", lambda: kc.model1_gather(cache, bad([0]), page_size=4)),
        ("topk_ids", lambda: kc.topk_to_kvcache_indices(bad([[0]]), i32([[0]]), page_size=4, num_pages=2)),
        ("block_table", lambda: kc.topk_to_kvcache_indices(i32([[0]]), bad([[0]]), page_size=4, num_pages=2)),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"^{name}: data must be \d-byte aligned"):
            call()
    after = pool.to_reference()
    for n, v in before.items():
        np.testing.assert_array_equal(getattr(after, n), v, err_msg=n)
    assert not cache.any() and pool.read_errors() == 0


def test_max_requests_past_int32_slots_is_named_before_allocating():
    """max_requests past 2^31 (the ops take slots as int32) is a ValueError naming it, for a pool and
    a decode state, before anything is allocated: 2**63 failed in numpy's allocation ('Maximum allowed
    dimension exceeded'), 2**31 + 1 as a MemoryError, naming nothing."""
    for R in (2 ** 31 + 1, 2 ** 63, 2 ** 64):
        with pytest.raises(ValueError, match="^max_requests: "):
            kc.PagedKVPool("csa", 8, 4, R, 4, device="cpu")
        with pytest.raises(ValueError, match="^max_requests: "):
            kc.DecodeState("hca", R, device="cpu")
