"""The NVFP4 family's argument rules, held for every op at once (each op's own
rules are in its test file): numbers and None passed as tensors, 0-d inputs,
the dtype rules the CUDA path applies, outputs overlapping or read-only, empty
inputs; on the GPU, refused arguments write nothing.

The launch-plan tests run the CUDA path on a CPU: CPU tensors that report
is_cuda and a runtime that records launches instead of making them
(tests/nvfp4/conftest.py). Every launch goes through its declaration
(rawkv.kernels.nvfp4), so a wrong keyword, a scalar of the wrong C type or a
missing argument fails there; the tests also check which buffer each pointer
parameter receives."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv.reference import nvfp4 as R  # noqa: E402
from support.dlpack import Bare  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.nvfp4 import u8  # noqa: E402


# ---- argument errors --------------------------------------------------------------------------------
nv = rawkv.nvfp4


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



@pytest.mark.parametrize("scope", [np.array(["row", "tensor"]), np.array("row"), ["row"], 1])
def test_a_scope_that_is_not_a_string_is_named(scope):
    """The operator takes a `str scope`, and so does the public op. (Found
    by a review: an array scope reached `scope == "row"` and `scope not in
    SCOPES`, whose elementwise comparison raised numpy's 'truth value of an
    array ... is ambiguous', naming nothing, or took a 0-d one as 'row'.)"""
    x = _parts()[0]
    for call in (lambda: nv.quantize(x, scope=scope), lambda: nv.quantize(x, scope=scope, out=(None, None, None)),
                 lambda: nv.quantize(x, scope=scope, gs=0.5)):
        with pytest.raises(ValueError, match="^scope: expected one of"):
            call()


@pytest.mark.parametrize("shape", [np.array(4), torch.tensor(4)])
def test_an_unswizzle_shape_that_is_no_sequence_is_named(shape):
    """(Found by a review: a 0-d array or tensor passed the `__iter__` test,
    and iterating it raised 'iteration over a 0-d array', naming nothing.)"""
    with pytest.raises(TypeError, match="^shape: expected a sequence of ints"):
        nv.unswizzle_scales(np.zeros(512, np.uint8), shape)

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
    """issue 21, item 10 (found again by the property tests):
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


def test_a_number_gs_of_a_decode_is_a_positive_float32_and_eps_a_number():
    # the rule quantize applies (check_gs_number): 1e39 decoded to inf, and
    # 2**2000 was a bare OverflowError; eps likewise names itself
    q, sf, _ = nv.quantize(np.ones((1, 16), np.float32))
    idx = np.zeros(1, np.int32)
    for gs in (1e39, 2 ** 2000, 0.0, -1.0, float("nan"), np.float64(1e-50)):
        with pytest.raises(ValueError, match="^gs: a global scale must be a finite positive float32"):
            nv.dequantize(q, sf, gs)
        with pytest.raises(ValueError, match="^gs: a global scale must be a finite positive float32"):
            nv.gather(q, sf, gs, idx)
    assert np.array_equal(nv.dequantize(q, sf, 0.5), nv.dequantize(q, sf, np.float32(0.5)))
    with pytest.raises(ValueError, match="^eps: epsilon must be a finite positive float32"):
        rawkv.fused.rmsnorm_quantize(np.ones((1, 16), np.float32), np.ones(16, np.float32), eps=2 ** 2000)


def test_unswizzle_checks_the_size_before_it_allocates():
    with pytest.raises(ValueError, match=r"^sw: expected 40000000000000 bytes for scales of shape \(10000000000000, 4\)"):
        nv.unswizzle_scales(np.zeros(512, np.uint8), (10 ** 13, 4))
    assert nv.unswizzle_scales(np.zeros(512, np.uint8), (3, 4)).shape == (3, 4)


def test_bad_arguments_cpu():
    x = np.ones((2, 24), np.float32)
    with pytest.raises(ValueError, match="^x:"):
        rawkv.nvfp4.quantize(x)
    with pytest.raises(ValueError, match="^scope:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), scope="col")
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), scope="given")
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), scope="given", gs=float("nan"))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(np.ones((2, 16), np.float32), gs=1.0)
    with pytest.raises(TypeError, match="^dtype:"):
        rawkv.nvfp4.dequantize(np.zeros((1, 8), np.uint8), np.zeros((1, 1), np.uint8), 1.0, dtype="int8")


def test_bad_arguments_write_nothing(cuda):
    x = torch.randn(4, 64, device="cuda")
    q = torch.full((4, 32), 0xAB, dtype=torch.uint8, device="cuda")
    sf = torch.full((4, 4), 0xAB, dtype=torch.uint8, device="cuda")
    gs = torch.full((), 5.0, device="cuda")
    bad_sf = torch.full((4, 3), 0xAB, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"^out\[1\]:"):
        rawkv.nvfp4.quantize(x, out=(q, bad_sf, gs))
    with pytest.raises(TypeError, match=r"^out\[2\]:"):
        rawkv.nvfp4.quantize(x, out=(q, sf, gs.double()))
    # (40 columns: no out= fits such an x, so out[0]'s shape is wrong too;
    # the argument layer names it before the format's rule names x)
    with pytest.raises(ValueError, match=r"^(x|out\[0\]):"):
        rawkv.nvfp4.quantize(torch.randn(4, 40, device="cuda"), out=(q, sf, gs))
    with pytest.raises(TypeError, match="^x:"):
        rawkv.nvfp4.quantize(torch.ones(4, 64, dtype=torch.int32, device="cuda"), out=(q, sf, gs))
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=torch.ones(2, device="cuda"), out=(q, sf, gs))
    with pytest.raises(TypeError, match=r"^out\[0\]:"):
        rawkv.nvfp4.quantize(x, out=(torch.zeros(4, 32, device="cuda"), sf, gs))     # float32 q
    with pytest.raises(ValueError, match=r"^out\[2\]:"):
        rawkv.nvfp4.quantize(x, out=(q, sf, torch.zeros(4, device="cuda")))          # gs shape
    with pytest.raises(ValueError, match=r"^out\[2\]:"):
        rawkv.nvfp4.quantize(x, scope="row", out=(q, sf, gs))                         # gs shape
    assert (u8(q) == 0xAB).all() and (u8(sf) == 0xAB).all() and float(gs) == 5.0
    out = torch.full((4, 64), 3.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^sf:"):
        rawkv.nvfp4.dequantize(q, bad_sf, 1.0, out=out)
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.dequantize(q, sf, torch.ones(3, device="cuda"), out=out)
    with pytest.raises(TypeError, match="^out:"):
        rawkv.nvfp4.dequantize(q, sf, 1.0, dtype=torch.float32, out=out)
    with pytest.raises(TypeError, match="^indices:"):
        rawkv.nvfp4.gather(q, sf, 1.0, torch.zeros(2, device="cuda"), out=out[:2])
    with pytest.raises(TypeError, match="^errors:"):
        rawkv.nvfp4.gather(q, sf, 1.0, torch.zeros(4, dtype=torch.int64, device="cuda"), out=out,
                           errors=torch.zeros(1, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match="^indices:"):
        rawkv.nvfp4.gather(q, sf, 1.0, torch.zeros(4, dtype=torch.int64), out=out)   # CPU indices
    assert (out.float() == 3.0).all()
    with pytest.raises(ValueError, match="^sw:"):
        rawkv.nvfp4.unswizzle_scales(torch.zeros(100, dtype=torch.uint8, device="cuda"), (4, 4))
    # numbers and None where a tensor belongs: TypeError naming the argument
    idx = torch.zeros(4, dtype=torch.int64, device="cuda")
    for name, call in (("out[0]", lambda: rawkv.nvfp4.quantize(x, out=(1.0, sf, gs))),
                       ("out[1]", lambda: rawkv.nvfp4.quantize(x, out=(q, 2, gs))),
                       ("q", lambda: rawkv.nvfp4.dequantize(1.0, sf, gs, out=out)),
                       ("out", lambda: rawkv.nvfp4.dequantize(q, sf, gs, out=3.0)),
                       ("indices", lambda: rawkv.nvfp4.gather(q, sf, gs, 3, out=out[:1])),
                       ("errors", lambda: rawkv.nvfp4.gather(q, sf, gs, idx, out=out, errors=0)),
                       ("gs", lambda: rawkv.nvfp4.gather(q, sf, None, idx, out=out)),
                       ("out", lambda: rawkv.nvfp4.swizzle_scales(sf, out=1))):
        with pytest.raises(TypeError, match="^" + name.replace("[", r"\[")):
            call()
    assert (u8(q) == 0xAB).all() and (u8(sf) == 0xAB).all() and float(gs) == 5.0
    assert (out.float() == 3.0).all()
    with pytest.raises(ValueError, match="^gs:"):             # the float16 bound (docs/format.md)
        rawkv.nvfp4.quantize(x.half(), scope="given", gs=2e7, out=(q, sf, gs))
    assert (u8(q) == 0xAB).all()


def test_allocation_refused_while_the_stream_argument_captures(cuda):
    # torch's current stream is not capturing, the op's stream is: an op
    # without out= must refuse to allocate (Runtime.empty gets the stream)
    rawkv.warmup()
    x = torch.randn(4, 64, device="cuda")
    q, sf, gs = rawkv.nvfp4.quantize(x)
    idx = torch.zeros(2, dtype=torch.int32, device="cuda")
    sw = rawkv.nvfp4.swizzle_scales(sf)
    s, other = torch.cuda.Stream(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    other.wait_stream(torch.cuda.current_stream())
    ops = [lambda: rawkv.nvfp4.quantize(x, stream=s),
           lambda: rawkv.nvfp4.dequantize(q, sf, gs, stream=s),
           lambda: rawkv.nvfp4.gather(q, sf, gs, idx, stream=s),
           lambda: rawkv.nvfp4.swizzle_scales(sf, stream=s),
           lambda: rawkv.nvfp4.unswizzle_scales(sw, sf.shape, stream=s)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="relaxed"):
        with torch.cuda.stream(other):
            assert not torch.cuda.is_current_stream_capturing()
            for op in ops:
                with pytest.raises(rawkv.CaptureError, match="out="):
                    op()
    torch.cuda.synchronize()


# ---- launch plan ------------------------------------------------------------------------------------
def test_empty_inputs_launch_nothing(rt):
    x = fake(torch.ones(0, 32))
    q, sf, gs = rawkv.nvfp4.quantize(x)
    assert float(gs) == 1.0
    rawkv.nvfp4.dequantize(q, sf, gs)
    rawkv.nvfp4.gather(fake(torch.zeros(3, 16, dtype=torch.uint8)), fake(torch.zeros(3, 2, dtype=torch.uint8)),
                       1.0, fake(torch.zeros(0, dtype=torch.int64)))
    assert rt.calls == []


def test_host_arrays_with_strides_of_no_whole_elements_are_refused():
    """A numpy view whose byte strides are not whole elements (a record
    field, 130-byte rows of float32) has no torch or CUDA counterpart: the
    stride rules, which count elements, are not fooled by it (130 // 4 read
    as 32), and it is refused by name."""
    rec = np.zeros(4, dtype=[("a", np.float32, (32,)), ("pad", np.uint8, 2)])
    with pytest.raises(ValueError, match=r"^x: strides \(130, 4\) \(bytes\) are not whole 4-byte elements"):
        rawkv.nvfp4.quantize(rec["a"])
    q, sf, gs = rawkv.nvfp4.quantize(np.ascontiguousarray(rec["a"]))        # the copy is taken
    assert q.shape == (4, 16)


def test_a_layout_quantize_refuses_is_named_before_its_outputs_are_sized():
    """A stride-0 view of 2^34 rows sized q and sf (TBs) before x was
    refused (rawkv._args.out_rows); row-strided views, which quantize takes,
    still size their outputs."""
    huge = torch.zeros(1, 16, dtype=torch.bfloat16).expand(2 ** 34, 16)
    with pytest.raises(ValueError, match=r"^x: unsupported strides \(0, 1\)"):
        rawkv.nvfp4.quantize(huge, scope="row")
    x = torch.randn(8, 64).bfloat16()
    for view in (x[:, :32], x[::2, :32]):
        q, sf, gs = rawkv.nvfp4.quantize(view, scope="row")
        ref = rawkv.nvfp4.quantize(view.contiguous(), scope="row")
        assert q.shape == (view.shape[0], 16) and torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8))
        assert torch.equal(sf.view(torch.uint8), ref[1].view(torch.uint8)) and torch.equal(gs, ref[2])


def test_decode_inputs_the_rules_refuse_are_named_before_out_is_sized():
    """dequantize sized out from q, gather from q and indices, before the
    rules had checked them: a stride-0 view of 2^34 rows (or of one row of
    2^38 bytes) allocated terabytes first (rawkv._args.out_lead)."""
    q, sf = torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8)
    idx = torch.zeros(4, dtype=torch.int32)
    long_row = torch.zeros(1, 1, dtype=torch.uint8).expand(1, 2 ** 38)
    cases = [
        ("q", lambda: nv.dequantize(q.expand(2 ** 34, 8), sf.expand(2 ** 34, 1), 1.0)),
        ("q", lambda: nv.dequantize(np.broadcast_to(q.numpy(), (2 ** 34, 8)),
                                    np.broadcast_to(sf.numpy(), (2 ** 34, 1)), 1.0)),
        ("q", lambda: nv.dequantize(long_row, sf, 1.0)),
        ("q", lambda: nv.gather(long_row, sf, 1.0, idx)),
        ("indices", lambda: nv.gather(q, sf, 1.0, idx[:1].expand(2 ** 34))),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=f"^{name}: must be contiguous"):
            call()



def test_a_dlpack_input_without_shape_is_sized_as_the_rules_read_it():
    """The DLPack protocol promises no .shape: a bare producer's x, q or
    indices sized outputs of no rows, then refused as out[0] / out
    (rawkv._args.as_read sizes them from the view the rules wrap it in)."""
    x = torch.randn(4, 64)
    q, sf, gs = nv.quantize(x, scope="row")
    q8, idx = q.view(torch.uint8), torch.tensor([3, 0, 3], dtype=torch.int32)
    for got, want in [(nv.quantize(Bare(x), scope="row"), nv.quantize(x, scope="row")),
                      ((nv.dequantize(Bare(q8), sf, gs),), (nv.dequantize(q8, sf, gs),)),
                      ((nv.gather(Bare(q8), sf, gs, idx),), (nv.gather(q8, sf, gs, idx),)),
                      ((nv.gather(q8, sf, gs, Bare(idx)),), (nv.gather(q8, sf, gs, idx),))]:
        for g, w in zip(got, want):         # (a host DLPack input gets numpy outputs: BF16 as float32)
            g, w = (t.view(torch.uint8) if t.element_size() == 1 else t.float() for t in (torch.as_tensor(g), w))
            assert torch.equal(g, w)


class _OnDevice(Bare):
    """A bare CUDA DLPack producer (read as a fake CUDA tensor)."""

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("n", [0, 2])
def test_a_dlpack_gs_without_shape_of_other_than_one_element_is_named(rt, monkeypatch, n):
    """A given gs is one element; a DLPack gs without .shape slipped past
    that check (check_scope_gs reads .shape): on CPU the reference failed
    with numpy's unnamed 'cannot reshape array of size 2 into shape ()', on
    CUDA the kernel read the first of 2 floats, or past an empty gs.
    Refused on both, naming gs, before anything is launched or written."""
    from rawkv import _args
    x, g = torch.randn(4, 32), torch.full((n,), 0.5)
    q, sf, gout = torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), torch.zeros(())
    msg = rf"^gs: expected a float or a 1-element tensor, got shape \({n},\)"
    for out in (None, (q, sf, gout)):
        with pytest.raises(ValueError, match=msg):
            nv.quantize(x, scope="given", gs=Bare(g), out=out)
    monkeypatch.setattr(_args, "as_cuda_tensor", lambda a, name: fake(a.a) if isinstance(a, _OnDevice) else fake(a))
    for out in (None, tuple(map(fake, (q, sf, gout)))):
        with pytest.raises(ValueError, match=msg):
            nv.quantize(fake(x), scope="given", gs=_OnDevice(g), out=out)
    assert rt.calls == [] and not q.any() and not sf.any() and not gout.any()


def test_a_dlpack_gs_without_reshape_is_returned_as_the_gs_it_is():
    """With no out gs the given gs is the result's gs, reshaped to (): a
    DLPack array need not have .reshape (AttributeError: 'Bare' object has
    no attribute 'reshape' after the encode ran); it comes back as the view
    of its memory the rules read, shape ()."""
    x, g = torch.randn(4, 32), torch.full((1,), 0.5)
    q, sf, gs = nv.quantize(x, scope="given", gs=Bare(g))
    want = nv.quantize(x, scope="given", gs=g)
    assert torch.is_tensor(gs) and gs.shape == () and gs.data_ptr() == g.data_ptr()
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(gs, want[2])
    a = np.full((1,), 0.5, np.float32)
    assert nv.quantize(x.numpy(), scope="given", gs=Bare(a))[2].shape == ()


def test_a_device_dlpack_gs_of_one_element_is_read_on_the_device(rt, monkeypatch):
    """The one-element bare device gs is taken: the kernel reads it in place,
    and it is the result's gs (the view the rules read)."""
    from rawkv import _args
    monkeypatch.setattr(_args, "as_cuda_tensor", lambda a, name: fake(a.a) if isinstance(a, _OnDevice) else fake(a))
    monkeypatch.setattr(_args, "_dlpack_view", lambda a: fake(a.a))
    g = torch.full((1,), 0.5)
    _, _, gs = nv.quantize(fake(torch.randn(4, 32)), scope="given", gs=_OnDevice(g))
    assert [c[3]["gs_ptr"] for c in rt.calls] == [g.data_ptr()]
    assert gs.shape == () and gs.data_ptr() == g.data_ptr()
