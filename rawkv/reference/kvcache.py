"""DeepSeek-V4 compressed KV cache (CSA and HCA): the numpy reference.

This module *defines* what the compressed-KV kernels compute (SPEC sections 3
and 3a). docs/kvcache.md gives the public sources the equations were checked
against and every decision taken where the sources are silent.

Pipeline of one compressed entry (one layer, one request):

    kv_t, z_t  (per token, width coff*d)            caller's GEMMs
      -> softmax pooling over the window             compress_csa / compress_hca
         (decode: tail state, state_pool)
      -> RMSNorm(weight, eps=1e-6)                   rmsnorm
      -> RoPE on the last 64 dims at position i*m    apply_rope
      -> (indexer key only) Hadamard rotation        hadamard_rotate
      -> BF16                                        finish_entry / finish_index_key
      -> quantize + write into the paged pool        flush_write
      -> read back as BF16 rows                      gather_dense / gather_topk

Conventions: float arrays are float32; "BF16" arrays are float32 arrays that
hold exactly BF16-representable values (numpy has no bfloat16); codes and
scale bytes are uint8. Functions that take device-style indices (block
tables, slot ids, top-k ids) never read or write out of bounds: they skip the
row and return an error count, like the kernels' error counters (SPEC 4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .formats import (
    bf16_round, e2m1_decode, e4m3_decode, e4m3_encode,
    round_to_dtype,
)
from .nvfp4 import quantize as nvfp4_quantize

# ---------------------------------------------------------------------------
# Model constants (DeepSeek-V4 config.json / inference/model.py)
# ---------------------------------------------------------------------------
HEAD_DIM = 512            # attention cache entry width
ROPE_DIM = 64             # last 64 dims carry RoPE (qk_rope_head_dim)
NOPE_DIM = HEAD_DIM - ROPE_DIM
INDEX_HEAD_DIM = 128      # CSA indexer key width
CSA_RATIO = 4             # m for CSA (overlapping windows, coff = 2)
HCA_RATIO = 128           # m for HCA (one stream, coff = 1)
RMS_EPS = 1e-6
COMPRESS_ROPE_THETA = 160000.0
FP8_MAX = 448.0
NVFP4_BLOCK = 16
#: z of a score row that holds no token (b-stream before the first window,
#: cleared a-stream rows): exp(-inf - max) = 0 exactly, so it never counts.
Z_EMPTY = np.float32(-np.inf)


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation (no magnitude scaling: the reference
    builds cos/sin with unit modulus)."""
    factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float


#: rope_scaling of DeepSeek-V4-Flash/Pro config.json; the compressed (CSA/HCA)
#: layers use it together with compress_rope_theta.
DSV4_YARN = YarnConfig(factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0)


