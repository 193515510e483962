"""opcheck samples of the fp8 operators (tests/test_library*.py collect them)."""
import numpy as np
import torch


def samples(rng, device="cpu"):
    x = torch.from_numpy(rng.standard_normal((3, 37)).astype(np.float32)).to(device)
    # uint8 codes: opcheck compares buffers with allclose, which has no float8 kernel on CPU
    codes = torch.from_numpy(rng.integers(0, 256, (3, 37), dtype=np.uint8)).to(device)
    return {
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


# (name, make(rng, device) -> (step function, its arguments)): compiled with
# fullgraph=True, the step must give the same bits as eager
STEPS = [("fp8_encode_decode", _encode_decode)]
