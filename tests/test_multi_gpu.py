"""Two GPUs in one host (issue 15): each worker's kernels run on its own device.

(a) One process, two devices: every rawkv:: operator (the opcheck samples of
    test_library) and the demo's decode-step ops, called on tensors of
    cuda:1 while cuda:0 is current (and the reverse), give the bits of the
    same call on cuda:0, launch only on their tensors' device (profiler),
    keep the current device, and allocate nothing on the other device
    (torch's allocator, the device's free memory and, where nvidia-smi shows
    this process, the driver's per-process memory).
(b) A process that uses only cuda:1, with the current device left at 0,
    creates no context on GPU 0: the driver's primary-context state of GPU 0,
    read in the process after each phase, and nvidia-smi's compute
    processes, read while that process waits.
(c) Two ranks under torch.distributed (NCCL, one GPU each, started by
    torch.distributed.run as torchrun starts them; tools/multi_gpu_step.py)
    warm up together against one empty kernel cache directory, run the
    decode step captured in a CUDA graph, all_gather their bytes, and rank 0
    checks every rank against a single-GPU run of that rank's inputs. The
    shared directory then holds valid files only.

NVLink multicast stays off: the workers get NCCL_NVLS_ENABLE=0 and no
multicast API is called. The module skips itself on fewer than two GPUs.
tools/gpu_check.sh adds it to the run where nvidia-smi lists two or more.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu     # every test here needs two GPUs, the cuda fixture or not

torch = pytest.importorskip("torch")
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
if N_GPUS < 2:
    pytest.skip(f"needs 2 CUDA GPUs, found {N_GPUS}", allow_module_level=True)

import rawkv  # noqa: E402
import rawkv.library  # noqa: E402,F401  (registers torch.ops.rawkv)
from conftest import GPU_SKIP_REASON  # noqa: E402
from rawkv import _opdecl  # noqa: E402
from support.library import samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_PATH = ROOT / "tools" / "multi_gpu_step.py"
_spec = importlib.util.spec_from_file_location("multi_gpu_step", STEP_PATH)
step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step)

# (the tensors' device, the current device while the op is called)
DIRECTIONS = [(1, 0), (0, 1)]
DIRECTION_IDS = ["tensors-cuda1-current-cuda0", "tensors-cuda0-current-cuda1"]


def _env(**extra) -> dict:
    """The environment of a child: this tree, its tests and tools importable."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tools")] +
                           ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **extra)


def _warm():
    rawkv.warmup(0)
    rawkv.warmup(1)


def _sync():
    for d in range(2):
        torch.cuda.synchronize(d)


def _raw(x):
    """The bytes of a tensor, on the host (NaNs compare by their bits)."""
    return x.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


# ---------------------------------------------------------------------------
# nvidia-smi: the driver's view of this host's compute processes
# ---------------------------------------------------------------------------
def _bus(text: str) -> str:
    """A PCI bus id in one spelling: nvidia-smi writes 00000000:19:00.0, the
    driver API 0000:19:00.0."""
    dom, bus, devfn = text.strip().strip("\0").lower().split(":")
    return f"{int(dom, 16):x}:{int(bus, 16):02x}:{devfn}"


def _smi(query: str) -> list[list[str]] | None:
    """nvidia-smi's CSV rows for `query`; None when it cannot be run."""
    try:
        r = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return [[c.strip() for c in ln.split(",")] for ln in r.stdout.splitlines() if ln.strip()]


def _gpu_buses() -> dict[int, str] | None:
    rows = _smi("--query-gpu=index,pci.bus_id")
    return None if rows is None else {int(i): _bus(b) for i, b in rows}


def _process_memory(pid: int) -> dict[str, str] | None:
    """{bus id: used memory (MiB)} of process `pid`, one entry per GPU where
    the driver lists it; {} when nvidia-smi shows no process of that pid
    (processes of another pid namespace, as in a container, are hidden);
    None without nvidia-smi."""
    rows = _smi("--query-compute-apps=pid,gpu_bus_id,used_memory")
    if rows is None:
        return None
    return {_bus(b): mem for p, b, mem in rows if p.isdigit() and int(p) == pid}


