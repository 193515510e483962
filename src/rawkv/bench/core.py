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
    _gemm_host(results, torch, rawkv, calls // 2, 5 if quick else 9, fns["add_"])
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


def _gemm_host(results, torch, rawkv, calls, rounds, add_):
    """Host us per call of the W4A16 GEMM ops on small weights (kernels of a
    few us, so the host is what is timed): the fast path a repeated call
    takes (rawkv.gemm.fast), the checked path (a stream= argument takes it
    on every call) and torch's BF16 einsum / add_ beside them, interleaved."""
    import numpy as np
    rng = np.random.default_rng(0)

    def weight(g, n, k):
        codes = torch.from_numpy(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8))
        scales = torch.from_numpy(rng.integers(0x20, 0x50, (g, n, k // 16), dtype=np.uint8))
        return rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, torch.full((g,), 1e-3), groups=g).to("cuda")

    s = torch.cuda.current_stream()
    g, n, k = 8, 256, 256
    w = weight(g, n, k)
    wb = torch.randn(g, n, k, dtype=torch.bfloat16, device="cuda")
    cases = []
    for m, path in ((1, "mma.sync"), (256, "wgmma" if rawkv.get_runtime(0).arch == "sm_90" else "mma.sync")):
        x = torch.randn(m, g, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(m, g, n, dtype=torch.bfloat16, device="cuda")
        cases.append((f"gemm_grouped_linear/{path}", [m, g, n, k],
                      lambda x=x, out=out: rawkv.gemm.grouped_linear(x, w, out=out),
                      lambda x=x, out=out: rawkv.gemm.grouped_linear(x, w, out=out, stream=s),
                      lambda x=x: torch.einsum("tgk,gnk->tgn", x, wb)))
    e, rows = 16, 6
    wm = weight(e, n, k)
    offsets = torch.tensor([0] * 10 + [1, 2, 3, 4, 5, 6, 6], dtype=torch.int32, device="cuda")
    xm = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    om = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    cases.append(("gemm_moe_linear/mma.sync", [rows, e, n, k],
                  lambda: rawkv.gemm.moe_linear(xm, wm, offsets, out=om),
                  lambda: rawkv.gemm.moe_linear(xm, wm, offsets, out=om, stream=s), None))
    for name, shape, fast, checked, einsum in cases:
        fns = {"fast": fast, "checked": checked, "add_": add_}
        if einsum is not None:
            fns["einsum"] = einsum
        med = {kk: v[0] for kk, v in host_us_interleaved(fns, calls, rounds).items()}
        row = {"op": f"launch_overhead/{name}", "shape": shape, "dtype": "bfloat16",
               "host_us": round(med["fast"], 2), "checked_path_us": round(med["checked"], 2),
               "torch_add_us": round(med["add_"], 2), "ratio_vs_add": round(med["fast"] / med["add_"], 2),
               "baseline": "the checked path (stream= given)", "baseline_us": round(med["checked"], 2),
               "speedup": round(med["checked"] / med["fast"], 2),
               "timing": f"median of {rounds} interleaved rounds of {calls} calls"}
        if einsum is not None:
            row["torch_einsum_bf16_us"] = round(med["einsum"], 2)
        results.append(row)
        print(f"{row['op']} {shape}: {row['host_us']} us host (checked path {row['checked_path_us']}, "
              f"torch add_ {row['torch_add_us']}"
              + (f", einsum {row['torch_einsum_bf16_us']}" if einsum is not None else "") + ")", flush=True)
