"""GPU tests of rawkv.fused against the numpy reference (docs/fused.md).

Tolerances:
* swiglu_quantize, moe_stage, and every scope: bit-exact. Their math has no
  reduction other than max (order-independent) and silu uses rawkv's
  deterministic float32 exp, identical op by op in kernel and reference.
* rmsnorm_quantize / mhc_rmsnorm_quantize: the sum of squares is a float64
  reduction in another order than numpy's. inv_rms must be within 1 float32
  ulp of the reference on every row (in practice equal: the float64 sums agree
  to ~1e-16 relative, so f32(ss/N) only differs when ss/N lies that close to
  a float32 rounding boundary), and the whole output must be bit-exact
  against the reference evaluated with the kernel's own inv_rms. Against the
  plain reference, codes may differ only on rows whose inv_rms differs (scope
  row / given / none: rows are independent; scope tensor: one such row can
  move the shared gs, so then any row may differ). Those rows are reported (a
  warning) and bounded: <= max(1, rows // 100). Why that bound: a row differs
  only when ss/N lies within ~1e-16 (relative) of a float32 rounding boundary
  (spacing 2^-24 ~ 6e-8), about 3e-9 per row, so 0 is expected; the bound lets
  one such rare row pass and fails anything systematic (a float32 sum, another
  eps) that would change most rows.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from rawkv import fused as F
from rawkv.fused import plans as _rows
from rawkv.kernels import fused as K
from rawkv.reference import fused as R
from rawkv.reference import nvfp4 as RN

from support import nvfp4_edges as E

torch = pytest.importorskip("torch")
F32 = np.float32


def _np(t):
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.float().cpu().numpy()
    if t.dtype == getattr(torch, "float8_e4m3fn", None) or t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


def _b(t):
    """Byte view of FP8/FP4 tensors (few torch ops support those dtypes)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _dt(t):
    return str(t.dtype).replace("torch.", "")


