"""The ceiling of the W4A16 wgmma kernel's consumer loop (docs/gemm.md, "MoE at
4,096 tokens: what bounds a chunk"), at the token counts its blocks multiply:
two consumer warpgroups of two m64 tiles each (BM = 256), four BF16
m64nNk16 wgmmas per m-tile and 64-column chunk, the kernel's commit and wait
order (an m-tile's wgmmas are issued once its previous chunk's have
completed), operands already in shared memory (no producer, no global
memory), one block per SM, timed over 4,000 chunks. Variants:

  chain      the wgmmas alone, A fragments constant (RS) or A from shared
             memory (SS): what the tensor pipe gives at this N
  dequant    RS, and each m-tile's A fragments built from packed codes and
             scale bytes in shared memory before its wgmmas: the kernel's own
             gather_record, block_factors and dequant_fragment (gemm_fp4.cuh)
  dequant3   dequant with three A register sets in turn, so that a group's
             fragments are built while the two groups before it are in flight

N = 64, 96, 128: an expert of 85-96 tokens (MoE at 4,096 tokens) runs its
128-token tile's wgmmas at N = 96. If a chunk at N = 96 takes about as long
as at N = 128 in the "dequant" variant, the consumers' chain sets the chunk
time, not the tensor pipe. A standalone CUDA program: on a GPU machine with
nvcc,

    python tools/wgmma_bf16_ceiling.py

writes it to a temporary directory, compiles it for sm_90a and prints, per
variant and N, TFLOP/s and the time per chunk in nanoseconds (H100s,
2026-11-27, ns a chunk at N = 64 / 96 / 128: chain RS and SS 285 / 426 / 567;
dequant 450-475 / 541-580 / 608-652; dequant3 415-451 / 490-524 / 589-630;
docs/gemm.md).
"""
from __future__ import annotations

import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "src"))
sys.path.insert(0, str(_HERE))
import ceiling_program  # noqa: E402

NS = (64, 96, 128)


def wrapper_ss(n: int) -> str:
    """m64nNk16 BF16 with A from shared memory too (its descriptor)."""
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    return f'''__device__ __forceinline__ void wgmma_ss_m64n{n}k16_bf16(float (&d)[{nacc}], u64 desc_a, u64 desc_b) {{
    asm volatile(
        "{{\\n .reg .pred p;\\n setp.ne.b32 p, %{nacc + 2}, 0;\\n"
        " wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
        "{{{regs}}}, %{nacc}, %{nacc + 1}, p, 1, 1, 0, 0;\\n}}\\n"
        : {outs}
        : "l"(desc_a), "l"(desc_b), "r"(1));
}}
'''


