"""The fast paths (rawkv.gemm.fast, the FP8 encode / decode's) reuse a
launch the checked path made for a call like this one. An output that is an
inference tensor outside torch.inference_mode is one the checked path
refuses by name (rawkv._args.check_outputs), and the remembered call's key
does not tell the mode, so the fast path must send such a call to the
checked path: it once wrote the tensor where torch forbids it. Inside
inference_mode the same outputs are taken, on the fast path too."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv._plan import Launch  # noqa: E402
from rawkv.gemm import fast  # noqa: E402
from support.gemm import random_weight  # noqa: E402

MSG = r"is an inference tensor \(made under torch.inference_mode\)"


class _Kernel:
    """A launch's kernel that records its calls (CPU: rawkv.gemm.fast's
    logic without a GPU)."""
    smem = 0

    def __init__(self):
        self.calls = []

    def launch(self, rt, grid, block, stream=None, shared_mem=0, **args):
        self.calls.append(args)


def test_the_gemm_fast_path_declines_an_inference_output_outside_inference_mode():
    w, x, plain = torch.zeros(4, dtype=torch.uint8), torch.zeros(8), torch.zeros(8)
    with torch.inference_mode():
        frozen = torch.zeros(8)
    kernel = _Kernel()
    k = ("probe", id(w))
    try:
        fast.remember(k, (w,), Launch(kernel, (1,), (1,), {"w": w, "x": x, "out": plain}), ("out", "x"),
                      (plain, x), ("w",))
        assert fast.try_launch(k, (w,), ("w",), ("out", "x"), (plain, x), 1, lambda d: None)
        assert not fast.try_launch(k, (w,), ("w",), ("out", "x"), (frozen, x), 1, lambda d: None)
        # an inference tensor that is only read is no reason to decline
        assert fast.try_launch(k, (w,), ("w",), ("out", "x"), (plain, frozen), 1, lambda d: None)
        with torch.inference_mode():
            assert fast.try_launch(k, (w,), ("w",), ("out", "x"), (frozen, x), 1, lambda d: None)
        assert [c["out"] for c in kernel.calls] == [plain, plain, frozen]
    finally:
        fast.forget()


def test_gpu_gemm_refuses_an_inference_out_on_a_known_call(cuda, rng):
    g, n, k = 2, 64, 256
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(3, g, k, dtype=torch.bfloat16, device="cuda")
    want = rawkv.gemm.grouped_linear(x, w, out=torch.empty(3, g, n, dtype=torch.bfloat16, device="cuda"))
    with torch.inference_mode():
        out = torch.zeros(3, g, n, dtype=torch.bfloat16, device="cuda")
        rawkv.gemm.grouped_linear(x, w, out=out)              # remembered inside inference_mode
    with torch.inference_mode():
        out2 = torch.zeros(3, g, n, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=rf"^out: {MSG}"):
        rawkv.gemm.grouped_linear(x, w, out=out2)
    torch.cuda.synchronize()
    assert not out2.any()                                     # nothing written
    np.testing.assert_array_equal(out.view(torch.int16).cpu().numpy(), want.view(torch.int16).cpu().numpy())


@pytest.mark.parametrize("op", ["encode", "decode"])
def test_gpu_fp8_refuses_an_inference_out_on_a_known_call(cuda, op):
    if op == "encode":
        fn, src, dtype = rawkv.fp8.e4m3_encode, torch.ones(64, device="cuda"), torch.uint8
    else:
        fn, src, dtype = rawkv.fp8.e4m3_decode, torch.full((64,), 0x38, dtype=torch.uint8, device="cuda"), \
            torch.float32
    with torch.inference_mode():
        fn(src, out=torch.zeros(64, dtype=dtype, device="cuda"))    # remembered inside inference_mode
        frozen = torch.zeros(64, dtype=dtype, device="cuda")
    fn(src, out=torch.zeros(64, dtype=dtype, device="cuda"))        # and outside it
    with pytest.raises(ValueError, match=rf"^out: {MSG}"):
        fn(src, out=frozen)
    torch.cuda.synchronize()
    assert not frozen.any()
    with torch.inference_mode():
        fn(src, out=frozen)
    torch.cuda.synchronize()
    assert frozen.all()
