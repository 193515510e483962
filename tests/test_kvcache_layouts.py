"""The ecosystem byte layouts of the DeepSeek-V4 KV cache
(rawkv/reference/kvcache/layouts.py, rawkv/kvcache/layouts.py,
rawkv/cu/kv_layouts.cu; docs/kvcache.md "Ecosystem layouts").

CPU tests: the reference's pages against pages built independently from each
source's rules (each test names its source: FlashMLA tests/quant.py's layout
and dequantizer, DeepSeek act_quant / fp4_act_quant's scales, vLLM's
quantize_and_insert_k_cache and fused indexer kernels, DeepGEMM's paged
layouts, FlashMLA's abs_indices2indices_in_kvcache); the UE8M0 exponent
exhaustively against its exact definition; edge cases (zeros, the amax
floors, powers of two, huge values, NaN/Inf); round trips; addressing and
error counts; the public ops on CPU arrays. GPU tests (fixture `cuda`):
every kernel against the reference byte for byte (decoded rows: bit for bit,
NaN matching NaN), on poisoned caches, and a CUDA-graph capture.

Random tests take `rng` (conftest): replay with RAWKV_TEST_SEED=<seed>.
"""
from __future__ import annotations

import numpy as np
import pytest

from rawkv import kvcache as kc
from rawkv.reference.formats import bf16_round, e4m3_decode
from rawkv.reference.kvcache import layouts as R

