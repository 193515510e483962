"""rawkv ops as PyTorch custom operators: `import rawkv.library` registers
every declared op (rawkv._opdecl) as `torch.ops.rawkv.<name>`.

Each operator is the mutating form the engines use (vLLM, SGLang): its
outputs are arguments listed in mutates_args, it returns nothing and
allocates nothing, scalars are plain ints/floats/strs. It runs the numpy
reference on CPU tensors and the kernels on CUDA tensors (the device is
taken from the tensors), and has a fake implementation, so
`torch.compile(fullgraph=True)` traces it and CUDA graphs capture it.

Importing this module imports torch; `import rawkv` does not, and imports
this module itself when torch is loaded, before or after it (rawkv._op).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _op, _opdecl, ops  # noqa: F401  (ops: every op module declares its operators)

NAMESPACE = "rawkv"
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _make_fake(decl: _opdecl.OpDecl):
    """The fake implementation of `decl`. Mutating ops return nothing:
    shapes and dtypes are the caller's buffers, so it has nothing to
    compute, but it checks the memory rule of the arguments it writes, which the implementation
    cannot check once torch.compile has functionalized the call: each
    written argument then reaches it as a fresh copy, so an out= or errors=
    in another argument's memory (errors=pool.written[s:s+1], an out= that
    is a view of pool.rope or of the op's input) was taken, and the copy
    written back over that argument, where the eager op refuses it
    (A.check_outputs). While dynamo traces, the fake tensors keep the
    arguments' storages, so it is refused here, naming both, as eagerly.
    Memory shared without a storage, and the rules of the KV-cache ops that
    find a tensor by its memory (a pool's buffers), need the real tensors:
    an op whose body can check without writing (decl.checks_only) is
    checked on them while dynamo traces (rawkv.kvcache.traced)."""
    names = [n for n, _, _ in decl.args]
    writes = frozenset(i for i, (_, _, w) in enumerate(decl.args) if w)
    tensors = decl.tensors
    traced = None
    if decl.checks_only:
        from .kvcache import traced

    def fake(*args, **kwargs):
        if kwargs:
            args = (*args, *(kwargs[n] for n in names[len(args):] if n in kwargs))
        if traced is not None:
            traced.check(decl, args)
        spans = [(names[i], _fake_span(args[i])) for i in tensors if i < len(args)]
        for k, (name, s) in enumerate(spans):
            if s is None or tensors[k] not in writes:
                continue
            for other, t in spans[:k] + spans[k + 1:]:
                if t is not None and _op.A._overlap(s, t):
                    raise ValueError(f"{name}: overlaps {other} in memory; the op would write one over "
                                     "the other (pass separate buffers)")
        return None
    return fake


_FAKE_BASE = 1 << 12


def _fake_span(t):
    """A._span of a fake tensor (its storage for the address space, offsets
    within it for addresses); None for no tensor, an empty one, or one of
    symbolic geometry (nothing to compare without specializing it)."""
    if not isinstance(t, torch.Tensor) or isinstance(t.numel(), torch.SymInt) or t.numel() == 0:
        return None
    geo = (t.storage_offset(), *t.shape, *t.stride())
    if any(isinstance(v, torch.SymInt) for v in geo):
        return None
    space = ("fake", StorageWeakRef(t.untyped_storage()).cdata)
    item = t.element_size()
    ptr = _FAKE_BASE + t.storage_offset() * item       # (an address numpy takes: not 0)
    strides = tuple(s * item for s in t.stride())
    lo = ptr + sum(s * (d - 1) for d, s in zip(t.shape, strides) if s < 0)
    hi = ptr + sum(s * (d - 1) for d, s in zip(t.shape, strides) if s > 0) + item
    return space, lo, hi, t.is_contiguous(), (space, ptr, tuple(t.shape), strides, item)


def _make_impl(decl: _opdecl.OpDecl):
    """The dispatcher calls the kernel positionally, in schema order: a
    generated function with the schema's parameters passes them on by
    keyword (no per-call dict building on the hot path)."""
    names = [n for n, _, _ in decl.args]
    # The dispatcher leaves out trailing arguments the caller did not pass
    # and that have schema defaults: the generated function has them too.
    params = [f"{n}=DEFAULTS[{n!r}]" if n in decl.defaults else n for n in names]
    src = (f"def {decl.name}({', '.join(params)}):\n"
           f"    IMPL({', '.join(f'{n}={n}' for n in names)})\n")
    env = {"IMPL": decl.impl, "DEFAULTS": decl.defaults}
    exec(compile(src, f"<rawkv::{decl.name}>", "exec"), env)  # noqa: S102 - generated from the declaration
    return env[decl.name]


def _noting_copies(body):
    """A KV-cache operator's kernel: its body, after recording the copies
    torch made of the tensors a compiled graph writes when its
    auto_functionalized runs the call (rawkv.kvcache.traced.note_copies:
    the body's memory rules then decide on the tensors those copies stand
    for, as eagerly). The public ops call the body itself, eagerly."""
    from .kvcache.traced import call_noting_copies

    def kernel(*args):
        return call_noting_copies(body, args)
    kernel.__name__ = kernel.__qualname__ = body.__name__
    return kernel


def _register(decl: _opdecl.OpDecl) -> None:
    _LIB.define(f"{decl.name}({decl.schema}) -> ()")
    # An op written with rawkv._op.op: its body takes the schema's arguments
    # positionally, defaults included, so it is the implementation itself.
    fn = decl.body if decl.body is not None else _make_impl(decl)
    if decl.checks_only:
        fn = _noting_copies(fn)
    for key in ("CPU", "CUDA"):
        _LIB.impl(decl.name, fn, key)
    torch.library.register_fake(f"{NAMESPACE}::{decl.name}", _make_fake(decl), lib=_LIB)
    decl.overload = getattr(torch.ops.rawkv, decl.name).default


for _decl in _opdecl.declared().values():
    _register(_decl)
_op.torch_loaded(torch)


def operators() -> dict[str, object]:
    """{name: torch.ops.rawkv.<name>} of every registered operator."""
    return {n: getattr(torch.ops.rawkv, n) for n in _opdecl.declared()}
