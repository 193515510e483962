// gemm_w4a8_mma.cu: the W4A8 grouped GEMM for few tokens, on mma.sync
// (built for sm_90, where the W4A8 ops run).
//
// The same product, arguments and packed weight form as gemm_w4a8_sm90.cu
// (docs/gemm.md, "W4A8"): at a few tokens per group (decode) or per expert
// (MoE), the wgmma kernel's 128-feature blocks leave most SMs without weight
// bytes in flight, and its m64 x 64-token tile wastes most of each MMA. This
// kernel is the W4A16 mma.sync kernel's shape (gemm_fp4.cu): the weight is
// the MMA's A operand (16 output features per m-tile), the tokens its B
// operand (8 per n-tile); a lane's 32 packed bytes per (m-tile, 128-column
// chunk) are its A fragments of the chunk's four k32 steps (the form's 16-byte
// loads are one warp's wgmma A fragment, which is mma.sync's too).
//
// FP16 MMAs, not FP8 ones: Hopper runs mma.sync on E4M3 operands as FP16
// MMAs after converting both (ptxas emits F2FP + HMMA), so the kernel
// converts each operand once itself. Every E4M3 value, and every E2M1 code,
// is an FP16 value exactly, so the products stay exact and the sums are
// FP32 (at least as precise as the bound of the FP8 tensor cores).
// * Weights: each k32 step is one MXFP4 block of each row, so its power of
//   two (the block's shift) is applied to the step's FP32 result, not to the
//   codes: the codes go through the shift-0 table (E2M1 -> E4M3 by prmt, 7
//   instructions per 8 codes, no table per block) and one E4M3 -> FP16
//   conversion per pair. A shift byte past the table gives the factor 0:
//   the block reads as zeros.
// * The k order: step s's two m16n8k16 MMAs take columns 32 s + 16 h +
//   4 t .. + 3 of lane (q, t) as k slots 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (A:
//   the E4M3 bytes of nibbles 4 h .. 4 h + 3 of the row's word; B: the
//   token's 4 bytes at that column, one word), the same permutation for A
//   and B.
// * Per step, the result (FP32) times the rows' powers of two (exact) is
//   added to the chunk's partial sums, in step order (one FMA each); per
//   chunk, the partial sums times each token's scale of the chunk are added
//   to the accumulators (one FMA each). (Until session 44 each step's result
//   took both factors, two FP32 operations per accumulator, and the exact
//   shift test below ran on every chunk: 284 instructions a chunk in the
//   decode tile's loop against about 247, 2-3% more time.)
//
// Warps split K inside a block (KS) and sum their accumulators through
// shared memory in a fixed order: the same bits on every run and for every
// token tile of the same KS (not the wgmma kernel's bits: its order
// differs).
//
// Template: MT m-tiles and NT n-tiles per warp, KS warps splitting K, RW
// warps along the rows, a ring of S stages of one chunk per warp (cp.async
// of the m-tiles' codes and shifts: 1088 bytes each).
//
// Shift bytes past the table read as zeros and are counted once per call,
// as in the wgmma kernel: each warp counts the bad blocks of its m-tiles in
// its own chunks, lane t = 0 of the quad that owns the row pair, in the
// group's first token tile only.
#include "gemm_fp4.cuh"
#include "gemm_w4a8.cuh"
#include "sm90.cuh"
using namespace rkv;

namespace {

constexpr int kTileBytes = kCodeBytes + kShiftBytes;   // one m-tile's chunk in a ring stage

// The FP16 pair of the two E4M3 bytes in the low (HI = 0) or high half of
// w (one F2FP on the half: no shift or mask first).
template <int HI>
__device__ __forceinline__ u32 f16x2_of_e4m3x2(u32 w) {
    u32 d;
    if (HI) asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, h;\n}\n" : "=r"(d) : "r"(w));
    else asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "=r"(d) : "r"(w));
    return d;
}

