"""opcheck samples of the fp8 operators (tests/guards/test_library*.py collect them)."""
import numpy as np
import torch


def samples(rng, device="cpu"):
    x = torch.from_numpy(rng.standard_normal((3, 37)).astype(np.float32)).to(device)
    # uint8 codes: opcheck compares buffers with allclose, which has no float8 kernel on CPU
    codes = torch.from_numpy(rng.integers(0, 256, (3, 37), dtype=np.uint8)).to(device)
    xb = torch.from_numpy(rng.standard_normal((3, 144)).astype(np.float32)).to(device)
    u8 = dict(dtype=torch.uint8, device=device)
    bcodes = torch.from_numpy(rng.integers(0, 256, (3, 144), dtype=np.uint8)).to(device)
    x3 = torch.from_numpy(rng.standard_normal((2, 3, 64)).astype(np.float32)).to(device).half()
    return {
        "fp8_quantize_blocks": [(xb, 128, "fp32", torch.empty(3, 144, **u8), torch.empty(3, 2, device=device)),
                                (xb.bfloat16(), 64, "ue8m0", torch.empty(3, 144, **u8), torch.empty(3, 3, **u8)),
                                (xb, 32, "ue8m0", torch.empty(3, 144, **u8), torch.empty(3, 5, device=device)),
                                # float16 (..., K) x, scales written in DeepGEMM's MN-major layout (each
                                # block's column of rows contiguous); no rows
                                (x3, 32, "fp32", torch.empty(2, 3, 64, **u8), _mn_major((2, 3, 2), device)),
                                (xb[:0], 128, "ue8m0", torch.empty(0, 144, **u8), torch.empty(0, 2, **u8))],
        "fp8_dequantize_blocks": [(bcodes, torch.rand(3, 2, device=device), 128, torch.empty(3, 144, device=device)),
                                  (bcodes, torch.full((3, 5), 120, **u8), 32,
                                   torch.empty(3, 144, dtype=torch.bfloat16, device=device)),
                                  (bcodes, _mn_major((3, 3), device).copy_(torch.rand(3, 3)), 64,
                                   torch.empty(3, 144, dtype=torch.float16, device=device)),
                                  (bcodes[:0], torch.full((0, 2), 127, **u8), 128, torch.empty(0, 144, device=device))],
        "e4m3_encode": [(x, torch.empty(x.shape, dtype=torch.uint8, device=device)),
                        (x.bfloat16(), torch.empty(x.shape, dtype=torch.uint8, device=device)),
                        (x3, torch.empty(x3.shape, dtype=torch.uint8, device=device)),
                        (x[:0], torch.empty(0, 37, dtype=torch.uint8, device=device))],
        "e4m3_decode": [(codes, torch.empty(codes.shape, device=device)),
                        (codes, torch.empty(codes.shape, dtype=torch.float16, device=device)),
                        (codes.view(37, 3), torch.empty(37, 3, dtype=torch.bfloat16, device=device)),
                        (codes[:0], torch.empty(0, 37, device=device))],
    }


def _mn_major(shape, device):
    """A float32 scales buffer of `shape` (..., nb) in DeepGEMM's MN-major
    layout: the rows (the leading dimensions as one index) adjacent."""
    rows = int(np.prod(shape[:-1]))
    return torch.empty(shape[-1], rows, device=device).t().reshape(shape)


def _encode_decode(rng, device):
    x = torch.from_numpy(rng.standard_normal((8, 512)).astype(np.float32)).to(device)

    def step(x):
        import rawkv
        codes = rawkv.fp8.e4m3_encode(x)
        return rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)
    return step, (x,)


def _quantize_blocks(rng, device):
    x = torch.from_numpy(rng.standard_normal((8, 512)).astype(np.float32)).to(device).bfloat16()

    def step(x):
        import rawkv
        codes, scales = rawkv.fp8.quantize_blocks(x, scale_format="ue8m0")
        return rawkv.fp8.dequantize_blocks(codes, scales, dtype=torch.bfloat16)
    return step, (x,)


# (name, make(rng, device) -> (step function, its arguments)): compiled with
# fullgraph=True, the step must give the same bits as eager
STEPS = [("fp8_encode_decode", _encode_decode), ("fp8_quantize_blocks", _quantize_blocks)]
