// packed16.cuh: 16-bit inputs (BF16 / FP16) kept packed, two per 32-bit word,
// and quantized to NVFP4 from there. Chunks of 16 elements are one NVFP4
// block: the max |x| of a block is taken on the packed bits (two halves per
// instruction) and the elements are widened to float32 once, for the
// quantizer. Bit for bit the same as widening first (rawkv/reference/nvfp4.py).
#pragma once
#include "nvfp4_common.cuh"

namespace rkv {

// ---- a 16-element chunk of 16-bit T, packed two per u32 word ---------------------
// Word i holds elements 2i (low half) and 2i+1 (high half): the memory layout,
// so a loaded chunk is kept as its raw bits and never converted twice.
template <typename T> struct Bits;
template <> struct Bits<__nv_bfloat16> { static constexpr u32 kInf = 0x7F80u; };   // |x| bits >= kInf: Inf/NaN
template <> struct Bits<__half> { static constexpr u32 kInf = 0x7C00u; };

template <typename T> __device__ __forceinline__ float bits_f32(u32 b);
template <> __device__ __forceinline__ float bits_f32<__nv_bfloat16>(u32 b) { return __uint_as_float(b << 16); }
template <> __device__ __forceinline__ float bits_f32<__half>(u32 b) { return __half2float(__ushort_as_half((unsigned short)b)); }

template <typename T> __device__ __forceinline__ void word_f32(u32 w, float& lo, float& hi);
template <> __device__ __forceinline__ void word_f32<__nv_bfloat16>(u32 w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
}
template <> __device__ __forceinline__ void word_f32<__half>(u32 w, float& lo, float& hi) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x;
    hi = f.y;
}

// Two floats rounded to T (RNE) in one word: one F2FP pack instruction.
template <typename T> __device__ __forceinline__ u32 f32_word(float lo, float hi);
template <> __device__ __forceinline__ u32 f32_word<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&p);
}
template <> __device__ __forceinline__ u32 f32_word<__half>(float lo, float hi) {
    const __half2 p = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&p);
}

template <typename T>
__device__ __forceinline__ void pack_chunk(u32 (&w)[8], const float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = f32_word<T>(v[2 * i], v[2 * i + 1]);
}

template <typename T>
__device__ __forceinline__ void unpack_chunk(const u32 (&w)[8], float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) word_f32<T>(w[i], v[2 * i], v[2 * i + 1]);
}

template <typename T>
__device__ __forceinline__ void load_chunk(const T* p, u32 (&w)[8]) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const uint4 b = *reinterpret_cast<const uint4*>(p + 8);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// Max |x| bits of a chunk, two halves per instruction (non-negative 16-bit
// floats order like their bits); >= Bits<T>::kInf when it holds an Inf/NaN.
__device__ __forceinline__ u32 chunk_absmax_bits(const u32 (&w)[8]) {
    u32 m = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = __vmaxu2(m, w[i] & 0x7FFF7FFFu);
    return max(m & 0xFFFFu, m >> 16);
}

// Max finite |x| bits of a chunk that holds an Inf/NaN (rare: a slow path).
template <typename T>
__device__ __forceinline__ u32 chunk_finite_absmax_bits(const u32 (&w)[8]) {
    u32 m = 0u;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const u32 u = (w[i >> 1] >> (16 * (i & 1))) & 0x7FFFu;
        if (u < Bits<T>::kInf) m = max(m, u);
    }
    return m;
}

// The same as a call: code that is short of registers (the mHC kernel)
// keeps the rare path out of its register allocation.
template <typename T>
__device__ __noinline__ u32 chunk_finite_absmax_bits_call(const u32 (&w)[8]) {
    return chunk_finite_absmax_bits<T>(w);
}

// NVFP4 of a packed chunk whose max |x| bits are bmax_bits: the code bytes
// into `packed`, the scale byte returned.
template <typename T>
__device__ __forceinline__ u8 quantize_chunk(const u32 (&w)[8], u32 bmax_bits, float gs, uint2& packed) {
    float v[16];
    unpack_chunk<T>(w, v);
    return nvfp4_quantize_block_max(v, bits_f32<T>(bmax_bits), bmax_bits >= Bits<T>::kInf, gs, packed);
}

}  // namespace rkv
