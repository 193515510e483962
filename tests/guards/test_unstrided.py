"""Torch tensors that are not one block of strided memory (rawkv._args.unstrided):
sparse ones (COO, CSR) and nested ones (strided and jagged layout). Every
op refuses them by name, as an input and as an output, before anything is
sized, launched or written. (Until helper 81 they failed deep inside the op
with torch's RuntimeError, naming no argument: 'Cannot access data pointer
of Tensor that doesn't have storage', 'Sparse CSR tensors do not have
is_contiguous', 'NestedTensorImpl doesn't support sizes'; a jagged out= was
'has no memory'.) The CUDA path's rules are the same function; the fast
paths, keyed by a tensor's data pointer and sizes, send such a call to it."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv import fp8, fused, gemm, nvfp4  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from support.fake_cuda import RecordingRuntime, fake  # noqa: E402

MSG = {"coo": r"is a sparse tensor \(layout torch.sparse_coo\)",
       "csr": r"is a sparse tensor \(layout torch.sparse_csr\)",
       "nested": r"is a nested tensor \(layout torch.strided\)",
       "jagged": r"is a nested tensor \(layout torch.jagged\)"}


def _forms(good):
    """{form: good's values as that kind of tensor} for the forms torch
    makes of its dtype and rank."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # (torch's nested / sparse API warnings)
        parts = list(good.unbind(0)) if good.dim() > 1 else [good]
        makers = {"coo": lambda: good.to_sparse(),
                  "csr": lambda: good.to_sparse_csr() if good.dim() == 2 else None,
                  "nested": lambda: torch.nested.nested_tensor(parts),
                  "jagged": lambda: torch.nested.nested_tensor(parts, layout=torch.jagged)}
        for form, make in makers.items():
            try:
                made = make()
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                continue        # (no such form of this dtype)
            if made is not None:
                out[form] = made
    return out


def _calls(rng):
    """(argument name, a good value of it, the op's call with it replaced):
    inputs and outputs of each op family."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x = t(rng.standard_normal((4, 64)).astype(np.float32))
    xb = x.bfloat16()
    w = torch.ones(64)
    codes = fp8.e4m3_encode(x)
    q, sf, gs = nvfp4.quantize(x)
    cache = kc.new_layout_cache("index_fp8", 2, 4, device="cpu")
    keys = t(rng.standard_normal((3, 128)).astype(np.float32))
    slots = torch.tensor([0, 5, -1], dtype=torch.int32)
    m1 = kc.new_layout_cache("model1", 2, 4, device="cpu")
    idx = torch.tensor([[0, 3], [-1, 6]], dtype=torch.int32)
    rows = torch.zeros(2, 2, 512, dtype=torch.bfloat16)
    wt = gemm.Fp4Weight.from_float(torch.linspace(-1, 1, 2 * 16 * 64).reshape(2, 16, 64))
    xg = t(rng.standard_normal((3, 2, 64)).astype(np.float32)).bfloat16()
    ids = torch.tensor([[0, 5, -1], [3, 1, 2]], dtype=torch.int32)
    table = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    return [
        ("x", x, lambda bad: fp8.e4m3_encode(bad)),
        ("out", codes.view(torch.uint8), lambda bad: fp8.e4m3_encode(x, out=bad)),
        ("codes", codes.view(torch.uint8), lambda bad: fp8.e4m3_decode(bad)),
        ("out", x, lambda bad: fp8.e4m3_decode(codes, out=bad)),
        ("x", x, lambda bad: fp8.quantize_blocks(bad, block=64)),
        ("x", x, lambda bad: nvfp4.quantize(bad)),
        ("gs", torch.tensor([0.5]), lambda bad: nvfp4.quantize(x, scope="given", gs=bad)),
        ("q", q, lambda bad: nvfp4.dequantize(bad, sf, gs)),
        ("sf", sf, lambda bad: nvfp4.dequantize(q, bad, gs)),
        ("x", xb, lambda bad: fused.rmsnorm_quantize(bad, w)),
        ("weight", w, lambda bad: fused.rmsnorm_quantize(xb, bad)),
        ("x", xb, lambda bad: fused.rmsnorm_quantize_fp8(bad, w, block=64)),
        ("x", xg, lambda bad: gemm.grouped_linear(bad, wt)),
        ("out", torch.zeros(3, 2, 16, dtype=torch.bfloat16), lambda bad: gemm.grouped_linear(xg, wt, out=bad)),
        ("cache", cache, lambda bad: kc.index_fp8_store(bad, keys, slots, page_size=4)),
        ("keys", keys, lambda bad: kc.index_fp8_store(cache, bad, slots, page_size=4)),
        ("slots", slots, lambda bad: kc.index_fp8_store(cache, keys, bad, page_size=4)),
        ("errors", torch.zeros(1, dtype=torch.int32),
         lambda bad: kc.index_fp8_store(cache, keys, slots, page_size=4, errors=bad)),
        ("indices", idx, lambda bad: kc.model1_gather(m1, bad, page_size=4)),
        ("out", rows, lambda bad: kc.model1_gather(m1, idx, page_size=4, out=bad)),
        ("topk_ids", ids, lambda bad: kc.topk_to_kvcache_indices(bad, table, page_size=4, num_pages=2)),
        ("block_table", table, lambda bad: kc.topk_to_kvcache_indices(ids, bad, page_size=4, num_pages=2)),
    ]


def _pool_calls(rng):
    """The same on the ops of a pool and a decode state."""
    pool = kc.PagedKVPool("csa", 4, 4, 2, 2, device="cpu")
    pool.add_request()
    pool.prepare_step([0], [15])
    ents = torch.from_numpy(rng.standard_normal((2, 512)).astype(np.float32)).bfloat16()
    keys = torch.from_numpy(rng.standard_normal((2, 128)).astype(np.float32)).bfloat16()
    valid = torch.tensor([True, True])
    slots = torch.tensor([0, 0], dtype=torch.int32)
    pos = torch.tensor([0, 4], dtype=torch.int32)
    topk = torch.tensor([[0, 1]], dtype=torch.int32)
    state = kc.DecodeState("hca", 2, device="cpu")
    return [
        ("entries", ents, lambda bad: kc.flush_write(pool, bad, valid, slots, pos, index_keys=keys)),
        ("valid_mask", valid, lambda bad: kc.flush_write(pool, ents, bad, slots, pos, index_keys=keys)),
        ("positions", pos, lambda bad: kc.flush_write(pool, ents, valid, slots, bad, index_keys=keys)),
        ("index_keys", keys, lambda bad: kc.flush_write(pool, ents, valid, slots, pos, index_keys=bad)),
        ("topk_ids", topk, lambda bad: kc.gather_topk(pool, slots[:1], bad)),
        ("slots", slots, lambda bad: kc.state_clear(state, bad)),
    ]


def _check(name, good, call):
    forms = _forms(good)
    assert forms, name
    for form, bad in forms.items():
        with pytest.raises(TypeError, match=rf"^{name}: {MSG[form]}"):
            call(bad)
    return forms


@pytest.mark.parametrize("i", range(22))
def test_sparse_and_nested_tensors_are_refused_by_name(rng, i):
    calls = _calls(rng)
    assert len(calls) == 22
    name, good, call = calls[i]
    call(good)                                  # (the call is good with a plain tensor)
    _check(name, good, call)


@pytest.mark.parametrize("i", range(6))
def test_the_pool_and_state_ops_refuse_them_too(rng, i):
    calls = _pool_calls(rng)
    assert len(calls) == 6
    name, good, call = calls[i]
    _check(name, good, call)


def test_nothing_is_written():
    x = torch.randn(4, 64)
    buf = torch.zeros(4, 64, dtype=torch.uint8)
    for form, bad in _forms(x).items():
        with pytest.raises(TypeError, match=rf"^x: {MSG[form]}"):
            fp8.e4m3_encode(bad, out=buf)
    assert not buf.any()
    cache = kc.new_layout_cache("index_fp8", 2, 4, device="cpu")
    for form, bad in _forms(torch.tensor([0, 1], dtype=torch.int32)).items():
        with pytest.raises(TypeError, match=rf"^slots: {MSG[form]}"):
            kc.index_fp8_store(cache, torch.randn(2, 128), bad, page_size=4)
    assert not cache.any()


def test_the_cuda_path_and_its_fast_paths_refuse_them(monkeypatch):
    """The CUDA path (CPU tensors that report CUDA, launches recorded): a
    strided nested tensor, the one form such a fake can be, is refused by
    the same rules, also after the fp8 and GEMM fast paths have remembered
    a plain call's launch (their keys read sizes a nested tensor lacks)."""
    rec = RecordingRuntime()
    monkeypatch.setattr(rawkv.fp8, "get_runtime", lambda i: rec)
    x, out = fake(torch.randn(4, 64)), fake(torch.zeros(4, 64, dtype=torch.uint8))
    fp8.e4m3_encode(x, out=out)
    assert rec.calls
    nested = fake(_forms(torch.randn(4, 64))["nested"])
    with pytest.raises(TypeError, match=rf"^x: {MSG['nested']}"):
        fp8.e4m3_encode(nested, out=out)
    with pytest.raises(TypeError, match=rf"^out: {MSG['nested']}"):
        fp8.e4m3_encode(x, out=fake(_forms(torch.zeros(4, 64, dtype=torch.uint8))["nested"]))
    with pytest.raises(TypeError, match=rf"^codes: {MSG['nested']}"):
        fp8.e4m3_decode(fake(_forms(torch.zeros(4, 64, dtype=torch.uint8))["nested"]),
                        out=fake(torch.zeros(4, 64)))
    from rawkv.gemm import fast
    assert fast.launched("grouped", (fake(torch.zeros(3, 2, 16)), nested), 1, (), (16, 64), ("out", "x"),
                         ()) is False
