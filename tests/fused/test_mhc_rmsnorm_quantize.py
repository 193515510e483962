"""rawkv.fused.mhc_rmsnorm_quantize (the mHC mix, then RMSNorm + NVFP4): the
reference against float64, argument errors, the CUDA kernel against the
reference (the tolerances of test_rmsnorm_quantize.py)."""
from __future__ import annotations

import numpy as np
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
from support.fused import (  # noqa: E402
    _LONG, _PREFILL_N, _check_rms, _huge_weight, _np, _plant, _prefill_rows, _rand, _with_edges)
from support.properties import (  # noqa: E402
    SETTINGS, _activation_ref, _fused_gs, f_scopes, host, judge, layouts, leads, libs, make, p_dtypes, seeds,
    widths, x_dtypes)


# ---- the reference ----------------------------------------------------------------------------------
F32 = np.float32


def test_mhc_mix_matches_float64(rng):
    X = bf16_round(rng.standard_normal((17, 4, 256)).astype(F32))
    A = rng.random((17, 4)).astype(F32)
    m = R.mhc_mix(X, A, "bfloat16")
    m64 = np.einsum("mh,mhn->mn", A.astype(np.float64), X.astype(np.float64))
    assert np.all(np.abs(m - m64) <= np.abs(m64) * 2.0 ** -8 * 1.001 + 1e-6)
    # h == 0 is a product, not 0 + product: -0 stays -0
    z = R.mhc_mix(np.full((1, 1, 16), -0.0, F32), np.ones((1, 1), F32), "float32")
    assert np.all(np.signbit(z))


# ---- argument errors --------------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, lead=leads, n_hc=st.sampled_from([1, 2, 3, 4] * 2 + [0, 5]), n=widths, xdt=x_dtypes, mdt=p_dtypes, lib=libs,
       layout=layouts, special=st.booleans(), scope=f_scopes)
def test_fused_mhc_rmsnorm_quantize(seed, lead, n_hc, n, xdt, mdt, lib, layout, special, scope):
    x = make(seed, (*lead, n_hc, n), xdt, lib, layout, special)
    mix = make(seed + 1, (*lead, n_hc), mdt, lib)
    w = make(seed + 2, (n,), "float32", lib)

    def reference():
        m = int(np.prod(lead)) if lead else 1
        sc, gv = _fused_gs(scope, None)
        q, sf, gg, inv = RFU.mhc_rmsnorm_quantize(host(x).reshape(m, n_hc, n), host(mix).reshape(m, n_hc),
                                                  host(w), 1e-6, sc, gv, xdt)
        return _activation_ref(lead, n, q, sf, gg, inv)
    judge(lambda: rawkv.fused.mhc_rmsnorm_quantize(x, mix, w, scope=scope),
          ("x", "mix", "weight", "scope", "gs"), reference)


# ---- GPU: against the reference ---------------------------------------------------------------------
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
@pytest.mark.parametrize("n", _PREFILL_N)
def test_mhc_rmsnorm_quantize_prefill_layout(cuda, rng, n, scope):
    rows = _prefill_rows(cuda, n)
    X = _plant(_rand(rng, (rows, 3, n), torch.bfloat16))
    A = torch.from_numpy(rng.random((rows, 3)).astype(F32)).cuda()
    w = torch.from_numpy((rng.standard_normal(n) * 0.1 + 1).astype(F32)).cuda()
    qa = F.mhc_rmsnorm_quantize(X, A, w, scope=scope)
    _check_rms(qa, lambda inv: R.mhc_rmsnorm_quantize(_np(X), _np(A), _np(w), 1e-6, scope, None,
                                                      "bfloat16", inv), rows, (rows,), scope)
