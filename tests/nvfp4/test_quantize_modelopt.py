"""rawkv's NVFP4 encoder is byte-identical to NVIDIA ModelOpt's
(`NVFP4QTensor.quantize`, nvidia-modelopt 0.47.0, the `peers` extra; CPU).

Which ModelOpt source each rule follows (all in
modelopt/torch/quantization/qtensor/nvfp4_tensor.py unless said otherwise):
- gs = amax / (6 * 448): `get_weights_scaling_factor_2` (amax from
  `reduce_amax`, modelopt/torch/quantization/utils/core_utils.py);
- r = bmax / (6 * gs), `r == 0 -> 1.0`: `get_weights_scaling_factor`
  (`per_block_scale[per_block_scale == 0] = 1.0`): an all-zero block's scale
  is 0x38;
- `clamp(min=2**-9, max=448)` then the RNE cast to float8_e4m3fn:
  `_cast_per_block_scale_to_fp8`: a block whose scale would round to 0 gets
  0x01 and keeps its values;
- codes of x / (float(sf) * gs) in float32: `quantize`; the E2M1 index from
  `searchsorted` on the bounds plus the ties at 0.75 / 1.75 / 3.5, the sign
  bit from `weight < 0`: `_cast_fp4` (so -0.0, and a negative x whose
  quotient underflows to -0, give code 0);
- nibble order (element 2j low): `quantize`'s `packed_weight`.

The same rules in the source repository: github.com/NVIDIA/Model-Optimizer
(formerly TensorRT-Model-Optimizer), main at
a2fbac7bad8ab446d3f8783dadb0c3366eb0ad73, where nvfp4_tensor.py was last
changed by d0c01a4e9615eaaf0015ec0a5c7c54c5e41eda90. The 0.47.0 wheel's file
is no commit of main (the release branch was not in the copy read); it
differs from d0c01a4e's only by a `staticmethod` alias of
`_cast_per_block_scale_to_fp8` and the order of `quantize`'s try_tensorrt
conditions, none of the rules above.

Where rawkv keeps its own rule (docs/format.md says why), the last tests pin
what each library writes, so a change on either side shows up here.

The reference (numpy, rawkv.reference.nvfp4) and the public op on CPU tensors
(rawkv.nvfp4.quantize) are compared; the kernels equal the reference bit for
bit (tests/nvfp4/test_quantize_gpu.py, tests/fused/ on a GPU).
"""
from __future__ import annotations

import importlib.metadata
import warnings

import numpy as np
import pytest

import rawkv
from rawkv.reference import nvfp4 as R
from rawkv.reference.formats import e4m3_decode

from support import nvfp4_edges as E

torch = pytest.importorskip("torch")
try:
    MODELOPT_VERSION = importlib.metadata.version("nvidia-modelopt")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("nvidia-modelopt is not installed (pip install -e '.[peers]')", allow_module_level=True)
# Installed: it must import (a broken install fails rather than skips).
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

F32 = np.float32
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def modelopt(x: torch.Tensor, gs=None):
    """(q, sf, gs) as NVFP4QTensor.quantize writes them: uint8 bytes, float32 gs.
    gs: None (ModelOpt computes its own per-tensor gs), or a float32 tensor
    (shape () or (rows, 1))."""
    qt, sf, g = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=gs)
    return (qt._quantized_data.numpy(), sf.view(torch.uint8).numpy(),
            np.asarray(g.float().numpy(), F32))


def rawkv_bytes(x: torch.Tensor, scope: str, gs=None):
    """The public op on a CPU tensor: (q, sf, gs) as uint8 / float32 numpy."""
    q, sf, g = rawkv.nvfp4.quantize(x, scope=scope, gs=gs)
    return q.view(torch.uint8).numpy(), sf.view(torch.uint8).numpy(), g.numpy()


