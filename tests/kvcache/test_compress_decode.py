"""compress_decode: the decode states' complete windows compressed into the pool
(rawkv/kvcache/decode.py, rawkv/cu/kv_compress.cu): the reference's flush
rule, the argument rules (the states' fit to the pool), states out of step,
written[], decode == prefill, duplicate slots and entries counted (the lowest
valid row of a slot flushes), the kernel against the CPU pool (tolerance:
tests/support/kvcache_compress.py) and in a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
import rawkv.kvcache as kvc  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.kvcache import DecodeState, compress_decode, compress_prefill  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from support.kvcache import D, DI, F32, _Dev, _changed, _random_state, assert_pool_equal  # noqa: E402
from support.kvcache_compress import (  # noqa: E402
    M, _arr, assert_entries_close, _entries, _inputs, _pool, _sl, _t,
)
from support.kvcache_properties import (  # noqa: E402
    GOOD_EPS, GOOD_THETAS, GOOD_YARNS, POOL_FIELDS, ROPE_NAMES, STATE_FIELDS, batches, faults, _host_ints,
    kv_kinds, pick, picks, pool_layouts, _rope_args, same_fields, _scene, slot_array,
)
from support.properties import SETTINGS, host, judge, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def test_compress_decode_flush_rule(rng):
    """The compressor's flush decision, row by row (paged_compress_decode,
    the rule kv_compress.cu follows)."""
    m, d = 4, 512
    pool = ref.PagedPoolRef.create(8, 2, m, index_head_dim=128, max_requests=4, max_blocks_per_request=2)
    pool.block_table[:, 0] = [0, 1, 2, 3]
    st = _random_state(rng, "csa", 4, d)
    ist = _random_state(rng, "csa", 4, 128)
    st.count[:] = [m, m, 1, m]
    ist.count[:] = [m, 2, 1, m]
    nw, iw = np.ones(d, np.float32), np.ones(128, np.float32)
    slots = np.array([0, 1, 2, 3, 9, 0], np.int32)
    pos = np.array([3, 3, 3, -1, 3, 7], np.int32)
    valid = np.array([True, True, True, True, True, False])
    before = pool.copy()
    err = ref.paged_compress_decode(pool, st, nw, valid, slots, pos, index=(ist, iw))
    # slot 0 flushes; slot 1: only the entry's window is complete (out of step): counted, nothing
    # written; slot 2: neither complete, silent; slot 3: negative position, counted; slot 9: counted
    assert err == 3
    assert _changed(before, pool) == {(0, 0)}
    np.testing.assert_array_equal(pool.written, [1, 0, 0, 0])
    e = ref.finish_entry(ref.state_pool(st, [0]), nw, [0], m)
    k = ref.finish_index_key(ref.state_pool(ist, [0]), iw, [0], m)
    codes, scale, _ = ref.fp8_entry_quantize(e)
    assert np.array_equal(pool.kv_fp8[0, 0], codes[0]) and pool.kv_scale[0, 0] == scale[0]
    assert np.array_equal(pool.idx_q[0, 0], ref.indexer_key_quantize(k)[0][0])
    # HCA (no indexer): the entry's window alone decides
    hp = ref.PagedPoolRef.create(4, 2, 128, head_dim=128, max_requests=2, max_blocks_per_request=1)
    hp.block_table[:, 0] = [0, 1]
    hs = _random_state(rng, "hca", 2, 128)
    hs.count[:] = [128, 5]
    assert ref.paged_compress_decode(hp, hs, np.ones(128, np.float32), np.ones(2, bool),
                                     np.array([0, 1]), np.array([127, 127])) == 0
    np.testing.assert_array_equal(hp.written, [1, 0])


def test_reference_decode_refuses_a_state_of_another_window(rng):
    """paged_compress_decode pools a state's window into an entry of the
    pool's m: a state (or indexer state) of another window size (an HCA
    state, m = 128, given a CSA pool, m = 4) had its first 4 rows pooled
    into entry 0 as if they were a full window, with no error. Refused,
    naming it, before anything is written (the public op's rule)."""
    pool = ref.PagedPoolRef.create(4, 4, 4, index_head_dim=128, max_requests=2, max_blocks_per_request=2)
    pool.block_table[0, 0] = 0
    hca = ref.DecodeStateRef.create("hca", 2, 512)
    hca.count[0] = 4                                  # 4 of its 128 rows: a CSA pool's full window
    csa, ist = _random_state(rng, "csa", 2, 512), _random_state(rng, "csa", 2, 128)
    csa.count[0] = ist.count[0] = 4
    ihca = ref.DecodeStateRef.create("hca", 2, 128)
    ihca.count[0] = 4
    nw, iw = np.ones(512, np.float32), np.ones(128, np.float32)
    args = (nw, np.ones(1, bool), np.zeros(1, np.int32), np.array([3], np.int32))
    before = pool.copy()
    with pytest.raises(ValueError, match="^state: "):
        ref.paged_compress_decode(pool, hca, *args, index=(ist, iw))
    with pytest.raises(ValueError, match="^index.state: "):
        ref.paged_compress_decode(pool, csa, *args, index=(ihca, iw))
    assert not _changed(before, pool) and not pool.written.any()


def _slot_rule_batch(rng, B, R, m):
    """(valid, slots, positions) of B rows over R slots: slots repeated
    often, some out of range; positions of entries 0..4 (4: past the
    block table), some negative; about one row in five invalid."""
    slots = rng.integers(-1, R + 1, B)
    slots = np.where(rng.random(B) < 0.5, rng.integers(0, 2, B), slots).astype(np.int32)  # crowd slots 0, 1
    e = rng.integers(-1, 5, B)
    pos = np.where(e < 0, -rng.integers(1, m + 1, B), e * m + rng.integers(0, m, B)).astype(np.int32)
    return rng.random(B) > 0.2, slots, pos


def test_compress_decode_duplicate_slot_rule(rng):
    """docs/kvcache.md decision 11 for compress_decode, on random batches
    with repeated slots (some rows invalid, slots out of range, windows
    complete / partial / out of step with the indexer's, positions negative
    or past the block table): among the valid rows with an in-range slot,
    the lowest row of a slot is the only one that may flush; every other
    such row is skipped and counts exactly one error, whatever its window
    or position. So the call leaves the pool bit for bit as the call on the
    batch without those rows, with one more error each. The test's own
    model of a duplicate: a valid, in-range row whose slot a lower valid
    row names."""
    for trial in range(60):
        kind = ("csa", "hca")[trial % 2]
        m, d = (4, 512) if kind == "csa" else (128, 128)
        R = int(rng.integers(1, 5))
        pool = ref.PagedPoolRef.create(4 * R + 2, 2, m, head_dim=d, index_head_dim=128 if kind == "csa" else None,
                                       max_requests=R, max_blocks_per_request=2)
        pool.block_table[:] = rng.permutation(4 * R + 2)[:2 * R].reshape(R, 2)
        pool.block_table[rng.random((R, 2)) < 0.1] = -1
        st = _random_state(rng, kind, R, d)
        st.count[:] = rng.choice([0, 1, m - 1, m, m, m], size=R)
        ix = None
        if kind == "csa":
            ist = _random_state(rng, "csa", R, 128)
            ist.count[:] = np.where(rng.random(R) < 0.8, st.count, rng.choice([0, m], size=R))
            ix = (ist, (1 + 0.1 * rng.standard_normal(128)).astype(F32))
        nw = (1 + 0.1 * rng.standard_normal(d)).astype(F32)
        valid, slots, pos = _slot_rule_batch(rng, int(rng.integers(1, 9)), R, m)
        seen, dup = set(), np.zeros(slots.shape[0], bool)
        for b in range(slots.shape[0]):
            if valid[b] and 0 <= slots[b] < R:
                dup[b] = int(slots[b]) in seen
                seen.add(int(slots[b]))
        got, want = pool.copy(), pool.copy()
        err = ref.paged_compress_decode(got, st, nw, valid, slots, pos, index=ix)
        keep = ~dup
        err_solo = ref.paged_compress_decode(want, st, nw, valid[keep], slots[keep], pos[keep], index=ix)
        what = f"trial {trial} ({kind}): valid {valid.tolist()} slots {slots.tolist()} positions {pos.tolist()}"
        assert err == err_solo + int(dup.sum()), what
        assert_pool_equal(got, want, what)
        np.testing.assert_array_equal(got.written, want.written, err_msg=what)


def _decode_run(kind, device, rng_inputs, lengths, prefill_upto, torch_mod=None):
    """Requests of `lengths` tokens: prefill the first prefill_upto[i] tokens
    (a multiple of m) with compress_prefill, then decode the rest token by
    token (state_append -> compress_decode -> csa_rotate/hca_reset). Returns
    the pool and the slots."""
    m = M[kind]
    pool = _pool(kind, device)
    st = DecodeState(kind, 4, device=device)
    ist = DecodeState("csa", 4, DI, device=device) if kind == "csa" else None
    pool.attach(*(x for x in (st, ist) if x is not None))
    conv = (lambda a: a) if torch_mod is None else (lambda a: torch_mod.from_numpy(np.ascontiguousarray(a)).cuda())
    slots = [pool.add_request() for _ in lengths]
    for s, L, P, (kv, z, ape, nw, idx) in zip(slots, lengths, prefill_upto, rng_inputs):
        pool.prepare_step([s], [L - 1])
        if P:
            cidx = None if idx is None else tuple(conv(a) for a in _sl(idx, 0, P))
            compress_prefill(pool, conv(kv[:P]), conv(z[:P]), conv(ape), conv(nw), s, index=cidx)
        # admission: the decode states get the tail the prompt leaves (CSA: the
        # b-half of the last prefilled window); P = 0 just empties the slot
        kvc.state_seed(st, s, conv(kv[:P]), conv(z[:P]), ape=conv(ape))
        if kind == "csa":
            kvc.state_seed(ist, s, conv(idx[0][:P]), conv(idx[1][:P]), ape=conv(idx[2]))
    steps = max(L - P for L, P in zip(lengths, prefill_upto))
    for t in range(steps):
        pos = np.array([P + t for P in prefill_upto], np.int32)
        valid = np.array([P + t < L for L, P in zip(lengths, prefill_upto)])
        flush = valid & ((pos + 1) % m == 0)
        kvb = np.stack([inp[0][min(p, L - 1)] for inp, p, L in zip(rng_inputs, pos, lengths)])
        zb = np.stack([inp[1][min(p, L - 1)] for inp, p, L in zip(rng_inputs, pos, lengths)])
        sl = np.array(slots, np.int32)
        kvc.state_append(st, conv(kvb), conv(zb), conv(valid), conv(sl), ape=conv(rng_inputs[0][2]))
        ix = None
        if kind == "csa":
            ikv = np.stack([inp[4][0][min(p, L - 1)] for inp, p, L in zip(rng_inputs, pos, lengths)])
            iz = np.stack([inp[4][1][min(p, L - 1)] for inp, p, L in zip(rng_inputs, pos, lengths)])
            kvc.state_append(ist, conv(ikv), conv(iz), conv(valid), conv(sl), ape=conv(rng_inputs[0][4][2]))
            ix = (ist, conv(rng_inputs[0][4][3]))
        compress_decode(pool, st, conv(rng_inputs[0][3]), conv(valid), conv(sl), conv(pos), index=ix)
        if kind == "csa":
            kvc.csa_rotate(st, conv(flush), conv(sl))
            kvc.csa_rotate(ist, conv(flush), conv(sl))
        else:
            kvc.hca_reset(st, conv(flush), conv(sl))
    return pool, slots


def _shared_inputs(rng, kind, lengths):
    """Same ape / norm weights for every request (one layer), own token rows."""
    first = _inputs(rng, kind, max(lengths))
    out = []
    for L in lengths:
        kv, z, _, _, idx = _inputs(rng, kind, L)
        if idx is not None:
            idx = (idx[0], idx[1], first[4][2], first[4][3])
        out.append((kv, z, first[2], first[3], idx))
    return out


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_decode_equals_prefill(rng, kind):
    m = M[kind]
    lengths = [3 * m + 1, 2 * m, 4 * m + m // 2] if kind == "csa" else [2 * m + 3, m]
    inputs = _shared_inputs(rng, kind, lengths)
    upto = [m, 0, 2 * m] if kind == "csa" else [m, 0]
    dec, slots = _decode_run(kind, "cpu", inputs, lengths, upto)
    assert dec.read_errors() == 0
    for s, L, (kv, z, ape, nw, idx) in zip(slots, lengths, inputs):
        full = _pool(kind, "cpu")
        fs = full.add_request()
        full.prepare_step([fs], [L - 1])
        n = compress_prefill(full, kv, z, ape, nw, fs, index=idx)
        assert_entries_close(_entries(dec, s, n), _entries(full, fs, n), exact=True)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_written_follows_compress_and_free(rng, kind):
    """compress_prefill / compress_decode raise pool.written (the bound every
    gather applies); free_request zeroes it, so a reused block's entries are
    not readable by the next request."""
    m = M[kind]
    lengths = [3 * m + 1, 2 * m]
    inputs = _shared_inputs(rng, kind, lengths)
    pool, slots = _decode_run(kind, "cpu", inputs, lengths, [m, 0])
    np.testing.assert_array_equal(pool.written[slots], [3, 2])
    blocks_a = pool.blocks_of(slots[0])
    pool.free_request(slots[0])
    assert pool.written[slots[0]] == 0
    b = pool.add_request()
    pool.prepare_step([b], [0])
    rows = kvc.gather_topk(pool, np.array([b], np.int32), np.array([[0, 1, 2]], np.int32))
    assert pool.blocks_of(b) == blocks_a[:1]               # A's entries 0..2 are in it
    assert not rows.any() and pool.read_errors() == 3     # the freed entries are not B's


def _out_of_step_case(device, rng, t=lambda a: a):
    """Main and indexer states of one CSA layer whose counts disagree (a caller
    error): such a row writes neither the entry nor its key and counts one
    error; rows where both are complete flush; rows where neither is are
    skipped silently. Returns nothing; asserts."""
    m = M["csa"]
    pool = _pool("csa", device)
    slots = [pool.add_request() for _ in range(4)]
    pool.prepare_step(slots, [m - 1] * 4)
    st = DecodeState("csa", 4, device=device)
    ist = DecodeState("csa", 4, DI, device=device)
    pool.attach(st, ist)
    kv, z, ape, nw, idx = _inputs(rng, "csa", m)
    for s in slots:                    # m - 1 rows of the first window in both states
        kvc.state_seed(st, s, t(kv[:m - 1]), t(z[:m - 1]), ape=t(ape))
        kvc.state_seed(ist, s, t(idx[0][:m - 1]), t(idx[1][:m - 1]), ape=t(idx[2]))
    # the last row: main complete in slots 0, 1; indexer complete in slots 0, 2
    sl = t(np.array(slots, np.int32))
    last = lambda a: t(np.repeat(a[m - 1:m], 4, 0))  # noqa: E731
    kvc.state_append(st, last(kv), last(z), t(np.array([True, True, False, False])), sl, ape=t(ape))
    kvc.state_append(ist, last(idx[0]), last(idx[1]), t(np.array([True, False, True, False])), sl,
                     ape=t(idx[2]))
    compress_decode(pool, st, t(nw), t(np.ones(4, bool)), t(np.array(slots, np.int32)),
                    t(np.full(4, m - 1, np.int32)), index=(ist, t(idx[3])))
    assert pool.read_errors() == 2                       # slots[1], slots[2]
    written = _arr(pool.written)
    np.testing.assert_array_equal(written[slots], [1, 0, 0, 0])
    blocks = _arr(pool.block_table)[slots, 0]
    fp8, isf = _arr(pool.fp8), _arr(pool.index_sf)
    assert fp8[blocks[0], 0].any() and isf[blocks[0], 0].any()       # entry and key
    for b in blocks[1:]:
        assert not fp8[b].any() and not isf[b].any()                  # neither part


def test_cpu_decode_states_out_of_step_write_nothing(rng):
    _out_of_step_case("cpu", rng)


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_decode_argument_errors(kind):
    pool = _pool(kind, "cpu")
    st = DecodeState(kind, 4, device="cpu")
    other = DecodeState("hca" if kind == "csa" else "csa", 4, device="cpu")
    ist = DecodeState("csa", 4, DI, device="cpu") if kind == "csa" else None
    nw = np.ones(D, np.float32)
    v, s, p = np.ones(2, bool), np.zeros(2, np.int32), np.zeros(2, np.int32)
    ix = None if ist is None else (ist, np.ones(DI, np.float32))
    with pytest.raises(ValueError, match="^state: is not attached to this pool"):
        compress_decode(pool, st, nw, v, s, p, index=ix)
    pool.attach(st)
    if kind == "csa":
        with pytest.raises(ValueError, match="^index.state: is not attached to this pool"):
            compress_decode(pool, st, nw, v, s, p, index=ix)
        pool.attach(ist)
    with pytest.raises(ValueError, match="^state"):
        compress_decode(pool, other, nw, v, s, p, index=ix)
    with pytest.raises(ValueError, match="^norm_weight"):
        compress_decode(pool, st, nw[:-1], v, s, p, index=ix)
    with pytest.raises(TypeError, match="^valid_mask"):
        compress_decode(pool, st, nw, v.astype(np.int32), s, p, index=ix)
    with pytest.raises(ValueError, match="^positions"):
        compress_decode(pool, st, nw, v, s, p[:1], index=ix)
    with pytest.raises(TypeError, match="^slots"):
        compress_decode(pool, st, nw, v, s.astype(np.float32), p, index=ix)
    if kind == "csa":
        with pytest.raises(ValueError, match="^index"):
            compress_decode(pool, st, nw, v, s, p)
        bad = DecodeState("csa", 3, DI, device="cpu")
        with pytest.raises(ValueError, match="^index.state"):
            compress_decode(pool, st, nw, v, s, p, index=(bad, np.ones(DI, np.float32)))


def test_decode_refuses_misaligned_slots_and_positions():
    """The compressor loads slots[b] / positions[b] as int32 or int64: one
    not aligned to its element size faults on the GPU (a sticky error).
    Taken on CPU and launched on CUDA before; now refused by name."""
    torch = pytest.importorskip("torch")
    from support.views import off_element
    pool = _pool("hca", "cpu")
    st = DecodeState("hca", 4, device="cpu")
    pool.attach(st)
    nw, v = np.ones(D, np.float32), torch.ones(2, dtype=torch.bool)
    for dt in (torch.int32, torch.int64):
        good = torch.zeros(2, dtype=dt)
        bad = off_element(good)
        with pytest.raises(ValueError, match="^slots: data must be .-byte aligned"):
            compress_decode(pool, st, nw, v, bad, good)
        with pytest.raises(ValueError, match="^positions: data must be .-byte aligned"):
            compress_decode(pool, st, nw, v, good, bad)
    assert not pool.errors.any() and not pool.written.any()


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_decode_state_rows_must_equal_pool_rows(kind):
    """Slots index the decode state AND the pool's block table: a state with
    more rows than the pool has request slots would let slot 5 of an
    8-row state read past a 4-row block table. Refused before anything runs."""
    m = M[kind]
    pool = _pool(kind, "cpu", R=4)
    a = pool.add_request()
    pool.prepare_step([a], [4 * m])
    big = DecodeState(kind, 8, device="cpu")
    big.count[5] = m                                    # a complete window in slot 5
    ist = DecodeState("csa", 4, DI, device="cpu") if kind == "csa" else None
    ix = None if ist is None else (ist, np.ones(DI, np.float32))
    v, sl, pos = np.ones(1, bool), np.array([5], np.int32), np.array([m - 1], np.int32)
    with pytest.raises(ValueError, match="^state.*max_requests"):
        compress_decode(pool, big, np.ones(D, np.float32), v, sl, pos, index=ix)
    if kind == "csa":
        st = DecodeState("csa", 4, device="cpu")
        with pytest.raises(ValueError, match="^index.state.*max_requests"):
            compress_decode(pool, st, np.ones(D, np.float32), v, sl, pos,
                            index=(DecodeState("csa", 8, DI, device="cpu"), np.ones(DI, np.float32)))
    assert not pool.fp8.any() and pool.read_errors() == 0 and not pool.written.any()


def test_one_state_as_entry_and_key_state_is_refused():
    """The entry's and the key's decode states must be two states. A CSA
    pool of head_dim 128 (the key's width) takes a state of head_dim 128 as
    either; given as both (the object, a view of it, or views over the
    same engine buffers), the key was pooled from the entry's rows and
    written as the entry's key, no error. Refused naming index.state
    before anything is written; two states are taken."""
    pytest.importorskip("torch")
    from rawkv.kvcache import views
    rng = np.random.default_rng(87)
    print("seed 87")
    pool = kc.PagedKVPool("csa", 8, 4, 2, 2, head_dim=DI, layout="rawkv", device="cpu")
    st, ist = DecodeState("csa", 2, DI, device="cpu"), DecodeState("csa", 2, DI, device="cpu")
    pool.attach(st, ist)
    s = pool.add_request()
    pool.prepare_step([s], [3])
    for state in (st, ist):                             # a complete window in slot s
        x = rng.standard_normal((4, 2 * DI)).astype(F32)
        kc.state_seed(state, s, x[:3], x[:3])
        kc.state_append(state, x[3:], x[3:], np.ones(1, bool), np.array([s], np.int32))
    nw = np.ones(DI, F32)
    args = (nw, np.ones(1, bool), np.array([s], np.int32), np.array([3], np.int32))
    same = [(st, st), (st, views.state_view(**views.state_args(st))), (views.state_view(**views.state_args(ist)), ist)]
    for a, b in same:
        with pytest.raises(ValueError, match="^index.state: is the state's memory"):
            compress_decode(pool, a, *args, index=kc.DecodeIndex(b, nw))
    pv = views.pool_view(**{n: (t.clone() if hasattr(t, "clone") else t) for n, t in views.pool_args(pool).items()})
    rows = {n: t.clone() for n, t in views.state_args(st, counter=False).items() if t is not None}
    sv1, sv2 = views.state_view(**rows), views.state_view(**rows)
    with pytest.raises(ValueError, match="^index.state: is the state's memory"):
        compress_decode(pv, sv1, *args, index=kc.DecodeIndex(sv2, nw))
    assert not pool.written.any() and not pool.marks.any() and pool.read_errors() == 0
    compress_decode(pool, st, *args, index=kc.DecodeIndex(ist, nw))
    assert list(pool.written) == [1, 0] and pool.read_errors() == 0


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
def position_array(seed, b, dtype, lib, m):
    """(b,) token positions of `dtype`, mostly of the entries the scene's
    slots hold (0 .. 4m - 1), some negative or past the prepared blocks."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 4 * m, size=b)
    odd = rng.random(b)
    v = np.where(odd < 0.1, -rng.integers(1, m + 1, size=b), np.where(odd > 0.9, v + 3 * m, v))
    return _host_ints(v, dtype, lib)


@settings(SETTINGS, max_examples=150)
@given(seed=seeds, kind=kv_kinds, layout=pool_layouts, has_index=st.booleans(), b=batches,
       sdt=st.sampled_from(["int32", "int32", "int64"]), lib=libs, eps=st.sampled_from(GOOD_EPS),
       theta=st.sampled_from(GOOD_THETAS), yarn=st.sampled_from(GOOD_YARNS),
       fault=faults("state", "state", "positions", "slots", "valid_mask", "norm_weight", "index", "index.state",
                    "index.norm_weight", "eps", "theta", "yarn"), i=picks)
def test_kvcache_compress_decode(seed, kind, layout, has_index, b, sdt, lib, eps, theta, yarn, fault, i):
    """compress_decode of a CPU pool's attached decode states (docs/kvcache.md,
    "Admission"; an unattached state is refused): the pool after the call
    is the reference's on copies of the pool and the states, which are
    only read. Slots out of range, free slots, negative positions and
    windows out of step with the indexer's are counted errors."""
    p, st_own, ist = _scene(seed, kind, layout, has_index)
    hd = p.head_dim
    st_ = st_own
    if fault == "state":
        st_ = pick([lambda: kc.DecodeState(kind, 3, head_dim=hd, device="cpu"),
                    lambda: kc.DecodeState("hca" if kind == "csa" else "csa", 3, head_dim=hd, device="cpu"),
                    lambda: kc.DecodeState(kind, 4, head_dim=hd, device="cpu"), lambda: p, lambda: None], i)()
    slots = slot_array(seed + 1, b, pick(["float32", "int16"], i) if fault == "slots" else sdt, lib)
    pos = position_array(seed + 2, b + (fault == "positions" and i % 2),
                         ("int64" if sdt == "int32" else "int32") if fault == "positions" and i % 2 == 0 else sdt,
                         lib, p.m)
    valid = make(seed + 3, (b + (fault == "valid_mask" and i % 2),),
                 "int32" if fault == "valid_mask" and i % 2 == 0 else "int64", lib, lo=0, hi=4)
    valid = valid if fault == "valid_mask" and i % 2 == 0 else valid != 0          # mostly True
    nw = make(seed + 4, (hd,), pick(["bfloat16", "float64"], i) if fault == "norm_weight" else "float32",
              "torch" if fault == "norm_weight" else lib)
    ix = None
    if p.has_index or fault == "index":
        inw = make(seed + 5, (128 - 16 * (fault == "index.norm_weight"),), "float32", lib)
        ist_ = ist
        if fault == "index.state":
            ist_ = pick([kc.DecodeState("csa", 3, head_dim=256, device="cpu"),     # not the indexer's width
                         kc.DecodeState("csa", 3, head_dim=128, device="cpu")], i)    # not attached
        ix = kc.DecodeIndex(ist_, inw)
        if fault == "index":
            ix = pick([None, (ist_,), "index"], i) if p.has_index else ix
    eps, theta, yarn = _rope_args(fault, i, eps, theta, yarn)
    fault = None if fault in ("index.state", "index.norm_weight") and not p.has_index else fault
    want, errors0 = p.to_reference(), p.read_errors()
    states = [s for s in (st_own, ist) if s is not None]
    state_want = [s.to_reference() for s in states]

    def reference():
        from rawkv.reference import kvcache as RKV
        rix = None if ix is None else (ix.state.to_reference(), host(ix.norm_weight))
        err = RKV.paged_compress_decode(want, st_.to_reference(), host(nw), host(valid), host(slots), host(pos),
                                        index=rix, eps=float(eps), theta=float(theta), yarn=yarn)
        same_fields(p.reference_view(), want, POOL_FIELDS, "pool")
        for s, sw in zip(states, state_want):
            same_fields(s.reference_view(), sw, STATE_FIELDS, "state")
        assert p.read_errors() == errors0 + err
        return None
    judge(lambda: kc.compress_decode(p, st_, nw, valid, slots, pos, index=ix, eps=eps, theta=theta, yarn=yarn),
          ("pool", "state", "norm_weight", "valid_mask", "slots", "positions", "index", "index.state",
           "index.norm_weight", *ROPE_NAMES), reference, fault)


# ---------------------------------------------------------------------------
# duplicates: counted, deterministic
# ---------------------------------------------------------------------------
def _decode_dups(device, rng, kind):
    """compress_decode with two rows on the same slot and position (the
    same entry) and one on the same slot at another entry's position: both
    repeats of slot 1 are skipped and counted (the lowest row of a slot
    flushes, decision 11)."""
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
    # rows 2 and 3 repeat row 0's slot 1 (at entry 1, at entry 2): skipped and counted
    assert pool.read_errors() == 2
    np.testing.assert_array_equal(pool.written, [1, 2, 2])
    rows = np.asarray(kc.gather_topk(pool, np.array([1], np.int32), np.array([[0, 1, 2]], np.int32)))
    assert pool.read_errors() == 4                      # entries 0 and 2 of slot 1: not written
    assert rows[0, 1].any() and not rows[0, 0].any() and not rows[0, 2].any()


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_compress_decode_duplicates_deterministic(cuda, rng, kind):
    """The kernel's bytes are those of the CPU run (compressor tolerance
    aside, which test_compress_prefill / test_compress_decode cover): here the same marks,
    written[] and counts on every run, and identical bytes run to run."""
    seed = int(rng.integers(1 << 30))
    cpu = _decode_dups("cpu", np.random.default_rng(seed), kind).to_reference()
    first = None
    for run in range(10):
        p = _decode_dups("cuda", np.random.default_rng(seed), kind)
        got = p.to_reference()
        assert p.read_errors() == 2
        np.testing.assert_array_equal(got.written, cpu.written)
        np.testing.assert_array_equal(got.marks, cpu.marks)
        if first is None:
            first = got
        for name in ("kv_fp8", "kv_scale", "kv_rope"):
            np.testing.assert_array_equal(getattr(got, name).view(np.uint8), getattr(first, name).view(np.uint8),
                                          err_msg=f"run {run}: {name}")


# rows (slot, entry, valid) of one compress_decode over _dup_slot_scene's
# slots 0..3 (entry -1: position -1), and the rows that repeat a lower valid
# row's slot (docs/kvcache.md decision 11: the lowest row of a slot acts)
DUP_SLOT_ROWS = [
    (1, 1, True),     # 0: slot 1's owner: flushes entry 1
    (0, 2, False),    # 1: invalid: ignored, owns nothing
    (0, 2, True),     # 2: slot 0's owner (the invalid row 1 is not): flushes entry 2
    (1, 2, True),     # 3: slot 1 again, another entry: skipped, counted (wrote entry 2 before the rule)
    (9, 0, True),     # 4: slot out of range: counted
    (1, 1, True),     # 5: slot 1 again, its owner's entry: counted once
    (2, 1, True),     # 6: slot 2's owner, window incomplete: skipped silently
    (2, 3, True),     # 7: slot 2 again: counted, though its owner does not flush
    (1, -1, True),    # 8: slot 1 again, negative position: counted once
    (-1, 0, True),    # 9: slot out of range: counted
    (3, 3, True),     # 10: slot 3's owner: flushes entry 3
]
DUP_SLOT_REPEATS = (3, 5, 7, 8)
# the same with slot 1 reading slot 0's block-table row and request id (an
# engine's error, "Page ownership"): slot 0's repeat (row 1) claims no entry,
# so slot 1's owner (row 2) writes the entry row 1 named; row 3 repeats slot 1;
# slot 3 flushes entry 1 (a third entry for the GPU test's code tolerance)
DUP_SHARED_ROWS = [(0, 1, True), (0, 2, True), (1, 2, True), (1, 1, True), (3, 1, True)]
DUP_SHARED_REPEATS = (1, 3)


def _dup_slot_scene(device, seed, kind, shared=False):
    """A pool of 4 requests (slots 0..3, entries 0..3 prepared) and its
    attached decode states, filled from `seed`: slots 0, 1, 3 hold a
    complete window (both states), slot 2 m - 1 rows. shared: slot 1's
    block-table row and request id are slot 0's. Returns (pool, state,
    DecodeIndex or None, norm_weight)."""
    rng = np.random.default_rng(seed)
    dv = _Dev(device)
    m = M[kind]
    pool = kc.PagedKVPool(kind, 16, 2, 4, 2, layout="rawkv", device=device)
    slots = [pool.add_request() for _ in range(4)]
    pool.prepare_step(slots, [4 * m - 1] * 4)
    if shared:
        pool.block_table[1] = pool.block_table[0]
        pool.request_ids[1] = pool.request_ids[0]
    st = kc.DecodeState(kind, 4, device=device)
    ist = kc.DecodeState("csa", 4, DI, device=device) if kind == "csa" else None
    pool.attach(*(x for x in (st, ist) if x is not None))
    for state in (st, ist):
        if state is None:
            continue
        for s in slots:                                # a full window, then m - 1 rows
            kv = rng.standard_normal((2 * m - 1, state.width)).astype(F32)
            kc.state_seed(state, s, dv.t(kv), dv.t((1.5 * rng.standard_normal(kv.shape)).astype(F32)))
        kv = rng.standard_normal((4, state.width)).astype(F32)
        kc.state_append(state, dv.t(kv), dv.t(0.5 * kv), dv.t(np.array([True, True, False, True])),
                        dv.t(np.arange(4, dtype=np.int32)))      # the window's last row, but slot 2's
    nw = dv.t((1 + 0.1 * rng.standard_normal(D)).astype(F32))
    index = None if ist is None else kc.DecodeIndex(ist, dv.t((1 + 0.1 * rng.standard_normal(DI)).astype(F32)))
    return pool, st, index, nw


def _dup_slot_run(device, seed, kind, rows, keep=None, shared=False):
    """_dup_slot_scene(seed), then one compress_decode of `rows` (those
    numbered in `keep`; None: all). Positions: entry * m plus an offset
    drawn from `seed` per row, so a row's position is the same whichever
    rows are kept. Returns (pool, errors)."""
    pool, st, index, nw = _dup_slot_scene(device, seed, kind, shared)
    assert pool.read_errors() == 0
    dv, m = _Dev(device), M[kind]
    off = np.random.default_rng(seed + 1).integers(0, m, len(rows))
    keep = range(len(rows)) if keep is None else keep
    slots = np.array([rows[i][0] for i in keep], np.int32)
    pos = np.array([rows[i][1] * m + off[i] if rows[i][1] >= 0 else -1 for i in keep], np.int32)
    valid = np.array([rows[i][2] for i in keep])
    kc.compress_decode(pool, st, nw, dv.t(valid), dv.t(slots), dv.t(pos), index=index)
    return pool, pool.read_errors()


def _without(rows, repeats):
    return [i for i in range(len(rows)) if i not in repeats]


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_compress_decode_duplicate_slots(rng, kind):
    """A slot named by several valid rows: its lowest valid row flushes (or
    not, by the flush rule), every other row of the slot writes nothing and
    counts one error, whether or not the owner flushes and whatever the
    row's own position; invalid rows own nothing; out-of-range slots count
    as before. The pool is bit for bit the call's without the repeats."""
    seed = int(rng.integers(1 << 30))
    pool, err = _dup_slot_run("cpu", seed, kind, DUP_SLOT_ROWS)
    solo, err_solo = _dup_slot_run("cpu", seed, kind, DUP_SLOT_ROWS, _without(DUP_SLOT_ROWS, DUP_SLOT_REPEATS))
    assert err_solo == 2                                  # rows 4, 9: slots out of range
    assert err == err_solo + len(DUP_SLOT_REPEATS)
    got, want = pool.to_reference(), solo.to_reference()
    assert_pool_equal(got, want)
    np.testing.assert_array_equal(got.written, [3, 2, 0, 4])
    np.testing.assert_array_equal(got.written, want.written)
    table = got.block_table
    written = {tuple(x) for x in np.argwhere(got.marks)}
    assert written == {(table[0, 1], 0), (table[1, 0], 1), (table[3, 1], 1)}   # entries 2, 1, 3 (2 per block)
    # the shared table: slot 0's repeat claims no entry, so slot 1's owner writes it
    pool, err = _dup_slot_run("cpu", seed, kind, DUP_SHARED_ROWS, shared=True)
    solo, err_solo = _dup_slot_run("cpu", seed, kind, DUP_SHARED_ROWS, _without(DUP_SHARED_ROWS, DUP_SHARED_REPEATS),
                                   shared=True)
    assert err_solo == 0 and err == len(DUP_SHARED_REPEATS)
    got, want = pool.to_reference(), solo.to_reference()
    assert_pool_equal(got, want)
    np.testing.assert_array_equal(got.written, [2, 3, 0, 2])
    np.testing.assert_array_equal(got.written, want.written)


def _marked_entries(pool: ref.PagedPoolRef, marks):
    """(codes, scale, rope[, index codes, index scales]) of the entries
    `marks` flags, in block-major order (assert_entries_close's input)."""
    blk, row = np.nonzero(marks)
    out = [pool.kv_fp8[blk, row], pool.kv_scale[blk, row], pool.kv_rope[blk, row]]
    if pool.idx_q is not None:
        out += [pool.idx_q[blk, row], pool.idx_sf[blk, row]]
    return out


def _dup_slot_agreement(device, seed, kind, shared):
    """test_gpu_compress_decode_duplicate_slots on `device` against the CPU
    op (device "cpu" checks the test itself)."""
    rows, repeats = (DUP_SHARED_ROWS, DUP_SHARED_REPEATS) if shared else (DUP_SLOT_ROWS, DUP_SLOT_REPEATS)
    cpu, err_cpu = _dup_slot_run("cpu", seed, kind, rows, shared=shared)
    want = cpu.to_reference()
    solo, err_solo = _dup_slot_run(device, seed, kind, rows, _without(rows, repeats), shared=shared)
    solo = solo.to_reference()
    assert err_cpu == err_solo + len(repeats)
    for run in range(3):
        pool, err = _dup_slot_run(device, seed, kind, rows, shared=shared)
        got = pool.to_reference()
        what = f"{kind}, run {run}"
        assert err == err_cpu, what
        np.testing.assert_array_equal(got.written, want.written, err_msg=what)
        np.testing.assert_array_equal(got.marks, want.marks, err_msg=what)
        np.testing.assert_array_equal(got.block_table, want.block_table, err_msg=what)
        assert_pool_equal(got, solo, what)               # the repeats wrote nothing, on every run
        assert_entries_close(_marked_entries(got, want.marks), _marked_entries(want, want.marks))


@pytest.mark.parametrize("shared", [False, True], ids=["slots", "shared-table"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_compress_decode_duplicate_slots(cuda, rng, kind, shared):
    """The kernel's slot rule is the reference's: on the rows of
    test_cpu_compress_decode_duplicate_slots (and its shared block table)
    the CUDA op counts exactly the CPU op's errors and leaves exactly its
    written[] and marks (the entries the slots' lowest rows flush, nothing
    else), on every run; its pool is bit for bit the one of its own call
    without the repeated rows, and its entries are within the compressor
    tolerance (docs/kvcache.md) of the CPU op's."""
    _dup_slot_agreement("cuda", int(rng.integers(1 << 30)), kind, shared)


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_decode_equals_prefill(cuda, rng, kind):
    """Several requests of different lengths, prefilled in part, then decoded
    token by token: the cache equals the one of prefilling every whole
    sequence BIT FOR BIT (the same kernel source runs in both modes on the
    same float32 values: z + ape is one float32 add in state_append /
    state_seed as in the prefill CTA, --fmad=false, the same reduction
    order), and the CPU reference run agrees within the tolerance."""
    import torch
    m = M[kind]
    lengths = [9 * m + 1, 3 * m, 6 * m + 2] if kind == "csa" else [3 * m + 5, m, 2 * m]
    upto = [4 * m, 0, m] if kind == "csa" else [m, 0, m]
    inputs = _shared_inputs(rng, kind, lengths)
    dec, slots = _decode_run(kind, "cuda", inputs, lengths, upto, torch_mod=torch)
    torch.cuda.synchronize()
    assert dec.read_errors() == 0
    for s, L, (kv, z, ape, nw, idx) in zip(slots, lengths, inputs):
        full = _pool(kind, "cuda")
        fs = full.add_request()
        full.prepare_step([fs], [L - 1])
        gidx = None if idx is None else tuple(_t(a) for a in idx)
        n = compress_prefill(full, _t(kv), _t(z), _t(ape), _t(nw), fs, index=gidx)
        torch.cuda.synchronize()
        assert_entries_close(_entries(dec, s, n), _entries(full, fs, n), exact=True)
        cpu = _pool(kind, "cpu")
        cs = cpu.add_request()
        cpu.prepare_step([cs], [L - 1])
        compress_prefill(cpu, kv, z, ape, nw, cs, index=idx)
        assert_entries_close(_entries(dec, s, n), _entries(cpu, cs, n))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_decode_captures_in_graph(cuda, rng, kind):
    import torch
    m = M[kind]
    kv, z, ape, nw, idx = _inputs(rng, kind, m)
    pool = _pool(kind, "cuda")
    s = pool.add_request()
    pool.prepare_step([s], [m - 1])
    st = DecodeState(kind, 4, device="cuda")
    ist = DecodeState("csa", 4, DI, device="cuda") if kind == "csa" else None
    pool.attach(*(x for x in (st, ist) if x is not None))
    sl, v = _t(np.array([s], np.int32)), _t(np.array([True]))
    for t in range(m):
        kvc.state_append(st, _t(kv[t:t + 1]), _t(z[t:t + 1]), v, sl, ape=_t(ape))
        if ist is not None:
            kvc.state_append(ist, _t(idx[0][t:t + 1]), _t(idx[1][t:t + 1]), v, sl, ape=_t(idx[2]))
    pos = _t(np.array([m - 1], np.int32))
    w = _t(nw)
    ix = None if ist is None else (ist, _t(idx[3]))
    compress_decode(pool, st, w, v, sl, pos, index=ix)          # warm-up: table + kernel load
    ref_fp8 = pool.fp8.clone()
    pool.fp8.zero_()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        compress_decode(pool, st, w, v, sl, pos, index=ix)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.fp8, ref_fp8)


def test_gpu_decode_states_out_of_step_write_nothing(cuda, rng):
    _out_of_step_case("cuda", rng, _t)
