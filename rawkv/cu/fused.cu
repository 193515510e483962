// fused.cu: fused NVFP4 producers (docs/fused.md) and MoE input staging.
//
//   rkv_fused_rms<T, MIX>           [mHC mix +] RMSNorm + NVFP4 quantize
//   rkv_fused_swiglu<T, VEC>        SwiGLU de-interleave + silu*up + quantize
//   rkv_moe_stage<T, ID>            one-level NVFP4 + packed scales + top-k copy
//
// Row kernels: one CTA per row. Each thread owns up to REG chunks of 16
// elements (one NVFP4 block each: chunk c = tid + r * blockDim), held in
// registers in the input dtype T, so the input is read from memory once:
//   phase 0  load (and mix / de-interleave + silu*up), round to T
//   phase 1  (RMSNorm) float64 block sum of squares -> inv_rms; y = round_T(x*inv*w)
//   phase 2  (run-time `mode`) gs: row amax (MODE_ROW), amax of the tensor (MODE_AMAX: first of
//            two launches), the value MODE_AMAX left (MODE_TENSOR), or given
//   phase 3  quantize each chunk (nvfp4_quantize_block) and store 8 code
//            bytes + 1 scale byte
// Rows longer than REG * blockDim chunks (N > 32768 at 512 threads) recompute the extra
// chunks from global memory in each phase (a second read, from L2).
//
// Numerics follow rawkv/reference/fused.py operation by operation; the
// runtime compiles with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true.
#include "common.cuh"
#include "nvfp4_common.cuh"
using namespace rkv;

namespace {

constexpr int REG = 4;                  // register-held chunks per thread
constexpr int kMaxBlock = 512;          // threads per CTA at most (128 registers each)
constexpr int MODE_ROW = 0;             // gs per row, from the row amax
constexpr int MODE_AMAX = 1;            // tensor scope, launch 1: atomicMax of the amax
constexpr int MODE_TENSOR = 2;          // tensor scope, launch 2: quantize with it
constexpr int MODE_FIXED = 3;           // gs given (device pointer or value; 1 = one-level)
constexpr u32 kAmaxFlag = 0x80000000u;  // marks "gs word still holds the amax"

// ---- packing a 16-element chunk in T ------------------------------------------
template <typename T> struct Pack {
    static constexpr int W = 16 * (int)sizeof(T) / 4;   // u32 words per chunk
};

template <typename T> __device__ __forceinline__ u32 t_bits(T v);
template <> __device__ __forceinline__ u32 t_bits<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
template <> __device__ __forceinline__ u32 t_bits<__half>(__half v) { return __half_as_ushort(v); }

// Round 16 floats to T and pack them (element 0 in the low half of word 0).
template <typename T>
__device__ __forceinline__ void pack_chunk(u32 (&w)[Pack<T>::W], const float (&v)[16]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = __float_as_uint(v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            w[i] = t_bits<T>(from_f32<T>(v[2 * i])) | (t_bits<T>(from_f32<T>(v[2 * i + 1])) << 16);
    }
}

template <typename T> __device__ __forceinline__ float bits_f32(u32 b);
template <> __device__ __forceinline__ float bits_f32<__nv_bfloat16>(u32 b) { return __uint_as_float(b << 16); }
template <> __device__ __forceinline__ float bits_f32<__half>(u32 b) { return __half2float(__ushort_as_half((unsigned short)b)); }

template <typename T>
__device__ __forceinline__ void unpack_chunk(const u32 (&w)[Pack<T>::W], float (&v)[16]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[2 * i] = bits_f32<T>(w[i] & 0xFFFFu);
            v[2 * i + 1] = bits_f32<T>(w[i] >> 16);
        }
    }
}

template <typename T> __device__ __forceinline__ float round_t(float v) { return to_f32<T>(from_f32<T>(v)); }

// 8 consecutive T (16-byte aligned; 32 for float) -> float.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
    constexpr int N = Vec16<T>::N;
#pragma unroll
    for (int h = 0; h < 8 / N; ++h) {
        Vec16<T> a = load16(p + h * N);
#pragma unroll
        for (int j = 0; j < N; ++j) v[h * N + j] = to_f32(a.v[j]);
    }
}

