"""NVFP4 argument rules on the CPU path (no GPU): the scope/gs parser of
rawkv._args, numbers and None passed as tensors, 0-d inputs, and the dtype
rules the CUDA path applies."""
from __future__ import annotations

import numpy as np
import pytest

import rawkv
from rawkv import _args as A
from rawkv.reference import nvfp4 as R

nv = rawkv.nvfp4
SCOPES = ("tensor", "row", "given", "none")


@pytest.mark.parametrize("default", ["tensor", "row"])
def test_scope_gs_parser(default):
    assert A.check_scope_gs(None, None, SCOPES, default) == (default, None)
    assert A.check_scope_gs(None, 0.5, SCOPES, default) == ("given", 0.5)
    assert A.check_scope_gs("none", None, SCOPES, default) == ("none", None)
    scope, g = A.check_scope_gs("given", np.float32(0.25), SCOPES, default)
    assert scope == "given" and g == 0.25 and type(g) is float
    arr = np.ones((1, 1), np.float32)
    assert A.check_scope_gs("given", arr, SCOPES, default)[1] is arr
    with pytest.raises(ValueError, match="^scope:"):
        A.check_scope_gs("col", None, SCOPES, default)
    with pytest.raises(ValueError, match="^gs:"):
        A.check_scope_gs("given", None, SCOPES, default)
    with pytest.raises(ValueError, match="^gs:"):
        A.check_scope_gs("row", 1.0, SCOPES, default)
    with pytest.raises(ValueError, match="^gs:"):
        A.check_scope_gs("given", np.ones(2, np.float32), SCOPES, default)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-46):
        with pytest.raises(ValueError, match="^gs:"):
            A.check_scope_gs("given", bad, SCOPES, default)
    for bad in (True, np.bool_(False), "0.5", b"x"):
        with pytest.raises(TypeError, match="^gs:"):
            A.check_scope_gs("given", bad, SCOPES, default)


def test_quantize_scope_none_is_the_documented_default():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    for a, b in ((nv.quantize(x, scope=None), R.quantize(x, "tensor")),
                 (nv.quantize(x, scope=None, gs=0.01), R.quantize(x, "given", 0.01))):
        assert all(np.array_equal(u, v) for u, v in zip(a, b))


def _parts():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    q, sf, gs = R.quantize(x, "tensor")
    return x, q, sf, gs


@pytest.mark.parametrize("bad", [None, 1.5, 3, np.float32(2.0)])
def test_numbers_and_none_passed_as_tensors(bad):
    x, q, sf, gs = _parts()
    idx = np.array([1, 0], np.int32)
    calls = [
        ("x", lambda: nv.quantize(bad)),
        ("q", lambda: nv.dequantize(bad, sf, gs)),
        ("q", lambda: nv.gather(bad, sf, gs, idx)),
        ("sf", lambda: nv.gather(q, bad, gs, idx)),
        ("indices", lambda: nv.gather(q, sf, gs, bad)),
        ("sf", lambda: nv.swizzle_scales(bad)),
        ("sw", lambda: nv.unswizzle_scales(bad, (2, 2))),
    ]
    if bad is not None:      # an out= / errors= of None means "none given"
        calls += [("out[0]", lambda: nv.quantize(x, out=(bad, None, None))),
                  ("out[2]", lambda: nv.quantize(x, out=(None, None, bad))),
                  ("out", lambda: nv.dequantize(q, sf, gs, out=bad)),
                  ("out", lambda: nv.gather(q, sf, gs, idx, out=bad)),
                  ("errors", lambda: nv.gather(q, sf, gs, idx, errors=bad)),
                  ("errors", lambda: nv.quantize(x, errors=bad)),
                  ("out", lambda: nv.swizzle_scales(sf, out=bad))]
    else:
        calls += [("sf, gs", lambda: nv.dequantize(q, bad, gs)),
                  ("gs", lambda: nv.gather(q, sf, bad, idx))]
    for name, call in calls:
        with pytest.raises(TypeError, match="^" + name.replace("[", r"\[")):
            call()


def test_other_non_arrays_refused():
    _, q, sf, _ = _parts()
    for bad in (True, "1.0"):
        with pytest.raises(TypeError, match="^gs:"):
            nv.dequantize(q, sf, bad)
    with pytest.raises(TypeError, match="^shape:"):
        nv.unswizzle_scales(np.zeros(512, np.uint8), None)


def test_zero_d_inputs():
    x, q, sf, gs = _parts()
    assert gs.shape == () and nv.quantize(x)[2].shape == ()
    y = nv.gather(q, sf, gs, np.array(1, np.int64), dtype="float32")       # 0-d index: one row, shape (N,)
    assert y.shape == (32,) and np.array_equal(y, R.dequantize(q, sf, gs, "float32")[1])
    y = nv.dequantize(q, sf, np.float32(gs), dtype="float32")               # 0-d gs
    assert np.array_equal(y, R.dequantize(q, sf, gs, "float32"))
    for call, name in ((lambda: nv.quantize(np.ones((), np.float32)), "x"),
                       (lambda: nv.dequantize(np.zeros((), np.uint8), np.zeros((), np.uint8), 1.0), "q"),
                       (lambda: nv.swizzle_scales(np.zeros((), np.uint8)), "sf")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            call()


def test_cpu_dtypes_as_on_cuda():
    """The CPU path refuses what the CUDA path refuses (TypeError naming the
    argument), before the reference runs or anything is written."""
    x, q, sf, gs = _parts()
    idx = np.array([1, 0], np.int32)
    out = np.full((2, 32), 7.0, np.float32)
    calls = [
        ("x", lambda: nv.quantize(x.astype(np.float64))),
        ("x", lambda: nv.quantize(x.astype(np.int32))),
        ("gs", lambda: nv.quantize(x, scope="given", gs=np.array(0.5, np.float64))),
        ("q", lambda: nv.dequantize(q.astype(np.float32), sf, gs)),
        ("sf", lambda: nv.dequantize(q, sf.astype(np.int8), gs)),
        ("gs", lambda: nv.dequantize(q, sf, np.asarray(gs, np.float64))),
        ("out", lambda: nv.dequantize(q, sf, gs, dtype="float16", out=out)),
        ("indices", lambda: nv.gather(q, sf, gs, idx.astype(np.int16), out=out)),
        ("errors", lambda: nv.gather(q, sf, gs, idx, out=out, errors=np.zeros(1, np.int64))),
        ("errors", lambda: nv.quantize(x, out=(None, None, out[0, 0, ...]), errors=np.zeros(1, np.int64))),
        ("sf", lambda: nv.swizzle_scales(sf.astype(np.float32))),
        ("sw", lambda: nv.unswizzle_scales(np.zeros(512, np.int32), (2, 2))),
    ]
    for name, call in calls:
        with pytest.raises(TypeError, match=f"^{name}:"):
            call()
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="^errors:"):
        nv.gather(q, sf, gs, idx, out=out, errors=np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="^errors:"):
        nv.quantize(x, out=(None, None, out[0, 0, ...]), errors=np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="^out:"):
        nv.swizzle_scales(sf, out=np.zeros(7, np.uint8))
    assert (out == 7.0).all()
