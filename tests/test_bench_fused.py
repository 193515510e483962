"""The fused benchmark's all-torch FP8 baseline (rawkv.bench.fused.torch_act_quant,
DeepSeek-V4's act_quant as torch operations) on a CPU: bit for bit the bytes
of rawkv.reference.fp8_blocks.quantize_blocks on random BF16 inputs and on
the edge cases of the rule (all-zero blocks, quotients that are FP32
subnormals, 1e30, blocks of 448 * 2^k and the BF16 value above it), for
E8M0 and float32 scales. Non-finite blocks are left out: the reference flags
them (codes 0, NaN scale) and the baseline does not. The benchmark itself
runs on a GPU (python -m rawkv bench --only fused)."""
from __future__ import annotations

import numpy as np
import pytest

from rawkv.bench.fused import torch_act_quant
from rawkv.reference import fp8_blocks as B

torch = pytest.importorskip("torch")

K = 512


def _block_rows(block, *values):
    """One row of K channels per value list: each block holds the values
    cycled (the first block) or zeros."""
    rows = np.zeros((len(values), K), np.float32)
    for r, v in enumerate(values):
        rows[r, :block] = np.resize(np.asarray(v, np.float32), block)
    return rows


def _edge_rows(block):
    """Rows whose first block is an edge case of the rule."""
    big, tiny = np.float32(2.0 ** 100), np.float32(2.0 ** -40)
    powers = [448 * np.float32(2.0) ** k for k in range(-30, 31, 5)]
    rows = [
        [0.0], [-0.0, 0.0],                             # all zero: amax is the 1e-4 floor
        [1e-30, -3e-36],                                # below the floor
        [big, tiny, -tiny, tiny * 3, -(2.0 ** -60)],    # x / s an FP32 subnormal, or below one
        [1e30], [-1e30, 1e30, 5e29, 1.0],
        *([p] for p in powers),                         # s a power of two, or an ulp from one
        *([p * (1 + 2.0 ** -7), -p] for p in powers),  # the BF16 value above: s just above 2^k
    ]
    return _block_rows(block, *rows)


def _random_rows(rng, rows):
    """Normal values, each row at a scale 2^-30 .. 2^30, and a few outliers."""
    x = rng.standard_normal((rows, K)) * np.exp2(rng.uniform(-30, 30, (rows, 1)))
    x[rng.random((rows, K)) < 0.01] *= 1e4
    return x.astype(np.float32)


def _bf16(x):
    """x rounded to BF16, and the float32 values the reference reads."""
    xt = torch.from_numpy(x).bfloat16()
    return xt, xt.float().numpy()


@pytest.mark.parametrize("block", B.BLOCKS)
@pytest.mark.parametrize("scale_format", B.SCALE_FORMATS)
def test_torch_act_quant_gives_the_reference_bytes(rng, seed, block, scale_format):
    print("seed", seed)
    xt, x = _bf16(np.concatenate([_edge_rows(block), _random_rows(rng, 64)]))
    assert np.isfinite(x).all()
    codes, scales = torch_act_quant(xt, block=block, ue8m0=scale_format == "ue8m0")
    want_codes, want_scales = B.quantize_blocks(x, block, scale_format)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == xt.shape
    got_codes = codes.view(torch.uint8).numpy()
    bad = np.argwhere(got_codes != want_codes)
    assert bad.size == 0, (seed, bad[:5].tolist(), x[tuple(bad[0])] if bad.size else None)
    if scale_format == "ue8m0":
        assert scales.dtype == torch.uint8
        assert np.array_equal(scales.numpy(), want_scales), seed
    else:
        assert scales.dtype == torch.float32
        assert np.array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32)), seed


@pytest.mark.parametrize("block", B.BLOCKS)
def test_the_cases_reach_what_they_are_for(rng, seed, block):
    """The inputs above can fail a wrong rule: they hold E8M0 scales that a
    round-to-nearest power of two would differ from (the rule rounds up),
    and FP32 quotients x / s below the least normal."""
    print("seed", seed)
    _, x = _bf16(np.concatenate([_edge_rows(block), _random_rows(rng, 64)]))
    xb = B._blocks(x, block)
    s, _ = B.scale_of(np.abs(xb).max(-1), "ue8m0")
    fp32_s, _ = B.scale_of(np.abs(xb).max(-1), "fp32")
    nearest = np.exp2(np.round(np.log2(fp32_s.astype(np.float64))))
    assert (s != nearest).any()
    for scale in (s, fp32_s):
        q = np.abs(xb / scale[..., None]).astype(np.float32)
        assert ((q > 0) & (q < np.finfo(np.float32).tiny)).any()


