"""The KV-cache operators' memory rules under torch.compile (docs/kvcache.md,
"Under torch.compile"); rawkv.library's fake implementation calls check().

torch.compile functionalizes a call of a mutating operator: each argument
it writes reaches the implementation as a fresh copy, which torch then
copies back over the argument (aot_eager always; inductor wherever it
cannot rewrite the call in place, e.g. when the graph reads the buffer
before the call). The rules that find a tensor by its memory (the registry
of the pools' and decode states' buffers: check_store_cache,
check_not_anothers, check_one_owner, ...; A.check_outputs between tensors
that share memory but not a torch storage, like two torch.from_numpy views
of a CPU pool's array) then see the copy, memory of nobody's, and a
compiled call took what eager refuses: a store into pool.marks, a gather
adding its count into pool.request_ids, a flush into another pool's
`written`; torch's copy-back wrote it.

Decision: check the call while dynamo traces it, when every argument is
still the caller's tensor, a view of one, or memory the graph allocates:

- a fake tensor argument over a graph input's fake storage becomes the same
  view of that input's real tensor (dynamo's GraphArgs keep both); one over
  memory the graph allocates becomes a fresh stand-in of its geometry (such
  memory is no object's buffer and overlaps no input: nothing the registry
  knows; allocated for the check on the argument's device, freed after);
- the op's body checks them (`checks_only=True`: every eager check,
  nothing written) and raises the eager error, naming the argument;
- each graph input it used is guarded on where its memory lies among the
  registered buffers (pool.placement), so a later call of the compiled
  function on memory placed otherwise is traced and checked again, not run
  on the copies. dynamo's own guards cover shapes, strides, dtypes and
  which inputs share a storage.

Rejected: checking only when the op runs (under inductor the copies it
makes, and under every backend a buffer a torch op of the graph wrote,
are all it gets; the originals are not reachable from it), and guarding
a tensor's identity (a freed tensor's id is reused, and an engine's
fresh `out=` each step would retrace every call).

When the op runs under torch's auto_functionalized (aot_eager), the
copies are reachable: its frame holds each copy beside the tensor it was
made of. The kernel records them (note_copies, pool.COPIES), and while
the body runs its registry lookups read a copy, or a copy an earlier
operator of the graph wrote, as the tensor it stands for: the runtime
rules then decide as eagerly. Before, they saw memory of nobody's there
too, and refused what eager takes (the demo's decode step: compress_decode
given state_append's copies of the decode states, "state: is not attached
to this pool") or took what it refuses on a later call not traced again
(a flush given another pool's `written`, which lies where the traced one
did).

A call is checked only when it writes a graph input's memory: aot's own
trace of the graph passes the copies again (nothing to learn from them),
and a call that writes only memory the graph allocates has no rule the
copies hide. Not covered (docs/kvcache.md): a symbolic size without a
hint (unbacked); on a later call, memory shared between two tensors
that torch sees as separate storages of which neither lies in a pool's or
state's buffer (two torch.from_numpy views of an engine's own array); and
when the op runs, a pool's or state's buffer that a torch op of the graph
(not a rawkv operator) wrote, or a copy inductor's code made, which is a
buffer of torch's own there (docs/engines.md).
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _args as A
from . import pool as _pool


# What a torch whose dynamo internals differ from those this module reads
# (GraphArg's example and fake tensor, the translator's output graph, the
# guard builder; torch 2.11 and 2.13 tested) raises there: such a torch
# compiles rawkv's operators as before, without this check.
_INTERNALS = (AttributeError, ImportError, TypeError, KeyError)


class _NoHint(Exception):
    """A symbolic value without a hint: nothing concrete to check."""


def check(decl, args: tuple) -> None:
    """Check `decl`'s call `args` (fake tensors, schema order) as eagerly,
    on the real tensors, when dynamo traces it and it writes a graph
    input's memory; then guard those inputs (module docstring)."""
    tx = _tracer()
    if tx is None:
        return
    try:
        inputs = _inputs(tx)
        found = {}
        for i in decl.tensors:
            a = args[i] if i < len(args) else None
            if isinstance(a, torch.Tensor):
                gas = inputs.get(_storage(a))
                if gas is not None:
                    found[i] = gas
        if not any(i in found for i, (_, _, w) in enumerate(decl.args) if w):
            return
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except _INTERNALS:
        return                  # (dynamo's internals changed: not checked, never a failed compile)
    try:
        with unset_fake_temporarily():
            try:
                real = [_real(a, found.get(i)) if isinstance(a, torch.Tensor) else _concrete(a)
                        for i, a in enumerate(args)]
            except _INTERNALS:
                return
            decl.body(*real, checks_only=True)      # (the eager refusal, naming the argument)
    except _NoHint:
        return
    for gas in found.values():
        for ga in gas:
            try:
                _guard(tx, ga)
            except _INTERNALS:
                return


