"""The core group: the device-to-device copy bandwidth every fraction is
taken of (measured by the driver, timing.COPY), the host's launch overhead
per op beside torch's and CuPy's, FP8 encode / decode bandwidth on a large
tensor and, at decode sizes, as graph replays against issue 14's latency
floor.

Entry point: run(rt, results, quick=False) (called by rawkv.bench.cli)."""
from __future__ import annotations

from .timing import COPY, cuda_time_us, entry, host_us_interleaved, latency


def run(rt, results, quick=False):
    import cupy
    import torch
    import rawkv
    from rawkv import _launch, kernels
    n = 4096
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.empty(n, dtype=torch.uint8, device="cuda")
    calls = 500 if quick else 2000
    # The prior approach: wrap both tensors with cupy.from_dlpack on every call.
    fn = rt.function("fp8.cu", "rkv_e4m3_encode<float, true>")
    s = rt.stream()

    def dlpack_launch():
        cx, co = cupy.from_dlpack(x), cupy.from_dlpack(out)
        fn((1,), (256,), (cx, co, n), stream=rt.stream())

    def encode():
        rawkv.fp8.e4m3_encode(x, out=out)

    import rawkv.library  # noqa: F401  (registers torch.ops.rawkv.*)
    custom_op = torch.ops.rawkv.e4m3_encode.default

    xp, op = x.data_ptr(), out.data_ptr()
    fns = {"rawkv": encode, "add_": lambda: x.add_(y),
           "custom_op": lambda: custom_op(x, out),
           # the floor under rawkv's own Python: the bare CuPy launch with fixed args
           "bare_cupy": lambda: fn((1,), (256,), (xp, op, n), shared_mem=0, stream=s),
           "empty": lambda: torch.empty(n, device="cuda")}
    drv = cupy.cuda.driver.launchKernel
    inst = kernels.fp8.ENCODE.instance("float32", True)
    launcher = _launch.Launcher()
    launcher(fn, (1,), (256,), inst.struct, (xp, op, n), 0, s.ptr)   # builds its slots
    slots = launcher._tls.slots
    sp = s.ptr
    # the floor of the launcher: the raw call alone, parameters already in place
    fns["bare_cupy_driver"] = lambda: drv(fn.ptr, 1, 1, 1, 256, 1, 1, 0, sp, slots[1], 0)
    rounds = 5 if quick else 9
    t = host_us_interleaved(fns, calls, rounds)
    dl_us = host_us_interleaved({"dl": dlpack_launch}, calls // 4, 3)["dl"][0]
    med = {k: v[0] for k, v in t.items()}
    rawkv_us, add_us = med["rawkv"], med["add_"]
    row = {"op": "launch_overhead/e4m3_encode", "shape": [n], "dtype": "float32",
           "launcher": launcher.name, "host_us": round(rawkv_us, 2),
           "torch_add_us": round(add_us, 2),
           "ratio_vs_add": round(rawkv_us / add_us, 2),
           "custom_op_us": round(med["custom_op"], 2),
           "custom_op_ratio_vs_add": round(med["custom_op"] / add_us, 2),
           "baseline": "cupy.from_dlpack per tensor per call", "baseline_us": round(dl_us, 2),
           "speedup": round(dl_us / rawkv_us, 2),
           "bare_cupy_launch_us": round(med["bare_cupy"], 2), "torch_empty_us": round(med["empty"], 2),
           "timing": f"median of {rounds} interleaved rounds of {calls} calls",
           "ratio_vs_add_min": round(t["rawkv"][1] / t["add_"][1], 2),
           "bare_cupy_driver_launch_us": round(med["bare_cupy_driver"], 2)}
    results.append(row)
    # E4M3 encode / decode bandwidth on a large tensor.
    m = 1 << 28
    xb = torch.randn(m, device="cuda", dtype=torch.bfloat16)
    cb = torch.empty(m, dtype=torch.uint8, device="cuda")
    yb = torch.empty(m, dtype=torch.bfloat16, device="cuda")
    us = cuda_time_us(lambda i: rawkv.fp8.e4m3_encode(xb, out=cb), reps=20)
    base = cuda_time_us(lambda i: cb.copy_(xb.to(torch.float8_e4m3fn).view(torch.uint8)), reps=20)
    results.append(entry("e4m3_encode", [m], "bfloat16", us, 3 * m, COPY["GBps"],
                         "torch .to(float8_e4m3fn) + copy", base))
    us = cuda_time_us(lambda i: rawkv.fp8.e4m3_decode(cb, out=yb), reps=20)
    base = cuda_time_us(lambda i: yb.copy_(cb.view(torch.float8_e4m3fn).to(torch.bfloat16)), reps=20)
    results.append(entry("e4m3_decode", [m], "bfloat16", us, 3 * m, COPY["GBps"],
                         "torch .to(bfloat16) + copy", base))
    del xb, cb, yb
    # Decode sizes (M rows of 7168) as graph replays, against issue 14's latency floor.
    for rows in (1, 8, 64):
        m = rows * 7168
        xb = torch.randn(m, device="cuda", dtype=torch.bfloat16)
        cb = rawkv.fp8.e4m3_encode(xb)
        yb = torch.empty_like(xb)
        for op, fn in (("e4m3_encode", lambda: rawkv.fp8.e4m3_encode(xb, out=cb)),
                       ("e4m3_decode", lambda: rawkv.fp8.e4m3_decode(cb, out=yb))):
            lat = latency(fn, 3 * m)
            results.append(entry(f"{op}/graph", [rows, 7168], "bfloat16", lat["device_us"], 3 * m,
                                 COPY["GBps"], **lat))

