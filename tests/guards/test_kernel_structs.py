"""The struct parameters of the kernels (a wide kernel's groups of
parameters, passed by value): the layout rawkv.kernels packs them with (each
field's offset, the size) is the compiler's. NVRTC compiles each kernel
file with a probe kernel per field (rawkv.kernels._abi.struct_probes) to
PTX on a CPU; a probe's parameter size and its one load's offset are the
compiler's layout."""
import re

import pytest

from rawkv import _nvrtc, kernels
from rawkv.errors import GpuUnavailableError
from rawkv.kernels import _abi
from rawkv.runtime import kernel_options

from .test_kernel_abi import _STRUCTS, declare  # noqa: F401  (the fixture)


def _ptx(filename, source, options=()) -> str:
    """PTX of `source` for compute_90, through NVRTC (no GPU). The program
    is named as the runtime names it (_nvrtc.program_name: its path in
    rawkv/cu), so a quoted #include never reads the working directory."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")
    try:
        opts = _nvrtc.compile_options("compute_90", tuple(options))
    except GpuUnavailableError as exc:
        pytest.skip(str(exc))
    nvrtc = _nvrtc._nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), _nvrtc.program_name(filename).encode(), 0, [], [])
    try:
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert int(res[0]) == 0, log.decode(errors="replace")
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx = bytearray(n)
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_LOAD = re.compile(r"ld\.param(?:\.v(\d))?\.[a-z]+(\d+)\s+(\{[^}]*\}|%\w+), \[(\w+)_param_0(?:\+(\d+))?\]")


def _layout(ptx: str, probe: str) -> tuple[int, list[int]]:
    """(size of the probe's struct parameter, the offsets it reads): a
    vector load (ptxas may read a field with its neighbours) counts at the
    element the probe then uses."""
    body = ptx[ptx.index(f".entry {probe}("):]
    body = body[:body.index("\n}")]
    size = re.search(rf"\.param \.align \d+ \.b8 {probe}_param_0\[(\d+)\]", body)
    offsets = []
    for m in _LOAD.finditer(body):
        if m.group(4) != probe:
            continue
        base, width = int(m.group(5) or 0), int(m.group(2)) // 8
        regs = [r.strip() for r in m.group(3).strip("{}").split(",")]
        rest = body[m.end():]
        used = [i for i, r in enumerate(regs) if re.search(re.escape(r) + r"\b", rest)]
        offsets += [base + i * width for i in used]
    return int(size.group(1)), offsets


def _mismatches(filename, source, kf, options=()) -> list[str]:
    probes, expect = _abi.struct_probes(kf)
    assert expect, f"{filename}: no struct parameter to check"
    ptx = _ptx(filename, source + "\n" + probes, options)
    out = []
    for probe, (what, offset, size) in expect.items():
        got_size, loads = _layout(ptx, probe)
        if (got_size, loads) != (size, [offset]):
            out.append(f"{what}: packed at {offset} of {size} bytes, the compiler's {loads} of {got_size}")
    return out


def _with_structs():
    return sorted(kf.filename for kf in kernels.files().values()
                  if any(p.fields is not None for k in kf.kernels.values() for p in k.params))


def test_some_kernel_takes_a_struct():
    assert "kv_compress.cu" in _with_structs(), "the layout test checks no kernel's struct"


@pytest.mark.parametrize("filename", _with_structs())
def test_struct_layouts_are_the_compilers(filename):
    kf = kernels.files()[filename]
    assert _mismatches(filename, kf.source(), kf, kernel_options(filename)) == []


def test_the_layout_check_finds_a_wrong_offset(declare):  # noqa: F811
    """Padding C adds (after an int before a long long, bool and float
    packed after them, a trailing pad) is read as the compiler lays it out;
    a struct the packing gets wrong is found (here: a source whose field
    order differs from the one the declaration read)."""
    head = '#include "common.cuh"\nusing namespace rkv;\n'
    kernel = "template <typename T> __global__ void k(Part<T> p, const Small s) {}\n"
    kf = declare("test_structs_layout.cu", head + _STRUCTS + kernel)
    kf.kernel("k", (kernels.TParam("typename", "T", ("float32", "bfloat16")),))
    assert _mismatches(kf.filename, kf.source(), kf) == []
    swapped = head + _STRUCTS.replace("int a, b; u8* p; u8 c;", "u8 c; int a, b; u8* p;") + kernel
    assert _mismatches(kf.filename, swapped, kf) == [
        "Small.a: packed at 0 of 24 bytes, the compiler's [4] of 24",
        "Small.b: packed at 4 of 24 bytes, the compiler's [8] of 24",
        "Small.p: packed at 8 of 24 bytes, the compiler's [16] of 24",
        "Small.c: packed at 16 of 24 bytes, the compiler's [0] of 24"]


def test_a_header_in_the_working_directory_is_not_compiled_in(tmp_path, monkeypatch):
    """_ptx named the NVRTC program by its bare file name ("kv_compress.cu"),
    which NVRTC reads as the working directory: a common.cuh there was
    compiled in instead of rawkv's. It uses the runtime's rule
    (_nvrtc.program_name: the file's path in rawkv/cu)."""
    (tmp_path / "common.cuh").write_text('#error "the working directory\'s common.cuh"\n')
    monkeypatch.chdir(tmp_path)
    kf = kernels.files()["kv_compress.cu"]
    assert _mismatches(kf.filename, kf.source(), kf, kernel_options(kf.filename)) == []
