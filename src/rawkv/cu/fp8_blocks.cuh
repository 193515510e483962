// fp8_blocks.cuh: the FP8 block-activation rule on the device, one copy for
// the standalone quantizer (fp8_blocks.cu: rawkv.fp8.quantize_blocks) and the
// fused producers' FP8 outputs (fused.cu). rawkv/reference/fp8_blocks.py
// defines the bytes and names the DeepSeek source each rule follows (V4 /
// V3.2-Exp act_quant):
//   amax = max(max|x|, FP32(1e-4)); s = amax * FP32(1/448) (a product, not a
//   quotient); ue8m0: s = 2^(exponent + (mantissa != 0)) from s's bits;
//   code = E4M3_rne_satfinite(FP32(x / s)) with IEEE division.
// A block holding NaN or Inf is flagged: codes 0, scale NaN (E8M0 0xFF).
// Formats: `ue8m0` rounds the scale up to a power of two; `sbyte` stores it as
// its E8M0 byte (else as float32; sbyte needs ue8m0). Callers pass them (and
// the block) as template constants or run-time values alike: after inlining
// the constants fold.
#pragma once
#include "common.cuh"

namespace rkv {

#define RKV_FP8_AMAX_FLOOR 0x1.a36e2ep-14f    // FP32(1e-4)
#define RKV_FP8_INV_MAX 0x1.24924ap-9f        // FP32(1/448)

// The E8M0 byte of a block scale computed from its (floored) amax: the
// exponent of s rounded up to a power of two (fast_round_scale).
__device__ __forceinline__ u32 fp8_ue8m0_byte(float s) {
    const u32 bits = __float_as_uint(s);
    return ((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u);
}

// The scale of a block whose finite elements' max |x| is amax; `byte` gets
// its E8M0 byte when ue8m0 (the scale is then that power of two).
__device__ __forceinline__ float fp8_block_scale(float amax, bool ue8m0, u32& byte) {
    float s = __fmul_rn(fmaxf(amax, RKV_FP8_AMAX_FLOOR), RKV_FP8_INV_MAX);
    byte = 0u;
    if (ue8m0) {
        byte = fp8_ue8m0_byte(s);
        s = __uint_as_float(byte << 23);
    }
    return s;
}

// The code of v in a block of scale s (0 in a flagged block).
__device__ __forceinline__ u8 fp8_block_code(float v, float s, bool flag) {
    return flag ? (u8)0 : e4m3_encode(__fdiv_rn(v, s));
}

// Scale i of `scales`: its E8M0 byte (sbyte) or its float32, the NaN of
// either for a flagged block.
__device__ __forceinline__ void fp8_store_scale(void* scales, i64 i, float s, u32 byte, bool flag, bool sbyte) {
    if (sbyte)
        static_cast<u8*>(scales)[i] = flag ? (u8)0xFF : (u8)byte;
    else
        static_cast<float*>(scales)[i] = flag ? __uint_as_float(0x7FC00000u) : s;
}

// The amax and the non-finite flag of a block held by `lanes` consecutive
// lanes (a power of two <= 32, aligned; every lane of the warp calls this).
__device__ __forceinline__ void fp8_group_reduce(float& amax, int& flag, int lanes) {
#pragma unroll
    for (int o = lanes / 2; o > 0; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        flag |= __shfl_xor_sync(0xffffffffu, flag, o);
    }
}

// The N codes of one thread, stored as one word.
template <int N> struct CodesWord;
template <> struct CodesWord<8> { typedef uint2 type; };
template <> struct CodesWord<4> { typedef u32 type; };

// Quantize rows x K of contiguous x (K % 16 == 0) into codes and one scale
// per row per `block` channels, the last block partial. A grid-stride loop:
// one thread per 16-byte vector of x (Vec16<T>::N channels); tpb = block / N
// consecutive lanes hold one (row, block) unit and reduce its amax with
// shuffles (block / N must be a power of two <= 32). Every lane of a warp
// runs the same number of iterations (the shuffles need them all), each with
// the warp's next 32 / tpb units. Rows are K elements apart (contiguous x
// and codes); K % 16 == 0, so every vector is whole and a partial last block
// is a whole number of vectors. Scale (row, b) is element row * s_row +
// b * s_blk of `scales` (any layout: DeepSeek's row-major, DeepGEMM's
// MN-major).
template <typename T>
__device__ __forceinline__ void fp8_quantize_rows(const T* __restrict__ x, u8* __restrict__ codes,
                                                  void* __restrict__ scales, i64 s_row, i64 s_blk, i64 rows,
                                                  i64 K, int block, bool ue8m0, bool sbyte) {
    constexpr int N = Vec16<T>::N;
    const int tpb = block / N;
    const int upw = 32 / tpb;                       // units per warp per iteration
    const i64 nb = (K + block - 1) / block;
    const i64 units = rows * nb;
    const int lane = threadIdx.x & 31;
    const int t = lane % tpb;
    const i64 warps = grid_threads() / 32;
    for (i64 base = global_thread() / 32 * upw; base < units; base += warps * upw) {
        const i64 u = base + lane / tpb;
        const i64 row = u / nb, b = u - row * nb;
        const i64 col = b * block + (i64)t * N;
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
        fp8_group_reduce(amax, flag, tpb);
        u32 byte;
        const float s = fp8_block_scale(amax, ue8m0, byte);
        if (!has) continue;
        typedef typename CodesWord<N>::type W;
        union { u8 b[N]; W w; } out;
#pragma unroll
        for (int j = 0; j < N; ++j) out.b[j] = fp8_block_code(v[j], s, flag);
        *reinterpret_cast<W*>(codes + row * K + col) = out.w;
        if (t == 0) fp8_store_scale(scales, row * s_row + b * s_blk, s, byte, flag, sbyte);
    }
}

}  // namespace rkv
