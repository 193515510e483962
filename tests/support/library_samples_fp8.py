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
    return {
        "fp8_quantize_blocks": [(xb, 128, "fp32", torch.empty(3, 144, **u8), torch.empty(3, 2, device=device)),
                                (xb.bfloat16(), 64, "ue8m0", torch.empty(3, 144, **u8), torch.empty(3, 3, **u8)),
                                (xb, 32, "ue8m0", torch.empty(3, 144, **u8), torch.empty(3, 5, device=device))],
        "fp8_dequantize_blocks": [(bcodes, torch.rand(3, 2, device=device), 128, torch.empty(3, 144, device=device)),
                                  (bcodes, torch.full((3, 5), 120, **u8), 32,
                                   torch.empty(3, 144, dtype=torch.bfloat16, device=device))],
        "e4m3_encode": [(x, torch.empty(x.shape, dtype=torch.uint8, device=device)),
                        (x.bfloat16(), torch.empty(x.shape, dtype=torch.uint8, device=device))],
        "e4m3_decode": [(codes, torch.empty(codes.shape, device=device)),
                        (codes, torch.empty(codes.shape, dtype=torch.float16, device=device))],
    }


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
