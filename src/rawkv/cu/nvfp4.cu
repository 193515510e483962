// nvfp4.cu: NVFP4 quantize / dequantize / gather / scale swizzle
// (docs/format.md "NVFP4"; numpy twin: rawkv/reference/nvfp4.py, layouts.py).
//
// Work unit: BPT (1 or 2) consecutive 16-element blocks of one row, handled by
// one thread: BPT=2 (N % 32 == 0) reads 32 inputs with 16-byte loads and
// writes 16 code bytes with one 16-byte store (+ 2 scale bytes); BPT=1 writes
// 8 code bytes. Nobody else touches the unit: no redundant work.
//
// Row groups: `tpr` threads (a power of two below 32, else a multiple of 32)
// share a row; a CTA of blockDim.x = tpr * groups threads handles `groups`
// rows at a time and strides over rows by gridDim.x * groups. Inside a row,
// lane l handles units l, l + tpr, ...
//
// Pointers: x rows are `ldx` elements apart (row-strided 2-D views), q / sf /
// out are dense. The host (rawkv/nvfp4/_checks.py) checks the alignment of
// every vector access: 16 bytes for x (pointer and row stride), quantize's
// q / sf, gather's out; 4 for gather's q (read as u32 words); sf is read byte
// by byte.
//
// Constants shared with the host are declared once, in rawkv/kernels/nvfp4.py,
// and arrive here as -D macros.
#include "packed16.cuh"
using namespace rkv;

#if !defined(RKV_NVFP4_MODE_GIVEN) || !defined(RKV_NVFP4_MODE_AMAX)
#error "RKV_NVFP4_MODE_GIVEN / RKV_NVFP4_MODE_AMAX: compile through rawkv (rawkv/kernels/nvfp4.py)"
#endif
#ifndef RKV_NVFP4_GATHER_UNROLL
#error "RKV_NVFP4_GATHER_UNROLL: compile through rawkv (rawkv/kernels/nvfp4.py)"
#endif
#ifndef RKV_NVFP4_MAX_BLOCK_THREADS
#error "RKV_NVFP4_MAX_BLOCK_THREADS: compile through rawkv (rawkv/kernels/nvfp4.py)"
#endif

