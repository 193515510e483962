"""rawkv.fused accepts and refuses the same arguments on CPU and on CUDA.
Every case runs on torch CPU tensors (the reference path) and, where a GPU
exists, on CUDA tensors: a refused case raises the same exception type with
the same argument named first; an accepted one returns the same bits. Then the
family's argument rules held for every op at once on the CPU, and on CUDA
refused arguments write nothing."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv import fused as F  # noqa: E402
from support.dlpack import Bare, NoDtype  # noqa: E402
from support.fused import _names  # noqa: E402


# ---- argument errors --------------------------------------------------------------------------------
U8, F32, BF16 = torch.uint8, torch.float32, torch.bfloat16


class Args:
    """The inputs of every case, on one device. Values are small integers
    (and their halves), so every sum of squares is exact in any order and
    the CUDA RMSNorm gives the reference's bits."""

    def __init__(self, dev):
        g = torch.Generator().manual_seed(7)

        def ints(*shape, dtype=BF16, lo=-4, hi=5):
            return torch.randint(lo, hi, shape, generator=g).to(dtype).to(dev)

        self.dev = dev
        self.x = ints(4, 64)
        self.w = ints(64, dtype=F32, lo=1, hi=3) / 2
        self.X = ints(4, 2, 64)
        self.mix = ints(4, 2, dtype=F32, lo=1, hi=3) / 2
        self.h = ints(4, 128)
        self.hid = ints(2, 128)
        self.ids = ints(2, 4, dtype=torch.int32, lo=0, hi=64)
        self.wts = ints(2, 4, dtype=F32, lo=0, hi=4) / 4

    def t(self, *shape, dtype=F32, fill=0.0):
        return torch.full(shape, fill, dtype=dtype, device=self.dev)

    def t8(self, *shape, dtype=U8):
        return torch.zeros(shape, dtype=U8, device=self.dev).view(dtype)


_rms, _mhc, _sw, _moe = F.rmsnorm_quantize, F.mhc_rmsnorm_quantize, F.swiglu_quantize, F.moe_stage

