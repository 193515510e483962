"""index_fp8_store and index_mxfp4_store: indexer keys into DeepGEMM's paged FP8 / MXFP4
key pages (rawkv/kvcache/layouts.py, rawkv/cu/kv_layouts.cu): the
reference's pages against vLLM's fused indexer insert and DeepSeek's
fp4_act_quant, the MXFP4 scale word's byte order, edge cases and the NaN
rule, round trips, the ops on CPU tensors through DeepGEMM's view, the kernels
against the reference byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.kvcache import F32  # noqa: E402
from support.kvcache_layouts import (  # noqa: E402
    edge_rows, _poisoned, tile_scaled, tt, vllm_fp8_key_pages, vllm_mxfp4_key_pages,
)


# ---------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------
# layout name -> (layout, reference writer, the sources' construction, scale block, fmax)
KEY_LAYOUTS = {
    "index_fp8": (R.INDEX_FP8, R.index_fp8_write, vllm_fp8_key_pages, 128, 448.0),
    "index_mxfp4": (R.INDEX_MXFP4, R.index_mxfp4_write, vllm_mxfp4_key_pages, 32, 6.0),
}


@pytest.mark.parametrize("name,page_size", [("index_fp8", 64), ("index_fp8", 32), ("index_fp8", 5),
                                            ("index_mxfp4", 64), ("index_mxfp4", 128), ("index_mxfp4", 7)])
def test_index_key_pages_match_the_sources(rng, name, page_size):
    """index_fp8: vLLM's fused FP8 indexer insert (the scale rule;
    fused_compress_quant_cache.py at e8f3d1e27521ae42f2e602a6b7bc2c083e89f9dc) in
    the SM90 paged layout of DeepGEMM csrc/apis/attention.hpp at
    0274ad7b911b99b4eb6f8d796403811cf1e18f3d ((pages, P, 1, 132): P x 128
    codes, then P float32 scales). index_mxfp4: DeepSeek fp4_act_quant
    (inference/kernel.py blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8) / vLLM's
    fused MXFP4 insert (scale rule, E2M1 rounding, nibble order) in DeepGEMM's
    SM100 paged layout (P x 64 code bytes, then
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
    # E2M1 has one mantissa bit: relative error <= 1/4 above the smallest step
    e = (b4.astype(np.int64) - 127).repeat(32, axis=1)
    assert (np.abs(k - y4) <= np.maximum(np.abs(k) / 4, np.ldexp(1.0, e - 2))).all()


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


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
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
