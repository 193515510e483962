"""rawkv.nvfp4.swizzle_scales / unswizzle_scales / swizzled_size: the
tensor-core scale layout against the reshape formula, argument errors, the
launch plan and the CUDA kernels.

The launch-plan tests run the CUDA path on a CPU: CPU tensors that report
is_cuda and a runtime that records launches instead of making them
(tests/nvfp4/conftest.py). Every launch goes through its declaration
(rawkv.kernels.nvfp4), so a wrong keyword, a scalar of the wrong C type or a
missing argument fails there; the tests also check which buffer each pointer
parameter receives."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import layouts as L  # noqa: E402
from rawkv.reference import layouts as RL  # noqa: E402
from support.fake_cuda import fake  # noqa: E402
from support.nvfp4 import u8  # noqa: E402
from support.properties import BYTES, SETTINGS, host, judge, libs, make, seeds  # noqa: E402


# ---- the reference ----------------------------------------------------------------------------------
def swizzle_by_reshape(sf: np.ndarray) -> np.ndarray:
    """The block rearrangement written as reshapes (torchao to_blocked,
    github.com/pytorch/ao torchao/prototype/mx_formats/utils.py at
    d3a0add9bacaac7afa7dcc4e8d2b16fd817deb5d; cuBLAS 'block scaling factors
    layout'): pad to (128k, 4l), view as
    (rb, 128, cb, 4) -> (rb, cb, 128, 4) -> (tiles, 4, 32, 4) -> swap the
    4- and 32- axes -> flatten."""
    rows, cols = sf.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    p = np.zeros((pr, pc), np.uint8)
    p[:rows, :cols] = sf
    blocks = p.reshape(pr // 128, 128, pc // 4, 4).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1)


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (128, 4), (130, 448), (257, 9), (300, 1)])
def test_swizzle_matches_reshape_formula_and_round_trips(rng, shape):
    sf = rng.integers(0, 256, shape, dtype=np.uint8)
    sw = L.swizzle_scales(sf)
    assert sw.size == L.swizzled_size(*shape)
    assert np.array_equal(sw, swizzle_by_reshape(sf))
    assert np.array_equal(L.unswizzle_scales(sw, *shape), sf)
    assert np.array_equal(rawkv.nvfp4.unswizzle_scales(rawkv.nvfp4.swizzle_scales(sf), shape), sf)


def test_swizzle_known_offsets():
    off = L.swizzle_offsets(256, 8)
    assert off[0, 0] == 0 and off[0, 3] == 3 and off[1, 0] == 16 and off[32, 0] == 4
    assert off[31, 0] == 31 * 16 and off[127, 3] == 31 * 16 + 3 * 4 + 3
    assert off[0, 4] == 512 and off[128, 0] == 1024


# ---- argument errors --------------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, shape=st.lists(st.integers(0, 130), min_size=0, max_size=3), lib=libs,
       dt=st.sampled_from(BYTES + ("float32",)))
def test_nvfp4_swizzle_roundtrip(seed, shape, lib, dt):
    sf = make(seed, shape, dt, lib)
    sw = judge(lambda: rawkv.nvfp4.swizzle_scales(sf), ("sf",), lambda: RL.swizzle_scales(host(sf)))
    if sw is not None:
        judge(lambda: rawkv.nvfp4.unswizzle_scales(sw, tuple(shape)), ("sw", "shape"), lambda: host(sf))


BAD_SHAPES = [(2, 3), (0, 5), (3, 0), (), (-1, 4), (2.5, 4), (2, 4.0), "ab", None, (True, 4), (1, 2, 3)]


@SETTINGS
@given(seed=seeds, shape=st.sampled_from(BAD_SHAPES), size=st.integers(0, 1024), lib=libs)
def test_nvfp4_unswizzle_shapes(seed, shape, size, lib):
    sw = make(seed, (size,), "uint8", lib)

    def reference():
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        return RL.unswizzle_scales(host(sw), rows, cols).reshape(shape)
    judge(lambda: rawkv.nvfp4.unswizzle_scales(sw, shape), ("sw", "shape"), reference)


@SETTINGS
@given(rows=st.one_of(st.integers(-300, 300), st.sampled_from([1.5, True, None, "3"])),
       cols=st.one_of(st.integers(-10, 20), st.sampled_from([7.0, False])))
def test_nvfp4_swizzled_size(rows, cols):
    def reference():
        for v in (rows, cols):      # the reference's domain: sizes are non-negative ints
            assert isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"accepted {v!r}"
        return 512 * -(-rows // 128) * -(-cols // 4)
    judge(lambda: rawkv.nvfp4.swizzled_size(rows, cols), ("rows", "cols"), reference)


def test_an_sf_the_rules_refuse_is_named_before_out_is_sized():
    """swizzle_scales sized its new out from sf's raw shape before the rules
    read sf: a stride-0 view of 2^36 rows allocated 256 GiB (an allocator
    error naming nothing) before sf was refused, and a DLPack producer
    without .shape sized an out of 0 bytes that was refused as `out`; now
    out is sized as the rules read sf (rawkv._args.out_lead)."""
    from support.dlpack import Bare
    with pytest.raises(ValueError, match="^sf: must be contiguous"):
        rawkv.nvfp4.swizzle_scales(torch.zeros(1, 4, dtype=torch.uint8).expand(2 ** 36, 4))
    sf = torch.arange(5 * 3, dtype=torch.uint8).reshape(5, 3)
    got = rawkv.nvfp4.swizzle_scales(Bare(sf))
    assert np.array_equal(np.asarray(got), swizzle_by_reshape(sf.numpy()))


# ---- launch plan ------------------------------------------------------------------------------------
def test_swizzle(rt):
    sf = fake(torch.zeros(130, 7, dtype=torch.uint8))
    sw = rawkv.nvfp4.swizzle_scales(sf)
    (name, _, _, a), = rt.calls
    assert name == "rkv_nvfp4_swizzle" and sw.numel() == rawkv.nvfp4.swizzled_size(130, 7)
    assert a == {"sf": sf.data_ptr(), "out": sw.data_ptr(), "rows": 130, "cols": 7, "ncb": 2,
                 "nwords": sw.numel() // 4}
    rt.calls.clear()
    back = rawkv.nvfp4.unswizzle_scales(sw, (2, 65, 7))
    (name, _, _, a), = rt.calls
    assert name == "rkv_nvfp4_unswizzle" and back.shape == (2, 65, 7)
    assert a == {"sw": sw.data_ptr(), "sf": back.data_ptr(), "rows": 130, "cols": 7, "ncb": 2}


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (128, 4), (130, 448), (257, 9), (2, 3, 7), (4096, 448)])
def test_swizzle_gpu(cuda, rng, shape):
    sf = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)).cuda()
    sw = rawkv.nvfp4.swizzle_scales(sf)
    assert np.array_equal(u8(sw), L.swizzle_scales(u8(sf)))
    back = rawkv.nvfp4.unswizzle_scales(sw, shape)
    assert np.array_equal(u8(back), u8(sf))
