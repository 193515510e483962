"""rawkv.nvfp4.quantize's CUDA kernels against the numpy reference, bit for bit
(GPU; skipped without one). NaN outputs compare as both-NaN. The reference,
argument, plan and operator tests are in test_quantize.py."""
from __future__ import annotations

import numpy as np
from support import nvfp4_edges as E
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv.reference import nvfp4 as R  # noqa: E402
from support.nvfp4 import DTYPES, assert_decoded_equal, assert_q_equal, ref_of, u8  # noqa: E402


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
def all_bf16_cuda():
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).cuda()


@pytest.mark.parametrize("scope", ["none", "given", "tensor"])
def test_all_bf16_values_as_single_element_blocks(cuda, scope):
    # block i holds BF16 value i alone: sf = e4m3(v / (gs*6)), code = e2m1(v / es)
    v = all_bf16_cuda()
    x = torch.zeros((1 << 16, 16), dtype=torch.bfloat16, device="cuda")
    x[:, 0] = v
    x[:, 5] = v * 0.37       # a second value in the block: exercises e2m1 below bmax
    if scope != "tensor":
        gs = 0.25 if scope == "given" else None
        got = rawkv.nvfp4.quantize(x, scope=scope, gs=gs)
        assert_q_equal(got, ref_of(x, scope, gs))
        return
    # One tensor of every BF16 value has amax ~3.4e38, so gs ~1.3e35 and 93%
    # of the blocks quantize to zero. Instead each window of 2048 consecutive
    # bit patterns (16 binades of one sign; Inf and the NaNs in the last
    # window of each sign) is its own tensor, its amax near its values.
    nonzero = 0
    for w in range(0, 1 << 16, 2048):
        xw = x[w:w + 2048]
        want = ref_of(xw, "tensor")
        assert_q_equal(rawkv.nvfp4.quantize(xw), want)
        nonzero += int(((R.unpack_nibbles(want[0])[:, 0] & 7) != 0).sum())
    vals = v.float().cpu().numpy()
    assert nonzero > 0.99 * int((np.isfinite(vals) & (vals != 0)).sum())     # not vacuous


@pytest.mark.parametrize("scope", ["none", "row", "tensor"])
def test_all_bf16_values_packed(cuda, scope):
    x = all_bf16_cuda().reshape(512, 128)
    got = rawkv.nvfp4.quantize(x, scope=scope)
    assert_q_equal(got, ref_of(x, scope))


@pytest.mark.parametrize("scope", ["none", "row", "tensor"])
@pytest.mark.parametrize("shape", [(512, 128), (1, 1 << 16)])
def test_all_fp16_values_packed(cuda, scope, shape):
    # every FP16 bit pattern (subnormals, -0, Inf, NaN; 0x7C00 is the Inf/NaN
    # bound of the packed block max). (1, 65536): a row longer than 1024
    # units, read twice (rkv_nvfp4_quantize_rows<..., 0>).
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(shape).cuda()
    assert_q_equal(rawkv.nvfp4.quantize(x, scope=scope), ref_of(x, scope))


@pytest.mark.parametrize("scope", ["none", "row"])
def test_all_bf16_values_one_long_row(cuda, scope):
    assert_q_equal(rawkv.nvfp4.quantize(all_bf16_cuda().reshape(1, -1), scope=scope),
                   ref_of(all_bf16_cuda().reshape(1, -1), scope))


SHAPES = [(1, 16), (1, 7168), (3, 48), (17, 7168), (5, 3, 32), (2, 4, 7, 16), (63, 112), (1000, 16),
          (8, 30016)]


