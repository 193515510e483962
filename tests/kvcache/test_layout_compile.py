"""A layout op on a view of a cache under torch.compile takes and refuses
what the eager op does, and writes the same bytes (rawkv/kvcache/_rules.py,
cache; docs/kvcache.md, "Ecosystem layouts").

Compiled, a written cache that is a graph input reaches the op as a copy of
the bytes it shows (functionalization's clone_preserve_strides), copied back
after the op. flashmla_view(cache, P) shows no padding, so its copy ended
at the last page's records, and the rule that a cache's memory holds its
whole last page (until helper 81) refused it ('... (the page stride); got
shape (3, 4, 1, 584) strides (2880, 584, 584, 1) over 8096 bytes') where
the eager op took the same view. A slice of each page was taken eagerly and
written past the bytes it shows, which a compiled op cannot copy back:
refused by both now."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv.library  # noqa: E402,F401
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402

P, PAGES = 4, 3
STORES = {"model1": (kc.model1_store, R.ENTRY_DIM), "index_fp8": (kc.index_fp8_store, R.INDEX_DIM),
          "index_mxfp4": (kc.index_mxfp4_store, R.INDEX_DIM), "index_mxfp8": (kc.index_mxfp8_store, R.INDEX_DIM)}


def _views(layout):
    """(name, cache -> the cache an engine passes): taken or refused alike."""
    lay = R.LAYOUTS[layout]
    rec = P * (lay.data_bytes + lay.scale_bytes)
    engine = (lambda c: kc.flashmla_view(c, P)) if layout == "model1" else \
        (lambda c: kc.deepgemm_view(c, P, layout))
    return [("pages", lambda c: c), ("engine view", engine), ("records", lambda c: c[:, :rec]),
            ("first pages", lambda c: c[:2]), ("a slice of each page", lambda c: c[:, :16]),
            ("a view of all but a record", lambda c: engine(c)[:, :P - 1])]


def _run(call):
    """(error text or None). A refusal found while dynamo traces comes
    wrapped (torch's TorchRuntimeError, rawkv.kvcache.traced): the eager
    error it carries is the one compared."""
    try:
        call()
    except Exception as e:
        inner = e
        while not isinstance(inner, (TypeError, ValueError)) and (inner.__cause__ or inner.__context__):
            inner = inner.__cause__ or inner.__context__
        if not isinstance(inner, (TypeError, ValueError)):
            raise
        return f"{type(inner).__name__}: {inner}"
    return None


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("layout", sorted(STORES))
def test_compiled_store_into_a_view_takes_what_eager_takes(rng, backend, layout):
    store, width = STORES[layout]
    rows = torch.from_numpy(rng.standard_normal((5, width)).astype(np.float32))
    slots = torch.from_numpy(rng.permutation(PAGES * P)[:5].astype(np.int32))
    errors = torch.zeros(1, dtype=torch.int32)

    def step(cache, rows, slots, errors):
        store(cache, rows, slots, page_size=P, errors=errors)

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    try:
        for name, view in _views(layout):
            want, got = (kc.new_layout_cache(layout, PAGES, P, device="cpu") for _ in range(2))
            we, ge = torch.zeros_like(errors), torch.zeros_like(errors)
            eager = _run(lambda: step(view(want), rows, slots, we))
            traced = _run(lambda: compiled(view(got), rows, slots, ge))
            assert traced == eager, (name, eager, traced)
            assert torch.equal(got, want) and torch.equal(ge, we), name
            assert (eager is None) == (name not in ("a slice of each page", "a view of all but a record")), \
                (name, eager)
            if eager is None:
                assert want.any(), name
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_gather_from_a_view_takes_what_eager_takes(rng, backend):
    cache = kc.new_layout_cache("model1", PAGES, P, device="cpu")
    kc.model1_store(cache, torch.from_numpy(rng.standard_normal((PAGES * P, R.ENTRY_DIM)).astype(np.float32)),
                    torch.arange(PAGES * P, dtype=torch.int32), page_size=P)
    idx = torch.from_numpy(rng.integers(-1, PAGES * P, 7).astype(np.int32))

    def step(cache, idx, out):
        kc.model1_gather(cache, idx, page_size=P, out=out)

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    try:
        for name, view in _views("model1"):
            want, got = torch.zeros(7, R.ENTRY_DIM), torch.zeros(7, R.ENTRY_DIM)
            eager = _run(lambda: step(view(cache), idx, want))
            assert _run(lambda: compiled(view(cache), idx, got)) == eager, name
            assert torch.equal(got, want), name
    finally:
        torch._dynamo.reset()
