// kv_compress.cu: the DeepSeek-V4 KV compressor, one launch from token rows
// (or the decode tail state) to quantized entries in the paged pool
// (docs/kvcache.md "Compressor kernel"; reference: rawkv/reference/kvcache.py).
//
//   rkv_kv_compress<T, I, DECODE, OVERLAP, RG, LAYOUT>
//
// One CTA per (entry, part): blockIdx.x = entry (prefill) or batch row
// (decode); blockIdx.y = 0 the attention entry (d = head_dim, <= 512),
// blockIdx.y = 1 the CSA indexer key (d = 128). The CTA has 128 * RG threads:
// channel-thread tc = threadIdx.x % 128 owns channels c = tc + 128 k (k < d/128,
// so every load of a warp is 32 consecutive elements), row group rg =
// threadIdx.x / 128 owns a contiguous slice of the pooled rows.
//
//   1. pooling, per channel, over R = m (HCA) or 2m (CSA: b-half of window
//      i-1, then a-half of window i) rows, z += ape[row] in prefill:
//        CSA (OVERLAP, R = 2m <= 8, RG == 1): two passes over registers in the
//          reference's order: mx = max z; e_j = expf(z_j - mx); S = sum e_j
//          (row order); out = sum (e_j / S) * v_j (row order). Only expf
//          differs from the reference (exp in float64, rounded once).
//        HCA: online softmax in chunks of 8 rows per row group
//          (running max, S and A = sum e v rescaled by expf(M_old - M_new)
//          when the max grows), row groups combined through shared memory,
//          out = A / S.
//   2. RMSNorm: float64 block sum of squares, r = (float)(1 / sqrt(ms + eps))
//      (float64, as the reference), y = (x * r) * w in float32.
//   3. RoPE on the last rope_dim dims, interleaved pairs, from the host-built
//      table cos/sin[entry] (position entry * m); a pair's partner is in the
//      same thread (even channels per thread) or lane tc ^ 1 (odd).
//   4. indexer only: Walsh-Hadamard in float64 in shared memory, * 1/sqrt(d),
//      rounded to float32.
//   5. one BF16 rounding, then quantize: attention entry -> E4M3 codes of the
//      non-RoPE dims + FP32 scale amax/448 + BF16 RoPE dims; indexer key ->
//      one-level NVFP4 (nvfp4_quantize_block, gs = 1). LAYOUT != 0 (the
//      pool's "model1" layout): the CTA puts the finished entry (key) in
//      shared memory and its first warp writes the record exactly as the
//      layout ops do (kv_layouts.cuh: model1_store_lane, index_store_lane,
//      LAYOUT 1 FP8 keys, 2 MXFP4 keys, 3 MXFP8 keys) into page blk of out_pages
//      (out_index_pages), record entry % epb.
//   6. scatter through block_table[row][entry / epb]; a row outside the
//      block table, an entry id past the table or the RoPE table, a
//      physical block outside [0, num_blocks), or a block not assigned to
//      the row's request (owners[blk] != request_ids[row] or no request:
//      page ownership, kv_cache.cu's locate), is skipped and counted in
//      *errors; written[row] = max(written[row], entry + 1) and
//      marks[dest] = 1 (the entry is written by its block's owner: gathers
//      read only marked entries).
//      Prefill: two (or more) of the row's logical blocks naming one physical
//      block put entries of the launch on one record; the lowest entry of the
//      launch at that record writes it, every other writes nothing and is
//      counted (each CTA scans the row's blocks below its own that hold an
//      entry of the launch).
//      Decode: rows with valid_mask false are skipped silently (and own
//      nothing); an out-of-range slot is counted. Duplicate slots
//      (docs/kvcache.md decision 11, as the state ops): the lowest valid row
//      of a slot owns it; every other valid row of that slot writes nothing
//      and is counted, whether or not the owner flushes (every CTA scans the
//      rows below it, slot_taken_below in kv_layouts.cuh; run-order free).
//      Duplicate entries: among the slots' owners, a lower row that writes
//      the same pool entry owns it; this row writes nothing and is counted
//      (every CTA scans the rows below it with the same decision,
//      decode_target and repeats_a_slot). The flush decision is taken per ROW,
//      identically by both parts, from both states' counts: neither window
//      complete -> skipped silently; both complete (or the one, without an
//      indexer) -> flushed; exactly one complete (the states are out of
//      step, a caller error) -> NOTHING written (an entry without its key,
//      or a key without its entry, would pair new data with stale data) and
//      counted. A flushed row with a negative position is counted.
//      Because both parts decide alike from the same data, every error is
//      one that part 0 meets too: part 0 counts it, once per row.
//
// Compiled with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true.
#include "common.cuh"
#include "nvfp4_common.cuh"
#include "kv_layouts.cuh"
using namespace rkv;

