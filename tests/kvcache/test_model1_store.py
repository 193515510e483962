"""model1_store and model1_window_insert: entries into FlashMLA's MODEL1_FP8Sparse pages
(rawkv/kvcache/layouts.py, rawkv/cu/kv_layouts.cu). The reference's pages
against pages built independently from FlashMLA's tests/quant.py and
DeepSeek's act_quant scales, vLLM's insert; edge cases, NaN / Inf, round
trips, every E4M3 code, addressing; the public ops on CPU arrays; the kernel
against the reference byte for byte on a poisoned cache."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.formats import bf16_round, e4m3_decode  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.kvcache import F32  # noqa: E402
from support.kvcache_layouts import edge_rows, fp8_codes, _poisoned, tile_scaled, tt, vllm_insert  # noqa: E402


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
def e8m0_byte(scale):
    """A power-of-two float32 scale as its float8_e8m0fnu byte (torch's cast)."""
    return scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def flashmla_pages(x, page_size, rule="deepseek"):
    """MODEL1_FP8Sparse pages built the way FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb
    quantize_k_cache lays them out (a page of P tokens: [P x (448 FP8 +
    128 B BF16)] [P x 8 B: 7 e8m0 scales + 1], padded to a multiple of 576),
    with the scale rule of DeepSeek act_quant / vLLM (rule 'deepseek': amax
    clamped to 1e-4; DeepSeek-V4 inference/kernel.py blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8
    at Mockingjay1316/deepseek-v4-flash-spark 0825add42734731a285e30f657b0ccfc5bad74c9, called by
    its model.py as act_quant(kv[..., :-rd], 64, "ue8m0", ..., True); vLLM cache_utils.py at
    4fec5ad6fd00f5128c6a797e9536ae1939c3bbe6) or FlashMLA's own test quantizer (rule 'flashmla':
    the scale clamped to 1e-4, _cast_scale_inv_to_ue8m0 at 520fec6a). x: (num_pages, P, 512) BF16 values."""
    n, p, _ = x.shape
    size = (p * 584 + 575) // 576 * 576
    buf = torch.zeros((n, size), dtype=torch.uint8)
    tok = buf[:, :p * 576].view(n, p, 576)
    sf = buf[:, p * 576:p * 584].view(n, p, 8)[:, :, :7]
    xb = tt(x).bfloat16()
    tok[:, :, 448:].view(torch.bfloat16)[:] = xb[..., 448:]
    for t in range(7):
        cur = xb[..., 64 * t:64 * t + 64].float()
        amax = cur.abs().amax(dim=-1)
        if rule == "deepseek":
            scale = torch.pow(2, torch.ceil(torch.log2(amax.clamp_min(1e-4) / 448.0)))
        else:
            scale = torch.pow(2, torch.ceil(torch.log2((amax / 448.0).clamp_min(1e-4))))
        sf[:, :, t] = e8m0_byte(scale)
        tok[:, :, 64 * t:64 * t + 64] = fp8_codes(cur / scale[..., None])
    return buf.numpy()


@pytest.mark.parametrize("page_size", [64, 2, 3])
def test_model1_pages_match_flashmla_layout_with_deepseek_scales(rng, page_size):
    """Source: FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb
    (layout of a page) with the scale rule
    of DeepSeek act_quant / vLLM (amax clamped to 1e-4). Every page byte,
    padding included, is equal."""
    n = 3
    x = edge_rows(rng, n * page_size, 512, 64, 448.0)
    cache = R.new_cache(R.MODEL1, n, page_size)
    assert R.model1_write(cache, page_size, x, np.arange(n * page_size)) == 0
    want = flashmla_pages(x.reshape(n, page_size, 512), page_size, "deepseek")
    np.testing.assert_array_equal(cache, want)


def flashmla_dequantize(pages, page_size):
    """FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb dequantize_k_cache (MODEL1): nope codes and
    e8m0 scales to BF16, multiplied in BF16; RoPE dims as stored."""
    n = pages.shape[0]
    q = tt(pages)
    tok = q[:, :page_size * 576].view(n, page_size, 576)
    nope = tok[:, :, :448].view(torch.float8_e4m3fn)
    rope = tok[:, :, 448:].contiguous().view(torch.bfloat16)
    sc = q[:, page_size * 576:page_size * 584].view(n, page_size, 8)[:, :, :7]
    sc = sc.contiguous().view(torch.float8_e8m0fnu)
    out = torch.empty((n, page_size, 512), dtype=torch.bfloat16)
    out[..., 448:] = rope
    for t in range(7):
        out[..., 64 * t:64 * t + 64] = nope[..., 64 * t:64 * t + 64].to(torch.bfloat16) * \
            sc[:, :, t].to(torch.bfloat16).unsqueeze(-1)
    return out.float().numpy()


def test_model1_flashmla_scale_rule_differs_only_for_tiles_below_0_0448(rng):
    """FlashMLA's test quantizer (FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb,
    _cast_scale_inv_to_ue8m0) clamps the scale (amax / 448 >= 1e-4)
    instead of amax. Only tiles with amax below 448e-4 = 0.0448 can differ,
    and they do exactly when amax <= 448 * 2^-14 (then FlashMLA's scale byte
    is 114 = 2^-13, ours is lower; up to 0.0448 both round up to 2^-13).
    FlashMLA's dequantizer decodes our pages to our values."""
    p, n = 16, 4
    x = tile_scaled(rng, n * p, 512, 64, lo=-16, hi=4)
    cache = R.new_cache(R.MODEL1, n, p)
    R.model1_write(cache, p, x, np.arange(n * p))
    fm = flashmla_pages(x.reshape(n, p, 512), p, "flashmla")
    amax = np.abs(x[:, :448].reshape(n * p, 7, 64)).max(-1)
    small = amax <= F32(448 * 2.0 ** -14)
    assert small.any() and (~small).any() and (amax[small] < F32(0.0448)).all()
    assert ((amax > F32(448 * 2.0 ** -14)) & (amax < F32(0.0448))).any()
    ours_sf = cache[:, p * 576:p * 584].reshape(n * p, 8)[:, :7]
    fm_sf = fm[:, p * 576:p * 584].reshape(n * p, 8)[:, :7]
    assert np.array_equal(ours_sf == fm_sf, ~small)
    assert (fm_sf[small] == 114).all() and (ours_sf[small] < 114).all()
    ours_codes = cache[:, :p * 576].reshape(n * p, 576)[:, :448].reshape(n * p, 7, 64)
    fm_codes = fm[:, :p * 576].reshape(n * p, 576)[:, :448].reshape(n * p, 7, 64)
    assert np.array_equal(ours_codes[~small], fm_codes[~small])
    np.testing.assert_array_equal(flashmla_dequantize(cache, p).reshape(n * p, 512),
                                  R.model1_gather(cache, p, np.arange(n * p), "bfloat16")[0])


def test_model1_window_insert_matches_vllm_insert(rng):
    """Source: vLLM quantize_and_insert_k_cache (deepseek_v4 cache_utils.py):
    token rows by slot mapping, -1 skipped; the whole cache is equal."""
    p, n, T = 8, 5, 23
    rows = edge_rows(rng, T, 512, 64, 448.0)
    slots = rng.permutation(n * p)[:T].astype(np.int64)
    slots[rng.random(T) < 0.2] = -1
    cache = rng.integers(0, 256, (n, R.MODEL1.page_bytes(p)), dtype=np.uint8)
    want = cache.copy()
    assert R.model1_write(cache, p, rows, slots) == 0
    vllm_insert(want, p, rows, slots)
    np.testing.assert_array_equal(cache, want)


def test_model1_quantize_edge_cases():
    x = np.zeros((1, 512), F32)
    t = x[0, :448].reshape(7, 64)
    t[1, 0] = 1e-4                    # at the floor: e = -22
    t[2, 0] = -448.0 * 2.0 ** -22     # exactly 448 * 2^-22: still -22, code 448
    t[3, 5] = 448.0 * 2.0 ** -21 * (1 + 2 ** -7)   # next BF16 above 448 * 2^-21: e = -20
    t[4, :] = 3.3895314e38            # largest BF16: e = 120 (byte 247), x * 2^-120 = 255 -> code 256
    t[5, 1::2] = -0.0
    t[6, 0] = 448.0                   # e = 0 exactly
    t[6, 1] = 2.0 ** -9 * 0.5         # a tie below the smallest subnormal code: 0
    t[6, 2] = -2.0 ** -9 * 1.5        # a tie between subnormal codes 1 and 2: 2 (even)
    x[0, 448:] = np.arange(64) - 31.5
    data, sc = R.model1_quantize(x)
    assert list(sc[0]) == [105, 105, 105, 107, 247, 105, 127, 0]
    codes = data[0, :448].reshape(7, 64)
    assert (codes[0] == 0).all() and (codes[5, 0::2] == 0).all() and (codes[5, 1::2] == 0x80).all()
    assert codes[2, 0] == 0xFE and (codes[4] == 0x78).all()
    assert codes[6, 0] == 0x7E and codes[6, 1] == 0 and codes[6, 2] == 0x82
    assert np.array_equal(data[0, 448:].view("<u2"), (bf16_round(x[0, 448:]).view(np.uint32) >> 16))
    back = R.model1_dequantize(data, sc)
    # 255 * 2^120 rounds to the code 256: 2^128 decodes to infinity (in BF16 too, FlashMLA's decode)
    assert back[0, 2 * 64] == x[0, 2 * 64] and back[0, 4 * 64] == np.inf


def test_model1_nan_inf_rule():
    """A tile holding NaN / +-Inf (also a float32 value that rounds to BF16
    infinity) gets codes 0 and scale 0xFF and decodes to NaN; the other
    tiles and the RoPE dims are untouched by it; RoPE NaN is stored as BF16
    NaN."""
    x = np.ones((4, 512), F32)
    x[0, 70] = np.nan
    x[1, 0] = -np.inf
    x[2, 448 - 1] = 3.4e38            # BF16 rounding overflows
    x[3, 450] = np.nan
    data, sc = R.model1_quantize(x)
    for r, t in ((0, 1), (1, 0), (2, 6)):
        assert sc[r, t] == 0xFF and (data[r, 64 * t:64 * t + 64] == 0).all()
        others = [i for i in range(7) if i != t]
        assert (sc[r, others] == 127 - 8).all()          # amax 1: 2^ceil(log2(1 / 448)) = 2^-8
    assert (sc[3, :7] == 119).all() and sc[3, 7] == 0
    back = R.model1_dequantize(data, sc)
    assert np.isnan(back[0, 64:128]).all() and not np.isnan(back[0, :64]).any()
    assert np.isnan(back[3, 450]) and np.isnan(back[3]).sum() == 1
    assert data[3, 448 + 4:448 + 6].view("<u2")[0] & 0x7FC0 == 0x7FC0


def test_model1_round_trip(rng):
    """Decode, re-encode, decode gives the same values (the encoding is
    idempotent on its own grid), and the error of one trip is within E4M3's
    half step: |x - y| <= max(|x| * 2^-4, 2^(e - 10))."""
    x = tile_scaled(rng, 200, 512, 64)
    data, sc = R.model1_quantize(x)
    y = R.model1_dequantize(data, sc)
    assert np.array_equal(R.model1_dequantize(*R.model1_quantize(y)), y)
    e = (sc[:, :7].astype(np.int64) - 127).repeat(64, axis=1)
    bound = np.maximum(np.abs(x[:, :448]) * 2.0 ** -4, np.ldexp(1.0, e - 10))
    assert (np.abs(x[:, :448] - y[:, :448]) <= bound).all()
    assert np.array_equal(y[:, 448:], x[:, 448:])
    assert np.array_equal(R.model1_dequantize(data, sc, "bfloat16"), bf16_round(y))


def test_model1_every_e4m3_code_survives():
    """Tiles holding every finite E4M3 value, each tile with amax 448
    (scale 1), store exactly those codes (-0.0 included)."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    x = np.zeros((1, 512), F32)
    t = x[0, :448].reshape(7, 64)
    t[:, 0] = 448.0
    vals = np.zeros(7 * 63, F32)
    vals[:codes.size] = e4m3_decode(codes)
    t[:, 1:] = vals.reshape(7, 63)
    data, sc = R.model1_quantize(x)
    assert (sc[0, :7] == 127).all()
    got = data[0, :448].reshape(7, 64)
    assert (got[:, 0] == 0x7E).all() and np.array_equal(got[:, 1:].reshape(-1)[:codes.size], codes)


def test_addressing_skips_and_counts(rng):
    """-1 is padding (skipped, not counted); any other bad slot / page /
    offset is skipped and counted, and writes nothing (padding bytes of the
    page stay as they were)."""
    p, n = 4, 3
    cache = rng.integers(0, 256, (n, R.MODEL1.page_bytes(p)), dtype=np.uint8)
    before = cache.copy()
    x = tile_scaled(rng, 6, 512, 64)
    assert R.model1_write(cache, p, x, [-1, -2, n * p, 2 ** 40, -(2 ** 40), -1]) == 4
    assert np.array_equal(cache, before)
    assert R.model1_write(cache, p, x, [-1, 0, n, 1, -3, -1], offsets=[0, p, 0, -1, 0, 3]) == 4
    assert np.array_equal(cache, before)
    assert R.model1_write(cache, p, x[:2], [2, 0], offsets=[3, 0]) == 0
    data, sc = R.model1_quantize(x[:2])
    assert np.array_equal(cache[2, 3 * 576:4 * 576], data[0]) and np.array_equal(cache[0, :576], data[1])
    assert np.array_equal(cache[2, p * 576 + 24:p * 576 + 32], sc[0])
    assert np.array_equal(cache[:, p * 584:], before[:, p * 584:])          # page padding untouched
    rows, err = R.model1_gather(cache, p, np.array([[11, -1], [0, 12]]))
    assert err == 1
    assert np.array_equal(rows[0, 0], R.model1_dequantize(data[0], sc[0], "bfloat16"))
    assert not rows[0, 1].any() and not rows[1, 1].any()


def test_cpu_ops_write_into_the_callers_cache(rng):
    p, n = 4, 3
    x = tile_scaled(rng, 5, 512, 64)
    slots = np.array([0, 5, -1, 11, 30], np.int64)
    want = R.new_cache(R.MODEL1, n, p)
    assert R.model1_write(want, p, x, slots) == 1
    pb = R.MODEL1.page_bytes(p)
    for cache in (kc.new_layout_cache("model1", n, p), torch.zeros((n, pb), dtype=torch.uint8),
                  torch.zeros((n, pb), dtype=torch.uint8).view(torch.float8_e4m3fn)):
        err = np.zeros(1, np.int32)
        assert kc.model1_window_insert(cache, tt(x).bfloat16(), slots, page_size=p, errors=err) is None
        got = cache if isinstance(cache, np.ndarray) else cache.view(torch.uint8).numpy()
        np.testing.assert_array_equal(got, want)
        assert err[0] == 1
    # through FlashMLA's view of the cache
    cache = torch.zeros((n, R.MODEL1.page_bytes(p)), dtype=torch.uint8)
    view = kc.flashmla_view(cache, p)
    assert tuple(view.shape) == (n, p, 1, 584) and view.stride(0) == R.MODEL1.page_bytes(p)
    kc.model1_store(view, x, slots, page_size=p)
    np.testing.assert_array_equal(cache.numpy(), want)
    # FlashMLA's (P, 1, 584) is a shape over the page bytes (its kernels address the split page
    # themselves): the view starts each page at the page's first byte
    assert np.array_equal(view[1, 0, 0, :576].numpy(), want[1, :576])
    assert view.data_ptr() == cache.data_ptr()
    rows = kc.model1_gather(view, torch.tensor([5, -1, 99], dtype=torch.int32), page_size=p)
    assert rows.dtype == torch.bfloat16 and rows.shape == (3, 512)
    assert np.array_equal(rows.float().numpy(), R.model1_gather(want, p, np.array([5, -1, 99]))[0])


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
@pytest.mark.parametrize("page_size", [64, 2])
def test_gpu_model1_store_bit_exact(cuda, rng, in_dtype, id_dtype, page_size):
    n = 9
    N = min(n * page_size, 150)
    x = edge_rows(rng, N, 512, 64, 448.0, finite_only=False)
    if in_dtype == "float32":     # values between BF16 neighbours, ties and overflow to BF16 infinity
        x = (x * (1 + rng.integers(-2, 3, x.shape) * 2.0 ** -9)).astype(F32)
        x[0, 17] = F32(3.4e38)                                 # rounds to BF16 infinity: a NaN/Inf tile
    slots = rng.permutation(n * page_size)[:N].astype(np.int64)
    slots[rng.random(N) < 0.1] = -1
    slots[:3] = [n * page_size, -7, 2 ** 33 if id_dtype == "int64" else 2 ** 31 - 1]
    # the input in its dtype, made on the host: the reference and the kernel
    # read the same bits (a GPU float->bf16 cast would canonicalize NaNs)
    rows_host = tt(x).to(getattr(torch, in_dtype))
    x = rows_host.float().numpy()
    start = _poisoned(rng, R.MODEL1, n, page_size)
    want = start.copy()
    nerr = R.model1_write(want, page_size, x, slots)
    assert nerr == 3
    cache = tt(start).cuda()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = rows_host.cuda()
    kc.model1_window_insert(cache, rows, tt(slots.astype(id_dtype)).cuda(), page_size=page_size, errors=err)
    np.testing.assert_array_equal(cache.cpu().numpy(), want)
    assert int(err.item()) == nerr
    # pages + offsets addressing
    pages, offs = slots // page_size, slots % page_size
    pages[:3], offs[:3] = [-1, n, 0], [0, 0, page_size]
    want2 = start.copy()
    nerr2 = R.model1_write(want2, page_size, x, pages, offs)
    cache.copy_(tt(start))
    err.zero_()
    kc.model1_store(cache, rows, tt(pages.astype(id_dtype)).cuda(), page_size=page_size,
                    offsets=tt(offs.astype(np.int32)).cuda(), errors=err)
    np.testing.assert_array_equal(cache.cpu().numpy(), want2)
    assert int(err.item()) == nerr2 == 2