def assert_identical(x: torch.Tensor):
    """Byte identity with ModelOpt: gs computed by each (scope 'tensor'), the
    same per-tensor gs handed to both, and rawkv's per-row gs handed to both;
    the op (CPU path) and the numpy reference agree."""
    q, sf, gs = rawkv_bytes(x, "tensor")
    mq, msf, mgs = modelopt(x)
    assert gs == mgs, f"gs: rawkv {gs!r}, ModelOpt {mgs!r}"
    assert np.array_equal(sf, msf), f"sf differs in {int((sf != msf).sum())} blocks"
    assert np.array_equal(q, mq), f"q differs in {int((q != mq).sum())} bytes"
    rq, rsf, _ = R.quantize(x.float().numpy(), "tensor")
    assert np.array_equal(rq, q) and np.array_equal(rsf, sf)
    # the same gs handed in
    g = torch.tensor(gs)
    q2, sf2, _ = rawkv_bytes(x, "given", g)
    mq2, msf2, _ = modelopt(x, g)
    assert np.array_equal(q2, mq2) and np.array_equal(sf2, msf2)
    # per-row gs (rawkv's scope 'row'), handed to ModelOpt as (..., rows, 1)
    qr, sfr, gr = rawkv_bytes(x, "row")
    mqr, msfr, _ = modelopt(x, torch.from_numpy(gr)[..., None])
    assert np.array_equal(qr, mqr) and np.array_equal(sfr, msfr)
    return q, sf


def tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, F32)).to(TORCH[dtype])


def with_zero_blocks(rng, a: np.ndarray) -> np.ndarray:
    """Zero out a random eighth of the blocks (+0, -0 or mixed) and sprinkle
    signed zeros."""
    a = a.copy()
    b = a.reshape(-1, 16)
    pick = rng.random(b.shape[0]) < 0.125
    b[pick] = rng.choice([0.0, -0.0], (int(pick.sum()), 16))
    a.reshape(-1)[rng.random(a.size) < 0.02] = -0.0
    return a


def wide_range(rng, rows: int = 512, k: int = 512) -> np.ndarray:
    """Rows whose magnitudes span 1e-4 .. 1e4: under one per-tensor gs most
    low rows have blocks whose scale would round to 0."""
    return (rng.standard_normal((rows, k)) * np.logspace(-4, 4, rows)[:, None]).astype(F32)


