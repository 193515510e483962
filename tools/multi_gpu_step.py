"""The decode step on several GPUs (issue 15): the worker that
tests/test_multi_gpu.py starts as torchrun would, and the run it is checked
against.

    NCCL_NVLS_ENABLE=0 RAWKV_CACHE_DIR=<empty dir> \\
        python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tools/multi_gpu_step.py --seed 7 --out result.json

Every rank owns GPU LOCAL_RANK and its own pools and decode states. The
ranks meet at a barrier and then warm up at the same moment against the one
kernel cache directory they share. Each rank then runs the demo's decode
step (rawkv/demo.py: state_append -> compress_decode -> csa_rotate /
hca_reset -> gather_topk, gather_dense_batch, gather_index_keys_batch),
captured once in a CUDA graph and replayed every step, on inputs derived
from (seed, rank). An all_gather brings every rank's bytes to rank 0. Rank 0
recomputes each rank's inputs and runs the same steps eagerly on its own GPU,
then compares byte for byte. It writes --out (JSON) and exits 1 on any
difference.

decode_run() is also what the single-process tests call, on any device,
with any current device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

KINDS = ("csa", "hca")
M = {"csa": 4, "hca": 128}
D, DI = 512, 128
PROMPTS = (250, 389)      # partial windows: state_seed carries them (as the demo's small run)
TOPK, EPB = 16, 16
STEPS = 12                # crosses an HCA flush (position 255) and three CSA flushes per request


def make_inputs(seed: int, rank: int, steps: int = STEPS) -> dict:
    """Weights and token rows of one rank, a function of (seed, rank) only."""
    rng = np.random.default_rng([seed, rank])
    total = [L + steps for L in PROMPTS]
    f32 = np.float32

    def layer(m, w, d):
        return {"ape": (0.5 * rng.standard_normal((m, w))).astype(f32),
                "nw": (1 + 0.1 * rng.standard_normal(d)).astype(f32),
                "tok": [(rng.standard_normal((n, w)).astype(f32),
                         (1.5 * rng.standard_normal((n, w))).astype(f32)) for n in total]}
    inp = {k: layer(M[k], (2 if k == "csa" else 1) * D, D) for k in KINDS}
    inp["index"] = layer(M["csa"], 2 * DI, DI)
    inp["steps"] = steps
    return inp


def decode_run(inp: dict, device, *, graph: bool):
    """Prefill, then inp["steps"] decode steps on `device` (eager, or one
    captured CUDA graph replayed per step). Returns (bytes, errors): a
    uint8 tensor on `device` of every step's gathered rows followed by the
    final pools and decode states, and the kernels' error count.

    Eager mode never changes the current device: each op takes its device
    from its tensors. Graph mode makes `device` current for the capture and
    the replays (torch captures on the current device's stream)."""
    import torch

    from rawkv import kvcache as kvc

    dev = torch.device(device)
    steps = inp["steps"]
    B = len(PROMPTS)
    total = [L + steps for L in PROMPTS]

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    pools, states = {}, {}
    for k in KINDS:
        mb = -(-(max(total) // M[k] + 1) // EPB)
        pools[k] = kvc.PagedKVPool(k, B * mb, EPB, B, mb, device=dev)
        states[k] = kvc.DecodeState(k, B, device=dev)
    istate = kvc.DecodeState("csa", B, DI, device=dev)
    pools["csa"].attach(states["csa"], istate)
    pools["hca"].attach(states["hca"])
    slots = [pools["csa"].add_request() for _ in range(B)]
    assert [pools["hca"].add_request() for _ in range(B)] == slots
    W = {k: t(inp[k]["nw"]) for k in KINDS}
    APE = {k: t(inp[k]["ape"]) for k in KINDS}
    IW, IAPE = t(inp["index"]["nw"]), t(inp["index"]["ape"])
    itok = inp["index"]["tok"]

    # ---- prefill and admission (rawkv/demo.py) ----
    for i, (s, L) in enumerate(zip(slots, PROMPTS)):
        for k in KINDS:
            pools[k].prepare_step([s], [L - 1])
            kv, z = t(inp[k]["tok"][i][0][:L]), t(inp[k]["tok"][i][1][:L])
            idx = None
            if k == "csa":
                idx = (t(itok[i][0][:L]), t(itok[i][1][:L]), IAPE, IW)
                kvc.state_seed(istate, s, idx[0], idx[1], ape=IAPE)
            kvc.compress_prefill(pools[k], kv, z, APE[k], W[k], s, index=idx)
            kvc.state_seed(states[k], s, kv, z, ape=APE[k])

    # ---- the step's static buffers ----
    def zeros(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=dev)
    sl = t(np.asarray(slots, np.int32))
    valid = t(np.ones(B, bool))
    pos = zeros(B, torch.int32)
    flush = {k: zeros(B, torch.bool) for k in KINDS}
    x_kv = {k: zeros((B, APE[k].shape[1]), torch.float32) for k in KINDS}
    x_z = {k: zeros((B, APE[k].shape[1]), torch.float32) for k in KINDS}
    xi_kv, xi_z = zeros((B, 2 * DI), torch.float32), zeros((B, 2 * DI), torch.float32)
    ids = torch.full((B, TOPK), -1, dtype=torch.int32, device=dev)
    n_csa, n_hca = zeros(B, torch.int32), zeros(B, torch.int32)
    outs = (torch.empty((B, TOPK, D), dtype=torch.bfloat16, device=dev),
            torch.empty((B, max(total) // M["hca"], D), dtype=torch.bfloat16, device=dev),
            torch.empty((B, max(total) // M["csa"], DI), dtype=torch.bfloat16, device=dev))
    hist = [torch.empty((steps,) + tuple(o.shape), dtype=o.dtype, device=dev) for o in outs]

    def step_body():
        for k in KINDS:
            kvc.state_append(states[k], x_kv[k], x_z[k], valid, sl, ape=APE[k])
        kvc.state_append(istate, xi_kv, xi_z, valid, sl, ape=IAPE)
        kvc.compress_decode(pools["csa"], states["csa"], W["csa"], valid, sl, pos, index=(istate, IW))
        kvc.compress_decode(pools["hca"], states["hca"], W["hca"], valid, sl, pos)
        kvc.csa_rotate(states["csa"], flush["csa"], sl)
        kvc.csa_rotate(istate, flush["csa"], sl)
        kvc.hca_reset(states["hca"], flush["hca"], sl)
        kvc.gather_topk(pools["csa"], sl, ids, n_entries=n_csa, out=outs[0])
        kvc.gather_dense_batch(pools["hca"], sl, n_hca, out=outs[1])
        kvc.gather_index_keys_batch(pools["csa"], sl, n_csa, out=outs[2])

    def put(dst, arr):
        dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)))

    def prepare(step):
        p = np.asarray([L + step for L in PROMPTS], np.int32)
        for k in KINDS:
            pools[k].prepare_step(slots, p)
            put(flush[k], (p + 1) % M[k] == 0)
            put(x_kv[k], np.stack([inp[k]["tok"][i][0][p[i]] for i in range(B)]))
            put(x_z[k], np.stack([inp[k]["tok"][i][1][p[i]] for i in range(B)]))
        put(xi_kv, np.stack([itok[i][0][p[i]] for i in range(B)]))
        put(xi_z, np.stack([itok[i][1][p[i]] for i in range(B)]))
        put(pos, p)
        nc = (p + 1) // M["csa"]
        put(n_csa, nc.astype(np.int32))
        put(n_hca, ((p + 1) // M["hca"]).astype(np.int32))
        sel = np.full((B, TOPK), -1, np.int32)      # the most recent top-k entries
        for i in range(B):
            lo = max(0, nc[i] - TOPK)
            sel[i, : nc[i] - lo] = np.arange(lo, nc[i])
        put(ids, sel)

    def keep(step):
        for h, o in zip(hist, outs):
            h[step].copy_(o)

    if graph:
        with torch.cuda.device(dev):
            prepare(0)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):     # capture does not run the body: step 0 is the first replay
                step_body()
            for step in range(steps):
                if step:
                    prepare(step)
                g.replay()
                keep(step)
            torch.cuda.synchronize()
    else:
        for step in range(steps):
            prepare(step)
            step_body()
            keep(step)

    bufs = list(hist)
    for p in pools.values():
        bufs += [p.fp8, p.scale, p.rope, p.index_q, p.index_sf, p.pages, p.index_pages, p.block_table,
                 p.written]
    for s in (*states.values(), istate):
        bufs += [s.kv_a, s.z_a, s.kv_b, s.z_b, s.count]
    flat = torch.cat([_bytes(torch, b) for b in bufs if b is not None])
    errors = sum(x.read_errors() for x in (*pools.values(), *states.values(), istate))
    return flat, errors


def _bytes(torch, b):
    """The bytes of a buffer as a flat uint8 tensor (a CPU pool's buffers
    are numpy arrays: the CPU dry run of decode_run)."""
    if isinstance(b, np.ndarray):
        b = torch.from_numpy(np.ascontiguousarray(b))
    return b.contiguous().view(torch.uint8).reshape(-1)


def _worker(a) -> int:
    import torch
    import torch.distributed as dist

    import rawkv

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    dist.barrier(device_ids=[local])       # both ranks start warming up together
    t0 = time.time()
    rt = rawkv.warmup(local)
    t1 = time.time()
    warm_stats = dict(rt.stats)            # what the warm-up compiled / loaded / found damaged
    got, errors = decode_run(make_inputs(a.seed, rank, a.steps), f"cuda:{local}", graph=True)
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    info = {"rank": rank, "local_rank": local, "device": got.device.index,
            "current_device": torch.cuda.current_device(), "name": torch.cuda.get_device_name(local),
            "runtime_device": rt.device_index, "arch": rt.arch, "stats": warm_stats,
            "warmup": [t0, t1], "errors": errors, "nbytes": got.numel(),
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "cache_dir": os.environ.get("RAWKV_CACHE_DIR")}
    infos = [None] * world
    dist.all_gather_object(infos, info)
    status = 0
    if rank == 0:
        match, ref_errors = [], []
        for r in range(world):
            want, e = decode_run(make_inputs(a.seed, r, a.steps), f"cuda:{local}", graph=False)
            match.append(bool(torch.equal(every[r], want)))
            ref_errors.append(e)
        distinct = all(not torch.equal(every[0], every[r]) for r in range(1, world))
        result = {"world": world, "ranks": infos, "match": match, "reference_errors": ref_errors,
                  "distinct": distinct, "seed": a.seed, "steps": a.steps}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
        ok = all(match) and distinct and not any(ref_errors) and not any(i["errors"] for i in infos)
        print(f"multi_gpu_step: world {world}, match {match}, distinct {distinct}, errors "
              f"{[i['errors'] for i in infos]}, reference errors {ref_errors}, warm-up stats "
              f"{[i['stats'] for i in infos]}: {'ok' if ok else 'FAILED'}", flush=True)
        status = 0 if ok else 1
    dist.barrier(device_ids=[local])
    dist.destroy_process_group()
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--out", default=None, help="rank 0 writes the result here (JSON)")
    a = p.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        p.error("start it with python -m torch.distributed.run --nproc_per_node N (torchrun)")
    return _worker(a)


if __name__ == "__main__":
    sys.exit(main())
