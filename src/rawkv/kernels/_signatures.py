"""The `__global__` signatures of a CUDA source, read without a compiler.

The `.cu` file is where a kernel's parameters are written: the declarations
(_decl) take their parameter lists from here, on first use, and the ABI
check (_abi) holds the declared names and template parameters against the
same reading. Plain text processing: no CUDA, runs on any machine.
"""
from __future__ import annotations

import re

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_TEMPLATE_TAIL = re.compile(r"template\s*<([^<>]*)>\s*$")


def normalize_ctype(ctype: str) -> str:
    """A C parameter type as the declarations compare and pack it:
    `__restrict__` dropped, whitespace collapsed, '*' attached to the type."""
    t = ctype.replace("__restrict__", " ")
    t = " ".join(t.split())
    return t.replace(" *", "*").replace("* ", "*")


def _balanced(src: str, i: int) -> int:
    """Index just past the parenthesis group that opens at src[i] == '('."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == "(":
            depth += 1
        elif src[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError("unbalanced parentheses")


def _tparams(text: str) -> tuple[tuple[str, str], ...]:
    out = []
    for part in text.split(","):
        words = part.split("=")[0].split()
        if not words:
            continue
        kind = " ".join(words[:-1])
        kind = "typename" if kind in ("typename", "class") else ("bool" if kind == "bool" else "int")
        out.append((kind, words[-1]))
    return tuple(out)


def split_params(text: str) -> tuple[tuple[str, str], ...]:
    """((C type, name), ...) of a parameter list 'const T* __restrict__ x, i64 n'."""
    out = []
    for part in text.split(","):
        part = normalize_ctype(part)
        if not part or part == "void":
            continue
        cut = max(part.rfind(" "), part.rfind("*"))
        out.append((part[:cut + 1].strip(), part[cut + 1:]))
    return tuple(out)


def global_signatures(source: str) -> dict[str, dict]:
    """{kernel name: {"template": ((kind, name), ...), "params": ((ctype, name), ...)}}
    of every __global__ function in a CUDA source."""
    src = _COMMENTS.sub(" ", source)
    out = {}
    for m in re.finditer(r"__global__\s+void\s+", src):
        i = m.end()
        # Launch attributes between `void` and the name: __launch_bounds__(..),
        # __cluster_dims__(..), in any order.
        while lb := re.match(r"\s*(__launch_bounds__|__cluster_dims__)\s*", src[i:]):
            i = _balanced(src, i + lb.end())
        name = re.match(r"\s*(\w+)\s*", src[i:])
        i += name.end()
        j = _balanced(src, i)
        tail = _TEMPLATE_TAIL.search(src[:m.start()])
        out[name.group(1)] = {"template": _tparams(tail.group(1)) if tail else (),
                              "params": split_params(src[i + 1:j - 1])}
    return out
