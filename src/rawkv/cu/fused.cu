// fused.cu: fused NVFP4 producers (docs/fused.md) and MoE input staging.
//
//   rkv_fused_rms<T, MIX, REG>      [mHC mix +] RMSNorm + NVFP4 quantize
//   rkv_fused_swiglu<T, VEC, REG>   SwiGLU de-interleave + silu*up + quantize
//   rkv_moe_stage<T, ID>            one-level NVFP4 + packed scales + top-k copy
//   rkv_fused_set_gs                gs of an op with no rows (scopes tensor / given / none)
//   rkv_fused_rms_fp8<T, REG>, rkv_fused_swiglu_fp8<T, VEC, REG>, rkv_moe_stage_fp8<T, ID>
//                                   the same with an FP8 block output (fp8_blocks.cuh's rule on the
//                                   T-rounded y: DeepSeek's act_quant of the unfused BF16 output)
//
// Row kernels: one CTA per row. Each thread owns up to REG chunks of 16
// elements (one NVFP4 block each: chunk c = tid + r * blockDim), held in
// registers as packed T (two per word), so the input is read from memory once:
//   phase 0  load (raw bits; or mix / de-interleave + silu*up, rounded to T)
//   phase 1  (RMSNorm) float64 sum of squares -> inv_rms; y = round_T(x*inv*w)
//            each chunk's max |y| from the packed bits (two halves per instruction)
//   phase 2  (run-time `mode`) gs: row amax (MODE_ROW), amax of the tensor (MODE_AMAX: first of
//            two launches), the value MODE_AMAX left (MODE_TENSOR), or given (MODE_FIXED:
//            checked by nvfp4_given_gs_ok<T>; a refused one flags every block, is counted)
//   phase 3  quantize each chunk (nvfp4_quantize_block_max) and store 8 code
//            bytes + 1 scale byte
// REG = 2: a 224-thread CTA per row (N = 7168) of at most 64 registers per
// thread, 4 CTAs per SM. Rows longer than REG * blockDim chunks (N > 24576 at 768 threads)
// recompute the extra chunks from global memory in each phase (a second
// read, from L2).
//
// Numerics follow rawkv/reference/fused.py operation by operation; the
// runtime compiles with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true.

// The constants fused.cu shares with the host are written once, in
// rawkv/kernels/fused.py, and reach this file as -D options.
#if !defined(RKV_FUSED_MODE_ROW) || !defined(RKV_FUSED_MODE_AMAX) || !defined(RKV_FUSED_MODE_TENSOR) || \
    !defined(RKV_FUSED_MODE_FIXED) || !defined(RKV_FUSED_KIND_F32) || !defined(RKV_FUSED_KIND_BF16) || \
    !defined(RKV_FUSED_KIND_F16) || !defined(RKV_FUSED_MAX_HC) || !defined(RKV_FUSED_MAX_THREADS) || \
    !defined(RKV_FUSED_MAX_THREADS_SM100) || !defined(RKV_FUSED_MOE_BLOCK)
#error "fused.cu: a shared constant is missing; compile it through rawkv (rawkv.kernels.fused passes them as -D options)"
#endif

#include "packed16.cuh"
#include "fp8_blocks.cuh"
using namespace rkv;

