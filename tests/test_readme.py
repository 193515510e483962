"""What the README tells a newcomer to run, run as written.

- The CPU example runs verbatim (the code block after EXAMPLE_MARK) and
  prints what the README says it prints.
- The links of the README and of the pages it sends a newcomer to (the
  glossary, the runtime page) lead to files and headings that exist.
- The command for the CPU tests (`python -m pytest -q -m "not gpu"`) selects
  every CPU test and no GPU test: its collection is checked item by item.
- CI (.ci/run) runs the README's test command verbatim (checked line for line).
- The first command ("Main job") ends in the layer demo, which on a machine
  without a GPU runs the numpy reference and prints its accuracy and time
  lines, the ones the README names.
- The runtime page's table of declared versions, and the benchmarks page's
  --peer sentence, name the versions pyproject.toml pins.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLE_MARK = "<!-- tests/test_readme.py runs the next code block as it is written here -->"
# What the README says the example prints: "... It prints `line 1` and `line 2`:"
PRINTS = re.compile(r"It prints\s+`([^`]+)`\s+and\s+`([^`]+)`:")
NUMBER_AT_END = re.compile(r"(\d+\.\d+)$")


def readme_example() -> str:
    """The code of the ```python block that follows EXAMPLE_MARK (only blank lines between)."""
    text = README.read_text()
    assert text.count(EXAMPLE_MARK) == 1, "README.md must hold the CPU example's marker exactly once"
    m = re.compile(r"\s*```python\n(.*?)\n```", re.S).match(text, text.index(EXAMPLE_MARK) + len(EXAMPLE_MARK))
    assert m, "no ```python block right after the CPU example's marker"
    return m.group(1)


