"""Outputs given as another library's DLPack array (CuPy, JAX, ...: the ops
accept them) are checked against the inputs' memory like numpy arrays and
torch tensors: an `out=` or `errors=` over an input is refused by name and
nothing is written (rawkv._args.check_outputs spans them through a zero-copy
view)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv import fused, kvcache as kv  # noqa: E402

from support.outputs import _refused  # noqa: E402


class DL:
    """A bare DLPack producer over `a` (what a CuPy or JAX array offers)."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def _weight(g=3, n=16, k=64):
    return rawkv.gemm.Fp4Weight.from_float(torch.linspace(-1, 1, g * n * k).reshape(g, n, k))


def test_gemm_errors_over_the_offsets():
    w = _weight()
    offsets = np.array([0, 2, 4, 9], np.int32)
    before = offsets.copy()
    _refused("errors", "offsets", lambda: rawkv.gemm.moe_linear(
        torch.randn(6, 64).bfloat16(), w, DL(offsets), errors=torch.from_numpy(offsets[:1])))
    _refused("errors", "offsets", lambda: rawkv.gemm.moe_linear(
        torch.randn(6, 64).bfloat16(), w, offsets, errors=DL(offsets[:1])))
    assert np.array_equal(offsets, before)


def test_gemm_out_over_x():
    w = _weight()
    buf = torch.randn(3, 3, 64).bfloat16()
    before = buf.clone()
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(DL(buf), w, out=buf[..., :16]))
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(buf, w, out=DL(buf[..., :16])))
    assert torch.equal(buf, before)


def test_fused_out_over_x():
    x = torch.randint(-4, 5, (4, 64)).bfloat16()
    w = torch.ones(64)
    before = x.clone()
    _refused("out.inv_rms", "x", lambda: fused.rmsnorm_quantize(
        DL(x), w, out=(None, None, None, x.view(torch.float32)[0, :4])))
    _refused("out.inv_rms", "x", lambda: fused.rmsnorm_quantize(
        x, w, out=(None, None, None, DL(x.view(torch.float32)[0, :4]))))
    assert torch.equal(x, before)


def test_kvcache_errors_over_the_pool():
    pool = kv.PagedKVPool("hca", 4, 2, 2, 4, device="cpu")
    slot = pool.add_request()
    pool.prepare_step([slot], [127])
    written = pool.written.copy()
    args = (np.zeros((1, 512), np.float32), np.ones(1, bool), np.array([slot], np.int32),
            np.array([127], np.int32))
    _refused("errors", "pool.written", lambda: kv.flush_write(pool, *args, errors=DL(pool.written[:1])))
    assert np.array_equal(pool.written, written)


def test_cpu_dlpack_bfloat16_and_fp8_inputs_are_read():
    """A CPU DLPack array of BF16 (or FP8 codes) reads as the torch tensor
    does; numpy alone has no such dtypes."""
    w = _weight()
    x = torch.randn(3, 3, 64).bfloat16()
    got = rawkv.gemm.grouped_linear(DL(x), w)
    assert np.array_equal(np.asarray(got, np.float32), rawkv.gemm.grouped_linear(x, w).float().numpy())
    if hasattr(torch, "float8_e4m3fn"):
        codes, scales = rawkv.fp8.quantize_blocks(torch.randn(2, 256))
        codes8 = codes.view(torch.float8_e4m3fn)
        assert np.array_equal(rawkv.fp8.dequantize_blocks(DL(codes8), scales),
                              rawkv.fp8.dequantize_blocks(codes8, scales))


def test_gpu_outputs_over_inputs_through_dlpack_are_refused(cuda):
    """The same on CUDA: a DLPack-wrapped device array (CuPy's, JAX's) as
    out= over x, or as x under out=, is refused before the launch."""
    w = _weight().to("cuda")
    buf = torch.randn(3, 3, 64, device="cuda").bfloat16()
    before = buf.clone()
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(DL(buf), w, out=buf[..., :16]))
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(buf, w, out=DL(buf[..., :16])))
    torch.cuda.synchronize()
    assert torch.equal(buf, before)
    out = torch.empty(3, 3, 16, device="cuda", dtype=torch.bfloat16)
    rawkv.gemm.grouped_linear(DL(buf), w, out=DL(out))                # apart: written
    assert torch.equal(out, rawkv.gemm.grouped_linear(buf, w))

