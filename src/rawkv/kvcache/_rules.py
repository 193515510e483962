"""Argument rules of the KV-cache ops (the generic ones, one function per
kind of argument, are rawkv._args): the same on CPU and CUDA pools, states
and caches.

An op on a pool or decode state runs where the object lives (`placed`: its
arrays must be there too, A.placement's rule), an op on a bare cache where
its arrays live. Every array argument is checked once, by rawkv._args.tensor
through `arg`: dtype (names as torch spells them), dimensions, shape, device,
contiguity and the alignment the kernel needs, so code that runs on a CPU
pool runs on a CUDA one. numpy has no bfloat16: a bfloat16 argument given as
a numpy array is float32 holding BF16 values (the reference's convention);
a torch tensor has the CUDA dtypes on both placements. Errors name the
argument and are raised before anything is launched or written.
"""
from __future__ import annotations

import numpy as np

from .. import _args as A
from ..kernels import kv_compress as KC
from ..reference.kvcache import layouts as RL
from ..reference.kvcache.constants import ROPE_DIM
from .pool import (
    PagedKVPool, check_bare_table, check_not_anothers, check_store_cache, check_view_cache, own_allocations,
)
from .state import DecodeState

BOOL = ("bool",)
I32 = ("int32",)
IDS = ("int32", "int64")
F32 = ("float32",)
BF16 = ("bfloat16",)
ROWS = ("float32", "bfloat16")
OUT = ("bfloat16", "float16", "float32")
U8 = ("uint8",)
CACHE = ("uint8", "float8_e4m3fn")             # a layout cache's bytes
# the first byte of a layout cache, as its kernel loads it
CACHE_ALIGN = {"model1": 16, "index_fp8": 4, "index_mxfp4": 4, "index_mxfp8": 4}
# the first byte of a cache an engine's view shows, as the engine loads it (docs/kvcache.md, "DeepGEMM
# compatibility per architecture"): DeepGEMM reads key pages through TMA descriptors (cuTensorMapEncodeTiled
# takes a 16-byte-aligned global address), FlashMLA MODEL1 records by 16-byte loads (SM90) and TMA (SM100,
# which asserts the 16-byte base); the stores' own rule (CACHE_ALIGN) is the kernels' need only
VIEW_ALIGN = 16


# ---- the objects and host ints --------------------------------------------------------------
def pool(p) -> None:
    """The one test of "is this a pool" of every op taking one."""
    if not isinstance(p, PagedKVPool):
        raise TypeError(f"pool: expected a rawkv.kvcache.PagedKVPool, got {type(p).__name__}")


def state(s, name: str = "state") -> None:
    if not isinstance(s, DecodeState):
        raise TypeError(f"{name}: expected a rawkv.kvcache.DecodeState, got {type(s).__name__}")


def host_int(name: str, v, lo: int, hi: int | None = None) -> int:
    """A host int argument in [lo, hi) (a NumPy one as the int it holds,
    traced by torch.compile too: rawkv._args.as_number)."""
    v = A.as_number(v)
    if not A.is_int(v):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v >= hi):
        raise ValueError(f"{name}: {v} is out of range [{lo}, {hi if hi is not None else 'inf'})")
    return int(v)


def launch_rows(name: str, n: int) -> None:
    """The kernels index one launch's rows in 32 bits."""
    if n >= 2 ** 31:
        raise ValueError(f"{name}: {n} output rows/blocks; at most 2^31 - 1 per launch")


# ---- placement and array arguments -----------------------------------------------------------
def placed(obj, name: str, *named) -> tuple:
    """(where, dev) of an op on a pool or state `obj` (`name`: 'pool' or
    'state'): where it lives, which every array of the (name, array) pairs
    `named` must share (A.placement: 'x: is on cpu but pool is on cuda'),
    and the device index A.tensor compares (-1: the host)."""
    anchor = obj.block_table if isinstance(obj, PagedKVPool) else obj.count
    where = A.placement((name, anchor), *named)
    return where, (obj.device_index if obj.is_cuda else -1)


def arg(x, name: str, dtypes: tuple, where: str, dev: int, *, shape=None, ndim=None, align: int = 1):
    """Array argument `name` (A.tensor: dtype, shape, device, C-contiguous,
    `align`-byte first element), of exactly `ndim` dimensions if given. A
    numpy array stands for bfloat16 as float32."""
    if "bfloat16" in dtypes and "float32" not in dtypes and isinstance(x, np.ndarray):
        dtypes = dtypes + F32
    x = A.tensor(x, name, dtypes, where, shape=shape, device=dev, align=align)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def opt(x, name: str, dtypes: tuple, where: str, dev: int, **kw):
    """arg() for an optional argument: None stays None."""
    return None if x is None else arg(x, name, dtypes, where, dev, **kw)


# ---- the counter and the outputs --------------------------------------------------------------
def own_counter(obj, errors) -> bool:
    """`errors` is obj's own counter: the object's array, its torch view
    (what a public op passes its operator) or the same memory."""
    mine = obj.errors
    return errors is mine or errors is obj.operator_buffers()[-1] or A.same_memory(errors, mine)


def owned(obj, name: str) -> tuple:
    """check_outputs' `owned` for a pool / state (`name`: 'pool' or 'state'):
    the spans of its buffers, named 'pool.written' etc. The buffers are
    fixed when the object is built (ErrorCounter.__setattr__), so their
    spans are made once per object, not on every call."""
    sp = obj.__dict__.get("_owned")
    if sp is None:
        sp = A.spans((f"{name}.{b}", getattr(obj, b)) for b in obj.BUFFERS)
        obj._owned = sp
    return sp


