"""python -m rawkv demo --cache [--cpu] [--small] [--steps N] [--seed S] [--layout L] [--index-layout I]

A DeepSeek-V4-shaped decode simulation of one CSA layer (m = 4, 512-dim
entries + 128-dim indexer keys) and one HCA layer (m = 128):

  1. a few requests of different prompt lengths are prefilled with
     compress_prefill (one launch per request and layer) and admitted to
     decoding with state_seed (the decode state gets the tail the prompt
     leaves; the pools, to which the states are attached, empty a slot's
     state whenever the slot changes owner);
  2. every decode step (state_append -> compress_decode -> csa_rotate /
     hca_reset -> gather_topk (CSA) / gather_dense_batch (HCA)) is captured
     ONCE in a CUDA graph and replayed; between replays only host
     bookkeeping runs (pool.prepare_step, the step's token rows, positions,
     flush masks and top-k ids copied into the graph's static buffers);
  3. it prints the cache's bytes per token against a BF16 cache and against
     the pool's other layout, the accuracy of the gathered entries against
     the BF16 path (the numpy reference's BF16 entries before quantization),
     and the time per step.

The pools hold the entries in --layout: "model1" (the pages FlashMLA's
sparse decode and DeepGEMM's paged indexer logits read: MODEL1_FP8Sparse
entries, FP8, MXFP4 or MXFP8 indexer keys: --index-layout, fp8 by default) or
"rawkv" (rawkv's own: an FP32 scale per entry, NVFP4 indexer keys; giving
--index-layout with it is a usage error, not ignored).

--steps is at most 10,000: every token's synthetic rows are kept on the host
and the whole run is checked against the reference at the end, so the run is
sized up front instead of running out of memory part way.

When the GPU path cannot run (or with --cpu) the same ops run the numpy
reference on CPU pools at a small size, and the first line says why, in the
words of the runtime's GpuUnavailableError (a CPU-only torch, no CUDA device,
CuPy or cuda-python missing).

Without --cache, python -m rawkv demo runs one DeepSeek-V4-Flash-shaped
decoder layer's decode step (this cache step inside it, with the NVFP4
producers, the FP4 GEMMs and the MoE) against the same step in plain BF16
torch, for --batch requests at --context tokens: rawkv/demo_layer.py, whose
docstring lists the step.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .reference import kvcache as ref
from .reference.kvcache import layouts as L

M = {"csa": ref.CSA_RATIO, "hca": ref.HCA_RATIO}
D, DI, ROPE = ref.HEAD_DIM, ref.INDEX_HEAD_DIM, ref.ROPE_DIM
BF16_ENTRY, BF16_INDEX = 2 * D, 2 * DI
#: the layouts the demo can run the pools in (PagedKVPool layout=)
LAYOUTS = ("model1", "rawkv")
DEFAULT_LAYOUT = "model1"


def entry_bytes(layout: str, index_layout: str | None, epb: int) -> tuple:
    """Bytes one compressed entry and its CSA indexer key take in a pool of
    `layout` with pages of `epb` entries (page padding included)."""
    if layout == "rawkv":
        return (D - ROPE) + 4 + 2 * ROPE, DI // 2 + DI // 16     # FP8 + FP32 scale + BF16 RoPE; NVFP4
    key = ref.INDEX_LAYOUTS[index_layout or "fp8"]
    return L.MODEL1.page_bytes(epb) / epb, key.page_bytes(epb) / epb


def _bytes_lines(kinds, layout, index_layout, epb):
    """Bytes per token of each layer in `layout`, against BF16 and against
    the other layout."""
    other = "rawkv" if layout == "model1" else "model1"
    lines = []
    for kind in kinds:
        m = M[kind]
        size = {lay: entry_bytes(lay, index_layout, epb) for lay in LAYOUTS}
        tot = {lay: e + (k if kind == "csa" else 0) for lay, (e, k) in size.items()}
        bf = BF16_ENTRY + (BF16_INDEX if kind == "csa" else 0)
        lines.append(f"bytes/token {kind.upper()} (m={m}): {layout} {tot[layout] / m:.2f} vs BF16 {bf / m:.2f} "
                     f"({bf / tot[layout]:.2f}x smaller), vs the {other} layout {tot[other] / m:.2f}")
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


#: --steps at most: the demo keeps every token's synthetic rows on the host
#: (kv and z of both layers and the indexer, float32: TOKEN_BYTES per token and
#: request) and checks the whole run against the reference at the end, so a
#: run is sized up front: 10,000 steps take ~0.9 GB at the full size (the
#: prompts add 0.3 GB), where 10^8 steps ran out of memory after 25 s.
MAX_STEPS = 10_000
TOKEN_BYTES = 2 * 4 * (2 * D + D + 2 * DI)


def _count(least: int, most: int | None = None):
    """An argparse type: an int in [least, most] (argparse names the option
    in its error)."""
    want = f"an integer >= {least}" if most is None else f"an integer from {least} to {most:,}"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if v < least or (most is not None and v > most):
            raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", action="store_true", help="run the numpy reference on CPU")
    p.add_argument("--small", action="store_true", help="--cache: small sizes (the CPU default)")
    p.add_argument("--steps", type=_count(1, MAX_STEPS), default=None,
                   help=f"decode steps, 1 to {MAX_STEPS:,} (default 20 on a GPU, 2 on CPU; --cache: 300 on "
                        "a GPU, 130 with --small or on CPU, every token's rows kept on the host)")
    p.add_argument("--seed", type=_count(0), default=0, help="seed of the synthetic data, >= 0")
    p.add_argument("--layout", choices=LAYOUTS, default=DEFAULT_LAYOUT,
                   help="the pools' layout: model1 (FlashMLA MODEL1_FP8Sparse entries, DeepGEMM indexer "
                        "keys) or rawkv (FP32 scale per entry, NVFP4 keys); default %(default)s")
    p.add_argument("--index-layout", choices=tuple(ref.INDEX_LAYOUTS), default=None,
                   help="--cache: model1's indexer keys: fp8 (Hopper and Blackwell), mxfp4 or mxfp8 "
                        "(Blackwell); default fp8. "
                        "Only with --layout model1 (the rawkv layout's keys are NVFP4)")


def check_arguments(a, error) -> None:
    """The options' combination, checked after parsing: --index-layout
    belongs to --layout model1 (given with rawkv it would be ignored, so it
    is refused through `error`, argparse's one-line usage error); fills in
    its default. (The layer demo's options: rawkv.demo_layer.check_arguments.)"""
    if a.layout != "model1" and a.index_layout is not None:
        error(f"argument --index-layout: not allowed with --layout {a.layout} (its indexer keys "
              "are NVFP4; --index-layout picks model1's)")
    if a.layout == "model1" and a.index_layout is None:
        a.index_layout = "fp8"


#: the kernel files the cache demo launches: a cold start compiles only these
#: (in parallel), not every rawkv kernel
CACHE_FILES = ("kv_cache.cu", "kv_compress.cu", "kv_layouts.cu")


def runtime_or_reason(cpu: bool, files=None):
    """(the runtime of device 0, warmed up for `files` (default: every
    kernel; () none, for a caller that warms up its own instances), None),
    or (None, why the GPU path does not run: "--cpu given" or the runtime's
    GpuUnavailableError)."""
    from .errors import GpuUnavailableError
    from .runtime import warmup

    if cpu:
        return None, "--cpu given"
    try:
        return warmup(0, files), None
    except GpuUnavailableError as exc:
        return None, str(exc)


def run(a) -> int:
    """The demo for parsed arguments: on the GPU when the runtime can run
    there, else on CPU with the runtime's own reason on the first line."""
    rt, why = runtime_or_reason(a.cpu, CACHE_FILES)
    if rt is not None:
        return _run(a, rt)
    print(f"rawkv demo: CPU MODE (the numpy reference at a small size, not the kernels): {why}")
    return _run(a, None)


class Decoder:
    """The demo's two layers at one size: weights, token rows, pools and
    decode states (prefill), and the decode step's static buffers
    (prepare / step). `device`: "cuda" (CUDA pools, tensors), "cpu" (CPU
    pools; numpy arrays, or CPU torch tensors with tensors=True: what
    torch.compile traces, tests/support/library_samples_kvcache.py)."""

    def __init__(self, rng, prompts, steps, topk, epb, *, device="cpu", tensors=False, layout=DEFAULT_LAYOUT,
                 index_layout=None, step_rows=True):
        """step_rows: also draw the decode steps' token rows (False: only the
        prompts'; the caller writes each step's rows into x_kv / x_z / xi_kv /
        xi_z itself, as the layer demo does from its projection)."""
        from . import kvcache as kvc

        self.kvc, self.prompts, self.topk = kvc, list(prompts), topk
        self.torch = device != "cpu" or tensors
        self.gpu = device != "cpu"
        B = self.B = len(prompts)
        self.total = [L + steps for L in prompts]
        self.layers = {k: _Layer(rng, k) for k in ("csa", "hca")}
        rows = self.total if step_rows else self.prompts
        self.toks = {k: [_tokens(rng, n, self.layers[k].w) for n in rows] for k in self.layers}
        self.itoks = [_tokens(rng, n, 2 * DI) for n in rows]
        self.pools, self.states = {}, {}
        for k in self.layers:
            max_e = max(self.total) // M[k] + 1
            mb = -(-max_e // epb)
            self.pools[k] = kvc.PagedKVPool(k, B * mb, epb, B, mb, device=device, layout=layout,
                                            index_layout=index_layout)
            self.states[k] = kvc.DecodeState(k, B, device=device)
        self.istate = kvc.DecodeState("csa", B, DI, device=device)
        # attached once: a pool empties its states' slot when the slot changes owner
        self.pools["csa"].attach(self.states["csa"], self.istate)
        self.pools["hca"].attach(self.states["hca"])
        self.slots = [self.pools["csa"].add_request() for _ in range(B)]
        for k in self.layers:
            if k != "csa":
                assert [self.pools[k].add_request() for _ in range(B)] == self.slots
        arr = self.array
        self.W = {k: arr(self.layers[k].nw) for k in self.layers}
        self.APE = {k: arr(self.layers[k].ape) for k in self.layers}
        self.IW, self.IAPE = arr(self.layers["csa"].inw), arr(self.layers["csa"].iape)
        # ---- static step buffers ----
        self.sl = arr(np.asarray(self.slots, np.int32))
        self.valid = arr(np.ones(B, bool))
        self.pos = arr(np.zeros(B, np.int32))
        self.flush = {k: arr(np.zeros(B, bool)) for k in self.layers}
        self.x_kv = {k: arr(np.zeros((B, self.layers[k].w), np.float32)) for k in self.layers}
        self.x_z = {k: arr(np.zeros((B, self.layers[k].w), np.float32)) for k in self.layers}
        self.xi_kv, self.xi_z = arr(np.zeros((B, 2 * DI), np.float32)), arr(np.zeros((B, 2 * DI), np.float32))
        self.ids = arr(np.full((B, topk), -1, np.int32))
        self.n_csa = arr(np.zeros(B, np.int32))
        self.n_hca = arr(np.zeros(B, np.int32))
        self.k_hca = max(self.total) // M["hca"]
        self.out = None           # the gathers' outputs: static buffers on the GPU, new arrays on CPU
        if self.gpu:
            import torch
            self.out = {"csa": torch.empty((B, topk, D), dtype=torch.bfloat16, device="cuda"),
                        "hca": torch.empty((B, self.k_hca, D), dtype=torch.bfloat16, device="cuda")}

    def array(self, x):
        """x (numpy) as the step's array type."""
        if not self.torch:
            return x
        import torch
        t = torch.from_numpy(np.ascontiguousarray(x))
        return t.cuda() if self.gpu else t

    def put(self, dst, arr):
        if self.torch:
            import torch
            dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)), non_blocking=False)
        else:
            dst[...] = arr

    def prefill(self):
        """Every prompt through compress_prefill, then admission (state_seed)."""
        kvc, arr = self.kvc, self.array
        for i, (s, L) in enumerate(zip(self.slots, self.prompts)):
            for k in self.layers:
                self.pools[k].prepare_step([s], [L - 1])
                kv, z = arr(self.toks[k][i][0][:L]), arr(self.toks[k][i][1][:L])
                idx = None
                if k == "csa":
                    idx = (arr(self.itoks[i][0][:L]), arr(self.itoks[i][1][:L]), self.IAPE, self.IW)
                    # the indexer's decode state: what its prompt rows leave
                    kvc.state_seed(self.istate, s, idx[0], idx[1], ape=self.IAPE)
                kvc.compress_prefill(self.pools[k], kv, z, self.APE[k], self.W[k], s, index=idx)
                # admission: the slot's decode state is reset and seeded with the tail
                # of the prompt (CSA: the b-half of the last window; any partial window)
                kvc.state_seed(self.states[k], s, kv, z, ape=self.APE[k])

    def prepare(self, t):
        """Host side, before step t: blocks, and the step's inputs into the static buffers."""
        p_ = self.prepare_meta(t)
        B, put = self.B, self.put
        for k in self.layers:
            put(self.x_kv[k], np.stack([self.toks[k][i][0][p_[i]] for i in range(B)]))
            put(self.x_z[k], np.stack([self.toks[k][i][1][p_[i]] for i in range(B)]))
        put(self.xi_kv, np.stack([self.itoks[i][0][p_[i]] for i in range(B)]))
        put(self.xi_z, np.stack([self.itoks[i][1][p_[i]] for i in range(B)]))

    def prepare_meta(self, t):
        """Host side, before step t, all but the token rows: blocks, positions,
        flush masks, entry counts and the top-k ids (the most recent entries).
        Returns the step's positions (B,) int32."""
        B, put, M_ = self.B, self.put, M
        p_ = np.asarray([L + t for L in self.prompts], np.int32)
        for k in self.layers:
            self.pools[k].prepare_step(self.slots, p_)
            put(self.flush[k], (p_ + 1) % M_[k] == 0)
        put(self.pos, p_)
        nc = (p_ + 1) // M_["csa"]
        put(self.n_csa, nc.astype(np.int32))
        put(self.n_hca, ((p_ + 1) // M_["hca"]).astype(np.int32))
        sel = np.full((B, self.topk), -1, np.int32)     # the most recent top-k entries ("indexer")
        for i in range(B):
            lo = max(0, nc[i] - self.topk)
            sel[i, : nc[i] - lo] = np.arange(lo, nc[i])
        put(self.ids, sel)
        return p_

    def step(self):
        """One decode step of both layers (what the GPU demo captures in one
        CUDA graph): state_append -> compress_decode -> csa_rotate /
        hca_reset -> gather_topk (CSA) / gather_dense_batch (HCA). Returns
        the gathered rows (CSA, HCA)."""
        kvc, pools, states, istate = self.kvc, self.pools, self.states, self.istate
        sl, valid = self.sl, self.valid
        for k in self.layers:
            kvc.state_append(states[k], self.x_kv[k], self.x_z[k], valid, sl, ape=self.APE[k])
        kvc.state_append(istate, self.xi_kv, self.xi_z, valid, sl, ape=self.IAPE)
        kvc.compress_decode(pools["csa"], states["csa"], self.W["csa"], valid, sl, self.pos,
                            index=(istate, self.IW))
        kvc.compress_decode(pools["hca"], states["hca"], self.W["hca"], valid, sl, self.pos)
        kvc.csa_rotate(states["csa"], self.flush["csa"], sl)
        kvc.csa_rotate(istate, self.flush["csa"], sl)
        kvc.hca_reset(states["hca"], self.flush["hca"], sl)
        if self.out is not None:
            return (kvc.gather_topk(pools["csa"], sl, self.ids, n_entries=self.n_csa, out=self.out["csa"]),
                    kvc.gather_dense_batch(pools["hca"], sl, self.n_hca, out=self.out["hca"]))
        return (kvc.gather_topk(pools["csa"], sl, self.ids, n_entries=self.n_csa),
                kvc.gather_dense_batch(pools["hca"], sl, self.n_hca, max_entries=self.k_hca))


def _run(a, rt) -> int:
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
    if gpu:
        import torch
        print(f"rawkv demo: GPU {rt.name} ({rt.arch}): kernels, decode steps in one CUDA graph")
    index_layout = a.index_layout if a.layout == "model1" else "nvfp4"
    print(f"config: {B} requests, prompts {prompts} tokens, {steps} decode steps; layers CSA (m=4, "
          f"head_dim {D}, indexer {DI}, top-k {topk}) and HCA (m=128, dense); pool layout {a.layout} "
          f"(indexer keys {index_layout}, {epb} entries per page)")

    dec = Decoder(rng, prompts, steps, topk, epb, device="cuda" if gpu else "cpu", layout=a.layout,
                  index_layout=a.index_layout)
    kvc, layers, toks, itoks = dec.kvc, dec.layers, dec.toks, dec.itoks
    slots, total = dec.slots, dec.total
    pools, states, istate = dec.pools, dec.states, dec.istate

    # ---- prefill ----
    t0 = time.perf_counter()
    dec.prefill()
    if gpu:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0

    times = []
    if gpu:
        dec.prepare(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        # capture does not run the body: step 0 runs as the first replay
        with torch.cuda.graph(g):
            dec.step()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for t in range(steps):
            if t:
                dec.prepare(t)
            ev0.record()
            g.replay()
            ev1.record()
            ev1.synchronize()
            times.append(ev0.elapsed_time(ev1) * 1e3)
        torch.cuda.synchronize()
        last_csa, last_hca = dec.out["csa"], dec.out["hca"]
    else:
        for t in range(steps):
            dec.prepare(t)
            t1 = time.perf_counter()
            last_csa, last_hca = dec.step()
            times.append((time.perf_counter() - t1) * 1e6)

    # ---- accuracy against the BF16 path (reference entries before quantization) ----
    # rows skipped by the pools' and states' bounds checks (0 for a correct run)
    errs = sum(x.read_errors() for x in (*pools.values(), *states.values(), istate))
    cos = {"csa": [], "hca": [], "index": []}
    last_csa, last_hca = _np_rows(last_csa), _np_rows(last_hca)
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
    for line in _bytes_lines(("csa", "hca"), a.layout, a.index_layout, epb):
        print(line)
    ok = True
    for name, key, floor in (("CSA entries (top-k gather)", "csa", 0.999),
                             ("HCA entries (dense gather)", "hca", 0.999),
                             (f"CSA indexer keys ({index_layout.upper()})", "index", 0.98)):
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
