// kv_cache.cu: the format kernels of the DeepSeek-V4 compressed KV cache
// (paged pool of CSA/HCA entries and the per-request decode state).
//
// rawkv/reference/kvcache.py defines every result; docs/kvcache.md
// ("Paged pool and kernels") gives the layouts and the launch geometry.
// All kernels run on the caller's stream, allocate nothing and never
// synchronize, so a decode step captures into one CUDA graph. Device-side
// indices (slots, positions, block-table entries, top-k ids) are bounds-
// checked: an out-of-range row is skipped (never read or written out of
// bounds) and counted with one atomicAdd into errors[0].
//
// written[slot] (one int32 per request slot) is the high-water mark of the
// entries the slot's current request has written: the flush raises it with
// atomicMax, the host zeroes it when the slot is freed, and every gather
// treats an entry id >= written[slot] as out of range (zero row, counted).
// Freed blocks keep their bytes and are reused, and a request may skip
// entries below its mark (a prefill that starts mid-request), so the mark
// alone does not make an entry readable: marks[row] (one byte per entry) is
// set by every writer and cleared when the block is assigned to a request
// (PagedKVPool.prepare_step's device fill, or rkv_kv_assign_pages); a gather
// returns only entries with marks[row] != 0 (zero row and counted otherwise).
// Page ownership: owners[blk] is the id of the request the block is assigned
// to, request_ids[slot] the id of the slot's request; locate() treats a
// block with owners[blk] != request_ids[slot] (or a slot with no request)
// like a bad block, for every writer and reader, so a block an engine put in
// a block-table row without assigning it is skipped and counted, and a mark
// on a block owned by X was set by X.
//
// Duplicates: rows of one launch aimed at the same target (the same pool
// entry, or the same state slot) would race. The lowest row that would write
// the target owns it; every other is skipped and counted. Each row finds out
// by scanning the rows below it (cheap at decode batch sizes; no scratch
// state, nothing to reset, graph-safe), so the result never depends on the
// order CTAs run in (reference: rawkv/reference/kvcache/paged.py, state.py).
//
// Pool layout, entry row r = block * epb + (entry % epb):
//   fp8   (num_blocks*epb, nope_dim)        E4M3 codes of the non-RoPE dims
//   scale (num_blocks*epb)                  FP32 decode scale (docs/format.md)
//   rope  (num_blocks*epb, rope_dim)        BF16 RoPE dims
//   idx_q (num_blocks*epb, index_dim/2)     CSA indexer key, E2M1 pairs
//   idx_sf(num_blocks*epb, index_dim/16)    CSA indexer key, UE4M3 scales
// Host-side checks guarantee: nope_dim % 16 == 0, rope_dim % 8 == 0,
// index_dim % 16 == 0, every pointer 16-byte aligned.
#include "common.cuh"
#include "nvfp4_common.cuh"
#include "kv_layouts.cuh"
using namespace rkv;

// Shared with Python: rawkv/kernels/kv_cache.py passes them as -D options.
//   RKV_KV_BLOCK        threads per CTA of the gathers and the state kernels
//   RKV_KV_FLUSH_ROWS   batch rows per flush CTA (one warp each)
//   RKV_KV_RESET_HCA / _CSA / _CLEAR   the MODE values of rkv_kv_state_reset
#if !defined(RKV_KV_BLOCK) || !defined(RKV_KV_FLUSH_ROWS) || !defined(RKV_KV_RESET_HCA) || \
    !defined(RKV_KV_RESET_CSA) || !defined(RKV_KV_RESET_CLEAR)
#error "kv_cache.cu needs the -D constants of rawkv/kernels/kv_cache.py"
#endif

