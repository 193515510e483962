// kv_layouts.cuh: the per-record device code of the ecosystem byte layouts
// (FlashMLA MODEL1_FP8Sparse entries, DeepGEMM FP8 / MXFP4 / MXFP8 indexer
// keys),
// shared by every kernel that writes or reads them: the standalone layout ops
// (kv_layouts.cu), the paged pool's flush and gathers (kv_cache.cu) and the
// compressor (kv_compress.cu). rawkv/reference/kvcache/layouts.py defines
// every byte; docs/kvcache.md ("Ecosystem layouts") gives the sources.
//
// Split page of P records: [P x DATA bytes][P x SCALE bytes][zero pad]
//   MODEL1     DATA 576 = 448 E4M3 codes + 64 BF16,  SCALE 8 = 7 UE8M0 + 0
//   FP8 key    DATA 128 E4M3 codes,                  SCALE 4 = float32
//   MXFP4 key  DATA 64 = 128 E2M1 (2j low nibble),   SCALE 4 = 4 UE8M0
//   MXFP8 key  DATA 128 E4M3 codes,                  SCALE 4 = 4 UE8M0
//              (the page padded to a multiple of 512 bytes)
// The *_lane functions are called by every lane of one warp for one record
// (they shuffle): MODEL1 maps dims 16l .. 16l+15 to lane l, the keys 4l .. 4l+3.
// Beside the layouts, at the end: slot_taken_below, the duplicate-slot rule
// of the state kernels (kv_cache.cu) and the decode compressor (kv_compress.cu).
#pragma once
#include "common.cuh"

// Shared with Python: rawkv/kernels/kv_layouts.py (LAYOUT_CONSTANTS) passes
// them as -D options to every file that includes this header.
#if !defined(RKV_LAY_BLOCK) || !defined(RKV_LAY_NOPE) || !defined(RKV_LAY_ROPE) || \
    !defined(RKV_LAY_TILE) || !defined(RKV_LAY_M1_DATA) || !defined(RKV_LAY_M1_SCALE) || \
    !defined(RKV_LAY_INDEX_DIM) || !defined(RKV_LAY_MX_BLOCK) || !defined(RKV_LAY_FP8_FLOOR) || \
    !defined(RKV_LAY_MX_FLOOR) || !defined(RKV_LAY_UE8M0_BIAS) || !defined(RKV_LAY_KEY_FP8) || \
    !defined(RKV_LAY_KEY_MXFP4) || !defined(RKV_LAY_KEY_MXFP8)
#error "kv_layouts.cuh needs the -D constants of rawkv/kernels/kv_layouts.py"
#endif

