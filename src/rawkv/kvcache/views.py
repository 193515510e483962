"""The KV-cache ops as rawkv:: operators (rawkv.library): schemas and views.

A torch operator takes tensors and scalars, not a PagedKVPool / DecodeState,
so each op's schema lists the object's buffers (torch_buffers(): the ones
the op writes marked `(!)`) and the geometry their shapes do not hold (the
pool's `kind`, and its `index_layout`: FP8 and MXFP8 key pages have the
same bytes when the page size is a multiple of 128). A public op passes its object's buffers
(pool_operands / state_operands) and, in eager mode, the object itself;
its body (written with rawkv._op.op, taking the schema's arguments as
*args) takes them apart with pool_of / state_of: the object given, or,
when the operator runs (torch.compile, an engine's graph), a view rebuilt
over the buffers (pool_view / state_view: checked, no allocation). A view
has no host bookkeeping (free list, prepared entries): the ops need none,
except gather_dense's bound of n_entries by pool.n_entries(slot), which a
view over a pool's own buffers reads from that pool (check_one_owner; over
an engine's own buffers the kernel's bound by pool.written alone holds),
and compress_decode's test that its states are attached to the pool: a
view over a pool's own buffers requires state views over the buffers of
states attached to that pool (check_one_owner), as the public op requires
of the objects; over an engine's own pool buffers there is no pool to ask.
"""
from __future__ import annotations

import re
import string

import numpy as np

