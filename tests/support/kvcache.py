"""Helpers of the KV-cache tests (tests/kvcache/): bit-for-bit comparisons of pools
and states, BF16 rows with the FP8 entry's edge cases, small CPU pools with
requests, poisoned CUDA pools, and the CPU / CUDA twins of the isolation
cases."""

from __future__ import annotations

import numpy as np

from rawkv import kvcache as kc
from rawkv.reference import kvcache as ref
from rawkv.reference.formats import bf16_round


D, DI = ref.HEAD_DIM, ref.INDEX_HEAD_DIM


F32, F64 = np.float32, np.float64


class _Dev:
    """Host arrays -> the device's arguments, and results -> float32 numpy."""

    def __init__(self, device):
        self.cuda = device != "cpu"
        self.device = device
        if self.cuda:
            import torch
            self.torch = torch

    def t(self, a):
        a = np.ascontiguousarray(a)
        return self.torch.from_numpy(a).cuda() if self.cuda else a

    def bf(self, a):
        return self.t(np.asarray(a, F32)).bfloat16() if self.cuda else np.asarray(a, F32)

    def host(self, x):
        return x.float().cpu().numpy() if self.cuda else np.asarray(x, F32)

    def buf(self, x):
        return x.cpu().numpy() if self.cuda else np.array(x)


def _torch():
    import torch
    return torch


def _gpu_pool(kind, rng, *, num_blocks=16, epb=4, R=6, MB=5, n_req=4, corrupt=True):
    torch = _torch()
    p = kc.PagedKVPool(kind, num_blocks, epb, R, MB, layout="rawkv", device="cuda")
    slots = [p.add_request() for _ in range(n_req)]
    # request i holds i+1 logical blocks
    p.prepare_step(slots, [p.m * epb * (i + 1) - 1 for i in range(n_req)])
    if corrupt:   # device-side corruption the kernels must survive: ids past the pool
        last = slots[-1]
        p.block_table[last, 1] = num_blocks
        p.block_table[last, 2] = 1 << 30
        p.block_table[last, 3] = -7
    torch.cuda.synchronize()
    return p, slots


def _poison_pool(pool, rng):
    """Random bytes everywhere (NaN/Inf scale and RoPE patterns included)."""
    torch = _torch()

    def fill(t):
        raw = rng.integers(0, 256, size=t.numel() * t.element_size(), dtype=np.uint8)
        t.view(torch.uint8).view(-1).copy_(torch.from_numpy(raw))
    for t in (pool.fp8, pool.scale, pool.rope, pool.index_q, pool.index_sf):
        if t is not None:
            fill(t)


def assert_same(got, want, what=""):
    """Bit-for-bit equality of float arrays (signed zeros included); NaN
    matches NaN whatever its payload."""
    got = np.ascontiguousarray(np.asarray(got, F32))
    want = np.ascontiguousarray(np.asarray(want, F32))
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    gn, wn = np.isnan(got), np.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(np.uint32) != want.view(np.uint32)))
    if bad.any():
        idx = np.argwhere(bad)[:5]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} differ, e.g. at "
                             f"{idx.tolist()}: got {got[tuple(idx[0])]} want {want[tuple(idx[0])]}")


def assert_pool_equal(a: ref.PagedPoolRef, b: ref.PagedPoolRef, what="pool"):
    np.testing.assert_array_equal(a.kv_fp8, b.kv_fp8, err_msg=f"{what}.fp8")
    assert_same(a.kv_scale, b.kv_scale, f"{what}.scale")
    assert_same(a.kv_rope, b.kv_rope, f"{what}.rope")
    if a.idx_q is not None or b.idx_q is not None:
        np.testing.assert_array_equal(a.idx_q, b.idx_q, err_msg=f"{what}.index_q")
        np.testing.assert_array_equal(a.idx_sf, b.idx_sf, err_msg=f"{what}.index_sf")
    if a.marks is not None and b.marks is not None:
        np.testing.assert_array_equal(a.marks, b.marks, err_msg=f"{what}.marks")


def assert_state_equal(a: ref.DecodeStateRef, b: ref.DecodeStateRef, what="state"):
    assert_same(a.a_kv, b.a_kv, f"{what}.kv_a")
    assert_same(a.a_z, b.a_z, f"{what}.z_a")
    np.testing.assert_array_equal(a.count, b.count, err_msg=f"{what}.count")
    if a.b_kv is not None or b.b_kv is not None:
        assert_same(a.b_kv, b.b_kv, f"{what}.kv_b")
        assert_same(a.b_z, b.b_z, f"{what}.z_b")


def _small_hca_pool():
    p = kc.PagedKVPool("hca", 8, 2, 2, 4, layout="rawkv", device="cpu")
    s = p.add_request()
    p.prepare_step([s], [p.m * 2 - 1])
    return p, s


