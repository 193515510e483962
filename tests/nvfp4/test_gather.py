"""rawkv.nvfp4.gather: rows of an NVFP4 tensor decoded, bounds-checked (a bad
index row is zeros and counted), on CPU and CUDA (the launch plan, shared with
dequantize, is in test_dequantize.py)."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import layouts as L  # noqa: E402
from rawkv.reference import nvfp4 as R  # noqa: E402
from rawkv.reference import layouts as RL  # noqa: E402
from support.nvfp4 import assert_decoded_equal, u8  # noqa: E402
from support.properties import (  # noqa: E402
    GS, SETTINGS, _gs, _gs_ref, _q_sf, host, judge, libs, make, seeds, shapes, widths)


# ---- the reference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_gather_bad_index_row_is_zeros_and_counted(rng, idx_dtype):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((9, 64)).astype(np.float32)
    q, sf, gs = R.quantize(x, "row")
    idx = np.array([3, -1, 8, 9, 0, 1 << 30, 3], idx_dtype)
    bad = (idx < 0) | (idx >= 9)
    y, nerr = L.gather(q, sf, gs, idx, "float32")
    assert nerr == 3
    full = R.dequantize(q, sf, gs, "float32")
    assert np.array_equal(y[~bad], full[idx[~bad]])
    assert not y[bad].any() and not np.signbit(y[bad]).any()                   # +0.0
    # the op: errors= given is added to; an out= buffer's bad rows become zeros
    err = np.full(1, 5, np.int32)
    out = np.full((7, 64), 7.0, np.float32)
    counts = rawkv.nvfp4.error_counts("cpu")
    before = counts.copy()
    y2 = rawkv.nvfp4.gather(q, sf, gs, idx, dtype="float32", out=out, errors=err)
    assert y2 is out and err[0] == 8 and np.array_equal(out, y)
    errt = torch.zeros(2, dtype=torch.int32)
    rawkv.nvfp4.gather(torch.from_numpy(q), torch.from_numpy(sf), torch.from_numpy(gs),
                       torch.from_numpy(idx), errors=errt)
    assert errt.tolist() == [3, 0]
    assert np.array_equal(counts, before)
    # no errors=: kept in the CPU counter the caller reads
    rawkv.nvfp4.gather(q, sf, gs, idx, dtype="float32")
    assert counts[rawkv.nvfp4.GATHER_INDEX] - before[rawkv.nvfp4.GATHER_INDEX] == 3
    assert counts[rawkv.nvfp4.GIVEN_GS] == before[rawkv.nvfp4.GIVEN_GS]


# ---- argument errors --------------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, rows=st.integers(0, 5), n=widths, lib=libs, gs=st.sampled_from(GS[:4] + ["rows"]),
       idx_shape=shapes, idx_dt=st.sampled_from(["int32", "int64", "uint8", "float32"]),
       errors=st.sampled_from([None, "int32", "int64", "empty"]))
def test_nvfp4_gather(seed, rows, n, lib, gs, idx_shape, idx_dt, errors):
    q, sf = _q_sf(seed, (rows,), n, lib, "contiguous")
    g = make(seed, (rows,), "float32", lib) * 0 + 0.5 if gs == "rows" else _gs(gs, seed, lib)
    idx = make(seed + 2, idx_shape, idx_dt, lib, lo=-2, hi=rows + 2)
    err = None if errors is None else make(seed, (0,) if errors == "empty" else (1,),
                                           "int32" if errors == "empty" else errors, "numpy", lo=0, hi=1)

    def reference():
        y, nerr = RL.gather(host(q), host(sf), host(g) if gs == "rows" else _gs_ref(g), host(idx),
                            "bfloat16")
        if err is not None:
            assert err[0] == nerr
        return y.reshape(*host(idx).shape, host(q).shape[-1] * 2)
    judge(lambda: rawkv.nvfp4.gather(q, sf, g, idx, errors=err), ("q", "sf", "gs", "indices", "errors"),
          reference)


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rowgs", [False, True])
@pytest.mark.parametrize("n", [16, 512, 7168])
def test_gather_bad_rows_zeros_and_counted(cuda, rng, idx_dtype, rowgs, n):
    m = 333
    x = torch.from_numpy(rng.standard_normal((m, n)).astype(np.float32)).to(torch.bfloat16).cuda()
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row" if rowgs else "tensor")
    idx_np = rng.integers(0, m, 64)
    idx_np[[1, 5, 9, 60]] = [-1, m, 1 << 30, -(1 << 30)]
    idx = torch.from_numpy(idx_np).to(idx_dtype).cuda()
    want, nerr = L.gather(u8(q), u8(sf), gs.cpu().numpy(), idx_np, "bfloat16")
    assert nerr == 4 and not want[[1, 5, 9, 60]].any()
    counts = rawkv.nvfp4.error_counts()
    before = counts.clone()
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((64, n), 7.0, dtype=torch.bfloat16, device="cuda")
    rawkv.nvfp4.gather(q, sf, gs, idx, out=out, errors=errors)
    assert int(errors.item()) == nerr
    assert_decoded_equal(out, want, "bfloat16")                   # bad rows: zeros, not 7
    assert torch.equal(counts, before)                            # counted in errors= only
    out.fill_(7.0)
    rawkv.nvfp4.gather(q, sf, gs, idx, out=out)                   # no errors=: the device counter
    assert_decoded_equal(out, want, "bfloat16")
    y = rawkv.nvfp4.gather(q, sf, gs, idx, dtype=torch.float32)   # a fresh output: every row written
    want32, _ = L.gather(u8(q), u8(sf), gs.cpu().numpy(), idx_np, "float32")
    assert_decoded_equal(y, want32, "float32")
    delta = (counts - before).tolist()
    assert delta[rawkv.nvfp4.GATHER_INDEX] == 2 * nerr and delta[rawkv.nvfp4.GIVEN_GS] == 0


def test_gather_2d_indices(cuda, rng):
    x = torch.from_numpy(rng.standard_normal((40, 64)).astype(np.float32)).cuda()
    q, sf, gs = rawkv.nvfp4.quantize(x)
    idx = torch.from_numpy(rng.integers(0, 40, (3, 5))).cuda()
    y = rawkv.nvfp4.gather(q, sf, gs, idx, dtype=torch.float16)
    assert y.shape == (3, 5, 64)
    full = rawkv.nvfp4.dequantize(q, sf, gs, dtype=torch.float16)
    assert torch.equal(y.view(torch.int16), full[idx].view(torch.int16))
    y0 = rawkv.nvfp4.gather(q, sf, gs, idx[1, 2], dtype=torch.float16)       # a 0-d index: shape (N,)
    assert y0.shape == (64,) and torch.equal(y0.view(torch.int16), full[idx[1, 2]].view(torch.int16))
