"""The NVFP4 ops as rawkv:: operators on the CPU (opcheck and the compiled
steps of every family are in test_library.py): the operators' own argument
rules, what they write against what the public ops return, and the public
ops' results being the same objects and dtypes on CPU and CUDA (what the
traced branch allocates)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library  # noqa: E402,F401
from rawkv.reference import nvfp4 as R  # noqa: E402

nv = rawkv.nvfp4
ops = torch.ops.rawkv


def _x(rng, shape=(4, 64)):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _u8(*shape):
    return torch.full(shape, 0xAB, dtype=torch.uint8)


def test_operator_gs_arguments_named_in_errors(rng):
    x = _x(rng)
    q, sf, g = nv.quantize(x, scope="row")
    out = torch.full((4, 64), 7.0)
    g1 = torch.tensor([0.5])
    calls = [
        (ValueError, "gs_out", lambda: ops.nvfp4_quantize(x, "tensor", None, None, _u8(4, 32), _u8(4, 4),
                                                          None, None)),
        (ValueError, "gs", lambda: ops.nvfp4_quantize(x, "given", g1, 0.5, _u8(4, 32), _u8(4, 4),
                                                      torch.empty(()), None)),
        (TypeError, "gs", lambda: ops.nvfp4_dequantize(q, sf, None, None, out)),
        (ValueError, "gs", lambda: ops.nvfp4_dequantize(q, sf, g, 0.5, out)),
        (TypeError, "gs", lambda: ops.nvfp4_gather(q, sf, None, None, torch.tensor([0]), out[:1], None)),
        (ValueError, "gs", lambda: ops.nvfp4_quantize(x, "given", None, 0.0, _u8(4, 32), _u8(4, 4),
                                                      torch.empty(()), None)),
        (ValueError, "out", lambda: ops.nvfp4_dequantize(q, sf, g, None, out[:, :32])),
    ]
    for exc, name, call in calls:
        with pytest.raises(exc, match=f"^{name}:"):
            call()
    assert (out == 7.0).all()


def test_operators_write_what_the_public_ops_return(rng):
    x = _x(rng)
    for scope, gs, gs_value in (("tensor", None, None), ("row", None, None), ("given", None, 0.03),
                                ("given", torch.tensor([0.03]), None), ("none", None, None)):
        q, sf = _u8(4, 32), _u8(4, 4)
        g = None if gs is not None else torch.empty((4,) if scope == "row" else ())
        ops.nvfp4_quantize(x, scope, gs, gs_value, q, sf, g, None)
        want = nv.quantize(x, scope=scope, gs=gs if gs is not None else gs_value)
        assert torch.equal(q, want[0].view(torch.uint8)) and torch.equal(sf, want[1].view(torch.uint8))
        assert g is None or torch.equal(g, want[2])
    q, sf, g = nv.quantize(x, scope="row")
    y = torch.empty(4, 64, dtype=torch.bfloat16)
    ops.nvfp4_dequantize(q, sf, g, None, y)
    assert torch.equal(y, nv.dequantize(q, sf, g))
    idx = torch.tensor([3, 9, 0])
    y, err = torch.empty(3, 64), torch.zeros(1, dtype=torch.int32)
    ops.nvfp4_gather(q, sf, None, 2.0, idx, y, err)
    assert torch.equal(y, nv.gather(q, sf, 2.0, idx, dtype=torch.float32)) and int(err[0]) == 1
    sw = _u8(nv.swizzled_size(4, 4))
    ops.nvfp4_swizzle_scales(sf, sw)
    assert torch.equal(sw, nv.swizzle_scales(sf).view(torch.uint8))
    back = _u8(4, 4)
    ops.nvfp4_unswizzle_scales(sw, back)
    assert torch.equal(back, sf.view(torch.uint8))


def test_cpu_results_are_what_cuda_returns(rng):
    """out= buffers of uint8 come back as the FP4 / FP8 views the CUDA path
    returns, and a given gs tensor is the result's gs, as on CUDA: the
    traced branch returns the same on both."""
    x = _x(rng, (3, 32))
    outs = (_u8(3, 16), _u8(3, 2), None)
    g = torch.tensor([[0.02]])
    q, sf, gs = nv.quantize(x, scope="given", gs=g, out=outs)
    assert q.dtype == torch.float4_e2m1fn_x2 and q.data_ptr() == outs[0].data_ptr()
    assert sf.dtype == torch.float8_e4m3fn and sf.data_ptr() == outs[1].data_ptr()
    assert gs.shape == () and gs.data_ptr() == g.data_ptr()
    rq, rsf, _ = R.quantize(x.numpy(), "given", np.float32(0.02))
    assert np.array_equal(outs[0].numpy(), rq) and np.array_equal(outs[1].numpy(), rsf)
    sw = nv.swizzle_scales(sf, out=_u8(nv.swizzled_size(3, 2)))
    assert sw.dtype == torch.float8_e4m3fn
    back = nv.unswizzle_scales(sw, (3, 2), out=_u8(3, 2))
    assert back.dtype == torch.float8_e4m3fn and torch.equal(back.view(torch.uint8), outs[1])
    # numpy stays numpy
    qa, sfa, ga = nv.quantize(x.numpy(), scope="given", gs=np.float32(0.02))
    assert qa.dtype == np.uint8 and ga.shape == () and np.array_equal(qa, rq)


@pytest.mark.parametrize("gs_given", [False, True])
def test_scope_none_with_every_output_given_compiles_as_eager(rng, gs_given):
    """scope=None is the default scope whether or not the op allocates: with
    every output given (or a gs tensor and no out gs) it reached the
    operator as None, which its schema (`str scope`) refuses, so eager ran
    and torch.compile failed (found by a review)."""
    torch._dynamo.reset()
    x = _x(rng, (2, 32))
    gs = torch.tensor(0.25) if gs_given else None
    outs = (_u8(2, 16), _u8(2, 2), None if gs_given else torch.full((), 7.0))
    want = [t.clone() for t in nv.quantize(x, scope=None, gs=gs, out=outs)]

    def step(x):
        return nv.quantize(x, scope=None, gs=gs, out=outs)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(got, want))


def test_compiled_number_gs_is_checked_when_it_runs(rng):
    """A number gs of a compiled function is a symbolic float while tracing:
    the operator checks it when it runs, raising before anything is written."""
    torch._dynamo.reset()
    x = _x(rng, (2, 32))

    def step(x, g, out):
        return nv.quantize(x, scope="given", gs=g, out=out)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    outs = (_u8(2, 16), _u8(2, 2), torch.full((), 7.0))
    q, _, gs = compiled(x, 0.5, outs)
    assert float(gs) == 0.5 and q.data_ptr() == outs[0].data_ptr()
    outs[2].fill_(7.0)
    for bad in (-1.0, 1e39):
        with pytest.raises(ValueError, match="^gs:"):
            compiled(x, bad, outs)
    assert float(outs[2]) == 7.0


def test_operators_run_on_their_tensors_device(cuda, rng, monkeypatch):
    """GPU: every NVFP4 operator asks for the runtime of its tensors' device
    index, never for the current device (None)."""
    from support.library_samples_nvfp4 import samples
    from rawkv.nvfp4 import activation, decode, encode, scales
    rawkv.warmup()
    asked = []
    for mod in (encode, activation, decode, scales):
        monkeypatch.setattr(mod, "get_runtime", lambda d=None, real=mod.get_runtime: asked.append(d) or real(d))
    cases = samples(rng, "cuda")
    for name, calls in cases.items():
        for args in calls:
            getattr(ops, name)(*args)
    torch.cuda.synchronize()
    assert len(asked) >= sum(map(len, cases.values())) and set(asked) == {0}


def _steps():
    from support.library_samples_nvfp4 import STEPS
    return STEPS


@pytest.mark.parametrize("name,make", _steps(), ids=[n for n, _ in _steps()])
def test_compiled_steps_return_what_eager_returns(rng, name, make):
    """The traced branches allocate what eager returns: same dtypes (FP4 /
    FP8 views included, which test_library's bit comparison reads as
    uint8) and shapes; a given gs tensor is the returned gs in both."""
    torch._dynamo.reset()
    step, args = make(rng, "cpu")
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    want = step(*args)
    assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in want]
    if name == "nvfp4_given_gs":
        assert got[2].data_ptr() == want[2].data_ptr() == args[1].data_ptr()


@pytest.mark.parametrize("op", ["fp8.e4m3_decode", "fp8.dequantize_blocks", "nvfp4.dequantize"])
def test_a_decode_dtype_against_out_is_refused_compiled_as_eager(op):
    # the operator never sees the public `dtype`: checked against out in the
    # public function (rawkv._args.decode_dtype), which torch.compile traces
    import rawkv.fp8
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16) + 0x30
    q, sf = torch.full((1, 8), 0x22, dtype=torch.uint8), torch.full((1, 1), 0x38, dtype=torch.uint8)
    call = {"fp8.e4m3_decode": lambda out: rawkv.fp8.e4m3_decode(codes, dtype=torch.float16, out=out),
            "fp8.dequantize_blocks": lambda out: rawkv.fp8.dequantize_blocks(codes, torch.ones(1, 1),
                                                                            dtype=torch.float16, out=out),
            "nvfp4.dequantize": lambda out: rawkv.nvfp4.dequantize(q, sf, 1.0, dtype=torch.float16, out=out)}[op]
    out = torch.zeros(1, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^out: dtype bfloat16 is not supported \(expected float16\)"):
        call(out)
    torch._dynamo.reset()
    with pytest.raises(Exception):
        torch.compile(call, fullgraph=True, backend="aot_eager")(out)
    assert not out.any()
    torch._dynamo.reset()
    good = torch.compile(call, fullgraph=True, backend="aot_eager")(torch.zeros(1, 16, dtype=torch.float16))
    assert good.dtype == torch.float16 and good.any()
