// gemm_fp4.cu: grouped GEMM with FP4 weights on mma.sync tensor cores (sm_80+).
//
// out[t, g, n] = sum_k x[t, g, k] * w[g, n, k]  (batched: DeepSeek-V4 wo_a)
// out[r, n]    = sum_k x[r, k] * w[e(r), n, k]  (ragged: MoE experts, rows
//                                               sorted by expert, offsets)
//
// The weight is the MMA's A operand (16 output features per m-tile) and the
// tokens its B operand (8 per n-tile), so one token wastes 7/8 of an n-tile
// rather than 15/16 of an m-tile. Weights come packed as docs/gemm.md gives:
// one 16-byte load per lane per (m-tile, 64-column chunk), the lane's record,
// is that lane's A fragment for the chunk's four k16 steps (word s: its rows'
// columns 16t + 2s + {0, 1, 8, 9}, all in its NVFP4 block 16t .. 16t + 15,
// so one scale per chunk), and the lane's activations are the 16 contiguous
// columns kb = 64c + 16t .. kb + 15 of its token (ActChunk: step s's B
// fragment is their words s and s + 4). The MMA's k index is a permutation
// of the physical columns, the same for A and B. (The Hopper kernel reads
// the same records as word t of lanes (q, 0..3), its k16 step s being the
// physical columns 16s .. 16s + 15: that is what TMA brings it.)
//
// The dequantization and the helpers both GEMM kernels use: gemm_fp4.cuh.
//
// Template: ACT activation kind (0 BF16, 1 FP16, 2 NVFP4 codes + E4M3
// scales, multiplied in BF16); MX the weight's block scales (E4M3 per 16, or
// UE8M0 per 32); MT m-tiles and NT n-tiles per warp; KS warps
// splitting K inside a block (summed through shared memory in a fixed
// order: deterministic); RW warps along the rows; a ring of S stages of U
// chunks each per warp; PF the activations loaded one step ahead.
#include "gemm_fp4.cuh"
using namespace rkv;

// This lane's activations of chunks c .. c + U - 1, its n-tiles' tokens,
// from xc / sc (its columns of chunk c: running pointers, stepped here to
// chunk c + U). FULL: every chunk is the warp's and wholly inside K, so no
// load needs a predicate; else zeros past c_end and k. WORDS: 16-bit
// activations as eight 4-byte loads (ActChunk::load_words).
template <int ACT, int U, int NT, bool FULL, bool WORDS = false>
__device__ __forceinline__ void load_acts(ActChunk<ACT> (&av)[U][NT], const u8* (&xc)[NT], const u8* (&sc)[NT],
                                          int c, int c_end, int k, int t) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (FULL || (c + u < c_end && (c + u) * 64 + 16 * t < k)) {
                if constexpr (WORDS) av[u][j].load_words(xc[j], u * 64);
                else av[u][j].load(xc[j], sc[j], u * 64);
            } else {
                av[u][j].clear();
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        xc[j] += ACT == 2 ? 32 * U : 128 * U;
        if (ACT == 2) sc[j] += 4 * U;
    }
}

// This lane (q, t)'s A fragments of steps 0..3 in a tile's 512 code bytes
// at src: its own 16-byte record (docs/gemm.md, "Packed form").
__device__ __forceinline__ uint4 own_record(const u8* src, int lane) {
    return *reinterpret_cast<const uint4*>(src + record_offset(lane >> 2, lane & 3));
}

// The MMAs of one ring stage (U chunks x MT m-tiles of 576 bytes: the tile's
// 512 code bytes, then its scales), its first `live` chunks, with the
// activations `av`, into acc.
template <int ACT, bool MX, int MT, int NT, int U>
__device__ __forceinline__ void mma_stage(const u8* stage, int lane, int live, const ActChunk<ACT> (&av)[U][NT],
                                          float (&acc)[MT][NT][4]) {
    constexpr bool F16 = ACT == 1;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u >= live) break;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const u8* src = stage + (u * MT + i) * 576;
            const uint4 wv = own_record(src, lane);
            const u32 sv = *reinterpret_cast<const u16*>(src + 512 + lane * 2);
            u32 f0, f1;
            scale_factors<MX, F16>(sv, f0, f1);
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) {
                u32 a[4];
                dequant_fragment<F16>(word_of(wv, s4), f0, f1, a);
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    u32 b0, b1;
                    av[u][j].fragment(s4, b0, b1);
                    mma_step(acc[i][j], a, b0, b1, F16);
                }
            }
        }
    }
}

