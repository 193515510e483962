"""compress_prefill / compress_decode (rawkv/kvcache/prefill.py, decode.py,
rawkv/cu/kv_compress.cu).

CPU pools run the reference composition (compress_* -> finish_entry /
finish_index_key -> flush_write), so the CPU tests pin the API and the
composition itself; GPU tests (fixture `cuda`) compare the kernel with it.

Tolerance of the kernel (docs/kvcache.md, "Compressor kernel"): the kernel
uses expf (float32, <= 2 ulp) where the reference rounds a float64 exp, and
HCA pools with an online softmax (a few extra float32 roundings). A numpy
simulation that perturbs every exp weight by up to +-2 ulp moves ~0.01% of
the BF16 entry elements by one BF16 ulp, ~0.002% of FP8 codes by one step,
no scale, and keeps every entry's cosine >= 0.9999995. The tests allow
margin above that: per entry cosine >= 0.9999, <= 0.1% of FP8 codes
differing and each by at most one step, scale within one BF16 ulp of amax
(2^-7 relative), RoPE dims within one BF16 ulp; indexer keys (NVFP4, coarse:
one BF16 ulp at a rounding edge moves an E2M1 code a whole step) <= 1% of
codes differing and key cosine >= 0.99.
"""
from __future__ import annotations

import numpy as np
import pytest

from rawkv.reference import kvcache as ref

kvc = pytest.importorskip("rawkv.kvcache")
from rawkv.kvcache import (  # noqa: E402
    DecodeState, PagedKVPool, compress_decode, compress_prefill, reference_prefill,
)

D, DI = 512, 128
M = {"csa": 4, "hca": 128}
COFF = {"csa": 2, "hca": 1}


def _inputs(rng, kind, T, dtype=np.float32):
    m, w = M[kind], COFF[kind] * D
    kv = rng.standard_normal((T, w)).astype(dtype)
    z = (1.5 * rng.standard_normal((T, w))).astype(dtype)
    ape = (0.3 * rng.standard_normal((m, w))).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    idx = None
    if kind == "csa":
        idx = (rng.standard_normal((T, 2 * DI)).astype(dtype),
               (1.5 * rng.standard_normal((T, 2 * DI))).astype(dtype),
               (0.3 * rng.standard_normal((m, 2 * DI))).astype(np.float32),
               (1 + 0.1 * rng.standard_normal(DI)).astype(np.float32))
    return kv, z, ape, nw, idx


def _sl(idx, lo, hi):
    if idx is None:
        return None
    return (idx[0][lo:hi], idx[1][lo:hi], idx[2], idx[3])


def _pool(kind, device, R=4, nb=64, epb=4, mb=16):
    return PagedKVPool(kind, nb, epb, R, mb, layout="rawkv", device=device)


