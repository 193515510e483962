"""The CUDA path of an op on a CPU: CPU tensors that report is_cuda, and a
runtime that records launches instead of making them (every launch still
goes through its kernel's declaration, so a wrong keyword or a scalar of the
wrong C type fails). Used by the launch-plan tests and by the test that
holds the CPU path's argument rules against the CUDA path's
(test_cpu_cuda_agreement.py)."""
from __future__ import annotations

import torch

from rawkv import _op, kernels, runtime


class FakeCuda(torch.Tensor):
    """A CPU tensor the ops take for a CUDA one (get_device() is -1)."""

    @property
    def is_cuda(self):
        return True


def fake(t):
    return t.as_subclass(FakeCuda)


class RecordingRuntime:
    device_index = -1
    sm_count, max_threads_per_sm, arch = 132, 2048, "sm_90"        # an H100's
    resident_blocks = runtime.Runtime.resident_blocks
    grid_stride = runtime.Runtime.grid_stride
    run = runtime.Runtime.run                   # a plan's steps, each through the methods below
    counters = runtime.Runtime.counters
    counter = runtime.Runtime.counter
    _torch = torch

    def __init__(self):
        self._functions = {}
        self.calls = []
        self._counters = fake(torch.zeros(runtime.COUNTER_SLOTS, dtype=torch.int32))

    @staticmethod
    def _get_device():
        return 0        # not device_index: every launch goes through launch() below

    def function(self, filename, name, stream=None):
        assert name in kernels.registered_kernels()[filename], (filename, name)
        return name

    def launch(self, fn, grid, block, st, args, stream=None, shared_mem=0, what=None):
        st.pack(*args)                          # each scalar fits its C type
        # a struct parameter's fields as param.field, in the order they are packed
        names = [p.name if p.fields is None else f"{p.name}.{f.name}"
                 for p in what.kernel.params for f in (p.fields or (None,))]
        self.calls.append((fn, grid, block, dict(zip(names, args))))

    def memset(self, ptr, value, nbytes, stream=None):
        self.calls.append(("memset", ptr, value, nbytes))

    def empty(self, shape, dtype, stream=None):
        return fake(torch.full(tuple(shape), 0xAB if dtype == torch.uint8 else 7, dtype=dtype))

    def capturing(self, stream=None):
        return False

    def torch_stream(self, stream=None):
        return None


def install(monkeypatch, modules) -> RecordingRuntime:
    """A RecordingRuntime for device -1, where `modules` (the op modules)
    and the output allocator (rawkv._op) ask for their runtime."""
    r = RecordingRuntime()
    for mod in (_op, *modules):
        monkeypatch.setattr(mod, "get_runtime", lambda dev: r)
    return r
