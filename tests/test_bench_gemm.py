"""rawkv.bench.gemm's (and its gemm_peer's and gemm_plot's) pure logic on the CPU: the peer's row fields and
check, humming's indexed routing for sorted rows, the plot's series and its
quiet skip without matplotlib, and the driver's plot hook. The GPU run
itself is python -m rawkv bench --only gemm --peer (docs/gemm.md)."""
from __future__ import annotations

import sys

import pytest

from rawkv.bench import cli
from rawkv.bench import gemm as _gemm
from rawkv.bench import gemm_peer as gp
from rawkv.bench import gemm_plot as gplot
from rawkv.bench import timing


@pytest.fixture(scope="module")
def bg():
    return _gemm


@pytest.fixture
def bench():
    """The module whose cuda_time_us the group modules call (monkeypatched)."""
    return timing


def test_imports_without_gpu_or_peer(bg):
    assert callable(bg.run) and callable(bg.plot)
    assert bg.MOE["pro"] == (384, 8, {"gate_up": (6144, 7168), "down": (7168, 3072)})
    assert 128 in bg.WO_A_MS and 2048 in bg.WO_A_MS
    assert bg.MOE_TOKENS == (1, 16, 64, 256, 4096)


def test_peer_is_null_when_humming_is_missing(bg, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "humming", None)        # import humming -> ImportError
    assert gp.Humming.load(torch, "cuda") is None
    assert "unavailable" in capsys.readouterr().out
    assert gp.peer_fields(None, {}, {}, {}, 1) == {"peer": None, "peer_us": None}


def _fake_humming(monkeypatch, mxfp4: bool):
    """sys.modules entries for the humming names Humming.__init__ imports
    (humming.schema.mxfp4 only where `mxfp4`)."""
    import types

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m
    dtypes = types.SimpleNamespace(DataType=types.SimpleNamespace(from_torch_dtype=lambda d: "bf16"),
                                   float8e4m3="e4m3", float32="f32")
    module("humming", __version__="0.1.19", dtypes=dtypes, forward=object(), transform=object())
    module("humming.kernel"), module("humming.kernel.humming", HummingKernel=object)
    module("humming.schema", HummingInputSchema=lambda **kw: kw)
    module("humming.schema.modelopt", ModeloptNvfp4WeightSchema=object)
    module("humming.tune", get_heuristics_config=None)
    if mxfp4:
        module("humming.schema.mxfp4", Mxfp4WeightSchema=object)
    else:
        monkeypatch.setitem(sys.modules, "humming.schema.mxfp4", None)      # import -> ImportError


