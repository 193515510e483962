"""The tensors the CPU / CUDA agreement cases are built of
(tests/support/agreement_cases*.py, tests/guards/test_cpu_cuda_agreement.py):
CPU tensors, unaligned, strided and stride-0 views, and the dtypes' short names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


f32, f16, u8 = torch.float32, torch.float16, torch.uint8


bf = torch.bfloat16


i32, i64 = torch.int32, torch.int64


def ones(*shape, dtype=f32):
    return torch.ones(shape, dtype=dtype)


def buf(*shape, dtype=u8):
    return torch.zeros(shape, dtype=dtype)


def unaligned(*shape, dtype=f32, by=1):
    """A contiguous view starting `by` elements into a fresh buffer."""
    n = 1
    for s in shape:
        n *= s
    return torch.ones(n + by, dtype=dtype)[by:].view(shape)


def strided_last(*shape, dtype=f32):
    """Every other element of the last dimension."""
    return torch.ones(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]


def stride0(*shape, dtype=f32):
    return torch.ones(shape[-1], dtype=dtype).expand(*shape)


def bones(*shape):
    return torch.ones(shape, dtype=bf)


def ints(*v, dtype=i32):
    return torch.tensor(v, dtype=dtype)


def mask(*v):
    return torch.tensor(v, dtype=torch.bool)
