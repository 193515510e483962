"""The CUDA paths of the fused producers on a CPU (the recording runtime of
test_nvfp4_launch_plan: CPU tensors that report is_cuda, launches recorded
through their declarations, so a wrong keyword or C type fails here): which
gs pointer, value and error counter each launch receives. What the kernels
compute is checked on the GPU (test_fused_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

import rawkv
from rawkv.fused import moe, rms, swiglu
from rawkv.kernels import fused as K
from rawkv.nvfp4 import counters
from rawkv.reference import nvfp4 as RN

torch = pytest.importorskip("torch")
from support.fake_cuda import fake, install  # noqa: E402


@pytest.fixture
def rt(monkeypatch):
    return install(monkeypatch, (rms, swiglu, moe))


def _calls(rt, op, dtype, **kw):
    """Run producer `op` on fake CUDA inputs of `dtype`; its launches' arguments."""
    rt.calls.clear()
    if op == "rms":
        res = rawkv.fused.rmsnorm_quantize(fake(torch.ones(3, 64, dtype=dtype)), fake(torch.ones(64)), **kw)
    elif op == "mhc":
        res = rawkv.fused.mhc_rmsnorm_quantize(fake(torch.ones(3, 2, 64, dtype=dtype)), fake(torch.ones(3, 2)),
                                               fake(torch.ones(64)), **kw)
    else:
        res = rawkv.fused.swiglu_quantize(fake(torch.ones(3, 128, dtype=dtype)), **kw)
    return res, [c[3] for c in rt.calls if c[0] != "memset"]


@pytest.mark.parametrize("op", ["rms", "mhc", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_given_gs_launch_arguments(rt, op, dtype):
    """A device gs goes to the kernel with rawkv.nvfp4's GIVEN_GS counter
    (the kernel checks it and counts a refused one); a number goes by value
    with no counter (the host checked it); other scopes pass no counter."""
    counter = counters._CUDA[-1].data_ptr() + 4 * rawkv.nvfp4.GIVEN_GS
    gdev = fake(torch.full((1,), -0.5))                # refused, by the kernel: not the host's to read
    res, (a,) = _calls(rt, op, dtype, gs=gdev)
    assert (a["gs_in"], a["gs_val"], a["mode"], a["errors"]) == (gdev.data_ptr(), 0.0, K.MODE_FIXED, counter)
    assert a["gs_out"] == res.gs.data_ptr()
    res, (a,) = _calls(rt, op, dtype, gs=0.25)
    assert (a["gs_in"], a["gs_val"], a["mode"], a["errors"]) == (0, 0.25, K.MODE_FIXED, 0)
    for scope, modes in (("row", [K.MODE_ROW]), ("tensor", [K.MODE_AMAX, K.MODE_TENSOR]),
                         ("none", [K.MODE_FIXED])):
        _, launches = _calls(rt, op, dtype, scope=scope)
        assert [a["mode"] for a in launches] == modes and all(a["errors"] == 0 for a in launches)


@pytest.mark.parametrize("op", ["rms", "mhc", "swiglu"])
def test_number_gs_over_the_dtype_bound_refused_before_launch(rt, op):
    """2e7 is over the float16 bound (11179349) and under the bfloat16 one;
    a number is held against the bound as the float32 it becomes."""
    with pytest.raises(ValueError, match="^gs:"):
        _calls(rt, op, torch.float16, gs=2e7)
    assert rt.calls == []
    _, launches = _calls(rt, op, torch.bfloat16, gs=2e7)
    assert len(launches) == 1 and launches[0]["gs_val"] == 2e7
    with pytest.raises(ValueError, match="^gs:"):             # still refused once seen for bfloat16
        _calls(rt, op, torch.float16, gs=2e7)
    assert rt.calls == []
    limit = RN.given_gs_limit("float16")
    below = float(np.nextafter(np.float32(limit), np.float32(0)))
    _, launches = _calls(rt, op, torch.float16, gs=below)
    assert len(launches) == 1 and launches[0]["gs_val"] == below
    for _ in range(2):                                        # as the float32 the kernel reads: the bound
        with pytest.raises(ValueError, match="^gs:"):
            _calls(rt, op, torch.float16, gs=limit - 1e-9)
