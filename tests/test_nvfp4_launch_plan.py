"""The CUDA paths of the NVFP4 ops on a CPU: CPU tensors that report
is_cuda and a runtime that records launches instead of making them. Every
launch goes through its declaration (rawkv.kernels.nvfp4), so a wrong
keyword, a scalar of the wrong C type or a missing argument fails here; the
tests also check which buffer each pointer parameter receives. What the
kernels compute is checked on the GPU (test_nvfp4_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

import rawkv
from rawkv.kernels import nvfp4 as K
from rawkv.nvfp4 import activation, counters, decode, encode, scales

torch = pytest.importorskip("torch")
from support.fake_cuda import RecordingRuntime, fake, install  # noqa: E402,F401  (RecordingRuntime: the fused tests import it from here)


@pytest.fixture
def rt(monkeypatch):
    return install(monkeypatch, (encode, activation, decode, scales))


def names(rt):
    return [c[0] for c in rt.calls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [32, 48])
def test_quantize_scopes(rt, dtype, n):
    ct = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}[dtype]
    bpt = 2 if n % 32 == 0 else 1
    x = fake(torch.ones(3, n, dtype=dtype))
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row")
    (name, _, _, a), = rt.calls
    assert name == f"rkv_nvfp4_quantize_rows<{ct}, {bpt}, 1>"
    assert (a["x"], a["q"], a["sf"], a["gs_out"]) == (x.data_ptr(), q.data_ptr(), sf.data_ptr(), gs.data_ptr())
    assert (a["M"], a["upr"], a["ldx"]) == (3, n // (16 * bpt), n) and gs.shape == (3,)

    rt.calls.clear()
    q, sf, gs = rawkv.nvfp4.quantize(x)                               # small: one launch
    (name, grid, block, a), = rt.calls
    assert name == f"rkv_nvfp4_quantize_small<{ct}, {bpt}>" and a["gs_out"] == gs.data_ptr()

    rt.calls.clear()
    big = fake(torch.ones(rawkv.nvfp4.SMALL_NUMEL // n + 1, n, dtype=dtype))
    q, sf, gs = rawkv.nvfp4.quantize(big)
    assert names(rt) == ["memset", f"rkv_nvfp4_amax<{ct}>", f"rkv_nvfp4_quantize<{ct}, {bpt}, {K.MODE_AMAX}>",
                         "rkv_nvfp4_finalize_gs"]
    g = gs.data_ptr()
    assert rt.calls[0][1:] == (g, 0, 4)
    assert rt.calls[1][3]["amax_bits"] == g
    assert rt.calls[2][3]["gs_ptr"] == g and rt.calls[2][3]["gs_out"] == 0 and rt.calls[2][3]["errors"] == 0
    assert rt.calls[3][3] == {"gs": g}

    rt.calls.clear()
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=np.float32(0.25))
    (name, _, _, a), = rt.calls
    assert name == f"rkv_nvfp4_quantize<{ct}, {bpt}, {K.MODE_GIVEN}>"
    assert (a["gs_ptr"], a["gs_val"], a["gs_out"], a["errors"]) == (0, 0.25, gs.data_ptr(), 0)

    rt.calls.clear()
    gdev = fake(torch.full((1,), 0.5))
    counter = counters._CUDA[-1].data_ptr()
    for ogs in (None, fake(torch.zeros(()))):
        q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=gdev, out=(None, None, ogs))
        a = rt.calls[-1][3]
        assert a["gs_ptr"] == gdev.data_ptr() and a["errors"] == counter + 4 * rawkv.nvfp4.GIVEN_GS
        if ogs is None:
            assert gs.data_ptr() == gdev.data_ptr() and a["gs_out"] == 0     # the given tensor is gs
        else:
            assert gs is ogs and a["gs_out"] == ogs.data_ptr()
    rt.calls.clear()
    rawkv.nvfp4.quantize(x, scope="none")
    assert rt.calls[0][3]["gs_val"] == 1.0 and rt.calls[0][3]["gs_ptr"] == 0


def test_quantize_errors_counter(rt):
    """errors= takes the place of the device counter for a device gs; the
    operator passes its buffers, the given gs is the gs (no gs_out)."""
    import rawkv.library  # noqa: F401  (registers torch.ops.rawkv)
    x = fake(torch.ones(2, 32))
    gdev = fake(torch.full((1,), 0.5))
    err = fake(torch.zeros(1, dtype=torch.int32))
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=gdev, errors=err)
    assert rt.calls[-1][3]["errors"] == err.data_ptr() and gs.data_ptr() == gdev.data_ptr()
    rawkv.nvfp4.quantize(x, scope="given", gs=0.5, errors=err)       # a number: checked on the host
    assert rt.calls[-1][3]["errors"] == 0
    qb, sfb = fake(torch.empty(2, 16, dtype=torch.uint8)), fake(torch.empty(2, 2, dtype=torch.uint8))
    torch.ops.rawkv.nvfp4_quantize(x, "given", gdev, None, qb, sfb, None, err)
    a = rt.calls[-1][3]
    assert (a["q"], a["sf"], a["gs_ptr"], a["gs_out"], a["errors"]) == (
        qb.data_ptr(), sfb.data_ptr(), gdev.data_ptr(), 0, err.data_ptr())
    n = len(rt.calls)
    for bad, exc in ((err.long(), TypeError), (fake(torch.zeros(0, dtype=torch.int32)), ValueError)):
        with pytest.raises(exc, match="^errors:"):
            rawkv.nvfp4.quantize(x, scope="given", gs=gdev, errors=bad)
    assert len(rt.calls) == n


def test_quantize_long_rows_and_views(rt):
    x = fake(torch.ones(2, 16 * 2 * (K.MAX_BLOCK_THREADS + 1)))         # upr > MAX_BLOCK_THREADS: R = 0
    rawkv.nvfp4.quantize(x, scope="row")
    assert rt.calls[0][0] == "rkv_nvfp4_quantize_rows<float, 2, 0>"
    rt.calls.clear()
    base = fake(torch.ones(12, 96, dtype=torch.bfloat16))
    v = base[::2, 32:96]
    rawkv.nvfp4.quantize(v, scope="none")
    a = rt.calls[0][3]
    assert a["x"] == v.data_ptr() and a["ldx"] == 192 and a["M"] == 6


def test_quantize_refuses_unusable_numbers_before_launching(rt):
    x = fake(torch.ones(2, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=2e7)               # the float16 bound
    rawkv.nvfp4.quantize(x.float(), scope="given", gs=2e7)         # usable for float32
    assert len(rt.calls) == 1


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_and_gather(rt, out_dtype):
    ct = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}[out_dtype]
    q = fake(torch.zeros(5, 3, 32, dtype=torch.uint8))
    sf = fake(torch.zeros(5, 3, 4, dtype=torch.uint8))
    y = rawkv.nvfp4.dequantize(q, sf, 0.5, dtype=out_dtype)
    (name, _, _, a), = rt.calls
    assert name == f"rkv_nvfp4_gather<{ct}, int, false>" and y.shape == (5, 3, 64)
    assert (a["idx"], a["errors"], a["gs_ptr"], a["gs_val"]) == (0, 0, 0, 0.5)
    assert (a["M"], a["rows_out"], a["n8"], a["ldo"]) == (15, 15, 8, 64)

    rt.calls.clear()
    gs_rows = fake(torch.ones(5, 3))
    idx = fake(torch.tensor([[1, 20], [-1, 3]]))
    err = fake(torch.zeros(1, dtype=torch.int32))
    y = rawkv.nvfp4.gather(q, sf, gs_rows, idx, dtype=out_dtype, errors=err)
    (name, _, _, a), = rt.calls
    assert name == f"rkv_nvfp4_gather<{ct}, long long, true>" and y.shape == (2, 2, 64)
    assert (a["gs_ptr"], a["idx"], a["errors"], a["out"]) == (gs_rows.data_ptr(), idx.data_ptr(),
                                                              err.data_ptr(), y.data_ptr())
    assert (a["M"], a["rows_out"]) == (15, 4)
    assert y.dtype == out_dtype and (y == 7).all()      # not zero-filled on the host: the kernel writes every row

    rt.calls.clear()
    rawkv.nvfp4.gather(q, sf, fake(torch.tensor(2.0)), idx.int(), dtype=out_dtype)    # no errors=
    a = rt.calls[0][3]
    assert rt.calls[0][0] == f"rkv_nvfp4_gather<{ct}, int, false>"
    assert a["errors"] == counters._CUDA[-1].data_ptr() + 4 * rawkv.nvfp4.GATHER_INDEX


def test_swizzle(rt):
    sf = fake(torch.zeros(130, 7, dtype=torch.uint8))
    sw = rawkv.nvfp4.swizzle_scales(sf)
    (name, _, _, a), = rt.calls
    assert name == "rkv_nvfp4_swizzle" and sw.numel() == rawkv.nvfp4.swizzled_size(130, 7)
    assert a == {"sf": sf.data_ptr(), "out": sw.data_ptr(), "rows": 130, "cols": 7, "ncb": 2,
                 "nwords": sw.numel() // 4}
    rt.calls.clear()
    back = rawkv.nvfp4.unswizzle_scales(sw, (2, 65, 7))
    (name, _, _, a), = rt.calls
    assert name == "rkv_nvfp4_unswizzle" and back.shape == (2, 65, 7)
    assert a == {"sw": sw.data_ptr(), "sf": back.data_ptr(), "rows": 130, "cols": 7, "ncb": 2}


def test_empty_inputs_launch_nothing(rt):
    x = fake(torch.ones(0, 32))
    q, sf, gs = rawkv.nvfp4.quantize(x)
    assert float(gs) == 1.0
    rawkv.nvfp4.dequantize(q, sf, gs)
    rawkv.nvfp4.gather(fake(torch.zeros(3, 16, dtype=torch.uint8)), fake(torch.zeros(3, 2, dtype=torch.uint8)),
                       1.0, fake(torch.zeros(0, dtype=torch.int64)))
    assert rt.calls == []
