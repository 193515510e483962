"""The W4A8 GEMM's error bound (docs/gemm.md, "W4A8 (issue 23)"), the one the
GPU test of the kernel is to use, and a model of the kernel's arithmetic
order to test the bound against (numpy only: no torch needed).

What the kernel computes for output (t, n), with w'_k = E4M3(w8) the weight
rebased to E4M3 (w_k = w'_k * 2^r exactly), q_k the activation's E4M3 code
value and a_b its 128-channel block's scale:
  1. per 128-K block b (L_b <= 128 channels): the MMA's partial
     p_b = sum_{k in b} w'_k q_k. Each product is exact (4 x 4 significant
     bits), but Hopper's FP8 wgmma accumulates with about 14 significant bits
     (e8m13, truncating: DeepSeek-V3's report, "around 14 bits"; the
     H100 model of Khattak & Mikaitis, arXiv 2512.07004), which is why the
     partial is promoted every 128 K: |p^_b - p_b| <= L_b * MMA_UNIT * A_b,
     A_b = sum_{k in b} |w'_k q_k|, with MMA_UNIT = 2^-12 (one truncation
     of 2^-13 relative per addition, doubled for the alignment of a fused
     group of products to its largest);
  2. promotion in FP32 on the CUDA cores, acc += p^_b * a_b (an FMA or a
     multiply and an add, blocks in any order, split-K halves included):
     at most (nb + 1) * 2^-23 of the sum of the terms' magnitudes;
  3. the epilogue's multiply by 2^r: exact unless the result is an FP32
     subnormal (absolute 2^-150);
  4. BF16 rounding: 2^-8 relative, 2^-134 absolute among subnormals.
With S = sum_k |w_k x_k| (float64; sum_b |a_b| 2^r A_b = S):
  |out - exact| <= 2^-8 |exact| + (1 + 2^-8) * (L * MMA_UNIT + (nb + 1) *
                   2^-23 * (1 + L * MMA_UNIT)) * S + 2^-133,
L = min(K, 128), nb = ceil(K / 128). `bound` gives it; `assert_within_bound`
checks it with NaN / Inf positions equal.
"""
from __future__ import annotations

import numpy as np

from rawkv.reference import gemm as G
from rawkv.reference import gemm_w4a8 as W
from rawkv.reference.formats import e4m3_decode
from rawkv.reference.fp8_blocks import ue8m0_value

#: Relative error per addition inside the FP8 MMA (see the module docstring).
MMA_UNIT = 2.0 ** -12
FP32_UNIT = 2.0 ** -23
BF16_UNIT = 2.0 ** -8
#: Absolute slack for subnormal results: a BF16 subnormal step (2^-133)
#: covers the FP32 subnormal rounding of the epilogue and BF16's half step.
SUBNORMAL = 2.0 ** -133


def bound(exact, absolute, k: int, mma_unit: float = MMA_UNIT) -> np.ndarray:
    """The tolerance of each output, from the exact product and S."""
    length = min(k, W.ACT_BLOCK)
    nb = -(-k // W.ACT_BLOCK)
    rel = length * mma_unit + (nb + 1) * FP32_UNIT * (1 + length * mma_unit)
    return BF16_UNIT * np.abs(exact) + (1 + BF16_UNIT) * rel * absolute + SUBNORMAL


def assert_within_bound(got, exact, absolute, k: int, what: str = "", mma_unit: float = MMA_UNIT):
    """got: BF16 results (a torch tensor, or numpy values) within `bound` of
    the float64 exact product; NaN and Inf where the exact product has them."""
    got = got.double().cpu().numpy() if hasattr(got, "double") else np.asarray(got, np.float64)
    exact = np.asarray(exact, np.float64)
    tol = bound(exact, np.nan_to_num(absolute), k, mma_unit)
    nan_ref = np.isnan(exact)
    assert np.array_equal(np.isnan(got), nan_ref), f"{what}: NaN positions differ"
    assert np.array_equal(np.isinf(got) & ~nan_ref, np.isinf(exact)), f"{what}: Inf positions differ"
    finite = np.isfinite(exact)
    err = np.abs(got - exact)[finite]
    bad = err > tol[finite]
    assert not bad.any(), (f"{what}: {bad.sum()} outputs past the bound, worst err/tol "
                           f"{np.max(err / tol[finite]):.3g}")


def exact_and_absolute(x_codes, x_scales, w_codes, w_scales):
    """Batched mode's float64 exact product and S = sum |w x|."""
    x = W.activation_values(x_codes, x_scales)
    w = W.weight_values(w_codes, w_scales)
    return G.grouped(x, w), G.grouped(np.abs(x), np.abs(w))


def bf16_values(a) -> np.ndarray:
    """float64 -> the float64 values of round_to_bf16's BF16 bits."""
    bits = G.round_to_bf16(a).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


def _truncate(v: np.ndarray, bits: int) -> np.ndarray:
    """v truncated toward zero to `bits` significant bits."""
    _, ex = np.frexp(v)
    ulp = np.ldexp(1.0, ex - bits)
    return np.trunc(v / ulp) * ulp


def _fp32(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float32).astype(np.float64)


def kernel_order(x_codes, x_scales, w_codes, w_scales, mma: str = "fp32") -> np.ndarray:
    """Batched mode computed in the kernel's order (a model of it, not its
    bits): per 128-K block the MMA's partial, k in order, each sum rounded to
    FP32 ('fp32') or truncated to 14 significant bits ('e8m13', the H100's
    FP8 accumulator); promoted by an FMA into an FP32 accumulator; times 2^r;
    BF16. Returns the BF16 values as float64 (T, G, N)."""
    shifts, rebase = W.w4a8_form(w_codes, w_scales)
    w8 = e4m3_decode(W.w4a8_codes(w_codes, shifts)).astype(np.float64)        # (G, N, K)
    q = e4m3_decode(np.asarray(x_codes)).astype(np.float64)                   # (T, G, K)
    xs = np.asarray(x_scales)
    a = (ue8m0_value(xs) if xs.dtype == np.uint8 else xs).astype(np.float64)  # (T, G, nb)
    k = q.shape[-1]
    step = _fp32 if mma == "fp32" else (lambda v: _truncate(v, 14))
    acc = np.zeros((q.shape[0], w8.shape[0], w8.shape[1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(a.shape[-1]):
            part = np.zeros_like(acc)
            for kk in range(b * W.ACT_BLOCK, min(k, (b + 1) * W.ACT_BLOCK)):
                # products are exact in float64 (and in FP32)
                part = step(part + q[:, :, None, kk] * w8[None, :, :, kk])
            acc = _fp32(acc + part * a[:, :, b, None])    # an FMA: one FP32 rounding
        return bf16_values(_fp32(acc * np.ldexp(1.0, rebase)[None]))
