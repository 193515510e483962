"""The global-scale scopes planned once (rawkv.nvfp4.encode.plan_scope) for
rawkv.nvfp4.quantize and the fused producers: their launch plans read as
data, with no runtime (a rawkv._plan.Device and CPU tensors)."""
from __future__ import annotations

import pytest

from rawkv._plan import Device, Fill, Launch, Memset
from rawkv.fused import _rules as FR
from rawkv.fused import plans as FP
from rawkv.kernels import fused as KF
from rawkv.kernels import nvfp4 as KN
from rawkv.nvfp4 import encode

torch = pytest.importorskip("torch")

DEV = Device(sm_count=132, max_threads_per_sm=2048)
BF = torch.bfloat16


def _names(plan):
    return [s.__class__.__name__ if isinstance(s, Memset) else s.kernel.kernel.name for s in plan]


def _nvfp4(scope, m=64, n=4096, gs=None, errors=None, gs_out=True):
    x = torch.ones(m, n, dtype=BF)
    q, sf = torch.empty(m, n // 2, dtype=torch.uint8), torch.empty(m, n // 16, dtype=torch.uint8)
    g = torch.empty(m if scope == "row" else ()) if gs_out else None
    return encode.plan(DEV, x, q, sf, g, m, n, n, scope, gs, errors), g


def _rows(scope, rows=64, n=4096, gs=None, errors=None):
    x, w = torch.ones(rows, n, dtype=BF), torch.ones(n)
    q, sf = torch.empty(rows, n // 2, dtype=torch.uint8), torch.empty(rows, n // 16, dtype=torch.uint8)
    g, inv = torch.empty(rows if scope == "row" else ()), torch.empty(rows)
    a = FR.Rows("cuda", x, rows, n, "bfloat16", scope, gs, q, sf, g, inv)
    return FP.rms(DEV, a, None, w, 1e-6, 1, errors), g


def test_scope_passes_are_the_same_for_both_encoders():
    """'row' one pass; 'tensor' gs zeroed, an amax pass, a pass with it;
    'given' / 'none' one pass: the same sequence for both encoders."""
    assert _names(_nvfp4("row")[0]) == ["rkv_nvfp4_quantize_rows"]
    assert _names(_rows("row")[0]) == ["rkv_fused_rms"]
    plan, g = _nvfp4("tensor")
    assert plan[0] == Memset(g, 4)
    assert _names(plan) == ["Memset", "rkv_nvfp4_amax", "rkv_nvfp4_quantize", "rkv_nvfp4_finalize_gs"]
    plan, g = _rows("tensor")
    assert plan[0] == Memset(g, 4)
    assert [s.args["mode"] for s in plan[1:]] == [KF.MODE_AMAX, KF.MODE_TENSOR]
    assert all(s.args["gs_out"] is g for s in plan[1:])
    for scope in ("given", "none"):
        assert _names(_nvfp4(scope, gs=0.5 if scope == "given" else None)[0]) == ["rkv_nvfp4_quantize"]
        (launch,), _ = _rows(scope, gs=0.5 if scope == "given" else None)
        assert launch.args["mode"] == KF.MODE_FIXED


def test_small_tensor_scope_is_one_pass():
    plan, g = _nvfp4("tensor", m=8, n=1024)
    assert _names(plan) == ["rkv_nvfp4_quantize_small"] and plan[0].args["gs_out"] is g


@pytest.mark.parametrize("gs", [None, 0.25, "device"])
def test_given_gs_pointer_value_and_counter(gs):
    """A number goes by value with no counter; a device gs by pointer with
    the counter; 'none' is the value 1."""
    errors = torch.zeros(1, dtype=torch.int32)
    dev_gs = torch.full((1,), 0.5)
    g = dev_gs if gs == "device" else gs
    scope = "none" if gs is None else "given"
    want = (dev_gs, 0.0, errors) if gs == "device" else (None, 1.0 if gs is None else gs, None)
    (launch,), _ = _nvfp4(scope, gs=g, errors=errors)
    assert (launch.args["gs_ptr"], launch.args["gs_val"], launch.args["errors"]) == want
    assert launch.kernel is KN.QUANTIZE.instance(BF, 2, KN.MODE_GIVEN)
    (launch,), _ = _rows(scope, gs=g, errors=errors)
    assert (launch.args["gs_in"], launch.args["gs_val"], launch.args["errors"]) == want


def test_device_gs_without_gs_out_is_not_written():
    (launch,), _ = _nvfp4("given", gs=torch.full((1,), 0.5), gs_out=False)
    assert launch.args["gs_out"] is None


@pytest.mark.parametrize("scope,want", [("row", None), ("tensor", 1.0), ("none", 1.0), ("given", 0.25)])
def test_no_rows(scope, want):
    """No row: one thread writes gs (the gs of an empty encode, encode.empty_gs);
    scope 'row' has none to write."""
    plan, g = _rows(scope, rows=0, gs=0.25 if scope == "given" else None)
    if want is None:
        assert plan == []
        return
    assert plan == [Launch(KF.SET_GS.instance(), (1,), (1,), dict(gs_out=g, gs_in=None, gs_val=want))]
    assert encode.empty_gs(scope, 0.25 if scope == "given" else None).value == want


@pytest.mark.parametrize("scope,gs,want", [("row", None, 1.0), ("tensor", None, 1.0), ("none", None, 1.0),
                                          ("given", 0.25, 0.25)])
def test_no_elements_is_one_fill_of_gs(scope, gs, want):
    """No element: the plan is the gs alone, one Fill (the runtime runs it
    on the op's stream), of every row's gs under scope 'row'."""
    plan, g = _nvfp4(scope, m=0, gs=gs)
    assert plan == [Fill(g, want)]
    x, g = torch.ones(4, 0), torch.empty(4)
    assert encode.plan(DEV, x, x, x, g, 4, 0, 0, "row") == [Fill(g, 1.0)]
    assert encode.gs_plan(DEV, x, g, 4, 0, 0) == [Fill(g, 1.0)]


def test_no_elements_device_gs_is_copied_or_is_the_gs():
    dev_gs = torch.full((1,), 0.5)
    (fill,), g = _nvfp4("given", m=0, gs=dev_gs)
    assert fill.dst is g and torch.equal(fill.value, dev_gs.reshape(()))
    assert _nvfp4("given", m=0, gs=dev_gs, gs_out=False)[0] == []


def test_row_block_by_rows():
    """Few rows: one 16-element chunk per thread; from 2 x SMs rows, REG chunks."""
    assert FP.block_for(DEV, 1, 448) == 448
    assert FP.block_for(DEV, 2 * DEV.sm_count, 448) == 224
    assert _rows("row", rows=1)[0][0].block == (256,)
    assert _rows("row", rows=1)[0][0].grid == (1,)
