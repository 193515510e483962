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
its W4A8 form, torch's baseline, each of the peer's modes) ROUNDS times in
alternation, each keeping its fastest (best_of). The
weights are random NVFP4 checkpoint bytes in ModelOpt's form; rawkv gets them
through its loader (Fp4Weight.from_nvfp4), humming through its own.

The peer: humming-kernels 0.1.19 (the vLLM project's JIT W4A16 / FP4 GEMM
library; `pip install rawkv[bench]`; it compiles its kernels with NVRTC at run
time). Optional: timed only with --peer (run(..., peers=True)) and when
installed; otherwise every row has peer: null and the run goes on.
What is called, in humming's own modules:

* Weights, the steps HummingLayer.transform takes for a layer of
  weight_config {"quant_method": "modelopt", "quant_algo": "nvfp4"} and BF16
  activations: schema.modelopt.ModeloptNvfp4WeightSchema().convert_humming
  on {"weight": codes (G, N, K/2) uint8 (element 2j in the low nibble, read
  as int32 words: humming's packing), "weight_scale": the E4M3 block scales
  (G, N, K/16), "weight_scale_2": the per-group float32 global scale (G,)},
  then transform.prepare_layer_config (input schema
  HummingInputSchema(a_dtype=bfloat16)), transform.prepare_fp16_e8m0_scale (a
  no-op for E4M3 scales and BF16 output) and transform.transform_humming_tensors
  (codes repacked into its tile layout, scales permuted). The same bytes rawkv
  packs: the per-row check below compares the two outputs.
* The GEMM: forward.humming_forward (what HummingLayer.forward calls), BF16
  activations, output preallocated, a zeroed int32 locks buffer for Stream-K,
  compute_config {"gemm_type": mode}. Modes: wo_a "dense" (G calls, group g
  one (M, K) x (N, K) GEMM) and "grouped_contiguous" (one call over G experts
  of M rows each, expert_layout = the int32 offsets g * M); MoE
  "grouped_contiguous" (the rows sorted by expert, as rawkv.gemm.moe_linear
  takes them, expert_layout = the same int32 offsets) and "indexed" (vLLM's
  fused-MoE form over the same sorted rows with top_k = 1: sorted_ids padded
  per expert to the kernel's block M with the id R, expert_ids per block).
* Tuning: humming's default heuristics. tune.get_heuristics_config(layer,
  gemm_type=mode) lists M intervals with one tuning config each (on sm_90 a
  WGMMA or MMA kernel, mostly Stream-K: a tile's first K slice stores its
  BF16 output, later slices add theirs into it), and the launcher runs the
  config whose interval holds the call's rows. The bench passes only the
  intervals that hold its Ms (so exactly the default's choice at each M, and
  only those kernels are built), compiled in parallel before any timing
  (kernel.humming.HummingKernel.prepare_kernels, one kernel a job).
* Fastest mode: no mode wins everywhere (dense launches G kernels, each
  sized for M rows; grouped launches one, sized for the rows per expert;
  indexed gathers rows through sorted_ids and skips TMA loads), so each is
  timed and peer_us is the faster; peer_mode names it and peer_modes_us holds
  all. Activations are handed over in humming's layout ((G, M, K) contiguous
  for wo_a, a transpose of rawkv's (M, G, K) made outside the timed region),
  which can only flatter the peer.
* Its W4A8 mode (wo_a rows, sm_90; issue 23), beside rawkv's W4A8 row:
  schema.mxfp4.Mxfp4WeightSchema on random MXFP4 checkpoints (E2M1 codes, E8M0
  scales per 32 columns) and HummingInputSchema(a_dtype=float8e4m3,
  input_scale_group_size=128, input_scale_dtype=float32,
  input_quant_mode="dynamic_group") (E4M3 activations, a float32 scale per
  token per 128 columns: DeepSeek's recipe), the same modes; the activations
  quantized by forward.may_quant_input outside the timed calls, so its
  w4a8_peer_us, like rawkv's w4a8_us, is the GEMM on FP8 activations already
  written. Checked against w4a8_reference (the float32 product of the
  dequantized weights and rawkv's FP8 block activations of the same input).
  Fields: w4a8_peer, w4a8_peer_us, w4a8_peer_mode, w4a8_peer_modes_us,
  w4a8_peer_rel_err, w4a8_peer_error.
* Check: before a mode is timed at a (shape, M), its output is compared with
  rawkv's for the same inputs (relative Frobenius error, peer_rel_err); above
  PEER_TOL the mode is reported in peer_error instead of timed, so a wrong
  integration shows up instead of a fast wrong number.

plot(results, path) draws time against M per shape (rawkv, humming, torch
BF16, the floor; log axes) when matplotlib is importable; rawkv.bench.cli
calls it beside the JSON.

Entry points: run(rt, results, quick=False, peers=False) and plot(results,
path) (called by rawkv.bench.cli)."""
from __future__ import annotations

import json
import time

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

PEER_PACKAGE = "humming-kernels"
#: the peers --peer adds (rawkv.bench.cli passes peers= to a group that names some)
PEERS = (PEER_PACKAGE,)
MOE_MODES = ("grouped_contiguous", "indexed")
#: relative Frobenius error against rawkv's output above which a peer mode
#: counts as wrong (rawkv rounds one FP32 sum to BF16, ~0.2%; humming's
#: Stream-K adds BF16 partial sums, a little more; a wrong layout or scale
#: gives ~100%)
PEER_TOL = 0.02
#: Stream-K lock words (HummingLayer keeps 2048; the launcher checks the need)
PEER_LOCKS = 1 << 14
#: How many times each timing a row compares is taken, in alternation (rawkv,
#: W4A8, baseline, the peer's modes, then again), keeping each one's fastest:
#: a single timing of each, rawkv's first, compared states of the GPU as well
#: as kernels. H100 (2026-11-27, .probe sweep): the one-token Pro gate_up call
#: measured 85.3 us, then 73.0 us seconds later on the same weights, routing
#: and tile (and 73-75 us on four other routings and a second allocation).
ROUNDS = 2
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


# ---- the peer ------------------------------------------------------------------
def _interval(intervals, rows: int):
    """The [lo, hi, config] of humming's heuristic list that its launcher
    picks for `rows` (lo < rows <= hi)."""
    for iv in intervals:
        if iv[0] < rows <= iv[1]:
            return iv
    raise ValueError(f"rows: {rows} lies in none of the heuristic intervals")


def _pick_intervals(intervals, rows) -> list:
    """The intervals of humming's heuristic list that hold `rows`, each once,
    in order, as [lo, hi, config copy]; the first reaches down to 0, because
    its launcher first looks up the config of one row (to read the GEMM type)
    and refuses a list that has none. No other row's choice changes."""
    picked = {id(iv): iv for iv in (_interval(intervals, r) for r in rows)}
    out = [[lo, hi, dict(c)] for lo, hi, c in sorted(picked.values(), key=lambda iv: iv[0])]
    if out:
        out[0][0] = 0
    return out


def _indexed_layout(torch, offsets, block: int):
    """humming's indexed-GEMM routing (vLLM's moe_align_block_size) for rows
    already sorted by expert, top_k = 1: sorted_ids int32, each expert's rows
    offsets[e] .. offsets[e+1]-1 padded to a multiple of `block` with the id
    R = offsets[-1]; expert_ids int32, one per block; num_tokens_padded int32 ()."""
    offs = offsets.to(torch.int64)
    counts = offs[1:] - offs[:-1]
    experts = torch.arange(counts.numel(), device=offs.device)
    blocks = (counts + block - 1) // block
    padded = blocks * block
    slot_expert = torch.repeat_interleave(experts, padded)
    within = torch.arange(slot_expert.numel(), device=offs.device) - (torch.cumsum(padded, 0) - padded)[slot_expert]
    ids = torch.where(within < counts[slot_expert], offs[:-1][slot_expert] + within, offs[-1])
    return (ids.to(torch.int32), torch.repeat_interleave(experts, blocks).to(torch.int32),
            torch.tensor(ids.numel(), dtype=torch.int32, device=offs.device))


def _rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| (Frobenius, in float32)."""
    out, ref = out.float(), ref.float()
    den = float(ref.norm())
    num = float((out - ref).norm())
    return num / den if den > 0 else num


class Humming:
    """humming-kernels as the peer (module docstring): its weights, its
    heuristic intervals, its kernels compiled up front, its GEMM."""

    def __init__(self, torch, dev):
        import humming
        from humming import dtypes, forward, transform
        from humming.kernel.humming import HummingKernel
        from humming.schema import HummingInputSchema
        from humming.schema.modelopt import ModeloptNvfp4WeightSchema
        from humming.schema.mxfp4 import Mxfp4WeightSchema
        from humming.tune import get_heuristics_config
        self.torch = torch
        self.index = torch.device(dev).index
        if self.index is None:
            self.index = torch.cuda.current_device()
        self.dev = torch.device("cuda", self.index)
        self.name = f"{PEER_PACKAGE} {humming.__version__}"
        self.forward, self.transform, self.kernel = forward, transform, HummingKernel
        self.heuristics = get_heuristics_config
        self.schema = ModeloptNvfp4WeightSchema()
        self.input = HummingInputSchema(a_dtype=dtypes.DataType.from_torch_dtype(torch.bfloat16))
        # Its W4A8 mode (peer_w4a8): MXFP4 weights, E4M3 activations with a
        # float32 scale per token per 128 columns (DeepSeek's recipe).
        self.w8_schema = Mxfp4WeightSchema()
        self.w8_input = HummingInputSchema(a_dtype=dtypes.float8e4m3, input_scale_group_size=W4A8_GROUP,
                                           input_scale_dtype=dtypes.float32, input_quant_mode="dynamic_group")

    @classmethod
    def load(cls, torch, dev):
        """The peer, or None (with the reason printed) when humming is not
        installed or does not import."""
        try:
            return cls(torch, dev)
        except Exception as exc:  # noqa: BLE001 - optional: a missing or broken install is a null peer
            print(f"[gemm] peer {PEER_PACKAGE} unavailable ({type(exc).__name__}: {exc}); rows get peer: null",
                  flush=True)
            return None

    def layer_config(self, n: int, k: int, experts: int, w4a8: bool = False):
        """The LayerConfig its transform makes for an (N, K) NVFP4 weight of
        `experts` experts (0: a dense weight), without the weight; w4a8: an
        MXFP4 weight for its W4A8 mode."""
        schema, inputs = (self.w8_schema, self.w8_input) if w4a8 else (self.schema, self.input)
        return self.transform.prepare_layer_config(
            shape_n=n, shape_k=k, weight_schema=schema.to_humming_schema(self.torch.bfloat16),
            input_schema=inputs, num_experts=experts or None, torch_dtype=self.torch.bfloat16,
            device=self.dev)

    def weight(self, codes, scales, gs, experts: int):
        """(LayerConfig, its tensors) of one checkpoint weight: codes (E, N,
        K/2) or (N, K/2), scales likewise (K/16), gs (E,) or (1,)."""
        src = {"weight": codes, "weight_scale": scales.view(self.torch.float8_e4m3fn), "weight_scale_2": gs}
        return self._converted(self.schema, self.input, src, experts)

    def weight8(self, codes, scales, experts: int):
        """(LayerConfig, its tensors) of one MXFP4 checkpoint weight for the
        W4A8 mode: codes as weight's, E8M0 scale bytes (..., K/32) uint8."""
        return self._converted(self.w8_schema, self.w8_input, {"weight": codes, "weight_scale": scales}, experts)

    def _converted(self, schema, inputs, src, experts: int):
        torch, t = self.torch, self.transform
        n, k = src["weight"].shape[-2], 2 * src["weight"].shape[-1]
        schema, tensors = schema.convert_humming(src, shape_n_stacks=[n], shape_k_stacks=[k],
                                                 param_dtype=torch.bfloat16, num_experts=experts or None,
                                                 device=self.dev)
        cfg = t.prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema, input_schema=inputs,
                                     num_experts=experts or None, torch_dtype=torch.bfloat16, device=self.dev,
                                     tensors=tensors)
        cfg, tensors = t.prepare_fp16_e8m0_scale(cfg, tensors)
        return cfg, t.transform_humming_tensors(cfg, tensors)

    def quant_input(self, cfg, x):
        """(E4M3 codes, scales) of x (rows, K) BF16 for the W4A8 layer cfg,
        by humming's own quantizer, in the layout its GEMM reads."""
        return self.forward.may_quant_input(cfg, x)

    def intervals(self, cfg, mode: str, rows) -> list:
        """The default heuristic intervals that hold `rows` (_pick_intervals)."""
        return _pick_intervals(self.heuristics(cfg, gemm_type=mode, device=self.index), rows)

    def jobs(self, cfg, mode: str, rows) -> list:
        """prepare_kernels arguments, one kernel each, for these rows."""
        return [(cfg.to_str(), _compute(mode), json.dumps(c)) for _, _, c in self.intervals(cfg, mode, rows)]

    def prepare(self, jobs) -> None:
        """Compile every kernel the run will launch, in parallel (NVRTC runs
        as one subprocess a kernel), before any timing; a kernel that fails
        here fails again, reported, where its rows are timed."""
        from concurrent.futures import ThreadPoolExecutor

        from humming.ops.utils import init_humming_launcher
        from humming.utils.cpu import get_parallel_build_workers
        jobs = list(dict.fromkeys(jobs))
        if not jobs:
            return
        t0 = time.perf_counter()

        def build(job):
            try:
                self.kernel.prepare_kernels(*job, device=self.index)
                return None
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                return f"{type(exc).__name__}: {str(exc)[:200]}"
        init_humming_launcher()              # once, on this thread, before the workers register kernels
        with ThreadPoolExecutor(max_workers=get_parallel_build_workers()) as pool:
            errors = list(pool.map(build, jobs))
        bad = [e for e in errors if e]
        print(f"[gemm] peer: {len(jobs)} kernels ready in {time.perf_counter() - t0:.0f} s"
              + (f"; {len(bad)} failed, first: {bad[0]}" if bad else ""), flush=True)

    def locks(self):
        return self.torch.zeros(PEER_LOCKS, dtype=self.torch.int32, device=self.dev)

    def gemm(self, cfg, tensors, x, out, mode: str, ivs, locks, input_scale=None, **route):
        """out = x . W^T in BF16 through humming_forward; route: expert_layout
        (grouped_contiguous) or sorted_ids / expert_ids / num_tokens_padded
        (indexed); the W4A8 mode: x the E4M3 codes quant_input made and
        input_scale their scales."""
        return self.forward.humming_forward(
            cfg, inputs=x, weight=tensors["weight"], weight_scale=tensors.get("weight_scale"),
            weight_scale_2=tensors.get("weight_scale_2"), outputs=out, locks=locks, top_k=1,
            compute_config=_compute(mode), tuning_config=json.dumps(ivs), input_scale=input_scale, **route)


def _compute(mode: str) -> str:
    return json.dumps({"gemm_type": mode})


def peer_fields(name, modes_us: dict, errs: dict, notes: dict, flops: int) -> dict:
    """A row's peer fields: name (package and version, None: no peer), each
    mode's time (modes that failed or were wrong are absent), relative error
    and failure note. The fastest mode is the row's peer."""
    if name is None:
        return {"peer": None, "peer_us": None}
    if not modes_us:
        return {"peer": name, "peer_us": None, "peer_rel_err": _round_err(min(errs.values(), default=None)),
                "peer_error": "; ".join(f"{m}: {n}" for m, n in notes.items()) or "no mode ran"}
    best = min(modes_us, key=modes_us.get)
    us = modes_us[best]
    row = {"peer": f"{name} {best}", "peer_us": round(us, 2), "peer_mode": best,
           "peer_modes_us": {m: round(v, 2) for m, v in modes_us.items()},
           "peer_rel_err": _round_err(errs.get(best)), "peer_TFLOPs": round(flops / us / 1e6, 1)}
    if notes:
        row["peer_error"] = "; ".join(f"{m}: {n}" for m, n in notes.items())
    return row


def _round_err(e):
    return None if e is None else float(f"{e:.3g}")


def _peer_build(peer, build):
    """(build(), None), or (None, why) when it raises: the peer's weights of
    one shape failing cost that shape's peer rows, not the run."""
    if peer is None:
        return None, None
    try:
        return build(), None
    except Exception as exc:  # noqa: BLE001 - reported in the rows
        why = f"{type(exc).__name__}: {str(exc)[:160]}"
        print(f"[gemm] peer weights failed: {why}", flush=True)
        return None, why


def best_of(timers: dict, rounds: int = ROUNDS) -> tuple[dict, dict]:
    """Run each of `timers` (name -> fn() returning microseconds) `rounds`
    times, going through them in order each round: ({name: its fastest time},
    {name: "Error: message"} for a timer that raised, not run again)."""
    best, failed = {}, {}
    for _ in range(rounds):
        for name, run in timers.items():
            if name in failed:
                continue
            try:
                us = run()
            except Exception as exc:  # noqa: BLE001 - reported in the row
                failed[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                print(f"[gemm] {name} failed: {failed[name]}", flush=True)
                continue
            best[name] = min(us, best.get(name, us))
    return best, failed


#: best_of's name of the peer's mode m: PEER_TIMER + m (its W4A8 mode's:
#: PEER8_TIMER + m; neither prefix starts the other's names).
PEER_TIMER = "peer "
PEER8_TIMER = "peer8 "


def _peer_timers(peer, make_calls, ref, reps: int, prefix: str = PEER_TIMER) -> tuple[dict, dict, dict]:
    """make_calls() -> {mode: (fn(i), result())}, each mode writing its own
    NaN-filled output. Each mode runs once and its output is checked against
    ref (rawkv's): ({prefix + mode: timer} of the modes that match, to time
    like rawkv in best_of; their relative errors; notes on the rest)."""
    from .timing import warm_cuda_time_us as cuda_time_us
    timers, errs, notes = {}, {}, {}
    if peer is None:
        return timers, errs, notes
    try:
        calls = make_calls()
    except Exception as exc:  # noqa: BLE001 - the peer failing is reported in the row
        calls = {}
        notes["setup"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        print(f"[gemm] {prefix}setup failed: {notes['setup']}", flush=True)
    for mode, (fn, result) in calls.items():
        try:
            fn(0)
            errs[mode] = _rel_err(result(), ref)
        except Exception as exc:  # noqa: BLE001 - the peer failing is reported in the row
            notes[mode] = f"{type(exc).__name__}: {str(exc)[:160]}"
            print(f"[gemm] {prefix}{mode} failed: {notes[mode]}", flush=True)
            continue
        if not errs[mode] <= PEER_TOL:
            notes[mode] = f"output differs from rawkv's (relative error {errs[mode]:.3g} > {PEER_TOL})"
            print(f"[gemm] PEER MISMATCH {prefix}{mode}: {notes[mode]}", flush=True)
            continue
        timers[prefix + mode] = lambda fn=fn: cuda_time_us(fn, reps=reps)
    return timers, errs, notes


def _peer_row(peer, best: dict, failed: dict, errs: dict, notes: dict, flops: int,
              prefix: str = PEER_TIMER) -> dict:
    """The row's peer fields (peer_fields) from best_of's results of the
    timers _peer_timers made with `prefix`."""
    if peer is None:
        return peer_fields(None, {}, {}, {}, flops)
    n = len(prefix)
    modes_us = {name[n:]: us for name, us in best.items() if name.startswith(prefix)}
    notes = {**notes, **{name[n:]: why for name, why in failed.items() if name.startswith(prefix)}}
    return peer_fields(peer.name, modes_us, errs, notes, flops)


def _timed_row(timers: dict, peer, peer_calls, ref, reps: int, flops: int,
               w4a8=None) -> tuple[dict, dict, dict]:
    """A row's timings: `timers` (rawkv first) and the peer's matching modes
    through best_of; (best, failed, the row's fields of the peer). `w4a8`:
    (make_calls, ref) of the peer's W4A8 mode, whose fields join the row's
    as w4a8_peer, w4a8_peer_us, ... (w4a8_fields). rawkv's own timer failing
    fails the run, as a single timing of it did."""
    ptimers, errs, notes = _peer_timers(peer, peer_calls, ref, reps)
    p8 = _peer_timers(peer, w4a8[0], w4a8[1], reps, PEER8_TIMER) if w4a8 else ({}, {}, {})
    best, failed = best_of({**timers, **ptimers, **p8[0]})
    if "rawkv" in failed:
        raise RuntimeError(f"rawkv's timing failed: {failed['rawkv']}")
    row = _peer_row(peer, best, failed, errs, notes, flops)
    if w4a8 and peer is not None:
        row.update(w4a8_fields(_peer_row(peer, best, failed, p8[1], p8[2], flops, PEER8_TIMER)))
    return best, failed, row


def w4a8_fields(peer_row: dict) -> dict:
    """A peer row's fields (peer_fields) as the W4A8 peer's: peer ->
    w4a8_peer, peer_us -> w4a8_peer_us, and so on."""
    return {"w4a8_" + key: value for key, value in peer_row.items()}


def _peer_text(row: dict) -> str:
    if row.get("peer_us") is not None:
        return f"; {row['peer']} {row['peer_us']:.1f} us (err {row['peer_rel_err']})"
    return "" if row.get("peer") is None else f"; peer failed ({row.get('peer_error')})"


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


# ---- the peer's W4A8 mode (wo_a rows) ---------------------------------------------
#: humming's W4A8 mode beside rawkv's W4A8 rows (issue 23): random MXFP4
#: checkpoints (E2M1 codes, element 2j in the low nibble; E8M0 scale bytes in
#: [W4A8_SCALE_LO, W4A8_SCALE_HI), 2^-5 .. 2^2, one per 32 columns), E4M3
#: activations with a float32 scale per token per W4A8_GROUP columns. Checked
#: against w4a8_reference, not rawkv's W4A8 output: rawkv's W4A8 rows time
#: random W4A8 forms (_w4a8_weight), not these weights. Not on the MoE rows:
#: a fourth copy of the experts beside the others and torch's BF16 ones
#: would not fit the GPU at DeepSeek-V4-Pro's gate_up (docs/gemm.md).
W4A8_GROUP = 128
W4A8_SCALE_LO, W4A8_SCALE_HI = 122, 130


def _mxfp4_checkpoint(torch, g, n, k, dev):
    """Random MXFP4 checkpoint bytes: codes (G, N, K/2), scales (G, N, K/32)."""
    codes = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8, device=dev)
    scales = torch.randint(W4A8_SCALE_LO, W4A8_SCALE_HI, (g, n, k // 32), dtype=torch.uint8, device=dev)
    return codes, scales


def mxfp4_values(torch, codes, scales):
    """float32 (..., N, K): the values of MXFP4 codes (..., N, K/2), element
    2j in the low nibble, and E8M0 scale bytes (..., N, K/32) (2^(byte - 127))."""
    from ..reference.formats import E2M1_VALUES
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    v = torch.stack((lut[c & 15], lut[c >> 4]), dim=-1).flatten(-2)
    return v * torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)


def w4a8_reference(torch, rawkv, x, codes, scales):
    """float32 (M, G, N): x (M, G, K) as rawkv's FP8 block activations
    (quantize_blocks, DeepSeek's rule), dequantized, times the MXFP4 weights'
    values, in float32."""
    xa = rawkv.fp8.dequantize_blocks(*rawkv.fp8.quantize_blocks(x, block=W4A8_GROUP), block=W4A8_GROUP)
    return torch.einsum("mgk,gnk->mgn", xa, mxfp4_values(torch, codes, scales))


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
        hw, why = _peer_build(peer, lambda: [_wo_a_peer(peer, c, g) for c in ckpts])
        ckpts = None
        locks = peer.locks() if peer else None
        read_us = round(read_weight_us(torch, wbytes, sets, rt.sm_count, lambda f: cuda_time_us(f, reps=reps)), 2)
        wb = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16)
        w8 = wb.to(torch.float8_e4m3fn) if hasattr(torch, "float8_e4m3fn") else None
        w8s = [_w4a8_weight(torch, g, n, k, dev) for _ in range(sets)] if rt.arch == "sm_90" else None
        ck8 = [_mxfp4_checkpoint(torch, g, n, k, dev) for _ in range(sets)] if peer and w8s else None
        hw8, why8 = _peer_build(peer if ck8 else None, lambda: [_wo_a_peer8(peer, c, g) for c in ck8])
        ck8 = ck8[0] if ck8 else None          # (the reference's weights: set 0's)
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
            if ck8 is not None:
                w4a8 = (lambda: _wo_a_calls(peer, torch, hw8, x, n, locks, why8, quant=True),
                        w4a8_reference(torch, rawkv, x, *ck8))
            best, failed, peer_row = _timed_row(
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
                  + _peer_text(row) + _w4a8_text(row), flush=True)
        ws = wb = w8 = w8s = hw = hw8 = ck8 = None  # free before the next shape
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
    sorted_ids, expert_ids, padded = _indexed_layout(torch, offs, int(iv_i[0][2]["block_shape"][0]))

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
            hw, why = _peer_build(peer, lambda: [peer.weight(*c, experts) for c in ckpts])
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
                best, failed, peer_row = _timed_row(
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
                      f"{'-' if base is None else f'{base:.1f} us'}" + _peer_text(row) + _w4a8_text(row), flush=True)
            ws = wb = w8s = hw = None
            torch.cuda.empty_cache()


def run(rt, results, quick=False, peers=False):
    """The wo_a and MoE rows; peers: time humming beside rawkv when it is
    installed (without it, or with peers False, every row has peer: null)."""
    import torch
    from .timing import copy_bandwidth_GBps
    copy = copy_bandwidth_GBps()
    reps = 10 if quick else 40
    peer = Humming.load(torch, "cuda") if peers else None
    if peer:
        peer.prepare(_wo_a_jobs(peer, WO_A_MS_QUICK if quick else WO_A_MS, w4a8=rt.arch == "sm_90")
                     + _moe_jobs(peer, MOE_TOKENS_QUICK if quick else MOE_TOKENS))
    _wo_a(rt, results, peer, quick, reps, copy)
    _moe(rt, results, peer, quick, reps, copy)


# ---- plot ----------------------------------------------------------------------
SERIES = (("rawkv", "us"), ("rawkv W4A8", "w4a8_us"), ("humming", "peer_us"), ("humming W4A8", "w4a8_peer_us"),
          ("torch BF16", "baseline_us"),
          ("floor", "floor_us"))


def _panel(row):
    """(panel title, x) of a result row, or None for rows that are not GEMMs."""
    op, shape = row.get("op", ""), row.get("shape")
    if op.startswith("grouped_linear/wo_a-") and shape:
        m, g, k, n = shape
        return f"wo_a {row.get('model', op.split('-', 1)[1])} (G {g}, K {k}, N {n})", m
    if op.startswith("moe_linear/") and shape:
        tokens, experts, top_k, k, n = shape
        return (f"MoE {op.split('/', 1)[1]} {row.get('model', '')} "
                f"({experts} experts top-{top_k}, K {k}, N {n})").replace("  ", " "), tokens
    return None


def plot_series(results) -> dict:
    """{panel title: {"x": [M ...], series name: [us or None ...]}}, panels in
    the rows' order, points sorted by M."""
    panels: dict = {}
    for row in results:
        where = _panel(row)
        if where is None:
            continue
        title, x = where
        # (a series not timed for a row, or reported as unavailable: no point)
        panels.setdefault(title, []).append((x, [v if isinstance(v, (int, float)) else None
                                                 for v in (row.get(key) for _, key in SERIES)]))
    out = {}
    for title, points in panels.items():
        points.sort(key=lambda p: p[0])
        out[title] = {"x": [p[0] for p in points]}
        for j, (label, _) in enumerate(SERIES):
            out[title][label] = [p[1][j] for p in points]
    return out


def plot(results, path):
    """Time against M, log axes, one panel per shape: rawkv, humming (and
    the two's W4A8 rows), torch BF16 and the floor. Returns the path written, or None when matplotlib is
    not importable or there is nothing to draw."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = plot_series(results)
    if not panels:
        return None
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    style = {"rawkv": "o-", "rawkv W4A8": "D-", "humming": "s-", "humming W4A8": "v:", "torch BF16": "^-",
             "floor": "k--"}
    for ax, (title, s) in zip(axes.flat, panels.items()):
        for label, _ in SERIES:
            pts = [(x, y) for x, y in zip(s["x"], s[label]) if y is not None]
            if pts:
                ax.plot(*zip(*pts), style[label], label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("M (tokens)", fontsize=8)
        ax.set_ylabel("us", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
