// gemm_fp4.cuh: what both grouped FP4 GEMM kernels share (docs/gemm.md):
// the E2M1 -> 16-bit float dequantization of the packed weight fragments,
// the weight and activation scale factors, one lane's activation chunk, and
// the ragged (MoE) slot search. gemm_fp4.cu (mma.sync, sm_80+) and
// gemm_fp4_sm90.cu (wgmma, sm_90a) include it.
//
// E2M1 -> 16-bit float with integer ops: the code's magnitude bits go to
// the bottom of the exponent field, which reads as e2m1 * 2^-126 in BF16
// (2^-14 in FP16; code 1 is a subnormal there), and one packed multiply by
// the block scale times 2^117 (2^5 for FP16) gives e2m1 * scale * 2^-9,
// exact (at most 6 significant bits, inside the normal range). The 2^-9 per
// FP4 operand comes back in the FP32 epilogue with the global scales.
#pragma once
#include "common.cuh"

#ifndef RKV_GEMM_CHUNK
#error "RKV_GEMM_CHUNK must come from rawkv/kernels/gemm_fp4.py"
#endif
#ifndef RKV_GEMM_MAX_SEGMENTS
#error "RKV_GEMM_MAX_SEGMENTS must come from rawkv/kernels/gemm_fp4.py"
#endif
static_assert(RKV_GEMM_CHUNK == 64, "the packed layout is built around 64-column chunks");

namespace rkv {

constexpr float kTwoPow117 = 1.6615349947311448e35f;  // 2^117
constexpr float kTwoPow9 = 512.0f;
constexpr int kIntMin = -2147483647 - 1;

__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, bool f16) {
    if (f16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// One k16 step of the mma.sync kernel: b0 (activation word s) and b1 (word
// s + 4: the packed record pairs them, docs/gemm.md "Packed form") are no
// register pair, so ptxas moves them into one for the m16n8k16. On sm_100
// and up that cost ptxas registers it spilled (16-32 bytes in the decode
// and ragged tiles), so the step there is two m16n8k8 MMAs, which take one
// B register each (the same products; the k16 FP32 sum in two halves).
__device__ __forceinline__ void mma_step(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1, bool f16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
    if (f16) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
    }
#else
    mma16816(c, a, b0, b1, f16);
#endif
}

// a * b on two packed 16-bit floats, round to nearest, subnormals kept.
__device__ __forceinline__ u32 mul2(u32 a, u32 b, bool f16) {
    u32 d;
    if (f16) {
        asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    } else {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    }
    return d;
}

// The E2M1 codes at bits 12..15 (low half) and 28..31 (high half) of w as a
// packed pair of BF16 e2m1 * 2^-126 (NVFP4 activations, which the kernels
// multiply in BF16 whatever the output).
__device__ __forceinline__ u32 e2m1_pair_bits(u32 w) {
    return (w & 0x80008000u) | ((w >> 6) & 0x01C001C0u);
}

// Both halves of a packed pair set to the 16-bit float f.
__device__ __forceinline__ u32 splat(float f, bool f16) {
    u16 h = f16 ? __half_as_ushort(__float2half_rn(f)) : __bfloat16_as_ushort(__float2bfloat16_rn(f));
    return (u32)h | ((u32)h << 16);
}

// The packed factor that turns e2m1 bits into e2m1 * scale * 2^-9 for one
// E4M3 scale (NVFP4 activations): scale * 2^117 in BF16.
__device__ __forceinline__ u32 act_scale_factor(u32 b) {
    return splat(e4m3_decode((u8)b) * kTwoPow117, false);
}

// The weight rows' packed factors that turn e2m1 bits into
// e2m1 * scale * 2^-9, from the packed form's scale bytes (docs/gemm.md,
// "Packed form"): NVFP4 scale * 2^117 (BF16) / * 2^5 (FP16); MXFP4 (UE8M0
// byte e) 2^(e - 10) / 2^(e - 122). docs/gemm.md gives the exponent window
// in which the MXFP4 ones are exact; loaders refuse weights outside it.
//
// An NVFP4 scale is packed as its factor byte b = (E << 3) | m for the value
// 1.m * 2^(E - 20) (E4M3's normals and subnormals, normalized: E 11..28), 0
// for a zero scale, whose block's codes the packed form holds as zeros: the
// FP16 factor is b << 7 and the BF16 one 0x7000 + (b << 4) (exponent
// 224 + E; 2^97 for b = 0, times zero codes): two integer operations per
// row, where the E4M3 byte took a conversion through FP32.
__device__ __forceinline__ u32 splat_byte(u32 v, int i) { return __byte_perm(v, 0, 0x4040 | (i << 8) | i); }

template <bool MX, bool F16>
__device__ __forceinline__ u32 scale_factor(u32 sv, int i) {
    if (MX) {
        const u32 e = splat_byte(sv, i);
        // (e - 107) << 10, (e + 117) << 7 in each half (inside the window: no
        // borrow, no carry between the halves)
        return F16 ? (e - 0x006B006Bu) << 10 : e * 128u + 0x3A803A80u;
    }
    return F16 ? splat_byte(sv, i) << 7 : splat_byte(sv, i) * 16u + 0x70007000u;
}

// Both rows' factors of one block from their two scale bytes (sv: row q in
// the low byte, row q + 8 in the next).
template <bool MX, bool F16>
__device__ __forceinline__ void scale_factors(u32 sv, u32& f0, u32& f1) {
    f0 = scale_factor<MX, F16>(sv, 0);
    f1 = scale_factor<MX, F16>(sv, 1);
}

// The factors of rows q and q + 8 of a chunk's four 16-column blocks (the
// wgmma kernel's k16 steps) from their 8 scale bytes (block s's pair at
// bytes 2s, 2s + 1).
template <bool MX, bool F16>
__device__ __forceinline__ void block_factors(const uint2& sv, u32 (&f)[4][2]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        f[s][0] = scale_factor<MX, F16>(s < 2 ? sv.x : sv.y, 2 * (s & 1));
        f[s][1] = scale_factor<MX, F16>(s < 2 ? sv.x : sv.y, 2 * (s & 1) + 1);
    }
}

