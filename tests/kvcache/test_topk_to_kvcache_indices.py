"""topk_to_kvcache_indices: top-k token ids and a block table to FlashMLA's KV-cache
indices (rawkv/kvcache/layouts.py, rawkv/cu/kv_layouts.cu): the reference
against FlashMLA's abs_indices2indices_in_kvcache with every bad id counted,
the op on CPU arrays and tensors, the kernel against the reference."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.kvcache_layouts import flashmla_abs_indices, tt  # noqa: E402
from support.properties import SETTINGS, host, judge, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def test_bridge_matches_flashmla_and_counts_errors(rng):
    """Source: FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb abs_indices2indices_in_kvcache, on
    valid ids (and -1); then every kind of bad id is -1 and counted."""
    P, B, S, Kk, mb, npg = 8, 4, 3, 10, 6, 40
    table = rng.permutation(npg)[:B * mb].reshape(B, mb).astype(np.int32)
    ids = rng.integers(0, mb * P, (B, S, Kk))
    ids[rng.random(ids.shape) < 0.2] = -1
    got, err = R.topk_to_kvcache_indices(ids, table, P, npg)
    assert err == 0 and got.dtype == np.int32
    want = flashmla_abs_indices(tt(ids), tt(table.astype(np.int64)), P).numpy()
    assert np.array_equal(got, want)
    got2, _ = R.topk_to_kvcache_indices(ids[:, 0], table, P, npg)
    assert np.array_equal(got2, got[:, 0])
    # slots: request b reads table row slots[b]
    sl = np.array([3, 3, 0, 1])
    got3, _ = R.topk_to_kvcache_indices(ids[:, 0], table, P, npg, slots=sl)
    assert np.array_equal(got3, R.topk_to_kvcache_indices(ids[:, 0], table[sl], P, npg)[0])
    row3 = flashmla_abs_indices(tt(ids[1:2, 0]), tt(table[3:4].astype(np.int64)), P)[0].numpy()
    assert np.array_equal(got3[1], row3)
    # errors
    bad = np.array([[-2, mb * P, 5, 9, 0, -1, 2 ** 40]])
    tb = np.full((1, mb), 3, np.int32)
    tb[0, 1] = -1                    # id 9 (P = 8): logical block 1 has no page
    tb[0, 0] = npg                   # ids 5, 0: page out of range
    r, e = R.topk_to_kvcache_indices(bad, tb, P, npg)
    assert list(r[0]) == [-1] * 7 and e == 6
    tb[0, 0] = 7
    r, e = R.topk_to_kvcache_indices(bad, tb, P, npg, n_entries=[4])
    assert list(r[0]) == [-1, -1, -1, -1, 56, -1, -1] and e == 5
    r, e = R.topk_to_kvcache_indices(bad, tb, P, npg, slots=[1])      # row out of range
    assert (r == -1).all() and e == 6
    with pytest.raises(ValueError, match="^num_pages:"):
        R.topk_to_kvcache_indices(bad, tb, 2 ** 16, 2 ** 15)


def test_cpu_bridge_op(rng):
    table = rng.permutation(50)[:12].reshape(3, 4).astype(np.int32)
    ids = rng.integers(-1, 16, (3, 7)).astype(np.int32)
    out = np.full((3, 7), 77, np.int32)
    err = torch.zeros(1, dtype=torch.int32)
    res = kc.topk_to_kvcache_indices(ids, table, page_size=4, num_pages=50, out=out, errors=err)
    assert res is out and np.array_equal(out, R.topk_to_kvcache_indices(ids, table, 4, 50)[0])
    assert int(err[0]) == 0
    ne = np.array([3, 0, 16], np.int32)
    t = kc.topk_to_kvcache_indices(tt(ids).long(), tt(table), page_size=4, num_pages=50,
                                   n_entries=tt(ne), errors=err)
    want, nerr = R.topk_to_kvcache_indices(ids, table, 4, 50, n_entries=ne)
    assert t.dtype == torch.int32 and np.array_equal(t.numpy(), want)
    assert int(err[0]) == nerr == int((ids[0] >= 3).sum() + (ids[1] >= 0).sum())


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, b=st.integers(0, 3), k=st.integers(0, 4), three=st.booleans(), r=st.integers(1, 4),
       mb=st.integers(1, 3), page_size=st.sampled_from([1, 4, 0]), num_pages=st.integers(0, 5),
       idt=st.sampled_from(("int32", "int64", "float32")), use_slots=st.booleans(), use_n=st.booleans(),
       lib=libs)
def test_kvcache_topk_to_kvcache_indices(seed, b, k, three, r, mb, page_size, num_pages, idt, use_slots,
                                         use_n, lib):
    ids = make(seed, (b, 2, k) if three else (b, k), idt, lib, lo=-2, hi=mb * max(page_size, 1) + 2)
    table = make(seed + 1, (r, mb), "int32", lib, lo=-1, hi=num_pages + 1)
    slots = make(seed + 2, (b,), "int32", lib, lo=-1, hi=r + 1) if use_slots else None
    ne = make(seed + 3, (b,), "int32", lib, lo=0, hi=mb * max(page_size, 1) + 1) if use_n else None
    judge(lambda: kc.topk_to_kvcache_indices(ids, table, page_size=page_size, num_pages=num_pages, slots=slots,
                                             n_entries=ne),
          ("topk_ids", "block_table", "page_size", "num_pages", "slots", "n_entries"),
          lambda: R.topk_to_kvcache_indices(host(ids), host(table), page_size, num_pages,
                                            None if slots is None else host(slots),
                                            None if ne is None else host(ne))[0])


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_gpu_bridge_bit_exact(cuda, rng, id_dtype):
    P, B, S, Kk, mb, npg = 64, 5, 2, 300, 9, 40
    table = rng.integers(-2, npg + 2, (B + 2, mb)).astype(np.int32)
    ids = rng.integers(-3, mb * P + 5, (B, S, Kk)).astype(np.int64)
    ids[rng.random(ids.shape) < 0.1] = -1
    if id_dtype == "int64":
        ids[0, 0, :2] = [2 ** 40, -(2 ** 40)]
    ne = rng.integers(0, mb * P, B).astype(np.int32)
    sl = np.array([6, 0, -1, 3, B + 2], np.int32)
    for slots, n_entries, shape in ((None, None, ids.shape), (sl, ne, ids.shape), (sl, None, (B, S * Kk))):
        x = ids.reshape(shape)
        want, nerr = R.topk_to_kvcache_indices(x, table, P, npg, slots, n_entries)
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        got = kc.topk_to_kvcache_indices(
            tt(x.astype(id_dtype)).cuda(), tt(table).cuda(), page_size=P, num_pages=npg,
            slots=None if slots is None else tt(slots).cuda(),
            n_entries=None if n_entries is None else tt(n_entries).cuda(), errors=err)
        assert got.dtype == torch.int32 and tuple(got.shape) == shape
        np.testing.assert_array_equal(got.cpu().numpy(), want)
        assert int(err.item()) == nerr and nerr > 0


def _bare_bridge_on_a_pools_table(device):
    """topk_to_kvcache_indices checks neither the blocks' owners nor the
    entries' written marks (docs/kvcache.md, "The bridge"): on a pool's
    block table it could give a request rows of a block another request
    owns (a stale cell an engine left) or entries never written, with no
    error. A pool's table (or a view of it) is refused naming block_table,
    before anything is written; kvcache_indices(pool, ...) is the bridge on
    a pool. An engine's own table is its business."""
    pool = kc.PagedKVPool("hca", 4, 2, 2, 2, layout="rawkv", device=device)
    a, b = pool.add_request(), pool.add_request()
    pool.prepare_step([a, b], [300, 10])                # a: blocks 0, 1; b: block 2
    ids = torch.zeros(2, 1, dtype=torch.int32, device=device)
    out = torch.full((2, 1), 7, dtype=torch.int32, device=device)
    for table in (pool.block_table, pool.block_table[:, :1]):
        with pytest.raises(ValueError, match="^block_table: lies in the block_table buffer of a PagedKVPool; "):
            kc.topk_to_kvcache_indices(ids, table, page_size=2, num_pages=4, slots=torch.tensor(
                [a, b], dtype=torch.int32, device=device), out=out)
        assert bool((out == 7).all())
    t = pool.block_table
    own = t.copy() if isinstance(t, np.ndarray) else t.clone()     # an engine's own copy: its business
    kc.topk_to_kvcache_indices(ids, own, page_size=2, num_pages=4, out=out)


def test_the_bare_bridge_refuses_a_pools_table():
    _bare_bridge_on_a_pools_table("cpu")


def test_gpu_the_bare_bridge_refuses_a_pools_table(cuda):
    _bare_bridge_on_a_pools_table("cuda")