def _rand(rng, shape, dtype, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(F32)
    return torch.from_numpy(x).to(dtype).cuda()


def _with_edges(x, kind):
    """Plant edge values in rows of a 2-D (or 3-D: along the last axis) tensor."""
    x = x.clone()
    v = x.view(-1, x.shape[-1])
    r = v.shape[0]
    if kind == "zero_row":
        v[0] = 0
        if r > 2:
            v[r // 2] = -0.0
    elif kind == "nan":
        v[0, 3] = float("nan")
        if r > 1:
            v[r - 1, 17 % v.shape[1]] = float("inf")
            v[r - 1, 0] = float("-inf")
    elif kind == "huge":
        v[0] *= 1e30 if x.dtype == torch.bfloat16 else 100.0
        v[0, 5] = 3.0e38 if x.dtype == torch.bfloat16 else 60000.0
    elif kind == "tiny":
        v[0] *= 1e-35 if x.dtype == torch.bfloat16 else 1e-6
        if r > 1:
            v[1, :16] = 1e-38 if x.dtype == torch.bfloat16 else 6e-8
    return x


def _assert_equal(name, got, want, extra=""):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if got.dtype.kind == "f":
        same = (got.view(np.uint32) == want.astype(got.dtype).view(np.uint32))
    else:
        same = got == want
    n = int((~same).sum())
    assert n == 0, f"{name}: {n} of {same.size} differ {extra}; first at {np.argwhere(~same)[:5].tolist()}"


def _check_rms(qa, ref_fn, rows, lead, scope="row"):
    """Check a RMSNorm producer's result against the reference (see module doc)."""
    inv_k = _np(qa.inv_rms).reshape(rows)
    q0, sf0, gs0, inv0 = ref_fn(None)
    inv0 = np.asarray(inv0).reshape(rows)
    fin = np.isfinite(inv0)
    assert np.array_equal(np.isfinite(inv_k), fin)
    ulp = np.abs(inv_k[fin].astype(np.float64) - inv0[fin]) / np.spacing(inv0[fin]).astype(np.float64)
    assert ulp.size == 0 or ulp.max() <= 1.0, f"inv_rms differs by {ulp.max()} ulp"
    inv_diff = fin & (inv_k.view(np.uint32) != inv0.view(np.uint32))    # NaN rows: any NaN is equal
    # bit-exact against the reference with the kernel's inv_rms
    q1, sf1, gs1, _ = ref_fn(inv_k.reshape(lead))
    _assert_equal("q", _np(qa.q).reshape(rows, -1), q1.reshape(rows, -1))
    _assert_equal("sf", _np(qa.sf).reshape(rows, -1), sf1.reshape(rows, -1))
    _assert_equal("gs", _np(qa.gs), np.asarray(gs1, F32).reshape(_np(qa.gs).shape))
    # against the plain reference: which rows' codes / scales differ, and why
    code_diff = ((_np(qa.q).reshape(rows, -1) != q0.reshape(rows, -1)).any(axis=1)
                 | (_np(qa.sf).reshape(rows, -1) != sf0.reshape(rows, -1)).any(axis=1))
    n_inv = int(inv_diff.sum())
    if n_inv:
        warnings.warn(f"{n_inv} of {rows} rows have an inv_rms 1 ulp from the reference "
                      f"(rows {np.flatnonzero(inv_diff)[:5].tolist()}); {int(code_diff.sum())} rows' "
                      "codes differ from the plain reference")
    assert n_inv <= max(1, rows // 100), f"{n_inv} of {rows} rows have another inv_rms (see module doc)"
    if scope == "tensor":        # one shared gs: a changed row may move every row's codes
        assert n_inv or not code_diff.any(), "codes differ though every inv_rms is equal"
    else:                        # rows are independent
        bad = np.flatnonzero(code_diff & ~inv_diff)
        assert bad.size == 0, f"rows {bad[:5].tolist()} differ from the reference with an equal inv_rms"


# ---- RMSNorm + quantize -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7168), (37, 2048), (5, 16), (3, 40960), (2, 3, 512)])
def test_rmsnorm_quantize_row(cuda, rng, dtype, shape):
    n = shape[-1]
    x = _rand(rng, shape, dtype, rng.uniform(0.1, 10))
    w = torch.from_numpy((rng.standard_normal(n) * 0.2 + 1).astype(F32)).cuda()
    qa = F.rmsnorm_quantize(x, w, 1e-6)
    lead = shape[:-1]
    rows = int(np.prod(lead))
    assert qa.q.shape == (*lead, n // 2) and qa.gs.shape == lead and qa.inv_rms.shape == lead

    def ref(inv):
        return R.rmsnorm_quantize(_np(x).reshape(rows, n), _np(w), 1e-6, "row", None, _dt(x),
                                  None if inv is None else inv.reshape(rows))
    _check_rms(qa, ref, rows, (rows,))


@pytest.mark.parametrize("edge", ["zero_row", "nan", "huge", "tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_edges(cuda, rng, edge, dtype):
    x = _with_edges(_rand(rng, (9, 256), dtype), edge)
    w = torch.from_numpy(rng.random(256).astype(F32) + 0.5).to(torch.bfloat16).cuda()
    qa = F.rmsnorm_quantize(x, w, 1e-5)
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-5, "row", None, _dt(x), inv), 9, (9,))


@pytest.mark.parametrize("scope", ["tensor", "given_float", "given_tensor", "none"])
def test_rmsnorm_quantize_scopes(cuda, rng, scope):
    x = _rand(rng, (65, 1024), torch.bfloat16)
    w = torch.from_numpy(rng.random(1024).astype(F32) + 0.5).cuda()
    gsv = 0.00123
    kw = {"tensor": dict(scope="tensor"), "given_float": dict(gs=gsv),
          "given_tensor": dict(gs=torch.tensor([gsv], device="cuda")), "none": dict(scope="none")}[scope]
    qa = F.rmsnorm_quantize(x, w, **kw)
    sc = {"given_float": "given", "given_tensor": "given"}.get(scope, scope)
    assert qa.gs.shape == ()
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, sc, gsv if sc == "given" else None,
                                                  "bfloat16", inv), 65, (65,), sc)


@pytest.mark.parametrize("n_hc", [1, 2, 3, 4])
@pytest.mark.parametrize("mix_dtype", [torch.float32, torch.bfloat16])
def test_mhc_rmsnorm_quantize(cuda, rng, n_hc, mix_dtype):
    m = int(rng.integers(1, 40)) | 1
    X = _rand(rng, (m, n_hc, 7168), torch.bfloat16)
    A = torch.from_numpy(rng.random((m, n_hc)).astype(F32)).to(mix_dtype).cuda()
    w = torch.from_numpy((rng.standard_normal(7168) * 0.1 + 1).astype(F32)).cuda()
    qa = F.mhc_rmsnorm_quantize(X, A, w)
    _check_rms(qa, lambda inv: R.mhc_rmsnorm_quantize(_np(X), _np(A), _np(w), 1e-6, "row", None,
                                                      "bfloat16", inv), m, (m,))


def test_mhc_rmsnorm_quantize_edges_and_tensor_scope(cuda, rng):
    X = _with_edges(_rand(rng, (7, 4, 512), torch.float16), "nan")
    A = torch.from_numpy(rng.random((7, 4)).astype(F32)).cuda()
    w = torch.ones(512, device="cuda")
    for scope in ("row", "tensor"):
        qa = F.mhc_rmsnorm_quantize(X, A, w, scope=scope)
        _check_rms(qa, lambda inv: R.mhc_rmsnorm_quantize(_np(X), _np(A), _np(w), 1e-6, scope, None,
                                                          "float16", inv), 7, (7,), scope)


# ---- SwiGLU + quantize ---------------------------------------------------------------------
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


# ---- a given device gs: rawkv.nvfp4's rule, checked by the kernel -------------------------
_GIVEN = [0.0021, 2e7, -0.0021, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), "limit"]


def _given_call(rng, op, dtype):
    """(call(**kw) -> QuantizedActivation, reference(gs, inv) -> its tuple, rows)
    of producer `op` on small inputs with a NaN / Inf row and a zero row."""
    name = _dt(torch.empty(0, dtype=dtype))
    if op == "swiglu":
        h = _with_edges(_with_edges(_rand(rng, (5, 512), dtype, 2.0), "nan"), "zero_row")
        return (lambda **kw: F.swiglu_quantize(h, **kw),
                lambda g, inv: (*R.swiglu_quantize(_np(h), 8, "given", g, name), None), 5)
    w = torch.from_numpy(rng.random(256).astype(F32) + 0.5).cuda()
    if op == "rms":
        x = _with_edges(_with_edges(_rand(rng, (5, 256), dtype), "nan"), "zero_row")
        return (lambda **kw: F.rmsnorm_quantize(x, w, **kw),
                lambda g, inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, "given", g, name, inv), 5)
    X = _with_edges(_rand(rng, (5, 3, 256), dtype), "nan")
    A = torch.from_numpy(rng.random((5, 3)).astype(F32)).cuda()
    return (lambda **kw: F.mhc_rmsnorm_quantize(X, A, w, **kw),
            lambda g, inv: R.mhc_rmsnorm_quantize(_np(X), _np(A), _np(w), 1e-6, "given", g, name, inv), 5)


