"""Compiling per kernel instance, in parallel, with one progress line
(rawkv._compile, Runtime._load / warmup), on a CPU: NVRTC compiles for sm_90
without a GPU, and the runtime's CUDA side (CuPy's module loader) is a
stand-in that checks each loaded cubin holds the symbol it is asked for.

What only a GPU shows (the cold start's wall time, the modules really
loading): tests/runtime/test_runtime_gpu.py and the demo."""
import io
import json
import os
import re
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from rawkv import _cache, _compile, _nvrtc, kernels, runtime
from rawkv.errors import CaptureError, CompileError

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")

FILE = "fp8.cu"          # 12 small instances: the cheapest file to compile


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", str(tmp_path / "kc"))
    return tmp_path / "kc"


def _names(filename=FILE):
    return runtime.registered_kernels()[filename]


def _entries(names, filename=FILE, arch="sm_90"):
    return [_cache.Entry(filename, arch, (n,), runtime.kernel_options(filename)) for n in names]


# ---- the runtime, with CuPy's loader replaced -----------------------------------------
class _Module:
    """CuPy's Module as the runtime uses it: load(cubin), get_function(symbol)."""

    def load(self, cubin):
        assert cubin[:4] == b"\x7fELF"
        self.cubin = cubin

    def get_function(self, symbol):
        assert symbol.encode() in self.cubin, symbol      # the kernel is in this module
        return types.SimpleNamespace(ptr=0, symbol=symbol, module=self)


def _runtime(monkeypatch, arch="sm_90", capturing=False):
    """A Runtime for a device of `arch` whose CUDA calls are stand-ins."""
    rt = runtime.Runtime.__new__(runtime.Runtime)
    rt.arch, rt.device_index = arch, 0
    rt.stats = {"compiles": 0, "disk_hits": 0, "damaged": 0, "modules": 0}
    rt._modules, rt._functions, rt._streams = {}, {}, {}
    rt._lock = threading.Lock()
    rt._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(function=types.SimpleNamespace(Module=_Module)))
    rt._exchange_device = rt._maybe_exchange_device = lambda d: 0
    rt._current_stream_ptr = lambda: 0
    rt._streams[0] = "stream"
    rt.capturing = lambda stream=None: capturing
    monkeypatch.setattr(runtime, "_WARMUP_HOOKS", [])    # the op families' device state needs torch
    return rt


def _symbols(filename=FILE):
    """{name expression: mangled symbol} of every instance of the file."""
    res = _nvrtc.compile_cu((_nvrtc.CU_DIR / filename).read_text(), filename, "sm_90", _names(filename),
                            runtime.kernel_options(filename))
    return res.lowered


def test_first_use_compiles_only_its_instance(cache_dir, monkeypatch):
    """A first launch compiles one module holding the one instance it needs
    (not the file's other 11), writes one cache file; warmup() then builds
    the others, one module each."""
    rt = _runtime(monkeypatch)
    symbols = _symbols()
    first = _names()[0]
    fn = rt.function(FILE, first)
    assert fn.symbol == symbols[first]
    assert rt.stats == {"compiles": 1, "disk_hits": 0, "damaged": 0, "modules": 1}
    others = [s for n, s in symbols.items() if n != first]
    assert not [s for s in others if s.encode() in fn.module.cubin]
    assert len(list(cache_dir.iterdir())) == 1
    assert rt.function(FILE, first) is fn                     # kept: no second compile
    rt.warmup([FILE])
    n = len(_names())
    assert rt.stats == {"compiles": n, "disk_hits": 0, "damaged": 0, "modules": n}
    assert {rt._functions[(FILE, k)].symbol for k in _names()} == set(symbols.values())
    assert len(list(cache_dir.iterdir())) == n
    rt.warmup([FILE])                                          # all loaded: nothing to do
    assert rt.stats["compiles"] == n and rt.stats["modules"] == n


def test_a_second_runtime_loads_every_instance_from_disk(cache_dir, monkeypatch):
    _runtime(monkeypatch).warmup([FILE])
    rt = _runtime(monkeypatch)
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    rt.warmup([FILE])
    n = len(_names())
    assert rt.stats == {"compiles": 0, "disk_hits": n, "damaged": 0, "modules": n}
    assert out.getvalue() == ""                               # nothing compiled: no progress line