namespace {

constexpr unsigned kFull = 0xffffffffu;

// BPT blocks of T, as 16-byte vectors.
template <typename T, int BPT>
struct XUnit {
    static constexpr int PER = Vec16<T>::N;          // elements per vector
    static constexpr int NV = 16 * BPT / PER;        // vectors per unit
    Vec16<T> v[NV];
    __device__ __forceinline__ void load(const T* p) {
#pragma unroll
        for (int k = 0; k < NV; ++k) v[k] = load16(p + k * PER);
    }
    __device__ __forceinline__ float at(int e) const { return to_f32(v[e / PER].v[e % PER]); }
    // Block b (16-bit T) as 8 packed words.
    __device__ __forceinline__ void words(int b, u32 (&w)[8]) const {
        const uint4 a = v[2 * b].raw, c = v[2 * b + 1].raw;
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = c.x; w[5] = c.y; w[6] = c.z; w[7] = c.w;
    }
    // Max finite |x| of the unit (the amax of scopes 'row' and 'tensor').
    __device__ __forceinline__ float amax() const {
        if constexpr (sizeof(T) == 2) {          // on the packed bits, 2 per instruction
            u32 m = 0u;
#pragma unroll
            for (int b = 0; b < BPT; ++b) {
                u32 w[8];
                words(b, w);
                const u32 bm = chunk_absmax_bits(w);
                m = max(m, bm < Bits<T>::kInf ? bm : chunk_finite_absmax_bits<T>(w));
            }
            return bits_f32<T>(m);
        } else {
            float m = 0.0f;
#pragma unroll
            for (int e = 0; e < 16 * BPT; ++e) m = fmaxf(m, nvfp4_finite_abs(at(e)));
            return m;
        }
    }
};

// Quantize one unit with decode scale gs and store its codes and scales.
template <typename T, int BPT>
__device__ __forceinline__ void quantize_unit(const XUnit<T, BPT>& u, float gs, u8* q, u8* sf) {
    uint2 p[BPT];
    u8 s[BPT];
#pragma unroll
    for (int b = 0; b < BPT; ++b) {
        if constexpr (sizeof(T) == 2) {
            u32 w[8];
            u.words(b, w);
            s[b] = quantize_chunk<T>(w, chunk_absmax_bits(w), gs, p[b]);
        } else {
            float f[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) f[i] = u.at(b * 16 + i);
            s[b] = nvfp4_quantize_block(f, gs, p[b]);
        }
    }
    if constexpr (BPT == 2) {
        *reinterpret_cast<uint4*>(q) = make_uint4(p[0].x, p[0].y, p[1].x, p[1].y);
        *reinterpret_cast<u16*>(sf) = (u16)(s[0] | ((u16)s[1] << 8));
    } else {
        *reinterpret_cast<uint2*>(q) = p[0];
        *sf = s[0];
    }
}

// A unit under an unusable given gs: every block flagged (sf 0x7F, codes 0),
// as step 5 flags a block holding NaN / Inf, so it decodes to NaN.
template <int BPT>
__device__ __forceinline__ void flag_unit(u8* q, u8* sf) {
    if constexpr (BPT == 2) {
        *reinterpret_cast<uint4*>(q) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<u16*>(sf) = (u16)(kE4M3NaN | ((u16)kE4M3NaN << 8));
    } else {
        *reinterpret_cast<uint2*>(q) = make_uint2(0u, 0u);
        *sf = kE4M3NaN;
    }
}

// Max over the `tpr` threads of each row group (values >= 0, never NaN).
// Every thread of the CTA must call it (it may hold __syncthreads).
__device__ __forceinline__ float group_max(float m, int tpr, float* smem) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        if (o < tpr) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    if (tpr > 32) {
        __syncthreads();                      // earlier readers of smem are done
        if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = m;
        __syncthreads();
        const int nw = tpr >> 5, w0 = (int)(threadIdx.x / tpr) * nw;
        m = 0.0f;
        for (int w = 0; w < nw; ++w) m = fmaxf(m, smem[w0 + w]);
    }
    return m;
}

__device__ __forceinline__ float load_gs(const float* gs_ptr, double gs_val) {
    return gs_ptr ? *gs_ptr : (float)gs_val;
}

}  // namespace

// ---- scope 'tensor', large tensors: memset(gs, 0) -> amax -> quantize -> finalize
// atomicMax of the finite |x| bits (non-negative floats order like their bits)
// into amax_bits (the gs output buffer, zeroed by a memset node before).
template <typename T>
__global__ void rkv_nvfp4_amax(const T* __restrict__ x, i64 M, i64 N, i64 ldx, u32* amax_bits) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    __shared__ float smem[32];
    const i64 vpr = N / Vec16<T>::N;                       // 16-byte vectors per row
    const i64 total = M * vpr;
    float m = 0.0f;
    for (i64 v = global_thread(); v < total; v += grid_threads()) {
        const i64 r = v / vpr, c = v - r * vpr;
        Vec16<T> in = load16(x + r * ldx + c * Vec16<T>::N);
#pragma unroll
        for (int j = 0; j < Vec16<T>::N; ++j) m = fmaxf(m, nvfp4_finite_abs(to_f32(in.v[j])));
    }
    m = group_max(m, (int)blockDim.x, smem);
    if (threadIdx.x == 0 && m > 0.0f) atomicMax(amax_bits, __float_as_uint(m));
}

