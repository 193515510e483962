"""The paged pool of one compressed KV layer (DeepSeek-V4 CSA or HCA).

    pool = PagedKVPool("csa", num_blocks=1024, entries_per_block=64,
                       max_requests=64, max_blocks_per_request=256)
    slot = pool.add_request()
    pool.prepare_step([slot], [position])     # host side, before a (captured) step
    ...                                       # flush_write / gather_* (rawkv.kvcache)
    pool.free_request(slot)

Device buffers (allocated once, in the constructor; docs/kvcache.md, "Paged
pool and kernels" and "Pool layouts"). layout="rawkv" (rawkv's own layout,
field by field):

    fp8         (num_blocks, epb, head_dim - rope_dim) uint8    E4M3 codes
    scale       (num_blocks, epb)                      float32  decode scale
    rope        (num_blocks, epb, rope_dim)            bfloat16 RoPE dims
    index_q     (num_blocks, epb, index_head_dim // 2) uint8    CSA only
    index_sf    (num_blocks, epb, index_head_dim // 16) uint8   CSA only

layout="model1" (the default: the ecosystem's pages; a block is a page of
epb records):

    pages       (num_blocks, page_bytes) uint8        FlashMLA MODEL1_FP8Sparse
                entries (flashmla_view(pool.pages, epb) is FlashMLA's k_cache;
                entry row r = block * epb + o is its indices_in_kvcache)
    index_pages (num_blocks, index_page_bytes) uint8  CSA only: DeepGEMM's
                paged indexer keys, index_layout "fp8" (SM90 and SM100,
                132 B), "mxfp4" (SM100, 68 B) or "mxfp8" (SM100, 132 B, the
                page padded to a multiple of 512 bytes)

Both layouts:

    block_table (max_requests, max_blocks_per_request) int32    -1 = no block
    written     (max_requests,) int32: entries the slot's request has written
                (high-water mark: entry id + 1 of its highest write); every
                gather bounds entry ids by it
    marks       (num_blocks, epb) uint8: 1 = the entry was written since its
                block was allocated to its request (prepare_step clears the
                marks of the blocks it allocates, the writers set them); every
                gather returns only marked entries, so bytes left in a reused
                block by an earlier request are never returned, not even below
                written[] (docs/kvcache.md, "Stale entries")
    request_ids (max_requests,) int32: the id of each slot's request (> 0,
                fresh at every add_request; 0: no request)
    owners      (num_blocks,) int32: the id of the request each block was
                assigned to (prepare_step, or the assign_pages op an engine
                that writes block-table rows itself calls; 0: none). Every
                writer and reader uses a block of a slot's row only when
                owners[block] == request_ids[slot], so a block handed over
                without assign_pages is skipped and counted, never read
                (docs/kvcache.md, "Page ownership")
    errors      (1,) int32: kernels atomically add the rows they skipped

The free list and the per-slot bookkeeping live on the host. Entry e of the
request in slot s is block_table[s, e // epb], row e % epb, with e = position // m.

device="cpu" keeps every buffer as a numpy array (rope as float32 holding
BF16 values, like rawkv.reference.kvcache.PagedPoolRef) and every op runs the
numpy reference on it.
"""
from __future__ import annotations

import bisect
import functools
import sys
import threading
import weakref

import numpy as np

from .. import _args as A
from ..errors import CaptureError
from ..reference import kvcache as ref
from ..reference.kvcache import layouts as R
from ..runtime import get_runtime

KINDS = {"csa": ref.CSA_RATIO, "hca": ref.HCA_RATIO}
#: "rawkv": per-entry FP32-scale FP8 entries and one-level NVFP4 keys, field
#: by field; "model1": FlashMLA MODEL1_FP8Sparse pages and DeepGEMM key pages
#: (docs/kvcache.md, "Pool layouts")
LAYOUTS = ("rawkv", "model1")
_DEFAULT = object()
#: the largest request id (request_ids and owners are int32)
_MAX_ID = 2 ** 31 - 1


# Every live pool and decode state, whose buffers _SPANS indexes. A view
# (views.pool_view / state_view) takes a buffer of an object only whole, in
# that buffer's own role and only beside buffers of the same object (an
# engine's own buffers beside them are its business): request ids are
# numbered per pool, so pool A's block table and request ids over pool B's
# pages, owners and marks read B's requests' entries as A's, and a state
# view mixing two states' buffers pools one request's rows into another's
# entry (docs/kvcache.md, "What a view cannot check"). A tensor lying in an
# object's buffer without being it (a slice, another shape) is found through
# _SPANS, the registered buffers' byte ranges, and refused (_registered).
_OBJECTS = weakref.WeakSet()

# The registered buffers' byte ranges per address space, sorted by first
# byte: {space: (starts, rows)}, rows[i] = (end, geometry, role, weak ref to
# the object) of the buffer starting at starts[i]; rebuilt from _OBJECTS
# at the first lookup after an object registered or died (_STALE: a dead
# object's memory may be an engine's buffer now). The objects' buffers are
# their own allocations, so the ranges never overlap.
_SPANS: dict = {}
_STALE = [True]


def register_buffers(obj) -> None:
    """Record obj (a pool or decode state) so views find its buffers
    (_registered: its BUFFERS that are not None, by their memory)."""
    _OBJECTS.add(obj)
    # (own_allocations reads this flag, not `obj in _OBJECTS`: under
    # torch.compile dynamo traced the WeakSet's __contains__ and guarded on
    # its length and each member by position, so creating or dropping any
    # pool or state recompiled every compiled step, and a member collected
    # while a compile built its guards failed it with an IndexError)
    object.__setattr__(obj, "_registered_object", True)
    _STALE[0] = True


def _stale(_ref=None) -> None:
    _STALE[0] = True


def _index() -> dict:
    """_SPANS, rebuilt if an object registered or died since it was built."""
    if _STALE[0]:
        _STALE[0] = False
        rows: dict = {}
        for o in list(_OBJECTS):
            ref_o = weakref.ref(o, _stale)
            for n in o.BUFFERS:
                sp = A._span(getattr(o, n))
                if sp is not None:
                    rows.setdefault(sp[0], []).append((sp[1], sp[2], A._geometry(sp), n, ref_o))
        _SPANS.clear()
        for space, rs in rows.items():
            rs.sort(key=lambda r: r[0])
            _SPANS[space] = ([r[0] for r in rs], [r[1:] for r in rs])
    return _SPANS


