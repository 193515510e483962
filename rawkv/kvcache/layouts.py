"""The ecosystem byte layouts of the DeepSeek-V4 KV cache (docs/kvcache.md,
"Ecosystem layouts"): FlashMLA MODEL1_FP8Sparse entries (and the sliding
window), DeepGEMM's paged FP8 / MXFP4 indexer keys, the MODEL1 gather by
FlashMLA indices and the top-k -> indices_in_kvcache bridge.

    cache = new_layout_cache("model1", num_pages, 64, device="cuda")
    model1_store(cache, entries, pages, page_size=64, offsets=offs)     # compressed entries
    model1_window_insert(win, rows, slot_mapping, page_size=64)         # window tokens
    idx = topk_to_kvcache_indices(topk, block_table, page_size=64, num_pages=n, out=buf)
    flash_mla_sparse_decode(..., flashmla_view(cache, 64), idx, ...)    # the engine's call
    rows = model1_gather(cache, idx, page_size=64, out=rows_buf)       # without FlashMLA

A cache is a uint8 (or float8_e4m3fn) tensor whose first dimension is the
page and whose page stride is the layout's page bytes: (num_pages,
page_bytes) as new_layout_cache makes it, or the engines' views of it
(flashmla_view, deepgemm_view). On CUDA every op is one kernel launch
(rawkv.kernels.kv_layouts) on torch's current stream (or `stream`), with
no allocation when out= is given and no host synchronization, so it
captures into a CUDA graph; on CPU arrays it runs the numpy reference
(rawkv.reference.kvcache.layouts), which defines every byte. Arguments are
checked before anything is launched or written (rules in .checks); the
error names the argument. Device-side indices are bounds-checked: -1 is
padding (skipped, not counted), any other bad index skips its row and adds
1 to `errors` (an int32 array; None: not counted). Two rows aimed at one
record: which lands is undefined (a later phase makes it deterministic).

Every op is also a rawkv:: custom operator (torch.ops.rawkv.kv_<op>, the
mutating form: the cache / out and errors are written arguments), which the
op calls under torch.compile, allocating a missing out with torch.empty.
"""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import kv_layouts as K
from ..reference.kvcache import layouts as R
from ..runtime import get_runtime
from . import checks as C

_ALIGN = {"model1": 16, "index_fp8": 4, "index_mxfp4": 4}


def layout_of(layout) -> R.SplitLayout:
    """A layout by name ('model1', 'index_fp8', 'index_mxfp4') or itself."""
    if isinstance(layout, R.SplitLayout):
        return layout
    try:
        return R.LAYOUTS[layout]
    except (KeyError, TypeError):
        raise ValueError(f"layout: expected one of {sorted(R.LAYOUTS)}, got {layout!r}") from None


def layout_page_bytes(layout, page_size: int) -> int:
    """Bytes of one page (the page stride) of `page_size` records."""
    return layout_of(layout).page_bytes(C.host_int("page_size", page_size, 1))


def new_layout_cache(layout, num_pages: int, page_size: int, *, device=None):
    """A zero-filled (num_pages, page_bytes) uint8 cache: a torch tensor on
    `device` (e.g. 'cuda'), or a numpy array when device is None."""
    lay = layout_of(layout)
    shape = (C.host_int("num_pages", num_pages, 1), layout_page_bytes(lay, page_size))
    if device is None:
        return np.zeros(shape, np.uint8)
    import torch
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def flashmla_view(cache, page_size: int):
    """FlashMLA's view of a MODEL1 cache: (num_pages, P, 1, 584) bytes with
    page stride page_bytes (what flash_mla's sparse decode takes as k_cache)."""
    return _record_view(cache, R.MODEL1, page_size)


def deepgemm_view(cache, page_size: int, layout="index_fp8"):
    """DeepGEMM's view of an indexer-key cache: (num_pages, P, 1, 132) for
    FP8 keys (fp8_paged_mqa_logits), (num_pages, P, 1, 68) for MXFP4 keys."""
    lay = layout_of(layout)
    if lay is R.MODEL1:
        raise ValueError("layout: deepgemm_view is for the indexer-key layouts")
    return _record_view(cache, lay, page_size)