@pytest.mark.parametrize("scope", ["tensor", "row", "given", "none"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("xname", list(DTYPES))
def test_quantize_random(cuda, rng, scope, shape, xname):
    scale = rng.uniform(1e-3, 1e3)
    x = torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(DTYPES[xname]).cuda()
    gs = float(np.float32(scale / 500)) if scope == "given" else None
    got = rawkv.nvfp4.quantize(x, scope=scope, gs=gs)
    want = ref_of(x, scope, gs)
    assert_q_equal(got, want)
    for name in DTYPES:
        y = rawkv.nvfp4.dequantize(*got, dtype=DTYPES[name])
        assert_decoded_equal(y, R.dequantize(*want, name), name)


def test_quantize_large_tensor_scope_multi_kernel_path(cuda, rng):
    # > SMALL_NUMEL elements: memset + amax + quantize + finalize
    x = torch.from_numpy(rng.standard_normal((300, 7168)).astype(np.float32)).to(torch.bfloat16).cuda()
    x[7, 11] = 1e4
    assert x.numel() > rawkv.nvfp4.SMALL_NUMEL
    assert_q_equal(rawkv.nvfp4.quantize(x), ref_of(x, "tensor"))


@pytest.mark.parametrize("xname", ["bfloat16", "float16"])
@pytest.mark.parametrize("n", [7168, 2048, 48])
def test_row_scope_many_rows(cuda, rng, xname, n):
    # More rows than one wave of row groups (each CTA loops over rows), an odd
    # count; Inf / NaN / all-zero / tiny rows and blocks check the packed-bit
    # block maxima and the finite row amax.
    m = 4 * rawkv.get_runtime().sm_count + 3
    xs = rng.standard_normal((m, n)).astype(np.float32) * rng.uniform(1e-3, 1e3, (m, 1)).astype(np.float32)
    xs[5, 17] = np.inf
    xs[6, 3] = -np.inf
    xs[7, 40] = np.nan
    xs[8] = 0.0
    xs[9] *= 1e-6
    xs[m - 1, :16] = 0.0
    x = torch.from_numpy(xs).to(DTYPES[xname]).cuda()
    assert_q_equal(rawkv.nvfp4.quantize(x, scope="row"), ref_of(x, "row"))


def test_given_gs_device_tensor_no_sync(cuda, rng):
    x = torch.from_numpy(rng.standard_normal((9, 256)).astype(np.float32)).cuda()
    g = torch.tensor([0.0123], device="cuda")
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=g)
    assert gs.data_ptr() == g.data_ptr()
    assert_q_equal((q, sf, gs), ref_of(x, "given", g))


def test_special_values(cuda, rng):
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[0, :16] = 0                                 # zero block
    x[1, 3] = np.nan                              # NaN block
    x[2, 20] = np.inf; x[2, 40] = -np.inf         # Inf blocks
    x[3, :] *= 1e-6                               # E4M3-subnormal scales under a large gs
    x[4, 0] = 448 * 6 * 0.5                       # exactly 448*6*gs with gs = 0.5
    x[5, 16:32] = -0.0
    xt = torch.from_numpy(x).cuda()
    for scope, gs in (("tensor", None), ("row", None), ("given", 0.5), ("none", None)):
        got = rawkv.nvfp4.quantize(xt, scope=scope, gs=gs)
        want = ref_of(xt, scope, gs)
        assert_q_equal(got, want)
        assert_decoded_equal(rawkv.nvfp4.dequantize(*got, dtype=torch.float32), R.dequantize(*want, "float32"),
                             "float32")
    q, sf, _ = rawkv.nvfp4.quantize(xt, scope="given", gs=0.5)
    assert u8(sf)[4, 0] == 0x7E and u8(sf)[1, 0] == 0x7F


@pytest.mark.parametrize("xname", list(DTYPES))
def test_large_tensor_scope_with_nan_inf(cuda, rng, xname):
    # > SMALL_NUMEL: amax by atomicMax on float bits, which must skip NaN
    # (whose bits are above every finite value) and Inf, of either sign
    xs = rng.standard_normal((300, 7168)).astype(np.float32)
    xs[3, 5] = np.nan
    xs[5, 7] = -np.nan
    xs[17, 100] = np.inf
    xs[299, 7167] = -np.inf
    xs[150, :16] = np.nan                   # a whole block
    xs[42, 42] = -900.0                     # the finite amax (exact in BF16 / FP16)
    x = torch.from_numpy(xs).to(DTYPES[xname]).cuda()
    assert x.numel() > rawkv.nvfp4.SMALL_NUMEL
    got = rawkv.nvfp4.quantize(x)
    want = ref_of(x, "tensor")
    assert_q_equal(got, want)
    assert want[2] == np.float32(900) / np.float32(2688)
    assert_decoded_equal(rawkv.nvfp4.dequantize(*got), R.dequantize(*want, "bfloat16"), "bfloat16")


def test_3d_strided_views(cuda, rng):
    # leading dims that collapse into one evenly strided row index (rawkv._args.rows)
    base = torch.from_numpy(rng.standard_normal((4, 6, 96)).astype(np.float32)).to(torch.bfloat16).cuda()
    big = torch.from_numpy(rng.standard_normal((40, 30, 96)).astype(np.float32)).cuda()
    views = [base[:, :, 32:96],            # 24 rows, 96 elements apart
             base[1:3, :, :64],            # starts at row 6
             base[:, 2:3, 32:96],          # a size-1 dim: rows 576 elements apart
             base.view(2, 2, 6, 96)[:, :, :, 16:48],   # 4-D
             big[:, :, 32:96]]             # > SMALL_NUMEL: the multi-kernel tensor path
    assert views[-1].numel() > rawkv.nvfp4.SMALL_NUMEL
    for v in views:
        assert not v.is_contiguous()
        for scope, gs in (("tensor", None), ("row", None), ("none", None), ("given", 0.03)):
            got = rawkv.nvfp4.quantize(v, scope=scope, gs=gs)
            assert got[0].shape == (*v.shape[:-1], v.shape[-1] // 2)
            assert_q_equal(got, ref_of(v, scope, gs))
    for bad in (base[:, 1:5, 16:80],       # rows 96 apart inside a 576 step: not even
                base.transpose(0, 1)[..., :64]):
        with pytest.raises(ValueError, match="^x:"):
            rawkv.nvfp4.quantize(bad)


def test_row_strided_view_and_refusals(cuda, rng):
    base = torch.from_numpy(rng.standard_normal((12, 96)).astype(np.float32)).to(torch.bfloat16).cuda()
    v = base[::2, 32:96]                           # row-strided 2-D view
    for scope in ("tensor", "row", "none"):
        assert_q_equal(rawkv.nvfp4.quantize(v, scope=scope), ref_of(v.contiguous(), scope))
    with pytest.raises(ValueError, match="^x:"):
        rawkv.nvfp4.quantize(base.t())             # last dim not contiguous
    with pytest.raises(ValueError, match="^x:"):
        rawkv.nvfp4.quantize(base[:, 4:20])        # rows start mid-vector (not 16-byte aligned)


def test_zero_rows(cuda):
    x = torch.empty((0, 32), device="cuda")
    q, sf, gs = rawkv.nvfp4.quantize(x)
    assert q.shape == (0, 16) and float(gs) == 1.0


@pytest.mark.parametrize("as_int", [False, True])            # a torch stream or a raw handle
@pytest.mark.parametrize("shape", [(3, 0), (0, 32), (3, 32)])
@pytest.mark.parametrize("scope", ["tensor", "row", "given", "given-device", "none"])
def test_gs_written_on_the_stream_argument(cuda, scope, shape, as_int):
    # Stream s first sleeps, then sets gs to 7. quantize(..., stream=s) must
    # write its gs after that, on s; written at once on torch's current
    # stream (as the empty-input path once did) it would end up 7.
    x = torch.zeros(shape, device="cuda")
    gs_out = torch.zeros(shape[:-1] if scope == "row" else (), device="cuda")
    given = {"given": 0.5, "given-device": torch.tensor([0.25], device="cuda")}.get(scope)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())          # x, gs_out, given are ready on s
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)                  # tens of milliseconds of GPU time
        gs_out.fill_(7.0)
    rawkv.nvfp4.quantize(x, scope=scope.split("-")[0], gs=given, out=(None, None, gs_out),
                         stream=s.cuda_stream if as_int else s)
    torch.cuda.synchronize()
    want = {"given": 0.5, "given-device": 0.25}.get(scope, 1.0)    # x is all zero: amax 0 -> 1
    assert (gs_out.cpu() == want).all()