// A value of a small per-row / per-column parameter of run-time dtype
// (0 = float32, 1 = bfloat16, 2 = float16).
__device__ __forceinline__ float load_kind(const void* p, i64 i, int kind) {
    if (kind == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    if (kind == 2) return __half2float(static_cast<const __half*>(p)[i]);
    return static_cast<const float*>(p)[i];
}

// 16 consecutive weights starting at element c*16 (16-byte aligned).
__device__ __forceinline__ void load_weights16(const void* w, int kind, i64 c, float (&v)[16]) {
    if (kind == 0) {
        const float* p = static_cast<const float*>(w) + c * 16;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            Vec16<float> a = load16(p + 4 * h);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[4 * h + j] = a.v[j];
        }
    } else if (kind == 1) {
        load8(static_cast<const __nv_bfloat16*>(w) + c * 16, v);
        load8(static_cast<const __nv_bfloat16*>(w) + c * 16 + 8, v + 8);
    } else {
        load8(static_cast<const __half*>(w) + c * 16, v);
        load8(static_cast<const __half*>(w) + c * 16 + 8, v + 8);
    }
}

// ---- deterministic float32 exp / silu (rawkv.reference.fused.exp_f32) ----------
__device__ __forceinline__ float exp_f32(float x) {
    const float xc = fminf(fmaxf(x, -104.0f), 89.0f);   // NaN -> -104, as np.fmax/np.fmin
    const float n = rintf(xc * __uint_as_float(0x3FB8AA3Bu));
    float r = xc - n * __uint_as_float(0x3F317200u);
    r = r - n * __uint_as_float(0x35BFBE8Eu);
    float p = __uint_as_float(0x39500D01u);
    p = p * r + __uint_as_float(0x3AB60B61u);
    p = p * r + __uint_as_float(0x3C088889u);
    p = p * r + __uint_as_float(0x3D2AAAABu);
    p = p * r + __uint_as_float(0x3E2AAAABu);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int ni = (int)n;
    const int n1 = ni / 2, n2 = ni - n1;
    return (p * __uint_as_float((u32)(n1 + 127) << 23)) * __uint_as_float((u32)(n2 + 127) << 23);
}

__device__ __forceinline__ float silu_f32(float a) { return a / (1.0f + exp_f32(-a)); }

