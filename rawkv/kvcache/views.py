"""The KV-cache ops as rawkv:: operators (rawkv.library): schemas and views.

A torch operator takes tensors and scalars, not a PagedKVPool / DecodeState,
so each op's schema lists the object's buffers (torch_buffers(): the ones
the op writes marked `(!)`) and the one geometry value their shapes do not
hold (the pool's `kind`). Under torch.compile a public op passes its
object's buffers (pool_args / state_args); the operator's implementation
rebuilds a view over them (pool_view / state_view: checked, no allocation)
and runs the same op on it. A view has no host bookkeeping (free list,
prepared entries): the ops need none, except gather_dense's bound of
n_entries by pool.n_entries(slot), which a view cannot check (the kernel
still bounds every id by pool.written).
"""
from __future__ import annotations

import re
import string

from .. import _args as A
from ..reference import kvcache as ref
from ..reference.kvcache import layouts as R
from . import checks as C
from .pool import KINDS, PagedKVPool
from .state import DecodeState

U8 = ("uint8",)


def schema(*parts: str) -> str:
    """Join schema fragments and name each written argument's alias set in
    order: the first `Tensor(!)` becomes `Tensor(a!)`, the next `Tensor(b!)`."""
    letters = iter(string.ascii_lowercase)
    return re.sub(r"\(!\)", lambda _: f"({next(letters)}!)", ", ".join(p for p in parts if p))


def pool_schema(writes: bool, owners: bool = False) -> str:
    """A pool's arguments: its entry buffers and `written` are written by
    the ops that write entries; `errors` (the counter the op adds to) always.
    The entry buffers of the layout the pool does not use are None: fp8,
    scale, rope (and index_q, index_sf) for "rawkv", pages (and index_pages)
    for "model1". `owners` (and `marks`) are written by assign_pages
    (`owners=True`); every other op reads them."""
    w = "(!)" if writes else ""
    o = "(!)" if owners else ""
    return (f"str kind, Tensor{w}? fp8, Tensor{w}? scale, Tensor{w}? rope, Tensor{w}? index_q, "
            f"Tensor{w}? index_sf, Tensor{w}? pages, Tensor{w}? index_pages, Tensor block_table, "
            f"Tensor request_ids, Tensor{o} owners, Tensor{w} written, Tensor{w or o} marks, "
            "Tensor(!) errors")


_STATE = DecodeState.BUFFERS[:-1]       # a state's buffers but its counter


def state_schema(writes: bool, prefix: str = "", counter: bool = True, optional: bool = False,
                 b_writes=None) -> str:
    """A decode state's arguments (names prefixed: an indexer state's
    `index_kv_a`, ...): its a-stream and count written when `writes`, its
    b-stream when `b_writes` (default: `writes`); with `counter`, `errors`,
    the counter the op adds to; `optional`: every buffer may be None (no
    such state). kv_b / z_b are given exactly for a CSA state."""
    b = writes if b_writes is None else b_writes
    q = "?" if optional else ""
    text = ", ".join(f"Tensor{'(!)' if (b if n in ('kv_b', 'z_b') else writes) else ''}"
                     f"{'?' if n in ('kv_b', 'z_b') else q} {prefix}{n}" for n in _STATE)
    return text + (", Tensor(!) errors" if counter else "")


def pool_args(pool, errors=None) -> dict:
    """The pool's operator arguments (pool_schema); `errors` replaces the
    pool's counter when given."""
    args = {"kind": pool.kind, **pool.torch_buffers()}
    if errors is not None:
        args["errors"] = errors
    return args


def state_args(state, errors=None, *, prefix: str = "", counter: bool = True) -> dict:
    """The state's operator arguments (state_schema; a None state: all
    None): with `counter`, its `errors` (or the `errors` given); names
    prefixed by `prefix`."""
    if state is None:
        return {prefix + n: None for n in _STATE}
    t = state.torch_buffers()
    args = {prefix + n: t[n] for n in _STATE}
    if counter:
        args["errors"] = t["errors"] if errors is None else errors
    return args


def take_state(kw: dict, prefix: str = ""):
    """Pop a state's arguments (named with `prefix`) from an operator's
    keywords: a view over them, or None when they are all None."""
    bufs = [kw.pop(prefix + n) for n in _STATE]
    return None if all(b is None for b in bufs) else state_view(*bufs)


def call(decl, **kwargs) -> None:
    """Under torch.compile: call the op's rawkv:: operator."""
    import torch
    decl.call(torch, **kwargs)