def test_a_humming_without_the_w4a8_schema_still_is_the_w4a16_peer(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    _fake_humming(monkeypatch, mxfp4=False)
    peer = gp.Humming.load(torch, "cuda:0")
    assert peer is not None and peer.name == "humming-kernels 0.1.19" and not peer.has_w4a8
    assert "no W4A8 mode" in capsys.readouterr().out
    _fake_humming(monkeypatch, mxfp4=True)
    peer = gp.Humming.load(torch, "cuda:0")
    assert peer.has_w4a8 and peer.w8_input == {"a_dtype": "e4m3", "input_scale_group_size": 128,
                                              "input_scale_dtype": "f32", "input_quant_mode": "dynamic_group"}


def test_peer_fields_report_the_fastest_mode(bg):
    row = gp.peer_fields("humming-kernels 0.1.19", {"dense": 20.0, "grouped_contiguous": 12.5},
                         {"dense": 0.004, "grouped_contiguous": 0.0031234}, {}, 2 * 10**6)
    assert row["peer"] == "humming-kernels 0.1.19 grouped_contiguous"
    assert row["peer_us"] == 12.5 and row["peer_mode"] == "grouped_contiguous"
    assert row["peer_modes_us"] == {"dense": 20.0, "grouped_contiguous": 12.5}
    assert row["peer_rel_err"] == 0.00312
    assert row["peer_TFLOPs"] == round(2e6 / 12.5 / 1e6, 1)
    assert "peer_error" not in row


def test_peer_fields_without_a_working_mode_have_no_time(bg):
    row = gp.peer_fields("humming-kernels 0.1.19", {}, {"dense": 0.9}, {"dense": "output differs"}, 1)
    assert row["peer_us"] is None and row["peer_rel_err"] == 0.9
    assert "dense: output differs" in row["peer_error"]


def test_a_wrong_peer_output_is_reported_not_timed(bg, bench, monkeypatch):
    torch = pytest.importorskip("torch")
    timed = []
    monkeypatch.setattr(bench, "cuda_time_us", lambda fn, reps, *a, **kw: timed.append(fn) or 7.0)
    ref = torch.arange(1.0, 13.0).reshape(3, 4)
    good, bad = ref.to(torch.bfloat16), ref.flip(1)
    ran = []

    class Peer:
        name = "humming-kernels 0.1.19"
    calls = {"dense": (lambda i: ran.append(("dense", i)), lambda: bad),
             "grouped_contiguous": (lambda i: ran.append(("grouped", i)), lambda: good),
             "indexed": (lambda i: (_ for _ in ()).throw(RuntimeError("no kernel")), lambda: good)}
    best, failed, row = gp.timed_row({"rawkv": lambda: 5.0}, Peer(), lambda: calls, ref, reps=10, flops=96)
    assert ran == [("dense", 0), ("grouped", 0)]              # each ran once before any timing
    assert len(timed) == gp.ROUNDS                              # only the matching mode was timed
    assert best == {"rawkv": 5.0, "peer grouped_contiguous": 7.0} and failed == {}
    assert row["peer_mode"] == "grouped_contiguous" and row["peer_us"] == 7.0
    assert row["peer_rel_err"] < 1e-2
    assert "dense: output differs" in row["peer_error"] and "indexed: RuntimeError: no kernel" in row["peer_error"]


def test_a_peer_that_cannot_set_up_costs_its_rows_not_the_run(bg, bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "cuda_time_us", lambda fn, reps, *a, **kw: pytest.fail("nothing may be timed"))

    class Peer:
        name = "humming-kernels 0.1.19"
    hw, why = gp.peer_build(Peer(), lambda: 1 / 0)
    assert hw is None and why.startswith("ZeroDivisionError")
    best, failed, row = gp.timed_row({"rawkv": lambda: 5.0}, Peer(),
                                      lambda: bg._moe_calls(Peer(), None, hw, None, 8, None, 4, why), None, 10, 1)
    assert best == {"rawkv": 5.0}
    assert row["peer_us"] is None and "setup: RuntimeError: no weights (ZeroDivisionError" in row["peer_error"]
    assert "peer weights failed" in capsys.readouterr().out
    assert gp.peer_build(None, lambda: 1 / 0) == (None, None)      # no peer: nothing built


def test_best_of_alternates_and_keeps_each_fastest(bg):
    order = []
    times = {"rawkv": iter([9.0, 7.0]), "baseline": iter([5.0, 6.0]), "peer dense": iter([8.0, 8.5])}

    def timer(name):
        def run():
            order.append(name)
            return next(times[name])
        return run
    best, failed = gp.best_of({name: timer(name) for name in times}, rounds=2)
    assert order == ["rawkv", "baseline", "peer dense"] * 2       # one of each in turn, not all of one first
    assert best == {"rawkv": 7.0, "baseline": 5.0, "peer dense": 8.0} and failed == {}


def test_best_of_reports_a_failing_timer_and_skips_it_after(bg, capsys):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no kernel image")
    best, failed = gp.best_of({"rawkv": lambda: 3.0, "peer indexed": broken}, rounds=3)
    assert best == {"rawkv": 3.0}
    assert failed == {"peer indexed": "RuntimeError: no kernel image"} and len(calls) == 1
    assert "peer indexed failed" in capsys.readouterr().out


def test_a_failing_rawkv_timing_fails_the_row(bg):
    with pytest.raises(RuntimeError, match="rawkv's timing failed: ZeroDivisionError"):
        gp.timed_row({"rawkv": lambda: 1 / 0}, None, None, None, 10, 1)


def test_peer_timing_failures_are_the_rows_notes(bg):
    class Peer:
        name = "humming-kernels 0.1.19"
    row = gp.peer_row_fields(Peer(), {"rawkv": 4.0, "peer dense": 6.0}, {"peer indexed": "RuntimeError: launch"},
                       {"dense": 0.001, "indexed": 0.001}, {}, 12 * 10**6)
    assert row["peer_us"] == 6.0 and row["peer_modes_us"] == {"dense": 6.0}
    assert row["peer_error"] == "indexed: RuntimeError: launch"
    assert gp.peer_row_fields(None, {}, {}, {}, {}, 1) == {"peer": None, "peer_us": None}


def test_the_peers_w4a8_mode_is_timed_in_the_same_alternation(bg, bench, monkeypatch):
    torch = pytest.importorskip("torch")
    times = iter([6.0, 5.0])                             # w4a8 dense, twice (grouped is wrong)
    monkeypatch.setattr(bench, "cuda_time_us", lambda fn, reps, *a, **kw: next(times))
    ref = torch.arange(1.0, 13.0).reshape(3, 4)
    order = []

    class Peer:
        name = "humming-kernels 0.1.19"
    calls8 = {"dense": (lambda i: order.append("w8 dense"), lambda: ref),
              "grouped_contiguous": (lambda i: order.append("w8 grouped"), lambda: ref.flip(1))}
    best, failed, row = gp.timed_row({"rawkv": lambda: order.append("rawkv") or 4.0}, Peer(),
                                      lambda: {}, ref, 10, 96, w4a8=(lambda: calls8, ref))
    assert order == ["w8 dense", "w8 grouped", "rawkv", "rawkv"]   # each checked once; then timed in turn
    assert best == {"rawkv": 4.0, "peer8 dense": 5.0} and failed == {}
    assert row["w4a8_peer"] == "humming-kernels 0.1.19 dense" and row["w4a8_peer_us"] == 5.0
    assert row["w4a8_peer_rel_err"] == 0.0 and "grouped_contiguous: output differs" in row["w4a8_peer_error"]
    assert row["peer_us"] is None                            # the W4A16 peer had no mode
    assert "w4a8_peer_us" not in gp.timed_row({"rawkv": lambda: 4.0}, None, None, None, 10, 1)[2]


def test_mxfp4_values_are_the_loaders_dequantization(bg):
    torch = pytest.importorskip("torch")
    import rawkv
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (2, 3, 32), dtype=torch.uint8, generator=gen)
    scales = torch.randint(gp.W4A8_SCALE_LO, gp.W4A8_SCALE_HI, (2, 3, 2), dtype=torch.uint8, generator=gen)
    want = rawkv.gemm.Fp4Weight.from_mxfp4(codes, scales, groups=2).dequantize()
    assert torch.equal(gp.mxfp4_values(torch, codes, scales), want)