# Copies torch made of tensors a compiled graph writes (auto_functionalized,
# where the graph does not write in place: backend="aot_eager"), recorded
# by kvcache.traced.note_copies when a KV-cache operator runs on them:
# [(space, first byte, end byte, alive, delta, root)], alive() while the
# copy and the tensor it stands for are (root(): the latter). While such
# an operator runs (IN_COPIES.on, this thread), a span inside a live
# copy's bytes is that of the tensor the copy stands for, `delta` bytes
# on (the first operator's argument: a pool's or state's buffer, or an
# engine's own tensor), so the rules below decide on what the eager call
# would pass them (docs/kvcache.md, "The memory rules under
# torch.compile"); never in an eager call. An entry is dropped once it is
# not alive.
COPIES: list = []
IN_COPIES = threading.local()


def copy_entry(sp):
    """The COPIES entry of the live copy whose bytes hold the span `sp`
    (A._span), None when it lies in none; entries found freed on the way
    are dropped."""
    for e in tuple(COPIES):
        if not e[3]():
            try:
                COPIES.remove(e)
            except ValueError:
                pass
        elif e[0] == sp[0] and e[1] <= sp[1] and sp[2] <= e[2]:
            return e
    return None


def original_span(sp):
    """The span (A._span) `sp` stands for: in a live recorded copy's bytes,
    the same geometry `delta` bytes on, in the tensor the copy stands for;
    else `sp` itself."""
    if sp is None or not COPIES or not getattr(IN_COPIES, "on", False):
        return sp
    e = copy_entry(sp)
    if e is None:
        return sp
    space, delta, g = sp[0], e[4], A._geometry(sp)
    return space, sp[1] + delta, sp[2] + delta, sp[3], (space, g[1] + delta, *g[2:])


def _row(sp):
    """(first byte, end, geometry, role, weak ref to the object) of the
    registered buffer the span `sp` (A._span) shares memory with, None
    when it shares no byte with any. One bisection, not a scan."""
    index = _index().get(sp[0])
    if index is None:
        return None
    starts, rows = index
    i = bisect.bisect_left(starts, sp[2]) - 1          # the last buffer starting before buf ends
    if i < 0 or rows[i][0] <= sp[1]:
        return None
    return (starts[i], *rows[i])


def _lookup(buf):
    """(object, role, whole) of the pool's or decode state's buffer `buf`
    shares memory with (whole: it is that buffer, its memory, shape and
    strides), None when it shares no byte with any (an engine's own buffer,
    a copy)."""
    sp = original_span(A._span(buf))
    row = None if sp is None else _row(sp)
    if row is None:
        return None
    start, _, geometry, role, ref_o = row
    o = ref_o()
    if o is None:
        return None
    return o, role, start == sp[1] and A._geometry(sp) == geometry


def placement(buf):
    """Where `buf` lies among the registered buffers: None when it shares
    no byte with any, else (weak ref to the object, role, first and end
    byte from that buffer's first byte). The rules here decide on it and
    on buf's geometry, so a compiled call is guarded on it (kvcache.traced:
    a later call on memory placed otherwise is traced, and checked, again)."""
    sp = original_span(A._span(buf))
    row = None if sp is None else _row(sp)
    if row is None:
        return None
    start, _, _, role, ref_o = row
    return ref_o, role, sp[1] - start, sp[2] - start


def _registered(buf, name: str):
    """(object, role) when `buf` is exactly a pool's or decode state's
    buffer, None when it shares no byte with any (_lookup). A buffer whose
    memory overlaps one of theirs without being it (a slice such as
    block_table[1:] or count[:1], a reshape, a span across two of them) is
    a ValueError naming `name` and the buffer: a view over it would skip
    the rules a view over the object's own buffers keeps (its attached
    states, its prepared entries, one object per view) while reading and
    writing that object's rows."""
    found = _lookup(buf)
    if found is None:
        return None
    o, role, whole = found
    if whole:
        return o, role
    raise ValueError(f"{name}: overlaps the {role} buffer of a {type(o).__name__} without being it (a slice "
                     f"or another shape of its memory); an operator takes a pool's or decode state's "
                     f"buffer whole, or a buffer of the engine's own that shares no memory with one "
                     f"(otherwise its slots and request ids would escape the object's checks)")


def own_allocations(obj) -> bool:
    """Whether obj's buffers are a pool's or decode state's own allocations
    (obj is one, or a view over one: check_one_owner found it), which lie
    apart from any other object's; False for a view over an engine's own
    buffers, which may lie anywhere."""
    return getattr(obj, "_registered_object", False) or obj._owner is not None


def check_not_anothers(outputs, obj=None) -> None:
    """The arrays an op writes ((name, array or None) pairs) may not lie in
    the buffers of a pool or decode state other than `obj`, the one the op
    works on (check_outputs decides against obj's own buffers): the op
    would write that object's rows (an errors= that is another pool's
    request_ids added its count to a request's id). An `errors` that is an
    object's counter, whole, is a counter (check_counter_owner's rule on
    the operators' path). ValueError naming the argument and the buffer."""
    for name, a in outputs:
        if a is None or A.is_number(a):
            continue
        found = _lookup(a)
        if found is None or found[0] is obj:
            continue
        o, role, whole = found
        if name == "errors" and role == "errors" and whole:
            continue
        raise ValueError(f"{name}: lies in the {role} buffer of {'another' if obj is not None else 'a'} "
                         f"{type(o).__name__}; the op would write that object's {role} (pass a buffer of "
                         f"your own)")


