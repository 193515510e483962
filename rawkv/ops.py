"""Imports every op module, so that the kernel registry is complete.

Import-time work in op modules is plain Python (kernel declarations): no
CUDA API is touched until an op runs on a CUDA tensor.
"""
from . import fp8, fused, kvcache, nvfp4  # noqa: F401
