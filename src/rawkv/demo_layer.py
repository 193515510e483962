"""python -m rawkv demo [--cpu] [--batch B] [--context T] [--steps N] [--seed S] [--layout L]

One DeepSeek-V4-Flash-shaped decoder layer's decode step on rawkv, against
the same step in plain torch, for a batch of requests whose caches hold
--context tokens (random weights at the real shapes; random hidden states).

The rawkv step (on a GPU captured once in a CUDA graph and replayed):
  1. RMSNorm + NVFP4 quantize of the hidden state (rawkv.fused.rmsnorm_quantize);
  2. the layer's input projections as one FP4 GEMM on that NVFP4 activation
     (rawkv.gemm.grouped_linear, 1 group): the query's low-rank half, the
     window row, the CSA, HCA and indexer compressors' kv / gate rows;
  3. the compressors' decode step into the paged pools (CSA with its indexer
     keys, HCA: the cache demo's step, rawkv.demo.Decoder) and the window
     insert (rawkv.kvcache.model1_window_insert, MODEL1 pages);
  4. the gathers that feed attention: gather_topk (CSA; the top-k are the
     most recent entries: no indexer scoring), gather_dense_batch (HCA),
     model1_gather (the window);
  5. attention: torch SDPA over the gathered rows (one KV row shared by the
     query heads; not a rawkv kernel: the output says so);
  6. wo_a as the grouped FP4 GEMM (8 groups, K 4096, N 1024), wo_b as an FP4
     GEMM (1 group), the residual;
  7. MoE: routing (top-6 of 256 experts, random router, torch), RMSNorm
     (torch), rawkv.fused.moe_stage, the rows sorted by expert (torch),
     expert gate_up (rawkv.gemm.moe_linear, N 4096 = 2 x 2048, K 4096),
     rawkv.fused.swiglu_quantize, expert down (N 4096, K 2048), the combine.

The baseline step does the same in plain torch with BF16 weights (the values
rawkv quantized to NVFP4), BF16 activations and a BF16 cache (its compressor
in torch, float32 state), and is captured and timed the same way. Printed:
time per step of both, the bytes each reads per step (weights and KV rows),
the cosine of the KV rows attention reads against the baseline's, per
source (CSA top-k, HCA, window; the rows the attention mask lets through),
and the cosine of the layer's output (and of its update, output - input)
against the baseline's, from the same inputs. A mean under its floor
(ROWS_FLOOR per source, COS_FLOOR for the update) fails the run.

Without a GPU (or with --cpu) the same step runs at a tiny size on CPU
tensors, where every rawkv op runs its numpy reference, against the same
torch step in float64; the first line says so (a few seconds in all). A
size that does not fit the device (or the host) is refused before anything
is allocated or compiled. On a GPU only the kernel instances the run
launches are compiled (kernel_instances: 21 of rawkv's 385 on an H100 at
the defaults), in parallel threads while the caches' rows are drawn, with a
progress line when that takes more than a second.

--cache runs the compressed KV cache demo instead (rawkv/demo.py: the
cache's bytes per token and the accuracy of its entries; --small and
--index-layout are its options).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import demo as cache_demo
from .reference import kvcache as ref

D, DI = ref.HEAD_DIM, ref.INDEX_HEAD_DIM
M = cache_demo.M
GiB = 2 ** 30
#: --batch / --context bounds (argparse); what fits is checked per device
MAX_BATCH, MAX_CONTEXT = 4096, 1 << 20
#: a run whose update cosine (output - input against the baseline's) has a
#: mean below this fails (exit status 1). Not higher: where a token's routing
#: differs from the baseline's (top-k logits within the FP4 noise of each
#: other), its update differs by a whole expert; the line counts those.
COS_FLOOR = 0.8
#: the sources of the KV rows a step attends to, in the attention mask's
#: column order, with their names in the report line
SOURCES = {"csa": "CSA top-k", "hca": "HCA", "win": "window"}
#: a run where one source's rows (those the mask lets through, rawkv's
#: against the baseline's: rows_cos) have a mean cosine below this fails
#: (exit status 1): the update's cosine cannot see a broken source whose
#: rows are few of those attended (HCA rows all noise: 2 of 34 at the CPU
#: size: the update's cosine stays about 0.85). Healthy, the FP8 entries of the prompt give
#: 0.9997 and the rows the steps write (from the FP4 projection) 0.990 at
#: the least (CPU, 2 to 40 steps, contexts 5 to 1000: each source's mean
#: 0.993 or more); a source's rows all noise give |cosine| < 0.02, one row
#: in ten noise about 0.93.
ROWS_FLOOR = 0.95


@dataclass(frozen=True)
class Shape:
    """A decoder layer's sizes (head_dim 512 and the indexer's 128 are the
    cache's, rawkv.reference.kvcache)."""
    name: str
    hidden: int
    heads: int
    groups: int        # wo_a groups
    wo_rank: int       # wo_a's N per group
    q_rank: int        # the query's low-rank width
    experts: int
    top: int           # experts per token
    inter: int         # expert intermediate width
    window: int        # sliding-window tokens
    topk: int          # CSA entries gathered per request
    epb: int           # pool entries per page

    @property
    def proj_widths(self) -> dict:
        """The input projection's outputs, in column order."""
        return {"q_a": self.q_rank, "win": D, "csa_kv": 2 * D, "csa_z": 2 * D, "hca_kv": D, "hca_z": D,
                "idx_kv": 2 * DI, "idx_z": 2 * DI}

    def weights(self) -> dict:
        """name -> (groups, N, K) of every FP4 weight."""
        return {"w_in": (1, sum(self.proj_widths.values()), self.hidden),
                "wq_b": (1, self.heads * D, self.q_rank),
                "wo_a": (self.groups, self.wo_rank, self.heads // self.groups * D),
                "wo_b": (1, self.hidden, self.groups * self.wo_rank),
                "gate_up": (self.experts, 2 * self.inter, self.hidden),
                "down": (self.experts, self.hidden, self.inter)}

    def describe(self) -> str:
        return (f"{self.name} shapes: hidden {self.hidden}, {self.heads} heads x {D}, wo_a {self.groups} groups "
                f"K {self.heads // self.groups * D} N {self.wo_rank}, {self.experts} experts top-{self.top}, "
                f"expert gate_up N {2 * self.inter} K {self.hidden}, down N {self.hidden} K {self.inter}; "
                f"window {self.window}, CSA top-k {self.topk}")


FLASH = Shape("DeepSeek-V4-Flash", 4096, 64, 8, 1024, 1024, 256, 6, 2048, 128, 512, 64)
TINY = Shape("tiny", 256, 2, 2, 128, 128, 8, 2, 128, 16, 16, 16)
FP4_BYTES = 0.5 + 1 / 16          # an NVFP4 weight element: code nibble + its share of an E4M3 scale


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The layer demo's options (beside the cache demo's --cpu, --steps,
    --seed, --layout), and --cache, which picks the cache demo instead."""
    p.add_argument("--cache", action="store_true",
                   help="run the compressed KV cache demo instead (rawkv/demo.py: bytes per token and the "
                        "accuracy of the cache's entries)")
    p.add_argument("--layer", action="store_true",
                   help="the layer demo (the default; kept for command lines written when it was not)")
    p.add_argument("--batch", type=cache_demo._count(1, MAX_BATCH), default=None,
                   help=f"requests per step, 1 to {MAX_BATCH} (default 8 on a GPU, 2 on CPU)")
    p.add_argument("--context", type=cache_demo._count(1, MAX_CONTEXT), default=None,
                   help=f"tokens in each request's cache before the steps, 1 to {MAX_CONTEXT:,} "
                        "(default 4096 on a GPU, 300 on CPU)")


def check_arguments(a, error) -> None:
    """--batch / --context belong to the layer demo; --small and
    --index-layout to the cache demo (--cache): given to the other they
    would be ignored, so they are refused through `error`."""
    if a.cache:
        if a.layer:
            error("argument --layer: not with --cache (pick one demo)")
        for opt in ("batch", "context"):
            if getattr(a, opt) is not None:
                error(f"argument --{opt}: not with --cache (the layer demo's; --cache sizes itself: --small)")
        return
    if a.small:
        error("argument --small: only with --cache (the layer demo is small on CPU; pick --batch / --context)")
    if a.index_layout is not None:
        error("argument --index-layout: only with --cache (the layer demo's CSA pool keeps fp8 indexer keys)")


# ---- sizes ---------------------------------------------------------------------------------
def params(shape: Shape) -> int:
    return sum(g * n * k for g, n, k in shape.weights().values())


def need_bytes(shape: Shape, batch: int, context: int, steps: int, gpu: bool) -> tuple:
    """(device bytes, host bytes) a run needs, from the sizes alone (an
    estimate with margins, checked before anything is allocated)."""
    p = params(shape)
    biggest = max(g * n * k for g, n, k in shape.weights().values())
    base = 2 if gpu else 8                                # the baseline's weights: BF16 (GPU), float64 (CPU)
    weights = p * (base + FP4_BYTES) + biggest * (2 + 3 * FP4_BYTES)   # + from_float's temporaries
    entries = batch * (context + steps + 2 * shape.window)
    cache = entries * ((1 / M["csa"]) * (2 * (584 + 132) + 2 * (D + DI)) + (1 / M["hca"]) * (584 + 2 * D)) \
        + batch * shape.window * (584 + 2 * D)
    act = batch * shape.top * (4 * shape.inter + 2 * shape.hidden) * 2 * 4 + batch * shape.heads * D * 16 \
        + batch * shape.heads * (shape.topk + context // M["hca"] + shape.window) * 8
    device = int(weights + 2 * cache + act) + (GiB // 2 if gpu else 0)
    # the prompts' synthetic compressor rows (float32, kept by the Decoder) and
    # the reference prefill of one request for the baseline's cache
    host = int(cache_demo.TOKEN_BYTES * context * (batch + 4)) + 256 * 2 ** 20
    return device, host


def host_available() -> int:
    """Bytes of host memory available now (Linux MemAvailable; else the
    free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(shape: Shape, batch: int, context: int, steps: int, device_free: int | None) -> None:
    """Raise MemoryError, with the sizes and what to lower, when the run does
    not fit: device_free bytes on the GPU (None: CPU, all on the host)."""
    dev, host = need_bytes(shape, batch, context, steps, device_free is not None)
    if device_free is None:
        host += dev
    have = host_available()
    where = [("host memory", host, have)]
    if device_free is not None:
        where.insert(0, ("GPU memory", dev, device_free))
    for what, need, free in where:
        if need > free:
            raise MemoryError(f"--batch {batch} --context {context} needs about {need / GiB:.1f} GiB of {what} "
                              f"({shape.name} layer: {params(shape) / 1e9:.2f} G weight parameters); "
                              f"{free / GiB:.1f} GiB are free: lower --batch or --context")


# ---- the kernel instances a GPU run launches -------------------------------------------------
def kernel_instances(dev, shape: Shape, batch: int, layout: str, context: int = 4096, steps: int = 20) -> list:
    """(filename, name expression) of every rawkv kernel instance the GPU
    run launches on a device `dev` (a rawkv._plan.Device or the Runtime:
    arch, sm_count, max_threads_per_sm), in order, each once: the weights'
    NVFP4 quantize, the prefill, the window insert and the step, for
    `batch` requests of `context` tokens and `steps` steps (a prompt too
    short for an entry compresses nothing; before 128 tokens no HCA entry
    is gathered). The run
    warms up only these (a cold start compiles them in parallel, not every
    instance rawkv declares) and holds them against what it launched
    (Runtime.recording, instances_note). The choices that depend on sizes,
    device or layout come from the families' own plans (rawkv.nvfp4.encode,
    rawkv.gemm.plans, rawkv.kvcache.plans) on stand-ins of the demo's
    arguments: meta tensors (only their dtype and strides are read) and
    one-block CPU pools of the demo's layout; the others are the instance
    each op's plan takes for the demo's dtypes."""
    import torch
    from types import SimpleNamespace as Stub

    from . import kvcache as kvc
    from ._plan import Launch
    from .gemm import linear as tuning, plans as GP
    from .gemm._rules import BF16, NVFP4
    from .kernels import fused as KF, kv_cache as KV, kv_compress as KC, kv_layouts as KL
    from .kvcache import plans as KP
    from .kvcache.compressor import layout_targ
    from .nvfp4 import encode

    def meta(*size, dtype=torch.bfloat16):
        return torch.empty(size, dtype=dtype, device="meta")

    found = []

    def take(plan):
        found.extend(step.kernel.key for step in plan if isinstance(step, Launch))

    ws = shape.weights()
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    # the weights: Fp4Weight.from_float quantizes each group's (N, K) BF16 with scope 'tensor'
    for g, n, k in ws.values():
        take(encode.plan(dev, meta(n, k), None, None, None, n, k, k, "tensor"))
    pools = {kind: kvc.PagedKVPool(kind, 1, shape.epb, 1, 1, device="cpu", layout=layout)
             for kind in ("csa", "hca")}
    # prefill: compress_prefill of float32 token rows (CSA with its indexer keys), the window insert
    for kind, pool in pools.items():
        if KP.prefill_entries(pool, context, 0)[0] > 0:
            found.append(KC.COMPRESS.instance(*KC.targs(kind, f32, False, layout=layout_targ(pool))).key)
    found.append(KL.MODEL1_STORE.instance(bf16, i32).key)
    # the step: RMSNorm + quantize (BF16 hidden state, gs per row), the input projection
    found.append(KF.RMS.instance(bf16, False, KF.REG).key)

    def gemm(name, kind, lead):
        """The plan of grouped_linear (lead (T, G)) or moe_linear (lead (R,))."""
        g, n, k = ws[name]
        w = Stub(groups=g, n=n, k=k, fmt="nvfp4", codes=None, scales=None, gs=None)
        act = Stub(kind=kind, lead=lead, x=meta(*lead, k), sf=None, gs=None)
        if len(lead) == 2:
            return GP.grouped(dev, act, w, meta(*lead, n), tuning)
        return GP.moe(dev, act, w, None, meta(*lead, n), None, tuning)

    take(gemm("w_in", NVFP4, (batch, 1)))
    # the compressors' decode step (rawkv.demo.Decoder.step: float32 rows, int32 slots), the window insert
    found.append(KV.STATE_APPEND.instance(f32, f32).key)
    found.append(KL.MODEL1_STORE.instance(bf16, i32).key)
    for kind, pool in pools.items():
        found.append(KC.COMPRESS.instance(*KC.targs(kind, f32, True, i32, layout_targ(pool))).key)
    found += [KV.STATE_RESET.instance(KV.RESET_CSA).key, KV.STATE_RESET.instance(KV.RESET_HCA).key]
    # the gathers: CSA top-k (int32 ids), HCA dense, into BF16 rows; the window's
    take(KP.gather(dev, pools["csa"], meta(batch, shape.topk, dtype=torch.int32), None, None, None,
                   meta(batch, shape.topk, D), None, batch, shape.topk))
    k_hca = (context + steps) // M["hca"]               # the HCA rows gathered (rawkv.demo.Decoder.k_hca)
    take(KP.gather(dev, pools["hca"], None, None, None, None, meta(batch, k_hca, D), None, batch, k_hca))
    found.append(KL.MODEL1_GATHER.instance(bf16).key)
    # wq_b, wo_a, wo_b on BF16 activations
    for name, g in (("wq_b", 1), ("wo_a", shape.groups), ("wo_b", 1)):
        take(gemm(name, BF16, (batch, g)))
    # MoE: staging (BF16 rows, int32 expert ids), gate_up, SwiGLU + quantize, down
    rows = batch * shape.top
    found.append(KF.MOE_STAGE.instance(bf16, i32).key)
    take(gemm("gate_up", NVFP4, (rows,)))
    found.append(KF.SWIGLU.instance(bf16, True, KF.REG).key)    # granularity 8: 16-byte runs
    take(gemm("down", NVFP4, (rows,)))
    return list(dict.fromkeys(found))


def instances_note(wanted, seen) -> str | None:
    """What a run's launches (`seen`, Runtime.recording) say of the list it
    warmed up (`wanted`): None when they are the same set; else a line
    naming the instances launched outside the list (each compiled at its
    first launch, one at a time) and those listed but never launched
    (compiled for nothing)."""
    listed = set(wanted)
    extra = sorted(k for k in seen if k is not None and k not in listed)
    unused = [k for k in wanted if k not in seen]
    if not extra and not unused:
        return None
    name = lambda ks: ", ".join(f"{f}:{e}" for f, e in ks)  # noqa: E731
    parts = []
    if extra:
        parts.append(f"{len(extra)} launched but not listed (compiled at their first launch): {name(extra)}")
    if unused:
        parts.append(f"{len(unused)} listed but never launched: {name(unused)}")
    return "rawkv demo: kernel_instances() is not what the run launched: " + "; ".join(parts)


# ---- the layer's parameters ----------------------------------------------------------------
class Weights:
    """Random weights at `shape`: the baseline's (dtype `base`: BF16 on a
    GPU, float64 on CPU; BF16 values either way) and rawkv's NVFP4 of the
    same values."""

    def __init__(self, torch, shape: Shape, gen, dev, base, say):
        import rawkv.gemm as G
        self.base, self.fp4 = {}, {}
        for name, (g, n, k) in shape.weights().items():
            say(f"weights: {name} ({g} x {n} x {k}), random BF16, quantized to NVFP4")
            w = torch.randn((g, n, k), generator=gen, device=dev, dtype=torch.bfloat16).mul_(k ** -0.5)
            self.fp4[name] = G.Fp4Weight.from_float(w)
            self.base[name] = w.to(base)
            del w
        h = shape.hidden
        self.router = torch.randn((shape.experts, h), generator=gen, device=dev).mul_(h ** -0.5)
        self.norm_attn = (1 + 0.1 * torch.randn(h, generator=gen, device=dev)).to(torch.bfloat16)
        self.norm_ffn = (1 + 0.1 * torch.randn(h, generator=gen, device=dev)).to(torch.bfloat16)


def rms(torch, x, weight=None, eps=1e-6):
    """RMSNorm in float32 (float64 for float64 x), back to x's dtype."""
    f = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    y = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.to(f.dtype)).to(x.dtype)