@pytest.mark.parametrize("g", _GIVEN, ids=[str(g) for g in _GIVEN])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["rms", "mhc", "swiglu"])
def test_given_device_gs_rule(cuda, rng, op, dtype, g):
    """A device gs is checked by the kernel (nvfp4_given_gs_ok, the twin of
    the reference's given_gs_ok), as rawkv.nvfp4.quantize checks it: a
    refused one is never used, its sign bit included: every block is flagged
    (sf 0x7F, codes 0), the gs output holds the given value, inv_rms is the
    row's, and each call counts 1 in rawkv.nvfp4.error_counts()[GIVEN_GS].
    2e7 is refused for float16 input only (its bound is 11179349). The same
    value as a number is a ValueError naming gs."""
    import rawkv
    name = _dt(torch.empty(0, dtype=dtype))
    if g == "limit":
        g = RN.given_gs_limit(name)
    usable = RN.given_gs_ok(F32(g), name)
    assert usable == (g == 0.0021 or (g == 2e7 and name != "float16"))
    call, ref, rows = _given_call(rng, op, dtype)
    gdev = torch.tensor([g], dtype=torch.float32, device="cuda")
    counts = rawkv.nvfp4.error_counts()
    before = counts.clone()
    got = [call(gs=gdev)]
    ogs = torch.full((1,), 7.0, device="cuda")
    out = (None, None, ogs) + ((torch.full((rows,), 7.0, device="cuda"),) if op != "swiglu" else ())
    got.append(call(gs=gdev, out=out))
    delta = (counts - before).tolist()
    assert delta[rawkv.nvfp4.GIVEN_GS] == (0 if usable else 2) and delta[rawkv.nvfp4.GATHER_INDEX] == 0
    for qa in got:
        _assert_equal("gs", _np(qa.gs).reshape(()), np.asarray(g, F32))     # the given bits
        if op == "swiglu":
            q, sf, _, _ = ref(g, None)
            _assert_equal("q", _np(qa.q), q)
            _assert_equal("sf", _np(qa.sf), sf)
        else:
            _check_rms(qa, lambda inv: ref(g, inv), rows, (rows,), "given")
        if not usable:
            assert not _np(qa.q).any() and (_np(qa.sf) == 0x7F).all()
    assert got[1].gs is ogs
    if not usable:
        with pytest.raises(ValueError, match="^gs:"):
            call(gs=float(g))


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


