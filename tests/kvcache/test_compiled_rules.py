"""The pools' and decode states' protection rules under torch.compile
(rawkv/kvcache/traced.py; docs/kvcache.md, "Under torch.compile").

torch.compile functionalizes a mutating operator: each argument it writes
reaches the implementation as a fresh copy (aot_eager always; inductor
where it cannot write in place), written back over the argument after the
call. The rules that find a tensor by its memory (the registry of the
pools' and states' buffers: pool.check_store_cache, check_not_anothers,
check_one_owner, ...) saw the copy, an engine's own memory, and a compiled
call took what eager refuses: a store whose cache was pool.marks, a gather
whose errors= lay in pool.request_ids, a flush into another pool's
`written`. Each is now refused while dynamo traces, with the eager error,
and a later call of the compiled function on other memory retraces
(guards), so it is refused too. Nothing is written either way. Under
aot_eager the copies are read as the tensors they stand for when the
operator runs (kvcache.traced.note_copies), so the demo's decode step,
refused there before, runs as eagerly, and a later call not traced again
is held to the eager rules."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv.library  # noqa: E402,F401
from rawkv import _opdecl  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.kvcache import views as V  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from support.kvcache import _small_hca_pool  # noqa: E402
from support.library import samples  # noqa: E402

OPS = torch.ops.rawkv


def _compiled(fn):
    """fn under torch.compile with functionalization and no in-place
    rewrite (aot_eager), counting its traces."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, fullgraph=True, backend=counter), counter


def _refused_eager_and_compiled(fn, arg, match):
    """fn(arg) refused eagerly (the ValueError naming the argument) and,
    compiled fresh, while dynamo traces it (the same message, as torch's
    TorchRuntimeError carrying it)."""
    with pytest.raises(ValueError, match="^" + match):
        fn(arg)
    step, _ = _compiled(fn)
    with pytest.raises(Exception, match=match):
        step(arg)


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def test_compiled_store_into_a_pools_bookkeeping_is_refused(rng):
    """A layout store whose cache is pool.marks (FP8 key pages of one
    record: 132 bytes, marks' row) or pool.request_ids seen as bytes (a
    MODEL1 page of one record): eager refuses it naming cache; compiled,
    the store wrote the copy of the cache, which torch then copied over
    marks / request_ids. Through the public op and the operator, traced on
    it or traced on a cache of the engine's own and then called with it."""
    pool = kc.PagedKVPool("csa", 33, 132, 288, 1, layout="rawkv", device="cpu")    # marks (33, 132)
    pool.prepare_step([pool.add_request()], [0])
    keys = _t(rng.standard_normal((1, 128)).astype(np.float32))
    ents = _t(rng.standard_normal((1, 512)).astype(np.float32))
    one = torch.zeros(1, dtype=torch.int32)
    marks = _t(pool.marks)                       # (a storage of its own: not the pool's torch view)
    ids_bytes = _t(pool.request_ids).view(torch.uint8).reshape(1, 1152)
    cases = [
        ("marks", marks, lambda c: kc.index_fp8_store(c, keys, one, page_size=1)),
        ("marks", pool.torch_buffers()["marks"], lambda c: OPS.kv_index_fp8_store(c, keys, one, 1, None, None)),
        ("request_ids", ids_bytes, lambda c: kc.model1_store(c, ents, one, page_size=1)),
        ("request_ids", ids_bytes, lambda c: OPS.kv_model1_store(c, ents, one, 1, None, None)),
    ]
    before = (pool.marks.copy(), pool.request_ids.copy())
    for role, cache, store in cases:
        match = f"cache: lies in the {role} buffer of a PagedKVPool"
        _refused_eager_and_compiled(store, cache, match)
        # traced on the engine's own cache (written), then given the pool's buffer
        step, counter = _compiled(store)
        own = torch.zeros_like(cache)
        step(own)
        assert own.any() and counter.frame_count == 1
        with pytest.raises(Exception, match=match):
            step(cache)
        assert np.array_equal(pool.marks, before[0]) and np.array_equal(pool.request_ids, before[1]), role