def traced_out(decl, pool, out, dtype, shape, errors, **inputs):
    """Under torch.compile, a gather: `out` (or a new tensor of `shape` and
    `dtype`, bfloat16 by default, on the pool's device) written by the
    operator."""
    import torch
    t = out.dtype if dtype is None and out is not None else \
        torch.bfloat16 if dtype is None else getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if out is None:
        out = torch.empty(shape, dtype=t, device=pool.device)
    elif out.dtype != t:
        raise TypeError(f"out: dtype {out.dtype} is not the dtype asked for ({t})")
    decl.call(torch, **pool_args(pool, errors), **inputs, out=out)
    return out


def _device(x):
    """CUDA device index of the first buffer, which every other buffer must
    share; None for a host array (C.arg then checks it is one)."""
    return x.get_device() if getattr(x, "is_cuda", False) is True else None


def _blocks_of(x, name: str, nb: int, epb: int) -> None:
    """A per-entry buffer: (num_blocks, entries_per_block, n), fp8's blocks."""
    if tuple(x.shape[:2]) != (nb, epb):
        raise ValueError(f"{name}: expected shape ({nb}, {epb}, n) (fp8's blocks), got {tuple(x.shape)}")


def pool_view(kind, fp8, scale, rope, index_q, index_sf, pages, index_pages, block_table, request_ids, owners,
              written, marks, errors) -> PagedKVPool:
    """A PagedKVPool over these buffers (a CUDA pool's tensors, or host
    arrays: a CPU pool's, as numpy views), geometry from their shapes and
    `kind`, checked as the constructor checks its sizes. The layout is
    "model1" when `pages` is given (then fp8, scale, rope, index_q and
    index_sf are None), else "rawkv". rope is bfloat16 on CUDA and float32
    (holding BF16 values) on the host, as in a pool."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected 'csa' or 'hca', got {kind!r}")
    if pages is not None:
        return _pages_view(kind, fp8, scale, rope, index_q, index_sf, pages, index_pages, block_table,
                           request_ids, owners, written, marks, errors)
    if index_pages is not None:
        raise ValueError("index_pages: given without pages (a 'model1' pool has both)")
    dev = _device(fp8)
    f = C.arg(fp8, "fp8", U8, dev, ndim=3)
    nb, epb, nope = f.shape
    s = C.arg(scale, "scale", C.F32, dev, shape=(nb, epb))
    r = C.arg(rope, "rope", C.F32 if dev is None else C.BF16, dev, ndim=3)
    _blocks_of(r, "rope", nb, epb)
    if (index_q is None) != (index_sf is None):
        raise ValueError("index_q: index_q and index_sf are given together (a pool with indexer "
                         "keys) or both None")
    ih = None
    iq = isf = None
    if index_q is not None:
        iq = C.arg(index_q, "index_q", U8, dev, ndim=3)
        _blocks_of(iq, "index_q", nb, epb)
        ih = 2 * iq.shape[2]
        isf = C.arg(index_sf, "index_sf", U8, dev, shape=(nb, epb, ih // 16))
    bt, ids, own, wr, mk, err = _table_args(block_table, request_ids, owners, written, marks, errors, dev,
                                            (nb, epb))
    p = PagedKVPool.__new__(PagedKVPool)
    p._set_geometry(kind, nb, epb, bt.shape[0], bt.shape[1], nope + r.shape[2], r.shape[2], ih)
    p.fp8, p.scale, p.rope, p.index_q, p.index_sf = f, s, r, iq, isf
    p.pages = p.index_pages = None
    return _finish_view(p, dev, f, bt, ids, own, wr, mk, err)


def _table_args(block_table, request_ids, owners, written, marks, errors, dev, marks_shape):
    """The request table, the page owners, the marks and the counter of a
    view, checked."""
    bt = C.arg(block_table, "block_table", C.I32, dev, ndim=2)
    ids = C.arg(request_ids, "request_ids", C.I32, dev, shape=(bt.shape[0],))
    own = C.arg(owners, "owners", C.I32, dev, shape=(marks_shape[0],))
    wr = C.arg(written, "written", C.I32, dev, shape=(bt.shape[0],))
    mk = C.arg(marks, "marks", U8, dev, shape=marks_shape)
    err = C.errors_arg(A.require_array(errors, "errors"), None, dev)
    return bt, ids, own, wr, mk, err


def _finish_view(p, dev, first, bt, ids, own, wr, mk, err) -> PagedKVPool:
    p.is_cuda, p.device_index = dev is not None, dev
    p.device = first.device if dev is not None else "cpu"
    p.block_table, p.request_ids, p.owners, p.written, p.marks, p.errors = bt, ids, own, wr, mk, err
    p._table = p._free = p._active = p._nblocks = p._n_entries = p._staging = None
    p._ids = p._next_id = None
    p._seal()
    _counter_apart(p, "pool")
    return p


def _counter_apart(view, name: str) -> None:
    """A view's counter must not overlap its other buffers: under
    torch.compile a public op's errors= becomes the counter of the view its
    operator runs on (pool_args / state_args), so this is the eager ops'
    rule for errors= (checks.owned: 'errors: overlaps pool.written') on the
    operators' path. The spans stay cached on the view for the op's own
    check of out=."""
    if view.errors is None:
        return
    counter = f"{name}.errors"
    C.check_outputs((("errors", view.errors),), (), tuple(o for o in C.owned(view, name) if o[0] != counter))


def _pages_view(kind, fp8, scale, rope, index_q, index_sf, pages, index_pages, block_table, request_ids,
                owners, written, marks, errors) -> PagedKVPool:
    """pool_view of a "model1" pool: the page size is marks' second
    dimension; the indexer-key layout follows from index_pages' page bytes."""
    for name, x in (("fp8", fp8), ("scale", scale), ("rope", rope), ("index_q", index_q),
                    ("index_sf", index_sf)):
        if x is not None:
            raise ValueError(f"{name}: a 'model1' pool (pages given) has no {name} buffer; pass None")
    dev = _device(pages)
    pg = C.arg(pages, "pages", U8, dev, ndim=2)
    mk = C.arg(marks, "marks", U8, dev, ndim=2)
    nb, epb = mk.shape
    if pg.shape[0] != nb or pg.shape[1] != R.MODEL1.page_bytes(epb):
        raise ValueError(f"pages: expected shape ({nb}, {R.MODEL1.page_bytes(epb)}) (marks' blocks, "
                         f"MODEL1 pages of {epb} entries), got {tuple(pg.shape)}")
    ih, il, ip = None, "fp8", None
    if index_pages is not None:
        ip = C.arg(index_pages, "index_pages", U8, dev, ndim=2)
        by_bytes = {lay.page_bytes(epb): name for name, lay in ref.INDEX_LAYOUTS.items()}
        if ip.shape[0] != nb or ip.shape[1] not in by_bytes:
            raise ValueError(f"index_pages: expected shape ({nb}, one of {sorted(by_bytes)}) (FP8 or MXFP4 "
                             f"key pages of {epb} entries), got {tuple(ip.shape)}")
        ih, il = ref.INDEX_HEAD_DIM, by_bytes[ip.shape[1]]
    bt, ids, own, wr, mk, err = _table_args(block_table, request_ids, owners, written, mk, errors, dev,
                                            (nb, epb))
    p = PagedKVPool.__new__(PagedKVPool)
    p._set_geometry(kind, nb, epb, bt.shape[0], bt.shape[1], ref.HEAD_DIM, ref.ROPE_DIM, ih, "model1", il)
    p.fp8 = p.scale = p.rope = p.index_q = p.index_sf = None
    p.pages, p.index_pages = pg, ip
    return _finish_view(p, dev, pg, bt, ids, own, wr, mk, err)


