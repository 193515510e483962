"""NVFP4 blocks for the rules rawkv takes from NVIDIA ModelOpt (docs/format.md,
"NVFP4: tensors and layouts", encoding steps 2 and 4), shared by the
reference, ModelOpt and GPU tests:

- all-zero blocks (+0, -0, mixed): scale 1.0 (0x38), every code 0;
- blocks whose scale r = bmax / (6 gs) is below 2^-10 or exactly 2^-10 (the
  tie that rounded to scale 0): scale 2^-9 (0x01), the values kept;
- negative values whose quotient x / es lies at, just below and just above
  -2^-150 (half the smallest float32 subnormal): code 0 when the quotient
  rounds to -0, else the sign bit (0x8); the kernels decide this with a bound
  on x, not with their (Markstein) quotient, so these values are the ones that
  tell the two apart.

Every value is exact in the dtype it is built for, so the kernels see exactly
what the reference sees.
"""
from __future__ import annotations

import numpy as np

from rawkv.reference.formats import round_to_dtype
from rawkv.reference.nvfp4 import BLOCK, unpack_nibbles

F32 = np.float32
SUBNORMAL_MIN = {"float32": 2.0 ** -149, "bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}

#: (dtype, given gs) pairs the edge tests run: a power of two, gs whose es
#: are not powers of two (0.375, and 0.376 whose products round), and for
#: BF16 a gs large enough for its subnormals' quotients to underflow.
EDGE_CASES = [("float32", 1.0), ("float32", 0.375), ("float32", 0.376),
              ("bfloat16", 1.0), ("bfloat16", 0.375), ("bfloat16", 32768.0),
              ("float16", 1.0), ("float16", 0.375)]

# x / es = t exactly in a block whose scale is 2^-9: every E2M1 tie below 3,
# signs both ways, and -0
_TINY_T = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, -0.25, -0.5, -0.75, -1.0, -1.25, -2.5, -0.0]
# bmax = 3 * 2^-9 * gs: r = 2^-10 exactly
_TIE_T = [3.0, -3.0, 1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 0.0, -0.0, 2.0, -2.0, 1.5, -1.5, 0.75, -0.75]


def underflow_block(dtype: str, gs: float):
    """A block with bmax = 2688 gs (scale 448, es = 448 gs) and multiples
    +-k u of the dtype's smallest subnormal u around the tie es * 2^-150 =
    k0 u; None where the dtype cannot hold those multiples exactly (BF16
    holds k u for k < 256; FP16's u = 2^-24 never gets near the tie)."""
    es = F32(F32(448.0) * F32(gs))
    k0 = float(es) * 2.0 ** -150 / SUBNORMAL_MIN[dtype]
    k = int(np.floor(k0))
    if dtype == "float16" or k < 2 or (dtype == "bfloat16" and 2 * k + 1 > 255):
        return None
    ks = [1, k - 1, k, k + 1, k + 2, 2 * k, 2 * k + 1]
    u = SUBNORMAL_MIN[dtype]
    vals = [2688.0 * gs] + [-kk * u for kk in ks] + [kk * u for kk in ks] + [-0.0]
    return np.array(vals, np.float64)


def edge_blocks(dtype: str, gs: float, rng=None) -> np.ndarray:
    """(B, 16) float32 blocks exact in `dtype` for a given gs; with `rng`,
    also 8 random blocks of scale 2^-9 (values up to 3 * 2^-9 * gs, rounded
    to the dtype)."""
    unit = 2.0 ** -9 * gs
    blocks = [np.zeros(BLOCK), np.full(BLOCK, -0.0), np.tile([0.0, -0.0], BLOCK // 2),
              np.array(_TINY_T) * unit, np.array(_TIE_T) * unit]
    under = underflow_block(dtype, gs)
    if under is not None:
        blocks.append(under)
    if rng is not None:
        blocks += list(rng.uniform(-3, 3, (8, BLOCK)) * unit * rng.uniform(0.01, 1, (8, 1)))
    x = np.stack(blocks).astype(F32)
    if rng is not None:
        x = round_to_dtype(x, dtype).astype(F32) if dtype != "float16" else x.astype(np.float16).astype(F32)
    exact = round_to_dtype(x, dtype) if dtype != "float16" else x.astype(np.float16).astype(F32)
    assert np.array_equal(exact.view(np.uint32), x.view(np.uint32)), f"edge blocks not exact in {dtype}"
    return x


def as_rows(blocks: np.ndarray, n: int) -> np.ndarray:
    """Blocks laid out as rows of n elements, zero blocks appended to fill."""
    per = n // BLOCK
    pad = -len(blocks) % per
    full = np.concatenate([blocks, np.zeros((pad, BLOCK), F32)]) if pad else blocks
    return np.ascontiguousarray(full.reshape(-1, n))


def rules_hit(x: np.ndarray, q: np.ndarray, sf: np.ndarray) -> dict:
    """How often the encoding of x (as (q, sf)) used each rule, so an edge test
    can show that it is not vacuous."""
    blocks = np.asarray(x, F32).reshape(-1, BLOCK)
    codes = unpack_nibbles(q).reshape(-1, BLOCK)
    sf = np.asarray(sf).reshape(-1)
    neg = blocks < 0
    return {
        "zero_block_scale_1": int(((sf == 0x38) & ~blocks.any(axis=1)).sum()),
        "tiny_scale_2^-9": int((sf == 0x01).sum()),
        "tiny_value_kept": int(((sf == 0x01)[:, None] & ((codes & 7) != 0)).sum()),
        "negative_zero_code_8": int((neg & (codes == 0x8)).sum()),
        "negative_quotient_underflow_code_0": int((neg & (codes == 0)).sum()),
        "minus_zero_code_0": int((np.signbit(blocks) & (blocks == 0) & (codes == 0)).sum()),
    }
