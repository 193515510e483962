"""Grouped FP4 GEMM benchmarks (issues 11 and 20): DeepSeek-V4 wo_a (batched)
at the Flash, Pro and seed-004 shapes, and the DeepSeek-V4-Flash and -Pro MoE
experts (ragged), beside torch's BF16 einsum / grouped matmul, FP8 _scaled_mm
and the peer, humming-kernels, timed in the same run.

Every row: us (rawkv), baseline_us (torch BF16), floor_us (the bytes that must
move: E2M1 codes, block scales, activations, output; for MoE only the experts
the tokens touch, at the copy bandwidth of the same run), frac_of_floor,
TFLOPs, and peer / peer_us (null when humming is not installed); the wo_a rows
also read_us, a plain streaming read of the same weight bytes timed the same
way (read_weight_us: what any kernel that streams them takes at this size,
launch, ramp and tail included) and frac_of_read = read_us / us. Weights
rotate over several copies when they would fit in L2, for rawkv and the peer
alike (MoE: when one token's experts would, moe_sets; the row's weight_sets);
every op is timed by bench.warm_cuda_time_us (CUDA-graph replays, the GPU kept
busy after a pause: timing.keep_warm), and the timings a row compares (rawkv,
its W4A8 form, torch's baseline, each of the peer's modes) twice in
alternation, each keeping its fastest (gemm_peer.best_of). The
weights are random NVFP4 checkpoint bytes in ModelOpt's form; rawkv gets them
through its loader (Fp4Weight.from_nvfp4), humming through its own. The
peer, what of it is called, how its output is checked and its W4A8 mode:
rawkv.bench.gemm_peer.

plot(results, path) draws time against M per shape (rawkv, humming, both
W4A8 rows, torch BF16, the floor; log axes) when matplotlib is importable
(rawkv.bench.gemm_plot); rawkv.bench.cli calls it beside the JSON.

Entry points: run(rt, results, quick=False, peers=False) and plot(results,
path) (called by rawkv.bench.cli)."""
from __future__ import annotations

from . import gemm_plot
from .gemm_peer import (MOE_MODES, PEER_PACKAGE, Humming, indexed_layout, mxfp4_checkpoint, mxfp4_values, peer_build,
                        peer_text, timed_row, w4a8_reference)

WO_A = {"flash": (8, 4096, 1024), "pro": (16, 4096, 1024), "seed004": (8, 8192, 1536)}
WO_A_MS, WO_A_MS_QUICK = (1, 8, 16, 64, 128, 512, 2048, 4096), (1, 16, 4096)
#: model -> (experts, experts per token, {layer: (N, K) per expert})
MOE = {"flash": (256, 6, {"gate_up": (4096, 4096), "down": (4096, 2048)}),
       "pro": (384, 8, {"gate_up": (2 * 3072, 7168), "down": (7168, 3072)})}
MOE_TOKENS, MOE_TOKENS_QUICK = (1, 16, 64, 256, 4096), (1, 4096)
MODEL = {"flash": "DeepSeek-V4-Flash", "pro": "DeepSeek-V4-Pro", "seed004": "seed 004"}

#: The MoE rows' weight copies: as many as rotation() asks for the experts one
#: token reads (top_k of them), at most MOE_MAX_SETS and as many as fit
#: MOE_SET_BYTES (each kind of weight: rawkv's, W4A8's, the peer's).
MOE_MAX_SETS = 4
MOE_SET_BYTES = 8 << 30

#: the peers --peer adds (rawkv.bench.cli passes peers= to a group that names some)
PEERS = (PEER_PACKAGE,)
#: bytes of codes packed per rawkv loader call (its temporaries are a few
#: times this; a 384-expert weight at once would not fit beside the rest)
PACK_CHUNK = 1 << 30


