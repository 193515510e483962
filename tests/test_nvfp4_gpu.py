"""NVFP4 CUDA kernels vs the numpy reference, bit for bit (GPU; skipped
without one). NaN outputs compare as both-NaN."""
from __future__ import annotations

import numpy as np
import pytest

import rawkv
from rawkv.reference import layouts as L
from rawkv.reference import nvfp4 as R
from rawkv.reference.formats import bf16_bits

torch = pytest.importorskip("torch")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def u8(t):
    return t.view(torch.uint8).cpu().numpy()


def f32bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_q_equal(got, want):
    q, sf, gs = got
    rq, rsf, rgs = want
    assert np.array_equal(u8(q), rq), "q differs"
    assert np.array_equal(u8(sf), rsf), "sf differs"
    assert np.array_equal(f32bits(gs.cpu().numpy()), f32bits(rgs)), "gs differs"


def assert_decoded_equal(y, ref, name):
    y = y.cpu()
    if name == "bfloat16":
        got = y.view(torch.int16).numpy().view(np.uint16)
        want = bf16_bits(ref)
        nan_g = np.isnan(y.float().numpy())
    elif name == "float16":
        got = y.numpy().view(np.uint16)
        want = np.asarray(ref, np.float16).view(np.uint16)
        nan_g = np.isnan(y.numpy())
    else:
        got = y.numpy().view(np.uint32)
        want = np.asarray(ref, np.float32).view(np.uint32)
        nan_g = np.isnan(y.numpy())
    nan_w = np.isnan(np.asarray(ref, np.float32))
    assert np.array_equal(nan_g, nan_w), "NaN positions differ"
    assert np.array_equal(got[~nan_w], want[~nan_w]), "values differ"


def ref_of(x_gpu, scope, gs=None):
    xs = x_gpu.float().cpu().numpy()
    g = None if gs is None else np.float32(gs if isinstance(gs, float) else gs.cpu().item())
    return R.quantize(xs, scope, g)


def all_bf16_cuda():
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).cuda()


# ---- element conversions: every BF16 input -------------------------------------
@pytest.mark.parametrize("scope", ["none", "given", "tensor"])
def test_all_bf16_values_as_single_element_blocks(cuda, scope):
    # block i holds BF16 value i alone: sf = e4m3(v / (gs*6)), code = e2m1(v / es)
    v = all_bf16_cuda()
    x = torch.zeros((1 << 16, 16), dtype=torch.bfloat16, device="cuda")
    x[:, 0] = v
    x[:, 5] = v * 0.37       # a second value in the block: exercises e2m1 below bmax
    gs = 0.25 if scope == "given" else None
    got = rawkv.nvfp4.quantize(x, scope=scope, gs=gs)
    assert_q_equal(got, ref_of(x, scope, gs))


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


@pytest.mark.parametrize("name", list(DTYPES))
def test_decode_every_scale_byte_and_code(cuda, name):
    # row r: all 32 blocks scaled by E4M3 byte r; the 256 bytes of q hold every code pair
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1).cuda()
    sf = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 32).cuda()
    for gs in (1.0, 0.0173, 3.5e-7):
        y = rawkv.nvfp4.dequantize(q, sf, gs, dtype=DTYPES[name])
        assert_decoded_equal(y, R.dequantize(u8(q), u8(sf), np.float32(gs), name), name)
    g = torch.rand(256, device="cuda") * 100
    y = rawkv.nvfp4.dequantize(q, sf, g, dtype=DTYPES[name])
    assert_decoded_equal(y, R.dequantize(u8(q), u8(sf), g.cpu().numpy(), name), name)


# ---- random tensors ---------------------------------------------------------------
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


# ---- gather -------------------------------------------------------------------------
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rowgs", [False, True])
@pytest.mark.parametrize("n", [16, 512, 7168])
def test_gather_skips_and_counts(cuda, rng, idx_dtype, rowgs, n):
    m = 333
    x = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32)).to(torch.bfloat16).cuda()
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row" if rowgs else "tensor")
    idx_np = rng.integers(0, m, 64)
    idx_np[[1, 5, 9, 60]] = [-1, m, 1 << 30, -(1 << 30)]
    idx = torch.from_numpy(idx_np).to(idx_dtype).cuda()
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((64, n), 7.0, dtype=torch.bfloat16, device="cuda")
    rawkv.nvfp4.gather(q, sf, gs, idx, out=out, errors=errors)
    ref_out = np.full((64, n), 7.0, np.float32)
    want, nerr = L.gather(u8(q), u8(sf), gs.cpu().numpy(), idx_np, "bfloat16", out=ref_out)
    assert int(errors.item()) == nerr == 4
    assert_decoded_equal(out, want, "bfloat16")
    y = rawkv.nvfp4.gather(q, sf, gs, idx, dtype=torch.float32)       # fresh output: zeros
    want0, _ = L.gather(u8(q), u8(sf), gs.cpu().numpy(), idx_np, "float32")
    assert_decoded_equal(y, want0, "float32")


