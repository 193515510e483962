"""FP8 block scales at any layout (docs/format.md, "Scale layouts"): every
op that writes or reads FP8 block scales (rawkv.fp8.quantize_blocks /
dequantize_blocks, the FP8 producers, the W4A8 GEMM) takes a scales view
whose leading dimensions collapse into one evenly strided row index, at any
row and block strides: DeepSeek's row-major (M, K/block) and DeepGEMM's
SM90 MN-major, TMA-aligned layout (deep_gemm get_mn_major_tma_aligned_tensor
at 54e22612: the token index contiguous, each block's column padded to a
multiple of 4 tokens). Written or read there, the values are those of the
row-major scales, bit for bit, on CPU and CUDA; a view two of whose scales
share memory, or whose rows are not one strided index, is refused for
writing, with nothing written."""
import numpy as np
import pytest

from rawkv import fp8, fused
from rawkv.reference.fp8_blocks import ue8m0_value

torch = pytest.importorskip("torch")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request):
    if request.param == "cuda":
        request.getfixturevalue("cuda")              # (skips without a GPU)
    return request.param


def mn_major_buffer(rows: int, blocks: int, dtype, device):
    """An empty DeepGEMM MN-major scales buffer (rows, blocks): strides
    (1, align(rows, 4)), its padding filled with a sentinel."""
    store = torch.full((blocks, -(-rows // 4) * 4), 7, dtype=dtype, device=device)
    view = store.t()[:rows]
    assert view.stride() == (1, store.shape[1])
    return store, view


def as_stored(scales, dtype):
    """Row-major scales as a buffer of `dtype` holds them: E8M0 bytes as
    uint8, or as their float32 powers of two (reference ue8m0_value) when
    the buffer is float32."""
    b = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
    if dtype == torch.float32 and b.dtype == torch.uint8:
        return torch.from_numpy(ue8m0_value(b.cpu().numpy())).to(scales.device)
    return b


def bits(t):
    t = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t
    return t.cpu().view(torch.int32 if t.element_size() == 4 else torch.uint8)


FORMATS = [("fp32", torch.float32), ("ue8m0", torch.float32), ("ue8m0", torch.uint8)]


@pytest.mark.parametrize("fmt, sdtype", FORMATS)
@pytest.mark.parametrize("m, k, block", [(1, 128, 128), (7, 384, 128), (33, 160, 32), (12, 1056, 128)])
def test_quantize_blocks_writes_mn_major_scales(dev, rng, fmt, sdtype, m, k, block):
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32) * 5).to(torch.bfloat16).to(dev)
    want_codes, want_scales = fp8.quantize_blocks(x, block=block, scale_format=fmt)
    nb = want_scales.shape[-1]
    store, view = mn_major_buffer(m, nb, sdtype, dev)
    codes, scales = fp8.quantize_blocks(x, block=block, scale_format=fmt, out=(None, view))
    assert scales is view and torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(bits(view), bits(as_stored(want_scales, sdtype)))
    pad = store[:, m:]
    assert (pad == 7).all(), "the padding tokens are not written"
    # read back in place: the values the row-major scales give
    got = fp8.dequantize_blocks(codes, view, block=block, dtype=torch.float32)
    assert torch.equal(got, fp8.dequantize_blocks(want_codes, want_scales, block=block, dtype=torch.float32))


def test_three_dimensional_scales_collapse_into_rows(dev, rng):
    # (T, G, nb) scales whose leading dimensions are one strided row index
    # (rows 5 elements apart, blocks 1 apart: a padded row-major buffer)
    x = torch.from_numpy(rng.standard_normal((3, 2, 256)).astype(np.float32)).to(torch.bfloat16).to(dev)
    _, want = fp8.quantize_blocks(x)
    store = torch.full((3, 2, 5), -1.0, device=dev)
    view = store[..., 1:3]
    fp8.quantize_blocks(x, out=(None, view))
    assert torch.equal(view, want) and (store[..., 0] == -1).all() and (store[..., 3:] == -1).all()


@pytest.mark.parametrize("case", ["overlapping", "rows-not-one-index"])
def test_scales_that_cannot_be_written_once_each_are_refused(dev, rng, case):
    x = torch.from_numpy(rng.standard_normal((4, 2, 256)).astype(np.float32)).to(torch.bfloat16).to(dev)
    if case == "overlapping":
        store = torch.full((4, 2, 1), 9.0, device=dev)
        view = store.expand(4, 2, 2)                                 # both blocks of a row at one address
    else:
        store = torch.full((2, 2, 4), 9.0, device=dev)
        view = store.permute(2, 0, 1)[:4]                            # (4, 2, 2): T stride 1, G stride 8
    message = "share memory" if case == "overlapping" else "not one evenly strided row index"
    with pytest.raises(ValueError, match=f"scales: .*{message}"):
        fp8.quantize_blocks(x, out=(None, view))
    assert (store == 9).all(), "nothing is written"


def _producers(rng, dev, m, n):
    """(name, call(out) -> Fp8Activation-like, lead, width) of each FP8
    producer on random inputs of m rows of width n."""
    x = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32)).to(torch.bfloat16).to(dev)
    w = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16).to(dev)
    h = torch.from_numpy(rng.standard_normal((m, 2 * n)).astype(np.float32)).to(torch.bfloat16).to(dev)
    X = torch.from_numpy(rng.standard_normal((m, 4, n)).astype(np.float32)).to(torch.bfloat16).to(dev)
    mix = torch.from_numpy(rng.random((m, 4)).astype(np.float32)).to(dev)
    ids = torch.from_numpy(rng.integers(0, 8, (m, 2)).astype(np.int32)).to(dev)
    wts = torch.from_numpy(rng.random((m, 2)).astype(np.float32)).to(dev)
    return [
        ("rmsnorm", lambda **kw: fused.rmsnorm_quantize_fp8(x, w, **kw)),
        ("mhc_rmsnorm", lambda **kw: fused.mhc_rmsnorm_quantize_fp8(X, mix, w, **kw)),
        ("swiglu", lambda **kw: fused.swiglu_quantize_fp8(h, **kw)),
        ("moe_stage", lambda **kw: fused.moe_stage_fp8(x, ids, wts, **kw)),
    ]


