"""index_fp8_store, index_mxfp4_store and index_mxfp8_store: indexer keys into DeepGEMM's
paged FP8 / MXFP4 / MXFP8 key pages (rawkv/kvcache/layouts.py, rawkv/cu/kv_layouts.cu): the
reference's pages against vLLM's fused indexer insert, DeepSeek's fp4_act_quant and
DeepGEMM's per_token_cast_to_fp8 (MXFP8: random keys, every BF16 value, the edge cases),
the MX scale words' byte order, edge cases and the NaN rule, round trips, the ops on CPU
tensors through DeepGEMM's view (the MXFP8 page stride padded to 512 bytes), the kernels
against the reference byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.kvcache import F32  # noqa: E402
from support.kvcache_layouts import (  # noqa: E402
    deepgemm_mxfp8_key_pages, deepgemm_per_token_cast_to_fp8_mx, edge_rows, _poisoned, tile_scaled, tt,
    vllm_fp8_key_pages, vllm_mxfp4_key_pages,
)


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
# layout name -> (layout, reference writer, the sources' construction, scale block, fmax)
KEY_LAYOUTS = {
    "index_fp8": (R.INDEX_FP8, R.index_fp8_write, vllm_fp8_key_pages, 128, 448.0),
    "index_mxfp4": (R.INDEX_MXFP4, R.index_mxfp4_write, vllm_mxfp4_key_pages, 32, 6.0),
    "index_mxfp8": (R.INDEX_MXFP8, R.index_mxfp8_write, deepgemm_mxfp8_key_pages, 32, 448.0),
}
STORES = {"index_fp8": kc.index_fp8_store, "index_mxfp4": kc.index_mxfp4_store,
          "index_mxfp8": kc.index_mxfp8_store}


@pytest.mark.parametrize("name,page_size", [("index_fp8", 64), ("index_fp8", 32), ("index_fp8", 5),
                                            ("index_mxfp4", 64), ("index_mxfp4", 128), ("index_mxfp4", 7),
                                            ("index_mxfp8", 64), ("index_mxfp8", 128), ("index_mxfp8", 7)])
def test_index_key_pages_match_the_sources(rng, name, page_size):
    """index_fp8: vLLM's fused FP8 indexer insert (the scale rule;
    fused_compress_quant_cache.py at e8f3d1e27521ae42f2e602a6b7bc2c083e89f9dc) in
    the SM90 paged layout of DeepGEMM csrc/apis/attention.hpp at
    0274ad7b911b99b4eb6f8d796403811cf1e18f3d ((pages, P, 1, 132): P x 128
    codes, then P float32 scales). index_mxfp4: DeepSeek fp4_act_quant
    (inference/kernel.py blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8) / vLLM's
    fused MXFP4 insert (scale rule, E2M1 rounding, nibble order) in DeepGEMM's
    SM100 paged layout (P x 64 code bytes, then
    P int32 of 4 UE8M0 bytes). index_mxfp8: DeepGEMM's per_token_cast_to_fp8(
    use_ue8m0=True, gran_k=32, use_packed_ue8m0=True) (deep_gemm/utils/math.py
    at 54e22612409371d6364144b69086735beb54e98b) in its SM100 paged layout
    (attention.hpp at e824173623a7458bd813e71b04a32eb67b2562dc: P x 128 codes,
    then P int32 of 4 UE8M0 bytes), the page padded to a multiple of 512
    bytes. Every page byte is equal (the padding too: zero)."""
    lay, write, build, block, fmax = KEY_LAYOUTS[name]
    n = 3
    keys = edge_rows(rng, n * page_size, 128, block, fmax)
    slots = rng.permutation(n * page_size)
    slots[rng.random(slots.size) < 0.1] = -1
    cache = R.new_cache(lay, n, page_size)
    assert write(cache, page_size, keys, slots) == 0
    np.testing.assert_array_equal(cache, build(keys, page_size, n, slots))


def _deepgemm_mx(keys):
    """DeepGEMM's MXFP8 bytes (codes, scale bytes) of float32 keys that hold BF16 values."""
    return deepgemm_per_token_cast_to_fp8_mx(tt(np.asarray(keys, F32)).bfloat16())


