"""The W4A8 GEMM reference (rawkv.reference.gemm_w4a8; docs/gemm.md "W4A8
(issue 23)"): the E4M3 exactness claim exhaustively, the weight rule (its
rebase maximal: it refuses only rows no power of two holds, and names the
blocks), the products against an independent float64 computation, the
ragged offsets rule, and the error bound of tests/support/gemm_w4a8.py (that
it holds for models of the kernel's order and that it can fail). Random
tests take `rng` (its seed printed on failure; RAWKV_TEST_SEED replays)."""
from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest

from rawkv.reference import gemm as G
from rawkv.reference import gemm_w4a8 as W
from support import gemm_w4a8 as B
from support.ragged import RAGGED_OFFSET_CASES


def e4m3_values() -> np.ndarray:
    """The finite E4M3 values, from the bit layout written out here (not
    rawkv.reference.formats): exponent field e, mantissa m."""
    vals = []
    for byte in range(0x7F):                                  # 0x7F is NaN
        e, m = byte >> 3, byte & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    vals = np.array(vals)
    return np.concatenate([vals, -vals])


E4M3 = e4m3_values()
E2M1_MAG = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def _mxfp4(nibbles: np.ndarray) -> np.ndarray:
    """(..., K) 4-bit codes -> (..., K/2) bytes, element 2j low."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


# -- exactness ----------------------------------------------------------------------

def test_e2m1_times_power_of_two_is_e4m3_exactly_when_the_rule_says():
    # every magnitude x every shift that reaches past E4M3's range both ways
    for mag in range(8):
        for e in range(-30, 31):
            v = E2M1_MAG[mag] * 2.0 ** e
            assert bool(np.isin(v, E4M3)) == bool(W.exact_shift(mag, e)), (mag, e)


def test_shift_table_holds_the_exact_e4m3_bytes_and_nan_elsewhere():
    assert W.SHIFT_TABLE.shape == (W.SHIFT_MAX - W.SHIFT_MIN + 1, 8)
    assert (W.SHIFT_MIN, W.SHIFT_MAX, W.SHIFT_BIAS) == (-11, 9, 11)
    for row in range(W.SHIFT_TABLE.shape[0]):
        e = row - W.SHIFT_BIAS
        for mag in range(8):
            byte = int(W.SHIFT_TABLE[row, mag])
            want = Fraction(E2M1_MAG[mag]) * Fraction(2) ** e
            if np.isin(float(want), E4M3):
                assert byte < 0x7F and Fraction(E4M3[byte]) == want, (e, mag)
            else:
                assert byte == 0x7F, (e, mag)
    # a block whose shift is outside [-11, 9] has no nonzero element that fits
    for e in (W.SHIFT_MIN - 1, W.SHIFT_MAX + 1):
        assert not W.exact_shift(np.arange(1, 8), e).any()


def _rows_of_pairs(c0, b0, c1, b1):
    """One row per case: element 0 (block 0) code c0 under byte b0, element
    32 (block 1) code c1 under b1, every other element 0."""
    nib = np.zeros((len(c0), 64), np.uint8)
    nib[:, 0], nib[:, 32] = c0, c1
    return _mxfp4(nib)[None], np.stack([b0, b1], -1).astype(np.uint8)[None]


def test_rule_is_exhaustive_over_codes_and_scale_bytes():
    # Every E2M1 code (signs too) under every scale byte, beside a fixed
    # element (magnitude 1, byte 127) in the row's other block: the rule
    # accepts exactly the rows for which SOME power of two 2^-r makes both
    # elements E4M3 values (searched here over every r that could), and its
    # values are then the MXFP4 values exactly.
    codes = np.arange(16)
    c0, b0 = np.meshgrid(codes, np.arange(256), indexing="ij")
    c0, b0 = c0.ravel(), b0.ravel()
    c1, b1 = np.full_like(c0, 2), np.full_like(c0, 127)
    w_codes, w_scales = _rows_of_pairs(c0, b0, c1, b1)
    shifts, rebase, bad = W.w4a8_blocks(w_codes, w_scales)
    mxfp4 = G.dequantize_weight(w_codes, w_scales, None, "mxfp4")[0]
    r = np.arange(-160, 161)
    with np.errstate(over="ignore"):
        v0 = (np.sign(1 - 2 * (c0 >> 3)) * E2M1_MAG[c0 & 7] * np.ldexp(1.0, b0 - 127))[:, None] * np.ldexp(1.0, -r)
    v1 = 1.0 * np.ldexp(1.0, -r)[None, :]
    fits = (np.isin(v0, E4M3) & np.isin(v1, E4M3)).any(-1) & (b0 != 255)
    np.testing.assert_array_equal(~bad[0].any(-1), fits)
    assert bad[0, b0 == 255, 0].all()                       # NaN, zero code or not
    ok = ~bad[0].any(-1)
    vals = W.w4a8_codes(w_codes, shifts)
    from rawkv.reference.formats import e4m3_decode
    got = e4m3_decode(vals[0, ok]).astype(np.float64) * np.ldexp(1.0, rebase[0, ok])[:, None]
    np.testing.assert_array_equal(got, mxfp4[ok])
    # the shifts of accepted blocks with a nonzero element stay in the table
    assert (shifts[0, ok] <= W.SHIFT_MAX + W.SHIFT_BIAS).all()


@pytest.mark.parametrize("byte", [0, 1, 4, 126, 127, 128, 137, 254])
def test_boundary_bytes_alone_are_exact(byte):
    # a row holding every magnitude under one scale byte spans 2^-1 .. 6:
    # always held, at any byte but 255
    nib = np.tile(np.arange(16, dtype=np.uint8), 2)[None, None]
    w_codes, w_scales = _mxfp4(nib), np.full((1, 1, 1), byte, np.uint8)
    np.testing.assert_array_equal(W.weight_values(w_codes, w_scales),
                                  G.dequantize_weight(w_codes, w_scales, None, "mxfp4"))
    shifts, rebase = W.w4a8_form(w_codes, w_scales)
    assert rebase[0, 0] == byte - 127 + 2 - 8            # 6 = 1.5 * 2^2 brought to 2^8's binade
    assert shifts[0, 0, 0] == 6 + W.SHIFT_BIAS


def test_nan_scale_is_refused_even_with_zero_codes():
    w_codes = np.zeros((1, 2, 16), np.uint8)
    w_scales = np.array([[[127], [255]]], np.uint8)
    with pytest.raises(ValueError, match=r"^weight: 1 MXFP4 block\(s\).*\(g=0, n=1, block=0: byte 255\)"):
        W.w4a8_form(w_codes, w_scales)


def test_zero_blocks_take_any_byte_and_a_zero_row_rebases_by_one():
    nib = np.zeros((1, 2, 96), np.uint8)
    nib[0, 0, 40] = 7                                      # 6 in block 1 of row 0
    w_scales = np.array([[[0, 137, 4], [0, 200, 254]]], np.uint8)
    shifts, rebase = W.w4a8_form(_mxfp4(nib), w_scales)
    assert rebase.tolist() == [[137 - 127 + 2 - 8, 0]]
    assert shifts.tolist() == [[[W.ZERO_SHIFT, 6 + W.SHIFT_BIAS, W.ZERO_SHIFT], [W.ZERO_SHIFT] * 3]]


def test_shift_bytes_past_the_table_read_as_zeros_and_are_counted(rng):
    # the bytes past the table: from SHIFT_ROWS = 21 (no accepted block's) on
    assert W.SHIFT_ROWS == W.SHIFT_MAX + W.SHIFT_BIAS + 1 == 21
    assert W.past_table(np.arange(256, dtype=np.uint8)).tolist() == [b >= 21 for b in range(256)]
    g, n, k = 2, 3, 128
    nib = rng.integers(0, 16, (g, n, k), dtype=np.uint8)
    codes = _mxfp4(nib)
    shifts = rng.integers(0, W.SHIFT_ROWS, (g, n, k // 32)).astype(np.uint8)
    shifts[0, 1, 2], shifts[1, 0, 0], shifts[1, 2, 3] = 21, 255, 20          # (20: the table's last row)
    bad = shifts >= 21
    e4m3 = W.w4a8_codes(codes, shifts).reshape(g, n, k // 32, 32)
    nb = nib.reshape(g, n, k // 32, 32)
    # a bad block's elements: +-0 (the code's sign, as the kernel keeps it); the others the table's
    np.testing.assert_array_equal(e4m3[bad], (nb[bad] & 8) << 4)
    np.testing.assert_array_equal(e4m3[~bad], W.SHIFT_TABLE[shifts[~bad][:, None], nb[~bad] & 7] | ((nb[~bad] & 8) << 4))
    rows = np.ldexp(1.0, rng.integers(-8, 8, (g, n))).astype(np.float32)
    gs = np.array([1.0, 0.5], np.float32)
    vals = W.form_values(codes, shifts, rows, gs)
    assert (vals.reshape(g, n, k // 32, 32)[bad] == 0).all()
    # the other blocks as with the bad ones' bytes in the table; gs multiplies each group
    clean = W.form_values(codes, np.where(bad, W.ZERO_SHIFT, shifts).astype(np.uint8), rows)
    np.testing.assert_array_equal(vals.reshape(g, n, k // 32, 32)[~bad],
                                  (clean * gs[:, None, None]).reshape(g, n, k // 32, 32)[~bad])
    # counted once per block, in the groups that multiply a row
    assert [W.shift_errors(shifts, live) for live in ([1, 1], [1, 0], [0, 1], [0, 0])] == [2, 1, 1, 0]
    x_codes, x_scales = _activation(rng, (4, g), k, "fp32")
    out, errors = W.form_grouped(x_codes, x_scales, codes, shifts, rows, gs)
    assert errors == 2
    np.testing.assert_array_equal(out, G.grouped(W.activation_values(x_codes, x_scales), vals))
    assert W.form_grouped(x_codes[:0], x_scales[:0], codes, shifts, rows, gs)[1] == 0      # no rows: none
    xr, sr = _activation(rng, (6,), k, "ue8m0")
    for offsets, want in (([0, 3, 6], 2), ([0, 6, 6], 1), ([0, 0, 6], 1), ([4, 2, 6], 1 + 1), ([0, 0, 0], 0)):
        out, errors = W.form_ragged(xr, sr, codes, shifts, rows, gs, np.array(offsets, np.int32))
        assert errors == want, offsets
        ref, _ = G.ragged(W.activation_values(xr, sr), vals, np.array(offsets, np.int32))
        np.testing.assert_array_equal(out, ref)


# -- the weight rule on random weights ----------------------------------------------------

def test_random_weights_in_a_narrow_range_are_exact(rng):
    g, n, k = 3, 7, 192
    w_codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    w_scales = rng.integers(118, 131, (g, n, k // 32), dtype=np.uint8)    # spans <= 12 binades
    np.testing.assert_array_equal(W.weight_values(w_codes, w_scales),
                                  G.dequantize_weight(w_codes, w_scales, None, "mxfp4"))


def test_refusal_names_the_blocks_and_counts_them(rng):
    g, n, k = 2, 5, 128
    w_codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8) | 0x22   # every element nonzero
    w_scales = np.full((g, n, k // 32), 127, np.uint8)
    w_scales[1, 3, 2] = 100                          # 27 binades below its row: refused
    w_scales[0, 0, 0] = 150                          # lifts row 0: its other blocks fall out
    with pytest.raises(ValueError) as exc:
        W.w4a8_form(w_codes, w_scales)
    msg = str(exc.value)
    assert msg.startswith("weight: 4 MXFP4 block(s)"), msg
    assert "(g=0, n=0, block=1: byte 127), (g=0, n=0, block=2: byte 127), (g=0, n=0, block=3: byte 127), " \
           "(g=1, n=3, block=2: byte 100)." in msg, msg
    assert "W4A16" in msg
    many = np.full((1, 12, 2), 127, np.uint8)
    many[0, :, 1] = 1
    with pytest.raises(ValueError, match=re.escape("weight: 12 MXFP4 block(s)") + ".*" +
                       re.escape("(g=0, n=7, block=1: byte 1) and 4 more.")):
        W.w4a8_form(np.full((1, 12, 32), 0x22, np.uint8), many, name="weight")


def test_rule_refuses_bad_arguments_by_name():
    with pytest.raises(TypeError, match="^codes: expected uint8"):
        W.w4a8_form(np.zeros((1, 2, 16), np.int8), np.zeros((1, 2, 1), np.uint8))
    with pytest.raises(ValueError, match="^scales: expected shape"):
        W.w4a8_form(np.zeros((1, 2, 16), np.uint8), np.zeros((1, 2, 2), np.uint8))
    with pytest.raises(ValueError, match="^codes: expected a 3-d"):
        W.w4a8_form(np.zeros((2, 16), np.uint8), np.zeros((1, 2, 1), np.uint8))


# -- activations and the products ------------------------------------------------------

def _activation(rng, lead, k, scale_format):
    codes = rng.integers(0, 256, (*lead, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A                     # no NaN codes unless asked
    nb = -(-k // 128)
    if scale_format == "ue8m0":
        scales = rng.integers(110, 140, (*lead, nb), dtype=np.uint8)
    else:
        scales = (rng.random((*lead, nb)) * 0.05 + 1e-3).astype(np.float32)
    return codes, scales


def _activation_by_hand(codes, scales):
    """E4M3 code value x scale in exact rationals, element by element."""
    out = np.empty(codes.shape)
    for idx in np.ndindex(codes.shape):
        byte = int(codes[idx])
        sign = -1 if byte & 0x80 else 1
        v = Fraction(E4M3[byte & 0x7F]) * sign
        s = scales[(*idx[:-1], idx[-1] // 128)]
        s = Fraction(2) ** (int(s) - 127) if scales.dtype == np.uint8 else Fraction(float(s))
        out[idx] = float(v * s)                               # exact: 4 x 24 bits
        assert Fraction(out[idx]) == v * s
    return out


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_activation_values_are_code_times_block_scale(rng, scale_format):
    codes, scales = _activation(rng, (2, 3), 200, scale_format)     # a partial last block
    np.testing.assert_array_equal(W.activation_values(codes, scales), _activation_by_hand(codes, scales))
    nan = np.array([[0x7F, 0xFF, 0x38]], np.uint8)
    assert np.isnan(W.activation_values(nan, np.array([[1.0]], np.float32))[0, :2]).all()
    assert np.isnan(W.activation_values(nan[:, 2:], np.array([[255]], np.uint8))).all()


def test_activation_arguments_are_named():
    c = np.zeros((2, 130), np.uint8)
    with pytest.raises(TypeError, match="^x_codes: expected uint8"):
        W.activation_values(c.astype(np.int16), np.ones((2, 2), np.float32))
    with pytest.raises(TypeError, match="^x_scales: expected float32"):
        W.activation_values(c, np.ones((2, 2)))
    with pytest.raises(ValueError, match=re.escape("x_scales: expected shape (2, 2)")):
        W.activation_values(c, np.ones((2, 1), np.float32))


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_grouped_against_an_independent_float64_sum(rng, scale_format):
    t, g, n, k = 3, 2, 5, 160
    x_codes, x_scales = _activation(rng, (t, g), k, scale_format)
    w_codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    w_scales = rng.integers(120, 132, (g, n, k // 32), dtype=np.uint8)
    got = W.grouped(x_codes, x_scales, w_codes, w_scales)
    x = _activation_by_hand(x_codes, x_scales)
    w = G.dequantize_weight(w_codes, w_scales, None, "mxfp4")
    for ti, gi, ni in np.ndindex(t, g, n):
        want = math.fsum(x[ti, gi, kk] * w[gi, ni, kk] for kk in range(k))   # correctly rounded
        assert abs(got[ti, gi, ni] - want) <= k * 2.0 ** -53 * np.abs(x[ti, gi] * w[gi, ni]).sum()


def test_grouped_refuses_a_weight_the_rule_refuses():
    with pytest.raises(ValueError, match=r"^weight: 1 MXFP4 block"):
        W.grouped(np.zeros((1, 1, 64), np.uint8), np.ones((1, 1, 1), np.float32),
                  np.full((1, 1, 32), 0x11, np.uint8), np.array([[[127, 90]]], np.uint8))


@pytest.mark.parametrize("offsets,want,errors", [*RAGGED_OFFSET_CASES,
                                                  ([0], [0], 0)])     # no experts: every row zero
def test_ragged_offsets_rule(rng, offsets, want, errors):
    rows, n, k = 9, 3, 64
    e = len(offsets) - 1
    x_codes, x_scales = _activation(rng, (rows,), k, "ue8m0")
    w_codes = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
    w_scales = rng.integers(122, 132, (e, n, k // 32), dtype=np.uint8)
    got, errs = W.ragged(x_codes, x_scales, w_codes, w_scales, np.array(offsets, np.int32))
    assert errs == errors
    x = _activation_by_hand(x_codes, x_scales)
    w = G.dequantize_weight(w_codes, w_scales, None, "mxfp4")
    expect = np.zeros((rows, n))
    for ei in range(e):
        for r in range(want[ei], want[ei + 1]):
            for ni in range(n):
                expect[r, ni] = math.fsum(x[r, kk] * w[ei, ni, kk] for kk in range(k))
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-12 * np.abs(expect).max(initial=1.0))
    assert (got[[r for r in range(rows) if not any(want[i] <= r < want[i + 1] for i in range(e))]] == 0).all()


# -- the bound -------------------------------------------------------------------------

def _case(rng, t, g, n, k, scale_format, same_sign=False):
    x_codes, x_scales = _activation(rng, (t, g), k, scale_format)
    w_codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    if same_sign:                                       # no cancellation: the sum is the absolute sum
        x_codes &= 0x7F
        w_codes &= 0x77
    w_scales = rng.integers(118, 131, (g, n, k // 32), dtype=np.uint8)
    return x_codes, x_scales, w_codes, w_scales


@pytest.mark.parametrize("mma", ["fp32", "e8m13"])
@pytest.mark.parametrize("scale_format,k", [("fp32", 256), ("ue8m0", 224), ("fp32", 96)])
def test_bound_holds_for_models_of_the_kernel_order(rng, mma, scale_format, k):
    case = _case(rng, 4, 2, 6, k, scale_format)
    exact, absolute = B.exact_and_absolute(*case)
    B.assert_within_bound(B.kernel_order(*case, mma=mma), exact, absolute, k, f"{mma} {scale_format}")


def test_bound_holds_for_the_e8m13_model_where_it_loses_most():
    # a large product first (448 * 6 = 2688: a 14-bit accumulator's step is
    # 0.25 there), then 127 products of 0.375 * 0.5 = 0.1875 that it drops
    # one by one: 23.8 lost, past BF16's step (16) and FP32's bound
    k = 128
    x_codes = np.full((1, 1, k), 0x2C, np.uint8)               # 0.375
    x_codes[0, 0, 0] = 0x7E                                    # 448
    w_codes = np.full((1, 1, k // 2), 0x11, np.uint8)          # 0.5
    w_codes[0, 0, 0] = 0x17                                    # 6, then 0.5
    w_scales = np.full((1, 1, k // 32), 127, np.uint8)
    x_scales = np.ones((1, 1, 1), np.float32)
    exact, absolute = B.exact_and_absolute(x_codes, x_scales, w_codes, w_scales)
    got = B.kernel_order(x_codes, x_scales, w_codes, w_scales, mma="e8m13")
    assert got[0, 0, 0] < B.bf16_values(exact)[0, 0, 0]        # the model loses what it should
    B.assert_within_bound(got, exact, absolute, k)
    # ... and the MMA term is what covers it: FP32 accumulation's bound alone fails
    with pytest.raises(AssertionError, match="past the bound"):
        B.assert_within_bound(got, exact, absolute, k, mma_unit=2.0 ** -23)


def test_bound_fails_past_it(rng):
    k = 256
    case = _case(rng, 3, 2, 4, k, "ue8m0")
    exact, absolute = B.exact_and_absolute(*case)
    got = B.bf16_values(exact)
    B.assert_within_bound(got, exact, absolute, k)
    tol = B.bound(exact, absolute, k)
    bad = got.copy()
    bad[1, 0, 2] = exact[1, 0, 2] + 1.01 * tol[1, 0, 2]
    with pytest.raises(AssertionError, match="1 outputs past the bound"):
        B.assert_within_bound(bad, exact, absolute, k)
    nan = got.copy()
    nan[0, 1, 1] = np.nan
    with pytest.raises(AssertionError, match="NaN positions differ"):
        B.assert_within_bound(nan, exact, absolute, k)


def test_bound_catches_one_block_scaled_wrong(rng):
    # a kernel applying the wrong activation block's scale (here: one block's
    # scale doubled) on inputs without cancellation is caught
    k = 256
    x_codes, x_scales, w_codes, w_scales = _case(rng, 2, 2, 4, k, "ue8m0", same_sign=True)
    # Both blocks' products of one size (random scales can leave block 1 2^-40
    # of the sum, where doubling it moves nothing a BF16 result shows).
    x_scales[:, :, 1] = x_scales[:, :, 0]
    w_scales[:] = 127
    exact, absolute = B.exact_and_absolute(x_codes, x_scales, w_codes, w_scales)
    wrong = x_scales.copy()
    wrong[:, :, 1] += 1
    with pytest.raises(AssertionError, match="past the bound"):
        B.assert_within_bound(B.kernel_order(x_codes, wrong, w_codes, w_scales), exact, absolute, k)


def test_bound_zero_rows_must_be_zero():
    exact = absolute = np.zeros((2, 3))
    B.assert_within_bound(np.zeros((2, 3)), exact, absolute, 128)
    with pytest.raises(AssertionError):
        B.assert_within_bound(np.full((2, 3), 2.0 ** -120), exact, absolute, 128)


# -- rawkv.gemm.w4a8_weight: the rule on an Fp4Weight --------------------------------------

def test_w4a8_weight_is_the_reference_rule_packed(rng):
    torch = pytest.importorskip("torch")
    import rawkv
    g, n, k = 2, 21, 160                                   # padding rows and columns
    w_codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    w_scales = rng.integers(4, 138, (g, n, k // 32), dtype=np.uint8)
    w_scales[:, :, :] = np.clip(w_scales[:, :1, :1] + rng.integers(-6, 7, (g, n, k // 32)), 4, 137)
    w_scales = w_scales.astype(np.uint8)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(w_codes), torch.from_numpy(w_scales), groups=g)
    w8 = rawkv.gemm.w4a8_weight(w)
    shifts, rebase = W.w4a8_form(w_codes, w_scales)
    np.testing.assert_array_equal(w8.codes.numpy(), W.pack_codes8(w_codes))
    np.testing.assert_array_equal(w8.shifts.numpy(), W.pack_shifts8(shifts))
    npad = W.padded8(n, k)[0]
    assert w8.row_scale.dtype == torch.float32 and tuple(w8.row_scale.shape) == (g, npad)
    np.testing.assert_array_equal(w8.row_scale.numpy()[:, :n], np.ldexp(1.0, rebase))
    assert (w8.row_scale.numpy()[:, n:] == 1).all()
    # padding blocks take a row of the table whose entry 0 is 0
    assert (w8.shifts.numpy() <= W.SHIFT_MAX + W.SHIFT_BIAS).all()
    assert (w8.n, w8.k, w8.groups) == (n, k, g) and torch.equal(w8.gs, w.gs)
    # the global scales are the form's own (they were the Fp4Weight's tensor): a later change
    # of the Fp4Weight's leaves them
    w.gs.fill_(2.0)
    assert torch.equal(w8.gs, torch.ones(g))


# -- the W4A8 kernel's packed layout ----------------------------------------------------------

@pytest.mark.parametrize("g, n, k", [(1, 16, 128), (2, 21, 160), (3, 40, 288)])
def test_packed_codes_and_shifts_round_trip(rng, g, n, k):
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    shifts = rng.integers(0, 21, (g, n, k // 32), dtype=np.uint8)
    p, ps = W.pack_codes8(codes), W.pack_shifts8(shifts)
    tiles, chunks = -(-n // 16), -(-k // 128)
    assert p.shape == (g, tiles, chunks, 2, 32, 16) and ps.shape == (g, tiles, chunks, 8, 8)
    np.testing.assert_array_equal(W.unpack_codes8(p, n, k), codes)
    np.testing.assert_array_equal(W.unpack_shifts8(ps, n, k), shifts)


def test_packed_code_positions_are_the_fp8_fragment(rng):
    """Every code's place, from the layout's definition (one index at a time):
    plane s // 2, lane 4 q + t, bytes 8 (s % 2) + 4 h .. + 3 (k32 step s,
    row q for h = 0, q + 8 for h = 1) hold code j, the one at column
    32 s + 16 (j // 4) + 4 t + j % 4 (the wgmma E4M3 A fragment: a0 / a1
    columns 4 t .. + 3 of rows q / q + 8, a2 / a3 16 + 4 t ..), its
    magnitude at bits 4 j .. 4 j + 2 and its sign at bit 8 j + 3 (j < 4) or
    8 (j - 4) + 7: the bit 7 of E4M3 byte j % 4 of (w << 4) for codes 0..3,
    of w for 4..7 (gemm_w4a8.cuh, e4m3_of_e2m1)."""
    g, n, k = 1, 24, 160
    nib = rng.integers(0, 16, (g, n, k), dtype=np.uint8)
    codes = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    p = W.pack_codes8(codes)
    for tile in range(2):
        for c in range(2):
            for lane in range(32):
                q, t = divmod(lane, 4)
                for s in range(4):
                    for h in range(2):
                        at = 8 * (s % 2) + 4 * h
                        word = int.from_bytes(p[0, tile, c, s // 2, lane, at:at + 4].tobytes(), "little")
                        for j in range(8):
                            row, col = 16 * tile + 8 * h + q, 128 * c + 32 * s + 16 * (j // 4) + 4 * t + j % 4
                            want = nib[0, row, col] if row < n and col < k else 0
                            sign_bit = 8 * j + 3 if j < 4 else 8 * (j - 4) + 7
                            got = (word >> (4 * j)) & 7 | ((word >> sign_bit) & 1) << 3
                            assert got == want, (tile, c, lane, s, h, j)


def test_packed_shift_positions(rng):
    g, n, k = 1, 20, 160
    shifts = rng.integers(0, 21, (g, n, k // 32), dtype=np.uint8)
    ps = W.pack_shifts8(shifts)
    for tile in range(2):
        for c in range(2):
            for q in range(8):
                for s in range(4):
                    for h in range(2):
                        row, blk = 16 * tile + 8 * h + q, 4 * c + s
                        want = shifts[0, row, blk] if row < n and blk < k // 32 else W.ZERO_SHIFT
                        assert ps[0, tile, c, q, 2 * s + h] == want


def test_w4a8_weight_refuses_by_name():
    torch = pytest.importorskip("torch")
    import rawkv
    codes = torch.full((1, 3, 32), 0x22, dtype=torch.uint8)
    scales = torch.tensor([[[137, 4], [127, 127], [10, 137]]], dtype=torch.uint8)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales)
    with pytest.raises(ValueError, match=re.escape("weight: 2 MXFP4 block(s)") + ".*" +
                       re.escape("(g=0, n=0, block=1: byte 4), (g=0, n=2, block=0: byte 10).")):
        rawkv.gemm.w4a8_weight(w)
    nv = rawkv.gemm.Fp4Weight.from_float(torch.randn(16, 64))
    with pytest.raises(ValueError, match="^weight: W4A8 takes MXFP4 weights only, got nvfp4"):
        rawkv.gemm.w4a8_weight(nv)
    with pytest.raises(TypeError, match="^weight: expected a rawkv.gemm.Fp4Weight"):
        rawkv.gemm.w4a8_weight(codes)
