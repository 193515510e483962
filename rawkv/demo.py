"""python -m rawkv demo [--cpu] [--small] [--steps N] [--seed S]

A DeepSeek-V4-shaped decode simulation of one CSA layer (m = 4, 512-dim
entries + 128-dim indexer keys) and one HCA layer (m = 128):

  1. a few requests of different prompt lengths are prefilled with
     compress_prefill (one launch per request and layer) and admitted to
     decoding with state_seed (the decode state gets the tail the prompt
     leaves; this also resets a reused slot);
  2. every decode step (state_append -> compress_decode -> csa_rotate /
     hca_reset -> gather_topk (CSA) / gather_dense_batch (HCA)) is captured
     ONCE in a CUDA graph and replayed; between replays only host
     bookkeeping runs (pool.prepare_step, the step's token rows, positions,
     flush masks and top-k ids copied into the graph's static buffers);
  3. it prints the cache's bytes per token against a BF16 cache, the
     accuracy of the gathered entries against the BF16 path (the numpy
     reference's BF16 entries before quantization), and the time per step.

When the GPU path cannot run (or with --cpu) the same ops run the numpy
reference on CPU pools at a small size, and the first line says why, in the
words of the runtime's GpuUnavailableError (a CPU-only torch, no CUDA device,
CuPy or cuda-python missing).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .reference import kvcache as ref

M = {"csa": ref.CSA_RATIO, "hca": ref.HCA_RATIO}
D, DI, ROPE = ref.HEAD_DIM, ref.INDEX_HEAD_DIM, ref.ROPE_DIM
ENTRY_BYTES = (D - ROPE) + 4 + 2 * ROPE          # E4M3 codes + FP32 scale + BF16 RoPE dims
INDEX_BYTES = DI // 2 + DI // 16                 # NVFP4 codes + UE4M3 scales
BF16_ENTRY, BF16_INDEX = 2 * D, 2 * DI


def _bytes_lines(kinds):
    lines = []
    for kind in kinds:
        m = M[kind]
        rk = ENTRY_BYTES + (INDEX_BYTES if kind == "csa" else 0)
        bf = BF16_ENTRY + (BF16_INDEX if kind == "csa" else 0)
        lines.append(f"bytes/token {kind.upper()} (m={m}): rawkv {rk / m:.2f} vs BF16 {bf / m:.2f} "
                     f"({bf / rk:.2f}x smaller)")
    return lines


def _cos_rows(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return num / np.where(den == 0, 1, den)


class _Layer:
    """Weights of one compressor layer (plus the CSA indexer's)."""

    def __init__(self, rng, kind):
        self.kind, self.m = kind, M[kind]
        coff = 2 if kind == "csa" else 1
        self.w = coff * D
        self.ape = (0.5 * rng.standard_normal((self.m, self.w))).astype(np.float32)
        self.nw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
        if kind == "csa":
            self.iape = (0.5 * rng.standard_normal((self.m, 2 * DI))).astype(np.float32)
            self.inw = (1 + 0.1 * rng.standard_normal(DI)).astype(np.float32)


def _tokens(rng, n, w):
    """Synthetic projections: kv rows with a shared low-rank structure (so the
    entries are not pure noise) and gate scores of unit scale."""
    base = rng.standard_normal((n, 8)).astype(np.float32) @ rng.standard_normal((8, w)).astype(np.float32)
    kv = (0.5 * base + rng.standard_normal((n, w))).astype(np.float32)
    z = rng.standard_normal((n, w)).astype(np.float32)
    return kv, z


def _count(least: int):
    """An argparse type: an int >= least (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {v}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", action="store_true", help="run the numpy reference on CPU")
    p.add_argument("--small", action="store_true", help="small sizes (the CPU default)")
    p.add_argument("--steps", type=_count(1), default=None,
                   help="decode steps, >= 1 (default 300 on a GPU, 130 with --small or on CPU)")
    p.add_argument("--seed", type=_count(0), default=0, help="seed of the synthetic data, >= 0")


def run(a) -> int:
    """The demo for parsed arguments: on the GPU when the runtime can run
    there, else on CPU with the runtime's own reason on the first line."""
    from .errors import GpuUnavailableError
    from .runtime import warmup

    why, rt = "--cpu given", None
    if not a.cpu:
        try:
            rt = warmup(0)
        except GpuUnavailableError as exc:
            why = str(exc)
    if rt is not None:
        return _run(a, rt)
    print(f"rawkv demo: CPU MODE (the numpy reference at a small size, not the kernels): {why}")
    return _run(a, None)


def _run(a, rt) -> int:
    from . import kvcache as kvc

    gpu = rt is not None
    rng = np.random.default_rng(a.seed)
    small = a.small or not gpu
    if small:
        prompts = [250, 389]                       # partial windows: state_seed carries them
        steps = a.steps if a.steps is not None else 130
        topk, epb = 64, 16
    else:
        prompts = [8192, 4096, 2048, 6144]
        steps = a.steps if a.steps is not None else 300
        topk, epb = 512, 64
    B = len(prompts)
    total = [L + steps for L in prompts]
    device = "cuda" if gpu else "cpu"
    if gpu:
        import torch
        print(f"rawkv demo: GPU {rt.name} ({rt.arch}): kernels, decode steps in one CUDA graph")
    print(f"config: {B} requests, prompts {prompts} tokens, {steps} decode steps; layers CSA (m=4, "
          f"head_dim {D}, indexer {DI}, top-k {topk}) and HCA (m=128, dense)")

    layers = {k: _Layer(rng, k) for k in ("csa", "hca")}
    toks = {k: [_tokens(rng, n, layers[k].w) for n in total] for k in layers}
    itoks = [_tokens(rng, n, 2 * DI) for n in total]

    def dev(x):
        if not gpu:
            return x
        return torch.from_numpy(np.ascontiguousarray(x)).cuda()

    pools, states, istate = {}, {}, None
    for k in layers:
        max_e = max(total) // M[k] + 1
        mb = -(-max_e // epb)
        pools[k] = kvc.PagedKVPool(k, B * mb, epb, B, mb, device=device)
        states[k] = kvc.DecodeState(k, B, device=device)
    istate = kvc.DecodeState("csa", B, DI, device=device)
    slots = [pools["csa"].add_request() for _ in range(B)]
    for k in layers:
        if k != "csa":
            assert [pools[k].add_request() for _ in range(B)] == slots

    # ---- prefill ----
    W = {k: dev(layers[k].nw) for k in layers}
    APE = {k: dev(layers[k].ape) for k in layers}
    IW, IAPE = dev(layers["csa"].inw), dev(layers["csa"].iape)
    t0 = time.perf_counter()
    for i, (s, L) in enumerate(zip(slots, prompts)):
        for k, lay in layers.items():
            pools[k].prepare_step([s], [L - 1])
            kv, z = dev(toks[k][i][0][:L]), dev(toks[k][i][1][:L])
            idx = None
            if k == "csa":
                idx = (dev(itoks[i][0][:L]), dev(itoks[i][1][:L]), IAPE, IW)
                # the indexer's decode state: what its prompt rows leave
                kvc.state_seed(istate, s, idx[0], idx[1], ape=IAPE)
            kvc.compress_prefill(pools[k], kv, z, APE[k], W[k], s, index=idx)
            # admission: the slot's decode state is reset and seeded with the tail
            # of the prompt (CSA: the b-half of the last window; any partial window)
            kvc.state_seed(states[k], s, kv, z, ape=APE[k])
    if gpu:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0

    # ---- static step buffers ----
    sl = dev(np.asarray(slots, np.int32))
    valid = dev(np.ones(B, bool))
    pos = dev(np.zeros(B, np.int32))
    flush = {k: dev(np.zeros(B, bool)) for k in layers}
    x_kv = {k: dev(np.zeros((B, layers[k].w), np.float32)) for k in layers}
    x_z = {k: dev(np.zeros((B, layers[k].w), np.float32)) for k in layers}
    xi_kv, xi_z = dev(np.zeros((B, 2 * DI), np.float32)), dev(np.zeros((B, 2 * DI), np.float32))
    ids = dev(np.full((B, topk), -1, np.int32))
    n_csa = dev(np.zeros(B, np.int32))
    n_hca = dev(np.zeros(B, np.int32))
    k_hca = max(total) // M["hca"]
    if gpu:
        out_csa = torch.empty((B, topk, D), dtype=torch.bfloat16, device="cuda")
        out_hca = torch.empty((B, k_hca, D), dtype=torch.bfloat16, device="cuda")
    gathered = {}

    def step_body():
        for k in layers:
            kvc.state_append(states[k], x_kv[k], x_z[k], valid, sl, ape=APE[k])
        kvc.state_append(istate, xi_kv, xi_z, valid, sl, ape=IAPE)
        kvc.compress_decode(pools["csa"], states["csa"], W["csa"], valid, sl, pos, index=(istate, IW))
        kvc.compress_decode(pools["hca"], states["hca"], W["hca"], valid, sl, pos)
        kvc.csa_rotate(states["csa"], flush["csa"], sl)
        kvc.csa_rotate(istate, flush["csa"], sl)
        kvc.hca_reset(states["hca"], flush["hca"], sl)
        if gpu:
            kvc.gather_topk(pools["csa"], sl, ids, n_entries=n_csa, out=out_csa)
            kvc.gather_dense_batch(pools["hca"], sl, n_hca, out=out_hca)
        else:
            gathered["csa"] = kvc.gather_topk(pools["csa"], sl, ids, n_entries=n_csa)
            gathered["hca"] = kvc.gather_dense_batch(pools["hca"], sl, n_hca, max_entries=k_hca)

    def put(dst, arr):
        if gpu:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)), non_blocking=False)
        else:
            dst[...] = arr

    def prepare(t):
        p_ = np.asarray([L + t for L in prompts], np.int32)
        for k in layers:
            pools[k].prepare_step(slots, p_)
            put(flush[k], (p_ + 1) % M[k] == 0)
            put(x_kv[k], np.stack([toks[k][i][0][p_[i]] for i in range(B)]))
            put(x_z[k], np.stack([toks[k][i][1][p_[i]] for i in range(B)]))
        put(xi_kv, np.stack([itoks[i][0][p_[i]] for i in range(B)]))
        put(xi_z, np.stack([itoks[i][1][p_[i]] for i in range(B)]))
        put(pos, p_)
        nc = (p_ + 1) // M["csa"]
        put(n_csa, nc.astype(np.int32))
        put(n_hca, ((p_ + 1) // M["hca"]).astype(np.int32))
        sel = np.full((B, topk), -1, np.int32)     # the most recent top-k entries ("indexer")
        for i in range(B):
            lo = max(0, nc[i] - topk)
            sel[i, : nc[i] - lo] = np.arange(lo, nc[i])
        put(ids, sel)

    times = []
    if gpu:
        prepare(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        # capture does not run the body: step 0 runs as the first replay
        with torch.cuda.graph(g):
            step_body()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for t in range(steps):
            if t:
                prepare(t)
            ev0.record()
            g.replay()
            ev1.record()
            ev1.synchronize()
            times.append(ev0.elapsed_time(ev1) * 1e3)
        torch.cuda.synchronize()
    else:
        for t in range(steps):
            prepare(t)
            t1 = time.perf_counter()
            step_body()
            times.append((time.perf_counter() - t1) * 1e6)

    # ---- accuracy against the BF16 path (reference entries before quantization) ----
    # rows skipped by the pools' and states' bounds checks (0 for a correct run)
    errs = sum(x.read_errors() for x in (*pools.values(), *states.values(), istate))
    cos = {"csa": [], "hca": [], "index": []}
    last_csa = _np_rows(out_csa if gpu else gathered["csa"])
    last_hca = _np_rows(out_hca if gpu else gathered["hca"])
    for i, s_ in enumerate(slots):
        n_tok = total[i]
        for k, lay in layers.items():
            kv, z = toks[k][i]
            idx = None
            if k == "csa":
                idx = (itoks[i][0][:n_tok], itoks[i][1][:n_tok], lay.iape, lay.inw)
            _, ent, keys = kvc.reference_prefill(k, kv[:n_tok], z[:n_tok], lay.ape, lay.nw, index=idx)
            if k == "csa":
                n = ent.shape[0]
                lo = max(0, n - topk)
                cos["csa"] += list(_cos_rows(last_csa[i, : n - lo], ent[lo:n]))
                got = _np_rows(kvc.gather_index_keys(pools["csa"], s_, n))
                cos["index"] += list(_cos_rows(got, keys))
            else:
                n = ent.shape[0]
                cos["hca"] += list(_cos_rows(last_hca[i, :n], ent))
    ms = np.median(times)
    unit = "us per step (one CUDA graph replay, CUDA events)" if gpu else \
        "us per step (numpy reference, wall clock)"
    for line in _bytes_lines(("csa", "hca")):
        print(line)
    ok = True
    for name, key, floor in (("CSA entries (top-k gather)", "csa", 0.999),
                             ("HCA entries (dense gather)", "hca", 0.999),
                             ("CSA indexer keys (NVFP4)", "index", 0.98)):
        c = np.asarray(cos[key])
        good = c.size > 0 and c.min() >= floor
        ok &= bool(good)
        print(f"accuracy {name} vs BF16 path: cosine min {c.min():.6f} mean {c.mean():.6f} over "
              f"{c.size} rows ({'ok' if good else 'BELOW'} >= {floor})")
    counted = f"kernel errors {errs}" if gpu else \
        f"skipped rows {errs} (counted by the numpy reference ops; no kernel ran)"
    print(f"time: {ms:.1f} {unit}; prefill {prefill_s * 1e3:.0f} ms; {counted}")
    return 0 if ok and errs == 0 else 1


def _np_rows(x):
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)
