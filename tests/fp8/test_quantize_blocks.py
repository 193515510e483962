"""FP8 block activations (rawkv.fp8.quantize_blocks / dequantize_blocks): the
reference against DeepSeek's official rule restated independently in torch,
edge cases, argument errors, the launch plan as data, the operator, and the
CUDA kernels against the reference bit for bit (GPU tests skip without one).

The rule followed is DeepSeek-V4's act_quant (inference/kernel.py, tilelang;
git blob ea7976fa1b4a549306ce57d7a1a78f4798b222b8 of the Hugging Face file,
committed as text in github.com/Mockingjay1316/deepseek-v4-flash-spark at
0825add42734731a285e30f657b0ccfc5bad74c9 -- that repository's first commit,
135f0266, holds only a symlink to the blob -- the same act_quant as
github.com/deepseek-ai/DeepSeek-V3.2-Exp inference/kernel.py at
2305c7ec3bf4b357dc0aee8dd97e0a1cbc0ea0e1):
    amax = max(max|x|, FP32(1e-4)); s = amax * FP32(1/448);
    ue8m0: s = 2^(exponent(s) + (mantissa(s) != 0));
    code = E4M3_rne_satfinite(clamp(FP32(x / s), -448, 448)).
rawkv/reference/fp8_blocks.py has the details and where they come from."""
import numpy as np
import pytest

import rawkv
from rawkv import fp8
from rawkv._plan import Device
from rawkv.kernels import fp8_blocks as KB
from rawkv.reference import fp8_blocks as B
from rawkv.reference import formats as F

torch = pytest.importorskip("torch")

ALL_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
FINITE_BF16 = ALL_BF16[np.isfinite(ALL_BF16)]


# ---- DeepSeek's rule, restated in torch (independent of the numpy reference) ----------------
def deepseek_v4_act_quant(x, block=128, scale_fmt=None, scale_dtype=torch.float32):
    """DeepSeek-V4 act_quant (kernel.py blob ea7976fa, act_quant_kernel),
    vectorized in torch on CPU for finite x with x.size(-1) % block == 0:
    the same operations in the same FP32 order, with torch's (IEEE) FP32
    multiply and divide standing in for the CUDA ones tilelang 0.1.8 emits
    without fast math."""
    xf = x.float().unflatten(-1, (-1, block))
    amax = xf.abs().amax(dim=-1)                                        # T.reduce_absmax
    amax = torch.maximum(amax, torch.tensor(1e-4, dtype=torch.float32))  # T.max(amax, 1e-4)
    s = amax * torch.tensor(1 / 448.0, dtype=torch.float32)             # amax * fp8_max_inv
    if scale_fmt is not None:                                           # fast_round_scale
        bits = s.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & ((1 << 23) - 1)) != 0).int()   # fast_log2_ceil
        s = ((exp + 127) << 23).view(torch.float32)                     # fast_pow2
    y = torch.clamp(xf / s.unsqueeze(-1), -448.0, 448.0).to(torch.float8_e4m3fn)
    return y.flatten(-2), s.to(scale_dtype)