def route(torch, hn, router, top):
    """Top-`top` experts of each row (random router, softmax over the chosen
    logits): (ids (B, top) int32, weights (B, top) float32)."""
    logits = hn.to(router.dtype) @ router.t()
    w, ids = logits.topk(top, dim=-1)
    return ids.to(torch.int32), torch.softmax(w, -1).to(torch.float32)


def sort_rows(torch, ids, experts):
    """Rows (token, choice) sorted by expert: (order (R,) int64 into the
    flattened choices, token of each sorted row, offsets (E+1,) int32,
    expert of each sorted row). Static shapes, no host sync (capturable)."""
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    bounds = torch.arange(experts + 1, device=ids.device, dtype=torch.int64)
    offsets = torch.searchsorted(expert, bounds, out_int32=True)
    return order, order // ids.shape[1], offsets, expert


def combine(torch, y_sorted, order, weights, acc):
    """The MoE output (B, N) in dtype `acc`: each token's expert rows
    (sorted by expert) back in (token, choice) order, weighted and summed."""
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    b, k = weights.shape
    return (y.view(b, k, -1).to(acc) * weights.unsqueeze(-1).to(acc)).sum(1)


# ---- the baseline's compressor and cache (torch) -------------------------------------------
class TorchCompressor:
    """One compressor's decode step in torch, batched and branch-free (so it
    is captured): append the row, pool the window as if it were complete,
    finish the entry (RMSNorm, RoPE at e * m, Hadamard for indexer keys) and
    write it to entry e = (pos + 1) // m - 1 of `cache` only for rows whose
    window completes (others write a spare last row), then rotate / reset.
    The state is rawkv.reference.kvcache's (float32; float64 for a float64
    cache), seeded from it; cache (B, max_entries + 1, d)."""

    def __init__(self, torch, kind, ape, norm_w, states, cache, hadamard=False):
        self.torch, self.kind, self.m = torch, kind, M[kind]
        self.cache = cache
        dev = cache.device
        self.dt = torch.float64 if cache.dtype == torch.float64 else torch.float32
        t = lambda a: torch.as_tensor(np.stack(a), device=dev).to(self.dt)  # noqa: E731
        self.a_kv, self.a_z = t([s.a_kv[0] for s in states]), t([s.a_z[0] for s in states])
        self.count = torch.as_tensor(np.stack([s.count[0] for s in states]), device=dev).to(torch.int64)
        self.b_kv = t([s.b_kv[0] for s in states]) if kind == "csa" else None
        self.b_z = t([s.b_z[0] for s in states]) if kind == "csa" else None
        self.ape = torch.as_tensor(ape, device=dev).to(self.dt)
        self.norm_w = torch.as_tensor(norm_w, device=dev).to(self.dt)
        d = self.d = cache.shape[-1]
        cos, sin = ref.rope_cos_sin(np.arange(cache.shape[1]) * self.m)
        self.cos, self.sin = (torch.as_tensor(c, device=dev).to(self.dt) for c in (cos, sin))
        self.had = torch.as_tensor(ref.hadamard_matrix(d) / math.sqrt(d), device=dev).to(self.dt) \
            if hadamard else None

    def step(self, kv, z, pos):
        torch, B = self.torch, kv.shape[0]
        c = self.count
        w = self.a_kv.shape[-1]
        at = c.view(B, 1, 1).expand(B, 1, w)
        self.a_kv.scatter_(1, at, kv.to(self.dt).unsqueeze(1))
        self.a_z.scatter_(1, at, (z.to(self.dt) + self.ape[c]).unsqueeze(1))
        c += 1
        d = self.d
        if self.kind == "csa":
            vals = torch.cat([self.b_kv, self.a_kv[..., d:]], 1)
            scores = torch.cat([self.b_z, self.a_z[..., d:]], 1)
        else:
            vals, scores = self.a_kv, self.a_z
        pooled = (torch.softmax(scores, 1) * vals).sum(1)
        flush = (pos + 1) % self.m == 0
        e = ((pos + 1) // self.m - 1).clamp(min=0).to(torch.int64)
        y = self._finish(pooled, e)
        row = torch.where(flush, e, torch.full_like(e, self.cache.shape[1] - 1))
        self.cache.scatter_(1, row.view(B, 1, 1).expand(B, 1, d), y.unsqueeze(1).to(self.cache.dtype))
        fl = flush.view(B, 1, 1)
        if self.kind == "csa":
            self.b_kv.copy_(torch.where(fl, self.a_kv[..., :d], self.b_kv))
            self.b_z.copy_(torch.where(fl, self.a_z[..., :d], self.b_z))
        self.a_kv.masked_fill_(fl, 0.0)
        self.a_z.masked_fill_(fl, ref.Z_EMPTY)
        c.masked_fill_(flush, 0)

    def _finish(self, pooled, e):
        """RMSNorm, RoPE on the last ROPE_DIM dims (interleaved pairs) at
        entry e's position, the indexer's Hadamard rotation."""
        torch = self.torch
        y = rms(torch, pooled, self.norm_w, ref.RMS_EPS)
        r = ref.ROPE_DIM
        ev, od = y[:, -r::2], y[:, -r + 1::2]
        cos, sin = self.cos[e], self.sin[e]
        rot = torch.stack([ev * cos - od * sin, od * cos + ev * sin], -1).flatten(-2)
        y = torch.cat([y[:, :-r], rot], -1)
        return y @ self.had if self.had is not None else y

    def tensors(self):
        return [t for t in (self.a_kv, self.a_z, self.count, self.b_kv, self.b_z, self.cache) if t is not None]


# ---- the demo ------------------------------------------------------------------------------
class LayerDemo:
    """Weights, caches, static step buffers and the two steps (rawkv,
    baseline) at one size. gpu: CUDA tensors, else CPU tensors (the rawkv
    ops run their numpy reference)."""

    def __init__(self, a, shape: Shape, batch: int, context: int, steps: int, gpu: bool, say, ready=None):
        """ready: called once the caches' host rows are drawn, before the
        first rawkv launch (the GPU run waits there for its kernels, which
        compile meanwhile in another thread)."""
        import torch
        self.torch, self.shape, self.B, self.gpu, self.say = torch, shape, batch, gpu, say
        dev = self.dev = "cuda" if gpu else "cpu"
        self.base = torch.bfloat16 if gpu else torch.float64
        self.rng = np.random.default_rng(a.seed)
        self.seed = a.seed
        # the caches first: drawing their rows is host work (seconds at the
        # Flash size) that a cold start overlaps with compiling; no rawkv launch
        say(f"caches: {batch} requests x {context} tokens (pools, states, window)")
        self.dec = cache_demo.Decoder(self.rng, [context] * batch, steps, shape.topk, shape.epb, device=dev,
                                      tensors=True, layout=a.layout, step_rows=False)
        if ready is not None:
            ready()
        gen = torch.Generator(device=dev).manual_seed(a.seed)
        self.w = Weights(torch, shape, gen, dev, self.base, say)
        self.context = context
        self._buffers()

    # -- buffers ---------------------------------------------------------------------------
    def _buffers(self):
        torch, s, B, dev = self.torch, self.shape, self.B, self.dev
        bf = dict(dtype=torch.bfloat16, device=dev)
        W = s.window
        self.x = torch.zeros(B, s.hidden, **bf)
        self.k_hca = self.dec.k_hca
        self.n_kv = s.topk + self.k_hca + W
        self.mask = torch.zeros(B, 1, 1, self.n_kv, dtype=torch.bool, device=dev)
        self.win_slot = torch.zeros(B, dtype=torch.int32, device=dev)
        self.win_idx = torch.full((B, W), -1, dtype=torch.int32, device=dev)
        self.win_pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self.errors = torch.zeros(2, dtype=torch.int32, device=dev)      # window ops, MoE offsets
        from .kvcache import new_layout_cache
        self.win_cache = new_layout_cache("model1", B, W, device=dev)
        # rawkv's outputs, written in place (a captured step allocates nothing through rawkv)
        self.out = {"h": torch.empty(B, 1, sum(s.proj_widths.values()), **bf),
                    "q": torch.empty(B, 1, s.heads * D, **bf),
                    "oa": torch.empty(B, s.groups, s.wo_rank, **bf),
                    "attn": torch.empty(B, 1, s.hidden, **bf),
                    "win": torch.empty(B, W, D, **bf),
                    "gu": torch.empty(B * s.top, 2 * s.inter, **bf),
                    "dn": torch.empty(B * s.top, s.hidden, **bf)}
        u8, f32 = dict(dtype=torch.uint8, device=dev), dict(dtype=torch.float32, device=dev)
        R, H, I = B * s.top, s.hidden, s.inter
        self.out["xq"] = (torch.empty(B, H // 2, **u8), torch.empty(B, H // 16, **u8), torch.empty(B, **f32),
                          torch.empty(B, **f32))
        self.out["stage"] = (torch.empty(B, H // 2, **u8), torch.empty(B, H // 64, dtype=torch.int32, device=dev),
                             torch.empty(B, s.top, dtype=torch.int64, device=dev), torch.empty(B, s.top, **f32))
        self.out["a"] = (torch.empty(R, I // 2, **u8), torch.empty(R, I // 16, **u8), torch.empty(R, **f32))
        self.one = torch.ones(1, dtype=torch.float32, device=dev)
        # the baseline's cache: entries in BF16 (float64 on CPU) plus a spare row each
        n = lambda k: max(self.dec.total) // M[k] + 2  # noqa: E731
        z = dict(dtype=self.base, device=dev)
        self.t_cache = {"csa": torch.zeros(B, n("csa"), D, **z), "hca": torch.zeros(B, n("hca"), D, **z),
                        "idx": torch.zeros(B, n("csa"), DI, **z), "win": torch.zeros(B, W, D, **z)}

    # -- prefill ---------------------------------------------------------------------------
    def prefill(self):
        """The prompts' entries into both caches (rawkv: compress_prefill +
        state_seed; baseline: the numpy reference's BF16 entries and seeded
        states), and the last `window` tokens' rows into both windows."""
        torch, dec, B, L, W = self.torch, self.dec, self.B, self.context, self.shape.window
        self.say(f"prefill: rawkv pools ({B} x {L} tokens)")
        dec.prefill()
        self.say("prefill: the baseline's BF16 entries (numpy reference)")
        comps = {}
        for k, lay in dec.layers.items():
            st, ist = [], []
            for i in range(B):
                kv, z = dec.toks[k][i]
                idx = (dec.itoks[i][0], dec.itoks[i][1], lay.iape, lay.inw) if k == "csa" else None
                _, ent, keys = ref.reference_prefill(k, kv, z, lay.ape, lay.nw, index=idx)
                self.t_cache[k][i, : len(ent)] = torch.as_tensor(ent).to(self.base)
                st.append(_seeded(k, D, kv, z, lay.ape))
                if k == "csa":
                    self.t_cache["idx"][i, : len(keys)] = torch.as_tensor(keys).to(self.base)
                    ist.append(_seeded(k, DI, *dec.itoks[i], lay.iape))
            comps[k] = TorchCompressor(torch, k, lay.ape, lay.nw, st, self.t_cache[k])
            if k == "csa":
                comps["idx"] = TorchCompressor(torch, k, lay.iape, lay.inw, ist, self.t_cache["idx"], hadamard=True)
        self.comps = comps
        # the window: the prompt's last W tokens (synthetic rows, RMS-normed)
        n = min(W, L)
        rows = rms(torch, torch.as_tensor(self.rng.standard_normal((B, n, D)), dtype=torch.float32))
        pos = np.arange(L - n, L)
        slots = (np.arange(B)[:, None] * W + pos % W).astype(np.int32)
        from .kvcache import model1_window_insert
        model1_window_insert(self.win_cache, rows.reshape(-1, D).bfloat16().to(self.dev),
                             torch.as_tensor(slots.reshape(-1)).to(self.dev), page_size=W, errors=self.errors[:1])
        self.t_cache["win"][:, torch.as_tensor(pos % W)] = rows.bfloat16().to(self.base).to(self.dev)

    # -- host side of a step -----------------------------------------------------------------
    def prepare(self, t):
        """Before step t: the pools' bookkeeping (the cache demo's), the
        window's slot and rows, the attention mask, a new hidden state."""
        torch, dec, B, W, put = self.torch, self.dec, self.B, self.shape.window, self.dec.put
        p = dec.prepare_meta(t)
        put(self.win_slot, (np.arange(B) * W + p % W).astype(np.int32))
        put(self.win_pos, (p % W).astype(np.int64))
        filled = np.arange(W)[None, :] <= p[:, None]          # window records written so far
        put(self.win_idx, np.where(filled, np.arange(B)[:, None] * W + np.arange(W), -1).astype(np.int32))
        ids = np.asarray(dec.ids.cpu())
        nh = np.asarray(dec.n_hca.cpu())
        mask = np.concatenate([ids >= 0, np.arange(self.k_hca)[None, :] < nh[:, None], filled], 1)
        put(self.mask, mask[:, None, None, :])
        # step t's hidden state depends on (seed, t) only: prepare(t) may run twice (warm-up)
        x = np.random.default_rng([self.seed, t]).standard_normal((B, self.shape.hidden)).astype(np.float32)
        self.x.copy_(torch.from_numpy(x).to(self.dev))

    # -- the two steps ---------------------------------------------------------------------
    def _split(self, h):
        out, at = {}, 0
        for name, width in self.shape.proj_widths.items():
            out[name] = h[:, at: at + width]
            at += width
        return out

    def step_rawkv(self):
        """The layer's decode step on rawkv; returns the output (B, hidden) BF16."""
        import rawkv.fused as F
        import rawkv.gemm as G
        from .kvcache import model1_gather, model1_window_insert
        from .nvfp4 import QuantizedActivation
        torch, s, B, o, w, dec = self.torch, self.shape, self.B, self.out, self.w, self.dec
        xq = F.rmsnorm_quantize(self.x, w.norm_attn, out=o["xq"])
        act = QuantizedActivation(xq.q.view(B, 1, -1), xq.sf.view(B, 1, -1), xq.gs.view(B, 1))
        p = self._split(G.grouped_linear(act, w.fp4["w_in"], out=o["h"]).view(B, -1))
        for k, kv, z in (("csa", "csa_kv", "csa_z"), ("hca", "hca_kv", "hca_z")):
            dec.x_kv[k].copy_(p[kv])
            dec.x_z[k].copy_(p[z])
        dec.xi_kv.copy_(p["idx_kv"])
        dec.xi_z.copy_(p["idx_z"])
        model1_window_insert(self.win_cache, rms(torch, p["win"]), self.win_slot, page_size=s.window,
                             errors=self.errors[:1])
        csa, hca = dec.step()
        win = model1_gather(self.win_cache, self.win_idx, page_size=s.window, out=o["win"], errors=self.errors[:1])
        self.rows_rawkv = {"csa": csa, "hca": hca, "win": win}
        q = G.grouped_linear(p["q_a"].unsqueeze(1), w.fp4["wq_b"], out=o["q"])
        att = self._attention(q, torch.cat([csa, hca, win], 1))
        oa = G.grouped_linear(att.reshape(B, s.groups, -1), w.fp4["wo_a"], out=o["oa"])
        h1 = self.x + G.grouped_linear(oa.reshape(B, 1, -1), w.fp4["wo_b"], out=o["attn"]).view(B, -1)
        hn = rms(torch, h1, w.norm_ffn)
        ids, wts = route(torch, hn, w.router, s.top)
        self.ids_rawkv = ids
        st = F.moe_stage(hn, ids, wts, out=o["stage"])
        order, tok, offsets, _ = sort_rows(torch, ids, s.experts)
        xs = QuantizedActivation(st.q.index_select(0, tok), st.sf.view(torch.uint8).index_select(0, tok), self.one)
        gu = G.moe_linear(xs, w.fp4["gate_up"], offsets, out=o["gu"], errors=self.errors[1:])
        a = F.swiglu_quantize(gu, out=o["a"])
        dn = G.moe_linear(a, w.fp4["down"], offsets, out=o["dn"], errors=self.errors[1:])
        return (h1.float() + combine(torch, dn, order, st.topk_weights, torch.float32)).to(torch.bfloat16)

    def step_base(self):
        """The same step in plain torch (dtype self.base); returns (B, hidden)."""
        torch, s, B, w, dec, tc = self.torch, self.shape, self.B, self.w.base, self.dec, self.t_cache
        x = self.x.to(self.base)
        hn = rms(torch, x, self.w.norm_attn)
        p = self._split(hn @ w["w_in"][0].t())
        pos = dec.pos.to(torch.int64)
        self.comps["csa"].step(p["csa_kv"], p["csa_z"], pos)
        self.comps["idx"].step(p["idx_kv"], p["idx_z"], pos)
        self.comps["hca"].step(p["hca_kv"], p["hca_z"], pos)
        tc["win"].scatter_(1, self.win_pos.view(B, 1, 1).expand(B, 1, D), rms(torch, p["win"]).unsqueeze(1))
        ids = dec.ids.to(torch.int64).clamp(min=0)
        csa = tc["csa"].gather(1, ids.unsqueeze(-1).expand(B, s.topk, D))
        q = p["q_a"] @ w["wq_b"][0].t()
        self.rows_base = {"csa": csa, "hca": tc["hca"][:, : self.k_hca], "win": tc["win"]}   # rows_cos's
        att = self._attention(q, torch.cat([csa, tc["hca"][:, : self.k_hca], tc["win"]], 1))
        oa = torch.einsum("bgk,gnk->bgn", att.reshape(B, s.groups, -1), w["wo_a"])
        h1 = x + oa.reshape(B, -1) @ w["wo_b"][0].t()
        hn = rms(torch, h1, self.w.norm_ffn)
        ids, wts = route(torch, hn, self.w.router, s.top)
        self.ids_base = ids
        order, tok, offsets, expert = sort_rows(torch, ids, s.experts)
        xs = hn.index_select(0, tok)
        gu = self._experts(xs, w["gate_up"], offsets, expert)
        g = gu.view(gu.shape[0], -1, 2, 8)                     # swiglu_quantize's de-interleave (granularity 8)
        a = (torch.nn.functional.silu(g[:, :, 0].float()) * g[:, :, 1].float()).to(self.base).flatten(1)
        dn = self._experts(a, w["down"], offsets, expert)
        acc = torch.float64 if self.base == torch.float64 else torch.float32
        return h1.to(acc) + combine(torch, dn, order, wts, acc)

    def _attention(self, q, kv):
        """torch SDPA: the heads are the query rows of one KV head (B, 1, n, D)."""
        torch, B = self.torch, self.B
        o = torch.nn.functional.scaled_dot_product_attention(
            q.view(B, 1, self.shape.heads, D), kv.unsqueeze(1).to(q.dtype), kv.unsqueeze(1).to(q.dtype),
            attn_mask=self.mask)
        return o.reshape(B, -1)

    def _experts(self, x, w, offsets, expert):
        """Expert rows x (R, K) sorted by expert -> (R, N): torch._grouped_mm
        where it runs (CUDA BF16), else each row's expert weight gathered."""
        torch = self.torch
        if self.gpu and getattr(self, "grouped_mm", True) and hasattr(torch, "_grouped_mm"):
            try:
                return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:])
            except Exception as exc:  # noqa: BLE001 - reported, then the gather form
                self.say(f"baseline: torch._grouped_mm unavailable ({type(exc).__name__}); "
                         "gathering each row's expert weight instead")
                self.grouped_mm = False
        return torch.bmm(w.index_select(0, expert), x.unsqueeze(-1)).squeeze(-1)

    # -- state, for the eager warm-up before capture ---------------------------------------------
    def state_tensors(self):
        """Every tensor a step writes that outlives it (restored after the
        eager warm-up run, so the captured steps start from the prefill)."""
        dec = self.dec
        ts = [self.win_cache, self.errors, *self.t_cache.values()]
        for c in self.comps.values():
            ts += c.tensors()
        for obj in (*dec.pools.values(), *dec.states.values(), dec.istate):
            ts += [t for t in obj.torch_buffers().values() if t is not None]
        return ts

    def errors_total(self) -> int:
        dec = self.dec
        return int(self.errors.sum()) + sum(x.read_errors() for x in (*dec.pools.values(), *dec.states.values(),
                                                                       dec.istate))

    def bytes_read(self, ids, fp4: bool, layout: str) -> float:
        """Bytes a step reads from weights and KV rows (activations not
        counted): FP4 weights and the pool's entry bytes for rawkv, BF16
        for the baseline; experts: those the step's routing touched."""
        s, k = self.shape, self.shape.weights()
        per = FP4_BYTES if fp4 else 2
        dense = sum(g * n * kk for name, (g, n, kk) in k.items() if name not in ("gate_up", "down"))
        touched = len(np.unique(np.asarray(ids.cpu())))
        expert = (k["gate_up"][1] * k["gate_up"][2] + k["down"][1] * k["down"][2]) * touched
        entry = cache_demo.entry_bytes(layout, "fp8", s.epb)[0] if fp4 else 2 * D
        win = 584 if fp4 else 2 * D
        kv = self.B * ((s.topk + self.k_hca) * entry + s.window * win)
        return (dense + expert) * per + s.experts * s.hidden * 4 + kv


def _seeded(kind, d, kv, z, ape):
    """A one-slot reference decode state after admission (state_seed)."""
    st = ref.DecodeStateRef.create(kind, 1, d)
    ref.state_seed(st, 0, kv, z, ape=ape)
    return st


def rows_cos(torch, demo) -> dict:
    """source (SOURCES) -> the cosine of the KV rows rawkv's last step
    gathered (demo.rows_rawkv) against the baseline's (demo.rows_base), over
    the rows the step's attention mask lets through, all of them flattened
    (None where it lets none through). On a GPU both are the graphs' static
    tensors: read after the replays."""
    mask = demo.mask.view(demo.B, -1)
    out, at = {}, 0
    for k in SOURCES:
        got, want = demo.rows_rawkv[k], demo.rows_base[k]
        n = want.shape[1]
        assert got.shape == want.shape, (k, got.shape, want.shape)
        sel = mask[:, at: at + n]
        at += n
        out[k] = _cos(torch, got[sel], want[sel]) if bool(sel.any()) else None
    assert at == mask.shape[1]
    return out


def rows_line(base: str, steps: int, cos: dict) -> tuple:
    """(ok, the report line) of the per-source row cosines `cos` (source ->
    the steps' values): ok when each source's mean is >= ROWS_FLOOR (NaN
    is not; a source no step attended to has nothing to hold)."""
    parts, bad = [], []
    for k, name in SOURCES.items():
        cs = cos[k]
        if not cs:
            parts.append(f"{name} no rows")
            continue
        mean = float(np.mean(cs))
        if not mean >= ROWS_FLOOR:
            bad.append(name)
        of = "" if len(cs) == steps else f" ({len(cs)} of {steps} steps)"
        parts.append(f"{name} min {float(np.min(cs)):.6f} mean {mean:.6f}{of}")
    tag = "ok: each mean" if not bad else f"BELOW: {', '.join(bad)}; each mean must be"
    return not bad, (f"KV rows attended vs the {base} step's (cosine per source, the rows the attention mask lets "
                     f"through): {', '.join(parts)} ({tag} >= {ROWS_FLOOR}) over {steps} steps")


def _routing_differs(a, b) -> int:
    """Expert choices (token, expert) of one routing missing from the other."""
    a, b = (np.sort(np.asarray(t.cpu()), 1) for t in (a, b))
    return sum(len(set(x) - set(y)) for x, y in zip(a, b))


def _cos(torch, a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp(min=1e-300))


def _say(msg: str) -> None:
    print(f"  ... {msg}", file=sys.stderr, flush=True)


def main(a) -> int:
    """python -m rawkv demo for parsed (and checked) arguments: on device 0
    when the GPU path can run there, else on CPU with the runtime's reason."""
    try:
        import torch  # noqa: F401 - the layer demo's tensors, on CPU too
    except ImportError:
        print("python -m rawkv demo: error: the layer demo needs PyTorch (pip install torch); "
              "python -m rawkv demo --cache runs with numpy alone", file=sys.stderr)
        return 2
    # files=(): no kernel compiled yet; the GPU run warms its own instances after its size check
    return run(a, *cache_demo.runtime_or_reason(a.cpu, files=()))


def run(a, rt, why: str | None) -> int:
    """The layer demo for parsed arguments: on the GPU when `rt` (the
    runtime) is given, else on CPU (`why`: the reason, for the first line)."""
    import torch
    gpu = rt is not None
    shape = FLASH if gpu else TINY
    batch = a.batch or (8 if gpu else 2)
    context = a.context or (4096 if gpu else 300)
    steps = a.steps or (20 if gpu else 2)
    if gpu:
        print(f"rawkv demo: GPU {rt.name} ({rt.arch}): rawkv kernels, each step one CUDA graph replay")
    else:
        print(f"rawkv demo: CPU MODE (the numpy reference at the {shape.name} size, not the kernels; "
              f"baseline in float64): {why}")
    try:
        check_fits(shape, batch, context, steps, torch.cuda.mem_get_info()[0] if gpu else None)
    except MemoryError as exc:
        print(f"python -m rawkv demo: error: {exc}", file=sys.stderr)
        return 2
    print(f"config: {shape.describe()}; batch {batch}, context {context} tokens, {steps} steps; pools {a.layout} "
          f"(CSA, HCA), window MODEL1")
    print("step: RMSNorm + NVFP4 quantize -> input projections (FP4 GEMM) -> compressor decode (CSA + indexer "
          "keys, HCA) + window insert -> gathers (CSA top-k, HCA dense, window) -> attention: torch SDPA over "
          "the gathered entries (not a rawkv kernel) -> wo_a (grouped FP4 GEMM) -> wo_b (FP4 GEMM) -> MoE "
          "(routing, moe_stage, gate_up FP4 GEMM, swiglu_quantize, down FP4 GEMM, combine)")
    base = "BF16" if gpu else "float64"
    print(f"baseline: the same step in plain torch, {base} weights (the values rawkv holds in NVFP4), "
          f"activations and cache")
    if not gpu:
        return _steps(a, shape, batch, context, steps, gpu, base, None)
    wanted = kernel_instances(rt, shape, batch, a.layout, context, steps)
    from .runtime import instances_for
    _say(f"kernels: the {len(wanted)} instances this run launches (of {len(instances_for(rt.arch))} rawkv "
         f"declares for {rt.arch}), compiled in parallel threads or loaded from the disk cache")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rawkv-demo-warmup")
    try:
        warming = pool.submit(rt.warmup, instances=wanted)
        with rt.recording() as seen:
            code = _steps(a, shape, batch, context, steps, gpu, base, warming.result)
    finally:
        pool.shutdown(wait=True)
    note = instances_note(wanted, seen)
    if note:
        print(note, file=sys.stderr)
    return code


def _steps(a, shape, batch, context, steps, gpu, base, ready) -> int:
    """The run after the header: caches, weights, prefill, the steps of both
    paths, the report lines; `ready` as LayerDemo takes it."""
    import torch
    demo = LayerDemo(a, shape, batch, context, steps, gpu, _say, ready)
    demo.prefill()
    times = {"rawkv": [], base: []}
    cos_out, cos_upd, differ = [], [], 0
    cos_rows = {k: [] for k in SOURCES}
    if gpu:
        steps_fn = _captured(demo, base)
    else:
        steps_fn = {"rawkv": demo.step_rawkv, base: demo.step_base}
    _say(f"running {steps} steps")
    for t in range(steps):
        demo.prepare(t)
        x = demo.x.clone()
        outs = {}
        for name, fn in steps_fn.items():
            outs[name], us = _timed(torch, fn, gpu)
            times[name].append(us)
        got, want = outs["rawkv"], outs[base]
        cos_out.append(_cos(torch, got, want))
        cos_upd.append(_cos(torch, got.double() - x.double(), want.double() - x.double()))
        differ += _routing_differs(demo.ids_rawkv, demo.ids_base)
        for k, c in rows_cos(torch, demo).items():
            if c is not None:
                cos_rows[k].append(c)
    errs = demo.errors_total()
    mb = {n: demo.bytes_read(ids, n == "rawkv", a.layout) / 2 ** 20
          for n, ids in (("rawkv", demo.ids_rawkv), (base, demo.ids_base))}
    print(f"bytes read per step (weights + KV rows, activations not counted): rawkv {mb['rawkv']:.1f} MiB, "
          f"BF16 {mb[base]:.1f} MiB ({mb[base] / mb['rawkv']:.2f}x)")
    rows_ok, line = rows_line(base, steps, cos_rows)
    print(line)
    ok = bool(np.mean(cos_upd) >= COS_FLOOR)       # False for NaN too
    print(f"accuracy vs the {base} step: cosine of the layer output min {min(cos_out):.6f} mean "
          f"{np.mean(cos_out):.6f}; of its update (output - input) min {min(cos_upd):.6f} mean "
          f"{np.mean(cos_upd):.6f} ({'ok' if ok else 'BELOW'}: mean >= {COS_FLOOR}) over {steps} steps; "
          f"routing: {differ} of {steps * batch * shape.top} expert choices differ from the {base} step's")
    r, b = float(np.median(times["rawkv"])), float(np.median(times[base]))
    how = "one CUDA graph replay each, CUDA events" if gpu else "wall clock, the numpy reference: not a speed"
    counted = f"kernel errors {errs}" if gpu else f"skipped rows {errs} (counted by the numpy reference ops)"
    print(f"time: rawkv {r:.1f} us per step, {base} {b:.1f} us per step ({how}; median of {steps}); {counted}")
    return 0 if ok and rows_ok and errs == 0 else 1


def _timed(torch, fn, gpu):
    """(fn's result, microseconds): CUDA events around a replay, or wall clock."""
    if not gpu:
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e6
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    out = fn()
    e1.record()
    e1.synchronize()
    return out, e0.elapsed_time(e1) * 1e3


def warm_run(demo: LayerDemo) -> None:
    """One eager run of each step, its writes then undone (state_tensors),
    so the next step is still step 0: the warm-up before capture (lazy
    library state; the baseline's grouped-GEMM choice is made here)."""
    keep = [(t, t.clone()) for t in demo.state_tensors()]
    demo.step_rawkv()
    demo.step_base()
    for t, c in keep:
        t.copy_(c)


def _captured(demo: LayerDemo, base: str) -> dict:
    """Both steps captured in a CUDA graph each, after warm_run. Returns
    name -> replay function returning the step's (static) output."""
    import torch
    _say("warm-up: one eager run of each step (its writes undone), then CUDA graph capture")
    demo.prepare(0)
    torch.cuda.synchronize()
    warm_run(demo)
    torch.cuda.synchronize()
    fns = {}
    for name, step in (("rawkv", demo.step_rawkv), (base, demo.step_base)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        fns[name] = (lambda g=g, out=out: (g.replay(), out)[1])
    torch.cuda.synchronize()
    return fns
