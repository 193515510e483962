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


def test_compiled_ops_refuse_outputs_in_another_arguments_memory():
    """torch.compile functionalizes a mutating operator: each written
    argument reaches the implementation as a fresh copy, which is then
    written back. So the implementation's memory rule (A.check_outputs) saw
    no overlap, and a compiled call took an out= or errors= in another
    argument's memory where the eager op refuses it: errors=pool.written[s:s+1]
    of a gather had its count added into written[s] (a request's entry
    count), an out= over the op's own input was written. The fake
    implementation refuses it while dynamo traces, naming both, as eagerly.
    Found by a review."""
    import numpy as np
    import rawkv
    import rawkv.kvcache as kvc
    from rawkv.reference import layouts as RL
    from support.kvcache import _small_hca_pool
    n = RL.swizzled_size(4, 4)
    buf = torch.arange(n + 16, dtype=torch.uint8)
    before = buf.clone()

    def swizzle(b):
        return rawkv.nvfp4.swizzle_scales(b[:16].view(4, 4), out=b[:n])
    for step in (swizzle, torch.compile(swizzle, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="out: overlaps sf in memory"):
            step(buf)
        assert torch.equal(buf, before)
    p, s = _small_hca_pool()
    written = p.torch_buffers()["written"]
    was = p.written.copy()
    slots, ids = torch.tensor([s], dtype=torch.int32), torch.tensor([[0, 5]], dtype=torch.int32)

    def gather(e):
        return kvc.gather_topk(p, slots, ids, errors=e)
    for step in (gather, torch.compile(gather, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"errors: overlaps (pool\.)?written in memory"):
            step(written[s:s + 1])
        assert np.array_equal(p.written, was)
    # apart, the same call compiles and gives the eager bits and count
    e1, e2 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    torch._dynamo.reset()
    assert same_bits(torch.compile(gather, fullgraph=True, backend="aot_eager")(e1), gather(e2))
    assert e1.item() == e2.item() > 0
    # overlap is decided on the bytes: interleaved views of one storage touch none in common
    from rawkv._args import _overlap
    b = torch.zeros(64)
    assert not _overlap(L._fake_span(b[0::2]), L._fake_span(b[1::2]))
    assert _overlap(L._fake_span(b[0::2]), L._fake_span(b[:8]))
    assert not _overlap(L._fake_span(b[:4]), L._fake_span(b[4:8]))


def test_the_docs_list_the_ops_that_write_the_device_counters():
    """The device's error counters (rawkv.nvfp4.error_counts) are written by
    ops whose schemas do not name them, so a read inside a compiled region is
    not ordered after the op: docs/runtime.md says so and lists the ops, those
    with an errors= the schema declares written (the ordered way to count)
    and those without one."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "runtime.md").read_text()
    start = text.index("## Error counters and torch.compile")
    section = text[start:text.index("\n## ", start + 1)]
    with_errors = ("nvfp4_gather", "nvfp4_quantize", "gemm_moe_linear", "gemm_grouped_linear_w4a8",
                   "gemm_moe_linear_w4a8")
    without = ("rmsnorm_quantize", "mhc_rmsnorm_quantize", "swiglu_quantize")
    declared = _opdecl.declared()
    for name in with_errors + without:
        assert f"`{name}`" in section, name
    for name in with_errors:
        assert ("errors", "Tensor?", True) in declared[name].args, name       # a declared write
    for name in without:
        assert not [a for a in declared[name].args if a[0] == "errors"], name
    assert "outside\ncompiled regions" in section or "outside compiled regions" in section
