"""Runtime behaviour on a GPU: streams, graph capture rules, disk cache."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import rawkv
from rawkv.reference import formats as ref
from rawkv.runtime import arch_for

torch = pytest.importorskip("torch")


def test_runtime_describes_the_device(cuda):
    assert cuda.arch == arch_for(torch.cuda.get_device_capability(0)) and cuda.sm_count > 0
    assert rawkv.get_runtime("cuda:0") is cuda and rawkv.get_runtime(torch.device("cuda:0")) is cuda
    grid, block = cuda.grid_stride(10 ** 9)
    assert block == 256 and grid == cuda.resident_blocks(256) * 2
    assert cuda.grid_stride(5) == (1, 256)


def test_launch_orders_with_torch_work_on_a_side_stream(cuda):
    s = torch.cuda.Stream()
    x = torch.empty(1 << 22, device="cuda")
    out = torch.empty(1 << 22, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(s):
        x.fill_(3.0)                       # torch work on s ...
        rawkv.fp8.e4m3_encode(x, out=out)  # ... then rawkv on the same stream
        x.fill_(100.0)
    torch.cuda.current_stream().wait_stream(s)
    assert (out == ref.e4m3_encode(np.float32(3.0))).all()


def test_graph_replay_gives_eager_bits(cuda, rng):
    rawkv.warmup()
    x = torch.from_numpy(rng.standard_normal(1 << 16).astype(np.float32)).cuda()
    out = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    back = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rawkv.fp8.e4m3_encode(x, out=out)
        rawkv.fp8.e4m3_decode(out, out=back)
    x.copy_(torch.from_numpy(rng.standard_normal(1 << 16).astype(np.float32)))
    g.replay()
    torch.cuda.synchronize()
    eager = rawkv.fp8.e4m3_encode(x).view(torch.uint8)
    assert torch.equal(out, eager)
    assert torch.equal(back, rawkv.fp8.e4m3_decode(eager, dtype=torch.bfloat16))


def test_allocation_during_capture_is_refused(cuda):
    rawkv.warmup()
    x = torch.randn(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(rawkv.CaptureError, match="out="):
        with torch.cuda.graph(g):
            rawkv.fp8.e4m3_encode(x)      # no out=: would allocate


def _unloaded(cuda, monkeypatch):
    """An encode's input and out=, every kernel then forgotten (as if
    warmup() had never run), and a graph to capture."""
    rawkv.warmup()
    x = torch.randn(1024, device="cuda")
    out = torch.empty(1024, dtype=torch.uint8, device="cuda")
    monkeypatch.setattr(cuda, "_functions", {})
    return x, out, torch.cuda.CUDAGraph()


def test_unloaded_kernel_during_capture_is_refused(cuda, monkeypatch):
    x, out, g = _unloaded(cuda, monkeypatch)
    with pytest.raises(rawkv.CaptureError, match="warmup"):
        with torch.cuda.graph(g):
            rawkv.fp8.e4m3_encode(x, out=out)


def test_unloaded_kernel_on_a_capturing_side_stream_is_refused(cuda, monkeypatch):
    """stream=s while s (not the current stream) is capturing: the capture
    rules look at the op's stream too."""
    x, out, g = _unloaded(cuda, monkeypatch)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g.capture_begin()
    try:
        assert not torch.cuda.is_current_stream_capturing()
        with pytest.raises(rawkv.CaptureError, match="warmup"):
            rawkv.fp8.e4m3_encode(x, out=out, stream=s)
    finally:
        with torch.cuda.stream(s):
            g.capture_end()


def test_unloaded_kernel_with_a_stream_while_the_current_stream_captures_is_refused(cuda, monkeypatch):
    """The reverse: torch's current stream captures and the op is given
    another stream s. The body runs with s made current (for the DLPack
    imports and copies it makes: _args.stream_current), and the capture
    rules still see the caller's capture, which loading a module would
    break (a global-mode capture forbids it in this thread)."""
    x, out, g = _unloaded(cuda, monkeypatch)
    s = torch.cuda.Stream()
    with pytest.raises(rawkv.CaptureError, match="warmup"):
        with torch.cuda.graph(g):
            assert torch.cuda.is_current_stream_capturing()
            rawkv.fp8.e4m3_encode(x, out=out, stream=s)