template <int ACT> struct ActChunk;

__device__ __forceinline__ u32 word_of(const uint4& v, int s) {
    return s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
}

template <> struct ActChunk<0> {  // 16 x 16-bit values
    uint4 lo, hi;
    __device__ __forceinline__ void clear() { lo = hi = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void load(const u8* row, const u8*, int kb) {
        const uint4* p = reinterpret_cast<const uint4*>(row + 2 * (i64)kb);
        lo = __ldg(p);
        hi = __ldg(p + 1);
    }
    // The same values as eight 4-byte loads: each lands in whatever register
    // ptxas picks, so a step's pair (words s and s + 4) is loaded into the
    // MMA's B register pair directly instead of moved there from two 16-byte
    // loads. More load instructions, fewer moves: the mma.sync kernel takes
    // it where a block of its two-m-tile, one-n-tile tile holds one or two
    // tokens (gemm_fp4.cu, `words`).
    __device__ __forceinline__ void load_words(const u8* row, int kb) {
        const u32* p = reinterpret_cast<const u32*>(row + 2 * (i64)kb);
        lo = make_uint4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3));
        hi = make_uint4(__ldg(p + 4), __ldg(p + 5), __ldg(p + 6), __ldg(p + 7));
    }
    __device__ __forceinline__ void fragment(int s, u32& b0, u32& b1) const {
        b0 = word_of(lo, s);
        b1 = word_of(hi, s);
    }
    __device__ __forceinline__ void words(uint4& w0, uint4& w1) const {
        w0 = lo;
        w1 = hi;
    }
};
template <> struct ActChunk<1> : ActChunk<0> {};