namespace rkvlay {

using rkv::u8;
using rkv::u32;
using rkv::i64;
using rkv::ue8m0_value;
using rkv::kF32InfBits;
using rkv::f32_qnan;

constexpr u32 kFull = 0xffffffffu;
constexpr int kEntry = RKV_LAY_NOPE + RKV_LAY_ROPE;
// MODEL1 lane map: one warp per entry, 16 dims per lane; lanes 0..27 hold the
// nope dims (4 lanes per tile of 64), lanes 28..31 the RoPE dims.
constexpr int kNopeLanes = RKV_LAY_NOPE / 16;
static_assert(kEntry == 32 * 16, "MODEL1 kernels map 16 dims to each lane of a warp");
static_assert(RKV_LAY_TILE == 4 * 16, "a MODEL1 tile is 4 lanes");
static_assert(RKV_LAY_M1_DATA == RKV_LAY_NOPE + 2 * RKV_LAY_ROPE, "MODEL1 data record");
static_assert(RKV_LAY_M1_SCALE == RKV_LAY_NOPE / RKV_LAY_TILE + 1, "MODEL1 scale record");
static_assert(RKV_LAY_INDEX_DIM == 32 * 4, "indexer kernels map 4 dims to each lane");
static_assert(RKV_LAY_MX_BLOCK == 8 * 4, "an MX block (MXFP4, MXFP8) is 8 lanes");

// The indexer-key records (template KEY of the key kernels; the values are
// rawkv/kernels/kv_layouts.py's KEYS): DeepGEMM's FP8 key (one float32
// scale), MXFP4 key and MXFP8 key (a UE8M0 byte per block of 32).
constexpr int kKeyFP8 = RKV_LAY_KEY_FP8;
constexpr int kKeyMXFP4 = RKV_LAY_KEY_MXFP4;
constexpr int kKeyMXFP8 = RKV_LAY_KEY_MXFP8;

// An indexer-key kind: its data bytes, and whether its scale record is 4
// UE8M0 bytes (one per block of 32) rather than one float32.
template <int KEY> struct Key {
    static_assert(KEY == kKeyFP8 || KEY == kKeyMXFP4 || KEY == kKeyMXFP8, "an indexer-key kind");
    static constexpr bool kFP4 = KEY == kKeyMXFP4;
    static constexpr bool kMX = KEY != kKeyFP8;
    static constexpr int kData = kFP4 ? RKV_LAY_INDEX_DIM / 2 : RKV_LAY_INDEX_DIM;
};

// float32 -> BF16 bits, RNE; NaN stays NaN with its quiet bit set, sign and
// top payload kept (reference formats.bf16_bits; the conversion instruction
// would return the canonical NaN instead).
__device__ __forceinline__ u32 bf16_bits_rne(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > kF32InfBits) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float bf16_round(float x) { return __uint_as_float(bf16_bits_rne(x) << 16); }
__device__ __forceinline__ float bf16_word_lo(u32 w) { return bf16_round(__uint_as_float(w << 16)); }
__device__ __forceinline__ float bf16_word_hi(u32 w) { return bf16_round(__uint_as_float(w & 0xFFFF0000u)); }

// N consecutive inputs (N = 16 or 4, 16 / 8-byte aligned) as float32 holding
// their BF16 rounding (the layouts quantize the entry rounded to BF16).
template <int N>
__device__ __forceinline__ void load_bf16_rounded(const __nv_bfloat16* p, float (&v)[N]) {
    static_assert(N == 16 || N == 4, "16 or 4 inputs");
    if (N == 16) {
#pragma unroll
        for (int c = 0; c < N / 8; ++c) {
            const uint4 w = reinterpret_cast<const uint4*>(p)[c];
            v[8 * c + 0] = bf16_word_lo(w.x); v[8 * c + 1] = bf16_word_hi(w.x);
            v[8 * c + 2] = bf16_word_lo(w.y); v[8 * c + 3] = bf16_word_hi(w.y);
            v[8 * c + 4] = bf16_word_lo(w.z); v[8 * c + 5] = bf16_word_hi(w.z);
            v[8 * c + 6] = bf16_word_lo(w.w); v[8 * c + 7] = bf16_word_hi(w.w);
        }
    } else {
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        v[0] = bf16_word_lo(w.x); v[1] = bf16_word_hi(w.x);
        v[2] = bf16_word_lo(w.y); v[3] = bf16_word_hi(w.y);
    }
}

template <int N>
__device__ __forceinline__ void load_bf16_rounded(const float* p, float (&v)[N]) {
#pragma unroll
    for (int c = 0; c < N / 4; ++c) {
        const float4 f = reinterpret_cast<const float4*>(p)[c];
        v[4 * c + 0] = bf16_round(f.x); v[4 * c + 1] = bf16_round(f.y);
        v[4 * c + 2] = bf16_round(f.z); v[4 * c + 3] = bf16_round(f.w);
    }
}

// amax over the finite values, and whether any is NaN/Inf.
template <int N>
__device__ __forceinline__ float finite_amax(const float (&v)[N], int& bad) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float a = fabsf(v[i]);
        const bool fin = a <= 3.402823466e38f;
        bad |= !fin;
        amax = fin ? fmaxf(amax, a) : amax;
    }
    return amax;
}

// amax and the bad flag reduced over the aligned group of `width` lanes.
__device__ __forceinline__ float group_amax(float amax, int& bad, int width) {
    for (int o = 1; o < width; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
        bad |= __shfl_xor_sync(kFull, bad, o);
    }
    return amax;
}

