"""NVFP4 argument rules on the CPU path (no GPU): the scope/gs parser of
rawkv._args, numbers and None passed as tensors, 0-d inputs, and the dtype
rules the CUDA path applies."""
from __future__ import annotations

import re

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


def test_outputs_in_one_another_or_in_an_input_refused():
    """Outputs that share memory with each other or with an input (issue 21,
    item 7) are refused naming both, before anything is written."""
    x, q, sf, gs = _parts()
    idx = np.array([1, 0], np.int32)
    buf = np.zeros(64, np.uint8)
    y = np.zeros((2, 32), np.float32)
    sf_sq = np.zeros((128, 4), np.uint8)
    calls = [
        ("out[1]", "out[0]", lambda: nv.quantize(x, out=(buf[:32].reshape(2, 16), buf[30:34].reshape(2, 2), None))),
        ("out[2]", "x", lambda: nv.quantize(x, out=(None, None, x.reshape(-1)[5:6].reshape(())))),
        ("errors", "out[2]", lambda: nv.quantize(x, out=(None, None, y[0, 0, ...]),
                                                   errors=y.reshape(-1)[:1].view(np.int32))),
        ("out", "q", lambda: nv.dequantize(q, sf, gs, dtype="float32", out=np.lib.stride_tricks.as_strided(
            q.view(np.float32).reshape(-1)[:1], (2, 32), (0, 0), writeable=True))),
        ("errors", "out", lambda: nv.gather(q, sf, gs, idx, dtype="float32", out=y,
                                            errors=y[1, 3:4].view(np.int32))),
        ("out", "indices", lambda: nv.gather(q, sf, gs, y.view(np.int32)[:1, :1], dtype="float32",
                                             out=y[:1, None, :])),
        ("out", "sf", lambda: nv.swizzle_scales(sf_sq, out=sf_sq.reshape(-1))),
        ("out", "sw", lambda: nv.unswizzle_scales(sf_sq.reshape(-1), (128, 4), out=sf_sq)),
    ]
    for name, other, call in calls:
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}: overlaps {re.escape(other)} in memory"):
            call()
    assert not buf.any() and not y.any() and not sf_sq.any()
    # parts of one buffer that do not overlap are fine
    q2, sf2, _ = nv.quantize(x, out=(buf[:32].reshape(2, 16), buf[32:36].reshape(2, 2), None))
    assert np.array_equal(q2, q) and np.array_equal(sf2, sf)


def test_read_only_outputs_refused_before_anything_is_written():
    """A read-only numpy output (issue 21, item 8) is refused by name before
    any output is written, not by numpy at its first store."""
    x, q, sf, gs = _parts()
    idx = np.array([1, 0], np.int32)

    def ro(a):
        a.flags.writeable = False
        return a
    q_out = np.zeros((2, 16), np.uint8)
    y = np.zeros((2, 32), np.float32)
    calls = [
        ("out[1]", lambda: nv.quantize(x, out=(q_out, ro(np.zeros((2, 2), np.uint8)), None))),
        ("out[2]", lambda: nv.quantize(x, out=(q_out, None, ro(np.zeros((), np.float32))))),
        ("errors", lambda: nv.quantize(x, out=(q_out, None, None), errors=ro(np.zeros(1, np.int32)))),
        ("out", lambda: nv.dequantize(q, sf, gs, dtype="float32", out=ro(np.zeros((2, 32), np.float32)))),
        ("errors", lambda: nv.gather(q, sf, gs, np.array([5, 0], np.int32), dtype="float32", out=y,
                                     errors=ro(np.zeros(1, np.int32)))),
        ("out", lambda: nv.swizzle_scales(sf, out=ro(np.zeros(512, np.uint8)))),
        ("out", lambda: nv.unswizzle_scales(np.zeros(512, np.uint8), (2, 2), out=ro(np.zeros((2, 2), np.uint8)))),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}: is read-only"):
            call()
    assert not q_out.any() and not y.any()


def test_sizes_and_empty_scales():
    """issue 21, item 10 (found again by tests/test_properties.py):
    swizzled_size(-200, 7) was -1024 and (1.5, 7) 1024.0; unswizzle_scales
    took a float shape; swizzle_scales of (n, 0) scales and a gather of
    N = 0 raised numpy's reshape error."""
    assert nv.swizzled_size(0, 0) == 0 and nv.swizzled_size(np.int64(129), 5) == 4 * 512
    for rows, cols, exc in ((-200, 7, ValueError), (1.5, 7, TypeError), (True, 7, TypeError),
                            (3, None, TypeError)):
        with pytest.raises(exc, match="^cols:" if cols is None else "^rows:"):
            nv.swizzled_size(rows, cols)
    for shape in ((2.5, 4), (2, -4), (True, 4), "ab"):
        with pytest.raises((TypeError, ValueError), match="^shape:"):
            nv.unswizzle_scales(np.zeros(512, np.uint8), shape)
    for shape in ((3, 0), (0, 0), (0, 5)):
        sw = nv.swizzle_scales(np.zeros(shape, np.uint8))
        assert sw.shape == (nv.swizzled_size(*shape),)
        assert nv.unswizzle_scales(sw, shape).shape == shape
    y = nv.gather(np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8), 1.0, np.array([0, -1], np.int32),
                  dtype="float32")
    assert y.shape == (2, 0)
