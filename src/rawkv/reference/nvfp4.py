"""NVFP4 quantize / dequantize reference (docs/format.md, "NVFP4: tensors and layouts").

Shapes: x (..., N) with N % 16 == 0 -> q (..., N/2) uint8, sf (..., N/16)
uint8 (UE4M3), gs float32: shape () for scope 'tensor' / 'given' / 'none',
x.shape[:-1] for scope 'row'.

Every step is float32 IEEE arithmetic in the order of the spec, with
NVIDIA ModelOpt's rules (nvidia-modelopt 0.47.0,
modelopt/torch/quantization/qtensor/nvfp4_tensor.py, NVFP4QTensor.quantize):
for finite x and a usable gs (every gs rawkv computes; a given gs that
given_gs_ok accepts) the bytes are ModelOpt's, apart from an es that
underflows to 0 (step 3).
  1. amax over the scope (finite elements only); gs = amax / 2688, and 1 if
     that is 0 (amax == 0, or the division underflows)
  2. r = bmax / (gs * 6); sf = 0x38 (1.0) if r == 0, else
     e4m3(max(r, 2^-9)) (NaN kept): a block whose scale would round to 0
     gets the smallest subnormal scale 0x01 and keeps its values
  3. es = float(sf) * gs; codes only for a positive finite es, else all 0
     (with a usable gs only es underflowing to 0, under a gs below 2^-140,
     where ModelOpt divides by 0)
  4. t = x / es; code = e2m1(|t|) with the sign bit set iff t < 0 (-0.0 and
     a negative x whose quotient underflows to -0 give code 0)
  5. a block holding NaN/Inf -> sf = 0x7F, codes 0

A caller-given gs that given_gs_ok refuses is never used: every block is
flagged as in step 5 (sf = 0x7F, codes 0), before steps 2-4, so none of
ModelOpt's scale rules applies to it (ModelOpt itself would encode with such
a gs: docs/format.md lists the difference). The ops refuse such a number or
host array; a device gs is checked by the kernel, which applies this rule.
"""
from __future__ import annotations

import functools

import numpy as np

from .formats import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, round_to_dtype

BLOCK = 16
SCOPES = ("tensor", "row", "given", "none")
F32 = np.float32


def check_last_dim(n: int, name: str = "x") -> None:
    if n % BLOCK != 0:
        raise ValueError(f"{name}: the last dimension ({n}) must be a multiple of {BLOCK} "
                         "for NVFP4 (no silent padding)")


#: Largest finite value of each input dtype (its float32 value): it bounds a
#: given gs. (float64 inputs are not taken: the ops read float32, float16,
#: bfloat16.)
MAX_FINITE = {"float32": float(np.finfo(np.float32).max), "bfloat16": float.fromhex("0x1.fep127"),
              "float16": 65504.0}


def given_gs_ok(gs, dtype: str = "float32") -> bool:
    """The rule for a caller-given decode global scale: usable when it is
    positive and the largest finite `dtype` input still gets a non-zero block
    scale before ModelOpt's clamp, e4m3(max / (gs * 6)) != 0 in float32 (the
    plain RNE cast of step 2's ratio, not block_scale). False for 0,
    negatives, NaN, +-Inf and every gs >= given_gs_limit(dtype): such a gs
    puts every input of the dtype below the range of the block scale (step
    2 would give every block the same scale whatever its data: the clamp's
    2^-9, or 1.0 where gs * 6 overflows and every r is 0), and it is no
    global scale of any such input (a computed gs is at most max / 2688).
    No positive float32 gs is too small: the largest input then saturates to
    sf 448 and code 6, with es = 448 * gs > 0."""
    g = F32(np.asarray(gs, dtype=F32).reshape(()))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        return bool(g > 0 and e4m3_encode(F32(MAX_FINITE[dtype]) / (g * F32(6.0))) != 0)


@functools.lru_cache(maxsize=None)
def given_gs_limit(dtype: str = "float32") -> float:
    """The smallest positive float32 that given_gs_ok(., dtype) refuses, so
    a gs is usable exactly when 0 < float32(gs) < given_gs_limit(dtype)
    (the rule is monotonic in gs: tests check both sides of the bound).
    Found by bisection over the positive float32 bit patterns."""
    lo, hi = 1, 0x7F800000                 # given_gs_ok(lo) is True, (hi = +Inf) False
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if given_gs_ok(np.uint32(mid).view(F32), dtype):
            lo = mid
        else:
            hi = mid
    return float(np.uint32(hi).view(F32))


def check_given_gs(gs, dtype: str = "float32") -> None:
    """The ops' refusal of a given gs whose value the host holds, naming gs
    (a ValueError) where given_gs_ok(gs, dtype) is False: a number (already
    finite and > 0 as a float32) from given_gs_limit(dtype) up, or a host
    float32 array of one element outside (0, given_gs_limit(dtype)). (A
    device gs is the kernel's to check: it flags every block of the call
    and counts it.)"""
    limit = given_gs_limit(dtype)
    if isinstance(gs, float):
        if not F32(gs) < limit:
            raise ValueError(f"gs: {gs!r} is too large for {dtype} input: from {limit:.9g} up, even the "
                             f"largest {dtype} value falls below the range of the E4M3 block scale "
                             "(docs/format.md)")
        return
    g = np.asarray(gs, F32).reshape(())
    if not 0 < g < limit:
        raise ValueError(f"gs: {float(g)!r} is not a usable global scale for {dtype} input (expected "
                         f"0 < gs < {limit:.9g}; docs/format.md)")


