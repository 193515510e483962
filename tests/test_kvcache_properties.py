"""Property-based tests (hypothesis, tests/support/properties.py) of the KV-cache
ops on CPU pools and decode states: compress (prefill, decode), the state ops,
the gathers, the KV-cache indices, page assignment; each call's whole pool or
state is the reference's on a copy."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import _dispatch as D  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from support.properties import SETTINGS, dtype_of, host, judge, layouts, libs, make, same, seeds  # noqa: E402


# ---- rawkv.kvcache: pool scenes, compared buffer by buffer ----------------------------------
# The tests below draw valid arguments and at most one fault: `fault` names
# the argument made wrong (None about half the time), `pick` which of its
# wrong values. Independent wrong values would have every call refused.
POOL_FIELDS = ("kv_fp8", "kv_scale", "kv_rope", "idx_q", "idx_sf", "pages", "index_pages", "block_table",
               "written", "marks", "request_ids", "owners")


picks = st.integers(0, 2 ** 16)


def faults(*names):
    """A fault draw: None as likely as all the named faults together."""
    return st.sampled_from([None] * len(names) + list(names))


def pick(values, i):
    return values[i % len(values)]


def same_fields(got, want, fields, what):
    """Every buffer of a PagedPoolRef / DecodeStateRef, bit for bit."""
    for f in fields:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f"{what}.{f}"
        if g is not None:
            same(g, w, f"{what}.{f}")


def _scene(seed, kind, layout, has_index=True):
    """A CPU pool of 6 blocks of 2 entries, 3 slots of up to 3 blocks:
    slot 0 holds entries 0..3 (0, 1, 3 written), slot 1 entries 0..1 (both
    written), slot 2 is free; its decode states (the compressor's and, for
    a CSA pool with indexer keys, the indexer's) attached, then filled with
    random rows: each slot's count is 0, m or in between, a CSA b-stream
    set or empty. Returns (pool, state, index_state or None)."""
    hd = 512 if layout == "model1" else 128          # model1 stores DeepSeek-V4's 512-dim entries
    ihd = 128 if kind == "csa" and has_index else None
    p = kc.PagedKVPool(kind, 6, 2, 3, 3, head_dim=hd, rope_dim=64, index_head_dim=ihd, layout=layout,
                       device="cpu")
    a, b = p.add_request(), p.add_request()
    p.prepare_step([a, b], [p.m * 4 - 1, p.m * 2 - 1])
    ents = make(seed, (5, hd), "bfloat16", "torch")
    keys = make(seed + 1, (5, ihd), "bfloat16", "torch") if ihd else None
    kc.flush_write(p, ents, torch.ones(5, dtype=torch.bool), torch.tensor([a, a, a, b, b], dtype=torch.int32),
                   torch.tensor([0, 1, 3, 0, 1], dtype=torch.int32) * p.m, index_keys=keys)
    st_ = kc.DecodeState(kind, 3, head_dim=hd, device="cpu")
    ist = kc.DecodeState("csa", 3, head_dim=ihd, device="cpu") if ihd else None
    p.attach(*(s for s in (st_, ist) if s is not None))
    rng = np.random.default_rng(seed)
    counts = rng.choice([0, p.m, p.m, p.m, 1, p.m - 1], size=3)
    _fill_state(st_, counts, seed)
    if ist is not None:         # mostly in step with the main state (else: counted, nothing written)
        _fill_state(ist, counts if rng.random() < 0.8 else rng.permutation(counts), seed + 1)
    return p, st_, ist


def _fill_state(st_, counts, seed) -> None:
    """Random rows into a decode state, in place: `counts` a-rows per slot
    (z of the rest stays -inf), a CSA b-stream in about half the slots."""
    rng = np.random.default_rng(seed)
    for s, c in enumerate(counts.tolist()):
        st_.kv_a[s, :c] = rng.standard_normal((c, st_.width))
        st_.z_a[s, :c] = rng.standard_normal((c, st_.width))
        st_.count[s] = c
        if st_.kv_b is not None and rng.random() < 0.5:
            st_.kv_b[s] = rng.standard_normal(st_.kv_b.shape[1:])
            st_.z_b[s] = rng.standard_normal(st_.z_b.shape[1:])


kv_kinds = st.sampled_from(["csa", "hca"])


pool_layouts = st.sampled_from(["rawkv", "model1"])
row_dtypes = st.sampled_from(["float32", "bfloat16"])
good_slots = st.sampled_from([0, 1, 1, 2, np.int64(1)])
BAD_SLOTS = [3, -1, True, 1.0, None, "1"]


GOOD_EPS = [1e-6, 1e-6, 1, np.float32(1e-5)]


GOOD_THETAS = [160000.0, 160000.0, 10000.0, np.float32(1e4), 50000, 1.5]


def _yarns():
    from rawkv.reference.kvcache import DSV4_YARN, YarnConfig
    good = [DSV4_YARN, DSV4_YARN, None, YarnConfig(1.0, 4096, 32.0, 1.0), YarnConfig(4, 4096, 2, 2)]
    bad = [YarnConfig(0.0, 4096, 32.0, 1.0), YarnConfig(float("nan"), 4096, 32.0, 1.0),
           YarnConfig(0.5, 4096, 32.0, 1.0), YarnConfig(4.0, 4096, 1.0, 32.0), YarnConfig(4.0, 4096.5, 32.0, 1.0),
           YarnConfig(4.0, 0, 32.0, 1.0), YarnConfig(4.0, 4096, 32.0, 0.0), YarnConfig(4.0, 4096, float("inf"), 1.0),
           YarnConfig(True, 4096, 32.0, 1.0), "bogus", (16.0, 65536, 32.0, 1.0)]
    return good, bad


GOOD_YARNS, BAD_YARNS = _yarns()
ROPE_NAMES = ("eps", "theta", "yarn", "yarn.factor", "yarn.original_seq_len", "yarn.beta_fast", "yarn.beta_slow")


def _rows(seed, shape, dt, lib, view="contiguous", special=False):
    """Token rows (kv, z, ...) of dtype dt: bfloat16 and float16 come as CPU
    tensors (numpy has no bfloat16)."""
    return make(seed, shape, dt, "torch" if dt in ("bfloat16", "float16") else lib, view, special)


BAD_EPS = [0.0, -1.0, float("nan"), float("inf"), True, None, "1e-6"]


BAD_THETAS = [1.0, 0.0, -5.0, float("inf"), float("nan"), 1e-30, True, "1e4", 10 ** 400, None]


def _rope_args(fault, i, eps, theta, yarn):
    """(eps, theta, yarn), one of them wrong when `fault` names it."""
    return (pick(BAD_EPS, i) if fault == "eps" else eps, pick(BAD_THETAS, i) if fault == "theta" else theta,
            pick(BAD_YARNS, i) if fault == "yarn" else yarn)


@settings(SETTINGS, max_examples=150)
@given(seed=seeds, kind=kv_kinds, layout=pool_layouts, has_index=st.booleans(), windows=st.integers(0, 3),
       extra=st.sampled_from([0, 0, 1, 3]), kvdt=row_dtypes, lib=libs, view=layouts, special=st.booleans(),
       ape=st.booleans(), slot=good_slots, start=st.sampled_from([0, 0, 1, 3, np.int32(2)]),
       eps=st.sampled_from(GOOD_EPS), theta=st.sampled_from(GOOD_THETAS), yarn=st.sampled_from(GOOD_YARNS),
       fault=faults("kv", "z", "ape", "norm_weight", "slot", "start_entry", "index", "index.z", "eps", "theta",
                    "yarn", "yarn"), i=picks)
# a float32 z beside a bfloat16 kv was accepted on the host (float32 stands
# for bfloat16 there) though the kernel reads z as kv's dtype and CUDA refuses it
@example(seed=0, kind="hca", layout="rawkv", has_index=False, windows=2, extra=0, kvdt="bfloat16", lib="torch",
         view="contiguous", special=False, ape=False, slot=0, start=0, eps=1e-6, theta=160000.0, yarn=None,
         fault="z", i=0)
def test_kvcache_compress_prefill(seed, kind, layout, has_index, windows, extra, kvdt, lib, view, special, ape,
                                  slot, start, eps, theta, yarn, fault, i):
    """compress_prefill on a CPU pool, the RoPE parameters drawn too (issue 21
    item 2: theta 1.0 was a ZeroDivisionError, yarn 'bogus' an
    AttributeError, yarn.factor 0 NaN RoPE dims): the whole pool after the
    call is the reference's on a copy, and so is the count it returns. A
    free slot (2) or entries past the block table are counted errors."""
    p, _, _ = _scene(seed, kind, layout, has_index)
    m, d, w = p.m, p.head_dim, (2 if kind == "csa" else 1) * p.head_dim
    T = windows * m + extra
    bad_rows = pick([("float16", w), ("float64", w), (kvdt, w - 16), (kvdt, None)], i)
    kdt, kw = bad_rows if fault == "kv" else (kvdt, w)
    kv = None if kw is None else _rows(seed, (T, kw), kdt, lib, view, special)
    zdt, zshape = pick([("float32" if kvdt == "bfloat16" else "bfloat16", (T, w)), (kvdt, (T + 1, w))], i) \
        if fault == "z" else (kvdt, (T, w))
    z = _rows(seed + 1, zshape, zdt, lib, view, special)
    adt, ashape = pick([("float16", (m, w)), ("float32", (m - 1, w)), ("bfloat16", (m, w))], i) \
        if fault == "ape" else ("float32", (m, w))
    ap = _rows(seed + 2, ashape, adt, lib) if ape or fault == "ape" else None
    ndt, nshape = pick([("bfloat16", (d,)), ("float64", (d,)), ("float32", (d + 1,)), ("float32", (1, d))], i) \
        if fault == "norm_weight" else ("float32", (d,))
    nw = _rows(seed + 3, nshape, ndt, lib)
    slot = pick(BAD_SLOTS, i) if fault == "slot" else slot
    start = pick([-1, True, 1.0, None], i) if fault == "start_entry" else start
    ix = None
    if p.has_index or fault == "index":
        iw = 2 * 128
        parts = [_rows(seed + 4, (T, iw), kvdt, lib, "contiguous", special),
                 _rows(seed + 5, (T, iw), kvdt, lib, "contiguous", special),
                 make(seed + 6, (m, iw), "float32", lib), make(seed + 7, (128,), "float32", lib)]
        if fault == "index.z":
            parts[1] = pick([_rows(seed + 5, (T, iw - 16), kvdt, lib), _rows(seed + 5, (T, iw), "float16", lib)], i)
        ix = kc.PrefillIndex(*parts)
        if fault == "index":
            ix = pick([None, tuple(parts[:3]), "index"], i) if p.has_index else ix
    eps, theta, yarn = _rope_args(fault, i, eps, theta, yarn)
    fault = None if fault == "index.z" and not p.has_index else fault
    want, errors0 = p.to_reference(), p.read_errors()

    def reference():
        from rawkv.reference import kvcache as RKV
        f32 = lambda a: None if a is None else host(a).astype(np.float32)  # noqa: E731
        n, err = RKV.paged_compress_prefill(
            want, kind, int(slot), f32(kv), f32(z), f32(ap), f32(nw), start_entry=int(start),
            index=None if ix is None else tuple(f32(a) for a in ix), eps=float(eps), theta=float(theta), yarn=yarn)
        same_fields(p.reference_view(), want, POOL_FIELDS, "pool")
        assert p.read_errors() == errors0 + err
        return np.int64(n)
    judge(lambda: kc.compress_prefill(p, kv, z, ap, nw, slot, start_entry=start, index=ix, eps=eps, theta=theta,
                                      yarn=yarn),
          ("pool", "kv", "z", "ape", "norm_weight", "slot", "start_entry", "index", "index.kv", "index.z",
           "index.ape", "index.norm_weight", *ROPE_NAMES), reference, fault)


STATE_FIELDS = ("a_kv", "a_z", "count", "b_kv", "b_z")


SLOT_VALUES = np.array([0, 0, 0, 1, 1, 1, 2, 3, -1])      # mostly the active slots 0 and 1


def _host_ints(v: np.ndarray, dtype: str, lib: str):
    v = v.astype(dtype)
    return torch.from_numpy(v) if lib == "torch" else v


def slot_array(seed, b, dtype, lib):
    """(b,) slots of `dtype`, mostly the scene's active slots 0 and 1, some
    free (2) or out of range (3, -1)."""
    return _host_ints(np.random.default_rng(seed).choice(SLOT_VALUES, size=b), dtype, lib)


def position_array(seed, b, dtype, lib, m):
    """(b,) token positions of `dtype`, mostly of the entries the scene's
    slots hold (0 .. 4m - 1), some negative or past the prepared blocks."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 4 * m, size=b)
    odd = rng.random(b)
    v = np.where(odd < 0.1, -rng.integers(1, m + 1, size=b), np.where(odd > 0.9, v + 3 * m, v))
    return _host_ints(v, dtype, lib)


batches = st.sampled_from([0, 1, 2, 3, 4, 4])


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


BAD_ERRORS = ["int64", "float32", "empty", "2d-int64", "read-only", "number", "list", "owned", "owned"]


def _errors(kind, seed, lib, obj):
    """An errors= argument: None, an int32 counter of one element or a 2-D
    one (fine), or one of BAD_ERRORS ('owned': an int32 buffer of the pool /
    state `obj` the op works on, which it reads or writes)."""
    if kind is None:
        return None
    if kind == "owned":
        names = [n for n in ("count", "written", "request_ids", "owners", "block_table") if hasattr(obj, n)]
        a = getattr(obj, pick(names, seed)).reshape(-1)[-1:]
        return torch.from_numpy(a) if lib == "torch" else a
    if kind == "read-only":
        a = np.zeros(1, np.int32)
        a.flags.writeable = False
        return a
    if kind in ("number", "list"):
        return 0 if kind == "number" else [0]
    shape = {"empty": (0,), "2d": (1, 2), "2d-int64": (1, 2)}.get(kind, (1,))
    return make(seed, shape, {"int64": "int64", "2d-int64": "int64", "float32": "float32"}.get(kind, "int32"),
                lib, lo=0, hi=1)


def counted(err, p_or_state, before) -> int:
    """What an op counted: in errors= when given, else in the object's own counter."""
    return int(host(err).reshape(-1)[0]) if err is not None else p_or_state.read_errors() - before


errors_ok = st.sampled_from([None, None, "int32", "2d"])


STATE_OPS = ("seed", "append", "clear", "csa_rotate", "hca_reset")


@settings(SETTINGS, max_examples=200)
@given(seed=seeds, op=st.sampled_from(STATE_OPS), kind=kv_kinds, b=batches, t=st.integers(0, 9),
       kvdt=row_dtypes, zdt=row_dtypes, lib=libs, view=layouts, special=st.booleans(), ape=st.booleans(),
       valid=st.sampled_from([True, True, False]), slot=good_slots, errors=errors_ok,
       fault=faults("state", "kv", "z", "ape", "valid_mask", "slots", "slot", "errors", "errors"), i=picks)
def test_kvcache_state_ops(seed, op, kind, b, t, kvdt, zdt, lib, view, special, ape, valid, slot, errors, fault,
                           i):
    """state_seed / state_append / state_clear / csa_rotate / hca_reset on a
    CPU decode state attached to its pool (rotate / reset of the other
    kind refused), slots out of range and duplicates included: the state
    after the call and the count are the reference's on a copy (the
    counter: errors= or state.errors)."""
    from rawkv.reference import kvcache as RKV
    _, st_, _ = _scene(seed, kind, "rawkv", False)
    w, m = st_.width, st_.m
    target = pick([None, kc.PagedKVPool(kind, 2, 2, 3, 1, head_dim=128, layout="rawkv", device="cpu")], i) \
        if fault == "state" else st_
    rows = t if op == "seed" else b
    kdt, kw = pick([("float16", w), ("float64", w), (kvdt, w - 4), ("int32", w)], i) if fault == "kv" else (kvdt, w)
    kv = _rows(seed, (rows, kw), kdt, lib, view, special)
    z_bad = fault == "z"
    z = _rows(seed + 1, (rows + (z_bad and i % 2), w), "float64" if z_bad and i % 2 == 0 else zdt, lib, view,
              special)
    ap = None
    if ape or fault == "ape":
        ap = make(seed + 2, (m - (fault == "ape" and i % 2), w), "float16" if fault == "ape" and i % 2 == 0
                  else "float32", "torch" if fault == "ape" else lib)
    slots = slot_array(seed + 3, b, pick(["int64", "float32"], i) if fault == "slots" else "int32", lib)
    vm = make(seed + 4, (b + (fault == "valid_mask" and i % 3 == 1),),
              "int32" if fault == "valid_mask" and i % 3 == 0 else "bool", lib, lo=0, hi=2)
    if (fault == "valid_mask" and i % 3 == 2) or (not valid and op == "clear"):
        vm = None                                  # required by rotate / reset, optional for clear
    slot = pick(BAD_SLOTS, i) if fault == "slot" else slot
    err = _errors(pick(BAD_ERRORS, i) if fault == "errors" else errors, seed + 5, lib, st_)
    takes = {"seed": ("state", "slot", "kv", "z", "ape"), "append": ("state", "kv", "z", "ape", "valid_mask", "slots", "errors"),
             "clear": ("state", "slots", "errors")}.get(op, ("state", "valid_mask", "slots", "errors"))
    if fault not in takes or (op == "clear" and vm is None):      # not this op's argument; None: a valid mask
        fault = None
    want, errors0 = st_.to_reference(), st_.read_errors()
    f32 = lambda a: None if a is None else host(a).astype(np.float32)  # noqa: E731
    calls = {"seed": (lambda: kc.state_seed(target, slot, kv, z, ape=ap),
                      lambda: RKV.state_seed(want, int(slot), f32(kv), f32(z), f32(ap)) or 0),
             "append": (lambda: kc.state_append(target, kv, z, vm, slots, ape=ap, errors=err),
                        lambda: RKV.state_append(want, f32(kv), f32(z), host(vm), host(slots), f32(ap))),
             "clear": (lambda: kc.state_clear(target, slots, valid_mask=vm, errors=err),
                       lambda: RKV.state_clear(want, host(slots), None if vm is None else host(vm))),
             "csa_rotate": (lambda: kc.csa_rotate(target, vm, slots, errors=err),
                            lambda: RKV.csa_rotate(want, host(vm), host(slots))),
             "hca_reset": (lambda: kc.hca_reset(target, vm, slots, errors=err),
                           lambda: RKV.hca_reset(want, host(vm), host(slots)))}
    call, ref_call = calls[op]

    def reference():
        n = ref_call()
        same_fields(st_.reference_view(), want, STATE_FIELDS, "state")
        got = counted(None if op == "seed" else err, st_, errors0)
        assert got == n, f"errors: {got} counted, the reference {n}"
        return None
    judge(call, ("state", "kv", "z", "ape", "valid_mask", "slots", "slot", "errors"), reference, fault)


DENSE_OPS = {"dense": (kc.gather_dense, False), "index_keys": (kc.gather_index_keys, True),
             "dense_batch": (kc.gather_dense_batch, False), "index_keys_batch": (kc.gather_index_keys_batch, True)}
OUT_DTYPES = [None, None, "bfloat16", "float16", "float32"]


def _owned_view(buf, shape, lib):
    """A view of the pool buffer `buf` of `shape`; when it has no element or
    `buf` is too small, a read-only array instead (still a wrong output)."""
    n = int(np.prod(shape))
    if not 0 < n <= buf.size:
        a = np.zeros(shape, buf.dtype)
        a.flags.writeable = False
        return a
    a = buf.reshape(-1)[buf.size - n:].reshape(shape)
    return torch.from_numpy(a) if lib == "torch" else a


def _out(fault, i, seed, shape, name, lib, ok, pool):
    """A gather's out=: None, or (ok) one of `shape` and dtype `name` (a
    numpy float32 for bfloat16 when lib is numpy); fault 'out': of another
    shape or dtype, read-only, or a view of the pool's float32 buffer (the
    RoPE dims of a 'rawkv' pool on the CPU)."""
    if fault == "out":
        kind = pick(["shape", "dtype", "read-only", "number", "owned"], i)
        if kind == "owned" and pool.rope is not None:
            return _owned_view(pool.rope, shape, lib)
        if kind == "read-only":
            o = np.zeros(shape, np.float32 if name in ("bfloat16", "float32") else np.float16)
            o.flags.writeable = False
            return o
        if kind == "number":
            return 0.0
        dt = name if kind == "shape" else ("float64" if name != "float16" else "float32")
        return _rows(seed, shape[:-1] + (shape[-1] + (kind == "shape"),), dt, lib)
    return _rows(seed, shape, name if name != "bfloat16" or lib == "torch" else "float32", lib) if ok else None


@settings(SETTINGS, max_examples=200)
@given(seed=seeds, op=st.sampled_from(sorted(DENSE_OPS)), kind=kv_kinds, layout=pool_layouts,
       slot=good_slots, n=st.sampled_from([4, 4, 3, 2, 1, 0]), b=batches, max_entries=st.sampled_from([None, 0, 3, 5]),
       lib=libs, dtype=st.sampled_from(OUT_DTYPES), out=st.booleans(), errors=errors_ok,
       fault=faults("slot", "n_entries", "slots", "max_entries", "dtype", "out", "out", "errors"), i=picks)
def test_kvcache_gather_dense(seed, op, kind, layout, slot, n, b, max_entries, lib, dtype, out, errors, fault, i):
    """gather_dense / gather_index_keys (host slot and length; more than the
    slot's prepared entries is refused) and their batched forms (device
    slots and lengths) on a CPU pool, against the reference on a copy:
    entries past written[], the unwritten entry 2 of slot 0 and free slots
    are zero rows and counted errors."""
    from rawkv.reference import kvcache as RKV
    fn, index = DENSE_OPS[op]
    p, _, _ = _scene(seed, kind, layout)
    batch = op.endswith("batch")
    width = p.index_head_dim if index and p.has_index else p.head_dim
    if not batch:
        n = min(n, p._n_entries[slot] if isinstance(slot, (int, np.integer)) and 0 <= slot < 3 else 0)
    slot = pick(BAD_SLOTS, i) if fault == "slot" else slot
    n = pick([-1, True, 2.0, None, 7], i) if fault == "n_entries" else n
    slots = slot_array(seed + 1, b, pick(["int64", "float32"], i) if fault == "slots" else "int32", lib)
    ne = make(seed + 2, (b,), "int32", lib, lo=-1, hi=6)
    if max_entries is None and not out:
        max_entries = 3
    max_entries = pick([-1, 2.0, True], i) if fault == "max_entries" else max_entries
    dtype = pick(["float64", "int32", np.float32, "bf16"], i) if fault == "dtype" else dtype
    name = dtype if isinstance(dtype, str) and fault != "dtype" else "bfloat16"
    k = max_entries if isinstance(max_entries, int) and not isinstance(max_entries, bool) and max_entries >= 0 else 3
    ln = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0
    o = _out(fault, i, seed + 3, (b, k, width) if batch else (ln, width), name, lib, out, p)
    err = _errors(pick(BAD_ERRORS, i) if fault == "errors" else errors, seed + 4, lib, p)
    if fault in (("slot", "n_entries") if batch else ("slots", "max_entries")):
        fault = None                                # not this op's argument
    want, errors0 = p.to_reference(), p.read_errors()
    if batch:
        call = lambda: fn(p, slots, ne, max_entries=max_entries, out=o, dtype=dtype, errors=err)  # noqa: E731
    else:
        call = lambda: fn(p, slot, n, out=o, dtype=dtype, errors=err)  # noqa: E731

    def reference():
        dt = dtype or (dtype_of(o) if D.is_torch(o) else "bfloat16")
        if batch:
            kk = max_entries if max_entries is not None else o.shape[1]
            rows, ne_ = RKV.paged_gather_dense_batch(want, host(slots), host(ne), kk, None, dt, index=index)
        else:
            rows, ne_ = RKV.paged_gather_dense(want, int(slot), int(n), dt, index=index)
        got = counted(err, p, errors0)
        assert got == ne_, f"errors: {got} counted, the reference {ne_}"
        return rows
    judge(call, ("pool", "slot", "n_entries", "slots", "max_entries", "out", "dtype", "errors"), reference, fault)


@settings(SETTINGS, max_examples=200)
@given(seed=seeds, kind=kv_kinds, layout=pool_layouts, b=batches, k=st.integers(0, 5),
       idt=st.sampled_from(["int32", "int64"]), use_n=st.booleans(), use_valid=st.booleans(), lib=libs,
       out=st.booleans(), errors=errors_ok,
       fault=faults("topk_ids", "slots", "n_entries", "valid_mask", "out", "errors"), i=picks)
def test_kvcache_kvcache_indices(seed, kind, layout, b, k, idt, use_n, use_valid, lib, out, errors, fault, i):
    """kvcache_indices (top-k ids -> the pool's rows) on a CPU pool: ids past
    written[], unwritten entries (slot 0's entry 2), free slots and -1
    padding, against the reference on a copy."""
    from rawkv.reference import kvcache as RKV
    p, _, _ = _scene(seed, kind, layout)
    ishape, idt = pick([((b, 2, k), idt), ((b, k), "float32"), ((b * k,), idt)], i) if fault == "topk_ids" \
        else ((b, k), idt)
    ids = make(seed, ishape, idt, lib, lo=-2, hi=7)
    slots = slot_array(seed + 1, b + (fault == "slots" and i % 2), "int64" if fault == "slots" and i % 2 == 0
                       else "int32", lib)
    ne = make(seed + 2, (b,), "int64" if fault == "n_entries" else "int32", lib, lo=0, hi=7) \
        if use_n or fault == "n_entries" else None
    vm = make(seed + 3, (b,), "int32" if fault == "valid_mask" else "bool", lib, lo=0, hi=2) \
        if use_valid or fault == "valid_mask" else None
    o = make(seed + 4, (b, k), "int32", lib) if out else None
    if fault == "out":
        o = pick([make(seed + 4, (b, k + 1), "int32", lib), make(seed + 4, (b, k), "int64", lib), "read-only",
                  _owned_view(pick([p.block_table, p.written, p.owners], seed), (b, k), lib)], i)
        if isinstance(o, str):
            o = np.zeros((b, k), np.int32)
            o.flags.writeable = False
    err = _errors(pick(BAD_ERRORS, i) if fault == "errors" else errors, seed + 5, lib, p)
    want, errors0 = p.to_reference(), p.read_errors()

    def reference():
        res, n = RKV.paged_kvcache_indices(want, host(slots), host(ids), None if ne is None else host(ne),
                                           None if vm is None else host(vm))
        got = counted(err, p, errors0)
        assert got == n, f"errors: {got} counted, the reference {n}"
        return res
    judge(lambda: kc.kvcache_indices(p, slots, ids, n_entries=ne, valid_mask=vm, out=o, errors=err),
          ("pool", "slots", "topk_ids", "n_entries", "valid_mask", "out", "errors"), reference, fault)


@settings(SETTINGS, max_examples=200)
@given(seed=seeds, kind=kv_kinds, layout=pool_layouts, b=st.integers(0, 5), lib=libs, errors=errors_ok,
       k=st.integers(0, 3), fault=faults("slots", "blocks", "errors", "pool"), i=picks)
def test_kvcache_assign_pages(seed, kind, layout, b, lib, errors, k, fault, i):
    """assign_pages (docs/kvcache.md, "Page ownership") on a CPU pool: blocks
    handed to slots (free slots, blocks out of range, -1 padding, a block
    twice), the whole pool against the reference on a copy; then a gather
    of every slot's top-k ids reads only entries its own request wrote."""
    from rawkv.reference import kvcache as RKV
    p, _, _ = _scene(seed, kind, layout)
    slots = slot_array(seed + 1, b, pick(["int64", "float32"], i) if fault == "slots" else "int32", lib)
    bshape, bdt = pick([((b + 1,), "int32"), ((b,), "int64"), ((b, 1), "int32")], i) if fault == "blocks" \
        else ((b,), "int32")
    blocks = make(seed + 2, bshape, bdt, lib, lo=-2, hi=p.num_blocks + 2)
    err = _errors(pick(BAD_ERRORS, i) if fault == "errors" else errors, seed + 3, lib, p)
    target = pick([None, p.reference_view(), kc.DecodeState(kind, 3, head_dim=p.head_dim, device="cpu")], i) \
        if fault == "pool" else p
    want, errors0 = p.to_reference(), p.read_errors()

    def reference():
        n = RKV.assign_pages(want, host(slots), host(blocks))
        same_fields(p.reference_view(), want, POOL_FIELDS, "pool")
        got = counted(err, p, errors0)
        assert got == n, f"errors: {got} counted, the reference {n}"
        return None
    if judge(lambda: kc.assign_pages(target, slots, blocks, errors=err), ("pool", "slots", "blocks", "errors"),
             reference, fault) is None:
        return
    gslots = np.arange(3, dtype=np.int32)
    ids = np.random.default_rng(seed).integers(-1, 6, size=(3, k)).astype(np.int32)
    rows, n = RKV.paged_gather_topk(want, gslots, ids, dtype="float32")
    e0 = p.read_errors()
    same(kc.gather_topk(p, gslots, ids, dtype="float32"), rows)
    assert p.read_errors() == e0 + n
