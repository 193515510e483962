"""The grouped FP4 GEMM reference (rawkv.reference.gemm): the packed layout
against docs/gemm.md's table, exact dequantization, the two GEMM modes
against plain loops, the ragged offsets rule (docs/gemm.md, "Ragged
offsets") and float64 -> BF16 rounding against a hand-written oracle."""
from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np
import pytest

from rawkv.reference import gemm as R
from rawkv.reference.formats import E2M1_VALUES, e4m3_decode
from support.ragged import RAGGED_OFFSET_CASES

# docs/gemm.md, "Packed form": code n_i of word W_s -> (row, column offset
# from kb = 64c + 16t + 2s), and the bits of the little-endian word that
# hold its bits 0..3 (m, e0, e1, sign), copied from the table.
TABLE_ROW = ["r0", "r1", "r0", "r1", "r0", "r1", "r0", "r1"]
TABLE_COL = [0, 0, 8, 8, 1, 1, 9, 9]
TABLE_BITS = [[6, 7, 8, 15], [3, 4, 5, 12], [0, 1, 2, 9], [14, 10, 11, 13],
              [22, 23, 24, 31], [19, 20, 21, 28], [16, 17, 18, 25], [30, 26, 27, 29]]


def _table_source(shape, n, k):
    """For every code of a packed codes array of `shape` (G, NP/16, C, 32,
    16), as (G, NP/16, C, 32, word s, code i), the (g, row, col) the table
    says it holds, as flat index (g * n + row) * k + col + 1, or 0 for
    padding."""
    src = np.zeros((*shape[:4], 4, 8), np.int64)
    for g, r, c, slot, s, i in np.ndindex(*shape[:4], 4, 8):
        t = slot // 8                                    # slot 8t + (q ^ 2t) holds lane 4q + t
        q = (slot % 8) ^ (2 * t)
        row = 16 * r + q + (8 if TABLE_ROW[i] == "r1" else 0)
        col = 64 * c + 16 * t + 2 * s + TABLE_COL[i]
        if row < n and col < k:
            src[g, r, c, slot, s, i] = (g * n + row) * k + col + 1
    return src


def _table_codes(packed):
    """The codes of packed bytes (..., 16) read where the table puts their
    bits: (..., word s, code i)."""
    w = np.ascontiguousarray(packed).view("<u4").astype(np.int64)
    return np.stack([sum(((w >> TABLE_BITS[i][b]) & 1) << b for b in range(4)) for i in range(8)], -1)


def test_codes_land_where_the_table_says():
    # Every element gets a distinct number (its flat index + 1); four packs
    # carry it 4 bits at a time, so every packed code names its source.
    g, n, k = 2, 20, 80                       # padding rows (NP = 32) and columns (C = 2)
    ident = np.arange(g * n * k, dtype=np.int64).reshape(g, n, k) + 1
    got = 0
    for b in range(4):
        nib = ((ident >> (4 * b)) & 0xF).astype(np.uint8)
        packed = R.pack_codes((nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8))
        got = got + (_table_codes(packed) << (4 * b))
    assert packed.shape == (g, 2, 2, 32, 16)
    np.testing.assert_array_equal(got, _table_source(packed.shape, n, k))


def test_the_table_bits_fill_each_word_once():
    # Every bit of a word belongs to exactly one code, and each 16-bit half
    # holds the codes of one BF16 half (n_0 .. n_3 the low, n_4 .. n_7 the high).
    bits = sorted(p for row in TABLE_BITS for p in row)
    assert bits == list(range(32))
    assert all(p < 16 for row in TABLE_BITS[:4] for p in row)
    np.testing.assert_array_equal(np.asarray(TABLE_BITS), R.CODE_BITS)