def test_index_mxfp8_equals_deepgemms_quantizer_on_random_keys(seed, rng):
    """The reference's MXFP8 codes and scale bytes equal DeepGEMM's
    per_token_cast_to_fp8(use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    (deep_gemm/utils/math.py at 54e22612409371d6364144b69086735beb54e98b;
    the same function in 38939a4c494ce6e904b54da94a1183955a5e9497) byte for
    byte on random BF16 keys (a fresh seed each run): blocks of magnitudes
    2^-140 .. 2^120 (BF16 subnormals, values below the 1e-4 floor, near the
    BF16 maximum), normal and heavy-tailed values, and the edge blocks."""
    print("seed", seed)
    n = 4000
    keys = np.concatenate([
        tile_scaled(rng, n, 128, 32, lo=-140, hi=121),
        bf16_keys(rng.standard_normal((n, 128)) * np.exp2(rng.integers(-30, 30, (n, 1)))),
        bf16_keys(rng.standard_cauchy((n, 128))),
        edge_rows(rng, 64, 128, 32, 448.0)])
    keys = np.clip(keys, -3.3895314e38, 3.3895314e38).astype(F32)
    codes, scales = R.index_mxfp8_quantize(keys)
    want_codes, want_scales = _deepgemm_mx(keys)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, want_codes)


def bf16_keys(x):
    from rawkv.reference.formats import bf16_round
    return bf16_round(np.asarray(x, F32))


def test_index_mxfp8_equals_deepgemms_quantizer_on_every_bf16_value(seed, rng):
    """Every finite BF16 value, as a block's amax (its scale byte) and as an
    element (its code), in blocks of 32 consecutive bit patterns (similar
    magnitudes: codes of every exponent) and of a random permutation of them
    (mixed magnitudes: small values beside a large amax, rounded to code 0
    or a subnormal code, signed zeros kept): the reference equals DeepGEMM's
    quantizer byte for byte."""
    print("seed", seed)
    bits = np.arange(1 << 16, dtype=np.uint32)
    vals = (bits << 16).view(F32)
    vals = vals[np.isfinite(vals)]
    vals = np.concatenate([vals, np.zeros(-vals.size % 128, F32)])
    for order in (vals, rng.permutation(vals)):
        keys = order.reshape(-1, 128)
        codes, scales = R.index_mxfp8_quantize(keys)
        want_codes, want_scales = _deepgemm_mx(keys)
        np.testing.assert_array_equal(scales, want_scales)
        np.testing.assert_array_equal(codes, want_codes)


def test_index_mxfp8_edge_cases():
    """Zeros (the floor: byte 127 - 22 = 105), a tie at 448 * 2^k, the BF16
    above it, the BF16 maximum (e = 120: 3.39e38 / 2^120 = 254.98 rounds to
    256, code 0x78, which decodes to 2^128 = Inf: decision 5), a BF16
    subnormal (below the floor: e = -22, code -0), signed zeros, an amax
    below the floor: the reference, checked value by value, equals DeepGEMM's
    quantizer."""
    k = np.zeros((6, 128), F32)
    k[1, 0] = 448.0 * 2.0 ** 3                      # block 0: a tie, e = 3, code 0x7E (448)
    k[1, 32] = bf16_keys(448.0 * 2.0 ** 3 * (1 + 2 ** -7))  # block 1: just above, e = 4
    k[2, 64] = 3.3895314e38                          # block 2: the largest BF16, e = 120
    k[2, 96] = -2.0 ** -133                          # block 3: a BF16 subnormal, below the floor: e = -22
    k[3, :32] = -0.0                                 # block 0: negative zeros stay 0x80
    k[3, 32:64] = 9.99e-5                            # block 1: amax below the 1e-4 floor
    k[4, :] = bf16_keys(np.linspace(-1, 1, 128))
    k[5, ::3] = bf16_keys(1e-30)
    codes, scales = R.index_mxfp8_quantize(k)
    assert list(scales[0]) == [105] * 4
    assert scales[1, 0] == 127 + 3 and codes[1, 0] == 0x7E
    assert scales[1, 1] == 127 + 4 and codes[1, 32] == 0x76       # 448 * (1 + 2^-7) / 2 = 225.75 -> 224
    assert scales[2, 2] == 127 + 120 and codes[2, 64] == 0x78
    assert scales[2, 3] == 105 and codes[2, 96] == 0x80
    assert (codes[3, :32] == 0x80).all() and scales[3, 1] == 105
    want_codes, want_scales = _deepgemm_mx(k)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, want_codes)
    # decoding is exact: each code times its block's power of two
    y = R.index_mxfp8_dequantize(codes, scales)
    assert y[1, 0] == 448.0 * 8 and np.isposinf(y[2, 64]) and y[2, 96] == 0.0