# (id, exception, argument named first, call)
REFUSED = [
    # dtypes of inputs, float64 included
    ("x-float64", TypeError, "x", lambda a: _rms(a.x.double(), a.w)),
    ("x-int32", TypeError, "x", lambda a: _rms(a.x.int(), a.w)),
    ("weight-float64", TypeError, "weight", lambda a: _rms(a.x, a.w.double())),
    ("weight-int32", TypeError, "weight", lambda a: _rms(a.x, a.w.int())),
    ("mix-float64", TypeError, "mix", lambda a: _mhc(a.X, a.mix.double(), a.w)),
    ("mix-int64", TypeError, "mix", lambda a: _mhc(a.X, a.mix.long(), a.w)),
    ("h-float64", TypeError, "h", lambda a: _sw(a.h.double())),
    ("hidden-float64", TypeError, "hidden", lambda a: _moe(a.hid.double(), a.ids, a.wts)),
    ("topk_ids-uint8", TypeError, "topk_ids", lambda a: _moe(a.hid, a.ids.to(U8), a.wts)),
    ("topk_ids-float32", TypeError, "topk_ids", lambda a: _moe(a.hid, a.ids.float(), a.wts)),
    ("topk_weights-float64", TypeError, "topk_weights", lambda a: _moe(a.hid, a.ids, a.wts.double())),
    ("topk_weights-int32", TypeError, "topk_weights", lambda a: _moe(a.hid, a.ids, a.wts.int())),
    # eps: a finite number > 0 as a float32 (0 gives NaN scales on an all-zero row)
    *[(f"eps-{v!r}", ValueError, "eps", lambda a, v=v: _rms(a.x, a.w, eps=v))
      for v in (0.0, 0, -0.0, -1e-6, float("nan"), float("inf"), 1e39, 1e-50, None, "1e-6", np.float32(0.0))],
    # a bool: a TypeError (A.refuse_bool, torch.ops.rawkv.*'s `Scalar eps` too)
    *[(f"eps-{v!r}", TypeError, "eps", lambda a, v=v: _rms(a.x, a.w, eps=v)) for v in (True, False, np.True_)],
    ("eps-0-mhc", ValueError, "eps", lambda a: _mhc(a.X, a.mix, a.w, eps=0.0)),
    ("eps-tensor", ValueError, "eps", lambda a: _rms(a.x, a.w, eps=a.t(1, fill=1e-6))),
    # a number gs: finite and > 0 as a float32, not a bool
    *[(f"gs-{v!r}", ValueError, "gs", lambda a, v=v: _rms(a.x, a.w, gs=v))
      for v in (0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-50, np.float32(-2.0))],
    ("gs-True", TypeError, "gs", lambda a: _sw(a.h, gs=True)),
    ("gs-str", TypeError, "gs", lambda a: _sw(a.h, gs="0.5")),
    ("gs-list", TypeError, "gs", lambda a: _sw(a.h, gs=[0.5])),
    # a tensor gs: 1 element, float32
    ("gs-tensor-float64", TypeError, "gs", lambda a: _sw(a.h, gs=a.t(1, dtype=torch.float64, fill=0.5))),
    ("gs-tensor-bfloat16", TypeError, "gs", lambda a: _rms(a.x, a.w, gs=a.t(1, dtype=BF16, fill=0.5))),
    ("gs-tensor-2", ValueError, "gs", lambda a: _sw(a.h, gs=a.t(2, fill=0.5))),
    # scope
    ("scope-unknown", ValueError, "scope", lambda a: _rms(a.x, a.w, scope="blocks")),
    ("scope-given-no-gs", ValueError, "gs", lambda a: _sw(a.h, scope="given")),
    ("scope-row-with-gs", ValueError, "gs", lambda a: _sw(a.h, scope="row", gs=0.5)),
    # out=: the dtypes the op returns (never a cast), shapes, entries
    ("out-tensor", TypeError, "out", lambda a: _rms(a.x, a.w, out=a.t8(4, 32))),
    ("out-2", TypeError, "out", lambda a: _rms(a.x, a.w, out=(a.t8(4, 32), a.t8(4, 4)))),
    ("out.q-int8", TypeError, "out.q", lambda a: _rms(a.x, a.w, out=(a.t(4, 32, dtype=torch.int8), None, None))),
    ("out.q-shape", ValueError, "out.q", lambda a: _rms(a.x, a.w, out=(a.t8(4, 16), None, None))),
    ("out.sf-float32", TypeError, "out.sf", lambda a: _rms(a.x, a.w, out=(None, a.t(4, 4), None))),
    ("out.sf-shape", ValueError, "out.sf", lambda a: _sw(a.h, out=(None, a.t8(4, 5), None))),
    ("out.gs-float64", TypeError, "out.gs", lambda a: _rms(a.x, a.w, out=(None, None, a.t(4, dtype=torch.float64)))),
    ("out.gs-shape-row", ValueError, "out.gs", lambda a: _rms(a.x, a.w, out=(None, None, a.t(3)))),
    ("out.gs-shape-tensor", ValueError, "out.gs", lambda a: _sw(a.h, scope="tensor", out=(None, None, a.t(4)))),
    ("out.inv_rms-float16", TypeError, "out.inv_rms",
     lambda a: _rms(a.x, a.w, out=(None, None, None, a.t(4, dtype=torch.float16)))),
    ("out.inv_rms-shape", ValueError, "out.inv_rms", lambda a: _mhc(a.X, a.mix, a.w, out=(None, None, None, a.t(2)))),
    ("out.inv_rms-swiglu", ValueError, "out.inv_rms", lambda a: _sw(a.h, out=(None, None, None, a.t(4)))),
    ("moe-out-3", TypeError, "out", lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, None))),
    ("moe-out.q-shape", ValueError, "out.q", lambda a: _moe(a.hid, a.ids, a.wts, out=(a.t8(2, 32), None, None, None))),
    ("moe-out.sf-uint8", TypeError, "out.sf", lambda a: _moe(a.hid, a.ids, a.wts, out=(None, a.t8(2, 8), None, None))),
    ("moe-out.topk_ids-int32", TypeError, "out.topk_ids",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, a.t(2, 4, dtype=torch.int32), None))),
    ("moe-out.topk_weights-float16", TypeError, "out.topk_weights",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, None, a.t(2, 4, dtype=torch.float16)))),
    ("moe-out.topk_weights-shape", ValueError, "out.topk_weights",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, None, a.t(2, 3)))),
    # numbers and None where a tensor belongs
    ("x-None", TypeError, "x", lambda a: _rms(None, a.w)),
    ("x-number", TypeError, "x", lambda a: _rms(1.5, a.w)),
    ("weight-None", TypeError, "weight", lambda a: _rms(a.x, None)),
    ("mix-number", TypeError, "mix", lambda a: _mhc(a.X, 0.5, a.w)),
    ("h-None", TypeError, "h", lambda a: _sw(None)),
    ("hidden-number", TypeError, "hidden", lambda a: _moe(3, a.ids, a.wts)),
    ("topk_ids-None", TypeError, "topk_ids", lambda a: _moe(a.hid, None, a.wts)),
    ("topk_weights-number", TypeError, "topk_weights", lambda a: _moe(a.hid, a.ids, 1.0)),
    ("out.q-number", TypeError, "out.q", lambda a: _rms(a.x, a.w, out=(1.0, None, None))),
    ("out.gs-number", TypeError, "out.gs", lambda a: _sw(a.h, out=(None, None, 2))),
    ("moe-out.topk_ids-number", TypeError, "out.topk_ids", lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, 0, None))),
    # shapes
    ("x-0d", ValueError, "x", lambda a: _rms(a.x[0, 0], a.w)),
    ("x-N24", ValueError, "x", lambda a: _rms(a.x[:, :24], a.w[:24])),
    ("x-N0", ValueError, "x", lambda a: _rms(a.x[:, :0], a.w[:0])),
    ("weight-shape", ValueError, "weight", lambda a: _rms(a.x, a.w[:32])),
    ("x-n_hc-5", ValueError, "x", lambda a: _mhc(a.x.view(4, 1, 64).expand(4, 5, 64).contiguous(), a.t(4, 5), a.w)),
    ("mix-shape", ValueError, "mix", lambda a: _mhc(a.X, a.mix[:, :1], a.w)),
    ("h-odd", ValueError, "h", lambda a: _sw(a.h[:, :33])),
    ("h-I-not-16", ValueError, "h", lambda a: _sw(a.h[:, :40])),
    ("granularity-3", ValueError, "granularity", lambda a: _sw(a.h, 3)),
    ("granularity-0", ValueError, "granularity", lambda a: _sw(a.h, 0)),
    ("granularity-bool", TypeError, "granularity", lambda a: _sw(a.h, True)),
    ("hidden-K192", ValueError, "hidden", lambda a: _moe(a.t(2, 192, dtype=BF16), a.ids, a.wts)),
    ("hidden-3d", ValueError, "hidden", lambda a: _moe(a.hid.view(2, 1, 128), a.ids, a.wts)),
    ("topk_ids-rows", ValueError, "topk_ids", lambda a: _moe(a.hid, a.ids[:1], a.wts[:1])),
    ("topk_weights-shape", ValueError, "topk_weights", lambda a: _moe(a.hid, a.ids, a.wts[:, :3])),
    # out= parts in one another's memory or in an input's (issue 21, item 7): out=(None, None, g, g)
    # returned inv_rms as gs
    ("out.gs-is-out.inv_rms", ValueError, "out.inv_rms", lambda a: _twice(a.t(4), lambda g: _rms(a.x, a.w, out=(None, None, g, g)))),
    ("out.sf-overlaps-out.q", ValueError, "out.sf", lambda a: _twice(a.t8(4 * 32 + 8), lambda b: _rms(
        a.x, a.w, out=(b[:128].view(4, 32), b[120:136].view(4, 4), None)))),
    ("out.inv_rms-in-x", ValueError, "out.inv_rms", lambda a: _rms(a.x, a.w, out=(None, None, None, a.x.view(F32)[0, :4]))),
    ("out.q-in-h", ValueError, "out.q", lambda a: _sw(a.h, out=(a.h.view(U8).reshape(-1)[:128].view(4, 32), None, None))),
    ("out.gs-is-gs", ValueError, "out.gs", lambda a: _twice(a.t(1, fill=0.5), lambda g: _sw(a.h, gs=g, out=(None, None, g)))),
    ("moe-out.topk_weights-is-input", ValueError, "out.topk_weights",
     lambda a: _moe(a.hid, a.ids, a.wts, out=(None, None, None, a.wts))),
    ("moe-out.topk_ids-is-out.topk_weights", ValueError, "out.topk_weights", lambda a: _twice(
        a.t(2, 4, dtype=torch.int64), lambda b: _moe(a.hid, a.ids, a.wts, out=(None, None, b, b.view(F32)[:, :4])))),
]


