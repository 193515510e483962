"""The paged pool in the ecosystem layout (PagedKVPool(layout="model1"):
FlashMLA MODEL1_FP8Sparse pages, DeepGEMM FP8 / MXFP4 / MXFP8 indexer-key pages;
docs/kvcache.md "Pool layouts").

CPU tests: the pool's pages are byte-identical to pages built independently
with the sources' rules (vLLM's quantize_and_insert_k_cache for the entries,
vLLM's fused FP8 indexer insert / DeepSeek's fp4_act_quant / DeepGEMM's
per_token_cast_to_fp8 (MXFP8, pages padded to 512 bytes) for the keys,
FlashMLA's abs_indices2indices_in_kvcache for the bridge: the constructions
of tests/support/kvcache_layouts.py, whose docstring names each source's file
and commit); the compressor writes what the layout
store writes from the reference's finished entries; the request rules
(written[], marks, lowest row wins) hold. GPU tests (fixture `cuda`): a CUDA
pool driven by the same calls as a CPU pool holds the same bytes and counts
and gathers the same bits; the compressor within the kernel tolerance of
tests/support/kvcache_compress.py and decode == prefill bit for bit.

Random tests take `rng` (conftest): replay with RAWKV_TEST_SEED=<seed>."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402
from rawkv.reference.formats import bf16_bits  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.kvcache import _Dev, _bf16_rows, _churn_step, _dup_flush_case  # noqa: E402
from support.kvcache_layouts import (  # noqa: E402
    deepgemm_mxfp8_key_pages, edge_rows, flashmla_abs_indices, vllm_fp8_key_pages, vllm_insert,
    vllm_mxfp4_key_pages,
)


# ---------------------------------------------------------------------------
# CPU: the pages follow the sources
# ---------------------------------------------------------------------------
def _pool(device, kind="csa", index_layout="fp8", nb=12, epb=4, R_=3, mb=4):
    return kc.PagedKVPool(kind, nb, epb, R_, mb, layout="model1", index_layout=index_layout, device=device)


def test_model1_pool_geometry_and_bytes():
    p = _pool("cpu", epb=64)
    assert p.pages.shape == (12, 37440) and p.index_pages.shape == (12, 132 * 64)
    assert (p.page_bytes, p.index_page_bytes, p.index_layout) == (37440, 8448, "fp8")
    assert p.fp8 is None and p.scale is None and p.rope is None and p.index_q is None
    q = _pool("cpu", index_layout="mxfp4", epb=64)
    assert q.index_pages.shape == (12, 68 * 64) and q.index_layout == "mxfp4"
    # MXFP8 keys: 132 bytes a key, the page padded to a multiple of 512 (8,448 -> 8,704 at 64; none at 128)
    for epb, pb in ((64, 8704), (128, 16896), (4, 1024)):
        x = _pool("cpu", index_layout="mxfp8", epb=epb)
        assert x.index_pages.shape == (12, pb) and x.index_page_bytes == pb and x.index_layout == "mxfp8"
    h = _pool("cpu", "hca", epb=2)                    # vLLM's HCA page: 2 entries per 256 tokens
    assert h.pages.shape == (12, 1728) and h.index_pages is None and h.index_layout is None
    for bad, match in (({"layout": "flash"}, "^layout: "), ({"layout": "model1", "head_dim": 256}, "^head_dim: "),
                       ({"layout": "model1", "index_layout": "nvfp4"}, "^index_layout: "),
                       ({"layout": "model1", "index_head_dim": 64}, "^index_head_dim: ")):
        with pytest.raises(ValueError, match=match):
            kc.PagedKVPool("csa", 4, 4, 2, 2, device="cpu", **bad)


D, DI = ref.HEAD_DIM, ref.INDEX_HEAD_DIM


KEY_PAGES = {"fp8": vllm_fp8_key_pages, "mxfp4": vllm_mxfp4_key_pages, "mxfp8": deepgemm_mxfp8_key_pages}
KEY_WRITES = {"fp8": R.index_fp8_write, "mxfp4": R.index_mxfp4_write, "mxfp8": R.index_mxfp8_write}
# the edge keys of each key layout: (block of one scale, fmax)
KEY_EDGES = {"fp8": (32, 6.0), "mxfp4": (32, 6.0), "mxfp8": (32, 448.0)}


LAYOUTS = [("csa", "fp8"), ("csa", "mxfp4"), ("csa", "mxfp8"), ("hca", "fp8")]


def _full(device, kind="csa", index_layout="fp8", **kw):
    """A pool whose every slot holds a request with all its blocks."""
    p = _pool(device, kind, index_layout, **kw)
    for _ in range(p.max_requests):
        p.add_request()
    last = p.max_blocks_per_request * p.entries_per_block * p.m - 1
    p.prepare_step(list(range(p.max_requests)), [last] * p.max_requests)
    return p


def _arr(x):
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def _slot_ids(pool, slots, entries):
    """FlashMLA slots (page * P + offset) of entries of the requests in slots."""
    table = _arr(pool.block_table)
    epb = pool.entries_per_block
    return table[slots, entries // epb].astype(np.int64) * epb + entries % epb


@pytest.mark.parametrize("kind, index_layout", LAYOUTS)
def test_flush_pages_are_the_sources_pages(rng, kind, index_layout):
    """flush_write into a 'model1' pool: entry pages as vLLM's
    quantize_and_insert_k_cache builds them (DeepSeek / vLLM UE8M0 rule),
    key pages as vLLM's fused FP8 insert (FP32 power-of-two scale),
    DeepSeek's fp4_act_quant (MXFP4, scales in one int32) or DeepGEMM's
    per_token_cast_to_fp8 (MXFP8, scales in one int32, the page padded)
    over DeepGEMM's paged layout; written[] and marks as for the rawkv
    layout."""
    p = _full("cpu", kind, index_layout)
    m, epb = p.m, p.entries_per_block
    slots = np.array([0, 2, 1, 0, 2, 1, 0], np.int32)
    ents = np.array([0, 5, 15, 7, 6, 3, 8])
    pos = (ents * m + rng.integers(0, m, ents.size)).astype(np.int32)
    rows = edge_rows(rng, ents.size, D, 64, 448.0)
    keys = _bf16_rows(rng, ents.size, DI) if kind == "csa" else None
    kc.flush_write(p, rows, np.ones(ents.size, bool), slots, pos, index_keys=keys)
    assert p.read_errors() == 0
    at = _slot_ids(p, slots, ents)
    want = np.zeros_like(p.pages)
    vllm_insert(want, epb, rows, at)
    np.testing.assert_array_equal(p.pages, want)
    if kind == "csa":
        np.testing.assert_array_equal(p.index_pages, KEY_PAGES[index_layout](keys, epb, p.num_blocks, at))
    blk, off = divmod(at, epb)
    marks = np.zeros_like(p.marks)
    marks[blk, off] = 1
    np.testing.assert_array_equal(p.marks, marks)
    np.testing.assert_array_equal(p.written, [9, 16, 7])


@pytest.mark.parametrize("kind, index_layout", LAYOUTS)
def test_gathers_and_bridge_read_only_written_entries(rng, kind, index_layout):
    """The pool's gathers decode the pages as the layout gathers do
    (model1_gather, index_*_gather) at the entries' FlashMLA slots, and
    kvcache_indices is FlashMLA's abs_indices2indices_in_kvcache on the
    pool's block table, for the entries the request wrote; every other id
    is a zero row / -1 and counted."""
    p = _full("cpu", kind, index_layout)
    m = p.m
    slots = np.array([0, 0, 1, 1, 1], np.int32)
    ents = np.array([0, 2, 1, 4, 3])
    rows, keys = _bf16_rows(rng, 5, D), _bf16_rows(rng, 5, DI)
    kc.flush_write(p, rows, np.ones(5, bool), slots, (ents * m).astype(np.int32),
                   index_keys=keys if kind == "csa" else None)
    ids = np.array([[0, 1, 2, -1, 3], [1, 3, 4, 0, 9]], np.int32)
    bs = np.array([0, 1], np.int32)
    written = {(0, 0), (0, 2), (1, 1), (1, 3), (1, 4)}
    ok = np.array([[(b, e) in written for e in row] for b, row in zip(bs, ids)])
    unread = int((~ok & (ids != -1)).sum())
    got = kc.gather_topk(p, bs, ids, dtype="float32")
    assert p.read_errors() == unread
    at = np.where(ok, _slot_ids(p, bs[:, None], np.maximum(ids, 0)), -1)
    want, _ = R.model1_gather(p.pages, p.entries_per_block, at.astype(np.int32), "float32")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.abs(got[ok]).sum(-1).all() and not got[~ok].any()
    p.reset_errors()
    idx = kc.kvcache_indices(p, bs, ids)
    assert p.read_errors() == unread
    fm = flashmla_abs_indices(torch.from_numpy(np.where(ok, ids, -1).astype(np.int64)),
                              torch.from_numpy(_arr(p.block_table)[bs].astype(np.int64)), p.entries_per_block)
    np.testing.assert_array_equal(idx, fm.numpy())
    p.reset_errors()
    dense = kc.gather_dense_batch(p, bs, np.array([3, 5], np.int32), max_entries=5, dtype="float32")
    assert p.read_errors() == 1 + 2                    # (0, 1); (1, 0), (1, 2)
    if kind == "csa":
        lay = ref.INDEX_LAYOUTS[index_layout]
        p.reset_errors()
        k = kc.gather_index_keys(p, 1, 5, dtype="float32")
        assert p.read_errors() == 2
        ka = np.where(np.isin(np.arange(5), [1, 3, 4]), _slot_ids(p, np.full(5, 1), np.arange(5)), -1)
        data, scales, _, _ = R.page_read(lay, p.index_pages, p.entries_per_block, ka)
        wk = R.decode_records(lay, data, scales, "float32")
        wk[ka < 0] = 0
        np.testing.assert_array_equal(k.view(np.uint32), wk.view(np.uint32))
    assert not dense[1, [0, 2]].any() and dense[1, [1, 3, 4]].any()


F32 = np.float32


M = {"csa": ref.CSA_RATIO, "hca": ref.HCA_RATIO}


@pytest.mark.parametrize("kind, index_layout", LAYOUTS)
def test_compressor_writes_the_layout_store_of_its_entries(rng, kind, index_layout):
    """compress_prefill into a 'model1' pool writes exactly the MODEL1 (and
    key) records of the reference's finished entries (reference_prefill ->
    model1_write / index_*_write); compress_decode token by token writes the
    same pages as prefill."""
    m = M[kind]
    T = (9 if kind == "csa" else 3) * m + 2
    coff = 2 if kind == "csa" else 1
    kv = rng.standard_normal((T, coff * D)).astype(F32)
    z = rng.standard_normal((T, coff * D)).astype(F32)
    ape = (0.3 * rng.standard_normal((m, coff * D))).astype(F32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(F32)
    idx = None
    if kind == "csa":
        idx = kc.PrefillIndex(rng.standard_normal((T, 2 * DI)).astype(F32),
                              rng.standard_normal((T, 2 * DI)).astype(F32),
                              (0.3 * rng.standard_normal((m, 2 * DI))).astype(F32), np.ones(DI, F32))
    p = _pool("cpu", kind, index_layout, nb=16, epb=2, mb=8)
    s = p.add_request()
    p.prepare_step([s], [T - 1])
    n = kc.compress_prefill(p, kv, z, ape, nw, s, index=idx)
    ids, ent, keys = ref.reference_prefill(kind, kv, z, ape, nw, index=idx)
    at = _slot_ids(p, np.full(n, s), ids)
    want = np.zeros_like(p.pages)
    R.model1_write(want, p.entries_per_block, ent, at)
    np.testing.assert_array_equal(p.pages, want)
    if kind == "csa":
        wk = np.zeros_like(p.index_pages)
        KEY_WRITES[index_layout](wk, p.entries_per_block, keys, at)
        np.testing.assert_array_equal(p.index_pages, wk)
    # decode, token by token, into a second pool
    q = _pool("cpu", kind, index_layout, nb=16, epb=2, mb=8)
    st = kc.DecodeState(kind, q.max_requests, device="cpu")
    ist = kc.DecodeState("csa", q.max_requests, DI, device="cpu") if kind == "csa" else None
    q.attach(*(x for x in (st, ist) if x is not None))
    s2 = q.add_request()
    one, sl = np.ones(1, bool), np.array([s2], np.int32)
    for t in range(T):
        q.prepare_step([s2], [t])
        kc.state_append(st, kv[t:t + 1], z[t:t + 1], one, sl, ape=ape)
        if ist is not None:
            kc.state_append(ist, idx.kv[t:t + 1], idx.z[t:t + 1], one, sl, ape=idx.ape)
        pos = np.array([t], np.int32)
        kc.compress_decode(q, st, nw, one, sl, pos, index=None if ist is None else (ist, idx.norm_weight))
        flush = np.array([(t + 1) % m == 0])
        (kc.csa_rotate if kind == "csa" else kc.hca_reset)(st, flush, sl)
        if ist is not None:
            kc.csa_rotate(ist, flush, sl)
    assert q.read_errors() == 0 and int(q.written[s2]) == n
    np.testing.assert_array_equal(q.pages, p.pages)
    if kind == "csa":
        np.testing.assert_array_equal(q.index_pages, p.index_pages)


def _dup_pool(device, index_layout="mxfp4"):
    p = kc.PagedKVPool("csa", 8, 2, 3, 2, layout="model1", index_layout=index_layout, device=device)
    for _ in range(3):
        p.add_request()
    p.prepare_step([0, 1, 2], [15, 15, 15])
    return p


@pytest.mark.parametrize("layout", ["rawkv", "model1"])
def test_float32_entries_stand_for_their_bf16_rounding_in_both_layouts(rng, layout):
    # a numpy float32 entry stands for a BF16 one (what a CUDA pool takes):
    # both layouts store the BF16 rounding (the rawkv layout quantized the
    # float32 values as they were, and disagreed with model1 and the GPU)
    from rawkv.reference.formats import bf16_round

    def run(ents, keys):
        p = kc.PagedKVPool("csa", 4, 2, 2, 2, layout=layout, device="cpu")
        s = p.add_request()
        p.prepare_step([s], [3])
        kc.flush_write(p, ents, np.ones(1, bool), np.array([s], np.int32), np.array([3], np.int32),
                       index_keys=keys)
        return kc.gather_dense(p, s, 1, dtype="float32"), kc.gather_index_keys(p, s, 1, dtype="float32")

    e = rng.standard_normal((1, 512)).astype(np.float32)
    k = rng.standard_normal((1, 128)).astype(np.float32)
    assert not np.array_equal(e, bf16_round(e))
    for got, want in zip(run(e, k), run(bf16_round(e), bf16_round(k))):
        assert np.array_equal(got, want)


def test_flush_duplicates_lowest_row_wins(rng):
    """Rows aimed at one entry: the lowest valid row writes it (its record,
    not a mix), the others are counted (the rawkv layout's rule)."""
    slots, pos, valid = _dup_flush_case(rng)
    rows, keys = _bf16_rows(rng, slots.size, D), _bf16_rows(rng, slots.size, DI)
    p = _dup_pool("cpu")
    kc.flush_write(p, rows, valid, slots, pos, index_keys=keys)
    assert p.read_errors() == 5
    owners = [2, 1, 3, 5]                               # _dup_flush_case's owners
    q = _dup_pool("cpu")
    kc.flush_write(q, rows[owners], np.ones(4, bool), slots[owners], pos[owners], index_keys=keys[owners])
    assert q.read_errors() == 0
    for name in ("pages", "index_pages", "marks", "written"):
        np.testing.assert_array_equal(getattr(p, name), getattr(q, name), err_msg=name)


def _reuse_run(device, rng, index_layout, steps=16):
    """Requests come and go (blocks reused, last freed first), flushing
    entries at scattered positions, with a prefill that starts mid-request
    after reuse: returns, per step, the pool's bytes, the gathers and the
    bridge with their counts."""
    dv = _Dev(device)
    p = kc.PagedKVPool("csa", 9, 2, 3, 3, layout="model1", index_layout=index_layout, device=device)
    out = []
    cap = 6
    for step in range(steps):
        slots, pos = _churn_step(p, step)
        rows, keys = _bf16_rows(rng, slots.size, D), _bf16_rows(rng, slots.size, DI)
        p.reset_errors()
        kc.flush_write(p, dv.bf(rows), dv.t(np.ones(slots.size, bool)), dv.t(slots), dv.t(pos),
                       index_keys=dv.bf(keys))
        ids = np.tile(np.arange(-1, cap, dtype=np.int32), (slots.size, 1))
        g = dv.host(kc.gather_topk(p, dv.t(slots), dv.t(ids), dtype="float32"))
        i = dv.buf(kc.kvcache_indices(p, dv.t(slots), dv.t(ids)))
        ne = dv.t(np.full(slots.size, cap, np.int32))
        k = dv.host(kc.gather_index_keys_batch(p, dv.t(slots), ne, max_entries=cap, dtype="bfloat16"))
        d = dv.host(kc.gather_dense_batch(p, dv.t(slots), ne, max_entries=cap, dtype="float16"))
        r = p.to_reference()
        out.append(dict(pages=r.pages, index_pages=r.index_pages, marks=r.marks, written=r.written,
                        gather=g, indices=i, keys=k, dense=d, errors=p.read_errors()))
    return out


@pytest.mark.parametrize("index_layout", ["fp8", "mxfp4", "mxfp8"])
def test_reuse_reads_no_stale_entry(rng, index_layout):
    steps = _reuse_run("cpu", rng, index_layout)
    for st in steps:
        ok = st["indices"] >= 0
        assert not st["gather"][~ok].any() and np.abs(st["gather"][ok]).sum(-1).all()
    assert any(st["errors"] > 0 for st in steps)


# ---------------------------------------------------------------------------
# GPU: the kernels against the CPU pool, byte for byte
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("index_layout", ["fp8", "mxfp4", "mxfp8"])
def test_gpu_reuse_run_matches_the_cpu_pool(cuda, rng, index_layout):
    """flush_write (rkv_kv_flush_pages), every gather (rkv_kv_gather_pages,
    rkv_kv_gather_index_pages) and kvcache_indices (rkv_kv_topk_indices) on a
    CUDA pool driven by the same calls as a CPU pool, over block reuse:
    the same pages, marks, written[], rows (bit for bit) and counts."""
    seed = int(rng.integers(1 << 30))
    want = _reuse_run("cpu", np.random.default_rng(seed), index_layout)
    got = _reuse_run("cuda", np.random.default_rng(seed), index_layout)
    for step, (g, w) in enumerate(zip(got, want)):
        for name in w:
            np.testing.assert_array_equal(np.asarray(g[name]).view(np.uint8) if name != "errors" else g[name],
                                          np.asarray(w[name]).view(np.uint8) if name != "errors" else w[name],
                                          err_msg=f"step {step}: {name}")


@pytest.mark.parametrize("kind, index_layout", LAYOUTS)
def test_gpu_flush_edge_entries_bit_exact(cuda, rng, kind, index_layout):
    """Edge tiles (zeros, the amax floor, powers of two, the largest BF16,
    NaN / Inf) through the CUDA flush: the CPU pool's pages byte for byte,
    and the gathers' rows in every output dtype."""
    cpu, gpu = _full("cpu", kind, index_layout), _full("cuda", kind, index_layout)
    m = cpu.m
    B = 12
    slots = (np.arange(B) % 3).astype(np.int32)
    ents = np.arange(B) // 3 * 3 + np.arange(B) % 3
    pos = (ents * m).astype(np.int32)
    rows = edge_rows(rng, B, D, 64, 448.0, finite_only=False)
    keys = edge_rows(rng, B, DI, *KEY_EDGES[index_layout], finite_only=False) if kind == "csa" else None
    dv = _Dev("cuda")
    import torch

    def same_bits(a):
        # The reference's BF16 bits of the rows, moved as they are: torch's
        # float32 -> bfloat16 conversions write NaN as 0x7FFF (CUDA) or
        # 0xFFFF (CPU) where the reference keeps 0x7FC0, and the two pools
        # must see the same input.
        bits = bf16_bits(np.asarray(a, F32)).astype(np.uint16).view(np.int16)
        return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bfloat16).cuda()
    kc.flush_write(cpu, rows, np.ones(B, bool), slots, pos, index_keys=keys)
    kc.flush_write(gpu, same_bits(rows), dv.t(np.ones(B, bool)), dv.t(slots), dv.t(pos),
                   index_keys=None if keys is None else same_bits(keys))
    a, b = cpu.to_reference(), gpu.to_reference()
    for name in ("pages", "index_pages", "marks", "written"):
        if getattr(a, name) is not None:
            np.testing.assert_array_equal(getattr(b, name), getattr(a, name), err_msg=name)
    ids = np.tile(np.arange(-1, 12, dtype=np.int32), (3, 1))
    for dt in ("bfloat16", "float16", "float32"):
        # (numpy rows come as float16 for float16, float32 holding BF16 values
        # for bfloat16: compared as float32, which holds both exactly)
        w = np.asarray(kc.gather_topk(cpu, np.arange(3, dtype=np.int32), ids, dtype=dt), np.float32)
        g = kc.gather_topk(gpu, dv.t(np.arange(3, dtype=np.int32)), dv.t(ids.astype(np.int64)), dtype=dt)
        gh = g.float().cpu().numpy()
        assert np.array_equal(np.isnan(gh), np.isnan(w))
        np.testing.assert_array_equal(np.nan_to_num(gh).view(np.uint32), np.nan_to_num(w).view(np.uint32))
    assert gpu.read_errors() == cpu.read_errors()


