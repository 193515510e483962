"""A bool where an op takes a number (an int or float argument of its
schema: eps, block, granularity, slot, n_entries, page_size, theta, ...)
is refused under torch.compile as the eager op refuses it
(docs/runtime.md, "Numbers"). Before, the op wrapper passed a traced bool
on to the operator, whose argument parser made it 1 or 1.0 (0, 0.0): the
compiled rmsnorm_quantize(x, w, True) normalized with eps 1.0 and
gather_dense(pool, True, n) read slot 1, where the eager ops refuse both.
Now the wrapper refuses it while it traces: without fullgraph dynamo runs
the call eagerly, which raises the eager op's own error; with
fullgraph=True torch reports the wrapper's TypeError naming the argument."""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.kvcache as kvc  # noqa: E402
import rawkv.library  # noqa: E402,F401  (torch.ops.rawkv.*)

X = torch.linspace(-3, 3, 4 * 128).reshape(4, 128)
BF16 = torch.bfloat16


def _gather(index):
    p = kvc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    p.add_request()
    p.prepare_step([0], [8 * p.m - 1])
    fn = kvc.gather_index_keys if index else kvc.gather_dense
    return (lambda v: fn(p, 0, v)) if index else (lambda v: fn(p, v, 8))


def _state_seed():
    st = kvc.DecodeState("hca", 2, device="cpu")
    rows = torch.zeros(3, st.head_dim)
    return lambda v: kvc.state_seed(st, v, rows, rows)


def _topk():
    ids, table = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)
    return lambda v: kvc.topk_to_kvcache_indices(ids, table, page_size=v, num_pages=50)


# (argument, what the schema takes, the public op with v there: built
# outside the compiled function, as a step's pool and state are)
CASES = [
    ("eps", "a number", lambda: lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), v)),
    ("granularity", "an int", lambda: lambda v: rawkv.fused.swiglu_quantize(torch.ones(4, 64, dtype=BF16), v)),
    ("block", "an int", lambda: lambda v: rawkv.fp8.quantize_blocks(X, block=v)),
    ("slot", "an int", lambda: _gather(False)),
    ("n_entries", "an int", lambda: _gather(True)),
    ("slot", "an int", _state_seed),
    ("page_size", "an int", _topk),
]


def _error(fn):
    with pytest.raises((TypeError, ValueError)) as ei:
        fn()
    return type(ei.value), str(ei.value)


def _compiled(fn, fullgraph):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")()


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("name,what,make", CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_a_compiled_op_refuses_a_bool_number_as_eagerly(name, what, make, value):
    call = make()
    eager = _error(lambda: call(value))
    assert eager[1].startswith(f"{name}: ")
    # without fullgraph: the eager op's own error (dynamo runs the refused call eagerly)
    assert _error(lambda: _compiled(lambda: call(value), False)) == eager
    # fullgraph: torch's report of the wrapper's refusal, naming the argument
    with pytest.raises(Exception, match=re.escape(f"{name}: expected {what}, got bool")):
        _compiled(lambda: call(value), True)


def test_a_refused_bool_writes_nothing():
    out = rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), 1e-6)
    before = [t.clone() for t in out]
    with pytest.raises(Exception, match="eps: expected a number, got bool"):
        _compiled(lambda: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), True, out=out), True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, before))


# ---- a bool gs: where a number or a tensor goes -------------------------------------------
Q = None


def _encoded():
    global Q
    if Q is None:
        Q = rawkv.nvfp4.quantize(X)
    return Q


def _ones_idx():
    return torch.zeros(2, dtype=torch.int32)


# (the op, the public call with v as its gs: a bool lands in the operator's
# `Tensor? gs` (A.split_number), refused by the op's own rule, Op.host)
GS_CASES = [
    ("nvfp4.quantize", lambda v: rawkv.nvfp4.quantize(X, scope="given", gs=v)),
    ("nvfp4.quantize-no-scope", lambda v: rawkv.nvfp4.quantize(X, scope=None, gs=v)),
    ("nvfp4.quantize-tensor-scope", lambda v: rawkv.nvfp4.quantize(X, scope="tensor", gs=v)),
    ("nvfp4.dequantize", lambda v: rawkv.nvfp4.dequantize(*_encoded()[:2], v)),
    ("nvfp4.gather", lambda v: rawkv.nvfp4.gather(*_encoded()[:2], v, _ones_idx())),
    ("fused.rmsnorm_quantize", lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), 1e-6,
                                                                     scope="given", gs=v)),
    ("fused.rmsnorm_quantize-bad-eps", lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), -1.0,
                                                                             scope="given", gs=v)),
    ("fused.mhc_rmsnorm_quantize", lambda v: rawkv.fused.mhc_rmsnorm_quantize(
        X.to(BF16).reshape(2, 2, 128), torch.ones(2, 2), torch.ones(128), 1e-6, scope="given", gs=v)),
    ("fused.swiglu_quantize", lambda v: rawkv.fused.swiglu_quantize(torch.ones(4, 64, dtype=BF16), 1,
                                                                    scope="given", gs=v)),
]


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("call", [c for _, c in GS_CASES], ids=[n for n, _ in GS_CASES])
def test_a_compiled_op_refuses_a_bool_gs_with_the_eager_error(call, value):
    """gs=True under torch.compile(fullgraph=True) was torch's own error (the
    fake call of the operator, whose `Tensor? gs` took the bool); now the op
    wrapper runs the op's rule for its arguments that are no tensor (Op.host)
    while it traces, so the compiled call raises the eager op's error, naming
    gs (or the argument the eager op names first: a scope that takes no gs,
    a bad eps)."""
    eager = _error(lambda: call(value))
    assert re.match(r"^(gs|eps): ", eager[1]), eager
    assert _error(lambda: _compiled(lambda: call(value), False)) == eager
    with pytest.raises(Exception, match=re.escape(eager[1])):
        _compiled(lambda: call(value), True)


def test_a_bool_gs_refused_when_compiled_writes_nothing():
    out = tuple(t.clone() for t in rawkv.nvfp4.quantize(X))
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    before = [raw(t).clone() for t in out]
    with pytest.raises(Exception, match="gs: expected a float, got True"):
        _compiled(lambda: rawkv.nvfp4.quantize(X, scope="given", gs=True, out=out), True)
    assert all(torch.equal(raw(a), b) for a, b in zip(out, before))


def test_a_bool_tensor_argument_without_a_host_rule_is_refused_by_name():
    """An op with no rule of its own for a bool in a tensor argument: the
    argument layer's error (A.require_array), as the eager op raises it."""
    pool = rawkv.kvcache.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    pool.add_request()
    pool.prepare_step([0], [31])
    sl, ids = torch.zeros(1, dtype=torch.int32), torch.zeros((1, 2), dtype=torch.int32)
    call = lambda: kvc.gather_topk(pool, sl, ids, n_entries=True)  # noqa: E731
    eager = _error(call)
    assert eager == (TypeError, "n_entries: expected a tensor or array, got bool")
    assert _error(lambda: _compiled(call, False)) == eager
    with pytest.raises(Exception, match=re.escape(eager[1])):
        _compiled(call, True)