# ---------------------------------------------------------------------------
# argument checks (SPEC 4: name the argument, write nothing)
# ---------------------------------------------------------------------------
def _f32(name: str, x, last: int | None = None, ndim: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a real numeric array, got dtype {a.dtype}")
    a = a.astype(np.float32, copy=False)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if a.ndim == 0:
        raise ValueError(f"{name}: expected an array, got a scalar")
    if last is not None and a.shape[-1] != last:
        raise ValueError(f"{name}: last dimension must be {last}, got shape {a.shape}")
    return a


def _ints(name: str, x, ndim: int | None = None) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    return a.astype(np.int64)


def _mask(name: str, x, n: int) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.bool_:
        raise TypeError(f"{name}: expected a bool array, got dtype {a.dtype}")
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
    return a


# ---------------------------------------------------------------------------
# softmax pooling
# ---------------------------------------------------------------------------
def _softmax_pool(values: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Per-channel softmax over the token axis (-2), then the weighted sum.

    values, scores: (..., R, d) float32 -> (..., d) float32.
    float32 throughout; exp is taken in float64 and rounded once so the
    result does not depend on numpy's SIMD/scalar exp paths; sums run over
    the R rows in order. A column whose scores are all -inf gives NaN
    (never happens for a full window: the a-stream is finite).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        mx = scores.max(axis=-2, keepdims=True)
        e = np.exp((scores - mx).astype(np.float64)).astype(np.float32)
        w = e / e.sum(axis=-2, keepdims=True, dtype=np.float32)
        return (w * values).sum(axis=-2, dtype=np.float32)


def _add_ape(z: np.ndarray, ape, m: int) -> np.ndarray:
    """z (T, w) + ape[t mod m]: the learned position bias of the gate."""
    if ape is None:
        return z
    ape = _f32("ape", ape, last=z.shape[-1], ndim=2)
    if ape.shape[0] != m:
        raise ValueError(f"ape: expected shape ({m}, {z.shape[-1]}), got {ape.shape}")
    return z + ape[np.arange(z.shape[0]) % m]


def _check_rows(kv, z):
    kv = _f32("kv", kv, ndim=2)
    z = _f32("z", z, ndim=2)
    if z.shape != kv.shape:
        raise ValueError(f"z: expected the shape of kv {kv.shape}, got {z.shape}")
    return kv, z


def compress_csa(kv, z, ape=None, m: int = CSA_RATIO) -> np.ndarray:
    """CSA pooling of a token sequence that starts at position 0.

    kv, z: (T, 2*d) per-token value and gate rows. Channel layout of a row:
        [:d]  b-half: pooled into the entry of the NEXT window (overlap)
        [d:]  a-half: pooled into the entry of its own window
    ape: (m, 2*d) or None; ape[t mod m] is added to z_t (pass None when z
        already holds it).
    Returns (T // m, d) float32 pooled entries, before RMSNorm. Entry i pools
    2m scores per channel with one softmax, in this row order:
        b-half of tokens of window i-1 (all -inf / 0 for i = 0), then
        a-half of tokens of window i.
    A trailing partial window (T % m tokens) is not pooled (it lives in the
    decode tail state).
    """
    kv, z = _check_rows(kv, z)
    if kv.shape[1] % 2:
        raise ValueError(f"kv: CSA rows have width 2*d, got odd width {kv.shape[1]}")
    T, w = kv.shape
    d = w // 2
    z = _add_ape(z, ape, m)
    n = T // m
    kv = kv[: n * m].reshape(n, m, w)
    z = z[: n * m].reshape(n, m, w)
    b_kv = np.zeros((n, m, d), np.float32)
    b_z = np.full((n, m, d), Z_EMPTY, np.float32)
    b_kv[1:] = kv[:-1, :, :d]
    b_z[1:] = z[:-1, :, :d]
    values = np.concatenate([b_kv, kv[:, :, d:]], axis=1)
    scores = np.concatenate([b_z, z[:, :, d:]], axis=1)
    return _softmax_pool(values, scores)


def compress_hca(kv, z, ape=None, m: int = HCA_RATIO) -> np.ndarray:
    """HCA pooling of a token sequence that starts at position 0.

    kv, z: (T, d); ape: (m, d) or None. Returns (T // m, d) float32: entry i
    is the per-channel softmax(z) weighted sum over the m tokens of window i.
    """
    kv, z = _check_rows(kv, z)
    T, d = kv.shape
    z = _add_ape(z, ape, m)
    n = T // m
    return _softmax_pool(kv[: n * m].reshape(n, m, d), z[: n * m].reshape(n, m, d))


# ---------------------------------------------------------------------------
# RMSNorm, RoPE, Hadamard
# ---------------------------------------------------------------------------
def rmsnorm(x, weight, eps: float = RMS_EPS) -> np.ndarray:
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last axis.

    x: (..., d); weight: (d,). The mean of squares is accumulated in float64
    and the reciprocal root rounded once to float32; the two products are
    float32, in the order (x * r) * weight, as in the DeepSeek-V4 reference.
    """
    x = _f32("x", x)
    weight = _f32("weight", weight, last=x.shape[-1], ndim=1)
    ms = np.mean(np.square(x.astype(np.float64)), axis=-1, keepdims=True)
    r = (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    return (x * r) * weight


def rope_inv_freq(rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
                  yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """(rope_dim // 2,) float32 inverse frequencies theta^(-2k/rope_dim),
    with YaRN interpolation when `yarn` is given (DeepSeek-V4
    precompute_freqs_cis: dims rotating faster than beta_fast turns over the
    original context keep their frequency, those slower than beta_slow are
    divided by `factor`, linear ramp between). Computed in float64, rounded
    once."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim: expected a positive even number, got {rope_dim}")
    k = np.arange(0, rope_dim, 2, dtype=np.float64)
    inv = 1.0 / (float(theta) ** (k / rope_dim))
    if yarn is not None:
        def corr_dim(n_rot):
            return (rope_dim * math.log(yarn.original_seq_len / (n_rot * 2 * math.pi))
                    / (2 * math.log(theta)))
        low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rope_dim // 2) - low) / (high - low), 0.0, 1.0)
        smooth = 1.0 - ramp
        inv = inv / yarn.factor * (1.0 - smooth) + inv * smooth
    return inv.astype(np.float32)


def rope_cos_sin(positions, rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
                 yarn: YarnConfig | None = DSV4_YARN):
    """cos, sin tables: (..., rope_dim // 2) float32 for integer positions
    (...). Angle = position * inv_freq (float32 inv_freq, product and cos/sin
    in float64, rounded once). Kernels should read this host-built table."""
    pos = _ints("positions", positions).astype(np.float64)
    ang = pos[..., None] * rope_inv_freq(rope_dim, theta, yarn).astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x, positions, rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
               yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """Rotate the last `rope_dim` dims of x (..., D) at `positions` (...).

    Interleaved pairs (GPT-J style, the DeepSeek reference's view_as_complex
    of (..., 32, 2)): pair k = dims (D - rope_dim + 2k, D - rope_dim + 2k + 1),
        even' = even*cos - odd*sin,  odd' = odd*cos + even*sin   (float32).
    Other dims are copied unchanged. Returns a new float32 array.
    """
    x = _f32("x", x)
    if rope_dim > x.shape[-1]:
        raise ValueError(f"x: last dimension {x.shape[-1]} is smaller than rope_dim {rope_dim}")
    pos = _ints("positions", positions)
    if pos.shape != x.shape[:-1]:
        raise ValueError(f"positions: expected shape {x.shape[:-1]}, got {pos.shape}")
    cos, sin = rope_cos_sin(pos, rope_dim, theta, yarn)
    y = x.copy()
    r = x[..., x.shape[-1] - rope_dim:]
    ev, od = r[..., 0::2], r[..., 1::2]
    y[..., x.shape[-1] - rope_dim::2] = ev * cos - od * sin
    y[..., x.shape[-1] - rope_dim + 1::2] = od * cos + ev * sin
    return y


def hadamard_matrix(n: int = INDEX_HEAD_DIM) -> np.ndarray:
    """Sylvester-ordered Walsh-Hadamard matrix H[i, j] = (-1)^popcount(i & j),
    float64, unnormalized (the ordering of fast_hadamard_transform)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return np.where(parity == 1, -1.0, 1.0)


def hadamard_rotate(x) -> np.ndarray:
    """Normalized Walsh-Hadamard transform over the last axis (power of two,
    128 for the indexer key): y = x @ H / sqrt(n). H is symmetric and
    orthonormal after scaling, so the transform is its own inverse.
    Computed in float64, rounded once to float32."""
    x = _f32("x", x)
    n = x.shape[-1]
    h = hadamard_matrix(n)
    return ((x.astype(np.float64) @ h) * (1.0 / math.sqrt(n))).astype(np.float32)


def entry_position(entry_ids, m: int) -> np.ndarray:
    """RoPE position of compressed entry i: i * m, the first token of its
    window (DeepSeek reference freqs_cis[start_pos + 1 - m]; vLLM
    (position // m) * m)."""
    return _ints("entry_ids", entry_ids) * m


def finish_entry(pooled, norm_weight, entry_ids, m: int, *, eps: float = RMS_EPS,
                 rope_dim: int = ROPE_DIM, theta: float = COMPRESS_ROPE_THETA,
                 yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """Pooled (n, 512) -> cache entry (n, 512) BF16 values: RMSNorm, RoPE on
    the last 64 dims at entry_position(entry_ids, m), one BF16 rounding."""
    y = rmsnorm(pooled, norm_weight, eps)
    y = apply_rope(y, entry_position(entry_ids, m), rope_dim, theta, yarn)
    return bf16_round(y)


def finish_index_key(pooled, norm_weight, entry_ids, m: int = CSA_RATIO, *,
                     eps: float = RMS_EPS, rope_dim: int = ROPE_DIM,
                     theta: float = COMPRESS_ROPE_THETA,
                     yarn: YarnConfig | None = DSV4_YARN) -> np.ndarray:
    """Pooled (n, 128) indexer rows -> indexer key (n, 128) BF16 values:
    RMSNorm, RoPE (last 64 dims), Hadamard rotation of all 128 dims, BF16."""
    y = rmsnorm(pooled, norm_weight, eps)
    y = apply_rope(y, entry_position(entry_ids, m), rope_dim, theta, yarn)
    return bf16_round(hadamard_rotate(y))


# ---------------------------------------------------------------------------
# FP8 entry (SPEC 3): 448 E4M3 + one FP32 decode scale, 64 BF16 RoPE dims
# ---------------------------------------------------------------------------
def fp8_entry_quantize(entry, rope_dim: int = ROPE_DIM):
    """entry (..., D) float32 -> (codes, scale, rope).

    codes: (..., D - rope_dim) uint8 E4M3 of the non-RoPE dims,
    scale: (...,) float32 decode scale s = amax / 448.0f (1.0 if that is 0:
           amax == 0, or an amax so small that the division underflows),
    rope:  (..., rope_dim) float32 holding the BF16-rounded RoPE dims.
    q = e4m3(x / s), float32 IEEE division, RNE, satfinite.
    An entry whose non-RoPE dims hold NaN or +-Inf gets s = NaN and codes 0
    (it decodes to NaN: bad data stays visible, as SPEC 2 rule 5).
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
# CSA indexer key: one-level NVFP4 (SPEC 2 with gs = 1)
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


# ---------------------------------------------------------------------------
# paged pool
# ---------------------------------------------------------------------------
@dataclass
class PagedPoolRef:
    """Paged pool of one compressed layer: `num_blocks` physical blocks of
    `entries_per_block` entries. Entry e of a request lives in physical block
    block_table[e // entries_per_block], slot e % entries_per_block, and
    e = position // m.

    kv_fp8   (num_blocks, epb, 448) uint8    E4M3 codes of the non-RoPE dims
    kv_scale (num_blocks, epb)      float32  FP8 decode scale
    kv_rope  (num_blocks, epb, 64)  float32  BF16 values of the RoPE dims
    idx_q    (num_blocks, epb, 64)  uint8    CSA only: indexer key E2M1 pairs
    idx_sf   (num_blocks, epb, 8)   uint8    CSA only: indexer UE4M3 scales
    """
    m: int
    kv_fp8: np.ndarray
    kv_scale: np.ndarray
    kv_rope: np.ndarray
    idx_q: np.ndarray | None = None
    idx_sf: np.ndarray | None = None

    @classmethod
    def create(cls, num_blocks: int, entries_per_block: int, m: int,
               head_dim: int = HEAD_DIM, rope_dim: int = ROPE_DIM,
               index_head_dim: int | None = None) -> "PagedPoolRef":
        """Zero-filled pool; pass index_head_dim=128 for a CSA layer."""
        if num_blocks <= 0 or entries_per_block <= 0 or m <= 0:
            raise ValueError("num_blocks, entries_per_block, m: expected positive sizes")
        shp = (num_blocks, entries_per_block)
        pool = cls(m=m,
                   kv_fp8=np.zeros(shp + (head_dim - rope_dim,), np.uint8),
                   kv_scale=np.zeros(shp, np.float32),
                   kv_rope=np.zeros(shp + (rope_dim,), np.float32))
        if index_head_dim is not None:
            if index_head_dim % NVFP4_BLOCK:
                raise ValueError(f"index_head_dim: expected a multiple of 16, got {index_head_dim}")
            pool.idx_q = np.zeros(shp + (index_head_dim // 2,), np.uint8)
            pool.idx_sf = np.zeros(shp + (index_head_dim // NVFP4_BLOCK,), np.uint8)
        return pool

    @property
    def num_blocks(self) -> int:
        return self.kv_fp8.shape[0]

    @property
    def entries_per_block(self) -> int:
        return self.kv_fp8.shape[1]

    @property
    def rope_dim(self) -> int:
        return self.kv_rope.shape[2]

    @property
    def head_dim(self) -> int:
        return self.kv_fp8.shape[2] + self.kv_rope.shape[2]

    @property
    def index_head_dim(self) -> int | None:
        return None if self.idx_q is None else self.idx_q.shape[2] * 2

    def copy(self) -> "PagedPoolRef":
        c = lambda a: None if a is None else a.copy()  # noqa: E731
        return PagedPoolRef(self.m, c(self.kv_fp8), c(self.kv_scale), c(self.kv_rope),
                            c(self.idx_q), c(self.idx_sf))


def _locate(pool: PagedPoolRef, table_row: np.ndarray, entry_id: int):
    """(physical block, slot) of entry `entry_id`, or None when the entry id,
    the logical block or the physical block id is out of range."""
    if entry_id < 0:
        return None
    lb, slot = divmod(int(entry_id), pool.entries_per_block)
    if lb >= table_row.shape[0]:
        return None
    blk = int(table_row[lb])
    if blk < 0 or blk >= pool.num_blocks:
        return None
    return blk, slot


def flush_write(pool: PagedPoolRef, entries, valid_mask, positions, block_table,
                index_keys=None) -> int:
    """Quantize and scatter one finished entry per batch row into the pool.

    entries:     (B, head_dim) float32 (finish_entry output)
    valid_mask:  (B,) bool; rows with False are skipped silently (no flush
                 this step)
    positions:   (B,) int; entry id = position // m (any position inside the
                 window, normally its last token)
    block_table: (B, max_blocks) int; row b is the block table of the request
                 in batch row b
    index_keys:  (B, index_head_dim) float32, required iff the pool is CSA
                 (finish_index_key output)
    Returns the number of valid rows skipped because the position is
    negative, the logical block is past the block table, or the physical
    block id is outside [0, num_blocks): nothing is written for them.
    Rows are written in batch order (two rows aimed at one entry: last wins;
    kernels leave that undefined, callers must not do it).
    """
    entries = _f32("entries", entries, last=pool.head_dim, ndim=2)
    B = entries.shape[0]
    valid_mask = _mask("valid_mask", valid_mask, B)
    positions = _ints("positions", positions, ndim=1)
    if positions.shape != (B,):
        raise ValueError(f"positions: expected shape ({B},), got {positions.shape}")
    block_table = _ints("block_table", block_table, ndim=2)
    if block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows, got shape {block_table.shape}")
    if (pool.idx_q is None) != (index_keys is None):
        raise ValueError("index_keys: required for a CSA pool (with indexer) and only for it")
    codes, scale, rope = fp8_entry_quantize(entries, pool.rope_dim)
    if index_keys is not None:
        index_keys = _f32("index_keys", index_keys, last=pool.index_head_dim, ndim=2)
        if index_keys.shape[0] != B:
            raise ValueError(f"index_keys: expected {B} rows, got shape {index_keys.shape}")
        iq, isf = indexer_key_quantize(index_keys)
    errors = 0
    for b in range(B):
        if not valid_mask[b]:
            continue
        pos = int(positions[b])
        loc = _locate(pool, block_table[b], pos // pool.m) if pos >= 0 else None
        if loc is None:
            errors += 1
            continue
        pool.kv_fp8[loc] = codes[b]
        pool.kv_scale[loc] = scale[b]
        pool.kv_rope[loc] = rope[b]
        if index_keys is not None:
            pool.idx_q[loc] = iq[b]
            pool.idx_sf[loc] = isf[b]
    return errors


def _read_entries(pool: PagedPoolRef, table_row, ids, n_entries, pad_ok: bool, dtype: str,
                  index: bool = False):
    """Decode entries `ids` (k,) of one request; out-of-range rows are zero.
    Returns (rows (k, width), errors)."""
    width = pool.index_head_dim if index else pool.head_dim
    out = np.zeros((ids.shape[0], width), np.float32)
    errors = 0
    for j, e in enumerate(ids):
        e = int(e)
        if pad_ok and e == -1:
            continue
        loc = None if (n_entries is not None and e >= n_entries) else _locate(pool, table_row, e)
        if loc is None:
            errors += 1
            continue
        if index:
            out[j] = indexer_key_dequantize(pool.idx_q[loc], pool.idx_sf[loc], dtype)
        else:
            out[j] = fp8_entry_dequantize(pool.kv_fp8[loc], pool.kv_scale[loc],
                                          pool.kv_rope[loc], dtype)
    return out, errors


def gather_dense(pool: PagedPoolRef, block_table_row, n_entries: int,
                 dtype: str = "bfloat16", *, written: int | None = None):
    """HCA reader: entries 0 .. n_entries-1 of one request -> (rows, errors).

    block_table_row: (max_blocks,) int. rows: (n_entries, head_dim) float32
    holding `dtype` values (BF16 by default). An entry whose block is out of
    range is a zero row and counts one error. written: the number of entries
    the request has written (None: no bound); entry ids >= written would read
    bytes the request never wrote (a previous owner's, after block reuse), so
    they are zero rows and count one error each.
    """
    row = _ints("block_table_row", block_table_row, ndim=1)
    if n_entries < 0:
        raise ValueError(f"n_entries: expected >= 0, got {n_entries}")
    return _read_entries(pool, row, np.arange(n_entries), written, False, dtype)


def gather_topk(pool: PagedPoolRef, block_table, topk_ids, n_entries=None,
                dtype: str = "bfloat16"):
    """CSA reader: selected entry ids -> (rows, errors).

    block_table: (..., max_blocks) int; topk_ids: (..., k) int with the same
    leading shape (one row per request / query); n_entries: (...,) int or
    None, the number of entries each request has written.
    rows: (..., k, head_dim) float32 (`dtype` values). id -1 is padding: zero
    row, no error. Any other id that is negative, >= n_entries, or maps to an
    out-of-range block gives a zero row and counts one error.
    """
    table = _ints("block_table", block_table)
    ids = _ints("topk_ids", topk_ids)
    if table.ndim < 1 or ids.ndim < 1 or table.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"block_table, topk_ids: leading shapes differ: {table.shape}, {ids.shape}")
    lead = ids.shape[:-1]
    ne = None
    if n_entries is not None:
        ne = _ints("n_entries", n_entries)
        if ne.shape != lead:
            raise ValueError(f"n_entries: expected shape {lead}, got {ne.shape}")
    rows = np.zeros(ids.shape + (pool.head_dim,), np.float32)
    errors = 0
    for idx in np.ndindex(*lead):
        rows[idx], e = _read_entries(pool, table[idx], ids[idx],
                                     None if ne is None else int(ne[idx]), True, dtype)
        errors += e
    return rows, errors


def gather_index_keys(pool: PagedPoolRef, block_table_row, n_entries: int,
                      dtype: str = "bfloat16", *, written: int | None = None):
    """CSA indexer reader: the indexer keys of entries 0 .. n_entries-1 of one
    request -> (keys (n_entries, 128), errors); same rules as gather_dense."""
    if pool.idx_q is None:
        raise ValueError("pool: has no indexer keys (not a CSA pool)")
    row = _ints("block_table_row", block_table_row, ndim=1)
    if n_entries < 0:
        raise ValueError(f"n_entries: expected >= 0, got {n_entries}")
    return _read_entries(pool, row, np.arange(n_entries), written, False, dtype, index=True)


# ---------------------------------------------------------------------------
# decode state (tail buffers)
# ---------------------------------------------------------------------------
@dataclass
class DecodeStateRef:
    """Per-request tail buffers of one compressor, indexed by slot.

    a_kv, a_z (S, m, coff*d) float32: the full rows of the window in
        progress (z with ape added). CSA keeps both halves: the a-half is
        pooled at this window's flush, the b-half is kept for the next one.
    b_kv, b_z (S, m, d) float32 (CSA only): the b-half of the previous window.
    count (S,) int32: rows of the a-stream filled so far.
    Empty rows hold kv = 0 and z = -inf (Z_EMPTY), so an empty b-stream (first
    window) gets weight exactly 0.
    """
    m: int
    head_dim: int
    a_kv: np.ndarray
    a_z: np.ndarray
    count: np.ndarray
    b_kv: np.ndarray | None = None
    b_z: np.ndarray | None = None

    @property
    def overlap(self) -> bool:
        return self.b_kv is not None

    @property
    def num_slots(self) -> int:
        return self.count.shape[0]

    @classmethod
    def create(cls, kind: str, num_slots: int, head_dim: int, m: int | None = None) -> "DecodeStateRef":
        """kind 'csa' (m = 4, overlap) or 'hca' (m = 128); all slots empty."""
        if kind not in ("csa", "hca"):
            raise ValueError(f"kind: expected 'csa' or 'hca', got {kind!r}")
        m = m or (CSA_RATIO if kind == "csa" else HCA_RATIO)
        w = 2 * head_dim if kind == "csa" else head_dim
        st = cls(m=m, head_dim=head_dim,
                 a_kv=np.zeros((num_slots, m, w), np.float32),
                 a_z=np.full((num_slots, m, w), Z_EMPTY, np.float32),
                 count=np.zeros(num_slots, np.int32))
        if kind == "csa":
            st.b_kv = np.zeros((num_slots, m, head_dim), np.float32)
            st.b_z = np.full((num_slots, m, head_dim), Z_EMPTY, np.float32)
        return st

    def copy(self) -> "DecodeStateRef":
        c = lambda a: None if a is None else a.copy()  # noqa: E731
        return DecodeStateRef(self.m, self.head_dim, self.a_kv.copy(), self.a_z.copy(),
                              self.count.copy(), c(self.b_kv), c(self.b_z))


def _slot_ok(state: DecodeStateRef, s: int) -> bool:
    return 0 <= s < state.num_slots


def _clear_a(state: DecodeStateRef, s: int) -> None:
    state.a_kv[s] = 0.0
    state.a_z[s] = Z_EMPTY
    state.count[s] = 0


def _slots_and_mask(state, valid_mask, slots):
    slots = _ints("slots", slots, ndim=1)
    return _mask("valid_mask", valid_mask, slots.shape[0]), slots


def state_clear(state: DecodeStateRef, slots) -> int:
    """New request in `slots` (B,): both streams emptied, count 0.
    Returns the number of out-of-range slots (skipped)."""
    slots = _ints("slots", slots, ndim=1)
    errors = 0
    for s in slots:
        if not _slot_ok(state, int(s)):
            errors += 1
            continue
        _clear_a(state, int(s))
        if state.overlap:
            state.b_kv[s] = 0.0
            state.b_z[s] = Z_EMPTY
    return errors


def state_seed(state: DecodeStateRef, slot: int, kv, z, ape=None) -> None:
    """Decode state of a request admitted after prefilling its prompt.

    slot: host int; kv, z (T, coff*d): the prompt's token rows, row 0 at a
    window boundary (the whole prompt is always right; a suffix must start at
    a multiple of m and, for CSA, hold the last full window). ape (m, coff*d)
    or None. The slot is emptied (as state_clear), then, with n = T // m
    full windows and r = T % m trailing rows:
      CSA, n >= 1: b-stream = b-half [0:d] of window n-1 (z + ape[j]);
      a-stream rows 0..r-1 = the trailing rows (z + ape[j]); count = r.
    This is exactly the state that state_clear followed by state_append of
    every row and csa_rotate / hca_reset after each full window leaves (the
    tests check that). Nothing else is touched.
    """
    if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot: expected an int, got {type(slot).__name__}")
    if not _slot_ok(state, int(slot)):
        raise ValueError(f"slot: {slot} is out of range [0, {state.num_slots})")
    s, m, d = int(slot), state.m, state.head_dim
    w = state.a_kv.shape[2]
    kv = _f32("kv", kv, last=w, ndim=2)
    z = _f32("z", z, last=w, ndim=2)
    if z.shape != kv.shape:
        raise ValueError(f"z: expected the shape of kv {kv.shape}, got {z.shape}")
    if ape is not None:
        ape = _f32("ape", ape, ndim=2)
        if ape.shape != (m, w):
            raise ValueError(f"ape: expected shape ({m}, {w}), got {ape.shape}")
    n, r = divmod(kv.shape[0], m)
    state_clear(state, np.array([s]))
    if state.overlap and n >= 1:
        rows = slice((n - 1) * m, n * m)
        state.b_kv[s] = kv[rows, :d]
        state.b_z[s] = z[rows, :d] if ape is None else z[rows, :d] + ape[:, :d]
    state.a_kv[s, :r] = kv[n * m:]
    state.a_z[s, :r] = z[n * m:] if ape is None else z[n * m:] + ape[:r]
    state.count[s] = r


def state_append(state: DecodeStateRef, kv, z, valid_mask, slots, ape=None) -> int:
    """Append one token row per batch row to its request's a-stream.

    kv, z: (B, coff*d) float32; valid_mask (B,) bool; slots (B,) int;
    ape: (m, coff*d) or None, ape[count] is added to z (count == t mod m for
    windows aligned at multiples of m). Returns the number of valid rows
    skipped: slot out of range, or window already full (count == m: the
    caller missed a flush).
    """
    valid_mask, slots = _slots_and_mask(state, valid_mask, slots)
    w = state.a_kv.shape[2]
    kv = _f32("kv", kv, last=w, ndim=2)
    z = _f32("z", z, last=w, ndim=2)
    if kv.shape[0] != slots.shape[0] or z.shape != kv.shape:
        raise ValueError(f"kv, z: expected ({slots.shape[0]}, {w}), got {kv.shape}, {z.shape}")
    if ape is not None:
        ape = _f32("ape", ape, ndim=2)
        if ape.shape != (state.m, w):
            raise ValueError(f"ape: expected shape ({state.m}, {w}), got {ape.shape}")
    errors = 0
    for b, s in enumerate(slots):
        if not valid_mask[b]:
            continue
        s = int(s)
        if not _slot_ok(state, s) or state.count[s] >= state.m:
            errors += 1
            continue
        r = int(state.count[s])
        state.a_kv[s, r] = kv[b]
        state.a_z[s, r] = z[b] if ape is None else z[b] + ape[r]
        state.count[s] = r + 1
    return errors


def state_pool(state: DecodeStateRef, slots) -> np.ndarray:
    """Pool the window held in `slots` (B,) -> (B, d) float32 (before RMSNorm).

    Same arithmetic and row order as compress_csa / compress_hca, so a full
    window pools bit-identically to the prefill path. Unfilled a-rows have
    z = -inf and weigh 0. Out-of-range slots give NaN rows (callers check
    slots first; flush kernels count them).
    """
    slots = _ints("slots", slots, ndim=1)
    d = state.head_dim
    ok = (slots >= 0) & (slots < state.num_slots)
    sl = np.where(ok, slots, 0)
    if state.overlap:
        values = np.concatenate([state.b_kv[sl], state.a_kv[sl][:, :, d:]], axis=1)
        scores = np.concatenate([state.b_z[sl], state.a_z[sl][:, :, d:]], axis=1)
    else:
        values, scores = state.a_kv[sl], state.a_z[sl]
    out = _softmax_pool(values, scores)
    out[~ok] = np.nan
    return out


def csa_rotate(state: DecodeStateRef, valid_mask, slots) -> int:
    """After a CSA flush: b <- b-half of the a rows, a emptied (kv 0, z -inf),
    count 0, for each valid row. Returns the number of valid rows whose slot
    is out of range (skipped). Slots must be distinct among valid rows."""
    if not state.overlap:
        raise ValueError("state: csa_rotate needs a CSA (overlap) state")
    valid_mask, slots = _slots_and_mask(state, valid_mask, slots)
    d = state.head_dim
    errors = 0
    for b, s in enumerate(slots):
        if not valid_mask[b]:
            continue
        s = int(s)
        if not _slot_ok(state, s):
            errors += 1
            continue
        state.b_kv[s] = state.a_kv[s, :, :d]
        state.b_z[s] = state.a_z[s, :, :d]
        _clear_a(state, s)
    return errors


def hca_reset(state: DecodeStateRef, valid_mask, slots) -> int:
    """After an HCA flush: a emptied (kv 0, z -inf), count 0, for each valid
    row. Returns the number of valid rows whose slot is out of range."""
    if state.overlap:
        raise ValueError("state: hca_reset needs an HCA state (use csa_rotate for CSA)")
    valid_mask, slots = _slots_and_mask(state, valid_mask, slots)
    errors = 0
    for b, s in enumerate(slots):
        if not valid_mask[b]:
            continue
        s = int(s)
        if not _slot_ok(state, s):
            errors += 1
            continue
        _clear_a(state, s)
    return errors