def owned_but_counter(obj, name: str) -> tuple:
    """owned() without the object's own counter: what its own counter is
    checked against (it is one of the object's buffers, and the op writes
    it), made once per object as owned() is."""
    sp = obj.__dict__.get("_owned_but_counter")
    if sp is None:
        sp = tuple(o for o in owned(obj, name) if o[0] != f"{name}.errors")
        obj._owned_but_counter = sp
    return sp


def outputs(obj, name: str, errors, where: str, dev: int, outs=(), inputs=(), writes: bool = False):
    """The counter an op on obj adds to, checked with the op's other
    outputs `outs` against its inputs and obj's buffers (check_outputs): obj's
    own counter as it is, another one an int32 array of at least one
    element on obj's device (A.counter). Returns the counter. Either one is
    checked against the inputs: on the operators' path (views.pool_view /
    state_view) the object's counter is the caller's `errors`, which may be
    a view of `slots` or `positions` (the op would add its count into them).
    `writes`: the op writes obj's buffers, so no input may lie in them
    (A.check_reads_apart; a gather only reads them)."""
    mine = own_counter(obj, errors)
    own = owned_but_counter(obj, name) if mine else owned(obj, name)
    A.check_outputs(((*outs, ("errors", errors))), inputs, own, reads_apart=writes)
    check_not_anothers((*outs, ("errors", None if mine else errors)), obj)
    return errors if mine else A.counter(errors, where, dev)


def add_errors(errors, n: int) -> None:
    """errors[0] += n on a host counter (numpy array or CPU tensor)."""
    if n:
        errors[(0,) * errors.ndim] += int(n)


# ---- gather outputs ------------------------------------------------------------------------------
# torch dtype -> name, of the output dtypes seen (the hot path reads out.dtype)
_OUT_NAMES: dict = {}


def out_dtype(dtype, out) -> str:
    """Name of a gather's output dtype (the public op's `dtype`): `dtype`,
    else a torch out's dtype, else bfloat16 (a numpy out holds bfloat16 in
    float32). An out of another dtype than `dtype` is refused, naming out."""
    if dtype is None:
        if out is None:
            return "bfloat16"
        name = _OUT_NAMES.get(getattr(out, "dtype", None))
        if name is not None:
            return name
        if not A.is_torch(out):
            name = "bfloat16"
            _agrees(name, out)
            return name
        dtype = out.dtype
        given = "out"                     # (the dtype is out's: a wrong one is out's error)
    else:
        given = "dtype"
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if name not in OUT:
        raise TypeError(f"{given}: expected bfloat16, float16 or float32, got {dtype!r}")
    if not isinstance(dtype, str) and A.is_torch(out):
        _OUT_NAMES[dtype] = name
    if out is not None:
        _agrees(name, out)
    return name


def _out_dtypes(name: str, out) -> tuple:
    """What an out of dtype `name` may be: a numpy one holds bfloat16 in float32."""
    return (name, "float32") if name == "bfloat16" and isinstance(out, np.ndarray) else (name,)


def _agrees(name: str, out) -> None:
    d = getattr(out, "dtype", None)
    if d is None:
        return                  # not an array: the op refuses it by name
    allowed = _out_dtypes(name, out)
    got = A.dtype_name(out)
    if got not in allowed:
        raise TypeError(f"out: dtype {got} is not supported (expected {', '.join(allowed)})")


def out_arg(out, dtype, where: str, dev: int, shape=None, ndim=None):
    """A gather's out: of `dtype` (the public op's name; None: out's own,
    one of OUT), `shape` or `ndim`, 16-byte aligned (the kernels store rows
    in 16-byte words). Returns (out, dtype name)."""
    allowed = OUT if dtype is None else _out_dtypes(dtype, out)
    out = arg(out, "out", allowed, where, dev, shape=shape, ndim=ndim, align=16)
    return out, dtype or A.dtype_name(out)


# ---- layout caches -------------------------------------------------------------------------------
def layout_of(layout) -> RL.SplitLayout:
    """A layout by name ('model1', 'index_fp8', 'index_mxfp4', 'index_mxfp8') or itself."""
    if isinstance(layout, RL.SplitLayout):
        return layout
    try:
        return RL.LAYOUTS[layout]
    except (KeyError, TypeError):
        raise ValueError(f"layout: expected one of {sorted(RL.LAYOUTS)}, got {layout!r}") from None


