// gemm_fp4_sm90.cu: the grouped FP4-weight GEMM on Hopper's wgmma (sm_90a).
//
// Same operation, arguments and packed weights as gemm_fp4.cu (docs/gemm.md):
// out[t, g, n] = sum_k x[t, g, k] * w[g, n, k] (batched), or rows sorted by
// expert with offsets (ragged). A block computes BM = 256 or 128 output
// features (16 or 8 row tiles) x BN tokens (64 or 128; 256 with BM = 128
// and TMA activations), one 64-column chunk per pipeline stage.
//
// Warp specialization (384 threads, three warpgroups):
// * warpgroups 0 and 1 consume: each owns BM / 2 features, BM / 128 m64
//   wgmma tiles. Warp w of warpgroup c holds row tiles c BM / 32 + 4 m + w;
//   a lane (q, t)'s wgmma A fragments of a row tile and chunk are word t of
//   the 16-byte records of lanes (q, 0..3) (gather_record: step s's word
//   holds its rows' physical columns 16s + 2t + {0, 1, 8, 9}; docs/gemm.md,
//   "Packed form"), dequantized in registers as the mma.sync kernel does,
//   with the factors of block s for step s (block_factors: two integer
//   operations per factor from the packed scale bytes);
// * warpgroup 2 produces: its 128 threads bring each stage's packed codes
//   and scales with cp.async (16 bytes a copy, 36 per row tile), bring the
//   activation tile (16-bit activations by one TMA copy where the view
//   allows it, else loaded and stored by the threads), and arrive on the
//   stage's "full" mbarrier.
//
// The B operand (activations) is K-major with the 128-byte swizzle: token
// row n of a stage is 128 bytes (64 columns), its 16-byte unit u (physical
// columns 8u .. 8u + 7, in order) stored at unit u ^ (n % 8): k16 step s is
// the physical columns 16s .. 16s + 15 (units 2s, 2s + 1), what TMA's
// 128-byte swizzle writes.
//
// Determinism: each output is one warpgroup's FP32 accumulation over the
// chunks in order, the k16 steps in order: the same bits on every run.
//
// Split K (rkv_gemm_fp4_sm90_splitk, batched calls whose grid would leave
// SMs idle): a cluster of KSPLIT blocks shares one output tile, block r
// accumulating the r-th of KSPLIT equal runs of chunks. The blocks other than
// rank 0 leave their FP32 accumulators in their own shared memory; rank 0
// reads them over the cluster's distributed shared memory and adds them to
// its own in rank order, then writes the tile: a fixed order, no atomics, no
// workspace, so the same bits on every run (not the same bits as one block
// over all of K: the sum is grouped differently).
#include "gemm_fp4.cuh"
#include "sm90.cuh"
#include "wgmma_rs.cuh"
using namespace rkv;

namespace {

constexpr int kThreads = 384;
constexpr int kCodeBytes = 512;          // one row tile, one chunk (32 lanes x 16 B)
constexpr int kScaleBytes = 64;          // its scales (32 lanes x 2 B)

template <int N, bool F16>
__device__ __forceinline__ void wgmma_step(float (&d)[N / 2], const u32 (&a)[4], u64 desc) {
    if constexpr (F16) wgmma_k16_f16<N>(d, a, desc);
    else wgmma_k16_bf16<N>(d, a, desc);
}

}  // namespace

// A tensor map (the driver's CUtensorMap: 128 bytes, 64-byte aligned),
// passed by value as a __grid_constant__ parameter so that its address is
// the parameter's: the 16-bit activations' map (rawkv.gemm.tma), or zeros
// when the producer's threads copy the tile (act_tma == 0).
struct alignas(64) TmaMap {
    u64 w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15;
};

