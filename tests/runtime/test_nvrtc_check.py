"""The compile-check tool: all kernels, all archs, resource report, failures."""
import io
import os
import random

import pytest

from rawkv import _nvrtc, runtime
from rawkv.kernels import KernelFile, _decl
from rawkv.tools import nvrtc_check


def _needs_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")


def test_reports_resources_for_every_kernel():
    _needs_nvrtc()
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 0, files=["fp8.cu"], out=buf) == 0
    text = buf.getvalue()
    for name in runtime.registered_kernels()["fp8.cu"]:
        assert f"[sm_90] {name}: " in text
    assert " regs, " in text and " B spills" in text and "all ok" in text


@pytest.fixture
def declare():
    """declare(filename, kernel names, constants) registers a fake kernel
    file as a family module does; it is removed again after the test."""
    made = []

    def declare(filename, names, constants=None):
        kf = KernelFile(filename, constants)
        made.append(filename)
        for n in names:
            kf.kernel(n)
        return kf
    yield declare
    for f in made:
        _decl._FILES.pop(f, None)


def test_compile_error_names_file_and_line(tmp_path, monkeypatch, declare):
    _needs_nvrtc()
    (tmp_path / "broken.cu").write_text('#include "common.cuh"\n__global__ void k() {\n  int x = ;\n}\n')
    (tmp_path / "common.cuh").write_text((_nvrtc.CU_DIR / "common.cuh").read_text())
    monkeypatch.setattr(_nvrtc, "CU_DIR", tmp_path)
    declare("broken.cu", ["k"])
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_80",), 0, files=["broken.cu"], out=buf) == 1
    text = buf.getvalue()
    assert "FAIL broken.cu [sm_80]" in text and "broken.cu(3)" in text


def test_files_constants_reach_the_compiler(tmp_path, monkeypatch, declare):
    """A kernel file's constants are -D options of its compile, as in the
    runtime: the source fails to compile without them."""
    _needs_nvrtc()
    # A value of this run in the code: a program NVRTC compiled before (an
    # earlier run's, kept in the CUDA compute cache) would come back with no
    # ptxas report, whatever check() asks of the cache.
    nonce = random.getrandbits(31)
    (tmp_path / "consts.cu").write_text(
        "#ifndef RKV_TEST_N\n#error RKV_TEST_N is not defined\n#endif\n"
        "static_assert(RKV_TEST_N == 24, \"RKV_TEST_N\");\n"
        f'extern "C" __global__ void k(int* p) {{ p[0] = RKV_TEST_N; p[1] = {nonce}; }}\n')
    monkeypatch.setattr(_nvrtc, "CU_DIR", tmp_path)
    declare("consts.cu", ["k"], {"RKV_TEST_N": 24})
    assert runtime.kernel_options("consts.cu") == ("-DRKV_TEST_N=24",)
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 0, files=["consts.cu"], out=buf) == 0, buf.getvalue()
    assert "ok   consts.cu [sm_90] k: " in buf.getvalue()


def test_compiling_leaves_the_shared_one_byte_bytes_intact():
    """NVRTC writes into the log buffer it is given; an empty log is 1 byte,
    and b" " * 1 is CPython's shared b" " object, which it used to overwrite
    with a NUL for the whole process."""
    _needs_nvrtc()
    source = (_nvrtc.CU_DIR / "fp8.cu").read_text()
    res = _nvrtc.compile_cu(source, "fp8.cu", "sm_90", ["rkv_e4m3_encode<float, true>"])
    assert res.cubin[:4] == b"\x7fELF"
    assert b" " == bytes([32]) and list(b" ") == [32]
    assert b"a b".split(b" ") == [b"a", b"b"]


# ---- the pass/fail decisions, on a fake compiler (no NVRTC needed) -----------------
K1 = "_Z2k1v"
PTXAS_K1_SPILLS = (
    f"ptxas info    : Compiling entry function '{K1}' for 'sm_90'\n"
    f"ptxas info    : Function properties for {K1}\n"
    "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
    "ptxas info    : Used 255 registers, 1024 bytes smem, 380 bytes cmem[0]\n")