namespace {

// REG (template): register-held chunks per thread. A row CTA has at most
// kMaxThreads / REG threads (the host launches at most
// rawkv.kernels.fused.MAX_BLOCK on every arch, within it). The registers per
// thread are capped by __maxnreg__ (NVRTC 12.4 or newer; it cannot be
// combined with __launch_bounds__), below what that many threads allow:
// * below sm_100, 56 (kRowRegs): at N = 7,168 a CTA of 224 threads then
//   leaves room for five CTAs per SM, not four at 64 (H200, 16,384 rows:
//   rmsnorm_quantize 184.0 -> 170.1 us, rmsnorm_quantize_fp8 154.2 -> 140.7;
//   docs/fused.md, "Row kernels: five CTAs per SM"); the instances that
//   spill in 56 keep 64 (kRowRegsWide: the mHC FP8 producer, the NVFP4
//   SwiGLU, and kRmsRegs' cases);
// * sm_100 / sm_120 code needs about 80 (ptxas spills in 64): both caps 80.
// The mHC kernel fits only with its rare Inf/NaN path as a call
// (CALL_SLOW_PATH).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kMaxThreads = RKV_FUSED_MAX_THREADS_SM100;
constexpr int kRowRegs = 80, kRowRegsWide = 80;
#else
constexpr int kMaxThreads = RKV_FUSED_MAX_THREADS;
constexpr int kRowRegs = 56, kRowRegsWide = 64;
#endif
static_assert(kRowRegsWide * (kMaxThreads / 2) <= 65536, "a CTA of the largest block fits an SM at REG = 2");
// The RMSNorm NVFP4 producer takes 56 on BF16 input only: on FP16 input it
// spills in 56 (32 bytes), and the mHC form measured 3% slower in 56 than
// in 64 (H200, 4,096 x 4 x 7,168: 101.0 -> 103.9 us).
template <typename T, bool MIX> constexpr int kRmsRegs = kRowRegsWide;
template <> constexpr int kRmsRegs<__nv_bfloat16, false> = kRowRegs;
constexpr int MODE_ROW = RKV_FUSED_MODE_ROW;        // gs per row, from the row amax
constexpr int MODE_AMAX = RKV_FUSED_MODE_AMAX;      // tensor scope, launch 1: atomicMax of the amax
constexpr int MODE_TENSOR = RKV_FUSED_MODE_TENSOR;  // tensor scope, launch 2: quantize with it
constexpr int MODE_FIXED = RKV_FUSED_MODE_FIXED;    // gs given (device pointer or value; 1 = one-level)
constexpr u32 kAmaxFlag = 0x80000000u;  // marks "gs word still holds the amax"

template <typename T> __device__ __forceinline__ float round_t(float v) { return to_f32<T>(from_f32<T>(v)); }

// 8 consecutive T (16-byte aligned) -> float.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    word_f32<T>(a.x, v[0], v[1]);
    word_f32<T>(a.y, v[2], v[3]);
    word_f32<T>(a.z, v[4], v[5]);
    word_f32<T>(a.w, v[6], v[7]);
}

// A value of a small per-row / per-column parameter of run-time dtype
// (RKV_FUSED_KIND_F32 / _BF16 / _F16).
__device__ __forceinline__ float load_kind(const void* p, i64 i, int kind) {
    if (kind == RKV_FUSED_KIND_BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    if (kind == RKV_FUSED_KIND_F16) return __half2float(static_cast<const __half*>(p)[i]);
    return static_cast<const float*>(p)[i];
}

// 16 consecutive weights starting at element c*16 (16-byte aligned).
__device__ __forceinline__ void load_weights16(const void* w, int kind, i64 c, float (&v)[16]) {
    if (kind == RKV_FUSED_KIND_F32) {
        const float* p = static_cast<const float*>(w) + c * 16;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            Vec16<float> a = load16(p + 4 * h);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[4 * h + j] = a.v[j];
        }
    } else if (kind == RKV_FUSED_KIND_BF16) {
        load8(static_cast<const __nv_bfloat16*>(w) + c * 16, v);
        load8(static_cast<const __nv_bfloat16*>(w) + c * 16 + 8, v + 8);
    } else {
        load8(static_cast<const __half*>(w) + c * 16, v);
        load8(static_cast<const __half*>(w) + c * 16 + 8, v + 8);
    }
}

// ---- deterministic float32 exp / silu (rawkv.reference.fused.exp_f32) ----------
// t = n + 1.5 * 2^23 (its bits 0x4B400000 + n) and p = e^r, r = x - n ln 2:
// exp_f32(x) = p * 2^n, the reference's steps.
__device__ __forceinline__ float exp_f32_poly(float xc, float& t_out) {
    // rint by the magic number 1.5 * 2^23 (RNE, exact for |y| < 2^22; here
    // |y| <= 151) of the exact product (one fma), and the integer read off
    // its bits: no conversion-pipe ops. Every multiply-add below is one fma
    // (explicit: the module is compiled with --fmad=false), as the reference's
    // fma_f32: nine instructions fewer than rounding each step apart.
    const float t = __fmaf_rn(xc, __uint_as_float(0x3FB8AA3Bu), 0x1.8p23f);
    t_out = t;
    const float n = __fsub_rn(t, 0x1.8p23f);
    float r = __fmaf_rn(-n, __uint_as_float(0x3F317200u), xc);
    r = __fmaf_rn(-n, __uint_as_float(0x35BFBE8Eu), r);
    float p = __uint_as_float(0x39500D01u);
    p = __fmaf_rn(p, r, __uint_as_float(0x3AB60B61u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3C088889u));
    p = __fmaf_rn(p, r, __uint_as_float(0x3D2AAAABu));
    p = __fmaf_rn(p, r, __uint_as_float(0x3E2AAAABu));
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    return p;
}

