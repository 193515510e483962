"""W4A8 GEMM reference (issue 23; docs/gemm.md "W4A8 (issue 23)"): MXFP4
weights as E4M3 values times one power of two per row, FP8 block activations
(rawkv.reference.fp8_blocks: E4M3 codes, one FP32 or UE8M0 scale per token per
128 channels), FP32 accumulation promoted per 128 K, BF16 out.

The weight rule (what the kernel's in-register conversion must reproduce):

  An MXFP4 element is e2m1 * 2^s (s = scale byte - 127); its nonzero
  magnitudes are m * 2^j with m in {1, 1.5} (0.5, 1, 2, 4: m = 1; 1.5, 3, 6:
  m = 1.5). E4M3 holds m * 2^p exactly iff p <= 8 and p >= -9 (m = 1: 2^-9
  is its least subnormal) or p >= -8 (m = 1.5: 3 * 2^-9), so an element
  m * 2^(j + e) is exact in E4M3 iff j + e <= 8 and j + e >= LEAST[m].

  Row rebase r (one power of two per row, applied in the epilogue): the
  largest exponent of the row's nonzero elements brought to E4M3's top
  binade, r = max(j + s) - 8 (0 for a row without nonzero elements). Every
  element is then at or below 1.5 * 2^8 = 384 <= 448; a block is refused iff
  one of its nonzero elements falls below E4M3's least value, j + s - r <
  LEAST[m], i.e. iff the row's elements span more exponents than E4M3 holds
  (2^17 between the largest and the smallest nonzero magnitude, about), or
  its scale byte is 255 (NaN, even with zero codes: 0 * NaN is NaN). Zero
  elements are exact whatever the scale, so all-zero blocks (any other
  scale byte, 0 included) never refuse a row. Top alignment refuses only
  rows that no power of two could hold (tested exhaustively).

  Block shift e_b = s_b - r, stored biased (e_b + SHIFT_BIAS, one byte per
  MXFP4 block in the scale layout): for an accepted block with a nonzero
  element, e_b lies in [SHIFT_MIN, SHIFT_MAX] = [-11, 9] (e > 9 would put
  0.5 above 448, e < -11 4 below 2^-9); an all-zero block stores e = 0. The
  E4M3 byte of element (code c, shift e) is SHIFT_TABLE[e + 11, c & 7] | sign
  (c & 8) << 4; the table holds 0x7F (NaN) where e2m1 * 2^e is not an E4M3
  value, entries no accepted weight reads.

  Shift bytes past the table (>= SHIFT_ROWS = 21: no form w4a8_blocks
  builds, only a form written by hand or corrupted memory) are device-side
  data out of range: such a block is skipped, its elements read as zeros
  (an all-zero table row; the code's sign bit kept, as the kernel's prmt
  keeps it: -0 for a negative code, the same value), and counted. The
  products of a form (form_grouped / form_ragged, what the CPU op runs and
  the kernel reproduces) count each such block once per call, in the
  groups that multiply at least one row (batched: every group when T > 0;
  ragged: the experts that own a row after the offsets are clamped), blocks
  of the weight proper only (padding rows and columns of the packed form
  are not the weight's: unpack_shifts8 drops them).

Why per row (not per row and 128-K block): the promotion then multiplies each
128-deep FP32 partial by the activation's scale of that (token, block) only,
DeepGEMM's promotion, and the row's power of two goes to the epilogue once.

NVFP4 weights are not taken: e2m1 (2 significant bits) times an E4M3 scale
(4) has up to 5 significant bits, more than E4M3's 4, and the NVFP4 block (16
along K) is shorter than an FP8 wgmma's K (32), so the scale cannot be
applied after the MMA either.

The GEMM: out = round_to_bf16(sum_k E4M3(w8) * 2^r * q_k * a_b), with w8 the
weight's E4M3 codes, r its row's rebase, q_k the activation's E4M3 code
values and a_b the scale of the 128-channel block holding k. By the rule,
E4M3(w8) * 2^r is the MXFP4 value exactly; every product is exact in float64
(3 + 4 + 24 significant bits), the float64 sum of K of them is within
K * 2^-53 of their absolute sum (far below the GPU bound).
"""
from __future__ import annotations

import numpy as np