template <> struct ActChunk<2> {  // 16 E2M1 codes + their E4M3 block scale
    uint2 q;
    u32 f;
    __device__ __forceinline__ void clear() { q = make_uint2(0, 0); f = 0; }
    __device__ __forceinline__ void load(const u8* row, const u8* sf_row, int kb) {
        q = __ldg(reinterpret_cast<const uint2*>(row + kb / 2));
        f = act_scale_factor(__ldg(sf_row + kb / 16));
    }
    // Byte s of the codes holds columns 2s, 2s + 1; byte s + 4 columns 2s + 8, + 9.
    __device__ __forceinline__ void fragment(int s, u32& b0, u32& b1) const {
        const u32 lo = (q.x >> (8 * s)) & 0xFFu, hi = (q.y >> (8 * s)) & 0xFFu;
        // byte * 0x01001000: its low nibble at bits 12..15, high at 28..31.
        b0 = mul2(e2m1_pair_bits(lo * 0x01001000u), f, false);
        b1 = mul2(e2m1_pair_bits(hi * 0x01001000u), f, false);
    }
    __device__ __forceinline__ void words(uint4& w0, uint4& w1) const {
        fragment(0, w0.x, w1.x);
        fragment(1, w0.y, w1.y);
        fragment(2, w0.z, w1.z);
        fragment(3, w0.w, w1.w);
    }
};

// The byte offset, in a row tile's 512 packed code bytes of a chunk, of the
// 16-byte record of lane (q, t): its slot 8t + (q ^ 2t) (docs/gemm.md,
// "Packed form"). The mma.sync kernel reads a lane's own record (16 bytes);
// the Hopper kernel reads word t of the records of lanes (q, 0..3) (four
// 4-byte loads, gather_record). Both sets of loads hit 32 distinct banks.
__device__ __forceinline__ int record_offset(int q, int t) { return 16 * (8 * t + (q ^ (2 * t))); }

// Lane (q, t)'s wgmma A fragments of k16 steps 0..3 from a tile's 512 code
// bytes at shared-window address `tile`: word t of lane (q, s)'s record for
// step s (its rows' physical columns 16s + 2t + {0, 1, 8, 9}), at
// tile + 128 s + ((16 q + 4 t) ^ 32 s). `lq` = 16 q + 4 t.
__device__ __forceinline__ uint4 gather_record(u32 tile, u32 lq) {
    uint4 w;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.x) : "r"(tile + lq));
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.y) : "r"(tile + 128 + (lq ^ 32)));
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.z) : "r"(tile + 256 + (lq ^ 64)));
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w.w) : "r"(tile + 384 + (lq ^ 96)));
    return w;
}

// 16 bytes global -> shared without passing through registers (L2 only:
// weights are read once per token tile).
// (dst: a shared-window address, converted once per warp rather than per copy)
__device__ __forceinline__ void cp_async16(u32 dst, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
// The same when `on`, else nothing: a predicated instruction, not a branch.
// LINE adds the L2 prefetch hint .L2::128B: a miss brings the whole 128-byte
// line from DRAM, not only the 32-byte sectors asked for, so a tile's
// 64-byte scale copy (lanes 0..3) also brings its next chunk's scales. Both
// mma.sync kernels' weight streams take it (W4A16: on Hopper decode and MoE
// below 28 tokens per expert, every batch elsewhere; W4A8's few-token
// kernel). H100: MoE Flash at 16 and 64 tokens 1.3-1.6% less time (W4A16)
// and 0.5-1.3% (W4A8), decode within 2-3% either way (docs/gemm.md,
// "Streaming"); the wgmma kernels' producers measured no better with it.
template <bool LINE = false>
__device__ __forceinline__ void cp_async16_if(bool on, u32 dst, const void* gmem) {
    if constexpr (LINE)
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n}\n"
                     ::"r"(dst), "l"(gmem), "r"((int)on));
    else
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n"
                     ::"r"(dst), "l"(gmem), "r"((int)on));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The four A-fragment registers of one k-step of one m-tile from a packed
