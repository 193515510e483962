"""The GEMM refuses, by name and before anything is written, outputs it could not
write (a read-only numpy array: issue 21, item 8) and outputs in the memory
of another output or of an input (item 7)."""

from __future__ import annotations

import numpy as np
import pytest

from support.outputs import _refused, _ro


def test_gemm_refuses_out_over_x_and_errors_over_out():
    torch = pytest.importorskip("torch")
    import rawkv
    w = rawkv.gemm.Fp4Weight.from_float(torch.ones(2, 16, 32))
    buf = torch.zeros(4 * 2 * 32, dtype=torch.bfloat16)
    x = buf.view(4, 2, 32)
    x.fill_(1)
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(x, w, out=buf[:4 * 2 * 16].view(4, 2, 16)))
    assert (x == 1).all()
    x2 = torch.ones(4, 32, dtype=torch.bfloat16)
    out = torch.zeros(4, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    _refused("errors", "out", lambda: rawkv.gemm.moe_linear(x2, w, offsets, out=out,
                                                            errors=out.view(torch.int32)[0, :1]))
    _refused("errors", None, lambda: rawkv.gemm.moe_linear(x2, w, offsets, errors=_ro(np.zeros(1, np.int32))))
    assert not out.any()
