// gemm_w4a8_sm90.cu: the W4A8 grouped GEMM on Hopper's FP8 wgmma (sm_90a).
//
// out[t, g, n] = sum_k w[g, n, k] * x[t, g, k] (batched), or rows sorted by
// expert with offsets (ragged), with (docs/gemm.md, "W4A8"):
// * w an MXFP4 weight in its W4A8 form: E2M1 codes and one biased shift per
//   32-column block (rawkv.reference.gemm_w4a8's rule: the code times 2^shift
//   is an E4M3 value exactly) and one power of two per row, 2^r, for the
//   epilogue, packed as pack_codes8 / pack_shifts8 give;
// * x FP8 block activations: E4M3 codes and one scale per token per 128
//   channels (rawkv.fp8.quantize_blocks), FP32 or its E8M0 byte (SB), read
//   in place at any strides (ss_t, ss_g, ss_b: token, group, block), so
//   DeepGEMM's MN-major layout needs no copy.
//
// A block computes BM = 128 output features x BN tokens, 128 columns of K
// per pipeline stage (one activation scale block; one 128-byte row of the
// swizzled B tile per token). Warp specialization (384 threads):
// * warpgroups 0 and 1 consume, one m64 row tile each: per stage they turn
//   their lanes' packed codes into the E4M3 A fragments of four k32 steps
//   (a table lookup per block: prmt on the block's eight E4M3 magnitudes),
//   run the four wgmmas into a block partial (FP32; the first one
//   overwrites it), and promote it into the accumulators with each token's
//   scale of that block (DeepGEMM's recipe: the FP8 tensor cores keep
//   about 14 bits, the promotion is FP32). The next stage's fragments are
//   built while the wgmmas run;
// * warpgroup 2 produces: 16-byte cp.async copies of the stage's packed
//   codes and shifts and of the activation tile (each token row into the
//   128-byte swizzle), each thread's arriving on the stage's "full"
//   mbarrier when they land; the tokens' scales loaded a chunk ahead and
//   stored, each thread arriving again after its store. Its per-chunk
//   steps are address increments: with 64-bit arithmetic per copy it was
//   what the consumers waited on (ncu).
//
// Determinism: each output is one warpgroup's FP32 sum over the stages in
// order; the same bits on every run.
//
// Split K (rkv_gemm_w4a8_sm90_splitk, batched calls whose grid would leave
// SMs idle: Flash wo_a's 64 blocks at up to 128 tokens): a cluster of KSPLIT
// blocks shares one output tile, block r taking the r-th run of chunks; the
// other ranks leave their sums in their own stage memory and rank 0 adds them
// in rank order over distributed shared memory (gemm_fp4_sm90.cu's scheme):
// no atomics, no workspace, the same bits on every run (not those of one
// block over all of K). Each rank counts the bad shift bytes of its own
// chunks.
//
// Shift bytes past the table (>= kShiftRows: only a form not built by
// rawkv.gemm.w4a8_weight, i.e. written by hand or corrupted memory) are
// device-side data out of range: skipped and counted, never followed, as
// the CPU path (rawkv.reference.gemm_w4a8.form_grouped / form_ragged) does.
// The block reads as zeros (+-0 by the code's sign): the byte already
// loaded is compared as it picks its table (the computed rows are bytes
// kFastShift .. kShiftRows - 1, one unsigned compare; every other byte
// indexes the table in shared memory, whose rows past the table are zeros).
// Each lane ORs a SIMD test of its shift words into a flag (a byte >= 21
// sets its bit 7: four instructions per chunk), and only a lane that met
// such a byte re-reads its row pair's bytes from global memory after the
// epilogue and counts them: each bad block of the weight proper (rows < n,
// blocks < k / 32; padding is not counted) once per call, by lane t = 0 of
// the quad that owns its row pair, in the block of the first token tile of
// its group (batched: blockIdx.y == 0; ragged: the tile that starts at the
// expert's first row, so experts without rows count nothing), one atomicAdd
// of that lane's count into errors[0]. Host-side checking would need a
// host sync.
#include "gemm_fp4.cuh"
#include "gemm_w4a8.cuh"
#include "sm90.cuh"
#include "wgmma_rs.cuh"
using namespace rkv;

