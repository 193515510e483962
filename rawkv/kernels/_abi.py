"""What can still disagree between a kernel's `.cu` signature, its
declaration in rawkv.kernels and the launches, checked with no compiler and
no GPU (tests/test_kernel_abi.py), so it fails CI rather than a GPU run.

The parameters themselves are read from the source (_signatures), so their
order and C types cannot disagree with a declaration. What is left:

* `mismatches`: every `__global__` of rawkv/cu/*.cu is declared and every
  declared kernel exists, with the same template parameters; every
  parameter's C type has a launch packing, no name is one the launch call
  takes, and the launcher has slots for them all;
* `launch_keyword_mismatches`: every launch in rawkv passes its kernel's
  parameter names as keywords, no more and (where the call shows them all)
  no fewer. A wrong keyword is also a TypeError naming the kernel at launch
  time; this finds it on a CPU, in code no CPU test runs.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

from .._launch import MAX_ARGS
from ._decl import Kernel, bind_params, files, template_problem
from ._signatures import global_signatures  # noqa: F401  (the parser, for the tests)

CU_DIR = Path(__file__).resolve().parent.parent / "cu"
PACKAGE_DIR = CU_DIR.parent

# Keywords of the launch call itself, not kernel parameters.
_LAUNCH_KEYWORDS = {"stream", "shared_mem"}


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


# ---------------------------------------------------------------------------
# Launch sites, read from the Python sources.
# ---------------------------------------------------------------------------
def _op_modules() -> dict[str, str]:
    """{path relative to the checkout: text} of every rawkv module that may
    launch (the declarations themselves excluded)."""
    out = {}
    for p in sorted(PACKAGE_DIR.rglob("*.py")):
        if p.parent.name != "kernels" or p.parent.parent != PACKAGE_DIR:
            out[str(p.relative_to(PACKAGE_DIR.parent))] = p.read_text()
    return out


def _kernel_modules(tree: ast.AST) -> dict[str, object]:
    """{local name: module} of the rawkv.kernels modules a file imports
    (`from ..kernels import kv_cache as K`)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("kernels", "rawkv.kernels") \
                and (node.level or node.module == "rawkv.kernels"):
            for alias in node.names:
                try:
                    out[alias.asname or alias.name] = importlib.import_module(f"rawkv.kernels.{alias.name}")
                except ImportError:
                    pass            # a name of the package, not a module
    return out


def _dict_helpers(trees) -> dict[str, frozenset]:
    """{function name: keys} of the top-level functions whose every return
    is `dict(key=..., ...)`: the keyword groups launches splat with `**f(...)`.
    A name defined twice with other keys is left out (it cannot be told)."""
    out, ambiguous = {}, set()
    for tree in trees:
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            rets = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
            if not rets or not all(isinstance(r, ast.Call) and isinstance(r.func, ast.Name)
                                   and r.func.id == "dict" and not r.args
                                   and all(k.arg for k in r.keywords) for r in rets):
                continue
            keys = frozenset(k.arg for r in rets for k in r.keywords)
            if out.get(fn.name, keys) != keys:
                ambiguous.add(fn.name)
            out[fn.name] = keys
    for name in ambiguous:
        out.pop(name)
    return out


def _splat_keys(node: ast.AST, helpers: dict, names: dict):
    """The keys of a `**` splat: a helper's call, a variable bound to one
    (`names`), or `a if c else b` of two with the same keys; None when
    they cannot be told."""
    if isinstance(node, ast.Call):
        f = node.func
        return helpers.get(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.IfExp):
        a, b = _splat_keys(node.body, helpers, names), _splat_keys(node.orelse, helpers, names)
        return a if a == b else None
    return None


def _bound_dicts(tree: ast.AST, helpers: dict) -> dict[str, frozenset]:
    """{variable: keys} of a module's variables bound to keyword dicts
    (`part1 = index_part() if ... else index_part(...)`); a name bound to
    anything else as well is left out."""
    out, other = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            keys = _splat_keys(node.value, helpers, {})
            if keys is None or out.get(name, keys) != keys:
                other.add(name)
            else:
                out[name] = keys
    return {n: k for n, k in out.items() if n not in other}


