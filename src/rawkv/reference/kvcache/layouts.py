"""The byte layouts the ecosystem's DeepSeek-V4 kernels read (docs/kvcache.md,
"Ecosystem layouts"): the definition, in numpy.

* MODEL1_FP8Sparse attention entry (FlashMLA sparse decode, vLLM, SGLang):
  512 dims = 448 "nope" dims as E4M3 in 7 tiles of 64, each with a UE8M0
  scale, + 64 RoPE dims as BF16. 576 data bytes + 8 scale bytes (7 + 1 zero
  pad) per entry; also the format of the sliding-window tokens.
* FP8 indexer key (DeepGEMM's paged MQA logits, SM90): 128 E4M3 codes + one
  FP32 scale (a power of two) per key: 132 bytes.
* MXFP4 indexer key (DeepSeek's trained format, SM100): 128 dims as E2M1 in
  4 blocks of 32, each with a UE8M0 scale: 64 code bytes + 4 scale bytes.
* MXFP8 indexer key (DeepGEMM's SM100 paged MQA logits with an int32 UE8M0
  query scale, and its SM100 sparse paged logits): 128 E4M3 codes in 4
  blocks of 32, each with a UE8M0 scale: 128 code bytes + 4 scale bytes.

Every layout is "split": a page of P records holds the P data records
[P x data_bytes] then the P scale records [P x scale_bytes], then zero padding
up to a multiple of the layout's alignment (576 for MODEL1, 512 for the
MXFP8 key, whose sparse reader wants 512-byte page strides; none for the
FP8 and MXFP4 keys). A cache is a (num_pages, page_bytes) uint8 array; record
`o` of page `p` is slot p * P + o (the slot mapping engines use).

Quantization rules (the sources and the decisions are in docs/kvcache.md):
the input is rounded to BF16 first; a block's scale is 2^e with
e = ceil(log2(max(amax, floor) / fmax)), computed exactly (ceil_log2 of the
IEEE float32 quotient, which for a normal quotient is the exact ceiling);
its UE8M0 byte is e + 127; codes = round(x * 2^-e) (RNE, E4M3 satfinite or
E2M1 saturating at 6). A block holding NaN or +-Inf gets codes 0 and scale
byte 0xFF (UE8M0 NaN; the FP8 indexer: a NaN float32 scale): it decodes to
NaN. Decoding multiplies in float32 (exact: every product of an E4M3/E2M1
value and a power of two is a float32 or overflows), then rounds to the
output dtype.

Functions that take device-style indices (slots, pages, block tables,
top-k ids) never read or write out of bounds: a bad row is skipped and
counted in the returned error count, like the kernels' error counters.
Index -1 is padding: skipped, not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import (
    bf16_bits, bf16_round, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, round_to_dtype,
)
from ._checks import _f32, _ints

F32 = np.float32

ENTRY_DIM = 512            # MODEL1 entry: nope + rope
NOPE_DIM = 448
ROPE_DIM = 64
FP8_TILE = 64              # MODEL1 quantization tile
FP8_TILES = NOPE_DIM // FP8_TILE
INDEX_DIM = 128            # indexer key
MXFP4_BLOCK = 32
MXFP4_BLOCKS = INDEX_DIM // MXFP4_BLOCK
MXFP8_BLOCK = 32           # DeepGEMM per_token_cast_to_fp8(gran_k=32)
MXFP8_BLOCKS = INDEX_DIM // MXFP8_BLOCK
#: DeepGEMM's SM100 paged sparse MQA logits asserts fused_kv_cache.stride(0)
#: % 512 == 0 (csrc/apis/attention.hpp at e824173): the MXFP8 key page is
#: padded to it (P = 64: 8,448 -> 8,704 bytes; P = 128: no padding)
MXFP8_PAGE_ALIGN = 512

FP8_MAX = F32(448.0)
E2M1_MAX = F32(6.0)
#: amax floors: DeepSeek act_quant / vLLM (FP8), DeepSeek fp4_act_quant (MXFP4)
FP8_AMAX_FLOOR = F32(1e-4)
MXFP4_AMAX_FLOOR = F32(6.0 * 2.0 ** -126)
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF
#: FlashMLA's indices_in_kvcache are int32: page * page_size + offset must fit.
INDEX_LIMIT = 2 ** 31 - 1


@dataclass(frozen=True)
class SplitLayout:
    """A page of P records: [P x data_bytes] [P x scale_bytes] [zero pad to
    a multiple of align]."""
    name: str
    data_bytes: int
    scale_bytes: int
    align: int = 1

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of `page_size` records (the page stride)."""
        p = _page_size(page_size)
        raw = p * (self.data_bytes + self.scale_bytes)
        return -(-raw // self.align) * self.align

    def scale_offset(self, page_size: int) -> int:
        """Byte offset of the scale records inside a page."""
        return _page_size(page_size) * self.data_bytes


#: FlashMLA MODEL1_FP8Sparse: 448 E4M3 + 64 BF16 (576 B) | 7 UE8M0 + 1 zero (8 B)
MODEL1 = SplitLayout("model1", NOPE_DIM + 2 * ROPE_DIM, FP8_TILES + 1, 576)
#: DeepGEMM SM90 paged FP8 key: 128 E4M3 | 1 float32
INDEX_FP8 = SplitLayout("index_fp8", INDEX_DIM, 4)
#: DeepGEMM SM100 paged MXFP4 key: 64 B of E2M1 pairs | 4 UE8M0 (one int32)
INDEX_MXFP4 = SplitLayout("index_mxfp4", INDEX_DIM // 2, MXFP4_BLOCKS)
#: DeepGEMM SM100 paged MXFP8 key: 128 E4M3 | 4 UE8M0 (one int32), the page
#: padded to a multiple of 512 bytes
INDEX_MXFP8 = SplitLayout("index_mxfp8", INDEX_DIM, MXFP8_BLOCKS, MXFP8_PAGE_ALIGN)

LAYOUTS = {lay.name: lay for lay in (MODEL1, INDEX_FP8, INDEX_MXFP4, INDEX_MXFP8)}


def _page_size(page_size) -> int:
    if isinstance(page_size, (bool, np.bool_)) or not isinstance(page_size, (int, np.integer)):
        raise TypeError(f"page_size: expected an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size}")
    return int(page_size)


# ---------------------------------------------------------------------------
# UE8M0 scales
# ---------------------------------------------------------------------------
def ceil_log2(q) -> np.ndarray:
    """ceil(log2(q)) of positive finite float32 values, exactly (int64):
    q = m * 2^k with m in [0.5, 1) gives k - 1 when m == 0.5, else k. For a
    normal q this is DeepSeek's fast_log2_ceil (biased exponent - 127, + 1
    when the mantissa bits are not all zero)."""
    m, k = np.frexp(np.asarray(q, F32).astype(np.float64))
    return np.where(m == 0.5, k - 1, k).astype(np.int64)


def ue8m0_exponent(amax, fmax, floor) -> np.ndarray:
    """e = ceil(log2(max(amax, floor) / fmax)) for finite amax >= 0, from
    the IEEE float32 quotient. With floor / fmax a normal float32 (both of
    ours) this is the exact ceiling, the smallest e with
    max(amax, floor) <= fmax * 2^e (tests check every float32 of a binade)."""
    a = np.maximum(np.asarray(amax, F32), F32(floor))
    return ceil_log2(a / F32(fmax))


def pow2(e) -> np.ndarray:
    """2^e as float32 (e an int array; subnormal and infinite results as
    IEEE gives them)."""
    with np.errstate(over="ignore", under="ignore"):
        return np.ldexp(F32(1.0), np.asarray(e, np.int64)).astype(F32)


def ue8m0_value(byte) -> np.ndarray:
    """The float32 value of UE8M0 scale bytes: 2^(byte - 127), 0xFF -> NaN
    (byte 0 is 2^-127, a float32 subnormal)."""
    b = np.asarray(byte, np.uint8)
    return np.where(b == UE8M0_NAN, F32(np.nan), pow2(b.astype(np.int64) - UE8M0_BIAS)).astype(F32)


def _pow2_blocks(x: np.ndarray, block: int, fmax, floor):
    """Per block of `block` elements of BF16-rounded x (..., n): the scaled
    values x * 2^-e (..., n/block, block), e (..., n/block) and whether the
    block holds NaN/Inf (its e is 0; the caller writes codes 0, scale NaN)."""
    blk = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    fin = np.isfinite(blk)
    bad = ~fin.all(axis=-1)
    amax = np.abs(np.where(fin, blk, F32(0))).max(axis=-1)
    e = np.where(bad, 0, ue8m0_exponent(amax, fmax, floor))
    # 2^-e is a normal float32 for every e the floors allow, so the product
    # is exact unless it is subnormal, where it rounds to a code 0 anyway.
    with np.errstate(invalid="ignore", under="ignore"):
        y = blk * pow2(-e)[..., None]
    return y, e, bad


def _scale_bytes(e, bad) -> np.ndarray:
    return np.where(bad, UE8M0_NAN, np.asarray(e) + UE8M0_BIAS).astype(np.uint8)


# ---------------------------------------------------------------------------
# MODEL1_FP8Sparse entry
# ---------------------------------------------------------------------------
def model1_quantize(entries):
    """Entries (..., 512) (float32 values, rounded to BF16 first) ->
    (data (..., 576) uint8, scales (..., 8) uint8).

    data: 448 E4M3 codes (tile t = dims 64t .. 64t+63 scaled by 2^-e_t),
    then the 64 RoPE dims as BF16 (little-endian bytes). scales: bytes
    e_t + 127 for t = 0..6, then 0. e_t = ceil(log2(max(amax_t, 1e-4) / 448))."""
    x = bf16_round(_f32("entries", entries, last=ENTRY_DIM))
    y, e, bad = _pow2_blocks(x[..., :NOPE_DIM], FP8_TILE, FP8_MAX, FP8_AMAX_FLOOR)
    codes = np.where(bad[..., None], np.uint8(0), e4m3_encode(y)).reshape(*x.shape[:-1], NOPE_DIM)
    rope = np.ascontiguousarray(bf16_bits(x[..., NOPE_DIM:]).astype("<u2")).view(np.uint8)
    data = np.concatenate([codes.astype(np.uint8), rope], axis=-1)
    pad = np.zeros((*x.shape[:-1], 1), np.uint8)
    return data, np.concatenate([_scale_bytes(e, bad), pad], axis=-1)


def model1_dequantize(data, scales, dtype: str = "float32") -> np.ndarray:
    """(data (..., 576), scales (..., 8)) uint8 -> (..., 512): e4m3(code) *
    2^(byte - 127) in float32 for the nope dims (byte 0xFF: NaN), the RoPE
    dims as stored, then rounded to `dtype`. The pad byte is not read."""
    data, scales = _bytes("data", data, MODEL1.data_bytes), _bytes("scales", scales, MODEL1.scale_bytes)
    if data.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"scales: expected leading shape {data.shape[:-1]}, got {scales.shape}")
    s = ue8m0_value(scales[..., :FP8_TILES])
    codes = e4m3_decode(data[..., :NOPE_DIM]).reshape(*data.shape[:-1], FP8_TILES, FP8_TILE)
    with np.errstate(over="ignore", invalid="ignore"):
        nope = (codes * s[..., None]).reshape(*data.shape[:-1], NOPE_DIM)
    return round_to_dtype(np.concatenate([nope, _bf16_from_bytes(data[..., NOPE_DIM:])], axis=-1), dtype)


def _bf16_from_bytes(b: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16
    return bits.view(F32)


def _bytes(name: str, a, last: int) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8, got {a.dtype}")
    if a.ndim == 0 or a.shape[-1] != last:
        raise ValueError(f"{name}: last dimension must be {last}, got shape {a.shape}")
    return a


# ---------------------------------------------------------------------------
# Indexer keys
# ---------------------------------------------------------------------------
def index_fp8_quantize(keys):
    """Keys (..., 128) (rounded to BF16 first) -> (codes (..., 128) uint8,
    scale (...,) float32): vLLM's rule, scale = 2^ceil(log2(max(amax, 1e-4)
    / 448)) (a power of two stored as FP32), codes = e4m3(x / scale)."""
    x = bf16_round(_f32("keys", keys, last=INDEX_DIM))
    y, e, bad = _pow2_blocks(x, INDEX_DIM, FP8_MAX, FP8_AMAX_FLOOR)
    codes = np.where(bad[..., None], np.uint8(0), e4m3_encode(y))[..., 0, :]
    scale = np.where(bad, F32(np.nan), pow2(e))[..., 0]
    return codes.astype(np.uint8), scale.astype(F32)


def index_fp8_dequantize(codes, scale, dtype: str = "float32") -> np.ndarray:
    """e4m3(code) * scale in float32, rounded to `dtype`."""
    codes = _bytes("codes", codes, INDEX_DIM)
    scale = np.asarray(scale, F32)
    if scale.shape != codes.shape[:-1]:
        raise ValueError(f"scale: expected shape {codes.shape[:-1]}, got {scale.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        return round_to_dtype(e4m3_decode(codes) * scale[..., None], dtype)


def index_mxfp4_quantize(keys):
    """Keys (..., 128) (rounded to BF16 first) -> (codes (..., 64) uint8,
    scales (..., 4) uint8): DeepSeek's fp4_act_quant, per block of 32
    e = ceil(log2(max(amax, 6 * 2^-126) / 6)), byte e + 127, codes
    e2m1(x * 2^-e) (RNE, saturating at 6), element 2j in the low nibble."""
    x = bf16_round(_f32("keys", keys, last=INDEX_DIM))
    y, e, bad = _pow2_blocks(x, MXFP4_BLOCK, E2M1_MAX, MXFP4_AMAX_FLOOR)
    c = np.where(bad[..., None], np.uint8(0), e2m1_encode(y)).reshape(*x.shape[:-1], INDEX_DIM)
    codes = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
    return codes, _scale_bytes(e, bad)


def index_mxfp4_dequantize(codes, scales, dtype: str = "float32") -> np.ndarray:
    """e2m1(code) * 2^(byte - 127) in float32 (byte 0xFF: NaN), rounded to `dtype`."""
    codes = _bytes("codes", codes, INDEX_DIM // 2)
    scales = _bytes("scales", scales, MXFP4_BLOCKS)
    if scales.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"scales: expected leading shape {codes.shape[:-1]}, got {scales.shape}")
    c = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], MXFP4_BLOCKS, MXFP4_BLOCK)
    with np.errstate(over="ignore", invalid="ignore"):
        v = e2m1_decode(c) * ue8m0_value(scales)[..., None]
    return round_to_dtype(v.reshape(*codes.shape[:-1], INDEX_DIM), dtype)


def index_mxfp8_quantize(keys):
    """Keys (..., 128) (rounded to BF16 first) -> (codes (..., 128) uint8,
    scales (..., 4) uint8): DeepGEMM's per_token_cast_to_fp8(use_ue8m0=True,
    gran_k=32, use_packed_ue8m0=True): per block of 32
    e = ceil(log2(max(amax, 1e-4) / 448)), byte e + 127 (block k in byte k
    of the key's int32), codes e4m3(x * 2^-e) (RNE). A block holding NaN/Inf
    stores codes 0 and byte 0xFF (rawkv's rule; DeepGEMM's test quantizer
    writes byte 0xFE and NaN codes there: docs/kvcache.md decision 3)."""
    x = bf16_round(_f32("keys", keys, last=INDEX_DIM))
    y, e, bad = _pow2_blocks(x, MXFP8_BLOCK, FP8_MAX, FP8_AMAX_FLOOR)
    codes = np.where(bad[..., None], np.uint8(0), e4m3_encode(y)).reshape(*x.shape[:-1], INDEX_DIM)
    return codes.astype(np.uint8), _scale_bytes(e, bad)


def index_mxfp8_dequantize(codes, scales, dtype: str = "float32") -> np.ndarray:
    """e4m3(code) * 2^(byte - 127) in float32 (byte 0xFF: NaN), rounded to `dtype`."""
    codes = _bytes("codes", codes, INDEX_DIM)
    scales = _bytes("scales", scales, MXFP8_BLOCKS)
    if scales.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"scales: expected leading shape {codes.shape[:-1]}, got {scales.shape}")
    c = codes.reshape(*codes.shape[:-1], MXFP8_BLOCKS, MXFP8_BLOCK)
    with np.errstate(over="ignore", invalid="ignore"):
        v = e4m3_decode(c) * ue8m0_value(scales)[..., None]
    return round_to_dtype(v.reshape(*codes.shape[:-1], INDEX_DIM), dtype)


