"""The Hopper GEMM kernel (rawkv/cu/gemm_fp4_sm90.cu: wgmma, sm_90a) against
the reference, with the error bound of tests/support/gemm.py (FP32
accumulation in any order, one rounding to BF16), forced onto every shape
class the dispatcher can route to it; bit reproducibility across runs and
across the token tilings it chooses. Runs only on a compute capability 9.0
GPU."""
import numpy as np
import pytest

import rawkv
from rawkv.gemm import linear, plans
from rawkv.reference import gemm as ref
from support.gemm import (_nvfp4_activation, assert_within_bound, check_nan_and_inf,
                          check_nvfp4_activations_equal_bf16, check_ragged, check_views_and_out, exact_grouped,
                          random_weight)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.fixture(params=[(128, None, True, None), (256, None, True, None), (128, 2, True, None),
                        (256, 2, True, None), (256, None, False, None), (128, None, True, 256),
                        (128, 2, True, 256)],
                ids=["bm128", "bm256", "bm128-split2", "bm256-split2", "bm256-copy", "bn256", "bn256-split2"])
def sm90(cuda, monkeypatch, request):
    """The runtime of an sm_90 device, every launch forced onto the wgmma
    kernel with blocks of 128 or 256 output features, and batched launches
    also onto the split-K kernel (a cluster of 2 blocks per output tile,
    each half of K: with K of 1 to 4 chunks a half may have none); 16-bit
    activation tiles by TMA where the view allows it, and ("copy") by the
    producer's threads; ("bn256") the 256-token tile wherever TMA can bring
    the activations (elsewhere the plan's 128-token tile)."""
    if cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    bm, splits, act_tma, bn = request.param
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    monkeypatch.setattr(linear, "SM90_FORCE_BN", bn)
    monkeypatch.setattr(linear, "SM90_FORCE_BM", bm)
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", splits)
    monkeypatch.setattr(linear, "SM90_ACT_TMA", act_tma)
    return cuda