__device__ __forceinline__ float exp_f32(float x) {
    const float xc = fminf(fmaxf(x, -104.0f), 89.0f);   // NaN -> -104, as np.fmax/np.fmin
    float t;
    const float p = exp_f32_poly(xc, t);
    const int ni = (int)(__float_as_uint(t) - 0x4B400000u);
    // Any split n1 + n2 = ni gives the reference's bits: p * 2^n1 is exact
    // (|n1| <= 76) and the second product rounds once, as p * 2^ni would.
    const int n1 = ni >> 1, n2 = ni - n1;
    return (p * __uint_as_float((u32)(n1 + 127) << 23)) * __uint_as_float((u32)(n2 + 127) << 23);
}

// 1 + exp_f32(x) for |x| <= 87 (what silu_f32_n's fast path takes), in 8
// instructions fewer than the two steps: there n is within [-126, 126], so
// 2^n is a normal float32, built from t's bits in one shift-add ((n + 127)
// << 23 = (bits(t) << 23) + (127 << 23) mod 2^32), and p * 2^n is exact (or,
// below 2^-126, far under half an ulp of 1), so one fma p * 2^n + 1 rounds
// as 1 + exp_f32(x) does (exp_f32 splits its scaling for the n below -126
// its clamp lets in); the clamp is the identity there (a NaN gives NaN,
// whose quotient is NaN either way). The same bits for every such x
// (tests/fused/test_silu_quotient.py).
__device__ __forceinline__ float one_plus_exp_f32_normal(float x) {
    float t;
    const float p = exp_f32_poly(x, t);
    return __fmaf_rn(p, __uint_as_float((__float_as_uint(t) << 23) + 0x3F800000u), 1.0f);
}

// silu(a) = a / (1 + exp_f32(-a)) (rawkv.reference.fused.silu) of N values
// at once, with no check and branch per value. Compiled per value, an IEEE
// quotient is a check (FCHK) and a branch to its slow path around the fast
// sequence, so ptxas schedules the N exps and quotients one after another
// and the kernel's code holds N copies of the branch. Here:
// * silu_quotient: the quotient by the division's fast sequence (y ~ 1/d by
//   MUFU.RCP, one Newton step, q = a y, the remainder r = d q - a exact in
//   one fma, q - y r), r taken with that sign so that a = -0 gives -0. On
//   the GPU it is the IEEE quotient a / (1 + exp_f32(-a)) for every float32
//   a but +Inf (NaN for Inf) and a below about -87.3 (d > 2^126: y flushes
//   to 0), NaN for NaN (tests/fused/test_silu_quotient.py: every pattern);
// * one range test for the N values, the max of their |a|, sends a group
//   holding an |a| > 87 (a < -87, an Inf, or a rare a > 87, whose quotient
//   the division gives the same) through the division (a loop: N divisions
//   inline lengthened the kernel's code and slowed it; docs/fused.md).
__device__ __forceinline__ float silu_quotient(float a, float d) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
    y = __fmaf_rn(y, __fmaf_rn(-d, y, 1.0f), y);
    const float q = __fmul_rn(a, y);
    return __fmaf_rn(-y, __fmaf_rn(d, q, -a), q);
}

// The range test's bound on |a|: one max of |a| (FMNMX takes |x| as an
// operand) is half the instructions of a min and a max.
constexpr float kSiluQuotientMax = 87.0f;