// Shared with Python: rawkv/kernels/kv_compress.py passes them as -D options.
#if !defined(RKV_KVC_CHANNEL_THREADS) || !defined(RKV_KVC_MAX_CPT) || !defined(RKV_KVC_CHUNK)
#error "kv_compress.cu needs the -D constants of rawkv/kernels/kv_compress.py"
#endif

// One part of a compression, passed by value (rawkv/kernels/_decl.py packs
// it at the offsets C gives these fields: tests/guards/test_kernel_structs.py):
// part 0 the attention entry, part 1 the CSA indexer key (all null when the
// pool has none: the launch has no part 1 then).
template <typename T>
struct CompressPart {
    const T* kv;            // prefill: the token rows; decode: the state's a-stream
    const T* z;
    const T* kvb;           // decode: the state's b-stream (CSA); else null
    const T* zb;
    const float* ape;       // prefill: the absolute position embedding; else null
    const float* w;         // the RMSNorm weight
    const int* count;       // decode: the state's row counts; else null
    long long d;            // width: head_dim (part 0), the indexer key's (part 1)
};

// The paged pool a compression writes into, passed by value (as CompressPart).
struct PoolGeometry {
    const int* block_table;     // (bt_rows, bt_stride): each request's physical blocks
    const int* request_ids;     // (bt_rows,): the request of each block-table row
    const int* owners;          // (num_blocks,): the request each block is assigned to
    long long bt_rows;
    long long bt_stride;
    long long num_blocks;
    long long epb;              // entries per block
    long long m;                // rows per entry (the compression ratio)
    int* written;               // (bt_rows,): entries written, per row
    u8* marks;                  // (num_blocks * epb,): 1 where an entry is written
};

namespace {

constexpr int kCT = RKV_KVC_CHANNEL_THREADS;   // channel threads per row group (= indexer key width)
constexpr int kMaxCPT = RKV_KVC_MAX_CPT;       // channels per thread: d <= kCT * kMaxCPT
constexpr int kMaxD = kCT * kMaxCPT;
constexpr int kChunk = RKV_KVC_CHUNK;          // rows held in registers per pass (CSA: 2m <= kChunk)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T>
__device__ __forceinline__ float ld(const T* p) { return to_f32<T>(*p); }

// Arguments of one part (attention entry or indexer key). Row r of the
// a-stream of this work item is a_kv[r * a_stride + c] (already offset to the
// a-half); row r of the b-stream is b_kv[r * b_stride + c]; ape_a / ape_b are
// the matching ape rows (prefill) or null (decode: the state holds z + ape).
template <typename T>
struct Src {
    const T* a_kv; const T* a_z; const T* b_kv; const T* b_z;
    const float* ape_a; const float* ape_b;
    i64 a_stride, b_stride, ape_stride;
    bool has_b;
};

template <typename T>
__device__ __forceinline__ void load_row(const Src<T>& s, int r, int mb, int c, float& v, float& z) {
    if (r < mb) {                                   // b-stream row
        if (s.has_b) {
            v = ld(s.b_kv + r * s.b_stride + c);
            z = ld(s.b_z + r * s.b_stride + c);
            if (s.ape_b) z = z + s.ape_b[r * s.ape_stride + c];
        } else {
            v = 0.0f; z = neg_inf();
        }
    } else {                                        // a-stream row
        const int ra = r - mb;
        v = ld(s.a_kv + ra * s.a_stride + c);
        z = ld(s.a_z + ra * s.a_stride + c);
        if (s.ape_a) z = z + s.ape_a[ra * s.ape_stride + c];
    }
}

// Four consecutive T as float (one 16-byte load for float, 8 for BF16).
template <typename T> __device__ __forceinline__ void ld4(const T* p, float* o);
template <> __device__ __forceinline__ void ld4<float>(const float* p, float* o) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}
template <> __device__ __forceinline__ void ld4<__nv_bfloat16>(const __nv_bfloat16* p, float* o) {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    o[0] = __uint_as_float(a.x << 16); o[1] = __uint_as_float(a.x & 0xFFFF0000u);
    o[2] = __uint_as_float(a.y << 16); o[3] = __uint_as_float(a.y & 0xFFFF0000u);
}

