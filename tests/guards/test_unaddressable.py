"""Tensors whose memory is not their values (rawkv._args.unaddressable): one
with the negative bit set (a lazily negated view, z.conj().imag or
torch._neg_view: its storage holds the negated values, which a kernel reads
and writes through the data pointer) and one with no memory (a ZeroTensor:
data pointer 0 while it holds elements, an illegal address for a kernel).
Every op refuses both by name, as an input and as an output, on CPU and CUDA
alike (the rules run before dispatch), before anything is written; the fast
paths, whose remembered launches are keyed by a tensor's metadata, send such
a call to the checked path. (Found by a review: the shared rules took both,
so CUDA computed with a negative global scale's magnitude and would have
read address 0, while CPU failed in numpy() without naming the argument.)"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv import fp8, fused, nvfp4  # noqa: E402
from rawkv._plan import Launch  # noqa: E402
from rawkv.gemm import fast  # noqa: E402

NEG = r"has its negative bit set"
NO_MEMORY = r"has no memory \(data pointer 0"


def _neg(t):
    """A view of t's memory with the negative bit set (its values -t)."""
    v = torch._neg_view(t)
    assert v.is_neg() and v.data_ptr() == t.data_ptr()
    return v


def _zero(shape, dtype=torch.float32, device="cpu"):
    z = torch._efficientzerotensor(shape, dtype=dtype, device=device)
    assert z._is_zerotensor() and z.data_ptr() == 0
    return z


def _calls(device):
    """(argument name, a good value of it, the op's call with it replaced):
    inputs and outputs of each op family."""
    x = torch.randn(4, 64, device=device)
    xb = x.bfloat16()
    w = torch.ones(64, device=device)
    codes = fp8.e4m3_encode(x)
    return [
        ("x", x, lambda bad: fp8.e4m3_encode(bad)),
        ("out", codes, lambda bad: fp8.e4m3_encode(x, out=bad)),
        ("codes", codes, lambda bad: fp8.e4m3_decode(bad)),
        ("x", x, lambda bad: nvfp4.quantize(bad)),
        ("gs", torch.tensor(0.5, device=device), lambda bad: nvfp4.quantize(x, scope="given", gs=bad)),
        ("x", x, lambda bad: fp8.quantize_blocks(bad)),
        ("x", xb, lambda bad: fused.rmsnorm_quantize(bad, w)),
        ("weight", w, lambda bad: fused.rmsnorm_quantize(xb, bad)),
    ]


CASES = range(len(_calls("cpu")))


@pytest.mark.parametrize("i", CASES)
def test_a_negative_bit_is_refused_by_name_on_cpu(i):
    name, good, call = _calls("cpu")[i]
    with pytest.raises(TypeError, match=rf"^{name}: {NEG}"):
        call(_neg(good))


@pytest.mark.parametrize("i", CASES)
def test_no_memory_is_refused_by_name_on_cpu(i):
    name, good, call = _calls("cpu")[i]
    with pytest.raises(ValueError, match=rf"^{name}: {NO_MEMORY}"):
        call(_zero(good.shape, good.dtype))


def test_a_negative_output_is_not_written():
    x = torch.randn(4, 64)
    buf = torch.randn(4, 64)
    before = buf.clone()
    out = torch._neg_view(buf)
    with pytest.raises(TypeError, match=rf"^out: {NEG}"):
        fp8.e4m3_decode(fp8.e4m3_encode(x), out=out)
    assert torch.equal(buf, before)


def test_the_gemm_fast_path_declines_what_the_checked_path_refuses():
    """rawkv.gemm.fast's key holds the negative bit and a zero pointer, so a
    call with such a tensor never reuses a plain tensor's launch."""
    w, x, out = torch.zeros(4, dtype=torch.uint8), torch.randn(8), torch.zeros(8)
    assert fast.key("op", (out, _neg(x)), (w,), ()) != fast.key("op", (out, x), (w,), ())
    assert fast.key("op", (out, _zero((8,))), (w,), ()) != fast.key("op", (out, x), (w,), ())
    assert fast.key("op", (_neg(out), x), (w,), ()) != fast.key("op", (out, x), (w,), ())
    # an empty tensor may have no memory: nothing to address, no other key
    assert fast.key("op", (out, _zero((0,))), (w,), ()) == fast.key("op", (out, torch.empty(0)), (w,), ())


def test_the_fp8_fast_key_tells_them_apart():
    x, out = torch.randn(8), torch.zeros(8, dtype=torch.uint8)
    plain = fp8._fast_key(x, out, 8, x.data_ptr(), out.data_ptr())
    assert fp8._fast_key(_neg(x), out, 8, x.data_ptr(), out.data_ptr()) != plain
    z = _zero((8,))
    assert fp8._fast_key(z, out, 8, z.data_ptr(), out.data_ptr()) != plain


@pytest.mark.parametrize("i", CASES)
def test_both_are_refused_by_name_on_cuda(cuda, i):
    name, good, call = _calls("cuda")[i]
    with pytest.raises(TypeError, match=rf"^{name}: {NEG}"):
        call(_neg(good))
    with pytest.raises(ValueError, match=rf"^{name}: {NO_MEMORY}"):
        call(_zero(good.shape, good.dtype, "cuda"))


def test_the_fp8_fast_path_sends_them_to_the_checked_path(cuda):
    x = torch.randn(4, 64, device="cuda")
    out = torch.empty(4, 64, dtype=torch.uint8, device="cuda")
    fp8.e4m3_encode(x, out=out)                  # the checked path remembers the combination
    fp8.e4m3_encode(x, out=out)                  # (the fast path)
    with pytest.raises(TypeError, match=rf"^x: {NEG}"):
        fp8.e4m3_encode(_neg(x), out=out)
    with pytest.raises(ValueError, match=rf"^x: {NO_MEMORY}"):
        fp8.e4m3_encode(_zero((4, 64), device="cuda"), out=out)
    torch.cuda.synchronize()


def test_the_gemm_fast_path_sends_them_to_the_checked_path(cuda):
    w = rawkv.gemm.Fp4Weight.from_float(torch.linspace(-1, 1, 2 * 32 * 64).reshape(2, 32, 64).cuda())
    x = torch.randn(3, 2, 64, device="cuda").bfloat16()
    out = torch.empty(3, 2, 32, device="cuda", dtype=torch.bfloat16)
    rawkv.gemm.grouped_linear(x, w, out=out)
    rawkv.gemm.grouped_linear(x, w, out=out)      # (the fast path)
    with pytest.raises(TypeError, match=rf"^x: {NEG}"):
        rawkv.gemm.grouped_linear(_neg(x), w, out=out)
    with pytest.raises(ValueError, match=rf"^x: {NO_MEMORY}"):
        rawkv.gemm.grouped_linear(_zero((3, 2, 64), torch.bfloat16, "cuda"), w, out=out)
    torch.cuda.synchronize()
