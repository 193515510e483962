"""Fused NVFP4 producers: numpy reference (docs/fused.md defines them).

Each fused op is the composition of the unfused steps, in float32 IEEE
arithmetic in the order written here, followed by rawkv.reference.nvfp4's
quantize. Every intermediate that an unfused pipeline would store in memory
is rounded to the input's dtype (`dtype`: 'bfloat16', 'float16' or 'float32';
'float32' means no rounding), exactly like the unfused BF16 pipeline
(mix -> bf16, rmsnorm -> bf16, silu*up -> bf16, then quantize). quantize
takes `dtype` too: a given gs that rawkv.reference.nvfp4.given_gs_ok refuses
for it flags every block (sf 0x7F, codes 0), as the kernels do.

    rmsnorm(x, w, eps)          ss = sum(x^2) in float64; ms = f32(ss / N)
                                inv_rms = 1 / sqrt(ms + f32(eps))   (float32)
                                y = round((x * inv_rms) * w)
    mhc_mix(X, A)               x = A0*X0; x = x + A1*X1; ... (h order); round
    silu(a)                     a / (1 + exp_f32(-a)), exp_f32 = rawkv's
                                deterministic float32 exp (below)
    swiglu(h, g)                y = round(silu(gate) * up), gate/up
                                de-interleaved with granularity g
    moe_stage(x, ids, w)        one-level NVFP4 (gs = 1) of x, scales packed
                                four per int32, ids widened to int64, w copied

The FP8 outputs (`*_fp8`) are rawkv.reference.fp8_blocks.quantize_blocks
(DeepSeek's act_quant) of the same rounded y: the BF16 (FP16) tensor the
unfused pipeline would store, which is what DeepSeek's model quantizes, so
the bytes equal act_quant's of the unfused op's output.

The float64 sum of squares is what the kernels do too (in another order); a
float64 sum of at most a few 10^5 exactly-squared float32 values lands on the
same float32 `ms` unless ss / N is within ~1e-16 (relative) of a float32
rounding boundary. The tests check this per row (see docs/fused.md).
"""
from __future__ import annotations

import numpy as np

from . import fp8_blocks
from .fma import fma_f32
from .formats import round_to_dtype
from .nvfp4 import check_last_dim, dequantize, quantize

F32 = np.float32
DTYPES = ("bfloat16", "float16", "float32")

# ---- deterministic float32 exp ------------------------------------------------
# Cody-Waite range reduction + degree-7 Taylor polynomial (Horner), every step
# one IEEE float32 operation or one correctly rounded float32 fused
# multiply-add (reference.fma.fma_f32, CUDA's fmaf), so rawkv/cu/fused.cu
# computes the same bits. (Until session 56 every multiply and add rounded
# apart: nine more operations an element in the kernel, docs/fused.md.)
# Error <= 2 ulp against the float32-rounded exact exp (what
# tests/fused/test_swiglu_quantize.py asserts; measured: 1 ulp over [-87, 88.7]).
_U = lambda bits: np.array(bits, dtype=np.uint32).view(np.float32)[()]  # noqa: E731
EXP_LOG2E = _U(0x3FB8AA3B)      # f32(log2(e))
EXP_LN2_HI = _U(0x3F317200)     # 0.693145751953125 (15 significant bits: n * hi is exact)
EXP_LN2_LO = _U(0x35BFBE8E)     # f32(ln2 - hi)
EXP_COEF = tuple(_U(b) for b in (0x39500D01, 0x3AB60B61, 0x3C088889, 0x3D2AAAAB,
                                 0x3E2AAAAB))  # f32(1/7!), 1/6!, 1/5!, 1/4!, 1/3!
EXP_LO, EXP_HI = F32(-104.0), F32(89.0)
EXP_MAGIC = F32(1.5 * 2**23)     # adding it rounds to an integer (|y| < 2^22)


def _pow2(n: np.ndarray) -> np.ndarray:
    """2^n as float32 for integer n in [-126, 127] (exact)."""
    return ((n.astype(np.int64) + 127) << 23).astype(np.uint32).view(np.float32)


def exp_f32(x) -> np.ndarray:
    """rawkv's deterministic float32 exp (the kernels compute the same bits).

    x is clamped to [-104, 89] with NaN-ignoring min/max (like CUDA fminf /
    fmaxf: NaN becomes -104), so exp(NaN) is not NaN here; silu() divides NaN
    by it and stays NaN. exp(89) overflows to +inf, exp(-104) is 0."""
    x = np.asarray(x, dtype=F32)
    xc = np.fmin(np.fmax(x, EXP_LO), EXP_HI)
    # n = rint(xc * log2(e)) by the magic number 1.5 * 2^23: the fma rounds
    # the exact product to an integer (ties to even), in [-150, 128]
    t = fma_f32(xc, EXP_LOG2E, EXP_MAGIC)
    n = (t - EXP_MAGIC).astype(F32)
    r = fma_f32(-n, EXP_LN2_HI, xc)
    r = fma_f32(-n, EXP_LN2_LO, r)
    p = EXP_COEF[0]
    for c in (*EXP_COEF[1:], F32(0.5), F32(1.0), F32(1.0)):
        p = fma_f32(p, r, c)
    ni = n.astype(np.int64)
    n1 = np.trunc(ni / 2).astype(np.int64)           # C integer division (toward zero)
    n2 = ni - n1
    with np.errstate(over="ignore", under="ignore"):
        return ((p * _pow2(n1)).astype(F32) * _pow2(n2)).astype(F32)