FP4 = getattr(torch, "float4_e2m1fn_x2", None)
FP8 = getattr(torch, "float8_e4m3fn", None)


if FP8 is not None:
    REFUSED += [("out.q-float8", TypeError, "out.q", lambda a: _rms(a.x, a.w, out=(a.t8(4, 32, dtype=FP8), None, None))),
                ("out.sf-float4", TypeError, "out.sf", lambda a: _rms(a.x, a.w, out=(None, a.t8(4, 4, dtype=FP4), None)))]


# "cuda" takes the fixture only when it runs (getfixturevalue), so it is marked by hand.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(request, dev):
    if dev == "cuda":
        request.getfixturevalue("cuda")       # skips without a GPU
    return dev


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_alike(request, dev, case):
    _, exc, arg, call = case
    a = Args(_device(request, dev))
    with pytest.raises(Exception) as ei:
        call(a)
    assert type(ei.value) is exc and _names(str(ei.value), arg), (type(ei.value).__name__, str(ei.value))


def _twice(buf, call):
    """call(buf): a case that passes one buffer as two arguments."""
    return call(buf)


# (id, variant, canonical): the variant gives the canonical form's bits
ACCEPTED = [
    ("gs-np.float32", lambda a: _sw(a.h, gs=np.float32(0.5)), lambda a: _sw(a.h, gs=0.5)),
    ("gs-np.float64", lambda a: _rms(a.x, a.w, gs=np.float64(0.5)), lambda a: _rms(a.x, a.w, gs=0.5)),
    ("gs-int", lambda a: _sw(a.h, gs=1), lambda a: _sw(a.h, scope="given", gs=1.0)),
    ("gs-tensor-0d", lambda a: _sw(a.h, gs=a.t(fill=0.5)), lambda a: _sw(a.h, gs=0.5)),
    ("gs-tensor-1", lambda a: _mhc(a.X, a.mix, a.w, gs=a.t(1, fill=0.5)), lambda a: _mhc(a.X, a.mix, a.w, gs=0.5)),
    ("eps-np.float32", lambda a: _rms(a.x, a.w, eps=np.float32(1e-6)),
     lambda a: _rms(a.x, a.w, eps=float(np.float32(1e-6)))),
    ("eps-int", lambda a: _rms(a.x, a.w, eps=1), lambda a: _rms(a.x, a.w, eps=1.0)),
    ("scope-none", lambda a: _sw(a.h, scope="none"), lambda a: _sw(a.h, gs=1.0)),
    ("out-list", lambda a: _rms(a.x, a.w, out=[None, None, None]), lambda a: _rms(a.x, a.w)),
    ("out-activation", lambda a: _sw(a.h, out=F.QuantizedActivation(None, None, None)), lambda a: _sw(a.h)),
    ("out.gs-(1,)", lambda a: _sw(a.h, scope="tensor", out=(None, None, a.t(1))),
     lambda a: (lambda r: r._replace(gs=r.gs.reshape(1)))(_sw(a.h, scope="tensor"))),
    ("out.q-uint8", lambda a: _rms(a.x, a.w, out=(a.t8(4, 32), a.t8(4, 4), None, None)), lambda a: _rms(a.x, a.w)),
    ("granularity-np.int64", lambda a: _sw(a.h, np.int64(4)), lambda a: _sw(a.h, 4)),
    ("mix-bfloat16", lambda a: _mhc(a.X, a.mix.to(BF16), a.w), lambda a: _mhc(a.X, a.mix, a.w)),
    ("weight-float16", lambda a: _rms(a.x, a.w.half()), lambda a: _rms(a.x, a.w)),
    ("moe-ids-int64", lambda a: _moe(a.hid, a.ids.long(), a.wts), lambda a: _moe(a.hid, a.ids, a.wts)),
    ("out-parts-of-one-buffer", lambda a: _twice(a.t8(4 * 32 + 4 * 4), lambda b: _rms(
        a.x, a.w, out=(b[:128].view(4, 32), b[128:].view(4, 4), None))), lambda a: _rms(a.x, a.w)),
    ("moe-out", lambda a: _moe(a.hid, a.ids, a.wts, out=(a.t8(2, 64), a.t(2, 2, dtype=torch.int32),
                                                           a.t(2, 4, dtype=torch.int64), a.t(2, 4))),
     lambda a: _moe(a.hid, a.ids, a.wts)),
]