def check_store_cache(cache, role: str, lay=None, page_size=None) -> None:
    """A layout store's cache (every byte of its pages) may lie in a pool's
    buffer only when that buffer is the one holding the store's records,
    `role` ('pages' for MODEL1, 'index_pages' for the indexer keys): that is
    what an engine stores into. In any other buffer of a pool or decode
    state (marks, owners, request_ids, written, the block table, a state's
    rows or count, viewed as bytes) the store would overwrite the metadata
    every gather trusts, e.g. set marks of entries a request never wrote or
    forge a block's owner, so one request would read another's entries with
    no error. In the pool's pages the store's layout `lay` and `page_size`
    must be the pool's (its index_layout, entries_per_block): pages of
    another geometry of the same bytes (an FP8 key store of page size 17
    into MXFP4 pages of 33 entries, 2,244 bytes both) would write records
    every gather of the pool decodes as garbage. ValueError naming cache,
    or page_size."""
    found = _lookup(cache)
    if found is None:
        return
    o, r, _ = found
    if r != role:
        raise ValueError(f"cache: lies in the {r} buffer of a {type(o).__name__}; a layout store writes "
                         f"its records only into a pool's {role} (or a cache of the engine's own), never "
                         f"into the {r} the pool's ops trust")
    if lay is not None and role == "index_pages" and ref.INDEX_LAYOUTS.get(o.index_layout) is not lay:
        raise ValueError(f"cache: lies in the index_pages of a PagedKVPool with index_layout "
                         f"{o.index_layout!r}; an {lay.name} store would write records its gathers misread")
    if page_size is not None and page_size != o.entries_per_block:
        raise ValueError(f"page_size: the cache lies in the {role} of a PagedKVPool of {o.entries_per_block} "
                         f"entries per block (its page size), got {page_size}; the store would write "
                         "records of another page geometry over its pages")
    _check_page_start(cache, o, role)


def check_view_cache(cache, lay, page_size: int, fn: str, verb: str = "views") -> None:
    """An engine's view of a layout cache (`fn`: flashmla_view,
    deepgemm_view) whose memory lies in a pool's buffer is a view of that
    pool's records in the pool's geometry, as check_store_cache requires of
    a store: MODEL1 records only in its pages, indexer keys only in its
    index_pages and of its index_layout, the page size its
    entries_per_block. The view launches nothing, but FlashMLA or DeepGEMM
    reads what it shows: a view of another geometry over the same bytes
    (deepgemm_view(pool.pages, 48) of a pool of 10 entries: 6,336-byte pages
    both; the MXFP4 index pages of 33 entries as FP8 keys of 17) was
    returned, and its kernels read entries as garbage, no error. A cache
    the pools do not hold (the engine's own) is only what its shape and
    strides say. model1_gather, which decodes the records itself, holds
    its cache to the same rule (`verb` 'reads' in its messages).
    ValueError naming cache, layout or page_size."""
    found = _lookup(cache)
    if found is None:
        return
    o, r, _ = found
    role = "pages" if lay is R.MODEL1 else "index_pages"
    if r != role:
        holds = {"pages": "MODEL1 entries", "index_pages": "indexer keys"}.get(r, "no layout records")
        raise ValueError(f"cache: lies in the {r} buffer of a {type(o).__name__} ({holds}); {fn} {verb} "
                         f"{lay.name} records, which a pool keeps in its {role}")
    if role == "index_pages" and ref.INDEX_LAYOUTS.get(o.index_layout) is not lay:
        raise ValueError(f"layout: the cache lies in the index_pages of a PagedKVPool with index_layout "
                         f"{o.index_layout!r}, got {lay.name!r}; the view would show its keys as another "
                         "layout's records")
    if page_size != o.entries_per_block:
        raise ValueError(f"page_size: the cache lies in the {role} of a PagedKVPool of {o.entries_per_block} "
                         f"entries per block (its page size), got {page_size}; {fn} would {'read' if verb == 'reads' else 'show'} "
                         "its records in another page geometry")
    _check_page_start(cache, o, role)


def _check_page_start(cache, o, role: str) -> None:
    """A cache in pool `o`'s `role` buffer (pages / index_pages, of the
    pool's layout and page size: checked before) starts on one of its
    pages: the same page stride from a byte inside a page (pages.view(-1)[16:])
    puts every record across the pool's records and scales, which its
    gathers (and FlashMLA / DeepGEMM through a view) read as garbage.
    ValueError naming cache."""
    at = placement(cache)
    pb = o.page_bytes if role == "pages" else o.index_page_bytes
    if at is not None and pb and at[2] % pb:
        raise ValueError(f"cache: starts {at[2]} bytes into the {role} of a PagedKVPool, inside a page of "
                         f"{pb} bytes; a cache in a pool's {role} starts on one of its pages")


def check_bare_table(table) -> None:
    """The bare bridge's block table (topk_to_kvcache_indices) may not be
    a pool's: that bridge checks neither the blocks' owners nor the
    entries' written marks, so on a pool's table it turned a request's
    top-k ids into rows of blocks another request owns, or of entries it
    never wrote, with no error. kvcache_indices(pool, ...) is the bridge
    on a pool. ValueError naming block_table."""
    found = _lookup(table)
    if found is not None:
        o, r, _ = found
        raise ValueError(f"block_table: lies in the {r} buffer of a {type(o).__name__}; "
                         "topk_to_kvcache_indices checks neither owners nor written marks, so on a pool it "
                         "could give a request another's entries: use rawkv.kvcache.kvcache_indices(pool, ...)")


def check_one_owner(view, what: str, anchor: str) -> None:
    """A view's buffers (all but its counter, the caller's errors=) that
    are a pool's or decode state's are each that object's buffer of the
    same name, whole, and all of one object; `what`: 'pool' or 'state', the
    view's kind; `anchor` (block_table, kv_a) is compared first.
    ValueError naming the first buffer that is not (_registered: one that
    lies in an object's buffer without being it). Returns the object whose
    `anchor` the view's is (a pool's block table, a state's kv_a: the view
    reads that object's host bookkeeping), or None (the engine's own)."""
    first, anchored = None, None
    for n in sorted(view.BUFFERS[:-1], key=lambda n: n != anchor):
        b = getattr(view, n)
        if b is None:
            continue
        found = _registered(b, n)
        if found is None:
            continue                                # the engine's own buffer
        o, role = found
        kind = type(o).__name__
        if role != n:
            raise ValueError(f"{n}: is the {role} buffer of a {kind}, not a {what}'s {n}")
        if n == anchor:
            anchored = o
        if first is None:
            first = (n, o)
        elif o is not first[1]:
            raise ValueError(f"{n}: belongs to another {kind} than {first[0]} (a {what} view's buffers are "
                             f"one object's, or the engine's own); request ids and slots are numbered per "
                             f"object, so one request would read or write another's entries")
    return anchored


