"""tools/ab_gemm.py, the A/B timing of two source trees' GEMM kernels: its
row selection, its summary (ratio of the fastest timings, whether every
output's bytes agree) and its driver (a git worktree of the base revision,
rounds of base then new, the worktree removed afterwards). The timings
themselves need a GPU; here the workers are replaced by fixed results."""
import pathlib
import subprocess

import pytest

from support.tools import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    return load_tool("ab_gemm")


def test_rows_are_named_sets_in_order_once():
    ab = _tool()
    assert ab.parse_rows("moe, wo_a,moe") == ("moe", "wo_a")
    assert ab.parse_rows("w4a8") == ("w4a8",)
    assert ab.parse_rows("decode,moe") == ("decode", "moe")
    assert ab.parse_rows("w4a8dec,fp8") == ("w4a8dec", "fp8")
    assert ab.parse_rows("fused, fp8") == ("fused", "fp8")
    for bad in ("", "moe,dense", " , "):
        with pytest.raises(ValueError, match="--rows"):
            ab.parse_rows(bad)


def test_digest_covers_every_tensor_of_a_result():
    """An FP8 producer's result is a tuple (codes, scales[, inv_rms]): its
    digest changes with any of them and skips a None entry."""
    torch = pytest.importorskip("torch")
    ab = _tool()
    codes, scales = torch.arange(8, dtype=torch.uint8), torch.ones(2)
    d = ab._digest(torch, (codes, scales, None))
    assert d == ab._digest(torch, (codes, scales)) != ab._digest(torch, codes)
    assert d != ab._digest(torch, (codes, scales * 2)) and d != ab._digest(torch, (codes + 1, scales))
    gs = torch.tensor(2.0)                                          # NVFP4 tensor scope: a 0-dim gs
    assert ab._digest(torch, (codes, gs)) != ab._digest(torch, (codes, gs * 2))


def test_summary_compares_fastest_and_bytes():
    ab = _tool()
    base = [{"a": (10.0, "h1"), "b": (5.0, "h2")}, {"a": (11.0, "h1"), "b": (5.5, "h2")}]
    new = [{"a": (9.5, "h1"), "b": (6.0, "hX"), "c": (1.0, "h3")}, {"a": (9.0, "h1"), "b": (5.0, "h2")}]
    lines = {ln.split()[0]: ln for ln in ab.summary(base, new)[1:]}
    assert lines["a"].split()[-2:] == ["0.900", "same"]          # 9.0 / 10.0
    assert lines["b"].split()[-2:] == ["1.000", "DIFFER"]        # one new round gave other bytes
    assert lines["c"].split()[-2:] == ["-", "same"]              # no base timing to compare with
    assert "10.0 11.0" in lines["a"] and "9.5 9.0" in lines["a"]


def test_driver_runs_rounds_on_a_worktree_and_removes_it(monkeypatch, capsys):
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    ab = _tool()
    calls = []

    def fake_run(src, rows):
        calls.append((src, rows))
        assert pathlib.Path(src, "rawkv", "__init__.py").is_file()     # the tree's package is there
        return {"row": (2.0 if str(ROOT / "src") == src else 4.0, "h")}

    monkeypatch.setattr(ab, "_run_tree", fake_run)
    assert ab.main(["--base", head, "--rounds", "2", "--rows", "moe"]) == 0
    assert [c[0] == str(ROOT / "src") for c in calls] == [False, True, False, True]   # base, then new, twice
    assert all(c[1] == ("moe",) for c in calls)
    out = capsys.readouterr().out
    assert "0.500" in out and "same" in out
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert calls[0][0].rsplit("/src", 1)[0] not in listed


def test_driver_needs_a_base_and_rounds():
    ab = _tool()
    with pytest.raises(SystemExit):
        ab.main(["--rows", "moe"])
    with pytest.raises(SystemExit):
        ab.main(["--base", "HEAD", "--rounds", "0"])
    with pytest.raises(SystemExit):
        ab.main(["--base", "HEAD", "--rows", "dense"])


def test_driver_takes_a_base_source_directory(monkeypatch, capsys, tmp_path):
    # --base-src: the base tree's src/ from a directory (git archive), for a
    # machine whose copy of the history is not the tree's (the device's)
    ab = _tool()
    (tmp_path / "src" / "rawkv").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(ab, "_run_tree", lambda src, rows: calls.append(src) or {"row": (3.0, "h")})
    assert ab.main(["--base-src", str(tmp_path), "--rounds", "1", "--rows", "w4a8"]) == 0
    assert calls == [str(tmp_path / "src"), str(ROOT / "src")]
    assert "1.000" in capsys.readouterr().out
    with pytest.raises(SystemExit):                                  # not both
        ab.main(["--base-src", str(tmp_path), "--base", "HEAD"])
    with pytest.raises(SystemExit):                                  # a directory without the package
        ab.main(["--base-src", str(tmp_path / "src")])


@pytest.mark.parametrize("l2", [50 << 20, 60 << 20])
def test_moe_rows_rotate_weight_copies_as_the_benchmark(l2):
    """The MoE rows rotate weight copies by the benchmark's rule
    (rawkv.bench.gemm.moe_sets): one copy of DeepSeek-V4-Flash's down
    weights, six experts of 4.7 MB at one token, stayed in L2 between calls
    (the A/B's decode rows timed L2 reads where the benchmark times DRAM)."""
    from rawkv.bench import gemm
    ab = _tool()
    for experts, top_k, layers in gemm.MOE.values():
        for n, k in layers.values():
            assert ab.moe_copies(experts, top_k, n, k, l2) == gemm.moe_sets(experts, top_k, n, k, l2)
    experts, top_k, layers = gemm.MOE[ab.MOE_MODEL]
    n, k = layers["down"]
    per_token = top_k * (n * k // 2 + n * k // 16)
    assert per_token < l2 and ab.moe_copies(experts, top_k, n, k, l2) * per_token > l2