def _bits(result):
    """Each entry of a result tuple as numpy bytes (None kept)."""
    out = []
    for t in result:
        if t is None:
            out.append(None)
            continue
        t = t.detach().cpu().contiguous()
        out.append((tuple(t.shape), t.reshape(-1).view(U8).numpy().copy() if t.numel() else b""))
    return out


def _same(got, want) -> bool:
    return len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and g[0] == w[0] and np.array_equal(g[1], w[1]))
        for g, w in zip(got, want))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_alike(request, dev, case):
    _, variant, canonical = case
    a = Args(_device(request, dev))
    got = _bits(variant(a))
    assert _same(got, _bits(canonical(a)))
    if dev == "cuda":            # and the same bits as the CPU reference
        assert _same(got, _bits(variant(Args("cpu"))))


def _sentinel_out(lead, n, per_row=True):
    return (torch.full((*lead, n // 2), 0xAB, dtype=torch.uint8, device="cuda"),
            torch.full((*lead, n // 16), 0xAB, dtype=torch.uint8, device="cuda"),
            torch.full(lead if per_row else (), 7.0, device="cuda"),
            torch.full(lead, 7.0, device="cuda"))


def _untouched(out):
    return all(bool(((t.view(torch.uint8) == 0xAB) if t.dtype == torch.uint8 else (t == 7.0)).all())
               for t in out if t is not None)


def test_cuda_argument_errors_write_nothing(cuda):
    x = torch.randn(4, 64, device="cuda").bfloat16()
    w = torch.ones(64, device="cuda")
    cases = [
        ("x", lambda o: F.rmsnorm_quantize(x.float(), w, out=o)),                       # dtype
        ("x", lambda o: F.rmsnorm_quantize(torch.randn(64, 4, device="cuda").bfloat16().t(), w, out=o)),
        ("x", lambda o: F.rmsnorm_quantize(torch.randn(4 * 64 + 1, device="cuda").bfloat16()[1:].view(4, 64),
                                           w, out=o)),                                  # misaligned
        ("weight", lambda o: F.rmsnorm_quantize(x, torch.ones(64, dtype=torch.int32, device="cuda"), out=o)),
        ("weight", lambda o: F.rmsnorm_quantize(x, torch.ones(64), out=o)),              # device
        ("weight", lambda o: F.rmsnorm_quantize(x, torch.ones(128, device="cuda")[::2], out=o)),
        ("gs", lambda o: F.rmsnorm_quantize(x, w, gs=torch.ones(1, dtype=torch.float64, device="cuda"),
                                            out=(o[0], o[1], torch.full((), 7.0, device="cuda"), o[3]))),
        ("out.q", lambda o: F.rmsnorm_quantize(x, w, out=(o[0][:, :16], o[1], o[2], o[3]))),
        ("out.sf", lambda o: F.rmsnorm_quantize(x, w, out=(o[0], o[1].float(), o[2], o[3]))),
        ("out.gs", lambda o: F.rmsnorm_quantize(x, w, scope="tensor", out=o)),          # (4,) for a scalar
        ("out.inv_rms", lambda o: F.rmsnorm_quantize(x, w, out=(o[0], o[1], o[2], o[3][:2]))),
        ("mix", lambda o: F.mhc_rmsnorm_quantize(x.view(4, 1, 64), torch.ones(4, 1, dtype=torch.int64,
                                                 device="cuda"), w, out=o)),
        ("h", lambda o: F.swiglu_quantize(torch.randn(4, 128, device="cuda"), out=o[:3])),
        ("x", lambda o: F.rmsnorm_quantize(x[:, :0], w[:0], out=o)),                  # N == 0
        ("x", lambda o: F.mhc_rmsnorm_quantize(x[:, None, :0], torch.ones(4, 1, device="cuda"), w[:0], out=o)),
        ("h", lambda o: F.swiglu_quantize(x[:, :0], out=o[:3])),
        ("gs", lambda o: F.rmsnorm_quantize(x, w, gs=-1.0, out=(o[0], o[1], torch.full((), 7.0, device="cuda"),
                                                               o[3]))),
        ("gs", lambda o: F.swiglu_quantize(x, gs=float("nan"), out=(o[0][:, :16], o[1][:, :2],
                                                                    torch.full((), 7.0, device="cuda")))),
        ("gs", lambda o: F.swiglu_quantize(x, gs=True, out=(o[0][:, :16], o[1][:, :2],
                                                            torch.full((), 7.0, device="cuda")))),
        ("out.inv_rms", lambda o: F.swiglu_quantize(torch.randn(4, 128, device="cuda").bfloat16(), out=o)),
        ("eps", lambda o: F.rmsnorm_quantize(x, w, eps=0.0, out=o)),          # NaN scales on a zero row
        ("eps", lambda o: F.mhc_rmsnorm_quantize(x.view(4, 1, 64), torch.ones(4, 1, device="cuda"), w, eps=0,
                                                 out=o)),
        ("eps", lambda o: F.rmsnorm_quantize(x, w, eps=float("nan"), out=o)),
        ("eps", lambda o: F.rmsnorm_quantize(x, w, eps=True, out=o)),
        ("weight", lambda o: F.rmsnorm_quantize(x, None, out=o)),
        ("x", lambda o: F.rmsnorm_quantize(1.5, w, out=o)),
        ("out.gs", lambda o: F.rmsnorm_quantize(x, w, out=(o[0], o[1], 7.0, o[3]))),
    ]
    for name, call in cases:
        out = _sentinel_out((4,), 64)
        with pytest.raises((ValueError, TypeError)) as ei:
            call(out)
        assert re.match(rf"{re.escape(name)}[:\s(]", str(ei.value)), (name, str(ei.value))
        torch.cuda.synchronize()
        assert _untouched(out), name


def test_inputs_the_rules_refuse_are_named_before_the_outputs_are_sized():
    """Each producer sized its new outputs from its input before the rules
    had checked it: a stride-0 view of 2^34 rows, or a 1-D hidden of 2^20
    (q of 2^20 x 2^19 bytes), allocated terabytes before it was named; a
    numpy string topk_weights failed in torch (rawkv._args.out_lead,
    moe._sizes)."""
    def big(*row, dtype=BF16):
        return torch.zeros(1, *row, dtype=dtype).expand(2 ** 34, *row)
    w, ids, wts = torch.ones(64), torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    hid, mix = torch.zeros(4, 128, dtype=BF16), big(2, dtype=F32)
    strs = np.array([["a", "b"]] * 4)
    cases = [
        ("x", lambda: F.rmsnorm_quantize(big(64), w)),
        ("x", lambda: F.rmsnorm_quantize(np.broadcast_to(np.zeros((1, 64), np.float32), (2 ** 34, 64)), w.numpy())),
        ("x", lambda: F.mhc_rmsnorm_quantize(big(2, 64), mix, w)),
        ("x", lambda: F.rmsnorm_quantize_fp8(big(64), w)),
        ("x", lambda: F.mhc_rmsnorm_quantize_fp8(big(2, 64), mix, w)),
        ("h", lambda: F.swiglu_quantize(big(64))),
        ("h", lambda: F.swiglu_quantize_fp8(big(64))),
        ("hidden", lambda: F.moe_stage(big(128), ids, wts)),
        ("hidden", lambda: F.moe_stage(torch.zeros(2 ** 20, dtype=BF16), ids, wts)),
        ("hidden", lambda: F.moe_stage_fp8(big(128), ids, wts)),
        ("topk_ids", lambda: F.moe_stage(hid, big(2, dtype=torch.int32), wts)),
        ("topk_ids", lambda: F.moe_stage_fp8(hid, big(2, dtype=torch.int32), wts)),
        ("topk_weights", lambda: F.moe_stage(hid, ids, strs)),
        ("topk_weights", lambda: F.moe_stage_fp8(hid, ids, strs)),
    ]
    for name, call in cases:
        with pytest.raises((ValueError, TypeError)) as ei:
            call()
        assert _names(str(ei.value), name), (name, str(ei.value))




def test_a_dlpack_input_without_shape_or_dtype_is_read_as_its_tensor():
    """The DLPack protocol promises no .shape or .dtype: moe_stage sized no
    copy of a topk_weights without .dtype and returned topk_weights None,
    and an input without .shape sized outputs of no rows (the reference
    failed writing them; on CUDA, where the op trusts outputs it has just
    sized, the kernel would write past them). Each is sized from the view
    the rules read (rawkv._args.as_read) and gives the tensor's bits."""
    a = Args("cpu")
    moe8 = F.moe_stage_fp8
    for got, want in [
            (_moe(a.hid, a.ids, NoDtype(a.wts)), _moe(a.hid, a.ids, a.wts)),
            (_moe(a.hid, a.ids, Bare(a.wts)), _moe(a.hid, a.ids, a.wts)),
            (_moe(Bare(a.hid), Bare(a.ids), a.wts), _moe(a.hid, a.ids, a.wts)),
            (moe8(a.hid, a.ids, NoDtype(a.wts)), moe8(a.hid, a.ids, a.wts)),
            (moe8(Bare(a.hid), Bare(a.ids), a.wts), moe8(a.hid, a.ids, a.wts)),
            (_rms(Bare(a.x), a.w), _rms(a.x, a.w)),
            (_mhc(Bare(a.X), a.mix, a.w), _mhc(a.X, a.mix, a.w)),
            (F.rmsnorm_quantize_fp8(Bare(a.x), a.w), F.rmsnorm_quantize_fp8(a.x, a.w)),
            (_sw(Bare(a.h)), _sw(a.h)),
            (F.swiglu_quantize_fp8(Bare(a.h)), F.swiglu_quantize_fp8(a.h))]:
        assert got[-1] is not None or want[-1] is None
        # (a host DLPack input gets numpy outputs: BF16 as float32)
        got = [None if t is None else torch.as_tensor(t).to(w.dtype) if w.element_size() > 1 else
               torch.as_tensor(t).view(w.dtype) for t, w in zip(got, want)]
        assert _same(_bits(got), _bits(want))


@pytest.mark.parametrize("n", [0, 2])
def test_a_dlpack_gs_without_shape_of_other_than_one_element_is_named(monkeypatch, n):
    """A given gs is a 1-element tensor; a DLPack gs without .shape slipped
    past that check (check_scope_gs reads .shape): on CPU the reference
    failed with numpy's unnamed 'cannot reshape array of size 2 into shape
    ()', and on CUDA the kernel read the first of 2 floats, or past an
    empty one. Refused on both, naming gs, before anything is launched."""
    from rawkv import _args
    from rawkv.fused import moe, rms, swiglu
    from support.fake_cuda import fake, install

    class OnDevice(Bare):
        """A bare CUDA DLPack producer (wrapped as a fake CUDA tensor)."""
        def __dlpack_device__(self):
            return (2, 0)
    a = Args("cpu")
    g = torch.full((n,), 0.5)
    for call in (lambda: _rms(a.x, a.w, gs=Bare(g)), lambda: _sw(a.h, gs=Bare(g)),
                 lambda: _mhc(a.X, a.mix, a.w, gs=Bare(g))):
        with pytest.raises(ValueError, match=rf"^gs: expected a float or a 1-element tensor, got shape \({n},\)"):
            call()
    rt = install(monkeypatch, (rms, swiglu, moe))
    monkeypatch.setattr(_args, "as_cuda_tensor", lambda x, name: fake(x.a) if isinstance(x, OnDevice) else fake(x))
    x, w, h = fake(a.x), fake(a.w), fake(a.h)
    for call in (lambda: _rms(x, w, gs=OnDevice(g)), lambda: _sw(h, gs=OnDevice(g)),
                 lambda: _mhc(fake(a.X), fake(a.mix), w, gs=OnDevice(g))):
        rt.calls.clear()
        with pytest.raises(ValueError, match=rf"^gs: expected a float or a 1-element tensor, got shape \({n},\)"):
            call()
        assert rt.calls == []
    one = torch.full((1,), 0.5)
    _rms(x, w, gs=OnDevice(one))                # (one element: taken, read on the device)
    assert [c[3]["gs_in"] for c in rt.calls] == [one.data_ptr()]


def test_a_dlpack_out_gs_without_shape_of_one_element_is_taken():
    """For scopes other than 'row' out.gs may have shape () or (1,); the
    shape it was held to was read from out.gs's .shape, which a DLPack array
    need not have, so a bare producer's (1,) buffer was refused ('out.gs:
    expected shape (), got (1,)') where the same memory as a tensor is
    taken. Read from the array the rules wrap (rawkv._args.as_read)."""
    a = Args("cpu")
    for op in (lambda o: _rms(a.x, a.w, scope="tensor", out=o), lambda o: _sw(a.h, scope="none", out=o),
               lambda o: _mhc(a.X, a.mix, a.w, gs=0.5, out=o)):
        for shape in ((1,), ()):
            g, want = torch.zeros(shape), torch.zeros(shape)
            op((None, None, Bare(g)))
            op((None, None, want))
            assert torch.equal(g, want) and float(g) != 0