def test_warmup_builds_the_devices_instances_only(monkeypatch):
    """A file built for one architecture (the wgmma GEMM, the W4A8 kernels) is
    built on its devices only; an unknown file is refused by name."""
    sm90 = runtime.instances_for("sm_90")
    sm80 = runtime.instances_for("sm_80")
    assert len(sm90) == sum(map(len, runtime.registered_kernels().values()))
    assert {f for f, _ in sm90} - {f for f, _ in sm80} == {"gemm_fp4_sm90.cu", "gemm_w4a8_sm90.cu", "gemm_w4a8_mma.cu"}
    assert runtime.instances_for("sm_80", ["gemm_fp4_sm90.cu"]) == []
    with pytest.raises(KeyError, match="nope.cu"):
        runtime.instances_for("sm_90", ["fp8.cu", "nope.cu"])
    built = []
    monkeypatch.setattr(runtime.Runtime, "_load", lambda self, todo: built.append(list(todo)))
    rt = _runtime(monkeypatch, arch="sm_80")
    rt.warmup()
    assert built == [sm80]


def test_warmup_lists_of_the_wrong_shape_are_refused_by_name():
    """warmup(files="fp8.cu") iterated the string: a KeyError for the file
    "f"; one instance or pair for `instances` failed to unpack, naming
    nothing. Each is a TypeError naming the argument; lists are taken."""
    inst = kernels.fp8.ENCODE.instance("float32", True)
    with pytest.raises(TypeError, match=r"^files: expected a list of \.cu file names, got 'fp8.cu'"):
        runtime.instances_for("sm_90", "fp8.cu")
    for one in (inst, inst.key):
        with pytest.raises(TypeError, match="^instances: expected a list of kernel instances"):
            runtime.instances_for("sm_90", instances=one)
    with pytest.raises(TypeError, match="^instances: expected kernel instances .* got <kernel fp8.cu"):
        runtime.instances_for("sm_90", instances=[kernels.fp8.ENCODE])
    assert runtime.instances_for("sm_90", instances=(inst, inst.key)) == [inst.key]
    assert runtime.instances_for("sm_90", ("fp8.cu",)) == runtime.instances_for("sm_90", ["fp8.cu"])


def test_warmup_refuses_to_compile_while_capturing(monkeypatch):
    rt = _runtime(monkeypatch, capturing=True)
    monkeypatch.setattr(_compile, "build", lambda *a, **k: pytest.fail("compiled while capturing"))
    with pytest.raises(CaptureError, match="warmup"):
        rt.warmup([FILE])
    with pytest.raises(CaptureError, match="warmup"):
        rt.function(FILE, _names()[0])


def test_unknown_kernel_is_refused_by_name(monkeypatch):
    rt = _runtime(monkeypatch)
    with pytest.raises(KeyError, match="rkv_nope"):
        rt.function(FILE, "rkv_nope")
    assert rt.stats["compiles"] == 0


# ---- parallel compiles ------------------------------------------------------------------
# NVRTC names a translation unit's internal-linkage symbols (a namespace-
# scope constant) _INTERNAL_<8 hex>_<n>_<file>_<8 hex id>_..., the id drawn
# anew by each compile, serial or not: two compiles of one source differ in
# those bytes only.
_TU_ID = re.compile(rb"(_INTERNAL_[0-9a-f]{8}_[0-9]+_\w+?_)[0-9a-f]{8}_")


def _same_code(cubin: bytes) -> bytes:
    return _TU_ID.sub(rb"\g<1>00000000_", cubin)


def test_parallel_build_gives_the_serial_bytes(monkeypatch):
    """The same cubin, byte for byte but NVRTC's per-compile id, whichever
    thread compiles it and however many compile at once."""
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")
    entries = _entries(_names())
    serial = _compile.build(entries, "sm_90", threads=1)
    parallel = _compile.build(entries, "sm_90", threads=4)
    assert [_same_code(r.cubin) for r in parallel] == [_same_code(r.cubin) for r in serial]
    assert [len(r.cubin) for r in parallel] == [len(r.cubin) for r in serial]
    assert [r.lowered for r in parallel] == [r.lowered for r in serial]
    assert len({_same_code(r.cubin) for r in serial}) == len(entries)      # one module per instance