#ifndef RKV_W4A8_TWO_BLOCKS_MAX_BN
#error "RKV_W4A8_TWO_BLOCKS_MAX_BN must come from rawkv/kernels/gemm_w4a8.py"
#endif

namespace {

constexpr int kThreads = 384;
constexpr int kBM = 128, kTiles = kBM / 16;

// 16 bytes, or zeros where `bytes` is 0 (the source is then not read).
__device__ __forceinline__ void cp_async16_zfill_if(bool on, u32 dst, const void* gmem, u32 bytes) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16, %3;\n}\n"
                 ::"r"(dst), "l"(gmem), "r"((int)on), "r"(bytes));
}

// Blocks per SM and the warpgroups' registers (setmaxnreg; the sums stay
// within what the launch bounds give a block: 384 x 168 for one block, 384
// x 80 for two). The 16-token tile (decode) needs few registers and fits
// twice per SM, whose second block's warps hide the chunk loop's latency;
// the others take one, their consumers 232 registers.
// (RKV_W4A8_TWO_BLOCKS_MAX_BN: rawkv.kernels.gemm_w4a8.blocks_per_sm's, so
// the dispatch and the launch bounds agree.)
template <int BN> constexpr int kBlocksPerSM = BN <= RKV_W4A8_TWO_BLOCKS_MAX_BN ? 2 : 1;
template <int BN> constexpr int kConsumerRegs = kBlocksPerSM<BN> == 2 ? 96 : 232;
constexpr int kProducerRegs = 40;
static_assert(256 * 232 + 128 * kProducerRegs <= 384 * 168 && 256 * 96 + 128 * kProducerRegs <= 384 * 80,
              "the warpgroups' registers fit the block's");

}  // namespace

