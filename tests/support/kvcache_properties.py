"""The KV-cache property tests' pieces (tests/kvcache/test_*.py, hypothesis; the shared
inputs and judge: tests/support/properties.py): pool and state scenes compared
buffer by buffer, argument strategies, faults."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from support.properties import host, make, same  # noqa: E402


BAD_ERRORS = ["int64", "float32", "empty", "2d-int64", "read-only", "number", "list", "owned", "owned"]


BAD_SLOTS = [3, -1, True, 1.0, None, "1"]


def pick(values, i):
    return values[i % len(values)]


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


batches = st.sampled_from([0, 1, 2, 3, 4, 4])


def counted(err, p_or_state, before) -> int:
    """What an op counted: in errors= when given, else in the object's own counter."""
    return int(host(err).reshape(-1)[0]) if err is not None else p_or_state.read_errors() - before


errors_ok = st.sampled_from([None, None, "int32", "2d"])


def faults(*names):
    """A fault draw: None as likely as all the named faults together."""
    return st.sampled_from([None] * len(names) + list(names))


good_slots = st.sampled_from([0, 1, 1, 2, np.int64(1)])


kv_kinds = st.sampled_from(["csa", "hca"])


picks = st.integers(0, 2 ** 16)


pool_layouts = st.sampled_from(["rawkv", "model1"])


SLOT_VALUES = np.array([0, 0, 0, 1, 1, 1, 2, 3, -1])      # mostly the active slots 0 and 1


def _host_ints(v: np.ndarray, dtype: str, lib: str):
    v = v.astype(dtype)
    return torch.from_numpy(v) if lib == "torch" else v


def slot_array(seed, b, dtype, lib):
    """(b,) slots of `dtype`, mostly the scene's active slots 0 and 1, some
    free (2) or out of range (3, -1)."""
    return _host_ints(np.random.default_rng(seed).choice(SLOT_VALUES, size=b), dtype, lib)


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


def _rows(seed, shape, dt, lib, view="contiguous", special=False):
    """Token rows (kv, z, ...) of dtype dt: bfloat16 and float16 come as CPU
    tensors (numpy has no bfloat16)."""
    return make(seed, shape, dt, "torch" if dt in ("bfloat16", "float16") else lib, view, special)


STATE_FIELDS = ("a_kv", "a_z", "count", "b_kv", "b_z")


row_dtypes = st.sampled_from(["float32", "bfloat16"])


def same_fields(got, want, fields, what):
    """Every buffer of a PagedPoolRef / DecodeStateRef, bit for bit."""
    for f in fields:
        g, w = getattr(got, f), getattr(want, f)
        assert (g is None) == (w is None), f"{what}.{f}"
        if g is not None:
            same(g, w, f"{what}.{f}")


# The tests below draw valid arguments and at most one fault: `fault` names
# the argument made wrong (None about half the time), `pick` which of its
# wrong values. Independent wrong values would have every call refused.
POOL_FIELDS = ("kv_fp8", "kv_scale", "kv_rope", "idx_q", "idx_sf", "pages", "index_pages", "block_table",
               "written", "marks", "request_ids", "owners")


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


BAD_EPS = [0.0, -1.0, float("nan"), float("inf"), True, None, "1e-6"]


BAD_THETAS = [1.0, 0.0, -5.0, float("inf"), float("nan"), 1e-30, True, "1e4", 10 ** 400, None]


def _rope_args(fault, i, eps, theta, yarn):
    """(eps, theta, yarn), one of them wrong when `fault` names it."""
    return (pick(BAD_EPS, i) if fault == "eps" else eps, pick(BAD_THETAS, i) if fault == "theta" else theta,
            pick(BAD_YARNS, i) if fault == "yarn" else yarn)
