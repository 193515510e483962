"""What can still disagree between a kernel's `.cu` signature, its
declaration in rawkv.kernels and the launches, checked with no compiler and
no GPU (tests/guards/test_kernel_abi.py), so it fails CI rather than a GPU run.

The parameters themselves are read from the source (_signatures), so their
order and C types cannot disagree with a declaration. What is left:

* `mismatches`: every `__global__` of rawkv/cu/*.cu is declared and every
  declared kernel exists, with the same template parameters; every
  parameter's C type has a launch packing (a struct's: every field's), no
  name is one the launch call takes, and the launcher has slots for them
  all;
* `launch_keyword_mismatches`: every launch in rawkv passes its kernel's
  parameter names as keywords, no more and (where the call shows them all)
  no fewer. A wrong keyword is also a TypeError naming the kernel at launch
  time; this finds it on a CPU, in code no CPU test runs;
* `struct_probes`: the layout the declarations pack a struct parameter
  with (its fields' offsets, its size), as probe kernels whose PTX the
  layout test reads after compiling them with the kernel's file through
  NVRTC, on a CPU (tests/guards/test_kernel_structs.py).
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from .._launch import MAX_ARGS
from ._decl import Kernel, bind_params, files, template_problem
from ._signatures import global_signatures, struct_fields

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
        found, structs = global_signatures(text), struct_fields(text)
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
                params_ = bind_params(name, sig["params"], structs)
            except ValueError as exc:
                problems.append(f"{filename}: {exc}")
                continue
            slots = sum(p.slots for p in params_)
            if slots > MAX_ARGS:
                problems.append(f"{filename}: {name} takes {slots} parameter slots, the launcher "
                                f"has {MAX_ARGS} (rawkv._launch.MAX_ARGS)")
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


_UNKNOWN = (frozenset(), False, frozenset())


def _merge(parts, keyword_parts) -> tuple[frozenset, bool, frozenset]:
    """(keys, all known, keys twice) of mappings merged: `parts` may
    overlap (dict(m, ...)), `keyword_parts` (keywords, ** splats) may not."""
    keys, complete, twice = set(), True, set()
    seen = set()
    for k, c, t in keyword_parts:
        twice |= (seen & k) | t
        seen |= k
    for k, c, t in list(parts) + list(keyword_parts):
        keys |= k
        complete = complete and c
        twice |= t
    return frozenset(keys), complete, frozenset(twice)


def _dict_keys(node: ast.AST, helpers: dict, names: dict) -> tuple[frozenset, bool, frozenset]:
    """(keys, all known, keys given twice) of a mapping expression:
    `dict(m, key=..., **d)`, a call of a helper returning one, a variable
    bound to one (`names`), or `a if c else b` of two with the same keys."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return _merge([_dict_keys(a, helpers, names) for a in node.args],
                      _keyword_parts(node, helpers, names))
    if isinstance(node, ast.Call):
        f = node.func
        return helpers.get(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None,
                           _UNKNOWN)
    if isinstance(node, ast.Name):
        return names.get(node.id, _UNKNOWN)
    if isinstance(node, ast.IfExp):
        a, b = _dict_keys(node.body, helpers, names), _dict_keys(node.orelse, helpers, names)
        return a if a == b else _UNKNOWN
    return _UNKNOWN


def _keyword_parts(call: ast.Call, helpers: dict, names: dict) -> list:
    return [(frozenset({kw.arg}), True, frozenset()) if kw.arg else _dict_keys(kw.value, helpers, names)
            for kw in call.keywords]


def _dict_helpers(trees) -> dict[str, tuple]:
    """{function name: _dict_keys} of the top-level functions whose every
    return is a mapping of known keys (`return dict(key=..., ...)`): the
    keyword groups launches splat with `**f(...)`. A name defined twice with
    other keys is left out (it cannot be told)."""
    out, ambiguous = {}, set()
    for tree in trees:
        for fn in tree.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            rets = [_dict_keys(n.value, {}, {}) for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value]
            if not rets or not all(r[1] for r in rets) or len(set(rets)) != 1:
                continue
            if out.get(fn.name, rets[0]) != rets[0]:
                ambiguous.add(fn.name)
            out[fn.name] = rets[0]
    for name in ambiguous:
        out.pop(name)
    return out


