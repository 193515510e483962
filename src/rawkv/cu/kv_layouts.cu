// kv_layouts.cu: the byte layouts the ecosystem's DeepSeek-V4 kernels read:
// FlashMLA's MODEL1_FP8Sparse attention entries (also the sliding-window
// tokens), DeepGEMM's paged FP8, MXFP4 and MXFP8 indexer keys, the gather of MODEL1
// entries by FlashMLA indices and the top-k -> indices_in_kvcache bridge.
//
// rawkv/reference/kvcache/layouts.py defines every byte; docs/kvcache.md
// ("Ecosystem layouts") gives the layouts, the sources and the decisions.
// Every kernel runs on the caller's stream, allocates nothing and never
// synchronizes (a decode step captures into one CUDA graph). Device-side
// indices are bounds-checked: index -1 is padding (skipped, not counted), any
// other out-of-range index skips its row and adds 1 to errors[0] (errors may
// be null: nothing is counted).
//
// Split page of P records (all four layouts):
//   [P x DATA bytes][P x SCALE bytes][zero pad], page stride page_bytes
//   MODEL1     DATA 576 = 448 E4M3 codes + 64 BF16,  SCALE 8 = 7 UE8M0 + 0
//   FP8 key    DATA 128 E4M3 codes,                  SCALE 4 = float32
//   MXFP4 key  DATA 64 = 128 E2M1 (2j low nibble),   SCALE 4 = 4 UE8M0
//   MXFP8 key  DATA 128 E4M3 codes,                  SCALE 4 = 4 UE8M0
// Host-side checks guarantee: the cache base is 16-byte aligned (MODEL1) or
// 4-byte aligned (keys), rows are 16-byte aligned, num_pages * P < 2^31.
#include "kv_layouts.cuh"
using namespace rkv;
using namespace rkvlay;

namespace {

// Where row r goes (reference layouts.locate): 0 = record (page, off);
// 1 = padding (-1), skipped, not counted; 2 = out of range, counted.
// offsets == nullptr: slots are slot ids page * P + off; else page ids.
template <typename TID>
__device__ __forceinline__ int locate(const TID* __restrict__ slots, const int* __restrict__ offsets,
                                      i64 r, i64 num_pages, i64 page_size, i64& page, i64& off) {
    const i64 s = (i64)slots[r];
    if (s == -1) return 1;
    if (offsets == nullptr) {
        if (s < 0 || s >= num_pages * page_size) return 2;
        page = (u32)s / (u32)page_size;                   // host: num_pages * P < 2^31
        off = s - page * page_size;
    } else {
        const i64 o = offsets[r];
        if (s < 0 || s >= num_pages || o < 0 || o >= page_size) return 2;
        page = s;
        off = o;
    }
    return 0;
}

__device__ __forceinline__ void count_error(int* errors) {
    if (errors != nullptr) atomicAdd(errors, 1);
}

// The record of row r (locate), counting a bad one (lane 0); false: skip the row.
template <typename TID>
__device__ __forceinline__ bool row_record(const TID* __restrict__ slots, const int* __restrict__ offsets,
                                           int* errors, i64 r, i64 num_pages, i64 page_size, int lane,
                                           i64& page, i64& off) {
    const int where = locate(slots, offsets, r, num_pages, page_size, page, off);
    if (where == 2 && lane == 0) count_error(errors);
    return where == 0;
}

__device__ __forceinline__ i64 first_warp() { return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }
__device__ __forceinline__ i64 grid_warps() { return (i64)gridDim.x * (blockDim.x >> 5); }

}  // namespace

// ===========================================================================
// MODEL1 store (entries and the window insert): one warp per row,
// grid-stride over rows. Row r (512 TIN values) goes to the record of
// locate(slots, offsets, r). Lane l loads dims 16l .. 16l+15 (BF16-rounded)
// and model1_store_lane (kv_layouts.cuh) writes the record.
// ===========================================================================
template <typename TIN, typename TID>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_model1_store(
        const TIN* __restrict__ rows, const TID* __restrict__ slots, const int* __restrict__ offsets,
        u8* __restrict__ cache, int* __restrict__ errors,
        i64 N, i64 num_pages, i64 page_size, i64 page_bytes) {
    const int lane = threadIdx.x & 31;
    for (i64 r = first_warp(); r < N; r += grid_warps()) {     // warp-uniform
        i64 page = 0, off = 0;
        if (!row_record(slots, offsets, errors, r, num_pages, page_size, lane, page, off)) continue;
        float v[16];
        load_bf16_rounded<16>(rows + r * kEntry + lane * 16, v);
        model1_store_lane(v, lane, cache + page * page_bytes, off, page_size);
    }
}