def test_compiled_gather_counter_in_request_ids_is_refused():
    """gather_topk(pool, ..., errors=request_ids[:1]): eager refuses it
    (errors: overlaps pool.request_ids); compiled, the count of the bad id
    was added to the slot's request id (1 -> 2: the request then read
    blocks owned by another id). The counter a view of a tensor of its own
    over the pool's request_ids (torch.from_numpy: another storage, so the
    fake tensors' storages did not show it either)."""
    p, s = _small_hca_pool()
    rid = _t(p.request_ids)
    slots, ids = torch.tensor([s], dtype=torch.int32), torch.tensor([[0, 99]], dtype=torch.int32)
    was = p.request_ids.copy()

    def gather(e):
        return kc.gather_topk(p, slots, ids, errors=e)

    match = "errors: overlaps pool.request_ids in memory"
    _refused_eager_and_compiled(gather, rid[:1], match)
    step, counter = _compiled(gather)
    own = torch.zeros(1, dtype=torch.int32)
    step(own)
    assert int(own[0]) == 2             # (id 99 out of range, and entry 0 never written)
    with pytest.raises(Exception, match=match):
        step(rid[:1])
    # the view made inside the compiled function; the pool's numpy array itself
    step, _ = _compiled(lambda r: kc.gather_topk(p, slots, ids, errors=r[:1]))
    with pytest.raises(Exception, match=match):
        step(rid)
    step, _ = _compiled(gather)
    with pytest.raises(Exception, match=match):
        step(p.request_ids[:1])
    assert np.array_equal(p.request_ids, was)


def _pool():
    p = kc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu", layout="rawkv")
    for _ in range(2):
        p.add_request()
    p.prepare_step([0, 1], [8 * p.m - 1, 5 * p.m - 1])
    return p


def test_compiled_operator_over_two_pools_buffers_is_refused(rng):
    """kv_flush_write over pool A's buffers but pool B's `written`: eager
    refuses it (check_one_owner); compiled, the view saw a copy of B's
    `written` (an engine's own buffer beside A's) and the flush raised B's
    entry counts from A's table. A compiled function traced on A's buffers
    whole and called with B's block table (read, not copied) refused
    nothing either: the guards cover every tensor the op takes. Called
    with B's `written`, it is refused when it runs (the copy read as what
    it stands for)."""
    a, b = _pool(), _pool()
    B = 2
    ents = _t(rng.standard_normal((B, ref.HEAD_DIM)).astype(np.float32)).bfloat16()
    keys = _t(rng.standard_normal((B, ref.INDEX_HEAD_DIM)).astype(np.float32)).bfloat16()
    valid, slots = torch.ones(B, dtype=torch.bool), torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([0, ref.CSA_RATIO], dtype=torch.int32)
    before = {n: t.clone() for n, t in b.torch_buffers().items() if t is not None}

    def flush(args):
        OPS.kv_flush_write(**args, entries=ents, valid_mask=valid, slots=slots, positions=pos, index_keys=keys)

    mixed = {**V.pool_args(a), "written": V.pool_args(b)["written"]}
    match = "written: belongs to another PagedKVPool than block_table"
    _refused_eager_and_compiled(flush, mixed, match)
    step, counter = _compiled(flush)
    step(V.pool_args(a))                               # A's buffers whole: accepted
    assert counter.frame_count == 1 and a.read_errors() == 0
    # then B's `written` (not traced again: it lies where A's did, in the
    # same role): refused when it runs, where the operator gets torch's
    # copy of it, which rawkv reads as B's `written` (kvcache.traced.
    # note_copies). Before, the copy was an engine's own buffer and the
    # flush raised B's entry counts from A's table.
    with pytest.raises(ValueError, match="^" + match):
        step(mixed)
    assert counter.frame_count == 1
    other_table = {**V.pool_args(a), "block_table": V.pool_args(b)["block_table"]}
    # (not traced again: the guards look at where each input lies, not in
    # whose buffer; the call is refused when it runs, by the read arguments
    # it gets whole: request_ids against B's block_table)
    match = r"\w+: belongs to another PagedKVPool than block_table"
    with pytest.raises(ValueError, match="^" + match):
        flush(other_table)
    with pytest.raises(Exception, match=match):
        step(other_table)
    for n, t in b.torch_buffers().items():
        assert t is None or torch.equal(t, before[n]), n


