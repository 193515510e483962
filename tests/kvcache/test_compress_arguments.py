"""The scalar arguments both compress ops take, eps and the RoPE parameters (theta,
yarn): one rule (rawkv._args / rawkv/kvcache/_rules.py) on CPU, in the
reference, through the operators and on CUDA, checked before anything is
written."""

from __future__ import annotations

import numpy as np
import pytest

import rawkv.kvcache as kvc
from rawkv.kvcache import DecodeState, compress_decode, compress_prefill
from rawkv.reference import kvcache as ref
from support.kvcache import D, DI
from support.kvcache_compress import M, _arr, _inputs, _pool, _t


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_eps_follows_the_one_rule(rng, op):
    """eps goes through rawkv._args.check_eps: <= 0 (eps = 0 would give NaN on
    an all-zero window), non-finite, not a float32 > 0, or not a number is a
    ValueError naming eps (a bool a TypeError), before anything is written;
    numpy scalars count."""
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

    for bad in (0, 0.0, -1e-6, float("inf"), float("nan"), 1e39, 1e-46, "1e-6", None,
                np.zeros(1, np.float32)):
        with pytest.raises(ValueError, match="^eps"):
            call(bad)
    for bad in (True, np.False_):       # (a bool: A.refuse_bool's TypeError)
        with pytest.raises(TypeError, match="^eps: expected a number, got bool$"):
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


def _one_window_case(rng, kind, device="cpu", **pool_kw):
    """A pool with one request prepared for 2 windows (pool_kw: more
    PagedKVPool arguments), its prompt rows and a decode state holding one
    complete window: call(op, theta, yarn) runs compress_prefill /
    compress_decode with those RoPE parameters."""
    m = M[kind]
    pool = _pool(kind, device, **pool_kw)
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


def _rope_dim_is_64(rng, device):
    """A pool whose rope_dim is not DeepSeek-V4's 64 (the PagedKVPool takes
    any multiple of 8) is refused by both compress ops with a ValueError
    naming rope_dim, before the RoPE table is built or anything written
    (and so is rope_table(pool)):
    the reference rotated the last 64 dims whatever the pool's rope_dim and
    the kernel the pool's rope_dim, so CPU and CUDA gave different entries."""
    from rawkv.kvcache import compressor
    tables = len(compressor._TABLES)
    for kind in ("csa", "hca"):
        for rope_dim in (32, 128):
            pool, call = _one_window_case(rng, kind, device, rope_dim=rope_dim)
            for op in ("prefill", "decode"):
                with pytest.raises(ValueError, match=f"^pool: rope_dim must be 64 .*got {rope_dim}$"):
                    call(op, ref.COMPRESS_ROPE_THETA, ref.DSV4_YARN)
            # the compressor's table refuses the pools the compressor does
            # (it built a table of the pool's rope_dim, which no op reads)
            with pytest.raises(ValueError, match=f"^pool: rope_dim must be 64 .*got {rope_dim}$"):
                kvc.rope_table(pool)
            assert _untouched(pool)
    assert len(compressor._TABLES) == tables


def test_the_reference_compressor_takes_rope_dim_64_only(rng):
    """reference.paged_compress_* called directly with a pool of another
    RoPE width are refused by the same rule as the public ops (they roped
    64 dims and stored the pool's width)."""
    for kind in ("csa", "hca"):
        m = M[kind]
        pool = ref.PagedPoolRef.create(4, 2, m, head_dim=D, rope_dim=32, max_requests=1,
                                       max_blocks_per_request=2)
        st = ref.DecodeStateRef.create(kind, 1, D)
        kv, z, ape, nw, _ = _inputs(rng, kind, 2 * m)
        with pytest.raises(ValueError, match="^pool: rope_dim must be 64 .*got 32$"):
            ref.paged_compress_prefill(pool, kind, 0, kv, z, ape, nw)
        with pytest.raises(ValueError, match="^pool: rope_dim must be 64 .*got 32$"):
            ref.paged_compress_decode(pool, st, nw, np.ones(1, bool), np.zeros(1, np.int32),
                                      np.full(1, m - 1, np.int32))
        assert not pool.written.any() and not pool.kv_rope.any()