def _compress_inputs(rng, kind, T):
    m, coff = M[kind], 2 if kind == "csa" else 1
    kv = rng.standard_normal((T, coff * D)).astype(F32)
    z = (1.5 * rng.standard_normal((T, coff * D))).astype(F32)
    ape = (0.3 * rng.standard_normal((m, coff * D))).astype(F32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(F32)
    idx = None
    if kind == "csa":
        idx = (rng.standard_normal((T, 2 * DI)).astype(F32), (1.5 * rng.standard_normal((T, 2 * DI))).astype(F32),
               (0.3 * rng.standard_normal((m, 2 * DI))).astype(F32), (1 + 0.1 * rng.standard_normal(DI)).astype(F32))
    return kv, z, ape, nw, idx


@pytest.mark.parametrize("kind, index_layout", LAYOUTS)
def test_gpu_compress_prefill_and_decode(cuda, rng, kind, index_layout):
    """The compressor kernel writing 'model1' pages: against the CPU pool
    within the compressor's tolerance (tests/support/kvcache_compress.py:
    entry cosine >= 0.9999, <= 0.1% of FP8 codes differ; keys cosine >=
    0.99), placement, written[] and marks exactly; and decode token by token
    gives the prefill's pages bit for bit (same kernel, same float32 values)."""
    m = M[kind]
    T = (37 if kind == "csa" else 9) * m + 3
    kv, z, ape, nw, idx = _compress_inputs(rng, kind, T)
    dv = _Dev("cuda")
    pools = {}
    for dev in ("cpu", "cuda"):
        p = _pool(dev, kind, index_layout, nb=64, epb=4, mb=16)
        s = p.add_request()
        p.prepare_step([s], [T - 1])
        cv = dv if dev == "cuda" else _Dev("cpu")
        ix = None if idx is None else tuple(cv.t(a) for a in idx)
        n = kc.compress_prefill(p, cv.t(kv), cv.t(z), cv.t(ape), cv.t(nw), s, index=ix)
        pools[dev] = p
    a, b = pools["cpu"].to_reference(), pools["cuda"].to_reference()
    assert pools["cuda"].read_errors() == 0
    np.testing.assert_array_equal(b.marks, a.marks)
    np.testing.assert_array_equal(b.written, a.written)
    ids = np.arange(n, dtype=np.int32)[None]
    ra = kc.gather_topk(pools["cpu"], np.zeros(1, np.int32), ids, dtype="float32")[0]
    rb = kc.gather_topk(pools["cuda"], dv.t(np.zeros(1, np.int32)), dv.t(ids), dtype="float32")[0].cpu().numpy()
    cos = (ra * rb).sum(-1) / np.linalg.norm(ra, axis=-1) / np.linalg.norm(rb, axis=-1)
    assert cos.min() >= 0.9999, cos.min()
    epb = a.page_size
    ca = a.pages[:, :epb * 576].reshape(-1, epb, 576)[..., :448]
    cb = b.pages[:, :epb * 576].reshape(-1, epb, 576)[..., :448]
    assert (ca != cb).mean() <= 1e-3
    if kind == "csa":
        ka = kc.gather_index_keys(pools["cpu"], 0, n, dtype="float32")
        kb = kc.gather_index_keys(pools["cuda"], 0, n, dtype="float32").cpu().numpy()
        kcos = (ka * kb).sum(-1) / np.linalg.norm(ka, axis=-1) / np.linalg.norm(kb, axis=-1)
        assert kcos.min() >= 0.99, kcos.min()
    # decode token by token on the GPU == prefill on the GPU, bit for bit
    q = _pool("cuda", kind, index_layout, nb=64, epb=4, mb=16)
    st = kc.DecodeState(kind, q.max_requests, device="cuda")
    ist = kc.DecodeState("csa", q.max_requests, DI, device="cuda") if kind == "csa" else None
    q.attach(*(x for x in (st, ist) if x is not None))
    s2 = q.add_request()
    one, sl = dv.t(np.ones(1, bool)), dv.t(np.array([s2], np.int32))
    g = {k: dv.t(v) for k, v in (("kv", kv), ("z", z), ("ape", ape), ("nw", nw))}
    gi = None if idx is None else tuple(dv.t(x) for x in idx)
    for t in range(T):
        q.prepare_step([s2], [t])
        kc.state_append(st, g["kv"][t:t + 1], g["z"][t:t + 1], one, sl, ape=g["ape"])
        if ist is not None:
            kc.state_append(ist, gi[0][t:t + 1], gi[1][t:t + 1], one, sl, ape=gi[2])
        kc.compress_decode(q, st, g["nw"], one, sl, dv.t(np.array([t], np.int32)),
                           index=None if ist is None else (ist, gi[3]))
        flush = dv.t(np.array([(t + 1) % m == 0]))
        (kc.csa_rotate if kind == "csa" else kc.hca_reset)(st, flush, sl)
        if ist is not None:
            kc.csa_rotate(ist, flush, sl)
    assert q.read_errors() == 0
    qr = q.to_reference()
    np.testing.assert_array_equal(qr.pages, b.pages)
    if kind == "csa":
        np.testing.assert_array_equal(qr.index_pages, b.index_pages)


def test_gpu_flush_duplicates_deterministic(cuda, rng):
    """20 launches of a batch full of duplicates: the same bytes every time,
    the CPU pool's."""
    slots, pos, valid = _dup_flush_case(rng)
    rows, keys = _bf16_rows(rng, slots.size, D), _bf16_rows(rng, slots.size, DI)
    cpu = _dup_pool("cpu")
    kc.flush_write(cpu, rows, valid, slots, pos, index_keys=keys)
    dv = _Dev("cuda")
    for run in range(20):
        p = _dup_pool("cuda")
        kc.flush_write(p, dv.bf(rows), dv.t(valid), dv.t(slots), dv.t(pos), index_keys=dv.bf(keys))
        got = p.to_reference()
        for name in ("pages", "index_pages", "marks", "written"):
            np.testing.assert_array_equal(getattr(got, name), getattr(cpu, name), err_msg=f"run {run}: {name}")
        assert p.read_errors() == 5


def test_gpu_decode_step_captures_in_a_graph(cuda, rng):
    """The demo's decode step on 'model1' pools, captured once and replayed,
    gives the eager step's rows and pages."""
    import rawkv
    from rawkv.demo import Decoder
    rawkv.warmup(0)                     # every kernel loaded before the capture
    outs = []
    for graph in (False, True):
        dec = Decoder(np.random.default_rng(7), [127, 134], 4, 8, 4, device="cuda", layout="model1")
        dec.prefill()
        for t in range(4):
            dec.prepare(t)
            if graph and t == 0:                # the RoPE tables: built by the prefill
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    dec.step()
            if graph:
                g.replay()
            else:
                dec.step()
        torch.cuda.synchronize()
        outs.append([dec.out["csa"].float().cpu().numpy(), dec.out["hca"].float().cpu().numpy(),
                     dec.pools["csa"].pages.cpu().numpy(), dec.pools["csa"].index_pages.cpu().numpy(),
                     dec.pools["hca"].pages.cpu().numpy()])
        assert sum(p.read_errors() for p in dec.pools.values()) == 0
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
