"""Degenerate inputs: the CPU path counts what the GPU path counts.

Where a call has nothing to compute (no output rows or columns), the CUDA
plan launches no kernel, so nothing reads the indices and nothing is
counted; the references count nothing there either. Where the cache or
table to read is empty, the CUDA kernel runs and counts every index but -1
as out of range; the references do the same instead of failing on the
empty array. Each case is run on both devices (the CUDA one skips without
a GPU) and checked against the count the rule gives; with the indices'
shape kept and a non-empty target, the same indices are counted, so the
zero is the rule's and not a counter that never moves.
(The ragged GEMM's case: tests/gemm/test_moe_linear.py.)"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv.kvcache import PagedKVPool  # noqa: E402
from rawkv.reference.kvcache import layouts as RL  # noqa: E402


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request):
    if request.param == "cuda":
        request.getfixturevalue("cuda")            # skips without a GPU
    return request.param


def _i32(values, dev):
    return torch.tensor(values, dtype=torch.int32, device=dev)


def _errors(dev):
    return torch.zeros(1, dtype=torch.int32, device=dev)


def test_nvfp4_gather_of_no_columns_counts_nothing(dev):
    for cols, want in ((0, 0), (16, 2)):              # 7 and -1 of 4 rows: counted where columns exist
        q = torch.zeros(4, cols // 2, dtype=torch.uint8, device=dev)
        sf = torch.zeros(4, cols // 16, dtype=torch.uint8, device=dev)
        errors = _errors(dev)
        out = rawkv.nvfp4.gather(q, sf, 1.0, _i32([7, -1, 2], dev), errors=errors)
        assert tuple(out.shape) == (3, cols) and int(errors[0]) == want, (cols, int(errors[0]))


@pytest.mark.parametrize("name", ["gather_dense_batch", "gather_index_keys_batch"])
def test_batched_pool_gather_of_no_entries_counts_nothing(dev, name):
    pool = PagedKVPool("csa", num_blocks=4, entries_per_block=64, max_requests=2, max_blocks_per_request=2,
                       device=dev)
    slot = pool.add_request()
    fn = getattr(rawkv.kvcache, name)
    for k, positive in ((0, False), (1, True)):       # n_entries 3 > K: counted where K > 0
        errors = _errors(dev)
        out = fn(pool, _i32([slot], dev), _i32([3], dev), max_entries=k, errors=errors)
        assert out.shape[:2] == (1, k) and (int(errors[0]) > 0) == positive, (k, int(errors[0]))


def test_model1_gather_from_no_pages_counts_every_index(dev):
    p = 64
    cache = torch.zeros(0, RL.MODEL1.page_bytes(p), dtype=torch.uint8, device=dev)
    errors = _errors(dev)
    out = rawkv.kvcache.model1_gather(cache, _i32([0, 3, -1], dev), page_size=p, errors=errors)
    assert tuple(out.shape) == (3, RL.ENTRY_DIM) and int(errors[0]) == 2
    assert not out.float().abs().sum()


@pytest.mark.parametrize("rows,cols,slots", [(0, 4, [0]), (2, 0, None)])
def test_topk_bridge_with_an_empty_table_counts_every_id(dev, rows, cols, slots):
    errors = _errors(dev)
    table = torch.zeros(rows, cols, dtype=torch.int32, device=dev)
    got = rawkv.kvcache.topk_to_kvcache_indices(_i32([[1, -1, -5]], dev), table, page_size=64, num_pages=8,
                                                slots=None if slots is None else _i32(slots, dev), errors=errors)
    assert np.asarray(got.cpu()).tolist() == [[-1, -1, -1]] and int(errors[0]) == 2