// Row r's channels c0 + k * cs, k < cpt (this thread's): with VEC (cpt == 4,
// cs == 1, every pointer and stride aligned to 4 elements) as one vector
// load per stream, else one load per channel. Same values as load_row.
template <typename T>
__device__ __forceinline__ void load_row_span(const Src<T>& s, int r, int mb, int c0, int cs, int cpt, bool vec,
                                              float (&v)[kMaxCPT], float (&z)[kMaxCPT]) {
    if (vec && kMaxCPT == 4) {
        float* v4 = v;
        float* z4 = z;
        const float* ape;
        if (r < mb) {
            if (!s.has_b) {
#pragma unroll
                for (int k = 0; k < 4; ++k) { v4[k] = 0.0f; z4[k] = neg_inf(); }
                return;
            }
            ld4(s.b_kv + r * s.b_stride + c0, v4);
            ld4(s.b_z + r * s.b_stride + c0, z4);
            ape = s.ape_b ? s.ape_b + r * s.ape_stride + c0 : nullptr;
        } else {
            const int ra = r - mb;
            ld4(s.a_kv + ra * s.a_stride + c0, v4);
            ld4(s.a_z + ra * s.a_stride + c0, z4);
            ape = s.ape_a ? s.ape_a + ra * s.ape_stride + c0 : nullptr;
        }
        if (ape) {
            float a[4];
            ld4(ape, a);
#pragma unroll
            for (int k = 0; k < 4; ++k) z4[k] = z4[k] + a[k];
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < kMaxCPT; ++k)
        if (k < cpt) load_row(s, r, mb, c0 + k * cs, v[k], z[k]);
}

// RN(e / s) for 0 <= e <= 1 <= s <= 8 (a softmax weight): Markstein's
// correction of e * RN(1/s) is exact while nothing underflows (e >= 2^-100
// keeps the quotient and the remainder normal); smaller e (and NaN) take the
// IEEE division. Three instructions instead of a division per weight.
__device__ __forceinline__ float softmax_weight(float e, float s, float y) {
    if (!(e >= 0x1p-100f)) return e / s;
    return markstein_quotient(e, s, y);
}

// ---- block reductions (all threads of the CTA call them) -----------------------
// (any: in, this thread's flag; out, whether any thread's was set: the
// first barrier's reduction, no barrier of its own)
__device__ __forceinline__ double block_sum_d(double v, double* sh, bool& any) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    any = __syncthreads_or(any ? 1 : 0) != 0;
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < nw; ++i) t += sh[i];
    return t;
}

__device__ __forceinline__ float block_max_f(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; ++i) t = fmaxf(t, sh[i]);
    return t;
}

__device__ __forceinline__ bool block_any(bool p) {
    return __syncthreads_or(p ? 1 : 0) != 0;
}

// Whether block `blk` (in range) is assigned to the request of block-table
// row `row` (in range): page ownership (kv_cache.cu's locate).
__device__ __forceinline__ bool owned_by(const int* __restrict__ request_ids, const int* __restrict__ owners,
                                         i64 row, i64 blk) {
    const int rid = request_ids[row];
    return rid > 0 && owners[blk] == rid;
}

// slot_taken_below's question (kv_layouts.cuh) asked by one thread about row
// q (valid, slot in range): whether q repeats a lower row's slot. Only asked
// of a row that would write the entry this CTA writes (rare: a caller error),
// so the serial scan costs nothing in the common case.
template <typename I>
__device__ __forceinline__ bool repeats_a_slot(const u8* __restrict__ valid, const I* __restrict__ slots, i64 q) {
    const I s = slots[q];
    for (i64 r = 0; r < q; ++r)
        if (valid[r] && slots[r] == s) return true;
    return false;
}

// Pool entry row that decode row q would write (the kernel's own decision:
// valid, slot in range, both windows complete, position >= 0, entry inside
// the RoPE table and the block table, block in range and owned by the slot's
// request), or -1. Whether q owns its slot is asked apart (repeats_a_slot).
template <typename I>
__device__ __forceinline__ i64 decode_target(i64 q, const u8* __restrict__ valid, const I* __restrict__ slots,
                                             const I* __restrict__ positions, const int* __restrict__ count0,
                                             const int* __restrict__ count1, const PoolGeometry& pool,
                                             i64 n_slots, i64 n_tab) {
    if (!valid[q]) return -1;
    const i64 s = (i64)slots[q];
    if (s < 0 || s >= n_slots || s >= pool.bt_rows) return -1;
    const bool full0 = (i64)count0[s] == pool.m;
    const bool full1 = count1 != nullptr ? (i64)count1[s] == pool.m : full0;
    const i64 pos = (i64)positions[q];
    if (!full0 || !full1 || pos < 0) return -1;
    const i64 e = pos / pool.m, lb = e / pool.epb;
    if (e >= n_tab || lb >= pool.bt_stride) return -1;
    const i64 blk = (i64)pool.block_table[s * pool.bt_stride + lb];
    if (blk < 0 || blk >= pool.num_blocks || !owned_by(pool.request_ids, pool.owners, s, blk)) return -1;
    return blk * pool.epb + (e - lb * pool.epb);
}

