// sm90.cuh: what the Hopper (sm_90a) kernels share: shared-memory
// addresses and loads, the mbarriers of their producer / consumer
// pipelines, the wgmma B-operand descriptor and fences, and the cluster of
// their split-K launches.
#pragma once
#include "common.cuh"

namespace rkv {

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Until the phase of `parity` has completed (try_wait itself sleeps a while).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
// Shared-window loads: a generic pointer into shared memory compiles to a
// generic load (LD.E), slower than LDS.
__device__ __forceinline__ uint4 ld_shared16(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ float4 ld_shared_f4(u32 addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint2 ld_shared_v2(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}
__device__ __forceinline__ u32 ld_shared_u16(u32 addr) {
    u16 v;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ void st_shared(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared16(u32 addr, const uint4& v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// TMA: the box at (c0, c1, c2) of the 3-d tensor map at `map` (a
// __grid_constant__ kernel parameter's address) into shared memory at dst,
// completing its bytes on the mbarrier's transaction count when it lands
// (elements past the tensor's ends read as zeros). The mbarrier's phase must
// expect them first (mbar_expect_tx).
__device__ __forceinline__ void tma_load_3d(u32 dst, const void* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Matrix descriptor of a K-major B tile with the 128-byte swizzle: start
// address, leading offset (unused for this layout: 1), stride 1024 bytes
// between 8-row groups, layout type 1 (128B swizzle). The tile is 1024-byte
// aligned; k16 step s starts 32 * s bytes into each row.
__device__ __forceinline__ u64 b_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
// The same descriptor from its low word, which alone depends on the address
// (+ 2 per 32 bytes, carry-free inside shared memory's 256 KB window): a loop
// steps the low word in 32-bit adds and the constant high word costs a move.
__device__ __forceinline__ u32 b_desc_lo(u32 addr) { return (u32)b_desc(addr); }
__device__ __forceinline__ u64 b_desc_of_lo(u32 lo) { return (u64)lo | (b_desc(0) & ~(u64)0xFFFFFFFFu); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The cluster of a split-K launch: its barrier, another block's shared
// memory, and mbarriers across its blocks.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The address of the same shared-memory location in the cluster's block `rank`.
__device__ __forceinline__ u32 cluster_addr(u32 addr, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
// Arrive on an mbarrier of another block of the cluster, releasing this
// thread's earlier shared-memory writes to whoever acquires the phase.
__device__ __forceinline__ void mbar_arrive_cluster(u32 cluster_bar) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar) : "memory");
}
__device__ __forceinline__ void mbar_wait_cluster(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n"
            " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}

// Two floats as a packed BF16 pair, each rounded to nearest even (lo in
// bits 0..15): one conversion for both, __float2bfloat16_rn's rounding.
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// A warp's four 8 x 8 matrices of 16-bit values, each held as an MMA
// accumulator fragment (lane (q, t): row q, columns 2t and 2t + 1 packed in
// r[i]), stored transposed: lane 8 i + c gives the shared address of
// matrix i's column c, whose 8 values land there as 16 contiguous bytes.
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// The last step of a wgmma kernel's staged epilogue (its two consumer
// warpgroups, threads 0..255): once each thread's values are in `stile`, a
// token-major tile of `rows` tokens of PITCH values (BM outputs and
// padding), every token's BM outputs go out as 16-byte runs from `orow0`
// (token 0's first output; tokens os_t apart, 16-byte aligned). ncu had
// shown the D fragments' own 2-byte stores using half of each 32-byte
// sector.
template <int BM, int PITCH>
__device__ __forceinline__ void store_staged(const __nv_bfloat16* stile, __nv_bfloat16* orow0, i64 os_t, int rows) {
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    constexpr int kUnits = BM / 8;                                 // 16-byte units per token
    for (int u = threadIdx.x; u < rows * kUnits; u += 256) {
        const int tl = u / kUnits, c = u % kUnits;
        const uint4 v = *reinterpret_cast<const uint4*>(stile + tl * PITCH + 8 * c);
        *reinterpret_cast<uint4*>(orow0 + (i64)tl * os_t + 8 * c) = v;
    }
}

// Split K across a cluster of KSPLIT blocks (the wgmma kernels' split
// instances): once a block's 256 consumer threads (warps 0..7) are done with
// the stages, whose shared memory starts at `stages`, the other ranks leave
// their N accumulators there (accumulator i of consumer thread ct at float
// i * 256 + ct: a warp's stores and loads are 128 contiguous bytes) and
// rank 0 adds them to its own in rank order over distributed shared memory:
// a fixed order, no atomics, no workspace. bars[0]: rank 0's "the sums are
// ready" ((KSPLIT - 1) x 256 arrivals), bars[1]: each other rank's "rank 0
// has read them" (256), so that no block exits while its memory is read.
// True on rank 0 (it goes on to the epilogue), false on the others.
template <int KSPLIT, int N>
__device__ __forceinline__ bool split_k_sum(float (&acc)[N], u32 stages, u64* bars, int split) {
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    const u32 part = stages + 4 * threadIdx.x;
    const u32 ready = smem_u32(&bars[0]), read = smem_u32(&bars[1]);
    if (split != 0) {
#pragma unroll
        for (int i = 0; i < N; ++i)
            asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(part + 1024 * i), "f"(acc[i]) : "memory");
        mbar_arrive_cluster(cluster_addr(ready, 0));
        mbar_wait_cluster(read, 0);
        return false;
    }
    mbar_wait_cluster(ready, 0);
#pragma unroll 1
    for (int r = 1; r < KSPLIT; ++r) {
        const u32 peer = cluster_addr(part, r);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] += ld_cluster_f32(peer + 1024 * i);
    }
#pragma unroll 1
    for (int r = 1; r < KSPLIT; ++r) mbar_arrive_cluster(cluster_addr(read, r));
    return true;
}

// A compile-time int as a value, for generic lambdas (run_tile).
template <int V>
struct IntC {
    static constexpr int value = V;
};

// f(IntC<N>{}) for the least multiple of STEP N with rows <= N, for 1 <=
// rows <= BN: the token columns a wgmma GEMM block's MMAs, promotion and
// epilogue cover (a block of a ragged expert's last tile, or a batched call's
// last token tile, holds fewer tokens than its tile). Tried from BN down, so
// the full tile's code comes first. Each N is one more copy of the main loop
// (compile time: a larger STEP for a wide tile).
template <int BN, int STEP = 16, class F>
__device__ __forceinline__ void run_tile(int rows, F& f) {
    static_assert(STEP % 16 == 0 && BN % STEP == 0 && BN >= STEP, "token tiles are multiples of the step, of 16");
    if constexpr (BN == STEP) {
        f(IntC<STEP>{});
    } else {
        if (rows > BN - STEP) f(IntC<BN>{});
        else run_tile<BN - STEP, STEP>(rows, f);
    }
}

}  // namespace rkv