def call_noting_copies(body, args):
    """A KV-cache operator's kernel (rawkv.library): body(*args), its rules
    deciding on the tensors torch's copies stand for when the call runs
    under auto_functionalized (note_copies)."""
    if not note_copies():
        return body(*args)
    flag = _pool.IN_COPIES
    was = getattr(flag, "on", False)
    flag.on = True
    try:
        return body(*args)
    finally:
        flag.on = was


def note_copies() -> bool:
    """Whether torch's auto_functionalized runs the calling operator (a
    compiled graph that does not write in place: backend="aot_eager"); its
    copies are then recorded. The arguments the operator writes are copies
    torch just made of the graph's tensors, and an argument it only reads
    may be such a copy an earlier operator of the graph wrote
    (compress_decode reads the decode state state_append wrote). Each copy
    is recorded with the tensor it stands for (pool.COPIES; a copy of a
    copy with the first tensor), so the body's rules that find a tensor by
    its memory (a pool's or state's buffers: pool._lookup, pool.placement)
    decide on what the eager call passes them: before, the demo's decode
    step was refused ("state: is not attached to this pool": compress_decode
    saw state_append's copies, memory of no state), and a flush given
    another pool's `written` (its copy) was taken. False outside
    auto_functionalized (an eager call, inductor's code), and where torch's
    internals differ (_INTERNALS): the rules then see what they are given,
    as before."""
    codes = _CODES or _af_codes()
    if not codes:
        return False            # (nothing functionalized in this process yet)
    try:
        pairs = _functional_copies(codes)
    except (ValueError, *_INTERNALS):     # (ValueError: a stack shallower than the kernel's caller)
        return False
    if pairs is None:
        return False
    if _pool.COPIES:
        _pool.COPIES[:] = [e for e in _pool.COPIES if e[3]()]     # (the copies freed since)
    for orig, new in pairs:
        _note(orig, new)
    return True


# the code objects of torch's auto_functionalized_v2_dense and
# auto_functionalized_dense, once torch has imported their module
_CODES: tuple = ()


def _af_codes() -> tuple:
    global _CODES
    af = sys.modules.get("torch._higher_order_ops.auto_functionalize")
    if af is None:
        return ()
    try:
        _CODES = (af.auto_functionalized_v2_dense.__code__, af.auto_functionalized_dense.__code__)
    except _INTERNALS:
        _CODES = (None, None)       # (another torch: nothing recorded)
    return _CODES


def _functional_copies(codes) -> list:
    """[(tensor, its copy)] of the auto_functionalized call that runs the
    calling operator (its frame's originals and the copies it passes:
    `_all_bases` / `all_bases_new` in auto_functionalized_v2_dense,
    `kwargs` / `new_kwargs` in auto_functionalized_dense: torch 2.13's
    names, read by name, so another torch's are a KeyError, _INTERNALS),
    None when none does."""
    v2, v1 = codes
    f = sys._getframe(4)        # (note_copies, call_noting_copies, the kernel, then OpOverload.__call__)
    for _ in range(3):
        if f is None:
            return None
        c = f.f_code
        if c is v2:
            loc = f.f_locals
            return list(zip(loc["_all_bases"], loc["all_bases_new"]))
        if c is v1:
            loc = f.f_locals
            out = []
            for name in loc["_mutable_args_names"]:
                o, n = loc["kwargs"][name], loc["new_kwargs"][name]
                out += zip(o, n) if isinstance(o, (list, tuple)) else [(o, n)]
            return out
        f = f.f_back
    return None


def _note(orig, new) -> None:
    """Record `new`, torch's copy of `orig` (the same dtype, shape and
    strides), as standing for orig's memory, or for what orig stands for
    when orig is itself a recorded copy (an earlier operator's)."""
    if orig is new or not isinstance(orig, torch.Tensor) or not isinstance(new, torch.Tensor):
        return
    if (orig.dtype != new.dtype or orig.shape != new.shape or orig.stride() != new.stride()
            or orig.device != new.device):
        return                  # (not a copy this can read as one: nothing recorded)
    sn, so = A._span(new), A._span(orig)
    if sn is None or so is None:
        return                  # (empty: no memory to stand for)
    delta = so[1] - sn[1]
    e = _pool.copy_entry(so) if _pool.COPIES else None
    if e is not None:
        # (orig is an earlier copy: new stands for what it stands for,
        # which outlives it; the graph frees orig once new is made)
        delta, root = delta + e[4], e[5]
    else:
        root = _alive(orig)
    copy = _alive(new)
    _pool.COPIES.append((sn[0], sn[1], sn[2], lambda: copy() and root(), delta, root))