PTXAS_K2_CLEAN = (
    "ptxas info    : Compiling entry function '_Z2k2v' for 'sm_90'\n"
    "ptxas info    : Function properties for _Z2k2v\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 20 registers, 380 bytes cmem[0]\n")


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch, declare):
    """fake.cu with kernels k1, k2 and one constant; compile_cu returns the
    log set in `logs` and records its calls in `logs["calls"]`."""
    (tmp_path / "fake.cu").write_text("// compiled by the fake compiler\n")
    monkeypatch.setattr(_nvrtc, "CU_DIR", tmp_path)
    monkeypatch.setattr(_nvrtc, "nvrtc_version", lambda: (12, 9))
    monkeypatch.setattr(_nvrtc, "cuda_include_dirs", lambda: ("/nowhere",))
    declare("fake.cu", ["k1", "k2"], {"FAKE_N": 7})
    logs = {"log": "", "calls": []}

    def compile_cu(source, filename, arch, names, extra_options=(), verbose_ptxas=False):
        logs["calls"].append((filename, arch, tuple(names), tuple(extra_options), verbose_ptxas))
        logs.setdefault("cache_disabled", []).append(os.environ.get("CUDA_CACHE_DISABLE"))
        return _nvrtc.CompileResult(b"\x7fELF", {"k1": K1, "k2": "_Z2k2v"}, logs["log"], arch)
    monkeypatch.setattr(_nvrtc, "compile_cu", compile_cu)
    return logs


def test_compiles_with_the_runtimes_names_and_options(fake_compiler):
    fake_compiler["log"] = PTXAS_K2_CLEAN
    nvrtc_check.check(("sm_80", "sm_90"), 0, files=["fake.cu"], out=io.StringIO())
    assert sorted(fake_compiler["calls"]) == [
        ("fake.cu", arch, runtime.registered_kernels()["fake.cu"], runtime.kernel_options("fake.cu"), True)
        for arch in ("sm_80", "sm_90")]
    assert runtime.kernel_options("fake.cu") == ("-DFAKE_N=7",)


@pytest.mark.parametrize("before", [None, "0"])
def test_compiles_past_the_cuda_compute_cache_and_restores_it(fake_compiler, monkeypatch, before):
    """A program served from NVRTC's cache (12.9+) has no ptxas report: every
    compile of the check runs with CUDA_CACHE_DISABLE=1, and the variable is
    as it was afterwards."""
    if before is None:
        monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    else:
        monkeypatch.setenv("CUDA_CACHE_DISABLE", before)
    fake_compiler["log"] = PTXAS_K2_CLEAN
    nvrtc_check.check(("sm_80", "sm_90"), 0, files=["fake.cu"], out=io.StringIO())
    assert fake_compiler["cache_disabled"] == ["1", "1"]
    assert os.environ.get("CUDA_CACHE_DISABLE") == before


def test_spill_threshold_decides_the_exit_code(fake_compiler):
    fake_compiler["log"] = PTXAS_K1_SPILLS + PTXAS_K2_CLEAN
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 11, files=["fake.cu"], out=buf) == 1
    text = buf.getvalue()
    assert "FAIL fake.cu [sm_90] k1: 255 regs, 1024 B smem, 16 B stack, 12 B spills" in text
    assert "ok   fake.cu [sm_90] k2: 20 regs, 0 B smem, 0 B stack, 0 B spills" in text
    assert "FAILED (1)" in text
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 12, files=["fake.cu"], out=buf) == 0
    assert "all ok" in buf.getvalue()


def test_a_kernel_without_ptxas_stats_fails(fake_compiler):
    fake_compiler["log"] = PTXAS_K2_CLEAN          # nothing reported for k1
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 0, files=["fake.cu"], out=buf) == 1
    text = buf.getvalue()
    assert "FAIL fake.cu [sm_90] k1: no ptxas report" in text and "FAILED (1)" in text


def test_unknown_file_fails_naming_it(fake_compiler, capsys):
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 0, files=["nope.cu"], out=buf) == 1
    assert "nope.cu" in buf.getvalue() and "all ok" not in buf.getvalue()
    assert nvrtc_check.main(["--arch", "sm_90", "--file", "nope.cu"]) == 1
    assert "nope.cu" in capsys.readouterr().out