def cache(c, lay: RL.SplitLayout, page_size: int, where: str, align: int | None = None):
    """(cache, num_pages) of a layout cache: uint8 (or float8_e4m3fn)
    bytes whose first dimension is the page, page_bytes apart, each page
    showing its records (records_bytes: every byte of the page but its
    padding) contiguously, its first byte aligned as the layout's kernel
    loads it (or to `align` bytes: an engine's view checks its engine's
    alignment itself, view_aligned): a (num_pages, page_bytes) array or
    an engine's view of one (flashmla_view / deepgemm_view). A numpy cache is C-contiguous (numpy
    does not say how far its memory reaches).

    A torch cache must show its records, not merely lie in memory holding
    them: under torch.compile a written cache reaches the op as a copy of
    the bytes it shows (functionalization's clone, copied back over the
    cache after the op), so a slice of each page (cache[:, :8]) lost the
    records past it, and flashmla_view, which shows no padding, came as a
    copy ending at the last page's records, which the rule of the whole
    last page (until helper 81) refused ('... over 8096 bytes') where the
    eager op took it. The padding is never read or written by an op."""
    c = A.tensor(c, "cache", CACHE, where, min_ndim=1, dense=isinstance(c, np.ndarray),
                 align=CACHE_ALIGN[lay.name] if align is None else align)
    pb = lay.page_bytes(page_size)
    n = c.shape[0]
    if isinstance(c, np.ndarray):
        if c.size != n * pb:
            raise ValueError(f"cache: a {lay.name} page of {page_size} records is {pb} bytes; "
                             f"got shape {c.shape}")
    else:
        st = tuple(c.stride())
        if st[-1] != 1:
            raise ValueError(f"cache: expected pages along dimension 0 and bytes contiguous, got shape "
                             f"{tuple(c.shape)} strides {st}")
        if st[0] != pb:
            raise ValueError(f"cache: a {lay.name} page of {page_size} records is {pb} bytes (the page "
                             f"stride); got shape {tuple(c.shape)} strides {st}")
        rec = records_bytes(lay, page_size)
        shown = _page_shown(tuple(c.shape), st)
        if n and (shown is None or shown < rec):
            raise ValueError(f"cache: a {lay.name} page of {page_size} records holds them in its first {rec} "
                             f"bytes, which a cache shows contiguously (the op writes whole records: a "
                             f"compiled op only the bytes its cache shows); got shape {tuple(c.shape)} "
                             f"strides {st}: pass the pages, flashmla_view or deepgemm_view")
    if n * page_size > RL.INDEX_LIMIT:
        raise ValueError(f"cache: {n} pages of {page_size} records exceed the int32 slot range "
                         "(2^31 - 1)")
    return c, n


def view_aligned(c, engine: str) -> None:
    """The first byte of a checked cache an engine's view shows lies on a
    VIEW_ALIGN boundary (`engine`: why that engine needs it), on CPU and
    CUDA alike, a numpy cache's address as a tensor's; a cache of no bytes
    is not checked (no engine reads it; A.tensor's rule). The stores take
    the cache their kernels can write (CACHE_ALIGN: 4 bytes for the keys),
    whose bytes a fresh copy hands to the engine; the view is what the
    engine reads in place. ValueError naming cache."""
    addr = A.address(c)
    if addr % VIEW_ALIGN and A.numel(c):
        raise ValueError(f"cache: starts at address {addr:#x}, not {VIEW_ALIGN}-byte aligned (address % {VIEW_ALIGN} "
                         f"== {addr % VIEW_ALIGN}); {engine}: pass a {VIEW_ALIGN}-byte-aligned cache "
                         "(new_layout_cache, a pool's buffers, or a fresh copy: .clone(), numpy .copy())")


def records_bytes(lay: RL.SplitLayout, page_size: int) -> int:
    """The bytes of a page holding its records (data, then scales): all
    of page_bytes but the padding (MODEL1's, to a multiple of 576; the
    MXFP8 key's, to a multiple of 512)."""
    return page_size * (lay.data_bytes + lay.scale_bytes)


def _page_shown(shape: tuple, strides: tuple):
    """Elements one page of a cache shows (its dimensions after the first),
    when they are C-contiguous (size-1 dimensions' strides aside, as
    torch's is_contiguous: flashmla_view's (P, 1, 584)); None otherwise."""
    want = 1
    for d, s in zip(reversed(shape[1:]), reversed(strides[1:])):
        if d != 1 and s != want:
            return None
        want *= d
    return want


def whole_pages(c, n: int, lay: RL.SplitLayout, page_size: int):
    """A checked cache as the memory its op reads or writes: the records of
    its n pages, page_bytes apart. A view of the pages may show a page's
    records in any shape (flashmla_view); the kernels move whole records;
    the overlap checks (check_outputs) compare this. A page's padding is
    not compared: no op reads or writes it (and a compiled op's copy of a
    view may end before the last page's)."""
    if isinstance(c, np.ndarray) or n == 0:
        return c                    # (a numpy cache is C-contiguous: its bytes are the pages)
    return c.as_strided((n, records_bytes(lay, page_size)), (lay.page_bytes(page_size), 1))


def cache_pages(c, n: int, lay: RL.SplitLayout, page_size: int) -> np.ndarray:
    """A checked host cache as the numpy (num_pages, page_bytes) array the
    reference writes, sharing its memory. A torch cache's memory may end
    at its last page's records (a compiled op's copy of flashmla_view):
    the array is made over its records with numpy's unchecked as_strided,
    so the last page's padding may lie past the memory, where the
    reference, which reads and writes records only (page_write /
    page_read), never goes."""
    pb = lay.page_bytes(page_size)
    if isinstance(c, np.ndarray):
        return c.reshape(n, pb)
    import torch
    flat = c.view(torch.uint8) if c.dtype != torch.uint8 else c
    recs = flat.as_strided((n, records_bytes(lay, page_size)), (pb, 1)).numpy()
    return np.lib.stride_tricks.as_strided(recs, (n, pb), (pb, 1))


