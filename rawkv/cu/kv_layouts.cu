// kv_layouts.cu: the byte layouts the ecosystem's DeepSeek-V4 kernels read:
// FlashMLA's MODEL1_FP8Sparse attention entries (also the sliding-window
// tokens), DeepGEMM's paged FP8 and MXFP4 indexer keys, the gather of MODEL1
// entries by FlashMLA indices and the top-k -> indices_in_kvcache bridge.
//
// rawkv/reference/kvcache/layouts.py defines every byte; docs/kvcache.md
// ("Ecosystem layouts") gives the layouts, the sources and the decisions.
// Every kernel runs on the caller's stream, allocates nothing and never
// synchronizes (a decode step captures into one CUDA graph). Device-side
// indices are bounds-checked: index -1 is padding (skipped, not counted), any
// other out-of-range index skips its row and adds 1 to errors[0] (errors may
// be null: nothing is counted).
//
// Split page of P records (all three layouts):
//   [P x DATA bytes][P x SCALE bytes][zero pad], page stride page_bytes
//   MODEL1     DATA 576 = 448 E4M3 codes + 64 BF16,  SCALE 8 = 7 UE8M0 + 0
//   FP8 key    DATA 128 E4M3 codes,                  SCALE 4 = float32
//   MXFP4 key  DATA 64 = 128 E2M1 (2j low nibble),   SCALE 4 = 4 UE8M0
// Host-side checks guarantee: the cache base is 16-byte aligned (MODEL1) or
// 4-byte aligned (keys), rows are 16-byte aligned, num_pages * P < 2^31.
#include "common.cuh"
using namespace rkv;

// Shared with Python: rawkv/kernels/kv_layouts.py passes them as -D options
// (the layout values come from the reference module).
#if !defined(RKV_LAY_BLOCK) || !defined(RKV_LAY_NOPE) || !defined(RKV_LAY_ROPE) || \
    !defined(RKV_LAY_TILE) || !defined(RKV_LAY_M1_DATA) || !defined(RKV_LAY_M1_SCALE) || \
    !defined(RKV_LAY_INDEX_DIM) || !defined(RKV_LAY_MX_BLOCK) || !defined(RKV_LAY_FP8_FLOOR) || \
    !defined(RKV_LAY_MX_FLOOR) || !defined(RKV_LAY_UE8M0_BIAS)
#error "kv_layouts.cu needs the -D constants of rawkv/kernels/kv_layouts.py"
#endif