// ===========================================================================
// Indexer key store, one warp per key, 4 dims per lane (index_store_lane,
// kv_layouts.cuh): KEY kKeyFP8 is DeepGEMM's paged FP8 key (SM90, SM100),
// kKeyMXFP4 / kKeyMXFP8 its SM100 paged MXFP4 / MXFP8 key.
// ===========================================================================
template <typename TIN, typename TID, int KEY>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_index_store(
        const TIN* __restrict__ rows, const TID* __restrict__ slots, const int* __restrict__ offsets,
        u8* __restrict__ cache, int* __restrict__ errors,
        i64 N, i64 num_pages, i64 page_size, i64 page_bytes) {
    const int lane = threadIdx.x & 31;
    for (i64 r = first_warp(); r < N; r += grid_warps()) {
        i64 page = 0, off = 0;
        if (!row_record(slots, offsets, errors, r, num_pages, page_size, lane, page, off)) continue;
        float v[4];
        load_bf16_rounded<4>(rows + r * RKV_LAY_INDEX_DIM + lane * 4, v);
        index_store_lane<KEY>(v, lane, cache + page * page_bytes, off, page_size);
    }
}

// ===========================================================================
// MODEL1 gather by FlashMLA indices (page * P + offset): one warp per output
// row, 16 dims per lane. Lanes 0..27: one 16-byte code load and the tile's
// scale byte, e4m3(code) * 2^(byte - 127) in float32; lanes 28..31: 16 BF16
// RoPE dims (two 16-byte loads). Each lane stores its 16 outputs as TO.
// Index -1: zero row, not counted; outside [0, num_pages * P): zero row,
// errors += 1.
// ===========================================================================
template <typename TO>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_model1_gather(
        const u8* __restrict__ cache, const int* __restrict__ indices, TO* __restrict__ out,
        int* __restrict__ errors, i64 R, i64 num_pages, i64 page_size, i64 page_bytes) {
    const int lane = threadIdx.x & 31;
    for (i64 r = first_warp(); r < R; r += grid_warps()) {
        i64 page = 0, off = 0;
        float v[16];
        if (!row_record(indices, (const int*)nullptr, errors, r, num_pages, page_size, lane, page, off)) {
#pragma unroll
            for (int i = 0; i < 16; ++i) v[i] = 0.0f;
        } else {
            model1_load_lane(cache + page * page_bytes, off, page_size, lane, v);
        }
        store16_as(out + r * kEntry + lane * 16, v);
    }
}

// ===========================================================================
// Bridge: logical top-k ids -> FlashMLA indices_in_kvcache (int32), one
// thread per id, grid-stride over B * per_row. Id t belongs to request
// b = t / per_row, which reads block-table row slots[b] (b when slots is
// null) of table (table_rows, max_blocks):
//   out = table[row, e / P] * P + e % P.
// e == -1 -> -1, not counted. e < -1, e >= n_entries[b] (when given),
// e / P >= max_blocks, a row outside [0, table_rows) or a block id outside
// [0, num_pages) -> -1, errors += 1. Host: B * per_row and max_blocks * P
// below 2^31, num_pages * P <= 2^31 - 1.
// ===========================================================================
template <typename TID>
__global__ void __launch_bounds__(RKV_LAY_BLOCK) rkv_topk_to_kvcache(
        const TID* __restrict__ ids, const int* __restrict__ table, const int* __restrict__ slots,
        const int* __restrict__ n_entries, int* __restrict__ out, int* __restrict__ errors,
        i64 B, i64 per_row, i64 table_rows, i64 max_blocks, i64 num_pages, i64 page_size) {
    const i64 total = B * per_row;
    for (i64 t = global_thread(); t < total; t += grid_threads()) {
        const i64 e = (i64)ids[t];
        int res = -1;
        if (e != -1) {
            const i64 b = (u32)t / (u32)per_row;
            const i64 row = slots != nullptr ? (i64)slots[b] : b;
            const bool in_range = row >= 0 && row < table_rows && e >= 0 && e < max_blocks * page_size &&
                                  (n_entries == nullptr || e < (i64)n_entries[b]);
            if (in_range) {
                const i64 lb = (u32)e / (u32)page_size;
                const i64 blk = table[row * max_blocks + lb];
                if (blk >= 0 && blk < num_pages) res = (int)(blk * page_size + (e - lb * page_size));
            }
            if (res < 0) count_error(errors);
        }
        out[t] = res;
    }
}