namespace {

constexpr u32 kFull = 0xffffffffu;

__device__ __forceinline__ float f32_neg_inf() { return __int_as_float((int)0xFF800000u); }

// Physical entry row (block * epb + slot in block) of entry `e` of the
// request in `slot`, or -1 when the slot, the entry id, the logical block or
// the physical block id is out of range (reference _locate), or the block is
// not assigned to the slot's request: owners[blk] != request_ids[slot], or
// the slot holds no request (reference table_rows). Every writer and reader
// locates through here, so none uses a block handed to a request without
// assign_pages.
__device__ __forceinline__ i64 locate(const int* __restrict__ table, const int* __restrict__ request_ids,
                                      const int* __restrict__ owners, i64 slot, i64 e,
                                      i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb) {
    if (slot < 0 || slot >= num_requests || e < 0 || e >= max_blocks * epb) return -1;
    const i64 lb = (u32)e / (u32)epb;              // 32-bit: the host keeps max_blocks*epb < 2^31
    const i64 blk = table[slot * max_blocks + lb];
    if (blk < 0 || blk >= num_blocks) return -1;
    const int rid = request_ids[slot];
    if (rid <= 0 || owners[blk] != rid) return -1;         // not assigned to the slot's request
    return blk * epb + (e - lb * epb);
}

// Pool row a flush row writes (valid, position -> entry, locate), or -1.
__device__ __forceinline__ i64 flush_target(const bool* __restrict__ valid, const int* __restrict__ slots,
                                            const int* __restrict__ positions, const int* __restrict__ table,
                                            const int* __restrict__ request_ids, const int* __restrict__ owners,
                                            i64 b, i64 num_requests, i64 max_blocks, i64 num_blocks,
                                            i64 epb, i64 m) {
    if (!valid[b]) return -1;
    const i64 pos = positions[b];
    if (pos < 0) return -1;
    return locate(table, request_ids, owners, slots[b], (i64)((u32)pos / (u32)m), num_requests, max_blocks,
                  num_blocks, epb);
}

// The pool row flush row b writes, claimed by the warp of row b (every lane
// calls it): -1 when the row is invalid (not counted), or out of range, or a
// lower row writes the same pool row (both counted: lane 0 adds 1).
// Otherwise written[slot] is raised to e + 1 and marks[row] set (readers run
// in later launches, in stream order, so this may precede the entry's bytes).
__device__ __forceinline__ i64 flush_claim(const bool* __restrict__ valid, const int* __restrict__ slots,
                                           const int* __restrict__ positions, const int* __restrict__ table,
                                           const int* __restrict__ request_ids, const int* __restrict__ owners,
                                           int* __restrict__ written, u8* __restrict__ marks,
                                           int* __restrict__ errors, i64 b, int lane, i64 num_requests,
                                           i64 max_blocks, i64 num_blocks, i64 epb, i64 m) {
    if (!valid[b]) return -1;                              // warp-uniform
    const i64 pos = positions[b];
    const i64 r = flush_target(valid, slots, positions, table, request_ids, owners, b, num_requests, max_blocks,
                               num_blocks, epb, m);
    bool dup = false;
    if (r >= 0)
        for (i64 q = lane; q < b; q += 32)
            dup |= flush_target(valid, slots, positions, table, request_ids, owners, q, num_requests, max_blocks,
                                num_blocks, epb, m) == r;
    if (r < 0 || __any_sync(kFull, dup)) {                 // r is warp-uniform
        if (lane == 0) atomicAdd(errors, 1);
        return -1;
    }
    if (lane == 0) {
        atomicMax(written + slots[b], (int)((u32)pos / (u32)m + 1));
        marks[r] = 1;
    }
    return r;
}

// The pool row output row (b, j) of a gather reads (rules of rkv_kv_gather
// below), or -1 for a zero row; `errs` gets the errors the row counts.
template <typename TID, bool DENSE>
__device__ __forceinline__ i64 gather_target(const int* __restrict__ table, const int* __restrict__ request_ids,
                                             const int* __restrict__ owners, const int* __restrict__ slots,
                                             const TID* __restrict__ ids, const int* __restrict__ n_entries,
                                             const bool* __restrict__ valid, const int* __restrict__ written,
                                             const u8* __restrict__ marks, i64 row, i64 b, i64 j, i64 K,
                                             i64 slot0, i64 n0, i64 num_requests, i64 max_blocks,
                                             i64 num_blocks, i64 epb, int& errs) {
    i64 r = -1;
    if (valid == nullptr || valid[b]) {
        const i64 slot = slots != nullptr ? (i64)slots[b] : slot0;
        const bool limited = n_entries != nullptr || n0 >= 0;
        const i64 n = n_entries != nullptr ? (i64)n_entries[b] : n0;
        // entries the request has written; a bad slot has none (locate fails too)
        const i64 wr = (slot >= 0 && slot < num_requests) ? (i64)written[slot] : 0;
        if (DENSE) {
            if (j == 0 && (n < 0 || n > K)) errs += 1;
            if (j < n) {
                r = j < wr ? locate(table, request_ids, owners, slot, j, num_requests, max_blocks, num_blocks, epb)
                           : -1;
                errs += r < 0;
            }
        } else {
            const i64 e = (i64)ids[row];
            if (e != -1) {
                r = ((!limited || e < n) && e < wr)
                    ? locate(table, request_ids, owners, slot, e, num_requests, max_blocks, num_blocks, epb) : -1;
                errs += r < 0;
            }
        }
        if (r >= 0 && marks[r] == 0) {                // not written by this block's owner
            r = -1;
            errs += 1;
        }
    }
    return r;
}

// The loop of the warp-per-row gathers: one warp per output row (b, j) of
// B x K, grid-stride; `put(row, r)` writes output row `row` from pool row r
// (gather_target's; r < 0: a zero row), then lane 0 adds the row's errors
// to the counter.
template <typename TID, bool DENSE, typename Put>
__device__ __forceinline__ void gather_rows(const int* __restrict__ table, const int* __restrict__ request_ids,
                                            const int* __restrict__ owners, const int* __restrict__ slots,
                                            const TID* __restrict__ ids, const int* __restrict__ n_entries,
                                            const bool* __restrict__ valid, const int* __restrict__ written,
                                            const u8* __restrict__ marks, int* __restrict__ errors, i64 B, i64 K,
                                            i64 slot0, i64 n0, i64 num_requests, i64 max_blocks, i64 num_blocks,
                                            i64 epb, Put put) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < B * K; row += warps) {
        const i64 b = (u32)row / (u32)K, j = row - b * K;   // host: B*K < 2^31
        int errs = 0;
        const i64 r = gather_target<TID, DENSE>(table, request_ids, owners, slots, ids, n_entries, valid, written,
                                                marks, row, b, j, K, slot0, n0, num_requests, max_blocks,
                                                num_blocks, epb, errs);
        put(row, r);
        if (lane == 0 && errs) atomicAdd(errors, errs);
    }
}

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }

// 8 BF16 (one 16-byte load) -> float32 (exact).
__device__ __forceinline__ void bf16x8(const uint4 raw, float* v) {
    v[0] = bf16_lo(raw.x); v[1] = bf16_hi(raw.x);
    v[2] = bf16_lo(raw.y); v[3] = bf16_hi(raw.y);
    v[4] = bf16_lo(raw.z); v[5] = bf16_hi(raw.z);
    v[6] = bf16_lo(raw.w); v[7] = bf16_hi(raw.w);
}

// 16 BF16 at p (16-byte aligned) -> float32.
__device__ __forceinline__ void load_bf16x16(const __nv_bfloat16* p, float (&v)[16]) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    bf16x8(q[0], v);
    bf16x8(q[1], v + 8);
}

// 4 elements of T -> float4 (T = float: one 16-byte load; BF16: one 8-byte load).
template <typename T> __device__ __forceinline__ float4 load4(const T* p);
template <> __device__ __forceinline__ float4 load4<float>(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
template <> __device__ __forceinline__ float4 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
}

// Store 8 float32 values as T (RNE): one 16-byte store (BF16/FP16) or two
// (FP32). Packed with integer ops rather than through a union, which made
// ptxas put the vector on the stack.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)__bfloat16_as_ushort(__float2bfloat16_rn(lo))
         | ((u32)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    return (u32)__half_as_ushort(__float2half_rn(lo)) | ((u32)__half_as_ushort(__float2half_rn(hi)) << 16);
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float* v);
template <> __device__ __forceinline__ void store8<__nv_bfloat16>(__nv_bfloat16* p, const float* v) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]),
                                              pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
}
template <> __device__ __forceinline__ void store8<__half>(__half* p, const float* v) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_f16(v[0], v[1]), pack_f16(v[2], v[3]),
                                              pack_f16(v[4], v[5]), pack_f16(v[6], v[7]));
}
template <> __device__ __forceinline__ void store8<float>(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

template <typename T>
__device__ __forceinline__ void store8_zero(T* p) {
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int h = 0; h < 8 / Vec16<T>::N; ++h) *reinterpret_cast<uint4*>(p + h * Vec16<T>::N) = z;
}

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

}  // namespace

