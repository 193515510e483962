"""What serving code does that the other argument tests did not: it builds
layers and buffers under torch.inference_mode and calls ops outside it too,
and it passes streams. An inference tensor may only be written inside
inference_mode, so as an output outside it is refused by name before
anything is written (rawkv._args.check_outputs; the CPU path raised torch's
error after writing its outputs, a kernel wrote it); a layer built under
inference_mode keeps a plain output buffer; a stream is checked on CPU as
the CUDA runtime checks it (a CPU call took any object)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402

MSG = r"is an inference tensor \(made under torch.inference_mode\)"


@pytest.mark.parametrize("which", range(4))
def test_an_inference_output_outside_inference_mode_is_refused_and_nothing_is_written(which):
    x, w = torch.randn(4, 64).bfloat16(), torch.ones(64)
    bufs = [torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4),
            torch.zeros(4)]
    with torch.inference_mode():
        bufs[which] = bufs[which].clone()
    with pytest.raises(ValueError, match=rf"^out\.\w+: {MSG}"):
        rawkv.fused.rmsnorm_quantize(x, w, scope="row", out=tuple(bufs))
    assert not any(b.any() for b in bufs)
    with torch.inference_mode():                     # inside it, the same buffers are written
        rawkv.fused.rmsnorm_quantize(x, w, scope="row", out=tuple(bufs))
    assert bufs[0].any()


def test_a_layer_built_under_inference_mode_runs_outside_it():
    with torch.inference_mode():
        layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu")
        layer.set_weight(torch.linspace(-1, 1, 2 * 16 * 64).reshape(2, 16, 64))
    x = torch.randn(3, 2, 64).bfloat16()
    assert not layer.out.is_inference()
    got = layer(x)
    assert torch.equal(got, rawkv.gemm.grouped_linear(x, layer.weight))
    out = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        out_inf = out.clone()
    with pytest.raises(ValueError, match=rf"^out: {MSG}"):
        layer(x, out=out_inf)
    assert not out_inf.any()


def test_the_layer_names_x_of_the_wrong_rank_and_device_strings():
    layer = rawkv.gemm.Fp4GroupedLinear(8, 64, 16, max_tokens=4, device="cpu")
    layer.set_weight(torch.zeros(8, 16, 64))
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., 64\) with 3 dimensions"):
        layer(torch.randn(16, 64).bfloat16())        # (was "x: 16 tokens, the layer was built for max_tokens=4")
    assert rawkv.gemm.Fp4GroupedLinear(1, 64, 16, max_tokens=2, device=" cpu").out.device.type == "cpu"
    with pytest.raises(ValueError, match=r"^device: 'cpu:x'"):
        rawkv.gemm.Fp4GroupedLinear(1, 64, 16, max_tokens=2, device="cpu:x")


@pytest.mark.parametrize("bad", ["bogus", object(), 1.5, True])
def test_a_stream_is_checked_on_cpu_as_on_cuda(bad):
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="^stream: expected a torch.cuda.Stream, cupy Stream or int"):
        rawkv.fp8.e4m3_encode(x, stream=bad)
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu").set_weight(torch.zeros(2, 16, 64))
    with pytest.raises(TypeError, match="^stream: "):
        layer(torch.randn(3, 2, 64).bfloat16(), stream=bad)
    rawkv.fp8.e4m3_encode(x, stream=0)                # an int handle is taken (the CPU path ignores it)


@pytest.mark.parametrize("bad", ["bogus", object(), 1.5, True])
def test_the_runtime_takes_the_streams_the_cpu_check_takes(bad):
    # one rule (rawkv._args.check_stream): Runtime.stream_ptr restated it and
    # took True as the stream handle 1
    from types import SimpleNamespace

    from rawkv.runtime import Runtime
    rt = SimpleNamespace(_current_stream_ptr=lambda: 7)      # (what stream_ptr reads of a Runtime)
    assert [Runtime.stream_ptr(rt, s) for s in (None, 5, SimpleNamespace(cuda_stream=11),
                                                SimpleNamespace(ptr=12))] == [7, 5, 11, 12]
    with pytest.raises(TypeError, match="^stream: expected a torch.cuda.Stream, cupy Stream or int"):
        Runtime.stream_ptr(rt, bad)


OUT_OF_RANGE = [-1, -2 ** 63, 2 ** 63, 2 ** 64, 2 ** 70]
RANGE_MSG = r"^stream: an int stream handle must be in \[0, 2\*\*63\)"


@pytest.mark.parametrize("bad", OUT_OF_RANGE)
def test_an_int_stream_outside_a_pointer_is_refused_by_name_on_cpu_and_cuda(monkeypatch, bad):
    """A CUstream is a pointer, which CuPy and the launch take as a signed
    intptr_t: an int outside [0, 2**63) can be no handle. It was taken (the CPU path ignores the
    stream) and on CUDA failed later, in ctypes or CuPy ('int too big to
    convert') or as an invalid handle from the driver, naming nothing. A
    ValueError naming stream, on CPU and CUDA, before anything runs; torch
    and CuPy streams are not looked into."""
    from types import SimpleNamespace

    from rawkv.runtime import Runtime
    from support.fake_cuda import fake, install
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=RANGE_MSG):
        rawkv.fp8.e4m3_encode(x, stream=bad)
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu").set_weight(torch.zeros(2, 16, 64))
    with pytest.raises(ValueError, match=RANGE_MSG):
        layer(torch.randn(3, 2, 64).bfloat16(), stream=bad)
    rt = install(monkeypatch, (rawkv.fp8,))
    out = fake(torch.zeros(4, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=RANGE_MSG):
        rawkv.fp8.e4m3_encode(fake(x), out=out, stream=bad)
    assert rt.calls == [] and not out.any()
    rts = SimpleNamespace(_current_stream_ptr=lambda: 7)      # (what stream_ptr reads of a Runtime)
    with pytest.raises(ValueError, match=RANGE_MSG):
        Runtime.stream_ptr(rts, bad)
    # the ends of the range, and the streams whose handle is an attribute, are taken
    assert [Runtime.stream_ptr(rts, s) for s in (0, 2 ** 63 - 1, SimpleNamespace(cuda_stream=bad))] == \
        [0, 2 ** 63 - 1, bad]
    rawkv.fp8.e4m3_encode(x, stream=2 ** 63 - 1)


def test_a_compiled_op_refuses_an_int_stream_outside_a_pointer():
    """Under torch.compile the stream is no operator argument, but what the
    eager op refuses as one is refused there too (_op._traced_stream)."""
    x = torch.ones(32)
    call = lambda: rawkv.fp8.e4m3_encode(x, stream=-1)        # noqa: E731
    with pytest.raises(ValueError, match=RANGE_MSG) as eager:
        call()
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(call, backend="eager")()
    assert str(compiled.value) == str(eager.value)
