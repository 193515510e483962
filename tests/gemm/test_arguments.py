"""The argument rules grouped_linear and moe_linear share (rawkv/gemm/_rules.py): one
table of refused arguments run on CPU and on CUDA (issue 21 item 5), outputs
refused by name before anything is written (issue 21 items 7, 8), a weight's
tensors checked again when they change, and through the operators."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from support.gemm import check_bad_argument_cases, random_weight, _weight  # noqa: E402
from support.outputs import _refused, _ro  # noqa: E402
from support.views import misaligned  # noqa: E402


def test_bad_out_and_offsets_name_the_argument(rng):
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises(ValueError, match=r"^out"):
        rawkv.gemm.grouped_linear(x, w, out=torch.empty(2, 3, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^offsets"):
        rawkv.gemm.moe_linear(x[:, 0], w, torch.tensor([0, 1, 2], dtype=torch.int32))


# ---------------------------------------------------------------------------
# issue 21 item 5: one set of argument rules on CPU and CUDA
# ---------------------------------------------------------------------------
def test_out_views_whose_rows_are_apart_are_taken(rng):
    # rows apart in any order (a permuted view, a gap between groups) are
    # taken and written as the reference's product (only the refused ones
    # are in the table below)
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    want = rawkv.gemm.grouped_linear(x, w)
    for out in (torch.empty(3, 2, 16, dtype=torch.bfloat16).transpose(0, 1),
                torch.empty(2, 3, 40, dtype=torch.bfloat16)[..., 4:20]):
        got = rawkv.gemm.grouped_linear(x, w, out=out)
        assert got is out and torch.equal(got.view(torch.int16), want.view(torch.int16))


def _one_feature_outs(rng, device):
    # N = 1: torch calls a tensor whose last dimension has size one contiguous
    # whatever its stride there (a transposed (T, 1, G) buffer); the rule
    # took only stride 1. Now taken, and written with the bits of a plain
    # out; a strided last dimension of two features is still refused
    w = _weight(rng, 3, 1, 64).to(device)
    x = torch.randn(2, 3, 64).bfloat16().to(device)
    want = rawkv.gemm.grouped_linear(x, w)
    out = torch.empty(2, 1, 3, dtype=torch.bfloat16, device=device).transpose(1, 2)
    assert out.shape == (2, 3, 1) and out.stride(-1) != 1 and out.is_contiguous()
    got = rawkv.gemm.grouped_linear(x, w, out=out)
    assert got is out and torch.equal(got.view(torch.int16), want.view(torch.int16))
    wm = _weight(rng, 2, 1, 64).to(device)
    offsets = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    want = rawkv.gemm.moe_linear(x[:, 0], wm, offsets)
    out = torch.empty(1, 2, dtype=torch.bfloat16, device=device).t()
    got = rawkv.gemm.moe_linear(x[:, 0], wm, offsets, out=out)
    assert got is out and torch.equal(got.view(torch.int16), want.view(torch.int16))
    w2 = _weight(rng, 3, 2, 64).to(device)
    with pytest.raises(ValueError, match=r"^out: the last dimension must be contiguous"):
        rawkv.gemm.grouped_linear(x, w2, out=torch.empty(2, 3, 4, dtype=torch.bfloat16, device=device)[..., ::2])


def test_an_out_of_one_feature_takes_any_last_stride(rng):
    _one_feature_outs(rng, "cpu")


def test_an_out_of_one_feature_takes_any_last_stride_on_cuda(cuda, rng):
    _one_feature_outs(rng, "cuda")


def test_an_mxfp4_weight_outside_the_scale_window_is_refused_for_every_activation(rng):
    # Fp4Weight.from_mxfp4 refuses scale bytes outside MX_WINDOW; a weight
    # built with the constructor (exp_range unknown) or given a wider span
    # is refused by the ops too, whatever the activations: past the window
    # the kernels' scale factor overflows its exponent field (BF16 too)
    codes = torch.from_numpy(rng.integers(0, 256, (2, 16, 32), dtype=np.uint8))
    scales = torch.full((2, 16, 2), 127, dtype=torch.uint8)
    good = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=2)
    x = torch.randn(3, 2, 64).bfloat16()
    want = rawkv.gemm.grouped_linear(x, good)
    hand = rawkv.gemm.Fp4Weight("mxfp4", 16, 64, good.codes, good.scales, good.gs)
    wide = rawkv.gemm.Fp4Weight("mxfp4", 16, 64, good.codes, good.scales, good.gs, exp_range=(0, 255))
    offs = torch.tensor([0, 1, 3], dtype=torch.int32)
    for w in (hand, wide):
        for call in (lambda: rawkv.gemm.grouped_linear(x, w), lambda: rawkv.gemm.grouped_linear(x.half(), w),
                     lambda: rawkv.gemm.moe_linear(x[:, 0], w, offs)):
            with pytest.raises(ValueError, match=r"^weight: MXFP4 scale bytes must lie in \[4, 137\]"):
                call()
    ok = rawkv.gemm.Fp4Weight("mxfp4", 16, 64, good.codes, good.scales, good.gs, exp_range=good.exp_range)
    assert torch.equal(rawkv.gemm.grouped_linear(x, ok).view(torch.int16), want.view(torch.int16))


def test_bad_arguments_are_refused_by_name_as_on_cuda(rng):
    check_bad_argument_cases(rng, "cpu")


def test_bad_arguments_are_refused_as_on_cpu(cuda, rng):
    # issue 21 item 5: tests/support/gemm.py's table of refused arguments,
    # on CUDA tensors: the same exception and message prefix as on CPU.
    check_bad_argument_cases(rng, "cuda")
    w, _ = random_weight(rng, 3, 16, 64, "nvfp4")
    xm = torch.randn(2, 64, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    for call, msg in ((lambda: rawkv.gemm.moe_linear(xm, w, offs), "offsets: is on cpu"),
                      (lambda: rawkv.gemm.moe_linear(xm, w, offs.cuda(), errors=torch.zeros(1, dtype=torch.int32)),
                       "errors: is on cpu"),
                      (lambda: rawkv.gemm.moe_linear(xm, w, offs.cuda(), out=torch.empty(2, 16, dtype=torch.bfloat16)),
                       "out: is on cpu"),
                      (lambda: rawkv.gemm.moe_linear(xm.cpu().float().numpy(), w, offs.numpy()), "weight: is on cuda")):
        with pytest.raises(ValueError, match="^" + msg):
            call()


# ---------------------------------------------------------------------------
# outputs (issue 21 items 7, 8)
# ---------------------------------------------------------------------------
def test_gemm_refuses_out_over_x_and_errors_over_out():
    torch = pytest.importorskip("torch")
    import rawkv
    w = rawkv.gemm.Fp4Weight.from_float(torch.ones(2, 16, 32))
    buf = torch.zeros(4 * 2 * 32, dtype=torch.bfloat16)
    x = buf.view(4, 2, 32)
    x.fill_(1)
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(x, w, out=buf[:4 * 2 * 16].view(4, 2, 16)))
    assert (x == 1).all()
    x2 = torch.ones(4, 32, dtype=torch.bfloat16)
    out = torch.zeros(4, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    _refused("errors", "out", lambda: rawkv.gemm.moe_linear(x2, w, offsets, out=out,
                                                            errors=out.view(torch.int32)[0, :1]))
    _refused("errors", None, lambda: rawkv.gemm.moe_linear(x2, w, offsets, errors=_ro(np.zeros(1, np.int32))))
    assert not out.any()


# ---------------------------------------------------------------------------
# the weight's tensors
# ---------------------------------------------------------------------------
def test_a_weights_tensors_are_checked_again_when_they_change(rng):
    # rawkv.gemm._rules keeps a weight's check for its next call; another
    # tensor, or the same one moved to other memory (set_), is checked anew
    w = _weight(rng, 2, 16, 64)
    x = torch.randn(3, 2, 64).bfloat16()
    rawkv.gemm.grouped_linear(x, w)
    bad = rawkv.gemm.Fp4Weight(w.fmt, w.n, w.k, w.codes, w.scales, w.gs.double())
    with pytest.raises(TypeError, match=r"^weight.gs: dtype float64"):
        rawkv.gemm.grouped_linear(x, bad)
    w.scales.set_(w.scales.clone()[..., :1])             # the same object, other memory and shape
    with pytest.raises(ValueError, match=r"^weight.scales: expected shape"):
        rawkv.gemm.grouped_linear(x, w)
    # the same memory, another shape (an in-place view change keeps data_ptr)
    w = _weight(rng, 2, 16, 64)
    rawkv.gemm.grouped_linear(x, w)
    w.gs.unsqueeze_(0)
    with pytest.raises(ValueError, match=r"^weight.gs: expected shape"):
        rawkv.gemm.grouped_linear(x, w)


def test_a_weights_tensor_whose_data_is_reassigned_is_checked_again(rng):
    # `t.data = ...` gives the same tensor object another dtype, shape,
    # strides or negative bit at the same address without a new version
    # (torch counts in-place ops, not .data): the remembered check held the
    # weight's old G and took int32 gs, a negated gs and a cut codes tensor
    x = torch.randn(3, 2, 64).bfloat16()
    w = _weight(rng, 2, 16, 64)
    rawkv.gemm.grouped_linear(x, w)
    w.gs.data = w.gs.data.view(torch.int32)
    with pytest.raises(TypeError, match=r"^weight.gs: dtype int32"):
        rawkv.gemm.grouped_linear(x, w)
    w = _weight(rng, 2, 16, 64)
    rawkv.gemm.grouped_linear(x, w)
    w.gs.data = w.gs.data._neg_view()
    with pytest.raises(TypeError, match=r"^weight.gs: has its negative bit set"):
        rawkv.gemm.grouped_linear(x, w)
    w = _weight(rng, 2, 16, 64)
    rawkv.gemm.grouped_linear(x, w)
    w.codes.data = w.codes.data[:1]                       # one group of two, at the same address
    with pytest.raises(ValueError, match=r"^weight.scales: expected shape"):
        rawkv.gemm.grouped_linear(x, w)
    w = _weight(rng, 2, 16, 64)
    rawkv.gemm.grouped_linear(x, w)
    st = w.scales.stride()                                # the same shape, transposed in its last (32, 2)
    w.scales.data = w.scales.data.as_strided(w.scales.shape, (*st[:-2], 1, 32))
    with pytest.raises(ValueError, match=r"^weight.scales: must be contiguous"):
        rawkv.gemm.grouped_linear(x, w)
    # the W4A8 form's memo too
    g, n, k = 2, 24, 160
    w8 = rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(
        torch.full((g, n, k // 2), 0x25, dtype=torch.uint8), torch.full((g, n, k // 32), 127, dtype=torch.uint8),
        groups=g))
    xa = (torch.zeros(3, g, k, dtype=torch.uint8), torch.ones(3, g, 2))
    rawkv.gemm.grouped_linear(xa, w8)
    w8.row_scale.data = w8.row_scale.data.view(torch.int32)
    with pytest.raises(TypeError, match=r"^weight.row_scale: dtype int32"):
        rawkv.gemm.grouped_linear(xa, w8)


def test_a_w4a8_weights_tensors_are_checked_again_when_they_change():
    # the same memo for the W4A8 form (rawkv.gemm._rules.weight8)
    g, n, k = 2, 24, 160
    w8 = rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(
        torch.full((g, n, k // 2), 0x25, dtype=torch.uint8), torch.full((g, n, k // 32), 127, dtype=torch.uint8),
        groups=g))
    x = (torch.zeros(3, g, k, dtype=torch.uint8), torch.ones(3, g, 2))
    first = rawkv.gemm.grouped_linear(x, w8)
    from rawkv.gemm import _rules
    assert _rules._CHECKED[id(w8.codes)][1] == ("w4a8", n, k)
    assert torch.equal(rawkv.gemm.grouped_linear(x, w8), first)          # remembered: the same result
    with pytest.raises(TypeError, match=r"^weight.row_scale: dtype float64"):
        rawkv.gemm.grouped_linear(x, w8._replace(row_scale=w8.row_scale.double()))
    w8.shifts.set_(w8.shifts.clone()[..., :1])            # the same object, other memory and shape
    with pytest.raises(ValueError, match=r"^weight.shifts: expected shape"):
        rawkv.gemm.grouped_linear(x, w8)


def test_weights_loaded_under_inference_mode_are_taken(rng):
    """Serving code loads its weights under torch.inference_mode; torch
    counts no in-place change of an inference tensor (reading `_version`
    raised, so every GEMM call on such a weight failed). Both forms, inside
    and outside inference_mode, the remembered check's second call too, and
    the layer: the results of the same bytes loaded the plain way."""
    g, n, k = 2, 24, 160
    codes = torch.from_numpy(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(120, 130, (g, n, k // 32), dtype=np.uint8))
    x = torch.from_numpy(rng.standard_normal((5, g, k)).astype(np.float32)).bfloat16()
    xa = rawkv.fp8.quantize_blocks(x.float())
    plain = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=g)
    want, want8 = rawkv.gemm.grouped_linear(x, plain), rawkv.gemm.grouped_linear(xa, rawkv.gemm.w4a8_weight(plain))
    with torch.inference_mode():
        w = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=g)
        w8 = rawkv.gemm.w4a8_weight(w)
        assert w.codes.is_inference() and w8.shifts.is_inference()
        for _ in range(2):
            assert torch.equal(rawkv.gemm.grouped_linear(x, w), want)
            assert torch.equal(rawkv.gemm.grouped_linear(xa, w8), want8)
    for _ in range(2):
        assert torch.equal(rawkv.gemm.grouped_linear(x, w), want)
        assert torch.equal(rawkv.gemm.grouped_linear(xa, w8), want8)
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=8, device="cpu")
    with torch.inference_mode():
        layer.load_mxfp4(codes, scales, w4a8=True)
        assert torch.equal(layer(xa), want8)


def test_the_fast_paths_stamp_takes_inference_tensors():
    """rawkv.gemm.fast keeps a launch by its weight tensors' addresses and
    versions; an inference tensor has no version (None in the stamp): its
    launch is reused, and a plain tensor changed in place is still not."""
    from rawkv._plan import Launch
    from rawkv.gemm import fast
    launched = []

    class Kernel:
        smem = 0

        def launch(self, rt, grid, block, stream=None, shared_mem=0, **args):
            launched.append(args)
    with torch.inference_mode():
        frozen = torch.zeros(4, dtype=torch.uint8)
    plain = torch.zeros(4, dtype=torch.uint8)
    x, out = torch.zeros(8), torch.zeros(8)
    try:
        for w in (frozen, plain):
            fast.remember(("probe", id(w)), (w,), Launch(Kernel(), (1,), (1,), {"w": w, "x": x, "out": out}),
                          ("out", "x"), (out, x), ("w",))
            assert fast.try_launch(("probe", id(w)), (w,), ("w",), ("out", "x"), (out, x), 1, lambda d: None)
        plain.add_(1)                                        # counted: the stamp no longer matches
        assert not fast.try_launch(("probe", id(plain)), (plain,), ("w",), ("out", "x"), (out, x), 1, lambda d: None)
        assert len(launched) == 2 and launched[0]["w"] is frozen
    finally:
        fast.forget()


def test_bad_sizes_and_activations_are_named_before_out_is_allocated():
    """A W4a8Weight is a NamedTuple: a float or bool N passed every shape
    comparison (24.0 == 24, the weight memo's key too) and failed in the
    body, a negative N in torch's allocation of out; x of the wrong rank
    sized out before its check (a stride-0 view of 2^40 codes: terabytes).
    Each is now refused naming the argument, before out is allocated."""
    g, n, k = 2, 24, 160
    w8 = rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(
        torch.full((g, n, k // 2), 0x25, dtype=torch.uint8), torch.full((g, n, k // 32), 127, dtype=torch.uint8),
        groups=g))
    codes, scales = rawkv.fp8.quantize_blocks(torch.ones(5, g, k))
    rawkv.gemm.grouped_linear((codes, scales), w8)           # (the weight's check is remembered)
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    flat = (codes[:, 0].contiguous(), scales[:, 0].contiguous())
    for bad in (24.0, True, np.float64(24.0)):
        with pytest.raises(TypeError, match=r"^weight: N = "):
            rawkv.gemm.grouped_linear((codes, scales), w8._replace(n=bad))
        with pytest.raises(TypeError, match=r"^weight: N = "):
            rawkv.gemm.moe_linear(flat, w8._replace(n=bad), offsets)
    with pytest.raises(TypeError, match=r"^weight: N = 24, K = 160.0"):
        rawkv.gemm.grouped_linear((codes, scales), w8._replace(k=160.0), out=torch.zeros(5, g, n).bfloat16())
    with pytest.raises(ValueError, match=r"^weight: N = -1"):
        rawkv.gemm.grouped_linear((codes, scales), w8._replace(n=-1))
    with pytest.raises(ValueError, match=r"^weight: N = -1"):
        rawkv.gemm.moe_linear(flat, w8._replace(n=-1), offsets)
    huge = torch.zeros(1, dtype=torch.uint8).expand(2 ** 40)
    with pytest.raises(ValueError, match=r"^x.codes: expected shape \(\.\.\., 160\) with 3 dimensions"):
        rawkv.gemm.grouped_linear((huge, scales), w8)
    with pytest.raises(ValueError, match=r"^x.codes: expected shape \(\.\.\., 160\) with 2 dimensions"):
        rawkv.gemm.moe_linear((huge, scales), w8, offsets)
    # the W4A16 ops the same way (an x of the right rank but past the launch grid too)
    w16 = rawkv.gemm.Fp4Weight.from_mxfp4(torch.full((g, n, k // 2), 0x25, dtype=torch.uint8),
                                          torch.full((g, n, k // 32), 127, dtype=torch.uint8), groups=g)
    bf = torch.zeros(1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., 160\) with 3 dimensions"):
        rawkv.gemm.grouped_linear(bf.expand(2 ** 40), w16)
    with pytest.raises(ValueError, match=r"^x: 1073741824 tokens x 2 groups is past the launch grid"):
        rawkv.gemm.grouped_linear(bf.view(1, 1, 1).expand(2 ** 30, g, k), w16)
    with pytest.raises(ValueError, match=r"^x: 2147483647 tokens x 2 groups is past the launch grid"):
        rawkv.gemm.moe_linear(bf.view(1, 1).expand(2 ** 31 - 1, k), w16, offsets)


def test_a_w4a16_weights_sizes_and_exp_range_are_integers():
    """An Fp4Weight's N, K and exp_range reach the operator's int arguments:
    a float or bool there passed every shape comparison (24.0 == 24, the
    weight memo's key too, True == 1) and a bool exp_range passed the MXFP4
    window test, where the operator under torch.compile refuses a bool
    (rawkv._op). Now refused eagerly too, naming the weight, on every path."""
    g, n, k = 2, 24, 160
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.full((g, n, k // 2), 0x25, dtype=torch.uint8),
                                        torch.full((g, n, k // 32), 127, dtype=torch.uint8), groups=g)
    x = torch.ones(5, g, k, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    rawkv.gemm.grouped_linear(x, w)                          # (the weight's check is remembered)
    for name, bad, match in (("n", 24.0, r"^weight: N = 24.0"), ("n", True, r"^weight: N = True"),
                             ("k", np.float64(160.0), r"^weight: N = 24, K = 160.0"),
                             ("exp_range", (True, 127), r"^weight: exp_range \(True, 127\)"),
                             ("exp_range", (120, 130.0), r"^weight: exp_range \(120, 130.0\)")):
        w2 = rawkv.gemm.Fp4Weight.from_mxfp4(torch.full((g, n, k // 2), 0x25, dtype=torch.uint8),
                                             torch.full((g, n, k // 32), 127, dtype=torch.uint8), groups=g)
        setattr(w2, name, bad)
        with pytest.raises(TypeError, match=match):
            rawkv.gemm.grouped_linear(x, w2, out=torch.zeros(5, g, n, dtype=torch.bfloat16))
        with pytest.raises(TypeError, match=match):
            rawkv.gemm.moe_linear(x[:, 0].contiguous(), w2, offsets, out=torch.zeros(5, n, dtype=torch.bfloat16))


def test_the_weight_memo_keeps_no_tensor_alive(rng):
    import gc
    import weakref
    w = _weight(rng, 2, 16, 64)
    rawkv.gemm.grouped_linear(torch.randn(3, 2, 64).bfloat16(), w)
    alive = [weakref.ref(t) for t in (w.codes, w.scales, w.gs)]
    del w
    gc.collect()
    assert [r() for r in alive] == [None, None, None]


# ---------------------------------------------------------------------------
# operator
# ---------------------------------------------------------------------------
def test_the_operators_check_the_weight_tensors(rng):
    # engines call torch.ops.rawkv.gemm_* with a weight's tensors: they are
    # checked as the public ops check them (they were not: a float64 gs or
    # int8 codes reached the kernel)
    import rawkv.library  # noqa: F401
    w = _weight(rng, 2, 16, 64)
    x = torch.randn(3, 2, 64).bfloat16()
    out = torch.empty(3, 2, 16, dtype=torch.bfloat16)
    args = rawkv.gemm.operator_args(x, w)
    for key, bad, exc, msg in (("gs", w.gs.double(), TypeError, "weight.gs: dtype float64"),
                               ("codes", w.codes.view(torch.int8), TypeError, "weight.codes: dtype int8"),
                               ("scales", w.scales[..., :1], ValueError, "weight.scales: expected shape"),
                               ("fmt", "fp4", ValueError, "weight: format 'fp4'"),
                               ("k", 72, ValueError, "weight: N = 16, K = 72"),
                               ("codes", misaligned(w.codes, 4), ValueError,
                                "weight.codes: data must be 16-byte aligned")):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            torch.ops.rawkv.gemm_grouped_linear(**{**args, key: bad}, out=out)
    torch.ops.rawkv.gemm_grouped_linear(**args, out=out)
    assert torch.equal(out.view(torch.int16), rawkv.gemm.grouped_linear(x, w).view(torch.int16))


def test_a_launch_grid_past_the_limit_is_refused_on_cpu_as_on_cuda():
    """The plans refuse a grid past 65535 token tiles, slots or groups; the
    same calls are refused on CPU (the shared rule, _rules.grid_fits, at 32
    tokens a tile: the fewest any kernel takes past 64), naming x."""
    from rawkv.gemm import _rules as R
    g = R.MAX_GRID_YZ + 1
    w = rawkv.gemm.Fp4Weight.from_nvfp4(torch.zeros(g, 16, 8, dtype=torch.uint8),
                                        torch.full((g, 16, 1), 0x38, dtype=torch.uint8), 1.0)
    with pytest.raises(ValueError, match=r"^x: 1 tokens x 65536 groups is past the launch grid's limit"):
        rawkv.gemm.grouped_linear(torch.zeros(1, g, 16, dtype=torch.bfloat16), w)
    # the bounds themselves: (the most tokens that fit, groups or experts, ragged); one more is refused
    top = R.MAX_GRID_YZ
    for t, groups, ragged in ((32 * top, top, False),            # 65535 tiles of 32 tokens, 65535 groups
                              (32 * (top - 3), 1, True),          # one expert: its tiles + 3 slots
                              (32 * (top - 1025), 1023, True)):   # 1023 experts: their tiles + 1025 slots
        R.grid_fits(t, groups, ragged)
        with pytest.raises(ValueError, match=r"^x: .* past the launch grid's limit"):
            R.grid_fits(t + 1, groups, ragged)
    with pytest.raises(ValueError, match=r"^x: 1 tokens x 65536 groups"):
        R.grid_fits(1, top + 1, False)
    R.grid_fits(top, 1023, True)          # a ragged call of few rows has at most one slot a row


def _cuda_w4a8_weight(cuda, rng, g, n, k):
    """A random W4A8 weight on the GPU (every MXFP4 scale 2^0); skips off sm_90."""
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 GEMM runs on sm_90 devices; this one is {cuda.arch}")
    codes = torch.from_numpy(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8))
    return rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(codes, torch.full((g, n, k // 32), 127,
                                                                  dtype=torch.uint8), groups=g).to("cuda"))


@pytest.mark.parametrize("case", ["grouped rows", "moe rows", "nvfp4 scales", "w4a8 grouped rows", "w4a8 moe rows"])
def test_a_view_the_rules_copy_is_copied_on_the_stream_argument(cuda, rng, case):
    """A call with stream=s whose activation view the rules copy (rows not
    16-byte aligned, an NVFP4 activation's strided scales): s first sleeps,
    then writes the view's new values; the op must read them. The copy was
    made on torch's current stream, at once, so the kernel on s multiplied
    the old values (zeros), and the copy's memory went back to the current
    stream while the kernel still read it."""
    g, n, k = 2, 48, 256
    i32 = dict(dtype=torch.int32, device="cuda")
    if case.startswith("w4a8"):
        w = _cuda_w4a8_weight(cuda, rng, g, n, k)
    else:
        w, _ = random_weight(rng, g, n, k, "nvfp4")
    lead = (5, g) if "grouped" in case or "nvfp4" in case else (10,)
    if case.startswith("w4a8"):
        new = tuple(t.cuda() for t in rawkv.fp8.quantize_blocks(torch.randn(*lead, k)))
        base = torch.zeros(*lead, k + 1, dtype=torch.uint8, device="cuda")
        view = base[..., 1:]                                 # rows not 16-byte aligned: copied
        x, fill = (view.view(new[0].dtype), new[1]), lambda: view.copy_(new[0].view(torch.uint8))
    elif case == "nvfp4 scales":
        q, sf, gs = rawkv.nvfp4.quantize(torch.randn(*lead, k, device="cuda"), scope="row")
        new = rawkv.nvfp4.QuantizedActivation(q, sf, gs)
        base = torch.zeros(*lead, 2 * sf.shape[-1], dtype=torch.uint8, device="cuda")
        view = base[..., ::2]                                # a strided last dimension: copied
        x, fill = rawkv.nvfp4.QuantizedActivation(q, view, gs), lambda: view.copy_(sf.view(torch.uint8))
    else:
        new = torch.randn(*lead, k, device="cuda").bfloat16()
        base = torch.zeros(*lead, k + 1, dtype=torch.bfloat16, device="cuda")
        view = base[..., 1:]                                 # rows not 16-byte aligned: copied
        x, fill = view, lambda: view.copy_(new)
    offsets = torch.tensor([0, 4, 10], **i32)
    run = (lambda a, **kw: rawkv.gemm.moe_linear(a, w, offsets, **kw)) if "moe" in case else \
        (lambda a, **kw: rawkv.gemm.grouped_linear(a, w, **kw))
    want = run(new)                                          # (and the kernel compiled before s sleeps)
    run(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)                       # tens of milliseconds of GPU time
        fill()
    got = run(x, stream=s)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), case


def test_weight_sizes_past_the_kernels_32_bit_arithmetic_are_refused():
    """N and K reach the GEMM kernels as int and their 32-bit arithmetic:
    the W4A8 wgmma producer stepped two row tiles (2 * ceil(K / 128) * 1024
    bytes) in 32 bits, which wrapped past K = 2^28 - 128 and copied another
    tile's weights (no error), and the W4A16 split-K offsets (2 K bytes)
    overflowed near K = 2^30. Sizes from 2^27 on are refused naming the
    weight, on every placement, before any tensor of the weight is read."""
    from rawkv.gemm import _rules as R
    tiny = torch.zeros(16, dtype=torch.uint8)
    for n, k in ((48, 2 ** 28), (2 ** 27, 128), (48, 2 ** 27)):
        with pytest.raises(ValueError, match=rf"^weight: N = {n}, K = {k}: each must be below 2\^27"):
            R.weight8(tiny, tiny, tiny, tiny, n, k, "cpu")
        with pytest.raises(ValueError, match=rf"^weight: N = {n}, K = {k}: each must be below 2\^27"):
            R.weight(tiny, tiny, tiny, "nvfp4", n, k, "cpu")
    # just below: the sizes pass, and the tensors' shapes are what is refused
    with pytest.raises(ValueError, match=r"^weight.codes: expected shape"):
        R.weight8(tiny, tiny, tiny, tiny, 48, 2 ** 27 - 128, "cpu")


@pytest.mark.parametrize("case", ["x rows", "x.sf strided", "w4a8 x.codes rows", "w4a8 x.scales blocks"])
def test_a_view_the_rules_would_copy_is_refused_during_capture(cuda, rng, case):
    """A view a kernel cannot read as it is is copied (an allocation), and no
    op allocates while a CUDA graph is captured (docs/format.md): under a
    capture the call is a CaptureError naming the view, and nothing is
    written. (Under a capture torch does not manage, the copy's block went
    back to the caching pool after the call while replays still read it.)"""
    g, n, k = 2, 48, 256
    if case.startswith("w4a8"):
        w = _cuda_w4a8_weight(cuda, rng, g, n, k)
        c, sc = (t.cuda() for t in rawkv.fp8.quantize_blocks(torch.randn(1, g, k)))   # one token: mma.sync
        if case.endswith("rows"):
            base = torch.zeros(1, g, k + 1, dtype=torch.uint8, device="cuda")
            x, name = (base[..., 1:].view(c.dtype), sc), "x.codes"
        else:
            wide = torch.zeros(1, g, 2 * sc.shape[-1], dtype=sc.dtype, device="cuda")
            x, name = (c, wide[..., ::2]), "x.scales"
    else:
        w, _ = random_weight(rng, g, n, k, "nvfp4")
        if case == "x rows":
            x, name = torch.zeros(3, g, k + 1, dtype=torch.bfloat16, device="cuda")[..., 1:], "x"
        else:
            q, sf, gs = rawkv.nvfp4.quantize(torch.randn(3, g, k, device="cuda"), scope="row")
            wide = torch.zeros(3, g, 2 * sf.shape[-1], dtype=torch.uint8, device="cuda")
            x, name = rawkv.nvfp4.QuantizedActivation(q, wide[..., ::2], gs), "x.sf"
    out = torch.full((x[0].shape[0] if isinstance(x, tuple) else 3, g, n), 7.0, dtype=torch.bfloat16,
                     device="cuda")
    rawkv.gemm.grouped_linear(x, w, out=out.clone())          # (compiled and copied outside capture)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(rawkv.CaptureError, match=f"^{re.escape(name)}: would be copied"):
        with torch.cuda.graph(graph):
            rawkv.gemm.grouped_linear(x, w, out=out)
    assert bool((out == 7.0).all())


def test_operator_args_names_a_weight_it_cannot_take(rng):
    # rawkv.gemm.operator_args(x, w) read w.exp_range first: a W4a8Weight
    # (whose operators take other arguments: rawkv.gemm.w4a8.operator_args8)
    # or None failed with AttributeError ("'W4a8Weight' object has no
    # attribute 'exp_range'"), naming nothing. Now a TypeError naming weight.
    x = torch.randn(3, 2, 64).bfloat16()
    mx = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(rng.integers(0, 256, (2, 16, 32), dtype=np.uint8)),
                                         torch.full((2, 16, 2), 127, dtype=torch.uint8), groups=2)
    assert rawkv.gemm.operator_args(x, mx)["exp_lo"] == 127
    with pytest.raises(TypeError, match=r"^weight: .*W4a8Weight.*operator_args8"):
        rawkv.gemm.operator_args(x, rawkv.gemm.w4a8_weight(mx))
    with pytest.raises(TypeError, match=r"^weight: expected a rawkv.gemm.Fp4Weight"):
        rawkv.gemm.operator_args(x, None)


def test_operator_args8_names_a_weight_it_cannot_take(rng):
    # The W4A8 sibling of operator_args: rawkv.gemm.w4a8.operator_args8(x, w)
    # read w.shifts after splitting x, so an Fp4Weight (whose operators take
    # rawkv.gemm.operator_args's arguments; w4a8_weight turns an MXFP4 one
    # into a W4a8Weight) or None failed with AttributeError ("'Fp4Weight'
    # object has no attribute 'shifts'"), naming nothing. A TypeError naming
    # weight, as operator_args gives for a W4a8Weight.
    from rawkv.gemm.w4a8 import operator_args8
    mx = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(rng.integers(0, 256, (2, 16, 32), dtype=np.uint8)),
                                         torch.full((2, 16, 2), 127, dtype=torch.uint8), groups=2)
    xa = rawkv.fp8.quantize_blocks(torch.randn(3, 2, 64))
    assert operator_args8(xa, rawkv.gemm.w4a8_weight(mx))["n"] == 16
    with pytest.raises(TypeError, match=r"^weight: an Fp4Weight's operators take other arguments: .*operator_args"):
        operator_args8(xa, mx)
    with pytest.raises(TypeError, match=r"^weight: expected a rawkv.gemm.W4a8Weight, got NoneType"):
        operator_args8(xa, None)


def test_numpy_activations_of_no_rows_are_taken_as_torch_ones(rng):
    """numpy gives an array of no elements strides of 0 (np.empty((0, 3, 24)).strides is (0, 0, 0)):
    the GEMM's rule on out's last stride refused the op's own output for a numpy x of no rows
    ('out: the last dimension must be contiguous'), and an empty numpy out, where torch's were taken."""
    g, n, k = 3, 24, 64
    w = _weight(rng, g, n, k)
    got = rawkv.gemm.grouped_linear(np.ones((0, g, k), np.float32), w)
    assert isinstance(got, np.ndarray) and got.shape == (0, g, n)
    out = np.empty((0, g, n), np.float32)
    assert rawkv.gemm.grouped_linear(np.ones((0, g, k), np.float32), w, out=out) is out
    got = rawkv.gemm.moe_linear(np.ones((0, k), np.float32), w, np.zeros(g + 1, np.int32))
    assert isinstance(got, np.ndarray) and got.shape == (0, n)
    codes = np.zeros((0, g, 160), np.uint8)
    w8 = rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(torch.full((g, n, 80), 0x25, dtype=torch.uint8),
                                                                torch.full((g, n, 5), 127, dtype=torch.uint8), groups=g))
    got = rawkv.gemm.grouped_linear((codes, np.ones((0, g, 2), np.float32)), w8)
    assert isinstance(got, np.ndarray) and got.shape == (0, g, n)
