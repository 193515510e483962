"""rawkv: NVFP4 and DeepSeek-V4 compressed-KV-cache kernels for PyTorch.

Kernels are CUDA C++ (rawkv/cu), compiled at run time with NVRTC, cached on
disk and launched through CuPy on torch's current stream. `import rawkv`
needs only numpy: no GPU, driver, CuPy or torch. CPU tensors and numpy arrays
run the numpy reference (rawkv.reference), which defines every op.
"""
from ._version import __version__  # noqa: F401

from . import fp8, fused, gemm, kvcache, nvfp4, reference  # noqa: E402,F401
from .errors import CaptureError, CompileError, GpuUnavailableError, RawkvError  # noqa: E402,F401
from .runtime import get_runtime, warmup  # noqa: E402,F401

from ._op import when_torch_loads as _when_torch_loads  # noqa: E402


def _register_ops():
    from . import library  # noqa: F401  (registers every declared op on import)


# torch.ops.rawkv.* whatever the import order: now if torch is loaded (an
# engine imported it first), else when `import torch` has run (rawkv._op).
_when_torch_loads(lambda: _register_ops())        # looked up when it runs