def test_index_mxfp8_nan_rule_and_deepgemms_non_finite_blocks():
    """A block holding NaN or +-Inf: rawkv stores codes 0 and scale byte 0xFF
    (UE8M0 NaN, decodes to NaN: the rule of index_fp8, index_mxfp4 and MODEL1,
    docs/kvcache.md decision 3); the other blocks of the key are unaffected
    and equal DeepGEMM's. DeepGEMM's test quantizer (math.py at 54e2261) is
    silent on them: its amax is NaN / Inf, ceil_to_ue8m0 clamps the exponent
    field to 254 (byte 0xFE, 2^127), and its codes are the cast of
    x * 2^-127 (NaN an E4M3 NaN code, the finite values 0 unless near the
    BF16 maximum). That is what this test states of it, so a change in
    DeepGEMM's rule shows here."""
    k = bf16_keys(np.linspace(-3, 3, 3 * 128).reshape(3, 128))
    k[0, 5] = np.nan                     # block 0
    k[1, 40] = np.inf                    # block 1
    k[1, 41] = 3.0e38                    # (a finite value beside it)
    k[2, 127] = -np.inf                  # block 3
    codes, scales = R.index_mxfp8_quantize(k)
    bad = np.zeros((3, 4), bool)
    bad[0, 0] = bad[1, 1] = bad[2, 3] = True
    assert (scales[bad] == 0xFF).all() and (scales[~bad] != 0xFF).all()
    blk = codes.reshape(3, 4, 32)
    assert (blk[bad] == 0).all()
    y = R.index_mxfp8_dequantize(codes, scales).reshape(3, 4, 32)
    assert np.isnan(y[bad]).all() and not np.isnan(y[~bad]).any()
    dg_codes, dg_scales = _deepgemm_mx(k)
    np.testing.assert_array_equal(scales[~bad], dg_scales[~bad])
    np.testing.assert_array_equal(blk[~bad], dg_codes.reshape(3, 4, 32)[~bad])
    assert (dg_scales[bad] == 0xFE).all()
    dg = dg_codes.reshape(3, 4, 32)
    assert dg[0, 0, 5] & 0x7F == 0x7F                          # NaN -> an E4M3 NaN code
    assert dg[1, 1, 9] != 0 and (np.delete(dg[0, 0], 5) <= 0x80).all()   # 3e38 * 2^-127 = 1.76: a code


def test_index_mxfp4_scale_word_byte_order(rng):
    """DeepGEMM reads MXFP4 block k's scale from byte k of the key's int32
    (deep_gemm/utils/math.py at 54e22612409371d6364144b69086735beb54e98b,
    pack_ue8m0_to_int: the UE8M0 bytes as uint8 viewed as int32, little-endian;
    attention.hpp at 0274ad7b: kv_cache_sf an int32 per key)."""
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
    c8m, b8m = R.index_mxfp8_quantize(k)
    y8m = R.index_mxfp8_dequantize(c8m, b8m)
    assert np.array_equal(R.index_mxfp8_dequantize(*R.index_mxfp8_quantize(y8m)), y8m)
    # E4M3 has three mantissa bits: relative error <= 1/16 above the block's smallest normal step
    e8 = (b8m.astype(np.int64) - 127).repeat(32, axis=1)
    assert (np.abs(k - y8m) <= np.maximum(np.abs(k) / 16, np.ldexp(1.0, e8 - 10))).all()
    # a block scale beats the key's single one: never worse than index_fp8 on these keys
    assert np.abs(k - y8m).sum() <= np.abs(k - y8).sum()
    # E2M1 has one mantissa bit: relative error <= 1/4 above the smallest step
    e = (b4.astype(np.int64) - 127).repeat(32, axis=1)
    assert (np.abs(k - y4) <= np.maximum(np.abs(k) / 4, np.ldexp(1.0, e - 2))).all()


