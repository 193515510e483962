"""The grouped FP4 GEMM kernel (rawkv/cu/gemm_fp4.cu) against the reference.

Error bound (what FP32 accumulation in any order plus the roundings can
give). Each product w_k * x_k is exact in FP32 (a BF16/FP16 activation times
a dequantized FP4 weight, e2m1 * scale * 2^-9, has at most 8 + 6 significant
bits), so the only errors are:
  * the FP32 sum of K products in any order (and any blocking across warps):
    |s_hat - s| <= (K - 1) * u * sum |w_k x_k| with u = 2^-24 for round-to-
    nearest adds; tensor cores may truncate instead of rounding, so u = 2^-23;
  * the epilogue's multiply by the global scales: one more rounding, u |s|;
  * the final BF16 rounding (8 significant bits, round to nearest): at
    most 2^-8 relative.
So |out - ref| <= 2^-8 |ref| + (1 + 2^-8) * (K + 1) * 2^-23 * S, with
S = gs * sum |w_k x_k| (float64). `assert_within_bound` checks exactly that.
"""
import numpy as np
import pytest

import rawkv
from rawkv.reference import gemm as ref
from rawkv.reference import formats as F

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def assert_within_bound(got, exact, absolute, k, what=""):
    got = got.double().cpu().numpy()
    tol = 2.0 ** -8 * np.abs(exact) + (1 + 2.0 ** -8) * (k + 1) * 2.0 ** -23 * absolute
    nan_ref = np.isnan(exact)
    assert np.array_equal(np.isnan(got), nan_ref), f"{what}: NaN positions differ"
    finite = np.isfinite(exact)
    assert np.array_equal(np.isinf(got) & ~nan_ref, np.isinf(exact)), f"{what}: Inf positions differ"
    err = np.abs(got - exact)[finite]
    bad = err > tol[finite]
    assert not bad.any(), (f"{what}: {bad.sum()} outputs past the bound, worst err/tol "
                           f"{np.max(err / np.maximum(tol[finite], 1e-300)):.3g}")


