"""The same inputs are accepted or refused on CPU and CUDA (issue 22 item 2).

Each case calls a public op twice on the same memory: as CPU tensors (the
reference's path) and as CPU tensors that report is_cuda with a runtime
that records launches (tests/support/fake_cuda.py: the CUDA path up to the
launch). Both calls must accept, or both refuse with the same error type and
message. Code that runs on CPU then runs on the GPU, and an input the GPU
refuses is refused on CPU first. The cases: tests/support/agreement_cases.py
(fp8, nvfp4, fused, gemm) and tests/support/agreement_cases_kvcache.py.

The differences by design are not here: a given gs whose value is
unusable is refused on the host when the host holds it, and flagged and
counted by the kernel when the device does (docs/format.md); the fused
producers take a float32 x / h / hidden on CPU (the reference's precision,
docs/fused.md). The KV-cache ops run where their pool / decode state lives:
a case passes a view of a CPU pool's buffers (rawkv.kvcache.views), and the
CUDA call a view of the same buffers seen as CUDA tensors (a CUDA pool's
rope is bfloat16: a copy); a numpy float32 array stands for bfloat16 on the
host, a torch tensor does not.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.kvcache as kvc  # noqa: E402
from rawkv import _opdecl, fp8  # noqa: E402
from rawkv.fused import moe, rms, swiglu  # noqa: E402
from rawkv.gemm import linear, w4a8  # noqa: E402
from rawkv.kvcache import assign, bridge, compressor, flush, gather, layouts, prefill, state_ops  # noqa: E402
from rawkv.kvcache import decode as kv_decode  # noqa: E402
from rawkv.kvcache import views as V  # noqa: E402
from rawkv.nvfp4 import activation, decode, encode, scales  # noqa: E402
from support.agreement_cases import OP_CASES  # noqa: E402
from support.agreement_cases_kvcache import KV_CASES  # noqa: E402
from support.fake_cuda import fake, install  # noqa: E402
from support.library import agreement_cases  # noqa: E402


# (an op's own test file may hold its cases: AGREEMENT, tests/support/library.py)
CASES = {**OP_CASES, **KV_CASES, **agreement_cases()}


FAMILIES = ("rawkv.fp8", "rawkv.nvfp4", "rawkv.fused", "rawkv.gemm", "rawkv.kvcache")


KV_MODULES = (layouts, flush, gather, assign, bridge, state_ops, prefill, kv_decode, compressor)


def _as_cuda(v):
    return _each(v, fake)


def _each(v, move):
    """v with `move` applied to each tensor in it (a tuple's, a
    QuantizedActivation's, an Fp4Weight's, a kvcache pool's or decode
    state's buffers: a view over the moved ones)."""
    if isinstance(v, torch.Tensor):
        return move(v)
    if isinstance(v, kvc.PagedKVPool):
        args = V.pool_args(v)
        if args["rope"] is not None:
            args["rope"] = args["rope"].bfloat16()      # a CUDA pool's rope is bfloat16, a CPU one's float32
        return V.pool_view(**{k: _each(a, move) for k, a in args.items()})
    if isinstance(v, kvc.DecodeState):
        return V.state_view(**{k: _each(a, move) for k, a in V.state_args(v).items()})
    if isinstance(v, rawkv.gemm.Fp4Weight):
        return rawkv.gemm.Fp4Weight(v.fmt, v.n, v.k, move(v.codes), move(v.scales), move(v.gs),
                                    exp_range=v.exp_range)
    if isinstance(v, tuple) and any(isinstance(t, torch.Tensor) for t in v):
        moved = (_each(t, move) for t in v)
        return type(v)(*moved) if hasattr(v, "_fields") else tuple(moved)
    return v


def _outcome(call):
    try:
        call()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "accepted"


def _on_gpu(v):
    """A CPU tensor's whole storage copied to the GPU, seen with the same
    shape, strides and offset (a CUDA allocation's alignment keeps the
    offsets' alignment)."""
    return _each(v, _tensor_on_gpu)


def _tensor_on_gpu(v):
    whole = torch.as_strided(v, (v.untyped_storage().nbytes() // v.element_size(),), (1,), 0)
    return whole.cuda().as_strided(v.shape, v.stride(), v.storage_offset())


def _no_address(outcome):
    return outcome if outcome == "accepted" else (outcome[0], re.sub(r"0x[0-9a-f]+", "ADDR", outcome[1]))


@pytest.mark.parametrize("name,case,build", [(n, c, b) for n, cases in CASES.items() for c, b in cases],
                         ids=[f"{n}-{c}" for n, cases in CASES.items() for c, _ in cases])
def test_cpu_and_cuda_accept_and_refuse_alike(monkeypatch, name, case, build):
    fn, args, kw = build()
    cpu = _outcome(lambda: fn(*args, **kw))
    install(monkeypatch, (fp8, encode, activation, decode, scales, rms, swiglu, moe, linear, w4a8, *KV_MODULES))
    monkeypatch.setattr(fp8, "_ENCODE_FAST", {})         # combinations the real runtime has seen
    monkeypatch.setattr(fp8, "_DECODE_FAST", {})
    cuda = _outcome(lambda: fn(*map(_as_cuda, args), **{k: _as_cuda(v) for k, v in kw.items()}))
    assert cpu == cuda
    assert (cpu == "accepted") == case.startswith("ok"), cpu


@pytest.mark.parametrize("name,case,build", [(n, c, b) for n, cases in CASES.items() for c, b in cases],
                         ids=[f"{n}-{c}" for n, cases in CASES.items() for c, _ in cases])
def test_gpu_accepts_and_refuses_as_the_cpu(cuda, name, case, build):
    """The same cases on real CUDA tensors (addresses aside in the messages)."""
    fn, args, kw = build()
    cpu = _outcome(lambda: fn(*args, **kw))
    gpu = _outcome(lambda: fn(*map(_on_gpu, args), **{k: _on_gpu(v) for k, v in kw.items()}))
    torch.cuda.synchronize()
    assert _no_address(cpu) == _no_address(gpu)


def test_every_operator_of_the_families_has_cases():
    """A new fp8 / nvfp4 / fused / gemm / kvcache operator needs its cases, accepted and refused:
    in tests/support/agreement_cases*.py, or in its own test file (AGREEMENT)."""
    ops = {n for n, d in _opdecl.declared().items() if d.impl.__module__.startswith(FAMILIES)}
    assert ops == set(CASES)
    for name, cases in CASES.items():
        kinds = {c.startswith("ok") for c, _ in cases}
        assert kinds == {True, False}, name