// ---- block reductions (all threads get the result) ---------------------------
__device__ __forceinline__ double block_sum(double v, double* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();                               // sh may still be read from a previous use
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ float block_max(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// ---- producers: what one row chunk of 16 values is --------------------------
// load(c, v): the 16 values of chunk c before normalization, rounded to T.
// NORM producers also provide norm(c, v, inv): v = round_T((v * inv) * w).

template <typename T, bool MIX>
struct RmsProducer {
    static constexpr bool NORM = true;
    const T* x;        // row start: x + row*N (MIX: X + row*n_hc*N)
    const void* w;
    int w_kind;
    int n_hc;
    i64 n;             // row length N
    float a[4];

    __device__ __forceinline__ void load(i64 c, float (&v)[16]) const {
        if constexpr (!MIX) {
            load8(x + c * 16, v);
            load8(x + c * 16 + 8, v + 8);
        } else {
            float t[16];
            load8(x + c * 16, v);
            load8(x + c * 16 + 8, v + 8);
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = a[0] * v[i];
#pragma unroll
            for (int h = 1; h < 4; ++h) {
                if (h < n_hc) {
                    load8(x + h * n + c * 16, t);
                    load8(x + h * n + c * 16 + 8, t + 8);
#pragma unroll
                    for (int i = 0; i < 16; ++i) v[i] = v[i] + a[h] * t[i];
                }
            }
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = round_t<T>(v[i]);
        }
    }

    __device__ __forceinline__ void norm(i64 c, float (&v)[16], float inv) const {
        float wv[16];
        load_weights16(w, w_kind, c, wv);
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = round_t<T>((v[i] * inv) * wv[i]);
    }
};

template <typename T, bool VEC>
struct SwigluProducer {
    static constexpr bool NORM = false;
    const T* h;        // row start: h + row*2I
    u32 g;             // interleave granularity (the host checks 2I < 2^31)

    // Output element i is gate column (i / g) * 2g + i % g and the up column g
    // after it. One 32-bit division per chunk; then a counter walks the row.
    __device__ __forceinline__ void load(i64 c, float (&v)[16]) const {
        const u32 i0 = (u32)c * 16u;
        u32 grp = i0 / g, off = i0 - grp * g;
        if constexpr (VEC) {            // g % 8 == 0: each run of 8 outputs is contiguous
            float gt[8], up[8];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const u32 col = grp * 2u * g + off;
                load8(h + col, gt);
                load8(h + col + g, up);
#pragma unroll
                for (int j = 0; j < 8; ++j) v[k * 8 + j] = round_t<T>(silu_f32(gt[j]) * up[j]);
                off += 8u;
                if (off == g) { off = 0u; ++grp; }
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const u32 col = grp * 2u * g + off;
                v[j] = round_t<T>(silu_f32(to_f32(h[col])) * to_f32(h[col + g]));
                if (++off == g) { off = 0u; ++grp; }
            }
        }
    }

    __device__ __forceinline__ void norm(i64, float (&)[16], float) const {}
};

// ---- the row kernel body ---------------------------------------------------------
template <typename T, class P>
__device__ __forceinline__ void row_quantize(const P& p, const int mode, i64 row, i64 C, float eps, i64 n,
                                             u8* __restrict__ q, u8* __restrict__ sf,
                                             float* gs_out, float* __restrict__ inv_out,
                                             const float* gs_in, float gs_val) {
    __shared__ double sh_d[32];
    __shared__ float sh_f[32];
    __shared__ float sh_gs;
    const int tid = threadIdx.x;
    const i64 B = blockDim.x;
    u32 st[REG][Pack<T>::W];

    // phase 0: load
#pragma unroll
    for (int r = 0; r < REG; ++r) {
        const i64 c = tid + r * B;
        if (c < C) {
            float v[16];
            p.load(c, v);
            pack_chunk<T>(st[r], v);
        }
    }

    // phase 1: RMSNorm
    float inv = 1.0f;
    if constexpr (P::NORM) {
        double ss = 0.0;
#pragma unroll
        for (int r = 0; r < REG; ++r) {
            const i64 c = tid + r * B;
            if (c < C) {
                float v[16];
                unpack_chunk<T>(st[r], v);
#pragma unroll
                for (int i = 0; i < 16; ++i) ss += (double)v[i] * (double)v[i];
            }
        }
        for (i64 c = tid + REG * B; c < C; c += B) {
            float v[16];
            p.load(c, v);
#pragma unroll
            for (int i = 0; i < 16; ++i) ss += (double)v[i] * (double)v[i];
        }
        ss = block_sum(ss, sh_d);
        const float ms = (float)(ss / (double)n);
        inv = 1.0f / sqrtf(ms + eps);
#pragma unroll
        for (int r = 0; r < REG; ++r) {
            const i64 c = tid + r * B;
            if (c < C) {
                float v[16];
                unpack_chunk<T>(st[r], v);
                p.norm(c, v, inv);
                pack_chunk<T>(st[r], v);
            }
        }
    }

    // phase 2: the global scale
    float gs;
    if (mode == MODE_ROW || mode == MODE_AMAX) {
        float amax = 0.0f;
#pragma unroll
        for (int r = 0; r < REG; ++r) {
            const i64 c = tid + r * B;
            if (c < C) {
                float v[16];
                unpack_chunk<T>(st[r], v);
#pragma unroll
                for (int i = 0; i < 16; ++i) amax = fmaxf(amax, nvfp4_finite_abs(v[i]));
            }
        }
        for (i64 c = tid + REG * B; c < C; c += B) {
            float v[16];
            p.load(c, v);
            p.norm(c, v, inv);
#pragma unroll
            for (int i = 0; i < 16; ++i) amax = fmaxf(amax, nvfp4_finite_abs(v[i]));
        }
        amax = block_max(amax, sh_f);
        if (mode == MODE_AMAX) {
            if (tid == 0) atomicMax(reinterpret_cast<u32*>(gs_out), kAmaxFlag | __float_as_uint(amax));
            return;
        }
        gs = nvfp4_global_scale(amax);
    } else if (mode == MODE_TENSOR) {
        if (tid == 0) {
            u32* word = reinterpret_cast<u32*>(gs_out);
            const u32 w = atomicOr(word, 0u);             // coherent read
            float g;
            if (w & kAmaxFlag) {                          // still the amax: convert it once
                g = nvfp4_global_scale(__uint_as_float(w & ~kAmaxFlag));
                atomicCAS(word, w, __float_as_uint(g));   // the first CTA wins; same value anyway
            } else {
                g = __uint_as_float(w);
            }
            sh_gs = g;
        }
        __syncthreads();
        gs = sh_gs;
    } else {
        gs = gs_in != nullptr ? *gs_in : gs_val;
    }

    // phase 3: quantize and store
    u8* qrow = q + row * C * 8;
    u8* sfrow = sf + row * C;
#pragma unroll
    for (int r = 0; r < REG; ++r) {
        const i64 c = tid + r * B;
        if (c < C) {
            float v[16];
            unpack_chunk<T>(st[r], v);
            uint2 packed;
            const u8 s = nvfp4_quantize_block(v, gs, packed);
            *reinterpret_cast<uint2*>(qrow + c * 8) = packed;
            sfrow[c] = s;
        }
    }
    for (i64 c = tid + REG * B; c < C; c += B) {
        float v[16];
        p.load(c, v);
        p.norm(c, v, inv);
        uint2 packed;
        const u8 s = nvfp4_quantize_block(v, gs, packed);
        *reinterpret_cast<uint2*>(qrow + c * 8) = packed;
        sfrow[c] = s;
    }
    if (tid == 0) {
        if (mode == MODE_ROW) gs_out[row] = gs;
        if (mode == MODE_FIXED && row == 0) gs_out[0] = gs;
        if constexpr (P::NORM) { if (inv_out != nullptr) inv_out[row] = inv; }
    }
}

}  // namespace

