"""opcheck samples and a compiled step of the ecosystem-layout operators
(rawkv.kvcache.layouts: FlashMLA MODEL1, DeepGEMM indexer keys, the top-k
bridge; tests/guards/test_library*.py collect them).

The caches are plain (num_pages, page_bytes) uint8 tensors: opcheck clones
the written arguments, and a clone of a strided engine view (flashmla_view)
loses the page stride. The slots and indices include padding (-1) and out
of range values, so the error counters are written too. The compiled step
clears its caches and counters first, so every call (eager or compiled)
starts from the same state and everything it wrote can be compared bit
for bit.
"""
import numpy as np
import torch

import rawkv.kvcache as kvc
from rawkv import _opdecl
from rawkv.reference.kvcache import layouts as R

P = 4          # records per page: small pages, so a few rows span several


def _args(name, **kw):
    """The operator's arguments in schema order (opcheck calls it positionally)."""
    return tuple(kw[n] for n, _, _ in _opdecl.declared()["kv_" + name].args)


class _Data:
    """Random inputs on one device."""

    def __init__(self, rng, device):
        self.rng, self.device = rng, device

    def t(self, a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def rows(self, n, width, dtype=torch.float32):
        # tiles of very different magnitudes: every scale exponent moves
        x = self.rng.standard_normal((n, width)) * np.exp2(self.rng.integers(-20, 20, (n, 1)))
        return self.t(x.astype(np.float32)).to(dtype)

    def ints(self, values, dtype=torch.int32):
        return self.t(np.asarray(values, np.int32)).to(dtype)

    def cache(self, layout, num_pages):
        return kvc.new_layout_cache(layout, num_pages, P, device=self.device)

    def errors(self):
        return torch.zeros(1, dtype=torch.int32, device=self.device)


def samples(rng, device="cpu"):
    d = _Data(rng, device)
    m1 = d.cache("model1", 3)
    # a written cache for the gather: finite entries in every record of pages 0-1
    kvc.model1_store(m1, d.rows(2 * P, R.ENTRY_DIM), d.ints(range(2 * P)), page_size=P)
    out = {
        "model1_store": [
            _args("model1_store", cache=d.cache("model1", 3), entries=d.rows(4, R.ENTRY_DIM),
                  slots=d.ints([0, 5, -1, 12]), page_size=P, offsets=None, errors=d.errors()),
            _args("model1_store", cache=d.cache("model1", 2), entries=d.rows(3, R.ENTRY_DIM, torch.bfloat16),
                  slots=d.ints([1, 0, 7], torch.int64), page_size=P, offsets=d.ints([3, 2, 0]), errors=None),
            _args("model1_store", cache=d.cache("model1", 2), entries=d.rows(0, R.ENTRY_DIM), slots=d.ints([]),
                  page_size=P, offsets=d.ints([]), errors=d.errors())],                  # no rows
        "model1_window_insert": [
            _args("model1_window_insert", cache=d.cache("model1", 2), rows=d.rows(3, R.ENTRY_DIM, torch.bfloat16),
                  slot_mapping=d.ints([6, -1, 8]), page_size=P, errors=d.errors()),
            # float32 rows, int64 slots (vLLM's slot_mapping), the device's counter; no rows
            _args("model1_window_insert", cache=d.cache("model1", 3), rows=d.rows(2, R.ENTRY_DIM),
                  slot_mapping=d.ints([9, 2], torch.int64), page_size=P, errors=None),
            _args("model1_window_insert", cache=d.cache("model1", 1), rows=d.rows(0, R.ENTRY_DIM),
                  slot_mapping=d.ints([], torch.int64), page_size=P, errors=None)],
        "index_fp8_store": [
            _args("index_fp8_store", cache=d.cache("index_fp8", 2), keys=d.rows(4, R.INDEX_DIM),
                  slots=d.ints([7, 0, -1, 9]), page_size=P, offsets=None, errors=d.errors()),
            _args("index_fp8_store", cache=d.cache("index_fp8", 2), keys=d.rows(2, R.INDEX_DIM, torch.bfloat16),
                  slots=d.ints([1, 0], torch.int64), page_size=P, offsets=d.ints([2, 3]), errors=None),
            _args("index_fp8_store", cache=d.cache("index_fp8", 1), keys=d.rows(0, R.INDEX_DIM), slots=d.ints([]),
                  page_size=P, offsets=None, errors=None)],
        "index_mxfp4_store": [
            _args("index_mxfp4_store", cache=d.cache("index_mxfp4", 2), keys=d.rows(3, R.INDEX_DIM),
                  slots=d.ints([3, 4, 20]), page_size=P, offsets=None, errors=d.errors()),
            _args("index_mxfp4_store", cache=d.cache("index_mxfp4", 2),
                  keys=d.rows(2, R.INDEX_DIM, torch.bfloat16), slots=d.ints([1, -1]), page_size=P,
                  offsets=d.ints([1, 0]), errors=None),
            _args("index_mxfp4_store", cache=d.cache("index_mxfp4", 3), keys=d.rows(2, R.INDEX_DIM),
                  slots=d.ints([11, 4], torch.int64), page_size=P, offsets=None, errors=None)],
        "index_mxfp8_store": [
            _args("index_mxfp8_store", cache=d.cache("index_mxfp8", 2), keys=d.rows(3, R.INDEX_DIM),
                  slots=d.ints([6, -1, 11]), page_size=P, offsets=None, errors=d.errors()),
            _args("index_mxfp8_store", cache=d.cache("index_mxfp8", 3),
                  keys=d.rows(2, R.INDEX_DIM, torch.bfloat16), slots=d.ints([2, 0], torch.int64), page_size=P,
                  offsets=d.ints([3, 1]), errors=None)],
        "model1_gather": [
            _args("model1_gather", cache=m1, indices=d.ints([[0, 5, -1], [7, 3, 40]]), page_size=P,
                  out=torch.empty((2, 3, R.ENTRY_DIM), dtype=torch.bfloat16, device=device), errors=d.errors()),
            _args("model1_gather", cache=m1, indices=d.ints([6, 1]), page_size=P,
                  out=torch.empty((2, R.ENTRY_DIM), dtype=torch.float32, device=device), errors=None),
            # indices of three dimensions into a float16 out; no indices
            _args("model1_gather", cache=m1, indices=d.ints([[[2], [-1]], [[12], [4]]]), page_size=P,
                  out=torch.empty((2, 2, 1, R.ENTRY_DIM), dtype=torch.float16, device=device), errors=d.errors()),
            _args("model1_gather", cache=m1, indices=d.ints(np.zeros((0, 3))), page_size=P,
                  out=torch.empty((0, 3, R.ENTRY_DIM), dtype=torch.bfloat16, device=device), errors=d.errors())],
        "topk_to_kvcache_indices": [
            _args("topk_to_kvcache_indices", topk_ids=d.ints([[0, 5, -1, 9], [3, 12, 2, 1]]),
                  block_table=d.ints([[4, 1, 7], [2, 0, 9]]), page_size=P, num_pages=8, slots=None,
                  n_entries=d.ints([10, 3]), out=torch.empty((2, 4), dtype=torch.int32, device=device),
                  errors=d.errors()),
            _args("topk_to_kvcache_indices", topk_ids=d.ints([[[1, -1], [6, 2]]], torch.int64),
                  block_table=d.ints([[0, 0], [5, 3]]), page_size=P, num_pages=6, slots=d.ints([1]),
                  n_entries=None, out=torch.empty((1, 2, 2), dtype=torch.int32, device=device), errors=None),
            _args("topk_to_kvcache_indices", topk_ids=d.ints(np.zeros((0, 4))), block_table=d.ints([[4, 1, 7]]),
                  page_size=P, num_pages=8, slots=d.ints([]), n_entries=d.ints([]),
                  out=torch.empty((0, 4), dtype=torch.int32, device=device), errors=d.errors())],    # no rows
    }
    return {"kv_" + k: v for k, v in out.items()}


def _sparse_step(rng, device):
    """A DeepSeek-V4 sparse-attention step on the ecosystem layouts: the
    compressed entries and the window tokens into MODEL1 pages, the indexer
    keys into the three DeepGEMM layouts, the top-k bridge and the MODEL1 gather
    at its indices (what an engine without FlashMLA reads)."""
    d = _Data(rng, device)
    caches = [d.cache("model1", 4), d.cache("model1", 2), d.cache("index_fp8", 4), d.cache("index_mxfp4", 4),
              d.cache("index_mxfp8", 4)]
    errors = [d.errors() for _ in range(3)]
    ents, win, keys = d.rows(6, R.ENTRY_DIM, torch.bfloat16), d.rows(3, R.ENTRY_DIM), d.rows(6, R.INDEX_DIM)
    pages, offs = d.ints([3, 1, 3, 0, -1, 2]), d.ints([0, 2, 1, 3, 0, 9])       # offset 9: an error
    slot_mapping = d.ints([5, 0, -1], torch.int64)
    topk = d.ints([[0, 6, -1, 2], [5, 1, 4, 7]])
    table, n_entries = d.ints([[3, 1], [0, 2]]), d.ints([8, 6])
    window_ids = d.ints([5, 0, 1])
    if device != "cpu":
        # the step writes them in place: static inputs, which CUDA graphs may write
        for t in (*caches, *errors):
            torch._dynamo.mark_static_address(t)

    def step():
        for t in (*caches, *errors):
            t.zero_()
        m1, mw, kf, k4, k8 = caches
        kvc.model1_store(m1, ents, pages, page_size=P, offsets=offs, errors=errors[0])
        kvc.model1_window_insert(mw, win, slot_mapping, page_size=P, errors=errors[0])
        kvc.index_fp8_store(kf, keys, pages, page_size=P, offsets=offs)
        kvc.index_mxfp4_store(k4, keys, pages, page_size=P, offsets=offs, errors=errors[1])
        kvc.index_mxfp8_store(k8, keys, pages, page_size=P, offsets=offs, errors=errors[1])
        idx = kvc.topk_to_kvcache_indices(topk, table, page_size=P, num_pages=4, n_entries=n_entries,
                                          errors=errors[2])
        rows = kvc.model1_gather(m1, idx, page_size=P, errors=errors[2])
        window = kvc.model1_gather(mw, window_ids, page_size=P, dtype="float32")
        return (idx, rows, window, *(t.clone() for t in (*caches, *errors)))
    return step, ()


# (name, make(rng, device) -> (step function, its arguments)): compiled with
# fullgraph=True, the step must give the same bits as eager
STEPS = [("kv_layouts_sparse_step", _sparse_step)]