// Shared memory, per stage: the B tile (BN token rows of 128 bytes, 1024-byte
// aligned for the swizzle), the packed codes and shifts of the block's row
// tiles, the tokens' scales; then the E4M3 table and the mbarriers.
template <int BN, int STAGES, int KSPLIT, bool SB>
__device__ __forceinline__ void gemm_w4a8(
    const u8* __restrict__ wq, const u8* __restrict__ wsh, const float* __restrict__ wrow,
    const float* __restrict__ wgs, const u8* __restrict__ x, const u8* __restrict__ xsf, i64 xs_t, i64 xs_g,
    i64 ss_t, i64 ss_g, i64 ss_b, __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors) {
    constexpr int kBStage = BN * 128;
    constexpr int kWStage = kTiles * (kCodeBytes + kShiftBytes);
    constexpr int kSStage = BN * 4;
    static_assert(kBStage % 1024 == 0, "B stages stay 1024-byte aligned");
    static_assert(KSPLIT == 1 || BN * 512 <= STAGES * (kBStage + kWStage + kSStage),
                  "split K keeps the partial sums in the stages' shared memory");
    __shared__ int s_off[RKV_GEMM_MAX_SEGMENTS];
    // Split K: rank 0's "the partial sums are ready" (every consumer thread
    // of the other blocks arrives) and each other block's "rank 0 has read
    // them" (rank 0's consumer threads arrive).
    __shared__ __align__(8) u64 s_split_bar[2];
    extern __shared__ u8 s_dyn[];
    u8* smem = reinterpret_cast<u8*>((reinterpret_cast<size_t>(s_dyn) + 1023) & ~size_t(1023));
    u8* const s_b = smem;
    u8* const s_w = s_b + STAGES * kBStage;
    u8* const s_s = s_w + STAGES * kWStage;
    u32* const s_table = reinterpret_cast<u32*>(s_s + STAGES * kSStage);
    const u32 bar_full = smem_u32(s_table + 2 * kTableRows);
    const u32 bar_empty = bar_full + 8 * STAGES;

    const int row_block = blockIdx.x / KSPLIT;
    const int split = blockIdx.x % KSPLIT;     // the block's rank in its cluster
    int g, t0, t1;
    if (!block_tokens(offsets, experts, tokens, BN, s_off, errors, out, os_t, n, row_block * kBM, kBM, g, t0, t1))
        return;
    const int tiles16 = (n + 15) / 16, chunks = (k + 127) / 128;
    // The block's run of chunks: all of them, or its KSPLIT-th; the
    // consumers count them from 0 (`nloc`), the producer's copies address
    // chunk c_beg + i.
    const int per_split = (chunks + KSPLIT - 1) / KSPLIT;
    const int c_beg = min(chunks, split * per_split), c_end = min(chunks, c_beg + per_split);
    const int nloc = c_end - c_beg;
    const int tile0 = row_block * kTiles;
    const int live_tiles = min(kTiles, tiles16 - tile0);
    const int rows = t1 - t0;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full + 8 * s, 256);   // each producer thread's copies, then its scale store
            mbar_init(bar_empty + 8 * s, 8);    // the 8 consumer warps
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
        // Codes: kTiles x 64 pieces of 16 bytes, piece p + 128 i (tile p / 64 + 2 i).
        const i64 tile_bytes = (i64)chunks * kCodeBytes;
        const u8* wsrc = wq + ((i64)g * tiles16 + tile0 + (p >> 6)) * tile_bytes + 16 * (p & 63);
        // Shifts: kTiles x 4 pieces, on threads p < 32 (tile p / 4).
        const u8* ssrc = wsh + ((i64)g * tiles16 + tile0 + (p >> 2)) * chunks * kShiftBytes + 16 * (p & 3);
        const bool slive = p < 4 * kTiles && (p >> 2) < live_tiles;
        // Activations: unit u = p % 8 of token rows p / 8 + 16 j (the same
        // row % 8 for every j); rows past the tile's last token are not
        // copied: their B columns (stale bytes) only reach outputs the
        // epilogue does not write (the MMA's columns are independent).
        const int unit = p & 7, r0 = p >> 3;
        const u8* xsrc = x + (i64)(t0 + r0) * xs_t + (i64)g * xs_g + 16 * unit;
        const u32 xdst = r0 * 128 + ((unit ^ (r0 & 7)) << 4);
        // The tokens' scales: token p on threads p < BN, stored in the order
        // the consumers read them: token 8 j + 2 t + h (j = 2 j2 + i) at float
        // 16 j2 + 4 t + 2 i + h, so lane t's 16-byte load j2 and its quad's
        // are 64 contiguous bytes. Loaded one chunk ahead into a register and
        // stored (a warp's 32 stores are one shared-memory wavefront; a 4-byte
        // cp.async costs one per thread: 14% of the kernel's wavefronts, ncu).
        // Float32 scales, or E8M0 bytes (SB: ActScale).
        using Scale = ActScale<SB>;
        const typename Scale::T* fsrc = reinterpret_cast<const typename Scale::T*>(xsf) + (i64)(t0 + p) * ss_t
                                        + (i64)g * ss_g;
        const u32 sdst = 4 * (16 * (p >> 4) + 4 * ((p >> 1) & 3) + 2 * ((p >> 3) & 1) + (p & 1));
        const bool sown = p < rows;
        // Every per-chunk step is an address increment from here: 32-bit
        // strides, running pointers, liveness as bits (with the arithmetic
        // per copy, ncu showed the consumers' full-barrier wait looping ~7
        // times per chunk against the producer's empty wait ~1.3).
        const u32 tile2 = (u32)(2 * tile_bytes);          // from tile p / 64 + 2 i to + 2 (i + 1)
        const u64 row16 = (u64)(16 * xs_t);               // token rows 16 apart
        u32 wlive = 0, xlive = 0;