// Prefill: the lowest logical block of the row that holds an entry of this
// launch (entries start_entry ...) at the offset of entry e (in block lb).
__device__ __forceinline__ i64 lowest_block_of_launch(i64 e, i64 lb, i64 epb, i64 start_entry) {
    const i64 in_block = e - lb * epb;
    return start_entry <= in_block ? 0 : (start_entry - in_block + epb - 1) / epb;
}

// One 4-byte word global -> shared memory, in flight until
// wait_async_copies (no register holds it meanwhile).
__device__ __forceinline__ void copy_word_async(int* dst, const int* src) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void wait_async_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Prefill: whether one of this thread's share of the block-table entries
// lb_lo .. lb - 1 of `row` names block blk: thread t's first one (lb_lo + t)
// came ahead by copy_word_async into sh_below[t], the next three are loaded
// together now (one round trip), the rest (past 4 x blockDim.x blocks) in
// turn.
__device__ __forceinline__ bool names_a_lower_block(const PoolGeometry& pool, i64 row, i64 lb, i64 lb_lo, int blk,
                                                    const int* sh_below) {
    const int* bt = pool.block_table + row * pool.bt_stride;
    const i64 l0 = lb_lo + threadIdx.x, n = blockDim.x;
    wait_async_copies();
    bool hit = l0 < lb && sh_below[threadIdx.x] == blk;
    int v[3];
#pragma unroll
    for (int j = 0; j < 3; ++j) v[j] = l0 + (j + 1) * n < lb ? __ldg(bt + l0 + (j + 1) * n) : -1;
#pragma unroll
    for (int j = 0; j < 3; ++j) hit |= v[j] == blk;
    for (i64 l = l0 + 4 * n; l < lb; l += n) hit |= __ldg(bt + l) == blk;
    return hit;
}

// The record of a finished entry (512 float32 in shared memory) / key (128,
// already BF16) in the pool's "model1" layout, written by one warp. Not
// inlined: the pooling registers of the kernel are dead here, and ptxas
// spilled when it allocated both together.
__device__ __noinline__ void model1_record(const float* sh, u8* page, i64 off, i64 page_size) {
    const int lane = threadIdx.x & 31;
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = rkvlay::bf16_round(sh[lane * 16 + i]);
    rkvlay::model1_store_lane(v, lane, page, off, page_size);
}

template <int KEY>
__device__ __noinline__ void key_record(const float* sh, u8* page, i64 off, i64 page_size) {
    const int lane = threadIdx.x & 31;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = sh[lane * 4 + i];
    rkvlay::index_store_lane<KEY>(v, lane, page, off, page_size);
}

// CTAs per SM the register budget is set for (CSA, one row group): prefill is
// latency-bound (each CTA loads its rows, then computes), so as many CTAs as
// fit without spills (ptxas: 64 registers for the model1 records on every
// arch; the rawkv layout 80 below sm_100, where sm_100 / sm_120 code spills,
// so 128 there); decode launches are small and keep 255.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kRawkvLayoutMinBlocks = 4;
#else
constexpr int kRawkvLayoutMinBlocks = 6;
#endif
constexpr int compress_min_blocks(bool decode, int rg, int layout) {
    return rg != 1 || decode ? 1 : layout != 0 ? 8 : kRawkvLayoutMinBlocks;
}

}  // namespace

