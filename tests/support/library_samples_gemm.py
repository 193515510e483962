"""opcheck samples of the grouped FP4 GEMM operators (tests/guards/test_library*.py
collect them): BF16 and NVFP4 activations, NVFP4 and MXFP4 weights, the
ragged form with offsets that need clamping."""
import numpy as np
import torch

import rawkv


def _weights(rng, device):
    g, n, k = 3, 24, 64
    w = rawkv.gemm.Fp4Weight.from_float(torch.from_numpy(rng.standard_normal((g, n, k)).astype(np.float32)))
    codes = torch.from_numpy(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(118, 132, (g, n, k // 32), dtype=np.uint8))
    mx = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=g)
    return w.to(device), mx.to(device)


def _args(x, w, **extra):
    return tuple((rawkv.gemm.operator_args(x, w) | extra).values())


def samples(rng, device="cpu"):
    w, mx = _weights(rng, device)
    x = torch.from_numpy(rng.standard_normal((5, 3, 64)).astype(np.float32)).bfloat16().to(device)
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row")
    # uint8 bytes: opcheck copies its inputs, and torch has no float4 copy
    qa = rawkv.nvfp4.QuantizedActivation(q.view(torch.uint8), sf.view(torch.uint8), gs)
    out = torch.empty(5, 3, 24, dtype=torch.bfloat16, device=device)
    xr = x[:, 0].contiguous()
    offsets = torch.tensor([0, 2, 1, 5], dtype=torch.int32, device=device)   # 1 < 2: clamped
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    outr = torch.empty(5, 24, dtype=torch.bfloat16, device=device)
    # NVFP4 activations of the rows (x_sf, x_gs given): a gs per row, and one for all (scope 'tensor')
    rq = [rawkv.nvfp4.QuantizedActivation(q.view(torch.uint8), sf.view(torch.uint8), gs)
          for q, sf, gs in (rawkv.nvfp4.quantize(xr, scope=sc) for sc in ("row", "tensor"))]
    q, sf, gs = rawkv.nvfp4.quantize(x)                                       # one gs for all
    qt = rawkv.nvfp4.QuantizedActivation(q.view(torch.uint8), sf.view(torch.uint8), gs)
    # FP16 activations; rows 128 channels apart (a strided x, read in place on CPU, copied once on CUDA)
    x16 = x.half()
    xs = torch.from_numpy(rng.standard_normal((5, 3, 128)).astype(np.float32)).bfloat16().to(device)[..., 64:]
    none = torch.zeros(4, dtype=torch.int32, device=device)                   # offsets of no rows
    # outs the kernels write at their strides: (T, G, N) over a (G, T, N) buffer, rows 32 apart
    out_gt = torch.empty(3, 5, 24, dtype=torch.bfloat16, device=device).transpose(0, 1)
    out_pad = torch.empty(5, 32, dtype=torch.bfloat16, device=device)[:, :24]
    return {
        "gemm_grouped_linear": [_args(x, w, out=out), _args(qa, mx, out=out.clone()),
                                _args(qt, w, out=out.clone()), _args(x16, w, out=out.clone()),
                                _args(xs, mx, out=out.clone()), _args(x[:0], w, out=out[:0].clone()),
                                _args(qa, w, out=out_gt)],
        "gemm_moe_linear": [_args(xr, w, offsets=offsets, out=outr, errors=errors),
                            _args(xr, mx, offsets=offsets, out=outr.clone(), errors=None),
                            _args(rq[0], w, offsets=offsets, out=outr.clone(), errors=errors.clone()),
                            _args(rq[1], mx, offsets=offsets, out=outr.clone(), errors=None),
                            _args(xr.half(), w, offsets=offsets, out=outr.clone(), errors=None),
                            _args(xs[:, 1], mx, offsets=offsets, out=outr.clone(), errors=errors.clone()),
                            _args(xr[:0], w, offsets=none, out=outr[:0].clone(), errors=errors.clone()),
                            _args(xr, mx, offsets=offsets, out=out_pad, errors=errors.clone())],
    }


def _wo_a(rng, device):
    w, _ = _weights(rng, device)
    x = torch.from_numpy(rng.standard_normal((4, 3, 64)).astype(np.float32)).bfloat16().to(device)

    def step(x):
        return rawkv.gemm.grouped_linear(x, w)
    return step, (x,)


STEPS = [("gemm_wo_a", _wo_a)]