# ---- long rows (chunks past REG * blockDim are recomputed from memory) with
# Inf/NaN blocks that also hold finite values, in both ranges ------------------------
_LONG = 40960            # 2560 chunks; 3 rows get 768-thread CTAs, 2 chunks each in registers


_BIG_COLS = (100, 103, 30001, 30007, _LONG - 2)    # chunks 6, 6, 1875, 1875, 2559


def _huge_weight(rng, x, dtype):
    """RMSNorm weight (float32) whose few huge entries overflow y in T where
    x is set to 8 (columns 100, 30001, n-2): Inf elements next to finite ones
    (huge or not) in register-held and recomputed blocks."""
    w = rng.random(_LONG).astype(F32) + 0.5
    big = 1e38 if dtype == torch.bfloat16 else 1e6
    for c in _BIG_COLS:
        w[c] = big
    for c in _BIG_COLS[::2]:
        x[..., c] = 8.0
    return torch.from_numpy(w).cuda()


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_long_rows_inf_blocks(cuda, rng, dtype, scope):
    assert _rows.block_for(cuda, 3, _LONG // 16) * K.REG * 16 < 30000   # the recompute path runs
    x = _rand(rng, (3, _LONG), dtype)
    w = _huge_weight(rng, x, dtype)
    x[1, 35000] = float("inf")                      # row 1: inv 0, a NaN block, zeros elsewhere
    qa = F.rmsnorm_quantize(x, w, scope=scope)
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, scope, None, _dt(x), inv), 3, (3,),
               scope)
    sf = _np(qa.sf)
    assert sf[0, 6] == 0x7F and sf[0, 1875] == 0x7F and sf[0, 2559] == 0x7F and sf[0, 5] != 0x7F


@pytest.mark.parametrize("scope", ["row", "tensor"])
def test_mhc_rmsnorm_quantize_long_rows_inf_blocks(cuda, rng, scope):
    # the mHC kernel takes the finite block max as a call (CALL_SLOW_PATH)
    X = _rand(rng, (3, 2, _LONG), torch.float16)
    A = torch.from_numpy(rng.random((3, 2)).astype(F32) + 0.5).cuda()
    w = _huge_weight(rng, X, torch.float16)
    qa = F.mhc_rmsnorm_quantize(X, A, w, scope=scope)
    _check_rms(qa, lambda inv: R.mhc_rmsnorm_quantize(_np(X), _np(A), _np(w), 1e-6, scope, None,
                                                      "float16", inv), 3, (3,), scope)


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


# ---- prefill launch layout: rows >= 2 x SMs switch block_for to REG (2) chunks per
# thread; at N = 2064 (129 chunks, 96 threads) the last thread's second chunk is
# absent. Scope tensor: every row CTA adds to the cross-CTA atomic amax. ----------
_PREFILL_N = [2064, 7168]


def _prefill_rows(cuda, n):
    """Rows that take the prefill layout on this GPU (any SM count), checked."""
    rows = 2 * cuda.sm_count + 37
    chunks = n // 16
    block = _rows.block_for(cuda, rows, chunks)
    assert block != _rows.block_for(cuda, 1, chunks)        # not the decode layout
    assert block < chunks <= K.REG * block                  # two chunks per thread, all in registers
    return rows


