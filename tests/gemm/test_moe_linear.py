"""rawkv.gemm.moe_linear: tokens sorted by expert, ragged offsets, through each
expert's FP4 weight (rawkv/gemm/linear.py, rawkv/cu/gemm_fp4.cu). On CPU the
reference, with offsets clamped and counted; its own argument errors (the
shared rules: tests/gemm/test_arguments.py); the ragged dispatch rule; the
mma.sync kernel's ragged paths within the FP32 bound of tests/support/gemm.py
(the wgmma kernel: tests/gemm/test_linear_sm90.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
import rawkv  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv.gemm import linear, plans  # noqa: E402
from rawkv.reference import gemm as ref  # noqa: E402
from support.gemm import (  # noqa: E402
    _Sizes, assert_within_bound, _bf16, _bits, _cached_weight, check_ragged, _exact, _f32_bits,
    random_weight, _weight,
)
from support.properties import SETTINGS, host, judge, layouts, make, seeds  # noqa: E402


# ---------------------------------------------------------------------------
# reference: CPU tensors run it, exactly
# ---------------------------------------------------------------------------
def test_cpu_moe_offsets_are_clamped_and_counted(rng):
    w = _weight(rng, 4, 16, 32)
    x = torch.randn(9, 32).bfloat16()
    offsets = torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32)
    want, bad = ref.ragged(x.double().numpy(), _exact(w), offsets.numpy())
    assert bad == 2                   # 3 < 5 and 12 > rows
    errors = np.zeros(1, np.int32)
    got = rawkv.gemm.moe_linear(x, w, offsets, errors=errors)
    assert np.array_equal(_bits(got), ref.round_to_bf16(want)) and errors[0] == 2
    before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
    rawkv.gemm.moe_linear(x, w, offsets)
    assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) == before + 2


def test_cpu_moe_with_nothing_to_multiply_counts_nothing(rng):
    # as the GPU, which launches no kernel then (docs/gemm.md, "Ragged offsets")
    offsets = torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32)
    for rows, n in ((0, 16), (9, 0)):
        w = _weight(rng, 4, n, 32) if n else rawkv.gemm.Fp4Weight.from_float(torch.zeros(4, 0, 32))
        errors = np.zeros(1, np.int32)
        before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
        got = rawkv.gemm.moe_linear(torch.randn(rows, 32).bfloat16(), w, offsets, errors=errors)
        rawkv.gemm.moe_linear(torch.randn(rows, 32).bfloat16(), w, offsets)
        assert tuple(got.shape) == (rows, n) and errors[0] == 0
        assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) == before


def test_numpy_nvfp4_activations_and_moe(rng):
    # a QuantizedActivation of numpy arrays (what rawkv.nvfp4.quantize and
    # the fused producers return for numpy input) gives the bits of the same
    # activation as CPU tensors; moe_linear takes numpy offsets / errors.
    w = _weight(rng, 3, 24, 64)
    xf = rng.standard_normal((4, 3, 64)).astype(np.float32)
    qa = rawkv.nvfp4.QuantizedActivation
    qn = qa(*rawkv.nvfp4.quantize(xf, scope="row")[:3])
    qt = qa(*rawkv.nvfp4.quantize(torch.from_numpy(xf), scope="row")[:3])
    assert isinstance(qn.q, np.ndarray)
    assert np.array_equal(_f32_bits(rawkv.gemm.grouped_linear(qn, w)), _bits(rawkv.gemm.grouped_linear(qt, w)))
    with pytest.raises(TypeError, match=r"^x.gs: dtype float64"):
        rawkv.gemm.grouped_linear(qa(qn.q, qn.sf, qn.gs.astype(np.float64)), w)
    xm = torch.randn(7, 64).bfloat16()
    offsets = np.array([0, 2, 1, 9], np.int32)                      # two clamps
    errors = np.zeros((1, 2), np.int32)                             # errors[0] is the first element
    got = rawkv.gemm.moe_linear(xm.float().numpy(), w, offsets, errors=errors)
    want = rawkv.gemm.moe_linear(xm, w, torch.from_numpy(offsets))
    assert np.array_equal(_f32_bits(got), _bits(want)) and errors.tolist() == [[2, 0]]
    with pytest.raises(TypeError, match=r"^offsets: dtype int64"):
        rawkv.gemm.moe_linear(xm.float().numpy(), w, offsets.astype(np.int64))


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
def test_a_bad_out_writes_nothing(rng):
    w = _weight(rng, 4, 16, 32)
    x = torch.randn(9, 32).bfloat16()
    errors = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match=r"^out"):
        rawkv.gemm.moe_linear(x, w, torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32), errors=errors,
                              out=torch.empty(9, 15, dtype=torch.bfloat16))
    assert errors[0] == 0             # the clamps are not counted by a call that raised


def test_too_many_experts_are_refused_on_cpu_too(rng, monkeypatch):
    # the ragged kernel's limit (MAX_SEGMENTS - 1 experts) was checked on CUDA only
    monkeypatch.setattr(rawkv.kernels.gemm_fp4, "MAX_SEGMENTS", 3)
    w = _weight(rng, 3, 16, 32)
    with pytest.raises(ValueError, match=r"^weight: 3 experts"):
        rawkv.gemm.moe_linear(torch.randn(4, 32).bfloat16(), w, torch.zeros(4, dtype=torch.int32))


def test_a_refused_errors_counts_nothing(rng):
    w = _weight(rng, 2, 16, 32)
    before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
    bad_offsets = torch.tensor([5, 0, 9], dtype=torch.int32)        # would count clamps
    with pytest.raises(TypeError, match=r"^errors"):
        rawkv.gemm.moe_linear(torch.randn(4, 32).bfloat16(), w, bad_offsets, errors=np.zeros(1, np.int64))
    assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) == before


# ---------------------------------------------------------------------------
# properties (hypothesis): the reference's bits or a refusal naming the argument
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, r=st.integers(0, 5), xdt=st.sampled_from(("bfloat16", "float16")), layout=layouts,
       special=st.booleans(), offs=st.lists(st.integers(-2, 7), min_size=3, max_size=3))
def test_gemm_moe_linear(seed, r, xdt, layout, special, offs):
    w = _cached_weight(2, 16, 64)
    x = make(seed, (r, 64), xdt, "torch", layout, special)
    offsets = torch.tensor(offs, dtype=torch.int32)
    err = np.zeros(1, np.int32)

    def reference():
        y, bad = ref.ragged(host(x).astype(np.float64), _exact(w), np.asarray(offs, np.int32))
        assert err[0] == bad
        return _bf16(ref.round_to_bf16(y))
    judge(lambda: rawkv.gemm.moe_linear(x, w, offsets, errors=err), ("x", "weight", "offsets", "errors"),
          reference)


# ---------------------------------------------------------------------------
# plan: which kernel and tile (arithmetic on the sizes, no GPU)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,expected", [(1, False), (12, False), (24, False), (27, False), (28, True), (96, True)])
def test_the_ragged_dispatch_rule(tokens, expected):
    assert plans.takes_sm90(_Sizes(256, 4096), tokens, True, linear) is expected


# ---------------------------------------------------------------------------
# GPU: the mma.sync kernel within the FP32 bound (tests/support/gemm.py)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("offsets", [[0, 3, 3, 10, 30, 37], [0, 0, 0, 0, 0, 37], [0, 37, 37, 37, 37, 37],
                                     [2, 3, 1, 10, 50, 30], [-4, 5, 5, 5, 20, 33]])
@pytest.mark.parametrize("act", ["bfloat16", "nvfp4"])
def test_ragged_experts(cuda, rng, offsets, act):
    check_ragged(rng, offsets, act, n=72, k=208, rows=37)


@pytest.mark.parametrize("offsets", [[0, 3, 3, 10, 30, 37], [0, 1, 2, 4, 5, 6, 9], [-4, 5, 5, 5, 20, 33],
                                     [0, 16, 16, 40, 41, 80], [0, 30, 31, 90, 91, 150]])
@pytest.mark.parametrize("act", ["bfloat16", "nvfp4"])
def test_ragged_tiles(cuda, rng, offsets, act, monkeypatch):
    # The ragged tiles (one warp streams all of K: RAGGED_CONFIGS, 8 to 32
    # tokens per expert) serve only grids of hundreds of blocks; forced here
    # at a small size, with K past a chunk boundary and N past a block's.
    from rawkv.gemm import linear
    monkeypatch.setattr(linear, "MMA_RAGGED_MIN_BLOCKS", 0)
    monkeypatch.setattr(linear, "SM90_MIN_EXPERT_TOKENS", 1 << 30)
    check_ragged(rng, offsets, act, n=200, k=336, rows=max(offsets))


def test_ragged_tiles_same_bits_every_run(cuda, rng, monkeypatch):
    from rawkv.gemm import linear
    monkeypatch.setattr(linear, "MMA_RAGGED_MIN_BLOCKS", 0)
    w, _ = random_weight(rng, 4, 136, 1040, "nvfp4")
    x = torch.randn(70, 1040, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([0, 9, 30, 31, 70], dtype=torch.int32, device="cuda")
    a, b = rawkv.gemm.moe_linear(x, w, offs), rawkv.gemm.moe_linear(x, w, offs)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ragged_tile_same_bits_alone_or_with_other_tokens(cuda, rng, monkeypatch, fmt):
    # A token's output from the 8-token ragged tile has the same bits whether
    # its block holds it alone or with other tokens: an MMA's column depends
    # only on its own token (what lets a column past the block's last token
    # read that token's row). Token x[0] through expert 0 alone, then among
    # three tokens of expert 0; both calls take the tile. K = 352: a partial
    # 64-column chunk, and whole MXFP4 blocks.
    from rawkv.gemm import linear
    from rawkv.kernels import gemm_fp4 as K
    monkeypatch.setattr(linear, "MMA_RAGGED_MIN_BLOCKS", 0)
    monkeypatch.setattr(linear, "SM90_MIN_EXPERT_TOKENS", 1 << 30)
    w, _ = random_weight(rng, 2, 200, 352, fmt)
    x = torch.randn(4, 352, dtype=torch.bfloat16, device="cuda")
    tile = plans.mma_config(1, K.RAGGED_CONFIGS)
    assert tile[:2] == (2, 1) and tile == plans.mma_config(2, K.RAGGED_CONFIGS)
    alone = rawkv.gemm.moe_linear(x[:2], w, torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"))
    among = rawkv.gemm.moe_linear(x[[0, 2, 3, 1]], w, torch.tensor([0, 3, 4], dtype=torch.int32, device="cuda"))
    assert torch.equal(alone[0].view(torch.int16), among[0].view(torch.int16))
    assert torch.equal(alone[1].view(torch.int16), among[3].view(torch.int16))


def test_ragged_many_experts_and_the_default_counter(cuda, rng):
    e, n, k = 256, 32, 64
    counts = rng.integers(0, 4, e)
    counts[rng.choice(e, 40, replace=False)] = 0                 # empty experts
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(offsets[-1])
    w, w64 = random_weight(rng, e, n, k, "mxfp4")
    xt = torch.randn(rows, k, dtype=torch.bfloat16)
    exact, _ = ref.ragged(xt.double().numpy(), w64, offsets)
    absolute, _ = ref.ragged(np.abs(xt.double().numpy()), np.abs(w64), offsets)
    assert_within_bound(rawkv.gemm.moe_linear(xt.cuda(), w, torch.from_numpy(offsets).cuda()),
                        exact, absolute, k, "256 experts")
    counter = rawkv.nvfp4.error_counts()
    before = int(counter[rawkv.nvfp4.GEMM_OFFSETS])
    bad = offsets.copy()
    bad[3] = rows + 50
    rawkv.gemm.moe_linear(xt.cuda(), w, torch.from_numpy(bad).cuda())
    _, nbad = ref.clamp_offsets(bad, rows)
    assert int(counter[rawkv.nvfp4.GEMM_OFFSETS]) - before == nbad


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp4", "w4a8"])
@pytest.mark.parametrize("last", [0, 2, 5, 7, -1])
def test_a_weight_of_no_experts_writes_zero_rows_and_counts_as_the_cpu(cuda, rng, kind, last):
    # E = 0 (offsets of one entry): no expert owns a row, so every row of out
    # is zero; an offset past the rows or below zero is clamped and counted,
    # on CUDA as on CPU (the ragged launch plans a grid over no experts).
    fmt = "nvfp4" if kind == "nvfp4" else "mxfp4"
    w, _ = random_weight(rng, 2, 24, 64, fmt, device="cpu")
    kw = {} if fmt == "nvfp4" else {"exp_range": w.exp_range}
    w0 = rawkv.gemm.Fp4Weight(fmt, 24, 64, w.codes[:0], w.scales[:0], w.gs[:0], **kw)
    x = torch.randn(5, 64).bfloat16()
    wd = w0.to("cuda")
    if kind == "w4a8":
        w0, wd, x = rawkv.gemm.w4a8_weight(w0), rawkv.gemm.w4a8_weight(wd), rawkv.fp8.quantize_blocks(x)
    offs = torch.tensor([last], dtype=torch.int32)
    want_err = np.zeros(1, np.int32)
    want = rawkv.gemm.moe_linear(x, w0, offs, errors=want_err)
    xd = tuple(t.cuda() for t in x) if kind == "w4a8" else x.cuda()
    out = torch.full((5, 24), float("nan"), dtype=torch.bfloat16, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    rawkv.gemm.moe_linear(xd, wd, offs.cuda(), out=out, errors=err)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
    assert int(err[0]) == int(want_err[0])