from .. import _args as A
from ..reference import kvcache as ref
from ..reference.kvcache import layouts as R
from . import _rules as C
from .pool import KINDS, PagedKVPool, check_counter_owner, check_one_owner, check_view_key_layout
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
    (`owners=True`); every other op reads them. `index_layout` is the pool's
    (None: inferred from the key pages' bytes where they tell it)."""
    w = "(!)" if writes else ""
    o = "(!)" if owners else ""
    return (f"str kind, str? index_layout, Tensor{w}? fp8, Tensor{w}? scale, Tensor{w}? rope, Tensor{w}? index_q, "
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
    args = {"kind": pool.kind, "index_layout": pool.index_layout, **pool.torch_buffers()}
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


POOL_ARITY = len(PagedKVPool.BUFFERS) + 2       # pool_schema's arguments: kind, index_layout, the buffers


def pool_operands(pool, errors=None) -> tuple:
    """pool_args' values in schema order, as a public op passes them to its
    op (positionally): the pool's operator_buffers, `errors` replacing its
    counter when given."""
    b = pool.operator_buffers()
    return (pool.kind, pool.index_layout, *b[:-1], b[-1] if errors is None else errors)


def widths(operands: tuple) -> tuple:
    """(head_dim, index_head_dim or None) of a pool's operands
    (pool_operands), as pool_view reads them: fp8's plus rope's last
    dimension and twice index_q's ("rawkv"), the layout's fixed sizes
    ("model1"). A public op sizes a new output with these, never with the
    pool's host ints: under torch.compile(dynamic=True) dynamo makes an
    object's int a graph input of its own, which the rules' comparisons
    (compress_decode's state.head_dim == pool.head_dim) equate with another
    object's; torch 2.13's inductor then binds the input under its own
    symbol while the size is written with the other one's, an input dynamo
    pruned as unused (`NameError: name 's16' is not defined` in the
    generated code; docs/engines.md). A buffer's dimension is always bound."""
    b = dict(zip(PagedKVPool.BUFFERS, operands[POOL_ARITY - len(PagedKVPool.BUFFERS):]))   # (after kind, index_layout)
    if b["pages"] is not None:
        return ref.HEAD_DIM, (None if b["index_pages"] is None else ref.INDEX_HEAD_DIM)
    iq = b["index_q"]
    return A.dims(b["fp8"])[2] + A.dims(b["rope"])[2], (None if iq is None else 2 * A.dims(iq)[2])


def state_operands(state, errors=None, *, counter: bool = True) -> tuple:
    """state_args' values in schema order (a None state: all None), as a
    public op passes them to its op."""
    if state is None:
        return (None,) * (len(_STATE) + counter)
    b = state.operator_buffers()
    if not counter:
        return b[:-1]
    return (*b[:-1], b[-1] if errors is None else errors)


def pool_of(args: tuple, pool) -> tuple:
    """(pool, errors, the op's own arguments) of a pool op's body from its
    schema arguments `args` (pool_schema's first): `pool` is the
    PagedKVPool of an eager call, whose operands lead args; None (the
    operator runs) builds a view over them (pool_view, checked), whose
    counter is args' errors."""
    if pool is None:
        pool = pool_view(*args[:POOL_ARITY])
        return pool, pool.errors, args[POOL_ARITY:]
    return pool, args[POOL_ARITY - 1], args[POOL_ARITY:]


def state_of(args: tuple, state, *, counter: bool = True, optional: bool = False) -> tuple:
    """(state, errors, the arguments after its own) of a body's `args` that
    start with a state's (state_schema), as pool_of: `state` the object of
    an eager call, else a view over them; without `counter` errors is None;
    `optional`: all None is no state (None)."""
    k = len(_STATE) + counter
    if state is None:
        bufs = args[:k]
        if optional and all(b is None for b in bufs):
            return None, None, args[k:]
        state = state_view(*bufs)
        return state, state.errors, args[k:]
    return state, (args[k - 1] if counter else None), args[k:]


def _where(x) -> tuple:
    """(placement, device index) of a view whose first buffer is x: every
    other buffer must be there too; -1 is the host."""
    if getattr(x, "is_cuda", False) is True:
        return "cuda", x.get_device()
    return "cpu", -1


#: The first-byte alignment of a view's data buffers (entries, pages, keys,
#: the decode state's rows): the kernels load and store them 16 bytes at a
#: time, as the buffers a pool or state allocates itself are aligned.
DATA_ALIGN = 16


def _buf(x, name: str, dtypes: tuple, at: tuple, **kw):
    """A view's buffer, checked (C.arg); on the host as numpy (the
    reference's), sharing the memory. A read-only numpy array is refused,
    naming it: every buffer of a pool or decode state is one some op
    writes, and a view over one was taken, then an op failed part way
    through with numpy's unnamed 'assignment destination is read-only'
    after writing the others (flush_write on a read-only `written` had
    written pages and marks)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name}: is read-only (a numpy array with flags.writeable False); a view's buffers "
                         "are its pool's or decode state's, which the ops write: pass writable arrays")
    x = C.arg(x, name, dtypes, *at, **kw)
    return x if at[0] == "cuda" else A.to_numpy(x, name)


def _blocks_of(x, name: str, nb: int, epb: int) -> None:
    """A per-entry buffer: (num_blocks, entries_per_block, n), fp8's blocks."""
    if tuple(x.shape[:2]) != (nb, epb):
        raise ValueError(f"{name}: expected shape ({nb}, {epb}, n) (fp8's blocks), got {tuple(x.shape)}")


def pool_view(kind, index_layout, fp8, scale, rope, index_q, index_sf, pages, index_pages, block_table,
              request_ids, owners, written, marks, errors) -> PagedKVPool:
    """A PagedKVPool over these buffers (a CUDA pool's tensors, or host
    arrays: a CPU pool's, as numpy views), geometry from their shapes,
    `kind` and `index_layout`, checked as the constructor checks its sizes.
    The layout is "model1" when `pages` is given (then fp8, scale, rope,
    index_q and index_sf are None), else "rawkv". rope is bfloat16 on CUDA
    and float32 (holding BF16 values) on the host, as in a pool.
    index_layout is the pool's ('fp8', 'mxfp4', 'mxfp8' for "model1" key
    pages, 'nvfp4' for "rawkv" keys, None without keys) or None: then
    "model1" key pages' layout follows from their page bytes, and pages
    two layouts share (FP8 and MXFP8 keys at a page size that is a multiple
    of 128) are refused, naming index_layout."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected 'csa' or 'hca', got {kind!r}")
    if pages is not None:
        return _pages_view(kind, index_layout, fp8, scale, rope, index_q, index_sf, pages, index_pages,
                           block_table, request_ids, owners, written, marks, errors)
    if index_pages is not None:
        raise ValueError("index_pages: given without pages (a 'model1' pool has both)")
    at = _where(fp8)
    f = _buf(fp8, "fp8", U8, at, ndim=3, align=DATA_ALIGN)
    nb, epb, nope = f.shape
    s = _buf(scale, "scale", C.F32, at, shape=(nb, epb), align=DATA_ALIGN)
    r = _buf(rope, "rope", C.BF16 if at[0] == "cuda" else C.F32, at, ndim=3, align=DATA_ALIGN)
    _blocks_of(r, "rope", nb, epb)
    if (index_q is None) != (index_sf is None):
        raise ValueError("index_q: index_q and index_sf are given together (a pool with indexer "
                         "keys) or both None")
    _key_layout(index_layout, "rawkv")
    ih = None
    iq = isf = None
    if index_q is not None:
        iq = _buf(index_q, "index_q", U8, at, ndim=3, align=DATA_ALIGN)
        _blocks_of(iq, "index_q", nb, epb)
        ih = 2 * iq.shape[2]
        isf = _buf(index_sf, "index_sf", U8, at, shape=(nb, epb, ih // 16), align=DATA_ALIGN)
    bt, ids, own, wr, mk, err = _table_args(block_table, request_ids, owners, written, marks, errors, at,
                                            (nb, epb))
    p = PagedKVPool.__new__(PagedKVPool)
    p._set_geometry(kind, nb, epb, bt.shape[0], bt.shape[1], nope + r.shape[2], r.shape[2], ih)
    p.fp8, p.scale, p.rope, p.index_q, p.index_sf = f, s, r, iq, isf
    p.pages = p.index_pages = None
    return _finish_view(p, at, f, bt, ids, own, wr, mk, err)


def _table_args(block_table, request_ids, owners, written, marks, errors, at, marks_shape):
    """The request table, the page owners, the marks and the counter of a
    view, checked."""
    bt = _buf(block_table, "block_table", C.I32, at, ndim=2, align=A.ELEMENT)
    ids = _buf(request_ids, "request_ids", C.I32, at, shape=(bt.shape[0],), align=A.ELEMENT)
    own = _buf(owners, "owners", C.I32, at, shape=(marks_shape[0],), align=A.ELEMENT)
    wr = _buf(written, "written", C.I32, at, shape=(bt.shape[0],), align=A.ELEMENT)
    mk = _buf(marks, "marks", U8, at, shape=marks_shape)
    return bt, ids, own, wr, mk, _counter(errors, at)


def _counter(errors, at):
    """A view's counter: A.counter's rule, as numpy on the host."""
    err = A.counter(A.require_array(errors, "errors"), *at)
    return err if at[0] == "cuda" else A.to_numpy(err, "errors")


def _finish_view(p, at, first, bt, ids, own, wr, mk, err) -> PagedKVPool:
    cuda = at[0] == "cuda"
    p.is_cuda, p.device_index = cuda, (at[1] if cuda else None)
    p.device = first.device if cuda else "cpu"
    p.block_table, p.request_ids, p.owners, p.written, p.marks, p.errors = bt, ids, own, wr, mk, err
    p._table = p._free = p._active = p._nblocks = p._staging = None
    p._ids = p._next_id = None
    # over a pool's own buffers (its block table, and no other object's
    # buffer): that pool's count of prepared entries, read when the op runs
    # (gather_dense's bound of n_entries, as eagerly), and the pool itself
    # (compress_decode's states must be attached to it)
    owner = check_one_owner(p, "pool", "block_table")
    check_view_key_layout(p)
    p._owner = owner
    p._n_entries = None if owner is None else owner._n_entries
    p._seal()
    _counter_apart(p, "pool")
    check_counter_owner(p)
    return p


def _counter_apart(view, name: str) -> None:
    """A view's counter, then each of its other buffers, must not overlap
    its other buffers (_buffers_apart for the latter). Under
    torch.compile a public op's errors= becomes the counter of the view its
    operator runs on (pool_operands / state_operands), so this is the eager
    ops' rule for errors= (_rules.outputs: 'errors: overlaps pool.written')
    on the operators' path. The spans stay cached on the view for the op's
    own check of out=."""
    counter = f"{name}.errors"
    if view.errors is not None:
        A.check_outputs((("errors", view.errors),), (), tuple(o for o in C.owned(view, name) if o[0] != counter))
    _buffers_apart(tuple(o for o in C.owned(view, name) if o[0] != counter), name)


def _buffers_apart(spans: tuple, name: str) -> None:
    """A view's buffers lie apart in memory, as a pool's or state's own
    allocations do: an engine's buffers carved from one allocation that
    overlap (written over request_ids, owners inside the block table, marks
    inside pages) would let an op's writes change the tables the next op
    reads, e.g. a flush raising written[s] renumbering slot s's request, with
    no error. A ValueError naming both (`written: overlaps request_ids`)."""
    cut = len(name) + 1
    for i, (n, sp) in enumerate(spans):
        for other, t in spans[:i]:
            if A._overlap(sp, t):
                raise ValueError(f"{n[cut:]}: overlaps {other[cut:]} in memory; a {name}'s buffers are "
                                 "separate (an op writing one would change what the next op reads in the "
                                 "other): pass separate buffers")


def _key_layout(index_layout, layout: str) -> None:
    """A view's index_layout: None, or one of what its layout takes, by the
    constructor's rule and error (reference index_layout_of; a pool without
    keys takes the engine's one setting too)."""
    if index_layout is not None:
        ref.index_layout_of(layout, index_layout)


def _pages_view(kind, index_layout, fp8, scale, rope, index_q, index_sf, pages, index_pages, block_table,
                request_ids, owners, written, marks, errors) -> PagedKVPool:
    """pool_view of a "model1" pool: the page size is marks' second
    dimension; the indexer-key layout is index_layout, or (None) the one
    index_pages' page bytes fit, refused where two layouts fit them."""
    for name, x in (("fp8", fp8), ("scale", scale), ("rope", rope), ("index_q", index_q),
                    ("index_sf", index_sf)):
        if x is not None:
            raise ValueError(f"{name}: a 'model1' pool (pages given) has no {name} buffer; pass None")
    at = _where(pages)
    pg = _buf(pages, "pages", U8, at, ndim=2, align=DATA_ALIGN)
    mk = _buf(marks, "marks", U8, at, ndim=2)
    nb, epb = mk.shape
    if pg.shape[0] != nb or pg.shape[1] != R.MODEL1.page_bytes(epb):
        raise ValueError(f"pages: expected shape ({nb}, {R.MODEL1.page_bytes(epb)}) (marks' blocks, "
                         f"MODEL1 pages of {epb} entries), got {tuple(pg.shape)}")
    ih, il, ip = None, "fp8", None
    _key_layout(index_layout, "model1")
    if index_pages is not None:
        ip = _buf(index_pages, "index_pages", U8, at, ndim=2, align=DATA_ALIGN)
        names = (index_layout,) if index_layout is not None else tuple(ref.INDEX_LAYOUTS)
        fits = [n for n in names if ref.INDEX_LAYOUTS[n].page_bytes(epb) == ip.shape[1]]
        if ip.shape[0] != nb or not fits:
            want = sorted({ref.INDEX_LAYOUTS[n].page_bytes(epb) for n in names})
            what = f"{index_layout!r} key pages" if index_layout is not None else "FP8, MXFP4 or MXFP8 key pages"
            raise ValueError(f"index_pages: expected shape ({nb}, {want[0] if len(want) == 1 else f'one of {want}'}) "
                             f"({what} of {epb} entries), got {tuple(ip.shape)}")
        if len(fits) > 1:
            raise ValueError(f"index_layout: index_pages of {ip.shape[1]} bytes are {' or '.join(fits)} key pages "
                             f"of {epb} entries alike (the same page bytes); pass the pool's index_layout")
        ih, il = ref.INDEX_HEAD_DIM, fits[0]
    bt, ids, own, wr, mk, err = _table_args(block_table, request_ids, owners, written, mk, errors, at,
                                            (nb, epb))
    p = PagedKVPool.__new__(PagedKVPool)
    p._set_geometry(kind, nb, epb, bt.shape[0], bt.shape[1], ref.HEAD_DIM, ref.ROPE_DIM, ih, "model1", il)
    p.fp8 = p.scale = p.rope = p.index_q = p.index_sf = None
    p.pages, p.index_pages = pg, ip
    return _finish_view(p, at, pg, bt, ids, own, wr, mk, err)


def state_view(kv_a, z_a, kv_b, z_b, count, errors=None) -> DecodeState:
    """A DecodeState over these buffers: CSA when kv_b / z_b are given, HCA
    when both are None; m, max_requests and head_dim from kv_a's shape.
    `errors` None: a state for ops that count nothing (state_seed, the
    compressor's read of it)."""
    at = _where(kv_a)
    a = _buf(kv_a, "kv_a", C.F32, at, ndim=3, align=DATA_ALIGN)
    R, m, w = a.shape
    kind = "hca" if kv_b is None else "csa"
    coff = 2 if kind == "csa" else 1
    if m != KINDS[kind] or w % coff:
        raise ValueError(f"kv_a: a {kind.upper()} state (kv_b {'given' if kv_b is not None else 'None'}) "
                         f"has shape (slots, {KINDS[kind]}, {'2*' if kind == 'csa' else ''}head_dim), "
                         f"got {tuple(a.shape)}")
    st = DecodeState.__new__(DecodeState)
    st._set_geometry(kind, R, w // coff)
    za = _buf(z_a, "z_a", C.F32, at, shape=(R, m, w), align=DATA_ALIGN)
    if (kv_b is None) != (z_b is None):
        raise ValueError("z_b: kv_b and z_b are given together (a CSA state) or both None (HCA)")
    kb = zb = None
    if kv_b is not None:
        kb = _buf(kv_b, "kv_b", C.F32, at, shape=(R, m, st.head_dim), align=DATA_ALIGN)
        zb = _buf(z_b, "z_b", C.F32, at, shape=(R, m, st.head_dim), align=DATA_ALIGN)
    c = _buf(count, "count", C.I32, at, shape=(R,), align=A.ELEMENT)    # (the kernels' int32 loads / stores)
    cuda = at[0] == "cuda"
    st.is_cuda, st.device_index = cuda, (at[1] if cuda else None)
    st.device = a.device if cuda else "cpu"
    st.kv_a, st.z_a, st.kv_b, st.z_b, st.count = a, za, kb, zb, c
    st.errors = None if errors is None else _counter(errors, at)
    # over a state's own buffers: that state (its pool, if attached)
    st._owner = check_one_owner(st, "state", "kv_a")
    st._seal()
    _counter_apart(st, "state")
    check_counter_owner(st)
    return st