// ===========================================================================
// flush_write: one warp per batch row, RKV_KV_FLUSH_ROWS rows per CTA.
//   valid_mask[b] false         -> nothing, not counted
//   slot / position / block bad -> nothing written, errors += 1
//   otherwise entry e = pos / m is written to row locate(slot, e):
//     amax over the finite non-RoPE dims (warp max), s = amax/448 (1 if 0),
//     NaN (and codes 0) if any non-RoPE dim is NaN/Inf; q = e4m3(x / s)
//     16 codes per lane per step (one 16-byte store); RoPE dims copied as
//     BF16 bits (16-byte chunks); indexer key: one NVFP4 block of 16 per lane
//     (nvfp4_quantize_block, gs = 1), 8 code bytes + 1 scale byte;
//     written[slot] = max(written[slot], e + 1), marks[row] = 1.
//   a lower row writing the same pool row -> nothing written, errors += 1
//     (the warp scans rows 0..b-1, 32 at a time).
// ===========================================================================
template <bool HAS_INDEX>
__global__ void __launch_bounds__(32 * RKV_KV_FLUSH_ROWS, 8) rkv_kv_flush_write(
        const __nv_bfloat16* __restrict__ entries, const __nv_bfloat16* __restrict__ index_keys,
        const bool* __restrict__ valid, const int* __restrict__ slots,
        const int* __restrict__ positions, const int* __restrict__ table,
        const int* __restrict__ request_ids, const int* __restrict__ owners,
        u8* __restrict__ fp8, float* __restrict__ scale, __nv_bfloat16* __restrict__ rope,
        u8* __restrict__ idx_q, u8* __restrict__ idx_sf, int* __restrict__ written,
        u8* __restrict__ marks, int* __restrict__ errors,
        i64 B, i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 m,
        i64 nope_dim, i64 rope_dim, i64 index_dim) {
    const int lane = threadIdx.x & 31;
    const i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= B) return;                                    // warp-uniform
    const i64 r = flush_claim(valid, slots, positions, table, request_ids, owners, written, marks, errors, b, lane,
                              num_requests, max_blocks, num_blocks, epb, m);
    if (r < 0) return;
    const i64 hd = nope_dim + rope_dim;
    const __nv_bfloat16* src = entries + b * hd;

    // 1. amax over the finite non-RoPE dims, and whether any is NaN/Inf.
    const i64 nc = nope_dim / 16;
    float amax = 0.0f;
    bool bad = false;
    for (i64 c = lane; c < nc; c += 32) {
        float v[16];
        load_bf16x16(src + c * 16, v);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const float a = fabsf(v[i]);
            const bool fin = a <= 3.402823466e38f;
            bad |= !fin;
            amax = fin ? fmaxf(amax, a) : amax;
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
    bad = __any_sync(kFull, bad);
    const float s = bad ? f32_qnan() : fp8_entry_scale(amax);
    if (lane == 0) scale[r] = s;

    // 2. E4M3 codes (the row is L1/L2-resident: read again rather than hold it).
    u8* dst = fp8 + r * nope_dim;
    for (i64 c = lane; c < nc; c += 32) {
        Vec16<u8> o;
        if (bad) {
            o.raw = make_uint4(0u, 0u, 0u, 0u);
        } else {
            float v[16];
            load_bf16x16(src + c * 16, v);
#pragma unroll
            for (int i = 0; i < 16; ++i) o.v[i] = e4m3_encode(v[i] / s);
        }
        store16(dst + c * 16, o);
    }

    // 3. RoPE dims: BF16 bits, 8 per 16-byte chunk.
    const i64 rc = rope_dim / 8;
    for (i64 c = lane; c < rc; c += 32)
        store16(rope + r * rope_dim + c * 8, load16(src + nope_dim + c * 8));

    // 4. CSA indexer key: one-level NVFP4, one block of 16 per lane.
    if (HAS_INDEX) {
        const i64 nb = index_dim / 16;
        const __nv_bfloat16* key = index_keys + b * index_dim;
        for (i64 c = lane; c < nb; c += 32) {
            float v[16];
            load_bf16x16(key + c * 16, v);
            uint2 packed;
            const u8 sf = nvfp4_quantize_block(v, 1.0f, packed);
            *reinterpret_cast<uint2*>(idx_q + r * (index_dim / 2) + c * 8) = packed;
            idx_sf[r * nb + c] = sf;
        }
    }
}

// ===========================================================================
// state_append: one CTA per batch row; 4 channels per thread per step.
// Row count[s] of the a-stream of slot s gets kv and z (+ ape[count]);
// count += 1. Out-of-range slot, a valid row below with the same slot (a
// duplicate: the lowest row appends) or a full window (count >= m; count < 0
// is treated the same way) -> skipped, errors += 1.
// Thread 0 reads count[s] once and hands it to the CTA through shared
// memory: threads that read count separately could disagree on whether to
// return, so some would wait at a barrier the others never reach (a hang).
// The CTA that owns the slot is the only writer of its count.
// ===========================================================================
template <typename TKV, typename TZ>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_state_append(
        const TKV* __restrict__ kv, const TZ* __restrict__ z, const float* __restrict__ ape,
        const bool* __restrict__ valid, const int* __restrict__ slots,
        float* __restrict__ a_kv, float* __restrict__ a_z, int* __restrict__ count,
        int* __restrict__ errors, i64 S, i64 m, i64 w) {
    __shared__ int sh_count;
    const i64 b = blockIdx.x;
    if (!valid[b]) return;                                   // CTA-uniform (read-only input)
    const i64 s = slots[b];
    if (s < 0 || s >= S || slot_taken_below</*NULL_IS_ALL=*/true>(valid, slots, b, s)) {
        if (threadIdx.x == 0) atomicAdd(errors, 1);
        return;
    }
    if (threadIdx.x == 0) {
        const int c = count[s];
        if (c >= 0 && c < m) count[s] = c + 1;
        sh_count = c;
    }
    __syncthreads();
    const i64 r = sh_count;                                  // CTA-uniform by construction
    if (r < 0 || r >= m) {
        if (threadIdx.x == 0) atomicAdd(errors, 1);
        return;
    }
    const TKV* src_kv = kv + b * w;
    const TZ* src_z = z + b * w;
    float* dkv = a_kv + (s * m + r) * w;
    float* dz = a_z + (s * m + r) * w;
    const float* pe = ape != nullptr ? ape + r * w : nullptr;
    for (i64 c = threadIdx.x; c < w / 4; c += blockDim.x) {
        const float4 k = load4(src_kv + c * 4);
        float4 g = load4(src_z + c * 4);
        if (pe != nullptr) {
            const float4 p = *reinterpret_cast<const float4*>(pe + c * 4);
            g.x = g.x + p.x; g.y = g.y + p.y; g.z = g.z + p.z; g.w = g.w + p.w;
        }
        *reinterpret_cast<float4*>(dkv + c * 4) = k;
        *reinterpret_cast<float4*>(dz + c * 4) = g;
    }
}

