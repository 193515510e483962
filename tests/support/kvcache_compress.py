"""Helpers of the compressor tests (tests/kvcache/test_compress_*.py): inputs,
reference pools, decode runs and the kernel's tolerance.

Tolerance of the kernel (docs/kvcache.md, "Compressor kernel"): the kernel
uses expf (float32, <= 2 ulp) where the reference rounds a float64 exp, and
HCA pools with an online softmax (a few extra float32 roundings). A numpy
simulation that perturbs every exp weight by up to +-2 ulp moves ~0.01% of
the BF16 entry elements by one BF16 ulp, ~0.002% of FP8 codes by one step,
no scale, and keeps every entry's cosine >= 0.9999995. The tests allow
margin above that: per entry cosine >= 0.9999, <= 0.1% of FP8 codes
differing and each by at most one step, scale within one BF16 ulp of amax
(2^-7 relative), RoPE dims within one BF16 ulp or 8 FP32 ulps of their
entry's largest (an element near zero after cancellation: seen at -7.42e-6
against -7.54e-6 in a row of magnitude 2); indexer keys (NVFP4, coarse:
one BF16 ulp at a rounding edge moves an E2M1 code a whole step) <= 1% of
codes differing and key cosine >= 0.99 (assert_entries_close)."""

from __future__ import annotations

import numpy as np

from rawkv.kvcache import PagedKVPool
from rawkv.reference import kvcache as ref
from support.kvcache import D, DI


M = {"csa": 4, "hca": 128}


COFF = {"csa": 2, "hca": 1}


def _inputs(rng, kind, T, dtype=np.float32):
    m, w = M[kind], COFF[kind] * D
    kv = rng.standard_normal((T, w)).astype(dtype)
    z = (1.5 * rng.standard_normal((T, w))).astype(dtype)
    ape = (0.3 * rng.standard_normal((m, w))).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    idx = None
    if kind == "csa":
        idx = (rng.standard_normal((T, 2 * DI)).astype(dtype),
               (1.5 * rng.standard_normal((T, 2 * DI))).astype(dtype),
               (0.3 * rng.standard_normal((m, 2 * DI))).astype(np.float32),
               (1 + 0.1 * rng.standard_normal(DI)).astype(np.float32))
    return kv, z, ape, nw, idx


def _pool(kind, device, R=4, nb=64, epb=4, mb=16, **kw):
    return PagedKVPool(kind, nb, epb, R, mb, layout="rawkv", device=device, **kw)


def _t(a, dtype=None):
    import torch
    t = torch.from_numpy(np.ascontiguousarray(a)).cuda()
    return t if dtype is None else t.to(dtype)


def _arr(x):
    if hasattr(x, "detach"):
        import torch
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _entries(pool, slot, n):
    """(codes (n, 448), scale (n,), rope (n, 64), iq, isf) of entries 0..n-1."""
    table = _arr(pool.block_table)[slot]
    epb = pool.entries_per_block
    e = np.arange(n)
    blk, row = table[e // epb], e % epb
    out = [_arr(pool.fp8)[blk, row], _arr(pool.scale)[blk, row], _arr(pool.rope)[blk, row]]
    if pool.index_q is not None:
        out += [_arr(pool.index_q)[blk, row], _arr(pool.index_sf)[blk, row]]
    return out


def assert_entries_close(got, want, *, exact=False):
    """The kernel tolerance stated in the module doc (exact=True: bit for bit)."""
    gc, gs, gr = got[:3]
    wc, ws, wr = want[:3]
    if exact:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        return
    gd = ref.fp8_entry_dequantize(gc, gs, gr)
    wd = ref.fp8_entry_dequantize(wc, ws, wr)
    cos = (gd * wd).sum(1) / (np.linalg.norm(gd, axis=1) * np.linalg.norm(wd, axis=1))
    assert cos.min() >= 0.9999, f"entry cosine {cos.min()}"
    diff = gc != wc
    assert diff.mean() <= 1e-3, f"{diff.mean():.5f} of FP8 codes differ"
    step = np.abs((gc & 0x7F).astype(int) - (wc & 0x7F).astype(int))
    same_sign = (gc & 0x80) == (wc & 0x80)
    assert np.all(np.where(diff & same_sign, step, 0) <= 1), "an FP8 code moved more than one step"
    assert np.all(np.where(diff & ~same_sign, np.maximum(gc & 0x7F, wc & 0x7F), 0) <= 1)
    np.testing.assert_allclose(gs, ws, rtol=2.0 ** -7, atol=0)
    # one BF16 ulp, or FP32 rounding at the entry's scale for an element
    # that cancellation brought near zero
    scale = np.abs(np.asarray(wr, np.float64)).max(axis=-1, keepdims=True)
    assert np.all(np.abs(np.asarray(gr, np.float64) - wr) <= np.maximum(2.0 ** -7 * np.abs(wr), 2.0 ** -20 * scale)), \
        "a RoPE dim moved more than one BF16 ulp or 8 FP32 ulps of its entry's largest"
    if len(got) > 3:
        gq, gsf = got[3:]
        wq, wsf = want[3:]
        kd = ref.indexer_key_dequantize(gq, gsf)
        kw = ref.indexer_key_dequantize(wq, wsf)
        kc = (kd * kw).sum(1) / (np.linalg.norm(kd, axis=1) * np.linalg.norm(kw, axis=1))
        assert kc.min() >= 0.99, f"indexer key cosine {kc.min()}"
        codes_g = np.stack([gq & 15, gq >> 4], -1)
        codes_w = np.stack([wq & 15, wq >> 4], -1)
        assert (codes_g != codes_w).mean() <= 1e-2


def _sl(idx, lo, hi):
    if idx is None:
        return None
    return (idx[0][lo:hi], idx[1][lo:hi], idx[2], idx[3])
