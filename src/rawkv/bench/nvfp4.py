"""NVFP4 benchmarks: quantize (each scope), dequantize, gather, the graph
replay of quantize+dequantize at decode sizes, against a prototype's approaches
re-implemented here as baselines (timed in the same run):

* seed001-torch-ops: the prototype's all-torch quantize_to_nvfp4, defects included
  (double rounding through a half-step table, clamp(1e-8), no NaN handling);
* seed000-dequant-kernel: the prototype's dequant kernels (one 16-thread CTA per
  16-element block, all 16 threads computing the same 16 outputs, byte loads,
  output from torch.zeros), compiled with cupy.RawKernel.

Entry point: run(rt, results, quick=False) (called by rawkv.bench.cli)."""
from __future__ import annotations

from .timing import copy_GBps, cuda_time_us, entry, graph_time_us, latency, rotation

SEED000_SRC = r"""
#include <cuda_fp8.h>
#include <cuda_bf16.h>
__device__ __constant__ float E2M1_LUT[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
__device__ __forceinline__ void seed_block(const unsigned char* fp4_row, const unsigned char* sf_row, float gsa,
                                           __nv_bfloat16* out_row, int n_block, int N) {
    unsigned char sf_byte = sf_row[n_block];
    __nv_fp8_e4m3 sf_val;
    memcpy(&sf_val, &sf_byte, 1);
    float bsf = (float)sf_val;
    for (int i = 0; i < 8; i++) {
        unsigned char packed = fp4_row[n_block * 8 + i];
        unsigned char lo = packed & 0x0F, hi = (packed >> 4) & 0x0F;
        float lo_val = ((lo & 8) ? -1.0f : 1.0f) * E2M1_LUT[lo & 7] * bsf * gsa;
        int lo_col = n_block * 16 + 2 * i;
        if (lo_col < N) out_row[lo_col] = __float2bfloat16(lo_val);
        float hi_val = ((hi & 8) ? -1.0f : 1.0f) * E2M1_LUT[hi & 7] * bsf * gsa;
        int hi_col = lo_col + 1;
        if (hi_col < N) out_row[hi_col] = __float2bfloat16(hi_val);
    }
}
extern "C" __global__ void seed_dequant(const unsigned char* fp4, const unsigned char* sf, const float* gsa,
                                        __nv_bfloat16* out, int M, int N) {
    int m = blockIdx.y, nb = blockIdx.x;
    if (m >= M || nb * 16 >= N) return;
    seed_block(fp4 + (long long)m * (N / 2), sf + (long long)m * (N / 16), gsa[m], out + (long long)m * N, nb, N);
}
extern "C" __global__ void seed_dequant_selective(const unsigned char* fp4, const unsigned char* sf,
                                                  const float* gsa, const int* idx, __nv_bfloat16* out,
                                                  int K, int N) {
    int k = blockIdx.y, nb = blockIdx.x;
    if (k >= K || nb * 16 >= N) return;
    int r = idx[k];
    seed_block(fp4 + (long long)r * (N / 2), sf + (long long)r * (N / 16), gsa[r], out + (long long)k * N, nb, N);
}
"""