// ===========================================================================
// State reset: one CTA per batch row (valid == nullptr: every row).
//   MODE RKV_KV_RESET_HCA   hca_reset : a emptied (kv 0, z -inf), count 0
//   MODE RKV_KV_RESET_CSA   csa_rotate: b <- a[:, :, :d] (kv and z), then a emptied, count 0
//   MODE RKV_KV_RESET_CLEAR clear     : a and b (when present) emptied, count 0
// Each float4 of the a-stream is read (csa_rotate) and cleared by one thread, so
// no barrier is needed. Out-of-range slot, or a valid row below with the
// same slot (a duplicate: the lowest row acts): skipped, errors += 1.
// ===========================================================================
template <int MODE>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_state_reset(
        const bool* __restrict__ valid, const int* __restrict__ slots,
        float* __restrict__ a_kv, float* __restrict__ a_z, float* __restrict__ b_kv,
        float* __restrict__ b_z, int* __restrict__ count, int* __restrict__ errors,
        i64 S, i64 m, i64 d, i64 w) {
    const i64 b = blockIdx.x;
    if (valid != nullptr && !valid[b]) return;
    const i64 s = slots[b];
    if (s < 0 || s >= S || slot_taken_below</*NULL_IS_ALL=*/true>(valid, slots, b, s)) {
        if (threadIdx.x == 0) atomicAdd(errors, 1);
        return;
    }
    if (threadIdx.x == 0) count[s] = 0;
    const float ninf = f32_neg_inf();
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 ninf4 = make_float4(ninf, ninf, ninf, ninf);
    float* ak = a_kv + s * m * w;
    float* az = a_z + s * m * w;
    for (i64 c = threadIdx.x; c < m * w / 4; c += blockDim.x) {
        if (MODE == RKV_KV_RESET_CSA) {
            const i64 j = (u32)(c * 4) / (u32)w, col = c * 4 - j * w;
            if (col < d) {
                const float4 k = *reinterpret_cast<const float4*>(ak + c * 4);
                const float4 g = *reinterpret_cast<const float4*>(az + c * 4);
                *reinterpret_cast<float4*>(b_kv + (s * m + j) * d + col) = k;
                *reinterpret_cast<float4*>(b_z + (s * m + j) * d + col) = g;
            }
        }
        *reinterpret_cast<float4*>(ak + c * 4) = zero4;
        *reinterpret_cast<float4*>(az + c * 4) = ninf4;
    }
    if (MODE == RKV_KV_RESET_CLEAR && b_kv != nullptr) {
        for (i64 c = threadIdx.x; c < m * d / 4; c += blockDim.x) {
            *reinterpret_cast<float4*>(b_kv + s * m * d + c * 4) = zero4;
            *reinterpret_cast<float4*>(b_z + s * m * d + c * 4) = ninf4;
        }
    }
}