template <typename T, typename I, bool DECODE, bool OVERLAP, int RG, int LAYOUT>
__global__ void __launch_bounds__(kCT * RG, compress_min_blocks(DECODE, RG, LAYOUT)) rkv_kv_compress(
    const CompressPart<T> p0, const CompressPart<T> p1,
    // part 0's outputs (the attention entry), part 1's (the CSA indexer key; null when absent)
    u8* __restrict__ out_fp8, float* __restrict__ out_scale, __nv_bfloat16* __restrict__ out_rope,
    u8* __restrict__ out_iq, u8* __restrict__ out_isf,
    // RoPE table (n_tab, 2, rope_dim / 2) float32: cos, sin of entry e at position e * m
    const float* __restrict__ rope_tab, long long n_tab, long long rope_dim,
    const PoolGeometry pool,
    // decode: batch rows
    const u8* __restrict__ valid, const I* __restrict__ slots, const I* __restrict__ positions,
    long long n_slots,
    // prefill: block-table row, first entry id, context windows before the first entry
    long long slot, long long start_entry, long long pre,
    int* __restrict__ errors, double eps,
    // LAYOUT != 0: the pool's pages (MODEL1 entries, indexer keys) and their strides
    u8* __restrict__ out_pages, u8* __restrict__ out_index_pages, long long page_bytes,
    long long index_page_bytes)
{
    static_assert(!OVERLAP || RG == 1, "CSA pools 2m <= 8 rows per thread, one row group");
    __shared__ float sh_part[RG > 1 ? RG - 1 : 1][3][kMaxD];
    __shared__ double sh_red[(kCT * RG) / 32];
    __shared__ float sh_redf[(kCT * RG) / 32];
    __shared__ double sh_had[kCT];
    __shared__ float sh_key[kCT];
    __shared__ float sh_ent[LAYOUT != 0 ? kMaxD : 1];
    __shared__ int sh_below[DECODE ? 1 : kCT * RG];   // prefill: a block-table entry below this entry's

    const int part = blockIdx.y;
    const bool count_errors = part == 0;
    const int tc = threadIdx.x % kCT;
    const int rg = threadIdx.x / kCT;
    const i64 n = blockIdx.x;

    const i64 d = part == 0 ? p0.d : p1.d;
    // A thread's channels are c0 + k * cs, k < cpt: consecutive (cs = 1) for an
    // even cpt, so a RoPE pair (c, c ^ 1) is in one thread and 4 channels are
    // one vector load; for an odd cpt (the indexer's 1) every 128th, so the
    // pair is in lanes tc, tc ^ 1.
    const int cpt = (int)(d / kCT);
    const int cs = (cpt & 1) ? kCT : 1;
    const int c0 = (cpt & 1) ? tc : tc * cpt;
    const i64 w = OVERLAP ? 2 * d : d;              // width of a token row / a-stream row
    const i64 off_a = OVERLAP ? d : 0;              // a-half offset in a row

    // ---- which entry, from where, to where (uniform over the CTA) ----
    i64 row, e;
    Src<T> src;
    src.ape_stride = w;
    if constexpr (DECODE) {
        if (!valid[n]) return;
        const i64 s = (i64)slots[n];
        // the host makes the states' rows equal the block table's; both bounds
        // are checked anyway, so no slot reads past either
        if (s < 0 || s >= n_slots || s >= pool.bt_rows) {
            if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
            return;
        }
        // A lower valid row names this slot: it owns the slot, this row is
        // skipped and counted whatever the windows and the position (one
        // window is never pooled into two entries). CTA-uniform, as above.
        if (slot_taken_below</*NULL_IS_ALL=*/false>(valid, slots, n, s)) {
            if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
            return;
        }
        // Nothing in this launch writes the counts: every thread of both
        // parts reads the same values, so the decision is CTA- and part-uniform.
        const bool full0 = (i64)p0.count[s] == pool.m;
        const bool full1 = p1.count != nullptr ? (i64)p1.count[s] == pool.m : full0;
        if (!full0 && !full1) return;               // window not complete: nothing to flush
        if (full0 != full1) {                       // states out of step: write neither part
            if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
            return;
        }
        const i64 pos = (i64)positions[n];
        if (pos < 0) {
            if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
            return;
        }
        row = s;
        e = pos / pool.m;
        const T* kv = part == 0 ? p0.kv : p1.kv;
        const T* z = part == 0 ? p0.z : p1.z;
        src.a_kv = kv + s * pool.m * w + off_a;
        src.a_z = z + s * pool.m * w + off_a;
        src.a_stride = w;
        src.b_kv = (part == 0 ? p0.kvb : p1.kvb) + s * pool.m * d;
        src.b_z = (part == 0 ? p0.zb : p1.zb) + s * pool.m * d;
        src.b_stride = d;
        src.has_b = OVERLAP;
        src.ape_a = nullptr;
        src.ape_b = nullptr;
    } else {
        row = slot;
        e = start_entry + n;
        const T* kv = part == 0 ? p0.kv : p1.kv;
        const T* z = part == 0 ? p0.z : p1.z;
        const float* ape = part == 0 ? p0.ape : p1.ape;
        const i64 wa = n + pre;                     // window of the a-rows, in kv rows / m
        src.a_kv = kv + wa * pool.m * w + off_a;
        src.a_z = z + wa * pool.m * w + off_a;
        src.a_stride = w;
        src.has_b = OVERLAP && wa >= 1;
        src.b_kv = kv + (wa - 1) * pool.m * w;      // b-half = [0:d] of the previous window
        src.b_z = z + (wa - 1) * pool.m * w;
        src.b_stride = w;
        src.ape_a = ape ? ape + off_a : nullptr;
        src.ape_b = ape;
    }
    const i64 lb = e / pool.epb;
    if (row < 0 || row >= pool.bt_rows || e >= n_tab || lb >= pool.bt_stride) {
        if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
        return;
    }
    const i64 blk = (i64)pool.block_table[row * pool.bt_stride + lb];
    if (blk < 0 || blk >= pool.num_blocks || !owned_by(pool.request_ids, pool.owners, row, blk)) {
        if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
        return;
    }
    const i64 dest = blk * pool.epb + (e - lb * pool.epb);
    // vector loads: 4 channels a thread and every row start 4-element aligned
    // (uniform over the CTA)
    const u64 align_bits = (u64)src.a_kv | (u64)src.a_z | (OVERLAP ? (u64)src.b_kv | (u64)src.b_z : 0ull);
    const u64 ape_bits = (u64)src.ape_a | (u64)src.ape_b;
    const bool vec = cpt == 4 && (align_bits & (4 * sizeof(T) - 1)) == 0 && (ape_bits & 15) == 0 &&
                     ((src.a_stride | (OVERLAP ? src.b_stride : 0) | src.ape_stride) & 3) == 0;
    // Prefill: two logical blocks of the row naming one physical block (an
    // engine's in-place table write) put two entries of this launch on one
    // record; the lower one writes it, this one writes nothing and is counted,
    // as in the reference. The blocks to look at are those below this entry's
    // that hold an entry of this launch at its offset. Each thread's first
    // one is copied to shared memory now, in flight with the pooling's loads
    // and holding no register; the comparison waits for the RMSNorm's
    // barrier, which reduces it (names_a_lower_block). Loaded and compared
    // before the pooling, the scan cost CSA prefill 16-29%
    // (docs/attempts/2026-11-29-kv-compress-prefill-duplicate-blocks.patch);
    // this way 3-5% at 128K tokens in one launch (docs/kvcache.md, decision 9).
    if constexpr (!DECODE) {
        const i64 l0 = lowest_block_of_launch(e, lb, pool.epb, start_entry) + threadIdx.x;
        if (l0 < lb) copy_word_async(&sh_below[threadIdx.x], pool.block_table + row * pool.bt_stride + l0);
    }
    if constexpr (DECODE) {
        bool hit = false;
        for (i64 q = threadIdx.x; q < n; q += blockDim.x)
            hit |= decode_target(q, valid, slots, positions, p0.count, p1.count, pool, n_slots, n_tab) == dest &&
                   !repeats_a_slot(valid, slots, q);   // a slot's repeat writes nothing, claims nothing
        if (block_any(hit)) {                       // a lower row owns this entry
            if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
            return;
        }
    }

    // ---- 1. softmax pooling ----
    const int mb = OVERLAP ? (int)pool.m : 0;
    const int R = mb + (int)pool.m;
    float x[kMaxCPT];
#pragma unroll
    for (int k = 0; k < kMaxCPT; ++k) x[k] = 0.0f;

    if constexpr (OVERLAP) {
        // CSA (R = 2m <= 8, checked on the host): two passes over registers, in
        // the reference's order
        float zv[kChunk][kMaxCPT], vv[kChunk][kMaxCPT];
#pragma unroll
        for (int j = 0; j < kChunk; ++j)
            if (j < R) load_row_span(src, j, mb, c0, cs, cpt, vec, vv[j], zv[j]);
#pragma unroll
        for (int k = 0; k < kMaxCPT; ++k) {
            if (k >= cpt) continue;
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < kChunk; ++j) if (j < R) mx = fmaxf(mx, zv[j][k]);
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < kChunk; ++j)
                if (j < R) { zv[j][k] = expf(zv[j][k] - mx); s = s + zv[j][k]; }
            const float y = __frcp_rn(s);
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < kChunk; ++j)
                if (j < R) acc = acc + softmax_weight(zv[j][k], s, y) * vv[j][k];
            x[k] = acc;
        }
    } else {
        // online softmax over this row group's slice, 8 rows per pass
        const int per = (R + RG - 1) / RG;
        const int r0 = rg * per;
        const int r1 = min(R, r0 + per);
        float M[kMaxCPT], S[kMaxCPT], A[kMaxCPT];
#pragma unroll
        for (int k = 0; k < kMaxCPT; ++k) { M[k] = neg_inf(); S[k] = 0.0f; A[k] = 0.0f; }
        for (int rb = r0; rb < r1; rb += kChunk) {
            float zv[kChunk][kMaxCPT], vv[kChunk][kMaxCPT];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
#pragma unroll
                for (int k = 0; k < kMaxCPT; ++k) { vv[j][k] = 0.0f; zv[j][k] = neg_inf(); }
                if (rb + j < r1) load_row_span(src, rb + j, mb, c0, cs, cpt, vec, vv[j], zv[j]);
            }
#pragma unroll
            for (int k = 0; k < kMaxCPT; ++k) {
                float mx = M[k];
#pragma unroll
                for (int j = 0; j < kChunk; ++j) mx = fmaxf(mx, zv[j][k]);
                if (mx == neg_inf()) continue;          // nothing but empty rows so far
                if (mx != M[k]) {
                    const float f = M[k] == neg_inf() ? 0.0f : expf(M[k] - mx);
                    S[k] = S[k] * f;
                    A[k] = A[k] * f;
                    M[k] = mx;
                }
#pragma unroll
                for (int j = 0; j < kChunk; ++j) {
                    const float ej = expf(zv[j][k] - mx);   // empty rows: expf(-inf) = 0
                    S[k] = S[k] + ej;
                    A[k] = A[k] + ej * vv[j][k];
                }
            }
        }
        if (RG > 1) {
            if (rg > 0) {
#pragma unroll
                for (int k = 0; k < kMaxCPT; ++k) {
                    if (k >= cpt) continue;
                    sh_part[rg - 1][0][c0 + k * cs] = M[k];
                    sh_part[rg - 1][1][c0 + k * cs] = S[k];
                    sh_part[rg - 1][2][c0 + k * cs] = A[k];
                }
            }
            __syncthreads();
            if (rg == 0) {
#pragma unroll
                for (int k = 0; k < kMaxCPT; ++k) {
                    if (k >= cpt) continue;
                    const int c = c0 + k * cs;
                    float mt = M[k];
                    for (int g = 0; g < RG - 1; ++g) mt = fmaxf(mt, sh_part[g][0][c]);
                    float st = 0.0f, at = 0.0f;
                    if (mt != neg_inf()) {
                        if (M[k] != neg_inf()) {
                            const float f = expf(M[k] - mt);
                            st = S[k] * f; at = A[k] * f;
                        }
                        for (int g = 0; g < RG - 1; ++g) {
                            const float mg = sh_part[g][0][c];
                            if (mg == neg_inf()) continue;
                            const float f = expf(mg - mt);
                            st = st + sh_part[g][1][c] * f;
                            at = at + sh_part[g][2][c] * f;
                        }
                    }
                    S[k] = st; A[k] = at;
                }
            }
        }
        if (rg == 0) {
#pragma unroll
            for (int k = 0; k < kMaxCPT; ++k) x[k] = k < cpt ? A[k] / S[k] : 0.0f;
        }
    }

    // ---- 2. RMSNorm (only rg == 0 holds channels; the others add 0) ----
    const float* wt = part == 0 ? p0.w : p1.w;
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < kMaxCPT; ++k)
        if (rg == 0 && k < cpt) ss += (double)x[k] * (double)x[k];
    // (the duplicate-block question's answer comes with the sum's barrier)
    bool dup = false;
    if constexpr (!DECODE) dup = names_a_lower_block(pool, row, lb, lowest_block_of_launch(e, lb, pool.epb,
                                                                                          start_entry),
                                                     (int)blk, sh_below);
    ss = block_sum_d(ss, sh_red, dup);
    if (dup) {                                      // a lower entry of this launch owns the record
        if (count_errors && threadIdx.x == 0) atomicAdd(errors, 1);
        return;
    }
    const float r = (float)(1.0 / sqrt(ss / (double)d + eps));