def test_rope_dim_is_64(rng):
    _rope_dim_is_64(rng, "cpu")


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


def _decode_reads_apart_from_the_pool(rng, device):
    """compress_decode writes the pool's entries, written[] and counter: a
    row input in the pool's buffers (positions=pool.written, slots in
    pool.owners), or on the operators' path a counter that is a view of
    positions, is refused by name before anything is written, as the other
    writing ops refuse theirs (it was taken: the op read what it overwrote,
    and added its count into the caller's positions)."""
    torch = pytest.importorskip("torch")
    import rawkv.library  # noqa: F401
    from rawkv.kvcache import views as V
    kind, m = "csa", M["csa"]
    pool, case = _one_window_case(rng, kind, device)
    st, ist = case.states
    t = (lambda a: a) if device == "cpu" else _t
    kv, z, ape, nw, idx = _inputs(rng, kind, 2 * m)
    dix = kvc.DecodeIndex(ist, t(idx[3]))
    v, sl = t(np.ones(1, bool)), t(np.array([0], np.int32))
    written, owners = pool.written, pool.owners
    before = np.array(_arr(written)).copy()
    with pytest.raises(ValueError, match="^positions: overlaps pool.written in memory"):
        compress_decode(pool, st, t(nw), v, sl, written[:1], index=dix)
    with pytest.raises(ValueError, match="^slots: overlaps pool.owners in memory"):
        compress_decode(pool, st, t(nw), v, owners[:1], t(np.array([m - 1], np.int32)), index=dix)
    tt = (lambda a: torch.from_numpy(np.asarray(a))) if device == "cpu" else _t    # (the operators take tensors)
    positions = tt(np.array([m - 1], np.int32))
    with pytest.raises(ValueError, match="^positions: overlaps pool.errors in memory"):
        torch.ops.rawkv.kv_compress_decode(
            **V.pool_args(pool, errors=positions), **V.state_args(st, counter=False),
            **V.state_args(ist, prefix="index_", counter=False), norm_weight=tt(nw),
            valid_mask=tt(np.ones(1, bool)), slots=tt(np.array([0], np.int32)), positions=positions,
            index_norm_weight=tt(idx[3]), eps=1e-6, theta=1e4, yarn=None)
    assert int(positions[0]) == m - 1
    assert np.array_equal(np.array(_arr(written)), before) and _untouched(pool)


def test_decode_reads_apart_from_the_pool(rng):
    _decode_reads_apart_from_the_pool(rng, "cpu")


def test_decode_rows_past_the_launch_grid_refused_before_anything(monkeypatch):
    """rkv_kv_compress_decode runs one CTA per batch row on the grid's x
    dimension ((B, 2): at most 2^31 - 1 blocks), and the rules had no bound
    on B: 2^31 rows passed every check, ran the reference on CPU and planned
    a launch CUDA refuses. A ValueError naming valid_mask now, before the
    reference runs (the rule is the CUDA path's too: kvcache._rules). The
    2^31-row tensors are torch.empty's, never touched (address space, no
    memory)."""
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import decode
    pool = _pool("hca", "cpu", R=2)
    st = DecodeState("hca", 2, D, device="cpu")
    pool.attach(st)

    def not_run(*a, **k):
        raise AssertionError("the reference ran on rows past the launch grid")
    monkeypatch.setattr(decode.ref, "paged_compress_decode", not_run)
    rows = 2 ** 31
    with pytest.raises(ValueError, match=rf"^valid_mask: {rows} "):
        compress_decode(pool, st, torch.ones(D), torch.empty(rows, dtype=torch.bool),
                        torch.empty(rows, dtype=torch.int32), torch.empty(rows, dtype=torch.int32))


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
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


def test_gpu_rope_dim_is_64(cuda, rng):
    _rope_dim_is_64(rng, "cuda")


def test_gpu_decode_reads_apart_from_the_pool(cuda, rng):
    _decode_reads_apart_from_the_pool(rng, "cuda")