def test_a_partial_block_is_refused():
    with pytest.raises(ValueError, match="multiple of block"):
        torch_act_quant(torch.zeros(2, 96, dtype=torch.bfloat16), block=64)


def test_leading_dimensions_are_kept():
    x = torch.randn(2, 3, 256).bfloat16()
    codes, scales = torch_act_quant(x)
    want_codes, want_scales = B.quantize_blocks(x.float().numpy(), 128, "ue8m0")
    assert codes.shape == (2, 3, 256) and scales.shape == (2, 3, 2)
    assert np.array_equal(codes.view(torch.uint8).numpy(), want_codes)
    assert np.array_equal(scales.numpy(), want_scales)


# ---- the FP8 rows, on a CPU (the ops run rawkv's reference; the timers are stand-ins) -------
def test_fp8_rows_have_the_fused_rows_shape(monkeypatch):
    """Each FP8 row calls its op, baseline and torch baseline (the stand-in
    timer runs each twice, on two input sets) and carries the NVFP4 rows'
    fields, its byte count, and at decode sizes the graph fields."""
    from types import SimpleNamespace

    from rawkv.bench import fused as bench_fused
    calls = []

    def time_us(fn, reps, warmup=5):
        fn(0), fn(1)
        calls.append(fn)
        return 1e-3                          # 1 ns: GBps is the byte count
    monkeypatch.setattr(bench_fused, "_time_us", time_us)
    monkeypatch.setattr(bench_fused, "_rotation", lambda nbytes, l2: 2)
    monkeypatch.setattr(bench_fused, "_graph_us", lambda fn, nbytes: (fn(), {"graph_us": 1.0})[1])
    m, n = 2, 256
    rows = bench_fused._fp8_rows(m, n, SimpleNamespace(copy=1000.0, reps=1, l2=0, dev="cpu"))
    assert [r["op"] for r in rows] == ["quantize_blocks", "quantize_blocks/fp32", "rmsnorm_quantize_fp8",
                                       "swiglu_quantize_fp8", "moe_stage_fp8"]
    assert len(calls) == 3 * 5 - 2           # quantize_blocks' baseline is its torch baseline, timed once
    out = m * n + m * 2                      # codes, one E8M0 byte per 128 channels
    want_bytes = [m * n * 2 + out, m * n * 2 + m * n + m * 2 * 4, m * n * 2 + n * 4 + out + 4 * m,
                  m * n * 2 + m * n // 2 + m, m * n * 2 + out + m * 8 * 20]
    fields = {"op", "shape", "dtype", "us", "GBps", "frac_of_copy", "baseline", "baseline_us", "speedup",
              "torch_baseline", "torch_us", "torch_speedup", "launches", "graph_us"}
    for r, nbytes in zip(rows, want_bytes):
        assert set(r) == fields, r
        assert r["GBps"] == nbytes, (r["op"], nbytes)
        assert r["shape"] == [m, n] and r["launches"] == 1 and r["dtype"] == "bfloat16"
    assert rows[0]["baseline"] == rows[0]["torch_baseline"] == "torch act_quant (DeepSeek's rule)"
    assert rows[2]["baseline"] == "torch pre-op + rawkv.fp8.quantize_blocks"
    assert rows[2]["torch_baseline"] == "torch pre-op + torch act_quant (DeepSeek's rule)"


def test_timed_fp8_calls_write_into_buffers_made_before(monkeypatch):
    """Every rawkv FP8 call the timer runs (the op and the unfused baseline's
    quantize_blocks) passes out=: rawkv refuses to allocate while a CUDA graph
    is captured, and the timing would fall back to eager calls, their host
    time (the first H200 run of these rows timed the baselines so)."""
    from types import SimpleNamespace

    import rawkv
    from rawkv.bench import fused as bench_fused
    timing, outs = [False], []

    def spy(real):
        def call(*args, **kwargs):
            if timing[0]:
                outs.append(kwargs.get("out") is not None)
            return real(*args, **kwargs)
        return call
    for mod, name in ((rawkv.fp8, "quantize_blocks"), (rawkv.fused, "rmsnorm_quantize_fp8"),
                      (rawkv.fused, "swiglu_quantize_fp8"), (rawkv.fused, "moe_stage_fp8")):
        monkeypatch.setattr(mod, name, spy(getattr(mod, name)))

    def time_us(fn, reps, warmup=5):
        timing[0] = True
        fn(0)
        timing[0] = False
        return 1.0
    monkeypatch.setattr(bench_fused, "_time_us", time_us)
    monkeypatch.setattr(bench_fused, "_rotation", lambda nbytes, l2: 1)
    monkeypatch.setattr(bench_fused, "_graph_us", lambda fn, nbytes: {})
    bench_fused._fp8_rows(2, 256, SimpleNamespace(copy=1000.0, reps=1, l2=0, dev="cpu"))
    assert len(outs) == 2 + 3 * 2 and all(outs), outs


@pytest.mark.parametrize("scope", ["row", "tensor", "none"])
def test_nvfp4_unfused_baseline_writes_into_buffers_made_before(monkeypatch, scope):
    """The NVFP4 rows' unfused baseline (rawkv.nvfp4.quantize after the torch
    pre-op) passes out= on every timed call, the same buffers each time, and
    gives quantize's own bytes (its first H200 and H100 runs timed it eagerly:
    the allocation refused under capture)."""
    import rawkv
    from rawkv.bench import fused as bench_fused
    xs = [torch.randn(4, 64).bfloat16() for _ in range(2)]
    calls = []
    real = rawkv.nvfp4.quantize

    def spy(x, **kw):
        calls.append(kw.get("out"))
        return real(x, **kw)
    f = bench_fused.unfused_nvfp4(spy, lambda i: xs[i], scope)
    f(0)
    q, sf, gs = f(1)
    assert calls[0] is None and calls[1] is not None and calls[2] is calls[1] and len(calls) == 3
    want = real(xs[1], scope=scope)
    assert np.array_equal(np.asarray(q.view(torch.uint8)), np.asarray(want[0].view(torch.uint8)))
    assert np.array_equal(np.asarray(sf.view(torch.uint8)), np.asarray(want[1].view(torch.uint8)))


def test_torch_quantize_flags_a_non_finite_block_with_a_nan_scale():
    """torch_quantize (the NVFP4 rows' all-torch baseline) writes the NaN
    scale of a flagged block without a host tensor (a capture cannot copy one
    to the GPU): the E4M3 NaN byte, codes 0, as the reference."""
    from rawkv.bench.fused import torch_quantize
    y = torch.randn(2, 32).bfloat16()
    y[1, 3] = float("inf")
    q, sf, gs = torch_quantize(y, per_row=True)
    sfb = sf.view(torch.uint8)
    assert sfb[1, 0] == 0x7F and (q.view(torch.uint8)[1, :8] == 0).all()
    assert sfb[0, 0] != 0x7F and sfb[1, 1] != 0x7F


def test_the_moe_stage_all_torch_baseline_is_the_ops_work():
    """The moe_stage row's all-torch baseline (torch_moe_stage) writes the
    op's bytes: one-level NVFP4 with gs = 1, as rawkv.fused.moe_stage. It
    quantized with a gs per row before (an amax pass and a division the op
    does not make: more work in the baseline, a flattered torch_speedup)."""
    import rawkv
    from rawkv.bench.fused import torch_moe_stage, torch_quantize
    torch.manual_seed(0)
    hidden = (torch.randn(8, 256) * 3).bfloat16()     # (no all-zero block: torch_quantize writes
                                                       # scale 0 there, the op 1.0; the same work)
    ids, wts = torch.randint(0, 256, (8, 8), dtype=torch.int32), torch.rand(8, 8)
    got = torch_moe_stage(hidden, ids, wts)
    want = rawkv.fused.moe_stage(hidden, ids, wts)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(g.numpy(), np.asarray(w)), (g, w)
    q, sf, gs = torch_quantize(hidden, None)
    assert gs.numel() == 1 and float(gs) == 1.0
