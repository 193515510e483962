"""The stored formats of an entry: FP8 entry (448 E4M3 codes + one FP32
scale + 64 BF16 RoPE dims, docs/format.md "FP8 KV entries") and the CSA indexer key (one-level
NVFP4, docs/format.md NVFP4 with gs = 1)."""
from __future__ import annotations

import numpy as np

from ..formats import bf16_round, e2m1_decode, e4m3_decode, e4m3_encode, round_to_dtype
from ..nvfp4 import quantize as nvfp4_quantize
from ._checks import _f32
from .constants import FP8_MAX, NVFP4_BLOCK, ROPE_DIM


def fp8_entry_quantize(entry, rope_dim: int = ROPE_DIM):
    """entry (..., D) float32 -> (codes, scale, rope).

    codes: (..., D - rope_dim) uint8 E4M3 of the non-RoPE dims,
    scale: (...,) float32 decode scale s = amax / 448.0f (1.0 if that is 0:
           amax == 0, or an amax so small that the division underflows),
    rope:  (..., rope_dim) float32 holding the BF16-rounded RoPE dims.
    q = e4m3(x / s), float32 IEEE division, RNE, satfinite.
    An entry whose non-RoPE dims hold NaN or +-Inf gets s = NaN and codes 0
    (it decodes to NaN: bad data stays visible, as NVFP4 encoding step 5).
    """
    entry = _f32("entry", entry)
    if entry.shape[-1] <= rope_dim:
        raise ValueError(f"entry: last dimension must exceed rope_dim {rope_dim}, got {entry.shape}")
    nope = entry[..., : entry.shape[-1] - rope_dim]
    bad = ~np.isfinite(nope).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(nope), nope, np.float32(0))).max(axis=-1)
    with np.errstate(under="ignore"):
        s = (amax / np.float32(FP8_MAX)).astype(np.float32)
    s = np.where(s == 0, np.float32(1.0), s).astype(np.float32)
    s = np.where(bad, np.float32(np.nan), s).astype(np.float32)
    with np.errstate(invalid="ignore"):
        codes = e4m3_encode(nope / s[..., None])
    codes = np.where(bad[..., None], np.uint8(0), codes).astype(np.uint8)
    rope = bf16_round(entry[..., entry.shape[-1] - rope_dim:])
    return codes, s, rope


def fp8_entry_dequantize(codes, scale, rope, dtype: str = "bfloat16") -> np.ndarray:
    """(codes (..., Dn) uint8, scale (...,) float32, rope (..., R)) ->
    (..., Dn + R): float(q) * s in float32 for the non-RoPE dims, the RoPE
    dims as stored, then rounded to `dtype` ('bfloat16' -> float32 holding
    BF16 values, 'float16', 'float32')."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes: expected uint8, got {codes.dtype}")
    scale = _f32("scale", np.asarray(scale)[..., None])[..., 0]
    if scale.shape != codes.shape[:-1]:
        raise ValueError(f"scale: expected shape {codes.shape[:-1]}, got {scale.shape}")
    rope = _f32("rope", rope)
    if rope.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"rope: expected leading shape {codes.shape[:-1]}, got {rope.shape}")
    nope = e4m3_decode(codes) * scale[..., None]
    return round_to_dtype(np.concatenate([nope, rope], axis=-1), dtype)


# ---------------------------------------------------------------------------
# CSA indexer key: one-level NVFP4 (docs/format.md NVFP4 with gs = 1)
# ---------------------------------------------------------------------------
def _nvfp4_one_level(x: np.ndarray):
    """One-level NVFP4 encode of x (..., N), N % 16 == 0 -> (q, sf): the
    NVFP4 encoder with gs = 1 (rawkv.reference.nvfp4.quantize, scope 'none'),
    which the kernels share (nvfp4_quantize_block).
    q: (..., N/2) uint8, element 2j in the low nibble; sf: (..., N/16) uint8.
    """
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"x: last dimension must be a multiple of 16, got {x.shape[-1]}")
    q, sf, _ = nvfp4_quantize(x, "none")
    return q, sf


def indexer_key_quantize(key):
    """Indexer key (..., 128) float32 -> (q (..., 64) uint8, sf (..., 8) uint8),
    one-level NVFP4 (no global scale)."""
    return _nvfp4_one_level(_f32("key", key))


def indexer_key_dequantize(q, sf, dtype: str = "bfloat16") -> np.ndarray:
    """(q (..., N/2), sf (..., N/16)) -> (..., N): lut[code] * float(sf) in
    float32, then rounded to `dtype`. A NaN scale (0x7F) decodes to NaN."""
    q = np.asarray(q)
    sf = np.asarray(sf)
    if q.dtype != np.uint8 or sf.dtype != np.uint8:
        raise TypeError(f"q, sf: expected uint8, got {q.dtype}, {sf.dtype}")
    if sf.shape[:-1] != q.shape[:-1] or q.shape[-1] != sf.shape[-1] * (NVFP4_BLOCK // 2):
        raise ValueError(f"q, sf: shapes {q.shape} and {sf.shape} do not match")
    codes = np.stack([q & 0xF, q >> 4], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    vals = e2m1_decode(codes).reshape(*sf.shape, NVFP4_BLOCK) * e4m3_decode(sf)[..., None]
    return round_to_dtype(vals.reshape(codes.shape), dtype)
