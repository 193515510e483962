"""docs/engines.md's example runs as written: the decode step calls
torch.ops.rawkv.* only (no registration of its own), on the GPU captured in
a CUDA graph, on a CPU eagerly through the reference."""
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

DOC = Path(__file__).resolve().parent.parent / "docs" / "engines.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/engines.md has one example"
    return blocks[0]


def _run():
    env: dict = {}
    exec(compile(_example(), str(DOC), "exec"), env)  # noqa: S102 - the documented example
    return env


def test_example_registers_nothing_itself():
    code = _example()
    assert "torch.library" not in code and "Library(" not in code and "custom_op" not in code


def test_example_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = _run()
    rows, pool = env["rows"], env["pool"]
    want = env["entries"]
    # entry 0 of every request is the flushed entry, decoded back from FP8 (close, not equal)
    assert torch.allclose(rows[:, 0].float(), want.float(), rtol=0.07, atol=0.07)
    assert not rows[:, 1:].any()                       # -1 ids give zero rows
    assert pool.read_errors() == 0


def test_example_on_gpu(cuda):
    env = _run()
    assert env["device"] == "cuda"
    rows = env["rows"]
    assert torch.allclose(rows[:, 0].float().cpu(), env["entries"].float().cpu(), rtol=0.07, atol=0.07)
    assert not rows[:, 1:].any()


def test_instance_counts_the_docs_state():
    """What docs/engines.md, docs/runtime.md and the demo's --help say a full
    warmup() compiles on an H100 (sm_90) is rawkv's count now, and the cache
    demo's three files hold the instances engines.md names."""
    from rawkv import demo, demo_layer
    from rawkv.runtime import instances_for
    every, cache = len(instances_for("sm_90")), len(instances_for("sm_90", demo.CACHE_FILES))
    text = " ".join(DOC.read_text().split())
    assert f"(21 of the {every} on an H100 at the defaults" in text
    assert f"compiles its three kernel files: {cache} instances" in text
    runtime_md = " ".join((DOC.parent / "runtime.md").read_text().split())
    assert f"not all {every}:" in runtime_md
    assert f"21 of rawkv's {every} on an H100" in " ".join(demo_layer.__doc__.split())
