"""Property-based tests (hypothesis, tests/support/properties.py) of the KV-cache
layout ops on CPU: the ecosystem layouts' stores, the model1 gather, top-k to
KV-cache indices, the pool's flush and gather."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as RK  # noqa: E402
from support.properties import SETTINGS, host, judge, libs, make, same, seeds, shapes  # noqa: E402


STORES = {"model1": (kc.model1_store, RK.model1_write, RK.MODEL1, 512, "entries"),
          "window": (kc.model1_window_insert, RK.model1_write, RK.MODEL1, 512, "rows"),
          "index_fp8": (kc.index_fp8_store, RK.index_fp8_write, RK.INDEX_FP8, 128, "keys"),
          "index_mxfp4": (kc.index_mxfp4_store, RK.index_mxfp4_write, RK.INDEX_MXFP4, 128, "keys")}


@settings(SETTINGS, max_examples=60)
@given(seed=seeds, op=st.sampled_from(sorted(STORES)), pages=st.integers(1, 3), page_size=st.sampled_from([1, 2, 4, 0]),
       rows=st.integers(0, 5), width_delta=st.sampled_from([0, 0, 0, -16]),
       xdt=st.sampled_from(("float32", "bfloat16", "float16")), sdt=st.sampled_from(("int32", "int64", "float32")),
       offsets=st.booleans(), errors=st.booleans(), lib=libs, special=st.booleans())
def test_kvcache_layout_stores(seed, op, pages, page_size, rows, width_delta, xdt, sdt, offsets, errors, lib,
                               special):
    fn, write, lay, width, name = STORES[op]
    ps = max(page_size, 1)
    cache = np.zeros((pages, lay.page_bytes(ps)), np.uint8)
    x = make(seed, (rows, width + width_delta), xdt, lib, special=special)
    hi = pages * ps + 2 if not offsets else pages + 1
    slots = make(seed + 1, (rows,), sdt, lib, lo=-2, hi=hi)
    offs = make(seed + 2, (rows,), "int32", lib, lo=-1, hi=ps + 1) if offsets and op != "window" else None
    err = np.zeros(1, np.int32) if errors else None
    kw = {"offsets": offs} if op != "window" else {}
    want = cache.copy()

    def reference():
        bad = write(want, ps, host(x), host(slots), None if offs is None else host(offs))
        if err is not None:
            assert err[0] == bad
        return want
    if judge(lambda: fn(cache, x, slots, page_size=page_size, errors=err, **kw),
             ("cache", name, "slots", "slot_mapping", "page_size", "offsets", "errors"), lambda: None) is None:
        return
    same(cache, reference())


@SETTINGS
@given(seed=seeds, pages=st.integers(1, 3), page_size=st.sampled_from([1, 2, 4]), idx_shape=shapes,
       idt=st.sampled_from(("int32", "int64")), dtype=st.sampled_from([None, "float32", "float16", "int8"]),
       lib=libs)
def test_kvcache_model1_gather(seed, pages, page_size, idx_shape, idt, dtype, lib):
    cache = make(seed, (pages, RK.MODEL1.page_bytes(page_size)), "uint8")
    idx = make(seed + 1, idx_shape, idt, lib, lo=-2, hi=pages * page_size + 2)

    def reference():
        rows, _ = RK.model1_gather(cache, page_size, host(idx), dtype or "bfloat16")
        return rows
    judge(lambda: kc.model1_gather(cache, idx, page_size=page_size, dtype=dtype),
          ("cache", "indices", "page_size", "dtype"), reference)


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
          lambda: RK.topk_to_kvcache_indices(host(ids), host(table), page_size, num_pages,
                                             None if slots is None else host(slots),
                                             None if ne is None else host(ne))[0])


@settings(SETTINGS, max_examples=40)
@given(seed=seeds, kind=st.sampled_from(["csa", "hca"]), b=st.integers(0, 4), edt=st.sampled_from(("bfloat16", "float32", "float16")),
       sdt=st.sampled_from(("int32", "int64")), k=st.integers(0, 3), gdt=st.sampled_from([None, "float32", "float16"]),
       special=st.booleans(), layout=st.sampled_from(["rawkv", "model1"]))
def test_kvcache_pool_flush_and_gather(seed, kind, b, edt, sdt, k, gdt, special, layout):
    """flush_write then gather_topk on a CPU pool, against the reference on a copy of the pool."""
    p = kc.PagedKVPool(kind, 6, 2, 3, 4, layout=layout, device="cpu")
    slots_taken = [p.add_request() for _ in range(2)]
    p.prepare_step(slots_taken, [p.m * 3, p.m * 2])
    rng = np.random.default_rng(seed)
    ents = make(seed, (b, p.head_dim), edt, "torch", special=special)
    keys = make(seed + 1, (b, p.index_head_dim), "bfloat16", "torch") if p.has_index else None
    valid = make(seed + 2, (b,), "bool", "torch")
    slots = make(seed + 3, (b,), sdt, "torch", lo=-1, hi=4)
    pos = torch.from_numpy(rng.integers(0, p.m * 4, size=b).astype(np.int32))
    judge(lambda: kc.flush_write(p, ents, valid, slots, pos, index_keys=keys),
          ("pool", "entries", "valid_mask", "slots", "positions", "index_keys"), lambda: None)
    want = p.to_reference()
    ids = make(seed + 4, (2, k), "int32", "torch", lo=-2, hi=8)
    gslots = torch.tensor(slots_taken, dtype=torch.int32)

    def reference():
        from rawkv.reference import kvcache as RKV
        rows, _ = RKV.paged_gather_topk(want, gslots.numpy(), ids.numpy(), None, None, dtype=gdt or "bfloat16")
        return rows
    judge(lambda: kc.gather_topk(p, gslots, ids, dtype=gdt), ("pool", "slots", "topk_ids", "dtype"), reference)