#pragma unroll
    for (int k = 0; k < kMaxCPT; ++k)
        if (rg == 0 && k < cpt) x[k] = (x[k] * r) * wt[c0 + k * cs];

    // ---- 3. RoPE on the last rope_dim dims: pairs (c, c ^ 1), in this thread
    // (even cpt) or in lanes tc, tc ^ 1 (odd cpt) ----
    const i64 rbase = d - rope_dim;
    const i64 half = rope_dim / 2;
    if (cpt & 1) {                                   // cpt is CTA-uniform: every lane shuffles
#pragma unroll
        for (int k = 0; k < kMaxCPT; ++k) {
            const float other = __shfl_xor_sync(0xffffffffu, x[k], 1);
            const i64 c = c0 + k * cs;
            if (rg == 0 && k < cpt && c >= rbase) {
                const i64 p = (c - rbase) >> 1;
                const float cs_ = rope_tab[(e * 2) * half + p];
                const float sn = rope_tab[(e * 2 + 1) * half + p];
                if (((c - rbase) & 1) == 0) x[k] = x[k] * cs_ - other * sn;   // even' = e cos - o sin
                else x[k] = x[k] * cs_ + other * sn;                            // odd'  = o cos + e sin
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k + 1 < kMaxCPT; k += 2) {
            const i64 c = c0 + k;                    // even (rbase and c0 are)
            if (rg == 0 && k < cpt && c >= rbase) {
                const i64 p = (c - rbase) >> 1;
                const float cs_ = rope_tab[(e * 2) * half + p];
                const float sn = rope_tab[(e * 2 + 1) * half + p];
                const float ev = x[k], od = x[k + 1];
                x[k] = ev * cs_ - od * sn;
                x[k + 1] = od * cs_ + ev * sn;
            }
        }
    }

    if (LAYOUT != 0 && part == 0) {
        // ---- 5. the finished entry (d == 512 == kMaxD, checked on the host) -> MODEL1 record ----
        if (rg == 0) {
#pragma unroll
            for (int k = 0; k < kMaxCPT; ++k) if (k < cpt) sh_ent[c0 + k * cs] = x[k];
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            model1_record(sh_ent, out_pages + blk * page_bytes, e - lb * pool.epb, pool.epb);
            if (threadIdx.x == 0) {
                atomicMax(pool.written + row, (int)(e + 1));
                pool.marks[dest] = 1;
            }
        }
    } else if (part == 0) {
        // ---- 5. one BF16 rounding; FP8 entry ----
        const i64 nope = d - rope_dim;
        float amax = 0.0f;
        bool bad = false;
#pragma unroll
        for (int k = 0; k < kMaxCPT; ++k) {
            x[k] = __bfloat162float(__float2bfloat16_rn(x[k]));
            const i64 c = c0 + k * cs;
            if (rg == 0 && k < cpt && c < nope) {
                const float a = fabsf(x[k]);
                if (a <= 3.402823466e38f) amax = fmaxf(amax, a);
                else bad = true;
            }
        }
        amax = block_max_f(amax, sh_redf);
        bad = block_any(bad);
        const float s = bad ? __int_as_float(0x7fc00000) : fp8_entry_scale(amax);
        if (rg == 0) {
#pragma unroll
            for (int k = 0; k < kMaxCPT; ++k) {
                const i64 c = c0 + k * cs;
                if (k >= cpt) continue;
                if (c < nope) out_fp8[dest * nope + c] = bad ? (u8)0 : e4m3_encode(x[k] / s);
                else out_rope[dest * rope_dim + (c - nope)] = __float2bfloat16_rn(x[k]);
            }
            if (tc == 0) {
                out_scale[dest] = s;
                // part 1 writes the key of this entry in the same launch; readers
                // come in later launches
                atomicMax(pool.written + row, (int)(e + 1));
                pool.marks[dest] = 1;
            }
        }
    } else {
        // ---- 4. Hadamard (float64), 5. BF16, one-level NVFP4 ----
        // part 1 has d == 128 == kCT, RG == 1: one channel per thread.
        sh_had[tc] = (double)x[0];
        __syncthreads();
        for (int len = 1; len < kCT; len <<= 1) {
            if (tc < kCT / 2) {
                const int i = (tc / len) * 2 * len + (tc % len);
                const double a = sh_had[i], b = sh_had[i + len];
                sh_had[i] = a + b;
                sh_had[i + len] = a - b;
            }
            __syncthreads();
        }
        const float y = (float)(sh_had[tc] * (1.0 / sqrt((double)kCT)));
        if (LAYOUT != 0) {
            // -> the key's record (FP8, MXFP4 or MXFP8: KEY = LAYOUT - 1), one warp, 4 dims per lane
            sh_key[tc] = rkvlay::bf16_round(y);
            __syncthreads();
            if (tc < 32)
                key_record<LAYOUT == 0 ? 0 : LAYOUT - 1>(sh_key, out_index_pages + blk * index_page_bytes, e - lb * pool.epb, pool.epb);
            return;
        }
        sh_key[tc] = __bfloat162float(__float2bfloat16_rn(y));
        __syncthreads();
        if (tc < kCT / 16) {
            float v[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = sh_key[tc * 16 + i];
            uint2 packed;
            const u8 sf = nvfp4_quantize_block(v, 1.0f, packed);
            u8* q = out_iq + dest * (kCT / 2) + tc * 8;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                q[i] = (u8)(packed.x >> (8 * i));
                q[4 + i] = (u8)(packed.y >> (8 * i));
            }
            out_isf[dest * (kCT / 16) + tc] = sf;
        }
    }
}

// Instantiations are declared in rawkv/kernels/kv_compress.py.
