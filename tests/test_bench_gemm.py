"""tools/bench.py's plot hook on the CPU. The GPU run itself is
tools/bench.py --only gemm (docs/gemm.md)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(TOOLS))
    try:
        yield importlib.import_module("bench")
    finally:
        sys.path.remove(str(TOOLS))


def test_bench_writes_a_groups_plot_beside_its_json(bench, tmp_path, capsys):
    calls = []

    class WithPlot:
        @staticmethod
        def plot(results, path):
            calls.append((results, path))
            return path

    class Broken:
        @staticmethod
        def plot(results, path):
            raise RuntimeError("no axes")
    json_path = str(tmp_path / "2026-01-01-h100-gemm.json")
    assert bench.write_plot(WithPlot, [1], json_path) == str(tmp_path / "2026-01-01-h100-gemm.png")
    assert calls == [([1], str(tmp_path / "2026-01-01-h100-gemm.png"))]
    assert bench.write_plot(None, [1], json_path) is None             # core: no module
    assert bench.write_plot(object(), [1], json_path) is None         # a group without plot()
    assert bench.write_plot(Broken, [1], json_path) is None
    assert "plot failed: RuntimeError: no axes" in capsys.readouterr().out
