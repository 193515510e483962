"""python -m rawkv demo: one DeepSeek-V4-Flash-shaped decoder layer's decode
step on rawkv against plain torch. On CPU the tiny size runs end to end
(rawkv ops: the numpy reference; baseline: float64 torch); its torch
compressor equals the reference's; the eager warm-up before capture leaves
the state as it found it; arguments and sizes are refused before anything
is allocated. The kernel instances a GPU run warms up are valid for the
device and come from the families' plans; a GPU run holds them against its
launches. On a GPU: the real shapes, captured."""
from __future__ import annotations

import argparse
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rawkv.demo_layer as L  # noqa: E402
from rawkv import runtime  # noqa: E402
from rawkv.__main__ import main  # noqa: E402
from rawkv._plan import Device  # noqa: E402
from rawkv.reference import kvcache as ref  # noqa: E402


def _num(line: str, what: str) -> float:
    return float(re.search(what + r" ([0-9.]+)", line).group(1))


@pytest.mark.parametrize("layer", [[], ["--layer"]])       # the default; --layer kept for older command lines
def test_layer_cpu_end_to_end(layer, capsys):
    assert main(["demo", *layer, "--cpu", "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert lines[0].startswith("rawkv demo: CPU MODE (the numpy reference at the tiny size")
    assert lines[0].endswith(": --cpu given")
    assert lines[1].startswith("config: tiny shapes: hidden 256") and "batch 2, context 300 tokens, 1 steps" in lines[1]
    assert lines[2].startswith("step: RMSNorm + NVFP4 quantize") and \
        "attention: torch SDPA over the gathered entries (not a rawkv kernel)" in lines[2]
    assert lines[3].startswith("baseline: the same step in plain torch, float64")
    assert re.match(r"bytes read per step \(weights \+ KV rows, activations not counted\): rawkv [0-9.]+ MiB, "
                    r"BF16 [0-9.]+ MiB \([0-9.]+x\)$", lines[4])
    rows = lines[5]
    assert rows.startswith("KV rows attended vs the float64 step's (cosine per source, the rows the attention "
                           "mask lets through): CSA top-k min ") and f"(ok: each mean >= {L.ROWS_FLOOR})" in rows
    # the FP8 entries of the prompt, and (step 0) one window row from the FP4 projection
    for name in ("CSA top-k", "HCA", "window"):
        assert _num(rows, f"{name} min") >= 0.99 and _num(rows, f"{name} min [0-9.]+ mean") >= 0.99, (name, rows)
    acc = lines[6]
    assert acc.startswith("accuracy vs the float64 step: cosine of the layer output") and "(ok: mean >=" in acc
    # the layer's output, and its update (without the residual), against float64: FP4 weights and
    # activations, the FP8 cache, and (seed 0, step 0) no routing difference (where a token's
    # routing differs, its update takes another expert: 0.84 at step 1)
    assert _num(acc, "layer output min") >= 0.96
    assert _num(acc, r"\(output - input\) min") >= 0.95
    assert "routing: 0 of 4 expert choices differ" in acc
    assert re.match(r"time: rawkv [0-9.]+ us per step, float64 [0-9.]+ us per step \(wall clock", lines[7])
    assert lines[7].endswith("skipped rows 0 (counted by the numpy reference ops)")
    assert len(lines) == 8
    # progress lines on stderr, one per phase that can take a second
    assert err and all(ln.startswith("  ... ") for ln in err.rstrip().splitlines())
    assert any("prefill" in ln for ln in err.splitlines()) and any("running 1 steps" in ln for ln in err.splitlines())


#: each source's gather in the rawkv step (rawkv.kvcache's, looked up at each call)
GATHERS = {"csa": ("gather_topk", "CSA top-k"), "hca": ("gather_dense_batch", "HCA"),
           "win": ("model1_gather", "window")}


@pytest.mark.parametrize("source", list(GATHERS))
def test_layer_cpu_fails_a_broken_source(source, monkeypatch, capsys):
    """A source's gathered rows replaced by noise (the gather of that source
    broken, the others as they are) fail the run: its line says BELOW for
    that source alone and the exit status is 1. HCA's 2 rows of the 34
    attended at the CPU size leave the update's cosine above its floor:
    only the per-source check sees them."""
    import rawkv.kvcache as K
    fn, name = GATHERS[source]
    gather, g = getattr(K, fn), torch.Generator().manual_seed(1)

    def noise(*args, **kw):
        out = gather(*args, **kw)
        return out.copy_(torch.randn(out.shape, generator=g).to(out.dtype))

    monkeypatch.setattr(K, fn, noise)
    assert main(["demo", "--cpu", "--steps", "2"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    rows = next(ln for ln in lines if ln.startswith("KV rows attended"))
    assert f"(BELOW: {name}; each mean must be >= {L.ROWS_FLOOR})" in rows, rows
    for _, label in GATHERS.values():
        mean = float(re.search(label + r" min -?[0-9.]+ mean (-?[0-9.]+)", rows).group(1))
        assert (abs(mean) < 0.1) if label == name else (mean >= 0.99), (label, rows)
    if source == "hca":
        assert "(ok: mean >=" in next(ln for ln in lines if ln.startswith("accuracy vs"))


def test_rows_line():
    """Each source's min and mean over the steps; a source the mask never
    let through has no rows (and nothing to fail); NaN is below."""
    ok, line = L.rows_line("BF16", 3, {"csa": [0.99, 0.97, 0.98], "hca": [], "win": [0.999]})
    assert ok and line == ("KV rows attended vs the BF16 step's (cosine per source, the rows the attention mask "
                           "lets through): CSA top-k min 0.970000 mean 0.980000, HCA no rows, window min 0.999000 "
                           f"mean 0.999000 (1 of 3 steps) (ok: each mean >= {L.ROWS_FLOOR}) over 3 steps")
    ok, line = L.rows_line("BF16", 1, {"csa": [0.2], "hca": [float("nan")], "win": [0.99]})
    assert not ok and f"(BELOW: CSA top-k, HCA; each mean must be >= {L.ROWS_FLOOR})" in line


@pytest.mark.parametrize("context, steps, masked", [(5, 2, {"csa", "win"}), (250, 10, {"hca"})])
def test_rows_cos_reads_only_the_rows_the_mask_lets_through(context, steps, masked):
    """rows_cos compares rawkv's rows with the baseline's of the same source
    over the mask's rows only: what is outside it (invalid CSA ids, HCA
    entries not written yet, window slots not filled: `masked`, the sources
    with such rows at this context) does not count."""
    d = _demo(context=context, steps=steps)
    d.prepare(0)
    d.step_rawkv()
    d.step_base()
    healthy = L.rows_cos(torch, d)
    assert all(c is None or c > 0.99 for c in healthy.values()), healthy
    m, s, at, seen = d.mask.view(d.B, -1), d.shape, 0, set()
    for k, n in (("csa", s.topk), ("hca", d.k_hca), ("win", s.window)):
        off = ~m[:, at: at + n]
        at += n
        if off.any() and m[:, at - n: at].any():
            seen.add(k)
            d.rows_rawkv[k][off] = 1e3
    assert seen == masked
    assert L.rows_cos(torch, d) == healthy


def _args(**kw):
    a = dict(seed=0, layout="model1", steps=None, batch=None, context=None)
    a.update(kw)
    return argparse.Namespace(**a)


def _demo(context=40, steps=8):
    d = L.LayerDemo(_args(), L.TINY, 2, context, steps, False, lambda m: None)
    d.prefill()
    return d


def test_warm_run_undoes_its_writes():
    """The eager run before capture restores every tensor a step writes:
    the step after it gives the bits of a demo that had no warm-up."""
    # step 0 at position 43 completes a CSA window, step 4 the next: a state left
    # as the warm-up leaves it pools the wrong rows into an entry the steps gather
    a, b = _demo(context=43), _demo(context=43)
    a.prepare(0)
    L.warm_run(a)
    for t in range(5):
        a.prepare(t)
        b.prepare(t)
        assert torch.equal(a.step_rawkv(), b.step_rawkv())
        assert torch.equal(a.step_base(), b.step_base())


@pytest.mark.parametrize("kind, d, hadamard", [("csa", ref.HEAD_DIM, False), ("hca", ref.HEAD_DIM, False),
                                               ("csa", ref.INDEX_HEAD_DIM, True)])
def test_torch_compressor_is_the_reference(kind, d, hadamard):
    """The baseline's compressor (torch, float64), seeded after a prompt and
    stepped through the next tokens, writes the entries the reference
    computes from the whole sequence (the reference rounds them to BF16)."""
    rng = np.random.default_rng(7)
    print("seed 7")
    m = ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO
    w = 2 * d if kind == "csa" else d
    prompt, steps = 2 * m + 1, 2 * m + 3
    T = prompt + steps
    kv, z = (rng.standard_normal((T, w)).astype(np.float32) for _ in range(2))
    ape = (0.5 * rng.standard_normal((m, w))).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    n = T // m
    cache = torch.zeros(1, n + 1, d, dtype=torch.float64)
    comp = L.TorchCompressor(torch, kind, ape, nw, [L._seeded(kind, d, kv[:prompt], z[:prompt], ape)], cache,
                             hadamard=hadamard)
    for t in range(prompt, T):
        comp.step(torch.from_numpy(kv[t:t + 1]).double(), torch.from_numpy(z[t:t + 1]).double(),
                  torch.tensor([t]))
    if hadamard:      # the indexer: rows are its kv, z; keys are the third result
        _, _, want = ref.reference_prefill("csa", np.zeros((T, 2 * ref.HEAD_DIM), np.float32),
                                           np.zeros((T, 2 * ref.HEAD_DIM), np.float32), None,
                                           np.ones(ref.HEAD_DIM, np.float32), index=(kv, z, ape, nw))
    else:
        _, want, _ = ref.reference_prefill(kind, kv, z, ape, nw)
    first = prompt // m                 # entries the steps wrote
    got = cache[0, first:n].numpy()
    assert got.shape == want[first:n].shape and got.shape[0] >= 1
    np.testing.assert_allclose(got, want[first:n], rtol=1e-2, atol=1e-2)     # BF16 rounding of the reference
    assert not cache[0, :first].any()


def test_sort_rows_and_combine():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1]], dtype=torch.int32)
    order, tok, offsets, expert = L.sort_rows(torch, ids, 5)
    assert expert.tolist() == [0, 0, 1, 2, 3, 3] and offsets.tolist() == [0, 2, 3, 4, 6, 6]
    assert offsets.dtype == torch.int32 and tok.tolist() == [0, 1, 2, 1, 0, 2]
    rows = torch.arange(6, dtype=torch.float64)[:, None] * torch.ones(1, 2, dtype=torch.float64)
    wts = torch.tensor([[1.0, 10.0], [100.0, 1000.0], [1e4, 1e5]])
    y = L.combine(torch, rows[torch.argsort(order)][order], order, wts, torch.float64)
    # the row of choice (b, j) is the sorted position of flat index 2b + j
    pos = torch.argsort(order).double()
    want = (pos.view(3, 2) * wts.double()).sum(1)
    assert torch.equal(y[:, 0], want)


@pytest.mark.parametrize("argv, bad", [
    (["demo", "--cache", "--batch", "2"], "--batch: not with --cache"),
    (["demo", "--cache", "--context", "64"], "--context: not with --cache"),
    (["demo", "--cache", "--layer"], "--layer: not with --cache"),
    (["demo", "--batch", "0"], "--batch"),
    (["demo", "--batch", f"{L.MAX_BATCH + 1}"], "--batch"),
    (["demo", "--context", "0"], "--context"),
    (["demo", "--context", "many"], "--context"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--small"], "--small: only with --cache"),
    (["demo", "--layer", "--small"], "--small: only with --cache"),
    (["demo", "--index-layout", "mxfp4"], "--index-layout: only with --cache"),
    (["demo", "--layout", "nope"], "--layout"),
])
def test_layer_argument_errors(argv, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and bad in err, err


def test_size_refused_before_allocating(monkeypatch, capsys):
    """A run that cannot fit the host is refused with the sizes and what
    to lower, before any weight, cache or row is made."""
    def never(*a, **k):
        raise AssertionError("allocated before the size check")
    monkeypatch.setattr(L, "LayerDemo", never)
    assert main(["demo", "--cpu", "--batch", "4096", "--context", "1048576"]) == 2
    out, err = capsys.readouterr()
    assert "CPU MODE" in out.splitlines()[0] and len(out.splitlines()) == 1
    assert err.startswith("python -m rawkv demo: error: --batch 4096 --context 1048576 needs about ")
    assert "GiB of host memory" in err and "lower --batch or --context" in err


def test_fit_check_reads_the_device(monkeypatch):
    monkeypatch.setattr(L, "host_available", lambda: 512 * L.GiB)
    dev, host = L.need_bytes(L.FLASH, 8, 4096, 20, True)
    # Flash's weights: 6.6 G parameters, NVFP4 beside the BF16 baseline
    assert 6.5e9 < L.params(L.FLASH) < 6.6e9 and 25 * L.GiB < dev < 60 * L.GiB and host < 2 * L.GiB
    L.check_fits(L.FLASH, 8, 4096, 20, 78 * L.GiB)                     # an H100
    with pytest.raises(MemoryError, match=r"--batch 8 --context 4096 needs about [0-9.]+ GiB of GPU memory"):
        L.check_fits(L.FLASH, 8, 4096, 20, 16 * L.GiB)
    monkeypatch.setattr(L, "host_available", lambda: L.GiB)
    with pytest.raises(MemoryError, match="of host memory"):
        L.check_fits(L.FLASH, 64, 65536, 20, 78 * L.GiB)


@pytest.mark.parametrize("batch", [2, 64])
def test_layer_gpu(cuda, batch, capsys):
    """On a GPU: the Flash shapes, both steps captured, no kernel error, the
    update close to the BF16 step's; the run launched exactly the kernel
    instances kernel_instances() lists (it warmed up those alone)."""
    assert main(["demo", "--batch", str(batch), "--context", "600", "--steps", "3"]) == 0
    out, err = capsys.readouterr()
    assert "kernel_instances() is not what the run launched" not in err, err
    n = len(L.kernel_instances(cuda, L.FLASH, batch, "model1", 600, 3))
    assert f"kernels: the {n} instances this run launches" in err
    lines = out.strip().splitlines()
    assert lines[0] == (f"rawkv demo: GPU {cuda.name} ({cuda.arch}): rawkv kernels, each step one "
                        "CUDA graph replay")
    assert lines[1].startswith("config: DeepSeek-V4-Flash shapes: hidden 4096, 64 heads x 512, wo_a 8 groups "
                               "K 4096 N 1024")
    assert lines[5].startswith("KV rows attended vs the BF16 step's") and "(ok: each mean >=" in lines[5]
    assert all(_num(lines[5], f"{name} min") >= 0.98 for name in ("CSA top-k", "HCA", "window")), lines[5]
    assert "(ok: mean >=" in lines[6] and _num(lines[6], "layer output min") >= 0.9
    assert re.match(r"time: rawkv [0-9.]+ us per step, BF16 [0-9.]+ us per step \(one CUDA graph replay each", lines[7])
    assert lines[7].endswith("kernel errors 0")


def test_engines_doc_shows_the_layer_step():
    """docs/engines.md's layer example is LayerDemo.step_rawkv as it is."""
    import inspect
    import textwrap
    from pathlib import Path
    doc = (Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text()
    blocks = re.findall(r"```py\n(.*?)```", doc, re.S)
    assert blocks == [textwrap.dedent(inspect.getsource(L.LayerDemo.step_rawkv))]


# ---- the kernel instances a GPU run warms up ---------------------------------------------------
H100 = Device(132, 2048, "sm_90")
A100 = Device(108, 2048, "sm_80")


@pytest.mark.parametrize("dev", [H100, A100], ids=["sm_90", "sm_80"])
@pytest.mark.parametrize("layout", ["model1", "rawkv"])
@pytest.mark.parametrize("batch", [1, 8, 64, 512])
def test_kernel_instances_are_declared_for_the_device(dev, layout, batch):
    """Every listed instance is one rawkv declares and builds for the device
    (instances_for refuses any other, naming it), each listed once; a small
    part of everything a full warmup() compiles."""
    got = L.kernel_instances(dev, L.FLASH, batch, layout)
    assert runtime.instances_for(dev.arch, instances=got) == got
    assert len(set(got)) == len(got) and 15 <= len(got) <= 25 < len(runtime.instances_for(dev.arch)) // 5


def test_kernel_instances_at_the_defaults():
    """What a cold start compiles on the H100 at the defaults (batch 8,
    model1): 21 instances, each op's plan for the demo's dtypes: the
    weights' scope-'tensor' quantize (three kernels at the Flash size),
    the compressor (prefill and decode, CSA and HCA), the state ops, the
    gathers of MODEL1 pages, the fused producers and four mma.sync GEMM
    tiles (NVFP4 and BF16 activations at 8 tokens per group, BF16 also in
    the small-grid tile where a projection's grid has fewer than 2 blocks
    per SM, the experts' ragged tile at 48 rows over 256 experts)."""
    got = L.kernel_instances(H100, L.FLASH, 8, "model1")
    files = {}
    for f, _ in got:
        files[f] = files.get(f, 0) + 1
    assert files == {"nvfp4.cu": 3, "kv_compress.cu": 4, "kv_layouts.cu": 2, "fused.cu": 3, "gemm_fp4.cu": 4,
                     "kv_cache.cu": 5}
    assert ("kv_cache.cu", "rkv_kv_gather_pages<__nv_bfloat16, int, false>") in got
    # the rawkv layout gathers with its own kernel; the tiny weights of at most 64K values quantize
    # in one launch (the encode plan's rule), the Flash ones never
    assert ("kv_cache.cu", "rkv_kv_gather<__nv_bfloat16, int, false>") in L.kernel_instances(H100, L.FLASH, 8, "rawkv")
    small = ("nvfp4.cu", "rkv_nvfp4_quantize_small<__nv_bfloat16, 2>")
    assert small in L.kernel_instances(H100, L.TINY, 8, "model1") and small not in got


def test_kernel_instances_follow_the_gemm_plans():
    """The GEMM instances are the plans' own choice: the wgmma kernel on
    sm_90 from enough tokens per group (never on sm_80), mma.sync below;
    the experts' ragged GEMM by the rows per expert (batch x 6 over 256)."""
    from rawkv.gemm import plans as GP
    gemm = lambda ks, f: [k for k in ks if k[0] == f]  # noqa: E731
    sm90, mma = "gemm_fp4_sm90.cu", "gemm_fp4.cu"
    assert gemm(L.kernel_instances(H100, L.FLASH, 8, "model1"), sm90) == []
    assert gemm(L.kernel_instances(A100, L.FLASH, 2048, "model1"), sm90) == []
    for batch in (512, 2048):      # 12 and 48 rows per expert on average
        got = L.kernel_instances(H100, L.FLASH, batch, "model1")
        experts_wgmma = -(-batch * 6 // 256) >= GP.TUNED.SM90_MIN_EXPERT_TOKENS
        assert gemm(got, sm90) and bool(gemm(got, mma)) != experts_wgmma, (batch, got)


def test_kernel_instances_of_a_short_context():
    """A prompt shorter than an entry compresses nothing at prefill, and
    before 128 tokens no HCA entry is gathered: those instances are not
    listed (the run would report them as never launched)."""
    full = L.kernel_instances(H100, L.FLASH, 8, "model1")
    prefill = lambda kind: ("kv_compress.cu", f"rkv_kv_compress<float, int, false, {str(kind == 'csa').lower()}, "  # noqa: E731
                            f"{1 if kind == 'csa' else 4}, 1>")
    dense = ("kv_cache.cu", "rkv_kv_gather_pages<__nv_bfloat16, int, true>")
    assert {prefill("csa"), prefill("hca"), dense} <= set(full)
    short = L.kernel_instances(H100, L.FLASH, 8, "model1", context=100, steps=20)
    assert prefill("csa") in short and prefill("hca") not in short and dense not in short
    assert set(L.kernel_instances(H100, L.FLASH, 8, "model1", context=3, steps=200)) == set(full) - {
        prefill("csa"), prefill("hca")}


def test_instances_note():
    a, b, c = ("f.cu", "k<1>"), ("f.cu", "k<2>"), ("g.cu", "h")
    assert L.instances_note([a, b], {a, b}) is None
    note = L.instances_note([a, b], {a, c, None})
    assert note.startswith("rawkv demo: kernel_instances() is not what the run launched: ")
    assert "1 launched but not listed (compiled at their first launch): g.cu:h" in note
    assert "1 listed but never launched: f.cu:k<2>" in note


def test_instances_for_takes_a_list():
    """warmup(instances=...): exactly those, in order, each once; what is
    not declared, or not built for the architecture, is a KeyError naming
    it, never dropped."""
    from rawkv.kernels import gemm_fp4, kv_cache
    one = kv_cache.ASSIGN_PAGES.instance()
    assert runtime.instances_for("sm_90", instances=[one, one.key]) == [one.key]
    assert runtime.instances_for("sm_90", ["fp8.cu"], [one])[-1] == one.key
    with pytest.raises(KeyError, match="rkv_kv_nope"):
        runtime.instances_for("sm_90", instances=[("kv_cache.cu", "rkv_kv_nope")])
    wg = gemm_fp4.GEMM_SM90.instance(0, False, 64, 6, 256)
    assert runtime.instances_for("sm_90", instances=[wg]) == [wg.key]
    with pytest.raises(KeyError, match="gemm_fp4_sm90.cu is not built for sm_80"):
        runtime.instances_for("sm_80", instances=[wg])


def test_recording_sees_every_launch_and_restores_the_launcher():
    """Runtime.recording wraps the launcher for its block only: each launch
    is recorded by its instance and still made."""
    from types import SimpleNamespace
    made = []
    rt = SimpleNamespace(_launch_call=lambda *args: made.append(args))
    first = rt._launch_call
    inst = SimpleNamespace(key=("f.cu", "k<1>"))
    with runtime.Runtime.recording(rt) as seen:
        rt._launch_call("fn", (1,), (32,), None, (), 0, 0, inst)
        rt._launch_call("fn", (2,), (32,), None, (), 0, 0, inst)
    assert seen == {("f.cu", "k<1>")} and len(made) == 2 and rt._launch_call is first


def test_caches_before_the_first_launch(monkeypatch):
    """`ready` (where a GPU run waits for its kernels) comes after the
    caches' host rows are drawn and before the weights' quantize, the first
    rawkv launch."""
    order = []

    class Weights:
        def __init__(self, *args):
            order.append("weights")
            raise RuntimeError("stop")

    monkeypatch.setattr(L, "Weights", Weights)
    with pytest.raises(RuntimeError, match="stop"):
        L.LayerDemo(_args(), L.TINY, 2, 40, 2, False, lambda m: order.append(m.split(":")[0]),
                    lambda: order.append("ready"))
    assert order == ["caches", "ready", "weights"]


def test_without_torch_the_demo_says_what_to_run(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["demo", "--cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "needs PyTorch" in err and "python -m rawkv demo --cache runs with numpy alone" in err
