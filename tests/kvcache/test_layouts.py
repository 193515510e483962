"""The ecosystem layouts' shared rules (rawkv/reference/kvcache/layouts.py,
rawkv/kvcache/layouts.py, rawkv/cu/kv_layouts.cu; docs/kvcache.md "Ecosystem
layouts"): page bytes, the UE8M0 exponent (exhaustive), every layout op's
argument errors and output rules, the stores against the reference on random
arguments, the launch plans of the CUDA paths recorded on a CPU, GPU argument
errors, empty inputs and a CUDA-graph capture of insert + bridge + gather.
Each op: test_model1_store.py, test_index_store.py, test_model1_gather.py,
test_topk_to_kvcache_indices.py; the sources' pages: tests/support/kvcache_layouts.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.kvcache import F32  # noqa: E402
from support.kvcache_layouts import _poisoned, tile_scaled, tt  # noqa: E402
from support.outputs import _refused, _ro  # noqa: E402
from support.properties import SETTINGS, host, judge, libs, make, same, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------
def test_page_bytes_follow_the_sources():
    # FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb, quantize_k_cache (MODEL1):
    # (P * bytes_per_token + 575) // 576 * 576, bytes_per_token = 448 + 2*64 + 7 + 1 (csrc/api/
    # sparse_decode.h at 4855c772bacb4d2cca413d6fb73cce396256a3c1: 448 + 64*2 + (448/64)*1 + 1);
    # DeepGEMM csrc/apis/attention.hpp at 0274ad7b911b99b4eb6f8d796403811cf1e18f3d,
    # fp8_fp4_paged_mqa_logits: head_dim_with_sf == kv_head_dim + sf_bytes (128 + 4, 64 + 4)
    for p in (1, 2, 3, 16, 63, 64, 65, 256):
        assert R.MODEL1.page_bytes(p) == (p * 584 + 575) // 576 * 576
        assert R.INDEX_FP8.page_bytes(p) == p * (128 + 4)        # DeepGEMM head_dim_with_sf 132
        assert R.INDEX_MXFP4.page_bytes(p) == p * (64 + 4)       # 64 packed bytes + one int32
        # 128 codes + one int32 (attention.hpp at e824173623a7458bd813e71b04a32eb67b2562dc, is_mx_sf), the
        # page stride a multiple of 512 (fp8_fp4_paged_sparse_mqa_logits: stride(0) % 512 == 0)
        assert R.INDEX_MXFP8.page_bytes(p) == (p * (128 + 4) + 511) // 512 * 512
    assert R.INDEX_MXFP8.page_bytes(64) == 8704 and R.INDEX_MXFP8.page_bytes(128) == 16896 == 128 * 132
    assert R.MODEL1.page_bytes(64) == 37440 and R.MODEL1.page_bytes(2) == 1728
    assert R.MODEL1.data_bytes + R.MODEL1.scale_bytes == 584
    for bad in (0, -1):
        with pytest.raises(ValueError, match="^page_size:"):
            R.MODEL1.page_bytes(bad)
    with pytest.raises(TypeError, match="^page_size:"):
        R.MODEL1.page_bytes(2.0)


# ---------------------------------------------------------------------------
# UE8M0 exponent: exhaustive
# ---------------------------------------------------------------------------
def _exact_exponent(a, fmax):
    """Smallest e with a <= fmax * 2^e (float64 arithmetic: exact here)."""
    a = a.astype(np.float64)
    _, k = np.frexp(a / fmax)
    e = k.astype(np.int64) - 1
    e = np.where(fmax * np.ldexp(1.0, e) >= a, e, e + 1)
    e = np.where(fmax * np.ldexp(1.0, e - 1) >= a, e - 1, e)
    assert ((fmax * np.ldexp(1.0, e) >= a) & (fmax * np.ldexp(1.0, e - 1) < a)).all()
    return e


@pytest.mark.parametrize("fmax,floor,binade", [(448.0, R.FP8_AMAX_FLOOR, 0), (448.0, R.FP8_AMAX_FLOOR, 9),
                                               (6.0, R.MXFP4_AMAX_FLOOR, 0), (6.0, R.MXFP4_AMAX_FLOOR, -124)])
def test_ue8m0_exponent_is_exact_on_a_whole_binade(fmax, floor, binade):
    """Every float32 amax of a binade: the reference exponent (ceil_log2 of
    the IEEE quotient, as the kernels compute it) is the exact ceiling; so
    is DeepSeek's form amax * fp8_max_inv with the bit-level ceil (DeepSeek-V4
    inference/kernel.py fast_log2_ceil / fast_round_scale, blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8
    at Mockingjay1316/deepseek-v4-flash-spark 0825add42734731a285e30f657b0ccfc5bad74c9)."""
    bits = np.arange(2 ** 23, dtype=np.uint32) + np.uint32((127 + binade) << 23)
    a = np.maximum(bits.view(F32), F32(floor))
    want = _exact_exponent(a, fmax)
    assert np.array_equal(R.ue8m0_exponent(a, fmax, floor), want)
    assert np.array_equal(R.ceil_log2(a * F32(1.0 / fmax)), want)


def test_ue8m0_exponent_on_every_bf16_value():
    """Every positive finite BF16 amax (the layouts quantize BF16 values):
    the exponent is exact and equals ceil(log2(.)) taken in float32 (the
    form vLLM's Triton kernels use: fused_compress_quant_cache.py at
    e8f3d1e27521ae42f2e602a6b7bc2c083e89f9dc) and DeepSeek's bit-level ceil of
    amax * fl(1/fmax) (kernel.py blob ea7976fa, fast_round_scale); the range is [-22, 120] for FP8 and [-126, 126] for
    MXFP4, so 2^-e is always a normal float32."""
    a = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(F32)
    for fmax, floor, lo, hi in ((448.0, R.FP8_AMAX_FLOOR, -22, 120), (6.0, R.MXFP4_AMAX_FLOOR, -126, 126)):
        e = R.ue8m0_exponent(a, fmax, floor)
        assert np.array_equal(e, _exact_exponent(np.maximum(a, F32(floor)), fmax))
        with np.errstate(divide="ignore"):
            assert np.array_equal(e, np.ceil(np.log2(np.maximum(a, F32(floor)) / F32(fmax))).astype(np.int64))
        assert np.array_equal(e, R.ceil_log2(np.maximum(a, F32(floor)) * F32(1.0 / fmax)))   # DeepSeek's form
        assert e.min() == lo and e.max() == hi


def test_ue8m0_value_bytes():
    b = np.arange(256, dtype=np.uint8)
    v = R.ue8m0_value(b)
    assert np.isnan(v[255]) and not np.isnan(v[:255]).any()
    assert np.array_equal(v[:255].astype(np.float64), np.ldexp(1.0, np.arange(255) - 127))
    assert v[0] == F32(2.0 ** -127) and v[0] > 0            # a float32 subnormal, not 0
    # torch's float8_e8m0fnu agrees on every byte
    assert np.array_equal(tt(b).view(torch.float8_e8m0fnu).float().numpy()[:255], v[:255])


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("call,match", [
    (lambda c, x, s: kc.model1_store(c.astype(np.int8), x, s, page_size=4), "^cache:"),
    (lambda c, x, s: kc.model1_store(c[:, :-1], x, s, page_size=4), "^cache:"),
    (lambda c, x, s: kc.model1_store(c, x, s, page_size=5), "^cache:"),
    (lambda c, x, s: kc.model1_store(c, x, s, page_size=0), "^page_size:"),
    (lambda c, x, s: kc.model1_store(c, x[:, :448], s, page_size=4), "^entries:"),
    (lambda c, x, s: kc.model1_store(c, x.astype(np.float64), s, page_size=4), "^entries:"),
    (lambda c, x, s: kc.model1_store(c, x, s[:2], page_size=4), "^slots:"),
    (lambda c, x, s: kc.model1_store(c, x, s.astype(np.float32), page_size=4), "^slots:"),
    (lambda c, x, s: kc.model1_store(c, x, s, page_size=4, offsets=s), "^offsets:"),
    (lambda c, x, s: kc.model1_store(c, x, s, page_size=4, errors=np.zeros(0, np.int32)), "^errors:"),
    (lambda c, x, s: kc.model1_window_insert(c, x, None, page_size=4), "^slot_mapping:"),
    (lambda c, x, s: kc.index_fp8_store(c, x, s, page_size=4), "^cache:"),
    (lambda c, x, s: kc.model1_gather(c, s, page_size=4), "^indices:"),
    (lambda c, x, s: kc.model1_gather(c, s.astype(np.int32), page_size=4, dtype="int8"), "^dtype:"),
    (lambda c, x, s: kc.topk_to_kvcache_indices(s[None], np.zeros((1, 2), np.int64), page_size=4,
                                                num_pages=3), "^block_table:"),
    (lambda c, x, s: kc.topk_to_kvcache_indices(s, np.zeros((1, 2), np.int32), page_size=4,
                                                num_pages=3), "^topk_ids:"),
    (lambda c, x, s: kc.topk_to_kvcache_indices(s[None], np.zeros((1, 2), np.int32), page_size=4,
                                                num_pages=2 ** 30), "^num_pages:"),
])
def test_cpu_argument_errors_name_the_argument_and_write_nothing(rng, call, match):
    c = R.new_cache(R.MODEL1, 3, 4)
    x = tile_scaled(rng, 4, 512, 64)
    s = np.array([0, 1, 2, 3], np.int64)
    with pytest.raises((TypeError, ValueError), match=match):
        call(c, x, s)
    assert not c.any()


def test_new_layout_cache_refuses_more_slots_than_int32_holds():
    """new_layout_cache (and the reference's new_cache) made a cache of
    num_pages * page_size >= 2^31 records, allocating it (146 GB for
    2^25 MXFP4 pages of 64), which every op then refused ('cache: ... exceed
    the int32 slot range'). Refused naming num_pages before anything is
    allocated; the largest cache the ops take is still made."""
    for layout in ("model1", "index_fp8", "index_mxfp4"):
        for n, p in ((2 ** 25, 64), (1, 2 ** 31), (2 ** 31 - 1, 2)):
            with pytest.raises(ValueError, match="^num_pages: .* int32 slot range"):
                kc.new_layout_cache(layout, n, p, device="meta")
            with pytest.raises(ValueError, match="^num_pages: .* int32 slot range"):
                R.new_cache(R.LAYOUTS[layout], n, p)
        c = kc.new_layout_cache(layout, 2 ** 31 - 1, 1, device="meta")
        assert c.shape == (2 ** 31 - 1, R.LAYOUTS[layout].page_bytes(1))
        with pytest.raises(TypeError, match="^page_size:"):
            kc.new_layout_cache(layout, 2, 4.0, device="meta")


def test_layout_ops_refuse_read_only_or_overlapping_outputs():
    """model1_store into a read-only cache raised numpy's message, naming no
    argument."""
    p, n = 4, 2
    x = np.ones((1, 512), np.float32)
    slots = np.array([1], np.int32)
    cache = kc.new_layout_cache("model1", n, p)
    _refused("cache", None, lambda: kc.model1_store(_ro(cache.copy()), x, slots, page_size=p))
    _refused("cache", None, lambda: kc.model1_window_insert(_ro(cache.copy()), x, slots, page_size=p))
    _refused("errors", None, lambda: kc.index_fp8_store(kc.new_layout_cache("index_fp8", n, p),
                                                        np.ones((1, 128), np.float32), slots, page_size=p,
                                                        errors=_ro(np.zeros(1, np.int32))))
    _refused("errors", "cache", lambda: kc.model1_store(cache, x, slots, page_size=p,
                                                        errors=cache[1, :4].view(np.int32)))
    assert not cache.any()
    rows = np.zeros((1, 512), np.float32)
    _refused("out", None, lambda: kc.model1_gather(cache, slots, page_size=p, dtype="float32", out=_ro(rows)))
    table = np.zeros((1, 2), np.int32)
    _refused("out", "block_table", lambda: kc.topk_to_kvcache_indices(
        np.zeros((1, 2), np.int32), table, page_size=p, num_pages=n, out=table))
    kc.model1_store(cache, x, slots, page_size=p, errors=np.zeros(1, np.int32))       # apart: fine
    assert cache[0].any() and not cache[1].any()
    assert R.MODEL1.page_bytes(p) == cache.shape[1]


def test_a_cache_shows_every_record_of_its_pages():
    """A torch cache given as a slice of each page (pages along dimension 0,
    page_bytes apart) was accepted and written whole by the op, past the
    bytes it shows; compiled, the op gets a copy of those bytes only
    (functionalization), so the records past the slice could not land.
    Refused naming cache, eagerly as compiled (test_layout_compile.py),
    nothing written. The overlap checks compare the records of every page
    (what the ops move: an errors= in a record is refused, even through
    flashmla_view's shape), not a page's padding, which no op touches."""
    torch = pytest.importorskip("torch")
    p = 4
    full = kc.new_layout_cache("model1", 2, p, device="cpu")
    rows = torch.randn(2, 512)
    slots = torch.tensor([0, 99], dtype=torch.int32)
    out = torch.empty(1, 512)
    for part in (full[:, :8], full[:, :p * 584 - 1], kc.flashmla_view(full, p)[:, :p - 1]):
        with pytest.raises(ValueError, match=r"^cache: a model1 page of 4 records holds them in its first 2336 "):
            kc.model1_store(part, rows, slots, page_size=p)
        with pytest.raises(ValueError, match="^cache: "):
            kc.model1_gather(part, slots[:1], page_size=p, out=out)
    assert not full.any()
    err = full[0, 16:20].view(torch.int32)
    _refused("errors", "cache", lambda: kc.model1_store(kc.flashmla_view(full, p), rows, slots, page_size=p,
                                                        errors=err))
    assert not full.any()
    rec = full[1, 64:64 + 512 * 4].view(torch.float32).view(1, 512)
    _refused("out", "cache", lambda: kc.model1_gather(full[:, :p * 584], slots[:1], page_size=p, out=rec))
    pad = full[0, 2336:2340].view(torch.int32)                      # page 0's padding: the op's bytes apart
    kc.model1_store(kc.flashmla_view(full, p), rows, slots, page_size=p, errors=pad)
    assert full[0, :2336].any() and int(pad) == 1 and not full[0, 2340:].any()


def test_a_store_into_a_pools_bookkeeping_is_refused():
    """A layout store's cache may be a pool's pages (MODEL1) or index_pages
    (keys): that is what an engine stores into. Any other buffer of a pool or
    decode state, viewed as pages of bytes, was accepted: a store into
    pool.marks marked entries a request never wrote (a previous owner's
    bytes then read as its own, no error), one into pool.owners forged a
    block's owner. Refused naming cache, nothing written; the same rule runs
    before the CUDA launch (_rules.store)."""
    pool = kc.PagedKVPool("csa", 33, 132, 288, 1, layout="rawkv", device="cpu")   # marks (33, 132)
    state = kc.DecodeState("hca", 288, device="cpu")
    slot = pool.add_request()
    pool.prepare_step([slot], [0])
    keys = np.ones((1, 128), np.float32)
    ent = np.ones((1, 512), np.float32)
    one = np.zeros(1, np.int32)
    cases = [
        ("marks", lambda: kc.index_fp8_store(pool.marks, keys, one, page_size=1)),
        ("owners", lambda: kc.index_fp8_store(pool.owners.view(np.uint8).reshape(1, 132), keys, one,
                                              page_size=1)),
        ("request_ids", lambda: kc.model1_store(pool.request_ids.view(np.uint8).reshape(1, 1152), ent, one,
                                                page_size=1)),
        ("count", lambda: kc.model1_window_insert(state.count.view(np.uint8).reshape(1, 1152), ent, one,
                                                  page_size=1)),
    ]
    for role, call in cases:
        before = [np.array(b).copy() for b in (pool.marks, pool.owners, pool.request_ids, state.count)]
        with pytest.raises(ValueError, match=f"^cache: lies in the {role} buffer of a "):
            call()
        assert all(np.array_equal(np.array(b), a)
                   for b, a in zip((pool.marks, pool.owners, pool.request_ids, state.count), before))
    # a model1 pool's own pages / index_pages take their layout's records
    m1 = kc.PagedKVPool("csa", 2, 4, 1, 1, device="cpu")
    kc.model1_store(m1.pages, ent, one, page_size=4)
    kc.index_fp8_store(m1.index_pages, keys, one, page_size=4)
    assert m1.pages[0].any() and m1.index_pages[0].any()


def test_a_store_into_a_pools_pages_takes_the_pools_geometry():
    """A store into a model1 pool's pages / index_pages checked only the
    buffer's role and the bytes of a page: an FP8 key store of page size 17
    into MXFP4 index pages of 33 entries (2,244 bytes a page both), an MXFP4
    one of page size 11 into them seen as 3 times as many pages, or a
    MODEL1 store of page size 31 into the pages of a pool of 63 entries seen
    as twice as many pages, wrote records of another geometry over the
    pool's entries, which its gathers then decoded as garbage, no error.
    Refused naming cache (the other key layout) or page_size, nothing
    written; the rule runs before the CUDA launch too (_rules.store)."""
    keys = np.ones((1, 128), np.float32)
    ent = np.ones((1, 512), np.float32)
    one = np.zeros(1, np.int32)
    mx = kc.PagedKVPool("csa", 2, 33, 1, 1, device="cpu", index_layout="mxfp4")
    m1 = kc.PagedKVPool("csa", 2, 63, 1, 1, device="cpu")
    fp8 = kc.PagedKVPool("csa", 17, 4, 1, 1, device="cpu")       # index_pages (17, 528): 33 pages of 272
    cases = [
        ("^cache: lies in the index_pages of a PagedKVPool with index_layout 'mxfp4'",
         lambda: kc.index_fp8_store(mx.index_pages, keys, one, page_size=17)),
        ("^page_size: ", lambda: kc.index_mxfp4_store(mx.index_pages.reshape(6, -1), keys, one, page_size=11)),
        ("^page_size: ", lambda: kc.model1_store(m1.pages.reshape(4, -1), ent, one, page_size=31)),
        ("^page_size: ", lambda: kc.model1_window_insert(m1.pages.reshape(4, -1), ent, one, page_size=31)),
        # FP8 pages of 4 keys seen as MXFP4 pages of 4: the pool's page size, not its layout
        ("^cache: lies in the index_pages of a PagedKVPool with index_layout 'fp8'",
         lambda: kc.index_mxfp4_store(fp8.index_pages.reshape(33, -1), keys, one, page_size=4)),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match=match):
            call()
    for p in (mx, m1, fp8):
        assert not np.asarray(p.pages).any() and not np.asarray(p.index_pages).any()
    # the pool's own geometry is taken
    kc.index_mxfp4_store(mx.index_pages, keys, one, page_size=33)
    kc.model1_store(m1.pages, ent, one, page_size=63)
    kc.index_fp8_store(fp8.index_pages[1:], keys, one, page_size=4)
    assert mx.index_pages[0].any() and m1.pages[0].any() and fp8.index_pages[1].any()


def test_fp8_and_mxfp8_key_pages_of_one_size_keep_their_pools_layout():
    """FP8 and MXFP8 key pages of 128 entries have the same bytes (16,896):
    a store or a view of the other key layout into a pool's index_pages is
    refused naming cache / layout (the pool's index_layout decides), nothing
    written; the pool's own layout is taken."""
    keys = np.ones((1, 128), np.float32)
    one = np.zeros(1, np.int32)
    f8 = kc.PagedKVPool("csa", 2, 128, 1, 1, device="cpu", index_layout="fp8")
    m8 = kc.PagedKVPool("csa", 2, 128, 1, 1, device="cpu", index_layout="mxfp8")
    assert f8.index_pages.shape == m8.index_pages.shape == (2, 16896)
    with pytest.raises(ValueError, match="^cache: lies in the index_pages of a PagedKVPool with index_layout 'fp8'"):
        kc.index_mxfp8_store(f8.index_pages, keys, one, page_size=128)
    with pytest.raises(ValueError, match="^cache: lies in the index_pages of a PagedKVPool with index_layout 'mxfp8'"):
        kc.index_fp8_store(m8.index_pages, keys, one, page_size=128)
    with pytest.raises(ValueError, match="^layout: the cache lies in the index_pages of a PagedKVPool with "
                                         "index_layout 'mxfp8', got 'index_fp8'"):
        kc.deepgemm_view(m8.index_pages, 128, "index_fp8")
    with pytest.raises(ValueError, match="^layout: the cache lies in the index_pages of a PagedKVPool with "
                                         "index_layout 'fp8', got 'index_mxfp8'"):
        kc.deepgemm_view(f8.index_pages, 128, "index_mxfp8")
    assert not f8.index_pages.any() and not m8.index_pages.any()
    kc.index_mxfp8_store(m8.index_pages, keys, one, page_size=128)
    kc.index_fp8_store(f8.index_pages, keys, one, page_size=128)
    assert kc.deepgemm_view(m8.index_pages, 128, "index_mxfp8").shape == (2, 128, 1, 132)
    # one key of ones: FP8 scale 2^-8 (one float32), MXFP8 scale byte 127 - 8 for each of its 4 blocks
    assert f8.index_pages[0, 128 * 128:128 * 128 + 4].view(np.float32)[0] == 2.0 ** -8
    assert list(m8.index_pages[0, 128 * 128:128 * 128 + 4]) == [119, 119, 119, 119]


def test_an_engine_view_of_a_pools_pages_takes_the_pools_geometry():
    """flashmla_view / deepgemm_view of a pool's buffer checked only the
    bytes of a page, so the same memory seen as pages of another layout or
    page size was returned: a MODEL1 pool of 10 entries' pages as FP8 keys
    of 48 (6,336 bytes a page both), its FP8 index pages of 48 as MODEL1
    pages of 10, MXFP4 index pages of 33 as FP8 keys of 17 (2,244 bytes),
    the pages of 63 entries reshaped to pages of 31, a pool's marks as
    bytes. FlashMLA / DeepGEMM would read every entry as garbage. Refused
    naming cache, layout or page_size, on numpy and torch (and a CUDA
    tensor's path, faked) alike; the pool's own geometry is taken, and a
    cache of the engine's own is still only its shape."""
    m1 = kc.PagedKVPool("csa", 2, 10, 1, 1, device="cpu")                    # pages (2, 6336)
    fp8 = kc.PagedKVPool("csa", 2, 48, 1, 1, device="cpu")                   # index_pages (2, 6336)
    mx = kc.PagedKVPool("csa", 2, 33, 1, 1, device="cpu", index_layout="mxfp4")
    m63 = kc.PagedKVPool("csa", 2, 63, 1, 1, device="cpu")
    m68 = kc.PagedKVPool("csa", 2, 68, 1, 1, device="cpu")
    assert m1.pages.shape == fp8.index_pages.shape
    cases = [
        ("^cache: lies in the pages buffer of a PagedKVPool", lambda c: kc.deepgemm_view(c(m1.pages), 48)),
        ("^cache: lies in the index_pages buffer of a PagedKVPool",
         lambda c: kc.flashmla_view(c(fp8.index_pages), 10)),
        ("^layout: the cache lies in the index_pages of a PagedKVPool with index_layout 'mxfp4'",
         lambda c: kc.deepgemm_view(c(mx.index_pages), 17, "index_fp8")),
        ("^page_size: ", lambda c: kc.flashmla_view(c(m63.pages.reshape(4, -1)), 31)),
        ("^page_size: ", lambda c: kc.deepgemm_view(c(mx.index_pages.reshape(6, -1)), 11, "index_mxfp4")),
        # marks (2, 68) as MXFP4 pages of one key
        ("^cache: lies in the marks buffer of a PagedKVPool",
         lambda c: kc.deepgemm_view(c(m68.marks), 1, "index_mxfp4")),
    ]
    for conv in (lambda a: a, torch.from_numpy, lambda a: fake(torch.from_numpy(a))):
        for match, call in cases:
            with pytest.raises(ValueError, match=match):
                call(conv)
        # the pool's own geometry
        assert tuple(kc.flashmla_view(conv(m1.pages), 10).shape) == (2, 10, 1, 584)
        assert tuple(kc.deepgemm_view(conv(fp8.index_pages), 48).shape) == (2, 48, 1, 132)
        assert tuple(kc.deepgemm_view(conv(mx.index_pages), 33, "index_mxfp4").shape) == (2, 33, 1, 68)
        # (its second page starts 2,244 bytes in, not on a 16-byte boundary: DeepGEMM cannot read it in
        # place, test_an_engine_view_refuses_a_cache_its_engine_cannot_read_in_place)
        with pytest.raises(ValueError, match=r"^cache: starts at .*, not 16-byte aligned \(address % 16 == 4\)"):
            kc.deepgemm_view(conv(mx.index_pages[1:]), 33, "index_mxfp4")
        assert tuple(kc.deepgemm_view(conv(fp8.index_pages[1:]), 48).shape) == (1, 48, 1, 132)
        # a cache of the engine's own of those bytes is not a pool's: any geometry its shape fits
        assert tuple(kc.deepgemm_view(conv(m1.pages.copy()), 48).shape) == (2, 48, 1, 132)


# DeepGEMM deepseek-ai/DeepGEMM at 54e22612409371d6364144b69086735beb54e98b, csrc/apis/attention.hpp,
# fp8_fp4_paged_mqa_logits (fp8_paged_mqa_logits, lines 418-430, calls it with q's scale None):
# line 278 (MXFP4 keys) and line 312 (FP8 keys) assert fused_kv_cache.scalar_type() == torch::kByte,
# and nothing else (uint8 only; 1c9fa43e's fp8_paged_mqa_logits asserts the same). FlashMLA
# deepseek-ai/FlashMLA at 9241ae3ef9bac614dd25e45e507e089f888280e0 (and 520fec6a), csrc/api/sparse_decode.h
# line 260: kv.dtype() is kFloat8_e4m3fn, kInt8 or kUInt8.
DEEPGEMM_KV_DTYPES = ("uint8",)
FLASHMLA_KV_DTYPES = ("float8_e4m3fn", "int8", "uint8")


def _cache_forms(layout, p, dtype, conv):
    """A layout cache of `dtype` (a torch name) in the forms a view takes:
    the (num_pages, page_bytes) pages, pages from the second page on, and
    the engine's own 4-d view of them."""
    lay = R.LAYOUTS[layout]
    rec = lay.data_bytes + lay.scale_bytes
    pages = conv(kc.new_layout_cache(layout, 3, p, device="cpu").view(getattr(torch, dtype)))
    return (pages, pages[1:], pages.as_strided((3, p, 1, rec), (lay.page_bytes(p), rec, rec, 1)))


@pytest.mark.parametrize("layout", ["index_fp8", "index_mxfp4"])
def test_deepgemm_view_is_the_uint8_view_deepgemm_takes(layout):
    """deepgemm_view of a float8_e4m3fn cache (a dtype every layout op
    takes) was a float8 view, which DeepGEMM's fp8_paged_mqa_logits /
    fp8_fp4_paged_mqa_logits refuse (kByte only: DEEPGEMM_KV_DTYPES). The
    view of a cache of each accepted dtype (C.CACHE), torch and a CUDA
    tensor's path (faked) alike, is uint8 over the cache's own memory: its
    first byte, DeepGEMM's shape and strides in bytes, writes through it
    land in the cache. A numpy cache is a uint8 array likewise."""
    from rawkv.kvcache import _rules as C
    p = 32
    lay = R.LAYOUTS[layout]
    rec = lay.data_bytes + lay.scale_bytes
    for dtype in C.CACHE:
        for conv in (lambda t: t, fake):
            for cache in _cache_forms(layout, p, dtype, conv):
                v = kc.deepgemm_view(cache, p, layout)
                assert isinstance(v, torch.Tensor) and str(v.dtype).replace("torch.", "") in DEEPGEMM_KV_DTYPES
                assert v.dtype == torch.uint8
                assert tuple(v.shape) == (cache.shape[0], p, 1, rec)
                assert v.stride() == (lay.page_bytes(p), rec, rec, 1)
                assert v.data_ptr() == cache.data_ptr()
                v[-1, p - 1, 0, rec - 1] = 0x5A                                   # the cache's memory
                assert cache.view(torch.uint8).reshape(-1)[-(lay.page_bytes(p) - p * rec) - 1] == 0x5A
    n = kc.new_layout_cache(layout, 3, p)
    for cache in (n, n[1:]):
        v = kc.deepgemm_view(cache, p, layout)
        assert isinstance(v, np.ndarray) and v.dtype == np.uint8
        assert v.shape == (cache.shape[0], p, 1, rec) and v.strides == (lay.page_bytes(p), rec, rec, 1)
        assert v.__array_interface__["data"][0] == cache.__array_interface__["data"][0]


def test_flashmla_view_keeps_a_dtype_flashmla_takes():
    """FlashMLA's sparse decode takes a float8_e4m3fn, int8 or uint8 kv
    (FLASHMLA_KV_DTYPES), so flashmla_view keeps the cache's dtype: every
    dtype a cache may have (C.CACHE) is one of them. Shape, strides and
    first byte are the cache's pages'."""
    from rawkv.kvcache import _rules as C
    p = 4
    pb = R.MODEL1.page_bytes(p)
    assert set(C.CACHE) <= set(FLASHMLA_KV_DTYPES)
    for dtype in C.CACHE:
        for conv in (lambda t: t, fake):
            for cache in _cache_forms("model1", p, dtype, conv):
                v = kc.flashmla_view(cache, p)
                assert v.dtype == cache.dtype == getattr(torch, dtype)
                assert tuple(v.shape) == (cache.shape[0], p, 1, 584) and v.stride() == (pb, 584, 584, 1)
                assert v.data_ptr() == cache.data_ptr()
    v = kc.flashmla_view(kc.new_layout_cache("model1", 3, p), p)
    assert v.dtype == np.uint8 and v.shape == (3, p, 1, 584) and v.strides == (pb, 584, 584, 1)


# What each engine loads a cache's first byte as (docs/kvcache.md, "DeepGEMM compatibility per
# architecture"). DeepGEMM at 54e22612409371d6364144b69086735beb54e98b: fp8_fp4_paged_mqa_logits
# (csrc/apis/attention.hpp lines 283-294 / 317-328) hands fused_kv_cache.data_ptr() and data_ptr() +
# block_kv * kv_head_bytes to make_tma_3d_desc / make_tma_2d_desc (csrc/jit_kernels/impls/
# sm90_fp8_mqa_logits.hpp lines 340-347, sm100_mqa_logits.hpp lines 415-436), i.e. to
# cuTensorMapEncodeTiled (csrc/jit_kernels/impls/runtime_utils.hpp lines 144-148 / 182-186), whose
# globalAddress must be 16-byte aligned (CUDA driver API); DeepGEMM asserts no alignment itself, the
# driver's error surfaces through DG_CUDA_DRIVER_CHECK. FlashMLA at
# 9241ae3ef9bac614dd25e45e507e089f888280e0: csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh lines 554-584
# load each record's codes with load_128b_from_gmem (16 bytes) from kv + page * stride + row * 576;
# csrc/sm100/decode/head64/kernel.cuh line 911 asserts k_ptr % 16 == 0.
ENGINE_ALIGN = 16
VIEWS = [(lambda c, p: kc.flashmla_view(c, p), "model1", "FlashMLA's sparse decode loads"),
         (lambda c, p: kc.deepgemm_view(c, p, "index_fp8"), "index_fp8", "DeepGEMM's paged MQA logits read"),
         (lambda c, p: kc.deepgemm_view(c, p, "index_mxfp4"), "index_mxfp4", "DeepGEMM's paged MQA logits read")]


def _at(lib, n, pb, by):
    """A (n, pb) uint8 cache (numpy, or torch on CPU) starting `by` bytes
    past a 16-byte boundary."""
    whole = np.zeros(n * pb + 32, np.uint8) if lib == "numpy" else torch.zeros(n * pb + 32, dtype=torch.uint8)
    addr = whole.__array_interface__["data"][0] if lib == "numpy" else whole.data_ptr()
    start = (-addr) % ENGINE_ALIGN + by
    return whole[start:start + n * pb].reshape(n, pb)


def _outcome(call):
    try:
        v = call()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "accepted", tuple(v.shape)


@pytest.mark.parametrize("view,layout,why", VIEWS)
def test_an_engine_view_refuses_a_cache_its_engine_cannot_read_in_place(view, layout, why):
    """deepgemm_view took a key cache whose first byte was only 4-byte
    aligned (the key stores' rule, CACHE_ALIGN), and DeepGEMM's TMA
    descriptor over it fails in the driver (ENGINE_ALIGN). Now an engine's
    view refuses a cache not 16-byte aligned with a ValueError naming cache
    and saying why, numpy, torch, float8 and a CUDA tensor's path (faked)
    alike, the same message; flashmla_view's rule was already 16 bytes (the
    MODEL1 kernels' own) and now says why too. An aligned cache, one of no
    pages, and a fresh copy of a refused one are taken. The key stores still
    take a 4-byte aligned cache (their kernels write 4-byte words; a copy
    hands the bytes to DeepGEMM), and its copy's view shows them."""
    p, n = 32, 2
    pb = R.LAYOUTS[layout].page_bytes(p)
    assert pb % ENGINE_ALIGN == 0                     # every page of an aligned cache is aligned
    for lib in ("numpy", "torch"):
        for by in (1, 2, 4, 8, 12, 0, ENGINE_ALIGN):
            c = _at(lib, n, pb, by)
            forms = [c] if lib == "numpy" else [c, c.view(torch.float8_e4m3fn)]
            for cache in forms:
                got = _outcome(lambda: view(cache, p))
                if by % ENGINE_ALIGN:
                    assert got[0] == "ValueError", (lib, by)
                    assert re.match(rf"^cache: starts at address 0x[0-9a-f]+, not 16-byte aligned "
                                    rf"\(address % 16 == {by}\); {why} ", got[1]), got[1]
                    copy = cache.copy() if lib == "numpy" else cache.clone()
                    assert _outcome(lambda: view(copy, p)) == ("accepted", (n, p, 1, R.LAYOUTS[layout].data_bytes
                                                                            + R.LAYOUTS[layout].scale_bytes))
                else:
                    assert got[0] == "accepted", (lib, by, got)
                if lib == "torch":                   # the CUDA path (faked): the same memory, the same outcome
                    assert _outcome(lambda: view(fake(cache), p)) == got
        empty = _at(lib, 0, pb, 4)                   # no pages: no byte an engine reads
        assert _outcome(lambda: view(empty, p))[0] == "accepted"
    if layout != "model1":
        store = kc.index_fp8_store if layout == "index_fp8" else kc.index_mxfp4_store
        c = _at("torch", n, pb, 4)
        keys = torch.randn(3, 128)
        store(c, keys, torch.tensor([0, 33, 63], dtype=torch.int32), page_size=p)
        want = kc.new_layout_cache(layout, n, p, device="cpu")
        store(want, keys, torch.tensor([0, 33, 63], dtype=torch.int32), page_size=p)
        assert torch.equal(c, want)
        assert torch.equal(kc.deepgemm_view(c.clone(), p, layout), kc.deepgemm_view(want, p, layout))


@pytest.mark.parametrize("view,layout,why", VIEWS)
def test_gpu_an_engine_view_refuses_a_cache_as_the_cpu(cuda, view, layout, why):
    """The same caches on CUDA: refused and taken as on the CPU (the
    messages' addresses aside)."""
    p, n = 32, 2
    pb = R.LAYOUTS[layout].page_bytes(p)
    whole = torch.zeros(n * pb + 32, dtype=torch.uint8, device="cuda")
    for by in (1, 4, 8, 0, ENGINE_ALIGN):
        c = whole[by:by + n * pb].view(n, pb)          # (a CUDA allocation is 256-byte aligned)
        cpu = _outcome(lambda: view(_at("torch", n, pb, by), p))
        gpu = _outcome(lambda: view(c, p))
        assert (cpu[0], re.sub("0x[0-9a-f]+", "A", str(cpu[1]))) == (gpu[0], re.sub("0x[0-9a-f]+", "A", str(gpu[1])))
        assert (gpu[0] == "accepted") == (by % ENGINE_ALIGN == 0)


def test_model1_gather_reads_a_pools_pages_only_in_the_pools_geometry():
    """model1_gather decodes MODEL1 records itself, as FlashMLA does
    through flashmla_view, but its cache was checked only for its page
    stride: a pool's FP8 index_pages of 48 keys (6,336-byte pages, a
    MODEL1 page of 10 records) and the pool's pages seen from a byte
    inside a page (pages.view(-1)[16:]) were decoded as rows of garbage,
    with no error, where flashmla_view refuses both. Refused naming
    cache, as the view is, nothing written (numpy, torch, a CUDA tensor's
    path faked); the pool's pages, from a page's first byte, are read."""
    fp8 = kc.PagedKVPool("csa", 2, 48, 1, 1, device="cpu")                   # index_pages (2, 6336)
    m1 = kc.PagedKVPool("csa", 4, 4, 1, 1, device="cpu")                     # pages (4, 2880)
    keys = np.linspace(-3, 3, 2 * 128, dtype=np.float32).reshape(2, 128)
    kc.index_fp8_store(fp8.index_pages, keys, np.array([0, 48], np.int32), page_size=48)
    kc.model1_store(m1.pages, np.linspace(-2, 2, 4 * 512, dtype=np.float32).reshape(4, 512),
                    np.array([0, 4, 8, 12], np.int32), page_size=4)
    assert fp8.index_pages.any() and m1.pages.any()

    def shifted(buf, by):
        n, pb = buf.shape
        return buf.reshape(-1)[by:by + (n - 1) * pb].reshape(n - 1, pb)

    idx = np.array([0, 1, 4], np.int32)
    cases = [
        ("^cache: lies in the index_pages buffer of a PagedKVPool \\(indexer keys\\); model1_gather reads",
         lambda c: (c(fp8.index_pages), 10)),
        ("^cache: starts 16 bytes into the pages of a PagedKVPool", lambda c: (c(shifted(m1.pages, 16)), 4)),
        ("^cache: starts 576 bytes into the pages of a PagedKVPool", lambda c: (c(shifted(m1.pages, 576)), 4)),
    ]
    for conv in (lambda a: a, torch.from_numpy, lambda a: fake(torch.from_numpy(a))):
        for match, make_cache in cases:
            cache, page_size = make_cache(conv)
            out, err = conv(np.full((3, 512), 7, np.float32)), conv(np.zeros(1, np.int32))
            with pytest.raises(ValueError, match=match):
                kc.model1_gather(cache, conv(idx), page_size=page_size, out=out, dtype="float32", errors=err)
            assert (np.asarray(out) == 7).all() and not np.asarray(err).any()
    # the pool's own pages, from any page's first byte, in its page size
    want = kc.model1_gather(m1.pages, idx, page_size=4, dtype="float32")
    assert want[0].any() and want[2].any()
    got = kc.model1_gather(shifted(m1.pages, m1.pages.shape[1]), idx, page_size=4, dtype="float32")
    assert np.array_equal(got[0], want[2])
    # the same bytes copied are the engine's own cache: only its shape counts
    kc.model1_gather(fp8.index_pages.copy(), idx, page_size=10)


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
STORES = {"model1": (kc.model1_store, R.model1_write, R.MODEL1, 512, "entries"),
          "window": (kc.model1_window_insert, R.model1_write, R.MODEL1, 512, "rows"),
          "index_fp8": (kc.index_fp8_store, R.index_fp8_write, R.INDEX_FP8, 128, "keys"),
          "index_mxfp4": (kc.index_mxfp4_store, R.index_mxfp4_write, R.INDEX_MXFP4, 128, "keys"),
          "index_mxfp8": (kc.index_mxfp8_store, R.index_mxfp8_write, R.INDEX_MXFP8, 128, "keys")}


@settings(SETTINGS, max_examples=60)
@given(seed=seeds, op=st.sampled_from(sorted(STORES)), pages=st.integers(1, 3), page_size=st.sampled_from([1, 2, 4, 0]),
       rows=st.integers(0, 5), width_delta=st.sampled_from([0, 0, 0, -16]),
       xdt=st.sampled_from(("float32", "bfloat16", "float16")), sdt=st.sampled_from(("int32", "int64", "float32")),
       offsets=st.booleans(), errors=st.booleans(), lib=libs, special=st.booleans())
def test_kvcache_layout_stores(seed, op, pages, page_size, rows, width_delta, xdt, sdt, offsets, errors, lib,
                               special):
    fn, write, lay, width, name = STORES[op]
    ps = max(page_size, 1)
    cache = np.zeros((pages, lay.page_bytes(ps)), np.uint8)
    x = make(seed, (rows, width + width_delta), xdt, lib, special=special)
    hi = pages * ps + 2 if not offsets else pages + 1
    slots = make(seed + 1, (rows,), sdt, lib, lo=-2, hi=hi)
    offs = make(seed + 2, (rows,), "int32", lib, lo=-1, hi=ps + 1) if offsets and op != "window" else None
    err = np.zeros(1, np.int32) if errors else None
    kw = {"offsets": offs} if op != "window" else {}
    want = cache.copy()

    def reference():
        bad = write(want, ps, host(x), host(slots), None if offs is None else host(offs))
        if err is not None:
            assert err[0] == bad
        return want
    if judge(lambda: fn(cache, x, slots, page_size=page_size, errors=err, **kw),
             ("cache", name, "slots", "slot_mapping", "page_size", "offsets", "errors"), lambda: None) is None:
        return
    same(cache, reference())


# ---------------------------------------------------------------------------
# The CUDA paths on a CPU: tensors that report is_cuda, a runtime that
# records launches. Every launch goes through its declaration
# (rawkv.kernels.kv_layouts), so a wrong keyword, a scalar of the wrong C type
# or a missing argument fails here; the tests check which buffer each pointer
# receives and the scalars. What the kernels compute: the GPU tests of each op.
# ---------------------------------------------------------------------------
class Recorder:
    device_index = -1
    sm_count, max_threads_per_sm = 132, 2048

    def __init__(self):
        from rawkv import runtime
        self._functions, self.calls = {}, []
        self.grid_stride = runtime.Runtime.grid_stride.__get__(self)
        self.resident_blocks = runtime.Runtime.resident_blocks.__get__(self)

    def _get_device(self):
        return -2                         # never "current": launches take rt.launch

    def function(self, filename, name, stream=None):
        from rawkv.kernels import kv_layouts as KL
        assert filename == "kv_layouts.cu" and name in KL.FILE.name_expressions(), name
        return name

    def launch(self, fn, grid, block, st, args, stream=None, shared_mem=0, what=None):
        st.pack(*args)                    # each scalar fits its C type
        self.calls.append((fn, grid, block, dict(zip([p.name for p in what.kernel.params], args))))

    def empty(self, shape, dtype, stream=None):
        return fake(torch.zeros(tuple(shape), dtype=dtype))

    def capturing(self, stream=None):
        return False


@pytest.fixture
def rec(monkeypatch):
    from rawkv import _op
    r = Recorder()
    # the ops' launches, and their outputs allocated by the public functions (rawkv._op.empty)
    for mod in (kc.layouts, _op):
        monkeypatch.setattr(mod, "get_runtime", lambda dev: r)
    return r


def test_launch_plan_of_the_stores(rec):
    p, n, N = 64, 5, 70
    cache = fake(torch.zeros((n, R.MODEL1.page_bytes(p)), dtype=torch.uint8))
    rows = fake(torch.zeros((N, 512), dtype=torch.bfloat16))
    slots = fake(torch.zeros(N, dtype=torch.int64))
    err = fake(torch.zeros(1, dtype=torch.int32))
    kc.model1_window_insert(cache, rows, slots, page_size=p, errors=err)
    (name, grid, block, a), = rec.calls
    assert name == "rkv_model1_store<__nv_bfloat16, long long>" and block == (256,) and grid[0] * 256 >= N * 32
    assert (a["rows"], a["slots"], a["offsets"], a["cache"], a["errors"]) == \
        (rows.data_ptr(), slots.data_ptr(), 0, cache.data_ptr(), err.data_ptr())
    assert (a["N"], a["num_pages"], a["page_size"], a["page_bytes"]) == (N, n, p, 37440)
    rec.calls.clear()
    offs = fake(torch.zeros(N, dtype=torch.int32))
    view = kc.flashmla_view(cache, p)
    kc.model1_store(view, fake(torch.zeros((N, 512))), fake(torch.zeros(N, dtype=torch.int32)), page_size=p,
                    offsets=offs)
    (name, _, _, a), = rec.calls
    assert name == "rkv_model1_store<float, int>" and a["offsets"] == offs.data_ptr()
    assert a["cache"] == cache.data_ptr() and a["errors"] == 0
    for store, lay, key in ((kc.index_fp8_store, R.INDEX_FP8, 0), (kc.index_mxfp4_store, R.INDEX_MXFP4, 1),
                            (kc.index_mxfp8_store, R.INDEX_MXFP8, 2)):
        rec.calls.clear()
        # DeepGEMM's view of the pages (the MXFP8 key's page stride padded: 8,704 bytes at P = 64)
        c = kc.deepgemm_view(fake(torch.zeros((n, lay.page_bytes(p)), dtype=torch.uint8)), p, lay.name)
        keys = fake(torch.zeros((N, 128), dtype=torch.bfloat16))
        store(c, keys, slots, page_size=p)
        (name, _, _, a), = rec.calls
        assert name == f"rkv_index_store<__nv_bfloat16, long long, {key}>"
        assert (a["rows"], a["cache"], a["page_bytes"], a["num_pages"]) == (keys.data_ptr(), c.data_ptr(),
                                                                            lay.page_bytes(p), n)
    rec.calls.clear()
    kc.model1_window_insert(cache, rows[:0], slots[:0], page_size=p)          # nothing to do
    assert rec.calls == []


def test_launch_plan_of_the_gather_and_the_bridge(rec):
    p, n = 64, 5
    cache = fake(torch.zeros((n, R.MODEL1.page_bytes(p)), dtype=torch.uint8))
    idx = fake(torch.zeros((3, 7), dtype=torch.int32))
    out = kc.model1_gather(cache, idx, page_size=p, dtype=torch.float16)
    (name, grid, block, a), = rec.calls
    assert name == "rkv_model1_gather<__half>" and out.dtype == torch.float16 and out.shape == (3, 7, 512)
    assert (a["cache"], a["indices"], a["out"], a["R"], a["num_pages"]) == \
        (cache.data_ptr(), idx.data_ptr(), out.data_ptr(), 21, n)
    rec.calls.clear()
    ids = fake(torch.zeros((4, 2, 9), dtype=torch.int64))
    table = fake(torch.zeros((6, 3), dtype=torch.int32))
    sl = fake(torch.zeros(4, dtype=torch.int32))
    res = kc.topk_to_kvcache_indices(ids, table, page_size=p, num_pages=n, slots=sl)
    (name, grid, block, a), = rec.calls
    assert name == "rkv_topk_to_kvcache<long long>" and res.dtype == torch.int32 and res.shape == (4, 2, 9)
    assert (a["ids"], a["table"], a["slots"], a["n_entries"], a["out"]) == \
        (ids.data_ptr(), table.data_ptr(), sl.data_ptr(), 0, res.data_ptr())
    assert (a["B"], a["per_row"], a["table_rows"], a["max_blocks"], a["num_pages"], a["page_size"]) == \
        (4, 18, 6, 3, n, p)
    with pytest.raises(ValueError, match="^cache:"):                          # misaligned base
        kc.model1_gather(fake(torch.zeros(n * R.MODEL1.page_bytes(p) + 8, dtype=torch.uint8)[8:].view(n, -1)),
                         idx, page_size=p)


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def test_gpu_errors_none_and_empty_inputs(cuda, rng):
    cache = torch.zeros((2, R.MODEL1.page_bytes(4)), dtype=torch.uint8, device="cuda")
    x = torch.from_numpy(tile_scaled(rng, 3, 512, 64)).cuda()
    kc.model1_window_insert(cache, x, torch.tensor([9, 0, -1], device="cuda"), page_size=4)
    want = R.new_cache(R.MODEL1, 2, 4)
    R.model1_write(want, 4, x.cpu().numpy(), [9, 0, -1])
    np.testing.assert_array_equal(cache.cpu().numpy(), want)
    kc.model1_window_insert(cache, x[:0], torch.zeros(0, dtype=torch.int64, device="cuda"), page_size=4)
    r = kc.model1_gather(cache, torch.zeros((0, 3), dtype=torch.int32, device="cuda"), page_size=4)
    assert tuple(r.shape) == (0, 3, 512)
    np.testing.assert_array_equal(cache.cpu().numpy(), want)


def test_gpu_argument_errors_launch_nothing(cuda, rng):
    pb = R.MODEL1.page_bytes(4)
    wide = torch.zeros((2, pb + 16), dtype=torch.uint8, device="cuda")
    cache = torch.zeros((2, pb), dtype=torch.uint8, device="cuda")
    x = torch.from_numpy(tile_scaled(rng, 2, 512, 64)).cuda()
    s = torch.tensor([0, 1], device="cuda")
    with pytest.raises(ValueError, match="^cache:"):               # misaligned base
        kc.model1_store(wide.view(-1)[8:8 + 2 * pb].view(2, -1), x, s, page_size=4)
    with pytest.raises(ValueError, match="^cache:"):               # page stride
        kc.model1_store(wide, x, s, page_size=4)
    with pytest.raises(TypeError, match="^cache:"):
        kc.model1_store(cache.view(torch.int8), x, s, page_size=4)
    with pytest.raises(ValueError, match="^slots:"):
        kc.model1_store(cache, x, s.cpu(), page_size=4)
    with pytest.raises(ValueError, match="^entries:"):
        kc.model1_store(cache, x.cpu(), s, page_size=4)
    with pytest.raises(ValueError, match="^entries:"):             # a row view that is not 16-byte aligned
        kc.model1_store(cache, x.view(-1)[2:2 + 512].view(1, 512), s[:1], page_size=4)
    with pytest.raises(ValueError, match="^block_table:"):
        kc.topk_to_kvcache_indices(s.view(1, 2), torch.zeros((1, 2), dtype=torch.int32), page_size=4,
                                   num_pages=2)
    assert not cache.any() and not wide.any()


def test_gpu_graph_capture(cuda, rng):
    """Window insert + bridge + gather captured in one CUDA graph (out=
    given) and replayed give the bits of the eager run."""
    import rawkv
    from rawkv.errors import CaptureError
    rawkv.warmup(0, files=["kv_layouts.cu"])
    P, npg, B, Kk = 64, 8, 4, 50
    cache = tt(_poisoned(rng, R.MODEL1, npg, P)).cuda()
    rows = torch.from_numpy(tile_scaled(rng, 40, 512, 64)).cuda().bfloat16()
    slots = torch.from_numpy(rng.permutation(npg * P)[:40].astype(np.int64)).cuda()
    table = torch.from_numpy(rng.permutation(npg)[:B * 2].reshape(B, 2).astype(np.int32)).cuda()
    ids = torch.from_numpy(rng.integers(-1, 2 * P, (B, Kk)).astype(np.int32)).cuda()
    idx = torch.empty((B, Kk), dtype=torch.int32, device="cuda")
    out = torch.empty((B, Kk, 512), dtype=torch.bfloat16, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")

    def step():
        kc.model1_window_insert(cache, rows, slots, page_size=P, errors=err)
        kc.topk_to_kvcache_indices(ids, table, page_size=P, num_pages=npg, out=idx, errors=err)
        kc.model1_gather(cache, idx, page_size=P, out=out, errors=err)

    bufs = [cache, idx, out, err]
    snap = [b.clone() for b in bufs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    eager = [b.clone() for b in bufs]
    assert not torch.equal(eager[0], snap[0])
    for b, s in zip(bufs, snap):
        b.copy_(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
        with pytest.raises(CaptureError):
            kc.model1_gather(cache, idx, page_size=P)              # would allocate its output
    for _ in range(2):
        for b, s in zip(bufs, snap):
            b.copy_(s)
        g.replay()
        torch.cuda.synchronize()
        for b, e in zip(bufs, eager):
            assert torch.equal(b.view(torch.uint8), e.view(torch.uint8))


def test_a_cache_in_a_pools_pages_starts_on_a_page():
    """A cache over a pool's pages (index_pages) with the pool's page
    stride but starting inside a page (pages.view(-1)[16:]) passed the
    geometry checks of flashmla_view / deepgemm_view and of the stores:
    the view showed records straddling the pool's records and scales, the
    store wrote scale bytes over the next page's codes. Refused naming
    cache, nothing written; the same memory from a page's first byte is
    taken."""
    torch = pytest.importorskip("torch")
    pool = kc.PagedKVPool("csa", 4, 4, 1, 1, device="cpu")
    pages, ipages = pool.torch_buffers()["pages"], pool.torch_buffers()["index_pages"]
    before = (pool.pages.copy(), pool.index_pages.copy())

    def shifted(buf, by):
        n, pb = buf.shape
        return buf.view(-1)[by:by + (n - 1) * pb].view(n - 1, pb)

    one = torch.zeros(1, dtype=torch.int32)
    for by in (16, 576):
        c = shifted(pages, by)
        with pytest.raises(ValueError, match=f"^cache: starts {by} bytes into the pages of a PagedKVPool"):
            kc.flashmla_view(c, 4)
        with pytest.raises(ValueError, match=f"^cache: starts {by} bytes into the pages of a PagedKVPool"):
            kc.model1_store(c, torch.randn(1, 512), one, page_size=4)
    c = shifted(ipages, 4)
    with pytest.raises(ValueError, match="^cache: starts 4 bytes into the index_pages of a PagedKVPool"):
        kc.deepgemm_view(c, 4)
    with pytest.raises(ValueError, match="^cache: starts 4 bytes into the index_pages of a PagedKVPool"):
        kc.index_fp8_store(c, torch.randn(1, 128), one, page_size=4)
    assert np.array_equal(pool.pages, before[0]) and np.array_equal(pool.index_pages, before[1])
    # from a page's first byte: the pool's pages
    assert tuple(kc.flashmla_view(shifted(pages, pages.shape[1]), 4).shape) == (3, 4, 1, 584)
    kc.model1_store(pages[1:], torch.randn(1, 512), one, page_size=4)
    assert pool.pages[1].any()
