"""Helpers of the page-ownership tests (tests/kvcache/test_ownership.py,
test_assign_pages.py): host arrays as tensors on a device, a pool's ownership
state, and its comparison between a CPU and a CUDA pool."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv.library  # noqa: E402,F401


def _assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=f"{what}: {n}")


def _state(pool):
    """What must match between the CPU and the CUDA pool, as numpy."""
    r = pool.to_reference()
    out = {n: getattr(r, n) for n in ("written", "marks", "owners", "request_ids", "block_table")}
    for n in ("kv_fp8", "kv_scale", "kv_rope", "idx_q", "idx_sf", "pages", "index_pages"):
        if getattr(r, n) is not None:
            out[n] = getattr(r, n).view(np.uint8)
    return out


def _t(a, device):
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)
