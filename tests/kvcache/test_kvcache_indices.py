"""kvcache_indices: a pool's top-k entry ids to FlashMLA's KV-cache indices
(rawkv/kvcache/bridge.py): the output rules, the argument names, the op
against the reference. Its plan: tests/kvcache/test_plans.py; on a model1
pool: tests/kvcache/test_pool_layouts.py."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from support.kvcache_properties import (  # noqa: E402
    BAD_ERRORS, batches, counted, _errors, errors_ok, faults, kv_kinds, _owned_view, pick, picks,
    pool_layouts, _scene, slot_array,
)
from support.properties import SETTINGS, host, judge, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_kvcache_indices_arguments_name_themselves(layout):
    p = kc.PagedKVPool("csa", 4, 2, 2, 2, layout=layout, device="cpu")
    sl, ids = np.zeros(2, np.int32), np.zeros((2, 3), np.int32)
    for kw, exc, name in (({"topk_ids": ids.astype(np.float32)}, TypeError, "topk_ids"),
                          ({"slots": np.zeros(3, np.int32)}, ValueError, "slots"),
                          ({"n_entries": np.zeros(2, np.int64)}, TypeError, "n_entries"),
                          ({"out": np.zeros((2, 2), np.int32)}, ValueError, "out"),
                          ({"errors": np.zeros(0, np.int32)}, ValueError, "errors")):
        args = {"slots": sl, "topk_ids": ids, **kw}
        with pytest.raises(exc, match=f"^{name}: "):
            kc.kvcache_indices(p, args.pop("slots"), args.pop("topk_ids"), **args)
    with pytest.raises(TypeError, match="^pool: "):
        kc.kvcache_indices(object(), sl, ids)
    out = np.full((2, 3), 7, np.int32)
    assert kc.kvcache_indices(p, sl, ids, out=out) is out and (out == -1).all()   # nothing written yet
    assert p.read_errors() == 6


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
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