def _record_view(cache, lay: R.SplitLayout, page_size: int):
    p = C.host_int("page_size", page_size, 1)
    view, n, _ = _cache_arg(cache, lay, p)
    rec = lay.data_bytes + lay.scale_bytes
    shape, strides = (n, p, 1, rec), (lay.page_bytes(p), rec, rec, 1)
    if D.is_torch(cache):
        return cache.as_strided(shape, strides)
    return np.lib.stride_tricks.as_strided(view, shape, strides)


def _cache_arg(cache, lay: R.SplitLayout, page_size: int):
    """(cache, num_pages, dev): a CUDA tensor as given (dev its index), or
    a numpy (num_pages, page_bytes) view of a host cache (dev None), writes
    through to the caller's memory."""
    A.require_array(cache, "cache")
    pb = lay.page_bytes(page_size)
    if not D.is_torch(cache) and not isinstance(cache, np.ndarray):
        cache = D.as_cuda_tensor(cache, "cache") if D.placement(("cache", cache)) == "cuda" \
            else D.to_numpy(cache, "cache")
    if isinstance(cache, np.ndarray):
        if cache.dtype != np.uint8 or cache.ndim < 1 or not cache.flags.c_contiguous:
            raise TypeError(f"cache: expected a C-contiguous uint8 array, got {cache.dtype} "
                            f"(contiguous: {cache.flags.c_contiguous})")
        n = cache.shape[0]
        if cache.size != n * pb:
            raise ValueError(f"cache: a {lay.name} page of {page_size} records is {pb} bytes; "
                             f"got shape {cache.shape}")
        _check_pages(n, page_size)
        return cache.reshape(n, pb), n, None
    A.check_tensor(cache, "cache", A.dtypes().fp8, contiguous=False)
    if cache.dim() < 1 or cache.stride(-1) != 1:
        raise ValueError(f"cache: expected pages along dimension 0 and bytes contiguous, got shape "
                         f"{tuple(cache.shape)} strides {tuple(cache.stride())}")
    n = cache.shape[0]
    if cache.stride(0) != pb or cache.untyped_storage().nbytes() < cache.storage_offset() + n * pb:
        raise ValueError(f"cache: a {lay.name} page of {page_size} records is {pb} bytes (the page "
                         f"stride); got shape {tuple(cache.shape)} strides {tuple(cache.stride())} over "
                         f"{cache.untyped_storage().nbytes() - cache.storage_offset()} bytes")
    _check_pages(n, page_size)
    if cache.is_cuda:
        A.check_aligned("cache", cache, _ALIGN[lay.name])
        return cache, n, cache.get_device()
    import torch
    flat = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return flat.as_strided((n, pb), (pb, 1)).numpy(), n, None


def _check_pages(n: int, page_size: int) -> None:
    if n * page_size > R.INDEX_LIMIT:
        raise ValueError(f"cache: {n} pages of {page_size} records exceed the int32 slot range "
                         "(2^31 - 1)")


def _store(lay, kernel, targs, write, cache, rows, slots, page_size, offsets, errors, stream, width, name,
           slots_name="slots"):
    """The stores: checks, then one launch (one warp per row) or the
    reference `write` on the host. `name` / `slots_name`: what the public op
    calls the rows and the slots (errors name them)."""
    p = C.host_int("page_size", page_size, 1)
    c, n, dev = _cache_arg(cache, lay, p)
    x = C.arg(rows, name, C.ROWS, dev, ndim=2, aligned=True)
    N = x.shape[0]
    if x.shape[1] != width:
        raise ValueError(f"{name}: expected shape ({N}, {width}), got {tuple(x.shape)}")
    s = C.arg(slots, slots_name, C.IDS, dev, shape=(N,))
    o = C.opt(offsets, "offsets", C.I32, dev, shape=(N,))
    err = C.errors_arg(errors, None, dev)
    A.check_outputs((("cache", c), ("errors", errors)), ((name, x), (slots_name, s), ("offsets", o)))
    if dev is None:
        bad = write(c, p, x, s, o)
        if err is not None:
            C.add_errors(err, bad)
        return
    if N:
        rt = get_runtime(dev)
        grid, block = rt.grid_stride(N * 32, K.BLOCK)
        kernel.instance(x.dtype, s.dtype, *targs).launch(
            rt, (grid,), (block,), stream=stream, rows=x, slots=s, offsets=o, cache=c, errors=err,
            N=N, num_pages=n, page_size=p, page_bytes=lay.page_bytes(p))