// code word w, times the rows' scale factors f0 (row q) and f1 (row q + 8).
// Register p's two codes (its low half: n_p, its high half: n_p+4) sit in w
// where docs/gemm.md's "Packed form" puts them (rawkv.reference.gemm
// CODE_BITS) so that few operations lay them out as 16-bit floats:
//
// BF16 (sign at bit 15, magnitude m, e0, e1 at bits 6, 7, 8; +16 for the
// high half): registers 0, 1, 2 are w, w << 3 and w << 6 masked, and
// register 3's bits (m 14, e0 10, e1 11, sign 13) go to theirs by one
// multiply of (w >> 8)'s four bits by 1 + 2^5 + 2^10: three copies that
// never overlap, so nothing carries (9 integer operations per word where
// the nibble-per-code layout took 13).
// FP16 (magnitude at bits 9, 10, 11): two masked shifts per register.
template <bool F16>
__device__ __forceinline__ void dequant_fragment(u32 w, u32 f0, u32 f1, u32 (&a)[4]) {
    const u32 w3 = w << 3, w6 = w << 6;
    if (F16) {
        constexpr u32 S = 0x80008000u, M = 0x0E000E00u;
        a[0] = mul2((w & S) | (w3 & M), f0, true);
        a[1] = mul2((w3 & S) | (w6 & M), f1, true);
        a[2] = mul2((w6 & S) | ((w << 9) & M), f0, true);
        a[3] = mul2((w & 0x0C000C00u) | ((w >> 5) & 0x02000200u) | ((w << 2) & S), f1, true);
    } else {
        constexpr u32 F = 0x81C081C0u;
        a[0] = mul2(w & F, f0, false);
        a[1] = mul2(w3 & F, f1, false);
        a[2] = mul2(w6 & F, f0, false);
        a[3] = mul2((((w >> 8) & 0x006C006Cu) * 0x421u) & F, f1, false);
    }
}

// The sum of the accumulators of the KS warps that split K in a block of
// the mma.sync kernels (warp ks of row group rw: MT x NT fragments of 4),
// through shared memory `red` ((KS - 1) x RW x 32 x MT x NT x 4 floats) in a
// fixed order: warp ks = 0 adds those of warps 1 .. KS - 1 in turn to its
// own and returns true, the others return false. Every thread of the block
// calls it (it synchronizes the block).
template <int MT, int NT, int KS, int RW>
__device__ __forceinline__ bool sum_split_k(float* red, float (&acc)[MT][NT][4], int ks, int rw, int lane) {
    if (ks > 0) {
        float* mine = red + ((ks - 1) * RW + rw) * 32 * MT * NT * 4;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) mine[((i * NT + j) * 4 + r) * 32 + lane] = acc[i][j][r];
    }
    __syncthreads();
    if (ks > 0) return false;
#pragma unroll
    for (int p = 1; p < KS; ++p) {
        const float* part = red + ((p - 1) * RW + rw) * 32 * MT * NT * 4;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) acc[i][j][r] += part[((i * NT + j) * 4 + r) * 32 + lane];
    }
    return true;
}

// Zeros into output features row0 .. row0 + rows - 1 (those < n) of tokens
// t0 .. t1 - 1: the rows no expert owns (docs/gemm.md, "Ragged offsets").
// This thread writes items first, first + step, ... of the rows x tokens.
__device__ __forceinline__ void zero_rows(__nv_bfloat16* __restrict__ out, i64 os_t, int n, int row0, int rows,
                                          int t0, int t1, int first, int step) {
    const __nv_bfloat16 z = __float2bfloat16_rn(0.0f);
    for (int e = first; e < rows * (t1 - t0); e += step) {
        const int row = row0 + e % rows, tok = t0 + e / rows;
        if (row < n) out[tok * os_t + row] = z;
    }
}

