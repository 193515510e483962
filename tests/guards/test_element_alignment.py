"""Arguments a kernel loads, stores or atomically adds to element by element
(a float32 gs or scale, an int32 errors counter, int32 / int64 indices, an
FP8 encode's float input or decode's float output) must start aligned to
their own element size: a misaligned 4- or 8-byte access is a 'misaligned
address' fault on the GPU (a sticky error: the process's CUDA context is
lost), where numpy on the host reads it. Such a tensor comes from a DLPack
array (CuPy, numpy) or torch.frombuffer at an odd byte offset; torch's own
views never make one. Every NVFP4 / FP8 op, fused producer and GEMM refuses
it by name, on CPU as on CUDA, before anything is launched or written
(the views the GEMM copies instead stay copied). (Found by a review: the rules
checked the 16-byte alignment of the vector-loaded buffers only, so a
misaligned gs, errors, indices, FP8 scales or e4m3 x / out was taken on CPU
and launched on CUDA.)"""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
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


def _check(calls, i, move):
    """Case i of calls(move): the argument moved off its element's alignment
    is refused by name, nothing written."""
    name, good, call, written = calls(move)[i]
    bad = move(off_element(good))
    before = [t.clone() for t in (bad, *written)]
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: {MSG}"):
        call(bad)
    assert all(torch.equal(a, b) for a, b in zip((bad, *written), before))


@pytest.mark.parametrize("i", CASES)
def test_an_element_misaligned_argument_is_refused_on_cpu(i):
    _check(_calls, i, lambda t: t)


@pytest.mark.parametrize("i", CASES)
def test_an_element_misaligned_argument_is_refused_on_cuda_before_a_launch(monkeypatch, i):
    rt = install(monkeypatch, (fp8, encode, activation, decode, scales))
    monkeypatch.setattr(fp8, "_ENCODE_FAST", {})
    monkeypatch.setattr(fp8, "_DECODE_FAST", {})
    _check(_calls, i, fake)
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


# ---- the fused producers and the GEMMs ------------------------------------------------------------
# (Found by a review: their arguments loaded element by element in place (a
# given gs, mHC's mix, MoE staging's topk_ids; the GEMM's x.gs, weight.gs,
# W4A8 weight.row_scale and float32 x.scales, offsets, out) were still
# taken at an odd byte offset. The views the GEMM rules copy instead, an
# activation's rows and NVFP4 scales, stay copied: test below.)
def _w4a16():
    from support.agreement_cases import weight
    return weight()


def _w4a8():
    import numpy as np
    rng = np.random.default_rng(3)
    codes = torch.from_numpy(rng.integers(0, 256, (2, 16, 32), dtype=np.uint8))
    scales = torch.full((2, 16, 2), 127, dtype=U8)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=2)
    return rawkv.gemm.w4a8_weight(w)


def _gemm_weight(w, move, **bad):
    """w (either form) with its tensors seen through `move`, some replaced."""
    if isinstance(w, rawkv.gemm.W4a8Weight):
        t = {**w._asdict(), **bad}
        return rawkv.gemm.W4a8Weight(w.n, w.k, *(move(t[n]) for n in ("codes", "shifts", "row_scale", "gs")))
    t = {**dict(codes=w.codes, scales=w.scales, gs=w.gs), **bad}
    return rawkv.gemm.Fp4Weight(w.fmt, w.n, w.k, *(move(t[n]) for n in ("codes", "scales", "gs")),
                                exp_range=w.exp_range)


