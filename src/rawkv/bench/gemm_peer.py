"""The GEMM group's peer and the timing of its rows (rawkv.bench.gemm): humming-kernels
as the peer, the check of its output, the alternation in which a row's timings are
taken (best_of), and its W4A8 mode's weights and reference.

The peer: humming-kernels 0.1.20 (0.1.19 until session 64: the calls below are the same in both; the vLLM project's JIT W4A16 / FP4 GEMM
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
"""
from __future__ import annotations

import json
import time

PEER_PACKAGE = "humming-kernels"
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


def mxfp4_checkpoint(torch, g, n, k, dev):
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


def w4a8_reference(torch, rawkv, x, w):
    """float32 (M, G, N): x (M, G, K) as rawkv's FP8 block activations
    (quantize_blocks, DeepSeek's rule), dequantized, times the weights'
    values w (G, N, K) float32 (mxfp4_values, worked out once per shape)."""
    xa = rawkv.fp8.dequantize_blocks(*rawkv.fp8.quantize_blocks(x, block=W4A8_GROUP), block=W4A8_GROUP)
    return torch.einsum("mgk,gnk->mgn", xa, w)


def interval(intervals, rows: int):
    """The [lo, hi, config] of humming's heuristic list that its launcher
    picks for `rows` (lo < rows <= hi)."""
    for iv in intervals:
        if iv[0] < rows <= iv[1]:
            return iv
    raise ValueError(f"rows: {rows} lies in none of the heuristic intervals")


def pick_intervals(intervals, rows) -> list:
    """The intervals of humming's heuristic list that hold `rows`, each once,
    in order, as [lo, hi, config copy]; the first reaches down to 0, because
    its launcher first looks up the config of one row (to read the GEMM type)
    and refuses a list that has none. No other row's choice changes."""
    picked = {id(iv): iv for iv in (interval(intervals, r) for r in rows)}
    out = [[lo, hi, dict(c)] for lo, hi, c in sorted(picked.values(), key=lambda iv: iv[0])]
    if out:
        out[0][0] = 0
    return out


def indexed_layout(torch, offsets, block: int):
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


def rel_err(out, ref) -> float:
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
        # Its W4A8 mode: MXFP4 weights, E4M3 activations with a float32
        # scale per token per 128 columns (DeepSeek's recipe); has_w4a8 False
        # where this humming has no such schema (its W4A16 rows still run).
        self.w8_schema = self.w8_input = None
        try:
            from humming.schema.mxfp4 import Mxfp4WeightSchema
            self.w8_schema = Mxfp4WeightSchema()
            self.w8_input = HummingInputSchema(a_dtype=dtypes.float8e4m3, input_scale_group_size=W4A8_GROUP,
                                               input_scale_dtype=dtypes.float32, input_quant_mode="dynamic_group")
        except Exception as exc:  # noqa: BLE001 - optional: the W4A8 rows report no peer
            print(f"[gemm] peer {self.name}: no W4A8 mode ({type(exc).__name__}: {exc})", flush=True)

    @property
    def has_w4a8(self) -> bool:
        return self.w8_schema is not None

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
        """The default heuristic intervals that hold `rows` (pick_intervals)."""
        return pick_intervals(self.heuristics(cfg, gemm_type=mode, device=self.index), rows)

    def jobs(self, cfg, mode: str, rows) -> list:
        """prepare_kernels arguments, one kernel each, for these rows."""
        return [(cfg.to_str(), compute_config(mode), json.dumps(c)) for _, _, c in self.intervals(cfg, mode, rows)]

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
            compute_config=compute_config(mode), tuning_config=json.dumps(ivs), input_scale=input_scale, **route)


def compute_config(mode: str) -> str:
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


def peer_build(peer, build):
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


def peer_timers(peer, make_calls, ref, reps: int, prefix: str = PEER_TIMER) -> tuple[dict, dict, dict]:
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
            errs[mode] = rel_err(result(), ref)
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


def peer_row_fields(peer, best: dict, failed: dict, errs: dict, notes: dict, flops: int,
                    prefix: str = PEER_TIMER) -> dict:
    """The row's peer fields (peer_fields) from best_of's results of the
    timers peer_timers made with `prefix`."""
    if peer is None:
        return peer_fields(None, {}, {}, {}, flops)
    n = len(prefix)
    modes_us = {name[n:]: us for name, us in best.items() if name.startswith(prefix)}
    notes = {**notes, **{name[n:]: why for name, why in failed.items() if name.startswith(prefix)}}
    return peer_fields(peer.name, modes_us, errs, notes, flops)


def timed_row(timers: dict, peer, peer_calls, ref, reps: int, flops: int,
              w4a8=None) -> tuple[dict, dict, dict]:
    """A row's timings: `timers` (rawkv first) and the peer's matching modes
    through best_of; (best, failed, the row's fields of the peer). `w4a8`:
    (make_calls, ref) of the peer's W4A8 mode, whose fields join the row's
    as w4a8_peer, w4a8_peer_us, ... (w4a8_fields). rawkv's own timer failing
    fails the run, as a single timing of it did."""
    ptimers, errs, notes = peer_timers(peer, peer_calls, ref, reps)
    p8 = peer_timers(peer, w4a8[0], w4a8[1], reps, PEER8_TIMER) if w4a8 else ({}, {}, {})
    eager: set = set()
    best, failed = best_of({name: _noting_eager(name, run, eager)
                            for name, run in {**timers, **ptimers, **p8[0]}.items()})
    if "rawkv" in failed:
        raise RuntimeError(f"rawkv's timing failed: {failed['rawkv']}")
    row = peer_row_fields(peer, best, failed, errs, notes, flops)
    if w4a8 and peer is not None:
        row.update(w4a8_fields(peer_row_fields(peer, best, failed, p8[1], p8[2], flops, PEER8_TIMER)))
    if eager:
        # the timings that could not be captured in a CUDA graph: eager calls,
        # host time between launches included (not comparable with the others)
        row["eager_timings"] = sorted(eager)
    return best, failed, row


def _noting_eager(name: str, run, eager: set):
    """run(), adding `name` to `eager` when its timing fell back to eager
    calls (timing.EAGER grew)."""
    from . import timing

    def timed():
        before = len(timing.EAGER)
        us = run()
        if len(timing.EAGER) > before:
            eager.add(name)
        return us
    return timed


def w4a8_fields(peer_row: dict) -> dict:
    """A peer row's fields (peer_fields) as the W4A8 peer's: peer ->
    w4a8_peer, peer_us -> w4a8_peer_us, and so on."""
    return {"w4a8_" + key: value for key, value in peer_row.items()}


def peer_text(row: dict) -> str:
    if row.get("peer_us") is not None:
        return f"; {row['peer']} {row['peer_us']:.1f} us (err {row['peer_rel_err']})"
    return "" if row.get("peer") is None else f"; peer failed ({row.get('peer_error')})"