@pytest.mark.parametrize("scope", ["tensor", "row"])
@pytest.mark.parametrize("shape", [(3, 32), (520, 128)])       # tensor scope: small, large path
def test_tiny_amax_gives_gs_one(cuda, scope, shape):
    # amax ~1e-43: amax / 2688 underflows to 0 in float32, so gs must be 1
    # (not 0, which would make every zero block's sf NaN)
    xs = np.zeros(shape, np.float32)
    xs[0, 0] = 1e-43
    xs[1, 20] = -1e-43
    xs[-1, -1] = 3e-43
    x = torch.from_numpy(xs).cuda()
    if scope == "tensor" and shape[0] > 3:
        assert x.numel() > rawkv.nvfp4.SMALL_NUMEL
    got = rawkv.nvfp4.quantize(x, scope=scope)
    want = ref_of(x, scope)
    assert_q_equal(got, want)
    # scale 2^-9 (0x01) for the tiny blocks, 1.0 (0x38) for the zero ones; the
    # magnitudes round to 0, -1e-43 keeps its sign (x / 2^-9 < 0)
    assert (want[2] == 1).all() and not (R.unpack_nibbles(want[0]) & 7).any()
    assert set(np.unique(want[1])) == {0x01, 0x38}
    y = rawkv.nvfp4.dequantize(*got, dtype=torch.float32)
    assert_decoded_equal(y, R.dequantize(*want, "float32"), "float32")
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("g", [0.0, -0.0, -1.0, float("inf"), float("-inf"), float("nan"), "limit", 2e7])
@pytest.mark.parametrize("xname", list(DTYPES))
def test_given_device_gs_unusable(cuda, rng, g, xname):
    # a device gs is checked by the kernel (no host sync): an unusable one
    # (R.given_gs_ok) flags every block, as the reference does, and each
    # call is counted in error_counts()[GIVEN_GS]. 2e7 is unusable for
    # float16 input only (its bound is 11179349), usable for the others.
    if g == "limit":
        g = R.given_gs_limit(xname)
    usable = R.given_gs_ok(np.float32(g), xname)
    assert usable == (g == 2e7 and xname != "float16")
    xs = rng.standard_normal((5, 64)).astype(np.float32)
    xs[1, :16] = 0
    xs[2, 17] = np.nan
    xs[3, 40] = np.inf
    x = torch.from_numpy(xs).to(DTYPES[xname]).cuda()
    gdev = torch.tensor([g], device="cuda")
    want = ref_of(x, "given", gdev)
    if not usable:
        assert not want[0].any() and (want[1] == 0x7F).all()
    counts = rawkv.nvfp4.error_counts()
    before = counts.clone()
    assert_q_equal(rawkv.nvfp4.quantize(x, scope="given", gs=gdev), want)
    ogs = torch.zeros((), device="cuda")
    got = rawkv.nvfp4.quantize(x, scope="given", gs=gdev, out=(None, None, ogs))
    assert_q_equal(got, want)                       # the out gs holds the given value, bit for bit
    delta = (counts - before).tolist()
    assert delta[rawkv.nvfp4.GIVEN_GS] == (0 if usable else 2) and delta[rawkv.nvfp4.GATHER_INDEX] == 0
    with np.errstate(invalid="ignore"):
        ref_y = R.dequantize(*want, "float32")
    y = rawkv.nvfp4.dequantize(*got, dtype=torch.float32)
    assert_decoded_equal(y, ref_y, "float32")
    if not usable:
        assert torch.isnan(y).all()
    if not usable and np.isfinite(g) and g > 0:     # the same value as a number is refused
        with pytest.raises(ValueError, match="^gs:"):
            rawkv.nvfp4.quantize(x, scope="given", gs=float(g))


