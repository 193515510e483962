"""The grouped FP4 GEMM's launch plans (rawkv.gemm.plans) as data: which
kernel instance, grid, block and arguments a plan holds, from the checked
arguments (rawkv.gemm._rules on CPU tensors), the device properties and the
dispatch tunables, with no runtime. Every launch's arguments are exactly its
kernel's parameters and each scalar fits its C type. What the kernels
compute: tests/gemm/test_grouped_linear.py, test_moe_linear.py (the mma.sync kernel) and
tests/gemm/test_linear_sm90.py (wgmma)."""
import struct

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv import runtime  # noqa: E402
from rawkv._plan import Device, Launch  # noqa: E402
from rawkv.gemm import _rules as R  # noqa: E402
from rawkv.gemm import linear, plans as P  # noqa: E402
from rawkv.kernels import gemm_fp4 as K  # noqa: E402

H100 = Device(sm_count=132, max_threads_per_sm=2048, arch="sm_90")
A100 = Device(sm_count=108, max_threads_per_sm=2048, arch="sm_80")


def _weight(g=3, n=72, k=128, fmt="nvfp4"):
    if fmt == "nvfp4":
        return rawkv.gemm.Fp4Weight.from_float(torch.linspace(-1, 1, g * n * k).reshape(g, n, k))
    return rawkv.gemm.Fp4Weight.from_mxfp4(torch.zeros(g, n, k // 2, dtype=torch.uint8),
                                           torch.full((g, n, k // 32), 127, dtype=torch.uint8), groups=g)


def _grouped(x, w, out=None):
    """The checked (activation, weight, out) of grouped_linear(x, w)."""
    x, sf, gs = (x.q, x.sf, x.gs) if hasattr(x, "q") else (x, None, None)
    out = torch.empty(x.shape[0], w.groups, w.n, dtype=torch.bfloat16) if out is None else out
    lo, hi = w.exp_range or (0, 0)
    _, act, cw, out = R.grouped(x, sf, gs, w.codes, w.scales, w.gs, w.fmt, w.n, w.k, lo, hi, out)
    return act, cw, out


def _moe(x, w, offsets, errors=None):
    lo, hi = w.exp_range or (0, 0)
    out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16)
    _, act, cw, offsets, out, errors = R.moe(x, None, None, w.codes, w.scales, w.gs, w.fmt, w.n, w.k, lo, hi,
                                             offsets, out, errors)
    return act, cw, offsets, out, errors


def _one(plan):
    (launch,) = plan
    params = launch.kernel.kernel.params
    assert set(launch.args) == {p.name for p in params}, launch.kernel
    for p in params:
        value = launch.args[p.name]
        if p.pointer:
            assert value is None or isinstance(value, int) or hasattr(value, "shape"), p
        elif p.fields is not None:                # a struct by value: a dict of its fields
            assert set(value) == {f.name for f in p.fields}, p
            struct.pack("<" + "".join(f.fmt for f in p.fields), *(value[f.name] for f in p.fields))
        else:
            struct.pack("<" + p.slot, value)      # fits its C type
    assert all(isinstance(d, int) and d > 0 for d in (*launch.grid, *launch.block)), launch
    return launch


@pytest.mark.parametrize("tokens,cfg", [(1, 8), (8, 8), (9, 16), (16, 16), (17, 32), (64, 64), (65, "large")])
def test_mma_tiles_by_tokens(tokens, cfg):
    w = _weight()
    act, cw, out = _grouped(torch.ones(tokens, 3, 128, dtype=torch.bfloat16), w)
    a = _one(P.grouped(A100, act, cw, out))
    mt, nt, ks, rw = K.CONFIGS[cfg][:4]
    # a grid this small runs in one wave: tiles that prefetch do (PF)
    assert a.kernel is K.GEMM.instance(R.BF16, False, *K.CONFIGS[cfg], K.CONFIGS[cfg][1] >= 2)
    assert a.block == (32 * ks * rw,)
    assert a.grid == (-(-72 // (16 * mt * rw)), -(-tokens // (8 * nt)), 3)
    assert a.args["x"] is act.x and a.args["out"] is out and a.args["wq"] is w.codes
    assert (a.args["xs_t"], a.args["xs_g"], a.args["os_t"], a.args["os_g"]) == (384, 128, 216, 72)
    assert (a.args["n"], a.args["k"], a.args["tokens"], a.args["experts"]) == (72, 128, tokens, 0)
    assert a.args["xsf"] is None and a.args["offsets"] is None and a.args["errors"] is None


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_mma_prefetch_up_to_its_blocks_per_sm(act_dtype):
    """PF (activations a step ahead) where the tile has it (2+ n-tiles,
    16-bit activations) and the grid has at most
    MMA_PREFETCH_MAX_BLOCKS_PER_SM blocks per SM; never for one n-tile or
    NVFP4 activations, whatever the grid."""
    cfg = K.CONFIGS[16]
    rows = 16 * cfg[0] * cfg[3]
    for g, tokens, want in ((2, 16, True), (40, 16, True), (2, 8, False)):
        # g groups of 8 feature blocks x one token tile: 8 g blocks on A100's 108 SMs (3 per SM: 324)
        w = _weight(g=g, n=8 * rows)
        act, cw, out = _grouped(torch.ones(tokens, g, 128, dtype=act_dtype), w)
        a = _one(P.grouped(A100, act, cw, out))
        assert a.kernel.kernel is K.GEMM and a.grid[0] * a.grid[1] * a.grid[2] == 8 * g
        assert a.kernel.expr.endswith(f"{'true' if want else 'false'}>"), (g, tokens, a.kernel.expr)
    assert not K.prefetches(R.NVFP4, cfg) and not K.prefetches(R.BF16, K.CONFIGS[8])


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_a_16_token_grid_too_large_to_prefetch_takes_64_feature_blocks(act_dtype):
    """Where CONFIGS[16]'s grid has more than MMA_PREFETCH_MAX_BLOCKS_PER_SM
    blocks per SM, CONFIG_16_LARGE_GRID (the same KS: the same bits) with
    half the grid, itself prefetching by the same rule; NVFP4 activations
    (no PF instance) keep CONFIGS[16]."""
    cfg, wide = K.CONFIGS[16], K.CONFIG_16_LARGE_GRID
    rows = 16 * cfg[0] * cfg[3]
    assert 16 * wide[0] * wide[3] == 2 * rows and wide[2] == cfg[2] and 8 * wide[1] == 8 * cfg[1] == 16
    for g, tokens, tile, pf in ((40, 16, cfg, True), (41, 16, wide, True), (81, 9, wide, True), (82, 9, wide, False)):
        # 8 g blocks of CONFIGS[16] on A100's 108 SMs (3 per SM: 324), 4 g of the wide tile
        w = _weight(g=g, n=8 * rows)
        act, cw, out = _grouped(torch.ones(tokens, g, 128, dtype=act_dtype), w)
        a = _one(P.grouped(A100, act, cw, out))
        assert a.kernel is K.GEMM.instance(R.BF16 if act_dtype == torch.bfloat16 else R.FP16, False, *tile, pf)
        assert a.grid == (8 * rows // (16 * tile[0] * tile[3]), 1, g) and a.block == (32 * tile[2] * tile[3],)
    w = _weight(g=41, n=8 * rows)
    act, cw, out = _grouped(torch.ones(16, 41, 128, dtype=act_dtype), w)
    one_wave = P.Tuning(MMA_PREFETCH_MAX_BLOCKS_PER_SM=0)
    assert _one(P.grouped(A100, act, cw, out, one_wave)).kernel is K.GEMM.instance(
        R.BF16 if act_dtype == torch.bfloat16 else R.FP16, False, *wide, False)
    q, sf, gs = rawkv.nvfp4.quantize(torch.ones(16, 41, 128), scope="row")
    act, cw, out = _grouped(rawkv.nvfp4.QuantizedActivation(q, sf, gs), w)
    a = _one(P.grouped(A100, act, cw, out))
    assert a.kernel is K.GEMM.instance(R.NVFP4, False, *cfg, False) and a.grid == (8, 1, 41)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_small_grids_on_hopper_split_k_in_eight(act_dtype):
    """On sm_90, below MMA_SMALL_GRID_BLOCKS_PER_SM blocks per SM and from
    K = MMA_SMALL_GRID_MIN_K, calls of 1-16 tokens take K.SMALL_GRID_CONFIGS'
    tiles (9-16 tokens CONFIGS[16]'s grid, 32 features a block; 1-8 tokens 16
    features a block, twice CONFIGS[8]'s grid; eight warps split K, both
    tiles alike, so 1-16 tokens give the same bits); at the limits, with
    NVFP4 activations, past 16 tokens and on other GPUs, CONFIGS."""
    kind = R.BF16 if act_dtype == torch.bfloat16 else R.FP16
    for tt, features in ((8, 16), (16, 32)):
        cfg, small = K.CONFIGS[tt], K.SMALL_GRID_CONFIGS[tt]
        assert 16 * cfg[0] * cfg[3] == 32 and 16 * small[0] * small[3] == features
        assert small[1] == cfg[1] and small[2] == 8
    limit = P.TUNED.MMA_SMALL_GRID_BLOCKS_PER_SM * H100.sm_count      # 264 blocks of 32 features
    k = P.TUNED.MMA_SMALL_GRID_MIN_K

    def tile(g, k, tokens, dev=H100, tuning=P.TUNED):
        """(MT, NT, KS, RW, U, S) of the mma.sync instance the plan takes."""
        w = _weight(g=g, n=32, k=k, fmt="mxfp4")
        a = _one(P.grouped(dev, *_grouped(torch.ones(tokens, g, k, dtype=act_dtype), w), tuning))
        assert a.kernel.kernel is K.GEMM
        return tuple(int(v) for v in a.kernel.expr.split("<")[1].rstrip(">").split(", ")[2:8])

    for tokens, small, pf in ((1, K.SMALL_GRID_CONFIGS[8], False), (8, K.SMALL_GRID_CONFIGS[8], False),
                             (9, K.SMALL_GRID_CONFIGS[16], True), (16, K.SMALL_GRID_CONFIGS[16], True)):
        w = _weight(g=limit - 1, n=32, k=k, fmt="mxfp4")
        a = _one(P.grouped(H100, *_grouped(torch.ones(tokens, limit - 1, k, dtype=act_dtype), w)))
        assert a.kernel is K.GEMM.instance(kind, True, *small, pf), (tokens, a.kernel.expr)
        assert a.grid == (32 // (16 * small[0] * small[3]), 1, limit - 1) and a.block == (32 * small[2] * small[3],)
        cfg = K.CONFIGS[8 if tokens <= 8 else 16]
        for g, kk in ((limit, k), (limit - 1, k - 32)):           # the grid / K at the limit
            assert tile(g, kk, tokens) == cfg, (g, kk)
        assert tile(limit - 1, k, tokens, tuning=P.Tuning(MMA_SMALL_GRID_BLOCKS_PER_SM=0)) == cfg
    # the 16-token tile only with PF (its one instance): without, CONFIGS[16]'s rules
    assert tile(limit - 1, k, 16, tuning=P.Tuning(MMA_PREFETCH_MAX_BLOCKS_PER_SM=1)) == K.CONFIG_16_LARGE_GRID
    assert tile(limit - 1, k, 8, tuning=P.Tuning(MMA_PREFETCH_MAX_BLOCKS_PER_SM=1)) == K.SMALL_GRID_CONFIGS[8]
    assert (0, False, *K.SMALL_GRID_CONFIGS[16], False) not in K.GEMM._instance_args
    assert tile(limit - 1, k, 17) == K.CONFIGS[32]
    assert tile(A100.sm_count, k, 1, dev=A100) == K.CONFIGS[8]
    q, sf, gs = rawkv.nvfp4.quantize(torch.ones(1, 8, k), scope="row")
    w = _weight(g=8, n=32, k=k, fmt="mxfp4")
    a = _one(P.grouped(H100, *_grouped(rawkv.nvfp4.QuantizedActivation(q, sf, gs), w)))
    assert a.kernel is K.GEMM.instance(R.NVFP4, True, *K.CONFIGS[8], False)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_wide_grids_on_hopper_take_64_feature_tiles(act_dtype):
    """On sm_90, where CONFIGS[8] / [16]'s grid has more than
    MMA_WIDE_MIN_BLOCKS_PER_SM and at most MMA_WIDE_MAX_BLOCKS_PER_SM
    blocks per SM, from K = MMA_SMALL_GRID_MIN_K, calls of 1-16 tokens take
    K.WIDE_GRID_CONFIGS' tiles (64 features a block: half the grid; eight
    warps split K, both tiles alike and as the small-grid tiles, so 1-16
    tokens give the same bits; the 16-token one prefetching); at the limits,
    below that K, with NVFP4 activations, past 16 tokens, on other GPUs and
    where the 16-token tile could not prefetch, the rules before."""
    kind = R.BF16 if act_dtype == torch.bfloat16 else R.FP16
    for tt in (8, 16):
        cfg, wide = K.CONFIGS[tt], K.WIDE_GRID_CONFIGS[tt]
        assert 16 * wide[0] * wide[3] == 2 * 16 * cfg[0] * cfg[3] == 64 and 8 * wide[1] == tt
        assert wide[2] == K.SMALL_GRID_CONFIGS[tt][2] == 8
    sm90 = Device(sm_count=8, max_threads_per_sm=2048, arch="sm_90")
    lo = int(P.TUNED.MMA_WIDE_MIN_BLOCKS_PER_SM * sm90.sm_count)    # 24 blocks of 32 features
    hi = int(P.TUNED.MMA_WIDE_MAX_BLOCKS_PER_SM * sm90.sm_count)    # 32
    k = P.TUNED.MMA_SMALL_GRID_MIN_K

    def plan(blocks, tokens, kk=k, dev=sm90, tuning=P.TUNED):
        """The launch for one group of `blocks` 32-feature blocks."""
        w = _weight(g=1, n=32 * blocks, k=kk, fmt="mxfp4")
        return _one(P.grouped(dev, *_grouped(torch.ones(tokens, 1, kk, dtype=act_dtype), w), tuning))

    def targs(a):
        assert a.kernel.kernel is K.GEMM
        return tuple(int(v) for v in a.kernel.expr.split("<")[1].rstrip(">").split(", ")[2:8])

    for tokens, wide, pf in ((1, K.WIDE_GRID_CONFIGS[8], False), (8, K.WIDE_GRID_CONFIGS[8], False),
                             (9, K.WIDE_GRID_CONFIGS[16], True), (16, K.WIDE_GRID_CONFIGS[16], True)):
        for blocks in (lo + 1, hi):
            a = plan(blocks, tokens)
            assert a.kernel is K.GEMM.instance(kind, True, *wide, pf), (tokens, blocks, a.kernel.expr)
            assert a.grid == (-(-blocks // 2), 1, 1) and a.block == (256,)
        for blocks, kk in ((lo, k), (hi + 1, k), (hi, k - 32)):          # the grid / K past the limits
            assert targs(plan(blocks, tokens, kk)) not in K.WIDE_GRID_CONFIGS.values(), (tokens, blocks, kk)
        assert targs(plan(hi, tokens, dev=A100)) == K.CONFIGS[8 if tokens <= 8 else 16]
    assert targs(plan(hi, 17)) == K.CONFIGS[32]
    # the 16-token tile only with PF (its one instance): without, CONFIGS[16]'s rules
    assert targs(plan(hi, 16, tuning=P.Tuning(MMA_PREFETCH_MAX_BLOCKS_PER_SM=1))) == K.CONFIG_16_LARGE_GRID
    assert (0, False, *K.WIDE_GRID_CONFIGS[16], False) not in K.GEMM._instance_args
    q, sf, gs = rawkv.nvfp4.quantize(torch.ones(1, 1, k), scope="row")
    w = _weight(g=1, n=32 * hi, k=k, fmt="mxfp4")
    a = _one(P.grouped(sm90, *_grouped(rawkv.nvfp4.QuantizedActivation(q, sf, gs), w)))
    assert a.kernel is K.GEMM.instance(R.NVFP4, True, *K.CONFIGS[8], False) and a.grid == (hi, 1, 1)


def test_hopper_takes_the_wgmma_kernel_from_256_tokens_and_other_gpus_never():
    w = _weight(g=2, n=64)
    for tokens, kernel in ((255, K.GEMM), (256, K.GEMM_SM90)):
        act, cw, out = _grouped(torch.ones(tokens, 2, 128, dtype=torch.bfloat16), w)
        assert _one(P.grouped(H100, act, cw, out, linear)).kernel.kernel is kernel
        assert _one(P.grouped(A100, act, cw, out, linear)).kernel.kernel is K.GEMM


def test_wgmma_launch_geometry():
    # 8 groups x 1024 features x 512 tokens: 128 blocks of 256 features (one
    # wave on 132 SMs already), 128-token tiles
    w = _weight(g=8, n=1024, k=64)
    act, cw, out = _grouped(torch.ones(512, 8, 64, dtype=torch.float16), w)
    a = _one(P.grouped(H100, act, cw, out))
    assert a.kernel is K.GEMM_SM90.instance(R.FP16, False, *K.SM90_CONFIGS["large"], 256)
    assert a.grid == (4, 4, 8) and a.block == (K.SM90_THREADS,)
    runtime.Runtime.run(_Recorder(), [a])                      # launched with the instance's shared memory


def test_forced_paths_and_the_wrong_gpu():
    w = _weight()
    act, cw, out = _grouped(torch.ones(4, 3, 128, dtype=torch.bfloat16), w)
    forced = P.Tuning(KERNEL_PATH="sm90", SM90_FORCE_BM=128)
    a = _one(P.grouped(H100, act, cw, out, forced))
    assert a.kernel is K.GEMM_SM90.instance(R.BF16, False, *K.SM90_SMALL_CONFIG, 128)
    assert _one(P.grouped(H100, act, cw, out, P.Tuning(KERNEL_PATH="mma"))).kernel.kernel is K.GEMM
    with pytest.raises(ValueError, match="^x: the wgmma GEMM kernel runs on sm_90 devices, this one is sm_80"):
        P.grouped(A100, act, cw, out, forced)


def test_nvfp4_activation_and_mxfp4_weight_arguments():
    w = _weight(fmt="mxfp4")
    x = torch.linspace(-2, 2, 5 * 3 * 128).reshape(5, 3, 128)
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row")
    act, cw, out = _grouped(rawkv.nvfp4.QuantizedActivation(q, sf, gs), w)
    a = _one(P.grouped(A100, act, cw, out))
    assert a.kernel is K.GEMM.instance(R.NVFP4, True, *K.CONFIGS[8], False)
    assert (a.args["xs_t"], a.args["xs_g"], a.args["ss_t"], a.args["ss_g"]) == (192, 64, 24, 8)
    assert (a.args["gs_t"], a.args["gs_g"]) == (3, 1) and a.args["xgs"] is gs
    scalar = rawkv.nvfp4.QuantizedActivation(q, sf, torch.ones(()))
    a = _one(P.grouped(A100, *_grouped(scalar, w)))
    assert (a.args["gs_t"], a.args["gs_g"]) == (0, 0)


def test_out_rows_strided():
    w = _weight()
    out = torch.empty(4, 3, 80, dtype=torch.bfloat16)[..., :72]
    a = _one(P.grouped(A100, *_grouped(torch.ones(4, 3, 128, dtype=torch.bfloat16), w, out)))
    assert (a.args["os_t"], a.args["os_g"]) == (240, 80) and a.args["out"] is out


def test_nothing_to_do_is_no_launch():
    w = _weight()
    assert P.grouped(H100, *_grouped(torch.ones(0, 3, 128, dtype=torch.bfloat16), w)) == []
    act, cw, offsets, out, errors = _moe(torch.ones(0, 128, dtype=torch.bfloat16), w, torch.zeros(4, dtype=torch.int32))
    assert P.moe(H100, act, cw, offsets, out, 0) == []
    # A weight of no groups (the constructors refuse one; the operators take raw tensors) and
    # x (T, 0, K): the CPU path returns the empty (T, 0, N); a launch's grid would be empty.
    w1 = _weight(g=1, n=16, k=64)
    w0 = rawkv.gemm.Fp4Weight("nvfp4", 16, 64, w1.codes[:0], w1.scales[:0], w1.gs[:0])
    assert w0.groups == 0
    assert P.grouped(H100, *_grouped(torch.ones(5, 0, 64, dtype=torch.bfloat16), w0)) == []
    assert rawkv.gemm.grouped_linear(torch.ones(5, 0, 64, dtype=torch.bfloat16), w0).shape == (5, 0, 16)


@pytest.mark.parametrize("rows,experts,tokens_per_expert", [(7, 3, 3), (4096, 8, 512), (3, 8, 1)])
def test_moe_slots_cover_every_expert(rows, experts, tokens_per_expert):
    w = _weight(g=experts, n=40)
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    act, cw, offsets, out, _ = _moe(torch.ones(rows, 128, dtype=torch.bfloat16), w, offsets)
    t = P.tile(H100, cw, tokens_per_expert, ragged=True, rows=rows)
    a = _one(P.moe(H100, act, cw, offsets, out, 12345))
    assert a.kernel.kernel is t.kernel and a.block == t.block
    assert a.grid == (-(-40 // t.rows), min(rows, -(-rows // t.tokens) + experts + 2), 1)
    assert a.args["offsets"] is offsets and a.args["errors"] == 12345 and a.args["experts"] == experts
    assert (a.args["xs_g"], a.args["os_g"], a.args["tokens"]) == (0, 0, rows)


class _Sizes:
    """What the plans read of a weight: its groups, output features and K."""
    def __init__(self, groups, n, k=4096):
        self.groups, self.n, self.k = groups, n, k


@pytest.mark.parametrize("rows,experts,n,cfg", [
    (384, 256, 4096, 8),        # Flash gate_up, 64 tokens: 2 per expert, 32 x 306 blocks
    (3072, 256, 2048, 16),      # Flash down, 512 tokens: 12 per expert
    (4800, 256, 4096, 32),      # 800 tokens: 19 per expert
    (12, 256, 4096, 8),         # 2 tokens: 32 x 12 = 384 blocks, enough (2 per SM)
    (6, 256, 4096, "small"),    # 1 token: 32 x 6 = 192 blocks, too few: warps split K instead
    (7200, 256, 4096, None)])   # 1200 tokens: 28 per expert, the wgmma kernel
def test_ragged_calls_take_the_ragged_tiles_when_the_grid_is_large_enough(rows, experts, n, cfg):
    t = P.tile(H100, _Sizes(experts, n), -(-rows // min(rows, experts)), ragged=True, rows=rows)
    if cfg == "small":
        assert t.kernel is K.GEMM and t.targs == K.RAGGED_SMALL_CONFIG and t.targs[2] > 1
    elif cfg is None:
        assert t.kernel is K.GEMM_SM90
    else:
        assert t.kernel is K.GEMM and t.targs == K.RAGGED_CONFIGS[cfg] and t.targs[2] == 1
        assert t.tokens == 8 * K.RAGGED_CONFIGS[cfg][1]
    assert (t.kernel is K.GEMM_SM90) == (rows == 7200)


@pytest.mark.parametrize("per_expert,bn", [(28, 64), (64, 64), (65, 128), (85, 128), (96, 128), (300, 128)])
def test_ragged_wgmma_tiles_are_64_or_128_tokens(per_expert, bn):
    # A block's MMAs cover its tokens rounded up to 16 (run_tile), so an
    # expert's last tile costs what it holds: 128-token tiles from 65 tokens
    # per expert on average (DeepSeek-V4-Pro at 4,096 tokens: 85; a 96-token
    # tile served 65-88 before, measured slower since on the H100)
    t = P.tile(H100, _Sizes(384, 7168), per_expert, ragged=True, rows=384 * per_expert)
    assert t.kernel is K.GEMM_SM90 and t.tokens == bn and t.targs[0] == bn


@pytest.mark.parametrize("shape,tokens,wide,splits", [
    ((16, 1024), 4096, True, 1),       # DeepSeek-V4-Pro wo_a: full waves either way
    ((8, 1024), 512, True, 1),         # Flash: 128 blocks of either tile, one wave
    ((8, 1024), 128, False, None),     # 128 tokens: the 128-token tiles
    ((8, 1536, 8192), 512, True, 2),   # seed 004: 192 blocks; split in two, 384 fill 3 waves better
])
def test_the_256_token_tile_where_its_waves_are_cheapest(shape, tokens, wide, splits):
    # The 256-token tile (128 features) costs 0.86 of a 128 x 256 tile's
    # chunk (H100, 2026-11-27): it replaces that tile wherever the waves
    # are the same, and only where the activations can come by TMA (`wide`).
    t = P.tile(H100, _Sizes(*shape), tokens, wide=True)
    narrow = P.tile(H100, _Sizes(*shape), tokens, wide=False)
    assert narrow.tokens <= 128
    if wide:
        kernel = K.GEMM_SM90 if splits == 1 else K.GEMM_SM90_SPLITK
        assert t.kernel is kernel and t.targs[:3] == (*K.SM90_WIDE_CONFIG, 128) and t.rows == 128, t
        assert t.tokens == 256 and t.splits == splits
    else:
        assert t == narrow


def test_the_256_token_tile_forced(monkeypatch):
    # Forced, it serves any token count that can take it, split or not;
    # where the call's activations cannot come by TMA, or 256-feature blocks
    # are forced too, the 128-token tile serves instead (also with the ops'
    # tunables, rawkv.gemm.linear's attributes).
    w = _Sizes(8, 1024)
    monkeypatch.setattr(linear, "SM90_FORCE_BN", 256)
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    assert P.tile(H100, w, 3000, tuning=linear, wide=False).tokens == 128
    assert P.tile(H100, w, 3000, tuning=linear, wide=True).tokens == 256
    wide = P.Tuning(KERNEL_PATH="sm90", SM90_FORCE_BN=256)
    assert P.tile(H100, w, 3, tuning=wide, wide=True).targs == (*K.SM90_WIDE_CONFIG, 128, 2)   # split in two
    assert P.tile(H100, w, 3000, tuning=wide, wide=True).targs == (*K.SM90_WIDE_CONFIG, 128)
    assert P.tile(H100, w, 3, ragged=True, rows=40, tuning=wide, wide=True).tokens == 256
    assert P.tile(H100, w, 3000, tuning=wide, wide=False).tokens == 128
    assert P.tile(H100, w, 3000, tuning=wide._replace(SM90_FORCE_BM=256), wide=True).tokens == 128
    t = P.tile(H100, w, 3000, tuning=wide._replace(SM90_FORCE_KSPLIT=2), wide=True)
    assert t.splits == 2 and t.tokens == 256


def test_only_tma_activations_take_the_256_token_tile():
    # CPU tensors have no tensor map (the plan on them is what a GPU without
    # TMA for the view gets); NVFP4 activations, SM90_ACT_TMA off, fewer
    # than 129 tokens or another GPU: never.
    w = _weight(g=2, n=64)
    act, cw, out = _grouped(torch.ones(300, 2, 128, dtype=torch.bfloat16), w)
    assert not P.wide_tile(H100, act, 300, False, linear)
    a = _one(P.grouped(H100, act, cw, out, linear))
    assert a.kernel.kernel is K.GEMM_SM90 and a.grid[1] == 3         # 128-token tiles
    q, sf, gs = rawkv.nvfp4.quantize(torch.ones(300, 2, 128), scope="row")
    nv, _, _ = _grouped(rawkv.nvfp4.QuantizedActivation(q, sf, gs), w)
    forced = P.Tuning(SM90_FORCE_BN=256)
    for dev, a, tokens, tuning in ((H100, nv, 300, forced), (H100, act, 300, P.Tuning(SM90_ACT_TMA=False)),
                                   (H100, act, 128, P.TUNED), (A100, act, 300, forced)):
        assert not P.wide_tile(dev, a, tokens, False, tuning)


def test_a_forced_token_tile_without_an_instance_is_refused():
    with pytest.raises(ValueError, match="^SM90_FORCE_BN: expected 64, 128, 256 or None, got 96"):
        P.tile(H100, _Sizes(8, 1024), 300, tuning=P.Tuning(KERNEL_PATH="sm90", SM90_FORCE_BN=96))


def test_a_grid_past_the_limit_is_refused():
    w = _weight(g=1, n=16)
    act, cw, out = _grouped(torch.ones(1, 1, 128, dtype=torch.bfloat16), w)
    act.lead = (64 * 65536, 1)           # 32-token tiles: 131072 of them (the plan reads the sizes only)
    with pytest.raises(ValueError, match="^x: 4194304 tokens x 1 groups is past the launch grid's limit"):
        P.grouped(A100, act, cw, out)


class _Recorder:
    """A runtime stand-in that keeps the shared memory each launch asked for."""
    device_index = 0

    def __init__(self):
        self._functions = {}

    def function(self, filename, name, stream=None):
        return name

    def _get_device(self):
        return 1

    def launch(self, fn, grid, block, st, args, stream=None, shared_mem=0, what=None):
        assert shared_mem == what.smem > 0


def test_run_passes_each_instance_its_shared_memory():
    inst = K.GEMM_SM90.instance(0, False, *K.SM90_SMALL_CONFIG, 128)
    assert inst.smem == K.sm90_dynamic_smem(0, False, *K.SM90_SMALL_CONFIG, 128)
    w = _weight()
    act, cw, out = _grouped(torch.ones(4, 3, 128, dtype=torch.bfloat16), w)
    a = _one(P.grouped(H100, act, cw, out, P.Tuning(KERNEL_PATH="sm90", SM90_FORCE_BM=128)))
    assert a.kernel is inst
    runtime.Runtime.run(_Recorder(), [Launch(a.kernel, a.grid, a.block, a.args)])
