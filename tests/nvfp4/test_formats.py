"""The element formats under NVFP4 (rawkv.reference.formats: E2M1 codes,
E4M3 scales), checked exhaustively against independent brute-force searches."""
from __future__ import annotations

import numpy as np
import pytest

from rawkv.reference import formats as F


# ---- the reference ----------------------------------------------------------------------------------
E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def all_bf16() -> np.ndarray:
    """Every BF16 bit pattern as float32 (NaNs included)."""
    return (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


def brute_nearest_even(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of an increasing table to each a >= 0
    (float64 distances, exact here); ties go to the even index; beyond the
    last entry: the last index (saturation)."""
    d = np.abs(a[:, None] - table[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    idx = np.where(cand.sum(axis=1) > 1, np.argmax(cand & (np.arange(table.size) % 2 == 0), axis=1),
                   np.argmax(cand, axis=1))
    return np.where(a > table[-1], table.size - 1, idx)


def test_e2m1_encode_all_bf16_vs_brute_force():
    x = all_bf16()
    fin = ~np.isnan(x)
    x = x[fin]
    a = np.minimum(np.abs(x.astype(np.float64)), 1e300)
    want = brute_nearest_even(a, E2M1_MAG).astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 3)
    got = F.e2m1_encode(x)
    assert np.array_equal(got, want)


def e4m3_positive_values() -> np.ndarray:
    """Values of E4M3 codes 0..0x7E, from the bit layout (independent of formats.py)."""
    out = []
    for c in range(0x7F):
        e, m = c >> 3, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


def test_e4m3_encode_all_bf16_vs_brute_force():
    x = all_bf16()
    tab = e4m3_positive_values()
    nan = np.isnan(x)
    a = np.abs(np.where(nan, 0, x).astype(np.float64))
    a = np.where(np.isinf(a), 1e300, a)
    want = brute_nearest_even(a, tab).astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 7)
    want = np.where(nan, np.uint8(0x7F), want)
    assert np.array_equal(F.e4m3_encode(x), want)


def test_e4m3_encode_all_bf16_vs_torch():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch has no float8_e4m3fn")
    x = all_bf16()
    ok = ~np.isnan(x) & (np.abs(x) <= 448)      # torch does not saturate past 448
    t = torch.from_numpy(x[ok]).to(torch.bfloat16).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(F.e4m3_encode(x[ok]), t)


def test_e4m3_decode_all_bytes():
    vals = F.e4m3_decode(np.arange(256, dtype=np.uint8))
    tab = e4m3_positive_values()
    for c in range(256):
        if c & 0x7F == 0x7F:
            assert np.isnan(vals[c])
        else:
            v = tab[c & 0x7F] * (-1 if c & 0x80 else 1)
            assert vals[c] == v and np.signbit(vals[c]) == bool(c & 0x80)
    torch = pytest.importorskip("torch")
    if hasattr(torch, "float8_e4m3fn"):
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
        assert np.array_equal(vals, t, equal_nan=True)


def test_e2m1_decode_all_codes():
    got = F.e2m1_decode(np.arange(16, dtype=np.uint8))
    for c in range(16):
        assert got[c] == E2M1_MAG[c & 7] * (-1 if c & 8 else 1)
        assert np.signbit(got[c]) == bool(c & 8)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_every_tie_goes_to_even(sign):
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for t, code in ties.items():
        got = int(F.e2m1_encode(np.float32(sign * t)))
        assert got == code | (8 if sign < 0 else 0), t


def test_e4m3_every_tie_goes_to_even():
    tab = e4m3_positive_values()
    mids = (tab[:-1] + tab[1:]) / 2                  # exact in float32
    codes = F.e4m3_encode(mids.astype(np.float32))
    lo = np.arange(len(mids))
    want = np.where(lo % 2 == 0, lo, lo + 1)
    assert np.array_equal(codes, want.astype(np.uint8))
    assert np.array_equal(F.e4m3_encode(-mids.astype(np.float32)), (want | 0x80).astype(np.uint8))
    assert F.e4m3_encode(np.float32(464.0)) == 0x7E     # past the last tie: saturate
