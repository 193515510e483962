"""The argument rules every KV-cache op shares (rawkv/kvcache/_rules.py, rawkv._args): an
error names the argument and comes before anything is written, a CPU pool
refuses what a CUDA pool refuses (dtypes, scalars and None where an array
belongs, an object that is not a pool or state), and outputs may not lie in
the pool's or state's buffers (issue 21, item 7). Each op's own argument
errors: its test file."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rawkv import kvcache as kc
from support.kvcache import (
    F32, assert_pool_equal, assert_state_equal, bf16_values, _cpu_pool_with_requests, _gpu_pool,
    _poison_pool, _small_hca_pool, _torch,
)
from support.outputs import _refused


# ---------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------
def test_sizes_are_checked_before_out_is_allocated():
    # an n_entries / max_entries past what the op takes is a ValueError naming
    # it, not a MemoryError from allocating out first
    p = kc.PagedKVPool("hca", 4, 2, 2, 2, layout="rawkv", device="cpu")
    s = p.add_request()
    p.prepare_step([s], [255])
    with pytest.raises(ValueError, match=r"^n_entries: 100000000 is out of range \[0, 5\)"):
        kc.gather_dense(p, s, 10 ** 8)
    with pytest.raises(ValueError, match="^max_entries: "):
        kc.gather_dense_batch(p, np.array([s], np.int32), np.array([1], np.int32), max_entries=10 ** 13)
    assert kc.gather_dense(p, s, 2, dtype="float32").shape == (2, p.head_dim)
    # index arguments of 2^32 ids in 4 bytes (a stride-0 view) sized out before they were refused
    torch = pytest.importorskip("torch")
    ids = torch.zeros(1, 1, dtype=torch.int32).expand(1 << 16, 1 << 16)
    slots = torch.zeros(1 << 16, dtype=torch.int32)
    for call in (lambda: kc.gather_topk(p, slots, ids), lambda: kc.kvcache_indices(p, slots, ids),
                 lambda: kc.topk_to_kvcache_indices(ids, torch.zeros(1, 1, dtype=torch.int32), page_size=2,
                                                    num_pages=4)):
        with pytest.raises(ValueError, match=r"^topk_ids: must be contiguous"):
            call()
    from rawkv.kvcache import layouts
    with pytest.raises(ValueError, match=r"^indices: must be contiguous"):
        layouts.model1_gather(layouts.new_layout_cache("model1", 1, 4, device="cpu"), ids, page_size=4)


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
    # a torch out of another dtype and no dtype given: the out is named, not the dtype it set
    with pytest.raises(TypeError, match="^out: expected bfloat16, float16 or float32"):
        kc.gather_topk(p, s, ids, out=torch.zeros(2, 3, 512, dtype=torch.float64))
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


# ---------------------------------------------------------------------------
# outputs in the pool's / state's buffers
# ---------------------------------------------------------------------------
def test_pool_ops_refuse_outputs_in_the_pools_buffers():
    """out= / errors= in the memory of a buffer of the pool the op reads or
    writes (pool.written, pool.block_table, ...) was accepted: the op wrote
    its rows or counts into the pool's own bookkeeping."""
    p, s = _small_hca_pool()
    ents = np.ones((1, p.head_dim), np.float32)
    slots = np.array([s], np.int32)
    kc.flush_write(p, ents, np.ones(1, bool), slots, np.array([0], np.int32))
    before = p.to_reference()
    ids = np.zeros((1, 2), np.int32)
    flush = (p, ents, np.ones(1, bool), slots, np.array([p.m], np.int32))
    _refused("errors", "pool.written", lambda: kc.flush_write(*flush, errors=p.written[s:s + 1]))
    _refused("errors", "pool.owners", lambda: kc.gather_topk(p, slots, ids, errors=p.owners[:1]))
    _refused("errors", "pool.request_ids", lambda: kc.assign_pages(p, slots, slots * 0, errors=p.request_ids))
    _refused("out", "pool.block_table", lambda: kc.kvcache_indices(p, slots, ids, out=p.block_table[:1, :2]))
    rope = p.rope.reshape(-1)          # float32 on a CPU pool: the rows' dtype
    _refused("out", "pool.rope", lambda: kc.gather_dense(p, s, 1, dtype="float32",
                                                         out=rope[:p.head_dim].reshape(1, -1)))
    _refused("out", "pool.rope", lambda: kc.gather_dense_batch(p, slots, np.ones(1, np.int32), dtype="float32",
                                                               out=rope[:2 * p.head_dim].reshape(1, 2, -1)))
    _refused("out", "pool.rope", lambda: kc.gather_topk(
        p, slots, ids[:, :1], dtype="float32", out=rope[-p.head_dim:].reshape(1, 1, -1)))
    _refused("errors", "pool.marks", lambda: kc.gather_dense(p, s, 1, errors=p.marks.reshape(-1)[:4].view(np.int32)))
    got = p.reference_view()
    for f in ("kv_fp8", "kv_scale", "kv_rope", "block_table", "written", "marks", "request_ids", "owners"):
        assert np.array_equal(getattr(got, f), getattr(before, f)), f
    assert p.read_errors() == 0