def deepgemm_per_token_cast_to_fp8_ue8m0(x, gran_k=128):
    """DeepGEMM's test quantizer (github.com/deepseek-ai/DeepGEMM
    deep_gemm/utils/math.py per_token_cast_to_fp8 with use_ue8m0, at
    54e22612409371d6364144b69086735beb54e98b), restated: zero padding to a
    multiple of gran_k, sf = amax / 448 (a division), ceil_to_ue8m0 from the
    bits, codes = x * (1 / sf)."""
    m, n = x.shape
    pn = -(-n // gran_k) * gran_k
    xp = torch.zeros((m, pn), dtype=x.dtype)
    xp[:, :n] = x
    xv = xp.view(m, pn // gran_k, gran_k)
    sf = xv.abs().float().amax(dim=2).clamp(1e-4) / 448.0
    bits = sf.view(torch.int32)
    sf = ((((bits >> 23) & 0xFF) + (bits & 0x7FFFFF).bool().int()).clamp(1, 254) << 23).view(torch.float32)
    codes = (xv * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, pn)[:, :n].contiguous()
    return codes, sf


def _u8(t):
    return t.view(torch.uint8).numpy()


def _bytes(codes):
    return codes.view(torch.uint8).numpy() if isinstance(codes, torch.Tensor) else codes


def _inputs(rng, rows, k, kind):
    """bf16-valued float32 test inputs of a few shapes of distribution."""
    if kind == "normal":
        x = rng.standard_normal((rows, k)) * np.exp(rng.uniform(-20, 20, (rows, 1)))
    elif kind == "outliers":
        x = rng.standard_normal((rows, k))
        x[rng.random((rows, k)) < 0.01] *= 1e4
    elif kind == "bits":             # any finite bf16 pattern
        x = FINITE_BF16[rng.integers(0, FINITE_BF16.size, (rows, k))]
    else:                            # small integers times powers of two: many ties
        x = rng.integers(-64, 65, (rows, k)) * np.exp2(rng.integers(-30, 30, (rows, 1)))
    return F.bf16_round(np.asarray(x, np.float32))


# ---- the reference against DeepSeek's rule ---------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "outliers", "bits", "ties"])
@pytest.mark.parametrize("block", B.BLOCKS)
def test_reference_equals_deepseek_v4_act_quant(rng, seed, kind, block):
    print("seed", seed)
    x = _inputs(rng, 64, 512, kind)
    xt = torch.from_numpy(x).bfloat16()
    for fmt, scale_fmt in (("fp32", None), ("ue8m0", "ue8m0")):
        codes, scales = B.quantize_blocks(x, block, fmt)
        dc, ds = deepseek_v4_act_quant(xt, block, scale_fmt)
        assert np.array_equal(codes, _u8(dc)), (fmt, seed)
        want = ds.numpy() if fmt == "fp32" else _u8(ds.to(torch.float8_e8m0fnu))
        assert np.array_equal(scales.view(np.uint8) if fmt == "ue8m0" else scales, want), (fmt, seed)
        if fmt == "ue8m0":          # V3.2-Exp stores the same power of two as FP32
            assert np.array_equal(B.ue8m0_value(scales), ds.numpy())


def test_every_bf16_value_in_blocks_of_every_scale_equals_deepseek_v4():
    """Exhaustive over the element: every finite BF16 value, in blocks whose
    amax is each of a set of anchors (the element itself where it is larger),
    against the restated rule, both scale formats."""
    anchors = F.bf16_round(np.array([1e-30, 1e-4, 0.3, 1.0, 448.0, 449.0, 3e5, 1e30], np.float32))
    for a in anchors:
        x = np.full((FINITE_BF16.size // 64, 128), 0.0, np.float32)
        x[:, :64] = FINITE_BF16[: x.shape[0] * 64].reshape(-1, 64)
        x[:, 64] = a
        for fmt, scale_fmt in (("fp32", None), ("ue8m0", "ue8m0")):
            codes, _ = B.quantize_blocks(x, 128, fmt)
            dc, _ = deepseek_v4_act_quant(torch.from_numpy(x), 128, scale_fmt)
            assert np.array_equal(codes, _u8(dc)), (a, fmt)


def test_scales_of_every_bf16_amax_equal_deepseek_v4():
    x = np.zeros((FINITE_BF16.size, 32), np.float32)
    x[:, 0] = FINITE_BF16
    for fmt, scale_fmt in (("fp32", None), ("ue8m0", "ue8m0")):
        _, scales = B.quantize_blocks(x, 32, fmt)
        _, ds = deepseek_v4_act_quant(torch.from_numpy(x), 32, scale_fmt)
        got = B.ue8m0_value(scales) if fmt == "ue8m0" else scales
        assert np.array_equal(got[:, 0], ds.numpy()[:, 0]), fmt


def test_ue8m0_bytes_equal_deepgemm_per_token_cast_to_fp8(rng, seed):
    """With UE8M0 scales, V4's product amax * FP32(1/448) and DeepGEMM's
    quotient amax / 448 round up to the same power of two, and x / s equals
    x * (1/s) for a power of two s: the bytes agree (including partial last
    blocks). Their FP32 scales differ in the last bit for about half of all
    amax, so no such claim holds for scale_format 'fp32'."""
    print("seed", seed)
    for k in (512, 144, 16):
        x = _inputs(rng, 32, k, "normal")
        codes, scales = B.quantize_blocks(x, 128, "ue8m0")
        dc, ds = deepgemm_per_token_cast_to_fp8_ue8m0(torch.from_numpy(x).bfloat16())
        assert np.array_equal(codes, _u8(dc)), (k, seed)
        assert np.array_equal(B.ue8m0_value(scales), ds.numpy()), (k, seed)


def test_ue8m0_power_is_the_same_from_product_or_quotient_near_every_boundary():
    """Where amax / 448 is a power of two 2^e (amax = 448 * 2^e) the two ways
    could round to different sides: 4096 FP32 amax values either side of
    every such boundary, exhaustively."""
    e = np.arange(-13, 119)
    centre = (np.float32(448.0) * np.exp2(e).astype(np.float32)).astype(np.float32).view(np.int32)
    a = (centre[:, None] + np.arange(-4096, 4097)[None, :]).astype(np.int32).view(np.float32).ravel()
    a = a[a >= B.AMAX_FLOOR]
    _, byte = B.scale_of(a, "ue8m0")
    q = (a / np.float32(448.0)).astype(np.float32).view(np.uint32)
    assert np.array_equal(byte, ((q >> 23) & 0xFF) + ((q & 0x7FFFFF) != 0))


# ---- edge cases the reference defines (docs/format.md) -----------------------------------------
def test_zero_block_gets_the_floor_scale_and_zero_codes_with_their_sign():
    x = np.zeros((2, 128), np.float32)
    x[1] = -0.0
    codes, scales = B.quantize_blocks(x, 128, "fp32")
    assert (codes[0] == 0).all() and (codes[1] == 0x80).all()
    assert (scales == np.float32(np.float32(1e-4) * np.float32(1 / 448))).all()
    assert scales[0, 0].view(np.uint32) == 0x346FACAD       # FP32(1e-4) * FP32(1/448), rounded (2.2321429e-7)
    _, b = B.quantize_blocks(x, 128, "ue8m0")
    assert (b == 105).all()                                 # 2^-22 >= 2.23e-7 > 2^-23


def test_amax_floor_applies_to_tiny_and_subnormal_blocks():
    """Below 1e-4 every block shares the floor scale; subnormal inputs divide
    exactly (no flush to zero) and round to zero codes with their sign."""
    tiny = np.array([1e-5, -3e-5, 2.0 ** -130, -(2.0 ** -149), 0.0], np.float32)
    x = np.zeros((1, 32), np.float32)
    x[0, :5] = tiny
    codes, scales = B.quantize_blocks(x, 32, "fp32")
    s = np.float32(np.float32(1e-4) * np.float32(1 / 448))
    assert scales[0, 0] == s
    assert np.array_equal(codes[0, :5], F.e4m3_encode((tiny / s).astype(np.float32)))
    assert codes[0, 3] == 0x80 and codes[0, 2] == 0x00


@pytest.mark.parametrize("fmt", B.SCALE_FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_block_is_flagged_and_the_others_are_untouched(fmt, bad):
    x = F.bf16_round(np.linspace(-3, 3, 2 * 256, dtype=np.float32).reshape(2, 256))
    y = x.copy()
    y[1, 130] = bad
    codes, scales = B.quantize_blocks(y, 128, fmt)
    ref_codes, ref_scales = B.quantize_blocks(x, 128, fmt)
    assert (codes[1, 128:] == 0).all()
    flagged = scales[1, 1]
    assert (flagged == B.UE8M0_NAN) if fmt == "ue8m0" else np.isnan(flagged)
    keep = np.ones_like(codes, bool)
    keep[1, 128:] = False
    assert np.array_equal(codes[keep], ref_codes[keep])
    assert np.array_equal(np.delete(scales.ravel(), 3), np.delete(ref_scales.ravel(), 3))
    assert np.isnan(B.dequantize_blocks(codes, scales, 128)[1, 128:]).all()


def test_partial_last_block_is_the_zero_padded_block():
    x = F.bf16_round(np.random.default_rng(0).standard_normal((3, 144)).astype(np.float32) * 50)
    padded = np.concatenate([x, np.zeros((3, 112), np.float32)], axis=1)
    for fmt in B.SCALE_FORMATS:
        c, s = B.quantize_blocks(x, 128, fmt)
        pc, ps = B.quantize_blocks(padded, 128, fmt)
        assert c.shape == (3, 144) and s.shape == (3, 2)
        assert np.array_equal(c, pc[:, :144]) and np.array_equal(s, ps)


def test_the_amax_element_takes_the_top_codes():
    """x = amax over every positive BF16 amax: with FP32 scales x / s is 448
    within a few ulps, always the code 448 (0x7E); a power-of-two scale puts
    it in (224, 448], codes 0x76 (224) to 0x7E. Never NaN, never above."""
    a = FINITE_BF16[(FINITE_BF16 >= B.AMAX_FLOOR)]
    x = np.zeros((a.size, 32), np.float32)
    x[:, 0] = a
    codes, _ = B.quantize_blocks(x, 32, "fp32")
    assert (codes[:, 0] == 0x7E).all()
    codes, _ = B.quantize_blocks(x, 32, "ue8m0")
    assert set(np.unique(codes[:, 0]).tolist()) == set(range(0x76, 0x7F))


def test_dequantize_reference_is_code_times_scale():
    codes = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scales = np.array([[0.5], [3.0]], np.float32)
    got = B.dequantize_blocks(codes, scales, 128)
    want = F.e4m3_decode(codes) * scales
    assert np.array_equal(got, want, equal_nan=True)
    b = np.array([[0], [127], [254], [255]], np.uint8)
    assert np.array_equal(B.ue8m0_value(b).ravel(), np.array([2.0 ** -127, 1.0, 2.0 ** 127, np.nan], np.float32),
                          equal_nan=True)


def test_round_trip_error_is_bounded_by_half_an_e4m3_step(rng, seed):
    print("seed", seed)
    x = _inputs(rng, 16, 256, "normal")
    for fmt in B.SCALE_FORMATS:
        c, s = B.quantize_blocks(x, 128, fmt)
        y = B.dequantize_blocks(c, s, 128)
        sc = np.repeat(B.ue8m0_value(s) if fmt == "ue8m0" else s, 128, axis=-1)
        # E4M3 has 3 mantissa bits: relative step 2^-3, half of it 2^-4, and
        # subnormal codes are 2^-9 apart (times the scale)
        assert (np.abs(y - x) <= np.maximum(np.abs(x) * 2.0 ** -4, sc * 2.0 ** -10) * (1 + 1e-6)).all()


# ---- the public op on CPU ----------------------------------------------------------------------
def test_cpu_op_returns_the_reference_in_each_storage():
    x = torch.from_numpy(_inputs(np.random.default_rng(1), 4, 256, "normal")).bfloat16()
    rc, rs = B.quantize_blocks(x.float().numpy(), 128, "ue8m0")
    c, s = fp8.quantize_blocks(x, scale_format="ue8m0")
    assert c.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (4, 2)
    assert np.array_equal(_u8(c), rc) and np.array_equal(_u8(s), rs)
    c32, s32 = fp8.quantize_blocks(x, scale_format="ue8m0", out=(None, torch.empty(4, 2)))
    assert np.array_equal(s32.numpy(), B.ue8m0_value(rs)) and np.array_equal(_u8(c32), rc)
    cf, sf = fp8.quantize_blocks(x)
    assert sf.dtype == torch.float32
    assert np.array_equal(sf.numpy(), B.quantize_blocks(x.float().numpy(), 128, "fp32")[1])
    n_c, n_s = fp8.quantize_blocks(x.float().numpy(), block=64)          # numpy in, numpy out
    assert n_c.dtype == np.uint8 and n_s.shape == (4, 4)
    y = fp8.dequantize_blocks(c, s, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.float(), torch.from_numpy(F.bf16_round(B.dequantize_blocks(rc, rs, 128))))


def test_cpu_empty_and_leading_dimensions():
    c, s = fp8.quantize_blocks(torch.ones(0, 3, 128))
    assert c.shape == (0, 3, 128) and s.shape == (0, 3, 1)
    c, s = fp8.quantize_blocks(torch.ones(2, 3, 64), block=32, scale_format="ue8m0")
    assert s.shape == (2, 3, 2) and (_u8(c) == 0x78).all()            # 1 / 2^-8 = 256
    assert (_u8(s) == 127 - 8).all()


ONES = torch.ones(4, 128)


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: fp8.quantize_blocks(ONES, block=96), ValueError, "^block: expected one of"),
    (lambda: fp8.quantize_blocks(ONES, block=True), TypeError, "^block: expected an int, got bool$"),
    (lambda: fp8.quantize_blocks(ONES, block=128.0), ValueError, "^block: expected one of"),
    (lambda: fp8.quantize_blocks(ONES, scale_format="e8m0"), ValueError, "^scale_format: expected one of"),
    (lambda: fp8.quantize_blocks(torch.ones(4, 24)), ValueError, "^x: the last dimension must be a multiple of 16"),
    (lambda: fp8.quantize_blocks(torch.ones(4, 128, dtype=torch.float64)), TypeError, "^x: dtype float64"),
    (lambda: fp8.quantize_blocks(torch.tensor(1.0)), ValueError, "^x: expected at least 1 dimension"),
    (lambda: fp8.quantize_blocks(ONES.t()), ValueError, "^x: must be contiguous"),
    # (a stride-0 view of 2^40 elements: named before codes and scales of its shape were allocated)
    (lambda: fp8.quantize_blocks(torch.zeros(1).expand(2 ** 40)), ValueError, "^x: must be contiguous"),
    (lambda: fp8.quantize_blocks(torch.ones(4 * 128 + 1)[1:].view(4, 128)), ValueError, "^x: data must be 16-byte"),
    (lambda: fp8.quantize_blocks(ONES, out=torch.empty(4, 128)), TypeError, "^out: expected a tuple"),
    (lambda: fp8.quantize_blocks(ONES, out=(torch.empty(4, 64, dtype=torch.uint8), None)), ValueError,
     "^codes: expected shape"),
    (lambda: fp8.quantize_blocks(ONES, out=(None, torch.empty(4, 1, dtype=torch.uint8))), TypeError,
     "^scales: dtype uint8 is not supported"),
    (lambda: fp8.quantize_blocks(ONES, scale_format="ue8m0", out=(None, torch.empty(4, 1, dtype=torch.int32))),
     TypeError, "^scales: dtype int32"),
    (lambda: fp8.quantize_blocks(ONES, out=(None, torch.empty(4, 2))), ValueError, "^scales: expected shape"),
    (lambda: fp8.quantize_blocks(ONES, out=(ONES.view(torch.uint8)[:, :128], None)), ValueError,
     "^codes: overlaps x"),
    (lambda: fp8.dequantize_blocks(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 2)), ValueError,
     "^scales: expected shape"),
    (lambda: fp8.dequantize_blocks(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 1, dtype=torch.float16)),
     TypeError, "^scales: dtype float16"),
    (lambda: fp8.dequantize_blocks(torch.zeros(4, 24, dtype=torch.uint8), torch.ones(4, 1)), ValueError,
     "^codes: the last dimension must be a multiple of 16"),
    (lambda: fp8.dequantize_blocks(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 1), dtype=torch.int8),
     TypeError, "^dtype: expected one of"),
    (lambda: fp8.dequantize_blocks(torch.zeros(4, 128, dtype=torch.uint8), torch.ones(4, 1), block=16),
     ValueError, "^block: expected one of"),
])
def test_bad_arguments_are_refused_by_name(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_dequantize_codes_the_rules_refuse_are_named_before_out_is_sized():
    """dequantize_blocks sized a new out from codes' shape before the rules
    read it: a stride-0 view of 2^34 rows allocated terabytes (an allocator
    error naming nothing) before codes was refused, and a DLPack producer
    without .shape sized an out of shape () then refused as `out`; now out
    is sized as the rules read codes (rawkv._args.out_lead), as
    quantize_blocks sizes its outputs from x."""
    from support.dlpack import Bare
    with pytest.raises(ValueError, match="^codes: must be contiguous"):
        fp8.dequantize_blocks(torch.zeros(1, 128, dtype=torch.uint8).expand(2 ** 34, 128),
                              torch.ones(1, 1).expand(2 ** 34, 1))
    c, s = fp8.quantize_blocks(ONES * 3, block=64)
    got = fp8.dequantize_blocks(Bare(c.view(torch.uint8)), s, block=64)
    assert got.shape == (4, 128) and np.array_equal(np.asarray(got), fp8.dequantize_blocks(c, s, block=64).numpy())


def test_block_may_be_a_numpy_int():
    # (np.int64(64) was refused as "block: expected one of (32, 64, 128)";
    # a NumPy bool is refused as a bool is: test_bad_arguments_are_refused_by_name)
    c, s = fp8.quantize_blocks(ONES, block=64)
    for block in (np.int64(64), np.int32(64)):
        cn, sn = fp8.quantize_blocks(ONES, block=block)
        assert sn.shape == (4, 2) and torch.equal(sn, s) and np.array_equal(_u8(cn), _u8(c))
        assert torch.equal(fp8.dequantize_blocks(cn, sn, block=block), fp8.dequantize_blocks(c, s, block=64))
    with pytest.raises(ValueError, match=r"^block: expected one of \(32, 64, 128\), got 96"):
        fp8.quantize_blocks(ONES, block=np.int64(96))
    with pytest.raises(TypeError, match="^block: expected an int, got bool$"):
        fp8.quantize_blocks(ONES, block=np.True_)


def test_refused_call_writes_nothing():
    codes = torch.full((4, 128), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^scales: expected shape"):
        fp8.quantize_blocks(ONES, out=(codes, torch.empty(4, 3)))
    assert (codes == 0xAB).all()


# ---- the launch plan as data -------------------------------------------------------------------
H100 = Device(sm_count=132, max_threads_per_sm=2048, arch="sm_90")


class _Meta:
    """A tensor as the plan sees it (dtype and element size only)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def element_size(self):
        return self.dtype.itemsize


@pytest.mark.parametrize("dtype,block,per_unit", [(torch.bfloat16, 128, 8), (torch.float32, 128, 8),
                                                  (torch.float16, 32, 2), (torch.float32, 64, 4)])
def test_plan_is_one_thread_per_16_channels_of_each_unit(dtype, block, per_unit):
    """fp8_blocks.cuh's fp8_quantize_rows: a lane holds 16 channels (one or
    more 16-byte loads), whatever the input's dtype."""
    x, c = _Meta(dtype), object()
    for rows, k in ((1, 128), (7, 144), (4096, 7168)):
        s = torch.empty(rows, -(-k // block), dtype=torch.uint8)
        plan = fp8.plan_quantize_blocks(H100, x, c, s, rows, k, block, KB.SCALE_UE8M0)
        (launch,) = plan
        units = rows * -(-k // block)
        grid, threads = launch.grid[0], launch.block[0]
        assert threads % 32 == 0 and 32 % per_unit == 0
        assert grid * threads <= max(units * per_unit, threads) + threads
        assert grid == min(-(-units * per_unit // threads), 132 * (2048 // threads) * 2)
        assert launch.kernel is KB.QUANTIZE.instance(dtype, block, *KB.SCALE_UE8M0)
        assert launch.args == dict(x=x, codes=c, scales=s, s_row=s.shape[-1], s_blk=1, rows=rows, K=k)


def test_dequantize_plan_counts_eight_codes_per_thread():
    c, s, out = object(), torch.empty(10, 5, dtype=torch.uint8), _Meta(torch.bfloat16)
    (launch,) = fp8.plan_dequantize_blocks(H100, c, s, out, 10, 160, 32)
    assert launch.grid == (-(-(10 * 160 // 8) // 256),) and launch.block == (256,)
    assert launch.kernel is KB.DEQUANTIZE.instance(torch.bfloat16, True)
    assert launch.args == dict(codes=c, scales=s, s_row=5, s_blk=1, out=out, rows=10, K=160, blk=32)


# ---- CUDA against the reference (the lead runs these on a GPU) --------------------------------
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _gpu_case(x32, dtype, block, fmt, scales_dtype=None):
    """(GPU codes, GPU scales, reference codes, reference scales) of x32
    (float32 values exact in dtype) quantized on cuda:0."""
    x = torch.from_numpy(x32).to(DTYPES[dtype]).cuda()
    out = None
    if scales_dtype is not None:
        out = (None, torch.empty((*x.shape[:-1], -(-x.shape[-1] // block)), dtype=scales_dtype, device="cuda"))
    c, s = fp8.quantize_blocks(x, block=block, scale_format=fmt, out=out)
    rc, rs = B.quantize_blocks(x.float().cpu().numpy(), block, fmt)
    if scales_dtype == torch.float32 and fmt == "ue8m0":
        rs = B.ue8m0_value(rs)
    s = s.cpu()
    return _u8(c.cpu()), (s.numpy() if s.dtype == torch.float32 else _u8(s)), rc, rs


def _same(a, b):
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("block", B.BLOCKS)
@pytest.mark.parametrize("fmt,scales_dtype", [("fp32", None), ("ue8m0", None), ("ue8m0", torch.float32)])
def test_gpu_quantize_equals_the_reference(cuda, rng, seed, dtype, block, fmt, scales_dtype):
    print("seed", seed)
    for kind in ("normal", "outliers", "bits", "ties"):
        for rows, k in ((1, 16), (3, 144), (33, 512), (257, 2064)):
            x = _inputs(rng, rows, k, kind)
            if dtype == "float16":
                x = x.astype(np.float16).astype(np.float32)
                x[~np.isfinite(x)] = 0
            elif dtype == "float32":
                x = (x * (1 + rng.random(x.shape) * 2.0 ** -9)).astype(np.float32)
            c, s, rc, rs = _gpu_case(x, dtype, block, fmt, scales_dtype)
            assert _same(c, rc) and _same(s, rs), (kind, rows, k, seed)


def _e4m3_targets():
    """Every finite E4M3 magnitude, the midpoints between neighbours (2^-10,
    between 0 and the least subnormal, included) and 464 (where satfinite's
    448 meets the next binade's first step), float64."""
    vals = np.array(sorted({float(torch.tensor(i, dtype=torch.uint8).view(torch.float8_e4m3fn).float())
                            for i in range(0, 0x7F)}))
    return np.concatenate([vals, (vals[1:] + vals[:-1]) / 2, [464.0]])


def _quotients_near_codes(rng, rows):
    """Float32 blocks of 128 whose quotients x / s lie within three float32
    ulps of an E4M3 value or rounding midpoint, for scales s across the
    range (amax from below the 1e-4 floor to FLT_MAX), with -0, subnormals and
    the amax itself in every row: the cases where a quotient computed other
    than by IEEE division could round to another code."""
    targets = _e4m3_targets()
    amax = np.minimum(np.exp2(rng.uniform(-20, 127, rows)) * (1 + rng.random(rows)), np.finfo(np.float32).max)
    amax = amax.astype(np.float32)
    s = (np.maximum(amax, np.float32(1e-4)) * np.float32(1 / 448)).astype(np.float32)
    t = targets[rng.integers(0, targets.size, (rows, 128))]
    with np.errstate(over="ignore"):                       # (past FLT_MAX: Inf, then amax below)
        x = (t * s[:, None].astype(np.float64)).astype(np.float32)
    steps = rng.integers(-3, 4, (rows, 128))               # ulps away from the target, either way
    up, down = np.float32(np.inf), np.float32(0)
    for _ in range(3):
        x = np.where(steps > 0, np.nextafter(x, up), np.where(steps < 0, np.nextafter(x, down), x))
        steps = steps - np.sign(steps)
    x = np.minimum(x, amax[:, None]) * np.where(rng.random((rows, 128)) < 0.5, -1, 1).astype(np.float32)
    x[:, 0] = amax
    x[:, 1] = -0.0
    x[:, 2] = np.float32(-1e-45)
    x[:, 3] = np.float32(3e-39)
    return x.astype(np.float32)


def test_gpu_fp32_scales_at_e4m3_rounding_edges(cuda, rng, seed):
    """FP32 scales: the kernels' quotient (Markstein's correction of a
    reciprocal, fp8_blocks.cuh) gives the IEEE division's codes where that
    matters most, next to every E4M3 value and rounding midpoint."""
    print("seed", seed)
    x = _quotients_near_codes(rng, 2048)
    c, s, rc, rs = _gpu_case(x, "float32", 128, "fp32")
    assert _same(s, rs), seed
    bad = np.argwhere(c != rc)
    assert bad.size == 0, (seed, bad[:5], x[tuple(bad[0])] if bad.size else None)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_every_bf16_value_and_the_specials(cuda, dtype):
    x = np.zeros((FINITE_BF16.size // 64, 128), np.float32)
    x[:, :64] = FINITE_BF16[: x.shape[0] * 64].reshape(-1, 64)
    x[1::2, 64] = 448.0
    x[5, 3], x[9, 100], x[13, 7], x[17] = np.nan, np.inf, -np.inf, 0.0
    x[19, :] = -0.0
    if dtype == "float16":
        x = x.astype(np.float16).astype(np.float32)
    for fmt in B.SCALE_FORMATS:
        c, s, rc, rs = _gpu_case(x, dtype, 128, fmt)
        assert _same(c, rc) and _same(s, rs), fmt


def test_gpu_equals_deepseek_v4_rule_restated(cuda, rng, seed):
    print("seed", seed)
    x = torch.from_numpy(_inputs(rng, 1024, 7168, "normal")).bfloat16()
    for fmt, scale_fmt, sdt in (("fp32", None, torch.float32), ("ue8m0", "ue8m0", torch.float8_e8m0fnu)):
        c, s = fp8.quantize_blocks(x.cuda(), scale_format=fmt)
        dc, ds = deepseek_v4_act_quant(x, 128, scale_fmt, sdt)
        assert torch.equal(c.cpu().view(torch.uint8), dc.view(torch.uint8)), seed
        assert torch.equal(s.cpu().view(torch.uint8), ds.view(torch.uint8)), seed


def test_gpu_is_bit_reproducible_and_graph_capturable(cuda, rng):
    x = torch.from_numpy(_inputs(rng, 4096, 7168, "outliers")).bfloat16().cuda()
    codes = torch.empty(4096, 7168, dtype=torch.uint8, device="cuda")
    scales = torch.empty(4096, 56, dtype=torch.uint8, device="cuda")
    fp8.quantize_blocks(x, scale_format="ue8m0", out=(codes, scales))
    first = (codes.clone(), scales.clone())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fp8.quantize_blocks(x, scale_format="ue8m0", out=(codes, scales))
    codes.fill_(0xAA)                            # (no result byte of this input everywhere: a unit
    scales.fill_(0xAA)                           # the replay skipped would show)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(codes, first[0]) and torch.equal(scales, first[1])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ue8m0", [False, True])
def test_gpu_dequantize_equals_the_reference(cuda, rng, dtype, ue8m0):
    codes = rng.integers(0, 256, (37, 272), dtype=np.uint8)
    scales = (rng.integers(100, 160, (37, 3), dtype=np.uint8) if ue8m0
              else (rng.standard_normal((37, 3)) * 10).astype(np.float32))
    if ue8m0:
        scales[0, 0], scales[1, 1], scales[2, 2] = 0, 255, 254
    got = fp8.dequantize_blocks(torch.from_numpy(codes).cuda(), torch.from_numpy(scales).cuda(), block=128,
                                dtype=DTYPES[dtype]).float().cpu().numpy()
    want = F.round_to_dtype(B.dequantize_blocks(codes, scales, 128), dtype)
    if dtype == "float16":
        want = want.astype(np.float32)
    assert np.array_equal(got, want, equal_nan=True)


# ---- the operator ------------------------------------------------------------------------------
def test_operator_writes_what_the_public_op_returns(rng):
    import rawkv.library  # noqa: F401
    x = torch.from_numpy(_inputs(rng, 3, 256, "normal"))
    codes, scales = torch.empty(3, 256, dtype=torch.uint8), torch.empty(3, 2, dtype=torch.uint8)
    torch.ops.rawkv.fp8_quantize_blocks(x, 128, "ue8m0", codes, scales)
    c, s = fp8.quantize_blocks(x, scale_format="ue8m0")
    assert torch.equal(codes, c.view(torch.uint8)) and torch.equal(scales, s.view(torch.uint8))


def test_an_e8m0_out_scales_reaches_the_operator_as_bytes(monkeypatch):
    # torch.compile's inductor cannot functionalize an operator taking a
    # float8_e8m0fnu tensor (rawkv.fp8.e8m0_bytes): quantize_blocks passes a
    # caller's float8_e8m0fnu out.scales as its uint8 bytes, as the fused
    # producers do, and returns the buffer it was given
    seen = []
    real = rawkv.fp8._quantize_blocks
    monkeypatch.setattr(rawkv.fp8, "_quantize_blocks",
                        lambda x, block, fmt, codes, scales, stream: seen.append(scales.dtype)
                        or real(x, block, fmt, codes, scales, stream))
    x = torch.randn(4, 128)
    buf = torch.empty(4, 1, dtype=torch.float8_e8m0fnu)
    codes, scales = rawkv.fp8.quantize_blocks(x, scale_format="ue8m0", out=(None, buf))
    want = rawkv.fp8.quantize_blocks(x, scale_format="ue8m0")
    assert seen == [torch.uint8, torch.uint8] and scales is buf
    assert torch.equal(scales.view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8))
    # for FP32 scales the same buffer is refused naming its own dtype, not the bytes the operator sees
    with pytest.raises(TypeError, match="^scales: dtype float8_e8m0fnu is not supported for scale_format 'fp32'"):
        rawkv.fp8.quantize_blocks(x, out=(None, buf))


# Grids far smaller than the work: every lane's grid-stride loop takes many
# steps, so the (row, block) / (row, column) stepping and its carry into the
# next row run on every shape (at the ops' own grids the GPU tests above take
# one pass: their grids cover the work).
SMALL_GRIDS = [Device(sm_count=1, max_threads_per_sm=256), Device(sm_count=1, max_threads_per_sm=512),
               Device(sm_count=3, max_threads_per_sm=256)]


@pytest.mark.parametrize("dev", SMALL_GRIDS, ids=["grid2", "grid4", "grid6"])
@pytest.mark.parametrize("block", B.BLOCKS)
def test_gpu_small_grids_quantize_and_dequantize_every_unit_once(cuda, rng, seed, dev, block):
    """Outputs filled with a byte no result has first (0xAA: a code of
    -0.0625 only where the reference writes it), so a unit skipped or
    written twice elsewhere shows."""
    print("seed", seed)
    run = rawkv.get_runtime().run
    for rows, k, dtype in ((37, 2064, "bfloat16"), (29, 1040, "float32"), (130, 7168, "float16")):
        x32 = _inputs(rng, rows, k, "outliers")
        if dtype == "float16":
            x32 = x32.astype(np.float16).astype(np.float32)
            x32[~np.isfinite(x32)] = 0
        x = torch.from_numpy(x32).to(DTYPES[dtype]).cuda()
        nb = -(-k // block)
        for fmt, kind in (("ue8m0", KB.SCALE_UE8M0), ("fp32", KB.SCALE_FP32)):
            codes = torch.full((rows, k), 0xAA, dtype=torch.uint8, device="cuda")
            scales = (torch.full((rows, nb), 0xAA, dtype=torch.uint8, device="cuda") if fmt == "ue8m0"
                      else torch.full((rows, nb), -7.0, device="cuda"))
            (launch,) = fp8.plan_quantize_blocks(dev, x, codes, scales, rows, k, block, kind)
            assert launch.grid[0] * launch.block[0] < KB.quantize_threads(rows, k, block)
            run([launch])
            rc, rs = B.quantize_blocks(x.float().cpu().numpy(), block, fmt)
            s = scales.cpu()
            assert _same(_u8(codes.cpu()), rc), (rows, k, dtype, fmt, seed)
            assert _same(s.numpy() if fmt == "fp32" else _u8(s), rs), (rows, k, dtype, fmt, seed)
            out = torch.full((rows, k), float("nan"), dtype=torch.bfloat16, device="cuda")
            (launch,) = fp8.plan_dequantize_blocks(dev, codes, scales, out, rows, k, block)
            assert launch.grid[0] * launch.block[0] < rows * k // KB.DEQUANTIZE_UNIT
            run([launch])
            want = F.round_to_dtype(B.dequantize_blocks(rc, rs, block), "bfloat16")
            assert np.array_equal(out.float().cpu().numpy(), want, equal_nan=True), (rows, k, dtype, fmt, seed)


def test_the_lane_width_is_the_kernels():
    """rawkv.kernels.fp8_blocks.QUANTIZE_LANE (the plans' threads per unit)
    is the channels per lane fp8_blocks.cuh's loop and fp8_blocks.cu's
    instance assert use."""
    import pathlib
    import re
    cu = pathlib.Path(fp8.__file__).parent / "cu"
    cuh, src = (cu / "fp8_blocks.cuh").read_text(), (cu / "fp8_blocks.cu").read_text()
    assert re.findall(r"const int tpb = block / (\d+);", cuh) == [str(KB.QUANTIZE_LANE)]
    assert re.findall(r"constexpr int V = (\d+) / N;", cuh) == [str(KB.QUANTIZE_LANE)]
    assert re.findall(r"constexpr int TPB = BLOCK / (\d+);", src) == [str(KB.QUANTIZE_LANE)]