def _more_calls(move):
    """_calls' form, for the fused producers and the GEMMs."""
    from rawkv import fused as F
    bf = torch.bfloat16
    x, w, h = move(torch.randn(4, 64).to(bf)), move(torch.ones(64)), move(torch.randn(4, 128).to(bf))
    X, mix = move(torch.randn(4, 2, 64).to(bf)), move(torch.ones(4, 2))
    hid, wts = move(torch.randn(2, 128).to(bf)), move(torch.ones(2, 4))
    w16, w8 = _w4a16(), _w4a8()
    a16, ww8 = move(torch.randn(5, 3, 64).to(bf)), _gemm_weight(w8, move)
    q, sf, gs = (move(t) for t in nvfp4.quantize(torch.randn(5, 3, 64), scope="row"))
    q, sf = q.view(U8), sf.view(U8)
    c8, s8 = (move(t) for t in fp8.quantize_blocks(torch.randn(6, 2, 64)))
    r8, rs8 = (move(t) for t in fp8.quantize_blocks(torch.randn(6, 64)))
    offs = move(torch.tensor([0, 2, 6], dtype=I32))
    out16, out8, outr = (move(torch.zeros(*s, dtype=bf)) for s in ((5, 3, 24), (6, 2, 16), (6, 16)))
    qa = nvfp4.QuantizedActivation
    gl, ml = rawkv.gemm.grouped_linear, rawkv.gemm.moe_linear
    return [
        ("gs", torch.tensor([0.5]), lambda bad: F.rmsnorm_quantize(x, w, gs=bad), ()),
        ("gs", torch.tensor([0.5]), lambda bad: F.swiglu_quantize(h, gs=bad), ()),
        ("gs", torch.tensor([0.5]), lambda bad: F.mhc_rmsnorm_quantize(X, mix, w, gs=bad), ()),
        ("mix", torch.ones(4, 2), lambda bad: F.mhc_rmsnorm_quantize(X, bad, w), ()),
        ("topk_ids", torch.zeros(2, 4, dtype=I32), lambda bad: F.moe_stage(hid, bad, wts), ()),
        ("topk_ids", torch.zeros(2, 4, dtype=torch.int64), lambda bad: F.moe_stage_fp8(hid, bad, wts), ()),
        ("x.gs", torch.ones(5, 3), lambda bad: gl(qa(q, sf, bad), _gemm_weight(w16, move), out=out16), (out16,)),
        ("x.gs", torch.ones(()), lambda bad: gl(qa(q, sf, bad), _gemm_weight(w16, move), out=out16), (out16,)),
        ("weight.gs", torch.ones(3), lambda bad: gl(a16, _gemm_weight(w16, move, gs=bad), out=out16), (out16,)),
        ("out", torch.zeros(5, 3, 24, dtype=bf), lambda bad: gl(a16, _gemm_weight(w16, move), out=bad), ()),
        ("offsets", torch.tensor([0, 1, 2, 5], dtype=I32),
         lambda bad: ml(a16[:, 0], _gemm_weight(w16, move), bad, out=out16[:, 0]), (out16,)),
        ("weight.gs", torch.ones(2), lambda bad: gl((c8, s8), _gemm_weight(w8, move, gs=bad), out=out8), (out8,)),
        ("weight.row_scale", torch.ones(2, 16),
         lambda bad: gl((c8, s8), _gemm_weight(w8, move, row_scale=bad), out=out8), (out8,)),
        ("x.scales", torch.ones(6, 2, 1), lambda bad: gl((c8, bad), ww8, out=out8), (out8,)),
        ("x.scales", torch.ones(6, 1), lambda bad: ml((r8, bad), ww8, offs, out=outr), (outr,)),
        ("offsets", torch.tensor([0, 2, 6], dtype=I32), lambda bad: ml((r8, rs8), ww8, bad, out=outr), (outr,)),
    ]


MORE = range(len(_more_calls(lambda t: t)))


@pytest.mark.parametrize("i", MORE)
def test_an_element_misaligned_fused_or_gemm_argument_is_refused_on_cpu(i):
    _check(_more_calls, i, lambda t: t)


@pytest.mark.parametrize("i", MORE)
def test_an_element_misaligned_fused_or_gemm_argument_is_refused_on_cuda_before_a_launch(monkeypatch, i):
    from rawkv.fused import moe, rms, swiglu
    from rawkv.gemm import linear, w4a8
    rt = install(monkeypatch, (encode, rms, swiglu, moe, linear, w4a8))
    _check(_more_calls, i, fake)
    assert not rt.calls


def test_the_gemm_still_copies_the_activation_views_it_copies(monkeypatch):
    """An activation whose rows are not aligned (a BF16 x, NVFP4 codes) is
    copied, not refused (docs/gemm.md, "Ops"): an odd-offset one is launched
    from its copy, the element-aligned x.gs beside it read in place."""
    from rawkv.gemm import linear, w4a8
    rt = install(monkeypatch, (encode, linear, w4a8))
    w = _gemm_weight(_w4a16(), fake)
    x = fake(off_element(torch.randn(5, 3, 64).bfloat16()))
    q, sf, gs = (fake(t) for t in nvfp4.quantize(torch.randn(5, 3, 64), scope="row"))
    q = fake(off_element(q.view(U8)))
    for act, codes, xgs in ((x, x, 0), (nvfp4.QuantizedActivation(q, sf.view(U8), gs), q, gs.data_ptr())):
        rt.calls.clear()
        rawkv.gemm.grouped_linear(act, w)
        (args,) = [c[3] for c in rt.calls if c[0] != "memset"]
        assert args["x"] != codes.data_ptr() and args["xgs"] == xgs
