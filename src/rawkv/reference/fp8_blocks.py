"""FP8 activations with block scales (docs/format.md, "FP8 block activations"):
E4M3 codes with one scale per token per `block` channels, the recipe
DeepSeek-V3.2 / V4 and DeepGEMM use to feed the FP8 tensor cores.

This module defines the bytes. For every finite input they equal DeepSeek's
official `act_quant`, which this follows rule for rule:

  source: DeepSeek-V4 inference/kernel.py `act_quant_kernel` (tilelang 0.1.8),
          published on Hugging Face (deepseek-ai/DeepSeek-V4-Flash); read here
          as git blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8, whose text is
          committed in github.com/Mockingjay1316/deepseek-v4-flash-spark at
          0825add42734731a285e30f657b0ccfc5bad74c9 (at that repository's
          first commit, 135f0266e58f5ab72037c5d7a800179ae23b2226,
          inference/kernel.py is only a symlink to the Hub cache's
          blobs/ea7976fa...; its later 1795ef7 edits sparse_attn for GB10, not
          act_quant). The same `act_quant` rule is in the official
          github.com/deepseek-ai/DeepSeek-V3.2-Exp, inference/kernel.py at
          commit 2305c7ec3bf4b357dc0aee8dd97e0a1cbc0ea0e1.

  1. amax = max |x| over the block, in FP32 (reduce_absmax; |bf16| is exact).
  2. amax = max(amax, 1e-4): the constant is FP32(1e-4) = 0x1.a36e2ep-14
     (`T.max(amax, 1e-4)`), so an all-zero block gets a finite scale.
  3. s = amax * FP32(1/448): a multiplication by the FP32 reciprocal
     0x1.24924ap-9 (`amax * fp8_max_inv`), rounded to FP32 -- NOT amax / 448
     (that is V3's Triton kernel and DeepGEMM's test helper; the two differ in
     the last bit of s for some amax).
  4. ue8m0 (`fast_round_scale`): s = 2^ceil(log2 s) taken from s's bits: the
     biased exponent, plus one when any mantissa bit is set. Exact (no log2
     intrinsic). Stored as that biased exponent, one byte (V4's
     float8_e8m0fnu scale_dtype), or as the FP32 power of two (V3.2-Exp).
  5. code = E4M3(clamp(x / s, -448, 448)): an IEEE division rounded to FP32
     (tilelang 0.1.8 compiles without fast math: TL_ENABLE_FAST_MATH is off
     by default and V3.2-Exp sets TL_DISABLE_FAST_MATH), then the FP32 value
     rounded to E4M3 to nearest even (cvt.rn.satfinite). Two roundings, in
     that order. No flush to zero: subnormal inputs divide exactly.

DeepSeek-V3's Triton act_quant (github.com/deepseek-ai/DeepSeek-V3,
inference/kernel.py at adecc0efbe2fda18945734168fce6e0df0d804c3) has the same
steps 1 and 2, and step 5 without the clamp (it casts x / s to float8_e4m3fn
as it is), but computes s = amax / 448 and x / s with Triton's FP32
division, which lowers to PTX div.full.f32 (approximate, up to 2 ulp), and
the ue8m0 power with lg2/ex2 approximations: its bytes are not reproducible
off the GPU, and this module does not follow them.

Decisions where the official kernel has no rule worth copying (docs/format.md):
  * A block holding a NaN or an infinity is flagged: its scale is NaN (FP32
    NaN, or the E8M0 NaN byte 0xFF) and its codes are 0, so it dequantizes
    to NaN and the NaN reaches the GEMM output as BF16 math would carry it.
    (V4's kernel skips NaN in the amax, fmaxf semantics, and clamps a NaN
    quotient to -448: NaN would silently become -448.)
  * K need not be a multiple of the block: the last block is partial and its
    scale comes from its own elements (DeepGEMM's per_token_cast_to_fp8 zero
    padding gives the same; V4's act_quant asserts K % block == 0).
"""
from __future__ import annotations

import numpy as np

from . import formats as F

#: Block sizes (channels per scale): 128 for GEMM activations, 64 is V4's
#: KV-cache block, 32 the MX block.
BLOCKS = (32, 64, 128)
SCALE_FORMATS = ("fp32", "ue8m0")