// UE8M0 exponent e = ceil(log2(max(amax, floor) / fmax)) of a finite amax:
// the biased exponent of the IEEE quotient - 127, + 1 when its mantissa bits
// are not all zero. Both floors keep the quotient normal, where this is the
// exact ceiling (reference ue8m0_exponent).
__device__ __forceinline__ int ue8m0_exponent(float amax, float floor, float fmax) {
    const u32 b = __float_as_uint(fmaxf(amax, floor) / fmax);
    return (int)((b >> 23) & 0xFFu) - RKV_LAY_UE8M0_BIAS + (int)((b & 0x7FFFFFu) != 0u);
}

// 2^e for e in [-126, 127] (a normal float32).
__device__ __forceinline__ float pow2_normal(int e) { return __uint_as_float((u32)(e + 127) << 23); }

// (The value of a UE8M0 byte: ue8m0_value, common.cuh.)

// 16 float32 values stored as T at p (16-byte aligned).
__device__ __forceinline__ void store16_as(__nv_bfloat16* p, const float (&v)[16]) {
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = bf16_bits_rne(v[2 * i]) | (bf16_bits_rne(v[2 * i + 1]) << 16);
    reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(p)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}
__device__ __forceinline__ void store16_as(__half* p, const float (&v)[16]) {
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
        w[i] = (u32)__half_as_ushort(__float2half_rn(v[2 * i]))
             | ((u32)__half_as_ushort(__float2half_rn(v[2 * i + 1])) << 16);
    reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(p)[1] = make_uint4(w[4], w[5], w[6], w[7]);
}
__device__ __forceinline__ void store16_as(float* p, const float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        reinterpret_cast<float4*>(p)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}

// 4 float32 values stored as T at p (8-byte aligned for BF16/FP16, 16 for FP32).
__device__ __forceinline__ void store4_as(__nv_bfloat16* p, const float (&v)[4]) {
    *reinterpret_cast<uint2*>(p) = make_uint2(bf16_bits_rne(v[0]) | (bf16_bits_rne(v[1]) << 16),
                                              bf16_bits_rne(v[2]) | (bf16_bits_rne(v[3]) << 16));
}
__device__ __forceinline__ void store4_as(__half* p, const float (&v)[4]) {
    *reinterpret_cast<uint2*>(p) = make_uint2(
        (u32)__half_as_ushort(__float2half_rn(v[0])) | ((u32)__half_as_ushort(__float2half_rn(v[1])) << 16),
        (u32)__half_as_ushort(__float2half_rn(v[2])) | ((u32)__half_as_ushort(__float2half_rn(v[3])) << 16));
}
__device__ __forceinline__ void store4_as(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}

