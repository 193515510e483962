"""Imports every op module, so that every op declaration (rawkv._opdecl)
exists before rawkv.library registers them as torch custom operators.

Import-time work in op modules is plain Python (op declarations; the kernel
declarations are rawkv.kernels, which the runtime imports itself): no CUDA
API is touched until an op runs on a CUDA tensor.
"""
from . import fp8, fused, gemm, kvcache, nvfp4  # noqa: F401