# ---------------------------------------------------------------------------
# Records of any layout
# ---------------------------------------------------------------------------
def records(layout: SplitLayout, rows):
    """Rows (N, 512) for MODEL1, (N, 128) for the keys -> their records
    (data (N, data_bytes), scales (N, scale_bytes)) uint8; the FP8 key's
    scale record is its float32 scale, little-endian; the MX keys' their 4
    UE8M0 bytes (block k in byte k)."""
    if layout is MODEL1:
        return model1_quantize(rows)
    if layout is INDEX_MXFP4:
        return index_mxfp4_quantize(rows)
    if layout is INDEX_MXFP8:
        return index_mxfp8_quantize(rows)
    codes, scale = index_fp8_quantize(rows)
    return codes, np.ascontiguousarray(scale.astype("<f4")).view(np.uint8).reshape(*scale.shape, 4)


def decode_records(layout: SplitLayout, data, scales, dtype: str = "float32") -> np.ndarray:
    """records' inverse: (data, scales) -> rows of `dtype` values (float32
    arrays), by the layout's dequantizer."""
    if layout is MODEL1:
        return model1_dequantize(data, scales, dtype)
    if layout is INDEX_MXFP4:
        return index_mxfp4_dequantize(data, scales, dtype)
    if layout is INDEX_MXFP8:
        return index_mxfp8_dequantize(data, scales, dtype)
    scale = np.ascontiguousarray(_bytes("scales", scales, 4)).view("<f4")[..., 0].astype(F32)
    return index_fp8_dequantize(data, scale, dtype)


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------
def new_cache(layout: SplitLayout, num_pages: int, page_size: int) -> np.ndarray:
    """A zero-filled (num_pages, page_bytes) uint8 cache."""
    if isinstance(num_pages, (bool, np.bool_)) or not isinstance(num_pages, (int, np.integer)) \
            or num_pages < 1:
        raise ValueError(f"num_pages: expected a positive int, got {num_pages!r}")
    pb = layout.page_bytes(page_size)
    if int(num_pages) * int(page_size) > INDEX_LIMIT:
        raise ValueError(f"num_pages: {num_pages} pages of {page_size} records exceed the int32 slot range "
                         "(2^31 - 1)")
    return np.zeros((int(num_pages), pb), np.uint8)


