"""An input given as a bare DLPack producer (the protocol promises no .shape
or .dtype; CuPy and JAX arrays have them, others need not) sizes an op's new
outputs as the rules read it (rawkv._args.as_read, through out_lead /
out_rows), for every op that sizes outputs from an input: the result is the
one the tensor itself gives. Before, an op sized its outputs from a missing
shape (no rows) and then refused them as `out`, or (the GEMM) named `x` as
of the wrong rank. The nvfp4 and fused ops' cases are in their own test
files."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from support.dlpack import Bare  # noqa: E402


def _same(got, want):
    got, want = torch.as_tensor(np.asarray(got)) if not torch.is_tensor(got) else got, want
    assert got.shape == want.shape
    if want.dtype == torch.bfloat16:       # (a host DLPack input gets numpy outputs: BF16 as float32)
        got = got.to(torch.bfloat16)
    assert torch.equal(got.view(torch.uint8) if want.element_size() == 1 else got, want.view(torch.uint8)
                       if want.element_size() == 1 else want)


def test_fp8_quantize_blocks():
    x = torch.randn(3, 256)
    for got, want in zip(rawkv.fp8.quantize_blocks(Bare(x)), rawkv.fp8.quantize_blocks(x)):
        _same(got, want)


def test_gemm_batched_and_ragged():
    g, n, k = 2, 16, 64
    w = rawkv.gemm.Fp4Weight.from_float(torch.linspace(-1, 1, g * n * k).reshape(g, n, k))
    x = torch.randn(3, g, k).bfloat16()
    _same(rawkv.gemm.grouped_linear(Bare(x), w), rawkv.gemm.grouped_linear(x, w))
    offsets = torch.tensor([0, 1, 3], dtype=torch.int32)
    _same(rawkv.gemm.moe_linear(Bare(x[:, 0]), w, offsets), rawkv.gemm.moe_linear(x[:, 0].contiguous(), w, offsets))


def test_kvcache_topk_to_kvcache_indices():
    ids = torch.tensor([[0, 3, -1], [5, 1, 2]], dtype=torch.int32)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    args = dict(page_size=4, num_pages=4)
    _same(kc.topk_to_kvcache_indices(Bare(ids), table, **args), kc.topk_to_kvcache_indices(ids, table, **args))
