"""rawkv ops as torch custom operators (rawkv.library): every declared op is
registered as torch.ops.rawkv.<name> in mutating form and passes
torch.library.opcheck (schema, fake tensor, autograd registration, AOT
dispatch); torch.compile(fullgraph=True) traces the public ops with no graph
break. CPU here; the CUDA and CUDA-graph checks are in test_library_gpu."""
import re

import pytest

torch = pytest.importorskip("torch")
import rawkv.library as L  # noqa: E402
from rawkv import _opdecl  # noqa: E402
from support.library import same_bits, samples, steps  # noqa: E402


def test_every_declared_op_is_registered_and_sampled(rng):
    ops = L.operators()
    assert set(ops) == set(_opdecl.declared()) and ops
    assert set(samples(rng)) == set(ops), "every operator needs opcheck samples (tests/support/library.py)"
    for name, decl in _opdecl.declared().items():
        schema = str(getattr(torch.ops.rawkv, name).default._schema)
        assert schema.startswith(f"rawkv::{name}(") and schema.endswith("-> ()"), schema
        for arg in decl.mutates:
            # 'Tensor(a!) out', or 'Tensor(b!)? errors' (an optional written tensor)
            assert re.search(rf"\([a-z]!\)\??\s{arg}\b", schema), (schema, arg)


@pytest.mark.parametrize("name", sorted(_opdecl.declared()))
def test_opcheck_cpu(rng, name):
    for args in samples(rng)[name]:
        torch.library.opcheck(getattr(torch.ops.rawkv, name).default, args)


@pytest.mark.parametrize("name,make", steps(), ids=[n for n, _ in steps()])
def test_compile_fullgraph_traces_public_ops(rng, name, make):
    torch._dynamo.reset()
    step, args = make(rng, "cpu")
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert same_bits(compiled(*args), step(*args))


def test_schema_defaults_reach_the_implementation():
    calls = []
    decl = _opdecl.OpDecl("test_defaults", lambda **kw: calls.append(kw),
                          "Tensor x, Tensor(a!) out, float eps=1e-06, str scope='row', int? k=None")
    try:
        assert decl.defaults == {"eps": 1e-06, "scope": "row", "k": None}
        L._make_impl(decl)(1, 2)
        L._make_impl(decl)(1, 2, 0.5, "tensor", 3)
        assert calls == [{"x": 1, "out": 2, "eps": 1e-06, "scope": "row", "k": None},
                         {"x": 1, "out": 2, "eps": 0.5, "scope": "tensor", "k": 3}]
    finally:
        _opdecl._OPS.pop("test_defaults")


def test_schema_errors_are_caught_at_declaration():
    with pytest.raises(ValueError, match="writes at least one argument"):
        _opdecl.OpDecl("test_no_mutation", print, "Tensor x")
    with pytest.raises(ValueError, match="cannot read schema argument"):
        _opdecl.OpDecl("test_bad_schema", print, "Tensor(a!)")
    assert "test_no_mutation" not in _opdecl.declared()