def _cache(layout: SplitLayout, cache, page_size: int) -> np.ndarray:
    if not isinstance(cache, np.ndarray) or cache.dtype != np.uint8 or cache.ndim != 2:
        raise TypeError(f"cache: expected a 2-D uint8 numpy array, got "
                        f"{getattr(cache, 'dtype', type(cache).__name__)} {getattr(cache, 'shape', '')}")
    pb = layout.page_bytes(page_size)
    if cache.shape[1] != pb:
        raise ValueError(f"cache: a {layout.name} page of {page_size} records is {pb} bytes, "
                         f"got shape {cache.shape}")
    if cache.shape[0] * page_size > INDEX_LIMIT:
        raise ValueError(f"cache: {cache.shape[0]} pages of {page_size} records exceed the int32 "
                         "slot range (2^31 - 1)")
    return cache


def locate(num_pages: int, page_size: int, slots, offsets=None):
    """Where rows go or come from -> (page, offset, ok, errors), arrays of the
    rows' shape. Without `offsets`, slots are slot ids page * P + offset
    (vLLM's slot mapping, FlashMLA's indices_in_kvcache); with `offsets`,
    slots are page ids and offsets the records inside them. -1 (slot or page)
    is padding: not ok, not counted; any other slot outside [0, num_pages * P),
    page outside [0, num_pages) or offset outside [0, P) is not ok and counted."""
    s = _ints("slots", slots)
    pad = s == -1
    if offsets is None:
        ok = (s >= 0) & (s < num_pages * page_size)
        page, off = np.where(ok, s // page_size, 0), np.where(ok, s % page_size, 0)
    else:
        o = _ints("offsets", offsets)
        if o.shape != s.shape:
            raise ValueError(f"offsets: expected shape {s.shape}, got {o.shape}")
        ok = (s >= 0) & (s < num_pages) & (o >= 0) & (o < page_size)
        page, off = np.where(ok, s, 0), np.where(ok, o, 0)
    return page, off, ok, int((~ok & ~pad).sum())


def page_write(layout: SplitLayout, cache, page_size: int, data, scales, slots, offsets=None) -> int:
    """Store records (data (N, data_bytes), scales (N, scale_bytes) uint8)
    at the rows' slots (locate); returns the rows skipped and counted. Two
    rows aimed at one record: which one lands is undefined (the kernels may
    even mix them)."""
    cache = _cache(layout, cache, page_size)
    data = _bytes("data", data, layout.data_bytes)
    scales = _bytes("scales", scales, layout.scale_bytes)
    page, off, ok, errors = locate(cache.shape[0], page_size, slots, offsets)
    if page.shape != data.shape[:-1] or page.ndim != 1:
        raise ValueError(f"slots: expected shape {data.shape[:-1]} (one per row), got {page.shape}")
    p, o = page[ok][:, None], off[ok][:, None]
    cache[p, o * layout.data_bytes + np.arange(layout.data_bytes)] = data[ok]
    so = layout.scale_offset(page_size)
    cache[p, so + o * layout.scale_bytes + np.arange(layout.scale_bytes)] = scales[ok]
    return errors


def page_read(layout: SplitLayout, cache, page_size: int, slots):
    """Records at slot ids `slots` (any shape) -> (data (..., data_bytes),
    scales (..., scale_bytes), ok, errors): zeros where not ok (-1: not
    counted; out of range: counted). A cache of no pages holds no record:
    every slot but -1 is out of range."""
    cache = _cache(layout, cache, page_size)
    page, off, ok, errors = locate(cache.shape[0], page_size, slots)
    if cache.shape[0] == 0:
        shape = np.shape(ok)
        return (np.zeros((*shape, layout.data_bytes), np.uint8), np.zeros((*shape, layout.scale_bytes), np.uint8),
                ok, errors)
    p, o = page[..., None], off[..., None]
    data = cache[p, o * layout.data_bytes + np.arange(layout.data_bytes)]
    scales = cache[p, layout.scale_offset(page_size) + o * layout.scale_bytes + np.arange(layout.scale_bytes)]
    data[~ok] = 0
    scales[~ok] = 0
    return data, scales, ok, errors


def layout_write(layout: SplitLayout, cache, page_size: int, rows, slots, offsets=None) -> int:
    """Quantize rows (records) into `layout`'s pages at their slots (slot
    mapping, or pages + offsets: locate); returns the rows skipped and
    counted. Every layout's write is this."""
    return page_write(layout, cache, page_size, *records(layout, rows), slots, offsets)


def layout_gather(layout: SplitLayout, cache, page_size: int, slots, dtype: str):
    """`layout`'s rows at slot ids / indices (any shape; -1 = none) ->
    (rows (..., dim) of `dtype`, errors): -1 gives a zero row, not counted;
    an id outside the pages a zero row, counted (decode_records decodes)."""
    data, scales, ok, errors = page_read(layout, cache, page_size, slots)
    rows = decode_records(layout, data, scales, dtype)
    rows[~ok] = 0
    return rows, errors


def model1_write(cache, page_size: int, entries, slots, offsets=None) -> int:
    """Quantize entries (N, 512) into MODEL1 pages at their slots (slot
    mapping, or pages + offsets: locate). The window insert is this with
    the tokens' slot mapping. Returns the rows skipped and counted."""
    return layout_write(MODEL1, cache, page_size, entries, slots, offsets)


def model1_gather(cache, page_size: int, indices, dtype: str = "bfloat16"):
    """MODEL1 records at FlashMLA indices (any shape; page * P + offset,
    -1 = none) -> (rows (..., 512) of `dtype`, errors): -1 gives a zero row,
    not counted; an index outside [0, num_pages * P) a zero row, counted."""
    return layout_gather(MODEL1, cache, page_size, indices, dtype)


def index_fp8_write(cache, page_size: int, keys, slots, offsets=None) -> int:
    """Quantize keys (N, 128) into FP8 indexer pages (DeepGEMM paged FP8,
    SM90 and SM100); returns the rows skipped and counted."""
    return layout_write(INDEX_FP8, cache, page_size, keys, slots, offsets)


def index_fp8_gather(cache, page_size: int, slots, dtype: str = "float32"):
    """FP8 indexer keys at slot ids (any shape) -> (keys (..., 128), errors)."""
    return layout_gather(INDEX_FP8, cache, page_size, slots, dtype)


def index_mxfp4_write(cache, page_size: int, keys, slots, offsets=None) -> int:
    """Quantize keys (N, 128) into MXFP4 indexer pages (DeepGEMM SM100 paged
    layout, scales packed in one int32); returns the rows skipped and counted."""
    return layout_write(INDEX_MXFP4, cache, page_size, keys, slots, offsets)


def index_mxfp4_gather(cache, page_size: int, slots, dtype: str = "float32"):
    """MXFP4 indexer keys at slot ids (any shape) -> (keys (..., 128), errors)."""
    return layout_gather(INDEX_MXFP4, cache, page_size, slots, dtype)


def index_mxfp8_write(cache, page_size: int, keys, slots, offsets=None) -> int:
    """Quantize keys (N, 128) into MXFP8 indexer pages (DeepGEMM SM100 paged
    layout with UE8M0 scales packed in one int32, the page padded to a
    multiple of 512 bytes); returns the rows skipped and counted."""
    return layout_write(INDEX_MXFP8, cache, page_size, keys, slots, offsets)


def index_mxfp8_gather(cache, page_size: int, slots, dtype: str = "float32"):
    """MXFP8 indexer keys at slot ids (any shape) -> (keys (..., 128), errors)."""
    return layout_gather(INDEX_MXFP8, cache, page_size, slots, dtype)


# ---------------------------------------------------------------------------
# The bridge: logical top-k ids -> FlashMLA indices_in_kvcache
# ---------------------------------------------------------------------------
def topk_to_kvcache_indices(topk_ids, block_table, page_size: int, num_pages: int, slots=None,
                            n_entries=None):
    """Logical compressed-entry ids of each request (B, K) or (B, S, K) ->
    (indices (same shape) int32, errors). Row b reads block-table row
    slots[b] (or b when slots is None) of block_table (R, max_blocks):
    index = block_table[row, e // P] * P + e % P.

    e == -1 -> -1, not counted. e < -1, e >= n_entries[b] (when given),
    e // P >= max_blocks, a row outside [0, R), or a block id outside
    [0, num_pages) -> -1, counted (so with an empty table, R = 0 or
    max_blocks = 0, every id but -1)."""
    p = _page_size(page_size)
    ids = _ints("topk_ids", topk_ids)
    if ids.ndim not in (2, 3):
        raise ValueError(f"topk_ids: expected (B, K) or (B, S, K), got shape {ids.shape}")
    table = _ints("block_table", block_table, ndim=2)
    if num_pages * p > INDEX_LIMIT:
        raise ValueError(f"num_pages: {num_pages} pages of {p} entries exceed the int32 index range")
    B = ids.shape[0]
    rows = np.arange(B) if slots is None else _ints("slots", slots, ndim=1)
    if rows.shape != (B,):
        raise ValueError(f"slots: expected shape ({B},), got {rows.shape}")
    if slots is None and table.shape[0] < B:
        raise ValueError(f"block_table: {table.shape[0]} rows for {B} requests (pass slots=)")
    flat = ids.reshape(B, int(np.prod(ids.shape[1:])))      # (0, -1) is ambiguous to numpy
    lim = np.full(B, np.iinfo(np.int64).max) if n_entries is None else _ints("n_entries", n_entries, ndim=1)
    if lim.shape != (B,):
        raise ValueError(f"n_entries: expected shape ({B},), got {lim.shape}")
    row_ok = (rows >= 0) & (rows < table.shape[0])
    lb = np.where(flat >= 0, flat // p, -1)
    ok = row_ok[:, None] & (flat >= 0) & (flat < lim[:, None]) & (lb < table.shape[1])
    # (the table is read only where an entry is ok: an empty table has none)
    blk = np.where(ok, table[np.where(row_ok, rows, 0)[:, None], np.where(ok, lb, 0)], -1) if table.size \
        else np.full(flat.shape, -1, np.int64)
    ok &= (blk >= 0) & (blk < num_pages)
    out = np.where(ok, blk * p + np.where(ok, flat % p, 0), -1).astype(np.int32)
    errors = int((~ok & (flat != -1)).sum())
    return out.reshape(ids.shape), errors