# ---- a plain read of the weight bytes -------------------------------------------
# Each thread streams 16-byte words past L1 (__ldcs), four independent loads a
# step; a word is stored only on an impossible value, so no load is dropped.
READ_SRC = r"""
extern "C" __global__ void rkv_bench_read(const uint4* __restrict__ p, long long n16, unsigned* out) {
    unsigned acc = 0;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long st = (long long)gridDim.x * blockDim.x;
    for (; i + 3 * st < n16; i += 4 * st) {
        const uint4 a = __ldcs(p + i), b = __ldcs(p + i + st), c = __ldcs(p + i + 2 * st), d = __ldcs(p + i + 3 * st);
        acc ^= a.x ^ a.w ^ b.x ^ b.y ^ c.y ^ c.z ^ d.z ^ d.w;
    }
    for (; i < n16; i += st) {
        const uint4 a = __ldcs(p + i);
        acc ^= a.x ^ a.w;
    }
    if (acc == 0x9E3779B9u) out[0] = acc;
}
"""
#: (blocks per SM, threads per block) of the read; read_weight_us keeps the
#: faster (H100, 18.9 / 37.7 / 56.6 MB: 7.55 / 13.79 / 19.59 us and 7.90 /
#: 13.70 / 20.08; 8 x 256 and 2 x 1024 were no faster).
READ_GRIDS = ((4, 512), (16, 256))


def read_weight_us(torch, nbytes: int, sets: int, sm_count: int, time_us) -> float:
    """Device time of a plain streaming read of `nbytes` (whole 16-byte words),
    rotating over `sets` buffers as the op's weights rotate, timed by
    `time_us(fn)` as the op is: the least time any kernel that streams those
    bytes takes at this size (launch, ramp and tail included), which the
    floor at copy bandwidth does not count."""
    import cupy
    kernel = cupy.RawKernel(READ_SRC, "rkv_bench_read")
    n16 = nbytes // 16
    bufs = [torch.randint(0, 256, (n16 * 16,), dtype=torch.uint8, device="cuda") for _ in range(sets)]
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    best = float("inf")
    for per_sm, threads in READ_GRIDS:
        def call(i, blocks=per_sm * sm_count, threads=threads):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            kernel((blocks,), (threads,), (bufs[i % sets].data_ptr(), n16, sink.data_ptr()), stream=stream)
        best = min(best, time_us(call))
    return best


