"""The fused producers held to one rule at once (each op's own tests are in its
test file): the CPU path of every op, no rows and empty inputs, the given-gs
bound of the input dtype, the argument rules on the CPU, the launch plans (CUDA paths on a CPU through the
recording runtime of tests/nvfp4/conftest.py's kind: which gs pointer, value
and error counter each launch receives), fused.cu's constants, and on the GPU
the given device gs rule, out= buffers, graph capture and streams."""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv import fused as F  # noqa: E402
from rawkv.fused import plans as _rows  # noqa: E402
from rawkv.kernels import fused as K  # noqa: E402
from rawkv import nvfp4 as N  # noqa: E402
from rawkv.reference import fused as R  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
import rawkv  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.fused import (  # noqa: E402
    _assert_equal, _b, _check_rms, _dt, _inputs, _names, _np, _rand, _with_edges, _x)


# ---- the reference ----------------------------------------------------------------------------------
F32 = np.float32


def test_mhc_and_swiglu_and_moe_cpu(rng):
    X = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    A = torch.rand(4, 3)
    qa = F.mhc_rmsnorm_quantize(X, A, torch.ones(32))
    ref = R.mhc_rmsnorm_quantize(X.float().numpy(), A.numpy(), np.ones(32, F32))
    assert np.array_equal(qa.q.view(torch.uint8).numpy(), ref[0])
    assert np.array_equal(qa.sf.view(torch.uint8).numpy(), ref[1])
    assert np.array_equal(qa.gs.numpy(), ref[2]) and np.array_equal(qa.inv_rms.numpy(), ref[3])
    h = torch.randn(2, 3, 192).half()
    for g in (8, 4, 3, 6, 12):
        qs = F.swiglu_quantize(h, g, scope="given", gs=0.01)
        rs = R.swiglu_quantize(h.float().numpy().reshape(6, 192), g, "given", 0.01, "float16")
        assert np.array_equal(qs.q.view(torch.uint8).numpy().reshape(6, 48), rs[0]) and qs.inv_rms is None
        assert float(qs.gs) == float(F32(0.01))
    hid, ids, wts = torch.randn(3, 256).bfloat16(), torch.randint(0, 8, (3, 2), dtype=torch.int32), \
        torch.rand(3, 2).bfloat16()
    st = F.moe_stage(hid, ids, wts)
    assert st.q.dtype == torch.uint8 and st.sf.dtype == torch.int32 and st.sf.shape == (3, 4)
    assert st.topk_ids.dtype == torch.int64 and st.topk_weights.dtype == torch.bfloat16
    q, sf, ids64, _ = R.moe_stage(hid.float().numpy(), ids.numpy(), wts.float().numpy())
    assert np.array_equal(st.q.numpy(), q) and np.array_equal(st.sf.numpy(), sf)
    assert np.array_equal(st.topk_ids.numpy(), ids64) and torch.equal(st.topk_weights, wts)


def test_zero_rows_and_empty():
    qa = F.rmsnorm_quantize(np.zeros((2, 32), F32), np.ones(32, F32))
    assert np.all(qa.q == 0) and np.all(qa.sf == 0x38) and np.all(qa.gs == 1)   # zero blocks: scale 1.0
    assert np.allclose(qa.inv_rms, 1 / np.sqrt(F32(1e-6)))
    qe = F.swiglu_quantize(np.zeros((0, 64), F32))
    assert qe.q.shape == (0, 16) and qe.gs.shape == (0,)


@pytest.mark.parametrize("scope, gs, want", [("row", None, None), ("tensor", None, 1.0), ("none", None, 1.0),
                                             ("given", 0.5, 0.5)])