F32 = np.float32
torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------
def tile_scaled(rng, n, width, tile, lo=-30, hi=30):
    """BF16-valued rows whose tiles have magnitudes 2^U(lo, hi): every scale
    exponent gets exercised."""
    x = rng.standard_normal((n, width // tile, tile)) * np.exp2(rng.integers(lo, hi, (n, width // tile, 1)))
    return bf16_round(x.reshape(n, width).astype(F32))


def edge_rows(rng, n, width, tile, fmax, finite_only=True):
    """Rows with the edge tiles of a UE8M0 quantizer: zeros, tiny amax (at
    and around the floor), amax exactly fmax * 2^k and the next BF16 above,
    the largest BF16, negative zeros, and (finite_only False) NaN / Inf."""
    x = tile_scaled(rng, n, width, tile)
    t = x.reshape(n, -1, tile)
    cases = [
        lambda v: v.fill(0.0),
        lambda v: v.__setitem__(..., bf16_round(v * F32(1e-9))),
        lambda v: v.__setitem__(..., bf16_round(v / np.abs(v).max() * F32(9.99e-5))),
        lambda v: v.__setitem__(..., bf16_round(v / np.abs(v).max() * F32(1.07e-4))),
        lambda v: v.__setitem__(..., bf16_round(v / np.abs(v).max() * F32(fmax * 2.0 ** 5) * F32(0.999))),
        lambda v: v.__setitem__(slice(0, 1), F32(fmax * 2.0 ** -3)),          # exact power-of-two tie
        lambda v: v.__setitem__(slice(0, 1), -F32(fmax * 2.0 ** 7)),
        lambda v: v.__setitem__(slice(0, 1), bf16_round(F32(fmax * 2.0 ** 2) * F32(1 + 2 ** -7))),
        lambda v: v.__setitem__(slice(0, 1), F32(3.3895314e38)),               # largest BF16
        lambda v: v.__setitem__(slice(0, None, 2), -0.0),
        lambda v: v.__setitem__(..., bf16_round(v * F32(2.0 ** -120))),        # BF16 subnormals
    ]
    if not finite_only:
        cases += [lambda v: v.__setitem__(3, np.nan), lambda v: v.__setitem__(0, -np.inf),
                  lambda v: v.__setitem__(slice(0, None), np.inf)]
    for i, f in enumerate(cases):
        f(t[i % n, rng.integers(0, t.shape[1])])
    return x


# ---------------------------------------------------------------------------
# independent constructions of the sources' rules (torch on the CPU)
# ---------------------------------------------------------------------------
def tt(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def fp8_codes(v):
    """torch's float32 -> float8_e4m3fn cast (RNE), as bytes."""
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


def e8m0_byte(scale):
    """A power-of-two float32 scale as its float8_e8m0fnu byte (torch's cast)."""
    return scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def flashmla_pages(x, page_size, rule="deepseek"):
    """MODEL1_FP8Sparse pages built the way FlashMLA tests/quant.py
    quantize_k_cache lays them out (a page of P tokens: [P x (448 FP8 +
    128 B BF16)] [P x 8 B: 7 e8m0 scales + 1], padded to a multiple of 576),
    with the scale rule of DeepSeek act_quant / vLLM (rule 'deepseek': amax
    clamped to 1e-4) or FlashMLA's own test quantizer (rule 'flashmla': the
    scale clamped to 1e-4). x: (num_pages, P, 512) BF16 values."""
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


def flashmla_dequantize(pages, page_size):
    """FlashMLA tests/quant.py dequantize_k_cache (MODEL1): nope codes and
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


def vllm_insert(cache, page_size, rows, slot_mapping):
    """vLLM quantize_and_insert_k_cache (deepseek_v4 cache_utils.py), token by
    token: UE8M0 scale 2^ceil(log2(max(block_max, 1e-4) / 448)), codes
    fp8(clamp(x / scale)), byte exponent + 127, pad byte 7 = 0; token data at
    block * stride + pos * 576, scales at block * stride + P * 576 + pos * 8."""
    stride = cache.shape[1]
    flat = cache.reshape(-1)
    xb = tt(rows).bfloat16().float()
    for i, slot in enumerate(slot_mapping):
        if slot == -1:
            continue
        blk, pos = divmod(int(slot), page_size)
        base = blk * stride
        td, ts = base + pos * 576, base + page_size * 576 + pos * 8
        for q in range(7):
            v = xb[i, 64 * q:64 * q + 64]
            exponent = torch.ceil(torch.log2(v.abs().max().clamp_min(1e-4) / 448.0))
            scaled = (v / torch.exp2(exponent)).clamp(-448.0, 448.0)
            flat[td + 64 * q:td + 64 * q + 64] = fp8_codes(scaled).numpy()
            flat[ts + q] = int(exponent.item()) + 127
        flat[ts + 7] = 0
        flat[td + 448:td + 576] = xb[i, 448:].bfloat16().view(torch.uint8).numpy()


def vllm_fp8_key_pages(keys, page_size, num_pages, slots):
    """vLLM's fused FP8 indexer-key insert (fused_compress_quant_cache.py):
    absmax of the BF16 key, max(., 1e-4), exponent ceil(log2(absmax *
    (1/448))), codes fp8(clamp(x * 2^-exponent)), scale 2^exponent as FP32;
    placed per DeepGEMM csrc/apis/attention.hpp: kv at page + j * 128,
    kv_sf (float32) at page + P * 128 + j * 4."""
    buf = torch.zeros((num_pages, page_size * 132), dtype=torch.uint8)
    kv = buf[:, :page_size * 128].view(num_pages, page_size, 128)
    sf = buf[:, page_size * 128:].view(torch.float32)
    xb = tt(keys).bfloat16().float()
    for i, s in enumerate(slots):
        if s == -1:
            continue
        pg, j = divmod(int(s), page_size)
        absmax = xb[i].abs().max().clamp_min(1e-4)
        exponent = torch.ceil(torch.log2(absmax * torch.tensor(1.0 / 448.0, dtype=torch.float32)))
        kv[pg, j] = fp8_codes((xb[i] * torch.exp2(-exponent)).clamp(-448.0, 448.0))
        sf[pg, j] = torch.exp2(exponent)
    return buf.numpy()


_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_nearest_even(v):
    """E2M1 code of v by nearest-value search, ties to the even code,
    saturating at 6 (the rounding of PTX cvt.rn.satfinite.e2m1x2 that vLLM
    uses); the sign bit follows v's sign."""
    a = np.minimum(np.abs(v.astype(np.float64)), 6.0)
    d = np.abs(a[..., None] - _E2M1)
    best = d.min(axis=-1, keepdims=True)
    cand = np.where(d == best, np.arange(8), 99)
    even = np.where(cand % 2 == 0, cand, 99).min(axis=-1)
    code = np.where(even < 99, even, cand.min(axis=-1))
    return (code | (np.signbit(v) << 3)).astype(np.uint8)


def vllm_mxfp4_key_pages(keys, page_size, num_pages, slots):
    """vLLM's fused MXFP4 indexer-key insert / DeepSeek fp4_act_quant: per
    block of 32, amax of the BF16 values, max(., 6 * 2^-126), exponent
    ceil(log2(amax * (1/6))) clamped to [-127, 127], byte exponent + 127,
    codes e2m1(x * 2^-exponent), low nibble = even element; placed per
    DeepGEMM (is_fp4: 64 code bytes per key, is_mx_sf: one int32 of 4 UE8M0
    bytes per key at page + P * 64 + j * 4)."""
    buf = np.zeros((num_pages, page_size * 68), np.uint8)
    xb = bf16_round(np.asarray(keys, F32)).reshape(len(keys), 4, 32)
    for i, s in enumerate(slots):
        if s == -1:
            continue
        pg, j = divmod(int(s), page_size)
        amax = np.maximum(np.abs(xb[i]).max(axis=-1), F32(6.0 * 2.0 ** -126))
        r = np.clip(np.ceil(np.log2(amax * F32(1.0 / 6.0))), -127, 127)
        codes = e2m1_nearest_even(xb[i] * np.exp2(-r).astype(F32)[:, None]).reshape(128)
        buf[pg, j * 64:j * 64 + 64] = codes[0::2] | (codes[1::2] << 4)
        word = sum(int(b + 127) << (8 * k) for k, b in enumerate(r.astype(np.int64)))
        at = page_size * 64 + 4 * j
        buf[pg, at:at + 4].view(np.uint32)[0] = np.uint32(word)
    return buf


def flashmla_abs_indices(abs_indices, block_table, page_size):
    """FlashMLA tests/quant.py abs_indices2indices_in_kvcache (its
    documented per-request equivalent): block_table[i][id // P] * P + id % P,
    -1 stays -1."""
    out = torch.empty_like(abs_indices)
    for i in range(abs_indices.shape[0]):
        cur = abs_indices[i].clone()
        invalid = cur == -1
        cur[invalid] = 0
        res = block_table[i].index_select(0, cur.flatten() // page_size).view(cur.shape) * page_size \
            + cur % page_size
        res[invalid] = -1
        out[i] = res
    return out


# ---------------------------------------------------------------------------
# geometry
# ---------------------------------------------------------------------------
def test_page_bytes_follow_the_sources():
    # FlashMLA quant.py: (P * bytes_per_token + 575) // 576 * 576, bytes_per_token = 448 + 128 + 7 + 1
    for p in (1, 2, 3, 16, 63, 64, 65, 256):
        assert R.MODEL1.page_bytes(p) == (p * 584 + 575) // 576 * 576
        assert R.INDEX_FP8.page_bytes(p) == p * (128 + 4)        # DeepGEMM head_dim_with_sf 132
        assert R.INDEX_MXFP4.page_bytes(p) == p * (64 + 4)       # 64 packed bytes + one int32
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
    is DeepSeek's form amax * fp8_max_inv with the bit-level ceil (kernel.py
    fast_round_scale)."""
    bits = np.arange(2 ** 23, dtype=np.uint32) + np.uint32((127 + binade) << 23)
    a = np.maximum(bits.view(F32), F32(floor))
    want = _exact_exponent(a, fmax)
    assert np.array_equal(R.ue8m0_exponent(a, fmax, floor), want)
    assert np.array_equal(R.ceil_log2(a * F32(1.0 / fmax)), want)


def test_ue8m0_exponent_on_every_bf16_value():
    """Every positive finite BF16 amax (the layouts quantize BF16 values):
    the exponent is exact and equals ceil(log2(.)) taken in float32 (the
    form vLLM's Triton kernels use) and DeepSeek's bit-level ceil of
    amax * fl(1/fmax); the range is [-22, 120] for FP8 and [-126, 126] for
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
# MODEL1: pages against the sources
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [64, 2, 3])
def test_model1_pages_match_flashmla_layout_with_deepseek_scales(rng, page_size):
    """Source: FlashMLA tests/quant.py (layout of a page) with the scale rule
    of DeepSeek act_quant / vLLM (amax clamped to 1e-4). Every page byte,
    padding included, is equal."""
    n = 3
    x = edge_rows(rng, n * page_size, 512, 64, 448.0)
    cache = R.new_cache(R.MODEL1, n, page_size)
    assert R.model1_write(cache, page_size, x, np.arange(n * page_size)) == 0
    want = flashmla_pages(x.reshape(n, page_size, 512), page_size, "deepseek")
    np.testing.assert_array_equal(cache, want)


def test_model1_flashmla_scale_rule_differs_only_for_tiles_below_0_0448(rng):
    """FlashMLA's test quantizer clamps the scale (amax / 448 >= 1e-4)
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


# ---------------------------------------------------------------------------
# Indexer keys against the sources
# ---------------------------------------------------------------------------
# layout name -> (layout, reference writer, the sources' construction, scale block, fmax)
KEY_LAYOUTS = {
    "index_fp8": (R.INDEX_FP8, R.index_fp8_write, vllm_fp8_key_pages, 128, 448.0),
    "index_mxfp4": (R.INDEX_MXFP4, R.index_mxfp4_write, vllm_mxfp4_key_pages, 32, 6.0),
}


@pytest.mark.parametrize("name,page_size", [("index_fp8", 64), ("index_fp8", 32), ("index_fp8", 5),
                                            ("index_mxfp4", 64), ("index_mxfp4", 128), ("index_mxfp4", 7)])
def test_index_key_pages_match_the_sources(rng, name, page_size):
    """index_fp8: vLLM's fused FP8 indexer insert (the scale rule) in
    DeepGEMM csrc/apis/attention.hpp's SM90 paged layout ((pages, P, 1, 132):
    P x 128 codes, then P float32 scales). index_mxfp4: DeepSeek
    fp4_act_quant / vLLM's fused MXFP4 insert (scale rule, E2M1 rounding,
    nibble order) in DeepGEMM's SM100 paged layout (P x 64 code bytes, then
    P int32 of 4 UE8M0 bytes). Every page byte is equal."""
    lay, write, build, block, fmax = KEY_LAYOUTS[name]
    n = 3
    keys = edge_rows(rng, n * page_size, 128, block, fmax)
    slots = rng.permutation(n * page_size)
    slots[rng.random(slots.size) < 0.1] = -1
    cache = R.new_cache(lay, n, page_size)
    assert write(cache, page_size, keys, slots) == 0
    np.testing.assert_array_equal(cache, build(keys, page_size, n, slots))


def test_index_mxfp4_scale_word_byte_order(rng):
    """DeepGEMM reads MXFP4 block k's scale from byte k of the key's int32."""
    p = 16
    keys = tile_scaled(rng, p, 128, 32)
    cache = R.new_cache(R.INDEX_MXFP4, 1, p)
    R.index_mxfp4_write(cache, p, keys, np.arange(p))
    words = cache[0, p * 64:].view("<i4")
    _, sc = R.index_mxfp4_quantize(keys)
    for k in range(4):
        assert np.array_equal((words >> (8 * k)) & 0xFF, sc[:, k])


def test_index_key_edge_cases_and_nan_rule():
    k = np.zeros((5, 128), F32)
    k[1, 0] = 448.0 * 2.0 ** 3        # FP8: exact tie -> e = 3; MXFP4 block 0: 448*8/6 -> e = 10
    k[2, 33] = 6.0 * 2.0 ** -130      # MXFP4 block 1 below the floor: e = -126
    k[3, 5] = np.nan
    k[4, 100] = -np.inf
    c8, s8 = R.index_fp8_quantize(k)
    assert s8[0] == F32(2.0 ** -22) and s8[1] == 8.0 and (c8[1, 0] == 0x7E)
    assert np.isnan(s8[3]) and np.isnan(s8[4]) and (c8[3:] == 0).all()
    c4, b4 = R.index_mxfp4_quantize(k)
    assert list(b4[0]) == [1, 1, 1, 1]                 # zeros: 2^-126
    assert b4[1, 0] == 127 + 10 and c4[1, 0] & 0xF == 0x6   # 3584 / 2^10 = 3.5 -> 4.0 (code 6)
    assert b4[2, 1] == 1
    assert list(b4[3]) == [0xFF, 1, 1, 1] and (c4[3, :16] == 0).all()
    assert list(b4[4]) == [1, 1, 1, 0xFF] and (c4[4, 48:] == 0).all()
    assert np.isnan(R.index_mxfp4_dequantize(c4, b4)[3, :32]).all()
    assert not np.isnan(R.index_mxfp4_dequantize(c4, b4)[3, 32:]).any()


def test_index_key_round_trips(rng):
    k = tile_scaled(rng, 300, 128, 32)
    c8, s8 = R.index_fp8_quantize(k)
    y8 = R.index_fp8_dequantize(c8, s8)
    assert np.array_equal(R.index_fp8_dequantize(*R.index_fp8_quantize(y8)), y8)
    c4, b4 = R.index_mxfp4_quantize(k)
    y4 = R.index_mxfp4_dequantize(c4, b4)
    assert np.array_equal(R.index_mxfp4_dequantize(*R.index_mxfp4_quantize(y4)), y4)
    # E2M1 has one mantissa bit: relative error <= 1/4 above the smallest step
    e = (b4.astype(np.int64) - 127).repeat(32, axis=1)
    assert (np.abs(k - y4) <= np.maximum(np.abs(k) / 4, np.ldexp(1.0, e - 2))).all()


# ---------------------------------------------------------------------------
# addressing, gathers, the bridge
# ---------------------------------------------------------------------------
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


def test_bridge_matches_flashmla_and_counts_errors(rng):
    """Source: FlashMLA tests/quant.py abs_indices2indices_in_kvcache, on
    valid ids (and -1); then every kind of bad id is -1 and counted."""
    P, B, S, Kk, mb, npg = 8, 4, 3, 10, 6, 40
    table = rng.permutation(npg)[:B * mb].reshape(B, mb).astype(np.int32)
    ids = rng.integers(0, mb * P, (B, S, Kk))
    ids[rng.random(ids.shape) < 0.2] = -1
    got, err = R.topk_to_kvcache_indices(ids, table, P, npg)
    assert err == 0 and got.dtype == np.int32
    want = flashmla_abs_indices(tt(ids), tt(table.astype(np.int64)), P).numpy()
    assert np.array_equal(got, want)
    got2, _ = R.topk_to_kvcache_indices(ids[:, 0], table, P, npg)
    assert np.array_equal(got2, got[:, 0])
    # slots: request b reads table row slots[b]
    sl = np.array([3, 3, 0, 1])
    got3, _ = R.topk_to_kvcache_indices(ids[:, 0], table, P, npg, slots=sl)
    assert np.array_equal(got3, R.topk_to_kvcache_indices(ids[:, 0], table[sl], P, npg)[0])
    row3 = flashmla_abs_indices(tt(ids[1:2, 0]), tt(table[3:4].astype(np.int64)), P)[0].numpy()
    assert np.array_equal(got3[1], row3)
    # errors
    bad = np.array([[-2, mb * P, 5, 9, 0, -1, 2 ** 40]])
    tb = np.full((1, mb), 3, np.int32)
    tb[0, 1] = -1                    # id 9 (P = 8): logical block 1 has no page
    tb[0, 0] = npg                   # ids 5, 0: page out of range
    r, e = R.topk_to_kvcache_indices(bad, tb, P, npg)
    assert list(r[0]) == [-1] * 7 and e == 6
    tb[0, 0] = 7
    r, e = R.topk_to_kvcache_indices(bad, tb, P, npg, n_entries=[4])
    assert list(r[0]) == [-1, -1, -1, -1, 56, -1, -1] and e == 5
    r, e = R.topk_to_kvcache_indices(bad, tb, P, npg, slots=[1])      # row out of range
    assert (r == -1).all() and e == 6
    with pytest.raises(ValueError, match="^num_pages:"):
        R.topk_to_kvcache_indices(bad, tb, 2 ** 16, 2 ** 15)


# ---------------------------------------------------------------------------
# public ops on CPU arrays
# ---------------------------------------------------------------------------
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


def test_cpu_index_ops_and_deepgemm_view(rng):
    keys = tile_scaled(rng, 6, 128, 32)
    sl = np.array([0, 3, 64, 127, -1, 2], np.int32)
    for name, write in (("index_fp8", R.index_fp8_write), ("index_mxfp4", R.index_mxfp4_write)):
        lay = kc.layouts.layout_of(name)
        want = R.new_cache(lay, 2, 64)
        write(want, 64, keys, sl)
        got = torch.zeros((2, 64, 1, lay.data_bytes + lay.scale_bytes), dtype=torch.uint8)  # DeepGEMM's
        store = kc.index_fp8_store if name == "index_fp8" else kc.index_mxfp4_store
        store(got, tt(keys), tt(sl), page_size=64)
        np.testing.assert_array_equal(got.reshape(2, -1).numpy(), want)
        assert tuple(kc.deepgemm_view(want, 64, name).shape) == (2, 64, 1, lay.data_bytes + lay.scale_bytes)


def test_cpu_bridge_op(rng):
    table = rng.permutation(50)[:12].reshape(3, 4).astype(np.int32)
    ids = rng.integers(-1, 16, (3, 7)).astype(np.int32)
    out = np.full((3, 7), 77, np.int32)
    err = torch.zeros(1, dtype=torch.int32)
    res = kc.topk_to_kvcache_indices(ids, table, page_size=4, num_pages=50, out=out, errors=err)
    assert res is out and np.array_equal(out, R.topk_to_kvcache_indices(ids, table, 4, 50)[0])
    assert int(err[0]) == 0
    ne = np.array([3, 0, 16], np.int32)
    t = kc.topk_to_kvcache_indices(tt(ids).long(), tt(table), page_size=4, num_pages=50,
                                   n_entries=tt(ne), errors=err)
    want, nerr = R.topk_to_kvcache_indices(ids, table, 4, 50, n_entries=ne)
    assert t.dtype == torch.int32 and np.array_equal(t.numpy(), want)
    assert int(err[0]) == nerr == int((ids[0] >= 3).sum() + (ids[1] >= 0).sum())


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


# ---------------------------------------------------------------------------
# The CUDA paths on a CPU: tensors that report is_cuda, a runtime that
# records launches. Every launch goes through its declaration
# (rawkv.kernels.kv_layouts), so a wrong keyword, a scalar of the wrong C type
# or a missing argument fails here; the tests check which buffer each pointer
# receives and the scalars. What the kernels compute: the GPU tests below.
# ---------------------------------------------------------------------------
from support.fake_cuda import fake  # noqa: E402  (CPU tensors that report is_cuda)


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
    for store, lay, mx in ((kc.index_fp8_store, R.INDEX_FP8, "false"), (kc.index_mxfp4_store, R.INDEX_MXFP4, "true")):
        rec.calls.clear()
        c = fake(torch.zeros((n, p, 1, lay.data_bytes + lay.scale_bytes), dtype=torch.uint8))
        keys = fake(torch.zeros((N, 128), dtype=torch.bfloat16))
        store(c, keys, slots, page_size=p)
        (name, _, _, a), = rec.calls
        assert name == f"rkv_index_store<__nv_bfloat16, long long, {mx}>"
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
# GPU: kernels against the reference, byte for byte
# ---------------------------------------------------------------------------
def same_values(got, want, what=""):
    """Bit equality of decoded float arrays; NaN matches NaN (payloads are
    not part of the contract of a decode)."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(np.uint32) != want.view(np.uint32)))
    assert not bad.any(), f"{what}: {int(bad.sum())} differ, first at {np.argwhere(bad)[0].tolist()}"