// MODE_GIVEN: gs = *gs_ptr (device tensor) or gs_val (scopes 'given' and
//         'none'); block 0 thread 0 copies it to gs_out when gs_out is not
//         null. A gs that nvfp4_given_gs_ok<T> refuses (only a device gs can
//         be one: the host refuses such numbers) is never used: every block
//         is flagged (flag_unit) and block 0 thread 0 adds 1 to *errors (when
//         not null).
// MODE_AMAX: *gs_ptr holds the tensor's amax (from rkv_nvfp4_amax); gs derived
//         from it here; rkv_nvfp4_finalize_gs rewrites the buffer afterwards.
template <typename T, int BPT, int MODE>
__global__ void rkv_nvfp4_quantize(const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ sf,
                                   i64 M, i64 upr, i64 ldx, i64 tpr_,
                                   const float* gs_ptr, double gs_val, float* gs_out, int* errors) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    static_assert(MODE == RKV_NVFP4_MODE_GIVEN || MODE == RKV_NVFP4_MODE_AMAX, "MODE");
    constexpr bool kAmax = MODE == RKV_NVFP4_MODE_AMAX;
    const int tpr = (int)tpr_;
    const int gpc = blockDim.x / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
    const float gs = kAmax ? nvfp4_global_scale(*gs_ptr) : load_gs(gs_ptr, gs_val);
    const bool gs_ok = kAmax || nvfp4_given_gs_ok<T>(gs);
    if (!kAmax && blockIdx.x == 0 && threadIdx.x == 0) {
        if (gs_out != nullptr) *gs_out = gs;
        if (!gs_ok && errors != nullptr) atomicAdd(errors, 1);
    }
    if (!gs_ok) {
        for (i64 r = (i64)blockIdx.x * gpc + g; r < M; r += (i64)gridDim.x * gpc)
            for (i64 c = l; c < upr; c += tpr)
                flag_unit<BPT>(q + (r * upr + c) * (8 * BPT), sf + (r * upr + c) * BPT);
        return;
    }
    for (i64 r = (i64)blockIdx.x * gpc + g; r < M; r += (i64)gridDim.x * gpc) {
        const T* xr = x + r * ldx;
        u8* qr = q + r * upr * (8 * BPT);
        u8* sr = sf + r * upr * BPT;
        for (i64 c = l; c < upr; c += tpr) {
            XUnit<T, BPT> u;
            u.load(xr + c * (16 * BPT));
            quantize_unit(u, gs, qr + c * (8 * BPT), sr + c * BPT);
        }
    }
}

__global__ void rkv_nvfp4_finalize_gs(float* gs) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    if (threadIdx.x == 0 && blockIdx.x == 0) *gs = nvfp4_global_scale(*gs);
}

// ---- scope 'tensor', small tensors (decode): one launch. Every CTA reduces
// the whole (small, L2-resident) tensor itself, then quantizes its share of
// units; CTA 0 writes gs. No cross-CTA communication, so no race.
template <typename T, int BPT>
__global__ void __launch_bounds__(RKV_NVFP4_MAX_BLOCK_THREADS) rkv_nvfp4_quantize_small(const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ sf,
                                         i64 M, i64 upr, i64 ldx, float* gs_out) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    __shared__ float smem[32];
    const u32 vpr = (u32)(upr * (16 * BPT) / Vec16<T>::N);
    const u32 nvec = (u32)M * vpr;
    float m = 0.0f;
    for (u32 v = threadIdx.x; v < nvec; v += blockDim.x) {
        const u32 r = v / vpr, c = v - r * vpr;
        Vec16<T> in = load16(x + (i64)r * ldx + (i64)c * Vec16<T>::N);
#pragma unroll
        for (int j = 0; j < Vec16<T>::N; ++j) m = fmaxf(m, nvfp4_finite_abs(to_f32(in.v[j])));
    }
    const float gs = nvfp4_global_scale(group_max(m, (int)blockDim.x, smem));
    if (blockIdx.x == 0 && threadIdx.x == 0) *gs_out = gs;
    const u32 units = (u32)M * (u32)upr;
    for (u32 w = blockIdx.x * blockDim.x + threadIdx.x; w < units; w += gridDim.x * blockDim.x) {
        const u32 r = w / (u32)upr, c = w - r * (u32)upr;
        XUnit<T, BPT> u;
        u.load(x + (i64)r * ldx + (i64)c * (16 * BPT));
        quantize_unit(u, gs, q + (i64)w * (8 * BPT), sf + (i64)w * BPT);
    }
}