def state_view(kv_a, z_a, kv_b, z_b, count, errors=None) -> DecodeState:
    """A DecodeState over these buffers: CSA when kv_b / z_b are given, HCA
    when both are None; m, max_requests and head_dim from kv_a's shape.
    `errors` None: a state for ops that count nothing (state_seed, the
    compressor's read of it)."""
    dev = _device(kv_a)
    a = C.arg(kv_a, "kv_a", C.F32, dev, ndim=3)
    R, m, w = a.shape
    kind = "hca" if kv_b is None else "csa"
    coff = 2 if kind == "csa" else 1
    if m != KINDS[kind] or w % coff:
        raise ValueError(f"kv_a: a {kind.upper()} state (kv_b {'given' if kv_b is not None else 'None'}) "
                         f"has shape (slots, {KINDS[kind]}, {'2*' if kind == 'csa' else ''}head_dim), "
                         f"got {tuple(a.shape)}")
    st = DecodeState.__new__(DecodeState)
    st._set_geometry(kind, R, w // coff)
    za = C.arg(z_a, "z_a", C.F32, dev, shape=(R, m, w))
    if (kv_b is None) != (z_b is None):
        raise ValueError("z_b: kv_b and z_b are given together (a CSA state) or both None (HCA)")
    kb = zb = None
    if kv_b is not None:
        kb = C.arg(kv_b, "kv_b", C.F32, dev, shape=(R, m, st.head_dim))
        zb = C.arg(z_b, "z_b", C.F32, dev, shape=(R, m, st.head_dim))
    c = C.arg(count, "count", C.I32, dev, shape=(R,))
    st.is_cuda, st.device_index = dev is not None, dev
    st.device = a.device if dev is not None else "cpu"
    st.kv_a, st.z_a, st.kv_b, st.z_b, st.count = a, za, kb, zb, c
    st.errors = None if errors is None else C.errors_arg(errors, None, dev)
    st._seal()
    _counter_apart(st, "state")
    return st