def _alive(t):
    """Whether t's storage is still alive (a weak reference: a freed copy's
    bytes may be another tensor's)."""
    ref = StorageWeakRef(t.untyped_storage())
    return lambda: not ref.expired()


def _tracer():
    """dynamo's translator while it traces (None otherwise: opcheck's fake
    tests, make_fx, or a torch without it)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None


def _storage(t) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def _inputs(tx) -> dict:
    """{fake storage: [GraphArg]} of the graph's tensor inputs."""
    from torch.utils.weak import TensorWeakRef
    out: dict = {}
    for ga in tx.output.graphargs:
        if isinstance(ga._example, TensorWeakRef) and isinstance(ga.fake_tensor, torch.Tensor):
            out.setdefault(_storage(ga.fake_tensor), []).append(ga)
    return out


def _concrete(v):
    """A number argument as the traced call has it (a symbolic one's hint)."""
    if isinstance(v, (list, tuple)):
        return type(v)(_concrete(x) for x in v)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        h = v.node.hint
        if not isinstance(h, (int, float, bool)):
            raise _NoHint
        return h
    return v


def _real(fake, gas):
    """The real tensor `fake` stands for: its view of the graph input's
    storage (`gas`: the inputs over that storage), or a fresh stand-in of
    its geometry over memory of its own (None: the graph allocates it)."""
    shape = tuple(_concrete(d) for d in fake.shape)
    strides = tuple(_concrete(s) for s in fake.stride())
    offset = _concrete(fake.storage_offset())
    if gas is not None:
        storage = gas[0].example.untyped_storage()
    else:
        # (offset kept: the first element's alignment is the one the op sees)
        n = offset + 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else offset
        storage = torch.empty(n * fake.element_size(), dtype=torch.uint8, device=fake.device).untyped_storage()
    t = torch.empty(0, dtype=fake.dtype, device=fake.device).set_(storage, offset, shape, strides)
    if fake.requires_grad:
        t.requires_grad_(True)             # (the ops refuse an output that requires grad)
    return t


def _guard(tx, ga) -> None:
    """Guard graph input `ga` on its placement among the registered
    buffers (pool.placement), once per traced graph."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._guards import Guard
    except ImportError:
        return
    if not hasattr(GuardBuilder, "get_guard_manager"):
        return                  # (a torch before its C++ guard managers: not guarded; docs/kvcache.md)
    name = ga.source.name() if callable(ga.source.name) else ga.source.name
    # (the names guarded, kept on the traced graph itself: torch's
    # OutputGraph is not hashable, and dies with the trace)
    seen = tx.output.__dict__.setdefault("_rawkv_placement_guards", set())
    if name in seen:
        return
    seen.add(name)
    real = ga.example
    install_guard(Guard(ga.source, functools.partial(
        _placement_guard, ref=weakref.ref(real), where=_where(real))))


def _where(t):
    """pool.placement without the object: None (no object's buffer) or
    (the object's class, role, first and end byte in that buffer). Not
    which object: a model's one compiled layer function, called with each
    layer's own pool, must not be traced again per pool (dynamo stops
    compiling after its recompile limit: 8 layers). So a later call whose
    inputs mix two objects' buffers, each in the role traced, is not traced
    again (docs/kvcache.md, "Not covered"); the first trace checks it."""
    p = _pool.placement(t)
    if p is None:
        return None
    o = p[0]()
    return (None if o is None else type(o).__name__, *p[1:])


def _placement_guard(builder, guard, *, ref, where) -> None:
    """dynamo's create_fn of _guard: the input passes when it is the tensor
    traced (its memory cannot have moved into an object's buffer: a pool
    allocates its own) or lies where that one did."""
    from torch._dynamo.guards import get_verbose_code_parts

    def same_place(t) -> bool:
        return t is ref() or _where(t) == where
    builder.get_guard_manager(guard).add_lambda_guard(
        same_place, get_verbose_code_parts(f"rawkv_kvcache_placement({guard.name})", guard), guard.user_stack)