def test_w4a8_reference_is_the_product_of_the_dequantized_operands(bg):
    torch = pytest.importorskip("torch")
    import numpy as np
    import rawkv
    from rawkv.reference import fp8_blocks
    gen = torch.Generator().manual_seed(6)
    codes, scales = gp.mxfp4_checkpoint(torch, 2, 5, 256, "cpu")
    x = torch.randn(3, 2, 256, generator=gen).to(torch.bfloat16)
    got = gp.w4a8_reference(torch, rawkv, x, gp.mxfp4_values(torch, codes, scales))
    q, sc = fp8_blocks.quantize_blocks(x.float().numpy(), 128)
    xa = fp8_blocks.dequantize_blocks(q, sc, 128).astype(np.float64)
    w = gp.mxfp4_values(torch, codes, scales).double().numpy()
    # float32 sums of K = 256 products: within K 2^-24 of the products' absolute sum (a fixed
    # relative tolerance failed on outputs that cancel, with the codes drawn fresh each run)
    bound = 256 * 2.0 ** -24 * np.einsum("mgk,gnk->mgn", np.abs(xa), np.abs(w))
    assert (np.abs(got.numpy() - np.einsum("mgk,gnk->mgn", xa, w)) <= bound).all()
    assert ((scales >= gp.W4A8_SCALE_LO) & (scales < gp.W4A8_SCALE_HI)).all() and codes.shape == (2, 5, 128)


