"""python -m rawkv bench on a CPU: its help, the one-line refusal without a
GPU (status 2, nothing written), usage errors, the table it prints, the JSON
it writes, the commit it records, the generic figure, and that the package's
benchmark code reads nothing from tools/ or the working directory. The GPU
run itself: python -m rawkv bench --only core --quick (tools/gpu_check.sh)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import rawkv
from rawkv.__main__ import main
from rawkv.bench import GROUPS, cli, plot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _has_gpu() -> bool:
    try:
        rawkv.get_runtime(0)
    except rawkv.GpuUnavailableError:
        return False
    return True


def _python_m_rawkv(args, cwd):
    """python -m rawkv ARGS run from `cwd` (outside the source tree), rawkv
    found through PYTHONPATH as an installed package would be."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "rawkv", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


# ---- the command ---------------------------------------------------------------------
def test_help_from_outside_the_tree(tmp_path):
    r = _python_m_rawkv(["bench", "--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    for option in ("--only", "--quick", "--out", "--peer"):
        assert option in r.stdout
    assert ", ".join(GROUPS) in " ".join(r.stdout.split())
    assert "bench" in _python_m_rawkv(["--help"], tmp_path).stdout


def test_without_a_gpu_one_line_and_status_2(tmp_path):
    if _has_gpu():
        pytest.skip("a CUDA GPU is usable here: the refusal is tested with a stand-in below")
    out = tmp_path / "res"
    r = _python_m_rawkv(["bench", "--only", "core", "--out", str(out)], tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rawkv bench: needs a CUDA GPU: "), r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()                                  # nothing written


def test_the_gpu_refusal_is_one_line_whatever_the_message(monkeypatch, tmp_path, capsys):
    """The runtime's GpuUnavailableError (stood in for, so this runs on a GPU
    machine too) becomes one line on stderr and status 2, before anything
    is imported from the GPU stack or written."""
    def refuse(device=None):
        raise rawkv.GpuUnavailableError("CuPy is not installed;\n  no driver")
    monkeypatch.setattr(rawkv, "get_runtime", refuse)
    monkeypatch.setattr(rawkv, "warmup", lambda *a, **k: pytest.fail("warmup after the refusal"))
    out = tmp_path / "res"
    assert main(["bench", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "rawkv bench: needs a CUDA GPU: CuPy is not installed; no driver\n"
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--only", "gemm,foo"], "argument --only: unknown group(s) 'foo'"),
    (["--only", ","], "argument --only: names no group"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_usage_errors_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "python -m rawkv bench --help" in err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--out", str(f)])
    assert e.value.code == 2
    assert f"argument --out: {f} exists and is not a folder" in capsys.readouterr().err


def test_groups_keep_their_order_once_each():
    assert cli.parse_groups("gemm, core,gemm") == ["gemm", "core"]
    assert cli.parse_groups(",".join(GROUPS)) == list(GROUPS)


def test_only_a_group_with_peers_gets_peer():
    seen = []

    class Plain:
        @staticmethod
        def run(rt, results, quick):
            seen.append(("plain", quick))

    class WithPeers:
        PEERS = ("humming-kernels",)

        @staticmethod
        def run(rt, results, quick, peers):
            seen.append(("peers", quick, peers))
    a = SimpleNamespace(quick=True, peer=True)
    cli._run_group(Plain, None, [], a)
    cli._run_group(WithPeers, None, [], a)
    cli._run_group(WithPeers, None, [], SimpleNamespace(quick=False, peer=False))
    assert seen == [("plain", True), ("peers", True, True), ("peers", False, False)]


# ---- the table -----------------------------------------------------------------------
CORE_ROWS = [
    {"op": "launch_overhead/e4m3_encode", "shape": [4096], "dtype": "float32", "host_us": 11.43,
     "baseline": "cupy.from_dlpack per tensor per call", "baseline_us": 89.94},
    {"op": "e4m3_encode", "shape": [268435456], "dtype": "bfloat16", "us": 283.91, "GBps": 2836.5,
     "frac_of_copy": 0.959, "baseline": "torch", "baseline_us": 1448.2, "speedup": 5.1},
    {"op": "e4m3_encode/graph", "shape": [1, 7168], "dtype": "bfloat16", "us": 2.5, "GBps": 8.6,
     "frac_of_copy": 0.003},
    {"op": "core/error", "error": "RuntimeError('boom')"},
]


def test_table_of_a_fixed_results_list():
    assert cli.format_table(CORE_ROWS) == "\n".join([
        "op                           shape              us  baseline us  of copy",
        "launch_overhead/e4m3_encode  4096       11.43 host        89.94        -",
        "e4m3_encode                  268435456      283.91     1,448.20      96%",
        "e4m3_encode/graph            1x7168           2.50            -     0.3%",
        "core/error: RuntimeError('boom')",
    ])


def test_table_of_gemm_rows_gives_the_floor_and_the_peer():
    rows = [
        {"op": "grouped_linear/wo_a-flash", "shape": [1, 8, 4096, 1024], "us": 11.9, "frac_of_copy": 0.4,
         "frac_of_floor": 0.53, "baseline_us": 25.2, "peer": "humming-kernels 0.1.19 dense", "peer_us": 15.01},
        {"op": "moe_linear/down", "shape": [1, 256, 6, 2048, 4096], "us": 40.0, "frac_of_floor": 0.5,
         "baseline_us": None, "peer": None, "peer_us": None},
        {"op": "moe_linear/down", "shape": [16, 256, 6, 2048, 4096], "us": 50.0, "frac_of_floor": 0.6,
         "baseline_us": None, "peer": "humming-kernels 0.1.19", "peer_us": None, "peer_error": "x"},
    ]
    assert cli.format_table(rows).splitlines() == [
        "op                         shape                  us  baseline us  of floor  peer us",
        "grouped_linear/wo_a-flash  1x8x4096x1024       11.90        25.20       53%    15.01",
        "moe_linear/down            1x256x6x2048x4096   40.00            -       50%        -",
        "moe_linear/down            16x256x6x2048x4096  50.00            -       60%   failed",
    ]


def test_table_of_nothing_is_the_header():
    assert cli.format_table([]) == "op  shape  us  baseline us  of copy"


# ---- the JSON ------------------------------------------------------------------------
def test_json_document_and_file(tmp_path):
    doc = cli.document("NVIDIA H100 80GB HBM3", "2.11.0+cu130", "14.2.0", "abc1234", 2957.81, CORE_ROWS)
    assert list(doc) == ["device", "torch", "cupy", "commit", "copy_GBps", "results"]
    assert doc["copy_GBps"] == 2957.8
    path = cli.write_json(str(tmp_path), "2026-01-02", cli.device_short(doc["device"]), "core", doc)
    assert path == str(tmp_path / "2026-01-02-h100-core.json")
    assert json.loads(Path(path).read_text()) == doc


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_json_file_is_byte_for_byte_the_committed_shape(name, tmp_path):
    """A committed bench/results file, read and written again by write_json:
    the same bytes (the format of the files docs/benchmarks.md reads)."""
    src = RESULTS / name
    date, device, group = name[:10], name.split("-")[3], name[:-len(".json")].split("-", 4)[4]
    path = cli.write_json(str(tmp_path), date, device, group, json.loads(src.read_text()))
    assert Path(path).name == name
    assert Path(path).read_bytes() == src.read_bytes()


def test_device_short():
    assert cli.device_short("NVIDIA H100 80GB HBM3") == "h100"
    assert cli.device_short("NVIDIA H200") == "h200"
    assert cli.device_short("NVIDIA GeForce RTX 4090") == "4090"


def test_commit_override(monkeypatch):
    monkeypatch.setenv("RAWKV_COMMIT", "95865bc")
    assert cli.commit() == "95865bc"


def test_commit_outside_a_checkout_is_the_version(monkeypatch, tmp_path):
    monkeypatch.delenv("RAWKV_COMMIT", raising=False)
    assert cli.commit(tmp_path) == rawkv.__version__


def test_commit_inside_another_repository_is_the_version(monkeypatch, tmp_path):
    """An install whose site-packages lies inside some git checkout (a venv
    in a repository) records the version, not that repository's HEAD."""
    monkeypatch.delenv("RAWKV_COMMIT", raising=False)
    try:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not usable here")
    site = tmp_path / "venv" / "site-packages"
    site.mkdir(parents=True)
    assert cli.commit(site) == rawkv.__version__


def test_commit_of_the_source_tree_is_its_head(monkeypatch, tmp_path):
    monkeypatch.delenv("RAWKV_COMMIT", raising=False)
    try:
        head = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("the tests do not run from a git checkout")
    monkeypatch.chdir(tmp_path)                     # whatever the working directory
    assert cli.commit() == head


# ---- the generic figure --------------------------------------------------------------
def test_bar_rows_keep_the_timed_rows():
    assert plot.bar_rows(CORE_ROWS + [1]) == [
        ("e4m3_encode 268435456", {"rawkv": 283.91, "baseline": 1448.2, "peer": None}),
        ("e4m3_encode/graph 1x7168", {"rawkv": 2.5, "baseline": None, "peer": None}),
    ]


def test_bars_skip_quietly_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.bars(CORE_ROWS, str(tmp_path / "x.png")) is None
    assert not (tmp_path / "x.png").exists()


def test_bars_draw_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert plot.bars(CORE_ROWS[-1:], str(tmp_path / "none.png")) is None      # nothing timed
    path = str(tmp_path / "x-core.png")
    assert plot.bars(CORE_ROWS, path) == path
    assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- from the installed package ------------------------------------------------------
def test_the_benchmarks_read_nothing_from_tools_or_the_working_directory():
    """rawkv/bench ships in the wheel: no module of it imports the tools'
    scripts (`bench`, `bench_<group>`) or edits sys.path to find them."""
    pkg = Path(cli.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                names = []
            bad = [n for n in names if n.split(".")[0] in ("bench", "tools") or n.startswith("bench_")]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                pytest.fail(f"{path.name}:{node.lineno} uses sys.path")
        assert "__file__" not in path.read_text() or path.name == "cli.py", path.name


def test_the_tools_entry_points_run_the_package(tmp_path):
    """tools/bench.py keeps the timing helpers importable as `bench` (for
    tools/probe_gemm_paths.py) and passes its options on to the command."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gemm.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--peer" in r.stdout, r.stderr
    code = "import sys; sys.path.insert(0, sys.argv[1]); from bench import cuda_time_us; print(cuda_time_us.__module__)"
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.strip() == "rawkv.bench.timing", r.stderr


def test_a_timing_after_a_pause_warms_the_gpu_first(monkeypatch):
    # keep_warm runs `busy` only when the last timing ended more than IDLE_S
    # ago (a pause that may have dropped the GPU's clocks), not between
    # timings back to back
    from rawkv.bench import timing
    now = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(timing, "_LAST_TIMED", [0.0])
    warmed = []
    assert timing.keep_warm(warmed.append) and warmed == [timing.WARM_S]
    timing._timed()
    now[0] += timing.IDLE_S / 2
    assert not timing.keep_warm(warmed.append) and len(warmed) == 1
    now[0] += timing.IDLE_S
    assert timing.keep_warm(warmed.append) and len(warmed) == 2


def test_the_document_names_its_eager_timings_only_when_there_are_some():
    """A group's file lists why any of its timings fell back to eager calls
    (timing.EAGER: not CUDA-graph replays, host time counted)."""
    from rawkv.bench import cli
    doc = cli.document("NVIDIA H200", "2.11", "14.2", "abc", 4173.24, [], ["RuntimeError: x"])
    assert doc["eager_timings"] == ["RuntimeError: x"] and list(doc)[-1] == "results"
    assert "eager_timings" not in cli.document("NVIDIA H200", "2.11", "14.2", "abc", 4173.24, [], [])