@pytest.mark.parametrize("block", [16, 32])
def test_scales_land_where_the_doc_says(block):
    # docs/gemm.md: byte 0 the scale of (r0, kb), byte 1 of (r1, kb); block
    # kb // block; padding 0x00 (NVFP4) / 127 (MXFP4). NVFP4 scales as their
    # factor bytes: read back through the inverse table (bytes of 7 bits,
    # the E4M3 scales 0x00 .. 0x7E and one more).
    g, n, k = 2, 21, 160
    ident = np.arange(g * n * (k // block), dtype=np.int64).reshape(g, n, k // block)
    bits = 7 if block == 16 else 8
    back = (lambda p: R.E4M3_OF_NV_FACTOR[p]) if block == 16 else (lambda p: p)
    mask = (1 << bits) - 1
    lo, hi = back(R.pack_scales((ident & mask).astype(np.uint8), block)), \
        back(R.pack_scales((ident >> bits).astype(np.uint8), block))
    pad = {16: 0, 32: 127}[block]
    for gi, r, c, lane, half in np.ndindex(*lo.shape):
        row = 16 * r + lane // 4 + 8 * half
        kb = 64 * c + 16 * (lane % 4)
        if row < n and kb < k:
            want = ident[gi, row, kb // block]
            assert (int(lo[gi, r, c, lane, half]), int(hi[gi, r, c, lane, half])) == \
                (want & mask, want >> bits)
        else:
            assert lo[gi, r, c, lane, half] == pad == hi[gi, r, c, lane, half]


@pytest.mark.parametrize("g,n,k", [(1, 1, 16), (1, 16, 64), (3, 37, 208), (2, 50, 96), (1, 8, 320)])
def test_pack_round_trip(rng, g, n, k):
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    packed = R.pack_codes(codes)
    npad, chunks = R.padded_sizes(n, k)
    assert packed.shape == (g, npad // 16, chunks, 32, 16)
    np.testing.assert_array_equal(R.unpack_codes(packed, n, k), codes)
    for block in (16, 32):
        if k % block:
            continue
        # (NVFP4: the E4M3 scales a loader takes, 0x00 .. 0x7E, zeros and subnormals among them)
        scales = rng.integers(0, 0x7F if block == 16 else 256, (g, n, k // block), dtype=np.uint8)
        ps = R.pack_scales(scales, block)
        assert ps.shape == (g, npad // 16, chunks, 32, 2)
        np.testing.assert_array_equal(R.unpack_scales(ps, n, k, block), scales)


def test_unpack_refuses_wrong_shapes():
    packed = R.pack_codes(np.zeros((1, 20, 40), np.uint8))
    with pytest.raises(ValueError, match="^packed:"):
        R.unpack_codes(packed, 20, 144)
    with pytest.raises(ValueError, match="^packed:"):
        R.unpack_scales(R.pack_scales(np.zeros((1, 20, 5), np.uint8), 16), 40, 80, 16)
    with pytest.raises(ValueError, match="^block:"):
        R.pack_scales(np.zeros((1, 20, 5), np.uint8), 8)


def bad_packer_cases(P, to):
    """(what, call, exception, message prefix) for the packers of module `P`
    (rawkv.reference.gemm on numpy arrays, or rawkv.gemm.pack on torch
    tensors: `to` converts a numpy array). Both apply one rule
    (rawkv.reference.gemm.check_*); the torch packer raised KeyError,
    IndexError or RuntimeError on these, the reference TypeErrors naming
    nothing (n=16.0, k=None) or took block=16.0."""
    codes = np.zeros((1, 16, 32), np.uint8)
    scales = np.zeros((1, 16, 4), np.uint8)
    pc, ps = to(R.pack_codes(codes)), to(R.pack_scales(scales, 16))
    return [
        ("codes 2-d", lambda: P.pack_codes(to(codes[0])), ValueError, "codes: expected a 3-d"),
        ("codes float32", lambda: P.pack_codes(to(codes.astype(np.float32))), TypeError, "codes: expected uint8"),
        ("codes None", lambda: P.pack_codes(None), TypeError, "codes:"),
        ("scales 4-d", lambda: P.pack_scales(to(scales[None]), 16), ValueError, "scales: expected a 3-d"),
        ("scales int16", lambda: P.pack_scales(to(scales.astype(np.int16)), 16), TypeError, "scales: expected uint8"),
        *[(f"block {b!r}", (lambda b=b: P.pack_scales(to(scales), b)), ValueError, "block:") for b in (8, 0, 64, -16)],
        *[(f"block {b!r}", (lambda b=b: P.pack_scales(to(scales), b)), TypeError, "block:")
          for b in (16.0, True, None, "16")],
        ("unpack_codes n", lambda: P.unpack_codes(pc, 17, 64), ValueError, "packed: expected shape"),
        ("unpack_codes odd k", lambda: P.unpack_codes(pc, 16, 63), ValueError, "k: must be a multiple of 2"),
        ("unpack_codes negative n", lambda: P.unpack_codes(pc, -16, 64), ValueError, "n: must be >= 0"),
        ("unpack_codes float n", lambda: P.unpack_codes(pc, 16.0, 64), TypeError, "n: expected an int"),
        ("unpack_codes k None", lambda: P.unpack_codes(pc, 16, None), TypeError, "k: expected an int"),
        ("unpack_codes 4-d", lambda: P.unpack_codes(pc[0], 16, 64), ValueError, "packed: expected a 5-d"),
        ("unpack_codes int32", lambda: P.unpack_codes(to(R.pack_codes(codes).astype(np.int32)), 16, 64),
         TypeError, "packed: expected uint8"),
        ("unpack_codes of scales", lambda: P.unpack_codes(ps, 16, 64), ValueError, "packed: expected shape"),
        ("unpack_scales block 8", lambda: P.unpack_scales(ps, 16, 64, 8), ValueError, "block:"),
        ("unpack_scales block 0", lambda: P.unpack_scales(ps, 16, 64, 0), ValueError, "block:"),
        ("unpack_scales block 32.0", lambda: P.unpack_scales(ps, 16, 64, 32.0), TypeError, "block:"),
        ("unpack_scales k", lambda: P.unpack_scales(ps, 16, 48, 32), ValueError, "k: must be a multiple of 32"),
        ("unpack_scales n", lambda: P.unpack_scales(ps, 40, 64, 16), ValueError, "packed: expected shape"),
        ("unpack_scales of codes", lambda: P.unpack_scales(pc, 16, 64, 16), ValueError, "packed: expected shape"),
        ("unpack_scales bool n", lambda: P.unpack_scales(ps, True, 64, 16), TypeError, "n: expected an int"),
    ]


def check_bad_packer_cases(P, to):
    import re
    for what, call, exc, msg in bad_packer_cases(P, to):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            call()
        print("refused:", what)


def test_packers_refuse_bad_arguments_by_name():
    check_bad_packer_cases(R, lambda a: a)


def _exact(v: float) -> Fraction:
    return Fraction(v)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_weight_is_exact(rng, fmt):
    # The value of element (g, n, k) is e2m1(code) * scale * gs[g]
    # (docs/gemm.md, "Weights"), computed here in exact rationals.
    block = R.BLOCKS[fmt]
    g, n, k = 2, 5, 64
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 256, (g, n, k // block), dtype=np.uint8)
    gs = rng.uniform(1e-6, 1e3, g).astype(np.float32) if fmt == "nvfp4" else None
    got = R.dequantize_weight(codes, scales, gs, fmt)
    assert got.dtype == np.float64 and got.shape == (g, n, k)
    nibbles = np.stack((codes & 0xF, codes >> 4), -1).reshape(g, n, k)
    for gi, ni, ki in np.ndindex(g, n, k):
        byte = int(scales[gi, ni, ki // block])
        if fmt == "nvfp4":
            s = float(e4m3_decode(byte))
        else:
            s = math.nan if byte == 255 else Fraction(2) ** (byte - 127)
        if isinstance(s, float) and math.isnan(s):
            assert math.isnan(got[gi, ni, ki])
            continue
        want = _exact(float(E2M1_VALUES[nibbles[gi, ni, ki]])) * Fraction(s) * \
            (_exact(float(gs[gi])) if gs is not None else 1)
        assert Fraction(float(got[gi, ni, ki])) == want, (gi, ni, ki)


def test_dequantize_weight_nan_scales():
    codes = np.full((1, 1, 16), 0x22, np.uint8)            # 1.0 everywhere
    nv = R.dequantize_weight(codes, np.array([[[0x7F, 0xFF]]], np.uint8), [1.0], "nvfp4")
    assert np.isnan(nv).all()
    mx = R.dequantize_weight(codes, np.array([[[255]]], np.uint8), None, "mxfp4")
    assert np.isnan(mx).all()
    ok = R.dequantize_weight(codes, np.array([[[0]]], np.uint8), None, "mxfp4")
    assert (ok == 2.0 ** -127).all()


def _int_data(rng, shape, specials=0):
    """Small integers (float64 sums exact in any order), with some +-Inf /
    NaN; IEEE propagation of those does not depend on the order either."""
    a = rng.integers(-8, 9, shape).astype(np.float64)
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, specials, replace=False)
    flat[idx] = rng.choice([np.inf, -np.inf, np.nan], specials)
    return a


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # Inf / NaN on purpose
def test_grouped_equals_loops(rng):
    t, g, n, k = 3, 4, 5, 32
    x, w = _int_data(rng, (t, g, k), 3), _int_data(rng, (g, n, k), 2)
    want = np.zeros((t, g, n))
    for ti, gi, ni in np.ndindex(t, g, n):
        acc = 0.0
        for ki in range(k):
            acc += x[ti, gi, ki] * w[gi, ni, ki]
        want[ti, gi, ni] = acc
    got = R.grouped(x, w)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # Inf / NaN on purpose
def test_zero_times_inf_is_nan_in_both_modes():
    # IEEE: 0 * Inf = NaN, also where a BLAS would skip the zero weight
    x = np.array([[np.inf, 1.0], [1.0, 2.0]])
    w = np.array([[[0.0, 1.0], [0.0, 0.0], [2.0, 3.0]]])
    want = np.array([[np.nan, np.nan, np.inf], [2.0, 0.0, 8.0]])
    np.testing.assert_array_equal(R.grouped(x[:, None], w)[:, 0], want)
    np.testing.assert_array_equal(R.ragged(x, w, [0, 2])[0], want)
    np.testing.assert_array_equal(R.grouped(x[::-1, None].copy(), w * np.inf)[:, 0],
                                  np.array([[np.nan, np.nan, np.inf], [np.nan, np.nan, np.inf]]))


def clamp_by_the_rule(offsets, rows):
    """docs/gemm.md, "Ragged offsets", as written."""
    out = []
    for e, o in enumerate(offsets):
        lo = 0 if e == 0 else out[-1]
        out.append(min(max(o, lo), rows))
    return out, sum(a != b for a, b in zip(out, offsets))


@pytest.mark.parametrize("offsets,want,errors", RAGGED_OFFSET_CASES)
def test_ragged_offsets_rule(rng, offsets, want, errors):
    rows, n, k = 9, 3, 16
    x = _int_data(rng, (rows, k))
    w = _int_data(rng, (len(offsets) - 1, n, k))
    assert clamp_by_the_rule(offsets, rows) == (want, errors)
    c, errs = R.clamp_offsets(np.array(offsets), rows)
    assert c.tolist() == want and errs == errors
    got, errs = R.ragged(x, w, np.array(offsets, np.int32))
    assert errs == errors
    expect = np.zeros((rows, n))
    for e in range(len(offsets) - 1):
        for r in range(want[e], want[e + 1]):
            for ni in range(n):
                expect[r, ni] = sum(x[r, ki] * w[e, ni, ki] for ki in range(k))
    np.testing.assert_array_equal(got, expect)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # Inf / NaN on purpose
def test_ragged_random_offsets(rng):
    rows, experts, n, k = 23, 6, 4, 32
    x, w = _int_data(rng, (rows, k), 4), _int_data(rng, (experts, n, k), 2)
    for _ in range(50):
        offsets = rng.integers(-4, rows + 5, experts + 1)
        if rng.random() < 0.5:
            offsets.sort()
        want, errors = clamp_by_the_rule(offsets.tolist(), rows)
        got, errs = R.ragged(x, w, offsets)
        assert errs == errors
        owner = np.full(rows, -1)
        for e in range(experts):
            owner[want[e]:want[e + 1]] = e
        for r in range(rows):
            row = np.zeros(n) if owner[r] < 0 else np.array(
                [sum(x[r, ki] * w[owner[r], ni, ki] for ki in range(k)) for ni in range(n)])
            np.testing.assert_array_equal(got[r], row)


def test_ragged_counts_nothing_where_nothing_is_multiplied(rng):
    # docs/gemm.md, "Ragged offsets": no rows or no output features, no count
    # (the GPU runs no kernel to read the offsets then); the same offsets
    # with rows and features are counted
    bad = np.array([3, 1, 7, -2], np.int32)
    assert R.ragged(_int_data(rng, (5, 16)), _int_data(rng, (3, 2, 16)), bad)[1] == 3
    for rows, n in ((0, 2), (5, 0), (0, 0)):
        got, errs = R.ragged(np.zeros((rows, 16)), np.zeros((3, n, 16)), bad)
        assert errs == 0 and got.shape == (rows, n)


def test_ragged_refuses_wrong_offsets_shape():
    with pytest.raises(ValueError, match="^offsets:"):
        R.ragged(np.zeros((4, 16)), np.zeros((2, 3, 16)), np.array([0, 4]))


# -- float64 -> BF16 ---------------------------------------------------------------

def _bf16_value(bits: int) -> float:
    """Finite BF16 bits (0 .. 0x7F7F) -> value; 0x7F80 stands for 2^128 (where
    IEEE rounding with an unbounded exponent would go, so >= the tie
    2^128 - 2^119 becomes Inf)."""
    if bits == 0x7F80:
        return 2.0 ** 128
    e, m = bits >> 7, bits & 0x7F
    return math.ldexp(m, -133) if e == 0 else math.ldexp(128 + m, e - 134)


_POS = [_bf16_value(b) for b in range(0x7F81)]            # increasing


def oracle_bf16(v: float) -> int:
    """Nearest BF16 of a float64 by exact rational distances, ties to the
    even bit pattern; NaN -> 0x7FC0 with the sign."""
    sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
    if math.isnan(v):
        return sign | 0x7FC0
    a = abs(v)
    if a >= 2.0 ** 128:
        return sign | 0x7F80
    hi = bisect.bisect_left(_POS, a)                         # _POS[hi] >= a
    if _POS[hi] == a:
        return sign | hi
    lo = hi - 1
    dl, dh = Fraction(a) - Fraction(_POS[lo]), Fraction(_POS[hi]) - Fraction(a)
    pick = lo if dl < dh or (dl == dh and lo % 2 == 0) else hi
    return sign | pick


def _bf16_test_values(rng) -> np.ndarray:
    bits = rng.integers(0, 0x7F80, 3000)
    lo = np.array([_POS[b] for b in bits])
    hi = np.array([_POS[b + 1] for b in bits])
    mid = (lo + hi) / 2                                        # exact: 9 significant bits
    vals = [mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), lo, hi,
            # float64 noise below float32's precision: rounding through float32
            # first would land on the tie (double rounding)
            mid + lo * 2.0 ** -40, mid - lo * 2.0 ** -40,
            rng.standard_normal(2000) * np.exp2(rng.integers(-140, 130, 2000)),
            np.exp2(rng.uniform(-1074, 1023, 2000)),
            np.array([0.0, 2.0 ** -133, 2.0 ** -134, 3 * 2.0 ** -134, 2.0 ** -134 + 2.0 ** -160,
                      2.0 ** -134 - 2.0 ** -160, 5e-324, 2.0 ** -126, 2.0 ** -126 - 2.0 ** -134,
                      2.0 ** 128 - 2.0 ** 119, np.nextafter(2.0 ** 128 - 2.0 ** 119, 0),
                      2.0 ** 128 - 2.0 ** 120, 2.0 ** 128, 1e300, np.inf, np.nan,
                      1 + 2.0 ** -8 + 2.0 ** -40])]
    v = np.concatenate(vals)
    return np.concatenate([v, -v])


def test_round_to_bf16_against_oracle(rng):
    v = _bf16_test_values(rng)
    got = R.round_to_bf16(v)
    assert got.dtype == np.uint16
    want = np.array([oracle_bf16(float(x)) for x in v], np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(float(v[i]).hex(), hex(got[i]), hex(want[i])) for i in bad[:5]]


def test_round_to_bf16_known_values():
    # Direct RNE, not through float32 (which would give 0x3F80, 0x7F80, 0x0000):
    v = np.array([1 + 2.0 ** -8 + 2.0 ** -40, 2.0 ** 128 - 2.0 ** 119 - 2.0 ** 100,
                  2.0 ** -134 + 2.0 ** -160, 2.0 ** 128 - 2.0 ** 119, -0.0, -np.nan])
    np.testing.assert_array_equal(R.round_to_bf16(v),
                                  np.array([0x3F81, 0x7F7F, 0x0001, 0x7F80, 0x8000, 0xFFC0], np.uint16))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # Inf / NaN on purpose
def test_round_to_bf16_matches_torch_on_float32_inputs(rng):
    # torch's float64 -> bfloat16 goes through float32 (it gives 0x3F80 for
    # 1 + 2^-8 + 2^-40, where direct rounding gives 0x3F81), so it is an
    # oracle only where the float32 step is exact: float32-representable
    # inputs. There its RNE must agree with ours bit for bit (NaN aside:
    # torch drops the sign).
    torch = pytest.importorskip("torch")
    v = _bf16_test_values(rng).astype(np.float32).astype(np.float64)
    v = v[~np.isnan(v)]
    want = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(R.round_to_bf16(v), want)


def test_nvfp4_factor_bytes_give_the_kernels_factors_exactly():
    # docs/gemm.md, "Packed form": the factor byte b of every E4M3 scale
    # (0x00 .. 0x7E) gives scale * 2^117 as BF16 bits 0x7000 + (b << 4) and
    # scale * 2^5 as FP16 bits b << 7 (zero: b = 0, FP16 0), and unpacks to
    # the same byte.
    v = np.arange(0x7F, dtype=np.uint8)
    b = R.NV_FACTOR_OF_E4M3[v].astype(np.uint32)
    scale = e4m3_decode(v).astype(np.float64)
    bf16 = ((0x7000 + (b << 4)) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    nz = scale != 0
    np.testing.assert_array_equal(bf16[nz], scale[nz] * 2.0 ** 117)
    f16 = (b << 7).astype(np.uint16).view(np.float16).astype(np.float64)
    np.testing.assert_array_equal(f16, scale * 2.0 ** 5)
    assert b[0] == 0 and (b[1:] >= 88).all()
    np.testing.assert_array_equal(R.E4M3_OF_NV_FACTOR[R.NV_FACTOR_OF_E4M3[v]], v)
    assert R.NV_FACTOR_OF_E4M3[0x7F] == 0xFF and R.E4M3_OF_NV_FACTOR[0xFF] == 0x7F