def test_inputs_in_the_buffers_an_op_writes_are_refused():
    """An op that writes a pool's or decode state's buffers may not read an
    input that lies in them: a state_seed kv over state.kv_a read the rows
    the op had just cleared (the slot then claimed rows of zeros), a
    state_append's row 1 read row 0's new values; on a GPU blocks race.
    Refused naming both, before anything is written."""
    torch = pytest.importorskip("torch")
    st = kc.DecodeState("hca", 2, head_dim=8, device="cpu")
    kv = torch.arange(40.).reshape(5, 8) + 1
    kc.state_seed(st, 0, kv, torch.ones(5, 8))
    before = st.to_reference()
    kv_a, z_a = torch.from_numpy(st.kv_a), torch.from_numpy(st.z_a)
    count = torch.from_numpy(st.count)
    _refused("kv", "state.kv_a", lambda: kc.state_seed(st, 0, kv_a[0, :5], z_a[0, :5]))
    _refused("z", "state.z_a", lambda: kc.state_seed(st, 1, kv, z_a[0, :5]))
    _refused("kv", "state.kv_a", lambda: kc.state_append(st, kv_a[0, :2], z_a[1, :2].clone(),
                                                         torch.ones(2, dtype=torch.bool),
                                                         torch.tensor([0, 1], dtype=torch.int32)))
    _refused("slots", "state.count", lambda: kc.hca_reset(st, torch.ones(1, dtype=torch.bool), count[1:]))
    assert_state_equal(st.to_reference(), before)
    p, s = _small_hca_pool()
    pbefore = p.to_reference()
    rids = torch.from_numpy(p.request_ids)
    ents = torch.zeros(1, p.head_dim, dtype=torch.bfloat16)
    _refused("slots", "pool.request_ids", lambda: kc.flush_write(
        p, ents, torch.ones(1, dtype=torch.bool), rids[s:s + 1], torch.zeros(1, dtype=torch.int32)))
    _refused("blocks", "pool.request_ids", lambda: kc.assign_pages(p, torch.tensor([s], dtype=torch.int32),
                                                                   rids[:1]))
    assert_pool_equal(p.to_reference(), pbefore)
    assert p.read_errors() == 0 and st.read_errors() == 0


def test_the_objects_own_counter_given_explicitly_is_the_default():
    """errors=pool.errors / state.errors (or a tensor over it) is the op's
    default counter, not an overlap."""
    torch = pytest.importorskip("torch")
    p, s = _small_hca_pool()
    slots = np.array([s], np.int32)
    kc.gather_topk(p, slots, np.array([[5]], np.int32), errors=p.errors)
    kc.gather_topk(p, slots, np.array([[5]], np.int32), errors=torch.from_numpy(p.errors))
    assert p.read_errors() == 2
    st = kc.DecodeState("hca", 2, head_dim=128, device="cpu")
    kc.hca_reset(st, np.ones(1, bool), np.array([7], np.int32), errors=st.errors)
    assert st.read_errors() == 1


