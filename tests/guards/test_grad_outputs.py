"""Outputs that require grad are refused by name before anything is written
(rawkv._args.check_outputs): the ops write their outputs in place, which
autograd does not track; on CPU torch's in-place copy into such a tensor
failed after the op's other outputs were written."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402

MSG = "requires grad; rawkv's ops write their outputs in place"


def test_a_grad_output_is_refused_and_nothing_is_written():
    x, w = torch.randn(4, 48, dtype=torch.bfloat16), torch.ones(48)
    codes, scales = torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(4, 1)
    inv = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=f"^out.inv_rms: {MSG}"):
        rawkv.fused.rmsnorm_quantize_fp8(x, w, out=(codes, scales, inv))
    assert not codes.any() and not scales.any()
    # the same outputs without grad are written
    rawkv.fused.rmsnorm_quantize_fp8(x, w, out=(codes, scales, inv.detach()))
    assert codes.any() and scales.any()


def test_a_grad_out_is_refused_by_the_gemm_and_the_fp8_decode():
    wt = rawkv.gemm.Fp4Weight.from_float(torch.linspace(-1, 1, 2 * 16 * 64).reshape(2, 16, 64))
    out = torch.zeros(3, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match=f"^out: {MSG}"):
        rawkv.gemm.grouped_linear(torch.randn(3, 2, 64).bfloat16(), wt, out=out)
    dec = torch.zeros(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=f"^out: {MSG}"):
        rawkv.fp8.e4m3_decode(torch.zeros(4, 8, dtype=torch.uint8), dtype=torch.float32, out=dec)
    assert not out.detach().any() and not dec.detach().any()


def test_the_fp8_fast_path_refuses_a_grad_out_too(cuda):
    # after a launch has bound the combination, a requires_grad out of the
    # same dtypes and size still takes the checked path (rawkv.fp8's fast path)
    x = torch.randn(4, 64, device="cuda")
    good = torch.empty(4, 64, dtype=torch.uint8, device="cuda")
    rawkv.fp8.e4m3_encode(x, out=good)
    codes = torch.zeros(4, 64, dtype=torch.uint8, device="cuda")
    dec = torch.zeros(4, 64, device="cuda")
    rawkv.fp8.e4m3_decode(codes, dtype=torch.float32, out=dec)
    with pytest.raises(ValueError, match=f"^out: {MSG}"):
        rawkv.fp8.e4m3_decode(codes, dtype=torch.float32, out=dec.clone().requires_grad_())


def test_the_ops_make_no_version_promise_and_the_docs_say_so(monkeypatch):
    """The CUDA path writes through kernels and bumps no tensor's _version;
    the CPU path bumps it only where it writes through a torch op, and
    torch.ops.rawkv.* adds no bump of its own. Not bumped by design
    (docs/runtime.md, "Version counters": measured cost, no autograd use):
    held here so a change of either is a decision, not an accident."""
    from pathlib import Path

    import rawkv.library  # noqa: F401
    from rawkv.nvfp4 import scales
    from support import fake_cuda

    sf = torch.randint(0, 255, (128, 4), dtype=torch.uint8)
    # CPU, eager and through the operator: a torch copy_ into out (one bump each)
    out = torch.empty(512, dtype=torch.uint8)
    v = out._version
    rawkv.nvfp4.swizzle_scales(sf, out=out)
    torch.ops.rawkv.nvfp4_swizzle_scales(sf, out)
    assert out._version - v == 2
    # CPU, a write through numpy views: no bump, eager or through the operator
    x = torch.randn(4, 64)
    q, s, g = torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 4, dtype=torch.uint8), torch.empty(())
    vs = [t._version for t in (q, s, g)]
    torch.ops.rawkv.nvfp4_quantize(x, "tensor", None, None, q, s, g, None)
    assert [t._version for t in (q, s, g)] == vs
    # the CUDA path (a recording runtime): none
    rt = fake_cuda.install(monkeypatch, (scales,))
    out = fake_cuda.fake(torch.empty(512, dtype=torch.uint8))
    v = out._version
    rawkv.nvfp4.swizzle_scales(fake_cuda.fake(sf), out=out)
    assert rt.calls and out._version == v
    text = (Path(__file__).resolve().parents[2] / "docs" / "runtime.md").read_text()
    assert "### Version counters (`_version`)" in text and "make **no promise** about `_version`" in text