def check_view_key_layout(view) -> None:
    """A "model1" pool view over a pool's own index_pages takes them in that
    pool's index_layout: FP8 and MXFP8 key pages have the same bytes at page
    sizes that are multiples of 128, so a view told the other layout
    (views.pool_view's index_layout) would write records the pool's
    gathers, and DeepGEMM, misread. ValueError naming index_layout. (Called
    after check_one_owner, which refuses a part of a pool's buffer.)"""
    found = None if view.index_pages is None else _lookup(view.index_pages)
    if found is None or found[1] != "index_pages":
        return
    o = found[0]
    if o.index_layout != view.index_layout:
        raise ValueError(f"index_layout: index_pages are the key pages of a PagedKVPool with index_layout "
                         f"{o.index_layout!r}, got {view.index_layout!r}; the op would write or read its keys "
                         "as another layout's records")


def check_counter_owner(view) -> None:
    """A view's counter (the caller's errors=) may be any object's counter
    or the engine's own tensor, but no other buffer of a pool or decode
    state nor a part of one: the op adds its count there (into another
    pool's `written` it would raise a request's entry count). ValueError
    naming `errors`. (Checked after views' _counter_apart, which refuses a
    counter over the view's own buffers in its own words.)"""
    counter = view.BUFFERS[-1]
    c = getattr(view, counter)
    found = None if c is None else _registered(c, counter)
    if found is not None and found[1] != counter:
        raise ValueError(f"{counter}: is the {found[1]} buffer of a {type(found[0]).__name__}, not an error "
                         f"counter (the op would add its count into that object's {found[1]})")


#: request slots a pool or decode state may have: the ops take slots as int32
#: (the kernels read `const int* slots`), so slot 2^31 could never be named.
MAX_REQUESTS = 2 ** 31