@pytest.mark.parametrize("fmt, sdtype", FORMATS)
@pytest.mark.parametrize("m", [1, 6, 13])
def test_producers_write_mn_major_scales(dev, rng, fmt, sdtype, m):
    n, block = 512, 128
    for name, call in _producers(rng, dev, m, n):
        want = call(block=block, scale_format=fmt)
        store, view = mn_major_buffer(m, n // block, sdtype, dev)
        codes = torch.empty_like(want.codes)
        rest = (torch.empty_like(want.topk_ids), torch.empty_like(want.topk_weights)) if name == "moe_stage" else ()
        got = call(block=block, scale_format=fmt, out=(codes, view, *rest))
        assert got.scales is view, name
        assert torch.equal(codes.view(torch.uint8), want.codes.view(torch.uint8)), name
        assert torch.equal(bits(view), bits(as_stored(want.scales, sdtype))), name
        assert (store[:, m:] == 7).all(), name


def test_scale_strides_are_the_views_row_and_block_steps():
    """rawkv.fp8.scale_strides, the two strides every FP8 kernel takes: the
    innermost non-1 leading dimension's stride, the last dimension's."""
    _, mn = mn_major_buffer(6, 3, torch.float32, "cpu")
    assert fp8.scale_strides(mn) == (1, 8)
    assert fp8.scale_strides(torch.empty(3, 2, 5)[..., 1:3]) == (5, 1)
    assert fp8.scale_strides(torch.empty(4, 3)) == (3, 1)
    assert fp8.scale_strides(torch.empty(1, 3)) == (3, 1)            # (one row: a stride nothing steps by)
    assert fp8.scale_strides(torch.empty(2, 1, 4).expand(2, 1, 4)) == (4, 1)


def test_kernels_get_the_views_strides(monkeypatch, rng):
    """The CUDA path on a CPU (tests/support/fake_cuda.py: launches recorded
    through the kernels' declarations): quantize_blocks, dequantize_blocks
    and every FP8 producer launch with the out= / given scales' buffer and
    their (s_row, s_blk), row-major (nb, 1) or MN-major (1, align(M, 4))."""
    from rawkv.fused import moe, rms, swiglu
    from support.fake_cuda import fake, install
    rt = install(monkeypatch, (fp8, rms, swiglu, moe))
    m, n = 6, 512

    def launched(call):
        rt.calls.clear()
        call()
        (_, _, _, args), = [c for c in rt.calls if c[0] != "memset"]
        return args

    def t(shape, dtype=torch.bfloat16):
        return fake(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype))
    x, w, h = t((m, n)), t((n,)), t((m, 2 * n))
    X, mix = t((m, 4, n)), fake(torch.rand(m, 4))
    ids, wts = fake(torch.zeros(m, 2, dtype=torch.int32)), fake(torch.rand(m, 2))
    for form in ("row-major", "mn-major"):
        sf = fake(torch.empty(m, n // 128)) if form == "row-major" else fake(mn_major_buffer(m, n // 128,
                                                                                           torch.float32, "cpu")[1])
        want = (n // 128, 1) if form == "row-major" else (1, 8)
        codes = fake(torch.empty(m, n, dtype=torch.uint8))
        calls = [lambda: fp8.quantize_blocks(x, out=(codes, sf)),
                 lambda: fp8.dequantize_blocks(codes, sf, dtype=torch.bfloat16),
                 lambda: fused.rmsnorm_quantize_fp8(x, w, out=(codes, sf)),
                 lambda: fused.mhc_rmsnorm_quantize_fp8(X, mix, w, out=(codes, sf)),
                 lambda: fused.swiglu_quantize_fp8(h, out=(codes, sf)),
                 lambda: fused.moe_stage_fp8(x, ids, wts, out=(codes, sf, fake(torch.empty(m, 2, dtype=torch.int64)),
                                                              fake(torch.empty(m, 2)))),
                 ]
        for i, call in enumerate(calls):
            args = launched(call)
            assert args["scales"] == sf.data_ptr() and (args["s_row"], args["s_blk"]) == want, (form, i, args)