from . import gemm as G
from .formats import E2M1_VALUES, e4m3_decode, e4m3_encode
from .fp8_blocks import block_count, ue8m0_value
from .nvfp4 import unpack_nibbles

#: Activation channels per scale: the kernel promotes its FP32 partial once
#: per 128 K (DeepGEMM's recipe); the last block may be partial.
ACT_BLOCK = 128
#: MXFP4 elements per weight scale byte.
W_BLOCK = G.BLOCKS["mxfp4"]
#: Binary exponent j and significand (True: 1.5) of E2M1 magnitude i = code & 7
#: (value m * 2^j); magnitude 0 has neither and is exact at any shift.
E2M1_EXP = np.array([0, -1, 0, 0, 1, 1, 2, 2], np.int64)
E2M1_HALF = np.array([False, False, False, True, False, True, False, True])
#: E4M3's top binade exponent (1.5 * 2^8 = 384 <= 448 = 1.75 * 2^8) and its
#: least exponent for significand 1 (2^-9, the least subnormal) and 1.5 (3 * 2^-9).
TOP_EXP = 8
LEAST_EXP = np.where(E2M1_HALF, -8, -9)
#: Shift e of an element's magnitude i is exact iff SHIFT_LO[i] <= e <= SHIFT_HI[i].
SHIFT_HI = TOP_EXP - E2M1_EXP
SHIFT_LO = LEAST_EXP - E2M1_EXP
#: The shifts an accepted block with a nonzero element can have: -11 (only
#: 4s, -4s and zeros) to 9 (only +-0.5 and zeros).
SHIFT_MIN, SHIFT_MAX = int(SHIFT_LO[1:].min()), int(SHIFT_HI[1:].max())
SHIFT_BIAS = -SHIFT_MIN
#: Biased shift of a block without nonzero elements (and of padding blocks).
ZERO_SHIFT = SHIFT_BIAS
#: The NaN scale byte of UE8M0.
NAN_SCALE = 255
#: Blocks named in a refusal.
NAMED_BLOCKS = 8


def exact_shift(mag, e) -> np.ndarray:
    """True where E2M1 magnitude `mag` (0..7) times 2^e is an E4M3 value."""
    mag, e = np.asarray(mag, np.int64), np.asarray(e, np.int64)
    return (mag == 0) | ((e >= SHIFT_LO[mag]) & (e <= SHIFT_HI[mag]))


def _shift_table() -> np.ndarray:
    e = np.arange(SHIFT_MIN, SHIFT_MAX + 1)[:, None]
    mag = np.arange(8)[None, :]
    vals = (E2M1_VALUES[mag].astype(np.float64) * np.ldexp(1.0, e)).astype(np.float32)
    return np.where(exact_shift(mag, e), e4m3_encode(vals), np.uint8(0x7F)).astype(np.uint8)


#: (SHIFT_MAX - SHIFT_MIN + 1, 8) uint8: row e + SHIFT_BIAS, column the E2M1
#: magnitude: the E4M3 byte of e2m1 * 2^e, 0x7F (NaN) where not exact.
SHIFT_TABLE = _shift_table()
#: Rows of SHIFT_TABLE: a biased shift byte >= SHIFT_ROWS is past the table.
SHIFT_ROWS = SHIFT_TABLE.shape[0]
#: SHIFT_TABLE indexed by any shift byte: the rows past the table all zeros
#: (a block whose byte is past the table reads as zeros).
_BYTE_TABLE = np.zeros((256, 8), np.uint8)
_BYTE_TABLE[:SHIFT_ROWS] = SHIFT_TABLE


