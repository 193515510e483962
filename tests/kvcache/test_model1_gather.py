"""model1_gather: rows of MODEL1 pages by KV-cache index (rawkv/kvcache/layouts.py,
rawkv/cu/kv_layouts.cu): against the reference on random arguments and, on
CUDA, bit for bit on a poisoned cache. Addressing and counts:
test_model1_store.py's test_addressing_skips_and_counts."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import kvcache as kc  # noqa: E402
from rawkv.reference.kvcache import layouts as R  # noqa: E402
from support.kvcache import F32  # noqa: E402
from support.kvcache_layouts import _poisoned, tt  # noqa: E402
from support.properties import SETTINGS, host, judge, libs, make, seeds, shapes  # noqa: E402


# ---------------------------------------------------------------------------
# properties (hypothesis): the op against the reference, at most one wrong argument
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, pages=st.integers(1, 3), page_size=st.sampled_from([1, 2, 4]), idx_shape=shapes,
       idt=st.sampled_from(("int32", "int64")), dtype=st.sampled_from([None, "float32", "float16", "int8"]),
       lib=libs)
def test_kvcache_model1_gather(seed, pages, page_size, idx_shape, idt, dtype, lib):
    cache = make(seed, (pages, R.MODEL1.page_bytes(page_size)), "uint8")
    idx = make(seed + 1, idx_shape, idt, lib, lo=-2, hi=pages * page_size + 2)

    def reference():
        rows, _ = R.model1_gather(cache, page_size, host(idx), dtype or "bfloat16")
        return rows
    judge(lambda: kc.model1_gather(cache, idx, page_size=page_size, dtype=dtype),
          ("cache", "indices", "page_size", "dtype"), reference)


# ---------------------------------------------------------------------------
# GPU: the kernel against the reference
# ---------------------------------------------------------------------------
def same_values(got, want, what=""):
    """Bit equality of decoded float arrays; NaN matches NaN (payloads are
    not part of the contract of a decode)."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(np.uint32) != want.view(np.uint32)))
    assert not bad.any(), f"{what}: {int(bad.sum())} differ, first at {np.argwhere(bad)[0].tolist()}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_model1_gather_bit_exact(cuda, rng, dtype):
    n, p = 6, 64
    cache_np = _poisoned(rng, R.MODEL1, n, p)
    sc = cache_np[:, p * 576:p * 584]              # scale records: mostly plausible bytes, and the extremes
    plausible = rng.random(sc.shape) < 0.7
    sc[plausible] = rng.integers(90, 140, int(plausible.sum()), dtype=np.uint8)
    sc[0, :6] = [0, 255, 1, 254, 127, 0]
    idx = rng.integers(-1, n * p, (7, 33)).astype(np.int32)
    idx[0, :4] = [-1, -5, n * p, 2 ** 31 - 1]
    want, nerr = R.model1_gather(cache_np, p, idx, dtype)
    assert nerr == 3
    cache = tt(cache_np).cuda()
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((7, 33, 512), float("nan"), dtype=getattr(torch, dtype), device="cuda")
    res = kc.model1_gather(cache, tt(idx).cuda(), page_size=p, out=out, errors=err)
    assert res is out and int(err.item()) == nerr
    same_values(out.float().cpu().numpy(), want, f"model1_gather {dtype}")
    np.testing.assert_array_equal(cache.cpu().numpy(), cache_np)