// PF: the activations are loaded one step ahead (rawkv.gemm.plans chooses:
// the second register set costs blocks per SM, so it pays where the grid
// is small enough to run in one wave anyway).
// ptxas's own register choice (no minimum of blocks per SM: 0) spills 8-16
// bytes in two places, which a minimum of one block lifts (it may then use
// what registers it needs): NVFP4 activations (their codes converted at
// each load), sm_120's tiles (two m16n8k8 per step, mma_step) and on sm_100
// the four-m-tile, two-n-tile one (K.WIDE_GRID_CONFIGS[16], FP16 with PF;
// the plans take it on sm_90 only, where it fits without).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define RKV_GEMM_MIN_BLOCKS(ACT, MT, NT) 1
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define RKV_GEMM_MIN_BLOCKS(ACT, MT, NT) ((ACT) == 2 || ((MT) == 4 && (NT) == 2) ? 1 : 0)
#else
#define RKV_GEMM_MIN_BLOCKS(ACT, MT, NT) ((ACT) == 2 ? 1 : 0)
#endif

template <int ACT, bool MX, int MT, int NT, int KS, int RW, int U, int S, bool PF>
__global__ void __launch_bounds__(32 * KS * RW, RKV_GEMM_MIN_BLOCKS(ACT, MT, NT)) rkv_gemm_fp4(
    const u8* __restrict__ wq, const u8* __restrict__ wsf, const float* __restrict__ wgs,
    const u8* __restrict__ x, const u8* __restrict__ xsf, const float* __restrict__ xgs,
    i64 xs_t, i64 xs_g, i64 ss_t, i64 ss_g, i64 gs_t, i64 gs_g,
    __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors) {
    constexpr bool F16 = ACT == 1;
    constexpr int TT = 8 * NT;  // tokens per block
    // The rings (per warp: S stages x U chunks x MT m-tiles x (512 B codes +
    // 64 B scales)), the split-K partial sums and the offsets. Where they
    // would pass the 48 KB of static shared memory (eight warps along K over
    // 64 features: K.WIDE_GRID_CONFIGS), the sums take the rings' bytes once
    // every warp has left its main loop.
    constexpr int RING_BYTES = KS * RW * S * U * MT * 576;
    constexpr int RED_BYTES = KS > 1 ? (KS - 1) * RW * 32 * MT * NT * 4 * 4 : 4;
    constexpr bool RED_IN_RING = RING_BYTES + RED_BYTES + 4 * RKV_GEMM_MAX_SEGMENTS > 48 * 1024;
    __shared__ float s_red_own[RED_IN_RING ? 1 : RED_BYTES / 4];
    __shared__ int s_off[RKV_GEMM_MAX_SEGMENTS];
    __shared__ __align__(16) u8 s_ring[RED_IN_RING && RED_BYTES > RING_BYTES ? RED_BYTES : RING_BYTES];
    float* const s_red = RED_IN_RING ? reinterpret_cast<float*>(s_ring) : s_red_own;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rw = warp % RW, ks = warp / RW;
    const int q = lane >> 2, t = lane & 3;

    // (the block owns output features blockIdx.x RW MT 16 .. + RW MT 16: RW warps of MT row tiles)
    // Programmatic dependent launch (common.cuh): a batched call streams its
    // first stages of weights before it waits for the kernel before it; a
    // ragged one reads its offsets (and may write rows) at once.
    if (offsets) pdl_wait();
    int g, t0, t1;
    if (!block_tokens(offsets, experts, tokens, TT, s_off, errors, out, os_t, n, blockIdx.x * RW * MT * 16,
                      RW * MT * 16, g, t0, t1))
        return;

    const int tiles16 = (n + 15) / 16, chunks = (k + 63) / 64;
    const int tile0 = (blockIdx.x * RW + rw) * MT;
    const int per_warp = (chunks + KS - 1) / KS;
    const int c_beg = ks * per_warp, c_end = min(chunks, c_beg + per_warp);

    // This lane's token in each n-tile (B fragment column q). A column past
    // the block's last token reads that last token's row instead: column q
    // of an MMA's result depends only on column q of B, and the epilogue
    // stores no column past t1, so the loads need no per-token predicate
    // and no zeroed registers (the lanes of one row load the same bytes).
    // (The running pointers xc / sc are built from these below, after the
    // ring's first copies: built here in one loop, the same arithmetic
    // measured 0.5-1% slower at M <= 8 on an H100, docs/gemm.md.)
    const u8* xrow[NT];
    const u8* srow[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int tok = min(t0 + 8 * j + q, t1 - 1);
        const i64 xo = (i64)tok * xs_t + (i64)g * xs_g;
        xrow[j] = x + (ACT == 2 ? xo : 2 * xo);
        srow[j] = ACT == 2 ? xsf + (i64)tok * ss_t + (i64)g * ss_g : nullptr;
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

    const u8* wbase = wq + (((i64)g * tiles16 * chunks) * 32 + lane) * 16;
    const u8* sbase = wsf + (i64)g * tiles16 * chunks * 64;

    // Each warp streams its own weights through a ring of S stages of U
    // chunks in shared memory (cp.async: the bytes in flight hold no
    // registers), S - 1 stages ahead of the chunk it multiplies. Only the
    // warp reads its ring, so a warp barrier orders it.
    u8* ring = s_ring + warp * (S * U * MT * 576);
    // Per m-tile, the source of chunk c_beg (codes, lane's 16 bytes; scales,
    // the tile's 64 bytes): consecutive chunks are 512 / 64 bytes apart.
    const u8* wsrc[MT];  // (running: issue() steps them)
    const u8* ssrc[MT];
    bool tile_ok[MT];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const i64 at = (i64)(tile0 + i) * chunks + c_beg;
        tile_ok[i] = tile0 + i < tiles16;
        wsrc[i] = wbase + at * 512;
        ssrc[i] = sbase + at * 64 + lane * 16;
    }
    // The refill: each issue() copies the next U chunks of the warp's range
    // (chunk cn on, from wsrc / ssrc) into the next stage (at wr), those of
    // chunks past the range predicated off: running addresses, so a step
    // costs additions rather than 64-bit products.
    const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
    const u32 ring_end = ring_s + S * U * MT * 576;
    u32 wr = ring_s;
    int cn = c_beg;
    // Programmatic dependent launch: once the warp has requested its last
    // weights (and waited for the kernel before it), the next kernel may
    // start and stream its own weights while this one multiplies what it
    // holds (H100: docs/gemm.md, "Programmatic dependent launch").
    bool waited = offsets != nullptr;
    auto issue = [&]() {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool live = cn + u < c_end;
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const u32 dst = wr + (u * MT + i) * 576;
                const bool on = live && tile_ok[i];
                cp_async16_if<true>(on, dst + lane * 16, wsrc[i] + u * 512);
                cp_async16_if<true>(on && lane < 4, dst + 512 + lane * 16, ssrc[i] + u * 64);
            }
        }
        cp_async_commit();
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            wsrc[i] += U * 512;
            ssrc[i] += U * 64;
        }
        if (waited && cn < c_end && cn + U >= c_end) pdl_launch_dependents();
        cn += U;
        wr = wr + U * MT * 576 == ring_end ? ring_s : wr + U * MT * 576;
    };
