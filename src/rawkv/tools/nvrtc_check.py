"""Compile every rawkv kernel with NVRTC for several architectures, no GPU needed.

    python -m rawkv.tools.nvrtc_check [--arch sm_90 ...] [--max-spill-bytes 0]

For each .cu file and architecture: compiles all registered kernels (exactly
as the runtime does: the same options and the file's -D constants, plus
-Xptxas=-v) and prints, per kernel, the registers,
shared memory, stack frame and spill bytes that ptxas reports, or the
compiler error with file and line. Exits 1 on any compile error, on a
registered kernel ptxas reported nothing for, on spills above
--max-spill-bytes, on a kernel whose wgmmas ptxas serialized (its C7514
note), or when there is nothing to check (an unknown --file);
2 when NVRTC itself is unavailable, and on a bad command line (an --arch not
in the list below, a negative --max-spill-bytes).

NVRTC 12.9 and later keep compiled programs in the CUDA compute cache, and a
program served from it runs no ptxas, so its log has no report: the check
compiles with CUDA_CACHE_DISABLE=1 in its environment (set for the whole
check: the variable is NVRTC's and the process's, not per program).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

# What the runtime builds on each GPU rawkv supports (runtime.arch_for:
# A100, L40/RTX 4090, H100/H200, B200, RTX 5090), plus sm_100a (B200 with
# its arch-specific features): the default, and every --arch the tool takes.
DEFAULT_ARCHS = ("sm_80", "sm_89", "sm_90", "sm_100", "sm_100a", "sm_120")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
# ptxas's note that it made a kernel's wgmmas wait for each other (C7514 /
# C7515 ...: "wgmma.mma_async instructions are serialized due to ..."): a
# Hopper kernel that compiles clean and runs several times slower.
_SERIAL = re.compile(r"wgmma\.mma_async instructions are serialized.*function '([^']+)'")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """{mangled name: {registers, smem, stack, spill_stores, spill_loads}, and
    serialized: 1 where ptxas made the kernel's wgmmas wait for each other}."""
    out: dict[str, dict[str, int]] = {}
    current = None
    serialized = set()
    for line in log.splitlines():
        m = _SERIAL.search(line)
        if m:
            serialized.add(m.group(1))
            continue
        m = _ENTRY.search(line)
        if m:
            current = out.setdefault(m.group(1), {"registers": 0, "smem": 0, "stack": 0,
                                                  "spill_stores": 0, "spill_loads": 0})
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            current["smem"] = int(s.group(1)) if s else 0
    for name in serialized:
        out.setdefault(name, {"registers": 0, "smem": 0, "stack": 0, "spill_stores": 0,
                              "spill_loads": 0})["serialized"] = 1
    return out


def kernel_line(filename: str, arch: str, name: str, st, max_spill_bytes: int) -> tuple[bool, str]:
    """(ok, report line) for one kernel; `st` is its parse_ptxas entry, or
    None when ptxas reported nothing for it (a failure: nothing was checked)."""
    where = f"{filename} [{arch}] {name}"
    if st is None:
        return False, (f"FAIL {where}: no ptxas report for this kernel (was it compiled? served "
                       "from the CUDA compute cache? CUDA_CACHE_DISABLE=1)")
    spills = st["spill_stores"] + st["spill_loads"]
    serial = st.get("serialized", 0)
    ok = spills <= max_spill_bytes and not serial
    return ok, (f"{'ok  ' if ok else 'FAIL'} {where}: {st['registers']} regs, {st['smem']} B smem, "
                f"{st['stack']} B stack, {spills} B spills" + (", wgmmas serialized by ptxas" if serial else ""))


def check(archs, max_spill_bytes: int, files=None, jobs: int = 2, out=None) -> int:
    out = out or sys.stdout     # looked up per call, so a redirected stdout is honoured
    from .. import _nvrtc
    from ..errors import CompileError, GpuUnavailableError
    from ..runtime import compile_arch, kernel_options, registered_kernels

    registry = registered_kernels()
    if files:
        unknown = [f for f in files if f not in registry]
        if unknown:
            print(f"nvrtc_check: no kernels are registered for {', '.join(unknown)} "
                  f"(known: {', '.join(sorted(registry))})", file=out)
            return 1
        registry = {f: n for f, n in registry.items() if f in files}
    if not registry or not archs:
        print("nvrtc_check: nothing to check", file=out)
        return 1
    try:
        major, minor = _nvrtc.nvrtc_version()
        _nvrtc.cuda_include_dirs()
    except GpuUnavailableError as exc:
        print(f"nvrtc_check: {exc}", file=out)
        return 2
    print(f"NVRTC {major}.{minor}; {sum(map(len, registry.values()))} kernels in "
          f"{len(registry)} files; archs {' '.join(archs)}", file=out)

    def one(job):
        filename, arch = job
        source = (_nvrtc.CU_DIR / filename).read_text()
        try:
            res = _nvrtc.compile_cu(source, filename, compile_arch(filename, arch), registry[filename],
                                    kernel_options(filename), verbose_ptxas=True)
            return filename, arch, res, None
        except CompileError as exc:
            return filename, arch, None, str(exc)

    cache_was = os.environ.get("CUDA_CACHE_DISABLE")
    os.environ["CUDA_CACHE_DISABLE"] = "1"      # every program through ptxas, so each has its report
    try:
        return _check_all(one, registry, archs, max_spill_bytes, jobs, out)
    finally:
        if cache_was is None:
            os.environ.pop("CUDA_CACHE_DISABLE", None)
        else:
            os.environ["CUDA_CACHE_DISABLE"] = cache_was


def job_order(jobs_list: list) -> list:
    """The (file, arch) compiles, the files built for the fewest
    architectures first, in registry order otherwise. Those are the wgmma
    files (sm_90 only), one job each and the longest ones: gemm_fp4_sm90.cu
    took 190 s of a 600 s check on a 2-core machine (2026-11-27) and, started
    last, ran alone for its last 150 s; started first, it overlaps the
    six-architecture files' jobs (about 525 s in all)."""
    builds = {}
    for f, _ in jobs_list:
        builds[f] = builds.get(f, 0) + 1
    return sorted(jobs_list, key=lambda job: builds[job[0]])      # (stable: registry order within)


def _check_all(one, registry, archs, max_spill_bytes: int, jobs: int, out) -> int:
    """Compile every (file, arch) with `one` and print each kernel's line;
    1 if anything failed, else 0."""
    from ..runtime import compile_arch
    # A file of one architecture's own instructions is checked where it is built.
    jobs_list = job_order([(f, a) for f in registry for a in archs if compile_arch(f, a) is not None])
    failures = 0
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for filename, arch, res, err in pool.map(one, jobs_list):
            if err is not None:
                failures += 1
                print(f"FAIL {filename} [{arch}]\n{err}", file=out)
                continue
            stats = parse_ptxas(res.log)
            # Every registered kernel must have a report; kernels of the file
            # that are not registered are reported too (they are in the cubin).
            lines = [(name, stats.pop(res.lowered.get(name), None)) for name in registry[filename]]
            lines += sorted(stats.items())
            for name, st in lines:
                ok, line = kernel_line(filename, arch, name, st, max_spill_bytes)
                failures += not ok
                print(line, file=out)
    print(f"nvrtc_check: {'FAILED (' + str(failures) + ')' if failures else 'all ok'}", file=out)
    return 1 if failures else 0


def _spill_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line (no usage block) and exit code 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    p = _Parser(prog="rawkv-nvrtc-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", choices=DEFAULT_ARCHS, metavar="ARCH",
                   help=f"architecture (repeatable): one of {' '.join(DEFAULT_ARCHS)}; default all")
    p.add_argument("--file", action="append", help="only this .cu file (repeatable)")
    p.add_argument("--max-spill-bytes", type=_spill_bytes, default=0,
                   help="fail above this many spill bytes, >= 0 (default 0)")
    p.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2)")
    a = p.parse_args(argv)
    return check(tuple(a.arch or DEFAULT_ARCHS), a.max_spill_bytes, a.file, a.jobs)


if __name__ == "__main__":
    sys.exit(main())
