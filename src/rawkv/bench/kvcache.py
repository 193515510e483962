"""DeepSeek-V4 compressed-KV benchmarks, each beside an all-torch
implementation of the same math written here (timed in the same run):

* decode_step/csa, decode_step/hca: one decode step for 64 requests at 64K
  context replayed as ONE CUDA graph. CSA: flush_write + csa_rotate (entry
  and indexer states) + gather_topk of 2048 entries per request (DeepSeek-V4
  index_topk); HCA: flush_write + hca_reset + gather_dense_batch of
  64K/128 = 512 entries per request. decode_step/*+compress: the same with
  compress_decode (pool the tail state -> finish -> quantize -> scatter) as
  the flush. Baseline: the same step in torch ops, also one CUDA graph.
* compress/csa, compress/hca: prefill compression of 128K tokens of one
  request (float32 rows), compress_prefill vs torch ops.
* kv_gather/topk, kv_gather/dense: gather bandwidth (fewest bytes: codes +
  scale + rope read, BF16 rows written) as a fraction of copy (goal >= 0.70).
* kv_flush: flush_write of 64 entries vs torch.
* The same in the pool's "model1" layout (MODEL1 pages, FP8 indexer-key
  pages; entries named "...@model1"), timed in the same run beside the
  entries above (the pool's "rawkv" layout) and beside an all-torch
  implementation that writes / reads the same pages: compress/<kind>@model1
  (128K tokens), decode_step/<kind>@model1 (+compress) as one graph replay
  for 64 requests at 64K context, kv_gather/<topk|dense>@model1 (pool
  gathers to BF16: 584 page bytes read per entry), kv_gather/flashmla
  (kvcache_indices + model1_gather, the path of an engine without FlashMLA),
  kv_window_insert (model1_window_insert of one decode step's 64 tokens and
  of an 8192-token prefill chunk).

Entry point: run(rt, results, quick=False) (called by rawkv.bench.cli).
"""
from __future__ import annotations

import math

from . import timing

D, DI, ROPE = 512, 128, 64
NOPE = D - ROPE


# ---------------------------------------------------------------------------
# all-torch implementation of the same math (the baseline)
# ---------------------------------------------------------------------------
def torch_pool_rows(kv, z, ape, m, kind):
    """Softmax pooling of whole windows: (T, coff*d) -> (T//m, d) float32."""
    import torch
    T, w = kv.shape
    n = T // m
    if ape is not None:
        z = z[: n * m] + ape.repeat(n, 1)
    kv, z = kv[: n * m].float().view(n, m, w), z[: n * m].float().view(n, m, w)
    if kind == "hca":
        return (torch.softmax(z, dim=1) * kv).sum(1)
    d = w // 2
    bkv = torch.zeros((n, m, d), device=kv.device)
    bz = torch.full((n, m, d), float("-inf"), device=kv.device)
    bkv[1:], bz[1:] = kv[:-1, :, :d], z[:-1, :, :d]
    vals = torch.cat([bkv, kv[:, :, d:]], 1)
    sc = torch.cat([bz, z[:, :, d:]], 1)
    return (torch.softmax(sc, dim=1) * vals).sum(1)


def torch_finish(x, weight, tab, ids, hadamard=None, eps=1e-6):
    """RMSNorm, RoPE (interleaved, from the table), [Hadamard], BF16."""
    import torch
    r = torch.rsqrt(x.double().square().mean(-1, keepdim=True) + eps).float()
    y = (x * r) * weight
    cs, sn = tab[ids, 0], tab[ids, 1]
    ev, od = y[:, -ROPE::2], y[:, -ROPE + 1::2]
    rot = torch.stack([ev * cs - od * sn, od * cs + ev * sn], -1).flatten(1)
    y = torch.cat([y[:, :-ROPE], rot], 1)
    if hadamard is not None:
        y = (y.double() @ hadamard).float()
    return y.to(torch.bfloat16)