def global_scale(x: np.ndarray, scope: str, gs=None) -> np.ndarray:
    """The float32 decode scale gs for `x` under `scope` (step 1)."""
    x = np.asarray(x, dtype=F32)
    if scope == "none":
        return F32(1.0)
    if scope == "given":
        if gs is None:
            raise ValueError("gs: scope 'given' needs a global scale")
        return F32(np.asarray(gs, dtype=F32).reshape(()))
    finite_abs = np.where(np.isfinite(x), np.abs(x), F32(0))
    if scope == "tensor":
        amax = finite_abs.max() if x.size else F32(0)
    elif scope == "row":
        amax = finite_abs.max(axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], F32)
    else:
        raise ValueError(f"scope: expected one of {SCOPES}, got {scope!r}")
    with np.errstate(under="ignore"):
        g = (np.asarray(amax, dtype=F32) / F32(2688.0)).astype(F32)
    # gs == 0 (amax == 0, or an amax whose division underflows) -> 1: a zero
    # gs would make the zero blocks' sf NaN (0 / 0).
    return np.where(g == 0, F32(1.0), g).astype(F32)


SF_MIN = F32(2.0 ** -9)      # the smallest E4M3 subnormal (byte 0x01)
SF_ONE = np.uint8(0x38)       # E4M3 1.0


def block_scale(r) -> np.ndarray:
    """Step 2's scale byte from r = bmax / (gs * 6), as ModelOpt computes it
    (NVFP4QTensor.get_weights_scaling_factor: `per_block_scale[== 0] = 1.0`,
    then _cast_per_block_scale_to_fp8: `clamp(min=2**-9, max=448)` and the
    RNE cast): r == 0 -> 1.0 (an all-zero block); 0 < r < 2^-9 -> 2^-9; NaN
    stays NaN (0x7F). (A negative r needs a negative gs, which given_gs_ok
    refuses before this step.)"""
    r = np.asarray(r, dtype=F32)
    sf = e4m3_encode(np.where(r < SF_MIN, SF_MIN, r))
    return np.where(r == 0, SF_ONE, sf).astype(np.uint8)


def quantize(x, scope: str = "tensor", gs=None, dtype: str = "float32"):
    """NVFP4-encode `x` -> (q, sf, gs). See the module docstring. `dtype`:
    the dtype x came in (float32, float16 or bfloat16), whose largest finite
    value decides whether a given gs is usable (given_gs_ok)."""
    x = np.asarray(x, dtype=F32)
    check_last_dim(x.shape[-1])
    g = global_scale(x, scope, gs)
    if scope == "given" and not given_gs_ok(g, dtype):
        lead, n = x.shape[:-1], x.shape[-1]
        return (np.zeros((*lead, n // 2), np.uint8), np.full((*lead, n // BLOCK), 0x7F, np.uint8),
                np.asarray(g, dtype=F32))
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    # per-block gs: scalar, or one per row broadcast over the row's blocks
    gb = np.asarray(g, dtype=F32)[..., None] if np.ndim(g) else g
    bad = ~np.isfinite(blocks).all(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        bmax = np.abs(blocks).max(axis=-1)
        sf = block_scale(bmax / (gb * F32(6.0)))                      # step 2
        es = (e4m3_decode(sf) * gb).astype(F32)                       # step 3
        t = blocks / es[..., None]                                    # step 4
        codes = (e2m1_encode(np.abs(t)) | ((t < 0).astype(np.uint8) << 3)).astype(np.uint8)
    # codes only for a positive finite es (step 3; a usable gs gives no Inf /
    # NaN es, so es == 0 by underflow is the one case; the guard is the
    # kernels' nvfp4_es_usable)
    usable = (es > 0) & np.isfinite(es)
    codes = np.where((~usable)[..., None] | bad[..., None], np.uint8(0), codes)
    sf = np.where(bad, np.uint8(0x7F), sf).astype(np.uint8)           # step 5
    return pack_nibbles(codes.reshape(x.shape)), sf, np.asarray(g, dtype=F32)


def dequantize(q, sf, gs=1.0, dtype: str = "bfloat16") -> np.ndarray:
    """y = e2m1[code] * (float(sf) * gs) in float32, rounded to `dtype`
    ('bfloat16' returns float32 holding BF16 values, 'float16', 'float32').
    gs: scalar, or one per row (shape q.shape[:-1])."""
    q = np.asarray(q, dtype=np.uint8)
    sf = np.asarray(sf, dtype=np.uint8)
    codes = unpack_nibbles(q)
    n = codes.shape[-1]
    if sf.shape != (*q.shape[:-1], n // BLOCK):
        raise ValueError(f"sf: expected shape {(*q.shape[:-1], n // BLOCK)}, got {sf.shape}")
    g = np.asarray(gs, dtype=F32)
    g = g[..., None] if g.ndim else g
    es = (e4m3_decode(sf) * g).astype(F32)
    vals = e2m1_decode(codes).reshape(*codes.shape[:-1], n // BLOCK, BLOCK) * es[..., None]
    return round_to_dtype(vals.reshape(codes.shape).astype(F32), dtype)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """(..., N) 4-bit codes -> (..., N/2) bytes; element 2j in the low nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(q: np.ndarray) -> np.ndarray:
    """(..., N/2) bytes -> (..., N) 4-bit codes."""
    q = np.asarray(q, dtype=np.uint8)
    out = np.empty((*q.shape[:-1], q.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = q & 0xF
    out[..., 1::2] = q >> 4
    return out