# ---- weights -------------------------------------------------------------------
def _checkpoint(torch, g, n, k, dev):
    """Random NVFP4 checkpoint bytes in ModelOpt's form: codes (G, N, K/2)
    uint8, E4M3 block-scale bytes (G, N, K/16) in [0x20, 0x50) (1/8 .. 15),
    global scales (G,) float32."""
    codes = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8, device=dev)
    scales = torch.randint(0x20, 0x50, (g, n, k // 16), dtype=torch.uint8, device=dev)
    return codes, scales, torch.full((g,), 1e-3, device=dev)


def _rawkv_weight(torch, codes, scales, gs):
    """rawkv's Fp4Weight of the checkpoint bytes through its loader
    (from_nvfp4), packed PACK_CHUNK bytes of codes at a time."""
    from rawkv.gemm import Fp4Weight
    step = max(1, PACK_CHUNK // max(1, codes[0].numel()))
    parts = [Fp4Weight.from_nvfp4(codes[a:a + step], scales[a:a + step], gs[a:a + step])
             for a in range(0, codes.shape[0], step)]
    if len(parts) == 1:
        return parts[0]
    p = parts[0]
    return Fp4Weight("nvfp4", p.n, p.k, torch.cat([q.codes for q in parts]),
                     torch.cat([q.scales for q in parts]), torch.cat([q.gs for q in parts]))


def _w4a8_weight(torch, g, n, k, dev):
    """A W4A8 form of random bytes for timing (rawkv.gemm.W4a8Weight: packed
    codes, block shifts from the range where the kernel computes its tables,
    rows' powers of two 1): the kernel's time does not depend on the values,
    and the host rule of w4a8_weight on a 384-expert weight would take
    minutes."""
    from rawkv.gemm import W4a8Weight
    from rawkv.reference import gemm_w4a8 as W
    npad, chunks = W.padded8(n, k)
    tiles = npad // 16
    codes = torch.randint(0, 256, (g, tiles, chunks, W.PLANES, 32, W.LANE_BYTES // W.PLANES), dtype=torch.uint8,
                          device=dev)
    shifts = torch.randint(W.SHIFT_BIAS - 5, W.SHIFT_BIAS + 6, (g, tiles, chunks, 8, W.SHIFT_BYTES),
                           dtype=torch.uint8, device=dev)
    return W4a8Weight(n, k, codes, shifts, torch.ones(g, npad, device=dev), torch.ones(g, device=dev))


def _w4a8_fields(us, us_w4a16: float, flops: int) -> dict:
    """w4a8_us (rawkv's W4A8 GEMM on FP8 block activations), its TFLOP/s and
    its speedup over the W4A16 row; or, `us` a string, why it was not timed."""
    if isinstance(us, str):
        return {"w4a8_us": f"unavailable: {us[:100]}"}
    return {"w4a8_us": round(us, 2), "w4a8_TFLOPs": round(flops / us / 1e6, 1),
            "w4a8_speedup": round(us_w4a16 / us, 2)}


def _w4a8_text(row: dict) -> str:
    us = row.get("w4a8_us")
    if us is None:
        return ""
    text = f"; w4a8 {us:.1f} us (x{row['w4a8_speedup']})" if isinstance(us, float) else f"; w4a8 {us}"
    if row.get("w4a8_peer_us") is not None:
        text += f", {row['w4a8_peer']} {row['w4a8_peer_us']:.1f} us (err {row['w4a8_peer_rel_err']})"
    elif row.get("w4a8_peer") is not None:
        text += f", peer's W4A8 failed ({row.get('w4a8_peer_error')})"
    return text


# ---- wo_a ----------------------------------------------------------------------
def _wo_a_peer(peer, ckpt, g):
    """humming's weights of one wo_a set: dense (one per group) and grouped."""
    codes, scales, gs = ckpt
    dense = [peer.weight(codes[i], scales[i], gs[i:i + 1], 0) for i in range(g)]
    return {"dense": dense, "grouped_contiguous": peer.weight(codes, scales, gs, g)}


def _wo_a_calls(peer, torch, hw, x, n, locks, why=None, quant=False):
    """{mode: (fn(i), result())} for x (M, G, K) and the weight sets hw:
    activations in humming's (G, M, K) layout, its output (G, M, N) returned
    as rawkv's (M, G, N). why: the weights' failure, raised here. quant: the
    W4A8 mode's weights (weight8), the activations quantized by humming
    (quant_input) here, outside the timed calls, as rawkv's W4A8 row times
    its GEMM on activations a producer wrote."""
    if hw is None:
        raise RuntimeError(f"no weights ({why})")
    m, g = x.shape[0], x.shape[1]
    sets = len(hw)
    xg = x.transpose(0, 1).contiguous()
    od, og = (torch.full((g, m, n), float("nan"), device=x.device, dtype=torch.bfloat16) for _ in range(2))
    cfg_d = hw[0]["dense"][0][0]
    cfg_g = hw[0]["grouped_contiguous"][0]
    iv_d = peer.intervals(cfg_d, "dense", [m])
    iv_g = peer.intervals(cfg_g, "grouped_contiguous", [g * m])
    layout = torch.arange(g + 1, dtype=torch.int32, device=x.device) * m
    xd, xr = [(xg[j], None) for j in range(g)], (xg.view(g * m, -1), None)
    if quant:
        xd, xr = [peer.quant_input(cfg_d, a) for a, _ in xd], peer.quant_input(cfg_g, xr[0])

    def dense(i):
        for j, (cfg, t) in enumerate(hw[i % sets]["dense"]):
            peer.gemm(cfg, t, xd[j][0], od[j], "dense", iv_d, locks, input_scale=xd[j][1])

    def grouped(i):
        cfg, t = hw[i % sets]["grouped_contiguous"]
        peer.gemm(cfg, t, xr[0], og.view(g * m, n), "grouped_contiguous", iv_g, locks, input_scale=xr[1],
                  expert_layout=layout)
    return {"dense": (dense, lambda: od.transpose(0, 1)), "grouped_contiguous": (grouped, lambda: og.transpose(0, 1))}


def _wo_a_jobs(peer, ms, w4a8: bool = False):
    jobs = []
    for g, k, n in WO_A.values():
        for w8 in (False, True) if w4a8 else (False,):
            jobs += peer.jobs(peer.layer_config(n, k, 0, w8), "dense", ms)
            jobs += peer.jobs(peer.layer_config(n, k, g, w8), "grouped_contiguous", [g * m for m in ms])
    return jobs


def _wo_a_peer8(peer, ckpt, g):
    """humming's W4A8-mode weights of one wo_a set: dense (one per group) and grouped."""
    codes, scales = ckpt
    return {"dense": [peer.weight8(codes[i], scales[i], 0) for i in range(g)],
            "grouped_contiguous": peer.weight8(codes, scales, g)}


def _fp8_loop(torch, x, w8, scale):
    """wo_a as G FP8 GEMMs (torch._scaled_mm, per-tensor scales)."""
    return [torch._scaled_mm(x[:, g], w8[g].t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
            for g in range(w8.shape[0])]


def _wo_a(rt, results, peer, quick, reps, copy):
    import torch
    import rawkv
    from .timing import entry, rotation, warm_cuda_time_us as cuda_time_us
    dev = "cuda"
    ms = WO_A_MS_QUICK if quick else WO_A_MS
    for name, (g, k, n) in WO_A.items():
        wbytes = g * n * k // 2 + g * n * k // 16
        sets = min(8, rotation(wbytes, rt.l2_bytes))
        ckpts = [_checkpoint(torch, g, n, k, dev) for _ in range(sets)]
        ws = [_rawkv_weight(torch, *c) for c in ckpts]
        hw, why = peer_build(peer, lambda: [_wo_a_peer(peer, c, g) for c in ckpts])
        ckpts = None
        locks = peer.locks() if peer else None
        read_us = round(read_weight_us(torch, wbytes, sets, rt.sm_count, lambda f: cuda_time_us(f, reps=reps)), 2)
        wb = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16)
        w8 = wb.to(torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None
        w8s = [_w4a8_weight(torch, g, n, k, dev) for _ in range(sets)] if rt.arch == "sm_90" else None
        ck8 = [mxfp4_checkpoint(torch, g, n, k, dev) for _ in range(sets)] if peer and peer.has_w4a8 and w8s else None
        hw8, why8 = peer_build(peer if ck8 else None, lambda: [_wo_a_peer8(peer, c, g) for c in ck8])
        w8ref = mxfp4_values(torch, *ck8[0]) if ck8 else None   # (the reference's weights: set 0's)
        ck8 = None
        for m in ms:
            x = torch.randn(m, g, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, g, n, device=dev, dtype=torch.bfloat16)
            flops = 2 * m * g * n * k
            timers = {"rawkv": lambda: cuda_time_us(
                          lambda i: rawkv.gemm.grouped_linear(x, ws[i % sets], out=out), reps=reps),
                      "baseline": lambda: cuda_time_us(lambda i: torch.einsum("sgd,grd->sgr", x, wb), reps=reps)}
            if w8s is not None:
                xa = rawkv.fp8.quantize_blocks(x)
                timers["w4a8"] = lambda: cuda_time_us(
                    lambda i: rawkv.gemm.grouped_linear(xa, w8s[i % sets], out=out), reps=reps)
            ref = rawkv.gemm.grouped_linear(x, ws[0]) if peer else None
            w4a8 = None
            if w8ref is not None:
                w4a8 = (lambda: _wo_a_calls(peer, torch, hw8, x, n, locks, why8, quant=True),
                        w4a8_reference(torch, rawkv, x, w8ref))
            best, failed, peer_row = timed_row(
                timers, peer, lambda: _wo_a_calls(peer, torch, hw, x, n, locks, why), ref, reps, flops, w4a8)
            if "baseline" in failed:
                raise RuntimeError(f"torch's einsum timing failed: {failed['baseline']}")
            us, base = best["rawkv"], best["baseline"]
            nbytes = wbytes + m * g * k * 2 + m * g * n * 2
            extra = {"model": MODEL[name], "floor_us": round(nbytes / copy / 1e3, 2),
                     "TFLOPs": round(flops / us / 1e6, 1), "baseline_TFLOPs": round(flops / base / 1e6, 1)}
            extra["frac_of_floor"] = round(extra["floor_us"] / us, 3)
            extra["read_us"], extra["frac_of_read"] = read_us, round(read_us / us, 3)
            if w8 is not None and m % 16 == 0:
                try:
                    x8 = x.to(torch.float8_e4m3fn)
                    one = torch.ones((), device=dev)
                    extra["fp8_scaled_mm_us"] = round(cuda_time_us(lambda i: _fp8_loop(torch, x8, w8, one),
                                                                   reps=reps), 2)
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    extra["fp8_scaled_mm_us"] = f"unavailable: {type(exc).__name__}"
            if w8s is not None:
                extra.update(_w4a8_fields(best.get("w4a8", failed.get("w4a8")), us, flops))
            extra.update(peer_row)
            row = entry(f"grouped_linear/wo_a-{name}", (m, g, k, n), "nvfp4xbf16", us, nbytes, copy,
                        baseline="torch-einsum-bf16", baseline_us=base, **extra)
            results.append(row)
            print(f"[gemm] wo_a {name} M={m}: {us:.1f} us ({extra['frac_of_floor']:.0%} of floor "
                  f"{extra['floor_us']} us, {extra['TFLOPs']} TFLOP/s; weight read {read_us} us); einsum {base:.1f} us"
                  + peer_text(row) + _w4a8_text(row), flush=True)
        ws = wb = w8 = w8s = hw = hw8 = w8ref = None  # free before the next shape
        torch.cuda.empty_cache()


# ---- MoE -----------------------------------------------------------------------
def _routing(torch, gen, experts, top_k, tokens):
    """Random top-k routing: (counts per expert, int32 offsets (E+1,))."""
    choice = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    counts = torch.bincount(choice.reshape(-1), minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    return counts, offsets


def moe_sets(experts: int, top_k: int, n: int, k: int, l2_bytes: int) -> int:
    """How many copies of an MoE weight the rows rotate over (MOE_MAX_SETS,
    MOE_SET_BYTES): at one token the experts read may fit in L2, and
    back-to-back calls on one copy would read them from there."""
    from .timing import rotation
    per_expert = n * k // 2 + n * k // 16
    fit = max(1, MOE_SET_BYTES // max(1, experts * per_expert))
    return max(1, min(MOE_MAX_SETS, fit, rotation(top_k * per_expert, l2_bytes)))


def _moe_calls(peer, torch, hw, x, out_n, offs, rows, why=None):
    """{mode: (fn(i), result())} for one batch of sorted rows; hw: the
    peer's weight copies, call i using copy i % len(hw). why: the weights'
    failure, raised here."""
    if hw is None:
        raise RuntimeError(f"no weights ({why})")
    cfg, _ = hw[0]
    oc, oi = (torch.full((rows, out_n), float("nan"), device=x.device, dtype=torch.bfloat16) for _ in range(2))
    locks = peer.locks()
    iv_c = peer.intervals(cfg, "grouped_contiguous", [rows])
    iv_i = peer.intervals(cfg, "indexed", [rows])
    sorted_ids, expert_ids, padded = indexed_layout(torch, offs, int(iv_i[0][2]["block_shape"][0]))

    def contiguous(i):
        c, t = hw[i % len(hw)]
        peer.gemm(c, t, x, oc, "grouped_contiguous", iv_c, locks, expert_layout=offs)

    def indexed(i):
        c, t = hw[i % len(hw)]
        peer.gemm(c, t, x, oi, "indexed", iv_i, locks, sorted_ids=sorted_ids, expert_ids=expert_ids,
                  num_tokens_padded=padded)
    return {"grouped_contiguous": (contiguous, lambda: oc), "indexed": (indexed, lambda: oi)}


def _moe_jobs(peer, tokens):
    jobs = []
    for experts, top_k, layers in MOE.values():
        for n, k in layers.values():
            cfg = peer.layer_config(n, k, experts)
            for mode in MOE_MODES:
                jobs += peer.jobs(cfg, mode, [t * top_k for t in tokens])
    return jobs


def _moe(rt, results, peer, quick, reps, copy):
    import torch
    import rawkv
    from .timing import entry, warm_cuda_time_us as cuda_time_us
    dev = "cuda"
    tokens_list = MOE_TOKENS_QUICK if quick else MOE_TOKENS
    gen = torch.Generator().manual_seed(0)
    for model, (experts, top_k, layers) in MOE.items():
        for name, (n, k) in layers.items():
            sets = moe_sets(experts, top_k, n, k, rt.l2_bytes)
            ckpts = [_checkpoint(torch, experts, n, k, dev) for _ in range(sets)]
            ws = [_rawkv_weight(torch, *c) for c in ckpts]
            w8s = [_w4a8_weight(torch, experts, n, k, dev) for _ in range(sets)] if rt.arch == "sm_90" else None
            hw, why = peer_build(peer, lambda: [peer.weight(*c, experts) for c in ckpts])
            ckpts = None
            torch.cuda.empty_cache()
            wb = None
            for tokens in tokens_list:
                counts, offsets = _routing(torch, gen, experts, top_k, tokens)
                rows = tokens * top_k
                offs = offsets.to(dev)
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
                flops = 2 * rows * n * k
                timers = {"rawkv": lambda: cuda_time_us(
                    lambda i: rawkv.gemm.moe_linear(x, ws[i % sets], offs, out=out), reps=reps)}
                base_error = None
                if hasattr(torch, "_grouped_mm"):
                    try:
                        if wb is None:
                            wb = torch.randn(experts, k, n, device=dev, dtype=torch.bfloat16)
                        ends = offs[1:].contiguous()
                        timers["baseline"] = lambda: cuda_time_us(lambda i: torch._grouped_mm(x, wb, offs=ends),
                                                                  reps=reps)
                    except Exception as exc:  # noqa: BLE001 - reported, not fatal
                        base_error = f"{type(exc).__name__}: {str(exc)[:80]}"
                if w8s is not None:
                    xa = rawkv.fp8.quantize_blocks(x)
                    timers["w4a8"] = lambda: cuda_time_us(
                        lambda i: rawkv.gemm.moe_linear(xa, w8s[i % sets], offs, out=out), reps=reps)
                ref = rawkv.gemm.moe_linear(x, ws[0], offs) if peer else None
                best, failed, peer_row = timed_row(
                    timers, peer, lambda: _moe_calls(peer, torch, hw, x, n, offs, rows, why), ref, reps, flops)
                us, base = best["rawkv"], best.get("baseline")
                touched = int((counts > 0).sum())
                nbytes = touched * (n * k // 2 + n * k // 16) + rows * (k + n) * 2
                extra = {"model": MODEL[model], "floor_us": round(nbytes / copy / 1e3, 2),
                         "TFLOPs": round(flops / us / 1e6, 1), "experts_touched": touched, "weight_sets": sets}
                extra["frac_of_floor"] = round(extra["floor_us"] / us, 3)
                if base is not None:
                    extra["baseline_TFLOPs"] = round(flops / base / 1e6, 1)
                elif base_error or "baseline" in failed:
                    extra["baseline_error"] = (base_error or failed["baseline"])[:100]
                if w8s is not None:
                    extra.update(_w4a8_fields(best.get("w4a8", failed.get("w4a8")), us, flops))
                extra.update(peer_row)
                row = entry(f"moe_linear/{name}", (tokens, experts, top_k, k, n), "nvfp4xbf16", us, nbytes, copy,
                            **({"baseline": "torch-grouped_mm-bf16", "baseline_us": base} if base else {}),
                            **extra)
                row.setdefault("baseline_us", None)
                results.append(row)
                print(f"[gemm] moe {model} {name} tokens={tokens}: {us:.1f} us ({extra['frac_of_floor']:.0%} of "
                      f"floor {extra['floor_us']} us, {extra['TFLOPs']} TFLOP/s); grouped_mm "
                      f"{'-' if base is None else f'{base:.1f} us'}" + peer_text(row) + _w4a8_text(row), flush=True)
            ws = wb = w8s = hw = None
            torch.cuda.empty_cache()


def run(rt, results, quick=False, peers=False):
    """The wo_a and MoE rows; peers: time humming beside rawkv when it is
    installed (without it, or with peers False, every row has peer: null)."""
    import torch
    from .timing import copy_GBps
    # the run's copy bandwidth (timing.COPY, measured once by the driver and
    # written as the JSON's copy_GBps): the floor and frac_of_copy are taken
    # of the figure the file records, as every other group's fractions are
    copy = copy_GBps()
    reps = 10 if quick else 40
    peer = Humming.load(torch, "cuda") if peers else None
    if peer:
        peer.prepare(_wo_a_jobs(peer, WO_A_MS_QUICK if quick else WO_A_MS, w4a8=rt.arch == "sm_90" and peer.has_w4a8)
                     + _moe_jobs(peer, MOE_TOKENS_QUICK if quick else MOE_TOKENS))
    _wo_a(rt, results, peer, quick, reps, copy)
    _moe(rt, results, peer, quick, reps, copy)


#: The group's figure (rawkv.bench.cli draws it beside the JSON).
plot = gemm_plot.plot
