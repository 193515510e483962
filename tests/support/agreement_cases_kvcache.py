"""The CPU / CUDA agreement cases of the KV-cache operators
(tests/guards/test_cpu_cuda_agreement.py runs them): pool and state ops on
views of a CPU pool's / state's buffers, the layout ops on bare caches."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import rawkv.kvcache as kvc  # noqa: E402
from rawkv.kvcache import views as V  # noqa: E402
from rawkv.reference.kvcache import layouts as RL  # noqa: E402
from support.agreement import (  # noqa: E402
    bf, bones, buf, f16, f32, i32, i64, ints, mask, ones, stride0, strided_last, u8, unaligned,
)


def _kpool(kind="csa", layout="model1"):
    p = kvc.PagedKVPool(kind, 8, 4, 2, 4, device="cpu", layout=layout)
    for _ in range(2):
        p.add_request()
    p.prepare_step([0, 1], [8 * p.m - 1, 5 * p.m - 1])
    return p


def kpool(kind="csa", layout="model1"):
    """A view of a CPU pool's buffers (8 blocks of 4 entries, 2 requests:
    entries 0..7 and 0..4 prepared); CSA pools have indexer keys."""
    return V.pool_view(**V.pool_args(_kpool(kind, layout)))


def klayer(kind="csa"):
    """(pool, state, index state or None): views of a CPU pool's buffers
    (kpool's) and of its decode states' (2 slots; for CSA the indexer's,
    head_dim 128), the states attached to the pool, as compress_decode
    requires of them (through their views too: docs/kvcache.md, "What a
    view cannot check")."""
    p = _kpool(kind)
    states = [kvc.DecodeState(kind, 2, device="cpu")]
    if kind == "csa":
        states.append(kvc.DecodeState("csa", 2, 128, device="cpu"))
    p.attach(*states)
    views = [V.state_view(**V.state_args(st)) for st in states]
    return V.pool_view(**V.pool_args(p)), views[0], (views[1] if kind == "csa" else None)


def kstate(kind="csa", head_dim=512):
    """A view of a CPU decode state's buffers, 2 slots."""
    return V.state_view(**V.state_args(kvc.DecodeState(kind, 2, head_dim, device="cpu")))


def page(layout, n=2, p=4):
    """A (n, page_bytes) layout cache of pages of p records."""
    return buf(n, RL.LAYOUTS[layout].page_bytes(p))


def counter_in(obj, name):
    """errors= over one of obj's own buffers (whichever side the call is on)."""
    args = V.pool_args(obj) if isinstance(obj, kvc.PagedKVPool) else V.state_args(obj)
    return args[name].view(-1)[:4].view(u8).view(i32) if args[name].dtype != i32 else args[name][:1]


def rows_kv(n, w=1024, dtype=f32):
    return torch.ones((n, w), dtype=dtype)


IDS = lambda: torch.zeros((2, 3), dtype=i32)       # noqa: E731


PI = kvc.PrefillIndex


def _decode(layer, valid, slots, positions, index_norm_weight=None):
    """A compress_decode case on klayer's views (norm_weight ones; a CSA
    layer's DecodeIndex of its indexer state and `index_norm_weight`, ones
    by default)."""
    pool, st, ist = layer
    kw = {} if ist is None else {"index": kvc.DecodeIndex(ist, ones(128) if index_norm_weight is None
                                                          else index_norm_weight)}
    return kvc.compress_decode, (pool, st, ones(512), valid, slots, positions), kw


# op name -> [(case id, lambda: (public function, args, kwargs))]; the args
# are views of CPU pools' / states' buffers and CPU tensors (the CUDA call gets
# the same memory seen as CUDA tensors)
KV_CASES = {
    # ---- rawkv.kvcache: pool ops ----
    "kv_flush_write": [
        ("ok", lambda: (kvc.flush_write, (kpool(), bones(2, 512), mask(1, 1), ints(0, 1), ints(0, 4)),
                        {"index_keys": bones(2, 128)})),
        ("ok-hca-rawkv", lambda: (kvc.flush_write, (kpool("hca", "rawkv"), bones(2, 512), mask(1, 0), ints(0, 1),
                                                    ints(0, 128)), {})),
        ("entries-float32", lambda: (kvc.flush_write, (kpool("hca"), ones(2, 512), mask(1, 1), ints(0, 1),
                                                       ints(0, 128)), {})),
        ("entries-strided", lambda: (kvc.flush_write, (kpool("hca"), strided_last(2, 512, dtype=bf), mask(1, 1),
                                                       ints(0, 1), ints(0, 128)), {})),
        ("entries-unaligned", lambda: (kvc.flush_write, (kpool("hca"), unaligned(2, 512, dtype=bf), mask(1, 1),
                                                         ints(0, 1), ints(0, 128)), {})),
        ("slots-int64", lambda: (kvc.flush_write, (kpool("hca"), bones(2, 512), mask(1, 1), ints(0, 1, dtype=i64),
                                                   ints(0, 128)), {})),
        ("valid_mask-stride-0", lambda: (kvc.flush_write, (kpool("hca"), bones(2, 512), mask(1).expand(2),
                                                           ints(0, 1), ints(0, 128)), {})),
        ("index_keys-missing", lambda: (kvc.flush_write, (kpool(), bones(2, 512), mask(1, 1), ints(0, 1),
                                                          ints(0, 4)), {})),
        ("errors-over-written", lambda: (lambda p, *a: kvc.flush_write(p, *a, errors=counter_in(p, "written")),
                                         (kpool("hca"), bones(2, 512), mask(1, 1), ints(0, 1), ints(0, 128)), {})),
    ],
    "kv_assign_pages": [
        ("ok", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5, 6)), {})),
        ("ok-errors", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5, 9)), {"errors": buf(1, dtype=i32)})),
        ("blocks-shape", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5)), {})),
        ("slots-2d", lambda: (kvc.assign_pages, (kpool(), buf(2, 1, dtype=i32), ints(5, 6)), {})),
        ("errors-int64", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5, 6)), {"errors": buf(1, dtype=i64)})),
        ("errors-over-owners", lambda: (lambda p, *a: kvc.assign_pages(p, *a, errors=counter_in(p, "owners")),
                                        (kpool(), ints(0, 1), ints(5, 6)), {})),
    ],
    "kv_kvcache_indices": [
        ("ok", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), IDS()), {})),
        ("ok-int64-out", lambda: (kvc.kvcache_indices, (kpool("hca"), ints(0, 1), IDS().long()),
                                  {"out": buf(2, 3, dtype=i32), "n_entries": ints(3, 1), "valid_mask": mask(1, 0)})),
        ("topk_ids-transposed", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), buf(3, 2, dtype=i32).t()), {})),
        ("out-strided", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), IDS()),
                                 {"out": strided_last(2, 3, dtype=i32)})),
        ("n_entries-int64", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), IDS()),
                                     {"n_entries": ints(3, 1, dtype=i64)})),
    ],
    "kv_gather_topk": [
        ("ok", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()), {})),
        ("ok-float32-rawkv", lambda: (kvc.gather_topk, (kpool("csa", "rawkv"), ints(0, 1), IDS().long()),
                                      {"dtype": "float32", "valid_mask": mask(0, 1)})),
        ("ok-out", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()), {"out": ones(2, 3, 512, dtype=f16)})),
        ("out-unaligned", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()),
                                   {"out": unaligned(2, 3, 512, dtype=bf)})),
        ("out-not-dtype", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()),
                                   {"dtype": "float16", "out": bones(2, 3, 512)})),
        ("topk_ids-float", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), ones(2, 3)), {})),
        ("valid_mask-shape", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()), {"valid_mask": mask(1)})),
    ],
    "kv_gather_dense": [
        ("ok", lambda: (kvc.gather_dense, (kpool("hca"), 0, 2), {})),
        ("ok-out", lambda: (kvc.gather_dense, (kpool("hca", "rawkv"), 1, 2), {"out": ones(2, 512)})),
        ("slot-out-of-range", lambda: (kvc.gather_dense, (kpool("hca"), 5, 2), {})),
        ("n_entries-negative", lambda: (kvc.gather_dense, (kpool("hca"), 0, -1), {})),
        ("out-strided", lambda: (kvc.gather_dense, (kpool("hca"), 0, 2), {"out": strided_last(2, 512, dtype=bf)})),
    ],
    "kv_gather_index_keys": [
        ("ok", lambda: (kvc.gather_index_keys, (kpool(), 0, 3), {})),
        ("ok-rawkv-f16", lambda: (kvc.gather_index_keys, (kpool("csa", "rawkv"), 0, 3), {"dtype": f16})),
        ("pool-without-keys", lambda: (kvc.gather_index_keys, (kpool("hca"), 0, 3), {})),
        ("out-shape", lambda: (kvc.gather_index_keys, (kpool(), 0, 3), {"out": bones(3, 64)})),
    ],
    "kv_gather_dense_batch": [
        ("ok", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)), {"max_entries": 3})),
        ("ok-out", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)),
                            {"out": bones(2, 3, 512), "valid_mask": mask(1, 0)})),
        ("max_entries-missing", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)), {})),
        ("n_entries-int64", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1, dtype=i64)),
                                     {"max_entries": 3})),
        ("out-stride-0", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)),
                                  {"out": stride0(2, 3, 512, dtype=bf)})),
    ],
    "kv_gather_index_keys_batch": [
        ("ok", lambda: (kvc.gather_index_keys_batch, (kpool(), ints(0, 1), ints(2, 1)), {"max_entries": 3})),
        ("out-K-not-max_entries", lambda: (kvc.gather_index_keys_batch, (kpool(), ints(0, 1), ints(2, 1)),
                                           {"max_entries": 3, "out": bones(2, 4, 128)})),
        ("slots-strided", lambda: (kvc.gather_index_keys_batch, (kpool(), strided_last(2, dtype=i32), ints(2, 1)),
                                   {"max_entries": 3})),
    ],
    "kv_compress_prefill": [
        ("ok-hca", lambda: (kvc.compress_prefill, (kpool("hca"), rows_kv(256, 512), rows_kv(256, 512), None,
                                                   ones(512), 0), {})),
        ("ok-csa", lambda: (kvc.compress_prefill, (kpool("csa", "rawkv"), rows_kv(8, dtype=bf), rows_kv(8, dtype=bf),
                                                   ones(4, 1024), ones(512), 1),
                            {"index": PI(rows_kv(8, 256, bf), rows_kv(8, 256, bf), None, ones(128))})),
        ("z-float32-beside-bf16-kv", lambda: (kvc.compress_prefill, (kpool("hca"), rows_kv(256, 512, bf),
                                                                     rows_kv(256, 512), None, ones(512), 0), {})),
        ("kv-strided", lambda: (kvc.compress_prefill, (kpool("hca"), strided_last(256, 512), rows_kv(256, 512),
                                                       None, ones(512), 0), {})),
        ("norm_weight-shape", lambda: (kvc.compress_prefill, (kpool("hca"), rows_kv(256, 512), rows_kv(256, 512),
                                                              None, ones(513), 0), {})),
        ("index.kv-transposed", lambda: (kvc.compress_prefill, (kpool(), rows_kv(8), rows_kv(8), None, ones(512), 0),
                                         {"index": PI(ones(256, 8).t(), rows_kv(8, 256), None, ones(128))})),
        ("index-missing", lambda: (kvc.compress_prefill, (kpool(), rows_kv(8), rows_kv(8), None, ones(512), 0), {})),
    ],
    "kv_compress_decode": [
        ("ok-hca", lambda: _decode(klayer("hca"), mask(1, 1), ints(0, 1), ints(127, 5))),
        ("ok-csa", lambda: _decode(klayer(), mask(1, 1), ints(0, 1, dtype=i64), ints(3, 7, dtype=i64))),
        ("positions-not-slots-dtype", lambda: _decode(klayer("hca"), mask(1, 1), ints(0, 1),
                                                      ints(0, 1, dtype=i64))),
        ("state-kind", lambda: (kvc.compress_decode, (kpool("hca"), kstate("csa"), ones(512), mask(1, 1), ints(0, 1),
                                                      ints(0, 1)), {})),
        ("valid_mask-strided", lambda: _decode(klayer("hca"), strided_last(2, dtype=torch.bool), ints(0, 1),
                                               ints(0, 1))),
        ("index.norm_weight-unaligned-shape", lambda: _decode(klayer(), mask(1, 1), ints(0, 1), ints(3, 7),
                                                              index_norm_weight=ones(64))),
    ],
    # ---- rawkv.kvcache: decode-state ops ----
    "kv_state_seed": [
        ("ok", lambda: (kvc.state_seed, (kstate(), 0, rows_kv(6), rows_kv(6)), {})),
        ("ok-bf16-ape", lambda: (kvc.state_seed, (kstate(), 1, rows_kv(6, dtype=bf), rows_kv(6, dtype=bf)),
                                 {"ape": ones(4, 1024)})),
        ("slot-2", lambda: (kvc.state_seed, (kstate(), 2, rows_kv(6), rows_kv(6)), {})),
        ("kv-strided", lambda: (kvc.state_seed, (kstate(), 0, strided_last(6, 1024), rows_kv(6)), {})),
        ("ape-bf16", lambda: (kvc.state_seed, (kstate(), 0, rows_kv(6), rows_kv(6)), {"ape": bones(4, 1024)})),
    ],
    "kv_state_append": [
        ("ok", lambda: (kvc.state_append, (kstate(), rows_kv(2), rows_kv(2), mask(1, 1), ints(0, 1)), {})),
        ("ok-hca-ape", lambda: (kvc.state_append, (kstate("hca"), rows_kv(2, 512, bf), rows_kv(2, 512), mask(1, 0),
                                                   ints(0, 1)), {"ape": ones(128, 512)})),
        ("kv-unaligned", lambda: (kvc.state_append, (kstate(), unaligned(2, 1024), rows_kv(2), mask(1, 1), ints(0, 1)),
                                  {})),
        ("z-shape", lambda: (kvc.state_append, (kstate(), rows_kv(2), rows_kv(3), mask(1, 1), ints(0, 1)), {})),
        ("slots-int64", lambda: (kvc.state_append, (kstate(), rows_kv(2), rows_kv(2), mask(1, 1),
                                                    ints(0, 1, dtype=i64)), {})),
        ("errors-over-count", lambda: (lambda st, *a: kvc.state_append(st, *a, errors=counter_in(st, "count")),
                                       (kstate(), rows_kv(2), rows_kv(2), mask(1, 1), ints(0, 1)), {})),
    ],
    "kv_csa_rotate": [
        ("ok", lambda: (kvc.csa_rotate, (kstate(), mask(1, 0), ints(0, 1)), {})),
        ("state-hca", lambda: (kvc.csa_rotate, (kstate("hca"), mask(1, 0), ints(0, 1)), {})),
        ("valid_mask-none", lambda: (kvc.csa_rotate, (kstate(), None, ints(0, 1)), {})),
        ("slots-stride-0", lambda: (kvc.csa_rotate, (kstate(), mask(1, 0), ints(0).expand(2)), {})),
    ],
    "kv_hca_reset": [
        ("ok", lambda: (kvc.hca_reset, (kstate("hca"), mask(1, 1), ints(0, 1)), {"errors": buf(1, dtype=i32)})),
        ("state-csa", lambda: (kvc.hca_reset, (kstate(), mask(1, 1), ints(0, 1)), {})),
        ("errors-empty", lambda: (kvc.hca_reset, (kstate("hca"), mask(1, 1), ints(0, 1)),
                                  {"errors": buf(0, dtype=i32)})),
    ],
    "kv_state_clear": [
        ("ok", lambda: (kvc.state_clear, (kstate(), ints(0, 1)), {})),
        ("ok-mask", lambda: (kvc.state_clear, (kstate("hca"), ints(1)), {"valid_mask": mask(0)})),
        ("slots-2d", lambda: (kvc.state_clear, (kstate(), buf(2, 1, dtype=i32)), {})),
        ("valid_mask-int32", lambda: (kvc.state_clear, (kstate(), ints(0, 1)), {"valid_mask": ints(1, 0)})),
    ],
    # ---- rawkv.kvcache: the ecosystem layouts ----
    "kv_model1_store": [
        ("ok", lambda: (kvc.model1_store, (page("model1", 3), ones(2, 512), ints(0, 5)), {"page_size": 4})),
        ("ok-offsets-errors", lambda: (kvc.model1_store, (page("model1"), bones(2, 512), ints(0, 1, dtype=i64)),
                                       {"page_size": 4, "offsets": ints(0, 9), "errors": buf(1, dtype=i32)})),
        ("cache-unaligned", lambda: (kvc.model1_store, (buf(2 * RL.MODEL1.page_bytes(4) + 8)[8:].view(2, -1),
                                                        ones(2, 512), ints(0, 5)), {"page_size": 4})),
        ("entries-strided", lambda: (kvc.model1_store, (page("model1"), strided_last(2, 512), ints(0, 5)),
                                     {"page_size": 4})),
        ("slots-float", lambda: (kvc.model1_store, (page("model1"), ones(2, 512), ones(2)), {"page_size": 4})),
        ("errors-over-cache", lambda: (lambda c, x, sl: kvc.model1_store(c, x, sl, page_size=4,
                                                                         errors=c.view(-1)[:4].view(i32)),
                                       (page("model1"), ones(2, 512), ints(0, 5)), {})),
    ],
    "kv_model1_window_insert": [
        ("ok", lambda: (kvc.model1_window_insert, (page("model1"), bones(3, 512), ints(6, -1, 8, dtype=i64)),
                        {"page_size": 4})),
        ("slot_mapping-shape", lambda: (kvc.model1_window_insert, (page("model1"), bones(3, 512), ints(6, -1)),
                                        {"page_size": 4})),
        ("rows-unaligned", lambda: (kvc.model1_window_insert, (page("model1"), unaligned(3, 512, dtype=bf),
                                                               ints(6, -1, 8)), {"page_size": 4})),
    ],
    "kv_index_fp8_store": [
        ("ok", lambda: (kvc.index_fp8_store, (page("index_fp8"), ones(2, 128), ints(0, 1)), {"page_size": 4})),
        ("ok-deepgemm-shape", lambda: (kvc.index_fp8_store, (buf(2, 4, 1, 132), bones(2, 128), ints(7, 1)),
                                       {"page_size": 4})),
        ("cache-page-stride", lambda: (kvc.index_fp8_store, (buf(2, RL.INDEX_FP8.page_bytes(4) + 4), ones(2, 128),
                                                             ints(0, 1)), {"page_size": 4})),
        ("keys-width", lambda: (kvc.index_fp8_store, (page("index_fp8"), ones(2, 64), ints(0, 1)), {"page_size": 4})),
    ],
    "kv_index_mxfp4_store": [
        ("ok", lambda: (kvc.index_mxfp4_store, (page("index_mxfp4"), bones(2, 128), ints(1, -1)), {"page_size": 4})),
        ("keys-float16", lambda: (kvc.index_mxfp4_store, (page("index_mxfp4"), ones(2, 128, dtype=f16), ints(1, -1)),
                                  {"page_size": 4})),
        ("cache-int32", lambda: (kvc.index_mxfp4_store, (buf(2, RL.INDEX_MXFP4.page_bytes(4) // 4, dtype=i32),
                                                         bones(2, 128), ints(1, -1)), {"page_size": 4})),
    ],
    "kv_index_mxfp8_store": [
        ("ok", lambda: (kvc.index_mxfp8_store, (page("index_mxfp8"), bones(2, 128), ints(1, -1)), {"page_size": 4})),
        ("ok-deepgemm-view", lambda: (kvc.index_mxfp8_store,
                                      (kvc.deepgemm_view(page("index_mxfp8"), 4, "index_mxfp8"), ones(2, 128),
                                       ints(7, 0)), {"page_size": 4})),
        ("cache-unpadded-stride", lambda: (kvc.index_mxfp8_store, (buf(2, 4, 1, 132), bones(2, 128), ints(7, 1)),
                                           {"page_size": 4})),
        ("slots-float", lambda: (kvc.index_mxfp8_store, (page("index_mxfp8"), ones(2, 128), ones(2)),
                                 {"page_size": 4})),
    ],
    "kv_model1_gather": [
        ("ok", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5, -1)), {"page_size": 4})),
        ("ok-out-f32", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5)), {"page_size": 4, "out": ones(2, 512)})),
        ("indices-int64", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5, dtype=i64)), {"page_size": 4})),
        ("out-unaligned", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5)),
                                   {"page_size": 4, "out": unaligned(2, 512)})),
        ("out-not-dtype", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5)),
                                   {"page_size": 4, "dtype": "float16", "out": ones(2, 512)})),
    ],
    "kv_topk_to_kvcache_indices": [
        ("ok", lambda: (kvc.topk_to_kvcache_indices, (torch.tensor([[0, 5, -1], [3, 1, 2]], dtype=i32),
                                                      torch.tensor([[1, 0], [0, 1]], dtype=i32)),
                        {"page_size": 4, "num_pages": 2})),
        ("ok-3d-slots", lambda: (kvc.topk_to_kvcache_indices, (buf(2, 2, 3, dtype=i64), buf(3, 2, dtype=i32)),
                                 {"page_size": 4, "num_pages": 2, "slots": ints(2, 0), "errors": buf(1, dtype=i32)})),
        ("block_table-int64", lambda: (kvc.topk_to_kvcache_indices, (buf(2, 3, dtype=i32), buf(2, 2, dtype=i64)),
                                       {"page_size": 4, "num_pages": 2})),
        ("topk_ids-1d", lambda: (kvc.topk_to_kvcache_indices, (buf(3, dtype=i32), buf(2, 2, dtype=i32)),
                                 {"page_size": 4, "num_pages": 2})),
        ("out-strided", lambda: (kvc.topk_to_kvcache_indices, (buf(2, 3, dtype=i32), buf(2, 2, dtype=i32)),
                                 {"page_size": 4, "num_pages": 2, "out": strided_last(2, 3, dtype=i32)})),
    ],
}