template <int ACT, bool MX, int BN, int STAGES, int BM, int KSPLIT>
__device__ __forceinline__ void gemm_sm90(
    const u8* __restrict__ wq, const u8* __restrict__ wsf, const float* __restrict__ wgs,
    const u8* __restrict__ x, const u8* __restrict__ xsf, const float* __restrict__ xgs,
    i64 xs_t, i64 xs_g, i64 ss_t, i64 ss_g, i64 gs_t, i64 gs_g,
    __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors,
    const TmaMap& xmap, int act_tma) {
    constexpr bool F16 = ACT == 1;
    // BM output features per block: 256 (each consumer warpgroup two m64
    // tiles) or 128 (one, for grids too small to fill the GPU with 256).
    static_assert(BM == 128 || BM == 256, "BM is 128 or 256");
    constexpr int kBM = BM;
    constexpr int kTiles = BM / 16;          // packed row tiles per block
    constexpr int kMT = BM / 128;            // m64 tiles per consumer warpgroup
    constexpr int kWStage = kTiles * (kCodeBytes + kScaleBytes);
    constexpr int kBStage = BN * 128;    // BN token rows of 64 16-bit columns
    // The 256-token tile (BM = 128) takes its activations by TMA only: the
    // producer threads' path would hold 256 token rows in registers.
    constexpr bool kTmaOnly = BN > 128;
    static_assert(!kTmaOnly || (BM == 128 && ACT != 2), "the 256-token tile is BM = 128, 16-bit activations");
    // Registers per thread of the producer and the consumers after
    // setmaxnreg: 128 x P + 256 x C must stay at the launch's 384 x 168 (an
    // increase past it never returns). The TMA-only producer needs few; the
    // 256-token tile's consumers hold 128 accumulators.
    constexpr int kProducerRegs = kTmaOnly ? 56 : 120;
    constexpr int kConsumerRegs = kTmaOnly ? 224 : 192;
    static_assert(128 * kProducerRegs + 256 * kConsumerRegs == kThreads * 168, "the register split");
    static_assert(BN % 8 == 0 && kBStage % 1024 == 0, "B stages must stay 1024-byte aligned");
    __shared__ int s_off[RKV_GEMM_MAX_SEGMENTS];
    // Split K: rank 0's "the partial sums are ready" (every consumer thread
    // of the other blocks arrives) and each other block's "rank 0 has read
    // them" (rank 0's consumer threads arrive).
    __shared__ __align__(8) u64 s_split_bar[2];
    extern __shared__ u8 s_dyn[];
    // B stages first (1024-byte aligned for the swizzle), then the weight
    // stages, then the mbarriers.
    u8* smem = reinterpret_cast<u8*>((reinterpret_cast<size_t>(s_dyn) + 1023) & ~size_t(1023));
    u8* s_b = smem;
    u8* s_w = smem + STAGES * kBStage;
    const u32 bar_full = smem_u32(s_w + STAGES * kWStage);
    const u32 bar_empty = bar_full + 8 * STAGES;

    static_assert(KSPLIT == 1 || (BM / 128) * BN * 128 * 4 <= STAGES * (kBStage + kWStage),
                  "split K keeps the partial sums in the stages' shared memory");
    const int row_block = blockIdx.x / KSPLIT;
    const int split = blockIdx.x % KSPLIT;     // the block's rank in its cluster
    int g, t0, t1;
    if (!block_tokens(offsets, experts, tokens, BN, s_off, errors, out, os_t, n, row_block * kBM, kBM, g, t0, t1))
        return;

    const int tiles16 = (n + 15) / 16, chunks = (k + 63) / 64;
    // The block's run of chunks: all of them, or its KSPLIT-th.
    const int per_split = (chunks + KSPLIT - 1) / KSPLIT;
    const int c_beg = min(chunks, split * per_split), c_end = min(chunks, c_beg + per_split);
    const int tile0 = row_block * kTiles;                  // first row tile of the block
    const int live_tiles = min(kTiles, tiles16 - tile0);   // row tiles that exist

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 128 + 4);  // each producer thread's copies + the 4 producer warps
            mbar_init(bar_empty + 8 * s, 8);       // the 8 consumer warps
        }
        if (KSPLIT > 1) {
            mbar_init(smem_u32(&s_split_bar[0]), (KSPLIT - 1) * 256);
            mbar_init(smem_u32(&s_split_bar[1]), 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // (Split K: the other blocks' barriers are initialized before anyone
    // arrives on them.)
    if (KSPLIT > 1) cluster_sync();
    else __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 2) {
        // ---------------- producer ----------------
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
        const int p = threadIdx.x - 256;
        const int plane = p & 31, slot = p & 3;
        // Everything per chunk below is an address step from what is set up
        // here: the producer is one warp per scheduler with a serial stream
        // of instructions, and its issue time was a stage's time (ncu:
        // 282 instructions per warp per stage, 6.4 cycles each).
        //
        // Weight copies: kTiles row tiles x 32 code pieces = kTiles / 4 per
        // thread (tile p / 32 + 4 i, piece p % 32: a warp copies a tile's 512
        // contiguous bytes) and kTiles x 4 scale pieces on threads
        // p < 4 kTiles (tile p / 4, piece p % 4); both land at 16 p
        // (+ 2048 i) in the stage.
        constexpr int kCodeCopies = kTiles / 4;
        // Each source pointer steps one chunk per stage.
        const i64 wstep = (i64)4 * chunks * kCodeBytes;          // 4 row tiles further
        const u8* wsrc = wq + (((i64)g * tiles16 + tile0 + (p >> 5)) * chunks + c_beg) * kCodeBytes + 16 * plane;
        const u8* ssrc = wsf + (((i64)g * tiles16 + tile0 + (p >> 2)) * chunks + c_beg) * kScaleBytes + 16 * slot;
        u32 wlive = 0;                                             // bit i: code tile p / 32 + 4 i exists
#pragma unroll
        for (int i = 0; i < kCodeCopies; ++i) wlive |= (u32)((p >> 5) + 4 * i < live_tiles) << i;
        const bool slive = p < 4 * kTiles && (p >> 2) < live_tiles;
        // The stage's packed weights as cp.async copies; each thread's arrive
        // fires when its copies have landed. (Bulk copies, one per row tile
        // and part, measured slower: 32 small TMA copies per stage.)
        auto copy_weights = [&](int s) {
            const u32 dst = smem_u32(s_w + s * kWStage) + 16 * p;
#pragma unroll
            for (int i = 0; i < kCodeCopies; ++i) cp_async16_if(wlive >> i & 1, dst + 2048 * i, wsrc + i * wstep);
            wsrc += kCodeBytes;
            cp_async16_if(slive, dst + kTiles * kCodeBytes, ssrc);
            ssrc += kScaleBytes;
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_full + 8 * s) : "memory");
        };
        if (ACT != 2 && act_tma) {
            // 16-bit activations by TMA: thread 0 brings each stage's tile,
            // BN token rows from t0 (rows past the tensor and columns past
            // k read as zeros; a ragged tile's rows of the next expert only
            // reach outputs that are not written), in the 128-byte swizzle.
            int s = 0;
            u32 parity = 1;   // of the empty barriers: a fresh barrier passes parity 1
            for (int c = c_beg; c < c_end; ++c) {
                mbar_wait(bar_empty + 8 * s, parity);
                if (p == 0) {
                    mbar_expect_tx(bar_full + 8 * s, kBStage);
                    tma_load_3d(smem_u32(s_b + s * kBStage), &xmap, 64 * c, offsets ? 0 : g, t0, bar_full + 8 * s);
                }
                copy_weights(s);
                if (plane == 0) mbar_arrive(bar_full + 8 * s);
                if (++s == STAGES) {
                    s = 0;
                    parity ^= 1;
                }
            }
            return;
        }
        if constexpr (kTmaOnly) {
            __trap();   // (the plan gives this tile a tensor map or does not take it)
        } else {
            // Thread p owns kItems (token row, slot) items of every stage: rows
            // p / 4 + 32 j, slot i = p % 4, so a warp's 32 items are 8 rows x 4
            // slots, whose stores hit 32 distinct banks. Its activations run
            // kAhead chunks ahead in registers: a chunk's loads are issued kAhead
            // stages before they are stored, which hides the L2 / DRAM latency.
            constexpr int kItems = BN * 4 / 128;
            constexpr int kAhead = ACT == 2 ? 1 : 2;   // (NVFP4 rows: 2 spills in 120 registers)
            // A row past the tile's last token reads the last token again: its
            // B column only reaches outputs the epilogue does not write (the
            // MMA's columns are independent), so it needs no zeros and no test.
            const u8* xrow[kItems];
            const u8* srow[kItems];
#pragma unroll
            for (int j = 0; j < kItems; ++j) {
                const int tok = min(t0 + (p >> 2) + 32 * j, t1 - 1);
                const i64 xo = (i64)tok * xs_t + (i64)g * xs_g;
                xrow[j] = x + (ACT == 2 ? xo + 32 * c_beg : 2 * xo + 128 * c_beg);   // chunk c_beg; `load` steps it
                srow[j] = ACT == 2 ? xsf + (i64)tok * ss_t + (i64)g * ss_g + 4 * c_beg : nullptr;
            }
            // Item j's columns 16 slot .. + 7 and + 8 .. + 15 (units 2 slot and
            // 2 slot + 1) go to row (p / 4 + 32 j), units (2 slot + h) ^ (row % 8):
            // row % 8 is the same for every j. (A phase of 8 lanes, two rows x
            // four slots, stores to 8 distinct units: no bank conflicts.)
            u32 uoff[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) uoff[h] = (p >> 2) * 128 + (((2 * slot + h) ^ ((p >> 2) & 7)) << 4);

            ActChunk<ACT> buf[kAhead][kItems];
            // Columns past k must be zeros (the weight's zero padding times a
            // NaN would be NaN): only the chunk that holds k's end, and chunks
            // past the last, test them.
            const int full_chunks = k / 64;
            // `load` is called for chunks c_beg, c_beg + 1, ... in order: it reads
            // columns 16 slot .. + 15 of xrow / srow and steps them one chunk.
            auto load = [&](ActChunk<ACT> (&b)[kItems], int c) {
                if (c < full_chunks) {
#pragma unroll
                    for (int j = 0; j < kItems; ++j) b[j].load(xrow[j], srow[j], 16 * slot);
                } else {
                    const bool live = c * 64 + 16 * slot < k;
#pragma unroll
                    for (int j = 0; j < kItems; ++j) {
                        if (live) b[j].load(xrow[j], srow[j], 16 * slot);
                        else b[j].clear();
                    }
                }
#pragma unroll
                for (int j = 0; j < kItems; ++j) {
                    xrow[j] += ACT == 2 ? 32 : 128;
                    if (ACT == 2) srow[j] += 4;
                }
            };
#pragma unroll
            for (int d = 0; d < kAhead; ++d) load(buf[d], c_beg + d);
            int s = 0;
            u32 parity = 1;   // of the empty barriers: a fresh barrier passes parity 1
            for (int c0 = c_beg; c0 < c_end; c0 += kAhead) {
#pragma unroll
                for (int d = 0; d < kAhead; ++d) {
                    const int c = c0 + d;
                    if (c >= c_end) break;
                    mbar_wait(bar_empty + 8 * s, parity);
                    copy_weights(s);
                    const u32 btile = smem_u32(s_b + s * kBStage);
#pragma unroll
                    for (int j = 0; j < kItems; ++j) {
                        uint4 w0, w1;
                        buf[d][j].words(w0, w1);
                        st_shared16(btile + uoff[0] + 4096 * j, w0);
                        st_shared16(btile + uoff[1] + 4096 * j, w1);
                    }
                    // The arrive releases these stores; each consumer orders them
                    // before its tensor-core reads with its own proxy fence: a
                    // proxy fence here would also wait for this thread's loads in
                    // flight (measured: one load latency per stage).
                    __syncwarp();
                    if (plane == 0) mbar_arrive(bar_full + 8 * s);
                    load(buf[d], c + kAhead);
                    if (++s == STAGES) {
                        s = 0;
                        parity ^= 1;
                    }
                }
            }
        }
        return;
    }

    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    int my_tile[kMT];                                   // within the block
