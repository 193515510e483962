"""rawkv.gemm.grouped_linear: a batch of tokens through every group's FP4 weight
(rawkv/gemm/linear.py, rawkv/cu/gemm_fp4.cu). On CPU tensors the reference,
exactly (BF16 / numpy / NVFP4 activations); its own argument errors (the rules
shared with moe_linear: tests/gemm/test_arguments.py); the dispatch rule and the
wgmma tile chosen; the mma.sync kernel within the FP32 bound of
tests/support/gemm.py (the wgmma kernel: tests/gemm/test_linear_sm90.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
import rawkv  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv._plan import Device  # noqa: E402
from rawkv.gemm import linear, plans  # noqa: E402
from rawkv.reference import gemm as ref  # noqa: E402
from rawkv.reference import formats as RF  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
from support.gemm import (  # noqa: E402
    _Sizes, assert_within_bound, _bf16, _bits, _cached_weight, check_nan_and_inf,
    check_nvfp4_activations_equal_bf16, check_views_and_out, _exact, exact_grouped, _f32_bits,
    _nvfp4_activation, random_weight, _weight,
)
from support.properties import SETTINGS, host, judge, layouts, libs, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference: CPU tensors run it, exactly
# ---------------------------------------------------------------------------
def test_cpu_grouped_is_the_reference_rounded_once(rng):
    w = _weight(rng, 3, 40, 96)
    x = torch.randn(5, 3, 96).bfloat16()
    want = ref.round_to_bf16(ref.grouped(x.double().numpy(), _exact(w)))
    assert np.array_equal(_bits(rawkv.gemm.grouped_linear(x, w)), want)
    out = torch.empty(5, 3, 40, dtype=torch.bfloat16)
    assert rawkv.gemm.grouped_linear(x, w, out=out) is out
    assert np.array_equal(_bits(out), want)


def test_cpu_nvfp4_activation_is_its_exact_value(rng):
    w = _weight(rng, 2, 24, 64)
    x = torch.randn(4, 2, 64)
    qa = rawkv.nvfp4.QuantizedActivation(*rawkv.nvfp4.quantize(x, scope="given", gs=0.25))
    xv = qa.dequantize(torch.float32).double().numpy()        # e2m1 * sf * 2^-2: exact in float32
    want = ref.round_to_bf16(ref.grouped(xv, _exact(w)))
    assert np.array_equal(_bits(rawkv.gemm.grouped_linear(qa, w)), want)


def test_numpy_activations_run_the_reference(rng):
    # docs/gemm.md "Arguments": numpy arrays run the reference like CPU
    # tensors (they crashed: 'numpy.ndarray' object has no attribute 'dim').
    # numpy has no bfloat16: a float32 array holding BF16 values stands for
    # one, and the result is such an array.
    w = _weight(rng, 3, 40, 96)
    xt = torch.randn(5, 3, 96).bfloat16()
    want = _bits(rawkv.gemm.grouped_linear(xt, w))
    x32 = xt.float().numpy()
    got = rawkv.gemm.grouped_linear(x32, w)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (5, 3, 40)
    assert np.array_equal(_f32_bits(got), want)
    out = np.full((5, 3, 40), np.nan, np.float32)
    assert rawkv.gemm.grouped_linear(x32, w, out=out) is out and np.array_equal(_f32_bits(out), want)
    tout = torch.empty(5, 3, 40, dtype=torch.bfloat16)
    assert rawkv.gemm.grouped_linear(x32, w, out=tout) is tout and np.array_equal(_bits(tout), want)
    x16 = x32.astype(np.float16)
    assert np.array_equal(_f32_bits(rawkv.gemm.grouped_linear(x16, w)),
                          _bits(rawkv.gemm.grouped_linear(torch.from_numpy(x16), w)))
    bad = x32.copy()
    bad[1, 2, 3] = 0.1                              # not a BF16 value
    with pytest.raises(ValueError, match=r"^x: .*BF16 values; x\[1, 2, 3\]"):
        rawkv.gemm.grouped_linear(bad, w)
    with pytest.raises(TypeError, match=r"^x: dtype float64"):
        rawkv.gemm.grouped_linear(x32.astype(np.float64), w)
    with pytest.raises(TypeError, match=r"^out: dtype float64"):
        rawkv.gemm.grouped_linear(x32, w, out=np.empty((5, 3, 40)))


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("make,name", [
    (lambda x: x.float(), "x"),                                  # float32 is refused on CPU as on CUDA
    (lambda x: x[..., :32], "x"),                                # K mismatch
    (lambda x: x[:, :2], "x"),                                   # groups mismatch
    (lambda x: x[0], "x"),                                       # wrong rank
    (lambda x: 3.0, "x"),
])
def test_bad_activations_name_the_argument(rng, make, name):
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises((TypeError, ValueError), match=rf"^{name}"):
        rawkv.gemm.grouped_linear(make(x), w)


def test_nvfp4_activation_parts_are_checked(rng):
    w = _weight(rng, 3, 16, 64)
    q, sf, gs = rawkv.nvfp4.quantize(torch.randn(2, 3, 64), scope="row")
    with pytest.raises(TypeError, match=r"^x.q"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q.view(torch.uint8).float(), sf, gs), w)
    with pytest.raises(ValueError, match=r"^x.sf"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q, sf[..., :2], gs), w)
    with pytest.raises(ValueError, match=r"^x.gs"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q, sf, gs[:1]), w)


# ---------------------------------------------------------------------------
# properties (hypothesis): the reference's bits or a refusal naming the argument
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, t=st.integers(0, 3), g=st.sampled_from([2, 2, 1]), k_delta=st.sampled_from([0, 0, 16, -32]),
       xdt=st.sampled_from(("bfloat16", "float16", "float32")), layout=layouts, special=st.booleans())
def test_gemm_grouped_linear(seed, t, g, k_delta, xdt, layout, special):
    # numpy activations and wrong-typed weights crash today: test_gemm_known_crashes
    w = _cached_weight(2, 16, 64)
    x = make(seed, (t, g, 64 + k_delta), xdt, "torch", layout, special)
    judge(lambda: rawkv.gemm.grouped_linear(x, w), ("x", "weight", "out"),
          lambda: _bf16(ref.round_to_bf16(ref.grouped(host(x).astype(np.float64), _exact(w)))))


def _quantized_values(q, sf, gs) -> np.ndarray:
    """An NVFP4 activation's values as float64, exactly: e2m1[q] * sf * gs
    (gs one value, or one per row)."""
    v = RF.e2m1_decode(RN.unpack_nibbles(q)).astype(np.float64)
    v = v * np.repeat(RF.e4m3_decode(sf).astype(np.float64), 16, axis=-1)
    gs = np.asarray(gs, np.float64)
    return v * (gs if gs.ndim == 0 else gs[..., None])


@SETTINGS
@given(seed=seeds, lib=libs, weight=st.sampled_from(["fp4", "fp4", None, "tensor"]),
       xdt=st.sampled_from(["float16", "float32", "bfloat16", "float64"]), bf16_values=st.booleans(),
       quantized=st.sampled_from([None, None, "tensor", "row"]), special=st.booleans())
def test_gemm_any_activation_and_weight(seed, lib, weight, xdt, bf16_values, quantized, special):
    """numpy activations (a float32 one stands for BF16 and must hold BF16
    values), QuantizedActivations of numpy arrays or CPU tensors, and
    weights that are not Fp4Weights (issue 21 item 5: AttributeErrors)."""
    w = {"fp4": _cached_weight(2, 16, 64), None: None, "tensor": torch.ones(2, 16, 64)}[weight]
    x = make(seed, (2, 2, 64), xdt, lib, special=special)
    if bf16_values and xdt == "float32":        # low 16 bits cleared: BF16 values
        (x.view(np.int32) if lib == "numpy" else x.view(torch.int32))[...] &= -65536
    if quantized is not None:
        q, sf, g = RN.quantize(host(x).astype(np.float32), quantized)
        conv = (lambda a: a) if lib == "numpy" else torch.from_numpy
        x = rawkv.nvfp4.QuantizedActivation(conv(q), conv(sf), conv(np.ascontiguousarray(g)))

    def reference():
        v = _quantized_values(host(x.q), host(x.sf), host(x.gs)) if quantized else host(x).astype(np.float64)
        return _bf16(ref.round_to_bf16(ref.grouped(v, _exact(w))))
    judge(lambda: rawkv.gemm.grouped_linear(x, w), ("x", "weight"), reference)


# ---------------------------------------------------------------------------
# plan: which kernel and tile (arithmetic on the sizes, no GPU)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("groups,n,tokens,expected", [
    (8, 1024, 127, False), (8, 1024, 128, False),     # Flash wo_a at 128 tokens: 32 blocks
    (16, 1024, 128, True), (8, 1536, 128, True),      # Pro (64 blocks), seed 004 (48)
    (1, 16, 255, False), (1, 16, 256, True)])
def test_the_batched_dispatch_rule(groups, n, tokens, expected):
    """Which kernel an sm_90 device runs: arithmetic on the sizes, no GPU
    needed (docs/gemm.md), with the tunables rawkv.gemm.linear holds."""
    assert plans.takes_sm90(_Sizes(groups, n), tokens, False, linear) is expected


H100 = Device(sm_count=132, max_threads_per_sm=2048, arch="sm_90")


@pytest.mark.parametrize("groups,n,k,tokens,tile", [
    # (groups, n, k, tokens): (BN, BM, splits) or "mma", from the H200 sweep
    # of 2026-11-26 (docs/gemm.md, "Dispatch"): the best measured tile in
    # every case, and the mma.sync kernel below 48 tokens
    (8, 1024, 4096, 32, "mma"),
    # Flash at 48 and 64 tokens: 128 x 128 split in two (128 blocks) fills the SMs where 256 x 64
    # split in two (64 blocks) leaves half of them idle (H100, 2026-11-27, us: 20.2-20.8 against
    # 24.2-25.2); Pro and seed 004 keep 256 x 64 split in two (H100, the same run: Pro at 48
    # and 64 tokens 25.8-26.7 against 40.3-41.0 on 128 x 128 split in two; seed 004 42.1-42.5
    # against 62.1-62.9)
    (8, 1024, 4096, 48, (128, 128, 2)),
    (8, 1024, 4096, 64, (128, 128, 2)),
    (16, 1024, 4096, 48, (64, 256, 2)),
    (16, 1024, 4096, 64, (64, 256, 2)),       # Pro: 64 blocks of 256 x 64 -> 128 half-K blocks
    (8, 1536, 8192, 48, (64, 256, 2)),
    (8, 1536, 8192, 64, (64, 256, 2)),        # seed 004: 48 -> 96
    (8, 1024, 4096, 96, (128, 128, 2)),       # 64 blocks of 128 x 128 -> 128
    (16, 1024, 4096, 128, (128, 256, 2)),     # Pro: 64 blocks of 256 x 128 -> 128
    (8, 1024, 4096, 256, (128, 256, 2)),
    (8, 1536, 8192, 256, (128, 256, 1)),      # 96 blocks: split, 192 would end in a thin second wave
    (8, 1536, 8192, 512, (128, 256, 2)),      # 192 blocks (1.45 waves) -> 384 (2.9)
    (8, 1024, 4096, 512, (128, 256, 1)),      # 128 blocks: one wave already
    (8, 1024, 1024, 256, (128, 128, 1)),      # K = 1024: too few chunks to split; 128-feature blocks instead
    (8, 1024, 4096, 4096, (128, 256, 1))])
def test_the_wgmma_tile_is_the_modelled_fastest(groups, n, k, tokens, tile):
    t = plans.tile(H100, _Sizes(groups, n, k), tokens, tuning=linear)
    if tile == "mma":
        assert t.kernel is plans.K.GEMM
        return
    assert (t.tokens, t.rows, t.splits) == tile
    assert t.kernel is (plans.K.GEMM_SM90_SPLITK if tile[2] > 1 else plans.K.GEMM_SM90)
    assert t.targs[2] == t.rows and t.targs[0] == t.tokens


def test_a_forced_token_tile_is_kept(monkeypatch):
    # Flash at 64 tokens takes 128 x 128 tiles unforced; SM90_FORCE_BN = 64
    # keeps the 64-token tile (tests compare the bits of every token tile)
    w = _Sizes(8, 1024, 4096)
    assert (plans.tile(H100, w, 64, tuning=linear).tokens, plans.tile(H100, w, 64, tuning=linear).rows) == (128, 128)
    for bn in (64, 128):
        monkeypatch.setattr(linear, "SM90_FORCE_BN", bn)
        assert plans.tile(H100, w, 64, tuning=linear).tokens == bn
        assert plans.tile(H100, w, 64, ragged=True, tuning=linear).tokens == bn
    monkeypatch.setattr(linear, "SM90_FORCE_BM", 128)      # (128-feature blocks have 128-token tiles only)
    assert plans.tile(H100, w, 64, tuning=linear).tokens == 128


def test_the_tunables_set_on_linear_steer_the_plan(monkeypatch):
    # tests/gemm/test_linear_sm90.py and tools/probe_gemm_paths.py set them there
    w = _Sizes(8, 1024)
    assert plans.tile(H100, w, 16, tuning=linear).kernel is plans.K.GEMM
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    monkeypatch.setattr(linear, "SM90_FORCE_BM", 256)
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", 1)
    t = plans.tile(H100, w, 16, tuning=linear)
    assert t.kernel is plans.K.GEMM_SM90 and t.rows == 256 and t.tokens == 64
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", 2)
    t = plans.tile(H100, w, 16, tuning=linear)
    assert t.kernel is plans.K.GEMM_SM90_SPLITK and t.splits == 2 and t.targs == (64, 6, 256, 2)
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", None)
    monkeypatch.setattr(linear, "SM90_FORCE_BN", 128)
    assert plans.tile(H100, w, 16, tuning=linear).tokens == 128
    monkeypatch.setattr(linear, "SM90_MIN_EXPERT_TOKENS", 4)
    monkeypatch.setattr(linear, "KERNEL_PATH", "auto")
    assert plans.takes_sm90(w, 4, True, linear) and not plans.takes_sm90(w, 4, True)


# ---------------------------------------------------------------------------
# GPU: the mma.sync kernel within the FP32 bound (tests/support/gemm.py)
# ---------------------------------------------------------------------------
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


@pytest.mark.parametrize("tokens,dtype", [(9, "bfloat16"), (16, "float16"), (17, "bfloat16"), (32, "bfloat16")])
def test_prefetch_gives_the_same_bits(cuda, rng, monkeypatch, tokens, dtype):
    # the mma.sync kernel with the activations a step ahead (PF) and
    # without: the same MMAs in the same order, so the same bits; K = 208
    # ends in a partial chunk, 2,112 columns are 33 chunks (an odd number of
    # ring steps for the unrolled pair)
    for k in (208, 2112):
        w, w64 = random_weight(rng, 3, 72, k, "nvfp4")
        x = torch.from_numpy(rng.standard_normal((tokens, 3, k)).astype(np.float32)).to(getattr(torch, dtype)).cuda()
        monkeypatch.setattr(linear, "MMA_SMALL_GRID_BLOCKS_PER_SM", 0)    # (CONFIGS' tiles, whatever the GPU)
        monkeypatch.setattr(linear, "MMA_PREFETCH_MAX_BLOCKS_PER_SM", 0)
        plain = rawkv.gemm.grouped_linear(x, w)
        monkeypatch.setattr(linear, "MMA_PREFETCH_MAX_BLOCKS_PER_SM", 1 << 20)
        ahead = rawkv.gemm.grouped_linear(x, w)
        assert torch.equal(plain.view(torch.int16), ahead.view(torch.int16)), (tokens, dtype, k)
        exact, absolute = exact_grouped(x.double().cpu().numpy(), w64)
        assert_within_bound(ahead, exact, absolute, k, f"PF {dtype} T={tokens} K={k}")


@pytest.mark.parametrize("tokens,dtype", [(9, "bfloat16"), (16, "float16")])
def test_the_16_token_tile_of_large_grids_gives_the_same_bits(cuda, rng, monkeypatch, tokens, dtype):
    # K.CONFIG_16_LARGE_GRID (64-feature blocks) with and without PF against
    # CONFIGS[16] with PF: the same KS, so the same bits. One 64-feature
    # block per group and sm_count groups: CONFIGS[16]'s grid (two blocks a
    # group) is past one block per SM, the wide tile's is not. N = 56: a
    # partial row tile; K = 2,112: 33 chunks (an odd number of ring steps).
    sms = rawkv.runtime.get_runtime().sm_count
    k = 2112
    w, w64 = random_weight(rng, sms, 56, k, "nvfp4")
    x = torch.from_numpy(rng.standard_normal((tokens, sms, k)).astype(np.float32)).to(getattr(torch, dtype)).cuda()
    outs = {}
    for limit in (1 << 20, 1, 0):          # CONFIGS[16] with PF; the wide tile with PF; without
        monkeypatch.setattr(linear, "MMA_PREFETCH_MAX_BLOCKS_PER_SM", limit)
        outs[limit] = rawkv.gemm.grouped_linear(x, w)
    for limit in (1, 0):
        assert torch.equal(outs[limit].view(torch.int16), outs[1 << 20].view(torch.int16)), (tokens, dtype, limit)
    exact, absolute = exact_grouped(x.double().cpu().numpy(), w64)
    assert_within_bound(outs[1], exact, absolute, k, f"wide 16-token tile {dtype} T={tokens}")


def _plan_instance(x, w):
    """The kernel instance rawkv.gemm.grouped_linear(x, w) launches on this GPU."""
    from rawkv.gemm import _rules
    out = torch.empty(x.shape[0], w.groups, w.n, dtype=torch.bfloat16, device=x.device)
    lo, hi = w.exp_range or (0, 0)
    _, act, cw, out = _rules.grouped(x, None, None, w.codes, w.scales, w.gs, w.fmt, w.n, w.k, lo, hi, out)
    (launch,) = plans.grouped(rawkv.runtime.get_runtime(), act, cw, out, linear)
    return launch.kernel


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tiles", ["small", "wide"])
def test_grid_tiles_within_the_bound_and_the_same_bits_for_1_to_16_tokens(cuda, rng, monkeypatch, fmt, dtype,
                                                                         tiles):
    # plans' MMA_SMALL_GRID_* rule (sm_90) and its MMA_WIDE_* rule (forced
    # here, whatever the grid): 3 groups x 120 features (eight 16-feature, four
    # 32-feature or two 64-feature blocks a group, the last partial, its last
    # m-tile too), K =
    # 2,112 (33 chunks: eight warps of 5, the last with none). Every such tile
    # splits K in eight: a token's bits are the same in calls of 1 to 16 tokens
    # and in either tile; CONFIGS' tiles (four warps) stay within the bound too.
    k = 2112
    w, w64 = random_weight(rng, 3, 120, k, fmt)
    x = torch.from_numpy(rng.standard_normal((16, 3, k)).astype(np.float32)).to(getattr(torch, dtype)).cuda()
    exact, absolute = exact_grouped(x.double().cpu().numpy(), w64)
    small = rawkv.gemm.grouped_linear(x, w)
    configs = plans.K.SMALL_GRID_CONFIGS
    if tiles == "wide":
        monkeypatch.setattr(linear, "MMA_SMALL_GRID_BLOCKS_PER_SM", 0)
        monkeypatch.setattr(linear, "MMA_WIDE_MIN_BLOCKS_PER_SM", 0)
        monkeypatch.setattr(linear, "MMA_WIDE_MAX_BLOCKS_PER_SM", 1 << 20)
        configs = plans.K.WIDE_GRID_CONFIGS
    full = rawkv.gemm.grouped_linear(x, w)
    assert_within_bound(full, exact, absolute, k, f"{tiles} grid {fmt} {dtype}")
    assert torch.equal(full.view(torch.int16), small.view(torch.int16))
    for m in (1, 5, 8, 9, 15):
        part = rawkv.gemm.grouped_linear(x[:m], w)
        assert torch.equal(part.view(torch.int16), full[:m].view(torch.int16)), m
    kinds = {"bfloat16": 0, "float16": 1}
    if rawkv.runtime.get_runtime().arch == "sm_90":
        for m, tt, pf in ((8, 8, False), (16, 16, True)):
            assert _plan_instance(x[:m], w) is plans.K.GEMM.instance(kinds[dtype], fmt == "mxfp4", *configs[tt], pf)
    monkeypatch.setattr(linear, "MMA_SMALL_GRID_BLOCKS_PER_SM", 0)
    monkeypatch.setattr(linear, "MMA_WIDE_MAX_BLOCKS_PER_SM", 0)
    assert_within_bound(rawkv.gemm.grouped_linear(x, w), exact, absolute, k, f"CONFIGS[16] {fmt} {dtype}")
    assert _plan_instance(x, w) is plans.K.GEMM.instance(kinds[dtype], fmt == "mxfp4", *plans.K.CONFIGS[16], True)


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


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 9, 40, 130])
def test_nvfp4_activations_equal_the_bf16_gemm_of_their_exact_values(cuda, rng, fmt, tokens):
    check_nvfp4_activations_equal_bf16(rng, fmt, tokens)


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


def test_views_and_out(cuda, rng):
    check_views_and_out(rng, tokens=7)