// Segment (expert, or the unowned rows before / after) and token range of
// ragged slot `slot`; offsets are clamped as the reference does
// (o'_e = min(max(offsets[0..e], 0), rows)) and the clamps counted once.
__device__ void ragged_slot(const int* __restrict__ offsets, int experts, int rows, int tile, int slot,
                            int* s_off, int& seg, int& t0, int& t1, int* errors) {
    const int nseg = experts + 2;  // [0, o'_0), experts, [o'_E, rows)
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) s_off[i] = __ldg(offsets + i);
    __syncthreads();
    __shared__ int s_res[3];
    if (threadIdx.x < 32) {
        // Segment s ends at end(s) = min(max(offsets[0..s], 0), rows) (rows
        // for the last) and starts where s - 1 ends. Each lane walks a
        // contiguous run of segments; two warp scans join the runs (the
        // running max of the offsets, then the tile counts).
        const int lane = threadIdx.x;
        const int per = (nseg + 31) / 32, s0 = min(lane * per, nseg), s1 = min(s0 + per, nseg);
        int lmax = kIntMin;
        for (int s = s0; s < s1; ++s) lmax = max(lmax, s <= experts ? s_off[s] : rows);
        int incl = lmax;
        for (int d = 1; d < 32; d <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl = max(incl, o);
        }
        int carry = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0) carry = kIntMin;
        const int start0 = lane == 0 ? 0 : min(max(carry, 0), rows);
        int run = carry, start = start0, tiles = 0, bad = 0;
        for (int s = s0; s < s1; ++s) {
            const int raw = s <= experts ? s_off[s] : rows;
            run = max(run, raw);
            const int end = min(max(run, 0), rows);
            if (s <= experts) bad += raw != end;
            tiles += (end - start + tile - 1) / tile;
            start = end;
        }
        int cum = tiles;
        for (int d = 1; d < 32; d <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, cum, d);
            if (lane >= d) cum += o;
        }
        for (int d = 16; d > 0; d >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, d);
        const int before = cum - tiles;
        int f_seg = -1, f_t0 = 0, f_t1 = 0;
        if (slot >= before && slot < cum) {
            run = carry;
            start = start0;
            int b = before;
            for (int s = s0; s < s1; ++s) {
                run = max(run, s <= experts ? s_off[s] : rows);
                const int end = min(max(run, 0), rows);
                const int n = (end - start + tile - 1) / tile;
                if (slot < b + n) {
                    f_seg = s;
                    f_t0 = start + (slot - b) * tile;
                    f_t1 = min(end, f_t0 + tile);
                    break;
                }
                b += n;
                start = end;
            }
        }
        const unsigned hit = __ballot_sync(0xffffffffu, f_seg >= 0);
        if (hit) {
            const int src = __ffs(hit) - 1;
            f_seg = __shfl_sync(0xffffffffu, f_seg, src);
            f_t0 = __shfl_sync(0xffffffffu, f_t0, src);
            f_t1 = __shfl_sync(0xffffffffu, f_t1, src);
        }
        if (lane == 0) {
            s_res[0] = hit ? f_seg : -1;
            s_res[1] = f_t0;
            s_res[2] = f_t1;
            if (bad && errors && blockIdx.x == 0 && slot == 0) atomicAdd(errors, bad);
        }
    }
    __syncthreads();
    seg = s_res[0];
    t0 = s_res[1];
    t1 = s_res[2];
}

// The block's group g and its tokens [t0, t1), for every GEMM kernel:
// batched (offsets null), group blockIdx.z and token tile blockIdx.y of
// `tile` tokens; ragged, the expert of slot blockIdx.y (ragged_slot). False
// when the block has nothing to multiply: a slot past every expert's tiles,
// or one of the rows no expert owns, whose output features row0 .. row0 +
// rows - 1 the block's threads have then written as zeros. Every thread of
// the block calls it (ragged_slot synchronizes the block).
__device__ __forceinline__ bool block_tokens(const int* __restrict__ offsets, int experts, int tokens, int tile,
                                             int* s_off, int* errors, __nv_bfloat16* __restrict__ out, i64 os_t,
                                             int n, int row0, int rows, int& g, int& t0, int& t1) {
    if (!offsets) {
        g = blockIdx.z;
        t0 = blockIdx.y * tile;
        t1 = min(tokens, t0 + tile);
        return true;
    }
    int seg;
    ragged_slot(offsets, experts, tokens, tile, blockIdx.y, s_off, seg, t0, t1, errors);
    if (seg < 0) return false;
    if (seg == 0 || seg == experts + 1) {
        zero_rows(out, os_t, n, row0, rows, t0, t1, threadIdx.x, blockDim.x);
        return false;
    }
    g = seg - 1;
    return true;
}


}  // namespace rkv
