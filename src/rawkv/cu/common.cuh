// common.cuh: element formats and vector access shared by every rawkv kernel.
//
// docs/format.md is the contract; rawkv/reference/formats.py is its numpy
// twin. Everything here must give the same bits as that reference, which is
// why the runtime compiles with --fmad=false --ftz=false --prec-div=true.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace rkv {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr float kE4M3Max = 448.0f;
constexpr u8 kE4M3NaN = 0x7F;
// +Inf's float32 bits: a magnitude's bits at or above it are an Inf or a NaN
// (finite magnitudes order like their bits).
constexpr u32 kF32InfBits = 0x7F800000u;

__device__ __forceinline__ float f32_qnan() { return __int_as_float(0x7FC00000); }

// ---- E4M3 ------------------------------------------------------------------
// RNE, satfinite (+-Inf and |x| > 448 -> +-448), subnormals kept, NaN -> 0x7F.
// The clamp is exact for every non-NaN input (anything past 448 saturates
// anyway) and makes Inf handling independent of the conversion path.
__device__ __forceinline__ u8 e4m3_encode(float x) {
    if (isnan(x)) return kE4M3NaN;
    x = fminf(fmaxf(x, -kE4M3Max), kE4M3Max);
    return (u8)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// docs/format.md: the FP32 decode scale of a per-entry FP8 vector from its finite
// amax. A scale of 0 (amax == 0, or amax below 448 * 2^-150, where the
// division underflows) becomes 1: x / 0 would give NaN codes for zeros.
__device__ __forceinline__ float fp8_entry_scale(float amax) {
    const float s = amax / kE4M3Max;
    return s == 0.0f ? 1.0f : s;
}

// Every E4M3 value is exact in FP16, so the decode goes through it losslessly.
__device__ __forceinline__ float e4m3_decode(u8 b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

// ---- UE8M0 -----------------------------------------------------------------
// The value of an E8M0 scale byte: 2^(e - 127), NaN for 0xFF; 0 is 2^-127,
// an FP32 subnormal, exactly (rawkv/reference/fp8_blocks.py, ue8m0_value).
// (Bytes 0 and 0xFF are the two whose (e + 1) & 0xFE is 0: each takes
// mantissa bit 22, 2^-127 from 0 and a quiet NaN from 0xFF's Inf; no
// constant held in a register.)
__device__ __forceinline__ float ue8m0_value(u32 e) {
    return __uint_as_float((e << 23) | (((e + 1u) & 0xFEu) == 0u ? 0x00400000u : 0u));
}

// RN(a / s) from y = RN(1 / s) by Markstein's correction: q = RN(a * y),
// r = a - q * s (exact, one FMA), RN(q + r * y). It is the division's
// result whenever q, s and y are normal and r is exact; each caller says why
// its operands are (or takes the division where they may not be). Three
// instructions per quotient after one reciprocal per divisor.
__device__ __forceinline__ float markstein_quotient(float a, float s, float y) {
    const float q = __fmul_rn(a, y);
    return __fmaf_rn(__fmaf_rn(-q, s, a), y, q);
}

// ---- E2M1 ------------------------------------------------------------------
// RNE with saturation at 6; alternating strict/non-strict thresholds send the
// ties 0.25, 1.25, 2.5, 5 down and 0.75, 1.75, 3.5 up: always to the even code.
__device__ __forceinline__ u32 e2m1_encode(float v) {
    float a = fabsf(v);
    u32 idx = (u32)(a > 0.25f) + (u32)(a >= 0.75f) + (u32)(a > 1.25f) + (u32)(a >= 1.75f)
            + (u32)(a > 2.5f) + (u32)(a >= 3.5f) + (u32)(a > 5.0f);
    return idx | (signbit(v) ? 8u : 0u);
}

// Twice the E2M1 magnitudes {0,1,2,3,4,6,8,12}, one per byte: a shift instead
// of a table in local memory.
constexpr u64 kE2M1Twice = 0x0C08060403020100ull;

__device__ __forceinline__ float e2m1_decode(u32 code) {
    float mag = (float)((kE2M1Twice >> ((code & 7u) * 8u)) & 0xFFu) * 0.5f;
    return (code & 8u) ? -mag : mag;
}

// ---- element I/O -------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// A 16-byte vector of T, loaded and stored as one uint4.
template <typename T>
struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
    union { uint4 raw; T v[N]; };
};

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {
    Vec16<T> r; r.raw = *reinterpret_cast<const uint4*>(p); return r;
}

template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec16<T>& r) {
    *reinterpret_cast<uint4*>(p) = r.raw;
}

// A compile-time flag passed by value, for a generic lambda to branch on
// with `if constexpr` (NVRTC has no <type_traits>).
template <bool B> struct Flag { static constexpr bool value = B; };

// Programmatic dependent launch (sm_90+; docs/runtime.md): the GEMM kernels
// may be launched so that they start while the kernel before them in the
// stream finishes. pdl_wait() returns once that kernel has completed and its
// writes are visible: before it a kernel reads only its weights (constants
// of the call, never written by a kernel that lets its dependents start
// early); after it, everything else. pdl_launch_dependents() lets the next
// kernel start. Both are no-ops in a launch without the attribute, and on
// older architectures.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A producer's start (the kernels that write a GEMM's activations, declared
// `pdl`): it waits for the kernel before it, whose output it reads, then lets
// the next kernel start, so that a GEMM after it streams its weights while
// this one runs. After the wait, not before: the GEMM reads its weights
// before its own wait, and the kernel two back has completed by then, so a
// kernel that wrote those weights there is ordered as with plain launches.
__device__ __forceinline__ void pdl_producer_start() {
    pdl_wait();
    pdl_launch_dependents();
}

// Grid-stride loop helpers (64-bit indices: tensors past 2^31 elements exist).
__device__ __forceinline__ i64 global_thread() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * blockDim.x; }

}  // namespace rkv
