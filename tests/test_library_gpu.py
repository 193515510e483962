"""rawkv:: custom operators on the GPU: opcheck on CUDA tensors, and
torch.compile with the default inductor backend and with
mode="reduce-overhead" (CUDA graphs) giving the same bits as eager."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library as L  # noqa: E402
from rawkv import _opdecl  # noqa: E402
from test_library import samples  # noqa: E402


@pytest.mark.parametrize("name", sorted(_opdecl.declared()))
def test_opcheck_cuda(cuda, rng, name):
    rawkv.warmup()
    for args in samples(rng, "cuda")[name]:
        torch.library.opcheck(getattr(torch.ops.rawkv, name).default, args)


def _fp8_step(x):
    codes = rawkv.fp8.e4m3_encode(x)
    return rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)


STEPS = [_fp8_step]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("step", STEPS, ids=lambda f: f.__name__)
def test_compiled_step_same_bits_as_eager(cuda, rng, mode, step):
    rawkv.warmup()
    torch._dynamo.reset()
    x = torch.from_numpy(rng.standard_normal((8, 512)).astype(np.float32)).cuda()
    want = step(x)
    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(3):          # reduce-overhead records, then replays the graph
        got = compiled(x)
        torch.cuda.synchronize()
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                           want.view(torch.uint8) if want.dtype.itemsize == 1 else want)
        x = x * 1.5
        want = step(x)


def test_operator_runs_on_its_tensors_device(cuda, monkeypatch):
    """The operator takes its device from its tensors: the runtime it asks
    for is the tensor's device index, whatever the current device says."""
    asked = []
    real = rawkv.fp8.get_runtime
    monkeypatch.setattr(rawkv.fp8, "get_runtime", lambda d=None: asked.append(d) or real(d))
    monkeypatch.setattr(rawkv.fp8, "_ENCODE_FAST", {})     # the checked path asks for a runtime
    x = torch.randn(1000, device="cuda:0")
    out = torch.empty(1000, dtype=torch.uint8, device="cuda:0")
    torch.ops.rawkv.e4m3_encode(torch.randn(1000, device="cuda:0").add_(1), out)
    torch.ops.rawkv.e4m3_decode(out, torch.empty(1000, device="cuda:0"))
    assert len(asked) >= 2 and all(d == x.get_device() == 0 for d in asked)