def test_no_rows_every_output_defined(scope, gs, want):
    """M == 0 (any leading dim 0): empty codes / scales / inv_rms, and a defined gs."""
    kw = dict(scope=scope, gs=gs)
    w = torch.ones(64)
    for qa, lead, has_inv in ((F.rmsnorm_quantize(torch.zeros(2, 0, 64).bfloat16(), w, **kw), (2, 0), True),
                              (F.mhc_rmsnorm_quantize(torch.zeros(0, 3, 64).half(), torch.ones(0, 3), w, **kw),
                               (0,), True),
                              (F.swiglu_quantize(torch.zeros(0, 128).bfloat16(), **kw), (0,), False)):
        assert qa.q.shape == (*lead, 32) and qa.sf.shape == (*lead, 4)
        if want is None:
            assert qa.gs.shape == lead
        else:
            assert qa.gs.shape == () and float(qa.gs) == want
        assert qa.inv_rms.shape == lead if has_inv else qa.inv_rms is None
    st = F.moe_stage(torch.zeros(0, 128).bfloat16(), torch.zeros(0, 8, dtype=torch.int32), torch.zeros(0, 8))
    assert st.q.shape == (0, 64) and st.sf.shape == (0, 2) and st.topk_ids.shape == (0, 8)


def _op_dt(op, dtype, **kw):
    """Producer `op` (0 rms, 1 mhc, 2 swiglu) on CPU tensors of `dtype`."""
    t = lambda *s: torch.linspace(-3, 3, int(np.prod(s))).reshape(s).to(dtype)  # noqa: E731
    if op == 0:
        return F.rmsnorm_quantize(t(2, 32), torch.ones(32), **kw)
    if op == 1:
        return F.mhc_rmsnorm_quantize(t(2, 2, 32), torch.ones(2, 2), torch.ones(32), **kw)
    return F.swiglu_quantize(t(2, 64), **kw)


def _ref_dt(op, dtype, gs):
    """The reference's (q, sf, gs) of _op_dt's inputs under scope 'given'."""
    name = str(dtype).replace("torch.", "")
    t = lambda *s: torch.linspace(-3, 3, int(np.prod(s))).reshape(s).to(dtype).float().numpy()  # noqa: E731
    if op == 0:
        return R.rmsnorm_quantize(t(2, 32), np.ones(32, F32), 1e-6, "given", gs, name)[:3]
    if op == 1:
        return R.mhc_rmsnorm_quantize(t(2, 2, 32), np.ones((2, 2), F32), np.ones(32, F32), 1e-6, "given",
                                      gs, name)[:3]
    return R.swiglu_quantize(t(2, 64), 8, "given", gs, name)


@pytest.mark.parametrize("op", range(3))
def test_given_gs_bound_of_the_input_dtype(op):
    """A number or host array gs at or above given_gs_limit(x's dtype) is a
    ValueError naming gs (every block scale would be 0); just below it, and
    2e7 for bfloat16 / float32 input (refused for float16: its bound is
    11179349), it is used. A value accepted for bfloat16 is still refused
    for float16."""
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        name = str(dtype).replace("torch.", "")
        limit = RN.given_gs_limit(name)
        below = float(np.nextafter(F32(limit), F32(0)))
        for good in (below, 2e7) if name != "float16" else (below,):
            for gs in (good, good, np.array([good], F32), torch.tensor(good)):
                got = _op_dt(op, dtype, gs=gs)
                want = _ref_dt(op, dtype, good)
                assert np.array_equal(got.q.view(torch.uint8).numpy(), want[0])
                assert np.array_equal(got.sf.view(torch.uint8).numpy(), want[1])
                assert not (want[1] == 0x7F).all()              # used, not flagged
        bad = (limit, 2e7) if name == "float16" else (limit,)
        for g in bad:
            for gs in (g, g, np.float32(g), np.array([g], F32), torch.tensor([g])):
                with pytest.raises(ValueError, match="^gs:"):
                    _op_dt(op, dtype, gs=gs)


@pytest.mark.parametrize("op", range(3))
@pytest.mark.parametrize("g", [-0.5, -0.0, 0.0, np.nan, np.inf, -np.inf, "limit"])
def test_reference_flags_an_unusable_given_gs(op, g):
    """rawkv.reference.fused applies rawkv.reference.nvfp4's rule (what the
    kernels are compared with): a gs that given_gs_ok refuses for the input
    dtype is never used, sign bit included: every block is flagged (sf
    0x7F, codes 0) and gs is the given value. The ops refuse it on the host."""
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        gv = RN.given_gs_limit(name) if g == "limit" else g
        q, sf, gs = _ref_dt(op, dtype, gv)
        assert not q.any() and (sf == 0x7F).all()
        assert np.asarray(gs, F32).view(np.uint32) == np.asarray(gv, F32).view(np.uint32)
        with pytest.raises(ValueError, match="^gs:"):
            _op_dt(op, dtype, gs=np.array([gv], F32))