def seed001_quantize(x_bf16, lut, block_size=16):
    """The prototype's quantize_to_nvfp4, op for op (the baseline, defects included)."""
    import torch
    x_f32 = x_bf16.float()
    amax = x_f32.abs().max().clamp(min=1e-8).float()
    global_scale = amax / (6.0 * 448.0)
    x_norm = x_f32 / global_scale
    last_dim = x_norm.shape[-1]
    n_blocks = -(-last_dim // block_size)
    x_reshaped = x_norm.reshape(*x_norm.shape[:-1], n_blocks, block_size)
    block_amax = x_reshaped.abs().amax(dim=-1)
    zero_block = block_amax < (6.0 * 2.0 ** -9)
    x_reshaped = torch.where(zero_block.unsqueeze(-1), 0.0, x_reshaped)
    block_amax = block_amax.clamp(min=1e-8)
    block_scale = (block_amax / 6.0).to(torch.float8_e4m3fn)
    block_scale = torch.where(zero_block, 0.0, block_scale)
    block_sf_expanded = block_scale.float().unsqueeze(-1)
    x_scaled = x_reshaped / block_sf_expanded.clamp(min=1e-8)
    signs = torch.sign(x_scaled)
    abs_scaled = x_scaled.abs().clamp(max=6.0)
    half_steps = (abs_scaled * 2.0).round().clamp(0, 12).to(torch.int8)
    indices = lut[half_steps.long()]
    nibbles = torch.where(signs < 0, indices + 8, indices).to(torch.uint8)
    even = nibbles[..., ::2]
    odd = nibbles[..., 1::2]
    packed = (odd << 4) | even
    packed_shape = list(x_bf16.shape)
    packed_shape[-1] = last_dim // 2
    x_fp4 = packed.view(torch.float4_e2m1fn_x2).reshape(packed_shape)
    block_scale = block_scale.reshape(list(x_bf16.shape[:-1]) + [n_blocks])
    return x_fp4, block_scale, global_scale


def run(rt, results, quick=False):
    import cupy
    import numpy as np
    import torch
    import rawkv
    nv = rawkv.nvfp4
    copy = copy_GBps()
    reps = 10 if quick else 50
    dev = "cuda"
    lut = torch.as_tensor([0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 7, 7], dtype=torch.int8, device=dev)
    mod = cupy.RawModule(code=SEED000_SRC, options=("--std=c++17",))
    seed_deq = mod.get_function("seed_dequant")
    seed_sel = mod.get_function("seed_dequant_selective")
    N = 7168
    sizes = [16384, 1, 8, 64] if not quick else [16384, 1, 64]
    for M in sizes:
        in_bytes = M * N * 2
        q_bytes = M * N // 2 + M * N // 16
        k = rotation(in_bytes, rt.l2_bytes)
        xs = [torch.randn(M, N, device=dev, dtype=torch.bfloat16) for _ in range(min(k, 64))]
        k = len(xs)
        q = torch.empty(M, N // 2, dtype=torch.uint8, device=dev)
        sf = torch.empty(M, N // 16, dtype=torch.uint8, device=dev)
        gs = torch.empty((), device=dev)
        gsr = torch.empty(M, device=dev)
        y = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        base_q = cuda_time_us(lambda i: seed001_quantize(xs[i % k], lut), reps=reps)
        for scope in ("tensor", "row", "given", "none"):
            g_out = gsr if scope == "row" else gs
            gsv = 0.01 if scope == "given" else None
            us = cuda_time_us(lambda i: nv.quantize(xs[i % k], scope=scope, gs=gsv, out=(q, sf, g_out)),
                              reps=reps)
            results.append(entry(f"quantize/{scope}", [M, N], "bfloat16", us, in_bytes + q_bytes, copy,
                                 "seed001-torch-ops", base_q))
            if M < 16384:         # decode sizes: one graph replay against the latency floor
                lat = latency(lambda: nv.quantize(xs[0], scope=scope, gs=gsv, out=(q, sf, g_out)),
                              in_bytes + q_bytes)
                results.append(entry(f"quantize/{scope}/graph", [M, N], "bfloat16", lat["device_us"],
                                     in_bytes + q_bytes, copy, **lat))
        # dequantize (codes from a real quantize; rotated sets of q/sf)
        qs = []
        kq = rotation(q_bytes + M * N * 2, rt.l2_bytes)
        for j in range(min(kq, 64)):
            qq, ss, _ = nv.quantize(xs[j % k], scope="row")
            qs.append((qq.view(torch.uint8), ss.view(torch.uint8)))
        kq = len(qs)
        gsa = torch.rand(M, device=dev) + 0.5
        us = cuda_time_us(lambda i: nv.dequantize(qs[i % kq][0], qs[i % kq][1], gsa, out=y), reps=reps)

        def seed_run(i):
            out = torch.zeros(M, N, dtype=torch.bfloat16, device=dev)
            seed_deq((N // 16, M), (16,), (qs[i % kq][0].data_ptr(), qs[i % kq][1].data_ptr(), gsa.data_ptr(),
                                           out.data_ptr(), np.int32(M), np.int32(N)), stream=rt.stream())
        base = cuda_time_us(seed_run, reps=reps)
        results.append(entry("dequantize/row_gs", [M, N], "bfloat16", us, q_bytes + 4 * M + M * N * 2, copy,
                             "seed000-dequant-kernel", base))
        if M < 16384:
            nb = q_bytes + 4 * M + M * N * 2
            lat = latency(lambda: nv.dequantize(qs[0][0], qs[0][1], gsa, out=y), nb)
            results.append(entry("dequantize/row_gs/graph", [M, N], "bfloat16", lat["device_us"], nb, copy,
                                 **lat))
        if M == 16384:
            K = 2048
            idx = torch.randint(0, M, (K,), device=dev, dtype=torch.int32)
            err = torch.zeros(1, dtype=torch.int32, device=dev)
            yk = torch.empty(K, N, dtype=torch.bfloat16, device=dev)
            us = cuda_time_us(lambda i: nv.gather(qs[i % kq][0], qs[i % kq][1], gsa, idx, out=yk, errors=err),
                              reps=reps)

            def seed_g(i):
                out = torch.zeros(K, N, dtype=torch.bfloat16, device=dev)
                seed_sel((N // 16, K), (16,), (qs[i % kq][0].data_ptr(), qs[i % kq][1].data_ptr(), gsa.data_ptr(),
                                               idx.data_ptr(), out.data_ptr(), np.int32(K), np.int32(N)),
                         stream=rt.stream())
            base = cuda_time_us(seed_g, reps=reps)
            results.append(entry("gather/row_gs", [K, N], "bfloat16", us, K * (N // 2 + N // 16 + 4 + 4 + 2 * N),
                                 copy, "seed000-dequant-kernel (selective)", base, source_rows=M))
        else:
            x0 = xs[0]

            def step():
                nv.quantize(x0, out=(q, sf, gs))
                nv.dequantize(q, sf, gs, out=y)
            us = graph_time_us(step, reps=100 if quick else 500)
            results.append(entry("quantize+dequantize/graph", [M, N], "bfloat16", us,
                                 in_bytes + 2 * q_bytes + M * N * 2, copy))
        del xs, qs
        torch.cuda.empty_cache()