#pragma unroll
        for (int i = 0; i < kTiles / 2; ++i) wlive |= (u32)((p >> 6) + 2 * i < live_tiles) << i;
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) xlive |= (u32)(r0 + 16 * j < rows) << j;
        const u8* wcur = wsrc + (i64)c_beg * kCodeBytes;
        const u8* scur = ssrc + (i64)c_beg * kShiftBytes;
        const u8* xcur = xsrc + (i64)128 * c_beg;
        const typename Scale::T* fcur = fsrc + c_beg * ss_b;
        int kcol = c_beg * 128 + 16 * unit;              // the thread's activation column in chunk c
        const u32 wdst0 = smem_u32(s_w) + 16 * p, bdst0 = smem_u32(s_b) + xdst, sdst0 = smem_u32(s_s) + sdst;
        float sc_next = sown && c_beg < c_end ? Scale::value(Scale::load(fcur)) : 0.0f;
        int s = 0;
        u32 parity = 1;   // of the empty barriers: a fresh barrier passes parity 1
        for (int c = c_beg; c < c_end; ++c) {
            mbar_wait(bar_empty + 8 * s, parity);
            const u32 wdst = wdst0 + s * kWStage;
            const u8* wp = wcur;
#pragma unroll
            for (int i = 0; i < kTiles / 2; ++i, wp += tile2) cp_async16_if((wlive >> i) & 1u, wdst + 2048 * i, wp);
            cp_async16_if(slive, wdst + kTiles * kCodeBytes, scur);
            // Columns past k are zeros (K is a multiple of 32: a 16-byte
            // unit is wholly in or out; such a unit reads no bytes, from the
            // row's start).
            const u32 bytes = kcol < k ? 16u : 0u;
            const u32 bdst = bdst0 + s * kBStage;
            const u8* xp = bytes ? xcur : xsrc;
#pragma unroll
            for (int j = 0; j < BN / 16; ++j, xp += row16) cp_async16_zfill_if((xlive >> j) & 1u, bdst + 2048 * j, xp, bytes);
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar_full + 8 * s) : "memory");
            const float sc = sc_next;
            if (sown && c + 1 < c_end) sc_next = Scale::value(Scale::load(fcur + ss_b));
            if (p < BN) st_shared(sdst0 + s * kSStage, __float_as_uint(sc));
            mbar_arrive(bar_full + 8 * s);     // (release: the scale's store)
            wcur += kCodeBytes;
            scur += kShiftBytes;
            xcur += 128;
            fcur += ss_b;
            kcol += 128;
            if (++s == STAGES) {
                s = 0;
                parity ^= 1;
            }
        }
        return;
    }

    // ---------------- consumers ----------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs<BN>));
    // The E4M3 table in shared memory (only the rare blocks off the computed
    // rows read it), written by the consumers while the producer's first
    // copies are in flight: its constant loads (divergent addresses, each
    // its own constant-cache request) cost 0.5-0.7 us per block on the
    // path to the first chunk when every thread wrote it before the split
    // (H100: Pro wo_a at 1 token 18.9-19.4 -> 18.1 us).
    static_assert(2 * kFastShift <= kTableWords, "the table holds the rows read from shared memory");
    for (int i = threadIdx.x; i < 2 * kTableRows; i += 256) s_table[i] = i < kTableWords ? c_table[i] : 0u;
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int q = lane >> 2, t = lane & 3;
    const int my_tile = wg * 4 + warp;             // within the block
    const u32 table = smem_u32(s_table);
    u32 past = 0;                                  // bit 7 of a byte: a shift byte past the table seen

    // Per stage st: the lane's packed codes and shifts, the tokens' scales,
    // the B tile's descriptor (linear in the address: + 2 per 32 bytes).
    const u32 w_lane = smem_u32(s_w) + my_tile * kCodeBytes + lane * 16;
    const u32 sh_lane = smem_u32(s_w) + kTiles * kCodeBytes + my_tile * kShiftBytes + q * 8;
    const u32 sc_lane = smem_u32(s_s) + 16 * t;
    const u64 desc0 = b_desc(smem_u32(s_b));

    // The E4M3 A fragments of a stage's four k32 steps: lane (q, t), step
    // s: word 2 s (row q) and 2 s + 1 (row q + 8) of its 32 packed bytes,
    // each through its block's table (the shift bytes 2 s, 2 s + 1 of row
    // pair q). When every shift byte the warp reads is one of the computed
    // rows (kFastShift .. kShiftRows - 1: every block of a real checkpoint
    // but those 2^11 below their row's largest), each table is two prmt and
    // two multiply-adds from the shift word; otherwise (a warp-uniform
    // branch) block_table, which also reads the exact rows and the zero
    // rows past the table, and the bytes past the table are flagged.
    auto fragments = [&](u32 st, u32 (&a)[4][4]) {
        const u32 wst = w_lane + st * kWStage;
        const uint4 c0 = ld_shared16(wst);            // steps 0, 1
        const uint4 c1 = ld_shared16(wst + 512);      // steps 2, 3
        const uint2 sh = ld_shared8(sh_lane + st * kWStage);
        const u32 words[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        // Step s4's two words through the tables of bytes 2 (s4 & 1) and
        // 2 (s4 & 1) + 1 of its shift word, `table_of(word, byte)`.
        auto convert = [&](auto table_of) {
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) {
                const u32 shw = s4 < 2 ? sh.x : sh.y;
                const uint2 tq = table_of(shw, 2 * (s4 & 1)), tq8 = table_of(shw, 2 * (s4 & 1) + 1);
                e4m3_of_e2m1(words[2 * s4], tq.x, tq.y, a[s4][0], a[s4][2]);
                e4m3_of_e2m1(words[2 * s4 + 1], tq8.x, tq8.y, a[s4][1], a[s4][3]);
            }
        };
        if (__any_sync(0xffffffffu, ((outside_fast(sh.x) | outside_fast(sh.y)) & 0x80808080u) != 0)) {
            past |= (sh.x + kPastAdd) | sh.x | (sh.y + kPastAdd) | sh.y;
            convert([&](u32 w, int i) { return block_table(table, (w >> (8 * i)) & 255u); });
        } else {
            convert(fast_table);
        }
    };
    auto acquire = [&](u32 st, u32 ph) {
        mbar_wait(bar_full + 8 * st, ph);
        // The producer's cp.async writes (generic proxy), acquired through
        // the barrier, ordered before this warpgroup's wgmma reads.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    };
    // The rest runs on the block's tokens at N columns, the least multiple
    // of 16 that holds them (run_tile): a ragged block's last tile of an
    // expert, or a batched call's last token tile, issues m64nNk32 wgmmas
    // and promotes N / 2 accumulators instead of the tile's BN / 2. Each
    // token's column of a wgmma is computed alone, so its bits are those of
    // the full tile (tested: the same bits for every token tiling). The
    // stages keep the tile's layout (B rows 128 bytes apart, whatever N).
    auto run = [&](auto n_tag) {
        constexpr int N = decltype(n_tag)::value;
        float acc[N / 2], part[N / 2];
#pragma unroll
        for (int j = 0; j < N / 2; ++j) acc[j] = part[j] = 0.0f;    // (part: the first wgmma overwrites it)
        // The chunk of stage st: its four wgmmas into a block partial (the
        // first overwrites it).
        auto issue = [&](u32 st, const u32 (&a)[4][4], float (&part)[N / 2]) {
            const u64 desc = desc0 + st * (kBStage >> 4);
            wgmma_fence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) wgmma_k32_e4m3<N>(part, a[s4], desc + 2 * s4, s4);
            wgmma_commit();
        };
        // The partial into the accumulators with the tokens' scales of its
        // block; then its stage goes back to the producer.
        auto promote = [&](u32 st, const float (&part)[N / 2]) {
            promote_partial(acc, part, sc_lane + st * kSStage);
            __syncwarp();
            if (lane == 0) mbar_arrive(bar_empty + 8 * st);
        };
        // Chunk c (stage st): its four wgmmas into the block partial; meanwhile
        // chunk c + 1's A fragments into the other register set (`next`); then
        // the promotion, which needs the partial complete. The stage and the
        // full barrier's parity are carried along (no division by STAGES).
        u32 a0[4][4], a1[4][4];
        auto chunk = [&](int c, u32 st, u32 ph, const u32 (&a)[4][4], u32 (&next)[4][4]) {
            issue(st, a, part);
            if (c + 1 < nloc) {
                const bool wrap = st + 1 == STAGES;
                const u32 st1 = wrap ? 0u : st + 1;
                acquire(st1, wrap ? ph ^ 1u : ph);
                fragments(st1, next);
            }
            wgmma_wait<0>();
            promote(st, part);
        };
        u32 st = 0, ph = 0;                            // chunk c's stage and its full barrier's parity
        auto advance = [&]() {
            if (++st == STAGES) {
                st = 0;
                ph ^= 1u;
            }
        };
        if (nloc > 0) {                                // (K = 0: no chunk, the outputs are zeros)
            acquire(0, 0);
            fragments(0, a0);
        }
        for (int c = 0; c < nloc; c += 2) {
            chunk(c, st, ph, a0, a1);
            advance();
            if (c + 1 < nloc) {
                chunk(c + 1, st, ph, a1, a0);
                advance();
            }
        }
        const int row = (tile0 + my_tile) * 16 + q;

        // The bad shift bytes this lane met in the block's chunks, counted once
        // per call (see the top).
        if ((past & 0x80808080u) && t == 0 && errors && my_tile < live_tiles &&
            first_tile(s_off, offsets != nullptr, g, t0, tokens)) {
            const int bad = count_past(wsh + ((i64)g * tiles16 + tile0 + my_tile) * chunks * kShiftBytes + q * 8,
                                       row, n, c_beg, c_end, k / 32);
            if (bad) atomicAdd(errors, bad);
        }

        // Split K: this block's sums join rank 0's (sm90.cuh, split_k_sum).
        if constexpr (KSPLIT > 1) {
            if (!split_k_sum<KSPLIT>(acc, smem_u32(smem), s_split_bar, split)) return;
        }

        // Epilogue: rows q and q + 8 of the warp's tile (the wgmma D fragment:
        // accumulator 4 j + h at row q, token 8 j + 2 t + h; 4 j + 2 + h at row
        // q + 8), times the row's power of two and the group's global scale.
        __nv_bfloat16* const obase = out + (i64)g * os_g;
        const int row0 = tile0 * 16;                   // the block's first output feature
        // Where the block's BM features exist and each token's run of them is
        // 16-byte aligned, through shared memory as the W4A16 wgmma kernel's
        // (sm90.cuh, store_staged): token rows of BM + 8 values, 16 bytes of
        // padding putting a quad's four tokens in different banks. Both consumer
        // warpgroups are done with the stages first (the producer's last copies
        // were acquired with the last stage; split K: rank 0's stages hold no
        // partial sums).
        // Rows q and q + 8's power of two times the group's global scale (rows
        // of the padded N only).
        auto row_scale = [&](int r) { return wrow[(i64)g * tiles16 * 16 + r] * wgs[g]; };
        if (row0 + kBM <= n && ((reinterpret_cast<size_t>(obase + row0) | ((size_t)os_t * 2)) & 15) == 0) {
            constexpr int kPitch = kBM + 8;
            static_assert(N * kPitch * 2 <= STAGES * (kBStage + kWStage + kSStage),
                          "the staged tile fits in the stages");
            __nv_bfloat16* const stile = reinterpret_cast<__nv_bfloat16*>(smem);
            const float sc0 = row_scale(row), sc1 = row_scale(row + 8);
            asm volatile("bar.sync 1, 256;\n" ::: "memory");
            // Two 8-token groups at a time by stmatrix, as the W4A16 wgmma
            // kernel's epilogue (rows q and q + 8 of group j: matrices 0 and
            // 1, of group j + 1: 2 and 3; lane 8 i + c addresses matrix i's
            // token c).
            const int mi = lane >> 3, mc = lane & 7;
            const u32 sbase = smem_u32(stile + my_tile * 16 + 8 * (mi & 1));
#pragma unroll
            for (int j = 0; j < N / 8; j += 2) {
                const float* a = &acc[4 * j];
                stmatrix_x4_trans(sbase + 2 * (8 * (j + (mi >> 1)) + mc) * kPitch,
                                  bf16x2_rn(a[0] * sc0, a[1] * sc0), bf16x2_rn(a[2] * sc1, a[3] * sc1),
                                  bf16x2_rn(a[4] * sc0, a[5] * sc0), bf16x2_rn(a[6] * sc1, a[7] * sc1));
            }
            store_staged<kBM, kPitch>(stile, obase + (i64)t0 * os_t + row0, os_t, t1 - t0);
            return;
        }
        if (my_tile >= live_tiles) return;             // (rows past the padded N: no scales to read)
        const float sc0 = row_scale(row), sc1 = row_scale(row + 8);
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int tok = t0 + 8 * j + 2 * t + h;
                if (tok >= t1) continue;
                __nv_bfloat16* orow = obase + (i64)tok * os_t;
                if (row < n) orow[row] = __float2bfloat16_rn(acc[4 * j + h] * sc0);
                if (row + 8 < n) orow[row + 8] = __float2bfloat16_rn(acc[4 * j + 2 + h] * sc1);
            }
        }
    };
    // (Split-K instances keep BN columns: they serve batched calls, whose
    // token tiles are full but the last, and one main loop keeps their
    // compile time.)
    if constexpr (KSPLIT > 1) run(IntC<BN>{});
    else run_tile<BN>(rows, run);
}

