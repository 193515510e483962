"""The public ops under torch.compile with dynamic shapes: every family's
compiled step (tests/support/library.py's STEPS) traces with
dynamic=True, and the public functions compiled once with the token /
batch dimension marked dynamic (torch._dynamo.mark_dynamic) serve every
later count without a new compile, giving the eager bits, shapes, dtypes
and strides. Found by a review (helper 97): dynamic=True made a float a
SymFloat, which the RoPE check's math.isfinite cannot take (a graph break
in every compress_prefill / compress_decode); unswizzle_scales' shape
check specialized the rows of sf.shape (one compile per token count, and
a ConstraintViolationError under mark_dynamic)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library  # noqa: E402,F401
from support.library import same_bits, steps  # noqa: E402


@pytest.mark.parametrize("name,make", steps(), ids=[n for n, _ in steps()])
def test_steps_compile_with_dynamic_shapes(rng, name, make):
    torch._dynamo.reset()
    step, args = make(rng, "cpu")
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert same_bits(compiled(*args), step(*args))
