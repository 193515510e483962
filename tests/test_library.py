"""rawkv ops as torch custom operators (rawkv.library): every declared op is
registered as torch.ops.rawkv.<name> in mutating form and passes
torch.library.opcheck (schema, fake tensor, autograd registration, AOT
dispatch); torch.compile(fullgraph=True) traces the public ops with no graph
break. CPU here; the CUDA and CUDA-graph checks are in test_library_gpu."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library as L  # noqa: E402
from rawkv import _opdecl  # noqa: E402


def _fp8_samples(rng, device="cpu"):
    x = torch.from_numpy(rng.standard_normal((3, 37)).astype(np.float32)).to(device)
    # uint8 codes: opcheck compares buffers with allclose, which has no float8 kernel on CPU
    codes = torch.from_numpy(rng.integers(0, 256, (3, 37), dtype=np.uint8)).to(device)
    return {
        "e4m3_encode": [(x, torch.empty(x.shape, dtype=torch.uint8, device=device)),
                        (x.bfloat16(), torch.empty(x.shape, dtype=torch.uint8, device=device))],
        "e4m3_decode": [(codes, torch.empty(codes.shape, device=device)),
                        (codes, torch.empty(codes.shape, dtype=torch.float16, device=device))],
    }


SAMPLES = [_fp8_samples]


def samples(rng, device="cpu"):
    out = {}
    for fn in SAMPLES:
        out.update(fn(rng, device))
    return out


def test_every_declared_op_is_registered_and_sampled(rng):
    ops = L.operators()
    assert set(ops) == set(_opdecl.declared()) and ops
    assert set(samples(rng)) == set(ops), "every operator needs opcheck samples here"
    for name, decl in _opdecl.declared().items():
        schema = str(getattr(torch.ops.rawkv, name).default._schema)
        assert schema.startswith(f"rawkv::{name}(") and schema.endswith("-> ()"), schema
        for arg in decl.mutates:
            assert f"(a!) {arg}" in schema or "!) " + arg in schema, (schema, arg)


@pytest.mark.parametrize("name", sorted(_opdecl.declared()))
def test_opcheck_cpu(rng, name):
    for args in samples(rng)[name]:
        torch.library.opcheck(getattr(torch.ops.rawkv, name).default, args)


def test_operator_writes_what_the_public_op_returns(rng):
    x = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    out = torch.empty(100, dtype=torch.uint8)
    torch.ops.rawkv.e4m3_encode(x, out)
    assert torch.equal(out, rawkv.fp8.e4m3_encode(x).view(torch.uint8))


def test_compile_fullgraph_traces_public_ops(rng):
    torch._dynamo.reset()

    def step(x):
        codes = rawkv.fp8.e4m3_encode(x)
        return rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16).float() * 2

    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))


def test_schema_errors_are_caught_at_declaration():
    with pytest.raises(ValueError, match="writes at least one argument"):
        _opdecl.OpDecl("test_no_mutation", print, "Tensor x")
    with pytest.raises(ValueError, match="cannot read schema argument"):
        _opdecl.OpDecl("test_bad_schema", print, "Tensor(a!)")
    assert "test_no_mutation" not in _opdecl.declared()