// ===========================================================================
// Entry gather: one warp per output row (B*K rows, grid-stride over warps,
// RKV_KV_BLOCK / 32 warps per CTA). A row is (nope_dim + rope_dim)/8 chunks of 8
// output elements (512 dims: 56 + 8 = 64 chunks, 2 per lane): a non-RoPE
// chunk loads 8 code bytes (8-byte load) and computes e4m3(q) * s in FP32,
// a RoPE chunk loads 8 BF16 (16-byte load); each chunk is one 16-byte store
// (two for FP32 output).
//   TOPK (DENSE = false): entry e = ids[b, j]; -1 -> zero row, not counted;
//     any other e < 0, e >= n (when n_entries is given), e >= written[slot],
//     a bad slot/block, or marks[row] == 0 -> zero row, errors += 1.
//   DENSE: entry e = j; j >= n -> zero row (padding), not counted; for
//     j < n, j >= written[slot], a bad slot/block or marks[row] == 0 -> zero
//     row, errors += 1;
//     n < 0 or n > K counts one more error (at j == 0) and the first
//     min(n, K) rows are gathered.
//   valid != nullptr and valid[b] false -> zero rows, not counted.
//   slots == nullptr: every row uses slot0; n_entries == nullptr: n = n0
//   (TOPK: n0 < 0 means no limit).
// ===========================================================================
template <typename TO, typename TID, bool DENSE>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_gather(
        const u8* __restrict__ fp8, const float* __restrict__ scale,
        const __nv_bfloat16* __restrict__ rope, const int* __restrict__ table,
        const int* __restrict__ request_ids, const int* __restrict__ owners,
        const int* __restrict__ slots, const TID* __restrict__ ids,
        const int* __restrict__ n_entries, const bool* __restrict__ valid,
        const int* __restrict__ written, const u8* __restrict__ marks, TO* __restrict__ out,
        int* __restrict__ errors, i64 B, i64 K, i64 slot0, i64 n0, i64 num_requests, i64 max_blocks,
        i64 num_blocks, i64 epb, i64 nope_dim, i64 rope_dim) {
    const int lane = threadIdx.x & 31;
    const i64 hd = nope_dim + rope_dim;
    const i64 nc = nope_dim / 8;
    const i64 tc = nc + rope_dim / 8;
    gather_rows<TID, DENSE>(table, request_ids, owners, slots, ids, n_entries, valid, written, marks, errors, B, K,
                            slot0, n0, num_requests, max_blocks, num_blocks, epb, [&](i64 row, i64 r) {
        TO* dst = out + row * hd;
        if (r < 0) {
            for (i64 q = lane; q < tc; q += 32) store8_zero(dst + q * 8);
            return;
        }
        const float s = scale[r];
        const u8* codes = fp8 + r * nope_dim;
        const __nv_bfloat16* rp = rope + r * rope_dim - nc * 8;   // chunk c >= nc is at rp + 8c
        // Chunks lane, lane+32, lane+64, ...: two per step, both loads issued
        // before either is converted (memory-level parallelism).
        for (i64 q = lane; q < tc; q += 64) {
            uint4 raw[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 c = q + 32 * h;
                raw[h] = make_uint4(0u, 0u, 0u, 0u);
                if (c < nc) {
                    const uint2 w = *reinterpret_cast<const uint2*>(codes + c * 8);
                    raw[h].x = w.x;
                    raw[h].y = w.y;
                } else if (c < tc) {
                    raw[h] = *reinterpret_cast<const uint4*>(rp + c * 8);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const i64 c = q + 32 * h;
                if (c < nc) {
                    float v[8];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        v[i] = e4m3_decode((u8)((raw[h].x >> (i * 8)) & 0xFFu)) * s;
                        v[i + 4] = e4m3_decode((u8)((raw[h].y >> (i * 8)) & 0xFFu)) * s;
                    }
                    store8(dst + c * 8, v);
                } else if (c < tc) {
                    if (IsBf16<TO>::value) {      // bits as stored (NaN payloads kept)
                        *reinterpret_cast<uint4*>(dst + c * 8) = raw[h];
                    } else {
                        float v[8];
                        bf16x8(raw[h], v);
                        store8(dst + c * 8, v);
                    }
                }
            }
        }
    });
}

// ===========================================================================
// Indexer-key gather (DENSE rules of rkv_kv_gather, written[] and marks[] included): one thread per NVFP4
// block of 16 (8-byte code load + 1 scale byte, 16 outputs: two 16-byte
// stores for BF16/FP16, four for FP32), grid-stride over B*K*(index_dim/16).
// ===========================================================================
template <typename TO>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_gather_index(
        const u8* __restrict__ idx_q, const u8* __restrict__ idx_sf, const int* __restrict__ table,
        const int* __restrict__ request_ids, const int* __restrict__ owners, const int* __restrict__ slots,
        const int* __restrict__ n_entries, const bool* __restrict__ valid,
        const int* __restrict__ written, const u8* __restrict__ marks, TO* __restrict__ out,
        int* __restrict__ errors, i64 B, i64 K, i64 slot0, i64 n0, i64 num_requests, i64 max_blocks,
        i64 num_blocks, i64 epb, i64 index_dim) {
    const i64 nb = index_dim / 16;
    const i64 total = B * K * nb;
    for (i64 t = global_thread(); t < total; t += grid_threads()) {
        const i64 row = (u32)t / (u32)nb, k = t - row * nb;   // host: B*K*nb < 2^31
        const i64 b = (u32)row / (u32)K, j = row - b * K;
        i64 r = -1;
        int errs = 0;
        if (valid == nullptr || valid[b]) {
            const i64 slot = slots != nullptr ? (i64)slots[b] : slot0;
            const i64 n = n_entries != nullptr ? (i64)n_entries[b] : n0;
            if (j == 0 && k == 0 && (n < 0 || n > K)) errs += 1;
            const i64 wr = (slot >= 0 && slot < num_requests) ? (i64)written[slot] : 0;
            if (j < n) {
                r = j < wr ? locate(table, request_ids, owners, slot, j, num_requests, max_blocks, num_blocks, epb)
                           : -1;
                if (r >= 0 && marks[r] == 0) r = -1;      // not written by this block's owner
                errs += (r < 0 && k == 0);
            }
        }
        TO* dst = out + row * index_dim + k * 16;
        if (r < 0) {
            store8_zero(dst);
            store8_zero(dst + 8);
        } else {
            const uint2 packed = *reinterpret_cast<const uint2*>(idx_q + r * (index_dim / 2) + k * 8);
            float v[16];
            nvfp4_dequantize_block(packed, idx_sf[r * nb + k], 1.0f, v);
            store8(dst, v);
            store8(dst + 8, v + 8);
        }
        if (errs) atomicAdd(errors, errs);
    }
}