#: FP32(1e-4): the least amax a block's scale is taken from (rule 2).
AMAX_FLOOR = np.float32(1e-4)
#: FP32(1/448): the scale is amax times this (rule 3).
INV_E4M3_MAX = np.float32(1.0 / 448.0)
#: The E8M0 byte that is NaN (float8_e8m0fnu has no infinity).
UE8M0_NAN = 0xFF


def block_count(k: int, block: int) -> int:
    """Scales per row: one per block of `block` channels, the last partial."""
    return -(-k // block)


def scale_of(amax, scale_format: str):
    """(FP32 scale, E8M0 byte or None) of blocks whose finite amax is given
    (rules 2-4); the byte only for 'ue8m0'."""
    a = np.maximum(np.asarray(amax, np.float32), AMAX_FLOOR)
    s = (a * INV_E4M3_MAX).astype(np.float32)
    if scale_format == "fp32":
        return s, None
    bits = s.view(np.uint32)
    # a >= 1e-4 keeps s normal and its exponent below 247: no overflow here
    byte = (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)).astype(np.uint8)
    return ue8m0_value(byte), byte


def ue8m0_value(byte) -> np.ndarray:
    """The FP32 value of E8M0 bytes: 2^(byte - 127), NaN for 0xFF (0 is
    2^-127, an FP32 subnormal, exactly)."""
    b = np.asarray(byte, np.uint8).astype(np.int64)
    with np.errstate(over="ignore"):           # 0xFF's 2^128 overflows: it is NaN below
        v = np.ldexp(np.float32(1.0), b - 127).astype(np.float32)
    return np.where(b == UE8M0_NAN, np.float32(np.nan), v).astype(np.float32)


def _blocks(x, block: int):
    """x (..., K) as (..., nb, block) FP32 blocks, the last zero-padded."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    nb = block_count(k, block)
    if nb * block != k:
        x = np.concatenate([x, np.zeros((*x.shape[:-1], nb * block - k), np.float32)], axis=-1)
    return x.reshape(*x.shape[:-1], nb, block)


def quantize_blocks(x, block: int = 128, scale_format: str = "fp32"):
    """x (..., K), float32 values (BF16/FP16 inputs converted exactly) ->
    (codes uint8 (..., K), scales (..., ceil(K/block))): FP32 scales for
    'fp32', E8M0 bytes for 'ue8m0' (ue8m0_value gives their FP32 powers of
    two). The module docstring states the rule and its source."""
    if block not in BLOCKS:
        raise ValueError(f"block: expected one of {BLOCKS}, got {block!r}")
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format: expected one of {SCALE_FORMATS}, got {scale_format!r}")
    x = np.asarray(x, np.float32)
    if x.ndim < 1:
        raise ValueError(f"x: expected at least 1 dimension, got shape {x.shape}")
    k = x.shape[-1]
    xb = _blocks(x, block)
    finite = np.isfinite(xb).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(xb), xb, np.float32(0))).max(axis=-1, initial=np.float32(0))
    s, byte = scale_of(amax, scale_format)
    with np.errstate(invalid="ignore", over="ignore"):
        q = (xb / s[..., None]).astype(np.float32)           # IEEE FP32 division (rule 5)
    # The clamp of rule 5 is what E4M3 satfinite does to every non-NaN value.
    codes = np.where(finite[..., None], F.e4m3_encode(q), np.uint8(0)).astype(np.uint8)
    codes = codes.reshape(*x.shape[:-1], xb.shape[-2] * block)[..., :k]
    if byte is None:
        scales = np.where(finite, s, np.float32(np.nan)).astype(np.float32)
    else:
        scales = np.where(finite, byte, np.uint8(UE8M0_NAN)).astype(np.uint8)
    return codes, scales


def dequantize_blocks(codes, scales, block: int = 128) -> np.ndarray:
    """FP32 values code * scale of E4M3 `codes` (..., K) and their `scales`
    (..., ceil(K/block)): FP32 scales (float32 array) or E8M0 bytes (uint8).
    One FP32 multiplication per element; E4M3 NaN codes and NaN scales give
    NaN."""
    codes = np.asarray(codes, np.uint8)
    scales = np.asarray(scales)
    s = ue8m0_value(scales) if scales.dtype == np.uint8 else scales.astype(np.float32)
    k = codes.shape[-1]
    full = np.repeat(s, block, axis=-1)[..., :k]
    return (F.e4m3_decode(codes) * full).astype(np.float32)