def _arr(x):
    if hasattr(x, "detach"):
        import torch
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _entries(pool, slot, n):
    """(codes (n, 448), scale (n,), rope (n, 64), iq, isf) of entries 0..n-1."""
    table = _arr(pool.block_table)[slot]
    epb = pool.entries_per_block
    e = np.arange(n)
    blk, row = table[e // epb], e % epb
    out = [_arr(pool.fp8)[blk, row], _arr(pool.scale)[blk, row], _arr(pool.rope)[blk, row]]
    if pool.index_q is not None:
        out += [_arr(pool.index_q)[blk, row], _arr(pool.index_sf)[blk, row]]
    return out


def assert_entries_close(got, want, *, exact=False):
    """The kernel tolerance stated in the module doc (exact=True: bit for bit)."""
    gc, gs, gr = got[:3]
    wc, ws, wr = want[:3]
    if exact:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        return
    gd = ref.fp8_entry_dequantize(gc, gs, gr)
    wd = ref.fp8_entry_dequantize(wc, ws, wr)
    cos = (gd * wd).sum(1) / (np.linalg.norm(gd, axis=1) * np.linalg.norm(wd, axis=1))
    assert cos.min() >= 0.9999, f"entry cosine {cos.min()}"
    diff = gc != wc
    assert diff.mean() <= 1e-3, f"{diff.mean():.5f} of FP8 codes differ"
    step = np.abs((gc & 0x7F).astype(int) - (wc & 0x7F).astype(int))
    same_sign = (gc & 0x80) == (wc & 0x80)
    assert np.all(np.where(diff & same_sign, step, 0) <= 1), "an FP8 code moved more than one step"
    assert np.all(np.where(diff & ~same_sign, np.maximum(gc & 0x7F, wc & 0x7F), 0) <= 1)
    np.testing.assert_allclose(gs, ws, rtol=2.0 ** -7, atol=0)
    np.testing.assert_allclose(gr, wr, rtol=2.0 ** -7, atol=1e-30)
    if len(got) > 3:
        gq, gsf = got[3:]
        wq, wsf = want[3:]
        kd = ref.indexer_key_dequantize(gq, gsf)
        kw = ref.indexer_key_dequantize(wq, wsf)
        kc = (kd * kw).sum(1) / (np.linalg.norm(kd, axis=1) * np.linalg.norm(kw, axis=1))
        assert kc.min() >= 0.99, f"indexer key cosine {kc.min()}"
        codes_g = np.stack([gq & 15, gq >> 4], -1)
        codes_w = np.stack([wq & 15, wq >> 4], -1)
        assert (codes_g != codes_w).mean() <= 1e-2


def _ref_pool(kind, kv, z, ape, nw, idx, epb=4, nb=64, mb=16):
    """Reference composition written into a PagedPoolRef with identity blocks."""
    ids, ent, keys = reference_prefill(kind, kv, z, ape, nw, index=idx)
    p = ref.PagedPoolRef.create(nb, epb, M[kind], index_head_dim=DI if kind == "csa" else None)
    table = np.arange(mb)[None].repeat(len(ids), 0)
    assert ref.flush_write(p, ent, np.ones(len(ids), bool), ids * M[kind], table, keys) == 0
    return p, len(ids)


# ---------------------------------------------------------------------------
# CPU: argument checks
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_prefill_argument_errors(rng, kind):
    pool = _pool(kind, "cpu")
    s = pool.add_request()
    kv, z, ape, nw, idx = _inputs(rng, kind, 2 * M[kind])
    with pytest.raises(ValueError, match="^kv"):
        compress_prefill(pool, kv[:, :-1], z, ape, nw, s, index=idx)
    with pytest.raises(ValueError, match="^z"):
        compress_prefill(pool, kv, z[:-1], ape, nw, s, index=idx)
    with pytest.raises(ValueError, match="^ape"):
        compress_prefill(pool, kv, z, ape[:-1], nw, s, index=idx)
    with pytest.raises(ValueError, match="^norm_weight"):
        compress_prefill(pool, kv, z, ape, nw[:-1], s, index=idx)
    with pytest.raises(ValueError, match="^slot"):
        compress_prefill(pool, kv, z, ape, nw, 99, index=idx)
    with pytest.raises(TypeError, match="^slot"):
        compress_prefill(pool, kv, z, ape, nw, 0.5, index=idx)
    with pytest.raises(ValueError, match="^start_entry"):
        compress_prefill(pool, kv, z, ape, nw, s, start_entry=-1, index=idx)
    with pytest.raises(ValueError, match="^eps"):
        compress_prefill(pool, kv, z, ape, nw, s, index=idx, eps=float("nan"))
    if kind == "csa":
        with pytest.raises(ValueError, match="^index"):
            compress_prefill(pool, kv, z, ape, nw, s)
        with pytest.raises(TypeError, match="^index"):
            compress_prefill(pool, kv, z, ape, nw, s, index=idx[:2])
    else:
        with pytest.raises(ValueError, match="^index"):
            compress_prefill(pool, kv, z, ape, nw, s, index=(kv, z, ape, nw))
    with pytest.raises(TypeError, match="^pool"):
        compress_prefill(object(), kv, z, ape, nw, s)
    assert not pool.fp8.any() and pool.read_errors() == 0     # nothing written


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


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_eps_follows_the_one_rule(rng, op):
    """eps goes through rawkv._args.check_eps: <= 0 (eps = 0 would give NaN on
    an all-zero window), non-finite, not a float32 > 0, or not a number is a
    ValueError naming eps, before anything is written; numpy scalars count."""
    kind = "hca"
    m = M[kind]
    pool = _pool(kind, "cpu")
    s = pool.add_request()
    pool.prepare_step([s], [2 * m - 1])
    kv, z, ape, nw, _ = _inputs(rng, kind, 2 * m)
    st = DecodeState(kind, 4, device="cpu")
    pool.attach(st)
    st.kv_a[s], st.z_a[s], st.count[s] = kv[:m], z[:m], m    # one complete window
    v, sl, pos = np.ones(1, bool), np.array([s], np.int32), np.array([m - 1], np.int32)

    def call(eps):
        if op == "prefill":
            return compress_prefill(pool, kv, z, ape, nw, s, eps=eps)
        return compress_decode(pool, st, nw, v, sl, pos, eps=eps)

    for bad in (0, 0.0, -1e-6, float("inf"), float("nan"), 1e39, 1e-46, True, "1e-6", None,
                np.zeros(1, np.float32)):
        with pytest.raises(ValueError, match="^eps"):
            call(bad)
    assert not pool.fp8.any() and not pool.written.any() and pool.read_errors() == 0
    for good in (np.float32(1e-6), 1e-5, 1):
        call(good)
    assert pool.written[s] == (2 if op == "prefill" else 1) and pool.read_errors() == 0


Y = ref.DSV4_YARN
#: (theta, yarn, error type, the name the message starts with): what the issue
#: found (NaN rotations, plausible wrong ones, ZeroDivisionError, math domain
#: error, AttributeError from the reference) and the edges of each range
BAD_ROPE = [
    (1.0, Y, ValueError, "theta"), (True, Y, TypeError, "theta"), (0, Y, ValueError, "theta"),
    (float("inf"), Y, ValueError, "theta"), (1e-30, Y, ValueError, "theta"), (-5.0, None, ValueError, "theta"),
    (float("nan"), None, ValueError, "theta"), ("160000", Y, TypeError, "theta"), (None, Y, TypeError, "theta"),
    (10 ** 400, Y, ValueError, "theta"),
    (1e4, "bogus", TypeError, "yarn"), (1e4, (16.0, 65536, 32.0, 1.0), TypeError, "yarn"),
    (1e4, ref.YarnConfig(0.0, 65536, 32.0, 1.0), ValueError, "yarn.factor"),
    (1e4, ref.YarnConfig(float("nan"), 65536, 32.0, 1.0), ValueError, "yarn.factor"),
    (1e4, ref.YarnConfig(-16.0, 65536, 32.0, 1.0), ValueError, "yarn.factor"),
    (1e4, ref.YarnConfig(0.5, 65536, 32.0, 1.0), ValueError, "yarn.factor"),
    (1e4, ref.YarnConfig(float("inf"), 65536, 32.0, 1.0), ValueError, "yarn.factor"),
    (1e4, ref.YarnConfig(True, 65536, 32.0, 1.0), TypeError, "yarn.factor"),
    (1e4, ref.YarnConfig(16.0, 0, 32.0, 1.0), ValueError, "yarn.original_seq_len"),
    (1e4, ref.YarnConfig(16.0, 65536.5, 32.0, 1.0), TypeError, "yarn.original_seq_len"),
    (1e4, ref.YarnConfig(16.0, 65536, 32.0, 0.0), ValueError, "yarn.beta_slow"),
    (1e4, ref.YarnConfig(16.0, 65536, float("nan"), 1.0), ValueError, "yarn.beta_fast"),
    (1e4, ref.YarnConfig(16.0, 65536, 1.0, 32.0), ValueError, "yarn.beta_fast"),
]


def _one_window_case(rng, kind, device="cpu"):
    """A pool with one request prepared for 2 windows, its prompt rows and a
    decode state holding one complete window: call(op, theta, yarn) runs
    compress_prefill / compress_decode with those RoPE parameters."""
    m = M[kind]
    pool = _pool(kind, device)
    st = DecodeState(kind, 4, device=device)
    ist = DecodeState("csa", 4, DI, device=device) if kind == "csa" else None
    pool.attach(*(x for x in (st, ist) if x is not None))
    s = pool.add_request()
    pool.prepare_step([s], [2 * m - 1])
    kv, z, ape, nw, idx = _inputs(rng, kind, 2 * m)
    t = (lambda a: a) if device == "cpu" else _t
    for state, rows in ((st, (kv, z)), (ist, None if idx is None else idx[:2])):
        if state is not None:                       # m - 1 rows seeded, one appended: window 0 complete
            kvc.state_seed(state, s, t(rows[0][:m - 1]), t(rows[1][:m - 1]))
            kvc.state_append(state, t(rows[0][m - 1:m]), t(rows[1][m - 1:m]), t(np.ones(1, bool)),
                             t(np.array([s], np.int32)))
    tidx = None if idx is None else kvc.PrefillIndex(*(t(a) for a in idx))
    dix = None if ist is None else kvc.DecodeIndex(ist, t(idx[3]))
    v, sl, pos = t(np.ones(1, bool)), t(np.array([s], np.int32)), t(np.array([m - 1], np.int32))

    def call(op, theta, yarn):
        if op == "prefill":
            return compress_prefill(pool, t(kv), t(z), t(ape), t(nw), s, index=tidx, theta=theta, yarn=yarn)
        return compress_decode(pool, st, t(nw), v, sl, pos, index=dix, theta=theta, yarn=yarn)

    call.states = (st, ist)
    return pool, call


def _untouched(pool):
    """Nothing written: no entry byte, no written[], no count."""
    return not np.any(_arr(pool.fp8)) and not np.any(_arr(pool.written)) and pool.read_errors() == 0


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_rope_parameters_are_checked(rng, kind, op):
    """theta and yarn go through reference.check_rope on every path: each bad
    value is a TypeError / ValueError naming the field (theta, yarn,
    yarn.factor, ...) before anything is written; before the fix, yarn.factor
    0 or NaN wrote NaN RoPE dims with errors 0 and theta 1.0 raised
    ZeroDivisionError. The edges of each range are accepted."""
    pool, call = _one_window_case(rng, kind)
    for theta, yarn, exc, name in BAD_ROPE:
        with pytest.raises(exc, match=f"^{name}: "):
            call(op, theta, yarn)
    assert _untouched(pool)
    edges = [(1.0 + 2 ** -40, None), (np.float32(1e4), ref.YarnConfig(1.0, 1, 2.0, 2.0)),
             (10 ** 6, ref.YarnConfig(np.float64(40.0), np.int64(4096), 32, 1))]
    for theta, yarn in edges:
        call(op, theta, yarn)
    assert np.isfinite(_arr(pool.rope)).all() and pool.read_errors() == 0 and pool.written[0] > 0


def test_rope_parameters_are_checked_in_the_reference():
    """The reference's RoPE table applies the same rule (it is the rule's home)."""
    for theta, yarn, exc, name in BAD_ROPE:
        with pytest.raises(exc, match=f"^{name}: "):
            ref.rope_inv_freq(64, theta, yarn)
    assert np.isfinite(ref.rope_inv_freq(64, 1e4, ref.YarnConfig(1.0, 1, 2.0, 2.0))).all()


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_rope_parameters_are_checked_through_the_operators(rng, op):
    """torch.ops.rawkv.kv_compress_*: theta a float, yarn a float list; the
    same rule (the list's values included), nothing written."""
    torch = pytest.importorskip("torch")
    import rawkv.library  # noqa: F401
    from rawkv.kvcache import views as V
    kind, m = "csa", M["csa"]
    pool, case = _one_window_case(rng, kind)
    st, ist = case.states                               # each holds a complete window
    kv, z, ape, nw, idx = (torch.from_numpy(a) if isinstance(a, np.ndarray) else a
                           for a in _inputs(rng, kind, 2 * m))
    idx = tuple(torch.from_numpy(a) for a in idx)

    def call(theta, yarn):
        if op == "prefill":
            return torch.ops.rawkv.kv_compress_prefill(
                **V.pool_args(pool), kv=kv, z=z, ape=ape, norm_weight=nw, slot=0, start_entry=0,
                index_kv=idx[0], index_z=idx[1], index_ape=idx[2], index_norm_weight=idx[3], eps=1e-6,
                theta=theta, yarn=yarn)
        return torch.ops.rawkv.kv_compress_decode(
            **V.pool_args(pool), **V.state_args(st, counter=False),
            **V.state_args(ist, prefix="index_", counter=False), norm_weight=nw,
            valid_mask=torch.ones(1, dtype=torch.bool), slots=torch.zeros(1, dtype=torch.int32),
            positions=torch.full((1,), m - 1, dtype=torch.int32), index_norm_weight=idx[3], eps=1e-6,
            theta=theta, yarn=yarn)

    for theta, yarn, name in [(1.0, None, "theta"), (float("inf"), None, "theta"), (1e-30, None, "theta"),
                              (1e4, [0.0, 65536.0, 32.0, 1.0], "yarn.factor"),
                              (1e4, [float("nan"), 65536.0, 32.0, 1.0], "yarn.factor"),
                              (1e4, [16.0, 65536.5, 32.0, 1.0], "yarn.original_seq_len"),
                              (1e4, [16.0, float("nan"), 32.0, 1.0], "yarn.original_seq_len"),
                              (1e4, [16.0, 65536.0, 1.0, 32.0], "yarn.beta_fast"),
                              (1e4, [16.0, 65536.0, 32.0], "yarn")]:
        with pytest.raises((TypeError, ValueError), match=f"{name}: "):
            call(theta, yarn)
    assert _untouched(pool)


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_rope_parameters_are_checked(cuda, rng, kind, op):
    """The CUDA path refuses what the CPU path refuses, before the RoPE
    table is built or anything is launched."""
    from rawkv.kvcache import compressor
    pool, call = _one_window_case(rng, kind, "cuda")
    tables = len(compressor._TABLES)
    for theta, yarn, exc, name in BAD_ROPE:
        with pytest.raises(exc, match=f"^{name}: "):
            call(op, theta, yarn)
    assert _untouched(pool) and len(compressor._TABLES) == tables
    call(op, 1e4, ref.YarnConfig(1.0, 1, 2.0, 2.0))
    assert pool.read_errors() == 0 and int(pool.written.max()) > 0
    assert np.isfinite(_arr(pool.rope)).all()


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


# ---------------------------------------------------------------------------
# CPU: the composition
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_prefill_is_reference_composition(rng, kind):
    m = M[kind]
    T = 5 * m + m // 2                                  # a trailing partial window
    kv, z, ape, nw, idx = _inputs(rng, kind, T)
    pool = _pool(kind, "cpu")
    s = pool.add_request()
    pool.prepare_step([s], [T - 1])
    assert compress_prefill(pool, kv, z, ape, nw, s, index=idx) == 5
    want, n = _ref_pool(kind, kv, z, ape, nw, idx)
    got = _entries(pool, s, n)
    exp = [want.kv_fp8[:2].reshape(-1, 448)[:n], want.kv_scale[:2].reshape(-1)[:n],
           want.kv_rope[:2].reshape(-1, 64)[:n]]
    if kind == "csa":
        exp += [want.idx_q[:2].reshape(-1, 64)[:n], want.idx_sf[:2].reshape(-1, 8)[:n]]
    assert_entries_close(got, exp, exact=True)
    assert pool.read_errors() == 0


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


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_missing_blocks_are_counted(rng, kind):
    m = M[kind]
    kv, z, ape, nw, idx = _inputs(rng, kind, 3 * m)
    pool = _pool(kind, "cpu", mb=1, epb=2)
    s = pool.add_request()
    pool.prepare_step([s], [m])                         # one block: entries 0, 1
    compress_prefill(pool, kv, z, ape, nw, s, index=idx)
    assert pool.read_errors() == 1                      # entry 2: past the block table


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
    B = len(lengths)
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
def test_cpu_chunked_prefill(rng, kind):
    m = M[kind]
    T = 6 * m
    kv, z, ape, nw, idx = _inputs(rng, kind, T)
    whole = _pool(kind, "cpu")
    a = whole.add_request()
    whole.prepare_step([a], [T - 1])
    compress_prefill(whole, kv, z, ape, nw, a, index=idx)
    parts = _pool(kind, "cpu")
    b = parts.add_request()
    parts.prepare_step([b], [T - 1])
    assert compress_prefill(parts, kv[:2 * m], z[:2 * m], ape, nw, b, index=_sl(idx, 0, 2 * m)) == 2
    lo = m if kind == "csa" else 2 * m                # CSA: one window of overlap context
    assert compress_prefill(parts, kv[lo:], z[lo:], ape, nw, b, start_entry=2,
                            index=_sl(idx, lo, T)) == 4
    assert_entries_close(_entries(parts, b, 6), _entries(whole, a, 6), exact=True)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def _t(a, dtype=None):
    import torch
    t = torch.from_numpy(np.ascontiguousarray(a)).cuda()
    return t if dtype is None else t.to(dtype)


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_gpu_prefill_matches_reference(cuda, rng, kind, dt):
    import torch
    m = M[kind]
    T = (37 if kind == "csa" else 9) * m + 3
    kv, z, ape, nw, idx = _inputs(rng, kind, T)
    tdt = getattr(torch, dt)
    if dt == "bfloat16":     # the reference sees the BF16 values the kernel reads
        kv, z = (_t(kv, tdt).float().cpu().numpy(), _t(z, tdt).float().cpu().numpy())
        if idx is not None:
            idx = (_t(idx[0], tdt).float().cpu().numpy(), _t(idx[1], tdt).float().cpu().numpy(),
                   idx[2], idx[3])
    cpu = _pool(kind, "cpu", nb=64, epb=4, mb=16)
    gpu = _pool(kind, "cuda", nb=64, epb=4, mb=16)
    sc, sg = cpu.add_request(), gpu.add_request()
    cpu.prepare_step([sc], [T - 1])
    gpu.prepare_step([sg], [T - 1])
    n = compress_prefill(cpu, kv, z, ape, nw, sc, index=idx)
    gidx = None if idx is None else (_t(idx[0], tdt), _t(idx[1], tdt), _t(idx[2]), _t(idx[3]))
    assert compress_prefill(gpu, _t(kv, tdt), _t(z, tdt), _t(ape), _t(nw), sg, index=gidx) == n
    torch.cuda.synchronize()
    assert gpu.read_errors() == 0
    assert int(gpu.written[sg]) == int(cpu.written[sc]) == n
    assert_entries_close(_entries(gpu, sg, n), _entries(cpu, sc, n))


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
def test_gpu_errors_and_skips(cuda, rng, kind):
    import torch
    m = M[kind]
    kv, z, ape, nw, idx = _inputs(rng, kind, 3 * m)
    pool = _pool(kind, "cuda", mb=1, epb=2)
    s = pool.add_request()
    pool.prepare_step([s], [m])
    gidx = None if idx is None else tuple(_t(a) for a in idx)
    compress_prefill(pool, _t(kv), _t(z), _t(ape), _t(nw), s, index=gidx)
    assert pool.read_errors() == 1                        # entry 2 is past the table
    pool.reset_errors()
    st = DecodeState(kind, 4, device="cuda")
    ist = DecodeState("csa", 4, DI, device="cuda") if kind == "csa" else None
    pool.attach(*(x for x in (st, ist) if x is not None))
    ix = None if ist is None else (ist, _t(idx[3]))
    before = pool.fp8.clone()
    # slot 7 out of range (counted); slot 0 window incomplete (skipped silently);
    # row 2 not valid (skipped silently)
    compress_decode(pool, st, _t(nw), _t(np.array([True, True, False])),
                    _t(np.array([7, 0, 1], np.int32)), _t(np.array([m - 1, m - 1, m - 1], np.int32)),
                    index=ix)
    torch.cuda.synchronize()
    assert pool.read_errors() == 1
    assert torch.equal(before, pool.fp8)


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
