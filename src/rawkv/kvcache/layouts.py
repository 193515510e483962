"""The ecosystem byte layouts of the DeepSeek-V4 KV cache (docs/kvcache.md,
"Ecosystem layouts"): FlashMLA MODEL1_FP8Sparse entries (and the sliding
window), DeepGEMM's paged FP8 / MXFP4 / MXFP8 indexer keys, the MODEL1 gather by
FlashMLA indices and the top-k -> indices_in_kvcache bridge.

    cache = new_layout_cache("model1", num_pages, 64, device="cuda")
    model1_store(cache, entries, pages, page_size=64, offsets=offs)     # compressed entries
    model1_window_insert(win, rows, slot_mapping, page_size=64)         # window tokens
    idx = topk_to_kvcache_indices(topk, block_table, page_size=64, num_pages=n, out=buf)
    flash_mla_sparse_decode(..., flashmla_view(cache, 64), idx, ...)    # the engine's call
    rows = model1_gather(cache, idx, page_size=64, out=rows_buf)       # without FlashMLA

A cache is a uint8 (or float8_e4m3fn) tensor whose first dimension is the
page and whose page stride is the layout's page bytes, showing every record
of each page (_rules.cache: not a slice of each page, which a compiled op
could not write past): (num_pages, page_bytes) as new_layout_cache makes
it, or the engines' views of it (flashmla_view, deepgemm_view). On CUDA every op is one kernel launch
(rawkv.kernels.kv_layouts) on torch's current stream (or `stream`), with
no allocation when out= is given and no host synchronization, so it
captures into a CUDA graph; on CPU arrays it runs the numpy reference
(rawkv.reference.kvcache.layouts), which defines every byte. Arguments are
checked before anything is launched or written (rules in ._rules, the
same on CPU and CUDA); the error names the argument. Device-side indices are bounds-checked: -1 is
padding (skipped, not counted), any other bad index skips its row and adds
1 to `errors` (an int32 array; None: not counted). Two rows aimed at one
record: which lands is undefined (a later phase makes it deterministic).

Every op is written once as a rawkv:: custom operator (rawkv._op.op;
torch.ops.rawkv.kv_<op>, the mutating form: the cache / out and errors are
written arguments); the public function allocates a missing out and calls it.
"""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .._op import empty, op
from ..kernels import kv_layouts as K
from ..reference.kvcache import layouts as R
from ..runtime import get_runtime
from . import _rules as C
from ._rules import layout_of


def layout_page_bytes(layout, page_size: int) -> int:
    """Bytes of one page (the page stride) of `page_size` records."""
    return layout_of(layout).page_bytes(C.host_int("page_size", page_size, 1))


def new_layout_cache(layout, num_pages: int, page_size: int, *, device=None):
    """A zero-filled (num_pages, page_bytes) uint8 cache: a torch tensor on
    `device` (e.g. 'cuda'), or a numpy array when device is None."""
    lay = layout_of(layout)
    n, p = C.host_int("num_pages", num_pages, 1), C.host_int("page_size", page_size, 1)
    if n * p > R.INDEX_LIMIT:
        # (every op refuses such a cache: its slots are int32, FlashMLA's indices)
        raise ValueError(f"num_pages: {n} pages of {p} records exceed the int32 slot range (2^31 - 1)")
    shape = (n, lay.page_bytes(p))
    if device is None:
        return np.zeros(shape, np.uint8)
    import torch
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def flashmla_view(cache, page_size: int):
    """FlashMLA's view of a MODEL1 cache: (num_pages, P, 1, 584) bytes with
    page stride page_bytes (what flash_mla's sparse decode takes as k_cache),
    of the cache's own dtype: FlashMLA takes float8_e4m3fn, int8 or uint8
    (csrc/api/sparse_decode.h line 260 at 9241ae3e), so both of a cache's
    dtypes pass. A cache whose first byte is not 16-byte aligned is refused
    naming cache (FlashMLA's 16-byte loads; docs/kvcache.md, "DeepGEMM
    compatibility per architecture")."""
    return _record_view(cache, R.MODEL1, page_size, "flashmla_view", as_bytes=False)


# why each engine's view needs a 16-byte-aligned cache (C.view_aligned; docs/kvcache.md, "DeepGEMM
# compatibility per architecture")
_FLASHMLA_ALIGN = ("FlashMLA's sparse decode loads the MODEL1 records 16 bytes at a time (SM90) and asserts "
                   "a 16-byte-aligned kv base (SM100)")
_DEEPGEMM_ALIGN = ("DeepGEMM's paged MQA logits read the key pages through TMA descriptors, whose base "
                   "address (cuTensorMapEncodeTiled's globalAddress) must be 16-byte aligned")