def silu(a) -> np.ndarray:
    """silu(a) = a / (1 + exp_f32(-a)) in float32."""
    a = np.asarray(a, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return (a / (F32(1.0) + exp_f32(-a))).astype(F32)


# ---- unfused steps ----------------------------------------------------------------
def _check_width(n: int, name: str) -> None:
    """A row width: a positive multiple of 16 (an empty row has nothing to
    normalize or quantize, and its gs / inv_rms would be undefined)."""
    if n == 0:
        raise ValueError(f"{name}: the last dimension is 0; expected a positive multiple of 16")
    check_last_dim(n, name)


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    return dtype


def rms_inv(x, eps: float = 1e-6) -> np.ndarray:
    """inv_rms per row (last axis): float64 sum of squares, then float32."""
    x = np.asarray(x, dtype=F32)
    ss = np.sum(np.square(x.astype(np.float64)), axis=-1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ms = (ss / np.float64(x.shape[-1])).astype(F32)
        return (F32(1.0) / np.sqrt(ms + F32(eps))).astype(F32)


def rmsnorm(x, weight, eps: float = 1e-6, dtype: str = "bfloat16", inv_rms=None):
    """(y, inv_rms): y = round_dtype((x * inv_rms) * weight) in float32.
    `inv_rms` overrides the computed one (the GPU tests pass the kernel's)."""
    _check_dtype(dtype)
    x = np.asarray(x, dtype=F32)
    w = np.asarray(weight, dtype=F32)
    inv = rms_inv(x, eps) if inv_rms is None else np.asarray(inv_rms, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x * inv[..., None]).astype(F32) * w
    return round_to_dtype(y.astype(F32), dtype), inv


def mhc_mix(X, A, dtype: str = "bfloat16") -> np.ndarray:
    """x[m] = sum_h A[m, h] * X[m, h, :], summed in h order, rounded to dtype.
    X (M, n_hc, N), A (M, n_hc)."""
    _check_dtype(dtype)
    X = np.asarray(X, dtype=F32)
    A = np.asarray(A, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = (A[:, 0, None] * X[:, 0]).astype(F32)
        for h in range(1, X.shape[1]):
            acc = (acc + (A[:, h, None] * X[:, h]).astype(F32)).astype(F32)
    return round_to_dtype(acc, dtype)


def deinterleave(h, granularity: int = 8):
    """(gate, up) from a fused (M, 2I) tensor whose columns alternate
    `granularity` gate columns then `granularity` up columns."""
    h = np.asarray(h)
    two_i = h.shape[-1]
    g = int(granularity)
    if g < 1 or two_i % (2 * g):
        raise ValueError(f"granularity: {g} does not divide the fused width {two_i} into "
                         "gate/up pairs")
    v = h.reshape(*h.shape[:-1], two_i // (2 * g), 2, g)
    shp = (*h.shape[:-1], two_i // 2)
    return v[..., 0, :].reshape(shp), v[..., 1, :].reshape(shp)


def swiglu(h, granularity: int = 8, dtype: str = "bfloat16") -> np.ndarray:
    """round_dtype(silu(gate) * up) from the interleaved fused tensor."""
    _check_dtype(dtype)
    gate, up = deinterleave(np.asarray(h, dtype=F32), granularity)
    with np.errstate(over="ignore", invalid="ignore"):
        return round_to_dtype((silu(gate) * up).astype(F32), dtype)


# ---- fused ops ------------------------------------------------------------------------
def rmsnorm_quantize(x, weight, eps: float = 1e-6, scope: str = "row", gs=None,
                     dtype: str = "bfloat16", inv_rms=None):
    """(q, sf, gs, inv_rms) = quantize(rmsnorm(x, weight, eps), scope)."""
    x = np.asarray(x, dtype=F32)
    _check_width(x.shape[-1], "x")
    y, inv = rmsnorm(x, weight, eps, dtype, inv_rms)
    q, sf, g = quantize(y, scope, gs, dtype)
    return q, sf, g, inv


def mhc_rmsnorm_quantize(X, A, weight, eps: float = 1e-6, scope: str = "row", gs=None,
                         dtype: str = "bfloat16", inv_rms=None):
    """(q, sf, gs, inv_rms) = quantize(rmsnorm(mhc_mix(X, A)), scope)."""
    X = np.asarray(X, dtype=F32)
    _check_width(X.shape[-1], "x")
    return rmsnorm_quantize(mhc_mix(X, A, dtype), weight, eps, scope, gs, dtype, inv_rms)


def swiglu_quantize(h, granularity: int = 8, scope: str = "row", gs=None,
                    dtype: str = "bfloat16"):
    """(q, sf, gs) = quantize(swiglu(h, granularity), scope)."""
    h = np.asarray(h, dtype=F32)
    _check_width(h.shape[-1] // 2, "h (the intermediate width, h.shape[-1] / 2)")
    return quantize(swiglu(h, granularity, dtype), scope, gs, dtype)


def pack_scales_i32(sf: np.ndarray) -> np.ndarray:
    """(..., K/16) UE4M3 bytes -> (..., K/64) int32: block 4i+j in byte j (little endian)."""
    sf = np.ascontiguousarray(sf, dtype=np.uint8)
    if sf.shape[-1] % 4:
        raise ValueError(f"sf: the number of scales ({sf.shape[-1]}) must be a multiple of 4")
    b = sf.reshape(*sf.shape[:-1], sf.shape[-1] // 4, 4).astype(np.uint32)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return w.view(np.int32)


def unpack_scales_i32(sf32: np.ndarray) -> np.ndarray:
    """Inverse of pack_scales_i32."""
    w = np.ascontiguousarray(sf32, dtype=np.int32).view(np.uint32)
    b = np.stack([(w >> (8 * j)) & 0xFF for j in range(4)], axis=-1).astype(np.uint8)
    return b.reshape(*w.shape[:-1], w.shape[-1] * 4)


def _moe_hidden(hidden) -> np.ndarray:
    """MoE hidden states (M, K) as float32, K a positive multiple of 128."""
    x = np.asarray(hidden, dtype=F32)
    if x.ndim != 2 or x.shape[-1] % 128 or x.shape[-1] == 0:
        raise ValueError(f"hidden: expected (M, K) with K a positive multiple of 128, got shape {x.shape}")
    return x


def moe_stage(hidden, topk_ids, topk_weights):
    """(q, sf_i32, ids_i64, weights): one-level NVFP4 (gs = 1) of `hidden`
    (M, K), K % 128 == 0; scales packed four per int32; top-k ids widened to
    int64; top-k weights copied unchanged."""
    x = _moe_hidden(hidden)
    q, sf, _ = quantize(x, "none")
    return q, pack_scales_i32(sf), np.asarray(topk_ids).astype(np.int64), np.array(topk_weights)


# ---- FP8 block outputs -------------------------------------------------------------------
def rmsnorm_quantize_fp8(x, weight, eps: float = 1e-6, block: int = 128, scale_format: str = "fp32",
                         dtype: str = "bfloat16", inv_rms=None):
    """(codes, scales, inv_rms) = quantize_blocks(rmsnorm(x, weight, eps)):
    E4M3 codes (..., N) uint8 and scales (..., ceil(N/block)) (float32, or
    E8M0 bytes for 'ue8m0') of the rounded y."""
    x = np.asarray(x, dtype=F32)
    _check_width(x.shape[-1], "x")
    y, inv = rmsnorm(x, weight, eps, dtype, inv_rms)
    return (*fp8_blocks.quantize_blocks(y, block, scale_format), inv)


def mhc_rmsnorm_quantize_fp8(X, A, weight, eps: float = 1e-6, block: int = 128, scale_format: str = "fp32",
                             dtype: str = "bfloat16", inv_rms=None):
    """(codes, scales, inv_rms) = quantize_blocks(rmsnorm(mhc_mix(X, A)))."""
    X = np.asarray(X, dtype=F32)
    _check_width(X.shape[-1], "x")
    return rmsnorm_quantize_fp8(mhc_mix(X, A, dtype), weight, eps, block, scale_format, dtype, inv_rms)


def swiglu_quantize_fp8(h, granularity: int = 8, block: int = 128, scale_format: str = "fp32",
                        dtype: str = "bfloat16"):
    """(codes, scales) = quantize_blocks(swiglu(h, granularity))."""
    h = np.asarray(h, dtype=F32)
    _check_width(h.shape[-1] // 2, "h (the intermediate width, h.shape[-1] / 2)")
    return fp8_blocks.quantize_blocks(swiglu(h, granularity, dtype), block, scale_format)


def moe_stage_fp8(hidden, topk_ids, topk_weights, block: int = 128, scale_format: str = "fp32"):
    """(codes, scales, ids_i64, weights): quantize_blocks of `hidden` (M, K),
    K a positive multiple of 128 (as moe_stage); top-k ids widened to int64,
    top-k weights copied unchanged."""
    x = _moe_hidden(hidden)
    codes, scales = fp8_blocks.quantize_blocks(x, block, scale_format)
    return codes, scales, np.asarray(topk_ids).astype(np.int64), np.array(topk_weights)


def dequantize_activation(q, sf, gs, dtype: str = "bfloat16") -> np.ndarray:
    """Decode a QuantizedActivation's parts (gs scalar or per row)."""
    return dequantize(q, sf, gs, dtype)