def _other_objects_outputs(device):
    """(objects, [(call, refusal)], accepted) of ops given an out= / errors=
    in the buffers of a pool or decode state the op does not work on:
    another pool's request_ids, written, block_table, rope, owners, a
    state's count, eagerly and through the rawkv:: operators, the pool,
    state and layout ops alike. `accepted()` runs the calls that stay
    allowed (another object's counter whole, the engine's own arrays) and
    returns the count they added to pool B's counter."""
    import torch
    import rawkv.library  # noqa: F401
    from rawkv.kvcache import layouts
    from rawkv.kvcache import views as V
    ops = torch.ops.rawkv
    new = lambda: kc.PagedKVPool("hca", 8, 2, 2, 4, layout="rawkv", device=device)  # noqa: E731
    a, b = new(), new()
    for p in (a, b):
        p.prepare_step([p.add_request()], [2 * p.m - 1])
    st, st2 = (kc.DecodeState("hca", 2, head_dim=8, device=device) for _ in range(2))
    tb, ts2 = V.pool_args(b), V.state_args(st2)        # torch tensors over a CPU object's arrays too
    t = lambda x: torch.as_tensor(x).to(device)        # noqa: E731
    sl, ids = t(np.array([0], np.int32)), t(np.array([[0, 99]], np.int32))
    D = a.head_dim
    rope = tb["rope"].reshape(-1)[:D].view(1, D)       # (float32 on a CPU pool, bfloat16 on CUDA)
    cache = layouts.new_layout_cache("model1", 2, 4, device=device)
    rows, one = t(np.zeros((1, D), np.float32)), t(np.ones(1, bool))
    cases = [
        (lambda: kc.gather_topk(a, sl, ids, errors=tb["request_ids"]),
         "errors: is the request_ids buffer of a PagedKVPool, not an error counter"),
        (lambda: kc.gather_topk(a, sl, ids, errors=tb["written"][:1]),
         "errors: overlaps the written buffer of a PagedKVPool"),
        (lambda: kc.kvcache_indices(a, sl, ids, out=tb["block_table"][:1, :2]),
         "out: overlaps the block_table buffer of a PagedKVPool"),
        (lambda: kc.gather_dense(a, 0, 1, out=rope), "out: overlaps the rope buffer of a PagedKVPool"),
        (lambda: kc.flush_write(a, rows.bfloat16(), one, sl, t(np.zeros(1, np.int32)), errors=ts2["count"][:1]),
         "errors: overlaps the count buffer of a DecodeState"),
        (lambda: kc.assign_pages(a, sl, sl, errors=tb["owners"][:1]),
         "errors: overlaps the owners buffer of a PagedKVPool"),
        (lambda: kc.state_clear(st, sl, errors=tb["written"]), "errors: is the written buffer of a PagedKVPool"),
        (lambda: kc.state_append(st, rows[:, :8], rows[:, :8], one, sl, errors=ts2["count"]),
         "errors: is the count buffer of a DecodeState"),
        (lambda: layouts.model1_store(cache, rows, t(np.array([99], np.int32)), page_size=4, errors=tb["written"][:1]),
         "errors: overlaps the written buffer of a PagedKVPool"),
        (lambda: layouts.model1_gather(cache, sl, page_size=4, errors=tb["written"]),
         "errors: is the written buffer of a PagedKVPool"),
        (lambda: layouts.model1_gather(cache, sl, page_size=4, out=rope),
         "out: overlaps the rope buffer of a PagedKVPool"),
        (lambda: layouts.topk_to_kvcache_indices(ids, tb["block_table"].clone(), page_size=4, num_pages=2,
                                                 out=tb["block_table"][:1, :2]),
         "out: overlaps the block_table buffer of a PagedKVPool"),
        (lambda: layouts.topk_to_kvcache_indices(ids, tb["block_table"].clone(), page_size=4, num_pages=2,
                                                 errors=tb["owners"][:1]),
         "errors: overlaps the owners buffer of a PagedKVPool"),
        # the operators: the view refused such a counter already (check_counter_owner), not an out=
        (lambda: ops.kv_kvcache_indices(**V.pool_args(a), slots=sl, topk_ids=ids, n_entries=None, valid_mask=None,
                                        out=tb["block_table"][:1, :2]),
         "out: overlaps the block_table buffer of a PagedKVPool"),
        (lambda: ops.kv_gather_dense(**V.pool_args(a), slot=0, n_entries=1, out=rope),
         "out: overlaps the rope buffer of a PagedKVPool"),
        (lambda: ops.kv_model1_gather(cache, sl, 4, rope, None), "out: overlaps the rope buffer of a PagedKVPool"),
        (lambda: ops.kv_topk_to_kvcache_indices(ids, tb["block_table"].clone(), 4, 2, None, None,
                                                torch.empty_like(ids), tb["owners"][:1]),
         "errors: overlaps the owners buffer of a PagedKVPool"),
    ]

    def accepted():
        kc.gather_topk(a, sl, ids, errors=tb["errors"])                # another pool's counter, whole
        ops.kv_gather_topk(**V.pool_args(a, tb["errors"]), slots=sl, topk_ids=ids, n_entries=None,
                           valid_mask=None, out=kc.gather_topk(a, sl, ids, errors=t(np.zeros(1, np.int32))))
        layouts.model1_gather(cache, t(np.array([99], np.int32)), page_size=4, errors=tb["errors"])
        kc.state_clear(st, sl, errors=ts2["errors"])
        return b.read_errors()

    return (a, b, st, st2), cases, accepted