def deepgemm_view(cache, page_size: int, layout="index_fp8"):
    """DeepGEMM's view of an indexer-key cache: (num_pages, P, 1, 132) for
    FP8 keys (fp8_paged_mqa_logits), (num_pages, P, 1, 68) for MXFP4 keys,
    (num_pages, P, 1, 132) for MXFP8 keys ("index_mxfp8", its page stride
    padded to a multiple of 512), uint8 whatever the cache's dtype: both of
    DeepGEMM's entry points assert
    fused_kv_cache.scalar_type() == kByte (csrc/apis/attention.hpp lines
    278 and 312 at 54e22612), so a float8_e4m3fn cache is viewed as its
    bytes (no copy). A cache whose first byte is not 16-byte aligned is
    refused naming cache (DeepGEMM reads the pages through TMA, whose base
    must be 16-byte aligned), though the key stores take a 4-byte aligned
    one."""
    lay = layout_of(layout)
    if lay is R.MODEL1:
        raise ValueError("layout: deepgemm_view is for the indexer-key layouts")
    return _record_view(cache, lay, page_size, "deepgemm_view", as_bytes=True)


def _record_view(cache, lay: R.SplitLayout, page_size: int, fn: str, as_bytes: bool):
    p = C.host_int("page_size", page_size, 1)
    c, n = C.cache(cache, lay, p, A.placement(("cache", cache)), align=1)
    # a pool's pages are viewed only in the pool's geometry: the same bytes
    # fit pages of another layout or page size (C.check_view_cache)
    C.check_view_cache(C.whole_pages(c, n, lay, p), lay, p, fn)
    # the engine reads the pages in place from their first byte (after the
    # pool check: a view starting inside a pool's page is named as that)
    C.view_aligned(c, _FLASHMLA_ALIGN if lay is R.MODEL1 else _DEEPGEMM_ALIGN)
    rec = lay.data_bytes + lay.scale_bytes
    shape, strides = (n, p, 1, rec), (lay.page_bytes(p), rec, rec, 1)
    if A.is_torch(c):
        if as_bytes:
            import torch
            c = c.view(torch.uint8)             # (1-byte elements both: the same memory, no copy)
        return c.as_strided(shape, strides)
    if as_bytes:
        c = c.view(np.uint8)
    return np.lib.stride_tricks.as_strided(c, shape, strides)