def test_compiled_calls_on_other_memory_of_the_same_kind_do_not_retrace():
    """The guards compare where a tensor lies (no pool's buffer, or which
    pool buffer and where in it), not which tensor it is: a compiled
    gather given a fresh counter of its own at every call traces once."""
    p, s = _small_hca_pool()
    p.operator_buffers()        # (made at the first call otherwise, which dynamo's guards see as a change)
    slots, ids = torch.tensor([s], dtype=torch.int32), torch.tensor([[0, 99]], dtype=torch.int32)
    step, counter = _compiled(lambda e: kc.gather_topk(p, slots, ids, errors=e))
    for _ in range(4):
        e = torch.zeros(1, dtype=torch.int32)
        step(e)
        assert int(e[0]) == 2           # (id 99 out of range, and entry 0 never written)
    assert counter.frame_count == 1


def test_every_kvcache_operator_checks_without_writing(rng):
    """The check the fake implementation runs (the body with
    checks_only=True, on the real tensors) writes nothing: on every
    operator sample of the KV-cache ops, every tensor argument is
    unchanged."""
    kv = {n: d for n, d in _opdecl.declared().items() if n.startswith("kv_")}
    assert kv and all(d.checks_only for d in kv.values()), [n for n, d in kv.items() if not d.checks_only]
    for name, cases in samples(rng).items():
        if name not in kv:
            continue
        for args in cases:
            before = [_bits(a) for a in args]
            kv[name].body(*args, checks_only=True)
            for i, (x, y) in enumerate(zip(args, before)):
                assert not isinstance(x, torch.Tensor) or torch.equal(_bits(x), y), (name, kv[name].args[i][0])