def test_w4a8_fields_from_a_time_or_a_failure(bg):
    assert bg._w4a8_fields(5.0, 10.0, 10**7) == {"w4a8_us": 5.0, "w4a8_TFLOPs": 2.0, "w4a8_speedup": 2.0}
    assert bg._w4a8_fields("ValueError: weight", 10.0, 1) == {"w4a8_us": "unavailable: ValueError: weight"}


def test_rel_err(bg):
    torch = pytest.importorskip("torch")
    ref = torch.tensor([3.0, 4.0])
    assert gp.rel_err(ref, ref) == 0.0
    assert gp.rel_err(torch.tensor([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert gp.rel_err(torch.tensor([1.0, 0.0]), torch.zeros(2)) == 1.0
    assert not gp.rel_err(torch.tensor([float("nan"), 0.0]), ref) <= gp.PEER_TOL


def test_indexed_layout_pads_each_expert_to_the_block(bg):
    torch = pytest.importorskip("torch")
    offsets = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)   # experts of 3, 0, 5, 1 rows
    ids, experts, padded = gp.indexed_layout(torch, offsets, 4)
    assert ids.tolist() == [0, 1, 2, 9, 3, 4, 5, 6, 7, 9, 9, 9, 8, 9, 9, 9]
    assert experts.tolist() == [0, 2, 2, 3]
    assert ids.dtype == experts.dtype == padded.dtype == torch.int32
    assert padded.dim() == 0 and int(padded) == ids.numel()


def test_interval_is_the_launchers_choice(bg):
    ivs = [[0, 8, "a"], [8, 64, "b"], [64, 1 << 30, "c"]]
    assert [gp.interval(ivs, r)[2] for r in (1, 8, 9, 64, 65)] == ["a", "a", "b", "b", "c"]
    with pytest.raises(ValueError, match="rows"):
        gp.interval(ivs[:2], 65)


def test_picked_intervals_hold_the_rows_and_start_at_zero(bg):
    ivs = [[0, 8, {"b": 8}], [8, 64, {"b": 16}], [64, 512, {"b": 64}], [512, 1 << 30, {"b": 128}]]
    picked = gp.pick_intervals(ivs, [100, 4096, 65, 2048])
    # one row in the launcher's lookup (lo < rows <= hi) for each M, the same config the full list gives,
    # and the first interval reaching down to one row (the launcher looks that up first)
    assert picked == [[0, 512, {"b": 64}], [512, 1 << 30, {"b": 128}]]
    for rows in (1, 65, 100, 2048, 4096):
        assert gp.interval(picked, rows) is not None
    for rows in (65, 100, 2048, 4096):
        assert gp.interval(picked, rows)[2] == gp.interval(ivs, rows)[2]
    picked[0][2]["b"] = 0
    assert ivs[2][2] == {"b": 64}                                 # copies: humming's cached list untouched


def _row(op, shape, us, peer_us=None, base=None, floor=1.0, model=None):
    r = {"op": op, "shape": shape, "us": us, "peer_us": peer_us, "baseline_us": base, "floor_us": floor}
    if model:
        r["model"] = model
    return r


def test_plot_series_groups_rows_by_shape_sorted_by_m(bg):
    rows = [_row("grouped_linear/wo_a-flash", [64, 8, 4096, 1024], 27.0, 30.0, 28.0, 8.0, "DeepSeek-V4-Flash"),
            _row("grouped_linear/wo_a-flash", [1, 8, 4096, 1024], 11.0, None, 25.0, 6.0, "DeepSeek-V4-Flash"),
            {"op": "gemm/error", "error": "x"},
            _row("moe_linear/down", [16, 384, 8, 3072, 7168], 90.0, 80.0, None, 50.0, "DeepSeek-V4-Pro")]
    rows[0]["w4a8_us"] = 22.0
    rows[0]["w4a8_peer_us"] = 19.5
    rows[1]["w4a8_us"] = "unavailable: ValueError: ..."      # reported, not drawn
    s = gplot.plot_series(rows)
    assert list(s) == ["wo_a DeepSeek-V4-Flash (G 8, K 4096, N 1024)",
                       "MoE down DeepSeek-V4-Pro (384 experts top-8, K 3072, N 7168)"]
    wo = s["wo_a DeepSeek-V4-Flash (G 8, K 4096, N 1024)"]
    assert wo == {"x": [1, 64], "rawkv": [11.0, 27.0], "rawkv W4A8": [None, 22.0], "humming": [None, 30.0],
                  "humming W4A8": [None, 19.5], "torch BF16": [25.0, 28.0], "floor": [6.0, 8.0]}


def test_plot_skips_quietly_without_matplotlib(bg, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "x-gemm.png"
    assert bg.plot([_row("grouped_linear/wo_a-pro", [1, 16, 4096, 1024], 18.0)], str(path)) is None
    assert not path.exists()


def test_plot_draws_a_png(bg, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x-gemm.png"
    rows = [_row("grouped_linear/wo_a-pro", [m, 16, 4096, 1024], 10.0 * m, 9.0 * m, 20.0 * m, m) for m in (1, 64)]
    assert bg.plot(rows, str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_writes_a_groups_plot_beside_its_json(tmp_path, capsys, monkeypatch):
    calls = []

    class WithPlot:
        @staticmethod
        def plot(results, path):
            calls.append((results, path))
            return path

    class Broken:
        @staticmethod
        def plot(results, path):
            raise RuntimeError("no axes")
    json_path = str(tmp_path / "2026-01-01-h100-gemm.json")
    assert cli.write_plot(WithPlot, [1], json_path) == str(tmp_path / "2026-01-01-h100-gemm.png")
    assert calls == [([1], str(tmp_path / "2026-01-01-h100-gemm.png"))]
    assert cli.write_plot(Broken, [1], json_path) is None
    assert "plot failed: RuntimeError: no axes" in capsys.readouterr().out
    # a group without plot() (or whose import failed) gets the generic bars
    generic = []
    monkeypatch.setattr(cli, "bars", lambda results, path: generic.append(path) or path)
    assert cli.write_plot(object(), [1], json_path) == str(tmp_path / "2026-01-01-h100-gemm.png")
    assert cli.write_plot(None, [1], json_path) == str(tmp_path / "2026-01-01-h100-gemm.png")
    assert len(generic) == 2


def test_the_peer_is_loaded_only_when_asked_for(bg, monkeypatch):
    """--peer (run(..., peers=True)) loads humming; without it nothing of the
    peer is touched and every row gets peer: null."""
    loads, seen = [], []
    monkeypatch.setattr(gp.Humming, "load", classmethod(lambda cls, torch, dev: loads.append(dev)))
    monkeypatch.setitem(timing.COPY, "GBps", 1.0)
    monkeypatch.setattr(bg, "_wo_a", lambda rt, results, peer, quick, reps, copy: seen.append(peer))
    monkeypatch.setattr(bg, "_moe", lambda rt, results, peer, quick, reps, copy: seen.append(peer))
    pytest.importorskip("torch")
    bg.run(None, [], quick=True)
    assert loads == [] and seen == [None, None]
    bg.run(None, [], quick=True, peers=True)
    assert loads == ["cuda"] and seen[2:] == [None, None]       # load found no humming: None
    assert bg.PEERS == ("humming-kernels",)


def test_the_floor_is_taken_at_the_copy_bandwidth_the_file_records(bg, monkeypatch):
    """The rows' floor_us and frac_of_copy use the run's copy bandwidth
    (timing.COPY, which the driver measures once and writes as the JSON's
    copy_GBps), not a second measurement of the group's own: the committed
    GEMM files' rows were taken at a copy 0.2-1.9% below their copy_GBps."""
    pytest.importorskip("torch")
    seen = []
    monkeypatch.setitem(timing.COPY, "GBps", 4173.2)
    monkeypatch.setattr(timing, "copy_bandwidth_GBps", lambda nbytes=1 << 30: 4155.5)
    monkeypatch.setattr(bg, "_wo_a", lambda rt, results, peer, quick, reps, copy: seen.append(copy))
    monkeypatch.setattr(bg, "_moe", lambda rt, results, peer, quick, reps, copy: seen.append(copy))
    bg.run(None, [], quick=True)
    assert seen == [4173.2, 4173.2]


def test_moe_rows_rotate_weights_whose_token_experts_fit_in_l2(bg):
    # H100: 50 MiB of L2. One token of DeepSeek-V4-Flash reads 6 experts: 57 MB
    # (gate_up) or 28 MB (down), within 4 x L2, so the rows rotate copies
    # (3 of gate_up's 2.4 GB fit MOE_SET_BYTES, 4 of down's); Pro's 8 experts
    # are 198 MB / 99 MB, but one copy of its 9.5 / 4.8 GB weights is all
    # that fits.
    l2 = 50 << 20
    experts, top_k, layers = bg.MOE["flash"]
    assert bg.moe_sets(experts, top_k, *layers["gate_up"], l2) == 3
    assert bg.moe_sets(experts, top_k, *layers["down"], l2) == 4
    experts, top_k, layers = bg.MOE["pro"]
    assert bg.moe_sets(experts, top_k, *layers["gate_up"], l2) == 1
    assert bg.moe_sets(experts, top_k, *layers["down"], l2) == 1
    assert bg.moe_sets(256, 6, 4096, 4096, 1 << 40) == 3          # capped by MOE_SET_BYTES, not by L2
    assert bg.moe_sets(8, 1, 64, 64, 50 << 20) == bg.MOE_MAX_SETS   # tiny experts: the cap


def test_the_weight_read_kernel_compiles_without_a_gpu(bg):
    """The wo_a rows' read_us kernel (READ_SRC), compiled by NVRTC for the
    H100 as CuPy would: a source error would only show on the GPU run."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")
    from rawkv import _nvrtc
    res = _nvrtc.compile_cu(bg.READ_SRC, "rkv_bench_read.cu", "sm_90", ["rkv_bench_read"])
    assert res.cubin and "rkv_bench_read" in res.lowered


def test_read_weight_us_rotates_buffers_and_keeps_the_faster_grid(bg, monkeypatch):
    """read_weight_us times each READ_GRIDS grid through the given timer over
    `sets` rotated buffers of whole 16-byte words and returns the least time."""
    torch = pytest.importorskip("torch")
    launches = []

    class FakeKernel:
        def __init__(self, src, name):
            assert name == "rkv_bench_read"

        def __call__(self, grid, block, args, stream=None):
            launches.append((grid[0], block[0], args[0], args[1]))

    class FakeCupy:
        RawKernel = FakeKernel

        class cuda:
            @staticmethod
            def ExternalStream(ptr):
                return ptr

    made = []
    real_randint = torch.randint

    def randint(lo, hi, size, dtype=None, device=None):
        t = real_randint(lo, hi, size, dtype=dtype)
        made.append(t)
        return t

    class FakeCurrent:
        cuda_stream = 0
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy)
    monkeypatch.setattr(torch, "randint", randint)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.empty(1, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: FakeCurrent)
    times = iter([7.5, 7.25])

    def time_us(fn):
        for i in range(3):
            fn(i)
        return next(times)
    us = bg.read_weight_us(torch, 1000, 2, 132, time_us)
    assert us == 7.25
    assert [t.numel() for t in made] == [992, 992]          # whole 16-byte words, one buffer per set
    assert [(g, b) for g, b, _, _ in launches] == [(4 * 132, 512)] * 3 + [(16 * 132, 256)] * 3
    assert [p for _, _, p, _ in launches[:3]] == [made[0].data_ptr(), made[1].data_ptr(), made[0].data_ptr()]
    assert {n for _, _, _, n in launches} == {62}


def test_a_timing_that_fell_back_to_eager_calls_is_named_in_the_row(bg, monkeypatch):
    """A timing whose calls could not be captured in a CUDA graph is timed
    eagerly (host time between launches counted: timing.cuda_time_us); the
    row names it (eager_timings) instead of passing it off as a graph
    replay beside the others."""
    monkeypatch.setattr(timing, "EAGER", [])

    def eager_baseline():
        timing.EAGER.append("RuntimeError: not capturable")
        return 9.0
    best, failed, row = gp.timed_row({"rawkv": lambda: 5.0, "baseline": eager_baseline}, None, None, None, 10, 1)
    assert best == {"rawkv": 5.0, "baseline": 9.0}
    assert row["eager_timings"] == ["baseline"]
    assert "eager_timings" not in gp.timed_row({"rawkv": lambda: 5.0}, None, None, None, 10, 1)[2]