def _plant(x):
    """Edges in a (rows, ..., N) tensor: NaN / Inf blocks, a zero row, and a NaN in
    the last column (the partial second chunk at N = 2064)."""
    x = _with_edges(x, "nan")
    x[2] = 0
    x[3, ..., -1] = float("nan")
    return x


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("n", _PREFILL_N)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_prefill_layout(cuda, rng, dtype, n, scope):
    rows = _prefill_rows(cuda, n)
    x = _plant(_rand(rng, (rows, n), dtype, rng.uniform(0.1, 10)))
    w = torch.from_numpy((rng.standard_normal(n) * 0.2 + 1).astype(F32)).cuda()
    qa = F.rmsnorm_quantize(x, w, scope=scope)
    _check_rms(qa, lambda inv: R.rmsnorm_quantize(_np(x), _np(w), 1e-6, scope, None, _dt(x), inv),
               rows, (rows,), scope)


@pytest.mark.parametrize("scope", ["row", "tensor"])
@pytest.mark.parametrize("n", _PREFILL_N)
def test_mhc_rmsnorm_quantize_prefill_layout(cuda, rng, n, scope):
    rows = _prefill_rows(cuda, n)
    X = _plant(_rand(rng, (rows, 3, n), torch.bfloat16))
    A = torch.from_numpy(rng.random((rows, 3)).astype(F32)).cuda()
    w = torch.from_numpy((rng.standard_normal(n) * 0.1 + 1).astype(F32)).cuda()
    qa = F.mhc_rmsnorm_quantize(X, A, w, scope=scope)
    _check_rms(qa, lambda inv: R.mhc_rmsnorm_quantize(_np(X), _np(A), _np(w), 1e-6, scope, None,
                                                      "bfloat16", inv), rows, (rows,), scope)


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


# ---- MoE staging -------------------------------------------------------------------------------
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


