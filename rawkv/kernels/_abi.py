"""Read every `__global__` signature in rawkv/cu/*.cu and hold it against
the declarations in rawkv.kernels: names, template parameters and
parameters (name, C type, order). No compiler is involved: this runs on any
machine, so a declaration that disagrees with its kernel fails CI."""
from __future__ import annotations

import re
from pathlib import Path

from ._decl import files, normalize_ctype

CU_DIR = Path(__file__).resolve().parent.parent / "cu"

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_TEMPLATE_TAIL = re.compile(r"template\s*<([^<>]*)>\s*$")


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


def _params(text: str) -> tuple[tuple[str, str], ...]:
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
        lb = re.match(r"__launch_bounds__\s*", src[i:])
        if lb:
            i = _balanced(src, i + lb.end())
        name = re.match(r"\s*(\w+)\s*", src[i:])
        i += name.end()
        j = _balanced(src, i)
        tail = _TEMPLATE_TAIL.search(src[:m.start()])
        out[name.group(1)] = {"template": _tparams(tail.group(1)) if tail else (),
                              "params": _params(src[i + 1:j - 1])}
    return out


def mismatches(sources: dict[str, str] | None = None) -> list[str]:
    """Every disagreement between the declarations and the sources
    ({filename: text}; default: the files in rawkv/cu), one line each."""
    if sources is None:
        sources = {p.name: p.read_text() for p in sorted(CU_DIR.glob("*.cu"))}
    problems = []
    declared = files()
    for filename, text in sources.items():
        found = global_signatures(text)
        kf = declared.get(filename)
        kernels = kf.kernels if kf is not None else {}
        for name in found:
            if name not in kernels:
                problems.append(f"{filename}: __global__ {name} has no declaration in rawkv.kernels")
        for name, k in kernels.items():
            sig = found.get(name)
            if sig is None:
                problems.append(f"{filename}: {name} is declared but the source defines no such __global__")
                continue
            want_t = tuple((t.kind, t.name) for t in k.template)
            if sig["template"] != want_t:
                problems.append(f"{filename}: {name} template {sig['template']} != declared {want_t}")
            want_p = tuple((p.ctype, p.name) for p in k.params)
            if sig["params"] != want_p:
                for pos, (got, want) in enumerate(zip(sig["params"], want_p)):
                    if got != want:
                        problems.append(f"{filename}: {name} parameter {pos}: source "
                                        f"'{got[0]} {got[1]}' != declared '{want[0]} {want[1]}'")
                if len(sig["params"]) != len(want_p):
                    problems.append(f"{filename}: {name} takes {len(sig['params'])} parameters, "
                                    f"declared {len(want_p)}")
    for filename in declared:
        if filename not in sources:
            problems.append(f"{filename}: declared in rawkv.kernels but not found in rawkv/cu")
    return problems