#pragma unroll
    for (int m = 0; m < kMT; ++m) my_tile[m] = wg * (kTiles / 2) + 4 * m + warp;
    // The rest runs on the block's tokens at N columns, the least multiple
    // of 16 (32 in the 256-token tile) that holds them (run_tile in
    // sm90.cuh): a ragged block's last
    // tile of an expert, or a batched call's last token tile, issues
    // m64nNk16 wgmmas on N / 2 accumulators instead of the tile's BN / 2.
    // Each token's column of a wgmma is computed alone, so its bits are
    // those of the full tile (tested). The stages keep the tile's layout.
    auto run = [&](auto n_tag) {
        constexpr int N = decltype(n_tag)::value;
        float acc[kMT][N / 2];
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
            for (int j = 0; j < N / 2; ++j) acc[m][j] = 0.0f;

        // Each m-tile's four wgmmas of a stage are one commit group, so the
        // tensor cores always have a group queued while the next m-tile's
        // fragments are dequantized: m-tile 0 of stage c is issued once m-tile 0
        // of stage c - 1 has completed (its A registers are free again), m-tile 1
        // once m-tile 1 of c - 1 has, which also frees stage c - 1's buffers.
        // A fragment registers are never written while a wgmma reading them is
        // in flight (else ptxas serializes every wgmma).
        u32 a0[4][4], a1[4][4];
        // A stage's codes (word t of the records of lanes (q, 0..3):
        // gather_record) and scales (rows q and q + 8 of the chunk's four
        // 16-column blocks: 8 bytes, block s's pair at byte 2s) of both
        // m-tiles are read as soon as the stage is full, so the loads'
        // latency is not on the path from a wgmma wait to the next issue.
        const u32 lq = 4 * lane;                        // 16 q + 4 t
        const u32 sq = 8 * (lane >> 2);
        uint4 wv[kMT];
        uint2 sv[kMT];
        // A row tile past the weight's rows (my_tile >= live_tiles: never
        // copied) reads whatever its stage holds, unguarded: an MMA row
        // depends on its own A row alone, and those rows are never stored.
        auto fetch = [&](u32 wst, int m) {
            wv[m] = gather_record(wst + my_tile[m] * kCodeBytes, lq);
            sv[m] = ld_shared_v2(wst + kTiles * kCodeBytes + my_tile[m] * kScaleBytes + sq);
        };
        auto dequant = [&](int m, u32 (&a)[4][4]) {
            u32 f[4][2];
            block_factors<MX, F16>(sv[m], f);
            dequant_fragment<F16>(wv[m].x, f[0][0], f[0][1], a[0]);
            dequant_fragment<F16>(wv[m].y, f[1][0], f[1][1], a[1]);
            dequant_fragment<F16>(wv[m].z, f[2][0], f[2][1], a[2]);
            dequant_fragment<F16>(wv[m].w, f[3][0], f[3][1], a[3]);
        };
        // The B tile's descriptor is linear in its address (+ 2 per 32
        // bytes): stepped from stage 0's, not rebuilt per chunk and k16 step.
        const u32 desc0 = b_desc_lo(smem_u32(s_b));
        int s = 0, prev = STAGES - 1, prev2 = STAGES - 2;   // chunk c's stage, c - 1's, c - 2's
        u32 parity = 0;
        auto next_stage = [&]() {
            prev2 = prev;
            prev = s;
            if (++s == STAGES) {
                s = 0;
                parity ^= 1;
            }
        };
        auto release = [&](int st) {
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_empty + 8 * st);
        };
        // The producer's activation stores (generic proxy), acquired through the
        // barrier, ordered before this warpgroup's wgmma reads (async proxy).
        auto acquire = [&]() {
            mbar_wait(bar_full + 8 * s, parity);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        };
        if constexpr (kMT == 2) {
            for (int c = c_beg; c < c_end; ++c) {
                acquire();
                const u32 wst = smem_u32(s_w + s * kWStage);
                const u32 desc = desc0 + s * (kBStage >> 4);
                fetch(wst, 0);
                fetch(wst, 1);
                if (c > c_beg) wgmma_wait<1>();             // m-tile 0 of c - 1 done
                dequant(0, a0);
                wgmma_fence();
#pragma unroll
                for (int s4 = 0; s4 < 4; ++s4) wgmma_step<N, F16>(acc[0], a0[s4], b_desc_of_lo(desc + 2 * s4));
                wgmma_commit();
                if (c > c_beg) {
                    wgmma_wait<1>();                        // m-tile 1 of c - 1 done: stage c - 1 is free
                    release(prev);
                }
                dequant(1, a1);
                wgmma_fence();
#pragma unroll
                for (int s4 = 0; s4 < 4; ++s4) wgmma_step<N, F16>(acc[kMT - 1], a1[s4], b_desc_of_lo(desc + 2 * s4));
                wgmma_commit();
                next_stage();
            }
        } else {
            // One m-tile: its A fragments alternate between two register sets by
            // chunk, so chunk c is dequantized while chunk c - 1's wgmmas run;
            // set a0 is free again once chunk c - 2 has completed, which also
            // frees c - 2's stage.
            auto chunk = [&](int c, u32 (&a)[4][4]) {
                acquire();
                const u32 desc = desc0 + s * (kBStage >> 4);
                fetch(smem_u32(s_w + s * kWStage), 0);
                if (c >= c_beg + 2) {
                    wgmma_wait<1>();                        // chunk c - 2 done
                    release(prev2);
                }
                dequant(0, a);
                wgmma_fence();
#pragma unroll
                for (int s4 = 0; s4 < 4; ++s4) wgmma_step<N, F16>(acc[0], a[s4], b_desc_of_lo(desc + 2 * s4));
                wgmma_commit();
                next_stage();
            };
            for (int c = c_beg; c < c_end; c += 2) {
                chunk(c, a0);
                if (c + 1 < c_end) chunk(c + 1, a1);
            }
        }
        wgmma_wait<0>();
        // (The last stages are not released: nothing is loaded after them.)

        // Split K: this block's sums join rank 0's (sm90.cuh, split_k_sum);
        // accumulator m, j of consumer thread ct at float (m * BN / 2 + j) * 256 + ct.
        if constexpr (KSPLIT > 1) {
            if (!split_k_sum<KSPLIT>(reinterpret_cast<float(&)[kMT * (N / 2)]>(acc), smem_u32(smem), s_split_bar,
                                     split))
                return;
        }

        // Epilogue: thread (warp, lane q = lane / 4, t = lane % 4) holds, for each
        // 8-token group j, rows q and q + 8 of its 16-row tile at tokens
        // 8j + 2t and 8j + 2t + 1 (the wgmma D fragment). The 2^-9 of each FP4
        // operand, the weight's global scale and (NVFP4 activations) the token's
        // global scale.
        const int q = lane >> 2, t = lane & 3;
        const float wscale = wgs[g] * (ACT == 2 ? 512.0f * 512.0f : 512.0f);
        const int row0 = tile0 * 16;                      // the block's first output feature
        __nv_bfloat16* const obase = out + (i64)g * os_g;
        // Where the block's BM features exist and each token's run of them is
        // 16-byte aligned, the tile goes through shared memory: the fragments'
        // 2-byte values into a token-major tile, then 16-byte stores, a token's
        // BM features contiguous (ncu: the fragments' own 2-byte global stores
        // used half of each 32-byte sector). Else each value is stored alone.
        const bool staged =
            row0 + kBM <= n && ((reinterpret_cast<size_t>(obase + row0) | ((size_t)os_t * 2)) & 15) == 0;
        if (staged) {
            // Token rows of BM + 8 values: 16 bytes of padding put a quad's
            // four tokens in different banks.
            constexpr int kPitch = kBM + 8;
            static_assert(N * kPitch * 2 + N * 4 <= STAGES * (kBStage + kWStage), "the staged tile fits in the stages");
            __nv_bfloat16* const stile = reinterpret_cast<__nv_bfloat16*>(smem);
            // NVFP4 activations: each token's scale, read once into shared
            // memory (as 32 loads per thread, hoisted by the compiler, they
            // spilled beside the 128 accumulators).
            float* const s_scale = reinterpret_cast<float*>(smem + N * kPitch * 2);
            // Both consumer warpgroups are done with the stages (the producer's
            // last writes were acquired with the last stage).
            asm volatile("bar.sync 1, 256;\n" ::: "memory");
            if (ACT == 2) {
                for (int i = threadIdx.x; i < N; i += 256)      // (rows past t1 are never stored)
                    s_scale[i] = wscale * xgs[(i64)min(t0 + i, t1 - 1) * gs_t + (i64)g * gs_g];
                asm volatile("bar.sync 1, 256;\n" ::: "memory");
            }
            // Two 8-token groups at a time, by stmatrix: the D fragments of
            // rows q and q + 8 of group j are two 8 x 8 matrices (features x
            // tokens) in the MMA fragment layout, stored transposed, each
            // token's 8 features as 16 bytes (lane 8 i + c: matrix i's token
            // c), in place of one 2-byte store per value.
            const int mi = lane >> 3, mc = lane & 7;
#pragma unroll
            for (int j = 0; j < N / 8; j += 2) {
                const int tl = 8 * j + 2 * t;                         // this lane's first token
                const float s0 = ACT == 2 ? s_scale[tl] : wscale, s1 = ACT == 2 ? s_scale[tl + 1] : wscale;
                const float s2 = ACT == 2 ? s_scale[tl + 8] : wscale, s3 = ACT == 2 ? s_scale[tl + 9] : wscale;
                const int tok = 8 * (j + (mi >> 1)) + mc;             // the token whose row this lane addresses
#pragma unroll
                for (int m = 0; m < kMT; ++m) {
                    const float* a = &acc[m][4 * j];
                    stmatrix_x4_trans(smem_u32(stile + tok * kPitch + my_tile[m] * 16 + 8 * (mi & 1)),
                                      bf16x2_rn(a[0] * s0, a[1] * s1), bf16x2_rn(a[2] * s0, a[3] * s1),
                                      bf16x2_rn(a[4] * s2, a[5] * s3), bf16x2_rn(a[6] * s2, a[7] * s3));
                }
            }
            store_staged<kBM, kPitch>(stile, obase + (i64)t0 * os_t + row0, os_t, t1 - t0);
            return;
        }
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int tok = t0 + 8 * j + 2 * t + h;
                if (tok >= t1) continue;
                const float sc = ACT == 2 ? wscale * xgs[(i64)tok * gs_t + (i64)g * gs_g] : wscale;
                __nv_bfloat16* orow = obase + (i64)tok * os_t;
