"""rawkv.gemm.grouped_linear / moe_linear with a W4a8Weight (issue 23;
rawkv/gemm/w4a8.py, rawkv/cu/gemm_w4a8_sm90.cu and gemm_w4a8_mma.cu): on CPU
the reference's exact product (rawkv.reference.gemm_w4a8) rounded once to
BF16, bit for bit; its argument errors (AGREEMENT: the same on CPU and CUDA);
the launch plans; on an sm_90 GPU both kernels (the wgmma one and the FP8
mma.sync one for few tokens, each forced in turn) within the bound of
tests/support/gemm_w4a8.py on every shape class (partial row tiles and
128-column chunks, 1 to 300 tokens, empty experts, 384 experts, views), NaN
where a block's scale is NaN, the same bits on every run; shift bytes past
the table read as zeros and counted (CPU against the reference; GPU: the CPU
path's bits and count); the operators (opcheck samples)."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv.gemm import _rules as R, linear, plans  # noqa: E402
from rawkv.kernels import gemm_w4a8 as K8  # noqa: E402
from rawkv.reference import gemm as G  # noqa: E402
from rawkv.reference import gemm_w4a8 as W  # noqa: E402
from support import gemm_w4a8 as B  # noqa: E402
from support.agreement import bf, buf, ones, strided_last, u8  # noqa: E402


def mx_weight(rng, g, n, k, spread=3):
    """MXFP4 codes / scales a W4A8 form holds (scale bytes within `spread`
    of 127 per row), the Fp4Weight and its W4A8 form."""
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scales = np.clip(127 + rng.integers(-spread, spread + 1, (g, n, k // 32)), 1, 254).astype(np.uint8)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), groups=g)
    return codes, scales, w, rawkv.gemm.w4a8_weight(w)


def fp8_act(rng, shape, scale_format="fp32"):
    """FP8 block activations of a random x (codes as uint8 bytes, float32
    scales: the E8M0 ones as their powers of two)."""
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 3)
    codes, scales = rawkv.fp8.quantize_blocks(x, scale_format=scale_format)
    if scale_format == "ue8m0":
        scales = torch.from_numpy(W.ue8m0_value(scales.view(torch.uint8).numpy()))
    return codes.view(torch.uint8), scales


def bits(t) -> np.ndarray:
    return t.float().cpu().numpy().view(np.uint32) >> 16


# ---------------------------------------------------------------------------
# reference: CPU tensors run it, exactly
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("g, n, k", [(1, 16, 128), (2, 21, 160), (3, 40, 288)])
def test_cpu_grouped_is_the_reference_rounded_once(rng, scale_format, g, n, k):
    codes, scales, _, w8 = mx_weight(rng, g, n, k)
    xc, xs = fp8_act(rng, (5, g, k), scale_format)
    got = rawkv.gemm.grouped_linear((xc, xs), w8)
    want = G.round_to_bf16(W.grouped(xc.numpy(), xs.numpy(), codes, scales))
    assert got.dtype == torch.bfloat16 and np.array_equal(bits(got), want)


def test_cpu_moe_clamps_and_counts_offsets(rng):
    codes, scales, _, w8 = mx_weight(rng, 3, 24, 160)
    xc, xs = fp8_act(rng, (9, 160))
    offsets = torch.tensor([1, 5, 3, 12], dtype=torch.int32)
    errors = torch.zeros(1, dtype=torch.int32)
    got = rawkv.gemm.moe_linear(rawkv.fp8.Fp8Activation(xc, xs), w8, offsets, errors=errors)
    want, bad = W.ragged(xc.numpy(), xs.numpy(), codes, scales, offsets.numpy())
    assert bad == 2 and int(errors[0]) == 2
    assert np.array_equal(bits(got), G.round_to_bf16(want))


def test_nan_scale_reaches_the_output(rng):
    _, _, _, w8 = mx_weight(rng, 1, 16, 256)
    xc, xs = fp8_act(rng, (3, 1, 256))
    xs[1, 0, 1] = float("nan")
    got = rawkv.gemm.grouped_linear((xc, xs), w8).float()
    assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2]]).any()


def e8m0_act(rng, shape):
    """FP8 block activations with E8M0-byte scales (DeepSeek-V4's act_quant:
    quantize_blocks' 'ue8m0' bytes, float8_e8m0fnu) and the same scales as
    their float32 powers of two; block 1 of the first row's first group
    (where K has two blocks) takes byte 0 (2^-127, an FP32 subnormal), and
    a block of the last row byte 254 (2^127) over zero codes."""
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 3)
    codes, scales = rawkv.fp8.quantize_blocks(x, scale_format="ue8m0")
    b = scales.view(torch.uint8).clone()
    lead = (0,) * (len(shape) - 1)
    if b.shape[-1] > 1:
        b[lead + (1,)] = 0
    last = (shape[0] - 1,) + (0,) * (len(shape) - 2)
    b[last + (0,)] = 254
    codes = codes.view(torch.uint8).clone()
    codes[last + (slice(0, 128),)] = 0
    return codes, b.view(torch.float8_e8m0fnu), torch.from_numpy(W.ue8m0_value(b.numpy()))


@pytest.mark.parametrize("g, n, k", [(1, 16, 128), (2, 21, 160), (3, 40, 288)])
def test_cpu_e8m0_byte_scales_are_their_float32_values(rng, g, n, k):
    """E8M0 bytes (float8_e8m0fnu or uint8) give the bits of their float32
    powers of two, batched and ragged, and the reference's product."""
    codes, scales, _, w8 = mx_weight(rng, g, n, k)
    xc, xb, xf = e8m0_act(rng, (5, g, k))
    want = rawkv.gemm.grouped_linear((xc, xf), w8)
    assert np.array_equal(bits(want), G.round_to_bf16(W.grouped(xc.numpy(), xf.numpy(), codes, scales)))
    for sb in (xb, xb.view(torch.uint8)):
        assert torch.equal(rawkv.gemm.grouped_linear((xc, sb), w8), want)
        assert torch.equal(rawkv.gemm.grouped_linear(rawkv.fp8.Fp8Activation(xc, sb), w8), want)
    offsets = torch.tensor([0, 2] + [5] * (g - 1), dtype=torch.int32)
    rc, rb, rf = e8m0_act(rng, (5, k))
    ragged = rawkv.gemm.moe_linear((rc, rf), w8, offsets)
    assert torch.equal(rawkv.gemm.moe_linear((rc, rb), w8, offsets), ragged)


def test_cpu_e8m0_byte_ff_is_nan_in_its_row(rng):
    _, _, _, w8 = mx_weight(rng, 1, 16, 256)
    xc, xb, _ = e8m0_act(rng, (3, 1, 256))
    xb = xb.view(torch.uint8).clone()
    xb[1, 0, 1] = 0xFF
    got = rawkv.gemm.grouped_linear((xc, xb), w8).float()
    assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2]]).any()


def test_producers_e8m0_outputs_feed_the_gemm_as_they_are(rng):
    """rmsnorm_quantize_fp8(scale_format='ue8m0') returns float8_e8m0fnu
    scales; the W4A8 GEMM takes its Fp8Activation as it is, with the bits
    of the same scales as float32."""
    _, _, _, w8 = mx_weight(rng, 1, 24, 256)
    h = torch.from_numpy(rng.standard_normal((4, 1, 256)).astype(np.float32)).to(bf)
    fa = rawkv.fused.rmsnorm_quantize_fp8(h, torch.ones(256, dtype=bf), 1e-6, scale_format="ue8m0")
    assert fa.scales.dtype == torch.float8_e8m0fnu
    as_f32 = torch.from_numpy(W.ue8m0_value(fa.scales.view(torch.uint8).numpy()))
    assert torch.equal(rawkv.gemm.grouped_linear(fa, w8), rawkv.gemm.grouped_linear((fa.codes, as_f32), w8))


def test_an_e8m0_scales_tensor_reaches_the_operator_as_bytes(rng, monkeypatch):
    # torch.compile's inductor cannot functionalize an operator taking a
    # float8_e8m0fnu tensor (rawkv.fp8.e8m0_bytes): the public op passes
    # the scales' uint8 bytes, as the FP8 producers do
    from rawkv.gemm import w4a8
    seen = []
    real = w4a8._grouped8
    monkeypatch.setattr(w4a8, "_grouped8", lambda x, x_sf, *a: seen.append(x_sf.dtype) or real(x, x_sf, *a))
    _, _, _, w8 = mx_weight(rng, 1, 16, 128)
    xc, xb, xf = e8m0_act(rng, (2, 1, 128))
    got = rawkv.gemm.grouped_linear((xc, xb), w8)
    assert seen == [torch.uint8] and torch.equal(got, rawkv.gemm.grouped_linear((xc, xf), w8))


