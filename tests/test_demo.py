"""python -m rawkv: the command line (one-line usage errors, exit status 2) and the
demos' CPU mode (numpy reference), whose first line gives the runtime's reason: the
cache demo (--cache) here, the layer demo (the default) in test_demo_layer.py."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import rawkv
from rawkv.__main__ import main


def _gpu_reason() -> str | None:
    """Why the runtime cannot run here (its GpuUnavailableError), or None."""
    try:
        rawkv.warmup(0)
    except rawkv.GpuUnavailableError as exc:
        return str(exc)
    return None


def _check_report(lines, steps):
    assert "numpy reference" in lines[0]
    assert lines[1].startswith(f"config: 2 requests, prompts [250, 389] tokens, {steps} decode steps")
    bpt = [ln for ln in lines if ln.startswith("bytes/token")]
    assert len(bpt) == 2 and all("vs BF16" in ln for ln in bpt)
    acc = [ln for ln in lines if ln.startswith("accuracy")]
    assert len(acc) == 3 and all("(ok >=" in ln for ln in acc)
    for ln in acc:
        assert float(re.search(r"cosine min ([0-9.]+)", ln).group(1)) >= 0.98
    assert re.match(r"time: [0-9.]+ us per step \(numpy reference", lines[-1])
    # CPU mode runs no kernel, and says so instead of reporting "kernel errors"
    assert lines[-1].endswith("skipped rows 0 (counted by the numpy reference ops; no kernel ran)")
    assert "kernel" not in lines[-1].replace("no kernel ran", "")


def test_demo_cpu_flag_one_step(capsys):
    assert main(["demo", "--cache", "--cpu", "--small", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("rawkv demo: CPU MODE") and lines[0].endswith(": --cpu given")
    _check_report(lines, 1)


def test_demo_cpu_reason_is_this_machines(capsys):
    """The reason is the runtime's, not a guess: with a CPU-only torch (as on the
    CI machines) it names torch's build, and CuPy only if CuPy is really missing."""
    reason = _gpu_reason()
    if reason is None:
        pytest.skip("the GPU path runs here")
    assert main(["demo", "--cache", "--steps", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("rawkv demo: CPU MODE") and first.endswith(": " + reason)
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} was built without CUDA" in first
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert "CuPy is not installed" in first
    else:
        assert "CuPy" not in first


@pytest.mark.parametrize("missing", ["torch", "cupy", "device"])
def test_demo_cpu_reason_follows_what_is_missing(missing, monkeypatch, capsys):
    import rawkv.runtime
    monkeypatch.setattr(rawkv.runtime, "_runtimes", {})     # no Runtime made by earlier tests
    if missing == "device":       # a CUDA build of torch that finds no GPU
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        expected = f"torch {torch.__version__} (CUDA 12.8) finds no CUDA GPU or driver"
    else:
        monkeypatch.setitem(sys.modules, missing, None)     # import fails
        expected = {"torch": "PyTorch is not installed", "cupy": "CuPy is not installed"}[missing]
    assert main(["demo", "--cache", "--steps", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("rawkv demo: CPU MODE") and expected in first


def test_demo_gpu_small(cuda, capsys):
    """On a GPU: the kernels, the decode step captured in one CUDA graph, no kernel error."""
    assert main(["demo", "--cache", "--small", "--steps", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"rawkv demo: GPU {cuda.name} ({cuda.arch}): kernels, decode steps in one CUDA graph"
    assert lines[1].startswith("config: 2 requests, prompts [250, 389] tokens, 8 decode steps")
    acc = [ln for ln in lines if ln.startswith("accuracy")]
    assert len(acc) == 3 and all("(ok >=" in ln for ln in acc)
    assert re.match(r"time: [0-9.]+ us per step \(one CUDA graph replay", lines[-1])
    assert lines[-1].endswith("kernel errors 0")


@pytest.mark.parametrize("argv, bad", [
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--steps", "-3"], "--steps"),
    (["demo", "--steps", "many"], "--steps"),
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--steps", "100000000"], "--steps"),          # sized up front: was OOM after 25 s
    (["demo", "--steps", "10001"], "--steps"),
    (["demo", "--cache", "--layout", "rawkv", "--index-layout", "mxfp4"], "--index-layout: not allowed"),  # was ignored
    (["demo", "--cache", "--index-layout", "fp8", "--layout", "rawkv"], "--index-layout: not allowed"),
    (["demo", "--mode", "xyz"], "--mode xyz"),
    (["demo", "extra"], "extra"),
    (["warmup", "--device", "1"], "--device"),
    (["xyz"], "'xyz'"),
    (["--bogus"], "--bogus"),
])
def test_bad_command_line_is_one_line_and_status_2(argv, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m rawkv") and bad in lines[0], err
    assert ": error: " in lines[0] and lines[0].endswith("--help)")


def test_demo_steps_bound_and_layout_options(monkeypatch, capsys):
    """--steps up to MAX_STEPS is accepted (the run is not made here), and
    --index-layout goes with model1 only; its default is fp8."""
    import rawkv.demo as demo
    seen = []
    monkeypatch.setattr(demo, "run", lambda a: seen.append(a) or 0)
    assert main(["demo", "--cache", "--cpu", "--steps", str(demo.MAX_STEPS)]) == 0
    assert seen[-1].steps == demo.MAX_STEPS and seen[-1].index_layout == "fp8"
    assert main(["demo", "--cache", "--cpu", "--index-layout", "mxfp4"]) == 0 and seen[-1].index_layout == "mxfp4"
    assert main(["demo", "--cache", "--cpu", "--layout", "rawkv"]) == 0 and seen[-1].index_layout is None
    # the bound's reason: the host rows of a full-size run at MAX_STEPS stay near a GB
    assert 4 * demo.MAX_STEPS * demo.TOKEN_BYTES < 2 ** 30


def test_bad_value_from_the_shell_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "rawkv", "demo", "--steps", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("python -m rawkv demo: error: argument --steps: expected an integer from 1 to 10,000, "
                        "got 0 (see python -m rawkv demo --help)\n")


COMMANDS = ("bench", "demo", "nvrtc-check", "warmup")


def _listed(text: str) -> dict[str, str]:
    """command -> its one-line help, from the 'commands' section of --help."""
    section = text.split("commands:", 1)[1]
    return {m.group(1): " ".join(m.group(2).split())
            for m in re.finditer(r"^    (\S+)\s+(.+?)(?=^    \S|\Z)", section, re.M | re.S)}


def test_help_lists_every_command_with_a_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    listed = _listed(capsys.readouterr().out)
    assert sorted(listed) == sorted(COMMANDS)
    assert all(len(h) > 20 for h in listed.values()), listed


def test_no_command_prints_usage_and_status_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: python -m rawkv")
    assert sorted(_listed(err)) == sorted(COMMANDS)


def test_nvrtc_check_gets_its_own_options(capsys):
    """Options after nvrtc-check reach the compile-check's parser untouched."""
    with pytest.raises(SystemExit) as exc:
        main(["nvrtc-check", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max-spill-bytes" in out and "--arch" in out
