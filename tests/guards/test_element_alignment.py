"""Arguments a kernel loads, stores or atomically adds to element by element
(a float32 gs or scale, an int32 errors counter, int32 / int64 indices, an
FP8 encode's float input or decode's float output) must start aligned to
their own element size: a misaligned 4- or 8-byte access is a 'misaligned
address' fault on the GPU (a sticky error: the process's CUDA context is
lost), where numpy on the host reads it. Such a tensor comes from a DLPack
array (CuPy, numpy) or torch.frombuffer at an odd byte offset; torch's own
views never make one. Every NVFP4 / FP8 op refuses it by name, on CPU as on
CUDA, before anything is launched or written. (Found by a review: the rules
checked the 16-byte alignment of the vector-loaded buffers only, so a
misaligned gs, errors, indices, FP8 scales or e4m3 x / out was taken on CPU
and launched on CUDA.)"""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
from rawkv import fp8, nvfp4  # noqa: E402
from rawkv.nvfp4 import activation, decode, encode, scales  # noqa: E402
from support.fake_cuda import fake, install  # noqa: E402
from support.views import off_element  # noqa: E402

MSG = r"data must be \d-byte aligned"
U8, I32 = torch.uint8, torch.int32


def _q_sf():
    q, sf, _ = nvfp4.quantize(torch.linspace(-3, 3, 128).reshape(4, 32))
    return q.view(U8), sf.view(U8)


def _calls(move):
    """(argument name, a good value of it, the op's call with it replaced,
    the buffers the call would write), every tensor seen through `move`
    (CPU: as it is; CUDA: fake_cuda.fake)."""
    x, gs, q, sf = move(torch.randn(4, 32)), move(torch.tensor([0.5])), *map(move, _q_sf())
    out, ok_idx = move(torch.zeros(4, 32)), move(torch.tensor([1, 2]))
    codes, y = move(torch.zeros(4, 128, dtype=U8)), move(torch.zeros(4, 128))
    c8, o8 = move(torch.zeros(4, 8, dtype=U8)), move(torch.zeros(4, 8, dtype=U8))
    e = move(torch.zeros(1, dtype=I32))
    return [
        ("gs", torch.tensor([0.5]), lambda bad: nvfp4.quantize(x, scope="given", gs=bad), ()),
        ("out[2]", torch.zeros(()), lambda bad: nvfp4.quantize(x, out=(None, None, bad)), ()),
        ("errors", torch.zeros(1, dtype=I32), lambda bad: nvfp4.quantize(x, scope="given", gs=gs, errors=bad), ()),
        ("out", torch.zeros(()), lambda bad: nvfp4.global_scale(x, out=bad), ()),
        ("gs", torch.ones(4), lambda bad: nvfp4.dequantize(q, sf, bad, out=out), (out,)),
        ("gs", torch.tensor([0.5]), lambda bad: nvfp4.gather(q, sf, bad, ok_idx, out=out[:2]), (out,)),
        ("indices", torch.tensor([1, 2], dtype=I32), lambda bad: nvfp4.gather(q, sf, 0.5, bad, out=out[:2]), (out,)),
        ("indices", torch.tensor([1, 2]), lambda bad: nvfp4.gather(q, sf, 0.5, bad, out=out[:2]), (out,)),
        ("errors", torch.zeros(1, dtype=I32),
         lambda bad: nvfp4.gather(q, sf, 0.5, ok_idx, out=out[:2], errors=bad), (out,)),
        ("errors", torch.zeros(1, dtype=I32), lambda bad: nvfp4.gather(q, sf, 0.5, ok_idx.neg(), errors=bad), (e,)),
        ("x", torch.randn(4, 8), lambda bad: fp8.e4m3_encode(bad, out=o8), (o8,)),
        ("x", torch.randn(4, 8).bfloat16(), lambda bad: fp8.e4m3_encode(bad, out=o8), (o8,)),
        ("out", torch.zeros(4, 8), lambda bad: fp8.e4m3_decode(c8, out=bad), ()),
        ("scales", torch.zeros(4, 1), lambda bad: fp8.quantize_blocks(y, out=(codes, bad)), (codes,)),
        ("scales", torch.ones(4, 1), lambda bad: fp8.dequantize_blocks(codes, bad, out=y), (y,)),
    ]


CASES = range(len(_calls(lambda t: t)))


def _check(i, move):
    name, good, call, written = _calls(move)[i]
    bad = move(off_element(good))
    before = [t.clone() for t in (bad, *written)]
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: {MSG}"):
        call(bad)
    assert all(torch.equal(a, b) for a, b in zip((bad, *written), before))


@pytest.mark.parametrize("i", CASES)
def test_an_element_misaligned_argument_is_refused_on_cpu(i):
    _check(i, lambda t: t)


@pytest.mark.parametrize("i", CASES)
def test_an_element_misaligned_argument_is_refused_on_cuda_before_a_launch(monkeypatch, i):
    rt = install(monkeypatch, (fp8, encode, activation, decode, scales))
    monkeypatch.setattr(fp8, "_ENCODE_FAST", {})
    monkeypatch.setattr(fp8, "_DECODE_FAST", {})
    _check(i, fake)
    assert not rt.calls


def test_the_fp8_fast_key_tells_an_element_misaligned_tensor_apart():
    """The fast path reuses a launch the checked path made for a call whose
    key is the same: a 4-byte aligned x that is not 16-byte aligned has the
    key an element-misaligned one would, unless the key tells them apart."""
    x, out = torch.randn(2, 8), torch.zeros(2, 8, dtype=U8)
    four = torch.randn(20)[1:17].view(2, 8)             # 4-byte aligned, not 16
    bad = off_element(x)
    assert four.data_ptr() % 16 and not four.data_ptr() % 4
    assert fp8._fast_key(bad, out, 16, bad.data_ptr(), out.data_ptr()) != \
        fp8._fast_key(four, out, 16, four.data_ptr(), out.data_ptr())
    codes, ybad = torch.zeros(2, 8, dtype=U8), off_element(torch.zeros(2, 8))
    assert fp8._fast_key(codes, ybad, 16, codes.data_ptr(), ybad.data_ptr(), "float32") != \
        fp8._fast_key(codes, four, 16, codes.data_ptr(), four.data_ptr(), "float32")
