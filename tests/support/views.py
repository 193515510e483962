"""Views the tests build to probe the argument rules."""
from __future__ import annotations

import torch


def misaligned(t, offset):
    """A contiguous copy of t on its device starting `offset` bytes past a
    16-byte aligned address (as a tensor sliced out of one blob of packed
    tensors may)."""
    nbytes = t.numel() * t.element_size()
    blob = torch.zeros(nbytes + 16 + offset, dtype=torch.uint8, device=t.device)
    start = (-blob.data_ptr()) % 16 + offset
    v = blob[start:start + nbytes].view(t.dtype).view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 16 == offset % 16
    return v


def off_element(t):
    """A contiguous copy of CPU tensor t starting one byte past a 16-byte
    aligned address: not aligned to its own elements (2, 4 or 8 bytes), as
    a DLPack array (CuPy, numpy) viewed at an odd offset of a byte blob may
    be; torch's own views never are (view(dtype) refuses the offset)."""
    import numpy as np
    nbytes = t.numel() * t.element_size()
    raw = np.zeros(nbytes + 32, np.uint8)
    start = (-raw.ctypes.data) % 16 + 1
    v = torch.frombuffer(raw[start:start + nbytes], dtype=t.dtype).view(t.shape)
    v.copy_(t)
    assert v.data_ptr() % 16 == 1
    return v