def _cpu_pool_with_requests(kind, rng, n_req=3):
    p = kc.PagedKVPool(kind, 12, 2, 4, 4, layout="rawkv", device="cpu")
    slots = [p.add_request() for _ in range(n_req)]
    p.prepare_step(slots, [p.m * 2 * (i + 1) - 1 for i in range(n_req)])
    return p, slots


def bf16_values(rng, shape, scale=1.0):
    return bf16_round((rng.standard_normal(shape) * scale).astype(F32))


def special_entries(rng, B, hd, rope_dim=64):
    """BF16-valued entries with the edge cases of FP8 entries (docs/kvcache.md decision 8)."""
    e = bf16_values(rng, (B, hd), 2.0)
    nope = hd - rope_dim
    specials = [
        lambda r: r.__setitem__(slice(0, nope), 0.0),                    # amax 0 -> s = 1
        lambda r: r.__setitem__(5, np.nan),                              # NaN -> s NaN, codes 0
        lambda r: r.__setitem__(7, np.inf),
        lambda r: r.__setitem__(nope + 3, np.nan),                       # NaN in RoPE dims only
        lambda r: r.__setitem__(slice(0, nope), bf16_round(r[:nope] * F32(1e-30))),
        lambda r: r.__setitem__(slice(0, nope), bf16_round(r[:nope] * F32(1e37))),
        lambda r: r.__setitem__(slice(0, nope, 3), -0.0),
        lambda r: r.__setitem__(slice(0, nope), bf16_round(r[:nope] * F32(3e-39))),  # subnormals
    ]
    for i, f in enumerate(specials[:B]):
        f(e[i])
    return e


def special_keys(rng, B, ihd=128):
    k = bf16_values(rng, (B, ihd), 1.5)
    if B > 0:
        k[0, 0:16] = 0.0                      # all-zero block
    if B > 1:
        k[1, 17] = np.nan                     # NaN block -> sf 0x7F, codes 0
    if B > 2:
        k[2, 40] = -np.inf
    if B > 3:
        k[3, 64:80] = bf16_round(k[3, 64:80] * F32(1e-5))   # tiny block: sf 0 -> codes 0
    if B > 4:
        k[4, :] = bf16_round(k[4] * F32(300.0))
    return k


def _bf16_rows(rng, n, w):
    return bf16_round((rng.standard_normal((n, w)) * 2).astype(F32))


def _dup_flush_case(rng):
    """Rows aimed at 3 entries, several rows each, interleaved with good
    and bad rows. Returns the pool's shape and the batch."""
    m = ref.CSA_RATIO
    slots = np.array([0, 1, 0, 0, 1, 2, 0, 1, 9, 0], np.int32)
    ent = np.array([0, 2, 0, 1, 2, 3, 0, 2, 0, 1])
    pos = (ent * m + rng.integers(0, m, ent.size)).astype(np.int32)
    valid = np.array([False, True, True, True, True, True, True, True, True, True])
    return slots, pos, valid


def _decoded(ents, keys=None):
    """What a float32 gather returns for entries written from these rows."""
    codes, scale, rope = ref.fp8_entry_quantize(ents)
    rows = ref.fp8_entry_dequantize(codes, scale, rope, "float32")
    if keys is None:
        return rows, None
    return rows, ref.indexer_key_dequantize(*ref.indexer_key_quantize(keys), "float32")


