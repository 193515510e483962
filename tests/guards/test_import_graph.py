"""rawkv's import graph, read from the sources (imports inside functions
too): no cycle, and the runtime and the kernel cache import no op module."""
import ast
from pathlib import Path

import rawkv

ROOT = Path(rawkv.__file__).resolve().parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph():
    mods = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("rawkv"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rawkv"):
                deps.add(node.module)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for d in graph[todo.pop()]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_runtime_and_cache_know_no_op():
    graph = _graph()
    ops = {"rawkv.fp8", "rawkv.nvfp4", "rawkv.fused", "rawkv.kvcache", "rawkv.ops"}
    for engine in ("rawkv.runtime", "rawkv._cache", "rawkv._launch", "rawkv.kernels"):
        reached = _reach(graph, engine)
        assert not {m for m in reached if m in ops or m.startswith("rawkv.kvcache.")}, engine
        assert "rawkv" not in reached, f"{engine} imports the package itself"