// x: (M, N) or, with MIX, X: (M, n_hc, N); mix: (M, n_hc) of mix_kind; w: (N,) of w_kind.
// q (M, N/2), sf (M, N/16), gs_out (M,) for MODE_ROW else one float, inv_out (M,) or null.
// gs_in: a device float (MODE_FIXED) or null, then gs_val.
template <typename T, bool MIX>
__global__ void __launch_bounds__(kMaxBlock, 1) rkv_fused_rms(
        const T* __restrict__ x, const void* __restrict__ mix, long long mix_kind, long long n_hc,
        const void* __restrict__ w, long long w_kind, double eps, long long n,
        u8* __restrict__ q, u8* __restrict__ sf, float* gs_out, float* __restrict__ inv_out,
        const float* gs_in, double gs_val, long long mode) {
    const i64 row = blockIdx.x;
    RmsProducer<T, MIX> p;
    p.x = x + row * (MIX ? n_hc : 1) * n;
    p.w = w;
    p.w_kind = (int)w_kind;
    p.n_hc = (int)n_hc;
    p.n = n;
#pragma unroll
    for (int h = 0; h < 4; ++h)
        p.a[h] = (MIX && h < n_hc) ? load_kind(mix, row * n_hc + h, (int)mix_kind) : 0.0f;
    row_quantize<T>(p, (int)mode, row, n / 16, (float)eps, n, q, sf, gs_out, inv_out, gs_in, (float)gs_val);
}

// h: (M, 2I) with columns alternating g gate and g up; q (M, I/2), sf (M, I/16).
template <typename T, bool VEC>
__global__ void __launch_bounds__(kMaxBlock, 1) rkv_fused_swiglu(
        const T* __restrict__ h, long long inter, long long g,
        u8* __restrict__ q, u8* __restrict__ sf, float* gs_out,
        const float* gs_in, double gs_val, long long mode) {
    const i64 row = blockIdx.x;
    SwigluProducer<T, VEC> p;
    p.h = h + row * 2 * inter;
    p.g = (u32)g;
    row_quantize<T>(p, (int)mode, row, inter / 16, 0.0f, inter, q, sf, gs_out, nullptr, gs_in, (float)gs_val);
}

// MoE input staging, one launch: hidden (M, K) -> one-level NVFP4 codes
// (M, K/2) and UE4M3 scales packed four per int32 (M, K/64); top-k ids
// (M, k) of ID widened to int64; top-k weights copied as `w_bytes` bytes.
// Each thread handles 64 consecutive elements (4 blocks -> 32 code bytes and
// one scale word); K % 64 == 0 keeps units inside rows, so no row math.
template <typename T, typename ID>
__global__ void __launch_bounds__(256) rkv_moe_stage(
        const T* __restrict__ x, long long n_units, u8* __restrict__ q, u32* __restrict__ sf,
        const ID* __restrict__ ids, long long n_ids, long long* __restrict__ ids_out,
        const u8* __restrict__ wts, long long w_bytes, u8* __restrict__ wts_out) {
    for (i64 u = global_thread(); u < n_units; u += grid_threads()) {
        const T* src = x + u * 64;
        u32 scales = 0;
        uint2 codes[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            float v[16];
            load8(src + b * 16, v);
            load8(src + b * 16 + 8, v + 8);
            scales |= (u32)nvfp4_quantize_block(v, 1.0f, codes[b]) << (8 * b);
        }
        uint4* dst = reinterpret_cast<uint4*>(q + u * 32);
        dst[0] = make_uint4(codes[0].x, codes[0].y, codes[1].x, codes[1].y);
        dst[1] = make_uint4(codes[2].x, codes[2].y, codes[3].x, codes[3].y);
        sf[u] = scales;
    }
    for (i64 i = global_thread(); i < n_ids; i += grid_threads()) ids_out[i] = (long long)ids[i];
    for (i64 i = global_thread(); i < w_bytes; i += grid_threads()) wts_out[i] = wts[i];
}
