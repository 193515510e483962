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

import sys as _sys  # noqa: E402

if "torch" in _sys.modules:
    # torch is already loaded (an engine imported it first): register the
    # rawkv:: operators now, so torch.compile finds them (rawkv.library).
    from . import library  # noqa: E402,F401