# ---- one function per layout op ------------------------------------------------------------------
def store(lay, cache_, rows, slots, page_size, offsets, errors, width: int, name: str, slots_name: str):
    """(where, cache, num_pages, page_size, rows, slots, offsets, errors)
    of a layout store: rows (N, width) float32 / bfloat16 (`name`), slots
    (N,) int32 / int64 (`slots_name`), offsets (N,) int32 or None, errors
    a counter or None."""
    p = host_int("page_size", page_size, 1)
    inputs = ((name, rows), (slots_name, slots), ("offsets", offsets))
    where = A.placement(("cache", cache_), *inputs, ("errors", errors))
    c, n = cache(cache_, lay, p, where)
    pages = whole_pages(c, n, lay, p)
    A.check_outputs((("cache", pages), ("errors", errors)), inputs)
    # the cache may be a pool's pages (index_pages for the keys): what it stores into; no other buffer
    check_store_cache(pages, "pages" if lay is RL.MODEL1 else "index_pages", lay, p)
    check_not_anothers((("errors", errors),))
    dev = A.device_of(c)
    x = arg(rows, name, ROWS, where, dev, ndim=2, align=16)
    N = x.shape[0]
    if x.shape[1] != width:
        raise ValueError(f"{name}: expected shape ({N}, {width}), got {tuple(x.shape)}")
    s = arg(slots, slots_name, IDS, where, dev, shape=(N,), align=A.ELEMENT)
    o = opt(offsets, "offsets", I32, where, dev, shape=(N,), align=A.ELEMENT)
    err = None if errors is None else A.counter(errors, where, dev)
    return where, c, n, p, x, s, o, err


def model1_gather(cache_, indices, page_size, out, errors, dtype):
    """(where, cache, num_pages, page_size, indices, out, dtype name,
    errors) of model1_gather: indices int32 of any shape, out
    (*indices.shape, 512); a cache in a pool's buffer is its pages, in its
    geometry (check_view_cache)."""
    p = host_int("page_size", page_size, 1)
    where = A.placement(("cache", cache_), ("indices", indices), ("out", out), ("errors", errors))
    c, n = cache(cache_, RL.MODEL1, p, where)
    pages = whole_pages(c, n, RL.MODEL1, p)
    # a cache in a pool's buffer is its pages, from a page's first byte (the
    # rule of flashmla_view, whose records FlashMLA reads as this op does):
    # its index_pages or marks as MODEL1 pages, or its pages from a byte
    # inside a page, were decoded as garbage rows with no error
    check_view_cache(pages, RL.MODEL1, p, "model1_gather", "reads")
    A.check_outputs((("out", out), ("errors", errors)), (("cache", pages), ("indices", indices)))
    check_not_anothers((("out", out), ("errors", errors)))
    dev = A.device_of(c)
    idx = arg(indices, "indices", I32, where, dev, align=A.ELEMENT)
    out, name = out_arg(out, dtype, where, dev, shape=(*idx.shape, RL.ENTRY_DIM))
    err = None if errors is None else A.counter(errors, where, dev)
    launch_rows("indices", A.numel(idx))
    return where, c, n, p, idx, out, name, err


def topk_bridge(topk_ids, block_table, page_size, num_pages, slots, n_entries, out, errors):
    """(where, ids, table, page_size, num_pages, slots, n_entries, out,
    errors) of topk_to_kvcache_indices: ids (B, K) or (B, S, K) int32 /
    int64, table (R, max_blocks) int32, slots / n_entries (B,) int32 or
    None, out int32 of ids' shape."""
    p = host_int("page_size", page_size, 1)
    npg = host_int("num_pages", num_pages, 1)
    if npg * p > RL.INDEX_LIMIT:
        raise ValueError(f"num_pages: {npg} pages of {p} entries exceed the int32 index range (2^31 - 1)")
    inputs = (("topk_ids", topk_ids), ("block_table", block_table), ("slots", slots), ("n_entries", n_entries))
    where = A.placement(*inputs, ("out", out), ("errors", errors))
    A.check_outputs((("out", out), ("errors", errors)), inputs)
    check_not_anothers((("out", out), ("errors", errors)))
    if block_table is not None and not A.is_number(block_table):
        check_bare_table(block_table)       # (a pool's table: kvcache_indices is its bridge)
    ids = arg(topk_ids, "topk_ids", IDS, where, None, align=A.ELEMENT)
    if ids.ndim not in (2, 3):
        raise ValueError(f"topk_ids: expected (B, K) or (B, S, K), got shape {tuple(ids.shape)}")
    dev = A.device_of(ids)
    table = arg(block_table, "block_table", I32, where, dev, ndim=2, align=A.ELEMENT)
    B = ids.shape[0]
    s = opt(slots, "slots", I32, where, dev, shape=(B,), align=A.ELEMENT)
    ne = opt(n_entries, "n_entries", I32, where, dev, shape=(B,), align=A.ELEMENT)
    if s is None and table.shape[0] < B:
        raise ValueError(f"block_table: {table.shape[0]} rows for {B} requests; pass slots=")
    if table.shape[1] * p >= 2 ** 31:
        raise ValueError(f"block_table: {table.shape[1]} blocks of {p} entries exceed the int32 id range")
    out = arg(out, "out", I32, where, dev, shape=tuple(ids.shape), align=A.ELEMENT)
    err = None if errors is None else A.counter(errors, where, dev)
    launch_rows("topk_ids", A.numel(ids))
    return where, ids, table, p, npg, s, ne, out, err


# ---- one function per decode-state op ------------------------------------------------------------
def state_seed(st, slot, kv, z, ape):
    """(where, slot, kv, z, ape) of state_seed: slot a host int in
    [0, max_requests), kv / z (T, width) float32 / bfloat16, ape (m,
    width) float32 or None."""
    slot = host_int("slot", slot, 0, st.max_requests)
    where, dev = placed(st, "state", ("kv", kv), ("z", z), ("ape", ape))
    k = arg(kv, "kv", ROWS, where, dev, ndim=2)
    if k.shape[1] != st.width:
        raise ValueError(f"kv: expected shape (T, {st.width}), got {tuple(k.shape)}")
    zz = arg(z, "z", ROWS, where, dev, shape=tuple(k.shape))
    a = opt(ape, "ape", F32, where, dev, shape=(st.m, st.width))
    A.check_reads_apart((("kv", k), ("z", zz), ("ape", a)), owned(st, "state"))
    return where, slot, k, zz, a


