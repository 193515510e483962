// fp8_blocks.cu: FP8 block activations (rawkv.fp8.quantize_blocks /
// dequantize_blocks): E4M3 codes with one scale per row per BLOCK channels.
// rawkv/reference/fp8_blocks.py defines the bytes and names the DeepSeek
// source each rule follows (V4 / V3.2-Exp act_quant):
//   amax = max(max|x|, FP32(1e-4)); s = amax * FP32(1/448) (a product, not a
//   quotient); ue8m0: s = 2^(exponent + (mantissa != 0)) from s's bits;
//   code = E4M3_rne_satfinite(FP32(x / s)) with IEEE division.
// A block holding NaN or Inf is flagged: codes 0, scale NaN (E8M0 0xFF).
// UE8M0: the scale is rounded up to a power of two; SBYTE: it is stored as
// its E8M0 byte (else as float32; SBYTE needs UE8M0).
#include "common.cuh"
using namespace rkv;

#define RKV_FP8_AMAX_FLOOR 0x1.a36e2ep-14f    // FP32(1e-4)
#define RKV_FP8_INV_MAX 0x1.24924ap-9f        // FP32(1/448)

// The E8M0 byte of a block scale computed from its (floored) amax: the
// exponent of s rounded up to a power of two (fast_round_scale).
__device__ __forceinline__ u32 fp8_ue8m0_byte(float s) {
    const u32 bits = __float_as_uint(s);
    return ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u);
}

// The N codes of one thread, stored as one word.
template <int N> struct CodesWord;
template <> struct CodesWord<8> { typedef uint2 type; };
template <> struct CodesWord<4> { typedef u32 type; };

// One thread per 16-byte vector of x (Vec16<T>::N channels); TPB = BLOCK / N
// consecutive lanes hold one (row, block) unit and reduce its amax with
// shuffles. Every lane of a warp runs the same number of iterations (the
// shuffles need them all), each with the warp's next 32 / TPB units. Rows
// are K elements apart (contiguous x and codes); K % 16 == 0, so every
// vector is whole and a partial last block is a whole number of vectors.

template <typename T, int BLOCK, bool UE8M0, bool SBYTE>
__global__ void rkv_fp8_quantize_blocks(const T* __restrict__ x, u8* __restrict__ codes,
                                        void* __restrict__ scales, i64 rows, i64 K) {
    constexpr int N = Vec16<T>::N;
    constexpr int TPB = BLOCK / N;
    static_assert(UE8M0 || !SBYTE, "an E8M0 byte holds a power of two only");
    static_assert(TPB >= 1 && TPB <= 32 && (TPB & (TPB - 1)) == 0, "BLOCK / N must be a power of two <= 32");
    constexpr int UPW = 32 / TPB;                   // units per warp per iteration
    const i64 nb = (K + BLOCK - 1) / BLOCK;
    const i64 units = rows * nb;
    const int lane = threadIdx.x & 31;
    const int t = lane % TPB;
    const i64 warps = grid_threads() / 32;
    for (i64 base = global_thread() / 32 * UPW; base < units; base += warps * UPW) {
        const i64 u = base + lane / TPB;
        const i64 row = u / nb, b = u - row * nb;
        const i64 col = b * BLOCK + (i64)t * N;
        const bool has = u < units && col < K;
        Vec16<T> in;
        in.raw = make_uint4(0u, 0u, 0u, 0u);
        if (has) in = load16(x + row * K + col);
        float v[N];
        float amax = 0.0f;
        bool bad = false;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            v[j] = to_f32(in.v[j]);
            bad |= !isfinite(v[j]);
            amax = fmaxf(amax, fabsf(v[j]));
        }
        int flag = bad;
#pragma unroll
        for (int o = TPB / 2; o > 0; o >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            flag |= __shfl_xor_sync(0xffffffffu, flag, o);
        }
        float s = __fmul_rn(fmaxf(amax, RKV_FP8_AMAX_FLOOR), RKV_FP8_INV_MAX);
        u32 byte = 0;
        if (UE8M0) {
            byte = fp8_ue8m0_byte(s);
            s = __uint_as_float(byte << 23);
        }
        if (!has) continue;
        typedef typename CodesWord<N>::type W;
        union { u8 b[N]; W w; } out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.b[j] = flag ? (u8)0 : e4m3_encode(__fdiv_rn(v[j], s));
        *reinterpret_cast<W*>(codes + row * K + col) = out.w;
        if (t == 0) {
            if (SBYTE)
                static_cast<u8*>(scales)[u] = flag ? (u8)0xFF : (u8)byte;
            else
                static_cast<float*>(scales)[u] = flag ? __uint_as_float(0x7FC00000u) : s;
        }
    }
}

// Dequantize: one thread per 8 codes (K % 16 == 0: a unit never crosses a
// row or a block); out = FP32(decode(code) * scale), rounded to OutT, stored
// 16 bytes at a time (out 16-byte aligned).
template <typename OutT, bool UE8M0>
__global__ void rkv_fp8_dequantize_blocks(const u8* __restrict__ codes, const void* __restrict__ scales,
                                          OutT* __restrict__ out, i64 rows, i64 K, int blk) {
    const i64 upr = K / 8;
    const i64 nb = (K + blk - 1) / blk;
    const i64 units = rows * upr;
    for (i64 u = global_thread(); u < units; u += grid_threads()) {
        const i64 row = u / upr, col = (u - row * upr) * 8;
        const i64 si = row * nb + col / blk;
        float s;
        if (UE8M0) {
            const u32 e = static_cast<const u8*>(scales)[si];
            s = e == 0xFFu ? __uint_as_float(0x7FC00000u)
                           : (e == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(e << 23));
        } else {
            s = static_cast<const float*>(scales)[si];
        }
        union { uint2 w; u8 c[8]; } in;
        in.w = *reinterpret_cast<const uint2*>(codes + row * K + col);
        constexpr int N = Vec16<OutT>::N;
#pragma unroll
        for (int h = 0; h < 8 / N; ++h) {
            Vec16<OutT> o;
#pragma unroll
            for (int j = 0; j < N; ++j) o.v[j] = from_f32<OutT>(__fmul_rn(e4m3_decode(in.c[h * N + j]), s));
            store16(out + row * K + col + h * N, o);
        }
    }
}