def _poisoned(rng, lay, n, p):
    return rng.integers(0, 256, (n, lay.page_bytes(p)), dtype=np.uint8)


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


@pytest.mark.parametrize("name", ["index_fp8", "index_mxfp4"])
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
def test_gpu_index_store_bit_exact(cuda, rng, name, in_dtype):
    lay, write, _, block, fmax = KEY_LAYOUTS[name]
    store = kc.index_fp8_store if name == "index_fp8" else kc.index_mxfp4_store
    n, p = 5, 64
    N = 250
    keys = edge_rows(rng, N, 128, block, fmax, finite_only=False)
    if in_dtype == "float32":
        keys = (keys * (1 + rng.integers(-2, 3, keys.shape) * 2.0 ** -9)).astype(F32)
    slots = rng.permutation(n * p)[:N].astype(np.int32)
    slots[rng.random(N) < 0.1] = -1
    slots[:2] = [n * p, -3]
    keys_host = tt(keys).to(getattr(torch, in_dtype))      # the same input bits on both sides
    keys = keys_host.float().numpy()
    start = _poisoned(rng, lay, n, p)
    want = start.copy()
    nerr = write(want, p, keys, slots)
    cache = tt(start).cuda()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    store(cache, keys_host.cuda(), tt(slots).cuda(), page_size=p, errors=err)
    np.testing.assert_array_equal(cache.cpu().numpy(), want)
    assert int(err.item()) == nerr == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_model1_gather_bit_exact(cuda, rng, dtype):
    n, p = 6, 64
    cache_np = _poisoned(rng, R.MODEL1, n, p)
    sc = cache_np[:, p * 576:p * 584]              # scale records: mostly plausible bytes, and the extremes
    plausible = rng.random(sc.shape) < 0.7
    sc[plausible] = rng.integers(90, 140, int(plausible.sum()), dtype=np.uint8)
    sc[0, :6] = [0, 255, 1, 254, 127, 0]
    idx = rng.integers(-1, n * p, (7, 33)).astype(np.int32)
    idx[0, :4] = [-1, -5, n * p, 2 ** 31 - 1]
    want, nerr = R.model1_gather(cache_np, p, idx, dtype)
    assert nerr == 3
    cache = tt(cache_np).cuda()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((7, 33, 512), float("nan"), dtype=getattr(torch, dtype), device="cuda")
    res = kc.model1_gather(cache, tt(idx).cuda(), page_size=p, out=out, errors=err)
    assert res is out and int(err.item()) == nerr
    same_values(out.float().cpu().numpy(), want, f"model1_gather {dtype}")
    np.testing.assert_array_equal(cache.cpu().numpy(), cache_np)


