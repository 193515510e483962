"""rawkv.nvfp4.global_scale: the reference, the argument rules, the launch
plan, the GPU bits, the operator (opcheck samples and CPU/CUDA agreement
cases are here too: tests/support/library.py collects them)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv._plan import Device, Memset  # noqa: E402
from rawkv.nvfp4 import encode  # noqa: E402
from rawkv.reference import nvfp4 as R  # noqa: E402

gs_of = rawkv.nvfp4.global_scale


# ---- the reference ----------------------------------------------------------------------------------
def test_is_modelopts_weights_scaling_factor_2(rng):
    """amax / (6 * 448) over the finite elements, in float32; 1 where that is 0."""
    x = rng.standard_normal((5, 64)).astype(np.float32) * 3
    x[1, 7], x[2, 0] = np.inf, np.nan
    amax = np.abs(np.where(np.isfinite(x), x, 0)).max()
    assert gs_of(x) == np.float32(amax) / np.float32(6 * 448)
    assert gs_of(np.zeros((2, 16), np.float32)) == 1.0
    assert gs_of(np.full((1, 16), 1e-42, np.float32)) == 1.0        # amax / 2688 underflows to 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_is_quantizes_tensor_scope_gs(rng, dtype):
    x = torch.from_numpy(rng.standard_normal((3, 7, 48)).astype(np.float32)).to(dtype)
    g = gs_of(x)
    assert g.dtype == torch.float32 and g.shape == () and torch.equal(g, rawkv.nvfp4.quantize(x)[2])
    out = torch.empty((), dtype=torch.float32)
    assert gs_of(x[:, :, :32], out=out) is out and torch.equal(out, rawkv.nvfp4.quantize(x[:, :, :32])[2])


# ---- argument errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("x,out,err,match", [
    (torch.ones(4, 20), None, ValueError, "^x: the last dimension"),
    (torch.ones(4, 16, dtype=torch.float64), None, TypeError, "^x: dtype float64"),
    (torch.ones(4, 32)[:, ::2], None, ValueError, "^x: unsupported strides"),
    (torch.ones(4, 16), torch.empty(1), ValueError, r"^out: expected shape \(\)"),
    (torch.ones(4, 16), torch.empty((), dtype=torch.float16), TypeError, "^out: dtype float16"),
    (3.0, None, TypeError, "^x: expected a tensor"),
])
def test_refuses_naming_the_argument(x, out, err, match):
    with pytest.raises(err, match=match):
        gs_of(x, out=out)


# ---- the launch plan ---------------------------------------------------------------------------------
def test_plan_is_the_tensor_scopes_amax_pass_then_gs():
    x, g = torch.ones(64, 4096, dtype=torch.bfloat16), torch.empty(())
    plan = encode.gs_plan(Device(132, 2048), x, g, 64, 4096, 4096)
    assert plan[0] == Memset(g, 4)
    assert [s.kernel.kernel.name for s in plan[1:]] == ["rkv_nvfp4_amax", "rkv_nvfp4_finalize_gs"]
    assert plan[1].args["amax_bits"] is g and plan[2].args["gs"] is g


def test_cuda_path_launches_the_plan(rt):
    from support.fake_cuda import fake
    x = fake(torch.ones(8, 64))
    gs_of(x)
    assert [c[0] for c in rt.calls] == ["memset", "rkv_nvfp4_amax<float>", "rkv_nvfp4_finalize_gs"]


# ---- GPU bit-exactness -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (8, 7168), (300, 4096), (0, 64)])
def test_gpu_matches_the_reference(cuda, rng, dtype, shape):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 5).to(dtype)
    if x.numel():
        x.view(-1)[3] = float("inf")
    got = gs_of(x.cuda())
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), gs_of(x)) and torch.equal(got, rawkv.nvfp4.quantize(x.cuda())[2])


# ---- operator and compile ----------------------------------------------------------------------------
def opcheck_samples(rng, device="cpu"):
    """opcheck argument tuples of rawkv::nvfp4_global_scale (x, gs_out)."""
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32)).to(device)
    return {"nvfp4_global_scale": [(x, torch.empty((), device=device)),
                                   (x.bfloat16()[:, :32], torch.empty((), device=device)),
                                   (x.half().view(2, 2, 64), torch.empty((), device=device)),     # (..., K)
                                   (x[:0], torch.empty((), device=device))]}                      # no rows


def _ones(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype)


AGREEMENT = {"nvfp4_global_scale": [
    ("ok", lambda: (gs_of, (_ones(4, 32),), {})),
    ("ok-rows", lambda: (gs_of, (_ones(4, 64)[:, :32],), {})),
    ("ok-empty", lambda: (gs_of, (_ones(0, 16),), {})),
    ("x-width", lambda: (gs_of, (_ones(4, 24),), {})),
    ("x-float64", lambda: (gs_of, (_ones(4, 16, dtype=torch.float64),), {})),
    ("x-unaligned", lambda: (gs_of, (torch.ones(65)[1:].view(4, 16),), {})),
    ("out-shape", lambda: (gs_of, (_ones(4, 16),), {"out": torch.empty(1)})),
]}


def test_compiled_step_matches_eager(rng):
    torch._dynamo.reset()
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    step = torch.compile(lambda t: gs_of(t) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(step(x), gs_of(x) * 2)
