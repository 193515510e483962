"""Building many kernel modules at once: the disk cache first, then what it
lacks compiled with NVRTC in parallel threads, with one progress line.

The runtime compiles one module per kernel instance (a template
instantiation): a first call compiles only the instance it launches, and
`warmup()` hands every instance of the device to `build`, which spreads the
compiles over the CPU's cores. cuda-python's nvrtcCompileProgram releases
the GIL and NVRTC compiles separate programs concurrently, so threads
suffice (no worker processes to start, nothing to pickle); each compile
writes its own cache file. A compile gives the same cubin bytes whichever
thread runs it (tests/runtime/test_compile.py).

Nothing here touches CUDA: it runs, and is tested, on a machine with no GPU.
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from . import _cache, _nvrtc

#: Seconds a build may run before the progress line appears: a warm start
#: (everything from the disk cache) or one small kernel prints nothing.
PROGRESS_DELAY_S = 1.0
# How often the line is refreshed while compiles run.
_TICK_S = 0.25


def compile_threads() -> int:
    """Threads a build compiles with: $RAWKV_COMPILE_JOBS, else the CPUs
    this process may run on. A bad value is a ValueError naming it."""
    env = os.environ.get("RAWKV_COMPILE_JOBS")
    if env is not None and env.strip():
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"RAWKV_COMPILE_JOBS: expected an integer >= 1, got {env!r}")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):       # not Linux
        return max(1, os.cpu_count() or 1)


class Progress:
    """One line on `out` (stderr by default) for a build that outlasts
    `delay` seconds: `rawkv: compiling N kernels for ARCH (T threads): d/N`,
    rewritten in place on a terminal; elsewhere (a log file, a pipe) one
    line when it appears and one at the end, so a log holds no carriage
    returns. Nothing at all for a build that ends sooner, or in a process
    with no stderr (sys.stderr None)."""

    def __init__(self, total: int, arch: str, threads: int, out=None, delay: float = PROGRESS_DELAY_S,
                 clock=time.monotonic):
        self.total, self.arch, self.threads = total, arch, threads
        self.out = out
        self.delay, self.clock = delay, clock
        self.start = clock()
        self.shown = False

    def _stream(self):
        return self.out if self.out is not None else sys.stderr   # looked up late: a redirected stderr

    def _tty(self) -> bool:
        isatty = getattr(self._stream(), "isatty", None)
        try:
            return bool(isatty and isatty())
        except (OSError, ValueError):      # a closed stream
            return False

    def _head(self) -> str:
        s = "" if self.total == 1 else "s"
        t = "" if self.threads == 1 else "s"
        return f"rawkv: compiling {self.total} kernel{s} for {self.arch} ({self.threads} thread{t})"

    def _write(self, text: str) -> None:
        out = self._stream()
        if out is None:            # no stderr at all (started without fd 2, pythonw): no line
            return
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):      # a closed or broken stderr never fails a build
            pass

    def update(self, done: int) -> None:
        """`done` of the total compiled so far."""
        if not self.shown:
            if self.clock() - self.start < self.delay:
                return
            self.shown = True
            if not self._tty():
                self._write(self._head() + " ...\n")
                return
        if self._tty():
            self._write(f"\r{self._head()}: {done}/{self.total}")

    def finish(self, done: int, failed: bool = False) -> None:
        """The end line, when the progress line was shown."""
        if not self.shown:
            return
        s = "" if done == 1 else "s"
        what = f"compiled {done} kernel{s} for {self.arch}"
        if failed:
            what = f"compile failed after {done} of {self.total} kernels for {self.arch}"
        line = f"rawkv: {what} in {self.clock() - self.start:.1f} s"
        self._write(("\r" + line + "\033[K\n") if self._tty() else line + "\n")


def build(entries: list[_cache.Entry], arch: str, stats=None, threads: int | None = None,
          out=None, delay: float = PROGRESS_DELAY_S) -> list[_nvrtc.CompileResult]:
    """The module of each entry, in order: from the disk cache where it
    holds a valid file, the rest compiled in parallel (`threads`, default
    compile_threads()) and written to the cache. `arch` names the device's
    architecture in the progress line. `stats` counts 'disk_hits',
    'damaged' and 'compiles'. The first CompileError is raised once the
    compiles already running have ended (those not started are dropped)."""
    results: list = [None] * len(entries)
    with _cache.CacheDir() as d:
        missing = []
        for i, e in enumerate(entries):
            results[i] = _cache.lookup(e, d, stats)[0]
            if results[i] is None:
                missing.append(i)
        if missing:
            _compile_missing(entries, missing, results, d, arch, stats, threads, out, delay)
    return results


def _compile_missing(entries, missing, results, d, arch, stats, threads, out, delay) -> None:
    """Compile entries[i] for each i in `missing` into results[i], writing
    each to the cache directory `d` from its worker thread."""
    threads = min(len(missing), threads or compile_threads())
    progress = Progress(len(missing), arch, threads, out, delay)

    def work(i):
        r = _cache.compile_entry(entries[i])
        _cache.store(entries[i], r, d)
        return i, r

    done = 0
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rawkv-compile")
    try:
        pending = {pool.submit(work, i) for i in missing}
        while pending:
            finished, pending = wait(pending, timeout=_TICK_S, return_when=FIRST_COMPLETED)
            for f in finished:
                i, r = f.result()          # a CompileError leaves through the finally below
                results[i] = r
                done += 1
                if stats is not None:      # counted here, on one thread
                    stats["compiles"] = stats.get("compiles", 0) + 1
            progress.update(done)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.finish(done, failed=True)
        raise
    pool.shutdown(wait=True)
    progress.finish(done)