def extreme_weight(g=1, n=24, k=256):
    """MXFP4 bytes whose W4A8 form has every biased block shift an accepted
    weight can have at the ends of the range: 0..4 (the exact, subnormal
    rows of the table: e = -11..-7, only 4s) and 18..20 (e = 7..9, only
    0.5s and 1s), beside a row maximum of 0.5 x 2^s (block 0)."""
    codes = np.zeros((g, n, k // 2), np.uint8)
    scales = np.zeros((g, n, k // 32), np.uint8)
    e_of_block = [9, -11, -10, -9, -8, -7, 8, 7]                 # block 0 sets r = s0 - 9
    for row in range(n):
        s0 = 125 + row % 5
        for b, e in enumerate(e_of_block[:k // 32]):
            scales[:, row, b] = s0 - 9 + e                     # byte = 127 + r + e, r = s0 - 127 - 9
            codes[:, row, 16 * b:16 * b + 16] = 0x11 if e >= 7 else 0x66 if row % 2 else 0xE6
    return codes, scales


def test_extreme_shifts_form_and_cpu(rng):
    codes, scales = extreme_weight()
    shifts, _ = W.w4a8_form(codes, scales)
    assert set(np.unique(shifts)) == {0, 1, 2, 3, 4, 18, 19, 20}
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales))
    w8 = rawkv.gemm.w4a8_weight(w)
    xc, xs = fp8_act(rng, (3, 1, 256))
    got = rawkv.gemm.grouped_linear((xc, xs), w8)
    assert np.array_equal(bits(got), G.round_to_bf16(W.grouped(xc.numpy(), xs.numpy(), codes, scales)))


# ---------------------------------------------------------------------------
# shift bytes past the table (a form written by hand, or corrupted memory):
# the block reads as zeros and is counted, on CPU and CUDA alike
# ---------------------------------------------------------------------------
def exact_weight(rng, g, n, k):
    """MXFP4 codes of 0, +-0.5, +-1, +-2 under scale byte 127, the bytes and
    their W4A8 form: with exact_act's activations every product is 2^-2 ..
    2^1 and a 128-deep partial needs at most 11 bits, so the FP8 MMA is
    exact and the kernel's bits are the CPU path's."""
    mag = rng.choice(np.array([0, 1, 2, 4], np.uint8), (g, n, k))
    nib = mag | (rng.integers(0, 2, (g, n, k), dtype=np.uint8) << 3)
    codes = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    scales = np.full((g, n, k // 32), 127, np.uint8)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), groups=g)
    return codes, scales, rawkv.gemm.w4a8_weight(w)


def exact_act(rng, lead, k):
    """FP8 block activations of +-0.5 and +-1 (E4M3 bytes), scales 2^-2 .. 2^2."""
    codes = rng.choice(np.array([0x30, 0x38, 0xB0, 0xB8], np.uint8), (*lead, k))
    scales = np.ldexp(1.0, rng.integers(-2, 3, (*lead, -(-k // 128)))).astype(np.float32)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def past_table_form(rng, codes, w8, share=0.15):
    """w8 with biased shift bytes past the table (21 .. 255, both ends among
    them) written by hand into about `share` of the weight's blocks, and into
    every padding block (rows past N, blocks past K/32: not the weight's,
    never counted) -> (the hand-built form, bad (G, N, K/32) bool, the MXFP4
    codes with the bad blocks zeroed)."""
    g, n, k = w8.groups, w8.n, w8.k
    npad, chunks = W.padded8(n, k)
    shifts = W.unpack_shifts8(w8.shifts.numpy(), n, k)
    bad = rng.random(shifts.shape) < share
    past = rng.integers(W.SHIFT_ROWS, 256, shifts.shape).astype(np.uint8)
    bad[:, 0, -1] = True                                                 # one at least in every group
    bad[0, 0, 0], past[0, 0, 0] = True, W.SHIFT_ROWS                   # the first byte past the table
    bad[-1, -1, -1], past[-1, -1, -1] = True, 255
    full = rng.integers(W.SHIFT_ROWS, 256, (g, npad, chunks * 4)).astype(np.uint8)   # padding: past the table
    full[:, :n, :k // 32] = np.where(bad, past, shifts)
    hand = w8._replace(shifts=torch.from_numpy(W.pack_shifts8(full)))
    assert np.array_equal(W.unpack_shifts8(hand.shifts.numpy(), n, k) >= W.SHIFT_ROWS, bad)
    nib = np.stack([codes & 15, codes >> 4], -1).reshape(g, n, k)
    nib.reshape(g, n, k // 32, 32)[bad] = 0
    return hand, bad, (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def _form_args(w8):
    n, k = w8.n, w8.k
    return (W.unpack_codes8(w8.codes.numpy(), n, k), W.unpack_shifts8(w8.shifts.numpy(), n, k),
            w8.row_scale.numpy()[:, :n], w8.gs.numpy())


def test_cpu_shift_bytes_past_the_table_read_as_zeros_and_are_counted(rng):
    g, n, k = 3, 21, 160                                       # padding rows and blocks
    codes, scales, w8 = exact_weight(rng, g, n, k)
    hand, bad, zeroed = past_table_form(rng, codes, w8)
    xc, xs = exact_act(rng, (5, g), k)
    errors = torch.zeros(1, dtype=torch.int32)
    got = rawkv.gemm.grouped_linear((xc, xs), hand, errors=errors)
    # the reference defines it ...
    want, count = W.form_grouped(xc.numpy(), xs.numpy(), *_form_args(hand))
    assert count == int(bad.sum()) > 0 and int(errors[0]) == count      # each bad block once; padding not
    assert np.array_equal(bits(got), G.round_to_bf16(want))
    # ... as the product of the weight with those blocks zero (the MXFP4 values: no W4A8 code here)
    x = W.activation_values(xc.numpy(), xs.numpy())
    zero = G.grouped(x, G.dequantize_weight(zeroed, scales, None, "mxfp4"))
    assert np.array_equal(bits(got), G.round_to_bf16(zero))
    assert not np.array_equal(bits(got), bits(rawkv.gemm.grouped_linear((xc, xs), w8)))   # the blocks mattered
    # errors=None: the host's GEMM_OFFSETS counter, as the ragged op's clamps
    before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
    again = rawkv.gemm.grouped_linear((xc, xs), hand)
    assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) - before == count
    assert np.array_equal(bits(again), bits(got))
    # no tokens: nothing multiplied, nothing counted
    errors.zero_()
    rawkv.gemm.grouped_linear((xc[:0], xs[:0]), hand, errors=errors)
    assert int(errors[0]) == 0


def test_cpu_moe_counts_past_table_blocks_of_experts_that_own_rows(rng):
    e, n, k = 4, 24, 160
    codes, scales, w8 = exact_weight(rng, e, n, k)
    hand, bad, zeroed = past_table_form(rng, codes, w8)
    xc, xs = exact_act(rng, (12,), k)
    offsets = np.array([2, 5, 3, 9, 10], np.int32)     # 3 < 5: one clamp; expert 1 owns no row; rows 0-1, 10-11 none
    errors = torch.zeros(1, dtype=torch.int32)
    got = rawkv.gemm.moe_linear((xc, xs), hand, torch.from_numpy(offsets), errors=errors)
    want, count = W.form_ragged(xc.numpy(), xs.numpy(), *_form_args(hand), offsets)
    assert bad[1].any() and count == 1 + int(bad[[0, 2, 3]].sum()) and int(errors[0]) == count   # not expert 1's
    assert np.array_equal(bits(got), G.round_to_bf16(want))
    zero, clamps = G.ragged(W.activation_values(xc.numpy(), xs.numpy()),
                            G.dequantize_weight(zeroed, scales, None, "mxfp4"), offsets)
    assert clamps == 1 and np.array_equal(bits(got), G.round_to_bf16(zero))


def test_k_zero_gives_zeros():
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.zeros(1, 16, 0, dtype=u8), torch.zeros(1, 16, 0, dtype=u8))
    w8 = rawkv.gemm.w4a8_weight(w)
    out = rawkv.gemm.grouped_linear((buf(3, 1, 0), ones(3, 1, 0)), w8)
    assert out.shape == (3, 1, 16) and (out == 0).all()


# ---------------------------------------------------------------------------
# argument errors: the same on CPU and CUDA (tests/guards/test_cpu_cuda_agreement.py)
# ---------------------------------------------------------------------------
def _w8(g=3, n=24, k=160):
    codes = torch.full((g, n, k // 2), 0x25, dtype=u8)
    scales = torch.full((g, n, k // 32), 127, dtype=u8)
    return rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=g))


def _w8_past():
    """_w8() with shift bytes past the table (21 and 255) in two blocks."""
    w8 = _w8()
    shifts = w8.shifts.clone()
    shifts[0, 0, 0, 0, 0], shifts[2, 1, 1, 3, 5] = 21, 255
    return w8._replace(shifts=shifts)


def _xa(*lead, k=160):
    return buf(*lead, k), ones(*lead, -(-k // 128))


_gl, _ml = rawkv.gemm.grouped_linear, rawkv.gemm.moe_linear


def _offs(*v):
    return torch.tensor(v, dtype=torch.int32)


AGREEMENT = {
    "gemm_grouped_linear_w4a8": [
        ("ok", lambda: (_gl, (_xa(5, 3), _w8()), {})),
        ("ok-float8-codes", lambda: (_gl, ((_xa(5, 3)[0].view(torch.float8_e4m3fn), _xa(5, 3)[1]), _w8()), {})),
        ("ok-out", lambda: (_gl, (_xa(5, 3), _w8()), {"out": ones(5, 3, 24, dtype=bf)})),
        ("ok-codes-strided", lambda: (_gl, ((strided_last(5, 3, 160, dtype=u8), ones(5, 3, 2)), _w8()), {})),
        ("ok-empty", lambda: (_gl, (_xa(0, 3), _w8()), {})),
        ("ok-errors", lambda: (_gl, (_xa(5, 3), _w8()), {"errors": buf(1, dtype=torch.int32)})),
        ("ok-shifts-past-the-table", lambda: (_gl, (_xa(5, 3), _w8_past()), {"errors": buf(2, dtype=torch.int32)})),
        ("x-not-a-pair", lambda: (_gl, (buf(5, 3, 160), _w8()), {})),
        ("x.codes-bfloat16", lambda: (_gl, ((ones(5, 3, 160, dtype=bf), ones(5, 3, 2)), _w8()), {})),
        ("x.codes-K", lambda: (_gl, ((buf(5, 3, 128), ones(5, 3, 1)), _w8()), {})),
        ("x.codes-rank", lambda: (_gl, ((buf(5, 160), ones(5, 2)), _w8()), {})),
        ("x.codes-groups", lambda: (_gl, (_xa(5, 2), _w8()), {})),
        ("ok-scales-e8m0-bytes", lambda: (_gl, ((buf(5, 3, 160), buf(5, 3, 2)), _w8()), {})),
        ("x.scales-float16", lambda: (_gl, ((buf(5, 3, 160), ones(5, 3, 2, dtype=torch.float16)), _w8()), {})),
        ("x.scales-shape", lambda: (_gl, ((buf(5, 3, 160), ones(5, 3, 1)), _w8()), {})),
        ("out-float32", lambda: (_gl, (_xa(5, 3), _w8()), {"out": ones(5, 3, 24)})),
        ("out-shape", lambda: (_gl, (_xa(5, 3), _w8()), {"out": ones(5, 3, 23, dtype=bf)})),
        ("out-over-x", lambda: (lambda x, w: _gl(x, w, out=x[1].view(bf)[..., :0]), (_xa(5, 3), _w8()), {})),
        ("errors-int64", lambda: (_gl, (_xa(5, 3), _w8()), {"errors": buf(1, dtype=torch.int64)})),
        ("errors-empty", lambda: (_gl, (_xa(5, 3), _w8()), {"errors": buf(0, dtype=torch.int32)})),
    ],
    "gemm_moe_linear_w4a8": [
        ("ok", lambda: (_ml, (_xa(7), _w8(), _offs(0, 2, 2, 7)), {})),
        ("ok-clamped-errors", lambda: (_ml, (_xa(7), _w8(), _offs(0, 5, 2, 9)), {"errors": buf(1, dtype=torch.int32)})),
        ("ok-shifts-past-the-table", lambda: (_ml, (_xa(7), _w8_past(), _offs(0, 2, 2, 7)), {})),
        ("x.codes-rank", lambda: (_ml, (_xa(7, 3), _w8(), _offs(0, 2, 2, 7)), {})),
        ("offsets-shape", lambda: (_ml, (_xa(7), _w8(), _offs(0, 2, 7)), {})),
        ("offsets-int64", lambda: (_ml, (_xa(7), _w8(), torch.tensor([0, 2, 2, 7])), {})),
        ("errors-int64", lambda: (_ml, (_xa(7), _w8(), _offs(0, 2, 2, 7)), {"errors": buf(1, dtype=torch.int64)})),
        ("out-shape", lambda: (_ml, (_xa(7), _w8(), _offs(0, 2, 2, 7)), {"out": ones(7, 23, dtype=bf)})),
    ],
}


# ---------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------
class _Dev:
    arch, sm_count = "sm_90", 132


def test_plans_tile_by_tokens_and_refuse_other_archs():
    w8 = _w8(3, 300, 256)
    act = R.activation8(*_xa(65, 3, k=256), 3, 256, "cpu", -1)
    wc = R.weight8(w8.codes, w8.shifts, w8.row_scale, w8.gs, w8.n, w8.k, "cpu")
    (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(65, 3, 300, dtype=bf))
    assert launch.grid == (3, 1, 3) and launch.kernel.expr.endswith("<128, 6, false>")
    act = R.activation8(*_xa(64, 3, k=256), 3, 256, "cpu", -1)
    (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(64, 3, 300, dtype=bf))
    assert launch.grid == (3, 1, 3) and launch.kernel.expr.endswith("<64, 8, false>")
    # No groups (a weight of none, x (T, 0, K)): nothing to write, no launch (its grid would be empty).
    w0 = _w8(1, 300, 256)
    w0 = w0._replace(codes=w0.codes[:0], shifts=w0.shifts[:0], row_scale=w0.row_scale[:0], gs=w0.gs[:0])
    act = R.activation8(*_xa(5, 0, k=256), 3, 256, "cpu", -1)
    wc = R.weight8(w0.codes, w0.shifts, w0.row_scale, w0.gs, w0.n, w0.k, "cpu")
    assert plans.w4a8_grouped(_Dev, act, wc, torch.empty(5, 0, 300, dtype=bf)) == []

    # up to W4A8_MMA_MAX_TOKENS (8) per group: the mma.sync kernel, its tile
    # by tokens (grid: feature blocks of 16 MT RW, token tiles of 8 NT); a
    # forced mma.sync call of 16 tokens takes MMA_CONFIGS[16]
    for tokens, cfg, path in ((1, K8.MMA_CONFIGS[8], "auto"), (8, K8.MMA_CONFIGS[8], "auto"),
                              (16, K8.MMA_CONFIGS[16], "mma")):
        act = R.activation8(*_xa(tokens, 3, k=256), 3, 256, "cpu", -1)
        (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(tokens, 3, 300, dtype=bf),
                                       tuning=plans.Tuning(W4A8_PATH=path))
        mt, nt, ks, rw, _ = cfg
        assert launch.kernel.kernel is K8.GEMM_MMA
        assert launch.kernel.expr.endswith(f"<{', '.join(map(str, cfg))}, false>")
        assert launch.grid == (-(-300 // (16 * mt * rw)), -(-tokens // (8 * nt)), 3) and launch.block == (32 * ks * rw,)
    # past it, or where the wgmma grid fills 90% of the SMs: the wgmma kernel,
    # its 16-token tile up to 16 tokens, 64 up to 64
    for tokens, tile in ((9, (16, 8)), (16, (16, 8)), (17, (64, 8))):
        act = R.activation8(*_xa(tokens, 3, k=256), 3, 256, "cpu", -1)
        (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(tokens, 3, 300, dtype=bf))
        assert launch.kernel.kernel is K8.GEMM and launch.grid == (3, -(-tokens // tile[0]), 3), tokens
        assert launch.kernel.expr.endswith(f"<{tile[0]}, {tile[1]}, false>"), tokens
    # (40 groups x 10 blocks of 32 features: 3.03 per SM, which takes the
    # mma.sync kernel's wide tile, test_plans_batched_decode_tile_by_grid;
    # here that rule is closed)
    w40 = _w8(40, 300, 256)                                      # 40 groups x 3 feature blocks: 120 blocks
    wide = R.weight8(w40.codes, w40.shifts, w40.row_scale, w40.gs, w40.n, w40.k, "cpu")
    act40 = R.activation8(*_xa(1, 40, k=256), 3, 256, "cpu", -1)
    no_wide = plans.Tuning(W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM=0)
    (launch,) = plans.w4a8_grouped(_Dev, act40, wide, torch.empty(1, 40, 300, dtype=bf), tuning=no_wide)
    assert launch.kernel.kernel is K8.GEMM and launch.grid == (3, 1, 40)
    (launch,) = plans.w4a8_grouped(_Dev, act40, wide, torch.empty(1, 40, 300, dtype=bf),
                                   tuning=no_wide._replace(W4A8_SM90_MIN_FILL=0.95))
    assert launch.kernel.kernel is K8.GEMM_MMA
    assert launch.kernel.expr.endswith(f"<{', '.join(map(str, K8.MMA_CONFIGS[8]))}, false>")
    # forced either way
    act = R.activation8(*_xa(16, 3, k=256), 3, 256, "cpu", -1)
    (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(16, 3, 300, dtype=bf),
                                   tuning=plans.Tuning(W4A8_PATH="sm90"))
    assert launch.kernel.kernel is K8.GEMM and launch.grid == (3, 1, 3)
    act = R.activation8(*_xa(65, 3, k=256), 3, 256, "cpu", -1)
    (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(65, 3, 300, dtype=bf),
                                   tuning=plans.Tuning(W4A8_PATH="mma"))
    assert launch.kernel.kernel is K8.GEMM_MMA and launch.grid == (10, 5, 3)       # (16-token tiles)
    with pytest.raises(ValueError, match="^W4A8_PATH"):
        plans.w4a8_grouped(_Dev, act, wc, torch.empty(65, 3, 300, dtype=bf), tuning=plans.Tuning(W4A8_PATH="x"))

    # the wgmma kernel splits K in two where twice its grid fits one wave and
    # each half has W4A8_MIN_SPLIT_CHUNKS chunks: grid x doubles
    w16 = _w8(3, 300, 2048)
    wl = R.weight8(w16.codes, w16.shifts, w16.row_scale, w16.gs, w16.n, w16.k, "cpu")
    act = R.activation8(*_xa(40, 3, k=2048), 3, 2048, "cpu", -1)
    (launch,) = plans.w4a8_grouped(_Dev, act, wl, torch.empty(40, 3, 300, dtype=bf))
    assert launch.kernel.kernel is K8.GEMM_SPLITK and launch.kernel.expr.endswith("<64, 8, 2, false>")
    assert launch.grid == (6, 1, 3)
    (launch,) = plans.w4a8_grouped(_Dev, act, wl, torch.empty(40, 3, 300, dtype=bf),
                                   tuning=plans.Tuning(W4A8_KSPLIT=1))
    assert launch.kernel.kernel is K8.GEMM and launch.grid == (3, 1, 3)
    (launch,) = plans.w4a8_grouped(_Dev, act, wl, torch.empty(40, 3, 300, dtype=bf),
                                   tuning=plans.Tuning(W4A8_MIN_SPLIT_CHUNKS=9))
    assert launch.kernel.kernel is K8.GEMM                       # 16 chunks: halves of 8 < 9
    with pytest.raises(ValueError, match="^W4A8_KSPLIT"):
        plans.w4a8_grouped(_Dev, act, wl, torch.empty(40, 3, 300, dtype=bf), tuning=plans.Tuning(W4A8_KSPLIT=3))
    # on 12 SMs the grid of 9 blocks fills less than 90% of them: the 16-token
    # tile (two blocks per SM) splits, 18 <= 24; the 64-token one does not,
    # 18 > 12; nor does either where the grid fills 90% (10 SMs)
    class Twelve:
        arch, sm_count = "sm_90", 12

    class Ten:
        arch, sm_count = "sm_90", 10
    for dev, tokens, kernel in ((Twelve, 16, K8.GEMM_SPLITK), (Twelve, 17, K8.GEMM), (Ten, 16, K8.GEMM)):
        act = R.activation8(*_xa(tokens, 3, k=2048), 3, 2048, "cpu", -1)
        (launch,) = plans.w4a8_grouped(dev, act, wl, torch.empty(tokens, 3, 300, dtype=bf))
        assert launch.kernel.kernel is kernel, (dev.sm_count, tokens)

    class Ada:
        arch, sm_count = "sm_89", 142
    with pytest.raises(ValueError, match="^weight: the W4A8 GEMM runs on sm_90"):
        plans.w4a8_grouped(Ada, act, wc, torch.empty(65, 3, 300, dtype=bf))


def test_plans_read_e8m0_byte_scales_in_either_kernel():
    """E8M0-byte scales take each kernel's SB = true instance of the tile
    float32 scales take (the wgmma kernel whole and split, the mma.sync
    kernel)."""
    from rawkv.gemm import _rules as R
    for k, tokens, kernel in ((256, 65, K8.GEMM), (256, 4, K8.GEMM_MMA), (2048, 16, K8.GEMM_SPLITK)):
        w8 = _w8(3, 300, k)
        wc = R.weight8(w8.codes, w8.shifts, w8.row_scale, w8.gs, w8.n, w8.k, "cpu")
        xc, xs = _xa(tokens, 3, k=k)
        nb = -(-k // 128)
        exprs = set()
        for scales, sb in ((xs, "false"), (buf(tokens, 3, nb), "true"),
                           (buf(tokens, 3, nb).view(torch.float8_e8m0fnu), "true")):
            act = R.activation8(xc, scales, 3, k, "cpu", -1)
            (launch,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(tokens, 3, 300, dtype=bf))
            assert launch.kernel.kernel is kernel and launch.kernel.expr.endswith(f", {sb}>"), (tokens, sb)
            exprs.add(launch.kernel.expr.rsplit(", ", 1)[0])
        assert len(exprs) == 1, exprs                                # the same tile


def test_plans_batched_decode_tile_by_grid():
    """Up to W4A8_MMA_MAX_TOKENS tokens per group, by MMA_CONFIGS[8]'s
    grid (32 features a block) per SM, on 4 SMs: below 2 (K from 2,048) the
    small-grid tile, 2 to 3 MMA_CONFIGS[8], past 3 and up to 4 the wide tile
    (its own grid half as large), past 4 the rule before (the wgmma kernel
    where its grid fills 90% of the SMs); both tiles are programmatic
    dependent launches; a forced mma.sync path keeps MMA_CONFIGS."""
    from rawkv.gemm import _rules as R

    class Four:
        arch, sm_count = "sm_90", 4

    def launch(n, k, tokens=1, g=1, tuning=plans.TUNED):
        w8 = _w8(g, n, k)
        wc = R.weight8(w8.codes, w8.shifts, w8.row_scale, w8.gs, w8.n, w8.k, "cpu")
        act = R.activation8(*_xa(tokens, g, k=k), 3, k, "cpu", -1)
        (a,) = plans.w4a8_grouped(Four, act, wc, torch.empty(tokens, g, n, dtype=bf), tuning=tuning)
        return a

    def tile(a):                    # (the instance's tile: its template arguments but SB, false here)
        *cfg, sb = a.kernel.expr.split("<")[1].rstrip(">").split(", ")
        assert sb == "false"
        return tuple(int(v) for v in cfg)

    assert plans.TUNED.W4A8_MMA_SMALL_GRID_MIN_K == 2048
    for n, g, tokens, cfg, grid_x in ((224, 1, 1, K8.MMA_SMALL_GRID_CONFIG, 7),      # 7 blocks: 1.75 per SM
                                      (96, 2, 8, K8.MMA_SMALL_GRID_CONFIG, 3),       # 3 x 2 groups
                                      (256, 1, 1, K8.MMA_CONFIGS[8], 8),             # 2 per SM
                                      (384, 1, 8, K8.MMA_CONFIGS[8], 12),            # 3
                                      (400, 1, 1, K8.MMA_WIDE_CONFIG, 7),            # 13 of 32: 3.25 -> 7 of 64
                                      (512, 1, 5, K8.MMA_WIDE_CONFIG, 8)):           # 16: 4 -> 8
        a = launch(n, 2048, tokens, g)
        assert a.kernel.kernel is K8.GEMM_MMA and tile(a) == cfg, (n, g, tokens)
        assert a.grid == (grid_x, 1, g) and a.block == (32 * cfg[2] * cfg[3],), (n, g, tokens)
        assert a.kernel.pdl == (cfg != K8.MMA_CONFIGS[8] or grid_x * g >= 2.5 * Four.sm_count), (n, g, tokens)
    # K below W4A8_MMA_SMALL_GRID_MIN_K: MMA_CONFIGS[8] (plain: 7 blocks on 4 SMs)
    a = launch(224, 1024)
    assert tile(a) == K8.MMA_CONFIGS[8] and not a.kernel.pdl
    assert tile(launch(224, 1024, tuning=plans.Tuning(W4A8_MMA_SMALL_GRID_MIN_K=1024))) == K8.MMA_SMALL_GRID_CONFIG
    # past 4 per SM (17 blocks): the wgmma kernel (its 4 blocks of 128 fill the SMs); past 8 tokens too
    assert launch(544, 2048).kernel.kernel is K8.GEMM
    assert launch(224, 2048, tokens=9).kernel.kernel is K8.GEMM_SPLITK     # (2 blocks of 128, split in two)
    # the bounds are Tuning's; W4A8_PATH = "mma" keeps MMA_CONFIGS
    wide = plans.Tuning(W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM=1, W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM=0)
    assert tile(launch(224, 2048, tuning=wide)) == K8.MMA_WIDE_CONFIG
    # (the rule before: the wgmma kernel's 4 blocks of 128 fill the 4 SMs)
    assert launch(512, 2048, tuning=plans.Tuning(W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM=3.9)).kernel.kernel is K8.GEMM
    for n in (224, 400):
        assert tile(launch(n, 2048, tuning=plans.Tuning(W4A8_PATH="mma"))) == K8.MMA_CONFIGS[8]


def test_plans_launch_the_mma_kernel_programmatically_by_its_grid():
    """W4A8_MMA_PDL_MIN_BLOCKS_PER_SM (2.5: 330 blocks on 132 SMs): batched
    grids below it launch the mma.sync kernel the plain way, grids at it and
    every ragged call programmatically; the same function either way."""
    from rawkv.gemm import _rules as R
    limit = int(plans.TUNED.W4A8_MMA_PDL_MIN_BLOCKS_PER_SM * _Dev.sm_count)
    assert limit == 330
    mma = plans.Tuning(W4A8_PATH="mma")       # (grids this large would take the wgmma kernel)

    def launch(g, tokens=1, offsets=None):
        w8 = _w8(g, 32, 128)                   # one 32-feature block a group (MMA_CONFIGS[8])
        wc = R.weight8(w8.codes, w8.shifts, w8.row_scale, w8.gs, w8.n, w8.k, "cpu")
        if offsets is None:
            act = R.activation8(*_xa(tokens, g, k=128), 3, 128, "cpu", -1)
            (a,) = plans.w4a8_grouped(_Dev, act, wc, torch.empty(tokens, g, 32, dtype=bf), tuning=mma)
        else:
            act = R.activation8(*_xa(tokens, k=128), 2, 128, "cpu", -1)
            (a,) = plans.w4a8_moe(_Dev, act, wc, _offs(*offsets), torch.empty(tokens, 32, dtype=bf), None, mma)
        assert a.kernel.kernel is K8.GEMM_MMA
        return a

    below, at = launch(limit - 1), launch(limit)
    assert below.grid == (1, 1, limit - 1) and not below.kernel.pdl
    assert at.grid == (1, 1, limit) and at.kernel.pdl
    assert below.kernel.expr == at.kernel.expr and below.kernel.key == at.kernel.key
    assert launch(4, tokens=2, offsets=(0, 1, 1, 2, 2)).kernel.pdl


def test_plans_ragged_by_tokens_per_expert():
    # MoE: few tokens per expert take the mma.sync kernel's ragged tiles
    # (one warp streams all of K) when the grid has 2 blocks per SM, the
    # small tile (warps split K) below; above W4A8_MMA_MAX_EXPERT_TOKENS (3)
    # the wgmma kernel
    from rawkv.gemm import _rules as R
    w8 = _w8(256, 64, 256)
    wc = R.weight8(w8.codes, w8.shifts, w8.row_scale, w8.gs, w8.n, w8.k, "cpu")
    offsets = torch.zeros(257, dtype=torch.int32)
    assert plans.TUNED.W4A8_MMA_MAX_EXPERT_TOKENS == 3
    for rows, cfg in ((6, K8.MMA_RAGGED_SMALL_CONFIG), (384, K8.MMA_RAGGED_CONFIGS[8]),
                      (256 * 3, K8.MMA_RAGGED_CONFIGS[8]), (256 * 3 + 1, None), (256 * 12, None)):
        act = R.activation8(*_xa(rows, k=256), 2, 256, "cpu", -1)
        (launch,) = plans.w4a8_moe(_Dev, act, wc, offsets, torch.empty(rows, 64, dtype=bf), None)
        if cfg is None:
            assert launch.kernel.kernel is K8.GEMM
            continue
        mt, nt, ks, rw, _ = cfg
        assert launch.kernel.kernel is K8.GEMM_MMA
        assert launch.kernel.expr.endswith(f"<{', '.join(map(str, cfg))}, false>")
        assert launch.grid == (-(-64 // (16 * mt * rw)), plans.ragged_slots(rows, 256, 8 * nt), 1)
    # a grid large enough for MMA_RAGGED_CONFIGS[8] (N = 4,096: 32 blocks of 128
    # features x 12 slots = 384 >= 264) at up to W4A8_MMA_FEW_ROWS rows: its two-stage form
    # (the same bits), past it the tile itself
    wide = _w8(8, 4096, 256)
    wc = R.weight8(wide.codes, wide.shifts, wide.row_scale, wide.gs, wide.n, wide.k, "cpu")
    for rows, cfg in ((12, K8.MMA_RAGGED_FEW_ROWS_CONFIG), (13, K8.MMA_RAGGED_CONFIGS[8])):
        act = R.activation8(*_xa(rows, k=256), 2, 256, "cpu", -1)
        (launch,) = plans.w4a8_moe(_Dev, act, wc, torch.zeros(9, dtype=torch.int32), torch.empty(rows, 4096, dtype=bf),
                                   None)
        assert launch.kernel.expr.endswith(f"<{', '.join(map(str, cfg))}, false>"), rows
        assert launch.grid == (32, plans.ragged_slots(rows, 8, 8), 1) and launch.kernel.pdl, rows
    assert K8.MMA_RAGGED_FEW_ROWS_CONFIG[:4] == K8.MMA_RAGGED_CONFIGS[8][:4]
    # from K = W4A8_RAGGED_SM90_MIN_K (gate_up), the wgmma kernel's 16-token
    # tile at any few tokens per expert, but for calls of at most
    # W4A8_MMA_FEW_ROWS rows (12: a token or two), which take the small tile
    few = plans.TUNED.W4A8_MMA_FEW_ROWS
    assert few == 12
    w4k = _w8(8, 64, plans.TUNED.W4A8_RAGGED_SM90_MIN_K)
    wc = R.weight8(w4k.codes, w4k.shifts, w4k.row_scale, w4k.gs, w4k.n, w4k.k, "cpu")
    offsets = torch.zeros(9, dtype=torch.int32)
    for rows in (1, 6, few, few + 1, 128):
        act = R.activation8(*_xa(rows, k=w4k.k), 2, w4k.k, "cpu", -1)
        (launch,) = plans.w4a8_moe(_Dev, act, wc, offsets, torch.empty(rows, 64, dtype=bf), None)
        if rows <= few:
            assert launch.kernel.kernel is K8.GEMM_MMA, rows
            assert launch.kernel.expr.endswith(f"<{', '.join(map(str, K8.MMA_RAGGED_SMALL_CONFIG))}, false>")
            assert launch.grid == (-(-64 // 64), plans.ragged_slots(rows, 8, 8), 1)
            continue
        assert launch.kernel.kernel is K8.GEMM and launch.kernel.expr.endswith("<16, 8, false>"), rows
        assert launch.grid == (1, plans.ragged_slots(rows, 8, 16), 1)


# ---------------------------------------------------------------------------
# GPU: the kernel within the bound
# ---------------------------------------------------------------------------
@pytest.fixture
def sm90(cuda):
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 kernel runs on sm_90 devices; this one is {cuda.arch}")
    return cuda


@pytest.fixture(params=["sm90", "split", "mma"])
def path(request, monkeypatch):
    """Each W4A8 kernel in turn, forced for every token count: the wgmma
    kernel over all of K, split in two across a cluster (batched calls; a
    ragged one never splits), the mma.sync kernel."""
    monkeypatch.setattr(linear, "W4A8_PATH", "sm90" if request.param == "split" else request.param)
    monkeypatch.setattr(linear, "W4A8_KSPLIT", 2 if request.param == "split" else 1)
    return request.param


def _exact(xc, xs, codes, scales):
    return B.exact_and_absolute(xc.numpy(), xs.numpy(), codes, scales)


@pytest.mark.gpu
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 65, 130, 300])
def test_batched_within_the_bound(sm90, path, rng, tokens, scale_format):
    # N = 24: a partial row tile; N = 200: a second block of 128 features;
    # K = 160: a partial 128-column chunk; K = 1024: eight chunks. Block
    # scales within 3 of each other take the kernel's computed tables only;
    # within 6, blocks 6 binades below their row's largest need the exact
    # table (subnormal E4M3 entries) from shared memory.
    for g, n, k, spread in ((3, 24, 160, 3), (2, 200, 1024, 3), (2, 136, 512, 6)):
        codes, scales, _, w8 = mx_weight(rng, g, n, k, spread)
        xc, xs = fp8_act(rng, (tokens, g, k), scale_format)
        exact, absolute = _exact(xc, xs, codes, scales)
        w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
        out = torch.full((tokens, g, n), float("nan"), dtype=bf, device="cuda")
        rawkv.gemm.grouped_linear((xc.cuda(), xs.cuda()), w8c, out=out)
        B.assert_within_bound(out, exact, absolute, k, f"T={tokens} G={g} N={n} K={k}")


# The batched decode tiles the grid rule takes (test_plans_batched_decode_tile_by_grid),
# each forced through the tunables: every call of up to 8 tokens takes it.
_BY_GRID = {"small": dict(W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM=1e9, W4A8_MMA_SMALL_GRID_MIN_K=0),
            "wide": dict(W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM=0, W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM=-1,
                         W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM=1e9)}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(_BY_GRID))
@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_decode_tiles_by_grid_within_the_bound_and_their_bits(sm90, rng, monkeypatch, tile, scale_format):
    """K8.MMA_SMALL_GRID_CONFIG / MMA_WIDE_CONFIG: within the bound at 1 to 8
    tokens on partial row tiles (N = 24, 200), a partial chunk (K = 160),
    more chunks than eight warps' rings hold (K = 4,096) and blocks that
    need the exact table (spread 6); the same bits every run and for every
    token count; the wide tile (K split in four) MMA_CONFIGS[8]'s bits, the
    small one (in eight) its own."""
    assert K8.MMA_WIDE_CONFIG[2] == K8.MMA_CONFIGS[8][2] and K8.MMA_SMALL_GRID_CONFIG[2] == 8
    for g, n, k, spread in ((3, 24, 160, 3), (2, 200, 4096, 3), (2, 136, 512, 6)):
        codes, scales, _, w8 = mx_weight(rng, g, n, k, spread)
        w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
        xc, xs = fp8_act(rng, (8, g, k), scale_format)
        exact, absolute = _exact(xc, xs, codes, scales)
        xc, xs = xc.cuda(), xs.cuda()
        monkeypatch.setattr(linear, "W4A8_PATH", "mma")          # MMA_CONFIGS[8], whatever the tunables below
        base = rawkv.gemm.grouped_linear((xc, xs), w8c)
        monkeypatch.setattr(linear, "W4A8_PATH", "auto")
        for name, value in _BY_GRID[tile].items():
            monkeypatch.setattr(linear, name, value)
        shape = types.SimpleNamespace(n=n, k=k, groups=g)
        assert plans._w4a8_tile_by_grid(shape, sm90, linear) == (K8.MMA_SMALL_GRID_CONFIG if tile == "small"
                                                                 else K8.MMA_WIDE_CONFIG)
        full = rawkv.gemm.grouped_linear((xc, xs), w8c)
        what = f"{tile} G={g} N={n} K={k}"
        B.assert_within_bound(full, exact, absolute, k, what)
        assert torch.equal(full.view(torch.int16), rawkv.gemm.grouped_linear((xc, xs), w8c).view(torch.int16)), what
        if tile == "wide":
            assert torch.equal(full.view(torch.int16), base.view(torch.int16)), what
        for tokens in (1, 3, 7):
            part = rawkv.gemm.grouped_linear((xc[:tokens].contiguous(), xs[:tokens].contiguous()), w8c)
            assert torch.equal(part.view(torch.int16), full[:tokens].view(torch.int16)), (what, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, rows", [(4, 0), (4, 9), (8, 300), (384, 700)])
def test_ragged_within_the_bound(sm90, path, rng, experts, rows):
    n, k = 136, 288
    codes, scales, _, w8 = mx_weight(rng, experts, n, k)
    counts = rng.multinomial(rows, np.full(experts, 1 / experts)) if rows else np.zeros(experts, int)
    counts[0] = 0                                              # an empty expert
    counts[-1] += rows - counts.sum()
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    xc, xs = fp8_act(rng, (rows, k))
    exact, bad = W.ragged(xc.numpy(), xs.numpy(), codes, scales, offsets)
    absolute, _ = G.ragged(np.abs(W.activation_values(xc.numpy(), xs.numpy())),
                           np.abs(W.weight_values(codes, scales)), offsets)
    assert bad == 0
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = rawkv.gemm.moe_linear((xc.cuda(), xs.cuda()), w8c, torch.from_numpy(offsets).cuda(), errors=errors)
    B.assert_within_bound(out, exact, absolute, k, f"E={experts} R={rows}")
    assert int(errors[0]) == 0


@pytest.mark.gpu
def test_ragged_few_rows_tile_within_the_bound_and_its_three_stage_bits(sm90, rng, monkeypatch):
    """K8.MMA_RAGGED_FEW_ROWS_CONFIG (MMA_RAGGED_CONFIGS[8] with a ring of
    two stages, at up to W4A8_MMA_FEW_ROWS rows; forced here on a small grid
    through MMA_RAGGED_MIN_BLOCKS = 0): within the bound, with an empty
    expert and K past its ring (eight chunks), and the bits of the tile
    itself (W4A8_MMA_FEW_ROWS = 0)."""
    experts, rows, n, k = 4, 9, 136, 1024
    codes, scales, _, w8 = mx_weight(rng, experts, n, k)
    offsets = np.array([0, 0, 4, 6, 9], dtype=np.int32)          # expert 0 empty
    xc, xs = fp8_act(rng, (rows, k))
    exact, _ = W.ragged(xc.numpy(), xs.numpy(), codes, scales, offsets)
    absolute, _ = G.ragged(np.abs(W.activation_values(xc.numpy(), xs.numpy())),
                           np.abs(W.weight_values(codes, scales)), offsets)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    args = ((xc.cuda(), xs.cuda()), w8c, torch.from_numpy(offsets).cuda())
    monkeypatch.setattr(linear, "W4A8_PATH", "mma")
    monkeypatch.setattr(linear, "MMA_RAGGED_MIN_BLOCKS", 0)
    shape = types.SimpleNamespace(n=n, k=k, groups=experts)
    assert plans.w4a8_mma_config(shape, 3, True, rows, sm90, linear) == K8.MMA_RAGGED_FEW_ROWS_CONFIG
    few = rawkv.gemm.moe_linear(*args)
    B.assert_within_bound(few, exact, absolute, k, f"E={experts} R={rows}")
    monkeypatch.setattr(linear, "W4A8_MMA_FEW_ROWS", 0)
    assert plans.w4a8_mma_config(shape, 3, True, rows, sm90, linear) == K8.MMA_RAGGED_CONFIGS[8]
    assert torch.equal(few.view(torch.int16), rawkv.gemm.moe_linear(*args).view(torch.int16))


@pytest.mark.gpu
def test_ragged_clamps_count_and_unowned_rows_are_zero(sm90, path, rng):
    codes, scales, _, w8 = mx_weight(rng, 3, 40, 128)
    xc, xs = fp8_act(rng, (12, 128))
    offsets = np.array([2, 6, 4, 9], np.int32)                  # 4 < 6: clamped; rows 9.. and ..2 unowned
    exact, bad = W.ragged(xc.numpy(), xs.numpy(), codes, scales, offsets)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((12, 40), float("nan"), dtype=bf, device="cuda")
    rawkv.gemm.moe_linear((xc.cuda(), xs.cuda()), w8c, torch.from_numpy(offsets).cuda(), out=out, errors=errors)
    assert int(errors[0]) == bad == 1
    assert (out[:2] == 0).all() and (out[9:] == 0).all()
    absolute, _ = G.ragged(np.abs(W.activation_values(xc.numpy(), xs.numpy())),
                           np.abs(W.weight_values(codes, scales)), offsets)
    B.assert_within_bound(out, exact, absolute, 128, "clamped")


@pytest.mark.gpu
def test_extreme_shifts_within_the_bound(sm90, path, rng):
    # the table rows read from shared memory (subnormal entries) and the
    # computed rows at the top of the range, on the GPU
    codes, scales = extreme_weight(2, 40, 256)
    w8 = rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales),
                                                                groups=2))
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = fp8_act(rng, (70, 2, 256))
    exact, absolute = _exact(xc, xs, codes, scales)
    out = rawkv.gemm.grouped_linear((xc.cuda(), xs.cuda()), w8c)
    B.assert_within_bound(out, exact, absolute, 256, "extreme shifts")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [3, 40])
def test_nan_scale_reaches_the_output_on_the_gpu(sm90, path, rng, tokens):
    # a NaN block scale of token 1 makes its whole row NaN, and no other
    # token's (K = 1152: nine chunks, so that split K has two halves)
    _, _, _, w8 = mx_weight(rng, 2, 40, 1152)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = fp8_act(rng, (tokens, 2, 1152))
    xs[1, 0, 7] = float("nan")
    got = rawkv.gemm.grouped_linear((xc.cuda(), xs.cuda()), w8c).float().cpu()
    assert torch.isnan(got[1, 0]).all()
    nan = torch.isnan(got)
    nan[1, 0] = False
    assert not nan.any()


@pytest.mark.gpu
def test_k_zero_gives_zeros_on_the_gpu(sm90, path):
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.zeros(1, 16, 0, dtype=u8), torch.zeros(1, 16, 0, dtype=u8))
    w8 = rawkv.gemm.w4a8_weight(w)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    out = torch.full((3, 1, 16), float("nan"), dtype=bf, device="cuda")
    rawkv.gemm.grouped_linear((buf(3, 1, 0).cuda(), ones(3, 1, 0).cuda()), w8c, out=out)
    assert (out == 0).all()


@pytest.mark.gpu
def test_same_bits_every_run_and_every_token_tiling(sm90, rng, monkeypatch):
    # 16 tokens take BN = 16 tiles, 64 BN = 64, 300 BN = 128: each output is
    # one warpgroup's sum over the chunks in order, so a token's row is the
    # same whichever tile it lands in, and the same on every run.
    monkeypatch.setattr(linear, "W4A8_PATH", "sm90")
    monkeypatch.setattr(linear, "W4A8_KSPLIT", 1)
    codes, scales, _, w8 = mx_weight(rng, 2, 264, 1024)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = fp8_act(rng, (300, 2, 1024))
    xc, xs = xc.cuda(), xs.cuda()
    full = rawkv.gemm.grouped_linear((xc, xs), w8c)
    again = rawkv.gemm.grouped_linear((xc, xs), w8c)
    assert torch.equal(full.view(torch.int16), again.view(torch.int16))
    for tokens in (64, 16):
        part = rawkv.gemm.grouped_linear((xc[:tokens].contiguous(), xs[:tokens].contiguous()), w8c)
        assert torch.equal(part.view(torch.int16), full[:tokens].view(torch.int16)), tokens


@pytest.mark.gpu
def test_every_column_count_within_the_bound_and_same_bits_as_16_token_tiles(sm90, rng, monkeypatch):
    # A block's MMAs cover its tokens rounded up to 16 columns (gemm_w4a8_sm90.cu,
    # run_tile): experts of 1 .. 250 rows in 128-token tiles reach every count
    # from 16 to 128 (a last tile of 1, 16, 17, ... rows); each row within the
    # bound and the same bits as 16-token tiles give it, ragged and batched.
    monkeypatch.setattr(linear, "W4A8_PATH", "sm90")
    monkeypatch.setattr(linear, "W4A8_KSPLIT", 1)
    n, k = 136, 1152
    counts = np.array([1, 16, 17, 32, 33, 48, 49, 64, 65, 80, 81, 96, 97, 112, 113, 128, 129, 250, 0, 7])
    assert {-(-(c % 128 or 128) // 16) for c in counts if c} == set(range(1, 9))
    codes, scales, _, w8 = mx_weight(rng, len(counts), n, k)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(offsets[-1])
    xc, xs = fp8_act(rng, (rows, k))
    exact, bad = W.ragged(xc.numpy(), xs.numpy(), codes, scales, offsets)
    absolute, _ = G.ragged(np.abs(W.activation_values(xc.numpy(), xs.numpy())),
                           np.abs(W.weight_values(codes, scales)), offsets)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    act, offs = (xc.cuda(), xs.cuda()), torch.from_numpy(offsets).cuda()
    outs = {}
    for tile in (K8.CONFIGS["large"], K8.CONFIGS[16]):
        monkeypatch.setattr(plans, "w4a8_tile", lambda tokens, tile=tile: tile)
        outs[tile[0]] = rawkv.gemm.moe_linear(act, w8c, offs)
    B.assert_within_bound(outs[128], exact, absolute, k, "ragged, 128-token tiles")
    assert torch.equal(outs[128].view(torch.int16), outs[16].view(torch.int16))
    # batched: the last token tile of 1, 17, 40, 100 and 127 tokens
    xb, sb = fp8_act(rng, (127, 2, k))
    wb = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t[:2].cuda() for t in w8[2:]))
    xb, sb = xb.cuda(), sb.cuda()
    for tokens in (1, 17, 40, 100, 127):
        got = {}
        for tile in (K8.CONFIGS["large"], K8.CONFIGS[16]):
            monkeypatch.setattr(plans, "w4a8_tile", lambda t, tile=tile: tile)
            got[tile[0]] = rawkv.gemm.grouped_linear((xb[:tokens].contiguous(), sb[:tokens].contiguous()), wb)
        assert torch.equal(got[128].view(torch.int16), got[16].view(torch.int16)), tokens


@pytest.mark.gpu
@pytest.mark.parametrize("ksplit", [1, 2])
def test_16_token_tile_past_its_ring_within_the_bound_and_same_bits(sm90, rng, monkeypatch, ksplit):
    # K = 2,304: 18 chunks through the tile's 8 stages (9 per half when split),
    # so every stage is reused; within the bound, and a token's row the same
    # bits as the 128-token tile gives it (70 tokens; each split alike)
    monkeypatch.setattr(linear, "W4A8_PATH", "sm90")
    monkeypatch.setattr(linear, "W4A8_KSPLIT", ksplit)
    k = 2304
    assert -(-k // K8.CHUNK) // ksplit > K8.CONFIGS[16][1]
    codes, scales, _, w8 = mx_weight(rng, 3, 200, k)
    xc, xs = fp8_act(rng, (70, 3, k))
    exact, absolute = _exact(xc[:16], xs[:16], codes, scales)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = xc.cuda(), xs.cuda()
    small = rawkv.gemm.grouped_linear((xc[:16].contiguous(), xs[:16].contiguous()), w8c)    # 16-token tile
    B.assert_within_bound(small, exact, absolute, k, f"16-token tile, split {ksplit}")
    large = rawkv.gemm.grouped_linear((xc, xs), w8c)                                          # 128-token tile
    assert torch.equal(small.view(torch.int16), large[:16].view(torch.int16))


@pytest.mark.gpu
def test_instance_past_48k_of_static_and_dynamic_shared_memory_launches(sm90, rng, monkeypatch):
    # (16, 4): 46,400 bytes of dynamic shared memory and the kernel's static
    # 4 KB pass the 48 KB a launch takes without raising the kernel's limit
    # (the runtime raises it by their sum; by the dynamic bytes alone this
    # launch failed with "invalid argument")
    assert K8.dynamic_smem(16, 4) < 48 * 1024 < K8.dynamic_smem(16, 4) + 4096
    monkeypatch.setattr(K8.GEMM, "_instance_args", [*K8.GEMM._instance_args, (16, 4, False)])
    monkeypatch.setattr(plans, "w4a8_tile", lambda tokens: (16, 4))
    monkeypatch.setattr(linear, "W4A8_PATH", "sm90")
    monkeypatch.setattr(linear, "W4A8_KSPLIT", 1)
    codes, scales, _, w8 = mx_weight(rng, 2, 200, 1024)
    xc, xs = fp8_act(rng, (5, 2, 1024))
    exact, absolute = _exact(xc, xs, codes, scales)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    out = rawkv.gemm.grouped_linear((xc.cuda(), xs.cuda()), w8c)
    B.assert_within_bound(out, exact, absolute, 1024, "(16, 4)")


@pytest.mark.gpu
def test_split_k_same_bits_every_run_and_every_token_tiling(sm90, rng, monkeypatch):
    # Split in two, each output is rank 0's sum of its half plus rank 1's:
    # the same bits on every run and whichever token tile (64 or 128
    # tokens) it lands in; within the bound.
    monkeypatch.setattr(linear, "W4A8_PATH", "sm90")
    monkeypatch.setattr(linear, "W4A8_KSPLIT", 2)
    codes, scales, _, w8 = mx_weight(rng, 2, 264, 1152)          # 9 chunks: halves of 5 and 4
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = fp8_act(rng, (300, 2, 1152))
    exact, absolute = _exact(xc, xs, codes, scales)
    xc, xs = xc.cuda(), xs.cuda()
    full = rawkv.gemm.grouped_linear((xc, xs), w8c)
    B.assert_within_bound(full, exact, absolute, 1152, "split")
    assert torch.equal(full.view(torch.int16), rawkv.gemm.grouped_linear((xc, xs), w8c).view(torch.int16))
    part = rawkv.gemm.grouped_linear((xc[:64].contiguous(), xs[:64].contiguous()), w8c)
    assert torch.equal(part.view(torch.int16), full[:64].view(torch.int16))


@pytest.mark.gpu
def test_mma_kernel_same_bits_every_run_and_every_token_tiling(sm90, rng, monkeypatch):
    # The mma.sync kernel's batched tiles (8 and 16 tokens) both split K in
    # four warps the same way, so a token's row is the same whichever tile it
    # lands in; forced to 65 tokens (16-token tiles, the last partial).
    monkeypatch.setattr(linear, "W4A8_PATH", "mma")
    assert len({cfg[2] for cfg in K8.MMA_CONFIGS.values()}) == 1
    codes, scales, _, w8 = mx_weight(rng, 2, 264, 1024)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = fp8_act(rng, (65, 2, 1024))
    xc, xs = xc.cuda(), xs.cuda()
    full = rawkv.gemm.grouped_linear((xc, xs), w8c)
    assert torch.equal(full.view(torch.int16), rawkv.gemm.grouped_linear((xc, xs), w8c).view(torch.int16))
    for tokens in (1, 8, 9, 16):
        part = rawkv.gemm.grouped_linear((xc[:tokens].contiguous(), xs[:tokens].contiguous()), w8c)
        assert torch.equal(part.view(torch.int16), full[:tokens].view(torch.int16)), tokens


# Every tile of both kernels with E8M0-byte scales (their SB = true
# instances): (what, tunables, batched
# tokens per group or ragged (rows, experts)).
_E8M0_CASES = [
    ("wgmma", dict(W4A8_PATH="sm90"), [1, 16, 64, 130]),
    ("wgmma split", dict(W4A8_PATH="sm90", W4A8_KSPLIT=2), [1, 16, 64, 130]),
    ("mma", dict(W4A8_PATH="mma"), [1, 8, 16]),
    *((f"mma {tile} grid", dict(_BY_GRID[tile]), [8]) for tile in sorted(_BY_GRID)),
    ("wgmma ragged", dict(W4A8_PATH="sm90"), [(300, 8)]),
    ("mma ragged", dict(W4A8_PATH="mma", MMA_RAGGED_MIN_BLOCKS=0, W4A8_MMA_FEW_ROWS=0), [(40, 8), (100, 8)]),
    ("mma ragged few rows", dict(W4A8_PATH="mma", MMA_RAGGED_MIN_BLOCKS=0), [(9, 8)]),
    ("mma ragged small", dict(W4A8_PATH="mma", MMA_RAGGED_MIN_BLOCKS=1e9), [(9, 8)]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("what, tunables, calls", _E8M0_CASES, ids=[c[0] for c in _E8M0_CASES])
def test_e8m0_byte_scales_give_the_bits_of_their_float32_values(sm90, rng, monkeypatch, what, tunables, calls):
    """Scales as E8M0 bytes (float8_e8m0fnu and uint8; byte 0, 2^-127, and
    254 among them: e8m0_act) give the bits of the same scales as float32,
    in every tile, and byte 0xFF a NaN row of its token alone. K = 1152:
    nine chunks (split K has two halves), partial row tiles (N = 200)."""
    for name, value in tunables.items():
        monkeypatch.setattr(linear, name, value)
    n, k = 200, 1152
    for call in calls:
        ragged = isinstance(call, tuple)
        g = call[1] if ragged else 2
        _, _, _, w8 = mx_weight(rng, g, n, k)
        w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
        if ragged:
            rows = call[0]
            counts = rng.multinomial(rows, np.full(g, 1 / g))
            offs = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)).cuda()
            xc, xb, xf = (t.cuda() for t in e8m0_act(rng, (rows, k)))
            run = lambda x: rawkv.gemm.moe_linear(x, w8c, offs)  # noqa: E731
        else:
            xc, xb, xf = (t.cuda() for t in e8m0_act(rng, (call, g, k)))
            run = lambda x: rawkv.gemm.grouped_linear(x, w8c)  # noqa: E731
        want = run((xc, xf)).view(torch.int16)
        for sb in (xb, xb.view(torch.uint8)):
            assert torch.equal(run((xc, sb)).view(torch.int16), want), (what, call, sb.dtype)
        nan = xb.view(torch.uint8).clone()
        nan[-1].view(-1)[-1] = 0xFF                              # the last token's last block
        got = run((xc, nan)).float()
        bad = torch.isnan(got)
        assert bad[-1].all() if ragged else bad[-1, -1].all(), (what, call)
        if ragged:
            bad[-1] = False
        else:
            bad[-1, -1] = False
        assert not bad.any(), (what, call)


@pytest.mark.gpu
def test_views_are_read_as_they_are_or_copied(sm90, path, rng):
    codes, scales, _, w8 = mx_weight(rng, 2, 48, 256)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    xc, xs = fp8_act(rng, (20, 2, 256))
    want = rawkv.gemm.grouped_linear((xc.cuda(), xs.cuda()), w8c)
    wide = torch.zeros(20, 2, 512, dtype=u8)
    wide[..., 128:384] = xc                                   # rows 16-byte aligned, strided
    ws = torch.zeros(20, 2, 4)
    ws[..., ::2] = xs                                         # scales with a strided last dimension
    out = torch.empty(20, 2, 64, dtype=bf, device="cuda")[..., 8:56]
    got = rawkv.gemm.grouped_linear((wide.cuda()[..., 128:384], ws.cuda()[..., ::2]), w8c, out=out)
    assert got is out and torch.equal(out.view(torch.int16), want.view(torch.int16))
    tx = torch.zeros(20, 2, 257, dtype=u8)
    tx[..., 1:] = xc                                          # misaligned rows: copied
    got = rawkv.gemm.grouped_linear((tx.cuda()[..., 1:], xs.cuda()), w8c)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def mn_major(s):
    """Scales s (T, ..., nb) as DeepGEMM's SM90 FP8 GEMM holds activation
    scales (deep_gemm get_mn_major_tma_aligned_tensor at 54e22612: the token
    index contiguous, each block's column of tokens padded to a multiple of
    4): the same values, a strided view of a new buffer. E8M0 scales as
    their uint8 bytes."""
    t, d = s.shape[0], s.dim()
    store = torch.full((*s.shape[1:], -(-t // 4) * 4), 7, dtype=s.dtype, device=s.device)  # (padding: junk)
    store[..., :t] = s.permute(*range(1, d), 0)
    view = store[..., :t].permute(d - 1, *range(d - 1))
    assert view.stride(0) == 1 and torch.equal(view, s)
    return view


def test_cpu_mn_major_scales_give_the_row_major_bits(rng):
    codes, scales, _, w8 = mx_weight(rng, 2, 24, 288)
    xc, xs = fp8_act(rng, (6, 2, 288))
    want = rawkv.gemm.grouped_linear((xc, xs), w8).view(torch.int16)
    assert torch.equal(rawkv.gemm.grouped_linear((xc, mn_major(xs)), w8).view(torch.int16), want)
    rc, rs = fp8_act(rng, (9, 288))
    offsets = torch.tensor([0, 4, 9], dtype=torch.int32)
    want = rawkv.gemm.moe_linear((rc, rs), w8, offsets).view(torch.int16)
    assert torch.equal(rawkv.gemm.moe_linear((rc, mn_major(rs)), w8, offsets).view(torch.int16), want)


@pytest.mark.parametrize("op", ["grouped", "ragged"])
def test_strided_scale_blocks_reach_the_wgmma_kernel_alone(monkeypatch, rng, op):
    """The CUDA path on a CPU (tests/support/fake_cuda.py: launches recorded
    through their declarations): MN-major scales go to the wgmma kernel as
    they lie (ss_b its block stride) and are copied once for the mma.sync
    kernel, which reads a token's blocks adjacent (docs/gemm.md, "Scale
    layouts"); row-major scales are never copied."""
    from rawkv.gemm import w4a8 as w4a8_op
    from support.fake_cuda import fake, install
    rt = install(monkeypatch, (w4a8_op,))
    _, _, _, w8 = mx_weight(rng, 2, 200, 1056)
    w = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(fake(t) for t in w8[2:]))
    for tokens, kernel in ((1, "rkv_gemm_w4a8_mma"), (200, "rkv_gemm_w4a8_sm90")):
        lead = (tokens, 2) if op == "grouped" else (2 * tokens,)
        xc, xs = fp8_act(rng, (*lead, 1056))
        out = fake(torch.empty(*lead, 200, dtype=bf))
        offs = fake(torch.tensor([0, tokens, 2 * tokens], dtype=torch.int32))
        for sf in (xs, mn_major(xs)):
            rt.calls.clear()
            xa = (fake(xc), fake(sf))
            if op == "grouped":
                rawkv.gemm.grouped_linear(xa, w, out=out)
            else:
                rawkv.gemm.moe_linear(xa, w, offs, out=out)
            (fn, _, _, args), = [c for c in rt.calls if c[0] != "memset"]
            assert fn.startswith(kernel), (op, tokens, fn)
            in_place = args["xsf"] == sf.data_ptr()
            assert in_place == (sf.stride(-1) == 1 or kernel.endswith("sm90")), (op, tokens, sf.stride())
            assert args.get("ss_b") == (sf.stride(-1) if kernel.endswith("sm90") else None)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["grouped", "ragged"])
@pytest.mark.parametrize("tokens", [1, 12, 64, 200])
def test_mn_major_scales_are_read_in_place(sm90, path, rng, op, tokens):
    # DeepGEMM's MN-major scale layout (mn_major) gives the bits of the same
    # scales row-major through every kernel and token tile, FP32 and E8M0
    # bytes (uint8 and float8_e8m0fnu): the wgmma kernel reads it where it
    # lies, the mma.sync kernel a copy (which launch takes which:
    # test_strided_scale_blocks_reach_the_wgmma_kernel_alone). K = 1,056:
    # eight full 128-column chunks and a partial one (the scales' block
    # stride steps nine times).
    g, n, k = 2, 200, 1056
    _, _, _, w8 = mx_weight(rng, g, n, k)
    w8c = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))
    if op == "grouped":
        xc, xb, xf = (t.cuda() for t in e8m0_act(rng, (tokens, g, k)))
        run = lambda sf: rawkv.gemm.grouped_linear((xc, sf), w8c)  # noqa: E731
    else:
        rows = tokens * g
        xc, xb, xf = (t.cuda() for t in e8m0_act(rng, (rows, k)))
        offs = torch.tensor([0, rows // 3, rows], dtype=torch.int32, device="cuda")
        run = lambda sf: rawkv.gemm.moe_linear((xc, sf), w8c, offs)  # noqa: E731
    for sf in (xf, xb.view(torch.uint8)):
        want = run(sf).view(torch.int16)
        mn = mn_major(sf)
        forms = (mn, mn.view(torch.float8_e8m0fnu)) if sf.dtype == torch.uint8 else (mn,)
        for form in forms:
            assert torch.equal(run(form).view(torch.int16), want), (op, tokens, form.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["grouped", "ragged"])
def test_shift_bytes_past_the_table_same_bits_and_count_as_the_cpu(sm90, path, rng, op):
    # Products exact in the FP8 MMA (exact_weight / exact_act), so the
    # kernel's bits are the CPU path's. Two feature blocks (N = 200: a
    # partial row tile), a partial chunk (K = 288), two token tiles in a
    # group (batched: 200 tokens, BN = 128; ragged: experts of 155 and 130
    # rows): each bad block is counted once, by its group's first tile only;
    # bytes past the table in the padding too (not counted); ragged: an
    # expert without rows (its bad blocks not counted), a clamp, unowned rows.
    n, k = 200, 288
    if op == "grouped":
        g, lead, offsets, live = 3, (200, 3), None, [0, 1, 2]
    else:
        g, lead, offsets, live = 4, (300,), np.array([2, 5, 3, 160, 290], np.int32), [0, 2, 3]
    codes, scales, w8 = exact_weight(rng, g, n, k)
    hand, bad, zeroed = past_table_form(rng, codes, w8)
    xc, xs = exact_act(rng, lead, k)

    def call(w, dev, errors):
        xa = (xc.to(dev), xs.to(dev))
        w = rawkv.gemm.W4a8Weight(w.n, w.k, *(t.to(dev) for t in w[2:]))
        if offsets is None:
            return rawkv.gemm.grouped_linear(xa, w, errors=errors)
        return rawkv.gemm.moe_linear(xa, w, torch.from_numpy(offsets).to(dev), errors=errors)

    cpu_errors = torch.zeros(1, dtype=torch.int32)
    want = call(hand, "cpu", cpu_errors)
    gpu_errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    got = call(hand, "cuda", gpu_errors)
    count = int(bad[live].sum()) + (0 if offsets is None else 1)          # (ragged: one clamp)
    assert int(cpu_errors[0]) == count and int(gpu_errors[0]) == count, (int(gpu_errors[0]), count)
    assert np.array_equal(bits(got), bits(want)), f"{op}: {int((bits(got) != bits(want)).sum())} outputs differ"
    # the same bits as the form with those blocks' codes zeroed (shift bytes in the table)
    w8z = w8._replace(codes=torch.from_numpy(W.pack_codes8(zeroed)))
    assert np.array_equal(bits(call(w8z, "cuda", None)), bits(got))
    # errors=None: the device's GEMM_OFFSETS counter
    counter = rawkv.nvfp4.error_counts()
    before = int(counter[rawkv.nvfp4.GEMM_OFFSETS])
    again = call(hand, "cuda", None)
    assert int(counter[rawkv.nvfp4.GEMM_OFFSETS]) - before == count
    assert np.array_equal(bits(again), bits(got))


# ---------------------------------------------------------------------------
# the operators
# ---------------------------------------------------------------------------
def opcheck_samples(rng, device="cpu"):
    """opcheck argument tuples of rawkv::gemm_grouped_linear_w4a8 and
    rawkv::gemm_moe_linear_w4a8."""
    from rawkv.gemm.w4a8 import operator_args8
    _, _, _, w8 = mx_weight(rng, 3, 24, 160)
    w8 = rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.to(device) for t in w8[2:]))
    xc, xs = fp8_act(rng, (5, 3, 160))
    xa = (xc.to(device), xs.to(device))
    xr = (xc[:, 0].contiguous().to(device), xs[:, 0].contiguous().to(device))
    offsets = torch.tensor([0, 2, 1, 5], dtype=torch.int32, device=device)
    return {
        "gemm_grouped_linear_w4a8": [
            tuple((operator_args8(xa, w8) | {"out": torch.empty(5, 3, 24, dtype=bf, device=device),
                                             "errors": torch.zeros(1, dtype=torch.int32, device=device)}).values()),
            tuple((operator_args8(xa, w8) | {"out": torch.empty(5, 3, 24, dtype=bf, device=device),
                                             "errors": None}).values()),
            tuple((operator_args8((xc.to(device), e8m0_act(rng, (5, 3, 160))[1].to(device)), w8)
                   | {"out": torch.empty(5, 3, 24, dtype=bf, device=device), "errors": None}).values()),
            # scales MN-major, out (T, G, N) over a (G, T, N) buffer: both at strides the kernels take
            tuple((operator_args8((xa[0], mn_major(xa[1])), w8)
                   | {"out": torch.empty(3, 5, 24, dtype=bf, device=device).transpose(0, 1),
                      "errors": torch.zeros(1, dtype=torch.int32, device=device)}).values())],
        "gemm_moe_linear_w4a8": [
            tuple((operator_args8(xr, w8) | {"offsets": offsets, "out": torch.empty(5, 24, dtype=bf, device=device),
                                             "errors": torch.zeros(1, dtype=torch.int32, device=device)}).values()),
            # E8M0 bytes in DeepGEMM's MN-major, TMA-aligned layout (mn_major), the device's counter;
            # no rows
            tuple((operator_args8((xr[0], mn_major(e8m0_act(rng, (5, 160))[1].view(torch.uint8).to(device))), w8)
                   | {"offsets": offsets, "out": torch.empty(5, 24, dtype=bf, device=device),
                      "errors": None}).values()),
            tuple((operator_args8((xr[0][:0], xr[1][:0]), w8)
                   | {"offsets": torch.zeros(4, dtype=torch.int32, device=device),
                      "out": torch.empty(0, 24, dtype=bf, device=device),
                      "errors": torch.zeros(1, dtype=torch.int32, device=device)}).values())],
    }