def test_dequantize_takes_a_quantized_activation(rng):
    x = torch.from_numpy(rng.standard_normal((3, 4, 64)).astype(F32)).bfloat16()
    for qa in (F.rmsnorm_quantize(x, torch.ones(64)),                          # gs per row
               F.swiglu_quantize(x, scope="tensor"),                           # gs scalar
               F.rmsnorm_quantize(x.float().numpy(), np.ones(64, F32))):      # numpy
        for dt in (None, "float32"):
            want = N.dequantize(qa.q, qa.sf, qa.gs, dtype=dt)
            for got in (N.dequantize(qa, dtype=dt), qa.dequantize(dt)):
                assert type(got) is type(want) and got.dtype == want.dtype
                assert np.array_equal(_f32(got), _f32(want))
    with pytest.raises(TypeError, match="^sf, gs"):
        N.dequantize(qa.q)                              # a plain array needs sf and gs
    with pytest.raises(TypeError, match="^sf, gs"):
        N.dequantize(qa, qa.sf)                         # an activation takes neither


def _f32(a):
    return a.float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, F32)


# ---- argument errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("call, arg", [
    (lambda: F.rmsnorm_quantize(_x(2, 0), _x(0)), "x"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 3, 0), _x(2, 3), _x(0)), "x"),
    (lambda: F.swiglu_quantize(_x(2, 0)), "h"),
    (lambda: F.moe_stage(_x(2, 0), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: R.rmsnorm_quantize(_x(2, 0), _x(0)), "x"),
    (lambda: R.swiglu_quantize(_x(2, 0)), "h"),
])
def test_empty_last_dim_is_an_error(call, arg):
    """N == 0: a ValueError naming the input (CUDA would leave gs / inv_rms unwritten)."""
    with pytest.raises(ValueError) as ei:
        call()
    assert _names(str(ei.value), arg), str(ei.value)


_OPS_GS = [lambda **kw: F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), **kw),
           lambda **kw: F.mhc_rmsnorm_quantize(np.ones((2, 2, 32), F32), np.ones((2, 2), F32), np.ones(32, F32), **kw),
           lambda **kw: F.swiglu_quantize(np.ones((2, 64), F32), **kw)]


@pytest.mark.parametrize("op", range(3))
@pytest.mark.parametrize("gs", [-1.0, 0.0, float("nan"), float("inf"), 1e39, 1e-50, True, np.float32(-2.0)])
def test_bad_number_gs_is_refused(op, gs):
    with pytest.raises((ValueError, TypeError)) as ei:
        _OPS_GS[op](gs=gs)
    assert _names(str(ei.value), "gs"), str(ei.value)
    assert type(ei.value) is (TypeError if gs is True else ValueError)


@pytest.mark.parametrize("op", range(3))
def test_host_gs_array_value_is_checked(op):
    """A host gs array's value is already on the host: refused as a number
    would be; a good one gives the number's bits."""
    for bad in (-1.0, 0.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="^gs:"):
            _OPS_GS[op](gs=np.array([bad], F32))
    want = _OPS_GS[op](gs=0.5)
    for gs in (np.array([0.5], F32), np.array(0.5, F32), torch.tensor([0.5])):
        got = _OPS_GS[op](gs=gs)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want) if a is not None)


@pytest.mark.parametrize("op", range(3))
def test_numpy_scalar_gs_and_eps_accepted(op):
    want = _OPS_GS[op](gs=0.5)
    for gs in (np.float32(0.5), np.float64(0.5)):
        got = _OPS_GS[op](gs=gs)
        assert all(np.array_equal(a, b) for a, b in zip(got, want) if a is not None)
    if op == 0:      # eps: numpy real scalars too, as the float32 the kernel uses
        a = F.rmsnorm_quantize(np.ones((2, 32), F32) * 1e-3, np.ones(32, F32), eps=np.float32(1e-6))
        b = F.rmsnorm_quantize(np.ones((2, 32), F32) * 1e-3, np.ones(32, F32), eps=float(F32(1e-6)))
        assert np.array_equal(a.inv_rms, b.inv_rms) and np.array_equal(a.q, b.q)
        for bad in (np.float32(np.nan), -1e-6, 1e39, 0.0, 0, np.float64(0.0)):
            with pytest.raises(ValueError, match="^eps"):
                F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), eps=bad)
        with pytest.raises(TypeError, match="^eps: expected a number, got bool$"):
            F.rmsnorm_quantize(np.ones((2, 32), F32), np.ones(32, F32), eps=True)


