// fp8_blocks.cuh: the FP8 block-activation rule on the device, one copy for
// the standalone quantizer (fp8_blocks.cu: rawkv.fp8.quantize_blocks) and the
// fused producers' FP8 outputs (fused.cu). rawkv/reference/fp8_blocks.py
// defines the bytes and names the DeepSeek source each rule follows (V4 /
// V3.2-Exp act_quant):
//   amax = max(max|x|, FP32(1e-4)); s = amax * FP32(1/448) (a product, not a
//   quotient); ue8m0: s = 2^(exponent + (mantissa != 0)) from s's bits;
//   code = E4M3_rne_satfinite(FP32(x / s)) with IEEE division (the kernels
//   get the same quotient by a multiply or Markstein's correction:
//   fp8_block_codes16).
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

// The 16 codes of v[0..15] in a block of scale s (E8M0 byte `byte` when
// ue8m0), little-endian in a uint4; zeros in a flagged block. A code is
// E4M3(v / s), the IEEE quotient:
// * Where s is a power of two (ue8m0: s = 2^(byte - 127), byte 105 .. 247
//   from the amax floor to FLT_MAX), v times 2^(127 - byte), an exact normal
//   float, is that same correctly rounded quotient (subnormal results
//   included: --ftz=false), so one multiply replaces the division's
//   reciprocal, refinement and slow-path test.
// * An unflagged block's quotients are finite (|v| <= amax <= 448 s up to
//   s's rounding), so one satfinite conversion per pair gives
//   e4m3_encode's bytes (its NaN test and clamp to +-448 are what satfinite
//   does for them), and a flagged block is zeroed once, not per code.
// * Where s is any float32 (FP32 scales), the quotient is Markstein's
//   correction of RN(v * y) with y = RN(1 / s), one reciprocal per block:
//   q = RN(v * y), r = v - q * s (exact, one FMA), q' = RN(q + r * y) is
//   RN(v / s) whenever q, s and y are normal and r is exact. Here
//   s >= FP32(1e-4) / 448 = 2^-22.1, so every v whose quotient codes to
//   anything but a signed zero (|v / s| > 2^-10: |v| > 2^-32.1) meets that;
//   below it q' may be an ulp off inside the zero code's range. The sign is
//   v's, as the division's (q' of v = -0 is +0, whose code 0x00 is not
//   -0's 0x80): a copysign restores it. Checked against the division in
//   exact arithmetic on 16.6 million pairs (docs/fused.md, "FP32 scales by
//   Markstein's correction") and bit for bit by the GPU tests against the
//   reference.
__device__ __forceinline__ uint4 fp8_block_codes16(const float (&v)[16], float s, u32 byte, bool ue8m0,
                                                   bool flag) {
    // (One branch, two loops: every caller passes ue8m0 as a template
    // constant, so the other loop folds away.)
    u32 h[8];                                     // the codes of pairs 0..7
    if (ue8m0) {
        const float inv = __uint_as_float((254u - byte) << 23);
#pragma unroll
        for (int p = 0; p < 8; ++p)
            h[p] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * p], inv), __fmul_rn(v[2 * p + 1], inv)),
                                            __NV_SATFINITE, __NV_E4M3);
    } else {
        const float y = __frcp_rn(s);
        auto quotient = [&](float a) { return copysignf(markstein_quotient(a, s, y), a); };
#pragma unroll
        for (int p = 0; p < 8; ++p)
            h[p] = __nv_cvt_float2_to_fp8x2(make_float2(quotient(v[2 * p]), quotient(v[2 * p + 1])),
                                            __NV_SATFINITE, __NV_E4M3);
    }
    return flag ? make_uint4(0u, 0u, 0u, 0u)
                : make_uint4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
}

// Scale i of `scales`: its E8M0 byte (sbyte) or its float32, the NaN of
// either for a flagged block.
__device__ __forceinline__ void fp8_store_scale(void* scales, i64 i, float s, u32 byte, bool flag, bool sbyte) {
    if (sbyte)
        static_cast<u8*>(scales)[i] = flag ? (u8)0xFF : (u8)byte;
    else
        static_cast<float*>(scales)[i] = flag ? f32_qnan() : s;
}

