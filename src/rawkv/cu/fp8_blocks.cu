// fp8_blocks.cu: FP8 block activations (rawkv.fp8.quantize_blocks /
// dequantize_blocks): E4M3 codes with one scale per row per BLOCK channels.
// The rule (rawkv/reference/fp8_blocks.py defines the bytes) is on the device
// once, in fp8_blocks.cuh, shared with the fused producers' FP8 outputs.
// UE8M0: the scale is rounded up to a power of two; SBYTE: it is stored as
// its E8M0 byte (else as float32; SBYTE needs UE8M0).
#include "fp8_blocks.cuh"
using namespace rkv;

// The loop and the rule are fp8_blocks.cuh's (shared with fused.cu's FP8
// producers); here the block and the scale format are template constants.
template <typename T, int BLOCK, bool UE8M0, bool SBYTE>
__global__ void rkv_fp8_quantize_blocks(const T* __restrict__ x, u8* __restrict__ codes,
                                        void* __restrict__ scales, i64 s_row, i64 s_blk, i64 rows, i64 K) {
    static_assert(UE8M0 || !SBYTE, "an E8M0 byte holds a power of two only");
    constexpr int TPB = BLOCK / 16;                  // lanes per (row, block) unit
    static_assert(TPB >= 1 && TPB <= 32 && (TPB & (TPB - 1)) == 0, "BLOCK / 16 must be a power of two <= 32");
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    fp8_quantize_rows<T>(x, codes, scales, s_row, s_blk, rows, K, BLOCK, UE8M0, SBYTE);
}

// Dequantize: one thread per 8 codes (K % 16 == 0: a unit never crosses a
// row or a block); out = FP32(decode(code) * scale), rounded to OutT, stored
// 16 bytes at a time (out 16-byte aligned). Scale (row, b) at row * s_row +
// b * s_blk. A thread steps its unit's (row, column) by the grid's units per
// iteration (an add and a compare, no 64-bit division: fp8_quantize_rows).
// K > 0 (rawkv.fp8 launches only then); blk a power of two (the block is
// found by a shift).
template <typename OutT, bool UE8M0>
__global__ void rkv_fp8_dequantize_blocks(const u8* __restrict__ codes, const void* __restrict__ scales,
                                          i64 s_row, i64 s_blk, OutT* __restrict__ out, i64 rows, i64 K, int blk) {
    const i64 upr = K / 8;
    const i64 units = rows * upr;
    const i64 step = grid_threads(), step_rows = step / upr, step_units = step - step_rows * upr;
    const i64 first = global_thread();
    const int blk_shift = __ffs(blk) - 1;                 // (blk: 32, 64 or 128, rawkv.fp8.BLOCKS)
    i64 row = first / upr, c = first - row * upr;        // c: the unit within its row
    for (i64 u = first; u < units; u += step) {
        const i64 col = c * 8;
        const i64 si = row * s_row + (col >> blk_shift) * s_blk;
        float s;
        if (UE8M0) {
            s = ue8m0_value(static_cast<const u8*>(scales)[si]);
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
        c += step_units;
        row += step_rows;
        if (c >= upr) {
            c -= upr;
            ++row;
        }
    }
}