def test_numpy_scalar_gs(cuda, rng):
    x = torch.from_numpy(rng.standard_normal((6, 64)).astype(np.float32)).cuda()
    g32 = np.float32(0.0123)
    want = ref_of(x, "given", float(g32))
    for g in (g32, np.float64(g32), float(g32)):
        assert_q_equal(rawkv.nvfp4.quantize(x, scope="given", gs=g), want)
        y = rawkv.nvfp4.dequantize(want_q(want[0]), want_q(want[1]), g, dtype=torch.float32)
        assert_decoded_equal(y, R.dequantize(want[0], want[1], g32, "float32"), "float32")
        idx = torch.tensor([5, 0], device="cuda")
        y = rawkv.nvfp4.gather(want_q(want[0]), want_q(want[1]), g, idx, dtype=torch.float32)
        assert_decoded_equal(y, R.dequantize(want[0], want[1], g32, "float32")[[5, 0]], "float32")
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=np.float64(1e39))


def want_q(a):
    """A reference byte array as a CUDA uint8 tensor."""
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


@pytest.mark.parametrize("n", [16, 32, 64])                 # one block per unit, two, rows of 4
@pytest.mark.parametrize("xname, gs", E.EDGE_CASES)
def test_modelopt_edge_rules(cuda, rng, xname, gs, n):
    # zero and signed-zero blocks (scale 0x38), blocks whose scale would round
    # to 0 (0x01, values kept), negative values whose quotient rounds to -0
    # (code 0) or not (0x8): every path of the kernels against the reference
    xs = E.as_rows(E.edge_blocks(xname, gs, rng), n)
    x = torch.from_numpy(xs).to(DTYPES[xname]).cuda()
    assert np.array_equal(x.float().cpu().numpy().view(np.uint32), xs.view(np.uint32))   # -0 too
    want = ref_of(x, "given", gs)
    hit = E.rules_hit(xs, want[0], want[1])
    assert hit["zero_block_scale_1"] >= 3 and hit["tiny_scale_2^-9"] >= 2 and hit["tiny_value_kept"] > 0
    assert hit["negative_zero_code_8"] > 0 and hit["minus_zero_code_0"] > 0
    if E.underflow_block(xname, gs) is not None:
        assert hit["negative_quotient_underflow_code_0"] > 0
    for g in (gs, torch.tensor([gs], device="cuda")):
        assert_q_equal(rawkv.nvfp4.quantize(x, scope="given", gs=g), want)
    for scope in ("none", "row", "tensor"):
        assert_q_equal(rawkv.nvfp4.quantize(x, scope=scope), ref_of(x, scope))
    big = x.repeat(rawkv.nvfp4.SMALL_NUMEL // x.numel() + 1, 1)          # the multi-kernel tensor path
    assert_q_equal(rawkv.nvfp4.quantize(big), ref_of(big, "tensor"))
    assert_q_equal(rawkv.nvfp4.quantize(big, scope="given", gs=gs), ref_of(big, "given", gs))
    y = rawkv.nvfp4.dequantize(want_q(want[0]), want_q(want[1]), gs, dtype=torch.float32)
    assert_decoded_equal(y, R.dequantize(want[0], want[1], np.float32(gs), "float32"), "float32")


TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
TIE_CODES = np.array([0, 2, 2, 4, 4, 6, 6, 7], np.uint8)    # the even neighbour; 6 is bmax
TIE_SCALES = [1.0, 0.5, 1.5, 0.875, 3.5, 448.0, 2.0 ** -9, 7 * 2.0 ** -9]   # E4M3 values


@pytest.mark.parametrize("gs", [None, 0.375, 1.25, "device"])
@pytest.mark.parametrize("n", [16, 32])                    # one block per unit, two
@pytest.mark.parametrize("xname", list(DTYPES))
def test_e2m1_ties_go_to_even(cuda, xname, n, gs):
    # Block i: [+-t * s_i * gs for t in TIES]. bmax = 6 * s_i * gs, so sf =
    # s_i, es = s_i * gs (not a power of two for gs 0.375, 1.25) and
    # x / es = +-t exactly: every t but 6 is an E2M1 tie. All values are
    # exact in BF16 and FP16 (tests/nvfp4/test_quantize.py checks that).
    gsv = {None: 1.0, "device": 0.375}.get(gs, gs)
    t = np.concatenate([TIES, -TIES])
    xs = (np.stack([t * s for s in TIE_SCALES]) * gsv).astype(np.float32).reshape(-1, n)
    x = torch.from_numpy(xs).to(DTYPES[xname]).cuda()
    assert np.array_equal(x.float().cpu().numpy(), xs)
    scope = "none" if gs is None else "given"
    g_arg = torch.tensor([gsv], device="cuda") if gs == "device" else gs
    got = rawkv.nvfp4.quantize(x, scope=scope, gs=g_arg)
    want = ref_of(x, scope, None if gs is None else gsv)
    assert_q_equal(got, want)
    codes = R.unpack_nibbles(u8(got[0])).reshape(-1, 16)
    assert (codes == np.concatenate([TIE_CODES, TIE_CODES | 8])).all()


@pytest.mark.parametrize("scope,m", [("tensor", 1), ("tensor", 64), ("row", 8), ("tensor", 300)])
def test_graph_capture_quantize_dequantize(cuda, rng, scope, m):
    rawkv.warmup()
    x = torch.from_numpy(rng.standard_normal((m, 7168)).astype(np.float32)).to(torch.bfloat16).cuda()
    q = torch.empty((m, 3584), dtype=torch.uint8, device="cuda")
    sf = torch.empty((m, 448), dtype=torch.uint8, device="cuda")
    gs = torch.empty(() if scope == "tensor" else (m,), device="cuda")
    y = torch.empty((m, 7168), dtype=torch.bfloat16, device="cuda")

    def step():
        rawkv.nvfp4.quantize(x, scope=scope, out=(q, sf, gs))
        rawkv.nvfp4.dequantize(q, sf, gs, out=y)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    eager = (u8(q).copy(), u8(sf).copy(), gs.cpu().clone(), y.cpu().clone())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for t in (q, sf, y):
        t.zero_()
    gs.fill_(123.0)
    g.replay()
    torch.cuda.synchronize()
    assert np.array_equal(u8(q), eager[0]) and np.array_equal(u8(sf), eager[1])
    assert torch.equal(gs.cpu(), eager[2]) and torch.equal(y.cpu().view(torch.int16), eager[3].view(torch.int16))
    x.mul_(2)                          # replay sees new data
    g.replay()
    assert_q_equal((q, sf, gs), ref_of(x, scope))