def test_parser():
    st = nvrtc_check.parse_ptxas(PTXAS_K1_SPILLS)[K1]
    assert st == {"registers": 255, "smem": 1024, "stack": 16, "spill_stores": 8, "spill_loads": 4}


def test_serialized_wgmmas_fail_the_kernel():
    # ptxas's note (CUDA 12.9 / 13 wording) comes before the kernel's own lines
    note = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized "
            "due to non wgmma instructions reading accumulator registers of  a wgmma between start and end of "
            f"the pipeline stage in the function '{K1}'\n")
    st = nvrtc_check.parse_ptxas(note + PTXAS_K1_SPILLS)[K1]
    assert st["serialized"] == 1 and st["registers"] == 255
    ok, line = nvrtc_check.kernel_line("f.cu", "sm_90", "k1", st, max_spill_bytes=100)
    assert not ok and line.startswith("FAIL") and line.endswith("wgmmas serialized by ptxas")
    assert "serialized" not in nvrtc_check.parse_ptxas(PTXAS_K1_SPILLS)[K1]


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sm_75"], "argument --arch: invalid choice: 'sm_75'"),
    (["--arch", "sm_90", "--arch", "compute_90"], "argument --arch: invalid choice: 'compute_90'"),
    (["--max-spill-bytes", "-1"], "argument --max-spill-bytes: expected an integer >= 0, got '-1'"),
    (["--max-spill-bytes", "many"], "argument --max-spill-bytes: expected an integer >= 0, got 'many'"),
])
def test_bad_command_line_is_one_line_and_exit_2(argv, message, fake_compiler, capsys):
    with pytest.raises(SystemExit) as exc:
        nvrtc_check.main(argv + ["--file", "fake.cu"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"rawkv-nvrtc-check: error: {message}")
    assert err.endswith("\n") and err.count("\n") == 1
    assert fake_compiler["calls"] == []          # refused before compiling anything


def test_every_known_arch_and_a_zero_threshold_are_accepted(fake_compiler):
    fake_compiler["log"] = PTXAS_K1_SPILLS.replace("8 bytes spill stores, 4", "0 bytes spill stores, 0") \
        + PTXAS_K2_CLEAN
    argv = ["--file", "fake.cu", "--max-spill-bytes", "0"]
    for arch in nvrtc_check.DEFAULT_ARCHS:
        argv += ["--arch", arch]
    assert nvrtc_check.main(argv) == 0
    assert sorted(c[1] for c in fake_compiler["calls"]) == sorted(nvrtc_check.DEFAULT_ARCHS)


def test_default_archs_include_what_the_runtime_builds():
    # A100, L40, H100, B200, RTX 5090: the runtime compiles arch_for(capability)
    for cc in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert runtime.arch_for(cc) in nvrtc_check.DEFAULT_ARCHS
    assert runtime.arch_for((10, 0)) == "sm_100" and "sm_100a" in nvrtc_check.DEFAULT_ARCHS


def test_ci_and_readme_count_the_architectures_it_builds():
    """.ci/run and the README say how many architectures the compile-check
    builds; the number is DEFAULT_ARCHS' (.ci/run said five of six)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).parents[2]
    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    n = words[len(nvrtc_check.DEFAULT_ARCHS)]
    for name in (".ci/run", "README.md"):
        text = " ".join((root / name).read_text().replace("#", " ").split())
        said = re.findall(r"compile-check for all (\w+) architecture", text)
        assert said == [n], (name, said)


def test_files_built_for_one_architecture_compile_first():
    # The wgmma files (sm_90 only) are the longest single jobs: started
    # first, they overlap the other files' jobs instead of ending the check.
    jobs = [("a.cu", "sm_80"), ("a.cu", "sm_90"), ("w.cu", "sm_90"), ("b.cu", "sm_80"), ("b.cu", "sm_90")]
    assert nvrtc_check.job_order(jobs) == [("w.cu", "sm_90"), ("a.cu", "sm_80"), ("a.cu", "sm_90"),
                                           ("b.cu", "sm_80"), ("b.cu", "sm_90")]
