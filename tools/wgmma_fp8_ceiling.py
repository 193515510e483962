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
variant allows. A standalone CUDA program: on a GPU machine with nvcc,

    python tools/wgmma_fp8_ceiling.py

writes it to a temporary directory, compiles it for sm_90a and prints TFLOP/s
per variant (an H100 printed, on 2026-11-26: chain 1,921 RS / 1,928 SS,
promote const 1,389 / 1,471, promote lds 1,319 / 1,346, two partials 1,259 /
1,252, fragments 1,114).
"""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import tempfile

_HERE = pathlib.Path(__file__).resolve().parent
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
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
typedef uint32_t u32;
typedef uint64_t u64;
typedef uint8_t u8;
#define WRAPPERS

// K-major, 128-byte swizzle, 1024 bytes per 8 rows (the kernel's b_desc).
__device__ __forceinline__ u64 desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wfence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wcommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int K> __device__ __forceinline__ void wwait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(K) : "memory"); }
__device__ __forceinline__ float4 lds4(u32 a) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ uint4 ldsu4(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

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
            const u32 sc = smem_u32(ss + (c % S) * N) + 16 * t;
#pragma unroll
            for (int j2 = 0; j2 < N / 16; ++j2) {
                const float4 f = lds4(sc + 64 * j2);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int j = 2 * j2 + i;
                    const float f0 = i ? f.z : f.x, f1 = i ? f.w : f.y;
                    acc[4 * j] = fmaf(p[4 * j], f0, acc[4 * j]);
                    acc[4 * j + 1] = fmaf(p[4 * j + 1], f1, acc[4 * j + 1]);
                    acc[4 * j + 2] = fmaf(p[4 * j + 2], f0, acc[4 * j + 2]);
                    acc[4 * j + 3] = fmaf(p[4 * j + 3], f1, acc[4 * j + 3]);
                }
            }
        }
    };
    // The kernel's conversion: per 8 codes, two prmt on the magnitudes and
    // two in sign-replicate mode (gemm_w4a8.cuh, e4m3_of_e2m1).
    auto fragments = [&](int c, u32 (&f)[4][4]) {
        const u32 w = smem_u32(sw + (c % S) * 8192 + (wg * 4 + warp) * 1024 + lane * 16);
        const uint4 c0 = ldsu4(w), c1 = ldsu4(w + 512);
        const u32 words[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        const u32 t0 = 0x3C383000u + c, t1 = 0x4C484440u;
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 wd = words[2 * s + h], m = wd & 0x77777777u, sw4 = wd << 4;
                f[s][h] = prmt(t0, t1, m) | (prmt(sw4, wd, 0xD9C8u) & 0x80808080u);
                f[s][h + 2] = prmt(t0, t1, m >> 16) | (prmt(sw4, wd, 0xFBEAu) & 0x80808080u);
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

template <bool SS, int MODE>
void run(const char* name, float* out, int sms) {
    const int smem = S * (BST + AST) + S * N * 4 + S * 8192 + 1024, iters = 4000;
    auto k = ceiling<SS, MODE>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    k<<<sms, 256, smem>>>(out, 10);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaEventRecord(e0);
    k<<<sms, 256, smem>>>(out, iters);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
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
'''


def source() -> str:
    return BODY.replace("#define WRAPPERS", gen_wgmma.wrapper_fp8(128) + wrapper_ss(128))


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        cu, exe = pathlib.Path(d, "ceiling.cu"), pathlib.Path(d, "ceiling")
        cu.write_text(source())
        build = subprocess.run(["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                                str(cu), "-o", str(exe)], capture_output=True, text=True)
        if build.returncode:
            print(build.stdout + build.stderr, file=sys.stderr)
            return build.returncode
        return subprocess.run([str(exe)]).returncode


if __name__ == "__main__":
    sys.exit(main())