#pragma unroll
    for (int p = 0; p < S - 1; ++p) issue();
    if (!offsets) {
        pdl_wait();              // (the activations and the outputs from here on)
        waited = true;
        if (cn >= c_end) pdl_launch_dependents();   // (its last weights went before the wait)
    }
    int slot = 0;  // the stage multiplied
    // This lane's activations of chunk c_beg, by token (running: load_acts
    // steps them); chunks before c_full are the warp's and wholly inside K.
    const int kb0 = c_beg * 64 + 16 * t;
    const u8* xc[NT];
    const u8* sc[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        xc[j] = xrow[j] + (ACT == 2 ? kb0 / 2 : 2 * kb0);
        sc[j] = ACT == 2 ? srow[j] + kb0 / 16 : nullptr;
    }
    const int c_full = min(c_end, k / 64);
    if constexpr (PF) {
        // The activations one step ahead: step c loads those of c + U
        // before it multiplies, so their latency overlaps its MMAs (two
        // register sets, swapped by the unrolled pair of steps, not copied).
        // ready(): the step's stage has landed in the warp's ring, and the
        // stage freed by the previous step is refilled S - 1 steps ahead.
        auto ready = [&]() {
            cp_async_wait<S - 2>();
            __syncwarp();
            issue();
        };
        auto multiply = [&](const ActChunk<ACT> (&av)[U][NT], int c) {
            mma_stage<ACT, MX, MT, NT, U>(ring + slot * U * MT * 576, lane, c_end - c, av, acc);
            slot = slot + 1 == S ? 0 : slot + 1;
        };
        auto load = [&](ActChunk<ACT> (&av)[U][NT], int c) {
            if (c + U <= c_full) load_acts<ACT, U, NT, true>(av, xc, sc, c, c_end, k, t);
            else load_acts<ACT, U, NT, false>(av, xc, sc, c, c_end, k, t);
        };
        ActChunk<ACT> av0[U][NT], av1[U][NT];
        load(av0, c_beg);
        for (int c = c_beg; c < c_end; c += 2 * U) {
            load(av1, c + U);
            ready();
            multiply(av0, c);
            if (c + U >= c_end) break;
            load(av0, c + 2 * U);
            ready();
            multiply(av1, c + U);
        }
    } else {
        // (Written out rather than through mma_stage: through it ptxas
        // spills 16-32 bytes in the ragged 16-token tile on sm_90 / sm_100.)
        // FULL: every chunk of the step is the warp's and wholly inside K
        // (all but a warp's last step or two), so its loads and MMAs need
        // no predicate and no zeroed registers.
        auto step = [&](int c, auto full, auto words) {
            constexpr bool FULL = decltype(full)::value;
            ActChunk<ACT> av[U][NT];
            load_acts<ACT, U, NT, FULL, decltype(words)::value>(av, xc, sc, c, c_end, k, t);
            cp_async_wait<S - 2>();
            __syncwarp();
            issue();
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (!FULL && c + u >= c_end) break;
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const u8* src = ring + ((slot * U + u) * MT + i) * 576;
                    const uint4 wv = own_record(src, lane);
                    const u32 sv = *reinterpret_cast<const u16*>(src + 512 + lane * 2);
                    u32 f0, f1;
                    scale_factors<MX, F16>(sv, f0, f1);
#pragma unroll
                    for (int s4 = 0; s4 < 4; ++s4) {
                        u32 a[4];
                        dequant_fragment<F16>(word_of(wv, s4), f0, f1, a);
#pragma unroll
                        for (int j = 0; j < NT; ++j) {
                            u32 b0, b1;
                            av[u][j].fragment(s4, b0, b1);
                            mma_step(acc[i][j], a, b0, b1, F16);
                        }
                    }
                }
            }
            slot = slot + 1 == S ? 0 : slot + 1;
        };
        auto steps = [&](auto words) {
            int c = c_beg;
            for (; c + U <= c_full; c += U) step(c, Flag<true>{}, words);
            for (; c < c_end; c += U) step(c, Flag<false>{}, words);
        };
        // A block of two m-tiles and one n-tile that holds one or two tokens
        // (the 8-token ragged tile at a token or two per expert: MoE at 16-64
        // tokens) loads its activations as 4-byte words, through a loop of
        // its own: H100, MoE Flash gate_up / down at 16 tokens 2.2% / 0.9%
        // faster. Not with more tokens (a batched M = 8 tile was 45% slower)
        // nor one m-tile (one-token MoE 6-7% slower, Pro M = 1 4%), nor as a
        // test inside the 16-byte loop (MoE at 256 tokens 1-1.5% slower):
        // docs/gemm.md, "Activation words".
        if constexpr (NT == 1 && MT == 2 && ACT != 2) {
            if (t1 - t0 <= 2) steps(Flag<true>{});
            else steps(Flag<false>{});
        } else {
            steps(Flag<false>{});
        }
    }
    cp_async_wait<0>();

    if constexpr (RED_IN_RING) __syncthreads();   // (every warp's ring read before the sums overwrite it)
    if (KS > 1 && !sum_split_k<MT, NT, KS, RW>(s_red, acc, ks, rw, lane)) return;

    // Epilogue: the 2^-9 of each FP4 operand, the weight's global scale, and
    // (NVFP4 activations) the row's or tensor's global scale.
    const float wscale = wgs[g] * (ACT == 2 ? kTwoPow9 * kTwoPow9 : kTwoPow9);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int tok = t0 + 8 * j + 2 * t + h;
            if (tok >= t1) continue;
            const float sc = ACT == 2 ? wscale * xgs[(i64)tok * gs_t + (i64)g * gs_g] : wscale;
            __nv_bfloat16* orow = out + (i64)tok * os_t + (i64)g * os_g;
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int row = (tile0 + i) * 16 + q;
                if (row < n) orow[row] = __float2bfloat16_rn(acc[i][j][h] * sc);
                if (row + 8 < n) orow[row + 8] = __float2bfloat16_rn(acc[i][j][2 + h] * sc);
            }
        }
    }
}
