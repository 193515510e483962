"""rawkv.nvfp4.dequantize (and the tests that hold dequantize and gather, which
share the decode kernel, to the same rules): argument errors, the launch plan,
and the CUDA kernel against the reference.

The launch-plan tests run the CUDA path on a CPU: CPU tensors that report
is_cuda and a runtime that records launches instead of making them
(tests/nvfp4/conftest.py). Every launch goes through its declaration
(rawkv.kernels.nvfp4), so a wrong keyword, a scalar of the wrong C type or a
missing argument fails there; the tests also check which buffer each pointer
parameter receives."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import nvfp4 as R  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.nvfp4 import DTYPES, assert_decoded_equal, u8  # noqa: E402
from support.properties import (  # noqa: E402
    BYTES, GS, SETTINGS, _gs, _gs_ref, _q_sf, host, judge, layouts, leads, libs, make, seeds, widths)


# ---- argument errors --------------------------------------------------------------------------------
def test_q_alignment_checked_on_cpu_as_on_cuda():
    # the kernels load q 4 bytes at a time: a q view at an odd address is
    # refused by dequantize and gather on CPU tensors as on CUDA ones
    torch = pytest.importorskip("torch")
    buf = torch.zeros(4 * 8 + 4, dtype=torch.uint8)
    sf = torch.zeros(4, 1, dtype=torch.uint8)
    assert buf.data_ptr() % 16 == 0
    for off in (1, 2, 3):
        with pytest.raises(ValueError, match="^q: data must be 4-byte aligned"):
            rawkv.nvfp4.dequantize(buf[off:off + 32].view(4, 8), sf, 1.0)
        with pytest.raises(ValueError, match="^q: data must be 4-byte aligned"):
            rawkv.nvfp4.gather(buf[off:off + 32].view(4, 8), sf, 1.0, torch.tensor([0]))
    y = rawkv.nvfp4.dequantize(buf[4:36].view(4, 8), buf[1:5].view(4, 1), 1.0)   # what the kernel needs
    assert y.shape == (4, 16)


@SETTINGS
@given(seed=seeds, lead=leads, n=widths, lib=libs, layout=layouts, sf_dt=st.sampled_from(BYTES + ("int8",)),
       gs=st.sampled_from(GS + ["rows"]), dtype=st.sampled_from([None, "float32", "float16", "bfloat16", "int8"]))
def test_nvfp4_dequantize(seed, lead, n, lib, layout, sf_dt, gs, dtype):
    q, sf = _q_sf(seed, lead, n, lib, layout, sf_dt)
    g = make(seed, lead, "float32", lib) * 0 + 0.5 if gs == "rows" else _gs(gs, seed, lib)
    judge(lambda: rawkv.nvfp4.dequantize(q, sf, g, dtype=dtype), ("q", "sf", "gs", "dtype"),
          lambda: RN.dequantize(host(q), host(sf), host(g) if gs == "rows" else _gs_ref(g), dtype or "bfloat16"))


def test_misaligned_q_refused(cuda, rng):
    # rkv_nvfp4_gather loads q as 4-byte words: q must be 4-byte aligned
    # (ValueError naming q, nothing written); sf may sit at any byte
    x = torch.from_numpy(rng.standard_normal((8, 64)).astype(np.float32)).cuda()
    q, sf, gs = rawkv.nvfp4.quantize(x)
    idx = torch.tensor([7, 0, 3], device="cuda")
    buf = torch.zeros(8 * 32 + 16, dtype=torch.uint8, device="cuda")
    out = torch.full((8, 64), 3.0, dtype=torch.bfloat16, device="cuda")
    for off in (1, 2, 3, 6):
        qm = buf[off:off + 8 * 32].view(8, 32)
        qm.copy_(q.view(torch.uint8))
        with pytest.raises(ValueError, match="^q:"):
            rawkv.nvfp4.dequantize(qm, sf, gs, out=out)
        with pytest.raises(ValueError, match="^q:"):
            rawkv.nvfp4.gather(qm, sf, gs, idx, out=out[:3])
    assert (out.float() == 3.0).all()
    q4 = buf[4:4 + 8 * 32].view(8, 32)               # 4-byte aligned: what the kernel needs
    q4.copy_(q.view(torch.uint8))
    sfb = torch.zeros(8 * 4 + 1, dtype=torch.uint8, device="cuda")
    sf1 = sfb[1:].view(8, 4)                          # odd address
    sf1.copy_(sf.view(torch.uint8))
    want = R.dequantize(u8(q), u8(sf), gs.cpu().numpy(), "float32")
    assert_decoded_equal(rawkv.nvfp4.dequantize(q4, sf1, gs, dtype=torch.float32), want, "float32")
    assert_decoded_equal(rawkv.nvfp4.gather(q4, sf1, gs, idx, dtype=torch.float32), want[[7, 0, 3]], "float32")


# ---- launch plan ------------------------------------------------------------------------------------
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
    assert a["errors"] == rt._counters.data_ptr() + 4 * rawkv.nvfp4.GATHER_INDEX


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
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
