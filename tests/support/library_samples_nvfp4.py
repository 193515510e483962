"""opcheck samples and compiled steps of the NVFP4 operators
(tests/guards/test_library*.py collect them). Buffers the ops write as FP4 / FP8
are uint8 here: opcheck compares them with allclose, which has no FP8/FP4
kernel on CPU."""
import numpy as np
import torch

from rawkv.reference import layouts as RL
from rawkv.reference import nvfp4 as R


def samples(rng, device="cpu"):
    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def empty(*shape, dtype=torch.uint8):
        return torch.empty(shape, dtype=dtype, device=device)

    x = t(rng.standard_normal((4, 64)).astype(np.float32))
    q, sf, g = R.quantize(x.cpu().numpy(), "row")
    q, sf, g = t(q), t(sf), t(g)                       # valid codes and scales, gs one per row
    g1 = torch.tensor([0.05], device=device)           # a given gs tensor (1 element)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    idx = torch.tensor([[3, 0], [7, 1]], dtype=torch.int32, device=device)     # 7: not a row
    sf3 = t(rng.integers(0, 0x7F, (2, 3, 5), dtype=np.uint8))
    sw = t(RL.swizzle_scales(sf.cpu().numpy()))
    x3 = t(rng.standard_normal((2, 3, 32)).astype(np.float32)).half()
    q3, sf3q, g3 = (t(a) for a in R.quantize(x3.float().cpu().numpy(), "row"))   # (2, 3) rows, a gs each
    return {
        # x, scope, gs, gs_value, q, sf, gs_out, errors
        "nvfp4_quantize": [
            (x, "tensor", None, None, empty(4, 32), empty(4, 4), empty(dtype=torch.float32), None),
            (x.bfloat16(), "row", None, None, empty(4, 32), empty(4, 4), empty(4, dtype=torch.float32),
             None),
            (x, "given", None, 0.05, empty(4, 32), empty(4, 4), empty(dtype=torch.float32), None),
            (x, "given", g1, None, empty(4, 32), empty(4, 4), None, errors.clone()),
            (x.half(), "given", g1, None, empty(4, 32), empty(4, 4), empty(dtype=torch.float32), None),
            (x, "none", None, None, empty(4, 32), empty(4, 4), empty(dtype=torch.float32), None),
            # no rows; rows 128 floats apart (a strided x the op reads in place)
            (x[:0], "row", None, None, empty(0, 32), empty(0, 4), empty(0, dtype=torch.float32), None),
            (t(rng.standard_normal((4, 128)).astype(np.float32))[:, :64], "tensor", None, None, empty(4, 32),
             empty(4, 4), empty(dtype=torch.float32), errors.clone()),
            # (..., K) x of two leading dimensions (a gs per row: (2, 3)); a given gs of shape ()
            (x3, "row", None, None, empty(2, 3, 16), empty(2, 3, 2), empty(2, 3, dtype=torch.float32), None),
            (x3, "given", g1.reshape(()), None, empty(2, 3, 16), empty(2, 3, 2), None, errors.clone()),
        ],
        # q, sf, gs, gs_value, out
        "nvfp4_dequantize": [
            (q, sf, g, None, empty(4, 64, dtype=torch.float32)),
            (q, sf, None, 0.5, empty(4, 64, dtype=torch.bfloat16)),
            (q, sf, torch.tensor(0.25, device=device), None, empty(4, 64, dtype=torch.float16)),
            (q[:0], sf[:0], g[:0], None, empty(0, 64, dtype=torch.float32)),
            (q3, sf3q, g3, None, empty(2, 3, 32, dtype=torch.bfloat16)),
        ],
        # q, sf, gs, gs_value, indices, out, errors
        "nvfp4_gather": [
            (q, sf, g, None, idx, empty(2, 2, 64, dtype=torch.float32), errors.clone()),
            (q, sf, None, 0.5, idx[:, 1].long(), empty(2, 64, dtype=torch.bfloat16), None),
            # rows of a 3-D q (leading dimensions flattened: 6 rows), one gs tensor for all, a float16 out
            (q3, sf3q, g1, None, t(np.array([[5, -1, 0]], np.int64)), empty(1, 3, 32, dtype=torch.float16),
             errors.clone()),
        ],
        "nvfp4_swizzle_scales": [(sf, empty(RL.swizzled_size(4, 4))),
                                 (sf3, empty(RL.swizzled_size(6, 5)))],
        "nvfp4_unswizzle_scales": [(sw, empty(4, 4)),
                                   (t(RL.swizzle_scales(sf3.cpu().numpy())), empty(2, 3, 5))],
    }


def _floats(rng, device, shape, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device, dtype)


def _tensor_scope(rng, device):
    """quantize (scope 'tensor'), swizzle, unswizzle, dequantize (also of a
    QuantizedActivation)."""
    def step(x):
        import rawkv
        nv = rawkv.nvfp4
        q, sf, gs = nv.quantize(x)
        sw = nv.swizzle_scales(sf)
        sf2 = nv.unswizzle_scales(sw, sf.shape)
        return q, sf, gs, sw, sf2, nv.dequantize(q, sf2, gs), nv.QuantizedActivation(q, sf, gs).dequantize()
    return step, (_floats(rng, device, (2, 8, 128), torch.bfloat16),)


def _row_scope_gather(rng, device):
    """quantize (scope 'row'), gather with an errors= counter (out-of-range
    rows are zeros and counted), into an out= buffer too."""
    def step(x, idx):
        import rawkv
        nv = rawkv.nvfp4
        q, sf, gs = nv.quantize(x, scope="row")
        errors = torch.zeros(1, dtype=torch.int32, device=x.device)
        y = nv.gather(q, sf, gs, idx, dtype=torch.float32, errors=errors)
        y2 = nv.gather(q, sf, gs, idx[:2], out=torch.empty(2, x.shape[-1], dtype=torch.float16,
                                                          device=x.device))
        return q, sf, gs, y, y2, errors
    idx = torch.tensor([5, 0, 40, 3, -1, 31], dtype=torch.int64, device=device)
    return step, (_floats(rng, device, (32, 256)), idx)


def _given_gs(rng, device):
    """quantize with a given gs: a tensor (the result's gs is that tensor),
    a number into out= buffers, and scope 'none'; dequantize with a number gs."""
    def step(x, g):
        import rawkv
        nv = rawkv.nvfp4
        q, sf, gs = nv.quantize(x, scope="given", gs=g)
        outs = (torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8, device=x.device),
                torch.empty(x.shape[0], x.shape[1] // 16, dtype=torch.uint8, device=x.device),
                torch.empty((), dtype=torch.float32, device=x.device))
        q2, sf2, gs2 = nv.quantize(x, scope="given", gs=0.125, out=outs)
        q3, sf3, gs3 = nv.quantize(x, scope="none")
        return q, sf, gs, q2, sf2, gs2, q3, sf3, gs3, nv.dequantize(q2, sf2, 0.125, dtype=torch.float16)
    return step, (_floats(rng, device, (16, 96), torch.float16),
                  torch.tensor([0.0625], device=device))


# (name, make(rng, device) -> (step function, its arguments)): compiled with
# fullgraph=True, the step must give the same bits as eager
STEPS = [("nvfp4_tensor_scope_swizzle", _tensor_scope), ("nvfp4_row_scope_gather", _row_scope_gather),
         ("nvfp4_given_gs", _given_gs)]
