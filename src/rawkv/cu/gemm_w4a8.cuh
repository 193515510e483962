// gemm_w4a8.cuh: what both W4A8 GEMM kernels share (docs/gemm.md, "W4A8"):
// the packed form's sizes, the E4M3 table of each shift byte and the E2M1 ->
// E4M3 conversion through it, and the count of shift bytes past the table;
// and the wgmma kernel's promotion (tools/wgmma_fp8_ceiling.py times it too).
// gemm_w4a8_sm90.cu (wgmma, sm_90a) and gemm_w4a8_mma.cu (mma.sync) include it.
#pragma once
#include "common.cuh"
#include "sm90.cuh"

#if !defined(RKV_W4A8_TABLE) || !defined(RKV_W4A8_SHIFT_BIAS)
#error "RKV_W4A8_TABLE and RKV_W4A8_SHIFT_BIAS must come from rawkv/kernels/gemm_w4a8.py"
#endif

namespace rkv {

// An activation scale (one per token per 128 columns): float32, or an E8M0
// byte, 2^(b - 127), as DeepSeek-V4's act_quant stores it. The same FP32
// value either way, so the same products and bits. Each kernel takes the
// format per instance (template SB): read per call, the load kind cost the
// mma.sync kernel's loop 4-31 registers and the wgmma kernel's 16-token
// tile 3-7% (docs/gemm.md, "E8M0-byte scales").
// ActScale<BYTES>: T the stored element, load() what a register holds until
// the scale is used (bytes kept as bytes: converted where used, they cost the
// loop fewer registers), value() its FP32 value.
template <bool BYTES> struct ActScale {
    using T = float;
    static __device__ __forceinline__ u32 load(const T* p) { return __float_as_uint(__ldg(p)); }
    static __device__ __forceinline__ float value(u32 r) { return __uint_as_float(r); }
};
template <> struct ActScale<true> {
    using T = u8;
    static __device__ __forceinline__ u32 load(const T* p) { return __ldg(p); }
    static __device__ __forceinline__ float value(u32 r) { return ue8m0_value(r); }
};

constexpr int kCodeBytes = 1024;        // one row tile, one 128-column chunk (2 planes x 32 lanes x 16 B)
constexpr int kShiftBytes = 64;         // its shifts (8 row pairs x 8 B)
// The table's row of shift 0 (magnitudes 0..3, 4..7: 0, 0.5, 1, 1.5; 2, 3,
// 4, 6 as E4M3 bytes) and the biased shift from which every nonzero entry
// of a row is a normal number (0.5 x 2^-5 = 2^-6, E4M3's least normal).
constexpr u32 kTable0Lo = 0x3C383000u, kTable0Hi = 0x4C484440u;
constexpr u32 kShiftBias = RKV_W4A8_SHIFT_BIAS;
constexpr u32 kFastShift = kShiftBias - 5;
// The table in shared memory: one row per shift byte, so that any byte
// indexes it (SHIFT_TABLE's rows, then zeros for the bytes past it; the
// kernel reads the rows below kFastShift and those past the table).
constexpr int kTableRows = 256;

// The E4M3 byte of E2M1 magnitude i times 2^(e - SHIFT_BIAS), row e of
// rawkv.reference.gemm_w4a8.SHIFT_TABLE as two little-endian words (rows
// 0 .. kFastShift - 1 are the ones the kernel reads).
__constant__ u32 c_table[] = {RKV_W4A8_TABLE};
constexpr int kTableWords = sizeof(c_table) / sizeof(u32);
// The table's rows (SHIFT_ROWS = 21): a biased shift byte from here on is
// past the table.
constexpr u32 kShiftRows = kTableWords / 2;
static_assert(kShiftRows > kFastShift && kShiftRows <= 128, "the table's rows are the bytes below kShiftRows");
// Added to a word of shift bytes: bit 7 of (w + kPastAdd) | w is set in a
// byte iff some byte of w is >= kShiftRows (a byte >= 128 has it already; a
// carry into the next byte comes only from one >= 149).
constexpr u32 kPastAdd = (128u - kShiftRows) * 0x01010101u;

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Eight E2M1 codes of a packed word (pack_codes8: code j's magnitude at
// bits 4 j .. 4 j + 2; byte b's bit 3 holds code b's sign, its bit 7 code
// 4 + b's) -> the E4M3 bytes of codes 0..3 (lo) and 4..7 (hi) through the
// block's table (t0, t1: the E4M3 bytes of magnitudes 0..7): prmt on the
// magnitudes, then the signs ORed in at bit 7 of each byte, from w << 4
// (lo) and w (hi) as they lie: 7 instructions.
__device__ __forceinline__ void e4m3_of_e2m1(u32 w, u32 t0, u32 t1, u32& lo, u32& hi) {
    const u32 m = w & 0x77777777u;
    lo = prmt(t0, t1, m) | ((w << 4) & 0x80808080u);
    hi = prmt(t0, t1, m >> 16) | (w & 0x80808080u);
}

__device__ __forceinline__ uint2 ld_shared8(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}

// The computed row of shift byte e (kFastShift .. kShiftRows - 1): the
// shift-0 row with the shift added to each exponent field (no byte borrows
// or carries: bytes below 32).
__device__ __forceinline__ uint2 computed_row(u32 e) {
    return make_uint2(kTable0Lo + (e - kShiftBias) * 0x08080800u, kTable0Hi + (e - kShiftBias) * 0x08080808u);
}

// The E4M3 bytes of magnitudes 0..7 times 2^(e - SHIFT_BIAS) (two words),
// exact for every magnitude an accepted block (rawkv.gemm.w4a8_weight) can
// hold at that shift: from kFastShift on, the shift-0 row with the shift
// added to its exponent fields (no byte borrows or carries; an entry no
// accepted block reads, e.g. 6 x 2^9, is a wrong finite byte where the
// reference's table has NaN); below it, the exact row (subnormal entries)
// from the table in shared memory, a load only the lanes that need it make.
// A shift byte past the table (e >= kShiftRows: only a form not built by
// w4a8_weight) takes the shared-memory path too, to a row of zeros: the
// block is skipped (and counted, see above).
__device__ __forceinline__ uint2 block_table(u32 table, u32 e) {
    if (e - kFastShift < kShiftRows - kFastShift) return computed_row(e);
    return ld_shared8(table + 8 * e);
}

// block_table's computed row of byte i of the shift word w (a byte from
// kFastShift to kShiftRows - 1), the byte extracted by one prmt: three
// instructions with computed_row's two multiply-adds.
__device__ __forceinline__ uint2 fast_table(u32 w, int i) { return computed_row(prmt(w, 0u, 0x4440u | i)); }

// Bit 7 of each byte of the result: that byte of w is not a computed row
// (below kFastShift or from kShiftRows on, past the table included). A byte
// below 128 adds without carrying out of its byte; a byte from 128 on sets
// its own bit (its carry may flag its neighbour too: the test is "any").
__device__ __forceinline__ u32 outside_fast(u32 w) {
    return (w + (128u - kShiftRows) * 0x01010101u) | ~(w + (128u - kFastShift) * 0x01010101u) | w;
}

// The wgmma kernel's promotion (DeepGEMM's recipe): a 128-column block's
// FP32 partial (the wgmma D fragment of lane (q, t): partial 4 j + r at token
// 8 j + 2 t + (r & 1)) into the accumulators, each times its token's scale of
// the block, one FMA per accumulator. `sc`: this lane's scales in shared
// memory as the producer stores them (token 8 j + 2 t + h, j = 2 j2 + i, at
// float 16 j2 + 4 t + 2 i + h of the block's run, `sc` already 16 t bytes
// in: a 16-byte load per two 8-token groups).
template <int NP>
__device__ __forceinline__ void promote_partial(float (&acc)[NP], const float (&part)[NP], u32 sc) {
#pragma unroll
    for (int j2 = 0; j2 < NP / 8; ++j2) {
        const float4 f = ld_shared_f4(sc + 64 * j2);    // tokens 8 j + 2 t, + 1 of j = 2 j2, 2 j2 + 1
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int j = 2 * j2 + i;
            const float f0 = i ? f.z : f.x, f1 = i ? f.w : f.y;
            acc[4 * j] = fmaf(part[4 * j], f0, acc[4 * j]);
            acc[4 * j + 1] = fmaf(part[4 * j + 1], f1, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(part[4 * j + 2], f0, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(part[4 * j + 3], f1, acc[4 * j + 3]);
        }
    }
}

// The bad shift bytes (past the table) of row pair q of a 16-row tile
// whose bytes start at `src` (chunk c's 8 at src + 64 c, byte 2 s + h: row
// 8 h + q of the tile, block 4 c + s), rows below n and blocks below
// `blocks` only (padding is not the weight's), of chunks c_beg .. c_end - 1.
// Only a lane whose fragments met such a byte calls it: a cold path that
// re-reads the bytes.
__device__ __noinline__ int count_past(const u8* __restrict__ src, int row0, int n, int c_beg, int c_end,
                                       int blocks) {
    int bad = 0;
    for (int c = c_beg; c < c_end; ++c)
        for (int j = 0; j < 8; ++j)
            bad += (row0 + 8 * (j & 1) < n && 4 * c + (j >> 1) < blocks && src[64 * c + j] >= kShiftRows) ? 1 : 0;
    return bad;
}

// Whether the block's token tile is the first of its group (the one that
// counts the group's bad shift bytes): batched, tile 0; ragged, the tile
// starting at the expert's first row o'_g = min(max(offsets[0..g], 0),
// tokens) (ragged_slot's clamp, from the raw offsets in s_off).
__device__ __noinline__ bool first_tile(const int* s_off, bool ragged, int g, int t0, int tokens) {
    if (!ragged) return blockIdx.y == 0;
    int run = s_off[0];
    for (int i = 1; i <= g; ++i) run = max(run, s_off[i]);
    return t0 == min(max(run, 0), tokens);
}

}  // namespace rkv