// ---------------------------------------------------------------------------
// MODEL1 record `off` of the page at page_base (P = page_size records), one
// warp, lane l holding dims 16l .. 16l+15 already rounded to BF16.
//   lanes 0..27: tile t = l / 4; amax over the tile's finite values and a
//     NaN/Inf flag (4-lane reduction); e = ue8m0_exponent(amax, 1e-4, 448);
//     16 codes e4m3(x * 2^-e) (0 for a bad tile): one 16-byte store at
//     data + 16l.
//   lanes 28..31: 16 RoPE dims as BF16 bits: two 16-byte stores at
//     data + 448 + 32 (l - 28).
//   lanes 0..7: scale byte t = e_t + 127 (0xFF for a bad tile), lane 7 the
//     zero pad.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void model1_store_lane(const float (&v)[16], int lane, u8* page_base, i64 off,
                                                  i64 page_size) {
    int bad = 0;
    const float amax = group_amax(finite_amax(v, bad), bad, 4);
    const int e = ue8m0_exponent(amax, RKV_LAY_FP8_FLOOR, rkv::kE4M3Max);
    u8* data = page_base + off * RKV_LAY_M1_DATA;
    if (lane < kNopeLanes) {
        rkv::Vec16<u8> o;
        o.raw = make_uint4(0u, 0u, 0u, 0u);
        if (!bad) {
            const float inv = pow2_normal(-e);          // exact scaling
#pragma unroll
            for (int i = 0; i < 16; ++i) o.v[i] = rkv::e4m3_encode(v[i] * inv);
        }
        rkv::store16(data + lane * 16, o);
    } else {
        u32 w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = bf16_bits_rne(v[2 * i]) | (bf16_bits_rne(v[2 * i + 1]) << 16);
        uint4* dst = reinterpret_cast<uint4*>(data + RKV_LAY_NOPE + (lane - kNopeLanes) * 32);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
    const u32 byte = bad ? 0xFFu : (u32)(e + RKV_LAY_UE8M0_BIAS);
    const u32 tile_byte = __shfl_sync(kFull, byte, (lane & 7) * 4);
    if (lane < RKV_LAY_M1_SCALE)
        page_base[page_size * RKV_LAY_M1_DATA + off * RKV_LAY_M1_SCALE + lane] =
            (u8)(lane < RKV_LAY_M1_SCALE - 1 ? tile_byte : 0u);
}

// The 16 dims of lane l of MODEL1 record `off` as float32: lanes 0..27 one
// 16-byte code load and the tile's scale byte, e4m3(code) * 2^(byte - 127);
// lanes 28..31 16 BF16 RoPE dims (two 16-byte loads). No shuffles.
__device__ __forceinline__ void model1_load_lane(const u8* page_base, i64 off, i64 page_size, int lane,
                                                 float (&v)[16]) {
    const u8* data = page_base + off * RKV_LAY_M1_DATA;
    if (lane < kNopeLanes) {
        const rkv::Vec16<u8> c = rkv::load16(data + lane * 16);
        const float s = ue8m0_value(page_base[page_size * RKV_LAY_M1_DATA + off * RKV_LAY_M1_SCALE + lane / 4]);
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = rkv::e4m3_decode(c.v[i]) * s;
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(data + RKV_LAY_NOPE + (lane - kNopeLanes) * 32);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 w = src[h];
            v[8 * h + 0] = __uint_as_float(w.x << 16); v[8 * h + 1] = __uint_as_float(w.x & 0xFFFF0000u);
            v[8 * h + 2] = __uint_as_float(w.y << 16); v[8 * h + 3] = __uint_as_float(w.y & 0xFFFF0000u);
            v[8 * h + 4] = __uint_as_float(w.z << 16); v[8 * h + 5] = __uint_as_float(w.z & 0xFFFF0000u);
            v[8 * h + 6] = __uint_as_float(w.w << 16); v[8 * h + 7] = __uint_as_float(w.w & 0xFFFF0000u);
        }
    }
}

