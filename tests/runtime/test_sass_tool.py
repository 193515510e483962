"""tools/sass.py, a kernel instance's SASS with no GPU: its loop count (the
innermost loops holding tensor-core instructions, nested ones not counted
twice), its refusal without nvdisasm, and its driver (NVRTC's cubin of the
named instance handed to nvdisasm; a stand-in nvdisasm here)."""
import stat

import pytest

from support.tools import load_tool


SASS = """\
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_2:
        /*0020*/                   LDS R4, [R3] ;
        /*0030*/                   HMUL2.BF16_V2 R5, R4, R6 ;
        /*0040*/                   HGMMA.64x96x16.F32.BF16 R24, R120, gdesc[UR8], R24 ;
        /*0050*/              @!P0 BRA `(.L_x_2) ;
        /*0060*/                   ISETP.GE.AND P1, PT, R2, R7, PT ;
        /*0070*/              @!P1 BRA `(.L_x_1) ;
.L_x_3:
        /*0080*/                   FADD R8, R8, R9 ;
        /*0090*/              @!P2 BRA `(.L_x_3) ;
        /*00a0*/                   EXIT ;
"""


def _tool():
    return load_tool("sass")


def test_an_fp8_wgmma_loop_counts_too():
    (n, ops), = _tool().loops(SASS.replace("HGMMA.64x96x16.F32.BF16", "QGMMA.64x96x32.F32.E4M3.E4M3"))
    assert n == 4 and ops["QGMMA"] == 1


def test_loops_counts_the_innermost_tensor_core_loop_once():
    (n, ops), = _tool().loops(SASS)     # not the outer loop, not the FADD loop (no tensor op)
    assert n == 4 and ops["HGMMA"] == 1 and ops["LDS"] == 1 and ops["BRA"] == 1 and ops["HMUL2"] == 1


def test_without_nvdisasm_it_says_so(monkeypatch, capsys):
    monkeypatch.delenv("NVDISASM", raising=False)
    monkeypatch.setenv("PATH", "")
    assert _tool().main(["gemm_fp4", "GEMM", "0", "False", "1", "1", "8", "1", "2", "2", "False"]) == 2
    assert "no nvdisasm" in capsys.readouterr().err


def test_the_instance_goes_to_nvdisasm(monkeypatch, capsys, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    fake = tmp_path / "nvdisasm"
    seen = tmp_path / "args"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\nhead -c 4 \"$3\" | od -An -c | tr -d ' \\n' >> {seen}\n"
                    f"cat <<'X'\n{SASS}X\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("NVDISASM", str(fake))
    assert _tool().main(["gemm_fp4", "GEMM", "0", "False", "1", "1", "8", "1", "2", "2", "False", "--count"]) == 0
    assert capsys.readouterr().out.startswith("4 instructions: ")
    args = seen.read_text()
    assert args.startswith("-c -g ") and args.rstrip().endswith("177ELF")        # the cubin, an ELF file