def test_gather_2d_indices(cuda, rng):
    x = torch.from_numpy(rng.standard_normal((40, 64)).astype(np.float32)).cuda()
    q, sf, gs = rawkv.nvfp4.quantize(x)
    idx = torch.from_numpy(rng.integers(0, 40, (3, 5))).cuda()
    y = rawkv.nvfp4.gather(q, sf, gs, idx, dtype=torch.float16)
    assert y.shape == (3, 5, 64)
    full = rawkv.nvfp4.dequantize(q, sf, gs, dtype=torch.float16)
    assert torch.equal(y.view(torch.int16), full[idx].view(torch.int16))


# ---- swizzle ------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (128, 4), (130, 448), (257, 9), (2, 3, 7), (4096, 448)])
def test_swizzle_gpu(cuda, rng, shape):
    sf = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)).cuda()
    sw = rawkv.nvfp4.swizzle_scales(sf)
    assert np.array_equal(u8(sw), L.swizzle_scales(u8(sf)))
    back = rawkv.nvfp4.unswizzle_scales(sw, shape)
    assert np.array_equal(u8(back), u8(sf))


# ---- bad arguments: the error names the argument, nothing is written ------------------
def test_bad_arguments_write_nothing(cuda):
    x = torch.randn(4, 64, device="cuda")
    q = torch.full((4, 32), 0xAB, dtype=torch.uint8, device="cuda")
    sf = torch.full((4, 4), 0xAB, dtype=torch.uint8, device="cuda")
    gs = torch.full((), 5.0, device="cuda")
    bad_sf = torch.full((4, 3), 0xAB, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"^out\[1\]:"):
        rawkv.nvfp4.quantize(x, out=(q, bad_sf, gs))
    with pytest.raises(TypeError, match=r"^out\[2\]:"):
        rawkv.nvfp4.quantize(x, out=(q, sf, gs.double()))
    with pytest.raises(ValueError, match="^x:"):
        rawkv.nvfp4.quantize(torch.randn(4, 40, device="cuda"), out=(q, sf, gs))
    with pytest.raises(TypeError, match="^x:"):
        rawkv.nvfp4.quantize(torch.ones(4, 64, dtype=torch.int32, device="cuda"), out=(q, sf, gs))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=torch.ones(2, device="cuda"), out=(q, sf, gs))
    assert (u8(q) == 0xAB).all() and (u8(sf) == 0xAB).all() and float(gs) == 5.0
    out = torch.full((4, 64), 3.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^sf:"):
        rawkv.nvfp4.dequantize(q, bad_sf, 1.0, out=out)
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.dequantize(q, sf, torch.ones(3, device="cuda"), out=out)
    with pytest.raises(TypeError, match="^out:"):
        rawkv.nvfp4.dequantize(q, sf, 1.0, dtype=torch.float32, out=out)
    with pytest.raises(TypeError, match="^indices:"):
        rawkv.nvfp4.gather(q, sf, 1.0, torch.zeros(2, device="cuda"), out=out[:2])
    with pytest.raises(TypeError, match="^errors:"):
        rawkv.nvfp4.gather(q, sf, 1.0, torch.zeros(4, dtype=torch.int64, device="cuda"), out=out,
                           errors=torch.zeros(1, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="^indices:"):
        rawkv.nvfp4.gather(q, sf, 1.0, torch.zeros(4, dtype=torch.int64), out=out)   # CPU indices
    assert (out.float() == 3.0).all()
    with pytest.raises(ValueError, match="^sw:"):
        rawkv.nvfp4.unswizzle_scales(torch.zeros(100, dtype=torch.uint8, device="cuda"), (4, 4))


# ---- CUDA graph capture ----------------------------------------------------------------------
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