namespace {

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
static_assert(RKV_LAY_MX_BLOCK == 8 * 4, "an MXFP4 block is 8 lanes");

__device__ __forceinline__ float f32_qnan() { return __int_as_float(0x7FC00000); }

// float32 -> BF16 bits, RNE; NaN stays NaN with its quiet bit set, sign and
// top payload kept (reference formats.bf16_bits; the conversion instruction
// would return the canonical NaN instead).
__device__ __forceinline__ u32 bf16_bits_rne(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
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

// The value of a UE8M0 byte: 2^(byte - 127), byte 0 = 2^-127 (subnormal), 0xFF = NaN.
__device__ __forceinline__ float ue8m0_value(u32 byte) {
    return byte == 0xFFu ? f32_qnan() : byte == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(byte << 23);
}

// Where row r goes (reference layouts.locate): 0 = record (page, off);
// 1 = padding (-1), skipped, not counted; 2 = out of range, counted.
// offsets == nullptr: slots are slot ids page * P + off; else page ids.
template <typename TID>
__device__ __forceinline__ int locate(const TID* __restrict__ slots, const int* __restrict__ offsets,
                                      i64 r, i64 num_pages, i64 page_size, i64& page, i64& off) {
    const i64 s = (i64)slots[r];
    if (s == -1) return 1;
    if (offsets == nullptr) {
        if (s < 0 || s >= num_pages * page_size) return 2;
        page = (u32)s / (u32)page_size;                   // host: num_pages * P < 2^31
        off = s - page * page_size;
    } else {
        const i64 o = offsets[r];
        if (s < 0 || s >= num_pages || o < 0 || o >= page_size) return 2;
        page = s;
        off = o;
    }
    return 0;
}

__device__ __forceinline__ void count_error(int* errors) {
    if (errors != nullptr) atomicAdd(errors, 1);
}

// The record of row r (locate), counting a bad one (lane 0); false: skip the row.
template <typename TID>
__device__ __forceinline__ bool row_record(const TID* __restrict__ slots, const int* __restrict__ offsets,
                                           int* errors, i64 r, i64 num_pages, i64 page_size, int lane,
                                           i64& page, i64& off) {
    const int where = locate(slots, offsets, r, num_pages, page_size, page, off);
    if (where == 2 && lane == 0) count_error(errors);
    return where == 0;
}

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

__device__ __forceinline__ i64 first_warp() { return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 grid_warps() { return (i64)gridDim.x * (blockDim.x >> 5); }

}  // namespace

// ===========================================================================
// MODEL1 store (entries and the window insert): one warp per row,
// grid-stride over rows. Row r (512 TIN values) goes to the record of
// locate(slots, offsets, r). Lane l loads dims 16l .. 16l+15 (BF16-rounded).
//   lanes 0..27: tile t = l / 4; amax over the tile's finite values and a
//     NaN/Inf flag (4-lane reduction); e = ue8m0_exponent(amax, 1e-4, 448);
//     16 codes e4m3(x * 2^-e) (0 for a bad tile): one 16-byte store at
//     data + 16l.
//   lanes 28..31: 16 RoPE dims as BF16 bits: two 16-byte stores at
//     data + 448 + 32 (l - 28).
//   lanes 0..7: scale byte t = e_t + 127 (0xFF for a bad tile), lane 7 the
//     zero pad.
// ===========================================================================
template <typename TIN, typename TID>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_model1_store(
        const TIN* __restrict__ rows, const TID* __restrict__ slots, const int* __restrict__ offsets,
        u8* __restrict__ cache, int* __restrict__ errors,
        i64 N, i64 num_pages, i64 page_size, i64 page_bytes) {
    const int lane = threadIdx.x & 31;
    for (i64 r = first_warp(); r < N; r += grid_warps()) {     // warp-uniform
        i64 page = 0, off = 0;
        if (!row_record(slots, offsets, errors, r, num_pages, page_size, lane, page, off)) continue;
        float v[16];
        load_bf16_rounded<16>(rows + r * kEntry + lane * 16, v);
        int bad = 0;
        const float amax = group_amax(finite_amax(v, bad), bad, 4);
        const int e = ue8m0_exponent(amax, RKV_LAY_FP8_FLOOR, kE4M3Max);
        u8* page_base = cache + page * page_bytes;
        u8* data = page_base + off * RKV_LAY_M1_DATA;
        if (lane < kNopeLanes) {
            Vec16<u8> o;
            o.raw = make_uint4(0u, 0u, 0u, 0u);
            if (!bad) {
                const float inv = pow2_normal(-e);          // exact scaling
#pragma unroll
                for (int i = 0; i < 16; ++i) o.v[i] = e4m3_encode(v[i] * inv);
            }
            store16(data + lane * 16, o);
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
}

// ===========================================================================
// Indexer key store, one warp per key, 4 dims per lane.
//   MXFP4 false (DeepGEMM SM90 paged FP8): amax over the key's finite values
//     (warp reduction), e = ue8m0_exponent(amax, 1e-4, 448), codes
//     e4m3(x * 2^-e) (one 4-byte store per lane), scale 2^e as float32.
//   MXFP4 true (DeepGEMM SM100 paged MXFP4): a block of 32 is 8 lanes; per
//     block e = ue8m0_exponent(amax, 6 * 2^-126, 6), codes e2m1(x * 2^-e)
//     (element 2j in the low nibble: one 2-byte store per lane), scale byte
//     e + 127; lane 0 stores the 4 scale bytes as one int32 (block k in byte k).
// A NaN/Inf key (block) stores codes 0 and a NaN scale (byte 0xFF).
// ===========================================================================
template <typename TIN, typename TID, bool MXFP4>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_index_store(
        const TIN* __restrict__ rows, const TID* __restrict__ slots, const int* __restrict__ offsets,
        u8* __restrict__ cache, int* __restrict__ errors,
        i64 N, i64 num_pages, i64 page_size, i64 page_bytes) {
    constexpr int kGroup = MXFP4 ? RKV_LAY_MX_BLOCK / 4 : 32;       // lanes per scale
    constexpr int kData = MXFP4 ? RKV_LAY_INDEX_DIM / 2 : RKV_LAY_INDEX_DIM;
    const int lane = threadIdx.x & 31;
    for (i64 r = first_warp(); r < N; r += grid_warps()) {
        i64 page = 0, off = 0;
        if (!row_record(slots, offsets, errors, r, num_pages, page_size, lane, page, off)) continue;
        float v[4];
        load_bf16_rounded<4>(rows + r * RKV_LAY_INDEX_DIM + lane * 4, v);
        int bad = 0;
        const float amax = group_amax(finite_amax(v, bad), bad, kGroup);
        const int e = MXFP4 ? ue8m0_exponent(amax, RKV_LAY_MX_FLOOR, 6.0f)
                            : ue8m0_exponent(amax, RKV_LAY_FP8_FLOOR, kE4M3Max);
        u32 packed = 0u;
        if (!bad) {
            const float inv = pow2_normal(-e);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                packed |= MXFP4 ? e2m1_encode(v[i] * inv) << (4 * i) : (u32)e4m3_encode(v[i] * inv) << (8 * i);
        }
        u8* page_base = cache + page * page_bytes;
        u8* scale = page_base + page_size * kData + off * 4;
        if (MXFP4) {
            *reinterpret_cast<unsigned short*>(page_base + off * kData + lane * 2) = (unsigned short)packed;
            const u32 byte = bad ? 0xFFu : (u32)(e + RKV_LAY_UE8M0_BIAS);
            u32 word = byte;
#pragma unroll
            for (int k = 1; k < 32 / kGroup; ++k) word |= __shfl_sync(kFull, byte, k * kGroup) << (8 * k);
            if (lane == 0) *reinterpret_cast<u32*>(scale) = word;
        } else {
            *reinterpret_cast<u32*>(page_base + off * kData + lane * 4) = packed;
            if (lane == 0) *reinterpret_cast<float*>(scale) = bad ? f32_qnan() : pow2_normal(e);
        }
    }
}

// ===========================================================================
// MODEL1 gather by FlashMLA indices (page * P + offset): one warp per output
// row, 16 dims per lane. Lanes 0..27: one 16-byte code load and the tile's
// scale byte, e4m3(code) * 2^(byte - 127) in float32; lanes 28..31: 16 BF16
// RoPE dims (two 16-byte loads). Each lane stores its 16 outputs as TO.
// Index -1: zero row, not counted; outside [0, num_pages * P): zero row,
// errors += 1.
// ===========================================================================
template <typename TO>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_model1_gather(
        const u8* __restrict__ cache, const int* __restrict__ indices, TO* __restrict__ out,
        int* __restrict__ errors, i64 R, i64 num_pages, i64 page_size, i64 page_bytes) {
    const int lane = threadIdx.x & 31;
    for (i64 r = first_warp(); r < R; r += grid_warps()) {
        i64 page = 0, off = 0;
        float v[16];
        if (!row_record(indices, (const int*)nullptr, errors, r, num_pages, page_size, lane, page, off)) {
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = 0.0f;
        } else {
            const u8* page_base = cache + page * page_bytes;
            const u8* data = page_base + off * RKV_LAY_M1_DATA;
            if (lane < kNopeLanes) {
                const Vec16<u8> c = load16(data + lane * 16);
                const float s = ue8m0_value(
                    page_base[page_size * RKV_LAY_M1_DATA + off * RKV_LAY_M1_SCALE + lane / 4]);
#pragma unroll
                for (int i = 0; i < 16; ++i) v[i] = e4m3_decode(c.v[i]) * s;
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
        store16_as(out + r * kEntry + lane * 16, v);
    }
}

// ===========================================================================
// Bridge: logical top-k ids -> FlashMLA indices_in_kvcache (int32), one
// thread per id, grid-stride over B * per_row. Id t belongs to request
// b = t / per_row, which reads block-table row slots[b] (b when slots is
// null) of table (table_rows, max_blocks):
//   out = table[row, e / P] * P + e % P.
// e == -1 -> -1, not counted. e < -1, e >= n_entries[b] (when given),
// e / P >= max_blocks, a row outside [0, table_rows) or a block id outside
// [0, num_pages) -> -1, errors += 1. Host: B * per_row and max_blocks * P
// below 2^31, num_pages * P <= 2^31 - 1.
// ===========================================================================
template <typename TID>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_topk_to_kvcache(
        const TID* __restrict__ ids, const int* __restrict__ table, const int* __restrict__ slots,
        const int* __restrict__ n_entries, int* __restrict__ out, int* __restrict__ errors,
        i64 B, i64 per_row, i64 table_rows, i64 max_blocks, i64 num_pages, i64 page_size) {
    const i64 total = B * per_row;
    for (i64 t = global_thread(); t < total; t += grid_threads()) {
        const i64 e = (i64)ids[t];
        int res = -1;
        if (e != -1) {
            const i64 b = (u32)t / (u32)per_row;
            const i64 row = slots != nullptr ? (i64)slots[b] : b;
            const bool in_range = row >= 0 && row < table_rows && e >= 0 && e < max_blocks * page_size &&
                                  (n_entries == nullptr || e < (i64)n_entries[b]);
            if (in_range) {
                const i64 lb = (u32)e / (u32)page_size;
                const i64 blk = table[row * max_blocks + lb];
                if (blk >= 0 && blk < num_pages) res = (int)(blk * page_size + (e - lb * page_size));
            }
            if (res < 0) count_error(errors);
        }
        out[t] = res;
    }
}
