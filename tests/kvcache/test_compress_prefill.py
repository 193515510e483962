"""compress_prefill: a prompt's KV rows compressed into the pool (rawkv/kvcache/prefill.py,
rawkv/cu/kv_compress.cu). CPU pools run the reference composition
(compress_* -> finish_entry / finish_index_key -> flush_write), so the CPU
tests pin the API and the composition itself; GPU tests (fixture `cuda`)
compare the kernel with it, within the tolerance of
tests/support/kvcache_compress.py. The eps / RoPE rules of both compress ops:
tests/kvcache/test_compress_arguments.py."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.kvcache import DecodeState, compress_decode, compress_prefill, reference_prefill  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from support.kvcache import DI, _random_rows  # noqa: E402
from support.kvcache_compress import M, assert_entries_close, _entries, _inputs, _pool, _sl, _t  # noqa: E402
from support.kvcache_properties import (  # noqa: E402
    BAD_SLOTS, GOOD_EPS, GOOD_THETAS, GOOD_YARNS, POOL_FIELDS, ROPE_NAMES, faults, good_slots, kv_kinds,
    pick, picks, pool_layouts, _rope_args, row_dtypes, _rows, same_fields, _scene,
)
from support.properties import SETTINGS, host, judge, layouts, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def test_compress_prefill_into_the_pool(rng):
    m, T = 4, 5 * 4 + 2
    kv, z = _random_rows(rng, T, 1024), _random_rows(rng, T, 1024)
    nw = np.ones(512, np.float32)
    pool = ref.PagedPoolRef.create(8, 2, m, max_requests=2, max_blocks_per_request=2)
    pool.block_table[1] = [3, 6]                   # 4 entries; entry 4 is past the table
    n, err = ref.paged_compress_prefill(pool, "csa", 1, kv, z, None, nw)
    assert (n, err) == (5, 1)
    np.testing.assert_array_equal(pool.written, [0, 4])
    ids, ent, _ = ref.reference_prefill("csa", kv, z, None, nw)
    codes, _, _ = ref.fp8_entry_quantize(ent)
    assert np.array_equal(pool.kv_fp8[6, 1], codes[3]) and np.array_equal(ids, np.arange(5))


def _ref_pool(kind, kv, z, ape, nw, idx, epb=4, nb=64, mb=16):
    """Reference composition written into a PagedPoolRef with identity blocks."""
    ids, ent, keys = reference_prefill(kind, kv, z, ape, nw, index=idx)
    p = ref.PagedPoolRef.create(nb, epb, M[kind], index_head_dim=DI if kind == "csa" else None)
    table = np.arange(mb)[None].repeat(len(ids), 0)
    assert ref.flush_write(p, ent, np.ones(len(ids), bool), ids * M[kind], table, keys) == 0
    return p, len(ids)


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


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_cpu_missing_blocks_are_counted(rng, kind):
    m = M[kind]
    kv, z, ape, nw, idx = _inputs(rng, kind, 3 * m)
    pool = _pool(kind, "cpu", mb=1, epb=2)
    s = pool.add_request()
    pool.prepare_step([s], [m])                         # one block: entries 0, 1
    compress_prefill(pool, kv, z, ape, nw, s, index=idx)
    assert pool.read_errors() == 1                      # entry 2: past the block table


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
# argument errors
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
    for bad in (-1, 2 ** 31, 2 ** 57):           # (2^57 * m wrapped int64 in the reference: it overwrote entry 0)
        with pytest.raises(ValueError, match="^start_entry"):
            compress_prefill(pool, kv, z, ape, nw, s, start_entry=bad, index=idx)
    assert pool.read_errors() == 0
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


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
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
