"""Grouped FP4 GEMM reference (docs/gemm.md): the packed weight layout, exact
weight dequantization, the float64 products of both modes, and float64 ->
BF16 rounding.

The packers here are written as index formulas, element by element of the
packed array, straight from docs/gemm.md's table (the torch packer,
rawkv/gemm/pack.py, uses reshapes and permutes and is tested equal to these).

Unpacked ("checkpoint") form: codes (G, N, K/2) uint8, element 2j of a row in
the low nibble of byte j; scales (G, N, K/block) uint8, block 16 (NVFP4,
E4M3) or 32 (MXFP4, UE8M0). Packed form: codes (G, NP/16, C, 32, 16), scales
(G, NP/16, C, 32, 2), NP = ceil(N/16)*16, C = ceil(K/64).
"""
from __future__ import annotations

import numpy as np

from .formats import E2M1_VALUES, e4m3_decode
from .nvfp4 import unpack_nibbles  # element 2j in the low nibble: the NVFP4 rule

ROWS = 16          # rows of a packed row tile
CHUNK = 64         # columns of a packed chunk
LANES = 32
BLOCKS = {"nvfp4": 16, "mxfp4": 32}
#: Scale byte of padding rows / columns: E4M3 0 (NVFP4), UE8M0 2^0 (MXFP4).
SCALE_PAD = {16: 0x00, 32: 127}
#: The eight codes n_0 .. n_7 of word s of lane (q, t) (docs/gemm.md's
#: table): n_i is the code of row r0 (ROW_OF_CODE 0) or r1 (1) at column
#: 64c + 16t + 2s + COL_OF_CODE[i]. Codes n_p and n_p+4 are A-fragment
#: register p of k-step s (an m16n8k16 / wgmma A fragment: rows r0, r1 at
#: k = 2s, 2s + 1, 2s + 8, 2s + 9 of 16). The mma.sync kernel's lane (q, t)
#: takes its own record's word s as its step s (all in its NVFP4 block t);
#: the wgmma kernel's lane (q, t) takes word t of lane (q, s)'s record as its
#: k16 step s (physical columns 16s .. 16s + 15).
ROW_OF_CODE = np.array([0, 1, 0, 1, 0, 1, 0, 1])
COL_OF_CODE = np.array([0, 0, 8, 8, 1, 1, 9, 9])
#: Where the bits of code n_i sit in its little-endian 32-bit word:
#: CODE_BITS[i] = the positions of its bits 0..3 (m, e0, e1, sign). Register
#: p's low half from n_p, its high half from n_p+4 (+16): BF16 wants the
#: sign at bit 15 and m, e0, e1 at bits 6, 7, 8 (e2m1 * 2^-126), so n_0 sits
#: there, n_1 three bits lower and n_2 six (a shift and a mask each), n_3 in
#: the four bits left (one multiply moves them: docs/gemm.md).
CODE_BITS = np.array([[6, 7, 8, 15], [3, 4, 5, 12], [0, 1, 2, 9], [14, 10, 11, 13],
                      [22, 23, 24, 31], [19, 20, 21, 28], [16, 17, 18, 25], [30, 26, 27, 29]])
#: The index i of the code at (row half, column offset): CODE_AT[ROW_OF_CODE[i], COL_OF_CODE[i]] = i.
CODE_AT = np.full((2, 10), -1)
CODE_AT[ROW_OF_CODE, COL_OF_CODE] = np.arange(8)
#: The bits of row r0's codes in each byte of a word (the rest are r1's).
R0_BITS_OF_BYTE = np.array([sum(1 << (int(p) - 8 * j) for i in range(8) if ROW_OF_CODE[i] == 0
                                for p in CODE_BITS[i] if 8 * j <= p < 8 * j + 8) for j in range(4)])
