"""Each ecosystem source's layout rebuilt independently (tests/kvcache/test_layouts.py,
test_model1_store.py, test_index_store.py, ..., test_pool_layouts.py): FlashMLA
tests/quant.py's pages and dequantizer, DeepSeek act_quant / fp4_act_quant's
scales, vLLM's quantize_and_insert_k_cache and fused indexer kernels,
DeepGEMM's paged layouts, FlashMLA's abs_indices2indices_in_kvcache; rows
with the edge cases of the scales.

The sources and the commits each construction restates (docs/kvcache.md,
"Ecosystem layouts", L-S1..L-S4):
- deepseek-ai/FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb
  (MODEL1 page layout, 576-byte padding, abs_indices2indices_in_kvcache;
  unchanged but for a comment up to 9241ae3ef9bac614dd25e45e507e089f888280e0)
  and csrc/api/sparse_decode.h at 4855c772bacb4d2cca413d6fb73cce396256a3c1
  (bytes_per_token = 448 + 64*2 + 448/64 + 1, kv.stride(1) == 584);
- deepseek-ai/DeepGEMM csrc/apis/attention.hpp at
  0274ad7b911b99b4eb6f8d796403811cf1e18f3d (fp8_fp4_paged_mqa_logits: values
  at page + j * kv_head_dim, scales at page + block_kv * kv_head_dim + j *
  sf_bytes) and deep_gemm/utils/math.py at
  54e22612409371d6364144b69086735beb54e98b (per_token_cast_to_fp4: element 2j
  in the low nibble; pack_ue8m0_to_int: block k's UE8M0 in byte k;
  per_token_cast_to_fp8(use_ue8m0=True, gran_k=32, use_packed_ue8m0=True):
  the MXFP8 key, the same function in 38939a4c494ce6e904b54da94a1183955a5e9497);
  csrc/apis/attention.hpp at e824173623a7458bd813e71b04a32eb67b2562dc
  (fp8_fp4_paged_mqa_logits with an int32 q scale: FP8 keys with 4 UE8M0
  bytes per token; fp8_fp4_paged_sparse_mqa_logits: fused_kv_cache.stride(0)
  % 512 == 0) and csrc/jit_kernels/impls/sm100_sparse_mqa_logits.hpp there
  (the page stride passed to the kernel, which finds the scales at page +
  PAGE_KV * 128);
- DeepSeek-V4 inference/kernel.py, blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8
  (github.com/Mockingjay1316/deepseek-v4-flash-spark at
  0825add42734731a285e30f657b0ccfc5bad74c9; the same kernels in
  Anshler/deepseek-v4-with-attention-residuals at
  082a891c46f3e668c76d278c112b9de0d7f44e13): act_quant_kernel (amax floor
  FP32(1e-4), fast_round_scale(amax, 1/448)) and fp4_quant_kernel (floor
  6 * 2^-126, fast_round_scale(amax, 1/6), clamp to +-6); its model.py there
  quantizes the entry with act_quant(kv[..., :-rd], 64, "ue8m0", ...) and the
  indexer keys with fp4_act_quant(kv, 32, True);
- vllm-project/vllm vllm/models/deepseek_v4/common/ops/cache_utils.py at
  4fec5ad6fd00f5128c6a797e9536ae1939c3bbe6 and
  .../fused_compress_quant_cache.py at e8f3d1e27521ae42f2e602a6b7bc2c083e89f9dc."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv.reference.formats import bf16_round  # noqa: E402
from support.kvcache import F32  # noqa: E402


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


def flashmla_abs_indices(abs_indices, block_table, page_size):
    """FlashMLA tests/quant.py at 520fec6a7fd98028705ccad373b7f0e3e2ae75fb
    abs_indices2indices_in_kvcache (its documented per-request equivalent): block_table[i][id // P] * P + id % P,
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


def tt(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def fp8_codes(v):
    """torch's float32 -> float8_e4m3fn cast (RNE), as bytes."""
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


def vllm_insert(cache, page_size, rows, slot_mapping):
    """vLLM quantize_and_insert_k_cache (vllm/models/deepseek_v4/common/ops/
    cache_utils.py at 4fec5ad6fd00f5128c6a797e9536ae1939c3bbe6), token by
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
    """vLLM's fused FP8 indexer-key insert (fused_compress_quant_cache.py at
    e8f3d1e27521ae42f2e602a6b7bc2c083e89f9dc,
    _fused_kv_compress_norm_rope_insert_indexer_attn):
    absmax of the BF16 key, max(., 1e-4), exponent ceil(log2(absmax *
    (1/448))), codes fp8(clamp(x * 2^-exponent)), scale 2^exponent as FP32;
    placed per DeepGEMM csrc/apis/attention.hpp at
    0274ad7b911b99b4eb6f8d796403811cf1e18f3d: kv at page + j * 128,
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
    """vLLM's fused MXFP4 indexer-key insert (fused_compress_quant_cache.py at
    e8f3d1e2) / DeepSeek fp4_act_quant (kernel.py blob ea7976fa,
    fp4_quant_kernel): per
    block of 32, amax of the BF16 values, max(., 6 * 2^-126), exponent
    ceil(log2(amax * (1/6))) clamped to [-127, 127], byte exponent + 127,
    codes e2m1(x * 2^-exponent), low nibble = even element (DeepGEMM
    deep_gemm/utils/math.py at 54e22612 per_token_cast_to_fp4); placed per
    DeepGEMM attention.hpp at 0274ad7b (is_fp4: 64 code bytes per key, is_mx_sf: one int32 of 4 UE8M0
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


def deepgemm_per_token_cast_to_fp8_mx(x):
    """DeepGEMM deep_gemm/utils/math.py at 54e22612409371d6364144b69086735beb54e98b,
    per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True),
    restated in torch for x (m, n), n a multiple of 32 (no padding):
    x_amax = |x|.float().amax per block of 32, clamp(1e-4); sf = x_amax / 448;
    ceil_to_ue8m0(sf): bits = sf.view(int), exponent field + (mantissa != 0),
    clamped to [1, 254], << 23; codes (x * (1.0 / sf)).to(float8_e4m3fn);
    pack_ue8m0_to_int(sf): (sf.view(int) >> 23) as uint8, the 4 bytes of a
    token viewed as one int32. Returns (codes (m, n) uint8, scale bytes
    (m, n / 32) uint8), as numpy."""
    m, n = x.shape
    x_view = x.view(m, n // 32, 32)
    x_amax = x_view.abs().float().amax(dim=2).view(m, n // 32).clamp(1e-4)
    sf = x_amax / 448.0
    bits = sf.abs().float().view(torch.int)
    exp = ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()
    sf = (exp.clamp(1, 254) << 23).view(torch.float)
    x_fp8 = (x_view * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n)
    packed = (sf.view(torch.int) >> 23).to(torch.uint8).view(torch.int)        # (m, n / 128) int32
    return x_fp8.view(torch.uint8).numpy(), packed.view(torch.uint8).numpy()


def deepgemm_mxfp8_key_pages(keys, page_size, num_pages, slots):
    """DeepGEMM's MXFP8 key pages: keys as BF16 (the input of DeepGEMM's
    test, torch.bfloat16 x) through deepgemm_per_token_cast_to_fp8_mx, placed
    per attention.hpp at e824173623a7458bd813e71b04a32eb67b2562dc
    (fp8_fp4_paged_mqa_logits, is_mx_sf: kv at page + j * 128, kv_sf int32 at
    page + P * 128 + j * 4) in pages whose stride is padded to a multiple of
    512 bytes (fp8_fp4_paged_sparse_mqa_logits' fused_kv_cache.stride(0) %
    512 == 0), the padding zero."""
    stride = -(-page_size * 132 // 512) * 512
    buf = np.zeros((num_pages, stride), np.uint8)
    codes, sf = deepgemm_per_token_cast_to_fp8_mx(tt(np.asarray(keys, F32)).bfloat16())
    for i, s in enumerate(slots):
        if s == -1:
            continue
        pg, j = divmod(int(s), page_size)
        buf[pg, j * 128:j * 128 + 128] = codes[i]
        at = page_size * 128 + 4 * j
        buf[pg, at:at + 4] = sf[i]
    return buf


def _poisoned(rng, lay, n, p):
    return rng.integers(0, 256, (n, lay.page_bytes(p)), dtype=np.uint8)