@pytest.mark.parametrize("call, arg", [
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(_x(2, 16), None, None)), "out.q"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(None, _x(2, 2), None)), "out.sf"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(None, None, np.zeros(2))), "out.gs"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(None, None, None, np.zeros(2, np.float16))),
     "out.inv_rms"),
    (lambda: F.swiglu_quantize(_x(2, 64), out=(np.zeros((2, 16), np.int8), None, None)), "out.q"),
    (lambda: F.rmsnorm_quantize(np.ones((2, 32), np.int32), _x(32)), "x"),
    (lambda: F.rmsnorm_quantize(np.ones((2, 32)), _x(32)), "x"),                     # float64
    (lambda: F.rmsnorm_quantize(_x(2, 32), np.ones(32, np.int32)), "weight"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 1, 32), np.ones((2, 1), np.int64), _x(32)), "mix"),
    (lambda: F.swiglu_quantize(np.ones((2, 64), np.int16)), "h"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), gs=np.ones(1)), "gs"),             # float64 tensor gs
    (lambda: F.moe_stage(np.ones((2, 128), np.int32), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.uint8), _x(2, 4)), "topk_ids"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), np.zeros((2, 4), np.int32)), "topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), np.zeros((2, 4))), "topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(None, np.zeros((2, 8), np.uint8), None, None)), "out.sf"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(None, None, np.zeros((2, 4), np.int32), None)), "out.topk_ids"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(None, None, None, np.zeros((2, 4), np.float16))), "out.topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 4),
                         out=(_x(2, 64), None, None, None)), "out.q"),
])
def test_cpu_dtype_errors(call, arg):
    with pytest.raises(TypeError) as ei:
        call()
    assert _names(str(ei.value), arg), str(ei.value)


@pytest.mark.parametrize("call, arg", [
    (lambda: F.rmsnorm_quantize(_x(2, 24), _x(24)), "x"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(16)), "weight"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), eps=-1.0), "eps"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), scope="blocks"), "scope"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), scope="given"), "gs"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), scope="row", gs=1.0), "gs"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(_x(2, 16),)), "out"),
    (lambda: F.rmsnorm_quantize(_x(2, 32), _x(32), out=(np.zeros((2, 8), np.uint8), None, None)), "out.q"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 5, 32), _x(2, 5), _x(32)), "x"),
    (lambda: F.mhc_rmsnorm_quantize(_x(2, 3, 32), _x(2, 4), _x(32)), "mix"),
    (lambda: F.mhc_rmsnorm_quantize(_x(32), _x(1), _x(32)), "x"),
    (lambda: F.swiglu_quantize(_x(2, 40)), "h"),
    (lambda: F.swiglu_quantize(_x(2, 33)), "h"),
    (lambda: F.swiglu_quantize(_x(2, 64), 3), "granularity"),
    (lambda: F.swiglu_quantize(_x(2, 64), 0), "granularity"),
    (lambda: F.moe_stage(_x(2, 192), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: F.moe_stage(_x(2, 2, 128), np.zeros((2, 4), np.int32), _x(2, 4)), "hidden"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((3, 4), np.int32), _x(3, 4)), "topk_ids"),
    (lambda: F.moe_stage(_x(2, 128), np.zeros((2, 4), np.int32), _x(2, 3)), "topk_weights"),
    (lambda: F.moe_stage(_x(2, 128), _x(2, 4), _x(2, 4)), "topk_ids"),
])
def test_argument_errors_name_the_argument(call, arg):
    with pytest.raises((ValueError, TypeError)) as ei:
        call()
    assert _names(str(ei.value), arg), str(ei.value)


