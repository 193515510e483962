"""What can still disagree between a kernel's `.cu` signature, its
declaration in rawkv.kernels and the launches, checked with no compiler and
no GPU (tests/test_kernel_abi.py), so it fails CI rather than a GPU run.

The parameters themselves are read from the source (_signatures), so their
order and C types cannot disagree with a declaration. What is left:

every `__global__` of rawkv/cu/*.cu is declared and every declared kernel
exists, with the same template parameters; every parameter's C type has a
launch packing, no name is one the launch call takes, and the launcher has
slots for them all.
"""
from __future__ import annotations

from pathlib import Path

from .._launch import MAX_ARGS
from ._decl import bind_params, files, template_problem
from ._signatures import global_signatures  # noqa: F401  (the parser, for the tests)

CU_DIR = Path(__file__).resolve().parent.parent / "cu"


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
            problem = template_problem(name, k.template, sig["template"])
            if problem:
                problems.append(f"{filename}: {problem}")
            try:
                params_ = bind_params(name, sig["params"])
            except ValueError as exc:
                problems.append(f"{filename}: {exc}")
                continue
            if len(params_) > MAX_ARGS:
                problems.append(f"{filename}: {name} takes {len(params_)} parameters, the launcher "
                                f"has {MAX_ARGS} slots (rawkv._launch.MAX_ARGS)")
    for filename in declared:
        if filename not in sources:
            problems.append(f"{filename}: declared in rawkv.kernels but not found in rawkv/cu")
    return problems