template <int N>
__device__ __forceinline__ void silu_f32_n(float (&v)[N]) {
    float m = fabsf(v[0]);
#pragma unroll
    for (int j = 1; j < N; ++j) m = fmaxf(m, fabsf(v[j]));   // (NaN ignored: its quotient is NaN)
    if (m > kSiluQuotientMax) {
#pragma unroll 1
        for (int i = 0; i < N; ++i) {   // (the values shift through one division)
            const float q = __fdiv_rn(v[0], __fadd_rn(1.0f, exp_f32(-v[0])));
#pragma unroll
            for (int j = 0; j + 1 < N; ++j) v[j] = v[j + 1];
            v[N - 1] = q;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = silu_quotient(v[j], one_plus_exp_f32_normal(-v[j]));
    }
}

// One run of 8 SwiGLU outputs: silu(gate) * up, each rounded once in float32
// (the reference's order), into v[0..7]. The gate values are overwritten.
__device__ __forceinline__ void silu_times_up(float (&gt)[8], const float (&up)[8], float* v) {
    silu_f32_n(gt);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = gt[j] * up[j];
}

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
// load(c, w): chunk c before normalization, rounded to T and packed.
// NORM producers also provide norm(c, w, inv): w = round_T((x * inv) * weight).

template <typename T, bool MIX>
struct RmsProducer {
    static constexpr bool NORM = true;
    static constexpr bool CALL_SLOW_PATH = MIX;   // mHC: 64 registers only this way
    const T* x;        // row start: x + row*N (MIX: X + row*n_hc*N)
    const void* w;
    int w_kind;
    int n_hc;
    i64 n;             // row length N
    float a[RKV_FUSED_MAX_HC];

    __device__ __forceinline__ void load(i64 c, u32 (&w)[8]) const {
        if constexpr (!MIX) {
            load_chunk(x + c * 16, w);             // raw bits: already T
        } else {
            float v[16], t[16];
            load8(x + c * 16, v);
            load8(x + c * 16 + 8, v + 8);
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = a[0] * v[i];
#pragma unroll
            for (int h = 1; h < RKV_FUSED_MAX_HC; ++h) {
                if (h < n_hc) {
                    load8(x + h * n + c * 16, t);
                    load8(x + h * n + c * 16 + 8, t + 8);
#pragma unroll
                    for (int i = 0; i < 16; ++i) v[i] = v[i] + a[h] * t[i];
                }
            }
            pack_chunk<T>(w, v);
        }
    }

    __device__ __forceinline__ void norm(i64 c, u32 (&w)[8], float inv) const {
        float v[16], wv[16];
        unpack_chunk<T>(w, v);
        load_weights16(this->w, w_kind, c, wv);
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = (v[i] * inv) * wv[i];
        pack_chunk<T>(w, v);
    }
};

template <typename T, bool VEC>
struct SwigluProducer {
    static constexpr bool NORM = false;
    static constexpr bool CALL_SLOW_PATH = false;
    const T* h;        // row start: h + row*2I
    u32 g;             // interleave granularity (the host checks 2I < 2^31)

    // Output element i is gate column (i / g) * 2g + i % g and the up column g
    // after it. One 32-bit division per chunk; then a counter walks the row.
    __device__ __forceinline__ void load(i64 c, u32 (&w)[8]) const {
        const u32 i0 = (u32)c * 16u;
        u32 grp = i0 / g, off = i0 - grp * g;
        float v[16];
        if constexpr (VEC) {            // g % 8 == 0: each run of 8 outputs is contiguous
            float gt[8], up[8];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const u32 col = grp * 2u * g + off;
                load8(h + col, gt);
                load8(h + col + g, up);
                silu_times_up(gt, up, v + k * 8);
                off += 8u;
                if (off == g) { off = 0u; ++grp; }
            }
        } else {
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                float gt[8], up[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 col = grp * 2u * g + off;
                    gt[j] = to_f32(h[col]);
                    up[j] = to_f32(h[col + g]);
                    if (++off == g) { off = 0u; ++grp; }
                }
                silu_times_up(gt, up, v + k * 8);
            }
        }
        pack_chunk<T>(w, v);
    }

    __device__ __forceinline__ void norm(i64, u32 (&)[8], float) const {}
};

// ---- the row kernel body ---------------------------------------------------------
// A chunk's max |y| bits and whether it holds an Inf/NaN; `fin`: its max
// finite |y| bits (what the row amax takes).
template <typename T, bool CALL = false>
__device__ __forceinline__ u32 chunk_max(const u32 (&w)[8], u32& fin) {
    const u32 m = chunk_absmax_bits(w);
    if (m < Bits<T>::kInf) fin = m;
    else fin = CALL ? chunk_finite_absmax_bits_call<T>(w) : chunk_finite_absmax_bits<T>(w);
    return m;
}

template <typename T>
__device__ __forceinline__ void quantize_store(const u32 (&w)[8], u32 bmax_bits, float gs, u8* q, u8* sf) {
    uint2 packed;
    *sf = quantize_chunk<T>(w, bmax_bits, gs, packed);
    *reinterpret_cast<uint2*>(q) = packed;
}

