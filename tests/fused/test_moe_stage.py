"""rawkv.fused.moe_stage (one-level NVFP4 of the hidden states and the top-k
copy): the reference, argument errors, the CUDA kernel against the reference,
bit for bit."""
from __future__ import annotations

import re

import numpy as np
from support import nvfp4_edges as E
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import fused as F  # noqa: E402
from rawkv.reference import fused as R  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
from rawkv.reference.formats import bf16_round  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import fused as RFU  # noqa: E402
from support.fused import _assert_equal, _dt, _np, _rand, _with_edges  # noqa: E402
from support.properties import SETTINGS, host, judge, layouts, libs, make, p_dtypes, seeds, x_dtypes  # noqa: E402


# ---- the reference ----------------------------------------------------------------------------------
def test_pack_scales_layout():
    sf = np.arange(16, dtype=np.uint8).reshape(2, 8)
    w = R.pack_scales_i32(sf)
    assert w.dtype == np.int32 and w.shape == (2, 2)
    assert w.view(np.uint32)[0, 0] == 0x03020100 and w.view(np.uint32)[1, 1] == 0x0F0E0D0C
    assert np.array_equal(R.unpack_scales_i32(w), sf)


F32 = np.float32


def test_moe_stage_reference(rng):
    x = bf16_round(rng.standard_normal((5, 256)).astype(F32))
    x[1, 16:32] = np.nan
    ids = rng.integers(0, 64, (5, 6)).astype(np.int32)
    wts = rng.random((5, 6)).astype(F32)
    q, sf32, ids64, w = R.moe_stage(x, ids, wts)
    q2, sf2, _ = RN.quantize(x, "none")
    assert np.array_equal(q, q2) and np.array_equal(R.unpack_scales_i32(sf32), sf2)
    assert sf2[1, 1] == 0x7F and np.all(RN.unpack_nibbles(q)[1, 16:32] == 0)
    assert ids64.dtype == np.int64 and np.array_equal(ids64, ids) and np.array_equal(w, wts)
    # RNE ties (not rounding up): 0.25 * es -> 0, 2.5 * es -> 2
    t = np.zeros((1, 128), F32)
    t[0, :3] = [6.0, 0.25, 2.5]                     # bmax 6 -> sf = 1.0, es = 1
    codes = RN.unpack_nibbles(R.moe_stage(t, ids[:1], wts[:1])[0])
    assert list(codes[0, :3]) == [7, 0, 4]


def test_moe_stage_one_level_range():
    """gs = 1: a block's scale is e4m3(bmax / 6), never below 2^-9 (0x01,
    ModelOpt's clamp): a block whose scale would round to 0 keeps what E2M1
    times 2^-9 holds (|x| > 2^-11) instead of losing everything; normal
    scales (bmax >= 6 * 2^-6) keep the NVFP4 error bound; an all-zero block
    gets 1.0 (0x38)."""
    x = np.zeros((1, 128), F32)
    x[0, :16] = np.linspace(-1e-4, 1e-4, 16)                  # bmax 1e-4: scale 2^-9, |x| / 2^-9 < 0.25
    x[0, 16:32] = np.linspace(-1.0, 1.0, 16)                  # bmax 1.0
    x[0, 32:48] = np.linspace(-6 * 2.0**-10, 0, 16)           # bmax 6 * 2^-10: its tie rounded to 0 before
    x[0, 48:64] = np.linspace(0, 0.0078125, 16)               # bmax 2^-7: a subnormal scale, not lost
    q, sf32, _, _ = F.moe_stage(x, np.zeros((1, 1), np.int32), np.zeros((1, 1), F32))
    sf = R.unpack_scales_i32(sf32)
    codes = RN.unpack_nibbles(q)
    assert sf[0, 0] == 0x01 and np.all(codes[0, :16] & 7 == 0)
    assert np.array_equal(codes[0, :16] >> 3, (x[0, :16] < 0).astype(np.uint8))   # signed zeros
    assert sf[0, 2] == 0x01 and codes[0, 32] == 0x8 | 5                          # -3 * 2^-9: kept
    assert 0 < sf[0, 3] < 8 and np.any(codes[0, 48:64] & 7)
    assert np.all(sf[0, 4:] == 0x38) and not codes[0, 64:].any()
    d = RN.dequantize(q, sf, 1.0, "float32")
    assert d[0, 32] == -3 * 2.0**-9
    err = np.abs(d[0, 16:32] - x[0, 16:32])
    assert np.all(err <= 1.0 / 6 * (1 + 2.0**-4)), err.max()     # half the widest E2M1 gap x es


# ---- argument errors --------------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, m=st.integers(0, 4), k=st.sampled_from([128, 256, 0, 64, 130]), top=st.integers(0, 3),
       xdt=x_dtypes, idt=st.sampled_from(("int32", "int64", "float32", "uint8")), wdt=p_dtypes, lib=libs,
       layout=layouts, special=st.booleans())