BODY = r'''
#ifndef __CUDACC_RTC__
#include <cstdio>
#include <cuda_runtime.h>
#endif
#include "gemm_fp4.cuh"
#include "sm90.cuh"
#include "wgmma_rs.cuh"
using namespace rkv;
#define WRAPPERS

constexpr int S = 4, BM = 256, kTiles = BM / 16, kWStage = kTiles * (512 + 64);
enum { CHAIN_RS, CHAIN_SS, DEQUANT, DEQUANT3 };

template <int N>
__device__ __forceinline__ void ss(float (&d)[N / 2], u64 da, u64 db) {
    if constexpr (N == 64) wgmma_ss_m64n64k16_bf16(d, da, db);
    else if constexpr (N == 96) wgmma_ss_m64n96k16_bf16(d, da, db);
    else wgmma_ss_m64n128k16_bf16(d, da, db);
}

template <int N, int MODE>
__global__ void __launch_bounds__(256, 1) ceiling(float* out, int iters) {
    constexpr int BST = N * 128, AST = 128 * 128;      // a B stage; an A stage (SS: 128 rows x 64 columns)
    extern __shared__ u8 raw[];
    u8* sm = (u8*)(((size_t)raw + 1023) & ~(size_t)1023);
    u8* sb = sm;
    u8* sa = sb + S * BST;
    u8* sw = sa + S * AST;
    for (int i = threadIdx.x; i < (S * BST + S * AST) / 4; i += 256)
        ((u32*)sm)[i] = 0x3F803F80u ^ ((i * 2654435761u) & 0x007F007Fu);     // BF16 values near 1
    for (int i = threadIdx.x; i < S * kWStage / 4; i += 256) ((u32*)sw)[i] = (i * 2654435761u) & 0x77777777u;
    __syncthreads();
    const int wg = threadIdx.x / 128, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    float acc0[N / 2], acc1[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; ++j) acc0[j] = acc1[j] = 0.f;
    u32 a0[4][4], a1[4][4];
    for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 4; ++i) a0[s][i] = a1[s][i] = 0x3F803F80u ^ (threadIdx.x & 0x7F) ^ (s + i);
    const int tile[2] = {wg * (kTiles / 2) + warp, wg * (kTiles / 2) + 4 + warp};
    const u32 lq = 4 * lane, sq = 8 * (lane >> 2);
    uint4 wv[2];
    uint2 sv[2];
    auto fetch = [&](u32 wst, int m) {
        wv[m] = gather_record(wst + tile[m] * 512, lq);
        sv[m] = ld_shared_v2(wst + kTiles * 512 + tile[m] * 64 + sq);
    };
    auto dequant = [&](int m, u32 (&a)[4][4]) {
        u32 f[4][2];
        block_factors<false, false>(sv[m], f);
        dequant_fragment<false>(wv[m].x, f[0][0], f[0][1], a[0]);
        dequant_fragment<false>(wv[m].y, f[1][0], f[1][1], a[1]);
        dequant_fragment<false>(wv[m].z, f[2][0], f[2][1], a[2]);
        dequant_fragment<false>(wv[m].w, f[3][0], f[3][1], a[3]);
    };
    if constexpr (MODE == DEQUANT3) {
        // Three A register sets in turn over the m-tile groups: a group's
        // fragments are built while the two groups before it are in flight
        // (wait<2>: the group three back, the set's last reader, is done).
        u32 a2[4][4];
        auto group = [&](float (&acc)[N / 2], u32 (&a)[4][4], int m, u32 bt) {
            wgmma_wait<2>();
            dequant(m, a);
            wgmma_fence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) wgmma_k16_bf16<N>(acc, a[s4], b_desc(bt + 32 * s4));
            wgmma_commit();
        };
        auto chunk = [&](int c, u32 (&x)[4][4], u32 (&y)[4][4]) {
            const int st = c % S;
            const u32 wst = smem_u32(sw + st * kWStage), bt = smem_u32(sb + st * BST);
            fetch(wst, 0);
            fetch(wst, 1);
            group(acc0, x, 0, bt);
            group(acc1, y, 1, bt);
        };
        for (int c = 0; c < iters; c += 3) {
            chunk(c, a0, a1);
            chunk(c + 1, a2, a0);
            chunk(c + 2, a1, a2);
        }
    } else
    for (int c = 0; c < iters; ++c) {
        const int st = c % S;
        const u32 bt = smem_u32(sb + st * BST);
        const u32 at = smem_u32(sa + st * AST) + wg * 64 * 128;   // (SS: each warpgroup's 64 rows)
        if constexpr (MODE == DEQUANT) {
            const u32 wst = smem_u32(sw + st * kWStage);
            fetch(wst, 0);
            fetch(wst, 1);
        }
        if (c > 0) wgmma_wait<1>();
        if constexpr (MODE == DEQUANT) dequant(0, a0);
        wgmma_fence();
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {
            if constexpr (MODE == CHAIN_SS) ss<N>(acc0, b_desc(at + 32 * s4), b_desc(bt + 32 * s4));
            else wgmma_k16_bf16<N>(acc0, a0[s4], b_desc(bt + 32 * s4));
        }
        wgmma_commit();
        if (c > 0) wgmma_wait<1>();
        if constexpr (MODE == DEQUANT) dequant(1, a1);
        wgmma_fence();
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) {
            if constexpr (MODE == CHAIN_SS) ss<N>(acc1, b_desc(at + 32 * s4), b_desc(bt + 32 * s4));
            else wgmma_k16_bf16<N>(acc1, a1[s4], b_desc(bt + 32 * s4));
        }
        wgmma_commit();
    }
    wgmma_wait<0>();
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) sum += acc0[j] + acc1[j];
    out[blockIdx.x * 256 + threadIdx.x] = sum;                 // (keeps the work live)
}

#ifndef __CUDACC_RTC__     // (the host part: tests compile the kernels alone with NVRTC)
#define TIMING
template <int N, int MODE>
void run(const char* name, float* out, int sms) {
    const int smem = S * (N * 128 + 128 * 128) + S * kWStage + 1024, iters = 4000;
    const float best = best_ms(ceiling<N, MODE>, sms, smem, out, iters, 3);
    const cudaError_t err = cudaGetLastError();
    const int chunks = MODE == DEQUANT3 ? (iters + 2) / 3 * 3 : iters;
    const double flops = (double)sms * chunks * 2 * 2 * 4 * 64.0 * N * 16 * 2;
    printf("%-8s N = %3d %8.1f TFLOP/s %7.1f ns a chunk %s\n", name, N, flops / (best * 1e-3) / 1e12,
           best * 1e6 / chunks, err ? cudaGetErrorString(err) : "");
}

int main() {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float* out;
    cudaMalloc(&out, sms * 256 * 4);
    run<64, CHAIN_RS>("chain RS", out, sms);
    run<96, CHAIN_RS>("chain RS", out, sms);
    run<128, CHAIN_RS>("chain RS", out, sms);
    run<64, CHAIN_SS>("chain SS", out, sms);
    run<96, CHAIN_SS>("chain SS", out, sms);
    run<128, CHAIN_SS>("chain SS", out, sms);
    run<64, DEQUANT>("dequant", out, sms);
    run<96, DEQUANT>("dequant", out, sms);
    run<128, DEQUANT>("dequant", out, sms);
    run<64, DEQUANT3>("dequant3", out, sms);
    run<96, DEQUANT3>("dequant3", out, sms);
    run<128, DEQUANT3>("dequant3", out, sms);
    return 0;
}
#endif
'''

#: The kernels main() runs: (N, MODE).
INSTANCES = tuple(f"ceiling<{n}, {mode}>" for mode in range(4) for n in NS)


def source() -> str:
    """The program: the W4A16 kernel file's constants as #defines, then the body."""
    from rawkv.kernels import gemm_fp4
    wrappers = "".join(wrapper_ss(n) for n in NS)
    body = BODY.replace("#define WRAPPERS", wrappers).replace("#define TIMING", ceiling_program.TIMING)
    return ceiling_program.defines(gemm_fp4.FILE) + body


def main() -> int:
    return ceiling_program.build_and_run(source())


if __name__ == "__main__":
    sys.exit(main())
