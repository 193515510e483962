"""The fused ops as torch custom operators (rawkv.library; the schemas in
docs/fused.md): the operator writes what the public op returns, its gs
arguments and errors name the argument, traced results equal the eager ones
(out= variants included); on the GPU, the operators in a captured step and on
their tensors' device. opcheck and the compiled steps of every op are in
tests/guards/test_library.py (tests/support/library_samples_fused.py)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library  # noqa: E402,F401
from rawkv import fused as F  # noqa: E402
from support.fused import _inputs, same_result  # noqa: E402


# ---- the operator and torch.compile -----------------------------------------------------------------
BF16, U8 = torch.bfloat16, torch.uint8
OPS = torch.ops.rawkv


def _x(rng, *shape, dtype=BF16, lo=None):
    a = rng.standard_normal(shape) if lo is None else rng.uniform(lo, lo + 1, shape)
    return torch.from_numpy(a.astype(np.float32)).to(dtype)


def _empty_like_result(r, byte_views=True):
    """Buffers for out= / the operator: uint8 for the FP4 / FP8 parts."""
    return tuple(None if t is None else torch.empty(t.shape, dtype=U8 if byte_views and t.element_size() == 1
                                                    and t.dtype.is_floating_point else t.dtype) for t in r)


def test_operators_write_what_the_public_ops_return(rng):
    x, w = _x(rng, 3, 64), _x(rng, 64, dtype=torch.float32, lo=0.5)
    X, mix = _x(rng, 3, 2, 64), _x(rng, 3, 2, dtype=torch.float32, lo=0.0)
    h = _x(rng, 3, 256)
    hid, ids, wts = _x(rng, 2, 128), torch.tensor([[3, 1], [0, 7]]), _x(rng, 2, 2, dtype=torch.float32)
    gs = torch.tensor([0.01])
    cases = [
        (F.rmsnorm_quantize(x, w, 1e-5, scope="tensor"), OPS.rmsnorm_quantize, (x, w, 1e-5, "tensor", None, None)),
        (F.rmsnorm_quantize(x, w, gs=0.02), OPS.rmsnorm_quantize, (x, w, 1e-6, "given", None, 0.02)),
        (F.mhc_rmsnorm_quantize(X, mix, w, gs=gs), OPS.mhc_rmsnorm_quantize, (X, mix, w, 1e-6, "given", gs, None)),
        (F.swiglu_quantize(h, 4), OPS.swiglu_quantize, (h, 4, "row", None, None)),
        (F.moe_stage(hid, ids, wts), OPS.moe_stage, (hid, ids, wts)),
    ]
    for want, op, args in cases:
        bufs = [b for b in _empty_like_result(want) if b is not None]
        assert op(*args, *bufs) is None
        for b, t in zip(bufs, [t for t in want if t is not None]):
            assert torch.equal(b, t.view(U8) if b.dtype == U8 and t.dtype != U8 else t)


def test_operator_gs_arguments():
    """gs (a tensor) and gs_value (a number) are one public gs: at most one
    of them, checked as the public op checks gs (rawkv.nvfp4's rule)."""
    h = torch.ones(2, 64, dtype=BF16)
    bufs = (torch.empty(2, 16, dtype=U8), torch.empty(2, 2, dtype=U8), torch.empty(()))
    with pytest.raises(ValueError, match="^gs:"):
        OPS.swiglu_quantize(h, 8, "given", torch.tensor([0.5]), 0.5, *bufs)
    with pytest.raises(ValueError, match="^gs:"):
        OPS.swiglu_quantize(h, 8, "given", None, None, *bufs)
    with pytest.raises(ValueError, match="^gs:"):
        OPS.swiglu_quantize(h.half(), 8, "given", None, 2e7, *bufs)       # over the float16 bound
    with pytest.raises(ValueError, match="^gs:"):
        OPS.swiglu_quantize(h, 8, "row", None, 0.5, *bufs)
    OPS.swiglu_quantize(h, 8, "given", None, 2e7, *bufs)                   # bfloat16: usable
    assert float(bufs[2]) == 2e7


def test_operator_errors_name_the_argument():
    x, w = torch.ones(2, 64, dtype=BF16), torch.ones(64)
    bufs = (torch.empty(2, 32, dtype=U8), torch.empty(2, 4, dtype=U8), torch.empty(2), torch.empty(2))
    with pytest.raises(ValueError, match="^eps"):
        OPS.rmsnorm_quantize(x, w, 0.0, "row", None, None, *bufs)
    with pytest.raises(ValueError, match="^scope"):
        OPS.rmsnorm_quantize(x, w, 1e-6, "blocks", None, None, *bufs)
    with pytest.raises(ValueError, match="^out.gs"):
        OPS.rmsnorm_quantize(x, w, 1e-6, "tensor", None, None, *bufs)       # gs_out (2,): scope tensor has one
    with pytest.raises(TypeError, match="^out.topk_ids"):
        OPS.moe_stage(torch.ones(2, 128, dtype=BF16), torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 4),
                      torch.empty(2, 64, dtype=U8), torch.empty(2, 2, dtype=torch.int32),
                      torch.empty(2, 4, dtype=torch.int32), torch.empty(2, 4))