def state_append(st, errors, kv, z, valid_mask, slots, ape):
    """(where, kv, z, valid_mask, slots, ape, errors) of state_append: kv,
    z (B, width) float32 / bfloat16 and ape (m, width) float32 or None,
    16-byte aligned (float4 loads), valid_mask (B,) bool, slots (B,) int32."""
    inputs = (("kv", kv), ("z", z), ("valid_mask", valid_mask), ("slots", slots), ("ape", ape))
    where, dev = placed(st, "state", *inputs, ("errors", errors))
    w = st.width
    k = arg(kv, "kv", ROWS, where, dev, ndim=2, align=16)
    B = k.shape[0]
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape ({B}, {w}), got {tuple(k.shape)}")
    launch_rows("kv", B)            # (one CTA per row: the grid's x dimension)
    zz = arg(z, "z", ROWS, where, dev, shape=(B, w), align=16)
    v = arg(valid_mask, "valid_mask", BOOL, where, dev, shape=(B,))
    s = arg(slots, "slots", I32, where, dev, shape=(B,), align=A.ELEMENT)     # (int32 loads)
    a = opt(ape, "ape", F32, where, dev, shape=(st.m, w), align=16)
    errors = outputs(st, "state", errors, where, dev,
                     inputs=(("kv", k), ("z", zz), ("valid_mask", v), ("slots", s), ("ape", a)), writes=True)
    return where, k, zz, v, s, a, errors


def state_reset(st, mode_name: str, errors, valid_mask, slots):
    """(where, valid_mask, slots, errors) of csa_rotate / hca_reset /
    state_clear (`mode_name`): slots (B,) int32, valid_mask (B,) bool
    (state_clear: or None, every row). csa_rotate takes a CSA state,
    hca_reset an HCA one."""
    if mode_name == "csa_rotate" and not st.overlap:
        raise ValueError("state: csa_rotate needs a CSA state (use hca_reset for HCA)")
    if mode_name == "hca_reset" and st.overlap:
        raise ValueError("state: hca_reset needs an HCA state (use csa_rotate for CSA)")
    if valid_mask is None and mode_name != "state_clear":
        raise TypeError("valid_mask: is required")
    inputs = (("slots", slots), ("valid_mask", valid_mask))
    where, dev = placed(st, "state", *inputs, ("errors", errors))
    s = arg(slots, "slots", I32, where, dev, ndim=1, align=A.ELEMENT)         # (int32 loads)
    launch_rows("slots", s.shape[0])    # (one CTA per row: the grid's x dimension)
    v = opt(valid_mask, "valid_mask", BOOL, where, dev, shape=(s.shape[0],))
    errors = outputs(st, "state", errors, where, dev, inputs=(("slots", s), ("valid_mask", v)), writes=True)
    return where, v, s, errors


# ---- one function per paged-pool op --------------------------------------------------------------
def flush_write(p, errors, entries, valid_mask, slots, positions, index_keys):
    """(where, entries, valid_mask, slots, positions, index_keys, errors) of
    flush_write: entries (B, head_dim) bfloat16, valid_mask (B,) bool, slots
    and positions (B,) int32, index_keys (B, index_head_dim) bfloat16
    exactly for a pool with indexer keys; the rows 16-byte aligned."""
    inputs = (("entries", entries), ("valid_mask", valid_mask), ("slots", slots), ("positions", positions),
              ("index_keys", index_keys))
    where, dev = placed(p, "pool", *inputs, ("errors", errors))
    e = arg(entries, "entries", BF16, where, dev, ndim=2, align=16)
    B = e.shape[0]
    if e.shape[1] != p.head_dim:
        raise ValueError(f"entries: expected shape ({B}, {p.head_dim}), got {tuple(e.shape)}")
    v = arg(valid_mask, "valid_mask", BOOL, where, dev, shape=(B,))
    s = arg(slots, "slots", I32, where, dev, shape=(B,), align=A.ELEMENT)
    pos = arg(positions, "positions", I32, where, dev, shape=(B,), align=A.ELEMENT)
    if p.has_index:
        if index_keys is None:
            raise ValueError("index_keys: required for a CSA pool with indexer keys")
        k = arg(index_keys, "index_keys", BF16, where, dev, shape=(B, p.index_head_dim), align=16)
    elif index_keys is not None:
        raise ValueError("index_keys: this pool has no indexer keys (HCA, or index_head_dim=None)")
    else:
        k = None
    errors = outputs(p, "pool", errors, where, dev, inputs=(
        ("entries", e), ("valid_mask", v), ("slots", s), ("positions", pos), ("index_keys", k)), writes=True)
    return where, e, v, s, pos, k, errors


def assign_pages(p, errors, slots, blocks):
    """(where, slots, blocks, errors) of assign_pages: slots, blocks (B,) int32."""
    where, dev = placed(p, "pool", ("slots", slots), ("blocks", blocks), ("errors", errors))
    s = arg(slots, "slots", I32, where, dev, ndim=1, align=A.ELEMENT)
    b = arg(blocks, "blocks", I32, where, dev, shape=(s.shape[0],), align=A.ELEMENT)
    errors = outputs(p, "pool", errors, where, dev, inputs=(("slots", s), ("blocks", b)), writes=True)
    launch_rows("blocks", s.shape[0])
    return where, s, b, errors


