"""The `__global__` signatures of a CUDA source, and the structs a kernel
takes by value, read without a compiler.

The `.cu` file is where a kernel's parameters are written: the declarations
(_decl) take their parameter lists, and the fields of a struct parameter,
from here, on first use, and the ABI check (_abi) holds the declared names
and template parameters against the same reading. Plain text processing: no
CUDA, runs on any machine. (tests/guards/test_kernel_structs.py holds the
struct layouts _decl computes against the compiler's, through NVRTC.)
"""
from __future__ import annotations

import re

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_TEMPLATE_TAIL = re.compile(r"template\s*<([^<>]*)>\s*$")
_STRUCT = re.compile(r"(?:template\s*<([^<>]*)>\s*)?\bstruct\s+(?:alignas\s*\(\s*\d+\s*\)\s*)?(\w+)\s*\{")


def normalize_ctype(ctype: str) -> str:
    """A C parameter type as the declarations compare and pack it:
    `__restrict__` and `__grid_constant__` (a struct parameter whose
    address is the parameter's) dropped, whitespace collapsed, '*' attached
    to the type."""
    t = ctype.replace("__restrict__", " ").replace("__grid_constant__", " ")
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
        # __cluster_dims__(..), __maxnreg__(..), in any order.
        while lb := re.match(r"\s*(__launch_bounds__|__cluster_dims__|__maxnreg__)\s*", src[i:]):
            i = _balanced(src, i + lb.end())
        name = re.match(r"\s*(\w+)\s*", src[i:])
        i += name.end()
        j = _balanced(src, i)
        tail = _TEMPLATE_TAIL.search(src[:m.start()])
        out[name.group(1)] = {"template": _tparams(tail.group(1)) if tail else (),
                              "params": split_params(src[i + 1:j - 1])}
    return out


def _fields(body: str) -> tuple[tuple[str, str], ...] | None:
    """((C type, name), ...) of a struct body of plain data members, in
    order (`long long a, b;` and `const int *p, q;` as C reads them: each
    declarator its own stars); None for a body with anything else (member
    functions, nested types, arrays, initializers)."""
    if re.search(r"[(){}\[\]=]", body):
        return None
    out = []
    for decl in body.split(";"):
        parts = [normalize_ctype(p) for p in decl.split(",")]
        if not parts[0]:
            continue
        first = parts[0]
        cut = max(first.rfind(" "), first.rfind("*"))
        if cut < 0:
            return None
        ctype = first[:cut + 1].strip()
        out.append((ctype, first[cut + 1:]))
        base = ctype.rstrip("*").strip()
        for more in parts[1:]:
            name = more.lstrip("*").strip()
            if not name.isidentifier():
                return None
            out.append((base + "*" * (len(more) - len(more.lstrip("*"))), name))
    return tuple(out)


def struct_fields(source: str) -> dict[str, dict]:
    """{struct name: {"template": ((kind, name), ...), "fields": ((C type,
    name), ...) or None}} of every struct a CUDA source defines (fields
    None: not plain data, so not a kernel parameter)."""
    src = _COMMENTS.sub(" ", source)
    out = {}
    for m in _STRUCT.finditer(src):
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        out[m.group(2)] = {"template": _tparams(m.group(1)) if m.group(1) else (),
                           "fields": _fields(src[m.end():i - 1])}
    return out