def random_weight(rng, g, n, k, fmt, device="cuda"):
    """Fp4Weight from random checkpoint bytes (codes, block scales, gs), and
    its exact float64 values."""
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    if fmt == "nvfp4":
        scales = rng.integers(0x01, 0x7E, (g, n, k // 16), dtype=np.uint8)   # finite E4M3, subnormals too
        gs = (rng.random(g) * 0.01 + 1e-3).astype(np.float32)
        w = rawkv.gemm.Fp4Weight.from_nvfp4(torch.from_numpy(codes), torch.from_numpy(scales),
                                            torch.from_numpy(gs), groups=g)
    else:
        scales = rng.integers(113, 138, (g, n, k // 32), dtype=np.uint8)
        gs = np.ones(g, np.float32)
        w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), groups=g)
    return w.to(device), ref.dequantize_weight(codes, scales, gs, fmt)


def exact_grouped(x64, w64):
    return ref.grouped(x64, w64), ref.grouped(np.abs(x64), np.abs(w64))


@pytest.mark.parametrize("fmt,k", [("nvfp4", 208), ("nvfp4", 4096), ("mxfp4", 224)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64, 200])
def test_batched_within_the_fp32_bound(cuda, rng, fmt, k, dtype, tokens):
    # K = 208 / 224: not a multiple of the kernel's 64-column chunk; N = 72:
    # not a multiple of 16 or 64.
    g, n = (3, 72) if k < 1024 else (2, 40)
    w, w64 = random_weight(rng, g, n, k, fmt)
    x = torch.from_numpy(rng.standard_normal((tokens, g, k)).astype(np.float32)).to(getattr(torch, dtype))
    exact, absolute = exact_grouped(x.double().numpy(), w64)
    out = rawkv.gemm.grouped_linear(x.cuda(), w)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, g, n)
    assert_within_bound(out, exact, absolute, k, f"{fmt} {dtype} T={tokens}")


def test_4096_tokens(cuda, rng):
    g, n, k = 2, 96, 256
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(4096, g, k, dtype=torch.bfloat16)
    exact, absolute = exact_grouped(x.double().numpy(), w64)
    assert_within_bound(rawkv.gemm.grouped_linear(x.cuda(), w), exact, absolute, k, "T=4096")


def test_weights_from_float_match_their_dequantization(cuda, rng):
    g, n, k = 2, 64, 512
    wf = torch.from_numpy(rng.standard_normal((g, n, k)).astype(np.float32)).cuda()
    w = rawkv.gemm.Fp4Weight.from_float(wf)
    codes, scales, gs = (t.cpu().numpy() for t in w.unpack())
    w64 = ref.dequantize_weight(codes, scales, gs, "nvfp4")
    x = torch.randn(5, g, k, dtype=torch.bfloat16)
    exact, absolute = exact_grouped(x.double().numpy(), w64)
    assert_within_bound(rawkv.gemm.grouped_linear(x.cuda(), w), exact, absolute, k, "from_float")


def _nvfp4_activation(rng, lead, k, gs):
    codes = rng.integers(0, 16, (*lead, k), dtype=np.uint8)
    q = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    sf = rng.integers(0x10, 0x60, (*lead, k // 16), dtype=np.uint8)
    exact = F.e2m1_decode(codes).astype(np.float64) * np.repeat(F.e4m3_decode(sf).astype(np.float64), 16, -1)
    qa = rawkv.nvfp4.QuantizedActivation(torch.from_numpy(q).cuda(), torch.from_numpy(sf).cuda(), gs)
    return qa, exact


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 9, 40, 130])
def test_nvfp4_activations_equal_the_bf16_gemm_of_their_exact_values(cuda, rng, fmt, tokens):
    check_nvfp4_activations_equal_bf16(rng, fmt, tokens)


def check_nvfp4_activations_equal_bf16(rng, fmt, tokens):
    """e2m1 * E4M3 is exact in BF16, so with gs = 1 the NVFP4 path must give
    the BF16 path's bits on the dequantized activations (same tiles, same
    summation order), on whichever kernel the caller forced."""
    g, n, k = 2, 72, 224
    w, _ = random_weight(rng, g, n, k, fmt)
    qa, exact_x = _nvfp4_activation(rng, (tokens, g), k, torch.ones((), device="cuda"))
    a = rawkv.gemm.grouped_linear(qa, w)
    b = rawkv.gemm.grouped_linear(torch.from_numpy(exact_x).to(torch.bfloat16).cuda(), w)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("per_row", [False, True])
def test_nvfp4_activation_global_scales(cuda, rng, per_row):
    g, n, k, tokens = 3, 40, 160, 11
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    gs = (rng.random((tokens, g)) + 0.5).astype(np.float32) if per_row else np.float32(0.37)
    qa, xv = _nvfp4_activation(rng, (tokens, g), k, torch.tensor(gs, device="cuda"))
    x64 = xv * (gs[..., None] if per_row else np.float64(gs))
    exact, absolute = exact_grouped(x64, w64)
    assert_within_bound(rawkv.gemm.grouped_linear(qa, w), exact, absolute, k, "nvfp4 act")


def test_nan_and_inf_inputs(cuda, rng):
    check_nan_and_inf(rng, tokens=6, late=2)


def check_nan_and_inf(rng, tokens, late):
    """NaN and Inf activations (rows 0, 1 and `late`) give NaN / Inf where
    the reference does, and the bound elsewhere."""
    g, n, k = 2, 48, 128
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(tokens, g, k, dtype=torch.bfloat16)
    x[0, 0, 5] = float("nan")
    x[1, 1, 7] = float("inf")
    x[late, 0, 3] = float("-inf")
    x[late, 0, 9] = float("inf")          # Inf - Inf somewhere: NaN
    exact, absolute = exact_grouped(x.double().numpy(), w64)
    assert_within_bound(rawkv.gemm.grouped_linear(x.cuda(), w), exact, np.nan_to_num(absolute), k, "nan/inf")


def test_views_and_out(cuda, rng):
    check_views_and_out(rng, tokens=7)


def check_views_and_out(rng, tokens):
    """Strided, misaligned and shifted activation views, and an out= view
    whose neighbours stay untouched."""
    g, n, k = 3, 56, 192
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    base = torch.randn(g, tokens, k + 8, dtype=torch.bfloat16).cuda()
    x = base[:, :, :k].transpose(0, 1)               # (T, G, K), strided, rows aligned
    odd = torch.randn(tokens, g, k + 1, dtype=torch.bfloat16).cuda()[:, :, 1:]   # rows not aligned
    # contiguous but starting 2 bytes past an aligned address
    shifted = torch.randn(tokens * g * k + 1, dtype=torch.bfloat16).cuda()[1:].view(tokens, g, k)
    out_base = torch.zeros(tokens, g, n + 5, dtype=torch.bfloat16, device="cuda")
    for xi in (x, odd, shifted):
        exact, absolute = exact_grouped(xi.double().cpu().numpy(), w64)
        out = out_base[:, :, 2:2 + n]
        res = rawkv.gemm.grouped_linear(xi, w, out=out)
        assert res.data_ptr() == out.data_ptr()
        assert_within_bound(out, exact, absolute, k, "view")
        assert torch.count_nonzero(out_base[:, :, :2]) == 0 and torch.count_nonzero(out_base[:, :, 2 + n:]) == 0


@pytest.mark.parametrize("offsets", [[0, 3, 3, 10, 30, 37], [0, 0, 0, 0, 0, 37], [0, 37, 37, 37, 37, 37],
                                     [2, 3, 1, 10, 50, 30], [-4, 5, 5, 5, 20, 33]])
@pytest.mark.parametrize("act", ["bfloat16", "nvfp4"])
def test_ragged_experts(cuda, rng, offsets, act):
    check_ragged(rng, offsets, act, n=72, k=208, rows=37)


def check_ragged(rng, offsets, act, n, k, rows):
    """moe_linear over len(offsets) - 1 NVFP4 experts within the bound of the
    reference, and the clamps counted."""
    w, w64 = random_weight(rng, len(offsets) - 1, n, k, "nvfp4")
    if act == "nvfp4":
        x, x64 = _nvfp4_activation(rng, (rows,), k, torch.ones((), device="cuda"))
    else:
        xt = torch.randn(rows, k, dtype=torch.bfloat16)
        x, x64 = xt.cuda(), xt.double().numpy()
    exact, bad = ref.ragged(x64, w64, offsets)
    absolute, _ = ref.ragged(np.abs(x64), np.abs(w64), offsets)
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.moe_linear(x, w, torch.tensor(offsets, dtype=torch.int32, device="cuda"), out=out, errors=errors)
    assert_within_bound(out, exact, absolute, k, f"ragged {offsets}")
    assert int(errors[0]) == bad


@pytest.mark.parametrize("offsets", [[0, 3, 3, 10, 30, 37], [0, 1, 2, 4, 5, 6, 9], [-4, 5, 5, 5, 20, 33],
                                     [0, 16, 16, 40, 41, 80], [0, 30, 31, 90, 91, 150]])
@pytest.mark.parametrize("act", ["bfloat16", "nvfp4"])
def test_ragged_tiles(cuda, rng, offsets, act, monkeypatch):
    # The ragged tiles (one warp streams all of K: RAGGED_CONFIGS, 8 to 32
    # tokens per expert) serve only grids of hundreds of blocks; forced here
    # at a small size, with K past a chunk boundary and N past a block's.
    from rawkv.gemm import linear
    monkeypatch.setattr(linear, "MMA_RAGGED_MIN_BLOCKS", 0)
    monkeypatch.setattr(linear, "SM90_MIN_EXPERT_TOKENS", 1 << 30)
    check_ragged(rng, offsets, act, n=200, k=336, rows=max(offsets))


def test_ragged_tiles_same_bits_every_run(cuda, rng, monkeypatch):
    from rawkv.gemm import linear
    monkeypatch.setattr(linear, "MMA_RAGGED_MIN_BLOCKS", 0)
    w, _ = random_weight(rng, 4, 136, 1040, "nvfp4")
    x = torch.randn(70, 1040, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([0, 9, 30, 31, 70], dtype=torch.int32, device="cuda")
    a, b = rawkv.gemm.moe_linear(x, w, offs), rawkv.gemm.moe_linear(x, w, offs)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_ragged_many_experts_and_the_default_counter(cuda, rng):
    e, n, k = 256, 32, 64
    counts = rng.integers(0, 4, e)
    counts[rng.choice(e, 40, replace=False)] = 0                 # empty experts
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(offsets[-1])
    w, w64 = random_weight(rng, e, n, k, "mxfp4")
    xt = torch.randn(rows, k, dtype=torch.bfloat16)
    exact, _ = ref.ragged(xt.double().numpy(), w64, offsets)
    absolute, _ = ref.ragged(np.abs(xt.double().numpy()), np.abs(w64), offsets)
    assert_within_bound(rawkv.gemm.moe_linear(xt.cuda(), w, torch.from_numpy(offsets).cuda()),
                        exact, absolute, k, "256 experts")
    counter = rawkv.nvfp4.error_counts()
    before = int(counter[rawkv.nvfp4.GEMM_OFFSETS])
    bad = offsets.copy()
    bad[3] = rows + 50
    rawkv.gemm.moe_linear(xt.cuda(), w, torch.from_numpy(bad).cuda())
    _, nbad = ref.clamp_offsets(bad, rows)
    assert int(counter[rawkv.nvfp4.GEMM_OFFSETS]) - before == nbad


def test_layer_in_a_cuda_graph(cuda, rng):
    g, n, k = 4, 64, 256
    wf = torch.randn(g, n, k).cuda()
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=8).set_weight(wf)
    x = torch.randn(3, g, k, dtype=torch.bfloat16, device="cuda")
    first = layer(x).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            y = layer(x)
    x.copy_(torch.randn(3, g, k, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, layer(x))
    assert not torch.equal(y, first)


def test_layer_checkpoint_equals_set_weight(cuda, rng):
    g, n, k = 2, 48, 128
    wf = torch.randn(g, n, k)
    a = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=4).set_weight(wf.cuda())
    codes, scales, gs = a.weight.unpack()
    b = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=4).load_nvfp4(
        codes.reshape(g * n, k // 2).cpu(), scales.reshape(g * n, k // 16).cpu(), gs.cpu())
    x = torch.randn(4, g, k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(a(x), b(x))


def test_bad_arguments_are_refused_as_on_cpu(cuda, rng):
    # issue 21 item 5: tests/gemm/test_linear.py's table of refused arguments,
    # on CUDA tensors: the same exception and message prefix as on CPU.
    from gemm.test_linear import check_bad_argument_cases
    check_bad_argument_cases(rng, "cuda")
    w, _ = random_weight(rng, 3, 16, 64, "nvfp4")
    xm = torch.randn(2, 64, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    for call, msg in ((lambda: rawkv.gemm.moe_linear(xm, w, offs), "offsets: is on cpu"),
                      (lambda: rawkv.gemm.moe_linear(xm, w, offs.cuda(), errors=torch.zeros(1, dtype=torch.int32)),
                       "errors: is on cpu"),
                      (lambda: rawkv.gemm.moe_linear(xm, w, offs.cuda(), out=torch.empty(2, 16, dtype=torch.bfloat16)),
                       "out: is on cpu"),
                      (lambda: rawkv.gemm.moe_linear(xm.cpu().float().numpy(), w, offs.numpy()), "weight: is on cuda")):
        with pytest.raises(ValueError, match="^" + msg):
            call()


def test_loaders_check_cuda_scales(cuda, rng):
    # issue 21 items 1 and 6 on CUDA tensors: a bad global scale read back
    # from the device, a scale on another device, a device that does not exist.
    g, n, k = 2, 16, 64
    codes = torch.from_numpy(rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)).cuda()
    scales = torch.from_numpy(rng.integers(0x10, 0x60, (g * n, k // 16), dtype=np.uint8)).cuda()
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="^weight_scale_2:.*finite positive"):
            rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, torch.tensor([0.5, bad], device="cuda"), groups=g)
    with pytest.raises(ValueError, match="^weight_scale_2: is on cpu"):
        rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, torch.tensor([0.5, 0.25]), groups=g)
    bad_sf = scales.clone()
    bad_sf[0, 0] = 0x7F
    with pytest.raises(ValueError, match="^weight_scale:.*0x7f"):
        rawkv.gemm.Fp4Weight.from_nvfp4(codes, bad_sf, 0.5, groups=g)
    w = rawkv.gemm.Fp4Weight.from_nvfp4(codes, scales, 0.5, groups=g)
    missing = torch.cuda.device_count()
    with pytest.raises(ValueError, match="^device"):
        w.to(f"cuda:{missing}")
    with pytest.raises(ValueError, match="^device"):
        rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=2, device=missing)
    assert w.to("cpu").to(0).device == torch.device("cuda", 0)