// ===========================================================================
// The pool in the "model1" layout (docs/kvcache.md "Pool layouts"): block
// blk is page blk of `pages` (MODEL1_FP8Sparse records, page stride
// page_bytes) and, for a CSA pool, of `index_pages` (DeepGEMM's paged FP8,
// MXFP4 or MXFP8 keys, template KEY, page stride index_page_bytes); pool row
// r = blk * epb + o is record o of both (FlashMLA's indices_in_kvcache).
// The record code is kv_layouts.cuh's, as in the standalone layout ops; the
// request rules (written[], marks[], duplicates, error counts) are the
// rawkv layout's kernels' above, through the same helpers.
// Host-side checks: entries 512 dims (448 + 64 RoPE), keys 128 dims,
// every pointer 16-byte aligned, num_blocks * epb < 2^31.
// ===========================================================================

// flush_write into pages: one warp per batch row (flush_claim), lane l
// quantizes dims 16l .. 16l+15 of the entry (model1_store_lane) and, with
// HAS_INDEX, dims 4l .. 4l+3 of the key (index_store_lane<KEY>).
template <bool HAS_INDEX, int KEY>
__global__ void __launch_bounds__(32 * RKV_KV_FLUSH_ROWS, 8) rkv_kv_flush_pages(
        const __nv_bfloat16* __restrict__ entries, const __nv_bfloat16* __restrict__ index_keys,
        const bool* __restrict__ valid, const int* __restrict__ slots,
        const int* __restrict__ positions, const int* __restrict__ table,
        const int* __restrict__ request_ids, const int* __restrict__ owners,
        u8* __restrict__ pages, u8* __restrict__ index_pages, int* __restrict__ written,
        u8* __restrict__ marks, int* __restrict__ errors,
        i64 B, i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb, i64 m,
        i64 page_bytes, i64 index_page_bytes) {
    const int lane = threadIdx.x & 31;
    const i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= B) return;                                    // warp-uniform
    const i64 r = flush_claim(valid, slots, positions, table, request_ids, owners, written, marks, errors, b, lane,
                              num_requests, max_blocks, num_blocks, epb, m);
    if (r < 0) return;
    const i64 blk = (u32)r / (u32)epb, off = r - blk * epb;
    float v[16];
    rkvlay::load_bf16_rounded<16>(entries + b * rkvlay::kEntry + lane * 16, v);
    rkvlay::model1_store_lane(v, lane, pages + blk * page_bytes, off, epb);
    if (HAS_INDEX) {
        float k[4];
        rkvlay::load_bf16_rounded<4>(index_keys + b * RKV_LAY_INDEX_DIM + lane * 4, k);
        rkvlay::index_store_lane<KEY>(k, lane, index_pages + blk * index_page_bytes, off, epb);
    }
}

// Entry gather from pages (rules of rkv_kv_gather: gather_target): one warp
// per output row, grid-stride; lane l decodes dims 16l .. 16l+15
// (model1_load_lane) and stores them as TO; zero rows for r < 0.
template <typename TO, typename TID, bool DENSE>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_gather_pages(
        const u8* __restrict__ pages, const int* __restrict__ table,
        const int* __restrict__ request_ids, const int* __restrict__ owners,
        const int* __restrict__ slots, const TID* __restrict__ ids,
        const int* __restrict__ n_entries, const bool* __restrict__ valid,
        const int* __restrict__ written, const u8* __restrict__ marks, TO* __restrict__ out,
        int* __restrict__ errors, i64 B, i64 K, i64 slot0, i64 n0, i64 num_requests, i64 max_blocks,
        i64 num_blocks, i64 epb, i64 page_bytes) {
    const int lane = threadIdx.x & 31;
    gather_rows<TID, DENSE>(table, request_ids, owners, slots, ids, n_entries, valid, written, marks, errors, B, K,
                            slot0, n0, num_requests, max_blocks, num_blocks, epb, [&](i64 row, i64 r) {
        float v[16];
        if (r < 0) {
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = 0.0f;
        } else {
            const i64 blk = (u32)r / (u32)epb;
            rkvlay::model1_load_lane(pages + blk * page_bytes, r - blk * epb, epb, lane, v);
        }
        rkvlay::store16_as(out + row * rkvlay::kEntry + lane * 16, v);
    });
}