// Phase 1 of a NORM producer: the row's inv_rms from its register-held
// chunks `st` and the chunks past them (loaded again); 1 for the others.
// Each square is exact in float64, so fma == mul + add.
template <typename T, int REG, class P>
__device__ __forceinline__ float row_inv_rms(const P& p, const u32 (&st)[REG][8], i64 C, float eps, i64 n) {
    __shared__ double sh_d[32];
    if constexpr (!P::NORM) {
        return 1.0f;
    } else {
        const int tid = threadIdx.x;
        const i64 B = blockDim.x;
        // Two chains (the low and the high halves of each word), added at
        // the end: half the dependent DFMA latency of one chain (a fixed
        // order all the same).
        double sl = 0.0, sh = 0.0;
#pragma unroll
        for (int r = 0; r < REG; ++r) {
            const i64 c = tid + r * B;
            if (c < C) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float lo, hi;
                    word_f32<T>(st[r][i], lo, hi);
                    sl = __fma_rn((double)lo, (double)lo, sl);
                    sh = __fma_rn((double)hi, (double)hi, sh);
                }
            }
        }
        for (i64 c = tid + REG * B; c < C; c += B) {
            u32 w[8];
            p.load(c, w);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float lo, hi;
                word_f32<T>(w[i], lo, hi);
                sl = __fma_rn((double)lo, (double)lo, sl);
                sh = __fma_rn((double)hi, (double)hi, sh);
            }
        }
        const double ss = block_sum(__dadd_rn(sl, sh), sh_d);
        const float ms = (float)(ss / (double)n);
        return 1.0f / sqrtf(ms + eps);
    }
}

// Phase 0: this thread's register-held chunks of the row p points at.
template <int REG, class P>
__device__ __forceinline__ void load_row(const P& p, i64 C, u32 (&st)[REG][8]) {
#pragma unroll
    for (int r = 0; r < REG; ++r) {
        const i64 c = threadIdx.x + r * (i64)blockDim.x;
        if (c < C) p.load(c, st[r]);
    }
}

// Phases 1-3 of one row whose register-held chunks `st` are loaded.
template <typename T, int REG, class P>
__device__ __forceinline__ void row_quantize(const P& p, u32 (&st)[REG][8], const int mode, i64 row, i64 C,
                                             float eps, i64 n, u8* __restrict__ q, u8* __restrict__ sf,
                                             float* gs_out, float* __restrict__ inv_out,
                                             const float* gs_in, float gs_val, int* errors) {
    __shared__ float sh_f[32];
    __shared__ float sh_gs;
    const int tid = threadIdx.x;
    const i64 B = blockDim.x;
    u32 bm[REG];         // the chunks' max |y| bits
    u32 fin = 0u;        // max finite |y| bits over this thread's chunks

    // phase 1: RMSNorm
    const float inv = row_inv_rms<T, REG>(p, st, C, eps, n);

    // y and its block maxima (the register-held chunks)
#pragma unroll
    for (int r = 0; r < REG; ++r) {
        const i64 c = tid + r * B;
        if (c < C) {
            if constexpr (P::NORM) p.norm(c, st[r], inv);
            u32 f;
            bm[r] = chunk_max<T, P::CALL_SLOW_PATH>(st[r], f);
            fin = max(fin, f);
        }
    }

    // phase 2: the global scale
    float gs;
    if (mode == MODE_ROW || mode == MODE_AMAX) {
        for (i64 c = tid + REG * B; c < C; c += B) {     // chunks past the registers
            u32 w[8], f;
            p.load(c, w);
            p.norm(c, w, inv);
            chunk_max<T, P::CALL_SLOW_PATH>(w, f);
            fin = max(fin, f);
        }
        const float amax = block_max(bits_f32<T>(fin), sh_f);
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
        // A given gs (a device one: the host refuses bad numbers) that
        // nvfp4_given_gs_ok refuses is never used: the output gs keeps the
        // given value, the call is counted once, and gs becomes NaN, which
        // nvfp4_quantize_block_max turns into the flag for every block
        // (sf = e4m3(NaN) = 0x7F; es = NaN is not usable, so codes 0): the
        // reference's flagged result, with no extra register in phase 3.
        gs = gs_in != nullptr ? *gs_in : gs_val;
        const bool ok = nvfp4_given_gs_ok<T>(gs);
        if (tid == 0 && row == 0) {
            gs_out[0] = gs;
            if (!ok && errors != nullptr) atomicAdd(errors, 1);
        }
        if (!ok) gs = f32_qnan();
    }

    // phase 3: quantize and store
    u8* qrow = q + row * C * 8;
    u8* sfrow = sf + row * C;
#pragma unroll
    for (int r = 0; r < REG; ++r) {
        const i64 c = tid + r * B;
        if (c < C) quantize_store<T>(st[r], bm[r], gs, qrow + c * 8, sfrow + c);
    }
    for (i64 c = tid + REG * B; c < C; c += B) {
        u32 w[8], f;
        p.load(c, w);
        p.norm(c, w, inv);
        quantize_store<T>(w, chunk_max<T, P::CALL_SLOW_PATH>(w, f), gs, qrow + c * 8, sfrow + c);
    }
    if (tid == 0) {
        if (mode == MODE_ROW) gs_out[row] = gs;
        if constexpr (P::NORM) { if (inv_out != nullptr) inv_out[row] = inv; }
    }
}