// d = a . b (FP16 operands, FP32 out, from zero).
__device__ __forceinline__ void mma16816_f16_zero(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

// The biased FP32 exponents 2^(e - SHIFT_BIAS) of four shift bytes e, one
// per byte, +0 for a byte past the table (the block reads as zeros). Every
// byte of an accepted form is below kShiftRows, so the kernel adds
// kExpBias (no byte carries) unless the lane's SIMD test (bit 7 of a byte of
// (w + kPastAdd) | w, with false alarms only beside a byte past the table)
// says otherwise; then this exact form.
constexpr u32 kExpBias = (127u - kShiftBias) * 0x01010101u;
static_assert(kShiftRows + 127u - kShiftBias < 256u, "a biased exponent fits its byte");
__device__ __forceinline__ u32 factor_exponents(u32 w) {
    const u32 past = __vcmpgeu4(w, kShiftRows * 0x01010101u);
    return ((w & ~past) + kExpBias) & ~past;
}

// The factor of byte b of factor_exponents' word.
__device__ __forceinline__ float shift_factor(u32 fe, int b) {
    return __uint_as_float((b == 3 ? fe >> 1 : fe << (23 - 8 * b)) & 0x7F800000u);
}

}  // namespace

template <int MT, int NT, int KS, int RW, int S, bool SB>
__global__ void __launch_bounds__(32 * KS * RW) rkv_gemm_w4a8_mma(
    const u8* __restrict__ wq, const u8* __restrict__ wsh, const float* __restrict__ wrow,
    const float* __restrict__ wgs, const u8* __restrict__ x, const u8* __restrict__ xsf, i64 xs_t, i64 xs_g,
    i64 ss_t, i64 ss_g, __nv_bfloat16* __restrict__ out, i64 os_t, i64 os_g, int n, int k, int tokens,
    const int* __restrict__ offsets, int experts, int* __restrict__ errors) {
    constexpr int TT = 8 * NT;  // tokens per block
    __shared__ float s_red[KS > 1 ? (KS - 1) * RW * 32 * MT * NT * 4 : 1];
    __shared__ int s_off[RKV_GEMM_MAX_SEGMENTS];
    __shared__ __align__(16) u8 s_ring[KS * RW * S * MT * kTileBytes];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rw = warp % RW, ks = warp / RW;
    const int q = lane >> 2, t = lane & 3;

    // Programmatic dependent launch (common.cuh; gemm_fp4.cu's scheme): a
    // batched call streams its first stages of weights before it waits for
    // the kernel before it; a ragged one reads its offsets (and may write
    // rows) at once.
    if (offsets) pdl_wait();
    int g, t0, t1;
    if (!block_tokens(offsets, experts, tokens, TT, s_off, errors, out, os_t, n, blockIdx.x * RW * MT * 16,
                      RW * MT * 16, g, t0, t1))
        return;

    const int tiles16 = (n + 15) / 16, chunks = (k + 127) / 128;
    const int tile0 = (blockIdx.x * RW + rw) * MT;
    const int per_warp = (chunks + KS - 1) / KS;
    const int c_beg = min(chunks, ks * per_warp), c_end = min(chunks, c_beg + per_warp);

    // This lane's B column: token q of each n-tile; its accumulators'
    // tokens 8 j + 2 t + h (their scales). A token past the block's last
    // reads that last token's row and scales instead: column q of an MMA
    // and the accumulators of a token depend only on that token's values,
    // and the epilogue stores no token past t1, so no load tests the token
    // (as gemm_fp4.cu). Running pointers at chunk c_beg: load_acts steps them.
    // (SB: the scales are E8M0 bytes, else float32: ActScale.)
    using Scale = ActScale<SB>;
    const u8* xrow[NT];
    const typename Scale::T* srow[NT][2];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int tok = min(t0 + 8 * j + q, t1 - 1);
        xrow[j] = x + (i64)tok * xs_t + (i64)g * xs_g + 4 * t + 128 * c_beg;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int st = min(t0 + 8 * j + 2 * t + h, t1 - 1);
            srow[j][h] = reinterpret_cast<const typename Scale::T*>(xsf) + (i64)st * ss_t + (i64)g * ss_g + c_beg;
        }
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
    u32 past[MT];                                     // bit 7 of a byte: a shift byte past the table seen