@pytest.mark.parametrize("fmt,k", [("nvfp4", 208), ("nvfp4", 1024), ("mxfp4", 224)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens", [1, 7, 64, 65, 130, 300])
def test_batched_within_the_fp32_bound(sm90, rng, fmt, k, dtype, tokens):
    # N = 72: one partial block of 256 features and a partial row tile;
    # N = 300: a second block; K = 208 / 224: a partial 64-column chunk.
    for g, n in ((3, 72), (2, 300)):
        w, w64 = random_weight(rng, g, n, k, fmt)
        x = torch.from_numpy(rng.standard_normal((tokens, g, k)).astype(np.float32)).to(getattr(torch, dtype))
        exact, absolute = exact_grouped(x.double().numpy(), w64)
        out = torch.full((tokens, g, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        rawkv.gemm.grouped_linear(x.cuda(), w, out=out)
        assert_within_bound(out, exact, absolute, k, f"{fmt} {dtype} T={tokens} G={g} N={n}")


def test_same_bits_every_run_and_every_token_tiling(sm90, rng):
    # 64 tokens take BN = 64 tiles, 300 take BN = 128: each output is one
    # warpgroup's accumulation in a fixed order, so a token's row is the same
    # whichever tile (and block) it lands in, and the same on every run.
    g, n, k = 2, 520, 1024
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(300, g, k, dtype=torch.bfloat16, device="cuda")
    full = rawkv.gemm.grouped_linear(x, w)
    again = rawkv.gemm.grouped_linear(x, w)
    assert torch.equal(full.view(torch.int16), again.view(torch.int16))
    for lo, hi in ((0, 64), (200, 264), (131, 140)):
        part = rawkv.gemm.grouped_linear(x[lo:hi].contiguous(), w)
        assert torch.equal(part.view(torch.int16), full[lo:hi].view(torch.int16)), (lo, hi)


def test_same_bits_for_128_and_256_feature_blocks(sm90, rng, monkeypatch):
    # Each output is one warpgroup's accumulation over the same chunks and
    # k16 steps whichever block size holds its row: the plan may pick either.
    g, n, k = 3, 700, 1088
    w, _ = random_weight(rng, g, n, k, "mxfp4")
    x = torch.randn(150, g, k, dtype=torch.bfloat16, device="cuda")
    outs = []
    for bm in (128, 256):
        monkeypatch.setattr(linear, "SM90_FORCE_BM", bm)
        outs.append(rawkv.gemm.grouped_linear(x, w))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_4096_tokens_and_a_real_shape(sm90, rng):
    g, n, k = 2, 1024, 4096
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(4096, g, k, dtype=torch.bfloat16)
    out = rawkv.gemm.grouped_linear(x.cuda(), w)
    rows = rng.choice(4096, 48, replace=False)         # the float64 reference on a sample of tokens
    exact, absolute = exact_grouped(x[rows].double().numpy(), w64)
    assert_within_bound(out[rows], exact, absolute, k, "T=4096")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [9, 130])
def test_nvfp4_activations_equal_the_bf16_gemm_of_their_exact_values(sm90, rng, fmt, tokens):
    check_nvfp4_activations_equal_bf16(rng, fmt, tokens)


def test_nvfp4_activation_per_row_global_scales(sm90, rng):
    g, n, k, tokens = 3, 40, 160, 70
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    gs = (rng.random((tokens, g)) + 0.5).astype(np.float32)
    qa, xv = _nvfp4_activation(rng, (tokens, g), k, torch.tensor(gs, device="cuda"))
    exact, absolute = exact_grouped(xv * gs[..., None], w64)
    assert_within_bound(rawkv.gemm.grouped_linear(qa, w), exact, absolute, k, "nvfp4 act")


def test_nan_and_inf_inputs(sm90, rng):
    check_nan_and_inf(rng, tokens=70, late=66)


def test_views_and_out(sm90, rng):
    check_views_and_out(rng, tokens=67)


def _ragged_case(rng, counts, n, k, fmt):
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(offsets[-1])
    w, w64 = random_weight(rng, len(counts), n, k, fmt)
    xt = torch.randn(rows, k, dtype=torch.bfloat16)
    return offsets, rows, w, w64, xt.cuda(), xt.double().numpy()


@pytest.mark.parametrize("offsets", [[0, 3, 3, 100, 230, 237], [0, 0, 0, 0, 0, 237], [2, 3, 1, 100, 250, 230],
                                     [-4, 5, 5, 5, 120, 233]])
@pytest.mark.parametrize("act", ["bfloat16", "nvfp4"])
def test_ragged_experts(sm90, rng, offsets, act):
    check_ragged(rng, offsets, act, n=300, k=208, rows=237)


def test_ragged_384_experts_some_empty(sm90, rng):
    counts = rng.integers(0, 300, 384)
    counts[rng.choice(384, 100, replace=False)] = 0
    n, k = 64, 128
    offsets, rows, w, w64, x, x64 = _ragged_case(rng, counts, n, k, "mxfp4")
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.moe_linear(x, w, torch.from_numpy(offsets).cuda(), out=out)
    sample = rng.choice(rows, 512, replace=False)
    exact, _ = ref.ragged(x64, w64, offsets)
    absolute, _ = ref.ragged(np.abs(x64), np.abs(w64), offsets)
    assert_within_bound(out[sample], exact[sample], absolute[sample], k, "384 experts")
    again = torch.empty_like(out)
    rawkv.gemm.moe_linear(x, w, torch.from_numpy(offsets).cuda(), out=again)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))


@pytest.mark.parametrize("fmt,act", [("nvfp4", "bfloat16"), ("mxfp4", "float16")])
def test_every_column_count_within_the_bound_and_same_bits_for_every_tile(cuda, rng, monkeypatch, fmt, act):
    # A block's wgmmas cover its tokens rounded up to 16 columns (32 in the
    # 256-token tile; sm90.cuh, run_tile): experts of 1 .. 250 rows in 64-,
    # 128- and 256-token tiles reach every column count of each tile, the
    # same token at different counts (100 rows: 112 columns in a 128-token
    # tile, 64 + 48 in 64-token ones; 85 rows, DeepSeek-V4-Pro's mean at
    # 4,096 tokens, the plan's 128-token tile); within the bound, and the
    # same bits for every tile, ragged (empty experts, N past a block, K past
    # a chunk) and batched.
    if cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    n, k = 136, 1056
    counts = np.array([1, 16, 17, 32, 33, 48, 49, 64, 65, 80, 81, 85, 96, 97, 100, 112, 113, 128, 129, 250, 0, 7,
                       145, 161, 177, 193, 209, 225, 241])
    tiles = (256, 128, 64)
    for bn in tiles:
        assert {-(-(c % bn or bn) // 16) for c in counts if c} == set(range(1, bn // 16 + 1))
    offsets, rows, w, w64, x, x64 = _ragged_case(rng, counts, n, k, fmt)
    assert plans.tile(cuda, w, 85, ragged=True, tuning=linear).tokens == 128
    x = x.to(getattr(torch, act))
    offs = torch.from_numpy(offsets).cuda()
    x64 = x.double().cpu().numpy()
    exact, _ = ref.ragged(x64, w64, offsets)
    absolute, _ = ref.ragged(np.abs(x64), np.abs(w64), offsets)
    assert plans.tma.activation_map(x, True, 256) is not None       # (so the 256-token tile serves)
    got = {}
    for bn in tiles:
        monkeypatch.setattr(linear, "SM90_FORCE_BN", bn)
        assert plans.tile(cuda, w, 85, ragged=True, tuning=linear, wide=True).tokens == bn
        got[bn] = rawkv.gemm.moe_linear(x, w, offs)
    assert_within_bound(got[128], exact, absolute, k, f"{fmt} {act} ragged")
    for bn in (256, 64):
        assert torch.equal(got[bn].view(torch.int16), got[128].view(torch.int16)), bn
    xb = torch.randn(250, 2, k, device="cuda").to(getattr(torch, act))
    wb, _ = random_weight(rng, 2, n, k, fmt)
    for tokens in (1, 17, 40, 100, 127, 129, 200, 250):
        outs = []
        for bn in tiles:
            monkeypatch.setattr(linear, "SM90_FORCE_BN", bn)
            outs.append(rawkv.gemm.grouped_linear(xb[:tokens].contiguous(), wb))
        for o in outs[1:]:
            assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16)), tokens


@pytest.mark.parametrize("k", [64, 128, 4160])
def test_split_k_same_bits_every_run_and_within_the_bound(cuda, rng, monkeypatch, k):
    # The split-K kernel's own plan (seed 004's shape class at 64 tokens: a
    # grid too small for the GPU), forced where K gives one half no chunk.
    if cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", 2)
    g, n = 3, 520
    w, w64 = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(64, g, k, dtype=torch.bfloat16)
    exact, absolute = exact_grouped(x.double().numpy(), w64)
    a = rawkv.gemm.grouped_linear(x.cuda(), w)
    assert plans.tile(cuda, w, 64, tuning=linear).splits == 2
    assert_within_bound(a, exact, absolute, k, f"split K, K={k}")
    for _ in range(3):
        assert torch.equal(rawkv.gemm.grouped_linear(x.cuda(), w).view(torch.int16), a.view(torch.int16))


def test_dispatch_takes_the_wgmma_kernel_from_256_tokens(cuda, monkeypatch):
    if cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    w = rawkv.gemm.Fp4Weight.from_float(torch.randn(2, 64, 128, device="cuda"))
    # the runtime is the plan's device (its arch and sm_count)
    assert plans.tile(cuda, w, 255, tuning=linear).kernel is plans.K.GEMM   # 2 x 1 x 2 blocks: too few below 256
    assert plans.tile(cuda, w, 256, tuning=linear).kernel is plans.K.GEMM_SM90
    assert plans.tile(cuda, w, 27, ragged=True, tuning=linear).kernel is plans.K.GEMM
    assert plans.tile(cuda, w, 28, ragged=True, tuning=linear).kernel is plans.K.GEMM_SM90



@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_activation_tiles_by_tma_give_the_threads_bits(cuda, rng, monkeypatch, dtype, fmt):
    # The same MMAs on the same B tiles whoever brings them: batched (a
    # partial 64-column chunk, partial token tiles, one group) and ragged
    # (rows of the next expert in a tile, empty experts), split and whole.
    if cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    dt = getattr(torch, dtype)
    k = 224 if fmt == "mxfp4" else 208
    cases = []
    for g, n, tokens in ((3, 300, 130), (1, 72, 65), (2, 520, 300)):
        w, _ = random_weight(rng, g, n, k, fmt)
        x = torch.from_numpy(rng.standard_normal((tokens, g, k)).astype(np.float32)).to(dt).cuda()
        cases.append(lambda w=w, x=x: rawkv.gemm.grouped_linear(x, w))
    w, _ = random_weight(rng, 5, 264, k, fmt)
    offsets = torch.tensor([0, 0, 70, 71, 200, 333], dtype=torch.int32, device="cuda")
    xr = torch.from_numpy(rng.standard_normal((333, k)).astype(np.float32)).to(dt).cuda()
    cases.append(lambda: rawkv.gemm.moe_linear(xr, w, offsets))
    for splits in (None, 2):
        monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", splits)
        for i, call in enumerate(cases):
            if splits and i == len(cases) - 1:
                continue                                   # (ragged calls never split)
            got = []
            for act_tma in (True, False):
                monkeypatch.setattr(linear, "SM90_ACT_TMA", act_tma)
                got.append(call())
            assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16)), (fmt, dtype, splits, i)