#: The 16-byte record of lane l = 4q + t sits at slot SLOT_OF_LANE[l] of its
#: tile's 32: 8t + (q XOR 2t), so that both kernels' shared-memory reads
#: are free of bank conflicts (docs/gemm.md, "Packed form").
SLOT_OF_LANE = np.array([8 * (l % 4) + ((l // 4) ^ (2 * (l % 4))) for l in range(32)])
LANE_OF_SLOT = np.argsort(SLOT_OF_LANE)


def _nv_factor_tables() -> tuple[np.ndarray, np.ndarray]:
    """(factor byte of each E4M3 byte, E4M3 byte of each factor byte).
    A packed NVFP4 scale is the factor byte b = (E << 3) | m of the value
    1.m * 2^(E - 20), 0 for zero (docs/gemm.md, "Packed form"): the kernels
    make its BF16 factor scale * 2^117 as 0x7000 + (b << 4) and its FP16 one
    scale * 2^5 as b << 7. E4M3's normals are b = byte + 104, its
    subnormals m * 2^-9 normalized (E 11..13); E4M3 NaN and the negative
    scales (which the loaders refuse) pack as 0xFF, NaN; a factor byte with
    no E4M3 value unpacks as 0x7F."""
    fwd = np.full(256, 0xFF, np.uint8)
    vals = e4m3_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    for v, x in enumerate(vals):
        if x == 0:
            fwd[v] = 0
        else:
            mant, exp = np.frexp(x)                    # x = mant * 2^exp, mant in [0.5, 1)
            e, m = int(exp) - 1, int(round((mant * 2 - 1) * 8))
            fwd[v] = ((e + 20) << 3) | m
    inv = np.full(256, 0x7F, np.uint8)
    inv[fwd[:0x7F]] = np.arange(0x7F, dtype=np.uint8)
    return fwd, inv


#: NVFP4 scale bytes (E4M3) -> packed factor bytes, and back (_nv_factor_tables).
NV_FACTOR_OF_E4M3, E4M3_OF_NV_FACTOR = _nv_factor_tables()
#: The factor bytes a packed NVFP4 weight may hold (those of E4M3 0x00 .. 0x7F).
NV_FACTOR_VALID = np.isin(np.arange(256), NV_FACTOR_OF_E4M3[:0x80])


def padded_sizes(n: int, k: int) -> tuple[int, int]:
    """(NP, C): rows rounded up to the row tile, chunks of 64 along K."""
    return -(-n // ROWS) * ROWS, -(-k // CHUNK)


def _lane_coords(n_tiles: int, chunks: int, per_lane: int):
    """Index grids over (row tile r, chunk c, lane l, entry e) of a packed
    array, and each lane's rows r0, r1 and first column kb."""
    r, c, l, e = np.indices((n_tiles, chunks, LANES, per_lane), dtype=np.int64)
    r0 = ROWS * r + l // 4
    kb = CHUNK * c + 16 * (l % 4)
    return r0, r0 + 8, kb, e


# ---- argument rules of the packers (also rawkv/gemm/pack.py's, on torch
# tensors' shapes and dtype names), each error naming its argument.

def check_size(v, name: str) -> int:
    """A logical size (n, k): a non-negative int."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {v!r}")
    if v < 0:
        raise ValueError(f"{name}: must be >= 0, got {v}")
    return int(v)


def check_block(block) -> int:
    """Elements per block scale: 16 (NVFP4) or 32 (MXFP4), an int."""
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"block: expected 16 (NVFP4) or 32 (MXFP4), got {block!r}")
    if block not in SCALE_PAD:
        raise ValueError(f"block: expected 16 (NVFP4) or 32 (MXFP4), got {block!r}")
    return int(block)


def check_bytes(shape, dtype: str, ndim: int, name: str) -> None:
    """An unpacked (3-d) or packed (5-d) array: uint8 of `ndim` dimensions."""
    if dtype != "uint8":
        raise TypeError(f"{name}: expected uint8, got dtype {dtype}")
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d array, got shape {tuple(shape)}")


def check_packed(shape, dtype: str, n, k, block=None) -> tuple[int, int]:
    """A packed array's arguments: `packed` (G, NP/16, C, 32, 16) codes, or
    (G, NP/16, C, 32, 2) scales when `block` is given, of a weight n x k
    (k even; a multiple of `block` for scales). Returns (n, k)."""
    n, k = check_size(n, "n"), check_size(k, "k")
    if block is not None:
        block = check_block(block)
    check_bytes(shape, dtype, 5, "packed")
    step = 2 if block is None else block
    if k % step:
        raise ValueError(f"k: must be a multiple of {step}, got {k}")
    npad, chunks = padded_sizes(n, k)
    want = (npad // ROWS, chunks, LANES, 16 if block is None else 2)
    if tuple(shape[1:]) != want:
        raise ValueError(f"packed: expected shape (G, {', '.join(map(str, want))}) "
                         f"for n={n}, k={k}, got {tuple(shape)}")
    return n, k


def _check_ndim(a, ndim: int, name: str) -> np.ndarray:
    a = np.asarray(a)
    check_bytes(a.shape, str(a.dtype), ndim, name)
    return a


def pack_codes(codes) -> np.ndarray:
    """codes (G, N, K/2) uint8 -> packed (G, NP/16, C, 32, 16) uint8."""
    codes = _check_ndim(codes, 3, "codes")
    g, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    npad, chunks = padded_sizes(n, k)
    nib = np.zeros((g, npad, chunks * CHUNK), np.uint8)          # padding codes are 0
    nib[:, :n, :k] = unpack_nibbles(codes)
    r, c, slot, s = np.indices((npad // ROWS, chunks, LANES, 4), dtype=np.int64)
    lane = LANE_OF_SLOT[slot]
    r0 = ROWS * r + lane // 4
    kb = CHUNK * c + 16 * (lane % 4) + 2 * s                      # word s's first column
    word = np.zeros((g, *r.shape), np.uint32)
    for i in range(8):
        code = nib[:, r0 + 8 * ROW_OF_CODE[i], kb + COL_OF_CODE[i]].astype(np.uint32)
        for b in range(4):
            word |= ((code >> b) & 1) << np.uint32(CODE_BITS[i, b])
    return word.astype("<u4").view(np.uint8).reshape(g, npad // ROWS, chunks, LANES, 16)


def unpack_codes(packed, n: int, k: int) -> np.ndarray:
    """packed (G, NP/16, C, 32, 16) -> codes (G, N, K/2), padding dropped."""
    packed = np.asarray(packed)
    n, k = check_packed(packed.shape, str(packed.dtype), n, k)
    words = np.ascontiguousarray(packed).view("<u4")              # (G, NP/16, C, 32, 4)
    row, col = np.indices((n, k), dtype=np.int64)
    q, half = row % 8, (row % ROWS) // 8                          # half 0: r0, 1: r1
    u = col % CHUNK
    t, v = u // 16, u % 16                                        # lane t's block, column v of its 16
    s = (v % 8) // 2                                              # word s
    i = CODE_AT[half, v - 2 * s]                                  # the code's index in its word
    w = words[:, row // ROWS, col // CHUNK, SLOT_OF_LANE[4 * q + t], s]
    nib = sum(((w >> CODE_BITS[i, b].astype(np.uint32)) & 1) << b for b in range(4)).astype(np.uint8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def pack_scales(scales, block: int) -> np.ndarray:
    """scales (G, N, K/block) uint8 -> packed (G, NP/16, C, 32, 2) uint8;
    padding bytes SCALE_PAD[block]; NVFP4 scales as their factor bytes
    (NV_FACTOR_OF_E4M3)."""
    scales = _check_ndim(scales, 3, "scales")
    block = check_block(block)
    g, n, k = scales.shape[0], scales.shape[1], block * scales.shape[2]
    npad, chunks = padded_sizes(n, k)
    # one scale per 16-column unit (an MXFP4 block covers two), padded
    units = np.full((g, npad, chunks * CHUNK // 16), SCALE_PAD[block], np.uint8)
    units[:, :n, :k // 16] = np.repeat(scales, block // 16, axis=-1)
    r0, r1, kb, half = _lane_coords(npad // ROWS, chunks, 2)
    packed = units[:, np.where(half == 0, r0, r1), kb // 16]
    return NV_FACTOR_OF_E4M3[packed] if block == 16 else packed


def unpack_scales(packed, n: int, k: int, block: int) -> np.ndarray:
    """packed (G, NP/16, C, 32, 2) -> scales (G, N, K/block), padding dropped
    (an MXFP4 block is stored twice, once per 16-column half: the first
    copy is read)."""
    packed = np.asarray(packed)
    n, k = check_packed(packed.shape, str(packed.dtype), n, k, block)
    block = int(block)
    row, blk = np.indices((n, k // block), dtype=np.int64)
    kb = blk * block
    lane = 4 * (row % 8) + (kb % CHUNK) // 16
    out = packed[:, row // ROWS, kb // CHUNK, lane, (row % ROWS) // 8].astype(np.uint8)
    return E4M3_OF_NV_FACTOR[out] if block == 16 else out


def scale_values(scales, fmt: str) -> np.ndarray:
    """Block scale bytes -> float64: E4M3 (0x7F / 0xFF NaN) for 'nvfp4',
    2^(byte - 127) (255 NaN) for 'mxfp4'."""
    scales = np.asarray(scales, dtype=np.uint8)
    if fmt == "nvfp4":
        return e4m3_decode(scales).astype(np.float64)
    if fmt == "mxfp4":
        v = np.ldexp(1.0, scales.astype(np.int64) - 127)
        return np.where(scales == 255, np.nan, v)
    raise ValueError(f"fmt: expected 'nvfp4' or 'mxfp4', got {fmt!r}")


def dequantize_weight(codes, scales, gs, fmt: str) -> np.ndarray:
    """Unpacked codes (G, N, K/2), scales (G, N, K/block), gs (G,) (None: 1)
    -> float64 (G, N, K): e2m1(code) * scale * gs[g], exact (the product of
    a 3-bit, a 4-bit and a 24-bit significand is a float64, and float64's
    range holds every such product)."""
    if fmt not in BLOCKS:
        raise ValueError(f"fmt: expected 'nvfp4' or 'mxfp4', got {fmt!r}")
    block = BLOCKS[fmt]
    codes = _check_ndim(codes, 3, "codes")
    scales = _check_ndim(scales, 3, "scales")
    g, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    if k % block or scales.shape != (g, n, k // block):
        raise ValueError(f"scales: expected shape {(g, n, k // block)} for codes {codes.shape} "
                         f"({fmt}, K % {block} == 0), got {scales.shape}")
    gsv = np.ones(g) if gs is None else np.asarray(gs, dtype=np.float32).reshape(g).astype(np.float64)
    vals = E2M1_VALUES.astype(np.float64)[unpack_nibbles(codes)]
    sv = np.repeat(scale_values(scales, fmt), block, axis=-1)
    return vals * sv * gsv[:, None, None]


def _dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) . w (N, K)^T in float64, NaN / Inf propagating as IEEE does.
    BLAS for speed, but BLAS may skip a product by a zero (reference BLAS
    does), losing 0 * Inf = NaN: every output that meets a non-finite input
    row is recomputed with einsum, which multiplies every pair."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = x @ w.T
        bad_x, bad_w = ~np.isfinite(x).all(axis=1), ~np.isfinite(w).all(axis=1)
        if bad_x.any():
            out[bad_x] = np.einsum("mk,nk->mn", x[bad_x], w)
        if bad_w.any():
            out[:, bad_w] = np.einsum("mk,nk->mn", x, w[bad_w])
    return out


def grouped(x, w) -> np.ndarray:
    """Batched mode: x (T, G, K), w (G, N, K) -> float64 (T, G, N),
    out[t, g, n] = sum_k x[t, g, k] * w[g, n, k] in float64."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if x.ndim != 3 or w.ndim != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"x: expected (T, G, K) against w (G, N, K), got {x.shape} and {w.shape}")
    out = np.empty((x.shape[0], w.shape[0], w.shape[1]))
    for g in range(w.shape[0]):
        out[:, g] = _dot(x[:, g], w[g])
    return out


def clamp_offsets(offsets, rows: int) -> tuple[np.ndarray, int]:
    """(o', errors): o'_0 = min(max(o_0, 0), R), o'_e = min(max(o_e,
    o'_{e-1}), R) (non-decreasing, in [0, R]); errors = #{e : o_e != o'_e}."""
    o = np.asarray(offsets, dtype=np.int64)
    if o.ndim != 1 or o.size < 1:
        raise ValueError(f"offsets: expected a 1-d array of E + 1 >= 1 entries, got shape {o.shape}")
    c = np.empty_like(o)
    prev = 0
    for e, v in enumerate(o.tolist()):
        prev = min(max(v, prev), rows)
        c[e] = prev
    return c, int((c != o).sum())


def ragged(x, w, offsets) -> tuple[np.ndarray, int]:
    """Ragged mode: x (R, K), w (E, N, K), offsets (E + 1,) -> (float64 (R,
    N), errors). Expert e owns rows [o'_e, o'_{e+1}) of clamp_offsets; rows
    outside [o'_0, o'_E) are zeros. errors: clamp_offsets' count in a call
    that multiplies something, 0 with R = 0 or N = 0 (nothing is computed;
    on a GPU no kernel runs to read the offsets)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"x: expected (R, K) against w (E, N, K), got {x.shape} and {w.shape}")
    if np.shape(offsets) != (w.shape[0] + 1,):
        raise ValueError(f"offsets: expected shape ({w.shape[0] + 1},), got {np.shape(offsets)}")
    o, errors = clamp_offsets(offsets, x.shape[0])
    if x.shape[0] == 0 or w.shape[1] == 0:
        errors = 0
    out = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        out[o[e]:o[e + 1]] = _dot(x[o[e]:o[e + 1]], w[e])
    return out, errors


def round_to_bf16(a) -> np.ndarray:
    """float64 -> uint16 BF16 bits, rounded once to nearest, ties to even
    (not through float32, whose rounding first can move a value onto a BF16
    tie). Overflow per IEEE RNE: |a| >= 2^128 - 2^119 (the tie above the
    largest finite BF16) gives Inf; subnormals kept (step 2^-133); NaN ->
    0x7FC0 with a's sign bit."""
    a = np.asarray(a, dtype=np.float64)
    mag = np.abs(a)
    finite = np.isfinite(mag)
    m = np.where(finite, mag, 0.0)
    _, e2 = np.frexp(np.where(m > 0, m, 1.0))                # m = f * 2^e2, f in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(e2 - 1, -126) - 7)    # BF16 step at m's binade
    r = np.rint(m / quantum) * quantum                        # powers of two: exact
    r = np.where(finite & (r < 2.0 ** 128), r, np.inf)
    with np.errstate(over="ignore"):
        bits = (r.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bits = np.where(np.isnan(a), np.uint16(0x7FC0), bits)
    return (bits | (np.signbit(a).astype(np.uint16) << 15)).astype(np.uint16)
