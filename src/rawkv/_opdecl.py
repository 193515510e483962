"""Op declarations: what `torch.library` needs to know of a public op,
written once beside the op (plain Python: no torch import here).

A declaration names the op, the public function that implements it, and
its argument schema in torch's schema language with the arguments it
writes marked `(a!)` (`out`, caches). rawkv.library turns each declaration
into a `rawkv::<name>` custom operator: the mutating form (returns nothing,
allocates nothing, its writes listed in mutates_args), with a fake (meta)
implementation, on CPU (the reference) and CUDA (the kernels). Every op
declares itself through rawkv._op.op (an Op: its body is the
implementation); the public functions stay the allocating API on top of it,
and under torch.compile call the operator, so a compiled function that
calls them has no graph break.
"""
from __future__ import annotations

import re
from typing import Callable

_OPS: dict[str, "OpDecl"] = {}
# The schema types of number arguments. A number a caller passes (kvcache's
# slot, page_size, ...; block, granularity, GEMM's n / k / exp_lo / exp_hi;
# eps, theta, gs_value) is `Scalar`, not `int` / `float`: torch's argument
# parser makes a bool given as an `int` or `float` 1 / 1.0 (0, 0.0) before
# the body runs (slot=True read slot 1's request, eps=True normalized with
# 1.0), and keeps it a bool in a `Scalar`, which the body's own rule refuses
# by name as the public op does (docs/runtime.md, "Numbers"). A `Scalar`
# argument of a rawkv op is an integer unless its name is one of
# FLOAT_SCALARS (a float, which takes an int too): the op wrapper's error for
# a traced bool or float says which.
NUMBER_TYPES = ("int", "float", "Scalar")
INT_TYPES = ("int", "Scalar")
FLOAT_SCALARS = ("eps", "theta", "gs_value")
_ARG = re.compile(r"^\s*(?P<type>[\w\[\]?]+)(?P<alias>\([a-z]!\))?(?P<optional>\?)?\s+(?P<name>\w+)"
                  r"(?:\s*=\s*(?P<default>\S+))?\s*$")


class OpDecl:
    """`name`: rawkv::<name>. `impl`: called with the schema's arguments as
    keywords (the public function, or an adapter when the public signature
    needs more than the schema can say, e.g. a gs that is a number or a
    tensor). `schema`: 'Tensor x, Tensor(a!) out, float eps=1e-06'."""

    # An op written with rawkv._op.op: its body, which takes the schema's
    # arguments positionally and is registered as it is; and the registered
    # torch.ops.rawkv.<name>.default, once rawkv.library has run.
    body = None
    overload = None
    # Whether the body takes `checks_only=True` to check its arguments and
    # write nothing (rawkv._op.Op; the KV-cache ops, rawkv.kvcache.traced).
    checks_only = False

    def __init__(self, name: str, impl: Callable, schema: str):
        self.name, self.impl, self.schema = name, impl, schema
        self.args = []
        self.defaults = {}
        for part in _split(schema):
            m = _ARG.match(part)
            if m is None:
                raise ValueError(f"rawkv::{name}: cannot read schema argument {part!r}")
            # 'Tensor(a!)? errors': an optional written tensor (type 'Tensor?')
            self.args.append((m["name"], m["type"] + (m["optional"] or ""), m["alias"] is not None))
            if m["default"] is not None:
                self.defaults[m["name"]] = _literal(m["default"], name)
        self.mutates = tuple(n for n, _, w in self.args if w)
        # the positions of the number arguments (int, float, Scalar; optional or not)
        self.numbers = tuple(i for i, (_, t, _) in enumerate(self.args) if t.rstrip("?") in NUMBER_TYPES)
        # those of them that are integers (int, or a Scalar not named in FLOAT_SCALARS)
        self.ints = frozenset(i for i in self.numbers if self.args[i][1].rstrip("?") in INT_TYPES
                              and self.args[i][0] not in FLOAT_SCALARS)
        # the positions of the tensor arguments (optional or not)
        self.tensors = tuple(i for i, (_, t, _) in enumerate(self.args) if t.rstrip("?") == "Tensor")
        if not self.mutates:
            raise ValueError(f"rawkv::{name}: a mutating op writes at least one argument")
        if name in _OPS:
            raise ValueError(f"rawkv::{name} declared twice")
        _OPS[name] = self

    def __repr__(self):
        return f"rawkv::{self.name}({self.schema}) -> ()"

def _split(schema: str):
    """Top-level comma split (defaults like [1, 2] stay whole)."""
    depth, cur = 0, []
    for ch in schema:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            yield "".join(cur)
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        yield "".join(cur)


def _literal(text: str, op: str):
    """A schema default as the Python value the dispatcher stands for."""
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[:1] in "'\"" and text[-1:] == text[:1]:
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"rawkv::{op}: schema default {text!r} is not None, a bool, "
                             "a number or a quoted string") from None


def declared() -> dict[str, OpDecl]:
    return dict(_OPS)
