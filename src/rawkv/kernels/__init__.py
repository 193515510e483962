"""Every kernel rawkv launches, declared once: one module per rawkv/cu/*.cu
file (see _decl for what a declaration holds and gives).

Importing this package imports the declarations only (plain Python): the
runtime reads them to compile and warm up, ops launch through them, and
tests/guards/test_kernel_abi.py holds them against the CUDA sources.
"""
from ._decl import (CTYPE, Kernel, KernelFile, TParam, dynamic_smem, files, prepare,  # noqa: F401
                    registered_kernels)
from . import fp8, fp8_blocks  # noqa: F401,E402
from . import kv_cache, kv_compress  # noqa: F401,E402
from . import nvfp4  # noqa: F401,E402
from . import fused  # noqa: F401,E402
from . import kv_layouts  # noqa: F401,E402
from . import gemm_fp4  # noqa: F401,E402
from . import gemm_w4a8  # noqa: F401,E402