@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_gpu_bridge_bit_exact(cuda, rng, id_dtype):
    P, B, S, Kk, mb, npg = 64, 5, 2, 300, 9, 40
    table = rng.integers(-2, npg + 2, (B + 2, mb)).astype(np.int32)
    ids = rng.integers(-3, mb * P + 5, (B, S, Kk)).astype(np.int64)
    ids[rng.random(ids.shape) < 0.1] = -1
    if id_dtype == "int64":
        ids[0, 0, :2] = [2 ** 40, -(2 ** 40)]
    ne = rng.integers(0, mb * P, B).astype(np.int32)
    sl = np.array([6, 0, -1, 3, B + 2], np.int32)
    for slots, n_entries, shape in ((None, None, ids.shape), (sl, ne, ids.shape), (sl, None, (B, S * Kk))):
        x = ids.reshape(shape)
        want, nerr = R.topk_to_kvcache_indices(x, table, P, npg, slots, n_entries)
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        got = kc.topk_to_kvcache_indices(
            tt(x.astype(id_dtype)).cuda(), tt(table).cuda(), page_size=P, num_pages=npg,
            slots=None if slots is None else tt(slots).cuda(),
            n_entries=None if n_entries is None else tt(n_entries).cuda(), errors=err)
        assert got.dtype == torch.int32 and tuple(got.shape) == shape
        np.testing.assert_array_equal(got.cpu().numpy(), want)
        assert int(err.item()) == nerr and nerr > 0


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
