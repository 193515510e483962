"""rawkv.fused.swiglu_quantize: the reference (rawkv's float32 exp, silu, the
gate/up deinterleave) against float64, argument errors, the CUDA kernel
against the reference, bit for bit."""
from __future__ import annotations

import numpy as np
from support import nvfp4_edges as E
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import fused as F  # noqa: E402
from rawkv.reference import fused as R  # noqa: E402
from rawkv.reference.formats import bf16_round  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import fused as RFU  # noqa: E402
from support.fused import _LONG, _assert_equal, _dt, _np, _plant, _prefill_rows, _rand, _with_edges  # noqa: E402
from support.properties import (  # noqa: E402
    SETTINGS, _activation_ref, _fused_gs, _gs, f_gs, f_scopes, host, judge, layouts, leads, libs, make, seeds,
    x_dtypes)


# ---- the reference ----------------------------------------------------------------------------------
F32 = np.float32


def _ulps(a, b):
    """|a - b| in float32 ulps of b (a, b float32, finite)."""
    a = np.asarray(a, np.float64)
    b32 = np.asarray(b, np.float32)
    return np.abs(a - b32.astype(np.float64)) / np.spacing(np.abs(b32)).astype(np.float64)


def test_exp_f32_accuracy_and_constants():
    assert R.EXP_COEF == tuple(F32(1.0 / k) for k in (5040, 720, 120, 24, 6))
    assert R.EXP_LOG2E == F32(np.log2(np.e))
    assert R.EXP_LN2_HI + np.float64(R.EXP_LN2_LO) == pytest.approx(np.log(2), abs=1e-12)
    x = np.linspace(-87.0, 88.7, 400_001).astype(F32)
    e = R.exp_f32(x)
    # the bound docs/fused.md and the reference state (measured here: 1 ulp)
    assert _ulps(e, np.exp(x.astype(np.float64)).astype(F32)).max() <= 2.0
    sp = R.exp_f32(np.array([np.inf, -np.inf, 89.0, -104.0, 0.0, np.nan], F32))
    assert sp[0] == np.inf and sp[1] == 0 and sp[2] == np.inf and sp[3] == 0 and sp[4] == 1
    assert np.isfinite(sp[5])          # NaN -> -104 (NaN-ignoring clamp, as CUDA fmaxf)


# exp_f32's bits where fused multiply-adds and separately rounded steps differ (about 9% of
# inputs in [-100, 88]): (input, the definition's bits, the bits the pre-session-56 form
# without fma gave). The definition's bits come from the kernel's formula in C with hardware
# fmaf (gcc -mfma, x86-64), not from the numpy emulation; every one of the 2^32 float32
# inputs gave the reference's bits there (docs/fused.md).
EXP_FMA_BITS = [
    (0xC266A4EA, 0x15E0D47B, 0x15E0D47A), (0x42AB4B0B, 0x7D3CF3D3, 0x7D3CF3D4),
    (0xC178F068, 0x343BDD63, 0x343BDD62), (0x4252E108, 0x65854CC7, 0x65854CC8),
    (0xC2ADA711, 0x00D53589, 0x00D53588), (0x4225DD6F, 0x5D627709, 0x5D62770A),
    (0x4228CDA8, 0x5DEC0C51, 0x5DEC0C50), (0x41B053F4, 0x4F5E9E63, 0x4F5E9E62),
    (0x4096ECDA, 0x42DF887D, 0x42DF887C), (0x42995FF9, 0x76C6FF17, 0x76C6FF18),
    (0x4290717B, 0x7392673D, 0x7392673E), (0xC20000E7, 0x2863EFB7, 0x2863EFB6),
]


def test_exp_f32_is_the_fused_multiply_add_form():
    x = np.array([b[0] for b in EXP_FMA_BITS], np.uint32).view(F32)
    got = R.exp_f32(x).view(np.uint32)
    assert [int(g) for g in got] == [b[1] for b in EXP_FMA_BITS]
    assert all(b[1] != b[2] for b in EXP_FMA_BITS)     # the separately rounded form would fail


def test_silu_matches_float64(rng):
    a = (rng.standard_normal(100_000) * 8).astype(F32)
    s = R.silu(a)
    s64 = a.astype(np.float64) / (1 + np.exp(-a.astype(np.float64)))
    ok = np.abs(s64) > 1e-30
    assert np.max(np.abs(s[ok] - s64[ok]) / np.abs(s64[ok])) < 5e-7
    sp = R.silu(np.array([np.nan, np.inf, -np.inf, -0.0, 1000.0, -1000.0], F32))
    assert np.isnan(sp[0]) and sp[1] == np.inf and np.isnan(sp[2])
    assert sp[3] == 0 and np.signbit(sp[3]) and sp[4] == 1000 and sp[5] == 0