// ---- scope 'row': a row group (tpr threads) per row, the row kept in
// registers (R == 1: one unit per thread, tpr <= RKV_NVFP4_MAX_BLOCK_THREADS
// threads; R == 0: the row is too long for that and is read twice).
template <typename T, int BPT, int R>
__global__ void __launch_bounds__(RKV_NVFP4_MAX_BLOCK_THREADS) rkv_nvfp4_quantize_rows(const T* __restrict__ x, u8* __restrict__ q, u8* __restrict__ sf,
                                        float* __restrict__ gs_out, i64 M, i64 upr, i64 ldx, i64 tpr_) {
    pdl_producer_start();    // (common.cuh: the programmatic dependent launch)
    static_assert(R == 0 || R == 1, "R: 1 (one unit per lane, the host keeps upr <= tpr) or 0");
    __shared__ float smem[32];
    const int tpr = (int)tpr_;
    const int gpc = blockDim.x / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
    const bool mine = l < upr;                 // R == 1: this lane's unit exists
    for (i64 base = (i64)blockIdx.x * gpc; base < M; base += (i64)gridDim.x * gpc) {
        const i64 r = base + g;                    // the loop is uniform over the CTA
        const bool live = r < M;
        const T* xr = x + r * ldx;
        XUnit<T, BPT> u;
        float m = 0.0f;
        if (R > 0) {
            if (live && mine) { u.load(xr + (i64)l * (16 * BPT)); m = u.amax(); }
        } else if (live) {
            for (i64 c = l; c < upr; c += tpr) { u.load(xr + c * (16 * BPT)); m = fmaxf(m, u.amax()); }
        }
        const float gs = nvfp4_global_scale(group_max(m, tpr, smem));
        if (!live) continue;
        if (l == 0) gs_out[r] = gs;
        u8* qr = q + r * upr * (8 * BPT);
        u8* sr = sf + r * upr * BPT;
        if (R > 0) {
            if (mine) quantize_unit(u, gs, qr + (i64)l * (8 * BPT), sr + (i64)l * BPT);
        } else {
            for (i64 c = l; c < upr; c += tpr) {
                u.load(xr + c * (16 * BPT));
                quantize_unit(u, gs, qr + c * (8 * BPT), sr + c * BPT);
            }
        }
    }
}

// ---- dequantize and gather: out row o = decode(source row idx[o]) (idx null:
// o itself). A source row outside [0, M) is not read: out row o is written
// as zeros and counted into *errors (when not null), once per row. gs: per
// source row (ROWGS), else *gs_ptr, else gs_val.
//
// Work unit: 8 elements = 4 code bytes -> one 16-byte store of BF16/FP16
// (two for FP32), so the lanes of a warp load 128 contiguous code bytes and
// store 512 contiguous output bytes per instruction. Each thread keeps
// RKV_NVFP4_GATHER_UNROLL units in flight (loads first, then decode and store).
constexpr int kGatherUnroll = RKV_NVFP4_GATHER_UNROLL;

