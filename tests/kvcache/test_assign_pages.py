"""assign_pages: blocks handed to requests by the engine (rawkv/kvcache/assign.py;
docs/kvcache.md, "Page ownership"): the rules, the output rules, the op
against the reference on CPU and on a CUDA pool."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
import rawkv.library  # noqa: E402,F401
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from support.kvcache import _small_hca_pool  # noqa: E402
from support.kvcache_ownership import _assert_same, _state, _t  # noqa: E402
from support.kvcache_properties import (  # noqa: E402
    BAD_ERRORS, POOL_FIELDS, counted, _errors, errors_ok, faults, kv_kinds, pick, picks, pool_layouts,
    same_fields, _scene, slot_array,
)
from support.outputs import _refused  # noqa: E402
from support.properties import SETTINGS, host, judge, libs, make, same, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def _assign_case(device):
    """A pool whose slots 0, 1 hold requests (slot 2 none), every mark set;
    one assign_pages batch with padding, bad rows and duplicates."""
    pool = kc.PagedKVPool("hca", 6, 3, 3, 2, layout="rawkv", device=device)
    pool.add_request(), pool.add_request()
    pool.marks[...] = 1
    slots = np.array([0, 1, 0, 2, 5, -1, 1, 0, 1], np.int32)
    blocks = np.array([4, -1, 6, 1, 2, 3, 4, 5, 5], np.int32)
    kc.assign_pages(pool, _t(slots, device), _t(blocks, device))
    return pool


def test_cpu_assign_pages_rules():
    pool = _assign_case("cpu")
    # row 0: block 4 -> slot 0; row 1: padding; row 2: block 6 out of range; row 3: slot 2 holds no
    # request; rows 4, 5: slots out of range; row 6: block 4 again (row 0 wins); row 7: block 5 -> slot 0;
    # row 8: block 5 again
    assert pool.read_errors() == 6
    ids = pool.request_ids
    np.testing.assert_array_equal(pool.owners, [0, 0, 0, 0, ids[0], ids[0]])
    np.testing.assert_array_equal(pool.marks[:, 0], [1, 1, 1, 1, 0, 0])
    assert not pool.marks[4:].any() and pool.marks[:4].all()
    with pytest.raises(ValueError, match="^blocks: "):
        kc.assign_pages(pool, np.zeros(2, np.int32), np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="^slots: "):
        kc.assign_pages(pool, np.zeros(2, np.int64), np.zeros(2, np.int32))


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
def test_assign_pages_refuses_errors_over_its_inputs():
    """assign_pages checked errors= for writability only: a counter in
    slots' or blocks' memory was accepted (its kernel reads them while
    adding to errors)."""
    p, s = _small_hca_pool()
    blk = p.blocks_of(s)[0]
    slots_blocks = np.array([s, blk], np.int32)
    before = p.to_reference()
    _refused("errors", "slots", lambda: kc.assign_pages(p, slots_blocks[:1], slots_blocks[1:],
                                                        errors=slots_blocks[:1]))
    _refused("errors", "blocks", lambda: kc.assign_pages(p, slots_blocks[:1], slots_blocks[1:],
                                                         errors=slots_blocks[1:]))
    assert np.array_equal(p.owners, before.owners) and np.array_equal(p.marks, before.marks)
    assert list(slots_blocks) == [s, blk]


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
def test_gpu_assign_pages_matches_the_reference(cuda):
    for run in range(5):                                 # the duplicate rule does not depend on CTA order
        _assert_same(_state(_assign_case("cpu")), _state(_assign_case("cuda")), f"run {run}")
        p = _assign_case("cuda")
        assert p.read_errors() == 6