# (id, call(args, out) -> result, args, out): traced and eager give the same result
def _rms_args(rng):
    return _x(rng, 3, 2, 64), _x(rng, 64, dtype=torch.float32, lo=0.5)


TRACED = [
    ("rms-row", lambda a, o: F.rmsnorm_quantize(*a, out=o), _rms_args, None),
    ("rms-tensor-out-bytes", lambda a, o: F.rmsnorm_quantize(*a, scope="tensor", out=o), _rms_args,
     lambda: (torch.empty(3, 2, 32, dtype=U8), None, None, torch.empty(3, 2))),
    ("rms-given-out.gs-(1,)", lambda a, o: F.rmsnorm_quantize(*a, gs=np.float32(0.03), out=o), _rms_args,
     lambda: (None, torch.empty(3, 2, 4, dtype=torch.float8_e4m3fn), torch.empty(1), None)),
    ("mhc-given-tensor", lambda a, o: F.mhc_rmsnorm_quantize(*a, gs=torch.tensor(0.01), out=o),
     lambda rng: (_x(rng, 2, 3, 64), _x(rng, 2, 3, dtype=torch.float32), _x(rng, 64, lo=0.5)), None),
    ("swiglu-none-out-list", lambda a, o: F.swiglu_quantize(*a, scope="none", out=o),
     lambda rng: (_x(rng, 4, 96, dtype=torch.float16), 3), lambda: [None, None, torch.empty(())]),
    ("moe-out-some", lambda a, o: F.moe_stage(*a, out=o),
     lambda rng: (_x(rng, 3, 256), torch.zeros(3, 5, dtype=torch.int64), _x(rng, 3, 5)),
     lambda: (None, torch.empty(3, 4, dtype=torch.int32), None, torch.empty(3, 5, dtype=BF16))),
]


@pytest.mark.parametrize("case", TRACED, ids=[c[0] for c in TRACED])
def test_traced_results_are_the_eager_ones(rng, case):
    """Under torch.compile (fullgraph, aot_eager) the public op allocates
    what the eager path returns (FP4 / FP8 views, gs shapes by scope, out=
    entries returned as given) and the operator writes the same bits."""
    _, call, make_args, make_out = case
    args = make_args(rng)
    want = call(args, None if make_out is None else make_out())
    torch._dynamo.reset()
    out = None if make_out is None else make_out()
    got = torch.compile(lambda *a: call(a, out), fullgraph=True, backend="aot_eager")(*args)
    assert same_result(got, want)
    if out is not None:                      # the given buffers are the result's
        assert all(g is o for g, o in zip(got, out) if o is not None)


def _operator_calls(rng):
    """(operator, inputs, outputs) of every fused operator on cuda:0 (the
    FP8 ones with E8M0 scales: the operators take their uint8 bytes)."""
    x, w, X, A, h, hid, ids, wts = _inputs(rng, 5, 512, 2, 1024, torch.float16, 4)
    gs = torch.tensor([0.004], device="cuda")

    def outs(n, gs_shape, inv=True):
        o = (torch.empty(5, n // 2, dtype=torch.uint8, device="cuda"),
             torch.empty(5, n // 16, dtype=torch.uint8, device="cuda"), torch.empty(gs_shape, device="cuda"))
        return o + (torch.empty(5, device="cuda"),) if inv else o
    ops = torch.ops.rawkv
    moe_out = (torch.empty(5, 256, dtype=torch.uint8, device="cuda"), torch.empty(5, 8, dtype=torch.int32, device="cuda"),
               torch.empty(5, 4, dtype=torch.int64, device="cuda"), torch.empty(5, 4, device="cuda"))
    def fp8_outs(n, nb, inv=True):
        o = (torch.empty(5, n, dtype=torch.uint8, device="cuda"), torch.empty(5, nb, dtype=torch.uint8, device="cuda"))
        return o + (torch.empty(5, device="cuda"),) if inv else o
    return [(ops.rmsnorm_quantize, (x, w, 1e-6, "row", None, None), outs(512, (5,))),
            (ops.mhc_rmsnorm_quantize, (X, A, w, 1e-6, "given", gs, None), outs(512, (1,))),
            (ops.swiglu_quantize, (h, 8, "tensor", None, None), outs(512, (), False)),
            (ops.moe_stage, (hid, ids, wts), moe_out),
            (ops.rmsnorm_quantize_fp8, (x, w, 1e-6, 128, "ue8m0"), fp8_outs(512, 4)),
            (ops.mhc_rmsnorm_quantize_fp8, (X, A, w, 1e-6, 64, "ue8m0"), fp8_outs(512, 8)),
            (ops.swiglu_quantize_fp8, (h, 8, 32, "ue8m0"), fp8_outs(512, 16, False)),
            (ops.moe_stage_fp8, (hid, ids, wts, 128, "ue8m0"), fp8_outs(512, 4, False) + tuple(torch.empty_like(t) for t in moe_out[2:]))]


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