#pragma unroll
                for (int m = 0; m < kMT; ++m) {
                    const int row = row0 + my_tile[m] * 16 + q;
                    if (row < n) orow[row] = __float2bfloat16_rn(acc[m][4 * j + h] * sc);
                    if (row + 8 < n) orow[row + 8] = __float2bfloat16_rn(acc[m][4 * j + 2 + h] * sc);
                }
            }
        }
    };
    // (Split-K instances keep BN columns: they serve batched calls, whose
    // token tiles are full but the last, and one main loop keeps their
    // compile time.)
    // (The 256-token tile in steps of 32 tokens: 8 copies of the main loop,
    // not 16, which doubled the file's compile time; a partial last tile
    // multiplies at most 31 columns it does not store.)
    if constexpr (KSPLIT > 1) run(IntC<BN>{});
    else run_tile<BN, kTmaOnly ? 32 : 16>(t1 - t0, run);
}

// One block per output tile, all of K.
template <int ACT, bool MX, int BN, int STAGES, int BM>
__global__ void __launch_bounds__(kThreads, 1) rkv_gemm_fp4_sm90(
    const u8* __restrict__ wq, const u8* __restrict__ wsf, const float* __restrict__ wgs,
    const u8* __restrict__ x, const u8* __restrict__ xsf, const float* __restrict__ xgs,
    i64 xs_t, i64 xs_g, i64 ss_t, i64 ss_g, i64 gs_t, i64 gs_g,
    __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors,
    const __grid_constant__ TmaMap xmap, int act_tma) {
    gemm_sm90<ACT, MX, BN, STAGES, BM, 1>(wq, wsf, wgs, x, xsf, xgs, xs_t, xs_g, ss_t, ss_g, gs_t, gs_g, out, os_t,
                                          os_g, n, k, tokens, offsets, experts, errors, xmap, act_tma);
}

// A cluster of KSPLIT blocks per output tile, each a KSPLIT-th of K (batched
// calls only: grid x is the feature blocks times KSPLIT).
template <int ACT, bool MX, int BN, int STAGES, int BM, int KSPLIT>
__global__ void __cluster_dims__(KSPLIT, 1, 1) __launch_bounds__(kThreads, 1) rkv_gemm_fp4_sm90_splitk(
    const u8* __restrict__ wq, const u8* __restrict__ wsf, const float* __restrict__ wgs,
    const u8* __restrict__ x, const u8* __restrict__ xsf, const float* __restrict__ xgs,
    i64 xs_t, i64 xs_g, i64 ss_t, i64 ss_g, i64 gs_t, i64 gs_g,
    __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors,
    const __grid_constant__ TmaMap xmap, int act_tma) {
    gemm_sm90<ACT, MX, BN, STAGES, BM, KSPLIT>(wq, wsf, wgs, x, xsf, xgs, xs_t, xs_g, ss_t, ss_g, gs_t, gs_g, out,
                                               os_t, os_g, n, k, tokens, nullptr, experts, errors, xmap, act_tma);
}
