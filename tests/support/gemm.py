"""Helpers of the grouped FP4 GEMM tests (tests/gemm/): random weights and their
float64 values, the exact grouped product, NVFP4 activations with their exact
values, the checks both kernels' tests run (tests/gemm/test_grouped_linear.py,
test_moe_linear.py: mma.sync; test_linear_sm90.py: wgmma) and the table of
arguments both placements refuse (tests/gemm/test_arguments.py).

Error bound (what FP32 accumulation in any order plus the roundings can
give). Each product w_k * x_k is exact in FP32 (a BF16/FP16 activation times
a dequantized FP4 weight, e2m1 * scale * 2^-9, has at most 8 + 6 significant
bits), so the only errors are:
  * the FP32 sum of K products in any order (and any blocking across warps):
    |s_hat - s| <= (K - 1) * u * sum |w_k x_k| with u = 2^-24 for round-to-
    nearest adds; tensor cores may truncate instead of rounding, so u = 2^-23;
  * the epilogue's multiply by the global scales: one more rounding, u |s|;
  * the final BF16 rounding (8 significant bits, round to nearest): at
    most 2^-8 relative.
So |out - ref| <= 2^-8 |ref| + (1 + 2^-8) * (K + 1) * 2^-23 * S, with
S = gs * sum |w_k x_k| (float64). `assert_within_bound` checks exactly that.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv.reference import gemm as ref  # noqa: E402
from rawkv.reference import formats as F  # noqa: E402
from support.views import misaligned  # noqa: E402


def assert_within_bound(got, exact, absolute, k, what=""):
    got = got.double().cpu().numpy()
    tol = 2.0 ** -8 * np.abs(exact) + (1 + 2.0 ** -8) * (k + 1) * 2.0 ** -23 * absolute
    nan_ref = np.isnan(exact)
    assert np.array_equal(np.isnan(got), nan_ref), f"{what}: NaN positions differ"
    finite = np.isfinite(exact)
    assert np.array_equal(np.isinf(got) & ~nan_ref, np.isinf(exact)), f"{what}: Inf positions differ"
    err = np.abs(got - exact)[finite]
    bad = err > tol[finite]
    assert not bad.any(), (f"{what}: {bad.sum()} outputs past the bound, worst err/tol "
                           f"{np.max(err / np.maximum(tol[finite], 1e-300)):.3g}")


def random_weight(rng, g, n, k, fmt, device="cuda"):
    """Fp4Weight from random checkpoint bytes (codes, block scales, gs), and
    its exact float64 values."""
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    if fmt == "nvfp4":
        # finite E4M3, subnormals too, and some zero scales (their blocks pack with zero codes)
        scales = rng.integers(0x01, 0x7E, (g, n, k // 16), dtype=np.uint8)
        scales[rng.random(scales.shape) < 0.05] = 0
        gs = (rng.random(g) * 0.01 + 1e-3).astype(np.float32)
        w = rawkv.gemm.Fp4Weight.from_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales),
                                            torch.from_numpy(gs), groups=g)
    else:
        scales = rng.integers(113, 138, (g, n, k // 32), dtype=np.uint8)
        gs = np.ones(g, np.float32)
        w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), groups=g)
    return w.to(device), ref.dequantize_weight(codes, scales, gs, fmt)


def exact_grouped(x64, w64):
    return ref.grouped(x64, w64), ref.grouped(np.abs(x64), np.abs(w64))


def _nvfp4_activation(rng, lead, k, gs):
    codes = rng.integers(0, 16, (*lead, k), dtype=np.uint8)
    q = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    sf = rng.integers(0x10, 0x60, (*lead, k // 16), dtype=np.uint8)
    exact = F.e2m1_decode(codes).astype(np.float64) * np.repeat(F.e4m3_decode(sf).astype(np.float64), 16, -1)
    qa = rawkv.nvfp4.QuantizedActivation(torch.from_numpy(q).cuda(), torch.from_numpy(sf).cuda(), gs)
    return qa, exact


def check_nvfp4_activations_equal_bf16(rng, fmt, tokens):
    """e2m1 * E4M3 is exact in BF16, so with gs = 1 the NVFP4 path must give
    the BF16 path's bits on the dequantized activations (same tiles, same
    summation order), on whichever kernel the caller forced."""
    g, n, k = 2, 72, 224
    w, _ = random_weight(rng, g, n, k, fmt)
    qa, exact_x = _nvfp4_activation(rng, (tokens, g), k, torch.ones((), device="cuda"))
    a = rawkv.gemm.grouped_linear(qa, w)
    b = rawkv.gemm.grouped_linear(torch.from_numpy(exact_x).to(torch.bfloat16).cuda(), w)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_nan_and_inf(rng, tokens, late):
    """NaN and Inf activations (rows 0, 1 and `late`) give NaN / Inf where
    the reference does, and the bound elsewhere."""
    g, n, k = 2, 48, 128
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(tokens, g, k, dtype=torch.bfloat16)
    x[0, 0, 5] = float("nan")
    x[1, 1, 7] = float("inf")
    x[late, 0, 3] = float("-inf")
    x[late, 0, 9] = float("inf")          # Inf - Inf somewhere: NaN
    exact, absolute = exact_grouped(x.double().numpy(), w64)
    assert_within_bound(rawkv.gemm.grouped_linear(x.cuda(), w), exact, np.nan_to_num(absolute), k, "nan/inf")


def check_views_and_out(rng, tokens):
    """Strided, misaligned and shifted activation views, and an out= view
    whose neighbours stay untouched."""
    g, n, k = 3, 56, 192
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    base = torch.randn(g, tokens, k + 8, dtype=torch.bfloat16).cuda()
    x = base[:, :, :k].transpose(0, 1)               # (T, G, K), strided, rows aligned
    odd = torch.randn(tokens, g, k + 1, dtype=torch.bfloat16).cuda()[:, :, 1:]   # rows not aligned
    # contiguous but starting 2 bytes past an aligned address
    shifted = torch.randn(tokens * g * k + 1, dtype=torch.bfloat16).cuda()[1:].view(tokens, g, k)
    out_base = torch.zeros(tokens, g, n + 5, dtype=torch.bfloat16, device="cuda")
    for xi in (x, odd, shifted):
        exact, absolute = exact_grouped(xi.double().cpu().numpy(), w64)
        out = out_base[:, :, 2:2 + n]
        res = rawkv.gemm.grouped_linear(xi, w, out=out)
        assert res.data_ptr() == out.data_ptr()
        assert_within_bound(out, exact, absolute, k, "view")
        assert torch.count_nonzero(out_base[:, :, :2]) == 0 and torch.count_nonzero(out_base[:, :, 2 + n:]) == 0


def check_ragged(rng, offsets, act, n, k, rows):
    """moe_linear over len(offsets) - 1 NVFP4 experts within the bound of the
    reference, and the clamps counted."""
    w, w64 = random_weight(rng, len(offsets) - 1, n, k, "nvfp4")
    if act == "nvfp4":
        x, x64 = _nvfp4_activation(rng, (rows,), k, torch.ones((), device="cuda"))
    else:
        xt = torch.randn(rows, k, dtype=torch.bfloat16)
        x, x64 = xt.cuda(), xt.double().numpy()
    exact, bad = ref.ragged(x64, w64, offsets)
    absolute, _ = ref.ragged(np.abs(x64), np.abs(w64), offsets)
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.moe_linear(x, w, torch.tensor(offsets, dtype=torch.int32, device="cuda"), out=out, errors=errors)
    assert_within_bound(out, exact, absolute, k, f"ragged {offsets}")
    assert int(errors[0]) == bad


def _weight(rng, g, n, k):
    return rawkv.gemm.Fp4Weight.from_float(torch.from_numpy(rng.standard_normal((g, n, k)).astype(np.float32)))


def repacked(w, **tensors):
    """w with some of its packed tensors replaced (the constructor as a
    loader calls it)."""
    t = {**dict(codes=w.codes, scales=w.scales, gs=w.gs), **tensors}
    return rawkv.gemm.Fp4Weight(w.fmt, w.n, w.k, t["codes"], t["scales"], t["gs"], exp_range=w.exp_range)


def bad_argument_cases(rng, device):
    """(what, call, exception, message prefix): arguments the ops refuse,
    on `device`. The CPU path accepted several that CUDA refuses (int64
    offsets, int64 / float32 errors, a float64 / int32 gs) or crashed on
    them (weight=None, an empty or bool errors): tests/gemm/test_arguments.py
    runs the same table on CUDA."""
    w = _weight(rng, 3, 16, 64).to(device)
    x = torch.randn(2, 3, 64, device=device).bfloat16()
    xm = x[:, 0]
    offs = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=device)
    q, sf, gs = rawkv.nvfp4.quantize(torch.randn(2, 3, 64, device=device), scope="row")
    qa = rawkv.nvfp4.QuantizedActivation
    gl, ml = rawkv.gemm.grouped_linear, rawkv.gemm.moe_linear
    i32 = dict(dtype=torch.int32, device=device)
    bf = dict(dtype=torch.bfloat16, device=device)
    return [
        ("weight None", lambda: gl(x, None), TypeError, "weight: expected a rawkv.gemm.Fp4Weight"),
        ("weight a tensor", lambda: gl(x, w.codes), TypeError, "weight: expected a rawkv.gemm.Fp4Weight"),
        # (both kernels copy them 16 bytes at a time; the CPU path took such views, which CUDA would fault on)
        ("weight codes misaligned", lambda: gl(x, repacked(w, codes=misaligned(w.codes, 8))), ValueError,
         "weight.codes: data must be 16-byte aligned"),
        ("weight scales misaligned", lambda: ml(xm, repacked(w, scales=misaligned(w.scales, 2)), offs), ValueError,
         "weight.scales: data must be 16-byte aligned"),
        ("moe weight None", lambda: ml(xm, None, offs), TypeError, "weight: expected a rawkv.gemm.Fp4Weight"),
        ("x float32", lambda: gl(x.float(), w), TypeError, "x: dtype float32"),
        ("x None", lambda: gl(None, w), TypeError, "x: expected a tensor"),
        ("gs float64", lambda: gl(qa(q, sf, gs.double()), w), TypeError, "x.gs: dtype float64"),
        ("gs int32", lambda: gl(qa(q, sf, gs.int()), w), TypeError, "x.gs: dtype int32"),
        ("q float32", lambda: gl(qa(q.view(torch.uint8).float(), sf, gs), w), TypeError, "x.q: dtype float32"),
        ("offsets int64", lambda: ml(xm, w, offs.long()), TypeError, "offsets: dtype int64"),
        ("offsets float32", lambda: ml(xm, w, offs.float()), TypeError, "offsets: dtype float32"),
        ("offsets shape", lambda: ml(xm, w, offs[:3]), ValueError, "offsets: expected shape"),
        ("offsets strided", lambda: ml(xm, w, torch.zeros(8, **i32)[::2]), ValueError, "offsets: must be contiguous"),
        ("offsets None", lambda: ml(xm, w, None), TypeError, "offsets: expected a tensor"),
        ("offsets a list", lambda: ml(xm, w, [0, 1, 1, 2]), TypeError, "offsets: expected a tensor"),
        ("errors empty", lambda: ml(xm, w, offs, errors=torch.zeros(0, **i32)), ValueError, "errors: expected an int32 tensor with at least 1 element"),
        ("errors bool", lambda: ml(xm, w, offs, errors=torch.zeros(1, dtype=torch.bool, device=device)),
         TypeError, "errors: dtype bool"),
        ("errors int64", lambda: ml(xm, w, offs, errors=torch.zeros(1, dtype=torch.int64, device=device)),
         TypeError, "errors: dtype int64"),
        ("errors float32", lambda: ml(xm, w, offs, errors=torch.zeros(1, device=device)),
         TypeError, "errors: dtype float32"),
        ("errors strided", lambda: ml(xm, w, offs, errors=torch.zeros(4, **i32)[::2]), ValueError,
         "errors: must be contiguous"),
        ("errors a number", lambda: ml(xm, w, offs, errors=0), TypeError, "errors: expected a tensor"),
        ("out float32", lambda: gl(x, w, out=torch.empty(2, 3, 16, device=device)), TypeError, "out: dtype float32"),
        ("out shape", lambda: gl(x, w, out=torch.empty(2, 3, 15, **bf)), ValueError, "out: expected shape"),
        ("out last dim strided", lambda: gl(x, w, out=torch.empty(2, 3, 32, **bf)[..., ::2]),
         ValueError, "out: the last dimension"),
        ("out a number", lambda: gl(x, w, out=1.0), TypeError, "out: expected a tensor"),
        ("out expanded", lambda: gl(x, w, out=torch.empty(1, 3, 16, **bf).expand(2, 3, 16)),
         ValueError, "out: rows overlap"),
        ("out rows over each other", lambda: gl(x, w, out=torch.empty(64, **bf).as_strided((2, 3, 16), (24, 8, 1))),
         ValueError, "out: rows overlap"),
        ("moe out rows over each other", lambda: ml(xm, w, offs, out=torch.empty(32, **bf).as_strided((2, 16), (8, 1))),
         ValueError, "out: rows overlap"),
        ("moe out shape", lambda: ml(xm, w, offs, out=torch.empty(2, 15, **bf)), ValueError, "out: expected shape"),
    ]


def check_bad_argument_cases(rng, device):
    for what, call, exc, msg in bad_argument_cases(rng, device):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            call()
        print("refused:", what)


class _Sizes:
    def __init__(self, groups, n, k=4096):
        self.groups, self.n, self.k = groups, n, k


def _bf16(bits16) -> np.ndarray:
    """BF16 bit patterns (RG.round_to_bf16's result) as float32 values."""
    return (np.asarray(bits16, np.uint32) << 16).view(np.float32)


_WEIGHTS: dict = {}


def _cached_weight(g, n, k):
    """A small Fp4Weight (from_float of fixed values), made once per shape."""
    key = (g, n, k)
    if key not in _WEIGHTS:
        v = np.random.default_rng(g * 1000 + n * 10 + k).standard_normal((g, n, k)).astype(np.float32)
        _WEIGHTS[key] = rawkv.gemm.Fp4Weight.from_float(torch.from_numpy(v))
    return _WEIGHTS[key]


def _exact(w):
    codes, scales, gs = (t.numpy() for t in w.unpack())
    return ref.dequantize_weight(codes, scales, gs, w.fmt)


def _bits(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def _f32_bits(a):
    """numpy's BF16 stand-in (float32 holding BF16 values) as BF16 bits."""
    b = a.view(np.uint32)
    assert not (b & 0xFFFF).any()
    return (b >> 16).astype(np.uint16)