// ---- FP8 block outputs -------------------------------------------------------------
// One chunk of the T-rounded y (packed `w`; `has`: the thread holds chunk c
// of the row) into E4M3 codes, by fp8_blocks.cuh's rule. A block of `lanes`
// chunks (block / 16) is held by as many consecutive threads, the same r of
// each (blockDim is a multiple of 32, so c / lanes is the same block for
// them): they reduce its amax with shuffles, so every thread of the warp
// calls this, with or without a chunk. The block's first thread writes the
// scale (index srow + (c / lanes) * s_blk).
template <typename T>
__device__ __forceinline__ void fp8_chunk(const u32 (&w)[8], bool has, i64 c, int lanes, u8* __restrict__ crow,
                                          void* __restrict__ scales, i64 srow, i64 s_blk, bool ue8m0, bool sbyte) {
    const u32 m = has ? chunk_absmax_bits(w) : 0u;
    bool flag;
    const float amax = fp8_group_max(bits_f32<T>(m), m >= Bits<T>::kInf, lanes, flag);
    u32 byte;
    const float s = fp8_block_scale(amax, ue8m0, byte);
    if (!has) return;
    float v[16];
    unpack_chunk<T>(w, v);
    *reinterpret_cast<uint4*>(crow + c * 16) = fp8_block_codes16(v, s, byte, ue8m0, flag);
    if (c % lanes == 0) fp8_store_scale(scales, srow + c / lanes * s_blk, s, byte, flag, sbyte);
}

// A row's FP8 block output (phases 1 and 3 of row_quantize with no global
// scale): codes (N bytes at codes + row * N), ceil(N / block) scales at
// scales[row * s_row + b * s_blk], inv_rms for NORM producers. The loop past the
// registers runs the same number of times in every thread (the shuffles).
template <typename T, int REG, class P>
__device__ __forceinline__ void row_quantize_fp8(const P& p, u32 (&st)[REG][8], i64 row, i64 C, float eps, i64 n,
                                                 u8* __restrict__ codes, void* __restrict__ scales, i64 s_row,
                                                 i64 s_blk, float* __restrict__ inv_out, int block, bool ue8m0,
                                                 bool sbyte) {
    const int tid = threadIdx.x;
    const i64 B = blockDim.x;
    const float inv = row_inv_rms<T, REG>(p, st, C, eps, n);
    const int lanes = block / 16;
    const i64 srow = row * s_row;
    u8* crow = codes + row * C * 16;
#pragma unroll
    for (int r = 0; r < REG; ++r) {
        const i64 c = tid + r * B;
        if constexpr (P::NORM) { if (c < C) p.norm(c, st[r], inv); }
        fp8_chunk<T>(st[r], c < C, c, lanes, crow, scales, srow, s_blk, ue8m0, sbyte);
    }
    for (i64 c0 = REG * B; c0 < C; c0 += B) {
        const i64 c = c0 + tid;
        u32 w[8];
        if (c < C) {
            p.load(c, w);
            p.norm(c, w, inv);
        }
        fp8_chunk<T>(w, c < C, c, lanes, crow, scales, srow, s_blk, ue8m0, sbyte);
    }
    if constexpr (P::NORM) { if (tid == 0 && inv_out != nullptr) inv_out[row] = inv; }
}

}  // namespace

// The RMSNorm producer of row `row` (rkv_fused_rms's arguments), set in place.
template <typename T, bool MIX>
__device__ __forceinline__ void set_rms_producer(RmsProducer<T, MIX>& p, const T* x, const void* mix,
                                                 long long mix_kind, long long n_hc, const void* w,
                                                 long long w_kind, long long n, i64 row) {
    p.x = x + row * (MIX ? n_hc : 1) * n;
    p.w = w;
    p.w_kind = (int)w_kind;
    p.n_hc = (int)n_hc;
    p.n = n;
#pragma unroll
    for (int h = 0; h < RKV_FUSED_MAX_HC; ++h)
        p.a[h] = (MIX && h < n_hc) ? load_kind(mix, row * n_hc + h, (int)mix_kind) : 0.0f;
}

