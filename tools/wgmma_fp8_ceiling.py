"""The ceiling of the W4A8 wgmma kernel's consumer loop (docs/gemm.md, "W4A8
GEMM"): two consumer warpgroups issuing four FP8 m64n128k32 wgmmas per
128-column chunk from operands already in shared memory (no producer, no
global memory), one block per SM, timed over 4,000 chunks. Each variant adds
one piece of the kernel's per-chunk work:

  chain          the wgmmas alone, accumulating into one set (the pipe's peak)
  promote const  wait for each chunk's partial, add it times a constant
  promote lds    ... times the tokens' scales loaded from shared memory
  two partials   chunks c and c + 1 issued together, each promoted in turn
  fragments      promote lds, and the next chunk's A fragments built from
                 packed E2M1 codes (the kernel's prmt conversion)

A from registers (RS, the kernel's form) or from shared memory (SS), where the
variant allows. The promotion and the code conversion are the kernel's own
(gemm_w4a8.cuh: promote_partial, e4m3_of_e2m1), included from the source
tree. A standalone CUDA program: on a GPU machine with nvcc,

    python tools/wgmma_fp8_ceiling.py

writes it to a temporary directory, compiles it for sm_90a and prints TFLOP/s
per variant (an H100, three runs on 2026-11-26, RS / SS: chain 1,921-1,926 /
1,928-1,934, promote const 1,361-1,391 / 1,471-1,474, promote lds 1,317-1,319
/ 1,343-1,348, two partials 1,257-1,261 / 1,252-1,253, fragments
1,113-1,115).
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "src"))
sys.path.insert(0, str(_HERE))
import ceiling_program  # noqa: E402
_spec = importlib.util.spec_from_file_location("gen_wgmma", _HERE / "gen_wgmma.py")
gen_wgmma = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_wgmma)


def wrapper_ss(n: int) -> str:
    """m64nNk32 E4M3 x E4M3 with A from shared memory too (its descriptor)."""
    nacc = n // 2
    regs = ", ".join(f"%{i}" for i in range(nacc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nacc))
    return f'''__device__ __forceinline__ void wgmma_ss_m64n{n}k32_e4m3(float (&d)[{nacc}], u64 desc_a, u64 desc_b,
                                                         int scale_d) {{
    asm volatile(
        "{{\\n .reg .pred p;\\n setp.ne.b32 p, %{nacc + 2}, 0;\\n"
        " wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 "
        "{{{regs}}}, %{nacc}, %{nacc + 1}, p, 1, 1;\\n}}\\n"
        : {outs}
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}}
'''


BODY = r'''
#ifndef __CUDACC_RTC__
#include <cstdio>
#include <cuda_runtime.h>
#endif
#include "gemm_w4a8.cuh"
using namespace rkv;
#define WRAPPERS

// (b_desc: K-major, 128-byte swizzle, 1024 bytes per 8 rows; the A tile of
// the SS variant has the same layout.)
__device__ __forceinline__ u64 desc(u32 addr) { return b_desc(addr); }
__device__ __forceinline__ void wfence() { wgmma_fence(); }
__device__ __forceinline__ void wcommit() { wgmma_commit(); }
template <int K> __device__ __forceinline__ void wwait() { wgmma_wait<K>(); }

constexpr int S = 4, N = 128, BST = N * 128, AST = 128 * 128;
enum { CHAIN, PROMOTE_CONST, PROMOTE_LDS, TWO_PARTIALS, FRAGMENTS };

template <bool SS>
__device__ __forceinline__ void mma(float (&d)[N / 2], const u32 (&a)[4], u32 atile, u32 btile, int s4, int scale_d) {
    if constexpr (SS) wgmma_ss_m64n128k32_e4m3(d, desc(atile + 32 * s4), desc(btile + 32 * s4), scale_d);
    else wgmma_m64n128k32_e4m3(d, a, desc(btile + 32 * s4), scale_d);
}

template <bool SS, int MODE>
__global__ void __launch_bounds__(256, 1) ceiling(float* out, int iters) {
    extern __shared__ u8 raw[];
    u8* sm = (u8*)(((size_t)raw + 1023) & ~(size_t)1023);
    u8* sb = sm;
    u8* sa = sb + S * BST;
    float* ss = (float*)(sa + S * AST);
    u8* sw = (u8*)(ss + S * N);
    for (int i = threadIdx.x; i < (S * BST + S * AST) / 4; i += 256) ((u32*)sm)[i] = 0x38303830u ^ ((i * 2654435761u) & 0x07070707u);
    for (int i = threadIdx.x; i < S * N; i += 256) ss[i] = 1.0f + (i & 7) * 0.125f;
    for (int i = threadIdx.x; i < S * 2048; i += 256) ((u32*)sw)[i] = i * 2654435761u;
    __syncthreads();
    const int wg = threadIdx.x / 128, lane = threadIdx.x & 31, t = lane & 3, warp = (threadIdx.x >> 5) & 3;
    float acc[N / 2], part[N / 2], part2[MODE == TWO_PARTIALS ? N / 2 : 1];
    for (int j = 0; j < N / 2; ++j) acc[j] = part[j] = 0.f;
    if constexpr (MODE == TWO_PARTIALS)
        for (int j = 0; j < N / 2; ++j) part2[j] = 0.f;
    u32 a[4][4], a2[4][4];
    for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 4; ++i) a[s][i] = a2[s][i] = 0x38303830u ^ ((threadIdx.x * 0x01010101u) & 0x07070707u) ^ (s + i);
    const float fs = 1.0f + threadIdx.x * 1e-3f;
    auto promote = [&](int c, const float (&p)[N / 2]) {
        if constexpr (MODE == PROMOTE_CONST) {
            for (int j = 0; j < N / 2; ++j) acc[j] = fmaf(p[j], fs, acc[j]);
        } else {
            promote_partial(acc, p, smem_u32(ss + (c % S) * N) + 16 * t);
        }
    };
    // The kernel's conversion of the packed codes (a table per chunk here,
    // not per block).
    auto fragments = [&](int c, u32 (&f)[4][4]) {
        const u32 w = smem_u32(sw + (c % S) * 8192 + (wg * 4 + warp) * 1024 + lane * 16);
        const uint4 c0 = ld_shared16(w), c1 = ld_shared16(w + 512);
        const u32 words[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            e4m3_of_e2m1(words[2 * s], kTable0Lo + c, kTable0Hi, f[s][0], f[s][2]);
            e4m3_of_e2m1(words[2 * s + 1], kTable0Lo + c, kTable0Hi, f[s][1], f[s][3]);
        }
    };
    const u32 abase = smem_u32(sa) + wg * 64 * 128;
    for (int c = 0; c < iters; ++c) {
        const u32 bt = smem_u32(sb + (c % S) * BST), at = abase + (c % S) * AST;
        if constexpr (MODE == CHAIN) {
            wfence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) mma<SS>(acc, a[s4], at, bt, s4, 1);
            wcommit();
            wwait<1>();
        } else if constexpr (MODE == TWO_PARTIALS) {
            const u32 bt2 = smem_u32(sb + ((c + 1) % S) * BST), at2 = abase + ((c + 1) % S) * AST;
            wfence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) mma<SS>(part, a[s4], at, bt, s4, s4);
            wcommit();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) mma<SS>(part2, a[s4], at2, bt2, s4, s4);
            wcommit();
            wwait<1>();
            promote(c, part);
            wwait<0>();
            promote(c + 1, part2);
            ++c;
        } else if constexpr (MODE == FRAGMENTS) {
            const u32 bt2 = smem_u32(sb + ((c + 1) % S) * BST);
            wfence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) mma<SS>(part, a[s4], at, bt, s4, s4);
            wcommit();
            fragments(c + 1, a2);
            wwait<0>();
            promote(c, part);
            wfence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) mma<SS>(part, a2[s4], at, bt2, s4, s4);
            wcommit();
            fragments(c + 2, a);
            wwait<0>();
            promote(c + 1, part);
            ++c;
        } else {
            wfence();
#pragma unroll
            for (int s4 = 0; s4 < 4; ++s4) mma<SS>(part, a[s4], at, bt, s4, s4);
            wcommit();
            wwait<0>();
            promote(c, part);
        }
    }
    wwait<0>();
    float sum = 0.f;
    for (int j = 0; j < N / 2; ++j) sum += acc[j] + part[j];
    if constexpr (MODE == TWO_PARTIALS)
        for (int j = 0; j < N / 2; ++j) sum += part2[j];
    out[blockIdx.x * 256 + threadIdx.x] = sum;                 // (keeps the work live)
}

#ifndef __CUDACC_RTC__     // (the host part: tests compile the kernels alone with NVRTC)
#define TIMING
template <bool SS, int MODE>
void run(const char* name, float* out, int sms) {
    const int smem = S * (BST + AST) + S * N * 4 + S * 8192 + 1024, iters = 4000;
    const float ms = best_ms(ceiling<SS, MODE>, sms, smem, out, iters, 1);
    const cudaError_t err = cudaGetLastError();
    const double flops = (double)sms * iters * 2 * 4 * 64.0 * N * 32 * 2;
    printf("%-28s %s %8.1f TFLOP/s %s\n", name, SS ? "SS" : "RS", flops / (ms * 1e-3) / 1e12,
           err ? cudaGetErrorString(err) : "");
}

int main() {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    float* out;
    cudaMalloc(&out, sms * 256 * 4);
    run<false, CHAIN>("chain", out, sms);
    run<true, CHAIN>("chain", out, sms);
    run<false, PROMOTE_CONST>("promote const", out, sms);
    run<true, PROMOTE_CONST>("promote const", out, sms);
    run<false, PROMOTE_LDS>("promote lds", out, sms);
    run<true, PROMOTE_LDS>("promote lds", out, sms);
    run<false, TWO_PARTIALS>("two partials", out, sms);
    run<true, TWO_PARTIALS>("two partials", out, sms);
    run<false, FRAGMENTS>("fragments", out, sms);
    return 0;
}
#endif
'''

#: The kernels main() runs: (SS, MODE).
INSTANCES = tuple(f"ceiling<{ss}, {mode}>" for ss in ("false", "true") for mode in range(5)
                  if not (ss == "true" and mode == 4))


def source() -> str:
    """The program: the W4A8 kernel file's constants (the E4M3 table, ...) as
    #defines (nvcc would split a -D value at its commas), then the body."""
    from rawkv.kernels import gemm_w4a8
    wrappers = gen_wgmma.wrapper_fp8(128) + wrapper_ss(128)
    body = BODY.replace("#define WRAPPERS", wrappers).replace("#define TIMING", ceiling_program.TIMING)
    return ceiling_program.defines(gemm_w4a8.FILE) + body


def main() -> int:
    return ceiling_program.build_and_run(source())


if __name__ == "__main__":
    sys.exit(main())