@pytest.mark.parametrize("scope", ["row", "none", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quantize_modelopt_edge_rules(cuda, rng, scope, dtype):
    """Weight blocks of +0 and -0 give zero blocks holding signed zeros (the
    signs of x): scale 0x38, codes 0. Weight 2^-20 gives blocks far below
    every row's amax (and below 6 * 2^-10 for gs = 1): scale 0x01, the values
    kept under row / tensor scope."""
    n = 512
    w = (rng.random(n) + 0.5).astype(F32)
    w[:16], w[16:32], w[32:48] = 0.0, -0.0, 2.0 ** -20
    wt = torch.from_numpy(w).cuda()
    x = _rand(rng, (9, n), dtype)
    qa = F.rmsnorm_quantize(x, wt, scope=scope)

    def ref(inv):
        return R.rmsnorm_quantize(_np(x), w, 1e-6, scope, None, _dt(x), inv)
    _check_rms(qa, ref, 9, (9,), scope)
    q, sf, _, _ = ref(None)
    assert (sf[:, :2] == 0x38).all() and not RN.unpack_nibbles(q)[:, :32].any()
    assert (sf[:, 2] == 0x01).all()
    if scope != "none":
        assert (RN.unpack_nibbles(q)[:, 32:48] & 7).any()


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


def test_moe_stage_k_not_multiple_of_128(cuda):
    x = torch.zeros(2, 192, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^hidden: K = 192 must be a positive multiple of 128"):
        F.moe_stage(x, ids, torch.zeros(2, 4, device="cuda"))


# ---- argument errors on CUDA: raised before launch, nothing written ------------------------
def _sentinel_out(lead, n, per_row=True):
    return (torch.full((*lead, n // 2), 0xAB, dtype=torch.uint8, device="cuda"),
            torch.full((*lead, n // 16), 0xAB, dtype=torch.uint8, device="cuda"),
            torch.full(lead if per_row else (), 7.0, device="cuda"),
            torch.full(lead, 7.0, device="cuda"))


def _untouched(out):
    return all(bool(((t.view(torch.uint8) == 0xAB) if t.dtype == torch.uint8 else (t == 7.0)).all())
               for t in out if t is not None)


def test_cuda_argument_errors_write_nothing(cuda):
    x = torch.randn(4, 64, device="cuda").bfloat16()
    w = torch.ones(64, device="cuda")
    cases = [
        ("x", lambda o: F.rmsnorm_quantize(x.float(), w, out=o)),                       # dtype
        ("x", lambda o: F.rmsnorm_quantize(torch.randn(64, 4, device="cuda").bfloat16().t(), w, out=o)),
        ("x", lambda o: F.rmsnorm_quantize(torch.randn(4 * 64 + 1, device="cuda").bfloat16()[1:].view(4, 64),
                                           w, out=o)),                                  # misaligned
        ("weight", lambda o: F.rmsnorm_quantize(x, torch.ones(64, dtype=torch.int32, device="cuda"), out=o)),
        ("weight", lambda o: F.rmsnorm_quantize(x, torch.ones(64), out=o)),              # device
        ("weight", lambda o: F.rmsnorm_quantize(x, torch.ones(128, device="cuda")[::2], out=o)),
        ("gs", lambda o: F.rmsnorm_quantize(x, w, gs=torch.ones(1, dtype=torch.float64, device="cuda"),
                                            out=(o[0], o[1], torch.full((), 7.0, device="cuda"), o[3]))),
        ("out.q", lambda o: F.rmsnorm_quantize(x, w, out=(o[0][:, :16], o[1], o[2], o[3]))),
        ("out.sf", lambda o: F.rmsnorm_quantize(x, w, out=(o[0], o[1].float(), o[2], o[3]))),
        ("out.gs", lambda o: F.rmsnorm_quantize(x, w, scope="tensor", out=o)),          # (4,) for a scalar
        ("out.inv_rms", lambda o: F.rmsnorm_quantize(x, w, out=(o[0], o[1], o[2], o[3][:2]))),
        ("mix", lambda o: F.mhc_rmsnorm_quantize(x.view(4, 1, 64), torch.ones(4, 1, dtype=torch.int64,
                                                 device="cuda"), w, out=o)),
        ("h", lambda o: F.swiglu_quantize(torch.randn(4, 128, device="cuda"), out=o[:3])),
        ("x", lambda o: F.rmsnorm_quantize(x[:, :0], w[:0], out=o)),                  # N == 0
        ("x", lambda o: F.mhc_rmsnorm_quantize(x[:, None, :0], torch.ones(4, 1, device="cuda"), w[:0], out=o)),
        ("h", lambda o: F.swiglu_quantize(x[:, :0], out=o[:3])),
        ("gs", lambda o: F.rmsnorm_quantize(x, w, gs=-1.0, out=(o[0], o[1], torch.full((), 7.0, device="cuda"),
                                                               o[3]))),
        ("gs", lambda o: F.swiglu_quantize(x, gs=float("nan"), out=(o[0][:, :16], o[1][:, :2],
                                                                    torch.full((), 7.0, device="cuda")))),
        ("gs", lambda o: F.swiglu_quantize(x, gs=True, out=(o[0][:, :16], o[1][:, :2],
                                                            torch.full((), 7.0, device="cuda")))),
        ("out.inv_rms", lambda o: F.swiglu_quantize(torch.randn(4, 128, device="cuda").bfloat16(), out=o)),
        ("eps", lambda o: F.rmsnorm_quantize(x, w, eps=0.0, out=o)),          # NaN scales on a zero row
        ("eps", lambda o: F.mhc_rmsnorm_quantize(x.view(4, 1, 64), torch.ones(4, 1, device="cuda"), w, eps=0,
                                                 out=o)),
        ("eps", lambda o: F.rmsnorm_quantize(x, w, eps=float("nan"), out=o)),
        ("eps", lambda o: F.rmsnorm_quantize(x, w, eps=True, out=o)),
        ("weight", lambda o: F.rmsnorm_quantize(x, None, out=o)),
        ("x", lambda o: F.rmsnorm_quantize(1.5, w, out=o)),
        ("out.gs", lambda o: F.rmsnorm_quantize(x, w, out=(o[0], o[1], 7.0, o[3]))),
    ]
    for name, call in cases:
        out = _sentinel_out((4,), 64)
        with pytest.raises((ValueError, TypeError)) as ei:
            call(out)
        assert re.match(rf"{re.escape(name)}[:\s(]", str(ei.value)), (name, str(ei.value))
        torch.cuda.synchronize()
        assert _untouched(out), name


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


# ---- streams, out=, CUDA graphs, dequantize --------------------------------------------------
def _inputs(rng, m, n, n_hc, two_i, h_dtype, topk):
    """x (m, n), weight (n,), X (m, n_hc, n), mix (m, n_hc), h (m, two_i),
    hidden (m, n), topk_ids (m, topk) int32 and topk_weights of every op."""
    return (_rand(rng, (m, n), torch.bfloat16), torch.from_numpy(rng.random(n).astype(F32) + 0.5).cuda(),
            _rand(rng, (m, n_hc, n), torch.bfloat16), torch.from_numpy(rng.random((m, n_hc)).astype(F32)).cuda(),
            _rand(rng, (m, two_i), h_dtype), _rand(rng, (m, n), torch.bfloat16),
            torch.zeros(m, topk, dtype=torch.int32, device="cuda"), torch.rand(m, topk, device="cuda"))


def test_out_and_graph_capture(cuda, rng):
    import rawkv
    rawkv.warmup(0, files=["fused.cu"])
    x, w, X, A, h, hid, ids, wts = _inputs(rng, 16, 7168, 4, 4096, torch.bfloat16, 8)
    o1 = F.rmsnorm_quantize(x, w)
    o2 = F.mhc_rmsnorm_quantize(X, A, w)
    o3 = F.swiglu_quantize(h, scope="tensor")
    o4 = F.moe_stage(hid, ids, wts)
    want = [[_b(t).clone() for t in o if t is not None] for o in (o1, o2, o3, o4)]
    for o in (o1, o2, o3, o4):
        for t in o:
            if t is not None:
                _b(t).zero_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            F.rmsnorm_quantize(x, w, out=o1)
            F.mhc_rmsnorm_quantize(X, A, w, out=o2)
            F.swiglu_quantize(h, scope="tensor", out=o3)
            F.moe_stage(hid, ids, wts, out=o4)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    for o, wl in zip((o1, o2, o3, o4), want):
        for t, wt in zip([t for t in o if t is not None], wl):
            assert torch.equal(_b(t), wt)
    # allocation while capturing is refused with a clear error
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(rawkv.CaptureError):
        with torch.cuda.stream(s), torch.cuda.graph(g2, stream=s):
            F.rmsnorm_quantize(x, w)


def test_side_stream_and_dequantize(cuda, rng):
    x = _rand(rng, (8, 512), torch.bfloat16)
    w = torch.ones(512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    qa = F.rmsnorm_quantize(x, w, stream=s)
    torch.cuda.current_stream().wait_stream(s)
    q, sf, gs, inv = R.rmsnorm_quantize(_np(x), _np(w), 1e-6, "row", None, "bfloat16", _np(qa.inv_rms))
    _assert_equal("q", _np(qa.q), q)
    d = qa.dequantize(torch.float32)
    _assert_equal("dequantize", _np(d), RN.dequantize(q, sf, gs, "float32"))
    assert F.swiglu_quantize(_rand(rng, (3, 64), torch.bfloat16)).dequantize().dtype == torch.bfloat16


def test_empty_rows(cuda):
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda")
    qa = F.rmsnorm_quantize(x, torch.ones(64, device="cuda"), scope="tensor")
    assert qa.q.shape == (0, 32) and float(qa.gs) == 1.0
    qa = F.swiglu_quantize(torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda"), gs=0.5)
    assert float(qa.gs) == 0.5
    qa = F.mhc_rmsnorm_quantize(torch.zeros(2, 0, 3, 64, dtype=torch.float16, device="cuda"),
                                torch.ones(2, 0, 3, device="cuda"), torch.ones(64, device="cuda"))
    assert qa.q.shape == (2, 0, 32) and qa.gs.shape == (2, 0) and qa.inv_rms.shape == (2, 0)
    st = F.moe_stage(torch.zeros(0, 128, dtype=torch.bfloat16, device="cuda"),
                     torch.zeros(0, 8, dtype=torch.int32, device="cuda"), torch.zeros(0, 8, device="cuda"))
    assert st.q.shape == (0, 64) and st.topk_ids.shape == (0, 8)


@pytest.mark.parametrize("scope", ["tensor", "none", "given_float", "given_tensor"])
def test_empty_rows_gs_on_the_ops_stream(cuda, scope):
    """With no rows, gs is still written, on the op's `stream`: captured into a
    graph on `s` while torch's current stream is another one, the write must be
    in the graph (a torch fill_ on the current stream would run once, eagerly)."""
    import rawkv
    rawkv.warmup(0, files=["fused.cu"])
    h = torch.zeros(0, 128, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(64, device="cuda")
    gsd = torch.tensor([0.25], device="cuda")
    kw = {"tensor": dict(scope="tensor"), "none": dict(scope="none"), "given_float": dict(gs=0.5),
          "given_tensor": dict(gs=gsd)}[scope]
    want = {"tensor": 1.0, "none": 1.0, "given_float": 0.5, "given_tensor": 0.25}[scope]
    o_sw = (torch.empty(0, 32, dtype=torch.uint8, device="cuda"), torch.empty(0, 4, dtype=torch.uint8, device="cuda"),
            torch.full((), 7.0, device="cuda"))
    o_rms = (torch.empty(0, 32, dtype=torch.uint8, device="cuda"), torch.empty(0, 4, dtype=torch.uint8, device="cuda"),
             torch.full((), 7.0, device="cuda"), torch.empty(0, device="cuda"))
    s, other = torch.cuda.Stream(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        with torch.cuda.stream(other):              # torch's current stream is not `s`
            F.swiglu_quantize(h, out=o_sw, stream=s, **kw)
            F.rmsnorm_quantize(x, w, out=o_rms, stream=s, **kw)
    torch.cuda.synchronize()
    o_sw[2].fill_(7.0)
    o_rms[2].fill_(7.0)
    g.replay()
    torch.cuda.synchronize()
    assert float(o_sw[2]) == want and float(o_rms[2]) == want


# ---- the rawkv:: custom operators (rawkv.library) ---------------------------------------------
def _operator_calls(rng):
    """(operator, inputs, outputs) of every fused operator on cuda:0."""
    x, w, X, A, h, hid, ids, wts = _inputs(rng, 5, 512, 2, 1024, torch.float16, 4)
    gs = torch.tensor([0.004], device="cuda")

    def outs(n, gs_shape, inv=True):
        o = (torch.empty(5, n // 2, dtype=torch.uint8, device="cuda"),
             torch.empty(5, n // 16, dtype=torch.uint8, device="cuda"), torch.empty(gs_shape, device="cuda"))
        return o + (torch.empty(5, device="cuda"),) if inv else o
    ops = torch.ops.rawkv
    moe_out = (torch.empty(5, 256, dtype=torch.uint8, device="cuda"), torch.empty(5, 8, dtype=torch.int32, device="cuda"),
               torch.empty(5, 4, dtype=torch.int64, device="cuda"), torch.empty(5, 4, device="cuda"))
    return [(ops.rmsnorm_quantize, (x, w, 1e-6, "row", None, None), outs(512, (5,))),
            (ops.mhc_rmsnorm_quantize, (X, A, w, 1e-6, "given", gs, None), outs(512, (1,))),
            (ops.swiglu_quantize, (h, 8, "tensor", None, None), outs(512, (), False)),
            (ops.moe_stage, (hid, ids, wts), moe_out)]


def test_operators_in_a_captured_step(cuda, rng):
    """An engine's captured decode step calls torch.ops.rawkv.* on buffers it
    owns: captured after warmup, each replay gives the eager operator's bits."""
    import rawkv
    import rawkv.library  # noqa: F401
    rawkv.warmup(0, files=["fused.cu"])
    calls = _operator_calls(rng)
    for op, args, outs in calls:
        op(*args, *outs)
    torch.cuda.synchronize()
    want = [[o.clone() for o in outs] for _, _, outs in calls]
    for _, _, outs in calls:                # zeroed: the replay must write them
        for o in outs:
            o.zero_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for op, args, outs in calls:
            op(*args, *outs)
    g.replay()
    torch.cuda.synchronize()
    for (op, _, outs), wl in zip(calls, want):
        for o, wt in zip(outs, wl):
            assert torch.equal(o, wt), op


def test_operators_run_on_their_tensors_device(cuda, rng, monkeypatch):
    """Each fused operator asks for the runtime of its tensors' device index."""
    import rawkv.library  # noqa: F401
    from rawkv.fused import moe, rms, swiglu
    asked = []
    for mod in (rms, swiglu, moe):
        real = mod.get_runtime
        monkeypatch.setattr(mod, "get_runtime", lambda d=None, real=real: asked.append(d) or real(d))
    calls = _operator_calls(rng)
    for op, args, outs in calls:
        op(*args, *outs)
    assert len(asked) == len(calls) and all(d == 0 for d in asked)