// x: (M, N) or, with MIX, X: (M, n_hc, N); mix: (M, n_hc) of mix_kind; w: (N,) of w_kind.
// q (M, N/2), sf (M, N/16), gs_out (M,) for MODE_ROW else one float, inv_out (M,) or null.
// gs_in: a device float (MODE_FIXED) or null, then gs_val; errors: where an
// unusable gs_in is counted (rawkv.nvfp4's GIVEN_GS counter) or null. One CTA per row.
template <typename T, bool MIX, int REG>
__global__ void __maxnreg__((kRmsRegs<T, MIX>)) rkv_fused_rms(
        const T* __restrict__ x, const void* __restrict__ mix, long long mix_kind, long long n_hc,
        const void* __restrict__ w, long long w_kind, double eps, long long n,
        u8* __restrict__ q, u8* __restrict__ sf, float* gs_out, float* __restrict__ inv_out,
        const float* gs_in, double gs_val, long long mode, int* errors) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    const i64 row = blockIdx.x;
    RmsProducer<T, MIX> p;
    set_rms_producer(p, x, mix, mix_kind, n_hc, w, w_kind, n, row);
    u32 st[REG][8];
    load_row<REG>(p, n / 16, st);
    row_quantize<T, REG>(p, st, (int)mode, row, n / 16, (float)eps, n, q, sf, gs_out, inv_out, gs_in,
                         (float)gs_val, errors);
}

// h: (M, 2I) with columns alternating g gate and g up; q (M, I/2), sf (M, I/16);
// gs_out, gs_in, gs_val, errors as rkv_fused_rms's.
template <typename T, bool VEC, int REG>
__global__ void __maxnreg__(kRowRegsWide) rkv_fused_swiglu(
        const T* __restrict__ h, long long inter, long long g,
        u8* __restrict__ q, u8* __restrict__ sf, float* gs_out,
        const float* gs_in, double gs_val, long long mode, int* errors) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    const i64 row = blockIdx.x;
    SwigluProducer<T, VEC> p;
    p.h = h + row * 2 * inter;
    p.g = (u32)g;
    u32 st[REG][8];
    load_row<REG>(p, inter / 16, st);
    row_quantize<T, REG>(p, st, (int)mode, row, inter / 16, 0.0f, inter, q, sf, gs_out, nullptr, gs_in,
                         (float)gs_val, errors);
}

// FP8 block outputs of the row producers: codes (M, N) / (M, I), scales
// (M, ceil(N / blk)) at strides (s_row, s_blk) of E8M0 bytes (sbyte) or
// float32 (UE8M0: powers of two; a template constant, so an instance holds
// one quotient path: with both behind a run-time flag, the UE8M0 producers
// carried the FP32 path's registers, docs/fused.md "FP8 block outputs"),
// inv_out (M,) or null; the other arguments as rkv_fused_rms's /
// rkv_fused_swiglu's. One CTA per row, blockDim a multiple of 32.
template <typename T, bool MIX, int REG, bool UE8M0>
__global__ void __maxnreg__(MIX ? kRowRegsWide : kRowRegs) rkv_fused_rms_fp8(
        const T* __restrict__ x, const void* __restrict__ mix, long long mix_kind, long long n_hc,
        const void* __restrict__ w, long long w_kind, double eps, long long n, long long blk, long long sbyte,
        u8* __restrict__ codes, void* __restrict__ scales, long long s_row, long long s_blk,
        float* __restrict__ inv_out) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    const i64 row = blockIdx.x;
    RmsProducer<T, MIX> p;
    set_rms_producer(p, x, mix, mix_kind, n_hc, w, w_kind, n, row);
    u32 st[REG][8];
    load_row<REG>(p, n / 16, st);
    row_quantize_fp8<T, REG>(p, st, row, n / 16, (float)eps, n, codes, scales, s_row, s_blk, inv_out, (int)blk,
                             UE8M0, sbyte != 0);
}

template <typename T, bool VEC, int REG, bool UE8M0>
__global__ void __maxnreg__(kRowRegs) rkv_fused_swiglu_fp8(
        const T* __restrict__ h, long long inter, long long g, long long blk, long long sbyte,
        u8* __restrict__ codes, void* __restrict__ scales, long long s_row, long long s_blk) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    const i64 row = blockIdx.x;
    SwigluProducer<T, VEC> p;
    p.h = h + row * 2 * inter;
    p.g = (u32)g;
    u32 st[REG][8];
    load_row<REG>(p, inter / 16, st);
    row_quantize_fp8<T, REG>(p, st, row, inter / 16, 0.0f, inter, codes, scales, s_row, s_blk, nullptr, (int)blk,
                             UE8M0, sbyte != 0);
}