def test_the_plan_maps_the_activations_where_tma_can_take_them(cuda, rng, monkeypatch):
    # 16-bit activations on the GPU get a tensor map (the op hands the
    # kernel rows 16-byte aligned, a view as it is: its strides go into the
    # map, the same bits as the threads' copies); SM90_ACT_TMA off gets none;
    # activation_map refuses what TMA cannot take (a CPU tensor, rows or
    # strides off 16 bytes).
    from rawkv.gemm import _rules as R, tma
    if cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    w, _ = random_weight(rng, 2, 264, 1024, "nvfp4")
    out = torch.empty(300, 2, 264, dtype=torch.bfloat16, device="cuda")

    def plan(x, sf=None, gs=None, tuning=plans.TUNED):
        _, act, cw, o = R.grouped(x, sf, gs, w.codes, w.scales, w.gs, w.fmt, w.n, w.k, 0, 0, out)
        (launch,) = plans.grouped(cuda, act, cw, o, tuning)
        return launch

    x = torch.randn(300, 2, 1024, dtype=torch.bfloat16, device="cuda")
    launch = plan(x)
    assert launch.args["act_tma"] == 1 and any(launch.args["xmap"].values())
    launch = plan(x, tuning=plans.TUNED._replace(SM90_ACT_TMA=False))
    assert launch.args["act_tma"] == 0 and launch.args["xmap"] == tma.NONE
    wide = torch.randn(300, 2, 1088, dtype=torch.bfloat16, device="cuda")[..., 8:1032]   # rows 2,176 B apart
    launch = plan(wide)
    assert launch.args["act_tma"] == 1 and launch.args["xmap"] != plan(x).args["xmap"]
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    got = []
    for act_tma in (True, False):
        monkeypatch.setattr(linear, "SM90_ACT_TMA", act_tma)
        got.append(rawkv.gemm.grouped_linear(wide, w))
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16))
    assert torch.equal(got[0].view(torch.int16), rawkv.gemm.grouped_linear(wide.contiguous(), w).view(torch.int16))
    assert tma.activation_map(x.cpu(), False, 128) is None
    assert tma.activation_map(torch.randn(300, 2, 1028, dtype=torch.bfloat16, device="cuda")[..., 2:1026], False,
                              128) is None
    assert tma.activation_map(x.float(), False, 128) is None