def test_cpu_index_ops_and_deepgemm_view(rng):
    keys = tile_scaled(rng, 6, 128, 32)
    sl = np.array([0, 3, 64, 127, -1, 2], np.int32)
    for name, write in (("index_fp8", R.index_fp8_write), ("index_mxfp4", R.index_mxfp4_write),
                        ("index_mxfp8", R.index_mxfp8_write)):
        lay = kc.layouts.layout_of(name)
        rec, pb = lay.data_bytes + lay.scale_bytes, lay.page_bytes(64)
        want = R.new_cache(lay, 2, 64)
        write(want, 64, keys, sl)
        pages = torch.zeros((2, pb), dtype=torch.uint8)
        got = kc.deepgemm_view(pages, 64, name)                # DeepGEMM's (num_pages, P, 1, record)
        assert tuple(got.shape) == (2, 64, 1, rec) and tuple(got.stride()) == (pb, rec, rec, 1)
        STORES[name](got, tt(keys), tt(sl), page_size=64)
        np.testing.assert_array_equal(pages.numpy(), want)
        assert tuple(kc.deepgemm_view(want, 64, name).shape) == (2, 64, 1, rec)
        if name != "index_mxfp8":
            # unpadded pages: DeepGEMM's view is a contiguous (num_pages, P, 1, record) tensor too
            flat = torch.zeros((2, 64, 1, rec), dtype=torch.uint8)
            STORES[name](flat, tt(keys), tt(sl), page_size=64)
            np.testing.assert_array_equal(flat.reshape(2, -1).numpy(), want)


def test_index_mxfp8_pages_and_view_of_the_padded_stride():
    """The MXFP8 page is [P x 128 codes][P x 4 scale bytes] padded to a
    multiple of 512 bytes (DeepGEMM's SM100 sparse paged logits assert
    fused_kv_cache.stride(0) % 512 == 0: attention.hpp at e824173): no
    padding at P = 128 (16,896 = 33 x 512), 8,448 -> 8,704 at P = 64.
    deepgemm_view keeps the padded stride; a contiguous (num_pages, P, 1,
    132) tensor (the unpadded stride) is refused naming cache, and no store
    writes the padding."""
    lay = R.INDEX_MXFP8
    for p, pb in ((128, 16896), (64, 8704), (32, 4608), (16, 2560), (8, 1536), (1, 512), (7, 1024)):
        assert kc.layout_page_bytes("index_mxfp8", p) == lay.page_bytes(p) == pb and pb % 512 == 0
        assert pb - p * 132 < 512 and lay.scale_offset(p) == p * 128
    c = kc.new_layout_cache("index_mxfp8", 3, 64, device="cpu")
    assert tuple(c.shape) == (3, 8704) and kc.new_layout_cache("index_mxfp8", 3, 64).shape == (3, 8704)
    v = kc.deepgemm_view(c, 64, "index_mxfp8")
    assert tuple(v.shape) == (3, 64, 1, 132) and tuple(v.stride()) == (8704, 132, 132, 1)
    with pytest.raises(ValueError, match=r"^cache: a index_mxfp8 page of 64 records is 8704 bytes"):
        kc.index_mxfp8_store(torch.zeros((3, 64, 1, 132), dtype=torch.uint8), torch.ones(1, 128),
                             torch.zeros(1, dtype=torch.int32), page_size=64)
    keys = np.full((3 * 64, 128), 2.0, F32)
    pages = torch.full((3, 8704), 0xAB, dtype=torch.uint8)
    kc.index_mxfp8_store(pages, tt(keys), tt(np.arange(3 * 64, dtype=np.int32)), page_size=64)
    assert (pages[:, 64 * 132:] == 0xAB).all()                  # the padding is never written
    # 2 / 448 rounds up to 2^-7: every code 2 / 2^-7 = 256 (E4M3 0x78), every scale byte 127 - 7
    assert (pages[:, :64 * 128] == 0x78).all()
    assert (pages[:, 64 * 128:64 * 132].reshape(3, 64, 4) == 127 - 7).all()


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["index_fp8", "index_mxfp4", "index_mxfp8"])
@pytest.mark.parametrize("in_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("p", [64, 128])
def test_gpu_index_store_bit_exact(cuda, seed, rng, name, in_dtype, p):
    """The kernel (rkv_index_store<..., KEY>) equals the reference byte for
    byte, poisoned page bytes (the MXFP8 padding too) kept where no record
    is written, NaN / Inf blocks included."""
    print("seed", seed)
    lay, write, _, block, fmax = KEY_LAYOUTS[name]
    store = STORES[name]
    n = 5
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