def model1_store(cache, entries, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize entries (N, 512) float32/bfloat16 into MODEL1 records
    (reference.model1_write): 448 nope dims as E4M3 in 7 tiles of 64 with
    UE8M0 scales 2^ceil(log2(max(amax, 1e-4) / 448)) (from the entry rounded
    to BF16), 64 RoPE dims as BF16. Row b goes to slot slots[b]
    (page * page_size + offset), or, with offsets (N,) int32, to record
    offsets[b] of page slots[b]. slots (N,) int32/int64. -1: skipped; any
    other out-of-range slot / page / offset: skipped, errors += 1. A tile
    holding NaN/Inf stores codes 0 and scale byte 0xFF (decodes to NaN)."""
    _model1_store(cache, entries, slots, page_size, offsets, errors, stream)


def model1_window_insert(cache, rows, slot_mapping, *, page_size: int, errors=None, stream=None):
    """The sliding-window insert: token rows (N, 512) (RMSNormed + RoPEd)
    into MODEL1 window pages by slot mapping (N,) int32/int64 (vLLM's
    slot_mapping: page * page_size + offset, -1 skipped), in the entry
    format of model1_store. One launch."""
    _model1_window_insert(cache, rows, slot_mapping, page_size, errors, stream)


def index_fp8_store(cache, keys, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize indexer keys (N, 128) float32/bfloat16 into DeepGEMM's SM90
    paged FP8 layout (reference.index_fp8_write): 128 E4M3 codes and one
    FP32 scale 2^ceil(log2(max(amax, 1e-4) / 448)) per key (vLLM's rule).
    Addressing and errors as model1_store; a NaN/Inf key stores codes 0 and
    a NaN scale."""
    _index_fp8_store(cache, keys, slots, page_size, offsets, errors, stream)


def index_mxfp4_store(cache, keys, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize indexer keys (N, 128) float32/bfloat16 into DeepGEMM's SM100
    paged MXFP4 layout (reference.index_mxfp4_write): E2M1 in blocks of 32
    with UE8M0 scales 2^ceil(log2(max(amax, 6 * 2^-126) / 6)) (DeepSeek's
    fp4_act_quant), 4 scale bytes per key in one int32. Addressing and
    errors as model1_store; a NaN/Inf block stores codes 0, scale 0xFF."""
    _index_mxfp4_store(cache, keys, slots, page_size, offsets, errors, stream)


def index_mxfp8_store(cache, keys, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize indexer keys (N, 128) float32/bfloat16 into DeepGEMM's SM100
    paged MXFP8 layout (reference.index_mxfp8_write): E4M3 in blocks of 32
    with UE8M0 scales 2^ceil(log2(max(amax, 1e-4) / 448)) (DeepGEMM's
    per_token_cast_to_fp8(use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)),
    4 scale bytes per key in one int32, the page padded to a multiple of 512
    bytes. Addressing and errors as model1_store; a NaN/Inf block stores
    codes 0, scale 0xFF."""
    _index_mxfp8_store(cache, keys, slots, page_size, offsets, errors, stream)


def model1_gather(cache, indices, *, page_size: int, out=None, dtype=None, errors=None, stream=None):
    """MODEL1 entries at FlashMLA indices (any shape, int32: page *
    page_size + offset) back to rows (*indices.shape, 512) of `dtype`
    (bfloat16 default, float16, float32): e4m3(code) * 2^(byte - 127) in
    float32, RoPE dims as stored, rounded to dtype (reference.model1_gather).
    -1: zero row; an index outside [0, num_pages * page_size): zero row,
    errors += 1. One launch (one warp per row), capturable with out=."""
    name = C.out_dtype(dtype, out)
    if out is None:
        out = empty(indices, (*A.out_lead(indices, "indices"), R.ENTRY_DIM), name, stream)
    _model1_gather(cache, indices, page_size, out, errors, stream, name)
    return out


def topk_to_kvcache_indices(topk_ids, block_table, *, page_size: int, num_pages: int, slots=None,
                            n_entries=None, out=None, errors=None, stream=None):
    """The bridge to FlashMLA: each request's logical top-k entry ids
    (B, K) or (B, S, K) int32/int64 (-1 = none) -> indices_in_kvcache of the
    same shape, int32: block_table[row, e // page_size] * page_size +
    e % page_size, row = slots[b] (slots (B,) int32) or b. block_table
    (R, max_blocks) int32; n_entries (B,) int32 or None (ids >= n_entries[b]
    are out of range); num_pages bounds the block ids.
    -1 -> -1, not counted; any other id out of range, a row outside
    [0, R) or a block id outside [0, num_pages) -> -1, errors += 1
    (reference.topk_to_kvcache_indices). One launch, capturable with out=."""
    if out is None:
        out = empty(topk_ids, A.out_lead(topk_ids, "topk_ids"), "int32", stream)
    _topk_to_kvcache_indices(topk_ids, block_table, page_size, num_pages, slots, n_entries, out, errors, stream)
    return out


# ---- the ops ----------------------------------------------------------------------------------
_STORE = "Tensor(a!) cache, Tensor {rows}, Tensor {slots}, Scalar page_size, {offsets}Tensor(b!)? errors"


@op("kv_model1_store", _STORE.format(rows="entries", slots="slots", offsets="Tensor? offsets, "))
def _model1_store(cache, entries, slots, page_size, offsets, errors, stream=None, checks_only=False):
    """rawkv::kv_model1_store: entries into MODEL1 records of cache."""
    checked = C.store(R.MODEL1, cache, entries, slots, page_size, offsets, errors, R.ENTRY_DIM, "entries", "slots")
    _store(R.MODEL1, K.MODEL1_STORE, (), R.model1_write, checked, stream, checks_only)


@op("kv_model1_window_insert", _STORE.format(rows="rows", slots="slot_mapping", offsets=""))
def _model1_window_insert(cache, rows, slot_mapping, page_size, errors, stream=None, checks_only=False):
    """rawkv::kv_model1_window_insert: token rows into MODEL1 window pages."""
    checked = C.store(R.MODEL1, cache, rows, slot_mapping, page_size, None, errors, R.ENTRY_DIM, "rows", "slot_mapping")
    _store(R.MODEL1, K.MODEL1_STORE, (), R.model1_write, checked, stream, checks_only)


@op("kv_index_fp8_store", _STORE.format(rows="keys", slots="slots", offsets="Tensor? offsets, "))
def _index_fp8_store(cache, keys, slots, page_size, offsets, errors, stream=None, checks_only=False):
    """rawkv::kv_index_fp8_store: indexer keys into DeepGEMM's FP8 key pages."""
    checked = C.store(R.INDEX_FP8, cache, keys, slots, page_size, offsets, errors, R.INDEX_DIM, "keys", "slots")
    _store(R.INDEX_FP8, K.INDEX_STORE, (K.KEY_FP8,), R.index_fp8_write, checked, stream, checks_only)


@op("kv_index_mxfp4_store", _STORE.format(rows="keys", slots="slots", offsets="Tensor? offsets, "))
def _index_mxfp4_store(cache, keys, slots, page_size, offsets, errors, stream=None, checks_only=False):
    """rawkv::kv_index_mxfp4_store: indexer keys into DeepGEMM's MXFP4 key pages."""
    checked = C.store(R.INDEX_MXFP4, cache, keys, slots, page_size, offsets, errors, R.INDEX_DIM, "keys", "slots")
    _store(R.INDEX_MXFP4, K.INDEX_STORE, (K.KEY_MXFP4,), R.index_mxfp4_write, checked, stream, checks_only)


@op("kv_index_mxfp8_store", _STORE.format(rows="keys", slots="slots", offsets="Tensor? offsets, "))
def _index_mxfp8_store(cache, keys, slots, page_size, offsets, errors, stream=None, checks_only=False):
    """rawkv::kv_index_mxfp8_store: indexer keys into DeepGEMM's MXFP8 key pages."""
    checked = C.store(R.INDEX_MXFP8, cache, keys, slots, page_size, offsets, errors, R.INDEX_DIM, "keys", "slots")
    _store(R.INDEX_MXFP8, K.INDEX_STORE, (K.KEY_MXFP8,), R.index_mxfp8_write, checked, stream, checks_only)


def _store(lay, kernel, targs, write, checked, stream, checks_only=False):
    """A store's checked arguments (C.store) through the reference `write`
    on the host, or one launch (one warp per row); nothing with
    `checks_only` (the operator's fake implementation checks a traced
    call's real tensors that way: rawkv.kvcache.traced)."""
    if checks_only:
        return
    where, c, n, p, x, s, o, err = checked
    if where == "cpu":
        bad = write(C.cache_pages(c, n, lay, p), p, *A.host(x, s, o))
        if err is not None:
            C.add_errors(err, bad)
        return
    N = x.shape[0]
    if N:
        rt = get_runtime(c.get_device())
        grid, block = rt.grid_stride(N * 32, K.BLOCK)
        kernel.instance(x.dtype, s.dtype, *targs).launch(
            rt, (grid,), (block,), stream=stream, rows=x, slots=s, offsets=o, cache=c, errors=err,
            N=N, num_pages=n, page_size=p, page_bytes=lay.page_bytes(p))


@op("kv_model1_gather", "Tensor cache, Tensor indices, Scalar page_size, Tensor(a!) out, Tensor(b!)? errors")
def _model1_gather(cache, indices, page_size, out, errors, stream=None, dtype=None, checks_only=False):
    """rawkv::kv_model1_gather: the MODEL1 entries at indices into out, in
    `dtype` (the public op's; None: out's own)."""
    where, c, n, p, idx, out, name, err = C.model1_gather(cache, indices, page_size, out, errors, dtype)
    if checks_only:
        return
    if where == "cpu":
        rows, bad = R.model1_gather(C.cache_pages(c, n, R.MODEL1, p), p, *A.host(idx), name)
        if err is not None:
            C.add_errors(err, bad)
        A.from_numpy(rows, out, torch_dtype=name, out=out)
        return
    rows = idx.numel()
    if rows:
        rt = get_runtime(c.get_device())
        grid, block = rt.grid_stride(rows * 32, K.BLOCK)
        K.MODEL1_GATHER.instance(out.dtype).launch(
            rt, (grid,), (block,), stream=stream, cache=c, indices=idx, out=out, errors=err, R=rows,
            num_pages=n, page_size=p, page_bytes=R.MODEL1.page_bytes(p))


@op("kv_topk_to_kvcache_indices", "Tensor topk_ids, Tensor block_table, Scalar page_size, Scalar num_pages, "
                                  "Tensor? slots, Tensor? n_entries, Tensor(a!) out, Tensor(b!)? errors")
def _topk_to_kvcache_indices(topk_ids, block_table, page_size, num_pages, slots, n_entries, out, errors,
                             stream=None, checks_only=False):
    """rawkv::kv_topk_to_kvcache_indices: FlashMLA's indices of the top-k ids into out."""
    where, ids, table, p, npg, s, ne, out, err = C.topk_bridge(
        topk_ids, block_table, page_size, num_pages, slots, n_entries, out, errors)
    if checks_only:
        return
    if where == "cpu":
        res, bad = R.topk_to_kvcache_indices(*A.host(ids, table), p, npg, *A.host(s, ne))
        if err is not None:
            C.add_errors(err, bad)
        A.from_numpy(res, out, out=out)
        return
    total = ids.numel()
    if total:
        B = ids.shape[0]
        rt = get_runtime(ids.get_device())
        grid, block = rt.grid_stride(total, K.BLOCK)
        K.TOPK_TO_KVCACHE.instance(ids.dtype).launch(
            rt, (grid,), (block,), stream=stream, ids=ids, table=table, slots=s, n_entries=ne, out=out,
            errors=err, B=B, per_row=total // B, table_rows=table.shape[0], max_blocks=table.shape[1],
            num_pages=npg, page_size=p)