// The amax of a block held by `lanes` consecutive lanes (2, 4 or 8: blocks
// of 32, 64 or 128 channels; aligned; every lane of the warp calls this)
// from each lane's `amax` and whether it holds a NaN or an Inf (`bad`), and
// in `flag` whether the block does. A bad lane enters +Inf, so the result is
// +Inf exactly when the block holds one (a finite element's |x| is finite):
// one max reduction carries the flag too (two reductions did until session
// 57). Three shuffles whatever `lanes`, the steps past it masked out (no
// loop over a run-time count: the fused producers pass it at run time).
__device__ __forceinline__ float fp8_group_max(float amax, bool bad, int lanes, bool& flag) {
    if (bad) amax = __uint_as_float(kF32InfBits);
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, amax, o);
        if (o < lanes) amax = fmaxf(amax, other);
    }
    flag = amax == __uint_as_float(kF32InfBits);
    return amax;
}

// Quantize rows x K of contiguous x (K % 16 == 0) into codes and one scale
// per row per `block` channels, the last block partial. A grid-stride loop:
// one lane per 16 consecutive channels of a row (16 / Vec16<T>::N 16-byte
// loads, one 16-byte store of codes), so a lane's channels are wholly inside
// K or wholly past it; block / 16 consecutive lanes hold one (row, block)
// unit and reduce its amax with shuffles. Every lane of a warp runs the same
// number of iterations (the shuffles need them all), each with the warp's
// next 32 / (block / 16) units. Rows are K elements apart (contiguous x and
// codes). Scale (row, b) is element row * s_row + b * s_blk of `scales` (any
// layout: DeepSeek's row-major, DeepGEMM's MN-major). K > 0 (the blocks per
// row divide the stepping; every caller launches only then).
// A lane steps its unit (row, b) by the grid's units per iteration with an
// add and a compare. (It used to divide a 64-bit unit index every iteration,
// a call of ~70 instructions, and to load 16 bytes per lane: that held the
// loop near half the copy bandwidth; docs/fused.md, "FP8 block quantizer: at
// copy speed".)
template <typename T>
__device__ __forceinline__ void fp8_quantize_rows(const T* __restrict__ x, u8* __restrict__ codes,
                                                  void* __restrict__ scales, i64 s_row, i64 s_blk, i64 rows,
                                                  i64 K, int block, bool ue8m0, bool sbyte) {
    constexpr int N = Vec16<T>::N;
    constexpr int V = 16 / N;                       // 16-byte loads per lane
    const int tpb = block / 16;                     // lanes per unit
    const int upw = 32 / tpb;                       // units per warp per iteration
    const i64 nb = (K + block - 1) / block;
    const i64 units = rows * nb;
    const int lane = threadIdx.x & 31;
    const int t = lane % tpb;
    const i64 warp = global_thread() / 32, step = grid_threads() / 32 * upw;
    const i64 step_rows = step / nb, step_blocks = step - step_rows * nb;
    const i64 first = warp * upw + lane / tpb;
    i64 row = first / nb, b = first - row * nb;
    for (i64 base = warp * upw; base < units; base += step) {
        const i64 col = b * block + 16 * t;
        const bool has = row < rows && col < K;
        Vec16<T> in[V];
#pragma unroll
        for (int h = 0; h < V; ++h) {
            in[h].raw = make_uint4(0u, 0u, 0u, 0u);
            if (has) in[h] = load16(x + row * K + col + h * N);
        }
        float v[16];
        float amax = 0.0f;
        bool bad = false;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            v[j] = to_f32(in[j / N].v[j % N]);
            bad |= !isfinite(v[j]);
            amax = fmaxf(amax, fabsf(v[j]));
        }
        bool flag;
        amax = fp8_group_max(amax, bad, tpb, flag);
        u32 byte;
        const float s = fp8_block_scale(amax, ue8m0, byte);
        if (has) {
            *reinterpret_cast<uint4*>(codes + row * K + col) = fp8_block_codes16(v, s, byte, ue8m0, flag);
            if (t == 0) fp8_store_scale(scales, row * s_row + b * s_blk, s, byte, flag, sbyte);
        }
        b += step_blocks;
        row += step_rows;
        if (b >= nb) {
            b -= nb;
            ++row;
        }
    }
}

}  // namespace rkv