def test_build_runs_compiles_at_once(cache_dir, monkeypatch):
    """With T threads, T compiles run at the same time (a compile that
    waits for the others to start would hang a serial build)."""
    n = 3
    barrier = threading.Barrier(n, timeout=10)

    def compile_entry(entry):
        barrier.wait()                   # BrokenBarrierError unless all n run at once
        return _nvrtc.CompileResult(b"\x7fELF" + entry.names[0].encode(), {entry.names[0]: "sym"})
    monkeypatch.setattr(_cache, "compile_entry", compile_entry)
    stats = {}
    res = _compile.build(_entries(_names()[:n]), "sm_90", stats=stats, threads=n)
    assert [r.cubin[4:].decode() for r in res] == list(_names()[:n])
    assert stats == {"compiles": n}
    assert len(list(cache_dir.iterdir())) == n                 # each written by its thread


def test_a_compile_error_is_raised_with_its_log(monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")

    def compile_entry(entry):
        if entry.names[0] == _names()[1]:
            raise CompileError("fp8.cu failed to compile for sm_90:\nerror: planted")
        return _nvrtc.CompileResult(b"\x7fELF", {entry.names[0]: "sym"})
    monkeypatch.setattr(_cache, "compile_entry", compile_entry)
    with pytest.raises(CompileError, match="planted"):
        _compile.build(_entries(_names()[:4]), "sm_90", threads=2, out=io.StringIO())


@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5"])
def test_compile_jobs_env_is_checked(monkeypatch, value):
    monkeypatch.setenv("RAWKV_COMPILE_JOBS", value)
    with pytest.raises(ValueError, match="RAWKV_COMPILE_JOBS"):
        _compile.compile_threads()


def test_compile_jobs_default_and_env(monkeypatch):
    monkeypatch.delenv("RAWKV_COMPILE_JOBS", raising=False)
    assert _compile.compile_threads() >= 1
    monkeypatch.setenv("RAWKV_COMPILE_JOBS", "3")
    assert _compile.compile_threads() == 3


# ---- the progress line -------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self):
        return True


def _slow(monkeypatch, seconds):
    def compile_entry(entry):
        time.sleep(seconds)
        return _nvrtc.CompileResult(b"\x7fELF", {entry.names[0]: "sym"})
    monkeypatch.setattr(_cache, "compile_entry", compile_entry)


def test_a_slow_build_prints_a_start_and_an_end_line(monkeypatch):
    """In a log (not a terminal): one line when the delay has passed, one at
    the end, no carriage returns."""
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")
    _slow(monkeypatch, 0.3)
    out = io.StringIO()
    _compile.build(_entries(_names()[:3]), "sm_90", threads=2, out=out, delay=0.1)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2, out.getvalue()
    assert lines[0] == "rawkv: compiling 3 kernels for sm_90 (2 threads) ..."
    assert lines[1].startswith("rawkv: compiled 3 kernels for sm_90 in ") and lines[1].endswith(" s")


def test_a_slow_build_on_a_terminal_is_one_line_updated_in_place(monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")
    _slow(monkeypatch, 0.3)
    out = _Tty()
    _compile.build(_entries(_names()[:4]), "sm_90", threads=2, out=out, delay=0.1)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")       # one line, ended once
    assert "\rrawkv: compiling 4 kernels for sm_90 (2 threads): " in text
    assert text.split("\r")[-1].startswith("rawkv: compiled 4 kernels for sm_90 in ")


def test_a_quick_build_prints_nothing(monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")
    _slow(monkeypatch, 0.0)
    out = _Tty()
    _compile.build(_entries(_names()[:3]), "sm_90", threads=2, out=out, delay=5.0)
    assert out.getvalue() == ""


def test_a_failed_slow_build_ends_its_line(monkeypatch):
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")

    def compile_entry(entry):
        time.sleep(0.3)
        raise CompileError("planted")
    monkeypatch.setattr(_cache, "compile_entry", compile_entry)
    out = io.StringIO()
    with pytest.raises(CompileError):
        _compile.build(_entries(_names()[:2]), "sm_90", threads=1, out=out, delay=0.1)
    assert out.getvalue().splitlines()[-1].startswith("rawkv: compile failed after 0 of 2 kernels")


# ---- the cache key of an instance -------------------------------------------------------
def test_each_instance_has_its_own_key_and_file(cache_dir):
    entries = _entries(_names())
    assert len({e.key for e in entries}) == len({e.name for e in entries}) == len(entries)
    e = entries[0]
    # the runtime's batch key (one sources digest for all) is load_or_compile's key
    assert e.key == _cache.cache_key(FILE, "sm_90", e.names, e.options)
    _cache.load_or_compile(FILE, "sm_90", e.names, e.options)
    stats = {}
    (res,) = _compile.build([e], "sm_90", stats=stats)
    assert stats == {"disk_hits": 1} and set(res.lowered) == set(e.names)


def test_instance_key_follows_what_changes_its_cubin(tmp_path, monkeypatch):
    """Another arch, -D constant, version or source text: another key."""
    name = _names()[0]
    k = _cache.Entry(FILE, "sm_90", (name,)).key
    assert k != _cache.Entry(FILE, "sm_90a", (name,)).key
    assert k != _cache.Entry(FILE, "sm_90", (name,), ("-DX=1",)).key
    assert k != _cache.Entry(FILE, "sm_90", (name,), version="9.9").key
    src = tmp_path / "cu"
    src.mkdir()
    for p in _nvrtc.CU_DIR.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(_nvrtc, "CU_DIR", src)      # (another -I directory: another key)
    copied = _cache.Entry(FILE, "sm_90", (name,)).key
    assert _cache.Entry(FILE, "sm_90", (name,)).key == copied
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// edited\n")
    assert _cache.Entry(FILE, "sm_90", (name,)).key != copied


def test_key_names_the_nvrtc_library(monkeypatch):
    """NVRTC's version is major.minor only: a patch release of the library
    (another file) is another key."""
    lib = _nvrtc.nvrtc_library()
    if sys.platform.startswith("linux"):
        path = lib.rsplit(":", 2)[0]
        assert os.path.basename(path).startswith("libnvrtc.so") and os.path.isfile(path), lib
    name = _names()[0]
    k = _cache.Entry(FILE, "sm_90", (name,)).key
    monkeypatch.setattr(_nvrtc, "nvrtc_library", lambda: lib + "-patched")
    assert _cache.Entry(FILE, "sm_90", (name,)).key != k


def test_declared_instances_are_the_runtimes():
    """warmup() builds exactly the instances the declarations name."""
    assert runtime.instances_for("sm_90", [FILE]) == [(FILE, n) for n in kernels.files()[FILE].name_expressions()]


# ---- the NVRTC version ----------------------------------------------------------------------
def test_an_nvrtc_older_than_the_minimum_is_refused_by_name(monkeypatch):
    """fused.cu's __maxnreg__ needs NVRTC 12.4: an older library is named in
    the error before any source is handed to it; the minimum itself compiles."""
    src = 'extern "C" __global__ void k(int* p) { *p = 1; }'
    monkeypatch.setattr(_nvrtc, "nvrtc_version", lambda: (12, 3))
    with pytest.raises(CompileError, match=r"^rawkv needs NVRTC 12\.4 or newer .* loaded 12\.3 "):
        _nvrtc.compile_cu(src, "k.cu", "sm_90", ["k"])
    monkeypatch.setattr(_nvrtc, "nvrtc_version", lambda: _nvrtc.MIN_NVRTC)
    assert _nvrtc.compile_cu(src, "k.cu", "sm_90", ["k"]).cubin


def test_a_slow_build_without_a_stderr_still_builds(monkeypatch):
    """Python sets sys.stderr to None when the process starts without a file
    descriptor 2 (a service started with 2>&-, pythonw): the progress line
    is skipped. It raised AttributeError ('NoneType' has no 'write') out of
    the build once the delay had passed, after every module compiled."""
    monkeypatch.setenv("RAWKV_CACHE_DIR", "off")
    _slow(monkeypatch, 0.3)
    monkeypatch.setattr(sys, "stderr", None)
    res = _compile.build(_entries(_names()[:2]), "sm_90", threads=1, delay=0.1)
    assert [r.cubin for r in res] == [b"\x7fELF"] * 2


def test_a_compile_failure_names_nvrtcs_result(monkeypatch):
    """NVRTC can fail with nothing in its log: NVRTC_ERROR_BUILTIN_OPERATION_FAILURE
    (its builtins library missing or of another release, what
    cuda.pathfinder preloads against), out of memory. The CompileError said
    only 'k.cu failed to compile for sm_90:' then; it names the result."""
    real = _nvrtc._nvrtc()
    stand_in = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if n.startswith("nvrtc")})
    failure = real.nvrtcResult.NVRTC_ERROR_BUILTIN_OPERATION_FAILURE

    def compile_program(prog, n, opts):
        real.nvrtcCompileProgram(prog, n, opts)          # a clean compile: an empty log
        return (failure,)
    stand_in.nvrtcCompileProgram = compile_program
    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: stand_in)
    src = 'extern "C" __global__ void k(int* p) { *p = 1; }'
    with pytest.raises(CompileError, match=r"^k\.cu failed to compile for sm_90 \(NVRTC_ERROR_BUILTIN_OPERATION_FAILURE\)"):
        _nvrtc.compile_cu(src, "k.cu", "sm_90", ["k"])