#pragma unroll
    for (int i = 0; i < MT; ++i) past[i] = 0;

    // Each warp streams its m-tiles' chunks through its own ring (cp.async,
    // S - 1 stages ahead; only the warp reads it, so a warp barrier orders
    // it): per m-tile the 1024 code bytes (lane l: bytes 16 l and 512 + 16 l,
    // its two planes) and the 64 shift bytes (lanes 0..3).
    u8* const ring = s_ring + warp * (S * MT * kTileBytes);
    const u32 ring_s = smem_u32(ring);
    // issue(): the next chunk of the warp's range (chunk cn, from wsrc /
    // ssrc: running pointers) into the next stage (at wr), predicated off
    // past the range.
    const u8* wsrc[MT];
    const u8* ssrc[MT];
    bool tile_ok[MT];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const i64 at = ((i64)g * tiles16 + tile0 + i) * chunks + c_beg;
        tile_ok[i] = tile0 + i < tiles16;
        wsrc[i] = wq + at * kCodeBytes + 16 * lane;
        ssrc[i] = wsh + at * kShiftBytes + 16 * (lane & 3);
    }
    const u32 ring_end = ring_s + S * MT * kTileBytes;
    u32 wr = ring_s;
    int cn = c_beg;
    // Once the warp has issued its last chunk's copies (chunk `last`) and
    // waited, the next kernel may start: `trigger` is -1 (no chunk) until
    // the wait.
    const int last = c_end > c_beg ? c_end - 1 : -1;
    int trigger = offsets ? last : -1;
    auto issue = [&]() {
        const bool live = cn < c_end;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const u32 dst = wr + i * kTileBytes;
            const bool on = live && tile_ok[i];
            cp_async16_if<true>(on, dst + 16 * lane, wsrc[i]);
            cp_async16_if<true>(on, dst + 512 + 16 * lane, wsrc[i] + 512);
            cp_async16_if<true>(on && lane < 4, dst + kCodeBytes + 16 * lane, ssrc[i]);
            wsrc[i] += kCodeBytes;
            ssrc[i] += kShiftBytes;
        }
        cp_async_commit();
        if (cn == trigger) pdl_launch_dependents();
        ++cn;
        wr = wr + MT * kTileBytes == ring_end ? ring_s : wr + MT * kTileBytes;
    };
#pragma unroll
    for (int p = 0; p < S - 1; ++p) issue();
    if (!offsets) {
        pdl_wait();              // (the activations, their scales and the outputs from here on)
        trigger = last;
        if (cn > last) pdl_launch_dependents();   // (its last weights went before the wait)
    }

    // A chunk's activations (zeros past k: K is a multiple of 32, so a
    // 16-byte unit is wholly in or out) and the tokens' scales, loaded a
    // chunk ahead so that their latency overlaps the chunk before.
    // A chunk before c_full is the warp's and wholly inside K: its loads
    // need no predicate.
    const int c_full = min(c_end, k / 128);
    auto load_acts = [&](int c, u32 (&bx)[NT][8], u32 (&sc)[NT][2], auto full_tag) {
        const bool full = decltype(full_tag)::value, live = c < c_end;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                const bool on = full || (live && 128 * c + 16 * m < k);
                bx[j][m] = on ? __ldg(reinterpret_cast<const u32*>(xrow[j] + 16 * m)) : 0u;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) sc[j][h] = full || live ? Scale::load(srow[j][h]) : 0u;
            xrow[j] += 128;
