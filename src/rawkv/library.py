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

from . import _op, _opdecl, ops  # noqa: F401  (ops: every op module declares its operators)

NAMESPACE = "rawkv"
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _fake(*args, **kwargs):
    """Mutating ops return nothing: shapes and dtypes are the caller's
    buffers, so the fake implementation has nothing to compute."""
    return None


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


def _register(decl: _opdecl.OpDecl) -> None:
    _LIB.define(f"{decl.name}({decl.schema}) -> ()")
    # An op written with rawkv._op.op: its body takes the schema's arguments
    # positionally, defaults included, so it is the implementation itself.
    fn = decl.body if decl.body is not None else _make_impl(decl)
    for key in ("CPU", "CUDA"):
        _LIB.impl(decl.name, fn, key)
    torch.library.register_fake(f"{NAMESPACE}::{decl.name}", _fake, lib=_LIB)
    decl.overload = getattr(torch.ops.rawkv, decl.name).default


for _decl in _opdecl.declared().values():
    _register(_decl)
_op.torch_loaded(torch)


def operators() -> dict[str, object]:
    """{name: torch.ops.rawkv.<name>} of every registered operator."""
    return {n: getattr(torch.ops.rawkv, n) for n in _opdecl.declared()}