def _torch_bus(index: int) -> str:
    """The PCI bus id of torch's cuda:<index> (CUDA's device order need not
    be nvidia-smi's); read through the driver API, which creates no context."""
    from cuda.bindings import driver as cu
    cu.cuInit(0)
    err, dev = cu.cuDeviceGet(index)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, bus = cu.cuDeviceGetPCIBusId(32, dev)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return _bus(bus.decode() if isinstance(bus, bytes) else str(bus))


def _memory(device: int) -> dict:
    """What this process holds on `device`: torch's allocator, the device's
    free memory (catches allocations outside torch, e.g. CuPy's pool) and the
    driver's per-process count where nvidia-smi shows this process."""
    free, _ = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "device free": free,
            "driver (nvidia-smi, MiB)": (_process_memory(os.getpid()) or {}).get(_torch_bus(device))}


# ---------------------------------------------------------------------------
# (a) one process, two devices
# ---------------------------------------------------------------------------
def _mutated(name: str) -> list[int]:
    """Positions of the arguments operator `name` writes."""
    return [i for i, (_, _, writes) in enumerate(_opdecl.declared()[name].args) if writes]


def _sample_pair(seed: int, name: str, device: int):
    """The sample calls of `name` on cuda:0 and on cuda:<device>, built from
    one seed; every tensor argument of the second set gets the bytes of the
    first (out= buffers are torch.empty: their first bytes are whatever the
    allocator held), copied through the host, so the calls have the same
    inputs and the devices never talk to each other."""
    want = samples(np.random.default_rng(seed), "cuda:0")[name]
    got = samples(np.random.default_rng(seed), f"cuda:{device}")[name]
    assert len(want) == len(got) and want
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            if isinstance(a, torch.Tensor):
                assert b.device == torch.device("cuda", device), (name, b.device)
                b.copy_(a.cpu())
    _sync()
    return want, got


@pytest.mark.parametrize("tensors,current", DIRECTIONS, ids=DIRECTION_IDS)
@pytest.mark.parametrize("name", sorted(_opdecl.declared()))
def test_operator_on_the_other_device_same_bits_nothing_elsewhere(cuda, seed, name, tensors, current):
    _warm()
    other = 1 - tensors
    op = getattr(torch.ops.rawkv, name)
    want, got = _sample_pair(seed, name, tensors)
    with torch.cuda.device(0):
        for args in want:
            op(*args)
    _sync()
    before = _memory(other)
    with torch.cuda.device(current):
        for args in got:
            op(*args)
        assert torch.cuda.current_device() == current, "the operator changed the current device"
    _sync()
    assert _memory(other) == before, f"rawkv::{name} on cuda:{tensors} allocated on cuda:{other}"
    names = [n for n, _, _ in _opdecl.declared()[name].args]
    for k, (w, g) in enumerate(zip(want, got)):
        for i in _mutated(name):
            if w[i] is None:                  # an optional output the sample leaves out
                assert g[i] is None
                continue
            assert g[i].device.index == tensors
            assert torch.equal(_raw(g[i]), _raw(w[i])), \
                f"rawkv::{name} sample {k}: {names[i]} on cuda:{tensors} differs from cuda:0"