template <typename OutT, typename IdxT, bool ROWGS>
__global__ void rkv_nvfp4_gather(const u8* __restrict__ q, const u8* __restrict__ sf,
                                 const float* __restrict__ gs_ptr, double gs_val,
                                 const IdxT* __restrict__ idx, OutT* __restrict__ out,
                                 int* __restrict__ errors, i64 M, i64 rows_out, i64 n8, i64 ldo,
                                 i64 tpr_) {
    const int tpr = (int)tpr_;
    const int gpc = blockDim.x / tpr, g = threadIdx.x / tpr, l = threadIdx.x % tpr;
    const float gs_scalar = ROWGS ? 0.0f : load_gs(gs_ptr, gs_val);
    constexpr int PER = Vec16<OutT>::N;
    for (i64 o = (i64)blockIdx.x * gpc + g; o < rows_out; o += (i64)gridDim.x * gpc) {
        i64 r = idx ? (i64)idx[o] : o;
        // A bad row reads nothing: codes 0 and es = 0 * 0 decode to +0.
        const bool ok = r >= 0 && r < M;
        if (!ok) {
            if (l == 0 && errors) atomicAdd(errors, 1);
            r = 0;
        }
        const float gs = !ok ? 0.0f : ROWGS ? gs_ptr[r] : gs_scalar;
        const u32* qr = reinterpret_cast<const u32*>(q + r * n8 * 4);
        const u8* sr = sf + r * (n8 >> 1);
        OutT* orow = out + o * ldo;
        for (i64 c0 = l; c0 < n8; c0 += (i64)tpr * kGatherUnroll) {
            u32 w[kGatherUnroll];
            u8 s[kGatherUnroll];
#pragma unroll
            for (int k = 0; k < kGatherUnroll; ++k) {
                const i64 c = c0 + (i64)k * tpr;
                if (c < n8) { w[k] = ok ? qr[c] : 0u; s[k] = ok ? sr[c >> 1] : (u8)0; }
            }
#pragma unroll
            for (int k = 0; k < kGatherUnroll; ++k) {
                const i64 c = c0 + (i64)k * tpr;
                if (c >= n8) break;
                const float es = e4m3_decode(s[k]) * gs;
#pragma unroll
                for (int h = 0; h < 8 / PER; ++h) {
                    Vec16<OutT> v;
#pragma unroll
                    for (int j = 0; j < PER; ++j)
                        v.v[j] = from_f32<OutT>(e2m1_decode((w[k] >> ((h * PER + j) * 4)) & 0xFu) * es);
                    store16(orow + c * 8 + h * PER, v);
                }
            }
        }
    }
}

// ---- scale swizzle (linear (rows, cols) <-> 128x4 tiles of 32x4x4) --------
// One thread per 4-byte word of the swizzled buffer: word w = tile * 128 +
// j * 4 + i holds scales (row tile_r*128 + i*32 + j, cols tile_c*4 .. +3);
// padding is written as 0.
__global__ void rkv_nvfp4_swizzle(const u8* __restrict__ sf, u32* __restrict__ out,
                                  i64 rows, i64 cols, i64 ncb, i64 nwords) {
    for (i64 w = global_thread(); w < nwords; w += grid_threads()) {
        const i64 tile = w >> 7, within = w & 127;
        const i64 r = (tile / ncb) * 128 + (within & 3) * 32 + (within >> 2);
        const i64 c0 = (tile % ncb) * 4;
        u32 word = 0u;
        if (r < rows) {
            const u8* src = sf + r * cols;
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (c0 + k < cols) word |= (u32)src[c0 + k] << (8 * k);
        }
        out[w] = word;
    }
}

// One thread per (row, group of 4 columns) of the linear layout.
__global__ void rkv_nvfp4_unswizzle(const u32* __restrict__ sw, u8* __restrict__ sf,
                                    i64 rows, i64 cols, i64 ncb) {
    const i64 total = rows * ncb;
    for (i64 t = global_thread(); t < total; t += grid_threads()) {
        const i64 r = t / ncb, cb = t - r * ncb;
        const i64 rr = r & 127;
        const u32 word = sw[((r >> 7) * ncb + cb) * 128 + (rr & 31) * 4 + (rr >> 5)];
        u8* dst = sf + r * cols + cb * 4;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (cb * 4 + k < cols) dst[k] = (u8)(word >> (8 * k));
    }
}