// Scope tensor / given / none with no rows: no row CTA runs, and those are
// what write gs, so one thread gives it its value on the op's stream (gs_in:
// a given device scale, else gs_val: the given number, or 1).
__global__ void rkv_fused_set_gs(float* gs_out, const float* gs_in, double gs_val) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    if (threadIdx.x == 0 && blockIdx.x == 0) gs_out[0] = gs_in != nullptr ? *gs_in : (float)gs_val;
}

// The top-k part of MoE staging: ids widened to int64, weights copied as bytes.
template <typename ID>
__device__ __forceinline__ void moe_copy_topk(const ID* __restrict__ ids, i64 n_ids, long long* __restrict__ ids_out,
                                              const u8* __restrict__ wts, i64 w_bytes, u8* __restrict__ wts_out) {
    for (i64 i = global_thread(); i < n_ids; i += grid_threads()) ids_out[i] = (long long)ids[i];
    for (i64 i = global_thread(); i < w_bytes; i += grid_threads()) wts_out[i] = wts[i];
}

// MoE input staging, one launch: hidden (M, K) -> one-level NVFP4 codes
// (M, K/2) and UE4M3 scales packed four per int32 (M, K/64); top-k ids
// (M, k) of ID widened to int64; top-k weights copied as `w_bytes` bytes.
// n_units counts 64-element units (one scale word each; K % 64 == 0 keeps
// them inside rows, so no row math). A thread takes half a unit at a time
// (32 elements: 16 code bytes and 2 of the word's scale bytes, which are
// little endian, so the word's first half is blocks 0 and 1): the same
// per-thread work as nvfp4's quantize kernel, 32 fewer registers of data
// than a whole unit, so more threads in flight.
// Five CTAs of 256 threads per SM (48 registers) below sm_100; sm_100 /
// sm_120 code spills in 48, so four (64) there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kMoeMinBlocks = 4;
#else
constexpr int kMoeMinBlocks = 5;
#endif

template <typename T, typename ID>
__global__ void __launch_bounds__(RKV_FUSED_MOE_BLOCK, kMoeMinBlocks) rkv_moe_stage(
        const T* __restrict__ x, long long n_units, u8* __restrict__ q, u32* __restrict__ sf,
        const ID* __restrict__ ids, long long n_ids, long long* __restrict__ ids_out,
        const u8* __restrict__ wts, long long w_bytes, u8* __restrict__ wts_out) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    const i64 halves = 2 * n_units;
    for (i64 u = global_thread(); u < halves; u += grid_threads()) {
        const T* src = x + u * 32;
        u32 w0[8], w1[8];
        load_chunk(src, w0);
        load_chunk(src + 16, w1);
        uint2 c0, c1;
        const u32 s0 = quantize_chunk<T>(w0, chunk_absmax_bits(w0), 1.0f, c0);
        const u32 s1 = quantize_chunk<T>(w1, chunk_absmax_bits(w1), 1.0f, c1);
        *reinterpret_cast<uint4*>(q + u * 16) = make_uint4(c0.x, c0.y, c1.x, c1.y);
        reinterpret_cast<u16*>(sf)[u] = (u16)(s0 | (s1 << 8));
    }
    moe_copy_topk(ids, n_ids, ids_out, wts, w_bytes, wts_out);
}

// Four CTAs of 256 threads per SM (64 registers: 80 unbounded gave three,
// and 17% more time than quantize_blocks + torch's copies of the top-k at
// 16,384 x 7,168 on the H200; 48 spills).
constexpr int kMoeFp8MinBlocks = 4;

// MoE input staging with an FP8 block output: hidden (M, K) -> codes (M, K)
// and scales (M, ceil(K / blk), at strides (s_row, s_blk)) by fp8_blocks.cuh's grid-stride quantizer
// (a thread per 16 channels of x; every warp whole), then the top-k copy.
template <typename T, typename ID, bool UE8M0>
__global__ void __launch_bounds__(RKV_FUSED_MOE_BLOCK, kMoeFp8MinBlocks) rkv_moe_stage_fp8(
        const T* __restrict__ x, long long rows, long long K, long long blk, long long sbyte,
        u8* __restrict__ codes, void* __restrict__ scales, long long s_row, long long s_blk,
        const ID* __restrict__ ids, long long n_ids, long long* __restrict__ ids_out,
        const u8* __restrict__ wts, long long w_bytes, u8* __restrict__ wts_out) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    fp8_quantize_rows<T>(x, codes, scales, s_row, s_blk, rows, K, (int)blk, UE8M0, sbyte != 0);
    moe_copy_topk(ids, n_ids, ids_out, wts, w_bytes, wts_out);
}
