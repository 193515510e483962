"""Transitional: the names op modules used before the split into
rawkv._args (argument rules) and rawkv._dispatch (CPU/GPU dispatch)."""
from ._args import (  # noqa: F401
    aligned16, check_aligned, check_cpu_array, check_tensor, cpu_dtype_name, dtypes, is_number,
    require_array,
)
from ._args import check_gs_number as check_scale_value  # noqa: F401
from ._dispatch import (  # noqa: F401
    as_cuda_tensor, byte_dtypes, from_numpy, is_cuda_tensor, is_torch, placement, to_numpy,
)