def model1_store(cache, entries, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize entries (N, 512) float32/bfloat16 into MODEL1 records
    (reference.model1_write): 448 nope dims as E4M3 in 7 tiles of 64 with
    UE8M0 scales 2^ceil(log2(max(amax, 1e-4) / 448)) (from the entry rounded
    to BF16), 64 RoPE dims as BF16. Row b goes to slot slots[b]
    (page * page_size + offset), or, with offsets (N,) int32, to record
    offsets[b] of page slots[b]. slots (N,) int32/int64. -1: skipped; any
    other out-of-range slot / page / offset: skipped, errors += 1. A tile
    holding NaN/Inf stores codes 0 and scale byte 0xFF (decodes to NaN)."""
    if D.compiling():
        return _traced(MODEL1_STORE_OP, None, cache=cache, entries=entries, slots=slots, page_size=page_size,
                       offsets=offsets, errors=errors)
    _store(R.MODEL1, K.MODEL1_STORE, (), R.model1_write, cache, entries, slots, page_size, offsets, errors,
           stream, R.ENTRY_DIM, "entries")


def model1_window_insert(cache, rows, slot_mapping, *, page_size: int, errors=None, stream=None):
    """The sliding-window insert: token rows (N, 512) (RMSNormed + RoPEd)
    into MODEL1 window pages by slot mapping (N,) int32/int64 (vLLM's
    slot_mapping: page * page_size + offset, -1 skipped), in the entry
    format of model1_store. One launch."""
    if D.compiling():
        return _traced(MODEL1_WINDOW_INSERT_OP, None, cache=cache, rows=rows, slot_mapping=slot_mapping,
                       page_size=page_size, errors=errors)
    _store(R.MODEL1, K.MODEL1_STORE, (), R.model1_write, cache, rows, slot_mapping, page_size, None, errors,
           stream, R.ENTRY_DIM, "rows", "slot_mapping")


def index_fp8_store(cache, keys, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize indexer keys (N, 128) float32/bfloat16 into DeepGEMM's SM90
    paged FP8 layout (reference.index_fp8_write): 128 E4M3 codes and one
    FP32 scale 2^ceil(log2(max(amax, 1e-4) / 448)) per key (vLLM's rule).
    Addressing and errors as model1_store; a NaN/Inf key stores codes 0 and
    a NaN scale."""
    if D.compiling():
        return _traced(INDEX_FP8_STORE_OP, None, cache=cache, keys=keys, slots=slots, page_size=page_size,
                       offsets=offsets, errors=errors)
    _store(R.INDEX_FP8, K.INDEX_STORE, (False,), R.index_fp8_write, cache, keys, slots, page_size, offsets,
           errors, stream, R.INDEX_DIM, "keys")


def index_mxfp4_store(cache, keys, slots, *, page_size: int, offsets=None, errors=None, stream=None):
    """Quantize indexer keys (N, 128) float32/bfloat16 into DeepGEMM's SM100
    paged MXFP4 layout (reference.index_mxfp4_write): E2M1 in blocks of 32
    with UE8M0 scales 2^ceil(log2(max(amax, 6 * 2^-126) / 6)) (DeepSeek's
    fp4_act_quant), 4 scale bytes per key in one int32. Addressing and
    errors as model1_store; a NaN/Inf block stores codes 0, scale 0xFF."""
    if D.compiling():
        return _traced(INDEX_MXFP4_STORE_OP, None, cache=cache, keys=keys, slots=slots, page_size=page_size,
                       offsets=offsets, errors=errors)
    _store(R.INDEX_MXFP4, K.INDEX_STORE, (True,), R.index_mxfp4_write, cache, keys, slots, page_size,
           offsets, errors, stream, R.INDEX_DIM, "keys")


def _placement(x, name: str):
    """Device index of an array argument that decides where an op runs
    (None: the host), and the argument as a CUDA tensor there."""
    if D.is_cuda_tensor(x):
        return x, x.get_device()
    A.require_array(x, name)
    if D.placement((name, x)) == "cuda":
        x = D.as_cuda_tensor(x, name)
        return x, x.get_device()
    return x, None


def model1_gather(cache, indices, *, page_size: int, out=None, dtype=None, errors=None, stream=None):
    """MODEL1 entries at FlashMLA indices (any shape, int32: page *
    page_size + offset) back to rows (*indices.shape, 512) of `dtype`
    (bfloat16 default, float16, float32): e4m3(code) * 2^(byte - 127) in
    float32, RoPE dims as stored, rounded to dtype (reference.model1_gather).
    -1: zero row; an index outside [0, num_pages * page_size): zero row,
    errors += 1. One launch (one warp per row), capturable with out=."""
    if D.compiling():
        return _traced(MODEL1_GATHER_OP, _traced_out(out, dtype, (*indices.shape, R.ENTRY_DIM), cache),
                       cache=cache, indices=indices, page_size=page_size, errors=errors)
    p = C.host_int("page_size", page_size, 1)
    c, n, dev = _cache_arg(cache, R.MODEL1, p)
    name = C.out_dtype(dtype, out)
    idx = C.arg(indices, "indices", C.I32, dev)
    shape = tuple(idx.shape) + (R.ENTRY_DIM,)
    out = C.check_out(out, name, dev, shape=shape)
    err = C.errors_arg(errors, None, dev)
    A.check_outputs((("out", out), ("errors", errors)), (("cache", c), ("indices", idx)))
    if dev is None:
        rows, bad = R.model1_gather(c, p, idx, name)
        if err is not None:
            C.add_errors(err, bad)
        return D.from_numpy(rows, indices, torch_dtype=name, out=out)
    rows = idx.numel()
    C.check_launch_rows("indices", rows)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty(shape, C.torch_dtype(name), stream=stream)
    if rows:
        grid, block = rt.grid_stride(rows * 32, K.BLOCK)
        K.MODEL1_GATHER.instance(out.dtype).launch(
            rt, (grid,), (block,), stream=stream, cache=c, indices=idx, out=out, errors=err, R=rows,
            num_pages=n, page_size=p, page_bytes=R.MODEL1.page_bytes(p))
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
    if D.compiling():
        return _traced(TOPK_TO_KVCACHE_OP, _traced_out(out, "int32", topk_ids.shape, topk_ids),
                       topk_ids=topk_ids, block_table=block_table, page_size=page_size, num_pages=num_pages,
                       slots=slots, n_entries=n_entries, errors=errors)
    p = C.host_int("page_size", page_size, 1)
    npg = C.host_int("num_pages", num_pages, 1)
    if npg * p > R.INDEX_LIMIT:
        raise ValueError(f"num_pages: {npg} pages of {p} entries exceed the int32 index range (2^31 - 1)")
    ids, dev = _placement(topk_ids, "topk_ids")
    ids = C.arg(ids, "topk_ids", C.IDS, dev)
    if ids.ndim not in (2, 3):
        raise ValueError(f"topk_ids: expected (B, K) or (B, S, K), got shape {tuple(ids.shape)}")
    table = C.arg(block_table, "block_table", C.I32, dev, ndim=2)
    B = ids.shape[0]
    s = C.opt(slots, "slots", C.I32, dev, shape=(B,))
    ne = C.opt(n_entries, "n_entries", C.I32, dev, shape=(B,))
    if s is None and table.shape[0] < B:
        raise ValueError(f"block_table: {table.shape[0]} rows for {B} requests; pass slots=")
    if table.shape[1] * p >= 2 ** 31:
        raise ValueError(f"block_table: {table.shape[1]} blocks of {p} entries exceed the int32 id range")
    if out is not None:
        out = C.arg(out, "out", C.I32, dev, shape=tuple(ids.shape))
    err = C.errors_arg(errors, None, dev)
    A.check_outputs((("out", out), ("errors", errors)), (("topk_ids", ids), ("block_table", table), ("slots", s), ("n_entries", ne)))
    if dev is None:
        res, bad = R.topk_to_kvcache_indices(ids, table, p, npg, s, ne)
        if err is not None:
            C.add_errors(err, bad)
        return D.from_numpy(res, topk_ids, out=out)
    total = ids.numel()
    C.check_launch_rows("topk_ids", total)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty(tuple(ids.shape), C.torch_dtype("int32"), stream=stream)
    if total:
        grid, block = rt.grid_stride(total, K.BLOCK)
        K.TOPK_TO_KVCACHE.instance(ids.dtype).launch(
            rt, (grid,), (block,), stream=stream, ids=ids, table=table, slots=s, n_entries=ne, out=out,
            errors=err, B=B, per_row=total // B, table_rows=table.shape[0], max_blocks=table.shape[1],
            num_pages=npg, page_size=p)
    return out


def _traced_out(out, dtype, shape, like):
    """Under torch.compile: `out`, or a new tensor of `shape` and `dtype`
    (bfloat16 by default, as eager) on `like`'s device."""
    import torch
    t = out.dtype if dtype is None and out is not None else \
        torch.bfloat16 if dtype is None else getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if out is None:
        return torch.empty(shape, dtype=t, device=like.device)
    if out.dtype != t:
        raise TypeError(f"out: dtype {out.dtype} is not the dtype asked for ({t})")
    return out


def _traced(op, out, **inputs):
    """Under torch.compile: the rawkv:: operator (rawkv.library), which
    dynamo can put in a graph; returns what the eager op returns."""
    import torch
    if out is None:
        op.call(torch, **inputs)
    else:
        op.call(torch, **inputs, out=out)
    return out


# The operators. Their arguments are the public ops' keywords, so each
# public op is its own implementation (the dtype of a gather is out's).
_STORE = "Tensor(a!) cache, Tensor {rows}, Tensor {slots}, int page_size, {offsets}Tensor(b!)? errors"
MODEL1_STORE_OP = OpDecl("kv_model1_store", model1_store,
                         _STORE.format(rows="entries", slots="slots", offsets="Tensor? offsets, "))
MODEL1_WINDOW_INSERT_OP = OpDecl("kv_model1_window_insert", model1_window_insert,
                                 _STORE.format(rows="rows", slots="slot_mapping", offsets=""))
INDEX_FP8_STORE_OP = OpDecl("kv_index_fp8_store", index_fp8_store,
                            _STORE.format(rows="keys", slots="slots", offsets="Tensor? offsets, "))
INDEX_MXFP4_STORE_OP = OpDecl("kv_index_mxfp4_store", index_mxfp4_store,
                              _STORE.format(rows="keys", slots="slots", offsets="Tensor? offsets, "))
MODEL1_GATHER_OP = OpDecl("kv_model1_gather", model1_gather,
                          "Tensor cache, Tensor indices, int page_size, Tensor(a!) out, Tensor(b!)? errors")
TOPK_TO_KVCACHE_OP = OpDecl("kv_topk_to_kvcache_indices", topk_to_kvcache_indices,
                            "Tensor topk_ids, Tensor block_table, int page_size, int num_pages, Tensor? slots, "
                            "Tensor? n_entries, Tensor(a!) out, Tensor(b!)? errors")
