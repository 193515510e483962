"""A NumPy scalar where a number goes (gs, eps, granularity, block,
page_size, slot, n_entries, ...) is the number it holds, eagerly and under
torch.compile, and the op checks that value by the rule a Python number
meets (docs/runtime.md, "Numbers"; rawkv._args.as_number, which the op
wrapper applies to every number argument of a schema). Through
torch.ops.rawkv.* itself torch's parser decides: every number argument is
a `Scalar` (a bool stays a bool, refused by name), which takes a NumPy
float64 (a Python float) and refuses other NumPy numbers, naming the
argument (tests/guards/test_bool_numbers.py). Before, the op wrapper passed NumPy scalars on as
they were: the FP8 ops refused block=np.int64(64), and under torch.compile,
which traces a NumPy scalar as a 0-d array, they reached the operator as a
tensor (a gs of np.float32(0.0) decoded zeros where the eager op refused it)
or failed its call (eps, block, page_size)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.kvcache as kvc  # noqa: E402
import rawkv.library  # noqa: E402,F401  (torch.ops.rawkv.*)
from rawkv import _op, _opdecl  # noqa: E402
from support.library import same_bits  # noqa: E402

X = torch.linspace(-3, 3, 4 * 128).reshape(4, 128)
GS_RULE = "^gs: a global scale must be a finite positive float32"


def test_the_op_wrapper_gives_the_body_python_numbers():
    seen = []

    @_op.op("test_numbers", "Tensor x, int k, float? e, Tensor(a!) out")
    def body(x, k, e, out, stream=None):
        seen.append((k, e))
    try:
        body(None, np.int64(3), np.float32(0.5), None)
        body(None, np.int32(2), None, None)
        body(None, np.True_, 1, None)           # a NumPy bool as it is: the op's rules refuse it
    finally:
        _opdecl._OPS.pop("test_numbers")
    assert seen == [(3, 0.5), (2, None), (np.True_, 1)]
    assert [type(k) for k, _ in seen] == [int, int, np.bool_] and type(seen[0][1]) is float


def test_eager_ops_and_operators_take_a_numpy_scalar_as_its_number():
    xb, w = X.bfloat16(), torch.ones(128)
    # a fused FP8 producer's block (refused: "block: expected one of (32, 64, 128), got np.int64(64)")
    got = rawkv.fused.rmsnorm_quantize_fp8(xb, w, np.float32(1e-5), block=np.int64(64))
    assert same_bits(got, rawkv.fused.rmsnorm_quantize_fp8(xb, w, float(np.float32(1e-5)), block=64))
    codes, scales = torch.empty(4, 128, dtype=torch.uint8), torch.empty(4, 2)
    with pytest.raises(RuntimeError, match="argument 'block'"):     # (a Scalar's price: pass int(v))
        torch.ops.rawkv.fp8_quantize_blocks(X, np.int64(64), "fp32", codes, scales)
    torch.ops.rawkv.fp8_quantize_blocks(X, int(np.int64(64)), "fp32", codes, scales)
    assert torch.equal(scales, rawkv.fp8.quantize_blocks(X, block=64)[1])
    # refused by the value's rule, naming the argument, on every path
    q, sf, _ = rawkv.nvfp4.quantize(X)
    out = torch.full((4, 128), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=GS_RULE):
        rawkv.nvfp4.dequantize(q, sf, np.float32(0.0), out=out)
    with pytest.raises(ValueError, match=GS_RULE):
        torch.ops.rawkv.nvfp4_dequantize(q, sf, None, np.float64(0.0), out)
    with pytest.raises(RuntimeError, match="argument 'gs_value'"):      # (float32 is no Python float)
        torch.ops.rawkv.nvfp4_dequantize(q, sf, None, np.float32(0.5), out)
    assert (out == 7).all()


def _compiled(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")(*args)


def test_compiled_ops_take_a_numpy_scalar_as_eagerly():
    q, sf, _ = rawkv.nvfp4.quantize(X)
    out = torch.full((4, 128), 7.0, dtype=torch.bfloat16)

    def decode(q, sf, g):
        return rawkv.nvfp4.dequantize(q, sf, g, out=out)
    # a gs of 0 decoded zeros compiled (the 0-d array dynamo traces went on
    # as a tensor gs): now the operator checks the number when it runs
    with pytest.raises(ValueError, match=GS_RULE):
        _compiled(decode, q, sf, np.float64(0.0))                           # given: a guarded value
    with pytest.raises(ValueError, match=GS_RULE):
        _compiled(lambda q, sf: decode(q, sf, np.float32(0.0)), q, sf)     # made while tracing: a constant
    with pytest.raises(ValueError, match=GS_RULE):       # given float32: a symbol the `Scalar` takes
        _compiled(decode, q, sf, np.float32(0.0))
    assert (out == 7).all()
    # block, eps and n_entries (which sizes the new output) failed the operator call or sized no rows
    p = kvc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    p.add_request()
    p.prepare_step([0], [8 * p.m - 1])

    def step(x, block, eps, slot, n):
        return (rawkv.fp8.quantize_blocks(x, block=block), rawkv.nvfp4.dequantize(q, sf, np.float64(0.5)),
                rawkv.fused.rmsnorm_quantize(x.bfloat16(), torch.ones(128), eps), kvc.gather_dense(p, slot, n))
    got = _compiled(step, X, np.int64(64), np.float64(1e-5), np.int64(0), np.int64(8))
    want = step(X, 64, 1e-5, 0, 8)
    assert same_bits(got[:3], want[:3]) and got[0][1].shape == (4, 2)
    assert np.array_equal(got[3].float().numpy(), want[3])     # (eager: the CPU pool's numpy rows)


def test_a_compiled_function_given_numpy_float32_and_int32_numbers_runs_as_eagerly():
    """Every number argument is a `Scalar`, which takes the symbol dynamo makes
    of a given NumPy float32 / int32 (an `int` or `float` took none: with
    fullgraph the trace failed, naming the argument), so the compiled step
    gives the eager bits. (A given int32 block, which sizes a new output, is
    still data-dependent for dynamo: pass an int.)"""
    def step(x, eps, g, gs):
        return (rawkv.fused.rmsnorm_quantize(x.bfloat16(), torch.ones(128), eps),
                rawkv.fused.swiglu_quantize(torch.ones(4, 64, dtype=torch.bfloat16), g),
                rawkv.nvfp4.quantize(x, scope="given", gs=gs)[:2])
    got = _compiled(step, X, np.float32(1e-5), np.int32(8), np.float32(0.5))
    want = step(X, float(np.float32(1e-5)), 8, float(np.float32(0.5)))
    assert same_bits(got, want)