# ---- byte identity -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_normal(rng, dtype):
    assert_identical(tensor(rng.standard_normal((128, 1024)), dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heavy_tailed(rng, dtype):
    assert_identical(tensor(rng.standard_t(1.5, (128, 1024)), dtype))      # a few |x| in the 1e3s


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_outlier_channels(rng, dtype):
    a = rng.standard_normal((256, 512))
    cols = rng.choice(512, 6, replace=False)
    a[:, cols] *= rng.uniform(100, 2000, cols.size)                # LLM activations' outlier channels
    assert_identical(tensor(a, dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_range_keeps_tiny_blocks(rng, dtype):
    x = tensor(wide_range(rng), dtype)
    q, sf = assert_identical(x)
    # the rule is exercised: many blocks at the smallest scale, and their values kept
    tiny = sf.reshape(-1) == 0x01
    codes = R.unpack_nibbles(q).reshape(-1, 16)
    assert tiny.sum() > 100 and (codes[tiny] & 7).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_zero_blocks_and_signed_zeros(rng, dtype):
    x = tensor(with_zero_blocks(rng, rng.standard_normal((64, 512))), dtype)
    q, sf = assert_identical(x)
    assert (sf == 0x38).any()
    codes = R.unpack_nibbles(q)
    neg0 = torch.signbit(x).numpy() & (x == 0).numpy()
    assert neg0.any() and not codes[neg0].any()                    # -0.0 -> code 0 (ModelOpt's x < 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_range_zero_blocks_3d(rng, dtype):
    a = with_zero_blocks(rng, wide_range(rng, 96, 256)).reshape(4, 24, 256)   # stacked per-group weights
    assert_identical(tensor(a, dtype))


@pytest.mark.parametrize("dtype, gs", E.EDGE_CASES)
def test_edge_blocks_given_gs(rng, dtype, gs):
    """The GPU tests' edge blocks (tests/support/nvfp4_edges.py) under their given gs:
    the bytes the kernels must produce are ModelOpt's."""
    xs = E.edge_blocks(dtype, gs, rng)
    x = tensor(xs, dtype)
    g = torch.tensor(gs, dtype=torch.float32)
    q, sf, _ = rawkv_bytes(x, "given", g)
    mq, msf, _ = modelopt(x, g)
    assert np.array_equal(sf, msf) and np.array_equal(q, mq)
    hit = E.rules_hit(xs, q, sf)
    assert hit["zero_block_scale_1"] >= 3 and hit["tiny_value_kept"] > 0 and hit["negative_zero_code_8"] > 0
    if E.underflow_block(dtype, gs) is not None:
        assert hit["negative_quotient_underflow_code_0"] > 0


def test_scale_tie_and_underflowing_ratio():
    """r = bmax / (6 gs) exactly 2^-10 (its RNE tie rounds to 0: clamped to
    0x01) and r that underflows to 0 in float32 for a nonzero block (then
    ModelOpt's `== 0 -> 1.0` applies: 0x38, es = gs)."""
    x = np.zeros((2, 32), F32)
    x[0, :16] = np.linspace(-3, 3, 16) * 2.0 ** -9          # bmax 3 * 2^-9 under gs = 1
    x[1, 16:] = 1e-45                                     # with gs = 1e30: r underflows
    for g in (1.0, 1e30):
        t = torch.from_numpy(x)
        gt = torch.tensor(g, dtype=torch.float32)
        q, sf, _ = rawkv_bytes(t, "given", gt)
        mq, msf, _ = modelopt(t, gt)
        assert np.array_equal(sf, msf) and np.array_equal(q, mq)
    assert R.quantize(x, "given", F32(1.0))[1][0, 0] == 0x01
    assert R.quantize(x, "given", F32(1e30))[1][1, 1] == 0x38


# ---- where rawkv keeps its own rule (docs/format.md) ----------------------------------------------
def test_differs_all_zero_tensor_gs():
    """An all-zero tensor with gs computed: ModelOpt's gs is 0, so its scales
    are 0 / 0 = NaN and its codes those of NaN; rawkv's gs is 1, every scale
    1.0 and every code 0 (docs/format.md, step 1)."""
    x = torch.zeros(2, 32)
    q, sf, gs = rawkv_bytes(x, "tensor")
    mq, msf, mgs = modelopt(x)
    assert gs == 1 and (sf == 0x38).all() and not q.any()
    assert mgs == 0 and ((msf & 0x7F) == 0x7F).all()


def test_differs_when_es_underflows():
    """gs below 2^-140 (a scope whose every |x| is below ~2e-39): es = float(sf)
    * gs can round to 0. ModelOpt then divides by 0 and writes code 7 (+-6)
    for every element; rawkv writes codes 0 (step 3). Both decode to zeros."""
    x = np.zeros((1, 16), F32)
    x[0, 0], x[0, 1] = 1.4e-45, -1.4e-45
    g = torch.tensor(1e-44, dtype=torch.float32)
    q, sf, _ = rawkv_bytes(torch.from_numpy(x), "given", g)
    mq, msf, _ = modelopt(torch.from_numpy(x), g)
    assert np.array_equal(sf, msf)
    assert F32(e4m3_decode(sf[0, 0])) * F32(1e-44) == 0
    assert not q.any() and ((mq & 0x77) == 0x77).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_differs_unusable_given_gs(rng, dtype):
    """A given gs at the bound of docs/format.md ("NVFP4: a given global
    scale"): ModelOpt encodes with it, every block getting one scale whatever
    its data (0x01 from the clamp; 0x38 where gs * 6 overflows to Inf, so
    every r is 0); rawkv flags every block before any scale rule (encoding
    step 0) and the op refuses it as a number. Just below the bound both
    encode, byte for byte alike."""
    limit = F32(R.given_gs_limit(dtype))
    a = np.clip(rng.standard_normal((4, 64)) * np.array([1e-3, 1.0, 1e3, 3e4])[:, None], -6e4, 6e4)
    a[0, :16] = 0                                   # finite in float16 too; one zero block
    x = tensor(a, dtype)
    xs = x.float().numpy()
    mq, msf, _ = modelopt(x, torch.tensor(limit))
    with np.errstate(over="ignore"):
        one = 0x38 if np.isinf(limit * F32(6)) else 0x01
    nonzero = np.abs(xs).reshape(-1, 16).max(axis=1) > 0
    assert np.array_equal(msf.reshape(-1), np.where(nonzero, np.uint8(one), np.uint8(0x38)))
    q, sf, _ = R.quantize(xs, "given", limit, dtype)
    assert (sf == 0x7F).all() and not q.any()
    with pytest.raises(ValueError, match="^gs:"):
        rawkv.nvfp4.quantize(x, scope="given", gs=float(limit))
    below = np.nextafter(limit, F32(0))
    q2, sf2, _ = rawkv_bytes(x, "given", torch.tensor(below))
    mq2, msf2, _ = modelopt(x, torch.tensor(below))
    assert np.array_equal(sf2, msf2) and np.array_equal(q2, mq2)