// One block per output tile, all of K.
template <int BN, int STAGES, bool SB>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM<BN>) rkv_gemm_w4a8_sm90(
    const u8* __restrict__ wq, const u8* __restrict__ wsh, const float* __restrict__ wrow,
    const float* __restrict__ wgs, const u8* __restrict__ x, const u8* __restrict__ xsf, i64 xs_t, i64 xs_g,
    i64 ss_t, i64 ss_g, i64 ss_b, __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors) {
    gemm_w4a8<BN, STAGES, 1, SB>(wq, wsh, wrow, wgs, x, xsf, xs_t, xs_g, ss_t, ss_g, ss_b, out, os_t, os_g, n, k,
                                 tokens, offsets, experts, errors);
}

// A cluster of KSPLIT blocks per output tile, each a KSPLIT-th of K (batched
// calls only: grid x is the feature blocks times KSPLIT).
template <int BN, int STAGES, int KSPLIT, bool SB>
__global__ void __cluster_dims__(KSPLIT, 1, 1) __launch_bounds__(kThreads, kBlocksPerSM<BN>) rkv_gemm_w4a8_sm90_splitk(
    const u8* __restrict__ wq, const u8* __restrict__ wsh, const float* __restrict__ wrow,
    const float* __restrict__ wgs, const u8* __restrict__ x, const u8* __restrict__ xsf, i64 xs_t, i64 xs_g,
    i64 ss_t, i64 ss_g, i64 ss_b, __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g,
    int n, int k, int tokens, const int* __restrict__ offsets, int experts, int* __restrict__ errors) {
    gemm_w4a8<BN, STAGES, KSPLIT, SB>(wq, wsh, wrow, wgs, x, xsf, xs_t, xs_g, ss_t, ss_g, ss_b, out, os_t, os_g, n, k,
                                      tokens, nullptr, experts, errors);
}