def test_many_processes_warm_up_one_empty_cache_at_once(cuda, tmp_path):
    """N processes (as an engine's tensor-parallel workers start) import
    rawkv and warm up against one empty cache directory at the same moment:
    every one gets working kernels, no module is compiled more often than
    there are racing processes, and the directory ends with one valid file
    per module (kernel instance) and nothing else (a fresh process loads
    all of them)."""
    n = 4
    cache, go = tmp_path / "cache", tmp_path / "go"
    code = ("import json, os, time, torch, rawkv\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
            "rt = rawkv.warmup(0)\n"
            "x = torch.ones(64, device='cuda')\n"
            "assert rawkv.fp8.e4m3_encode(x).view(torch.uint8).eq(0x38).all()\n"
            "print(json.dumps(rt.stats))\n")
    env = dict(os.environ, RAWKV_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    go.touch()                                   # all start warming up together
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    modules = stats[0]["modules"]
    # one module per kernel instance the device builds
    assert modules == len(rawkv.runtime.instances_for(cuda.arch)) and modules > 0
    for s in stats:
        assert s["modules"] == modules and s["compiles"] + s["disk_hits"] == modules, s
        assert s["damaged"] == 0, s
    # every module compiled at least once, never by more processes than raced
    assert modules <= sum(s["compiles"] for s in stats) <= n * modules
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == modules and all(f.endswith(".cubin.rkv") for f in files), files
    r = subprocess.run([sys.executable, "-c", code.split("\n", 2)[0] + "\n" + code.split("\n", 2)[2]],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    fresh = json.loads(r.stdout.strip().splitlines()[-1])
    assert fresh["compiles"] == 0 and fresh["disk_hits"] == modules and fresh["damaged"] == 0


def test_second_process_loads_from_disk_without_compiling(cuda, tmp_path):
    code = ("import json, torch, rawkv; rt = rawkv.warmup(0); "
            "x = torch.ones(64, device='cuda'); "
            "assert rawkv.fp8.e4m3_encode(x).view(torch.uint8).eq(0x38).all(); "
            "print(json.dumps(rt.stats))")
    env = dict(os.environ, RAWKV_CACHE_DIR=str(tmp_path))
    stats = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        stats.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert stats[0]["compiles"] == stats[0]["modules"] > 0
    assert stats[1]["compiles"] == 0 and stats[1]["disk_hits"] == stats[1]["modules"]


def test_first_call_compiles_only_its_instance(cuda, tmp_path):
    """A fresh process with an empty cache: one encode compiles one module
    (its kernel instance), not its file or every kernel."""
    code = ("import json, torch, rawkv; x = torch.ones(64, device='cuda'); "
            "assert rawkv.fp8.e4m3_encode(x).view(torch.uint8).eq(0x38).all(); "
            "print(json.dumps(rawkv.get_runtime(0).stats))")
    env = dict(os.environ, RAWKV_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["compiles"] == stats["modules"] == 1 and len(list(tmp_path.iterdir())) == 1, stats


def test_cold_warmup_prints_one_progress_line(cuda, tmp_path):
    """`python -m rawkv warmup` on an empty cache compiles every instance in
    parallel and says so on stderr (a pipe: a line at the start, one at the
    end); a second run loads them from disk and prints no such line."""
    n = len(rawkv.runtime.instances_for(cuda.arch))
    env = dict(os.environ, RAWKV_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "rawkv", "warmup"]
    cold = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert cold.returncode == 0, cold.stderr
    lines = [ln for ln in cold.stderr.splitlines() if ln.startswith("rawkv: compil")]
    assert len(lines) == 2 and lines[0].startswith(f"rawkv: compiling {n} kernels for {cuda.arch} ("), lines
    assert lines[1].startswith(f"rawkv: compiled {n} kernels for {cuda.arch} in "), lines
    warm = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0 and "rawkv: compil" not in warm.stderr, warm.stderr


def test_launch_on_the_current_stream(cuda, rng):
    """On side stream s: a long sleep, then x gets new values, then the
    encode. Launched on s it sees the new values; launched on any other
    stream it would run during the sleep and encode the old ones."""
    rawkv.warmup()                       # nothing to compile while s sleeps
    x = torch.from_numpy(rng.standard_normal(3 << 16).astype(np.float32)).cuda()
    out = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
    for _ in range(2):               # the second call takes the fast path (out= given)
        new = rng.standard_normal(x.numel()).astype(np.float32)
        new_dev = torch.from_numpy(new).cuda()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(10_000_000)     # ~5 ms of GPU clock cycles
            x.copy_(new_dev)
            rawkv.fp8.e4m3_encode(x, out=out)
        torch.cuda.synchronize()
        assert np.array_equal(out.cpu().numpy(), ref.e4m3_encode(new))
