// nvfp4_common.cuh: NVFP4 block quantize / dequantize device functions
// (docs/format.md "NVFP4: tensors and layouts"). Include this from
// any kernel that produces or consumes NVFP4 (fused RMSNorm/SwiGLU+quantize,
// KV flush, ...): it is the single device-side definition of the encoding and
// matches rawkv/reference/nvfp4.py bit for bit when compiled with the runtime's
// options (--fmad=false --ftz=false --prec-div=true).
#pragma once
#include "common.cuh"

namespace rkv {

constexpr float kNvfp4GsDivisor = 2688.0f;   // 6 * 448
constexpr u8 kNvfp4ZeroBlockScale = 0x38;    // E4M3 1.0: an all-zero block's scale

// Step 1 (finishing part): the decode global scale from an amax over the
// scope's finite elements. A scale of 0 (amax == 0, or an amax so small,
// below 2688 * 2^-150, that the division underflows) becomes 1: a zero gs
// would turn the zero blocks' sf into NaN (0 / 0).
__device__ __forceinline__ float nvfp4_global_scale(float amax) {
    const float gs = amax / kNvfp4GsDivisor;
    return gs == 0.0f ? 1.0f : gs;
}

// Largest finite value of an input type (the bound of a given gs).
template <typename T> struct MaxFinite;
template <> struct MaxFinite<float> { static constexpr float value = 0x1.fffffep127f; };
template <> struct MaxFinite<__nv_bfloat16> { static constexpr float value = 0x1.fep127f; };
template <> struct MaxFinite<__half> { static constexpr float value = 65504.0f; };

// A caller-given decode global scale is usable when it is positive and the
// largest finite T input still gets a non-zero block scale before ModelOpt's
// clamp (the plain RNE cast of step 2's ratio, the same float32 operations,
// not nvfp4_block_scale): e4m3(max / (gs * 6)) != 0. False for 0, negatives,
// NaN, +-Inf and every gs at or above the bound of docs/format.md ("NVFP4: a
// given global scale"); rawkv/reference/nvfp4.py given_gs_ok is its twin.
// Kernels that take a device gs check it with this and never use a refused
// one: every block is flagged (0x7F, codes 0) before step 2, so no ModelOpt
// scale rule sees it (the host checks numbers and host arrays).
template <typename T>
__device__ __forceinline__ bool nvfp4_given_gs_ok(float gs) {
    return gs > 0.0f && e4m3_encode(MaxFinite<T>::value / (gs * 6.0f)) != 0;
}

// Step 2: the block-scale byte from r = bmax / (gs * 6), with NVIDIA
// ModelOpt's rule (nvidia-modelopt 0.47.0, qtensor/nvfp4_tensor.py:
// `per_block_scale[per_block_scale == 0] = 1.0`, then
// `clamp(min=2**-9, max=448).to(float8_e4m3fn)`): an all-zero block gets 1.0
// (0x38); a scale below the smallest E4M3 subnormal gets that subnormal
// (0x01) instead of rounding to 0 and losing the block. The compare is false
// for NaN, so a NaN r stays NaN (0x7F), which fmaxf would not keep.
__device__ __forceinline__ u8 nvfp4_block_scale(float r) {
    if (r == 0.0f) return kNvfp4ZeroBlockScale;
    return e4m3_encode(r < 0x1p-9f ? 0x1p-9f : r);
}

// Step 3's guard: codes are computed only for a positive finite es. With a
// usable gs (nvfp4_given_gs_ok, or one derived from an amax) es is 0 only
// when float(sf) * gs underflows (gs below 2^-140) and is never infinite or
// NaN; the guard keeps such an es from reaching e2m1(x / es) all the same.
__device__ __forceinline__ bool nvfp4_es_usable(float es) {
    return es > 0.0f && es <= 3.402823466e38f;   // false for NaN
}

// |x| if finite, else 0: the per-scope amax ignores NaN / Inf (step 1).
__device__ __forceinline__ float nvfp4_finite_abs(float x) {
    float a = fabsf(x);
    return a <= 3.402823466e38f ? a : 0.0f;   // false for NaN and Inf
}

// E2M1 magnitude index (0..7) of a = |v / es|, for a never NaN (Inf is fine).
// Same result as e2m1_encode's threshold compares, but on the FMA pipe: the
// magic number 2^23 rounds (ties to even) at each E2M1 step size, 0.5 on
// [0,2), 1 on [2,4), 2 above, with the segment's first index added as an
// even offset (so ties still go to the even code); rounding is monotonic, so
// the right segment's candidate is the smallest of the three, and 7
// saturates. Checked against the reference on every BF16 magnitude and a
// dense sweep of [0, 8) (tests compare the kernels bit for bit).
__device__ __forceinline__ u32 e2m1_index_fast(float a) {
    const float t0 = __fmaf_rn(a, 2.0f, 0x1p23f);
    const float t1 = __fadd_rn(a, 0x1p23f + 2.0f);
    const float t2 = __fmaf_rn(a, 0.5f, 0x1p23f + 4.0f);
    const float t = fminf(fminf(t0, t1), fminf(t2, 0x1p23f + 7.0f));
    return __float_as_uint(t) - 0x4B000000u;
}

// 4-bit code of a quotient: the E2M1 index of |q| and the sign bit iff the
// correctly rounded quotient is < 0 (ModelOpt's `sign_bit = weight < 0`):
// -0.0, and a negative x whose quotient underflows to -0, give code 0.
__device__ __forceinline__ u32 e2m1_code(float q, bool negative) {
    return e2m1_index_fast(fabsf(q)) | (negative ? 8u : 0u);
}

// Steps 2-5 for one block of 16 consecutive elements (nvfp4_quantize_block),
// or, from nvfp4_quantize_block_max, with the block's max magnitude `bmax`
// and "holds a NaN/Inf" flag `bad` computed by the caller (e.g. on packed
// 16-bit inputs, two elements per instruction).
//   v      : the 16 input values, already converted to float32 (element 0 first)
//   gs     : the float32 decode global scale of the block's scope (1 for
//            one-level NVFP4)
//   packed : out, the 8 code bytes as two u32 words, little endian: byte j
//            (bits 8j..8j+7 of packed.x for j<4, of packed.y for j>=4) holds
//            element 2j in its low nibble and element 2j+1 in its high nibble,
//            i.e. store `packed` as one uint2 at q + block*8.
//   return : the UE4M3 block-scale byte (0x7F when the block holds NaN/Inf;
//            its codes are then all 0).
// Order of float32 operations (do not change: it is what makes the kernels
// and the numpy reference agree):
//   bmax = max|v|;  sf = nvfp4_block_scale(bmax / (gs * 6));  es = float(sf) * gs;
//   code = es usable (positive, finite) ? e2m1(v / es) : 0, sign iff v / es < 0.
//
// Speed (quantize is instruction-bound, not memory-bound, with a plain IEEE
// division per element): the 16 quotients v / es share es, so one correctly
// rounded reciprocal y = RN(1/es) per block and Markstein's correction
//   q = RN(v*y); r = v - q*es (exact, by FMA); q' = RN(q + r*y)
// give exactly RN(v / es) in three instructions, provided nothing underflows
// or overflows. The guard keeps every quotient near the E2M1 thresholds far
// from both (es >= 2^-60, |v|*y < 2^100); other blocks (only possible with a
// caller-given gs) take the plain division. A tiny quotient may still be
// subnormal there, where Markstein is not exact, so the sign does not come
// from q: RN(v / es) < 0 exactly when v < -es * 2^-150 (2^-150 is the half
// way to the smallest subnormal, and its tie goes to 0), and v, a float,
// passes that bound exactly when it passes RZ(es * 2^-150); es * 2^-24 is
// exact (es >= 2^-60), so one rounding toward zero gives that bound.
__device__ __forceinline__ u8 nvfp4_quantize_block_max(const float (&v)[16], float bmax, bool bad, float gs,
                                                       uint2& packed) {
    if (bad) {                                   // step 5: flagged block, all codes 0
        packed = make_uint2(0u, 0u);
        return kE4M3NaN;
    }
    const u8 sf = nvfp4_block_scale(bmax / (gs * 6.0f));
    const float es = e4m3_decode(sf) * gs;
    if (!nvfp4_es_usable(es)) {                  // step 3: all codes 0
        packed = make_uint2(0u, 0u);
        return sf;
    }
    u32 w[2] = {0u, 0u};
    const float y = __frcp_rn(es);
    if (es >= 0x1p-60f && __fmul_rn(bmax, y) < 0x1p100f) {
        const float neg_bound = -__fmul_rz(__fmul_rn(es, 0x1p-24f), 0x1p-126f);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float q = markstein_quotient(v[i], es, y);
            w[i >> 3] |= e2m1_code(q, v[i] < neg_bound) << ((i & 7) * 4);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float q = v[i] / es;
            w[i >> 3] |= e2m1_code(q, q < 0.0f) << ((i & 7) * 4);
        }
    }
    packed = make_uint2(w[0], w[1]);
    return sf;
}

__device__ __forceinline__ u8 nvfp4_quantize_block(const float (&v)[16], float gs, uint2& packed) {
    // max of the magnitude bits: finite magnitudes order like their bits, and
    // anything >= kF32InfBits is an Inf or a NaN.
    u32 umax = 0u;
#pragma unroll
    for (int i = 0; i < 16; ++i) umax = max(umax, __float_as_uint(v[i]) & 0x7FFFFFFFu);
    return nvfp4_quantize_block_max(v, __uint_as_float(umax), umax >= kF32InfBits, gs, packed);
}

// Decode one block: out[i] = lut[code_i] * (float(sf) * gs), float32.
// `packed` as produced by nvfp4_quantize_block.
__device__ __forceinline__ void nvfp4_dequantize_block(uint2 packed, u8 sf, float gs, float (&out)[16]) {
    const float es = e4m3_decode(sf) * gs;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const u32 word = (i < 8) ? packed.x : packed.y;
        out[i] = e2m1_decode((word >> ((i & 7) * 4)) & 0xFu) * es;
    }
}

}  // namespace rkv