// Indexer-key gather from index pages (DENSE rules of rkv_kv_gather): one
// warp per output row, lane l decodes dims 4l .. 4l+3 (index_load_lane).
template <typename TO, int KEY>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_gather_index_pages(
        const u8* __restrict__ index_pages, const int* __restrict__ table,
        const int* __restrict__ request_ids, const int* __restrict__ owners, const int* __restrict__ slots,
        const int* __restrict__ n_entries, const bool* __restrict__ valid,
        const int* __restrict__ written, const u8* __restrict__ marks, TO* __restrict__ out,
        int* __restrict__ errors, i64 B, i64 K, i64 slot0, i64 n0, i64 num_requests, i64 max_blocks,
        i64 num_blocks, i64 epb, i64 index_page_bytes) {
    const int lane = threadIdx.x & 31;
    gather_rows<int, true>(table, request_ids, owners, slots, nullptr, n_entries, valid, written, marks, errors, B,
                           K, slot0, n0, num_requests, max_blocks, num_blocks, epb, [&](i64 row, i64 r) {
        float v[4];
        if (r < 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] = 0.0f;
        } else {
            const i64 blk = (u32)r / (u32)epb;
            rkvlay::index_load_lane<KEY>(index_pages + blk * index_page_bytes, r - blk * epb, epb, lane, v);
        }
        rkvlay::store4_as(out + row * RKV_LAY_INDEX_DIM + lane * 4, v);
    });
}

// ===========================================================================
// The bridge on a pool: top-k entry ids (B, K) -> the entries' pool rows
// (int32), one thread per id, grid-stride; the rules of the top-k gather
// (gather_target, DENSE false): -1 stays -1 (not counted), an id that is out
// of range, at or past min(n_entries[b], written[slot]) or not marked
// written gives -1 and errors += 1; valid[b] false: -1, not counted. For a
// "model1" pool the row is FlashMLA's indices_in_kvcache into `pages`.
// ===========================================================================
template <typename TID>
__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_topk_indices(
        const int* __restrict__ table, const int* __restrict__ request_ids, const int* __restrict__ owners,
        const int* __restrict__ slots, const TID* __restrict__ ids,
        const int* __restrict__ n_entries, const bool* __restrict__ valid,
        const int* __restrict__ written, const u8* __restrict__ marks, int* __restrict__ out,
        int* __restrict__ errors, i64 B, i64 K, i64 num_requests, i64 max_blocks, i64 num_blocks, i64 epb) {
    for (i64 t = global_thread(); t < B * K; t += grid_threads()) {
        const i64 b = (u32)t / (u32)K, j = t - b * K;       // host: B*K < 2^31
        int errs = 0;
        const i64 r = gather_target<TID, false>(table, request_ids, owners, slots, ids, n_entries, valid, written,
                                                marks, t, b, j, K, 0, -1, num_requests, max_blocks,
                                                num_blocks, epb, errs);
        out[t] = (int)r;                                      // host: num_blocks * epb < 2^31
        if (errs) atomicAdd(errors, errs);
    }
}

// ===========================================================================
// assign_pages: block blocks[b] goes to the request in slots[b] (reference
// assign_pages): owners[blk] = request_ids[slot] and the block's epb marks
// are cleared, so none of its entries reads as written until the new owner
// writes it. One warp per row, grid-stride.
//   blocks[b] == -1                             -> nothing, not counted
//   block outside [0, num_blocks), slot out of
//   range or holding no request (id <= 0)       -> nothing, errors += 1
//   a lower row assigning the same block        -> nothing, errors += 1
//     (the warp scans rows 0..b-1, 32 at a time: the lowest row wins)
// ===========================================================================
namespace {
// The block row b assigns, with the id it stamps in `rid`, or -1.
__device__ __forceinline__ i64 assign_target(const int* __restrict__ slots, const int* __restrict__ blocks,
                                             const int* __restrict__ request_ids, i64 b, i64 num_requests,
                                             i64 num_blocks, int& rid) {
    const i64 s = slots[b], blk = blocks[b];
    rid = (s >= 0 && s < num_requests) ? request_ids[s] : 0;
    return (rid > 0 && blk >= 0 && blk < num_blocks) ? blk : -1;
}
}  // namespace

__global__ void __launch_bounds__(RKV_KV_BLOCK, 4) rkv_kv_assign_pages(
        const int* __restrict__ slots, const int* __restrict__ blocks, const int* __restrict__ request_ids,
        int* __restrict__ owners, u8* __restrict__ marks, int* __restrict__ errors,
        i64 B, i64 num_requests, i64 num_blocks, i64 epb) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < B; b += warps) {
        if (blocks[b] == -1) continue;                     // padding (warp-uniform)
        int rid;
        const i64 blk = assign_target(slots, blocks, request_ids, b, num_requests, num_blocks, rid);
        bool dup = false;
        if (blk >= 0)
            for (i64 q = lane; q < b; q += 32) {
                int other;
                dup |= assign_target(slots, blocks, request_ids, q, num_requests, num_blocks, other) == blk;
            }
        if (blk < 0 || __any_sync(kFull, dup)) {           // blk is warp-uniform
            if (lane == 0) atomicAdd(errors, 1);
            continue;
        }
        if (lane == 0) owners[blk] = rid;
        for (i64 o = lane; o < epb; o += 32) marks[blk * epb + o] = 0;
    }
}