def test_readme_cpu_example_runs_and_prints_what_the_readme_says(capsys):
    torch = pytest.importorskip("torch")
    code = readme_example()
    assert "cuda" not in code, "the CPU example must not need a GPU"
    with torch.random.fork_rng():         # its manual_seed stays inside
        exec(compile(code, "README.md (CPU example)", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.splitlines()
    said = PRINTS.search(README.read_text())
    assert said, "README.md no longer says what the CPU example prints"
    assert len(printed) == 2, printed
    # The text is the same; the numbers are the same to the tolerance of another torch's
    # random numbers (the seed is fixed, the generator is torch's).
    for got, want, tol in zip(printed, said.groups(), (0.005, 0.002)):
        g, w = NUMBER_AT_END.search(got), NUMBER_AT_END.search(want)
        assert g and w, (got, want)
        assert got[:g.start()] == want[:w.start()], (got, want)
        assert abs(float(g.group(1)) - float(w.group(1))) <= tol, (got, want)

# Loaded into the collecting pytest (-p): writes, for each test, whether it
# needs a GPU and whether it carries the `gpu` marker, for the selected and
# the deselected tests alike. A test needs a GPU when it takes the `cuda`
# fixture, directly or through another fixture, or when its module asks for
# the fixture at run time (request.getfixturevalue("cuda")) and the test is
# parametrized with the device "cuda".
ORACLE = '''
import inspect, json, os

_rows = {"deselected": []}


def _asks_at_run_time(module, _seen={}):
    if module not in _seen:
        try:
            _seen[module] = 'getfixturevalue("cuda")' in inspect.getsource(module)
        except (OSError, TypeError):
            _seen[module] = False
    return _seen[module]


def _row(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    device_cuda = any(isinstance(v, str) and v == "cuda" for v in params.values())
    needs_gpu = "cuda" in item.fixturenames or (device_cuda and _asks_at_run_time(item.module))
    return [item.nodeid, needs_gpu, item.get_closest_marker("gpu") is not None]


def pytest_deselected(items):
    _rows["deselected"] += [_row(i) for i in items]


def pytest_collection_finish(session):
    _rows["selected"] = [_row(i) for i in session.items]
    with open(os.environ["RAWKV_ORACLE_OUT"], "w") as f:
        json.dump(_rows, f)
'''


def readme_command(marker_expr: str) -> list[str]:
    """The README's indented command line that runs pytest with -m MARKER_EXPR, as argv."""
    for line in README.read_text().splitlines():
        if line.startswith("    python -m pytest") and f'-m "{marker_expr}"' in line:
            return shlex.split(line.strip())
    raise AssertionError(f'README.md has no indented `python -m pytest ... -m "{marker_expr}"` line')


def test_cpu_test_command_selects_every_cpu_test_and_no_gpu_test(tmp_path):
    argv = readme_command("not gpu")
    assert argv[:3] == ["python", "-m", "pytest"]
    (tmp_path / "rawkv_gpu_oracle.py").write_text(ORACLE)
    out = tmp_path / "collected.json"
    env = dict(os.environ, RAWKV_ORACLE_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *argv[1:], "--collect-only", "-p", "no:cacheprovider",
                           "-p", "rawkv_gpu_oracle"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    gpu_selected = [nodeid for nodeid, needs_gpu, _ in rows["selected"] if needs_gpu]
    cpu_deselected = [nodeid for nodeid, needs_gpu, marked in rows["deselected"] if not (needs_gpu or marked)]
    assert gpu_selected == [], f"{len(gpu_selected)} GPU tests run as CPU tests, e.g. {gpu_selected[:5]}"
    assert cpu_deselected == [], f"{len(cpu_deselected)} CPU tests left out, e.g. {cpu_deselected[:5]}"
    # Both kinds exist, so the command did select something and left GPU tests out.
    assert len(rows["selected"]) > 100 and len(rows["deselected"]) > 100, (len(rows["selected"]),
                                                                           len(rows["deselected"]))
    assert re.search(r'^\s*"gpu:', (ROOT / "pyproject.toml").read_text(), re.M), "the gpu marker is not registered"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(md: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", md.read_text(), re.M)}


@pytest.mark.parametrize("page", ["README.md", "docs/glossary.md", "docs/runtime.md"])
def test_links_lead_somewhere(page):
    md = ROOT / page
    broken = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"[a-z]+:", target):           # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            broken.append(target)
    assert broken == [], f"{page}: links to nothing: {broken}"


def main_job_command() -> str:
    """The indented command line of the README's "Main job" paragraph."""
    lines = README.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Main job")), None)
    assert start is not None, 'README.md has no "Main job" paragraph'
    for line in lines[start:]:
        if line.startswith("    "):
            return line.strip()
    raise AssertionError('README.md has no indented command after its "Main job" paragraph')


def test_main_job_runs_the_layer_demo_and_prints_its_time_and_accuracy():
    """What the first command ends in, run as a fresh CPU-only machine runs
    it: the layer demo's CPU mode, saying so with the runtime's reason, with
    the accuracy and time lines the README names (the install before it is
    this environment's)."""
    steps = [part.strip() for part in main_job_command().split("&&")]
    assert steps[-1] == "python -m rawkv demo"
    import rawkv
    try:
        rawkv.get_runtime(0)
    except rawkv.GpuUnavailableError as exc:
        reason = str(exc)
    else:
        pytest.skip("the GPU path runs here; this checks the CPU mode")
    r = subprocess.run([sys.executable, "-m", "rawkv", "demo"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("rawkv demo: CPU MODE (the numpy reference at the tiny size") and \
        lines[0].endswith(reason)
    said = " ".join(README.read_text().split())
    for start in ("accuracy vs the float64 step: ", "time: rawkv "):
        assert f"`{start.strip()}" in said, f"README.md no longer names the line {start!r}"
    assert lines[-2].startswith("accuracy vs the float64 step: cosine of the layer output min ")
    assert re.match(r"time: rawkv [0-9.]+ us per step, float64 [0-9.]+ us per step \(wall clock", lines[-1])


def test_ci_runs_the_readmes_test_command_verbatim():
    # .ci/run says it runs the README's test command verbatim (after making
    # the venv the command's first two steps make): the two may not drift.
    # The README's command is the indented line after "Tests (what CI runs";
    # CI's is the line after its "verbatim" marker.
    text = README.read_text()
    at = text.index("Tests (what CI runs")
    readme_cmd = next(line.strip() for line in text[at:].splitlines() if line.startswith("    python3 -m venv"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    mark = next(i for i, line in enumerate(ci) if "the README's test command, verbatim" in line)
    prefix = "python3 -m venv .venv && . .venv/bin/activate && "
    assert readme_cmd.startswith(prefix), readme_cmd
    assert ci[mark + 1].strip() == readme_cmd[len(prefix):]
    assert any(line.strip() == "python3 -m venv .venv" for line in ci[:mark])


def _pins() -> dict:
    """{extra: [(package, version), ...]} of the exact pins (==) in
    pyproject.toml's optional dependencies (read as text: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    section = "\n".join(line for line in section.splitlines() if not line.lstrip().startswith("#"))
    pins = {}
    for name, body in re.findall(r"^(\w+) = \[(.*?)\]", section, re.M | re.S):
        pins[name] = [tuple(req.split("==")) for req in re.findall(r'"([^"]+)"', body) if "==" in req]
    assert pins.get("bench"), "pyproject.toml: no pinned bench extra found (the parse above is stale)"
    return pins


def test_docs_name_the_versions_pyproject_pins():
    """The runtime page's "Versions declared" table gives each extra's exact
    pins as pyproject.toml declares them, and docs/benchmarks.md's --peer
    sentence (what `pip install 'rawkv[bench]'` brings) the bench extra's:
    session 64 pinned humming-kernels 0.1.20 and both still said 0.1.19."""
    runtime = (ROOT / "docs" / "runtime.md").read_text()
    for extra, pins in _pins().items():
        for package, version in pins:
            row = re.search(rf"^\| `{extra}` extra[^|]*\|([^|]*)\|", runtime, re.M)
            assert row, f"docs/runtime.md: no row for the {extra} extra, which pins {package}"
            assert f"{package} == {version}" in row.group(1), (extra, row.group(1))
    bench = dict(_pins()["bench"])
    said = re.search(r"humming-kernels\s+(\S+)\s+beside the GEMM \(`pip install 'rawkv\[bench\]'`",
                     (ROOT / "docs" / "benchmarks.md").read_text())
    assert said, "docs/benchmarks.md no longer says which humming-kernels `rawkv[bench]` installs"
    assert said.group(1) == bench["humming-kernels"]
