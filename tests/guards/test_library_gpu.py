"""rawkv:: custom operators on the GPU: opcheck on CUDA tensors, and
torch.compile with the default inductor backend and with
mode="reduce-overhead" (CUDA graphs) giving the same bits as eager."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library as L  # noqa: E402
from rawkv import _opdecl  # noqa: E402
from support.library import same_bits, samples, steps  # noqa: E402


@pytest.mark.parametrize("name", sorted(_opdecl.declared()))
def test_opcheck_cuda(cuda, rng, name):
    rawkv.warmup()
    for args in samples(rng, "cuda")[name]:
        torch.library.opcheck(getattr(torch.ops.rawkv, name).default, args)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("name,make", steps(), ids=[n for n, _ in steps()])
def test_compiled_step_same_bits_as_eager(cuda, rng, mode, name, make):
    """Inductor, and inductor with CUDA graphs (reduce-overhead: the graph
    is recorded on the first calls, then replayed)."""
    rawkv.warmup()
    torch._dynamo.reset()
    step, args = make(rng, "cuda")
    want = step(*args)
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(3):
        got = compiled(*args)
        torch.cuda.synchronize()
        assert same_bits(got, want)


def test_operator_runs_on_its_tensors_device(cuda, monkeypatch):
    """The operator takes its device from its tensors: the runtime it asks
    for is the tensor's device index, whatever the current device says."""
    asked = []
    real = rawkv.fp8.get_runtime
    monkeypatch.setattr(rawkv.fp8, "get_runtime", lambda d=None: asked.append(d) or real(d))
    monkeypatch.setattr(rawkv.fp8, "_ENCODE_FAST", {})     # the checked path asks for a runtime
    monkeypatch.setattr(rawkv.fp8, "_DECODE_FAST", {})
    x = torch.randn(1000, device="cuda:0")
    out = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
    torch.ops.rawkv.e4m3_encode(torch.randn(1000, device="cuda:0").add_(1), out)
    torch.ops.rawkv.e4m3_decode(out, torch.empty(1000, device="cuda:0"))
    assert len(asked) >= 2 and all(d == x.get_device() == 0 for d in asked)
