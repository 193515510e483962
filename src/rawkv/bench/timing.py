"""Timing helpers of the benchmark groups (rawkv/bench/<group>.py): device
time from CUDA-graph replays (cuda_time_us), one graph's replay time
(graph_time_us), issue 14's latency floor (latency), host time per call
(host_us_interleaved), the copy bandwidth every fraction is taken of
(copy_bandwidth_GBps, kept in COPY for the run), a result row (entry), and
warm_cuda_time_us, the GEMM group's timing: cuda_time_us after keep_warm,
so that a pause before it does not leave the GPU at idle clocks.
They import torch / CuPy when called, so this module imports without a GPU."""
from __future__ import annotations

import statistics
import time


#: A GPU idle this long (weights built on the host, a peer's JIT compile)
#: may have dropped its clocks: the next warm timing (warm_cuda_time_us)
#: first calls the op itself for WARM_S, so that the first op timed after a
#: pause is not timed at idle clocks (H100: the first row of the GEMM group,
#: timed after the peer's 12 s compile, took 15.6 us where the same call
#: measures 10.9-11.1 us in runs without the pause; the peer, timed second,
#: had the warm GPU). Not BF16 matmuls: small ops timed right after them ran
#: 5-20% slower (f560ac3's run; their power draw may hold the clocks down).
IDLE_S = 0.25
WARM_S = 0.2
_LAST_TIMED = [0.0]


def keep_warm(busy, idle_s: float = IDLE_S, warm_s: float = WARM_S) -> bool:
    """Before a timing: when the last one ended more than `idle_s` ago, run
    `busy(warm_s)` (the timings pass a loop calling the op). True when it
    warmed."""
    idle = time.perf_counter() - _LAST_TIMED[0] > idle_s
    if idle:
        busy(warm_s)
    return idle


def _calling(fn):
    """busy(seconds) for keep_warm: fn(i) over and over for that long."""
    def busy(seconds: float) -> None:
        import torch
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):
                fn(i)
                i += 1
            torch.cuda.synchronize()
    return busy


def _timed() -> None:
    _LAST_TIMED[0] = time.perf_counter()


#: Why each cuda_time_us of the run fell back to eager calls (host time
#: between launches counted), in order: the driver writes a group's as its
#: file's eager_timings, the GEMM rows name theirs (gemm_peer.timed_row).
EAGER: list = []


def cuda_time_us(fn, reps: int = 50, warmup: int = 5, per_graph: int = 20, warm_after_idle: bool = False) -> float:
    """Device time of one fn(i) call in microseconds (i = call index, for
    rotating buffers).

    The calls are captured `per_graph` at a time into a CUDA graph and the
    replays are timed with CUDA events (median over replays): the figure is
    GPU time, not the host's Python time between launches (which per-call
    events would count whenever an op's host overhead exceeds its kernel
    time). Ops that cannot be captured fall back to events around a loop of
    back-to-back calls."""
    import torch
    if warm_after_idle:
        keep_warm(_calling(fn))
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    replays = max(5, reps // per_graph)
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=s):
            for i in range(per_graph):
                fn(i)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / per_graph)
        del g
        _timed()
        return statistics.median(times)
    except Exception as exc:  # noqa: BLE001 - not capturable: time eagerly
        print(f"[bench] graph capture failed ({type(exc).__name__}: {exc}); timing eagerly")
        EAGER.append(f"{type(exc).__name__}: {str(exc)[:120]}")
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(reps):
            fn(i)
        b.record()
        b.synchronize()
        _timed()
        return a.elapsed_time(b) * 1e3 / reps


def warm_cuda_time_us(fn, reps: int = 50, warmup: int = 5, per_graph: int = 20) -> float:
    """cuda_time_us after keep_warm: for stateless ops (the GEMM group's),
    which may be called any number of times; a stateful op (a cache write)
    takes cuda_time_us, whose calls are the ones it plans for."""
    return cuda_time_us(fn, reps, warmup, per_graph, warm_after_idle=True)


