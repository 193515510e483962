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

Rejected: checking when the op runs (the copies are all it gets; the
originals are not reachable from it), and guarding a tensor's identity
(a freed tensor's id is reused, and an engine's fresh `out=` each step
would retrace every call).

A call is checked only when it writes a graph input's memory: aot's own
trace of the graph passes the copies again (nothing to learn from them),
and a call that writes only memory the graph allocates has no rule the
copies hide. Not covered (docs/kvcache.md): a symbolic size without a
hint (unbacked), and, on a later call, memory shared between two tensors
that torch sees as separate storages of which neither lies in a pool's or
state's buffer (two torch.from_numpy views of an engine's own array).
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

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
