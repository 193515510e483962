"""The compile-check tool: all kernels, all archs, resource report, failures."""
import io

import pytest

from rawkv import _nvrtc, runtime
from rawkv.tools import nvrtc_check

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")


def test_reports_resources_for_every_kernel():
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_90",), 0, files=["fp8.cu"], out=buf) == 0
    text = buf.getvalue()
    for name in runtime.registered_kernels()["fp8.cu"]:
        assert f"[sm_90] {name}: " in text
    assert " regs, " in text and " B spills" in text and "all ok" in text


def test_compile_error_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text('#include "common.cuh"\n__global__ void k() {\n  int x = ;\n}\n')
    (tmp_path / "common.cuh").write_text((_nvrtc.CU_DIR / "common.cuh").read_text())
    monkeypatch.setattr(_nvrtc, "CU_DIR", tmp_path)
    monkeypatch.setitem(runtime._REGISTRY, "broken.cu", ["k"])
    buf = io.StringIO()
    assert nvrtc_check.check(("sm_80",), 0, files=["broken.cu"], out=buf) == 1
    text = buf.getvalue()
    assert "FAIL broken.cu [sm_80]" in text and "broken.cu(3)" in text


def test_spill_threshold_and_parser():
    log = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1kv\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, 1024 bytes smem, 380 bytes cmem[0]\n")
    st = nvrtc_check.parse_ptxas(log)["_Z1kv"]
    assert st == {"registers": 255, "smem": 1024, "stack": 16, "spill_stores": 8, "spill_loads": 4}