def graph_time_us(fn, reps: int = 200, warmup: int = 3) -> float:
    """Time of one replay of a CUDA graph that captures fn() once, measured
    over back-to-back replays between two CUDA events (what a decode loop
    that replays one graph per step sees on the GPU)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    per = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(max(1, reps // 5)):
            g.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) * 1e3 / max(1, reps // 5))
    _timed()
    return statistics.median(per)


EMPTY: dict = {}


def _empty_kernel_times() -> dict:
    """An empty kernel's time, measured once per run, two ways (see latency)."""
    if not EMPTY:
        import cupy
        import torch
        k = cupy.RawKernel('extern "C" __global__ void rkv_bench_empty() {}', "rkv_bench_empty")

        def launch():
            k((1,), (32,), (), stream=cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        EMPTY["graph_us"] = graph_time_us(launch, reps=500)
        EMPTY["device_us"] = cuda_time_us(lambda i: launch(), reps=200)
    return EMPTY


def latency(fn, nbytes: int) -> dict:
    """Issue 14's decode-size goal: within 1.5x of an empty kernel plus the
    op's bytes at copy bandwidth, measured two ways:
      graph_us   one replay of a graph holding fn() once, replays back to back
                 (what a decode loop pays; an empty kernel's replay is mostly
                 the host's graph launch, so this ratio is near 1 for any small op);
      device_us  fn() inside a graph of 20 calls, per call (the GPU's own
                 time: launch in the graph, ramp, the bytes, the tail)."""
    e = _empty_kernel_times()
    bytes_us = nbytes / (COPY["GBps"] * 1e3)
    g = graph_time_us(fn)
    d = cuda_time_us(lambda i: fn(), reps=100)
    return {"graph_us": round(g, 2), "graph_floor_us": round(e["graph_us"] + bytes_us, 2),
            "graph_ratio": round(g / (e["graph_us"] + bytes_us), 2),
            "device_us": round(d, 2), "device_floor_us": round(e["device_us"] + bytes_us, 2),
            "device_ratio": round(d / (e["device_us"] + bytes_us), 2)}


def rotation(nbytes_per_set: int, l2_bytes: int) -> int:
    """How many input sets to rotate so that repeated calls miss in L2."""
    return 1 if nbytes_per_set >= 4 * l2_bytes else max(2, -(-4 * l2_bytes // max(nbytes_per_set, 1)))


def entry(op, shape, dtype, us, nbytes, copy_GBps, baseline=None, baseline_us=None, **extra):
    gbps = nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0
    r = {"op": op, "shape": list(shape), "dtype": dtype, "us": round(us, 2),
         "GBps": round(gbps, 1), "frac_of_copy": round(gbps / copy_GBps, 3) if copy_GBps else None}
    if baseline is not None:
        r.update(baseline=baseline, baseline_us=round(baseline_us, 2),
                 speedup=round(baseline_us / us, 2) if us > 0 else None)
    r.update(extra)
    return r


def copy_bandwidth_GBps(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large device-to-device copy.

    Timed eagerly (CUDA events around each 1 GiB copy; host overhead is
    nothing next to ~0.7 ms of copy): captured in a CUDA graph, torch's copy_
    becomes a memcpy node served by the copy engines, measured at ~2,440 GB/s
    on an H100 against ~3,000 GB/s for the eager (SM) copy, and the lower
    figure would flatter every fraction of copy."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return 2 * nbytes / (statistics.median(times) * 1e-6) / 1e9


def host_us_per_call(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Median over `repeats` of host time per call for `calls` back-to-back
    calls (GPU work per call is tiny, so the host is what is measured)."""
    return host_us_interleaved({"fn": fn}, calls, repeats)["fn"][0]


def host_us_interleaved(fns: dict, calls: int = 2000, rounds: int = 9) -> dict:
    """{name: (median, min)} of host us per call for several functions timed
    in turn, `rounds` times over, in a rotating order: drift of the machine
    (clocks, other tenants) hits every function alike, so their ratios are
    comparable. A value may be (setup, fn): setup() runs untimed before each
    of fn's blocks (e.g. to switch the launcher)."""
    import torch
    items = [(k, v if isinstance(v, tuple) else (None, v)) for k, v in fns.items()]
    per: dict = {k: [] for k, _ in items}
    for r in range(rounds + 1):                      # round 0 warms up, untimed
        k0 = r % len(items)
        for name, (setup, fn) in items[k0:] + items[:k0]:
            if setup is not None:
                setup()
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            dt = (time.perf_counter() - t0) / calls * 1e6
            torch.cuda.synchronize()                 # drain the queue between blocks
            if r:
                per[name].append(dt)
    return {k: (statistics.median(v), min(v)) for k, v in per.items()}


#: the run's device-to-device copy bandwidth, measured once by the driver
COPY = {"GBps": 0.0}


def copy_GBps(nbytes: int = 1 << 30) -> float:
    """The run's copy bandwidth (COPY); measured here, and kept, when a group
    runs without the driver having measured it."""
    if not COPY["GBps"]:
        COPY["GBps"] = copy_bandwidth_GBps(nbytes)
    return COPY["GBps"]
