"""The decode-state ops: state_seed, state_append, csa_rotate, hca_reset, state_clear
(rawkv/kvcache/state_ops.py, rawkv/cu/kv_cache.cu): the reference's exact
states, duplicate slots (the lowest row wins), the output rules, the kernels
against the reference bit for bit (and state_seed in a CUDA graph)."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from rawkv.reference.formats import bf16_round  # noqa: E402
from support.kvcache import (  # noqa: E402
    F32, _Dev, assert_state_equal, bf16_values, _bits, _random_rows, _random_state, _torch,
)
from support.kvcache_properties import (  # noqa: E402
    BAD_ERRORS, BAD_SLOTS, STATE_FIELDS, batches, counted, _errors, errors_ok, faults, good_slots,
    kv_kinds, pick, picks, row_dtypes, _rows, same_fields, _scene, slot_array,
)
from support.outputs import _refused  # noqa: E402
from support.properties import SETTINGS, host, judge, layouts, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def test_initial_state_is_empty():
    st = ref.DecodeStateRef.create("csa", 3, 8)
    assert st.a_kv.shape == (3, 4, 16) and st.b_kv.shape == (3, 4, 8)
    assert np.all(st.a_z == -np.inf) and np.all(st.b_z == -np.inf)
    assert not st.a_kv.any() and not st.b_kv.any() and not st.count.any()
    h = ref.DecodeStateRef.create("hca", 2, 8)
    assert h.a_kv.shape == (2, 128, 8) and h.b_kv is None


def test_a_window_past_the_kernels_32_bit_rows_is_refused():
    """The state kernels find a window row with a 32-bit division: a state
    of m x width >= 2^32 values is refused (before it is allocated), naming
    head_dim."""
    for kind, hd in (("hca", 1 << 25), ("csa", 1 << 29)):            # m = 128 x head_dim, 4 x 2 head_dim
        with pytest.raises(ValueError, match="^head_dim: .*past the kernels' 2\\^32"):
            kc.DecodeState(kind, 1, head_dim=hd, device="cpu")


def _state_arrays(st):
    return [a for a in (st.a_kv, st.a_z, st.count, st.b_kv, st.b_z) if a is not None]


def _unchanged_slots(before, after, slots):
    return all(np.array_equal(_bits(a[slots]), _bits(b[slots]))
               for a, b in zip(_state_arrays(before), _state_arrays(after)))


def test_csa_rotate_exact_state(rng):
    S, d = 7, 16
    st = _random_state(rng, "csa", S, d)
    before = st.copy()
    slots = np.array([5, 1, 9, 3, -1, 0])
    valid = np.array([True, True, True, False, True, False])
    err = ref.csa_rotate(st, valid, slots)
    assert err == 2                                  # 9 and -1
    for s in (5, 1):
        assert np.array_equal(st.b_kv[s], before.a_kv[s, :, :d])
        assert np.array_equal(st.b_z[s], before.a_z[s, :, :d])
        assert not st.a_kv[s].any() and np.all(st.a_z[s] == -np.inf) and st.count[s] == 0
    assert _unchanged_slots(before, st, [0, 2, 3, 4, 6])
    with pytest.raises(ValueError, match="state"):
        ref.hca_reset(st, valid, slots)


def test_hca_reset_exact_state(rng):
    S, d = 5, 8
    st = _random_state(rng, "hca", S, d)
    before = st.copy()
    err = ref.hca_reset(st, np.array([True, True, False]), np.array([2, 5, 4]))
    assert err == 1
    assert not st.a_kv[2].any() and np.all(st.a_z[2] == -np.inf) and st.count[2] == 0
    assert _unchanged_slots(before, st, [0, 1, 3, 4])
    with pytest.raises(ValueError, match="state"):
        ref.csa_rotate(st, np.array([True]), np.array([0]))


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_state_seed_equals_token_by_token(rng, kind):
    """state_seed(prompt) leaves exactly the state that state_clear followed by
    state_append of every prompt row and csa_rotate / hca_reset after every
    full window leaves, on a slot that held garbage; other slots untouched."""
    d, S = 16, 4
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    w = 2 * d if kind == "csa" else d
    ape = _random_rows(rng, m, w)
    for T in sorted({0, 1, m - 1, m, m + 1, 2 * m, 3 * m + m // 2}):
        kv, z = _random_rows(rng, T, w), _random_rows(rng, T, w, 2.0)
        for use_ape in (True, False):
            a = ape if use_ape else None
            seeded = _random_state(rng, kind, S, d)
            slow = seeded.copy()
            ref.state_seed(seeded, 2, kv, z, a)
            assert ref.state_clear(slow, np.array([2])) == 0
            one = np.ones(1, bool)
            for t in range(T):
                assert ref.state_append(slow, kv[t:t + 1], z[t:t + 1], one, np.array([2]), a) == 0
                if slow.count[2] == m:
                    rot = ref.csa_rotate if kind == "csa" else ref.hca_reset
                    assert rot(slow, one, np.array([2])) == 0
            for x, y in zip(_state_arrays(seeded), _state_arrays(slow)):
                assert np.array_equal(_bits(x), _bits(y)), (T, use_ape)
    st = ref.DecodeStateRef.create(kind, S, d)
    with pytest.raises(ValueError, match="slot"):
        ref.state_seed(st, S, kv, z)
    with pytest.raises(TypeError, match="slot"):
        ref.state_seed(st, 1.0, kv, z)
    with pytest.raises(ValueError, match="kv"):
        ref.state_seed(st, 0, kv[:, :-1], z)
    with pytest.raises(ValueError, match="ape"):
        ref.state_seed(st, 0, kv, z, ape[:-1])


def test_state_append_and_clear(rng):
    S, d, m = 4, 8, 4
    st = ref.DecodeStateRef.create("csa", S, d)
    ape = _random_rows(rng, m, 2 * d)
    st.count[2] = m                                        # full window, flush missed
    kv, z = _random_rows(rng, 4, 2 * d), _random_rows(rng, 4, 2 * d)
    before = st.copy()
    err = ref.state_append(st, kv, z, np.array([True, True, True, False]),
                           np.array([0, 2, 7, 1]), ape)
    assert err == 2                                        # slot 2 full, slot 7 out of range
    assert st.count[0] == 1 and np.array_equal(st.a_kv[0, 0], kv[0])
    assert np.array_equal(st.a_z[0, 0], z[0] + ape[0])
    assert _unchanged_slots(before, st, [1, 2, 3])
    ref.state_append(st, kv, z, np.array([True, False, False, False]), np.array([0, 0, 0, 0]), ape)
    assert st.count[0] == 2 and np.array_equal(st.a_z[0, 1], z[0] + ape[1])
    # a negative count (corrupted memory) is skipped and counted, as the kernel does: never followed
    st.count[1] = -1
    before = st.copy()
    assert ref.state_append(st, kv, z, np.array([False, True, False, False]), np.array([0, 1, 0, 0]), ape) == 1
    assert st.count[1] == -1 and _unchanged_slots(before, st, [0, 1, 2, 3])
    st.count[1] = 0
    st.b_z[3] = 1.0
    assert ref.state_clear(st, np.array([3, 0, 11])) == 1
    for s in (0, 3):
        assert st.count[s] == 0 and np.all(st.a_z[s] == -np.inf) and np.all(st.b_z[s] == -np.inf)


def test_state_clear_valid_mask(rng):
    st = _random_state(rng, "csa", 4, 8)
    before = st.copy()
    err = ref.state_clear(st, np.array([0, 2, 9, 3]), valid_mask=np.array([True, False, True, False]))
    assert err == 1 and st.count[0] == 0 and np.all(st.a_z[0] == -np.inf)
    assert _unchanged_slots(before, st, [1, 2, 3])


def test_state_ops_duplicate_slots_lowest_row_wins(rng):
    """Duplicate slots (a caller error): the lowest valid row of a slot acts,
    every other valid row of it is skipped and counted (kv_cache.cu does the
    same, so the state never depends on the order CTAs run in)."""
    st = ref.DecodeStateRef.create("csa", 2, 8)
    st.count[0] = 1
    B = 9
    kv, z = _random_rows(rng, B, 16), _random_rows(rng, B, 16)
    valid = np.ones(B, bool)
    valid[0] = False                              # an invalid row owns nothing
    err = ref.state_append(st, kv, z, valid, np.zeros(B, np.int32))
    assert err == B - 2 and st.count[0] == 2 and st.count[1] == 0
    assert np.array_equal(st.a_kv[0, 1], kv[1]) and np.array_equal(st.a_z[0, 1], z[1])
    before = st.copy()
    # rotate: rows 1 and 3 duplicate slot 0 of row 0; row 2 is out of range
    err = ref.csa_rotate(st, np.ones(4, bool), np.array([0, 0, 5, 0], np.int32))
    assert err == 3 and st.count[0] == 0
    assert np.array_equal(st.b_kv[0], before.a_kv[0, :, :8])
    h = ref.DecodeStateRef.create("hca", 2, 8)
    h.count[:] = [3, 2]
    assert ref.hca_reset(h, np.ones(3, bool), np.array([1, 1, 1], np.int32)) == 2
    assert list(h.count) == [3, 0]
    assert ref.state_clear(h, np.array([0, 1, 0, 1], np.int32)) == 2


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
def test_state_ops_refuse_errors_in_the_states_buffers():
    st = kc.DecodeState("csa", 2, head_dim=128, device="cpu")
    rows = np.ones((1, st.width), np.float32)
    slots, valid = np.zeros(1, np.int32), np.ones(1, bool)
    _refused("errors", "state.count", lambda: kc.state_append(st, rows, rows, valid, slots, errors=st.count[:1]))
    _refused("errors", "state.count", lambda: kc.state_clear(st, slots, errors=st.count[1:]))
    z_a = st.z_a.reshape(-1)[:1].view(np.int32)
    _refused("errors", "state.z_a", lambda: kc.csa_rotate(st, valid, slots, errors=z_a))
    assert not st.count.any() and np.isneginf(st.z_a).all()


def test_state_ops_refuse_misaligned_slots():
    """The state kernels load slots[b] as an int32: a slots array not
    aligned to 4 bytes (a DLPack array or torch.frombuffer at an odd byte
    offset) faults on the GPU (a sticky error). It was taken on CPU and
    launched on CUDA; now refused by name on both, nothing written."""
    torch = pytest.importorskip("torch")
    from support.views import off_element
    st = kc.DecodeState("csa", 2, head_dim=128, device="cpu")
    rows = torch.ones((2, st.width))
    valid = torch.ones(2, dtype=torch.bool)
    slots = off_element(torch.tensor([0, 1], dtype=torch.int32))
    for call in (lambda: kc.state_append(st, rows, rows, valid, slots),
                 lambda: kc.csa_rotate(st, valid, slots),
                 lambda: kc.state_clear(st, slots)):
        with pytest.raises(ValueError, match="^slots: data must be 4-byte aligned"):
            call()
    assert not st.count.any() and np.isneginf(st.z_a).all()


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# duplicates: the lowest row wins
# ---------------------------------------------------------------------------
def _state_dups(device, rng, kind):
    """state_append / csa_rotate / hca_reset / state_clear with duplicate
    slots: the state after each op, and each op's count."""
    dv = _Dev(device)
    st = kc.DecodeState(kind, 3, 128, device=device)
    w = st.width
    slots = np.array([1, 0, 1, 1, 7, 0, 2, 1], np.int32)
    valid = np.array([False, True, True, True, True, True, True, True])
    out = []
    for step in range(st.m + 1):
        kv = rng.standard_normal((slots.size, w)).astype(F32)
        z = rng.standard_normal((slots.size, w)).astype(F32)
        st.reset_errors()
        kc.state_append(st, dv.t(kv), dv.t(z), dv.t(valid), dv.t(slots))
        out.append((st.to_reference().copy(), st.read_errors()))
    st.reset_errors()
    (kc.csa_rotate if kind == "csa" else kc.hca_reset)(st, dv.t(valid), dv.t(slots))
    out.append((st.to_reference().copy(), st.read_errors()))
    st.reset_errors()
    kc.state_clear(st, dv.t(slots))
    out.append((st.to_reference().copy(), st.read_errors()))
    return out


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_state_duplicates_lowest_row_wins(rng, kind):
    seed = int(rng.integers(1 << 30))
    res = _state_dups("cpu", np.random.default_rng(seed), kind)
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    # append: rows 2 (slot 1), 1 (slot 0), 6 (slot 2) own their slots; rows 3, 5, 7 are
    # duplicates, row 4 is out of range (rows 0: invalid)
    st, err = res[0]
    assert err == 4 and list(st.count) == [1, 1, 1]
    again = np.random.default_rng(seed)
    kv = again.standard_normal((8, res[0][0].a_kv.shape[2])).astype(F32)
    np.testing.assert_array_equal(st.a_kv[1, 0], kv[2])
    full, err = res[m]                                  # m appends: full windows
    assert list(full.count) == [m, m, m]
    st, err = res[m]
    assert err == 4 + 3                                 # the full windows refuse the owners too
    rot, err = res[m + 1]
    assert err == 4 and list(rot.count) == [0, 0, 0]
    clr, err = res[m + 2]
    assert err == 5                                     # no valid_mask: row 0 owns slot 1 now


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_state_duplicates_match_the_reference(cuda, rng, kind):
    """Repeated runs give the same state and counts, equal to the CPU's."""
    seed = int(rng.integers(1 << 30))
    want = _state_dups("cpu", np.random.default_rng(seed), kind)
    for run in range(5):
        got = _state_dups("cuda", np.random.default_rng(seed), kind)
        for i, ((a, ea), (b, eb)) in enumerate(zip(got, want)):
            assert ea == eb, f"run {run} op {i}: errors"
            for name in ("a_kv", "a_z", "b_kv", "b_z", "count"):
                x, y = getattr(a, name), getattr(b, name)
                if x is not None:
                    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8),
                                                  err_msg=f"run {run} op {i}: {name}")


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
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


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
@pytest.mark.parametrize("op", ["state_append", "csa_rotate", "hca_reset", "state_clear"])
def test_state_rows_past_the_launch_grid_refused_before_anything(monkeypatch, placement, op):
    """rkv_kv_state_append and rkv_kv_state_reset run one CTA per batch row
    (grid (B,)), and a grid's x dimension holds at most 2^31 - 1 blocks:
    2^31 rows (slots of 8 GiB, kv of 4 HCA channels in 16 GiB) were accepted
    on CPU and CUDA alike, and the launch failed on the GPU with CUDA's
    error, not the argument's. Refused (a ValueError naming kv / slots)
    before anything is launched or run. The 2^31-row tensors are
    torch.empty's, never touched (address space, no memory)."""
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import state_ops
    from support.fake_cuda import fake, install
    rt = install(monkeypatch, [state_ops])
    kind = "csa" if op == "csa_rotate" else "hca"

    class _NotRun:
        def __getattr__(self, name):
            raise AssertionError("the reference ran on rows past the launch grid")
    monkeypatch.setattr(state_ops, "ref", _NotRun())
    move = fake if placement == "cuda" else (lambda t: t)
    st = kc.DecodeState(kind, 2, 4, device="cpu")
    bufs = [None if b is None else move(torch.from_numpy(b.copy())) for b in
            (st.kv_a, st.z_a, st.kv_b, st.z_b, st.count, st.errors)]
    rows = 2 ** 31
    valid, slots = move(torch.empty(rows, dtype=torch.bool)), move(torch.empty(rows, dtype=torch.int32))
    if op == "state_append":
        kv, z = (move(torch.empty((rows, st.width), dtype=torch.bfloat16)) for _ in range(2))
        call, name = (lambda: state_ops._state_append(*bufs, kv, z, valid, slots, None)), "kv"
    else:
        body = {"csa_rotate": state_ops._csa_rotate, "hca_reset": state_ops._hca_reset,
                "state_clear": state_ops._state_clear}[op]
        call, name = (lambda: body(*bufs, valid, slots)), "slots"
    with pytest.raises(ValueError, match=rf"^{name}: {rows} "):
        call()
    assert rt.calls == []