def _refuses_other_objects_outputs(device):
    objs, cases, accepted = _other_objects_outputs(device)
    before = [{n: None if x is None else x.clone() for n, x in o.torch_buffers().items()} for o in objs]
    for call, msg in cases:
        # (the argument first, then the buffer it lies in; the words differ
        # by path: the operators' view checks name some first)
        name, buffer = msg.split(":")[0], re.search(r"the \w+ buffer of", msg).group(0)
        with pytest.raises(ValueError, match=f"^{name}: .*{buffer}"):
            call()
    for o, was in zip(objs, before):            # nothing written into any object
        now = o.torch_buffers()
        for n, x in was.items():
            assert (x is None and now[n] is None) or bool((now[n] == x).all()), (o, n)
    # gather_topk's id 99 twice and entry 0 (never written) twice; model1_gather's index 99
    assert accepted() == 5
    assert objs[0].read_errors() == 0 and objs[3].read_errors() == 0


def test_outputs_in_another_objects_buffers_are_refused():
    """An out= / errors= in a buffer of a pool or decode state other than
    the op's own was accepted eagerly (and an out= on the operators' path
    too): gather_topk(A, ..., errors=B.request_ids) added A's skipped ids
    into B's request id (B's request then read none of its blocks), an
    out= over B.block_table took A's indices, the layout ops alike. Now
    each is refused naming the argument and the buffer, before anything is
    written, on every path; another object's counter whole stays a
    counter, as the operators' check_counter_owner allows. (The cases are
    a review helper's, written against its own fix of the same finding.)"""
    pytest.importorskip("torch")
    _refuses_other_objects_outputs("cpu")


# ---------------------------------------------------------------------------
# GPU


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
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


def test_gpu_outputs_in_another_objects_buffers_are_refused(cuda):
    """The CUDA path refuses the same outputs, before anything is launched
    (the cases of a review helper's test, on both paths)."""
    _refuses_other_objects_outputs("cuda")