# ---- launch plan ------------------------------------------------------------------------------------
def _calls(rt, op, dtype, **kw):
    """Run producer `op` on fake CUDA inputs of `dtype`; its launches' arguments."""
    rt.calls.clear()
    if op == "rms":
        res = rawkv.fused.rmsnorm_quantize(fake(torch.ones(3, 64, dtype=dtype)), fake(torch.ones(64)), **kw)
    elif op == "mhc":
        res = rawkv.fused.mhc_rmsnorm_quantize(fake(torch.ones(3, 2, 64, dtype=dtype)), fake(torch.ones(3, 2)),
                                               fake(torch.ones(64)), **kw)
    else:
        res = rawkv.fused.swiglu_quantize(fake(torch.ones(3, 128, dtype=dtype)), **kw)
    return res, [c[3] for c in rt.calls if c[0] != "memset"]


@pytest.mark.parametrize("op", ["rms", "mhc", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_given_gs_launch_arguments(rt, op, dtype):
    """A device gs goes to the kernel with rawkv.nvfp4's GIVEN_GS counter
    (the kernel checks it and counts a refused one); a number goes by value
    with no counter (the host checked it); other scopes pass no counter."""
    counter = rt._counters.data_ptr() + 4 * rawkv.nvfp4.GIVEN_GS
    gdev = fake(torch.full((1,), -0.5))                # refused, by the kernel: not the host's to read
    res, (a,) = _calls(rt, op, dtype, gs=gdev)
    assert (a["gs_in"], a["gs_val"], a["mode"], a["errors"]) == (gdev.data_ptr(), 0.0, K.MODE_FIXED, counter)
    assert a["gs_out"] == res.gs.data_ptr()
    res, (a,) = _calls(rt, op, dtype, gs=0.25)
    assert (a["gs_in"], a["gs_val"], a["mode"], a["errors"]) == (0, 0.25, K.MODE_FIXED, 0)
    for scope, modes in (("row", [K.MODE_ROW]), ("tensor", [K.MODE_AMAX, K.MODE_TENSOR]),
                         ("none", [K.MODE_FIXED])):
        _, launches = _calls(rt, op, dtype, scope=scope)
        assert [a["mode"] for a in launches] == modes and all(a["errors"] == 0 for a in launches)


@pytest.mark.parametrize("op", ["rms", "mhc", "swiglu"])
def test_number_gs_over_the_dtype_bound_refused_before_launch(rt, op):
    """2e7 is over the float16 bound (11179349) and under the bfloat16 one;
    a number is held against the bound as the float32 it becomes."""
    with pytest.raises(ValueError, match="^gs:"):
        _calls(rt, op, torch.float16, gs=2e7)
    assert rt.calls == []
    _, launches = _calls(rt, op, torch.bfloat16, gs=2e7)
    assert len(launches) == 1 and launches[0]["gs_val"] == 2e7
    with pytest.raises(ValueError, match="^gs:"):             # still refused once seen for bfloat16
        _calls(rt, op, torch.float16, gs=2e7)
    assert rt.calls == []
    limit = RN.given_gs_limit("float16")
    below = float(np.nextafter(np.float32(limit), np.float32(0)))
    _, launches = _calls(rt, op, torch.float16, gs=below)
    assert len(launches) == 1 and launches[0]["gs_val"] == below
    for _ in range(2):                                        # as the float32 the kernel reads: the bound
        with pytest.raises(ValueError, match="^gs:"):
            _calls(rt, op, torch.float16, gs=limit - 1e-9)


_NP = {torch.float16: np.float16, torch.float32: np.float32, torch.uint8: np.uint8}


def _virtual(shape, dtype, like=None):
    """A contiguous tensor of `shape` over 64 bytes (a fake CUDA one where
    `like` is): the sizes a rule reads, memory nothing may read."""
    d = dtype if dtype in _NP else torch.uint8        # (an FP8 buffer: its bytes, viewed)
    item = np.dtype(_NP[d]).itemsize
    st = tuple(int(np.prod(shape[i + 1:])) * item for i in range(len(shape)))
    t = torch.from_numpy(np.lib.stride_tricks.as_strided(np.zeros(64 // item, _NP[d]), shape, st)).view(dtype)
    return fake(t) if isinstance(like, type(fake(torch.zeros(1)))) else t


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
@pytest.mark.parametrize("op", ["rms", "mhc", "swiglu", "rms_fp8", "mhc_fp8", "swiglu_fp8"])
def test_rows_past_the_launch_grid_refused_before_anything(rt, monkeypatch, placement, op):
    """The row kernels run one CTA per row (grid (rows,)), and a grid's x
    dimension holds at most 2^31 - 1 blocks: 2^31 rows of 16 FP16 values
    (64 GiB) were accepted on CPU and CUDA alike, and the launch failed on
    the GPU after the memset of scope 'tensor' had written out.gs. Refused (a
    ValueError naming x / h) on both, before anything is launched; the
    memory behind these tensors is never read (64 bytes)."""
    from rawkv import fp8
    from rawkv.fused import rms, swiglu
    move = fake if placement == "cuda" else (lambda t: t)
    virt = lambda s, d, like: _virtual(s, getattr(torch, d) if isinstance(d, str) else d, like)  # noqa: E731
    monkeypatch.setattr(rms, "empties", lambda like, stream, *specs: [
        None if s is None else virt(s[0], s[1], like) for s in specs])
    monkeypatch.setattr(fp8, "new_scales", lambda like, s, block, fmt, stream=None: virt(
        (*s[:-1], -(-s[-1] // block)), "float32", like))

    class _NotRead:
        def __getattr__(self, name):
            raise AssertionError("the reference ran on rows past the launch grid")
    monkeypatch.setattr(rms, "ref", _NotRead())
    monkeypatch.setattr(swiglu, "ref", _NotRead())
    monkeypatch.setattr(rms, "_reference", lambda *a: _NotRead().run)
    rows, w = 2 ** 31, move(torch.ones(16))
    x, mix = move(_virtual((rows, 16), torch.float16)), move(_virtual((rows, 1), torch.float32))
    X, h = move(_virtual((rows, 1, 16), torch.float16)), move(_virtual((rows, 32), torch.float16))
    call, name = {
        "rms": (lambda: F.rmsnorm_quantize(x, w, scope="tensor"), "x"),
        "mhc": (lambda: F.mhc_rmsnorm_quantize(X, mix, w, scope="tensor"), "x"),
        "swiglu": (lambda: F.swiglu_quantize(h, scope="tensor"), "h"),
        "rms_fp8": (lambda: F.rmsnorm_quantize_fp8(x, w), "x"),
        "mhc_fp8": (lambda: F.mhc_rmsnorm_quantize_fp8(X, mix, w), "x"),
        "swiglu_fp8": (lambda: F.swiglu_quantize_fp8(h), "h"),
    }[op]
    rt.calls.clear()
    with pytest.raises(ValueError, match=rf"^{name}: {rows} rows"):
        call()
    assert rt.calls == []
    # (2^31 - 1 rows still plan one CTA per row)
    a = rawkv.fused._rules.rms(fake(_virtual((rows - 1, 16), torch.float16)), None, fake(torch.ones(16)), 1e-6,
                               "row", None, None, None, None, None, None, fresh=True)[0]
    assert a.rows == rows - 1

class _FakeRt:
    def __init__(self, sm_count):
        self.sm_count = sm_count


@pytest.mark.parametrize("sm_count", [1, 80, 132, 148, 170])
def test_row_blocks_stay_within_every_arch_bound(sm_count):
    """The host launches at most K.MAX_BLOCK threads per row CTA, within the
    kernels' launch bound on every arch (below sm_100 and from sm_100 on),
    in whole warps; a prefill row fits its REG chunks per thread when it can."""
    rt = _FakeRt(sm_count)
    bound = min(K.MAX_THREADS, K.MAX_THREADS_SM100) // K.REG
    assert K.MAX_BLOCK == bound == 768           # the geometry the H100 numbers were measured with
    for rows in (1, 2 * sm_count - 1, 2 * sm_count, 10 ** 5):
        for chunks in (1, 16, 129, 448, 768, 1536, 1537, 2560, 10 ** 4):
            block = _rows.block_for(rt, rows, chunks)
            assert 32 <= block <= bound and block % 32 == 0, (rows, chunks, block)
            if rows < 2 * sm_count:              # decode: one chunk per thread, as far as it goes
                assert block == min(bound, -(-chunks // 32) * 32)
            elif chunks <= K.REG * bound:        # prefill: every chunk in registers
                assert chunks <= K.REG * block


def _fused_cu():
    from rawkv.kernels import _abi
    return (_abi.CU_DIR / "fused.cu").read_text()


def test_fused_cu_reads_every_shared_constant_from_the_declarations():
    src = _fused_cu()
    assert set(re.findall(r"\bRKV_FUSED_\w+", src)) == set(K.FILE.constants)
    guard = src[src.index("#if !defined("):src.index("#error")]
    assert set(re.findall(r"defined\((RKV_FUSED_\w+)\)", guard)) == set(K.FILE.constants)
    opts = K.FILE.options()
    for name, value in (("MAX_THREADS", K.MAX_THREADS), ("MAX_THREADS_SM100", K.MAX_THREADS_SM100),
                        ("MAX_HC", K.MAX_HC), ("MOE_BLOCK", K.MOE_BLOCK), ("MODE_TENSOR", K.MODE_TENSOR),
                        ("KIND_BF16", K.PARAM_KIND["bfloat16"])):
        assert f"-DRKV_FUSED_{name}={value}" in opts
    # the four row kernels (NVFP4 and FP8) are capped by the named register caps, not
    # literals, and the widest cap leaves room for a CTA of MAX_THREADS / REG threads
    caps = re.findall(r"__global__ void __maxnreg__\((.+?)\) rkv_fused_(\w+)\(", src)
    assert sorted(k for _, k in caps) == ["rms", "rms_fp8", "swiglu", "swiglu_fp8"], caps
    assert all(re.fullmatch(r"[\w<>(),?: ]*kRow\w*[\w<>(),?: ]*|\(kRmsRegs<T, MIX>\)", c) for c, _ in caps), caps
    assert "static_assert(kRowRegsWide * (kMaxThreads / 2) <= 65536" in src and K.REG == 2
    assert "__launch_bounds__(RKV_FUSED_MOE_BLOCK, kMoeMinBlocks)" in src
    assert "__launch_bounds__(RKV_FUSED_MOE_BLOCK, kMoeFp8MinBlocks) rkv_moe_stage_fp8(" in src
    assert len({K.MODE_ROW, K.MODE_AMAX, K.MODE_TENSOR, K.MODE_FIXED}) == 4
    assert sorted(K.PARAM_KIND.values()) == [0, 1, 2]


def test_fused_cu_compiles_only_with_its_constants():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")
    from rawkv import _nvrtc, runtime
    from rawkv.errors import CompileError
    with pytest.raises(CompileError, match="a shared constant is missing"):
        _nvrtc.compile_cu(_fused_cu(), "fused.cu", "sm_90", ["rkv_fused_set_gs"])
    res = _nvrtc.compile_cu(_fused_cu(), "fused.cu", "sm_90", ["rkv_fused_set_gs"],
                            runtime.kernel_options("fused.cu"))
    assert res.cubin[:4] == b"\x7fELF"


def test_nvrtc_check_compiles_with_the_files_constants(monkeypatch):
    import io
    from rawkv import _nvrtc
    from rawkv.errors import CompileError
    from rawkv.tools import nvrtc_check
    seen = {}

    def compile_cu(source, filename, arch, names, extra_options=(), verbose_ptxas=False):
        seen[filename] = tuple(extra_options)
        raise CompileError("not compiled here")
    monkeypatch.setattr(_nvrtc, "nvrtc_version", lambda: (12, 9))
    monkeypatch.setattr(_nvrtc, "cuda_include_dirs", lambda: ("/nowhere",))
    monkeypatch.setattr(_nvrtc, "compile_cu", compile_cu)
    assert nvrtc_check.check(("sm_90",), 0, files=["fused.cu"], out=io.StringIO()) == 1
    assert seen["fused.cu"] == K.FILE.options() and seen["fused.cu"]


# ---- GPU: against the reference ---------------------------------------------------------------------
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
