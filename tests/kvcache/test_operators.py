"""The KV-cache ops as rawkv:: operators (rawkv/kvcache/views.py): an
operator called on a pool's / state's buffers does what the public op does
on the object, the views it builds share the buffers and check them like a
pool's constructor, outputs in the objects' buffers are refused, and the
device comes from the tensors. opcheck and the compiled steps:
tests/guards/test_library.py with tests/support/library_samples_kvcache.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402,F401
import rawkv.kvcache as kvc  # noqa: E402
import rawkv.library  # noqa: E402,F401
from rawkv import kvcache as kc  # noqa: E402
from rawkv.kvcache import views as V  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from support.kvcache import D, DI, _small_hca_pool  # noqa: E402
from support.outputs import _refused  # noqa: E402
from support.views import misaligned  # noqa: E402


OPS = torch.ops.rawkv


def _pool(kind="csa", device="cpu", layout="rawkv", **index_layout):
    p = kvc.PagedKVPool(kind, 8, 4, 2, 4, device=device, layout=layout, **index_layout)
    for _ in range(2):
        p.add_request()
    p.prepare_step([0, 1], [8 * p.m - 1, 5 * p.m - 1])      # entries 0..7 and 0..4
    return p


def _flush_inputs(rng, kind, device="cpu"):
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    B = 6
    ents = t(rng.standard_normal((B, D)).astype(np.float32)).bfloat16()
    keys = t(rng.standard_normal((B, DI)).astype(np.float32)).bfloat16() if kind == "csa" else None
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    slots = t(np.array([0, 1, 0, 1, 5, 0], np.int32))          # slot 5: out of range, counted
    pos = t(np.array([0, 4, 8, 12, 0, 28], np.int32) * (m // ref.CSA_RATIO))
    return ents, t(np.array([1, 1, 1, 0, 1, 1], bool)), slots, pos, keys


def _same_buffers(a, b):
    for n in a.BUFFERS:
        x, y = a.torch_buffers()[n], b.torch_buffers()[n]
        assert (x is None and y is None) or torch.equal(x, y), n


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_operators_do_what_the_public_ops_do(rng, kind):
    """flush_write, a gather and the compressor through torch.ops.rawkv on
    the buffers of one pool, the public ops on a twin: same bytes, same
    counters, same rows."""
    pub, op = _pool(kind), _pool(kind)
    ents, valid, slots, pos, keys = _flush_inputs(rng, kind)
    kvc.flush_write(pub, ents, valid, slots, pos, index_keys=keys)
    OPS.kv_flush_write(**V.pool_args(op), entries=ents, valid_mask=valid, slots=slots, positions=pos,
                       index_keys=keys)
    _same_buffers(pub, op)
    assert op.read_errors() == pub.read_errors() == 1

    ids = torch.tensor([[0, 1, 2, 7], [1, 0, -1, 3]], dtype=torch.int32)
    sl = torch.tensor([0, 1], dtype=torch.int32)
    want = kvc.gather_topk(pub, sl, ids)
    out = torch.empty_like(want)
    OPS.kv_gather_topk(**V.pool_args(op), slots=sl, topk_ids=ids, n_entries=None, valid_mask=None, out=out)
    assert torch.equal(out, want) and want.abs().sum() > 0
    _same_buffers(pub, op)
    # id 1 of slot 0 and id 0 of slot 1: below written[] but never written (not marked);
    # id 3 of slot 1: past written[1] = 2
    assert op.read_errors() == 4

    w = 2 * D if kind == "csa" else D
    m = pub.m
    st_pub, st_op = kvc.DecodeState(kind, 2, device="cpu"), kvc.DecodeState(kind, 2, device="cpu")
    # each pool's states attached to it: the operator on a pool's own buffers
    # requires it as the public op does (test_operator_refuses_states_not_attached_to_the_pool)
    pub.attach(st_pub)
    op.attach(st_op)
    rows = torch.from_numpy(rng.standard_normal((2 * m - 1, w)).astype(np.float32))
    nw = torch.from_numpy((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    index = None
    if kind == "csa":
        ist = [kvc.DecodeState("csa", 2, DI, device="cpu") for _ in range(2)]
        pub.attach(ist[0])
        op.attach(ist[1])
        irows = torch.from_numpy(rng.standard_normal((2 * m - 1, 2 * DI)).astype(np.float32))
        inw = torch.from_numpy(np.ones(DI, np.float32))
    for st in (st_pub, st_op):
        kvc.state_seed(st, 1, rows, rows)
        kvc.state_append(st, rows[:2], rows[:2], torch.tensor([False, True]), torch.tensor([0, 1], dtype=torch.int32))
    if kind == "csa":
        for s in ist:
            kvc.state_seed(s, 1, irows, irows)
            OPS.kv_state_append(**V.state_args(s), kv=irows[:2], z=irows[:2], valid_mask=torch.tensor([False, True]),
                                slots=torch.tensor([0, 1], dtype=torch.int32), ape=None)
        _same_buffers(*ist)
        index = (ist[0], inw)
    p = torch.tensor([0, 4 * m - 1], dtype=torch.int32)
    valid2 = torch.tensor([True, True])
    kvc.compress_decode(pub, st_pub, nw, valid2, sl, p, index=index)
    OPS.kv_compress_decode(**V.pool_args(op), **V.state_args(st_op, counter=False),
                           **V.state_args(None if index is None else ist[1], prefix="index_", counter=False),
                           norm_weight=nw, valid_mask=valid2, slots=sl, positions=p,
                           index_norm_weight=None if index is None else inw, eps=ref.RMS_EPS,
                           theta=ref.COMPRESS_ROPE_THETA, yarn=[16.0, 65536.0, 32.0, 1.0])
    _same_buffers(pub, op)
    # the flushed entry: window 3 of slot 1; the counter still holds the gather's 4
    assert pub.written[1] == 4 and pub.read_errors() == 4


@pytest.mark.parametrize("layout, index_layout", [("rawkv", "nvfp4"), ("model1", "fp8"), ("model1", "mxfp4"),
                                                  ("model1", "mxfp8")])
def test_views_share_the_buffers_and_keep_the_geometry(layout, index_layout):
    p = _pool("csa", layout=layout, index_layout=index_layout)
    v = V.pool_view(**V.pool_args(p))
    for n in p.BUFFERS:
        if getattr(p, n) is None:                       # the other layout's buffers
            assert getattr(v, n) is None, n
        else:
            assert np.shares_memory(getattr(v, n), getattr(p, n)), n
    for a in ("kind", "m", "num_blocks", "entries_per_block", "max_requests", "max_blocks_per_request",
              "head_dim", "rope_dim", "nope_dim", "index_head_dim", "is_cuda", "device_index", "layout",
              "index_layout", "page_bytes", "index_page_bytes"):
        assert getattr(v, a) == getattr(p, a), a
    s = kvc.DecodeState("hca", 3, 64, device="cpu")
    sv = V.state_view(**V.state_args(s))
    assert (sv.kind, sv.m, sv.max_requests, sv.head_dim, sv.width) == ("hca", 128, 3, 64, 64)
    assert all(np.shares_memory(getattr(sv, n), getattr(s, n)) for n in ("kv_a", "z_a", "count", "errors"))
    # the torch buffers of a CPU pool are its arrays: what the host writes, they hold
    p.written[1] = 7
    assert p.torch_buffers()["written"][1] == 7


def _bad(args, name, value):
    return {**args, name: value}


def test_a_views_key_layout_is_the_pools_where_page_bytes_cannot_tell_it():
    """FP8 and MXFP8 key pages of 128 entries are both 16,896 bytes (132 x
    128 = 33 x 512: no MXFP8 padding), so a view cannot take the key layout
    from index_pages' shape there: the operators pass the pool's
    index_layout (pool_schema's `str? index_layout`). Without it (None) such
    pages are refused naming index_layout, not guessed; where the bytes tell
    (64 entries: 8,448 against 8,704) None still infers it. A layout the
    bytes do not fit is refused naming index_pages, one the layout does not
    take naming index_layout (the constructor's message), and a view over a
    pool's own index_pages in the other layout naming index_layout (it would
    write records the pool reads as the other layout's)."""
    pools = {il: kvc.PagedKVPool("csa", 2, 128, 1, 2, device="cpu", index_layout=il) for il in ("fp8", "mxfp8")}
    for il, p in pools.items():
        args = V.pool_args(p)
        assert args["index_layout"] == il and V.pool_view(**args).index_layout == il
        with pytest.raises(ValueError, match=r"^index_layout: index_pages of 16896 bytes are fp8 or mxfp8 key pages "
                                             r"of 128 entries alike"):
            V.pool_view(**_bad(args, "index_layout", None))
        other = "fp8" if il == "mxfp8" else "mxfp8"
        with pytest.raises(ValueError, match=rf"^index_layout: index_pages are the key pages of a PagedKVPool "
                                             rf"with index_layout '{il}', got '{other}'"):
            V.pool_view(**_bad(args, "index_layout", other))
        with pytest.raises(ValueError, match=r"^index_pages: expected shape \(2, 8704\) \('mxfp4' key pages"):
            V.pool_view(**_bad(args, "index_layout", "mxfp4"))
        with pytest.raises(ValueError, match=r"^index_layout: the 'model1' layout takes \['fp8', 'mxfp4', 'mxfp8'\]"):
            V.pool_view(**_bad(args, "index_layout", "nvfp4"))
        # an engine's own copy of the pages: the index_layout it names is what the view takes
        own = {k: v.clone() if hasattr(v, "clone") else v for k, v in args.items()}
        assert V.pool_view(**_bad(own, "index_layout", other)).index_layout == other
    for il in ("fp8", "mxfp4", "mxfp8"):
        p = kvc.PagedKVPool("csa", 2, 64, 1, 2, device="cpu", index_layout=il)
        assert V.pool_view(**_bad(V.pool_args(p), "index_layout", None)).index_layout == il
    # the rawkv layout's keys are NVFP4: another value is refused naming index_layout
    args = V.pool_args(_pool("csa"))
    with pytest.raises(ValueError, match=r"^index_layout: the 'rawkv' layout takes \['nvfp4'\]"):
        V.pool_view(**_bad(args, "index_layout", "mxfp8"))
    assert V.pool_view(**_bad(args, "index_layout", None)).index_layout == "nvfp4"


def test_views_refuse_what_a_pool_cannot_be():
    good = V.pool_args(_pool("csa"))
    f = good["fp8"]
    for args, exc, lead in (
            (_bad(good, "kind", "mla"), ValueError, "kind:"),
            (_bad(good, "scale", good["scale"].double()), TypeError, "scale:"),
            (_bad(good, "rope", good["rope"][:4]), ValueError, "rope:"),
            (_bad(good, "rope", good["rope"].bfloat16()), TypeError, "rope:"),   # a host pool's rope is float32
            (_bad(good, "index_sf", None), ValueError, "index_q:"),
            (_bad(good, "index_sf", good["index_sf"][:, :, :4]), ValueError, "index_sf:"),
            (_bad(good, "written", good["written"][:1]), ValueError, "written:"),
            (_bad(good, "errors", None), TypeError, "errors:"),
            (_bad(good, "errors", torch.zeros(0, dtype=torch.int32)), ValueError, "errors:"),
            (_bad(good, "fp8", f[:, :, :100].contiguous()), ValueError, "head_dim:"),
            (_bad({**good, "index_q": None, "index_sf": None}, "kind", "csa"), None, None),
            (_bad(good, "kind", "hca"), ValueError, "index_head_dim:")):
        if exc is None:
            assert V.pool_view(**args).index_head_dim is None
            continue
        with pytest.raises(exc) as e:
            V.pool_view(**args)
        assert str(e.value).startswith(lead), e.value
    st = V.state_args(kvc.DecodeState("csa", 2, device="cpu"))
    for args, exc, lead in ((_bad(st, "z_b", None), ValueError, "z_b:"),
                            (_bad(_bad(st, "kv_b", None), "z_b", None), ValueError, "kv_a:"),
                            (_bad(st, "count", st["count"].long()), TypeError, "count:"),
                            (_bad(st, "z_a", st["z_a"][:1]), ValueError, "z_a:")):
        with pytest.raises(exc) as e:
            V.state_view(**args)
        assert str(e.value).startswith(lead), e.value


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_views_refuse_misaligned_data_buffers(layout):
    """The kernels move a pool's entries, pages and keys and a state's rows 16
    bytes at a time (a misaligned one faults on CUDA, a sticky error): a view
    over such a buffer is refused naming it, on the host as on the GPU."""
    good = V.pool_args(_pool("csa", layout=layout))
    names = ("pages", "index_pages") if layout == "model1" else ("fp8", "scale", "rope", "index_q", "index_sf")
    for name in names:
        with pytest.raises(ValueError, match=rf"^{name}: .*aligned"):
            V.pool_view(**_bad(good, name, misaligned(good[name], good[name].element_size())))
    st = V.state_args(kvc.DecodeState("csa", 2, device="cpu"))
    for name in ("kv_a", "z_a", "kv_b", "z_b"):
        with pytest.raises(ValueError, match=rf"^{name}: .*aligned"):
            V.state_view(**_bad(st, name, misaligned(st[name], st[name].element_size())))


def test_state_view_refuses_a_misaligned_count():
    """The state kernels load and store count[s] as an int32: a view whose
    count is not 4-byte aligned (a DLPack array or torch.frombuffer at an
    odd byte offset) faults on CUDA, a sticky error. It was taken; now
    refused naming count."""
    from support.views import off_element
    st = V.state_args(kvc.DecodeState("csa", 2, device="cpu"))
    with pytest.raises(ValueError, match=r"^count: data must be 4-byte aligned"):
        V.state_view(**_bad(st, "count", off_element(torch.as_tensor(st["count"]))))


def _decode_layer(rng, kind):
    """A pool with its decode states (and, for CSA, the indexer's) attached,
    slot 0 of each holding a complete window: a compress_decode of slot 0
    at position m - 1 writes entry 0."""
    p = _pool(kind)
    m = p.m
    states = [kvc.DecodeState(kind, 2, device="cpu")]
    if kind == "csa":
        states.append(kvc.DecodeState("csa", 2, DI, device="cpu"))
    p.attach(*states)
    for st in states:
        rows = torch.from_numpy(rng.standard_normal((m, st.width)).astype(np.float32))
        kvc.state_seed(st, 0, rows[:m - 1], rows[:m - 1])
        kvc.state_append(st, rows[m - 1:], rows[m - 1:], torch.tensor([True]), torch.tensor([0], dtype=torch.int32))
    return p, states


def _decode_operator(pool_args, st, ist, m):
    """torch.ops.rawkv.kv_compress_decode of slot 0 at position m - 1, on the
    buffers given (`st` / `ist`: state_args dicts, ist None: no indexer)."""
    ist = V.state_args(None, prefix="index_", counter=False) if ist is None else ist
    OPS.kv_compress_decode(**pool_args, **st, **ist, norm_weight=torch.ones(D),
                           valid_mask=torch.ones(1, dtype=torch.bool), slots=torch.zeros(1, dtype=torch.int32),
                           positions=torch.full((1,), m - 1, dtype=torch.int32),
                           index_norm_weight=None if ist.get("index_kv_a") is None else torch.ones(DI),
                           eps=ref.RMS_EPS, theta=ref.COMPRESS_ROPE_THETA, yarn=None)


def _refusal(call):
    with pytest.raises((TypeError, ValueError)) as ei:
        call()
    return type(ei.value), str(ei.value)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_operator_refuses_states_not_attached_to_the_pool(rng, kind):
    """kv_compress_decode on a pool's own buffers (pool_args(pool), CPU
    tensors: the reference runs) requires what the public compress_decode
    requires of the objects: each state's buffers are those of a state
    attached to that pool (docs/kvcache.md, "Admission"). Another pool's
    state, an unattached state or buffers that are no state's (a copy) are
    refused with the public op's ValueError naming state / index.state
    before anything is read or written. Before, the operator's views skipped
    the check and the operator flushed another pool's state into this pool."""
    a, sa = _decode_layer(rng, kind)          # sa attached to a
    b, sb = _decode_layer(rng, kind)          # sb attached to b
    m = a.m
    loose = [kvc.DecodeState(st.kind, 2, st.head_dim, device="cpu") for st in sa]
    for st, src in zip(loose, sa):            # the same rows, never attached
        for n in ("kv_a", "z_a", "kv_b", "z_b", "count"):
            if getattr(st, n) is not None:
                getattr(st, n)[...] = getattr(src, n)
    objs = [a, b, *sa, *sb, *loose]
    before = [{n: None if t is None else t.clone() for n, t in o.torch_buffers().items()} for o in objs]
    nw, v = torch.ones(D), torch.ones(1, dtype=torch.bool)
    sl, pos = torch.zeros(1, dtype=torch.int32), torch.full((1,), m - 1, dtype=torch.int32)

    def public(pool, states):
        ix = None if len(states) == 1 else kvc.DecodeIndex(states[1], torch.ones(DI))
        kvc.compress_decode(pool, states[0], nw, v, sl, pos, index=ix, yarn=None)

    def operator(pool, states):
        ist = None if len(states) == 1 else V.state_args(states[1], prefix="index_", counter=False)
        _decode_operator(V.pool_args(pool), V.state_args(states[0], counter=False), ist, m)

    cases = [("state", b, sa),                # another pool's states
             ("state", a, loose)]             # states attached to no pool
    if kind == "csa":
        cases.append(("index.state", a, [sa[0], loose[1]]))     # the indexer's state unattached
    for name, pool, states in cases:
        want = _refusal(lambda: public(pool, states))
        assert want[0] is ValueError and want[1].startswith(f"{name}: is not attached to this pool"), want
        assert _refusal(lambda: operator(pool, states)) == want
    # buffers that are no state's (a copy of an attached state's): no pool would empty them
    copy = {n: None if t is None else t.clone() for n, t in V.state_args(sa[0], counter=False).items()}
    ist = None if kind == "hca" else V.state_args(sa[1], prefix="index_", counter=False)
    err = _refusal(lambda: _decode_operator(V.pool_args(a), copy, ist, m))
    assert err[0] is ValueError and err[1].startswith("state: is not attached to this pool"), err
    for o, was in zip(objs, before):          # nothing read into the pools, nothing written
        for n, t in o.torch_buffers().items():
            assert (t is None and was[n] is None) or torch.equal(t, was[n]), (o, n)

    # the pool's own states: accepted, entry 0 written, as the public op writes it on the twin
    operator(a, sa)
    public(b, sb)
    assert a.written[0] == b.written[0] == 1 and a.read_errors() == b.read_errors() == 0
    # an engine's own pool buffers (no pool object, so no attachment to ask of):
    # the engine owns admission (docs/kvcache.md, "What a view cannot check")
    own = {n: (t.clone() if hasattr(t, "clone") else t) for n, t in V.pool_args(b).items()}
    own["written"].zero_()
    ist = None if kind == "hca" else V.state_args(loose[1], prefix="index_", counter=False)
    _decode_operator(own, V.state_args(loose[0], counter=False), ist, m)
    assert own["written"][0] == 1


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_operator_refuses_a_view_over_two_pools_buffers(rng, layout):
    """A view's buffers that are a pool's are that pool's, each in its own
    role (docs/kvcache.md, "What a view cannot check"). Request ids are
    numbered per pool, so pool A's block table and request ids over pool
    B's pages, owners, marks and written passed the ownership check: A's
    slot 0 read B's request's entries as its own, with no error. Now each
    mix is refused, naming the buffer, before anything is read or written;
    an engine's own block table beside a pool's other buffers (engines.md)
    is still accepted."""
    a, b = _pool("csa", layout=layout), _pool("csa", layout=layout)
    ents, valid, slots, pos, keys = _flush_inputs(rng, "csa")
    kvc.flush_write(b, ents, valid, slots, pos, index_keys=keys)
    kvc.flush_write(a, ents, valid, slots, pos, index_keys=keys)
    ids, sl = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

    def gather(args):
        out = torch.zeros((1, 3, D), dtype=torch.bfloat16)
        OPS.kv_gather_topk(**args, slots=sl, topk_ids=ids, n_entries=None, valid_mask=None, out=out)
        return out

    mine = V.pool_args(a)
    theirs = V.pool_args(b)
    entry = "pages" if layout == "model1" else "fp8"
    for names, first in [(("fp8", "scale", "rope", "index_q", "index_sf", "pages", "index_pages", "owners",
                           "marks", "written"), entry),
                         (("block_table", "request_ids"), entry),
                         (("owners",), "owners")]:
        mixed = {**mine, **{n: theirs[n] for n in names}}
        with pytest.raises(ValueError, match=f"^{first}: belongs to another PagedKVPool than block_table"):
            gather(mixed)
    # a buffer of the pool in another buffer's role (same shape and dtype)
    with pytest.raises(ValueError, match="^request_ids: is the written buffer of a PagedKVPool"):
        gather({**mine, "request_ids": mine["written"]})
    assert a.read_errors() == b.read_errors() == 1        # (the flushes' slot 5)
    # the engine's own table beside the pool's other buffers: accepted, the pool's own rows
    want = kvc.gather_topk(a, sl, ids)
    got = gather({**mine, "block_table": mine["block_table"].clone()})
    assert torch.equal(got, want) and want.abs().sum() > 0


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_operator_refuses_a_view_over_two_states_buffers(rng, kind):
    """kv_compress_decode over a pool's own buffers with a state view whose
    kv_a is the attached state's but whose z_a, count (or kv_b, z_b) are
    another pool's state's: before, accepted, and pool A's entry 0 was
    pooled from pool B's request's rows. Now refused naming the buffer,
    before anything is written; the state ops' views likewise."""
    a, sa = _decode_layer(rng, kind)
    b, sb = _decode_layer(rng, kind)
    sa[0].count[0] = 0                          # A's request has no complete window
    theirs = V.state_args(sb[0], counter=False)
    ist = None if kind == "hca" else V.state_args(sa[1], prefix="index_", counter=False)
    names = ("z_a", "count") + (("kv_b", "z_b") if kind == "csa" else ())
    for n in names:
        st = {**V.state_args(sa[0], counter=False), n: theirs[n]}
        with pytest.raises(ValueError, match=f"^{n}: belongs to another DecodeState than kv_a"):
            _decode_operator(V.pool_args(a), st, ist, a.m)
    assert int(a.written[0]) == 0 and a.read_errors() == 0
    st = {**V.state_args(sa[0]), "count": theirs["count"]}
    with pytest.raises(ValueError, match="^count: belongs to another DecodeState than kv_a"):
        OPS.kv_hca_reset(**st, valid_mask=torch.ones(1, dtype=torch.bool),
                         slots=torch.zeros(1, dtype=torch.int32)) if kind == "hca" else \
            OPS.kv_csa_rotate(**st, valid_mask=torch.ones(1, dtype=torch.bool),
                              slots=torch.zeros(1, dtype=torch.int32))
    assert int(sb[0].count[0]) == b.m


def _cut(args, names, s):
    """args with each of `names` (present and not None) sliced by s."""
    return {n: (t[s] if n in names and t is not None else t) for n, t in args.items()}


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_operator_refuses_a_view_inside_an_objects_buffers(rng, kind):
    """A tensor lying in a pool's or decode state's buffer without being it
    (a slice, another shape of its memory) is refused naming the argument
    and the buffer, before anything is read or written (docs/kvcache.md,
    "One object's buffers per view"). Before, the registry knew a buffer
    only by its first byte (and pool_of_table also by its shape), so
    kv_compress_decode over pool A's buffers with block_table[:1],
    request_ids[:1], written[:1] and pool B's attached state's rows [:1]
    was a view over "an engine's own" pool: the attachment check was
    skipped and B's request's rows were pooled into A's slot 0 entry 0
    (written[0] 0 -> 1, no error); the slices [1:2] were accepted alike."""
    a, sa = _decode_layer(rng, kind)
    b, sb = _decode_layer(rng, kind)
    m = a.m
    table = ("block_table", "request_ids", "written")
    before = [{n: None if t is None else t.clone() for n, t in o.torch_buffers().items()} for o in (a, b, *sa, *sb)]
    for s in (slice(0, 1), slice(1, 2)):
        st = _cut(V.state_args(sb[0], counter=False), V._STATE, s)
        ist = None if kind == "hca" else _cut(V.state_args(sb[1], prefix="index_", counter=False),
                                               tuple("index_" + n for n in V._STATE), s)
        with pytest.raises(ValueError, match="^block_table: overlaps the block_table buffer of a PagedKVPool "
                                             "without being it"):
            _decode_operator(_cut(V.pool_args(a), table, s), st, ist, m)
        # the pool whole, its state sliced: refused naming the state's buffer
        with pytest.raises(ValueError, match="^kv_a: overlaps the kv_a buffer of a DecodeState"):
            _decode_operator(V.pool_args(a), _cut(V.state_args(sa[0], counter=False), V._STATE, s), None, m)
    # a state op over slot 1 of one state's rows and another state's count
    args = {**_cut(V.state_args(sa[0]), V._STATE, slice(1, 2)), "count": V.state_args(sb[0])["count"][1:]}
    with pytest.raises(ValueError, match="^kv_a: overlaps the kv_a buffer of a DecodeState"):
        op = OPS.kv_hca_reset if kind == "hca" else OPS.kv_csa_rotate
        op(**args, valid_mask=torch.ones(1, dtype=torch.bool), slots=torch.zeros(1, dtype=torch.int32))
    for o, was in zip((a, b, *sa, *sb), before):        # nothing read into the pools, nothing written
        for n, t in o.torch_buffers().items():
            assert (t is None and was[n] is None) or torch.equal(t, was[n]), (o, n)

    # the objects' whole buffers: accepted (the pool's own states), entry 0 written
    _decode_operator(V.pool_args(a), V.state_args(sa[0], counter=False),
                     None if kind == "hca" else V.state_args(sa[1], prefix="index_", counter=False), m)
    assert int(a.written[0]) == 1 and a.read_errors() == 0
    # an engine's own buffers, sliced (its memory, no object's): accepted, a one-slot pool
    own = {n: (t.clone() if hasattr(t, "clone") else t) for n, t in V.pool_args(b).items()}
    own["written"].zero_()
    loose = [{n: None if t is None else t.clone() for n, t in V.state_args(st, prefix=p, counter=False).items()}
             for st, p in zip(sb, ("", "index_"))]
    _decode_operator(_cut(own, table, slice(0, 1)), _cut(loose[0], V._STATE, slice(0, 1)),
                     None if kind == "hca" else _cut(loose[1], tuple("index_" + n for n in V._STATE), slice(0, 1)),
                     m)
    assert own["written"].tolist() == [1, 0]


def test_registry_forgets_a_dead_objects_memory(rng):
    """Once a pool is gone its memory is no object's: a tensor still holding
    it (here its old block table) is an engine's own buffer, slices too."""
    import gc
    p = _pool("csa")
    old = V.pool_args(p)["block_table"]
    own = {n: (t.clone() if hasattr(t, "clone") else t) for n, t in V.pool_args(p).items()}
    ids, sl = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    want = kvc.gather_topk(p, sl, ids)

    def gather(args):
        out = torch.zeros((1, 3, D), dtype=torch.bfloat16)
        OPS.kv_gather_topk(**args, slots=sl, topk_ids=ids, n_entries=None, valid_mask=None, out=out)
        return out

    with pytest.raises(ValueError, match="^block_table: overlaps the block_table buffer"):
        gather({**own, "block_table": old[:1], "request_ids": own["request_ids"][:1],
                "written": own["written"][:1]})
    del p
    gc.collect()
    got = gather({**own, "block_table": old[:1], "request_ids": own["request_ids"][:1], "written": own["written"][:1]})
    assert torch.equal(got, want)


def test_operator_counter_is_no_other_buffer_of_an_object():
    """The caller's `errors=` may be any object's counter or the engine's
    own tensor, but not another buffer of a pool or state, nor part of one:
    the op adds its count there. Before, pool B's `written` as pool A's
    counter was accepted, and an out-of-range id in A's gather raised B's
    request 0 to one written entry, with no error anywhere."""
    a, b = _pool("csa"), _pool("csa")
    ids, sl = torch.tensor([[0, 99]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

    def gather(errors):
        out = torch.zeros((1, 2, D), dtype=torch.bfloat16)
        OPS.kv_gather_topk(**V.pool_args(a, errors), slots=sl, topk_ids=ids, n_entries=None, valid_mask=None,
                           out=out)

    before = {n: None if t is None else t.clone() for n, t in b.torch_buffers().items()}
    with pytest.raises(ValueError, match="^errors: is the written buffer of a PagedKVPool, not an error counter"):
        gather(V.pool_args(b)["written"])
    with pytest.raises(ValueError, match="^errors: overlaps the written buffer of a PagedKVPool without being it"):
        gather(V.pool_args(b)["written"][1:2])
    for n, t in b.torch_buffers().items():
        assert (t is None and before[n] is None) or torch.equal(t, before[n]), n
    own = torch.zeros(1, dtype=torch.int32)        # the engine's own counter
    gather(own)
    assert int(own[0]) >= 1                        # (id 99, and entry 0 never written)
    gather(V.pool_args(b)["errors"])               # another pool's counter: the same count there
    assert b.read_errors() == int(own[0]) and a.read_errors() == 0


def test_operator_refuses_a_view_whose_buffers_overlap(rng):
    """An engine's own buffers (no pool's or state's) that overlap in memory
    are refused naming both, before anything is read or written. Before,
    `written` over `request_ids` was accepted: this flush, raising
    written[0] to 8, renumbered slot 0's request from 1 to 8 with no error
    (its own blocks no longer its; a block of request 8 in its row would
    have been read as its own)."""
    p = _pool("csa", layout="model1")
    own = {n: (t.clone() if hasattr(t, "clone") else t) for n, t in V.pool_args(p).items()}
    ents, valid, slots, pos, keys = _flush_inputs(rng, "csa")

    def flush(args):
        OPS.kv_flush_write(**args, entries=ents, valid_mask=valid, slots=slots, positions=pos,
                           index_keys=keys)

    ids = own["request_ids"].clone()
    pages = own["pages"]
    nb, epb = own["marks"].shape
    for args, msg in [({**own, "written": own["request_ids"]}, "^written: overlaps request_ids in memory"),
                      ({**own, "owners": own["block_table"].view(-1)[:nb]}, "^owners: overlaps block_table"),
                      ({**own, "marks": pages.view(-1)[pages.shape[1] - nb * epb:][:nb * epb].view(nb, epb)},
                       "^marks: overlaps pages in memory")]:
        with pytest.raises(ValueError, match=msg):
            flush(args)
    assert torch.equal(own["request_ids"], ids) and int(own["errors"][0]) == 0
    st = kvc.DecodeState("hca", 2, device="cpu")
    sa = {n: (t.clone() if hasattr(t, "clone") else t) for n, t in V.state_args(st).items()}
    with pytest.raises(ValueError, match="^z_a: overlaps kv_a in memory"):
        OPS.kv_hca_reset(**{**sa, "z_a": sa["kv_a"]}, valid_mask=torch.ones(1, dtype=torch.bool),
                         slots=torch.zeros(1, dtype=torch.int32))
    flush(own)                                  # apart: accepted, as the public op on the pool
    kvc.flush_write(p, ents, valid, slots, pos, index_keys=keys)
    assert torch.equal(own["pages"], V.pool_args(p)["pages"]) and int(own["errors"][0]) == p.read_errors() == 1


def test_operator_errors_name_the_argument(rng):
    p = _pool("csa")
    ids = torch.zeros((2, 3), dtype=torch.float32)
    with pytest.raises(TypeError, match="^topk_ids:"):
        OPS.kv_gather_topk(**V.pool_args(p), slots=torch.zeros(2, dtype=torch.int32), topk_ids=ids,
                           n_entries=None, valid_mask=None, out=torch.empty((2, 3, D), dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="^rope:"):
        OPS.kv_gather_dense(**{**V.pool_args(p), "rope": p.torch_buffers()["rope"].bfloat16()}, slot=0,
                            n_entries=1, out=torch.empty((1, D), dtype=torch.bfloat16))


def test_operators_refuse_outputs_in_the_objects_buffers():
    """The torch.compile path: a public op's errors= becomes the counter of
    the view its rawkv:: operator runs on (views.pool_args), and out= is
    the operator's; the same refusals, naming the same buffers."""
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import views as V
    p, s = _small_hca_pool()
    slots, ids = torch.tensor([s], dtype=torch.int32), torch.zeros((1, 1), dtype=torch.int32)
    written = torch.from_numpy(p.written)
    out = torch.zeros((1, 1, p.head_dim), dtype=torch.float32)
    gather = torch.ops.rawkv.kv_gather_topk
    _refused("errors", "pool.written", lambda: gather(**V.pool_args(p, written[s:s + 1]), slots=slots, topk_ids=ids,
                                                      n_entries=None, valid_mask=None, out=out))
    rope = torch.from_numpy(p.rope).view(-1)[:p.head_dim].view(1, 1, -1)
    _refused("out", "pool.rope", lambda: gather(**V.pool_args(p), slots=slots, topk_ids=ids, n_entries=None,
                                                valid_mask=None, out=rope))
    st = kc.DecodeState("hca", 2, head_dim=128, device="cpu")
    count = torch.from_numpy(st.count)
    _refused("errors", "state.count", lambda: torch.ops.rawkv.kv_state_clear(
        **V.state_args(st, count[1:]), valid_mask=None, slots=slots))
    assert not p.written.any() and not out.any() and p.read_errors() == 0


def test_operators_refuse_a_counter_over_their_inputs(rng):
    """On the operators' path the view's counter is the caller's errors=, so
    it is the object's own counter there; it is still checked against the
    op's inputs, as the public op checks it (an errors= over slots or
    positions had the op add its count into them), eager, as an operator and
    compiled."""
    p = _pool("csa")
    ents, valid, slots, pos, keys = _flush_inputs(rng, "csa")
    before = pos.clone()
    for counter, name in ((pos[:1], "positions"), (slots[4:5], "slots")):
        _refused("errors", name, lambda: kvc.flush_write(p, ents, valid, slots, pos, index_keys=keys,
                                                         errors=counter))
        _refused("errors", name, lambda: OPS.kv_flush_write(*V.pool_operands(p, counter), ents, valid, slots,
                                                            pos, keys))
    st = kc.DecodeState("csa", 4, head_dim=8, device="cpu")
    sl = torch.tensor([7, 0], dtype=torch.int32)              # slot 7: out of range, counted
    v = torch.ones(2, dtype=torch.bool)
    _refused("errors", "slots", lambda: OPS.kv_csa_rotate(*V.state_operands(st, sl[1:]), v, sl))
    torch._dynamo.reset()
    step = torch.compile(lambda s_, e_: kvc.csa_rotate(st, v, s_, errors=e_), fullgraph=True, backend="eager")
    # (refused while dynamo traces, by the operator's fake implementation: torch wraps the error)
    with pytest.raises(Exception, match="errors: overlaps slots in memory"):
        step(sl, sl[1:])
    assert torch.equal(pos, before) and sl.tolist() == [7, 0]
    assert p.read_errors() == 0 and st.read_errors() == 0 and not p.written.any()


def test_compiled_gather_of_a_cpu_pool_needs_out_for_the_same_type(rng):
    """Without a tensor argument a CPU pool's eager gather_dense returns numpy
    (the reference's arrays); compiled it returns a tensor of the same bits."""
    p = _pool("csa")
    ents, valid, slots, pos, keys = _flush_inputs(rng, "csa")
    kvc.flush_write(p, ents, valid, slots, pos, index_keys=keys)
    eager = kvc.gather_dense(p, 0, 8)
    torch._dynamo.reset()
    got = torch.compile(lambda: kvc.gather_dense(p, 0, 8), fullgraph=True, backend="aot_eager")()
    assert isinstance(eager, np.ndarray) and got.dtype == torch.bfloat16
    assert np.array_equal(got.float().numpy(), eager)


def test_operator_runs_on_its_tensors_device(cuda, rng, monkeypatch):
    """The device comes from the pool's tensors (the view's device_index),
    whatever the current device is."""
    from rawkv.kvcache import flush, gather
    asked = []
    for mod in (flush, gather):
        real = mod.get_runtime
        monkeypatch.setattr(mod, "get_runtime", lambda d=None, real=real: asked.append(d) or real(d))
    p = _pool("csa", device="cuda:0")
    ents, valid, slots, pos, keys = _flush_inputs(rng, "csa", "cuda:0")
    OPS.kv_flush_write(**V.pool_args(p), entries=ents, valid_mask=valid, slots=slots, positions=pos,
                       index_keys=keys)
    out = torch.empty((2, D), dtype=torch.bfloat16, device="cuda:0")
    OPS.kv_gather_dense(**V.pool_args(p), slot=0, n_entries=2, out=out)
    torch.cuda.synchronize()
    assert len(asked) == 2 and all(d == p.fp8.get_device() == 0 for d in asked)
    # 1 from the flush; 1 from the gather: entry 1 of slot 0 lies below written[0] but this
    # request never wrote it (unmarked: zeros and counted, docs/kvcache.md "Stale entries")
    assert p.read_errors() == 2 and out.abs().sum() > 0


def test_docs_list_the_operators_buffer_prefixes():
    """docs/kvcache.md's POOL / POOL_R / STATE prefixes are the schemas the
    operators are registered with (they omitted pages, index_pages and marks)."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[2] / "docs" / "kvcache.md").read_text()
    found = {}
    for name in ("POOL", "POOL_R", "STATE"):
        m = re.search(rf"^- {name}: `([^`]*)`", text, re.M)
        assert m, name
        found[name] = " ".join(m.group(1).split())
    assert found == {"POOL": V.pool_schema(True), "POOL_R": V.pool_schema(False), "STATE": V.state_schema(True)}


def test_a_view_over_read_only_numpy_buffers_is_refused_naming_the_buffer():
    """Every buffer of a pool or decode state is one some op writes: a view over a read-only numpy
    array is refused, naming it, before any op runs. It was taken, and flush_write on a view whose
    `written` was read-only wrote pages, index_pages and marks, then failed in numpy unnamed
    ('assignment destination is read-only')."""
    p = kc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    args = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in V.pool_args(p).items()}
    for name in ("pages", "index_pages", "block_table", "request_ids", "owners", "written", "marks"):
        bad = dict(args)
        bad[name] = args[name].view()
        bad[name].setflags(write=False)
        with pytest.raises(ValueError, match=f"^{name}: is read-only"):
            V.pool_view(**bad)
    st = kc.DecodeState("csa", 2, device="cpu")
    sargs = {k: v.numpy() for k, v in V.state_args(st).items()}
    for name in ("kv_a", "z_a", "kv_b", "z_b", "count"):
        bad = dict(sargs)
        bad[name] = sargs[name].view()
        bad[name].setflags(write=False)
        with pytest.raises(ValueError, match=f"^{name}: is read-only"):
            V.state_view(**bad)
    V.pool_view(**args)
    V.state_view(**sargs)
