"""NVRTC through cuda-python's bindings: source -> cubin, with no GPU.

The runtime (for the device's own architecture) and the compile-check tool
(for every architecture rawkv supports) both compile through `compile_cu`,
so what the check accepts is exactly what the runtime loads.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CompileError, GpuUnavailableError

CU_DIR = Path(__file__).resolve().parent / "cu"

# Every kernel must agree with the numpy reference bit for bit, so the
# compiler may not contract a*b+c into an FMA, flush subnormals or use
# approximate division / square root.
NUMERIC_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

# The oldest NVRTC that compiles every kernel (fused.cu's per-kernel
# register caps, __maxnreg__, came in 12.4): an older one is refused by name
# before it reports a syntax error inside a kernel.
MIN_NVRTC = (12, 4)


@dataclass
class CompileResult:
    cubin: bytes
    lowered: dict[str, str]          # name expression -> mangled symbol
    log: str = ""
    arch: str = ""
    options: tuple[str, ...] = field(default_factory=tuple)


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # cuda-python < 12.6
        except ImportError as exc:
            raise GpuUnavailableError(
                "rawkv needs cuda-python's NVRTC bindings to compile kernels: "
                "pip install 'rawkv[cu12]' (or [cu13])") from exc
    return nvrtc


def _ok(err, what: str, log: str = "") -> None:
    if int(err) != 0:
        raise CompileError(f"NVRTC {what} failed: {err!r}\n{log}")


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    res = nvrtc.nvrtcVersion()
    if int(res[0]) != 0:
        raise GpuUnavailableError(f"NVRTC library could not be loaded: {res[0]!r}")
    return int(res[1]), int(res[2])


@functools.lru_cache(maxsize=None)
def nvrtc_library() -> str:
    """Path, size and mtime of the NVRTC library this process loaded (read
    from /proc/self/maps once nvrtc_version() has loaded it), or "" where
    that cannot be read: nvrtcVersion() names only major.minor, and another
    release of the same minor (12.9.41 -> 12.9.86) may compile other code.
    Every libnvrtc mapped, one a line, where there are several (a conda
    torch's beside cuda-python's pip one): the maps do not say which one
    cuda-python compiles with, and the first by path need not be it."""
    nvrtc_version()
    try:
        with open("/proc/self/maps") as maps:
            # address perms offset dev inode [path]: the path is the sixth field
            paths = {f[5].strip() for f in (line.split(None, 5) for line in maps) if len(f) == 6}
    except OSError:
        return ""
    found = []
    for path in sorted(paths):
        if os.path.basename(path).startswith("libnvrtc.so"):
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(found)


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple[str, ...]:
    """Folders holding cuda_fp8.h / cuda_bf16.h: the pip CUDA runtime package
    (found by cuda.pathfinder), else CUDA_HOME / CUDA_PATH / /usr/local/cuda."""
    dirs: list[str] = []
    try:
        from cuda import pathfinder
        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # pathfinder missing or too old: fall back to the env
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    good = [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_fp8.h"))]
    if not good:
        raise GpuUnavailableError(
            "cuda_fp8.h was not found: install nvidia-cuda-runtime-cu12 "
            "(or set CUDA_HOME to a CUDA toolkit)")
    return tuple(dict.fromkeys(good))


def program_name(filename: str) -> str:
    """The name NVRTC is given for a translation unit: its path in CU_DIR.
    NVRTC searches the directory of the file it compiles first for a quoted
    #include ("common.cuh"), and a bare "fp8.cu" names the process's
    working directory: a common.cuh there was compiled in instead of
    rawkv's, under rawkv's cache key (docs/runtime.md, "Compilation")."""
    return filename if os.path.isabs(filename) else os.path.join(str(CU_DIR), filename)


def compile_options(arch: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    incs = tuple(f"-I{d}" for d in (str(CU_DIR), *cuda_include_dirs()))
    return (f"--gpu-architecture={arch}", "--std=c++17", "-default-device",
            *NUMERIC_OPTIONS, *incs, *extra)


def compile_cu(source: str, filename: str, arch: str, name_expressions,
               extra_options: tuple[str, ...] = (), verbose_ptxas: bool = False
               ) -> CompileResult:
    """Compile one translation unit to a cubin for `arch` (e.g. 'sm_90').

    Raises CompileError with the full log (file and line of each error), or
    naming the NVRTC version where it is older than MIN_NVRTC."""
    nvrtc = _nvrtc()
    version = nvrtc_version()
    if version < MIN_NVRTC:
        raise CompileError(f"rawkv needs NVRTC {MIN_NVRTC[0]}.{MIN_NVRTC[1]} or newer to compile its kernels; "
                           f"this process loaded {version[0]}.{version[1]} "
                           "(pip install 'nvidia-cuda-nvrtc-cu12>=12.4', or the cu13 extra)")
    extra = tuple(extra_options) + (("-Xptxas=-v",) if verbose_ptxas else ())
    options = compile_options(arch, extra)
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), program_name(filename).encode(), 0, [], [])
    _ok(err, "create")
    try:
        names = list(name_expressions)
        for n in names:
            _ok(nvrtc.nvrtcAddNameExpression(prog, n.encode())[0], f"add name {n}")
        opts = [o.encode() for o in options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: they must be mutable.
        # (b" " * n would hand it CPython's shared one-byte b" " when n == 1,
        # the size of an empty log, and corrupt that constant process-wide.)
        _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
        log_buf = bytearray(log_size)
        nvrtc.nvrtcGetProgramLog(prog, log_buf)
        log = bytes(log_buf).decode(errors="replace").rstrip("\x00 \n")
        if int(res[0]) != 0:
            # NVRTC's result too: some failures (its builtins library missing
            # or of another release, out of memory) leave the log empty.
            raise CompileError(f"{filename} failed to compile for {arch} "
                               f"({getattr(res[0], 'name', res[0])}):\n{log}")
        lowered = {}
        for n in names:
            err, sym = nvrtc.nvrtcGetLoweredName(prog, n.encode())
            _ok(err, f"lowered name of {n}")
            lowered[n] = sym.decode()
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = bytearray(size)
        _ok(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "get cubin", log)
        return CompileResult(bytes(cubin), lowered, log, arch, options)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