def _on_bookkeeper(method):
    """A host method of PagedKVPool that a view (no bookkeeping of its own)
    runs on the pool its _bookkeeper names: one rule for every such method."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._states is None:
            return getattr(self._bookkeeper(), method.__name__)(*args, **kwargs)
        return method(self, *args, **kwargs)
    return run


def _max_requests(v) -> int:
    """max_requests: a positive int (rawkv._args.positive_int) of at most MAX_REQUESTS slots;
    a ValueError naming it before anything is allocated (2**63 failed in
    numpy's allocation naming nothing: 'Maximum allowed dimension
    exceeded')."""
    v = A.positive_int("max_requests", v)
    if v > MAX_REQUESTS:
        raise ValueError(f"max_requests: {v} is past 2^31 request slots (the ops take slots as int32)")
    return v


def _kind(kind) -> int:
    if kind not in KINDS:
        raise ValueError(f"kind: expected 'csa' or 'hca', got {kind!r}")
    return KINDS[kind]


def resolve_device(device):
    """(is_cuda, CUDA device index or None) of "cpu", "cuda", "cuda:N", an
    int or a torch.device. A CUDA device needs the GPU stack: without it
    (a CPU-only torch, no CuPy) this raises rawkv's GpuUnavailableError,
    like every op, before any torch.cuda call."""
    if (isinstance(device, str) and device == "cpu") or getattr(device, "type", None) == "cpu":
        return False, None
    return True, get_runtime(device).device_index


def host_ints(name: str, x) -> np.ndarray:
    """1-D int64 numpy array of a host-side index argument (int, list, numpy
    array, CPU tensor). CUDA tensors are refused: reading them would
    synchronize the host."""
    if getattr(x, "is_cuda", False) is True:
        raise TypeError(f"{name}: expected host ints (list, numpy array or CPU tensor), got a CUDA "
                        "tensor; reading it would synchronize the host")
    if hasattr(x, "detach"):
        x = x.detach().numpy()
    a = np.asarray(x)
    if a.size == 0 and isinstance(x, (list, tuple)):
        a = a.astype(np.int64)          # an empty sequence has no dtype: numpy's float64 is not the caller's
    if a.dtype == np.bool_ or a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {a.shape}")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        # (the cast below wrapped it: 2^64 - 1 was refused as the position -1)
        raise ValueError(f"{name}: {int(a.max())} is past the int64 range")
    return a.astype(np.int64)


def plain_tensors():
    """A context in which torch makes plain tensors, never inference tensors
    (torch.inference_mode(False)): what a pool or decode state allocates,
    and the torch views of a CPU one's arrays. Serving code builds its
    layers under torch.inference_mode and runs them outside it too, while
    torch lets nothing write an inference tensor outside it: a pool built
    there had its own counter refused by every op (`errors: is an inference
    tensor`), compress_prefill raised torch's error after writing its
    entries, and on CUDA prepare_step / free_request raised it after
    changing the host's bookkeeping (as Fp4GroupedLinear keeps a plain
    output buffer)."""
    import torch
    return torch.inference_mode(False)


def capturing(device_index) -> bool:
    return get_runtime(device_index).is_capturing()


class ErrorCounter:
    """What a pool and a decode state share: the skipped-row counter
    (`errors`, a 1-element int32 buffer the kernels atomically add to; torch
    on CUDA, numpy on CPU; `is_cuda` and `device_index` say where it lives)
    and their buffers as the rawkv:: operators take them (torch_buffers)."""

    BUFFERS: tuple = ()      # the buffers' attribute names, which are the operators' argument names
    _torch = None
    _operands = None
    _sealed = False

    def __setattr__(self, name, value):
        # The buffers are checked once, when the object is built (constructor or
        # views.pool_view / state_view), and the ops trust them from then on:
        # replacing one (an int64 block table, an undersized scale buffer) would
        # let a kernel write out of bounds, so it is refused.
        if self._sealed and name in self.BUFFERS:
            raise AttributeError(f"{name}: a {type(self).__name__}'s buffers are fixed when it is built "
                                 "(checked once, trusted by every op); write into them in place, or "
                                 "build a new one")
        object.__setattr__(self, name, value)

    def _seal(self) -> None:
        """The buffers are in place and checked: fix them (__setattr__)."""
        object.__setattr__(self, "_sealed", True)

    def torch_buffers(self) -> dict:
        """{name: torch tensor or None} of BUFFERS: what a public op passes to
        its rawkv:: operator under torch.compile. A CPU object's tensors are
        torch views of its numpy arrays (shared memory, no copy), made once:
        at construction when torch is already imported, else here. They are
        plain tensors even when made under torch.inference_mode (plain_tensors)."""
        t = self._torch
        if t is None:
            t = {n: getattr(self, n) for n in self.BUFFERS}
            if not self.is_cuda:
                import torch
                with plain_tensors():
                    t = {n: None if a is None else torch.from_numpy(a) for n, a in t.items()}
            self._torch = t
        return t

    def _init_torch_buffers(self) -> None:
        """Make torch_buffers() now when torch is loaded (always on CUDA), so
        a function compiled later reads an attribute instead of tracing
        torch.from_numpy."""
        if self.is_cuda or sys.modules.get("torch") is not None:
            self.torch_buffers()

    def operator_buffers(self) -> tuple:
        """BUFFERS' values, in order, as a public op passes them to its op
        (rawkv.kvcache.views.pool_operands / state_operands): torch tensors
        (torch_buffers) once torch is loaded, whose operator torch.compile
        calls; before that a CPU object's own arrays (without torch there is
        no operator: the op's body runs on the object itself)."""
        b = self._operands
        if b is None:
            if not self.is_cuda and self._torch is None and sys.modules.get("torch") is None:
                return tuple(getattr(self, n) for n in self.BUFFERS)
            t = self.torch_buffers()
            b = self._operands = tuple(t[n] for n in self.BUFFERS)
        return b

    def read_errors(self) -> int:
        """Rows the kernels skipped since the last reset_errors(). Synchronizes
        the host with the device: for tests and checks, not the hot path."""
        if self.is_cuda:
            if capturing(self.device_index):
                raise CaptureError(f"{type(self).__name__}.read_errors: would synchronize during capture")
            return int(self.errors.item())
        return int(self.errors[0])

    def reset_errors(self) -> None:
        """errors[0] = 0 (a device memset on the current stream; capturable)."""
        if self.is_cuda:
            self.errors.zero_()
        else:
            self.errors[0] = 0


class PagedKVPool(ErrorCounter):
    """Paged pool of compressed KV entries of one layer (see module doc).

    kind: 'csa' (m = 4, with a CSA indexer key per entry unless
    index_head_dim=None) or 'hca' (m = 128, no indexer key). layout:
    'model1' (default; FlashMLA / DeepGEMM pages, indexer keys of
    index_layout 'fp8', 'mxfp4' or 'mxfp8') or 'rawkv' (index_layout 'nvfp4');
    index_layout None: the layout's own ('fp8' / 'nvfp4'). entries_per_block
    is the page size (vLLM: 64 for CSA, 2 for HCA: 256 tokens per page).
    """

    # Every layout's buffers (a pool holds its layout's; the others are None):
    # the operators' schemas list them all (views.pool_schema).
    BUFFERS = ("fp8", "scale", "rope", "index_q", "index_sf", "pages", "index_pages", "block_table",
               "request_ids", "owners", "written", "marks", "errors")
    _states = None      # the attached DecodeStates (attach); None for a view (views.pool_view)
    _owner = None       # a view's: the pool whose buffers it is over (check_one_owner), or None

    def __init__(self, kind, num_blocks, entries_per_block, max_requests, max_blocks_per_request,
                 *, head_dim=ref.HEAD_DIM, rope_dim=ref.ROPE_DIM, index_head_dim=_DEFAULT,
                 layout="model1", index_layout=None, device="cuda"):
        if index_head_dim is _DEFAULT:
            index_head_dim = ref.INDEX_HEAD_DIM if kind == "csa" else None
        self._set_geometry(kind, num_blocks, entries_per_block, max_requests, max_blocks_per_request,
                           head_dim, rope_dim, index_head_dim, layout, index_layout)
        self.is_cuda, self.device_index = resolve_device(device)

        nb, epb = self.num_blocks, self.entries_per_block
        R, MB = self.max_requests, self.max_blocks_per_request
        # host-side bookkeeping
        self._table = np.full((R, MB), -1, np.int32)     # host mirror of block_table
        self._free = list(range(nb - 1, -1, -1))          # pop() hands out block 0 first
        self._active = np.zeros(R, bool)
        self._nblocks = np.zeros(R, np.int64)             # logical blocks held per slot
        self._n_entries = np.zeros(R, np.int64)
        self._ids = np.zeros(R, np.int64)                 # host mirror of request_ids
        self._next_id = 1
        self._staging = None
        self._states = []
        if self.is_cuda:
            import torch
            with plain_tensors():
                dev = torch.device("cuda", self.device_index)
                self.device = dev
                self.fp8 = self.scale = self.rope = self.index_q = self.index_sf = None
                self.pages = self.index_pages = None
                if self.layout == "model1":
                    self.pages = torch.zeros((nb, self.page_bytes), dtype=torch.uint8, device=dev)
                    if self.index_head_dim is not None:
                        self.index_pages = torch.zeros((nb, self.index_page_bytes), dtype=torch.uint8, device=dev)
                else:
                    self.fp8 = torch.zeros((nb, epb, self.nope_dim), dtype=torch.uint8, device=dev)
                    self.scale = torch.zeros((nb, epb), dtype=torch.float32, device=dev)
                    self.rope = torch.zeros((nb, epb, self.rope_dim), dtype=torch.bfloat16, device=dev)
                    if self.index_head_dim is not None:
                        ih = self.index_head_dim
                        self.index_q = torch.zeros((nb, epb, ih // 2), dtype=torch.uint8, device=dev)
                        self.index_sf = torch.zeros((nb, epb, ih // 16), dtype=torch.uint8, device=dev)
                self.block_table = torch.full((R, MB), -1, dtype=torch.int32, device=dev)
                self.request_ids = torch.zeros(R, dtype=torch.int32, device=dev)
                self.owners = torch.zeros(nb, dtype=torch.int32, device=dev)
                self.written = torch.zeros(R, dtype=torch.int32, device=dev)
                self.marks = torch.zeros((nb, epb), dtype=torch.uint8, device=dev)
                self.errors = torch.zeros(1, dtype=torch.int32, device=dev)
        else:
            self.device = "cpu"
            r = ref.PagedPoolRef.create(nb, epb, self.m, self.head_dim, self.rope_dim,
                                        self.index_head_dim, layout=self.layout,
                                        index_layout=self.index_layout)
            self.fp8, self.scale, self.rope = r.kv_fp8, r.kv_scale, r.kv_rope
            self.index_q, self.index_sf, self.marks = r.idx_q, r.idx_sf, r.marks
            self.pages, self.index_pages = r.pages, r.index_pages
            # a copy, as on CUDA: the engine may write the table in place, and
            # the host's record of the blocks each slot holds (which
            # free_request returns to the free list) must not follow it
            self.block_table = self._table.copy()
            self.request_ids = np.zeros(R, np.int32)
            self.owners = np.zeros(nb, np.int32)
            self.written = np.zeros(R, np.int32)
            self.errors = np.zeros(1, np.int32)
        self._init_torch_buffers()
        self._seal()
        register_buffers(self)

    def _set_geometry(self, kind, num_blocks, entries_per_block, max_requests, max_blocks_per_request,
                      head_dim, rope_dim, index_head_dim, layout="rawkv", index_layout=None) -> None:
        """The pool's sizes, checked: the constructor's rules, which
        views.pool_view applies to the sizes of its buffers' shapes."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.kind = kind
        self.m = _kind(kind)
        self.num_blocks = A.positive_int("num_blocks", num_blocks)
        self.entries_per_block = A.positive_int("entries_per_block", entries_per_block)
        self.max_requests = _max_requests(max_requests)
        self.max_blocks_per_request = A.positive_int("max_blocks_per_request", max_blocks_per_request)
        self.head_dim = A.positive_int("head_dim", head_dim)
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, (int, np.integer)):
            raise TypeError(f"rope_dim: expected an int, got {type(rope_dim).__name__}")
        self.rope_dim = int(rope_dim)
        if self.rope_dim < 0 or self.rope_dim % 8:
            raise ValueError(f"rope_dim: expected a non-negative multiple of 8, got {rope_dim}")
        self.nope_dim = self.head_dim - self.rope_dim
        if self.nope_dim <= 0 or self.nope_dim % 16:
            raise ValueError(f"head_dim: head_dim - rope_dim must be a positive multiple of 16 "
                             f"(the FP8 part), got {head_dim} - {rope_dim}")
        if index_head_dim is not None:
            if kind != "csa":
                raise ValueError("index_head_dim: only a CSA pool has indexer keys (pass None for HCA)")
            index_head_dim = A.positive_int("index_head_dim", index_head_dim)
            if index_head_dim % ref.NVFP4_BLOCK:
                raise ValueError(f"index_head_dim: expected a multiple of 16, got {index_head_dim}")
        self.index_head_dim = index_head_dim
        # the indexer keys' format: rawkv's one-level NVFP4, or DeepGEMM's FP8 /
        # MXFP4 / MXFP8 pages. Checked for every kind and layout: a format the layout
        # does not store (rawkv with 'mxfp4') would be silently replaced by
        # the layout's own; an HCA pool has no keys but takes the engine's one
        # setting for its layers, so the same values
        index_layout = ref.index_layout_of(layout, index_layout)
        self.index_layout = None if index_head_dim is None else index_layout
        self.page_bytes = self.index_page_bytes = None
        if layout == "model1":
            ref.check_model1_geometry(self.head_dim, self.rope_dim, index_head_dim, index_layout)
            epb = self.entries_per_block
            self.page_bytes = R.MODEL1.page_bytes(epb)
            if index_head_dim is not None:
                self.index_page_bytes = ref.INDEX_LAYOUTS[index_layout].page_bytes(epb)
        if self.max_blocks_per_request * self.entries_per_block >= 2 ** 31 or \
                self.num_blocks * self.entries_per_block >= 2 ** 31:
            raise ValueError("entries_per_block: num_blocks and max_blocks_per_request times "
                             "entries_per_block must stay below 2^31 entries")

    def __repr__(self):
        return (f"<PagedKVPool {self.kind} m={self.m} layout={self.layout} "
                f"blocks={self.num_blocks}x{self.entries_per_block} "
                f"requests={self.max_requests}x{self.max_blocks_per_request} head_dim={self.head_dim} "
                f"index_head_dim={self.index_head_dim} index_layout={self.index_layout} device={self.device}>")

    @property
    def has_index(self) -> bool:
        return self.index_head_dim is not None

    # -- requests -----------------------------------------------------------
    def _check_host_time(self, what: str) -> None:
        if self.is_cuda and capturing(self.device_index):
            raise CaptureError(f"PagedKVPool.{what}: host-side bookkeeping with a host->device copy; "
                               "call it before capturing / replaying the step, not during capture")

    def _bookkeeper(self):
        """The pool whose host bookkeeping (slots, free list, attached
        states, prepared entries) a host method of this one uses: itself;
        for a view (views.pool_view) over a pool's own block table, that
        pool (the view is that pool, as for compress_decode's attachment
        rule and gather_dense's count of prepared entries). A view over an
        engine's own buffers has none: ValueError naming pool, before
        anything changes. (Before, such a call on any view raised a bare
        TypeError / AttributeError, and attach did so after binding the
        state to the view: the state was then refused by its own pool as
        attached to another, and no free_request ever emptied its slots.)"""
        if self._states is not None:
            return self
        if self._owner is not None:
            return self._owner
        raise ValueError("pool: is a view over an engine's own buffers (views.pool_view), which has no host "
                         "bookkeeping (request slots, free blocks, attached states): the engine that owns "
                         "the buffers manages its requests (docs/kvcache.md, \"The operators' path\")")

    def _slot(self, slot, active: bool = True) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"slot: expected an int, got {type(slot).__name__}")
        if not 0 <= slot < self.max_requests:
            raise ValueError(f"slot: {slot} is out of range [0, {self.max_requests})")
        if active and not self._active[slot]:
            raise ValueError(f"slot: {slot} holds no request (add_request() first)")
        return int(slot)

    @_on_bookkeeper
    def add_request(self) -> int:
        """A free request slot (the lowest); its block-table row is all -1 and
        it holds no entries. The slot gets a fresh request id
        (request_ids[slot], a device fill on the current stream), so no
        block of an earlier request is its own, and the slot is emptied in
        every attached decode state (free_request did, but the state ops do
        not know which slots hold a request: a stale step may have appended
        rows to the free slot since, which the new request's first entry
        would pool). RuntimeError when every slot is taken; CaptureError
        while capturing."""
        free = np.flatnonzero(~self._active)
        if free.size == 0:
            raise RuntimeError(f"PagedKVPool: all {self.max_requests} request slots are taken")
        self._check_host_time("add_request")
        s = int(free[0])
        for st in self._states:
            st._empty(s)
        self._set_id(s, self._fresh_id())
        self._active[s] = True
        self._nblocks[s] = 0
        self._n_entries[s] = 0
        return s

    @_on_bookkeeper
    def attach(self, *states) -> None:
        """Attach this layer's decode states (the compressor's and, for CSA,
        the indexer's), once, when the layer is built. From then on
        free_request empties the slot in every attached state, so a request
        never starts from the rows its slot's previous request left;
        compress_decode refuses a state not attached to its pool. A state
        has max_requests rows, the pool's device and kind, the head_dim of
        the pool's entries or (CSA) indexer keys, belongs to one pool,
        and is attached empty (no count, no CSA b-stream: rows already there
        could be anyone's), else ValueError naming state. Reads the states'
        counts (a host synchronization on CUDA): a build-time call. A view
        over a DecodeState's own buffers (views.state_view) is that state
        (its _owner), as on the operators' path: otherwise a view of
        another pool's state was attached here, and compress_decode pooled
        that pool's request's window into this pool's entry."""
        self._check_host_time("attach")
        for st in states:
            # a DecodeState: the ErrorCounter that is not a pool (state.py imports this module)
            if not isinstance(st, ErrorCounter) or isinstance(st, PagedKVPool):
                raise TypeError(f"state: expected a rawkv.kvcache.DecodeState, got {type(st).__name__}")
        states = [st if st._owner is None else st._owner for st in states]
        for st in states:
            if st.max_requests != self.max_requests or st.device_index != self.device_index:
                raise ValueError(f"state: has {st.max_requests} slots on {st.device}; this pool needs "
                                 f"{self.max_requests} (max_requests) on {self.device}")
            # (compress_decode takes only these: a state of another kind or width,
            # once bound, was refused by its own pool as attached to another)
            widths = (self.head_dim,) + ((self.index_head_dim,) if self.has_index else ())
            if st.kind != self.kind or st.head_dim not in widths:
                raise ValueError(f"state: is a {st.kind!r} state of head_dim {st.head_dim}; this {self.kind!r} "
                                 f"pool's decode states have head_dim {' or '.join(map(str, widths))} "
                                 "(the entry's, the indexer key's)")
            if st._pool is not None and st._pool is not self:
                raise ValueError("state: is attached to another pool (a decode state belongs to one "
                                 "layer's pool)")
            if st._pool is None and st._holds_rows():
                raise ValueError("state: holds rows already (a count or a CSA b-stream); attach it "
                                 "when it is built, or state_clear it first")
        for st in states:
            if st._pool is None:
                st._pool = self
                self._states.append(st)

    @_on_bookkeeper
    def free_request(self, slot) -> None:
        """Return the blocks of `slot` to the free list, set its block-table
        row to -1 and its `written` count and request id to 0 (device fills
        on the current stream), and empty the slot in every attached decode
        state (attach). The stale entries stay in the blocks until a new
        owner overwrites them; gathers never return them: the blocks belong
        to a request id no slot has, and assigning them to a new request
        clears their marks. The next request in this slot is admitted with
        state_seed (its prompt's tail). The device fills run on torch's
        current stream, like prepare_step's table upload: an engine whose
        kernels run on another stream must order that stream after them."""
        s = self._slot(slot)
        self._check_host_time("free_request")
        n = int(self._nblocks[s])
        blocks = self._table[s, :n].tolist()
        self._free.extend(reversed(blocks))          # LIFO: the next request reuses them first
        self._table[s] = -1
        if self.is_cuda:
            self.block_table[s].fill_(-1)
            self.written[s].fill_(0)
        else:
            self.block_table[s] = -1
            self.written[s] = 0
        for st in self._states:                      # the slot changes owner: no state row survives it
            st._empty(s)
        self._set_id(s, 0)                         # its blocks now belong to no slot's request
        self._active[s] = False
        self._nblocks[s] = 0
        self._n_entries[s] = 0

    def _set_id(self, slot: int, rid: int) -> None:
        self._ids[slot] = rid
        if self.is_cuda:
            self.request_ids[slot].fill_(rid)
        else:
            self.request_ids[slot] = rid

    def _fresh_id(self) -> int:
        """A request id no block is stamped with: 1, 2, ...; after 2^31 - 1
        of them, the ids are renumbered (_renumber)."""
        if self._next_id > _MAX_ID:
            self._renumber()
        rid = self._next_id
        self._next_id += 1
        return rid

    def _renumber(self) -> None:
        """The ids ran out (once every 2^31 - 1 admissions): the active
        requests get ids 1..k, each block owned by one of them is stamped
        with its new id and every other block with 0 (no request), so no
        old id survives. Reads owners back (a host sync, at admission)."""
        act = np.flatnonzero(self._active)
        new = np.arange(1, act.size + 1, dtype=np.int64)
        owners = self.owners.cpu().numpy() if self.is_cuda else self.owners
        stamped = np.zeros(self.num_blocks, np.int32)
        for old, rid in zip(self._ids[act].tolist(), new.tolist()):
            stamped[owners == old] = rid
        self._ids[:] = 0
        self._ids[act] = new
        if self.is_cuda:
            import torch
            self.owners.copy_(torch.from_numpy(stamped))
            self.request_ids.copy_(torch.from_numpy(self._ids.astype(np.int32)))
        else:
            self.owners[:] = stamped
            self.request_ids[:] = self._ids
        self._next_id = act.size + 1

    @_on_bookkeeper
    def n_entries(self, slot) -> int:
        """Complete entries of `slot` once the steps prepared so far have run:
        (highest prepared position + 1) // m."""
        return int(self._n_entries[self._slot(slot)])

    @_on_bookkeeper
    def blocks_of(self, slot) -> list:
        """Physical blocks of `slot`, in logical order (host copy)."""
        s = self._slot(slot)
        return self._table[s, : int(self._nblocks[s])].tolist()

    def capacity(self) -> int:
        """Entries the pool holds in all: num_blocks * entries_per_block."""
        return self.num_blocks * self.entries_per_block

    @_on_bookkeeper
    def free_blocks(self) -> int:
        return len(self._free)

    @_on_bookkeeper
    def active_slots(self) -> list:
        return np.flatnonzero(self._active).tolist()

    @_on_bookkeeper
    def block_table_host(self) -> np.ndarray:
        """Copy of the host mirror of block_table (no device access)."""
        return self._table.copy()

    # -- step preparation -----------------------------------------------------
    @_on_bookkeeper
    def prepare_step(self, slots, positions) -> int:
        """Host side, before a (captured) step runs: for every (slot, position)
        that the step will process, make sure entry position // m has a
        physical block (every logical block up to it is allocated), and
        record n_entries. The block-table cells of the blocks allocated (and
        no other cell: an engine may have written the table in place) go to
        the device in ONE host->device copy on the current stream (none when
        nothing was allocated).

        slots, positions: host ints (lists, numpy arrays, CPU tensors) of one
        shape; a slot may repeat (a prefill chunk: its highest position
        counts). All-or-nothing: an inactive/out-of-range slot, a negative
        position or one past max_blocks_per_request raises ValueError, and
        running out of blocks raises RuntimeError naming the slot, before
        anything is written. Refused (CaptureError) while capturing. An
        empty step (no slots: [] or a 0-length array) changes nothing.
        Returns the number of blocks allocated."""
        sl = host_ints("slots", slots)
        ps = host_ints("positions", positions)
        if sl.shape != ps.shape:
            raise ValueError(f"positions: expected shape {sl.shape} (one per slot), got {ps.shape}")
        self._check_host_time("prepare_step")
        last = {}
        for s, p in zip(sl.tolist(), ps.tolist()):
            if not 0 <= s < self.max_requests:
                raise ValueError(f"slots: slot {s} is out of range [0, {self.max_requests})")
            if not self._active[s]:
                raise ValueError(f"slots: slot {s} holds no request (add_request() first)")
            if p < 0:
                raise ValueError(f"positions: position {p} of slot {s} is negative")
            last[s] = max(last.get(s, -1), p)
        need = {}
        for s, p in last.items():
            lb = (p // self.m) // self.entries_per_block
            if lb >= self.max_blocks_per_request:
                raise ValueError(f"positions: slot {s} at position {p} needs logical block {lb}, but "
                                 f"max_blocks_per_request is {self.max_blocks_per_request}")
            need[s] = max(0, lb + 1 - int(self._nblocks[s]))
        total, avail = 0, len(self._free)
        for s, k in need.items():
            total += k
            if total > avail:
                raise RuntimeError(f"PagedKVPool: out of blocks: slot {s} needs {k} more block(s) "
                                   f"({total} for this step) but only {avail} of {self.num_blocks} "
                                   "are free; nothing was allocated")
        new, to, at = [], [], []
        for s, k in need.items():
            if k:
                n0 = int(self._nblocks[s])
                for i in range(k):
                    self._table[s, n0 + i] = self._free.pop()
                new.extend(self._table[s, n0:n0 + k].tolist())
                to.extend([s] * k)
                at.extend(range(n0, n0 + k))
                self._nblocks[s] = n0 + k
        for s, p in last.items():
            self._n_entries[s] = max(int(self._n_entries[s]), (p + 1) // self.m)
        if new:
            self._new_owner(to, at, new)
        return total

    def _new_owner(self, slots: list, cols: list, blocks: list) -> None:
        """Blocks `blocks` were just allocated to the requests of `slots`, as
        their logical blocks `cols`: write exactly those block-table cells,
        stamp each block with its request's id and clear its marks (its
        bytes are a previous owner's): reference.assign_pages, in stream
        order before any op of the step. Only the cells: every other cell,
        of these slots' rows or any other row, may hold an engine's in-place
        write, which an upload of whole host rows would undo. CUDA: one
        host->device copy of the cells' flat indices, the block ids and the
        request ids, one cast to int32, then index_copy_ (the cells),
        index_fill_ (marks) and index_copy_ (owners): no host sync, no copy
        per row."""
        if not self.is_cuda:
            self.block_table[slots, cols] = blocks
            ref.assign_pages(self.reference_view(), slots, blocks)
            return
        import torch
        k = len(blocks)
        cells = np.asarray(slots, np.int64) * self.max_blocks_per_request + np.asarray(cols, np.int64)
        # int64: the index dtype of index_copy_ / index_fill_; the values are cast to int32 on the device
        staged = np.concatenate([cells, blocks, self._ids[slots]])
        self._staging = torch.from_numpy(staged.astype(np.int64))
        dev = self._staging.to(self.device, non_blocking=True)
        vals = dev[k:].to(torch.int32)                  # the block ids, then their requests' ids
        # (the pool's own table, allocated contiguous and never replaced: view(-1) is the table)
        self.block_table.view(-1).index_copy_(0, dev[:k], vals[:k])
        idx = dev[k:2 * k]
        self.marks.index_fill_(0, idx, 0)
        self.owners.index_copy_(0, idx, vals[k:])

    # -- reference views ------------------------------------------------------
    def to_reference(self) -> ref.PagedPoolRef:
        """A rawkv.reference.kvcache.PagedPoolRef holding a host copy of the
        pool (rope as float32) with its request table (block_table, written).
        On CUDA this synchronizes: tests only."""
        if not self.is_cuda:
            return self.reference_view().copy()
        c = lambda t: None if t is None else t.cpu().numpy()  # noqa: E731
        return self._ref(c(self.fp8), c(self.scale), None if self.rope is None else self.rope.float().cpu().numpy(),
                         c(self.index_q), c(self.index_sf), c(self.block_table), c(self.written), c(self.marks),
                         c(self.pages), c(self.index_pages), c(self.request_ids), c(self.owners))

    def reference_view(self) -> ref.PagedPoolRef:
        """CPU pools: a PagedPoolRef sharing this pool's arrays (request table
        included): the CPU ops run the reference on it."""
        if self.is_cuda:
            raise ValueError("pool: reference_view() is for CPU pools; use to_reference()")
        return self._ref(self.fp8, self.scale, self.rope, self.index_q, self.index_sf, self.block_table,
                         self.written, self.marks, self.pages, self.index_pages, self.request_ids, self.owners)

    def _ref(self, fp8, scale, rope, iq, isf, table, written, marks, pages, index_pages, request_ids,
             owners) -> ref.PagedPoolRef:
        model1 = self.layout == "model1"
        return ref.PagedPoolRef(self.m, fp8, scale, rope, iq, isf, table, written, marks, pages, index_pages,
                                self.index_layout if model1 else None,
                                self.entries_per_block if model1 else None, request_ids, owners)