@pytest.mark.parametrize("g", [1, 2, 3, 4, 6, 8, 12, 16, 32])
def test_deinterleave_indexing(g):
    inter = 96
    h = np.arange(2 * inter, dtype=F32)[None, :]
    gate, up = R.deinterleave(h, g)
    for i in range(inter):
        assert gate[0, i] == (i // g) * 2 * g + i % g
        assert up[0, i] == (i // g) * 2 * g + g + i % g


@pytest.mark.parametrize("g", [3, 6, 8, 12])      # 3, 6, 12: groups straddle 16-element chunks
def test_swiglu_matches_float64(rng, g):
    h = bf16_round(rng.standard_normal((9, 2 * 480)).astype(F32) * 3)
    y = R.swiglu(h, g, "bfloat16")
    cols = np.arange(480)
    gate = h[:, (cols // g) * 2 * g + cols % g].astype(np.float64)       # docs/fused.md indexing
    up = h[:, (cols // g) * 2 * g + g + cols % g].astype(np.float64)
    y64 = gate / (1 + np.exp(-gate)) * up
    assert np.all(np.abs(y - y64) <= np.abs(y64) * 2.0 ** -8 * 1.001 + 1e-30)


# ---- argument errors --------------------------------------------------------------------------------
def test_scope_gs_number_keeps_the_rules():
    """A Python float gs accepted once is accepted again with scope None /
    'given' only; any other scope with it is still refused."""
    h = np.ones((2, 64), F32)
    want = F.swiglu_quantize(h, scope="given", gs=0.375)
    got = F.swiglu_quantize(h, gs=0.375)
    assert all(np.array_equal(a, b) for a, b in zip(got[:3], want[:3]))
    for scope in ("row", "tensor", "none"):
        with pytest.raises(ValueError, match="^gs:"):
            F.swiglu_quantize(h, scope=scope, gs=0.375)
    with pytest.raises(ValueError, match="^scope:"):
        F.swiglu_quantize(h, scope="blocks", gs=0.375)


@SETTINGS
@given(seed=seeds, lead=leads, two_i=st.sampled_from([64, 32, 96, 0, 33, 40, 128]), xdt=x_dtypes,
       gran=st.sampled_from([8, 16, 1, 4, 3, 0, -8, True, 8.0]), lib=libs, layout=layouts,
       special=st.booleans(), scope=f_scopes, gs=f_gs)
def test_fused_swiglu_quantize(seed, lead, two_i, xdt, gran, lib, layout, special, scope, gs):
    h = make(seed, (*lead, two_i), xdt, lib, layout, special)
    g = _gs(gs, seed, lib)

    def reference():
        sc, gv = _fused_gs(scope, g)
        q, sf, gg = RFU.swiglu_quantize(host(h).reshape(-1, two_i), int(gran), sc, gv, xdt)
        return _activation_ref(lead, two_i // 2, q, sf, gg)
    judge(lambda: rawkv.fused.swiglu_quantize(h, gran, scope=scope, gs=g),
          ("h", "granularity", "scope", "gs"), reference)


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, inter, g", [(1, 3584, 8), (33, 2048, 8), (5, 512, 16), (3, 96, 32),
                                         (7, 256, 1), (4, 192, 4), (2, 48, 24), (3, 40960, 8),
                                         # scalar path, groups straddling 16-element chunks
                                         (5, 480, 3), (3, 96, 6), (4, 1200, 12), (2, 2064, 12)])
def test_swiglu_quantize_row(cuda, rng, dtype, m, inter, g):
    h = _rand(rng, (m, 2 * inter), dtype, 3.0)
    qa = F.swiglu_quantize(h, g)
    q, sf, gs = R.swiglu_quantize(_np(h), g, "row", None, _dt(h))
    _assert_equal("q", _np(qa.q), q)
    _assert_equal("sf", _np(qa.sf), sf)
    _assert_equal("gs", _np(qa.gs), gs)
    assert qa.inv_rms is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scope", ["tensor", "given_float", "given_tensor", "none"])
@pytest.mark.parametrize("edge", [None, "zero_row", "nan", "huge", "tiny"])
def test_swiglu_quantize_scopes_edges(cuda, rng, scope, edge, dtype):
    # FP16 too: its Inf/NaN test on the packed bits is against 0x7C00, and
    # silu*up overflowing FP16 gives Inf blocks that also hold finite values.
    h = _rand(rng, (11, 1024), dtype, 2.0)
    if edge:
        h = _with_edges(h, edge)
    gsv = 0.0021
    kw = {"tensor": dict(scope="tensor"), "given_float": dict(gs=gsv),
          "given_tensor": dict(gs=torch.tensor(gsv, device="cuda")), "none": dict(scope="none")}[scope]
    qa = F.swiglu_quantize(h, **kw)
    sc = {"given_float": "given", "given_tensor": "given"}.get(scope, scope)
    q, sf, gs = R.swiglu_quantize(_np(h), 8, sc, gsv if sc == "given" else None, _dt(h))
    _assert_equal("q", _np(qa.q), q)
    _assert_equal("sf", _np(qa.sf), sf)
    _assert_equal("gs", _np(qa.gs), np.asarray(gs, F32))


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_quantize_long_rows_inf_blocks(cuda, rng, dtype, scope):
    h = _rand(rng, (3, 2 * _LONG), dtype, 3.0)
    h[0, 2 * _LONG - 3] = float("nan")              # last chunk (recomputed)
    h[1, 60000] = float("inf")                      # gate of output 30000 (recomputed)
    h[1, 200] = float("-inf")                       # up of output 96 (in registers)
    big = 3.0e38 if dtype == torch.bfloat16 else 60000.0
    h[2, 60008:60012] = big                         # up of outputs 30000..: silu*up overflows T
    h[2, 60000:60004] = 10.0
    qa = F.swiglu_quantize(h, 8, scope=scope)
    q, sf, gs = R.swiglu_quantize(_np(h), 8, scope, None, _dt(h))
    _assert_equal("q", _np(qa.q), q)
    _assert_equal("sf", _np(qa.sf), sf)
    _assert_equal("gs", _np(qa.gs), np.asarray(gs, F32))
    assert (sf[2, 1875] == 0x7F) and (sf[1, 1875] == 0x7F) and (sf[0, -1] == 0x7F)


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("n, g", [(2064, 8), (2064, 12), (7168, 8)])     # n: the output width I
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_quantize_prefill_layout(cuda, rng, dtype, n, g, scope):
    rows = _prefill_rows(cuda, n)
    h = _plant(_rand(rng, (rows, 2 * n), dtype, 3.0))
    qa = F.swiglu_quantize(h, g, scope=scope)
    q, sf, gs = R.swiglu_quantize(_np(h), g, scope, None, _dt(h))
    _assert_equal("q", _np(qa.q), q)
    _assert_equal("sf", _np(qa.sf), sf)
    _assert_equal("gs", _np(qa.gs), np.asarray(gs, F32))


def test_swiglu_tensor_scope_repeated_reuses_out(cuda, rng):
    """The tensor-scope gs word is re-armed by a memset each call: a second call
    into the same out= buffers must not see the previous gs."""
    h1 = _rand(rng, (64, 4096), torch.bfloat16, 1.0)
    h2 = _rand(rng, (64, 4096), torch.bfloat16, 0.01)
    out = F.swiglu_quantize(h1, scope="tensor")
    for h in (h2, h1, h2):
        r = F.swiglu_quantize(h, scope="tensor", out=out)
        assert r.q is out.q
        q, sf, gs = R.swiglu_quantize(_np(h), 8, "tensor", None, "bfloat16")
        _assert_equal("q", _np(r.q), q)
        _assert_equal("gs", _np(r.gs), np.asarray(gs, F32))


@pytest.mark.parametrize("scope", ["none", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_quantize_modelopt_edge_rules(cuda, rng, scope, dtype):
    """Rows scaled 0 (zero blocks), 1e-30 (silu(g) * u underflows to signed
    zeros), 1e-3 / 1e-2 (scales that would round to 0 under gs = 1, or under
    the tensor's gs), 1 and 30."""
    scale = np.array([0.0, 1e-30, 1e-3, 1e-2, 1.0, 30.0], F32)[:, None]
    hs = (rng.standard_normal((6, 1024)) * scale).astype(F32)
    h = torch.from_numpy(hs).to(dtype).cuda()
    qa = F.swiglu_quantize(h, scope=scope)
    q, sf, gs = R.swiglu_quantize(_np(h), 8, scope, None, _dt(h))
    _assert_equal("q", _np(qa.q), q)
    _assert_equal("sf", _np(qa.sf), sf)
    _assert_equal("gs", _np(qa.gs), np.asarray(gs, F32))
    hit = E.rules_hit(R.swiglu(_np(h), 8, _dt(h)), q, sf)
    assert hit["zero_block_scale_1"] > 0 and hit["tiny_scale_2^-9"] > 0 and hit["negative_zero_code_8"] > 0


def test_given_device_gs_counted_in_a_graph(cuda, rng):
    """Captured after warmup (which creates the counter), a refused device gs
    counts once per replay; the same graph with a usable gs counts nothing."""
    import rawkv
    rawkv.warmup(0, files=["fused.cu"])
    h = _rand(rng, (4, 256), torch.bfloat16)
    gdev = torch.tensor([-1.0], device="cuda")
    qa = F.swiglu_quantize(h, gs=gdev)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        F.swiglu_quantize(h, gs=gdev, out=qa)
    counts = rawkv.nvfp4.error_counts()
    before = int(counts[rawkv.nvfp4.GIVEN_GS])
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert int(counts[rawkv.nvfp4.GIVEN_GS]) - before == 2
    assert (_np(qa.sf) == 0x7F).all() and not _np(qa.q).any()
    gdev.fill_(0.0021)
    g.replay()
    torch.cuda.synchronize()
    assert int(counts[rawkv.nvfp4.GIVEN_GS]) - before == 2
    q, sf, _ = R.swiglu_quantize(_np(h), 8, "given", 0.0021, "bfloat16")
    _assert_equal("q", _np(qa.q), q)
    _assert_equal("sf", _np(qa.sf), sf)