@pytest.mark.parametrize("tensors,current", DIRECTIONS, ids=DIRECTION_IDS)
def test_operators_launch_on_their_tensors_device(cuda, seed, tensors, current):
    """Every kernel, memset and copy the operators issue runs on the device
    of their tensors, whatever device is current (CUPTI's record, through
    torch.profiler). A launch on the wrong device through a peer mapping
    would still give the right bits: only the record shows it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _warm()
    calls = [(getattr(torch.ops.rawkv, name), args)
             for name, sets in samples(np.random.default_rng(seed), f"cuda:{tensors}").items()
             for args in sets]
    _sync()
    with torch.cuda.device(current):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for op, args in calls:
                op(*args)
            torch.cuda.synchronize(tensors)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events:
        pytest.skip("torch.profiler recorded no CUDA activity in this process (CUPTI unavailable)")
    wrong = sorted({(e.name, e.device_index) for e in events if e.device_index != tensors})
    assert not wrong, f"launched on another device than cuda:{tensors}: {wrong}"
    assert any("rkv_" in e.name for e in events), sorted({e.name for e in events})


@pytest.mark.parametrize("tensors,current", DIRECTIONS, ids=DIRECTION_IDS)
def test_decode_step_ops_on_the_other_device(cuda, seed, tensors, current):
    """The demo's decode step (prefill, state_seed, state_append,
    compress_decode, csa_rotate, hca_reset, the three gathers; eager) on
    pools and states of cuda:<tensors> while the other device is current:
    the bytes of the same run on cuda:0, nothing allocated on the other
    device, the current device kept."""
    _warm()
    other = 1 - tensors
    inp = step.make_inputs(seed, 0, steps=6)
    with torch.cuda.device(0):
        want, want_errors = step.decode_run(inp, "cuda:0", graph=False)
    want = want.cpu()
    _sync()
    before = _memory(other)
    with torch.cuda.device(current):
        got, errors = step.decode_run(inp, f"cuda:{tensors}", graph=False)
        assert torch.cuda.current_device() == current, "a kvcache op changed the current device"
    _sync()
    assert _memory(other) == before, f"the decode step on cuda:{tensors} allocated on cuda:{other}"
    assert got.device == torch.device("cuda", tensors)
    assert errors == want_errors == 0
    assert torch.equal(got.cpu(), want), f"the decode step on cuda:{tensors} differs from cuda:0"


@pytest.mark.parametrize("tensors", [0, 1])
def test_a_stream_of_the_other_device_is_refused_nothing_written(cuda, tensors):
    """stream= a stream of the other device than the tensors', whichever
    device is current: a ValueError naming stream before anything is
    allocated, launched or written. (It went to the driver: a launch in the
    tensors' device's context on another device's stream fails, and
    quantize's memset of gs, which does not, had run before it.) A stream
    of the tensors' own device is taken."""
    _warm()
    other = 1 - tensors
    dev = f"cuda:{tensors}"
    s = torch.cuda.Stream(device=other)
    x = torch.randn(256, 4096, device=dev)         # > SMALL_NUMEL: gs zeroed, amax, quantize
    q = torch.full((256, 2048), 0xAB, dtype=torch.uint8, device=dev)
    sf = torch.full((256, 256), 0xAB, dtype=torch.uint8, device=dev)
    g = torch.full((), 7.0, device=dev)
    codes = torch.full(x.shape, 0xAB, dtype=torch.uint8, device=dev)
    _sync()
    for current in (0, 1):
        with torch.cuda.device(current):
            with pytest.raises(ValueError, match=rf"^stream: is a stream of cuda:{other} but the op runs on "
                                                 rf"cuda:{tensors}"):
                rawkv.nvfp4.quantize(x, out=(q, sf, g), stream=s)
            with pytest.raises(ValueError, match="^stream: "):
                rawkv.fp8.e4m3_encode(x, out=codes, stream=s)
            with pytest.raises(ValueError, match="^stream: "):
                rawkv.fp8.e4m3_encode(x, stream=s)          # no out=: nothing allocated either
    _sync()
    assert (q == 0xAB).all() and (sf == 0xAB).all() and g.item() == 7.0 and (codes == 0xAB).all()
    mine = torch.cuda.Stream(device=tensors)
    rawkv.fp8.e4m3_encode(x, out=codes, stream=mine)
    torch.cuda.synchronize(tensors)
    assert torch.equal(codes.cpu(), rawkv.fp8.e4m3_encode(x.cpu()).view(torch.uint8))


# ---------------------------------------------------------------------------
# (b) a worker of GPU 1 leaves GPU 0 alone
# ---------------------------------------------------------------------------
# Uses cuda:1 only and never sets the current device (it stays 0): warm-up,
# every rawkv:: operator, the decode step eager and as a CUDA graph. After
# each phase it reads whether each GPU's primary context is active (the
# driver API itself creates none), then reports and waits on stdin so that
# the parent can read nvidia-smi while it is alive.
CHILD = r'''
import json, os, sys
import numpy as np
import torch
from cuda.bindings import driver as cu
import rawkv, rawkv.library
from support.library import samples
import multi_gpu_step as step


def ok(res):
    err, *vals = res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"driver call failed: {err}")
    return vals


ok(cu.cuInit(0))
devs = [ok(cu.cuDeviceGet(i))[0] for i in range(2)]


def contexts():
    return [bool(ok(cu.cuDevicePrimaryCtxGetState(d))[1]) for d in devs]


phases = [("start", contexts())]
rawkv.warmup(1)
phases.append(("rawkv.warmup(1)", contexts()))
for name, calls in samples(np.random.default_rng(0), "cuda:1").items():
    for args in calls:
        getattr(torch.ops.rawkv, name)(*args)
torch.cuda.synchronize(1)
phases.append(("every rawkv:: operator on cuda:1", contexts()))
inp = step.make_inputs(0, 1, steps=6)
errors = [step.decode_run(inp, "cuda:1", graph=False)[1]]
phases.append(("decode step on cuda:1, eager", contexts()))
errors.append(step.decode_run(inp, "cuda:1", graph=True)[1])
phases.append(("decode step on cuda:1, CUDA graph", contexts()))
bus = [ok(cu.cuDeviceGetPCIBusId(32, d))[0] for d in devs]
bus = [b.split(b"\0")[0].decode() if isinstance(b, bytes) else str(b) for b in bus]
print("READY " + json.dumps({"pid": os.getpid(), "current_device": torch.cuda.current_device(),
                             "phases": phases, "bus": bus, "errors": errors}), flush=True)
sys.stdin.read()
'''


@pytest.fixture(scope="module")
def gpu1_worker(tmp_path_factory):
    """Run CHILD; return (its report, nvidia-smi's GPUs, its per-GPU memory
    as nvidia-smi listed it while the child was alive; None without
    nvidia-smi)."""
    if GPU_SKIP_REASON:
        pytest.skip(GPU_SKIP_REASON)
    # stderr to a file: a full pipe nobody reads would block the child
    err = open(tmp_path_factory.mktemp("gpu1-worker") / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=_env(), cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    report = gpus = listed = None
    try:
        for line in proc.stdout:
            if line.startswith("READY "):
                report = json.loads(line[len("READY "):])
                break
        if report is not None:
            gpus = _gpu_buses()
            listed = _process_memory(report["pid"])      # while the child is alive
    finally:
        proc.stdin.close()
        proc.wait(60)
        watchdog.cancel()
        err.seek(0)
        stderr = err.read()[-4000:]
        err.close()
    assert report is not None, f"the cuda:1 worker exited ({proc.returncode}) before reporting:\n{stderr}"
    assert proc.returncode == 0, f"the cuda:1 worker reported, then exited {proc.returncode}:\n{stderr}"
    return report, gpus, listed


def test_gpu1_worker_creates_no_context_on_gpu0(gpu1_worker):
    report, _, _ = gpu1_worker
    assert report["current_device"] == 0
    assert report["errors"] == [0, 0]
    phases = report["phases"]
    assert phases[0][1] == [False, False], f"contexts before anything ran: {phases[0]}"
    first = next((what for what, (gpu0, _) in phases if gpu0), None)
    assert first is None, f"a context on GPU 0 appeared at: {first} (phases: {phases})"
    assert phases[-1][1][1], "no context on GPU 1 either: the check sees nothing"


def test_gpu1_worker_has_no_driver_entry_on_gpu0(gpu1_worker):
    report, gpus, listed = gpu1_worker
    if gpus is None or listed is None:
        pytest.skip("nvidia-smi cannot be run here; the primary-context test covers it")
    bus0, bus1 = (_bus(b) for b in report["bus"])
    assert {bus0, bus1} <= set(gpus.values()), (report["bus"], gpus)
    if not listed:
        pytest.skip(f"nvidia-smi lists no compute process with pid {report['pid']} (processes of "
                    "this pid namespace are hidden, e.g. in a container); the primary-context "
                    "test covers it")
    assert bus1 in listed, f"the worker is not listed on GPU 1 ({bus1}): {listed}"
    assert bus0 not in listed, f"the worker of cuda:1 holds {listed[bus0]} MiB on GPU 0 ({bus0})"


# ---------------------------------------------------------------------------
# (c) two ranks under torch.distributed
# ---------------------------------------------------------------------------
# Loads every module from `dir` on one device per architecture present and
# prints each runtime's stats: a file that did not load shows as a compile.
VERIFY = r'''
import json, torch, rawkv
first = {}
for i in range(torch.cuda.device_count()):
    first.setdefault(rawkv.get_runtime(i).arch, i)
print(json.dumps([dict(rawkv.warmup(i).stats) for i in first.values()]))
'''


def _check_cache_dir(d: Path) -> None:
    names = sorted(os.listdir(d))
    assert names, "the warm-up wrote nothing to the shared kernel cache directory"
    assert not [n for n in names if n.startswith(".") or n.endswith(".tmp")], names
    for n in names:
        st = os.lstat(d / n)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, (n, oct(st.st_mode))
    r = subprocess.run([sys.executable, "-c", VERIFY], env=_env(RAWKV_CACHE_DIR=str(d)), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    for s in stats:
        assert s["compiles"] == 0 and s["damaged"] == 0 and s["disk_hits"] == s["modules"] > 0, stats
    assert sum(s["modules"] for s in stats) == len(names), (stats, names)
    assert sorted(os.listdir(d)) == names          # loading wrote nothing


def _run_group(cmd, env, timeout):
    """Run torch.distributed.run in its own session; on a time-out its
    workers are killed with it (signal to that process group)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torch.distributed.run did not finish in {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


def test_two_ranks_nccl_graph_step_shared_cache(cuda, seed, tmp_path):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("this torch has no torch.distributed with NCCL")
    cache = tmp_path / "kernel-cache"
    cache.mkdir(mode=0o700)
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(STEP_PATH), "--seed", str(seed), "--out", str(result)]
    code, out = _run_group(cmd, _env(NCCL_NVLS_ENABLE="0", RAWKV_CACHE_DIR=str(cache)), 480)
    assert code == 0, out[-6000:]
    res = json.loads(result.read_text())
    ranks = res["ranks"]
    assert res["world"] == 2 and [i["rank"] for i in ranks] == [0, 1], out[-3000:]
    for i in ranks:
        want = i["local_rank"]
        assert i["device"] == i["runtime_device"] == i["current_device"] == want, i
        assert i["nccl_nvls_enable"] == "0" and i["cache_dir"] == str(cache), i
        assert i["errors"] == 0, i
    assert res["match"] == [True, True], f"a rank differs from its single-GPU run: {res['match']}"
    assert res["distinct"], "both ranks produced the same bytes: the per-rank inputs were not used"
    assert res["reference_errors"] == [0, 0]
    # both warmed up at once against the empty directory: every module was
    # compiled by a rank or loaded from what the other wrote, nothing damaged
    (s0, e0), (s1, e1) = (i["warmup"] for i in ranks)
    assert max(s0, s1) < min(e0, e1), f"the warm-ups did not overlap: {ranks}"
    stats = [i["stats"] for i in ranks]
    for s in stats:
        assert s["damaged"] == 0 and s["compiles"] + s["disk_hits"] == s["modules"] > 0, stats
    if ranks[0]["arch"] == ranks[1]["arch"]:
        assert sum(s["compiles"] for s in stats) >= stats[0]["modules"], stats
    _check_cache_dir(cache)