def test_fused_moe_stage(seed, m, k, top, xdt, idt, wdt, lib, layout, special):
    hidden = make(seed, (m, k), xdt, lib, layout, special)
    ids = make(seed + 1, (m, top), idt, lib, lo=-3, hi=300)
    wts = make(seed + 2, (m, top), wdt, lib, special=special)
    judge(lambda: rawkv.fused.moe_stage(hidden, ids, wts), ("hidden", "topk_ids", "topk_weights"),
          lambda: RFU.moe_stage(host(hidden), host(ids), host(wts)))


def test_moe_argument_errors_write_nothing(cuda):
    x = torch.randn(2, 256, device="cuda").bfloat16()
    ids = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    wts = torch.zeros(2, 4, device="cuda")
    out = (torch.full((2, 128), 0xAB, dtype=torch.uint8, device="cuda"),
           torch.full((2, 4), 7, dtype=torch.int32, device="cuda"),
           torch.full((2, 4), 7, dtype=torch.int64, device="cuda"),
           torch.full((2, 4), 7.0, device="cuda"))
    bad = [("topk_ids", lambda: F.moe_stage(x, ids.float(), wts, out=out)),
           ("topk_weights", lambda: F.moe_stage(x, ids, wts.to(torch.int32), out=out)),
           ("hidden", lambda: F.moe_stage(x.float(), ids, wts, out=out)),
           ("out.sf", lambda: F.moe_stage(x, ids, wts, out=(out[0], out[1].view(torch.uint8), out[2], out[3]))),
           ("out.topk_ids", lambda: F.moe_stage(x, ids, wts, out=(out[0], out[1], out[2].int(), out[3]))),
           ("out.topk_weights", lambda: F.moe_stage(x, ids, wts, out=(out[0], out[1], out[2], out[3].half())))]
    for name, call in bad:
        with pytest.raises((ValueError, TypeError)) as ei:
            call()
        assert re.match(rf"{re.escape(name)}[:\s(]", str(ei.value)), (name, str(ei.value))
    torch.cuda.synchronize()
    assert bool((out[0] == 0xAB).all()) and all(bool((t == 7).all()) for t in out[1:])


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("id_dtype, w_dtype", [(torch.int32, torch.float32), (torch.int64, torch.bfloat16)])
@pytest.mark.parametrize("m, k, topk", [(1, 7168, 8), (37, 7168, 6), (5, 128, 1), (129, 4096, 8)])
def test_moe_stage_bit_exact(cuda, rng, dtype, id_dtype, w_dtype, m, k, topk):
    x = _rand(rng, (m, k), dtype, rng.uniform(0.001, 10))
    x = _with_edges(x, ["nan", "zero_row", "tiny", "huge"][int(rng.integers(4))])
    ids = torch.from_numpy(rng.integers(0, 256, (m, topk))).to(id_dtype).cuda()
    wts = torch.from_numpy(rng.random((m, topk)).astype(F32)).to(w_dtype).cuda()
    st = F.moe_stage(x, ids, wts)
    q, sf, ids64, w = R.moe_stage(_np(x), _np(ids), _np(wts))
    _assert_equal("q", _np(st.q), q)
    _assert_equal("sf", _np(st.sf), sf)
    assert st.sf.dtype == torch.int32 and st.sf.shape == (m, k // 64)
    assert st.topk_ids.dtype == torch.int64 and torch.equal(st.topk_ids.cpu(), ids.cpu().long())
    assert st.topk_weights.dtype == w_dtype and torch.equal(st.topk_weights, wts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_stage_modelopt_edge_rules(cuda, rng, dtype):
    """One-level NVFP4 (gs = 1) of the edge blocks (tests/support/nvfp4_edges.py):
    zero blocks get scale 0x38, blocks whose scale would round to 0 get 0x01
    and keep their values, -0 and negative values whose quotient rounds to
    -0 give code 0."""
    xname = _dt(torch.empty(0, dtype=dtype))
    xs = E.as_rows(E.edge_blocks(xname, 1.0, rng), 128)
    x = torch.from_numpy(xs).to(dtype).cuda()
    ids = torch.zeros((xs.shape[0], 2), dtype=torch.int32, device="cuda")
    wts = torch.ones((xs.shape[0], 2), device="cuda")
    st = F.moe_stage(x, ids, wts)
    q, sf, _, _ = R.moe_stage(xs, _np(ids), _np(wts))
    hit = E.rules_hit(xs, q, R.unpack_scales_i32(sf))
    assert hit["zero_block_scale_1"] >= 3 and hit["tiny_value_kept"] > 0
    assert hit["negative_zero_code_8"] > 0 and hit["minus_zero_code_0"] > 0
    _assert_equal("q", _np(st.q), q)
    _assert_equal("sf", _np(st.sf), sf)


def test_moe_stage_k_not_multiple_of_128(cuda):
    x = torch.zeros(2, 192, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^hidden: K = 192 must be a positive multiple of 128"):
        F.moe_stage(x, ids, torch.zeros(2, 4, device="cuda"))