def _check_mxfp4(codes, scales):
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    G.check_bytes(codes.shape, str(codes.dtype), 3, "codes")
    G.check_bytes(scales.shape, str(scales.dtype), 3, "scales")
    g, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    if k % W_BLOCK or scales.shape != (g, n, k // W_BLOCK):
        raise ValueError(f"scales: expected shape {(g, n, k // W_BLOCK)} for codes {codes.shape} "
                         f"(MXFP4, K % {W_BLOCK} == 0), got {scales.shape}")
    return codes, scales


def _block_bounds(codes: np.ndarray, n_blocks: int):
    """Per MXFP4 block, from its nonzero magnitudes: (hi, lo, any) with hi =
    min SHIFT_HI, lo = max SHIFT_LO (the shifts that keep every element
    exact) and any = whether it has one. int8 per element, one group at a
    time by the caller, so a checkpoint's weight fits in memory."""
    mag = unpack_nibbles(codes) & 7
    shape = (*mag.shape[:-1], n_blocks, W_BLOCK)
    big = np.int8(127)
    hi = np.where(mag == 0, big, SHIFT_HI.astype(np.int8)[mag]).reshape(shape).min(-1)
    lo = np.where(mag == 0, -big, SHIFT_LO.astype(np.int8)[mag]).reshape(shape).max(-1)
    return hi.astype(np.int64), lo.astype(np.int64), (mag != 0).reshape(shape).any(-1)


def _refusal(bad: np.ndarray, scales: np.ndarray, name: str) -> ValueError:
    idx = np.argwhere(bad)
    named = ", ".join(f"(g={g}, n={n}, block={b}: byte {int(scales[g, n, b])})"
                      for g, n, b in idx[:NAMED_BLOCKS].tolist())
    more = f" and {len(idx) - NAMED_BLOCKS} more" if len(idx) > NAMED_BLOCKS else ""
    return ValueError(
        f"{name}: {len(idx)} MXFP4 block(s) cannot be held exactly as E4M3 values after their row's "
        f"power-of-two rebase (a NaN scale byte 255, or a nonzero element below E4M3's least value "
        f"2^-9 once the row's largest element sits in [256, 448]: the row spans too many binades); "
        f"blocks (group, row, block of {W_BLOCK} along K): {named}{more}. The W4A16 path "
        f"(rawkv.gemm.grouped_linear with BF16 activations) takes this weight")


def w4a8_blocks(codes, scales):
    """MXFP4 checkpoint bytes, codes (G, N, K/2) and scales (G, N, K/32)
    uint8 -> (shifts uint8 (G, N, K/32), rebase int64 (G, N), refused bool
    (G, N, K/32)) by the rule of the module docstring: shifts the biased
    block shifts e_b + SHIFT_BIAS, rebase the rows' exponents r, refused the
    blocks the rule refuses (their shifts meaningless)."""
    codes, scales = _check_mxfp4(codes, scales)
    g, n, nb = scales.shape
    shifts = np.empty((g, n, nb), np.uint8)
    rebase = np.zeros((g, n), np.int64)
    bad = np.zeros((g, n, nb), bool)
    none = np.iinfo(np.int64).min
    for gi in range(g):                     # one group's int8 temporaries at a time
        hi, lo, live = _block_bounds(codes[gi], nb)
        s = scales[gi].astype(np.int64) - 127
        nan = scales[gi] == NAN_SCALE       # NaN even where the codes are 0 (0 * NaN)
        live_ok = live & ~nan
        top = np.where(live_ok, s - hi, none).max(-1, initial=none)
        r = np.where(top == none, 0, top)
        e = s - r[:, None]
        bad[gi] = nan | (live_ok & (e < lo))
        # accepted blocks' e lie in [SHIFT_MIN, SHIFT_MAX] already; the clip keeps
        # refused ones from wrapping around uint8
        shifts[gi] = np.where(live_ok & ~bad[gi], np.clip(e, SHIFT_MIN, SHIFT_MAX) + SHIFT_BIAS, ZERO_SHIFT)
        rebase[gi] = r
    return shifts, rebase, bad


def w4a8_form(codes, scales, *, name: str = "weight"):
    """(shifts, rebase) of w4a8_blocks, or a ValueError (prefixed `name`)
    naming the refused blocks: the first NAMED_BLOCKS as (group, row,
    block) with their scale byte, and their count."""
    shifts, rebase, bad = w4a8_blocks(codes, scales)
    if bad.any():
        raise _refusal(bad, np.asarray(scales), name)
    return shifts, rebase


def w4a8_codes(codes, shifts) -> np.ndarray:
    """The weight's E4M3 bytes (G, N, K): SHIFT_TABLE[shift of the element's
    block, magnitude] with the E2M1 sign, what the kernel builds in
    registers from the packed codes and shifts; a block whose shift byte
    is past the table (past_table) gives 0x00 / 0x80 (+-0, the sign of
    the code) for each of its elements."""
    nib = unpack_nibbles(np.asarray(codes, np.uint8))
    sh = np.repeat(np.asarray(shifts, np.uint8), W_BLOCK, axis=-1)
    return (_BYTE_TABLE[sh, nib & 7] | ((nib & 8) << 4)).astype(np.uint8)


def past_table(shifts) -> np.ndarray:
    """True for the blocks whose biased shift byte is past SHIFT_TABLE
    (>= SHIFT_ROWS): bytes no form w4a8_blocks builds. Such a block reads
    as zeros (w4a8_codes) and is counted (shift_errors)."""
    return np.asarray(shifts, np.uint8) >= SHIFT_ROWS


def shift_errors(shifts, live) -> int:
    """The count a product of the form adds for its shift bytes: the blocks
    past the table (past_table) of the groups where `live` ((G,) bool) is
    True, those that multiply at least one row, each once."""
    bad = past_table(shifts)
    live = np.asarray(live, bool)
    if live.shape != bad.shape[:1]:
        raise ValueError(f"live: expected shape {bad.shape[:1]}, got {live.shape}")
    return int(bad[live].sum())


def weight_values(codes, scales) -> np.ndarray:
    """float64 (G, N, K): E4M3(w4a8_codes) * 2^rebase, through the W4A8 form
    (so a refused weight is refused here too); equal to the MXFP4 values
    (rawkv.reference.gemm.dequantize_weight) for every accepted weight."""
    shifts, rebase = w4a8_form(codes, scales)
    w8 = e4m3_decode(w4a8_codes(codes, shifts)).astype(np.float64)
    return w8 * np.ldexp(1.0, rebase)[..., None]


def activation_values(x_codes, x_scales) -> np.ndarray:
    """float64 (..., K) of FP8 block activations: E4M3 code value times its
    128-channel block's scale, exactly (4 x 24 significant bits; no FP32
    rounding, unlike fp8_blocks.dequantize_blocks). x_scales float32 (FP32
    scales) or uint8 (UE8M0 bytes, 255 NaN), shape (..., ceil(K/128))."""
    x_codes, x_scales = np.asarray(x_codes), np.asarray(x_scales)
    if x_codes.dtype != np.uint8:
        raise TypeError(f"x_codes: expected uint8 (E4M3 bytes), got dtype {x_codes.dtype}")
    if x_scales.dtype not in (np.uint8, np.float32):
        raise TypeError(f"x_scales: expected float32 (FP32 scales) or uint8 (UE8M0 bytes), got dtype {x_scales.dtype}")
    if x_codes.ndim < 1:
        raise ValueError(f"x_codes: expected at least 1 dimension, got shape {x_codes.shape}")
    k = x_codes.shape[-1]
    want = (*x_codes.shape[:-1], block_count(k, ACT_BLOCK))
    if x_scales.shape != want:
        raise ValueError(f"x_scales: expected shape {want} (one per {ACT_BLOCK} channels), got {x_scales.shape}")
    s = ue8m0_value(x_scales) if x_scales.dtype == np.uint8 else x_scales
    full = np.repeat(s.astype(np.float64), ACT_BLOCK, axis=-1)[..., :k]
    return e4m3_decode(x_codes).astype(np.float64) * full


def grouped(x_codes, x_scales, w_codes, w_scales) -> np.ndarray:
    """Batched mode: activations (T, G, K) with scales (T, G, ceil(K/128)),
    MXFP4 weight bytes (G, N, K/2), (G, N, K/32) -> float64 (T, G, N), the
    exact product (out = rawkv.reference.gemm.round_to_bf16 of it)."""
    return G.grouped(activation_values(x_codes, x_scales), weight_values(w_codes, w_scales))


def ragged(x_codes, x_scales, w_codes, w_scales, offsets) -> tuple[np.ndarray, int]:
    """Ragged mode: activations (R, K), scales (R, ceil(K/128)), MXFP4
    weights of E experts, offsets (E + 1,) -> (float64 (R, N), errors) by
    rawkv.reference.gemm's offsets rule (clamp_offsets)."""
    return G.ragged(activation_values(x_codes, x_scales), weight_values(w_codes, w_scales), offsets)


# ---- the W4A8 kernel's packed weight (docs/gemm.md, "W4A8 layout") -------------------------
# The kernel multiplies one FP8 wgmma k32 step (32 columns: one MXFP4 block)
# at a time, 128 columns (one activation scale block, one 128-byte row of
# the swizzled B tile) per pipeline stage. Its k order is the physical one,
# so the FP8 activations go to shared memory as they are (16-byte copies).
# Lane l = 4 q + t of the warp that owns a 16-row tile holds, per k32 step
# s of a chunk, the wgmma A fragment of rows q and q + 8: columns
# 32 s + 4 t + i and 32 s + 16 + 4 t + i (i = 0..3).
#: Columns per packed chunk (and per pipeline stage).
CHUNK8 = 128
#: Packed code bytes per lane and chunk: 4 k32 steps x 2 rows x 4 bytes, in
#: two planes of 16 (steps 0-1, steps 2-3) so that a warp's 16-byte loads of
#: one plane are 512 contiguous bytes (no bank conflicts).
LANE_BYTES = 32
PLANES = 2
#: Packed shift bytes per row-pair (q, q + 8) and chunk: 4 steps x 2 rows.
SHIFT_BYTES = 8


def padded8(n: int, k: int) -> tuple[int, int]:
    """(NP, C): rows padded to whole 16-row tiles, K to whole 128-column chunks."""
    return -(-n // G.ROWS) * G.ROWS, -(-k // CHUNK8)


#: The sign bits of a packed word: bit 3 of nibble j (bit 4 j + 3) holds the
#: sign of code SIGN_OF[j] (code i's magnitude stays in nibble i's bits
#: 0..2). So byte b's bit 3 is code b's sign and its bit 7 code 4 + b's: the
#: kernel's E4M3 bytes of codes 0..3 take their signs from (w << 4) and those
#: of codes 4..7 from w itself, one AND-OR each (gemm_w4a8.cuh,
#: e4m3_of_e2m1), where signs in their own nibbles took a prmt each.
SIGN_OF = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def pack_codes8(codes) -> np.ndarray:
    """MXFP4 code bytes (G, N, K/2) (two E2M1 codes per byte, low nibble
    first) -> the kernel's codes uint8 (G, NP/16, C, 2, 32, 16): plane s // 2,
    lane l = 4 q + t, bytes 8 (s % 2) .. + 3 hold k32 step s of row q and
    8 (s % 2) + 4 .. + 7 of row q + 8, each a little-endian word of eight
    codes: code j is the one at column 128 c + 32 s + 16 (j // 4) + 4 t + j % 4,
    its magnitude (bits 0..2) at bits 4 j .. 4 j + 2, its sign at bit 3 of
    the nibble i with SIGN_OF[i] = j. Padding (rows past N, columns past K)
    is code 0."""
    codes = np.asarray(codes, np.uint8)
    g, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    npad, chunks = padded8(n, k)
    full = np.zeros((g, npad, chunks * CHUNK8), np.uint8)
    full[:, :n, :k] = unpack_nibbles(codes)
    # row = 16 tile + 8 half + q; column = 128 c + 32 s + 16 jh + 4 t + jl, s = 2 plane + s2
    v = full.reshape(g, npad // G.ROWS, 2, 8, chunks, PLANES, 2, 2, 4, 4)
    # -> g, tile, c, plane, q, t, s2, half, jh, jl
    v = v.transpose(0, 1, 4, 5, 3, 8, 6, 2, 7, 9).reshape(g, npad // G.ROWS, chunks, PLANES, 32, 2, 2, 8)
    v = (v & 7) | (v[..., SIGN_OF] & 8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).reshape(g, npad // G.ROWS, chunks, PLANES, 32, 16)


def unpack_codes8(packed, n: int, k: int) -> np.ndarray:
    """The inverse of pack_codes8: (G, N, K/2) MXFP4 code bytes."""
    packed = np.asarray(packed, np.uint8)
    g, tiles, chunks = packed.shape[:3]
    v = packed.reshape(g, tiles, chunks, PLANES, 32, 2, 2, 4)
    nib = np.stack([v & 0xF, v >> 4], axis=-1).reshape(g, tiles, chunks, PLANES, 32, 2, 2, 8)
    signs = np.empty_like(nib)
    signs[..., SIGN_OF] = nib & 8
    nib = ((nib & 7) | signs).reshape(g, tiles, chunks, PLANES, 8, 4, 2, 2, 2, 4)
    # axes: g, tile, c, plane, q, t, s2, half, jh, jl -> g, tile, half, q, c, plane, s2, jh, t, jl
    full = nib.transpose(0, 1, 7, 4, 2, 3, 6, 8, 5, 9).reshape(g, tiles * G.ROWS, chunks * CHUNK8)
    v = full[:, :n, :k]
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def pack_shifts8(shifts) -> np.ndarray:
    """Biased block shifts (G, N, K/32) -> the kernel's shifts uint8
    (G, NP/16, C, 8, 8): for q = 0..7 of a tile, byte 2 s + h is the shift
    of row 8 h + q, block 4 c + s (the four lanes of a quad read the same
    8 bytes). Padding is ZERO_SHIFT."""
    shifts = np.asarray(shifts, np.uint8)
    g, n, nb = shifts.shape
    npad, chunks = padded8(n, nb * W_BLOCK)
    full = np.full((g, npad, chunks * 4), ZERO_SHIFT, np.uint8)
    full[:, :n, :nb] = shifts
    v = full.reshape(g, npad // G.ROWS, 2, 8, chunks, 4).transpose(0, 1, 4, 3, 5, 2)
    return np.ascontiguousarray(v).reshape(g, npad // G.ROWS, chunks, 8, SHIFT_BYTES)


def unpack_shifts8(packed, n: int, k: int) -> np.ndarray:
    """The inverse of pack_shifts8: (G, N, K/32) biased shifts."""
    packed = np.asarray(packed, np.uint8)
    g, tiles, chunks = packed.shape[:3]
    v = packed.reshape(g, tiles, chunks, 8, 4, 2).transpose(0, 1, 5, 3, 2, 4)
    return v.reshape(g, tiles * G.ROWS, chunks * 4)[:, :n, :k // W_BLOCK].copy()


def form_values(codes, shifts, row_scale, gs=None) -> np.ndarray:
    """float64 (G, N, K) of a W4A8 form: E4M3(w4a8_codes(codes, shifts))
    times the row's power of two (row_scale (G, N), float32 2^r) and the
    group's global scale (gs float32 (G,); None: 1). Equal to weight_values
    for the form w4a8_form gives; a block whose shift byte is past the
    table is zeros."""
    w8 = e4m3_decode(w4a8_codes(codes, shifts)).astype(np.float64)
    w = w8 * np.asarray(row_scale, np.float64)[..., None]
    if gs is not None:
        w = w * np.asarray(gs, np.float32).reshape(w.shape[0]).astype(np.float64)[:, None, None]
    return w


def form_grouped(x_codes, x_scales, codes, shifts, row_scale, gs=None) -> tuple[np.ndarray, int]:
    """Batched mode on a W4A8 form (unpacked: codes (G, N, K/2), biased
    shifts (G, N, K/32), row_scale (G, N), gs (G,) or None), activations
    (T, G, K) with scales (T, G, ceil(K/128)) -> (float64 (T, G, N),
    errors): the exact product of form_values and the blocks past the
    table, counted in every group when T > 0 (shift_errors)."""
    x = activation_values(x_codes, x_scales)
    shifts = np.asarray(shifts, np.uint8)
    out = G.grouped(x, form_values(codes, shifts, row_scale, gs))
    return out, shift_errors(shifts, np.full(shifts.shape[0], x.shape[0] > 0))


def form_ragged(x_codes, x_scales, codes, shifts, row_scale, gs, offsets) -> tuple[np.ndarray, int]:
    """Ragged mode on a W4A8 form (as form_grouped), activations (R, K),
    offsets (E + 1,) -> (float64 (R, N), errors): rawkv.reference.gemm's
    offsets rule (its clamps counted), plus the blocks past the table of
    the experts that own at least one row after the clamp (shift_errors)."""
    x = activation_values(x_codes, x_scales)
    shifts = np.asarray(shifts, np.uint8)
    out, clamps = G.ragged(x, form_values(codes, shifts, row_scale, gs), offsets)
    o, _ = G.clamp_offsets(offsets, x.shape[0])
    return out, clamps + shift_errors(shifts, o[1:] > o[:-1])