def _named_kernel(node: ast.AST, mods: dict) -> Kernel | None:
    """The kernel a launch's receiver names: `M.NAME` or `M.NAME.instance(...)`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "instance":
        node = node.func.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in mods:
        k = getattr(mods[node.value.id], node.attr, None)
        return k if isinstance(k, Kernel) else None
    return None


def _keywords(call: ast.Call, helpers: dict, names: dict) -> tuple[set, bool, set]:
    """(keywords the call passes, whether that set is complete, keywords passed twice)."""
    given, twice, complete = set(), set(), True
    for kw in call.keywords:
        keys = {kw.arg} if kw.arg else _splat_keys(kw.value, helpers, names)
        if keys is None:
            complete = False        # `**kw`: its keys are not known here
            continue
        twice |= given & keys
        given |= keys
    return given - _LAUNCH_KEYWORDS, complete, twice


def _fit(k: Kernel, given: set, complete: bool) -> list[str]:
    names = {p.name for p in k.params}
    out = []
    if given - names:
        out.append(f"{k.name} has no parameter {', '.join(sorted(given - names))}")
    if complete and names - given:
        out.append(f"{k.name}'s parameter {', '.join(sorted(names - given))} is not passed")
    return out


class LaunchSite:
    """One `.launch(...)` call: where, the kernel it names (None when it
    launches an instance held in a variable), the kernels it may launch
    (the named one, or those of the kernel modules its file imports whose
    parameters fit its keywords), and its keyword problems."""

    def __init__(self, where: str, named: Kernel | None, fits: list, complete: bool, problems: list):
        self.where, self.named, self.fits, self.problems = where, named, fits, problems
        self.complete = complete      # every keyword the call passes is known


def _site(where: str, call: ast.Call, mods: dict, helpers: dict, names: dict) -> LaunchSite:
    given, complete, twice = _keywords(call, helpers, names)
    problems = [f"{where}: {', '.join(sorted(twice))} passed twice"] if twice else []
    k = _named_kernel(call.func.value, mods)
    if k is not None:
        return LaunchSite(where, k, [k], complete,
                          problems + [f"{where}: {p}" for p in _fit(k, given, complete)])
    candidates = [k for m in mods.values() for k in vars(m).values() if isinstance(k, Kernel)]
    fits = [k for k in candidates if not _fit(k, given, complete)]
    if not fits:
        closest = min(candidates, key=lambda k: len(given ^ {p.name for p in k.params}))
        problems.append(f"{where}: the keywords are no kernel's of "
                        f"{', '.join(sorted(m.__name__ for m in mods.values()))} "
                        f"(closest: {'; '.join(_fit(closest, given, complete))})")
    return LaunchSite(where, None, fits, complete, problems)


def launch_sites(modules: dict[str, str] | None = None) -> list[LaunchSite]:
    """Every launch: a `.launch(...)` call in a module that imports a
    rawkv.kernels module. `modules`: {path: text} (default: rawkv's own).

    The kernel is the one the call names (`K.NAME.launch`,
    `K.NAME.instance(...).launch`); an instance held in a variable must
    take the keywords of one kernel of the modules the file imports.
    Keywords from `**f(...)`, f a function returning `dict(...)` of keywords
    (in any of the modules), or from `**v`, v bound to such calls only,
    count as passed; after any other `**` splat only unknown keywords are
    found (`complete` False)."""
    if modules is None:
        modules = _op_modules()
    trees = {path: ast.parse(text) for path, text in modules.items()}
    helpers = _dict_helpers(trees.values())
    sites = []
    for path, tree in trees.items():
        mods = _kernel_modules(tree)
        if not mods:
            continue
        names = _bound_dicts(tree, helpers)
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "launch":
                sites.append(_site(f"{path}:{call.lineno}", call, mods, helpers, names))
    return sites


def launch_keyword_mismatches(modules: dict[str, str] | None = None) -> list[str]:
    """Every launch whose keywords are not its kernel's parameter names
    (see launch_sites), one line each."""
    return [p for s in launch_sites(modules) for p in s.problems]