// ---------------------------------------------------------------------------
// Indexer-key record `off`, one warp, lane l holding dims 4l .. 4l+3 already
// rounded to BF16.
//   KEY kKeyFP8 (DeepGEMM paged FP8, SM90 and SM100): amax over the key's
//     finite values (warp reduction), e = ue8m0_exponent(amax, 1e-4, 448),
//     codes e4m3(x * 2^-e) (one 4-byte store per lane), scale 2^e as float32.
//   KEY kKeyMXFP4 (DeepGEMM SM100 paged MXFP4): a block of 32 is 8 lanes; per
//     block e = ue8m0_exponent(amax, 6 * 2^-126, 6), codes e2m1(x * 2^-e)
//     (element 2j in the low nibble: one 2-byte store per lane).
//   KEY kKeyMXFP8 (DeepGEMM SM100 paged MXFP8): per block of 32 (8 lanes)
//     e = ue8m0_exponent(amax, 1e-4, 448), codes e4m3(x * 2^-e) (one 4-byte
//     store per lane).
//   The MX keys' scale byte is e + 127; lane 0 stores the 4 scale bytes as
//   one int32 (block k in byte k).
// A NaN/Inf key (block) stores codes 0 and a NaN scale (byte 0xFF).
// ---------------------------------------------------------------------------
template <int KEY>
__device__ __forceinline__ void index_store_lane(const float (&v)[4], int lane, u8* page_base, i64 off,
                                                 i64 page_size) {
    using K = Key<KEY>;
    constexpr int kGroup = K::kMX ? RKV_LAY_MX_BLOCK / 4 : 32;      // lanes per scale
    int bad = 0;
    const float amax = group_amax(finite_amax(v, bad), bad, kGroup);
    const int e = K::kFP4 ? ue8m0_exponent(amax, RKV_LAY_MX_FLOOR, 6.0f)
                          : ue8m0_exponent(amax, RKV_LAY_FP8_FLOOR, rkv::kE4M3Max);
    u32 packed = 0u;
    if (!bad) {
        const float inv = pow2_normal(-e);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            packed |= K::kFP4 ? rkv::e2m1_encode(v[i] * inv) << (4 * i) : (u32)rkv::e4m3_encode(v[i] * inv) << (8 * i);
    }
    u8* scale = page_base + page_size * K::kData + off * 4;
    if constexpr (K::kFP4)
        *reinterpret_cast<unsigned short*>(page_base + off * K::kData + lane * 2) = (unsigned short)packed;
    else
        *reinterpret_cast<u32*>(page_base + off * K::kData + lane * 4) = packed;
    if constexpr (K::kMX) {
        const u32 byte = bad ? 0xFFu : (u32)(e + RKV_LAY_UE8M0_BIAS);
        u32 word = byte;
#pragma unroll
        for (int k = 1; k < 32 / kGroup; ++k) word |= __shfl_sync(kFull, byte, k * kGroup) << (8 * k);
        if (lane == 0) *reinterpret_cast<u32*>(scale) = word;
    } else {
        if (lane == 0) *reinterpret_cast<float*>(scale) = bad ? f32_qnan() : pow2_normal(e);
    }
}

// The 4 dims of lane l of indexer-key record `off` as float32, decoded in
// float32 (exact): FP8 e4m3(code) * scale; MXFP4 e2m1(code) * 2^(byte - 127),
// MXFP8 e4m3(code) * 2^(byte - 127), with the byte of block l / 8. No shuffles.
template <int KEY>
__device__ __forceinline__ void index_load_lane(const u8* page_base, i64 off, i64 page_size, int lane,
                                                float (&v)[4]) {
    using K = Key<KEY>;
    const u8* scale = page_base + page_size * K::kData + off * 4;
    if constexpr (K::kFP4) {
        const u32 c = *reinterpret_cast<const unsigned short*>(page_base + off * K::kData + lane * 2);
        const float s = ue8m0_value(scale[lane / (RKV_LAY_MX_BLOCK / 4)]);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = rkv::e2m1_decode((c >> (4 * i)) & 0xFu) * s;
    } else {
        const u32 c = *reinterpret_cast<const u32*>(page_base + off * K::kData + lane * 4);
        const float s = K::kMX ? ue8m0_value(scale[lane / (RKV_LAY_MX_BLOCK / 4)])
                               : *reinterpret_cast<const float*>(scale);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = rkv::e4m3_decode((u8)((c >> (8 * i)) & 0xFFu)) * s;
    }
}

}  // namespace rkvlay

namespace rkv {

// The duplicate-slot rule (docs/kvcache.md decision 11): among the valid rows
// with an in-range slot, the lowest row of a slot owns it. Returns whether a
// valid row below b names slot s, i.e. whether row b repeats a lower row's
// slot. NULL_IS_ALL: valid == nullptr means every row is valid (the state
// kernels of kv_cache.cu); without it valid is never null and the loop tests
// no pointer (kv_compress.cu). Every thread of the CTA must call it: it is a
// barrier (__syncthreads_or).
template <bool NULL_IS_ALL, typename V, typename I>
__device__ __forceinline__ bool slot_taken_below(const V* __restrict__ valid, const I* __restrict__ slots,
                                                 i64 b, i64 s) {
    bool hit = false;
    for (i64 q = threadIdx.x; q < b; q += blockDim.x)
        hit |= ((NULL_IS_ALL && valid == nullptr) || valid[q]) && (i64)slots[q] == s;
    return __syncthreads_or(hit ? 1 : 0) != 0;
}

}  // namespace rkv