def test_key_names_every_nvrtc_library_the_process_has_loaded(tmp_path, monkeypatch):
    """Two libnvrtc files mapped at once (a conda torch's and cuda-python's
    pip one): the identity took the first by path, which need not be the
    one compiling, so a patch release of the other kept the key. Each
    loaded library is in it."""
    libs = []
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        lib = tmp_path / d / "libnvrtc.so.12"
        lib.write_bytes(b"\x7fELF " + d.encode())
        libs.append(lib)
    maps = "".join(f"7f00-7f10 r-xp 00000000 08:01 {i} {p}\n" for i, p in enumerate(libs))
    maps += "7f20-7f30 r-xp 00000000 08:01 9 /usr/lib/libc.so.6\n"
    real_open = open
    monkeypatch.setattr(_nvrtc, "open", lambda p, *a, **k: io.StringIO(maps) if p == "/proc/self/maps"
                        else real_open(p, *a, **k), raising=False)
    before = _nvrtc.nvrtc_library.__wrapped__()
    assert str(libs[0]) in before
    libs[1].write_bytes(b"\x7fELF b, another patch release")
    assert _nvrtc.nvrtc_library.__wrapped__() != before


def test_a_header_in_the_working_directory_is_not_compiled_in(tmp_path, monkeypatch):
    """NVRTC searches the directory of the file it compiles first for a
    quoted #include; the program was named "fp8.cu", the process's working
    directory, so a common.cuh there was compiled in instead of rawkv's (and
    cached under rawkv's key). The program is named by its path in rawkv/cu."""
    (tmp_path / "common.cuh").write_text('#error "the working directory\'s common.cuh"\n')
    monkeypatch.chdir(tmp_path)
    name = _names()[0]
    source = (_nvrtc.CU_DIR / FILE).read_text()
    res = _nvrtc.compile_cu(source, FILE, "sm_90", (name,), runtime.kernel_options(FILE))
    assert res.cubin[:4] == b"\x7fELF" and set(res.lowered) == {name}
    assert _nvrtc.program_name(FILE) == str(_nvrtc.CU_DIR / FILE)