def topk(p, errors, slots, topk_ids, n_entries, valid_mask, out, dtype=None, rows: bool = True):
    """(where, ids, slots, n_entries, valid_mask, out, dtype name, errors)
    of gather_topk (`rows`: out (B, K, head_dim) of `dtype`, out_arg) and
    kvcache_indices (out (B, K) int32): topk_ids (B, K) int32 / int64,
    slots (B,) int32, n_entries (B,) int32 or None, valid_mask (B,) bool
    or None."""
    inputs = (("slots", slots), ("topk_ids", topk_ids), ("n_entries", n_entries), ("valid_mask", valid_mask))
    where, dev = placed(p, "pool", *inputs, ("out", out), ("errors", errors))
    ids = arg(topk_ids, "topk_ids", IDS, where, dev, ndim=2, align=A.ELEMENT)
    B, k = ids.shape
    s = arg(slots, "slots", I32, where, dev, shape=(B,), align=A.ELEMENT)
    ne = opt(n_entries, "n_entries", I32, where, dev, shape=(B,), align=A.ELEMENT)
    v = opt(valid_mask, "valid_mask", BOOL, where, dev, shape=(B,))
    if rows:
        out, name = out_arg(out, dtype, where, dev, shape=(B, k, p.head_dim))
    else:
        out, name = arg(out, "out", I32, where, dev, shape=(B, k), align=A.ELEMENT), "int32"
    errors = outputs(p, "pool", errors, where, dev, (("out", out),), (
        ("slots", s), ("topk_ids", ids), ("n_entries", ne), ("valid_mask", v)))
    launch_rows("topk_ids", B * k)
    return where, ids, s, ne, v, out, name, errors


def index_width(p, index: bool):
    """Row width of a dense gather: head_dim, or (index) the indexer key's."""
    if not index:
        return p.head_dim
    if not p.has_index:
        raise ValueError("pool: has no indexer keys (not a CSA pool with index_head_dim)")
    return p.index_head_dim