#pragma unroll
            for (int h = 0; h < 2; ++h) ++srow[j][h];
        }
    };
    u32 bx[NT][8];
    u32 sc[NT][2];                                    // (Scale::load's: Scale::value where used)
    if (c_beg < c_full) load_acts(c_beg, bx, sc, Flag<true>{});
    else load_acts(c_beg, bx, sc, Flag<false>{});
    int slot = 0;                                     // the stage multiplied
    // FULL: the next chunk's loads need no predicate (the steps but the
    // warp's last one or two, written apart: gemm_fp4.cu's lean steps).
    auto step = [&](int c, auto full) {
        u32 bxn[NT][8];
        u32 scn[NT][2];
        load_acts(c + 1, bxn, scn, full);
        cp_async_wait<S - 2>();
        __syncwarp();
        issue();
        // The chunk's activations as FP16 pairs (word m of token q: its B
        // fragments of step m / 2, MMA m % 2).
        u32 bh[NT][8][2];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                bh[j][m][0] = f16x2_of_e4m3x2<0>(bx[j][m]);
                bh[j][m][1] = f16x2_of_e4m3x2<1>(bx[j][m]);
            }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const u32 src = ring_s + (slot * MT + i) * kTileBytes;
            const uint4 c0 = ld_shared16(src + 16 * lane);          // steps 0, 1
            const uint4 c1 = ld_shared16(src + 512 + 16 * lane);    // steps 2, 3
            const uint2 sh = ld_shared8(src + kCodeBytes + 8 * q);
            const u32 badx = (sh.x + kPastAdd) | sh.x, bady = (sh.y + kPastAdd) | sh.y;
            past[i] |= badx | bady;
            // (a branch, not a select: the exact test of each byte is rare work)
            u32 fb[2] = {sh.x + kExpBias, sh.y + kExpBias};
            if ((badx | bady) & 0x80808080u) {
                fb[0] = factor_exponents(sh.x);
                fb[1] = factor_exponents(sh.y);
            }
            const u32 words[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
            float part[NT][4];                               // the chunk's sum, before the tokens' scales
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) {
                u32 e[4];                                            // E4M3 bytes: rows q, q + 8 (lo, hi)
                e4m3_of_e2m1(words[2 * s4], kTable0Lo, kTable0Hi, e[0], e[2]);      // the shift-0 table
                e4m3_of_e2m1(words[2 * s4 + 1], kTable0Lo, kTable0Hi, e[1], e[3]);
                const float f0 = shift_factor(fb[s4 >> 1], 2 * (s4 & 1));       // row q's block s4
                const float f1 = shift_factor(fb[s4 >> 1], 2 * (s4 & 1) + 1);   // row q + 8's
                float d[NT][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 a[4] = {f16x2_of_e4m3x2<0>(e[2 * h]), f16x2_of_e4m3x2<0>(e[2 * h + 1]),
                                      f16x2_of_e4m3x2<1>(e[2 * h]), f16x2_of_e4m3x2<1>(e[2 * h + 1])};
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const u32* b = bh[j][2 * s4 + h];
                        if (h == 0) mma16816_f16_zero(d[j], a, b[0], b[1]);
                        else mma16816(d[j], a, b[0], b[1], true);
                    }
                }
                // partial r: row q (r < 2) or q + 8, token 8 j + 2 t + (r & 1); the
                // step's result times its blocks' powers of two is exact
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r)
                        part[j][r] = s4 == 0 ? d[j][r] * (r < 2 ? f0 : f1)
                                             : fmaf(d[j][r], r < 2 ? f0 : f1, part[j][r]);
            }
            // the chunk's partial sums times each token's scale of the chunk
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[i][j][r] = fmaf(part[j][r], Scale::value(sc[j][r & 1]), acc[i][j][r]);
        }
        slot = slot + 1 == S ? 0 : slot + 1;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int m = 0; m < 8; ++m) bx[j][m] = bxn[j][m];
            sc[j][0] = scn[j][0];
            sc[j][1] = scn[j][1];
        }
    };
    int c = c_beg;
    for (; c + 1 < c_full; ++c) step(c, Flag<true>{});
    for (; c < c_end; ++c) step(c, Flag<false>{});
    cp_async_wait<0>();

    // The bad shift bytes this warp met in its own chunks, counted once per
    // call (see the top).
    if (t == 0 && errors) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            if (tile_ok[i] && (past[i] & 0x80808080u) && first_tile(s_off, offsets != nullptr, g, t0, tokens)) {
                const int bad = count_past(wsh + ((i64)g * tiles16 + tile0 + i) * chunks * kShiftBytes + 8 * q,
                                           (tile0 + i) * 16 + q, n, c_beg, c_end, k / 32);
                if (bad) atomicAdd(errors, bad);
            }
        }
    }

    if (KS > 1 && !sum_split_k<MT, NT, KS, RW>(s_red, acc, ks, rw, lane)) return;

    // Epilogue: times the row's power of two and the group's global scale,
    // one rounding to BF16 (as the wgmma kernel).
    const float gsc = wgs[g];
    __nv_bfloat16* const obase = out + (i64)g * os_g;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        if (!tile_ok[i]) continue;
        const int row = (tile0 + i) * 16 + q;
        const float sc0 = wrow[(i64)g * tiles16 * 16 + row] * gsc, sc1 = wrow[(i64)g * tiles16 * 16 + row + 8] * gsc;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int tok = t0 + 8 * j + 2 * t + h;
                if (tok >= t1) continue;
                __nv_bfloat16* orow = obase + (i64)tok * os_t;
                if (row < n) orow[row] = __float2bfloat16_rn(acc[i][j][h] * sc0);
                if (row + 8 < n) orow[row + 8] = __float2bfloat16_rn(acc[i][j][2 + h] * sc1);
            }
        }
    }
}