def test_the_docs_count_the_instances_warmup_builds():
    """docs/runtime.md states how many instances warmup() builds on sm_90
    and the other architectures; it said 194 after the count had grown."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "runtime.md").read_text()
    m = re.search(r"`warmup\(\)` builds every instance the device runs \((\d+) on\s+sm_90, (\d+) on sm_80", text)
    assert m, "the sentence in docs/runtime.md, 'Compiling per instance, in parallel'"
    assert (int(m[1]), int(m[2])) == (len(runtime.instances_for("sm_90")), len(runtime.instances_for("sm_80")))


def test_warmup_takes_a_pair_given_as_a_list():
    """A (file, name expression) pair given as a two-string list (as a JSON
    round trip of instances_for's or Runtime.recording()'s list gives it)
    was taken and normalized before the wrong-shape checks (eb8cc66); those
    checks kept only tuples, refusing it with a TypeError. Taken again; one
    pair alone, as a list, is still refused by name."""
    inst = kernels.fp8.ENCODE.instance("float32", True)
    pairs = json.loads(json.dumps(runtime.instances_for("sm_90", instances=[inst])))
    assert pairs == [list(inst.key)]
    assert runtime.instances_for("sm_90", instances=pairs) == [inst.key]
    with pytest.raises(TypeError, match="^instances: expected a list of kernel instances"):
        runtime.instances_for("sm_90", instances=list(inst.key))
