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