def _bits(a):
    """A tensor's bytes (an empty() out holds NaNs, never equal to themselves);
    none for a tensor of no elements, whatever its strides (torch.from_numpy
    gives an empty array stride 0, which a byte view refuses)."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return a.contiguous().view(-1).view(torch.uint8).clone()


@pytest.mark.parametrize("part", ["_inputs", "_real", "_guard", "_functional_copies"])
def test_a_torch_with_other_dynamo_internals_still_compiles(monkeypatch, rng, part):
    """Where torch's internals that rawkv.kvcache.traced reads differ (an
    AttributeError there: another torch; dynamo's while it traces,
    auto_functionalized's frame when the graph runs), a compiled KV-cache
    operator is traced and runs as before, unchecked, instead of failing
    to compile or to run."""
    from rawkv.kvcache import traced

    def broken(*a, **k):
        raise AttributeError("'GraphArg' object has no attribute '_example'")

    monkeypatch.setattr(traced, part, broken)
    keys = _t(rng.standard_normal((1, 128)).astype(np.float32))
    one = torch.zeros(1, dtype=torch.int32)
    cache = torch.zeros(1, 132, dtype=torch.uint8)
    step, counter = _compiled(lambda c: kc.index_fp8_store(c, keys, one, page_size=1))
    step(cache)
    assert counter.frame_count == 1 and cache.any()


def test_one_compiled_layer_over_many_pools_is_traced_once(rng):
    """A model compiles one layer function and calls it with each layer's
    own pool: the guards compare where each input lies in its object's
    buffers, not which object, so it is traced once (per pool it was traced
    again, and dynamo stopped compiling after its recompile limit of 8),
    and each pool gets its own entries."""
    pools = []
    for _ in range(12):
        p = kc.PagedKVPool("hca", 8, 4, 2, 4, device="cpu", layout="rawkv")
        p.add_request(), p.add_request()
        p.prepare_step([0, 1], [8 * p.m - 1, 5 * p.m - 1])
        p.operator_buffers()            # (made before compiling, as docs/kvcache.md says)
        pools.append(p)
    B = 2
    valid, slots = torch.ones(B, dtype=torch.bool), torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([0, ref.HCA_RATIO], dtype=torch.int32)

    def layer(p, e):
        kc.flush_write(p, e, valid, slots, pos)

    step, counter = _compiled(layer)
    for _ in range(2):
        for p in pools:
            step(p, _t(rng.standard_normal((B, ref.HEAD_DIM)).astype(np.float32)).bfloat16())
    assert counter.frame_count == 1
    assert all((p.written[:2] == [1, 2]).all() and p.read_errors() == 0 for p in pools)


def _demo(layout, seed):
    from rawkv.demo import Decoder
    dec = Decoder(np.random.default_rng(seed), [127, 134], 2, 8, 4, device="cpu", tensors=True, layout=layout)
    dec.prefill()
    dec.prepare(0)
    return dec


def _buffers(dec):
    return [t for o in (*dec.pools.values(), *dec.states.values(), dec.istate)
            for t in o.torch_buffers().values() if t is not None]


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_demo_decode_step_is_the_eager_step(request, rng, backend, dynamic, layout):
    """The demo's decode step (rawkv.demo.Decoder.step: state_append,
    compress_decode, csa_rotate, hca_reset, gather_topk, gather_dense_batch
    on attached states, as the demo runs it, with no buffer written before
    it) compiled with fullgraph=True gives the eager step's rows and leaves
    the pools and states as the eager step does. Under aot_eager it was
    refused when it ran: `state: is not attached to this pool`,
    compress_decode's views seeing the copies torch made of the states for
    state_append (memory of no state, beside the pool's own block table);
    they are now read as the states' buffers (kvcache.traced.note_copies).
    (tests/support/library_samples_kvcache.py's step first copies a
    snapshot into every buffer, the block tables too, so its pools were
    buffers of no pool there and its step passed.) No copy is held once
    the step has run."""
    if backend == "inductor":
        request.getfixturevalue("fresh_inductor")      # (C++ compiled, caches off: tests/conftest.py)
    from rawkv.kvcache import pool as P
    seed = int(rng.integers(1 << 31))
    dec, twin = _demo(layout, seed), _demo(layout, seed)
    torch._dynamo.reset()
    got = torch.compile(dec.step, backend=backend, fullgraph=True, dynamic=dynamic)()
    want = twin.step()
    assert len(got) == len(want) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(_buffers(dec), _buffers(twin)))
    assert sum(x.read_errors() for x in (*dec.pools.values(), *dec.states.values(), dec.istate)) == 0
    assert not [e for e in getattr(P, "COPIES", ()) if e[3]()]


def _hca_layer(rng):
    """An HCA pool with an attached decode state whose slot 0 holds m - 1
    rows: appending one row completes the window, and compress_decode of
    slot 0 at position m - 1 writes entry 0."""
    p = kc.PagedKVPool("hca", 8, 4, 2, 4, device="cpu", layout="rawkv")
    p.add_request(), p.add_request()
    p.prepare_step([0, 1], [p.m - 1, p.m - 1])
    st = kc.DecodeState("hca", 2, device="cpu")
    p.attach(st)
    rows = _t(rng.standard_normal((p.m - 1, st.width)).astype(np.float32))
    kc.state_seed(st, 0, rows, rows)
    p.operator_buffers(), st.operator_buffers()
    return p, st


def test_compiled_operator_decode_step_refuses_another_pools_state_when_it_runs(rng):
    """The decode step on the operators (kv_state_append, then
    kv_compress_decode reading the state it wrote) over a pool's and its
    attached state's buffers, compiled with aot_eager: it writes entry 0
    as eagerly (before, refused: `state: is not attached to this pool`,
    the state's buffers being torch's copies). Called again with another
    pool's buffers and the same state (not attached to that pool; not
    traced again, every buffer lying where the traced one did, in its
    role), it is refused when it runs, with the eager error, as compress_
    decode gets the state's copies read as the state's buffers; that pool
    is unchanged."""
    (a, sa), (b, _) = _hca_layer(rng), _hca_layer(rng)
    row = _t(rng.standard_normal((1, sa.width)).astype(np.float32))
    one, slot = torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int32)
    pos, nw = torch.full((1,), a.m - 1, dtype=torch.int32), torch.ones(ref.HEAD_DIM)

    def step(pool_args, st):
        OPS.kv_state_append(**V.state_args(st), kv=row, z=row, valid_mask=one, slots=slot, ape=None)
        OPS.kv_compress_decode(**pool_args, **V.state_args(st, counter=False),
                               **V.state_args(None, prefix="index_", counter=False), norm_weight=nw,
                               valid_mask=one, slots=slot, positions=pos, index_norm_weight=None,
                               eps=ref.RMS_EPS, theta=ref.COMPRESS_ROPE_THETA, yarn=None)

    compiled, counter = _compiled(step)
    compiled(V.pool_args(a), sa)
    assert a.written[0] == 1 and a.read_errors() == sa.read_errors() == 0
    match = "state: is not attached to this pool"
    twin_b, _ = _hca_layer(rng)
    with pytest.raises(ValueError, match="^" + match):
        step(V.pool_args(twin_b), sa)
    before = {n: t.clone() for n, t in b.torch_buffers().items() if t is not None}
    with pytest.raises(ValueError, match="^" + match):
        compiled(V.pool_args(b), sa)
    assert counter.frame_count == 1
    assert all(torch.equal(t, before[n]) for n, t in b.torch_buffers().items() if t is not None)


def test_compiled_state_written_by_two_operators_before_compress_decode(rng):
    """kv_state_clear (another slot), then kv_state_append, then
    kv_compress_decode reading the state: under aot_eager the state's
    buffers reach compress_decode as the copy state_append made of
    state_clear's copy, which the graph has freed by then; it stands for
    the state's buffers all the same, and the step writes entry 0 as
    eagerly (refused while a copy of a copy was tied to the first copy's
    life: `state: is not attached to this pool`)."""
    (a, sa), (b, sb) = _hca_layer(rng), _hca_layer(rng)
    for o, t in zip((*b.torch_buffers().values(), *sb.torch_buffers().values()),
                    (*a.torch_buffers().values(), *sa.torch_buffers().values())):
        if o is not None:
            o.copy_(t)              # (b, sb: a twin of a, sa for the eager step)
    row = _t(rng.standard_normal((1, sa.width)).astype(np.float32))
    one, slot, other = torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    pos, nw = torch.full((1,), a.m - 1, dtype=torch.int32), torch.ones(ref.HEAD_DIM)

    def step(pool, st):
        OPS.kv_state_clear(**V.state_args(st), valid_mask=None, slots=other)
        OPS.kv_state_append(**V.state_args(st), kv=row, z=row, valid_mask=one, slots=slot, ape=None)
        OPS.kv_compress_decode(**V.pool_args(pool), **V.state_args(st, counter=False),
                               **V.state_args(None, prefix="index_", counter=False), norm_weight=nw,
                               valid_mask=one, slots=slot, positions=pos, index_norm_weight=None,
                               eps=ref.RMS_EPS, theta=ref.COMPRESS_ROPE_THETA, yarn=None)

    compiled, _ = _compiled(step)
    compiled(a, sa)
    step(b, sb)
    assert a.written[0] == 1 and a.read_errors() == sa.read_errors() == 0
    for x, y in ((a, b), (sa, sb)):
        for n, t in x.torch_buffers().items():
            assert t is None or torch.equal(t, y.torch_buffers()[n]), n


def test_a_compiled_step_is_not_compiled_again_when_another_pool_is_built_or_dropped(rng):
    """The demo's decode step compiled once keeps serving after an unrelated
    pool and decode state are built and dropped. Before, the rules' test
    of whether an object owns its buffers (pool.own_allocations) read
    `obj in _OBJECTS`, a WeakSet of every live pool and state, which dynamo
    traced: its guards held the set's length and each member by position,
    so any pool built or collected anywhere compiled every step again, and
    one collected while a compile built its guards failed that compile
    (IndexError: list index out of range; seen in the full suite)."""
    import gc
    from torch._dynamo.testing import CompileCounter
    seed = int(rng.integers(1 << 31))
    dec = _demo("rawkv", seed)
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(dec.step, backend=counter, fullgraph=True)
    step()
    assert counter.frame_count == 1
    other = kc.PagedKVPool("hca", 4, 8, 2, 2, device="cpu")
    state = kc.DecodeState("hca", 2, device="cpu")
    dec.prepare(1)
    step()
    assert counter.frame_count == 1, "compiled again after another pool was built"
    del other, state
    gc.collect()
    step()
    assert counter.frame_count == 1, "compiled again after another pool was built or dropped"