def dense(p, errors, slot, n_entries, out, dtype, index: bool):
    """(where, slot, n, out, dtype name, errors) of gather_dense /
    gather_index_keys (`index`): slot and n_entries host ints, n_entries at
    most what the slot's prepared steps make (a pool object's count, which
    a view over its buffers reads; a view over an engine's own buffers has
    none), out (n, width)."""
    width = index_width(p, index)
    slot = host_int("slot", slot, 0, p.max_requests)
    # n is a host int, so it is checked against the host's count of the slot's
    # entries (0 for a free slot); the kernel still bounds by pool.written,
    # which also catches entries prepared but not yet flushed.
    n = host_int("n_entries", n_entries, 0)
    have = n if p._n_entries is None else int(p._n_entries[slot])
    if n > have:
        raise ValueError(f"n_entries: {n} entries asked of slot {slot}, which holds {have} after the "
                         "steps prepared so far (pool.n_entries); the rest would be bytes this "
                         "request never wrote")
    where, dev = placed(p, "pool", ("out", out), ("errors", errors))
    out, name = out_arg(out, dtype, where, dev, shape=(n, width))
    errors = outputs(p, "pool", errors, where, dev, (("out", out),))
    launch_rows("out", n * (p.index_head_dim // 16 if index else 1))
    return where, slot, n, out, name, errors


def dense_batch(p, errors, slots, n_entries, valid_mask, out, dtype, index: bool, max_entries=None):
    """(where, slots, n_entries, valid_mask, out, K, dtype name, errors) of
    gather_dense_batch / gather_index_keys_batch (`index`): slots,
    n_entries (B,) int32, valid_mask (B,) bool or None, out (B, K, width)
    (K = max_entries, the public op's, when given)."""
    width = index_width(p, index)
    inputs = (("slots", slots), ("n_entries", n_entries), ("valid_mask", valid_mask))
    where, dev = placed(p, "pool", *inputs, ("out", out), ("errors", errors))
    s = arg(slots, "slots", I32, where, dev, ndim=1, align=A.ELEMENT)
    B = s.shape[0]
    ne = arg(n_entries, "n_entries", I32, where, dev, shape=(B,), align=A.ELEMENT)
    v = opt(valid_mask, "valid_mask", BOOL, where, dev, shape=(B,))
    out, name = out_arg(out, dtype, where, dev, ndim=3)
    k = out.shape[1]
    if tuple(out.shape) != (B, k, width) or (max_entries is not None and k != max_entries):
        raise ValueError(f"out: expected shape ({B}, {max_entries if max_entries is not None else 'K'}, "
                         f"{width}), got {tuple(out.shape)}")
    errors = outputs(p, "pool", errors, where, dev, (("out", out),),
                     (("slots", s), ("n_entries", ne), ("valid_mask", v)))
    launch_rows("out", B * k * (p.index_head_dim // 16 if index else 1))
    return where, s, ne, v, out, k, name, errors


def is_size(v) -> bool:
    """A host int >= 0 (not a bool): a shape a public op may allocate."""
    return A.is_int(v) and v >= 0


# ---- the compressor ------------------------------------------------------------------------------
def compressible(p) -> None:
    """The pool geometries the kernel handles (a PagedKVPool accepts more)."""
    d = p.head_dim
    if d % KC.CHANNEL_THREADS or d > KC.MAX_HEAD_DIM:
        raise ValueError(f"pool: head_dim must be a multiple of {KC.CHANNEL_THREADS} and "
                         f"<= {KC.MAX_HEAD_DIM} for the compressor, got {d}")
    # DeepSeek-V4's compressor ropes exactly the last 64 dims of the entry
    # and of the indexer key (qk_rope_head_dim; docs/kvcache.md section 2,
    # "RoPE"): the reference is that definition, while the kernel would
    # rotate the pool's rope_dim, so any other value gave CPU != CUDA
    if p.rope_dim != ROPE_DIM:
        raise ValueError(f"pool: rope_dim must be {ROPE_DIM} for the compressor (DeepSeek-V4 ropes "
                         f"the last {ROPE_DIM} dims of each entry and indexer key), got {p.rope_dim}")
    if p.has_index and p.index_head_dim != KC.INDEX_HEAD_DIM:
        raise ValueError(f"pool: the compressor supports index_head_dim {KC.INDEX_HEAD_DIM} only, "
                         f"got {p.index_head_dim}")
    if p.kind == "csa" and 2 * p.m > KC.CHUNK_ROWS:
        raise ValueError(f"pool: CSA needs 2m <= {KC.CHUNK_ROWS} (the 2m rows are held in "
                         f"registers), got m = {p.m}")


def index_parts(index, cls) -> tuple:
    """The public op's `index` (a `cls`: PrefillIndex / DecodeIndex, or
    None) as its operator's arguments: its fields, all None for None."""
    if index is None:
        return (None,) * len(cls._fields)
    if not isinstance(index, tuple) or len(index) != len(cls._fields):
        raise TypeError(f"index: expected a {cls.__name__} ({', '.join(cls._fields)})")
    return tuple(index)


def index_of(p, parts: tuple, cls):
    """The indexer inputs from the operator's arguments `parts` (a `cls`,
    or None when all are None): required exactly for a pool with indexer
    keys."""
    index = None if all(x is None for x in parts) else cls(*parts)
    if p.has_index:
        if index is None:
            raise ValueError("index: required for a CSA pool with indexer keys "
                             f"({cls.__name__}(...))")
    elif index is not None:
        raise ValueError("index: only a CSA pool with indexer keys takes index inputs")
    return index


def _rows(x, name: str, dt: str, where: str, dev: int, shape):
    """Token rows of kv's dtype `dt`, exactly: the kernel reads every row
    as kv's, so a float32 numpy z beside a bfloat16 kv is refused too."""
    return A.tensor(x, name, (dt,), where, shape=shape, device=dev)


def compress_prefill(p, kv, z, ape, norm_weight, slot, start_entry, parts: tuple, eps, index_cls):
    """(where, slot, start_entry, eps, kv, z, ape, norm_weight, index) of
    compress_prefill: kv, z (T, coff * head_dim) float32 / bfloat16 (z:
    kv's), ape (m, coff * head_dim) float32 or None, norm_weight (head_dim,)
    float32, slot in [0, max_requests), start_entry in [0, 2^31), the index (an
    `index_cls` of rows (T, 256) of kv's dtype, ape (m, 256) and
    norm_weight (128,) float32) exactly for a pool with indexer keys."""
    compressible(p)
    d, m = p.head_dim, p.m
    w = (2 if p.kind == "csa" else 1) * d
    slot = host_int("slot", slot, 0, p.max_requests)
    # (below 2^31: an entry id, as the pool's tables hold them; the token
    # arithmetic entry * m stays far inside int64)
    start_entry = host_int("start_entry", start_entry, 0, 2 ** 31)
    eps = A.check_eps(eps)
    index = index_of(p, parts, index_cls)
    named = (("kv", kv), ("z", z), ("ape", ape), ("norm_weight", norm_weight))
    if index is not None:
        named += tuple((f"index.{f}", x) for f, x in zip(index_cls._fields, index))
    where, dev = placed(p, "pool", *named)
    k = arg(kv, "kv", ROWS, where, dev, ndim=2)
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape (T, {w}), got {tuple(k.shape)}")
    dt = A.dtype_name(k)
    zz = _rows(z, "z", dt, where, dev, tuple(k.shape))
    a = opt(ape, "ape", F32, where, dev, shape=(m, w))
    nw = arg(norm_weight, "norm_weight", F32, where, dev, shape=(d,))
    if index is not None:
        iw = 2 * KC.INDEX_HEAD_DIM
        index = index_cls(_rows(index.kv, "index.kv", dt, where, dev, (k.shape[0], iw)),
                          _rows(index.z, "index.z", dt, where, dev, (k.shape[0], iw)),
                          opt(index.ape, "index.ape", F32, where, dev, shape=(m, iw)),
                          arg(index.norm_weight, "index.norm_weight", F32, where, dev,
                              shape=(KC.INDEX_HEAD_DIM,)))
    read = (("kv", k), ("z", zz), ("ape", a), ("norm_weight", nw))
    if index is not None:
        read += tuple((f"index.{f}", x) for f, x in zip(index_cls._fields, index))
    A.check_reads_apart(read, owned(p, "pool"))
    return where, slot, start_entry, eps, k, zz, a, nw, index


def _state_of_pool(p, st, name: str, kind: str, head_dim: int) -> None:
    """A decode state that belongs to `p`: its kind and head_dim, one row
    per request slot of the pool (slots index the state AND the block
    table), on the pool's device."""
    state(st, name)
    if st.kind != kind:
        raise ValueError(f"{name}: is a {st.kind!r} state but the pool needs a {kind!r} one")
    if st.head_dim != head_dim:
        raise ValueError(f"{name}: has head_dim {st.head_dim}, expected {head_dim}")
    if st.max_requests != p.max_requests:
        raise ValueError(f"{name}: has {st.max_requests} slots but the pool has max_requests = "
                         f"{p.max_requests}; a decode state must have one row per request slot "
                         "of its pool")
    if st.device_index != p.device_index:
        raise ValueError(f"{name}: is on {st.device} but the pool is on {p.device}")


def _attached(p, st, name: str) -> None:
    """A pool object's decode state is attached to it (pool.attach), so its
    slots are emptied when they change owner. The kv_compress_decode
    operator's views are held to the same rule through the objects whose
    buffers they are over (views: pool.check_one_owner): over a
    pool's own buffers, the state's buffers must be those of a state
    attached to that pool (an unattached state, another pool's, or buffers
    that are no state's are refused, as eagerly). Over an engine's own pool
    buffers no pool object exists: its engine owns admission
    (docs/kvcache.md, "Admission", "What a view cannot check"). A state
    view over a DecodeState's own buffers is that state (pool.attach's rule)
    and a pool view over a pool's own buffers that pool, whatever the other
    argument is (until a review, a pool view of P given with the
    DecodeState object attached to P was refused as not attached, while P
    with that state, or the two views, were taken)."""
    if p._states is None:           # a pool view: the pool its buffers are, if any
        p = p._owner
        if p is None:
            return
    if st._owner is not None:       # a view over a state's own buffers: that state
        st = st._owner
    if st._pool is not p:
        raise ValueError(f"{name}: is not attached to this pool; call pool.attach(state) when the layer "
                         "is built (the pool then empties a slot's decode state when the slot changes "
                         "owner, so no request's entry is pooled from another's rows)")


def decode_states(p, st, index_state, index_norm_weight, index_cls):
    """compress_decode's objects, checked before the op reads their
    buffers: the index (an `index_cls` of `index_state` and
    `index_norm_weight`, index_of's rule), `st` of the pool's kind and
    head_dim and the index's state the CSA indexer's (head_dim 128), each
    with one row per request slot of the pool, on its device, and attached
    to it (a pool object's). Returns the index or None."""
    index = index_of(p, (index_state, index_norm_weight), index_cls)
    _state_of_pool(p, st, "state", p.kind, p.head_dim)
    if index is not None:
        _state_of_pool(p, index.state, "index.state", "csa", KC.INDEX_HEAD_DIM)
    _attached(p, st, "state")
    if index is not None:
        _attached(p, index.state, "index.state")
        _two_states(st, index.state)
    return index


def _two_states(st, ist) -> None:
    """The entry's and the indexer key's decode states are two states. One
    state given as both (a pool whose head_dim is the key's 128 passes
    every other check) had the key pooled from the entry's rows, written
    as the entry's key with no error. The same object (or a view of it)
    is refused, and views over an engine's own buffers are compared by
    their rows' and counts' memory (a pool's or state's own allocations lie
    apart). ValueError naming index.state."""
    a = st if st._owner is None else st._owner
    b = ist if ist._owner is None else ist._owner
    same = a is b
    if not same and not (own_allocations(st) and own_allocations(ist)):
        mine = [t for n, t in owned(st, "state") if n != "state.errors"]
        same = any(A._overlap(s, t) for n, s in owned(ist, "index.state") if n != "index.state.errors"
                   for t in mine)
    if same:
        raise ValueError("index.state: is the state's memory (the entry's decode state); the indexer's key "
                         "is pooled from its own DecodeState, which its own state_append fills")


def compress_decode(p, state, index, norm_weight, valid_mask, slots, positions, eps):
    """(where, eps, norm_weight, valid_mask, slots, positions, index
    norm_weight or None) of compress_decode (its objects and index:
    decode_states): valid_mask (B,) bool, slots and positions (B,) int32 or
    int64 (one dtype), norm_weight (head_dim,) float32, the index's
    (128,) float32. The op writes the pool (its entries, written and
    counter): none of these, nor the states it reads, may lie in the pool's
    buffers (positions=pool.written, or on the operators' path a counter
    that is a view of positions, would read what the op overwrites)."""
    compressible(p)
    eps = A.check_eps(eps)
    inw = None if index is None else index.norm_weight
    where, dev = placed(p, "pool", ("valid_mask", valid_mask), ("slots", slots), ("positions", positions),
                        ("norm_weight", norm_weight), ("index.norm_weight", inw))
    v = arg(valid_mask, "valid_mask", BOOL, where, dev, ndim=1)
    B = v.shape[0]
    launch_rows("valid_mask", B)    # (one CTA per row: the grid's x dimension)
    # (loaded element by element: aligned to their own size, A.ELEMENT)
    s = arg(slots, "slots", IDS, where, dev, shape=(B,), align=A.ELEMENT)
    pos = arg(positions, "positions", (A.dtype_name(s),), where, dev, shape=(B,), align=A.ELEMENT)
    nw = arg(norm_weight, "norm_weight", F32, where, dev, shape=(p.head_dim,))
    if index is not None:
        inw = arg(inw, "index.norm_weight", F32, where, dev, shape=(KC.INDEX_HEAD_DIM,))
    read = A.spans((("valid_mask", v), ("slots", s), ("positions", pos), ("norm_weight", nw),
                    ("index.norm_weight", inw)))
    # (a state's own allocations lie apart from the pool's: only a view over
    # an engine's own buffers is compared, which saves about 20 us a call)
    for obj, name in ((state, "state"), (None if index is None else index.state, "index.state")):
        if obj is not None and not own_allocations(obj):
            read += owned(obj, name)
    A.check_spans_apart(read, owned(p, "pool"))
    return where, eps, nw, v, s, pos, inw