def torch_fp8_entry(ent):
    import torch
    x = ent[:, :NOPE].float()
    amax = x.abs().amax(1)
    s = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    codes = (x / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, s, ent[:, NOPE:]


_E2M1_EDGES = None


def torch_nvfp4(key):
    """One-level NVFP4 of (n, 128) BF16 keys -> (q (n, 64), sf (n, 8))."""
    import torch
    global _E2M1_EDGES
    x = key.float().view(key.shape[0], -1, 16)
    sf = (x.abs().amax(-1) / 6.0).to(torch.float8_e4m3fn)
    es = sf.float()
    v = (x / torch.where(es == 0, torch.ones_like(es), es)[..., None]).abs()
    if _E2M1_EDGES is None or _E2M1_EDGES.device != v.device:
        _E2M1_EDGES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=v.device)
    idx = torch.bucketize(v, _E2M1_EDGES)       # ties: approximate (baseline timing only)
    code = (idx | ((x < 0).to(torch.int64) << 3)).to(torch.uint8).view(key.shape[0], -1)
    q = code[:, 0::2] | (code[:, 1::2] << 4)
    return q, sf.view(torch.uint8)


def torch_scatter(pool, slots, ids, codes, scale, rope, iq=None, isf=None):
    epb = pool.entries_per_block
    blk = pool.block_table[slots.long(), (ids // epb).long()].long()
    row = (ids % epb).long()
    pool.fp8[blk, row] = codes
    pool.scale[blk, row] = scale
    pool.rope[blk, row] = rope
    if iq is not None:
        pool.index_q[blk, row] = iq
        pool.index_sf[blk, row] = isf


def torch_gather(pool, slots, ids, out):
    """out (B, K, D) bf16 = decoded entries ids (B, K) of requests slots (B,)."""
    import torch
    epb = pool.entries_per_block
    blk = torch.gather(pool.block_table[slots.long()], 1, (ids // epb).long()).long()
    row = (ids % epb).long()
    codes = pool.fp8[blk, row].view(torch.float8_e4m3fn).float()
    out[..., :NOPE] = (codes * pool.scale[blk, row][..., None]).to(torch.bfloat16)
    out[..., NOPE:] = pool.rope[blk, row]


def torch_model1(ent):
    """MODEL1 records of (n, 512) BF16 entries: (codes (n, 448) uint8,
    UE8M0 scale bytes (n, 7), rope (n, 64) BF16) with the DeepSeek / vLLM
    rule (baseline timing only: the NaN rule is left out)."""
    import torch
    x = ent[:, :NOPE].float().view(-1, NOPE // 64, 64)
    e = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-4) / 448.0))
    codes = (x * torch.exp2(-e)[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, NOPE)
    return codes, (e + 127).to(torch.uint8), ent[:, NOPE:]


def torch_fp8_key(key):
    """DeepGEMM SM90 FP8 key records of (n, 128) BF16 keys: (codes, float32
    power-of-two scale) with vLLM's rule."""
    import torch
    x = key.float()
    e = torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0))
    return (x * torch.exp2(-e)).to(torch.float8_e4m3fn).view(torch.uint8), torch.exp2(e)[:, 0]


def _page_views(pool):
    """(data (nb, P, 576), scales (nb, P, 8), key codes (nb, P, 128), key
    scales (nb, P) float32) views of a "model1" pool's pages."""
    import torch
    P = pool.entries_per_block
    pg, ip = pool.pages, pool.index_pages
    data = pg[:, :P * 576].view(-1, P, 576)
    scl = pg[:, P * 576:P * 584].view(-1, P, 8)
    if ip is None:
        return data, scl, None, None
    return data, scl, ip[:, :P * 128].view(-1, P, 128), ip[:, P * 128:P * 132].view(torch.float32).view(-1, P)


def torch_page_scatter(pool, slots, ids, codes, sc, rope, kq=None, ks=None):
    import torch
    P = pool.entries_per_block
    blk = pool.block_table[slots.long(), (ids // P).long()].long()
    off = (ids % P).long()
    data, scl, kd, kscl = _page_views(pool)
    data[blk, off] = torch.cat([codes, rope.contiguous().view(torch.uint8)], 1)
    scl[blk, off, :NOPE // 64] = sc
    if kq is not None:
        kd[blk, off] = kq
        kscl[blk, off] = ks


def torch_page_gather(pool, slots, ids, out):
    """out (B, K, D) bf16 = decoded MODEL1 entries ids (B, K) of requests slots."""
    import torch
    P = pool.entries_per_block
    blk = torch.gather(pool.block_table[slots.long()], 1, (ids // P).long()).long()
    off = (ids % P).long()
    data, scl, _, _ = _page_views(pool)
    rec = data[blk, off]
    codes = rec[..., :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(*ids.shape, NOPE // 64, 64)
    s = torch.exp2(scl[blk, off, :NOPE // 64].float() - 127.0)
    out[..., :NOPE] = (codes * s[..., None]).view(*ids.shape, NOPE).to(torch.bfloat16)
    out[..., NOPE:] = rec[..., NOPE:].contiguous().view(torch.bfloat16)


def torch_reset(state, mask, slots):
    """hca_reset: a emptied (kv 0, z -inf), count 0 where mask."""
    import torch
    s = slots.long()
    mk = mask[:, None, None]
    state.kv_a[s] = torch.where(mk, 0.0, state.kv_a[s])
    state.z_a[s] = torch.where(mk, float("-inf"), state.z_a[s])
    state.count[s] = torch.where(mask, 0, state.count[s])


def torch_rotate(state, mask, slots):
    """csa_rotate: b <- a[:, :, :d], then torch_reset."""
    import torch
    s = slots.long()
    d = state.head_dim
    mk = mask[:, None, None]
    state.kv_b[s] = torch.where(mk, state.kv_a[s, :, :d], state.kv_b[s])
    state.z_b[s] = torch.where(mk, state.z_a[s, :, :d], state.z_b[s])
    torch_reset(state, mask, slots)


def hadamard(n, device):
    """H_n / sqrt(n), float64 (rawkv.reference.kvcache.hadamard_matrix)."""
    import torch
    from rawkv.reference.kvcache import hadamard_matrix
    return torch.from_numpy(hadamard_matrix(n) / math.sqrt(n)).to(device)


# ---------------------------------------------------------------------------
def _fill_pool(pool, B, n_entries):
    """Requests 0..B-1 with n_entries each; random but valid entries."""
    import torch
    for _ in range(B):
        pool.add_request()
    pool.prepare_step(list(range(B)), [n_entries * pool.m - 1] * B)
    g = torch.Generator(device="cuda").manual_seed(0)
    if pool.layout == "model1":
        # bytes below 0x7E: finite E4M3 codes, BF16 RoPE dims and FP32 key
        # scales; scale bytes 2^-127 .. 2^-2
        for buf in (pool.pages, pool.index_pages):
            if buf is not None:
                buf.copy_(torch.randint(0, 126, buf.shape, device="cuda", dtype=torch.uint8, generator=g))
        pool.written[:B].fill_(n_entries)
        pool.marks.fill_(1)
        return
    pool.fp8.copy_(torch.randint(0, 126, pool.fp8.shape, device="cuda", dtype=torch.uint8, generator=g))
    pool.scale.uniform_(0.001, 0.01)
    pool.rope.normal_()
    if pool.index_q is not None:
        pool.index_q.copy_(torch.randint(0, 255, pool.index_q.shape, device="cuda",
                                         dtype=torch.uint8, generator=g))
        pool.index_sf.fill_(0x38)
    # the entries count as written by their requests (as a flush would record
    # them): the gathers bound ids by pool.written and read only marked
    # entries, and would otherwise time the zero-row path
    pool.written[:B].fill_(n_entries)
    pool.marks.fill_(1)


_STEP_BASELINE = "torch ops (same step, one CUDA graph)"


def _decode_step_entries(bench, results, kind, shape, copy, step, torch_step, step_compress,
                         nbytes, compress_nbytes, note, compress_note):
    """decode_step/<kind> and decode_step/<kind>+compress, both against the
    torch step (timed once, between the two)."""
    us = bench.graph_time_us(step)
    base = bench.graph_time_us(torch_step)
    results.append(bench.entry(f"decode_step/{kind}", shape, "bfloat16", us, nbytes, copy,
                               _STEP_BASELINE, base, note=note))
    us2 = bench.graph_time_us(step_compress)
    results.append(bench.entry(f"decode_step/{kind}+compress", shape, "bfloat16", us2,
                               compress_nbytes, copy, _STEP_BASELINE, base, note=compress_note))


# What the shared sections below need to know of a pool layout: the suffix of
# its entries' names, the bytes a gather reads per entry / a key takes, the
# entries per block (decode pools, the prefill pool), and the all-torch steps
# that write and read its pages.
_LAYOUTS = {
    "rawkv": dict(suffix="", entry_bytes=NOPE + 4 + 2 * ROPE, key_bytes=DI // 2 + DI // 16,
                  epb={"csa": 64, "hca": 32}, prefill_epb={"csa": 64, "hca": 64}, entry=torch_fp8_entry, key=torch_nvfp4,
                  scatter=torch_scatter, gather=torch_gather, gather_label="torch advanced indexing",
                  prefill_label="torch ops (softmax pool, RMSNorm, RoPE, quantize, scatter)"),
    "model1": dict(suffix="@model1", entry_bytes=584, key_bytes=132,
                   epb={"csa": 64, "hca": 2},                # vLLM: 256 tokens per page
                   prefill_epb={"csa": 64, "hca": 2},
                   entry=torch_model1, key=torch_fp8_key, scatter=torch_page_scatter,
                   gather=torch_page_gather, gather_label="torch advanced indexing (same pages)",
                   prefill_label="torch ops (softmax pool, RMSNorm, RoPE, MODEL1 / FP8-key quantize, "
                                 "page scatter)"),
}


def _hca_step(bench, results, copy, layout, B, ctx, w, valid, slots, pos, ents):
    """decode_step/hca<suffix> (+compress) and kv_gather/dense<suffix>: 64
    requests at ctx tokens in a pool of `layout`."""
    import torch
    from rawkv import kvcache as kvc
    L = _LAYOUTS[layout]
    dev = "cuda"
    pool, (hs,), n = _decode_inputs("hca", B, ctx, dev, layout)
    ne_h = torch.full((B,), n, dtype=torch.int32, device=dev)
    out_h = torch.empty((B, n, D), dtype=torch.bfloat16, device=dev)
    kvc.compress_decode(pool, hs, w, valid, slots, pos)
    dense_ids = torch.arange(n, dtype=torch.int32, device=dev)[None].repeat(B, 1)
    ids_h = (pos // 128).long()

    def step():
        kvc.flush_write(pool, ents, valid, slots, pos)
        kvc.hca_reset(hs, valid, slots)
        kvc.gather_dense_batch(pool, slots, ne_h, out=out_h)

    def step_compress():
        kvc.compress_decode(pool, hs, w, valid, slots, pos)
        kvc.hca_reset(hs, valid, slots)
        kvc.gather_dense_batch(pool, slots, ne_h, out=out_h)

    def torch_step():
        c, sc, r = L["entry"](ents)
        L["scatter"](pool, slots, ids_h, c, sc, r)
        torch_reset(hs, valid, slots)
        L["gather"](pool, slots, dense_ids, out_h)

    hbytes = B * n * (L["entry_bytes"] + 2 * D)
    _decode_step_entries(bench, results, "hca" + L["suffix"], [B, ctx, n], copy, step, torch_step,
                         step_compress, hbytes, hbytes + B * 128 * D * 8,
                         "flush_write + hca_reset + gather_dense_batch; bytes = gather",
                         "compress_decode + hca_reset + gather_dense_batch; bytes + state read")
    us = bench.cuda_time_us(lambda i: kvc.gather_dense_batch(pool, slots, ne_h, out=out_h))
    base = bench.cuda_time_us(lambda i: L["gather"](pool, slots, dense_ids, out_h))
    results.append(bench.entry("kv_gather/dense" + L["suffix"], [B, n, D], "bfloat16", us, hbytes, copy,
                               L["gather_label"], base))
    del pool, hs, out_h
    torch.cuda.empty_cache()


def _prefill(bench, results, copy, layout, quick, w, iw):
    """compress/<kind><suffix>: prefill compression of 128K tokens of one
    request (float32 rows) into a pool of `layout`, against torch ops."""
    import torch
    from rawkv import kvcache as kvc
    L = _LAYOUTS[layout]
    dev = "cuda"
    T = 32768 if quick else 131072
    for kind, m in (("csa", 4), ("hca", 128)):
        coff = 2 if kind == "csa" else 1
        n = T // m
        epb = L["prefill_epb"][kind]
        pool = kvc.PagedKVPool(kind, n // epb + 1, epb, 1, n // epb + 1, layout=layout, device=dev)
        s0 = pool.add_request()
        pool.prepare_step([s0], [T - 1])
        kv = torch.randn((T, coff * D), device=dev)
        z = torch.randn((T, coff * D), device=dev)
        ape = torch.randn((m, coff * D), device=dev)
        idx = None
        nbytes = 2 * kv.numel() * 4 + n * L["entry_bytes"]
        if kind == "csa":
            idx = (torch.randn((T, 2 * DI), device=dev), torch.randn((T, 2 * DI), device=dev),
                   torch.randn((m, 2 * DI), device=dev), iw)
            nbytes += 2 * T * 2 * DI * 4 + n * L["key_bytes"]
        tab = kvc.rope_table(pool)
        H = hadamard(DI, dev)
        eids = torch.arange(n, device=dev)
        sl0 = torch.zeros(n, dtype=torch.int32, device=dev)

        def torch_prefill(i):
            e = torch_finish(torch_pool_rows(kv, z, ape, m, kind), w, tab, eids)
            c, sc, r = L["entry"](e)
            kq = ks = None
            if idx is not None:
                k = torch_finish(torch_pool_rows(idx[0], idx[1], idx[2], m, "csa"), iw, tab, eids, H)
                kq, ks = L["key"](k)
            L["scatter"](pool, sl0, eids, c, sc, r, kq, ks)

        us = bench.cuda_time_us(lambda i: kvc.compress_prefill(pool, kv, z, ape, w, s0, index=idx), reps=20)
        base = bench.cuda_time_us(torch_prefill, reps=5, warmup=1)
        results.append(bench.entry(f"compress/{kind}{L['suffix']}", [T, coff * D], "float32", us, nbytes,
                                   copy, L["prefill_label"], base, entries=n))
        del pool, kv, z, idx
        torch.cuda.empty_cache()


def run(rt, results, quick=False):
    import torch
    from rawkv import kvcache as kvc
    bench = timing

    copy = timing.copy_GBps()
    dev = "cuda"
    B = 64
    ctx = 16384 if quick else 65536
    topk = 2048
    ebytes = NOPE + 4 + 2 * ROPE                          # stored entry bytes read by a gather

    # ---------------- decode step, CSA ----------------
    n_csa = ctx // 4
    epb = 64
    csa = kvc.PagedKVPool("csa", B * (n_csa // epb + 1), epb, B, n_csa // epb + 1, layout="rawkv", device=dev)
    _fill_pool(csa, B, n_csa)
    st = kvc.DecodeState("csa", B, device=dev)
    ist = kvc.DecodeState("csa", B, DI, device=dev)
    csa.attach(st, ist)
    st.count.fill_(4)
    ist.count.fill_(4)
    st.kv_a.normal_()
    st.z_a.normal_()
    ist.kv_a.normal_()
    ist.z_a.normal_()
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    valid = torch.ones(B, dtype=torch.bool, device=dev)
    pos = torch.full((B,), ctx - 1, dtype=torch.int32, device=dev)
    ents = torch.randn((B, D), device=dev).to(torch.bfloat16)
    keys = torch.randn((B, DI), device=dev).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_csa, device=dev)[:topk] for _ in range(B)]).to(torch.int32)
    ne = torch.full((B,), n_csa, dtype=torch.int32, device=dev)
    out = torch.empty((B, topk, D), dtype=torch.bfloat16, device=dev)
    w = torch.ones(D, device=dev)
    iw = torch.ones(DI, device=dev)
    kvc.compress_decode(csa, st, w, valid, slots, pos, index=(ist, iw))   # table + kernel load

    def step_csa():
        kvc.flush_write(csa, ents, valid, slots, pos, index_keys=keys)
        kvc.csa_rotate(st, valid, slots)
        kvc.csa_rotate(ist, valid, slots)
        kvc.gather_topk(csa, slots, ids, n_entries=ne, out=out)

    def step_csa_compress():
        kvc.compress_decode(csa, st, w, valid, slots, pos, index=(ist, iw))
        kvc.csa_rotate(st, valid, slots)
        kvc.csa_rotate(ist, valid, slots)
        kvc.gather_topk(csa, slots, ids, n_entries=ne, out=out)

    ids_e = (pos // 4).long()

    def torch_step_csa():
        c, s, r = torch_fp8_entry(ents)
        q, sf = torch_nvfp4(keys)
        torch_scatter(csa, slots, ids_e, c, s, r, q, sf)
        torch_rotate(st, valid, slots)
        torch_rotate(ist, valid, slots)
        torch_gather(csa, slots, ids, out)

    gbytes = B * topk * (ebytes + 2 * D)
    _decode_step_entries(bench, results, "csa", [B, ctx, topk], copy, step_csa, torch_step_csa,
                         step_csa_compress, gbytes, gbytes,
                         "flush_write + csa_rotate x2 + gather_topk; bytes = gather",
                         "compress_decode + csa_rotate x2 + gather_topk")
    # gather alone: bandwidth vs copy
    us = bench.cuda_time_us(lambda i: kvc.gather_topk(csa, slots, ids, n_entries=ne, out=out))
    base = bench.cuda_time_us(lambda i: torch_gather(csa, slots, ids, out))
    results.append(bench.entry("kv_gather/topk", [B, topk, D], "bfloat16", us, gbytes, copy,
                               "torch advanced indexing", base))
    # flush alone
    us = bench.cuda_time_us(lambda i: kvc.flush_write(csa, ents, valid, slots, pos, index_keys=keys))
    fbytes = B * (2 * D + 2 * DI + ebytes + DI // 2 + DI // 16)

    def torch_flush(i):
        c, s, r = torch_fp8_entry(ents)
        q, sf = torch_nvfp4(keys)
        torch_scatter(csa, slots, ids_e, c, s, r, q, sf)
    base = bench.cuda_time_us(torch_flush)
    results.append(bench.entry("kv_flush/csa", [B, D], "bfloat16", us, fbytes, copy, "torch ops", base))
    del out, csa, st, ist
    torch.cuda.empty_cache()

    _hca_step(bench, results, copy, "rawkv", B, ctx, w, valid, slots, pos, ents)
    _prefill(bench, results, copy, "rawkv", quick, w, iw)

    run_model1(bench, results, quick, copy)


def _decode_inputs(kind, B, ctx, dev, layout="model1"):
    """A pool of `kind` and `layout` with B requests at ctx tokens, its decode
    states with complete windows, and the step's inputs."""
    from rawkv import kvcache as kvc
    m = 4 if kind == "csa" else 128
    n = ctx // m
    epb = _LAYOUTS[layout]["epb"][kind]
    pool = kvc.PagedKVPool(kind, B * (n // epb + 1), epb, B, n // epb + 1, layout=layout, device=dev)
    _fill_pool(pool, B, n)
    states = [kvc.DecodeState(kind, B, device=dev)] + ([kvc.DecodeState("csa", B, DI, device=dev)]
                                                       if kind == "csa" else [])
    pool.attach(*states)
    for st in states:
        st.count.fill_(m)
        st.kv_a.normal_()
        st.z_a.normal_()
    return pool, states, n


def run_model1(bench, results, quick, copy):
    """The "@model1" entries (module doc)."""
    import torch
    from rawkv import kvcache as kvc
    from rawkv.kvcache import layouts as lay
    dev = "cuda"
    B = 64
    ctx = 16384 if quick else 65536
    topk = 2048
    m1 = 584                                              # page bytes read per MODEL1 entry
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    valid = torch.ones(B, dtype=torch.bool, device=dev)
    pos = torch.full((B,), ctx - 1, dtype=torch.int32, device=dev)
    ents = torch.randn((B, D), device=dev).to(torch.bfloat16)
    keys = torch.randn((B, DI), device=dev).to(torch.bfloat16)
    w, iw = torch.ones(D, device=dev), torch.ones(DI, device=dev)

    # ---------------- decode step, CSA ----------------
    pool, (st, ist), n = _decode_inputs("csa", B, ctx, dev)
    ids = torch.stack([torch.randperm(n, device=dev)[:topk] for _ in range(B)]).to(torch.int32)
    ne = torch.full((B,), n, dtype=torch.int32, device=dev)
    out = torch.empty((B, topk, D), dtype=torch.bfloat16, device=dev)
    idx_out = torch.empty((B, topk), dtype=torch.int32, device=dev)
    kvc.compress_decode(pool, st, w, valid, slots, pos, index=(ist, iw))     # table + kernel load
    ids_e = (pos // 4).long()

    def step():
        kvc.flush_write(pool, ents, valid, slots, pos, index_keys=keys)
        kvc.csa_rotate(st, valid, slots)
        kvc.csa_rotate(ist, valid, slots)
        kvc.gather_topk(pool, slots, ids, n_entries=ne, out=out)

    def step_compress():
        kvc.compress_decode(pool, st, w, valid, slots, pos, index=(ist, iw))
        kvc.csa_rotate(st, valid, slots)
        kvc.csa_rotate(ist, valid, slots)
        kvc.gather_topk(pool, slots, ids, n_entries=ne, out=out)

    def torch_step():
        c, sc, r = torch_model1(ents)
        kq, ks = torch_fp8_key(keys)
        torch_page_scatter(pool, slots, ids_e, c, sc, r, kq, ks)
        torch_rotate(st, valid, slots)
        torch_rotate(ist, valid, slots)
        torch_page_gather(pool, slots, ids, out)

    gbytes = B * topk * (m1 + 2 * D)
    _decode_step_entries(bench, results, "csa@model1", [B, ctx, topk], copy, step, torch_step, step_compress,
                         gbytes, gbytes, "flush_write + csa_rotate x2 + gather_topk; bytes = gather",
                         "compress_decode + csa_rotate x2 + gather_topk")
    us = bench.cuda_time_us(lambda i: kvc.gather_topk(pool, slots, ids, n_entries=ne, out=out))
    base = bench.cuda_time_us(lambda i: torch_page_gather(pool, slots, ids, out))
    results.append(bench.entry("kv_gather/topk@model1", [B, topk, D], "bfloat16", us, gbytes, copy,
                               "torch advanced indexing (same pages)", base))

    def flashmla_path(i):
        kvc.kvcache_indices(pool, slots, ids, n_entries=ne, out=idx_out)
        lay.model1_gather(pool.pages, idx_out, page_size=pool.entries_per_block, out=out)
    us = bench.cuda_time_us(flashmla_path)
    results.append(bench.entry("kv_gather/flashmla", [B, topk, D], "bfloat16", us,
                               gbytes + B * topk * 2 * 4, copy, "torch advanced indexing (same pages)", base,
                               note="kvcache_indices + model1_gather (an engine without FlashMLA)"))
    us = bench.cuda_time_us(lambda i: kvc.flush_write(pool, ents, valid, slots, pos, index_keys=keys))

    def torch_flush(i):
        c, sc, r = torch_model1(ents)
        kq, ks = torch_fp8_key(keys)
        torch_page_scatter(pool, slots, ids_e, c, sc, r, kq, ks)
    base = bench.cuda_time_us(torch_flush)
    results.append(bench.entry("kv_flush/csa@model1", [B, D], "bfloat16", us,
                               B * (2 * D + 2 * DI + m1 + 132), copy, "torch ops (same pages)", base))

    # ---------------- window insert (MODEL1 window pages, slot mapping) ----------------
    P = 64
    for rows_n in (B, 8192):
        win = lay.new_layout_cache("model1", rows_n // P + 2, P, device=dev)
        rows = torch.randn((rows_n, D), device=dev).to(torch.bfloat16)
        smap = torch.randperm(win.shape[0] * P, device=dev)[:rows_n].to(torch.int32)
        pg, off = (smap // P).long(), (smap % P).long()
        data = win[:, :P * 576].view(-1, P, 576)
        scl = win[:, P * 576:P * 584].view(-1, P, 8)

        def torch_insert(i):
            c, sc, r = torch_model1(rows)
            data[pg, off] = torch.cat([c, r.contiguous().view(torch.uint8)], 1)
            scl[pg, off, :NOPE // 64] = sc
        us = bench.cuda_time_us(lambda i: lay.model1_window_insert(win, rows, smap, page_size=P))
        base = bench.cuda_time_us(torch_insert)
        results.append(bench.entry("kv_window_insert", [rows_n, D], "bfloat16", us, rows_n * (2 * D + m1),
                                   copy, "torch ops (same pages)", base))
        del win, rows
    del out, pool, st, ist
    torch.cuda.empty_cache()

    _hca_step(bench, results, copy, "model1", B, ctx, w, valid, slots, pos, ents)
    _prefill(bench, results, copy, "model1", quick, w, iw)