def _bound_dicts(body, helpers: dict, outer: dict) -> dict[str, tuple]:
    """{variable: _dict_keys} of the variables a scope (a function's or the
    module's statements, nested functions apart) binds to mappings of known
    keys (`part1 = index_part() if ... else index_part(...)`), over those of
    `outer`; a name bound to anything else as well is left out."""
    out, other = dict(outer), set()
    todo = list(body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            keys = _dict_keys(node.value, helpers, out)
            if not keys[1] or (name in out and name not in outer and out[name] != keys):
                other.add(name)
            else:
                out[name] = keys
        todo.extend(ast.iter_child_nodes(node))
    return {n: k for n, k in out.items() if n not in other}


def _named_kernel(node: ast.AST, mods: dict) -> Kernel | None:
    """The kernel a launch's receiver names: `M.NAME` or `M.NAME.instance(...)`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "instance":
        node = node.func.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in mods:
        k = getattr(mods[node.value.id], node.attr, None)
        return k if isinstance(k, Kernel) else None
    return None


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


def _site(where: str, kernel_node: ast.AST, keys: tuple, mods: dict) -> LaunchSite:
    given, complete, twice = keys
    given = set(given) - _LAUNCH_KEYWORDS
    problems = [f"{where}: {', '.join(sorted(twice))} passed twice"] if twice else []
    k = _named_kernel(kernel_node, mods)
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


def _launch_calls(tree: ast.AST, helpers: dict):
    """(line, kernel expression, keys) of each launch of a module:
    `<kernel>.launch(rt, grid, block, ..., key=...)`, or a plan's
    `Launch(<kernel>, grid, block, <mapping>)` (rawkv._plan: the kernel
    first, the arguments last); variables are
    read in the scope of the function the launch is in."""
    def scope(node, names):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from scope(child, _bound_dicts(child.body, helpers, names))
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if isinstance(f, ast.Attribute) and f.attr == "launch":
                    yield child.lineno, f.value, _merge([], _keyword_parts(child, helpers, names))
                elif isinstance(f, ast.Name) and f.id == "Launch" and len(child.args) >= 2:
                    yield child.lineno, child.args[0], _dict_keys(child.args[-1], helpers, names)
            yield from scope(child, names)
    yield from scope(tree, _bound_dicts(tree.body, helpers, {}))


def launch_sites(modules: dict[str, str] | None = None) -> list[LaunchSite]:
    """Every launch: a `.launch(...)` call or a plan's `Launch(...)` in a
    module that imports a rawkv.kernels module. `modules`: {path: text}
    (default: rawkv's own).

    The kernel is the one the call names (`K.NAME.launch`,
    `K.NAME.instance(...).launch`); an instance held in a variable must
    take the keywords of one kernel of the modules the file imports.
    Keywords from `**f(...)`, f a function returning `dict(...)` of keywords
    (in any of the modules), or from `**v`, v bound to such mappings only,
    count as passed, as do the keys of a plan's `dict(...)`; after any other
    mapping only unknown keywords are found (`complete` False)."""
    if modules is None:
        modules = _op_modules()
    trees = {path: ast.parse(text) for path, text in modules.items()}
    helpers = _dict_helpers(trees.values())
    sites = []
    for path, tree in trees.items():
        mods = _kernel_modules(tree)
        if not mods:
            continue
        sites += [_site(f"{path}:{line}", node, keys, mods) for line, node, keys in _launch_calls(tree, helpers)]
    return sites


def launch_keyword_mismatches(modules: dict[str, str] | None = None) -> list[str]:
    """Every launch whose keywords are not its kernel's parameter names
    (see launch_sites), one line each."""
    return [p for s in launch_sites(modules) for p in s.problems]


def struct_probes(kernel_file) -> tuple[str, dict[str, tuple[str, int, int]]]:
    """(CUDA source, {probe: (what, offset, size)}) that holds the layout
    the declarations pack every struct parameter of `kernel_file`'s kernels
    with (in each declared instance: the kernel's template arguments
    spelled into the struct's type) against the compiler's: one
    `extern "C"` probe kernel per field, taking the struct by value and
    reading only that field. In the PTX of the file's source with the
    probes appended, probe p's parameter must be `size` bytes and its one
    load at `offset` (NVRTC has no constant offsetof to static_assert)."""
    src, expect = [], {}
    for k in kernel_file.kernels.values():
        for targs in k._instance_args:
            spelled = {t.name: t.spell(v) for t, v in zip(k.template, targs)}
            for p in k.params:
                if p.fields is None:
                    continue
                ctype = re.sub(r"\b\w+\b", lambda m: spelled.get(m.group(0), m.group(0)),
                               p.ctype.removeprefix("const "))
                for f in p.fields:
                    what = f"{ctype}.{f.name}"
                    if what in (w for w, _, _ in expect.values()):
                        continue
                    name = f"rkv_layout_probe_{len(expect)}"
                    expect[name] = (what, f.offset, p.size)
                    src.append(f'extern "C" __global__ void {name}({ctype} s, long long* out) '
                               f"{{ *out = (long long)s.{f.name}; }}")
    return "\n".join(src), expect