def _bits(a):
    """Bit pattern view, so -inf / NaN / -0.0 compare exactly."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == F32 else a


def _pool_arrays(pool):
    return [a for a in (pool.kv_fp8, pool.kv_scale, pool.kv_rope, pool.idx_q, pool.idx_sf)
            if a is not None]


def _changed(before, after):
    """Set of (block, slot) whose bytes differ in any pool array."""
    out = set()
    for a, b in zip(_pool_arrays(before), _pool_arrays(after)):
        diff = _bits(a) != _bits(b)
        diff = diff.reshape(diff.shape[0], diff.shape[1], -1).any(-1)
        out |= set(map(tuple, np.argwhere(diff)))
    return out


def _noisy_pool(rng, num_blocks, epb, m, index=True):
    pool = ref.PagedPoolRef.create(num_blocks, epb, m, index_head_dim=128 if index else None)
    pool.kv_fp8[:] = rng.integers(0, 256, pool.kv_fp8.shape)
    pool.kv_scale[:] = rng.standard_normal(pool.kv_scale.shape)
    pool.kv_rope[:] = rng.standard_normal(pool.kv_rope.shape)
    if index:
        pool.idx_q[:] = rng.integers(0, 256, pool.idx_q.shape)
        pool.idx_sf[:] = rng.integers(0, 256, pool.idx_sf.shape)
    pool.marks[:] = 1         # every entry counts as written (the bounds tests' subject is elsewhere)
    return pool


def _random_rows(rng, t, w, scale=1.0):
    return (rng.standard_normal((t, w)) * scale).astype(F32)


def _slot_pool(rng, nb=8, epb=2, m=4, R=3, MB=3):
    pool = _noisy_pool(rng, nb, epb, m)
    pool.block_table, pool.written = ref.PagedPoolRef.create(
        1, 1, 1, max_requests=R, max_blocks_per_request=MB).block_table, np.zeros(R, np.int32)
    pool.block_table[0, :2] = [5, 1]
    pool.block_table[1, :3] = [2, nb, 0]          # logical block 1 maps outside the pool
    return pool


def _fill_pool_random(pool, rng):
    """Plausible-but-adversarial pool contents for the gathers."""
    torch = _torch()
    nb, epb = pool.num_blocks, pool.entries_per_block
    pool.fp8.copy_(torch.from_numpy(rng.integers(0, 256, pool.fp8.shape, dtype=np.uint8)))
    sc = (np.exp(rng.standard_normal((nb, epb)) * 3)).astype(F32)
    flat = sc.reshape(-1)
    specials = np.array([0.0, -0.0, np.nan, np.inf, 1e-40, -2.5, 3e38], F32)
    flat[: specials.size] = specials
    rng.shuffle(flat)
    pool.scale.copy_(torch.from_numpy(sc))
    rope = bf16_values(rng, pool.rope.shape, 4.0)
    rope.reshape(-1)[rng.integers(0, rope.size, 5)] = np.nan
    rope.reshape(-1)[rng.integers(0, rope.size, 5)] = -np.inf
    pool.rope.copy_(torch.from_numpy(rope).bfloat16())
    if pool.index_q is not None:
        pool.index_q.copy_(torch.from_numpy(rng.integers(0, 256, pool.index_q.shape, dtype=np.uint8)))
        sf = rng.integers(0, 0x78, pool.index_sf.shape, dtype=np.uint8)
        sf.reshape(-1)[rng.integers(0, sf.size, 6)] = np.array([0x7F, 0xFF, 0, 0x80, 0x7E, 1], np.uint8)
        pool.index_sf.copy_(torch.from_numpy(sf))
    # most entries marked written by their block's owner; the others must read as unwritten
    pool.marks.copy_(torch.from_numpy((rng.random((nb, epb)) < 0.85).astype(np.uint8)))


def table_rows(table: np.ndarray, slots) -> np.ndarray:
    """Block-table rows of `slots`; all -1 for a slot out of range."""
    slots = np.asarray(slots, np.int64)
    ok = (slots >= 0) & (slots < table.shape[0])
    rows = np.full((slots.size, table.shape[1]), -1, np.int64)
    rows[ok] = table[slots[ok]]
    return rows


def _random_state(rng, kind, S, d):
    st = ref.DecodeStateRef.create(kind, S, d)
    st.a_kv[:] = rng.standard_normal(st.a_kv.shape)
    st.a_z[:] = rng.standard_normal(st.a_z.shape)
    st.count[:] = rng.integers(0, st.m + 1, S)
    if st.overlap:
        st.b_kv[:] = rng.standard_normal(st.b_kv.shape)
        st.b_z[:] = rng.standard_normal(st.b_z.shape)
    return st


def _csa_rows_f64(kv, z, i, m, d):
    """Rows entry i pools: b-half of window i-1, a-half of window i."""
    vals = [kv[t, d:] for t in range(i * m, (i + 1) * m)]
    scs = [z[t, d:] for t in range(i * m, (i + 1) * m)]
    if i > 0:
        vals += [kv[t, :d] for t in range((i - 1) * m, i * m)]
        scs += [z[t, :d] for t in range((i - 1) * m, i * m)]
    return np.array(vals), np.array(scs)


def _pool_f64(vals, scores):
    vals, scores = np.asarray(vals, F64), np.asarray(scores, F64)
    w = np.exp(scores - scores.max(0))
    return (w / w.sum(0) * vals).sum(0)


def _churn_step(p, step):
    """One step of the reuse scenario: every fourth step frees the oldest
    request, the pool is refilled to 3 requests, and positions scattered
    over 24 tokens are prepared. Returns (slots, positions)."""
    if step % 4 == 3:
        for s in p.active_slots()[:1]:
            p.free_request(s)
    while len(p.active_slots()) < 3:
        p.add_request()
    slots = np.array(p.active_slots(), np.int32)
    pos = np.array([(step * 5 + 3 * i) % 24 for i in range(slots.size)], np.int32)
    p.prepare_step(slots, pos)
    return slots, pos
