"""The rawkv runtime: one `Runtime` per CUDA device.

It owns everything between a kernel source in rawkv/cu/ and a launch:

* compilation (NVRTC, for the device's own architecture) and the module cache
  (in memory, and on disk through rawkv._cache): one module per kernel
  instance, so a first call compiles only what it launches, and `warmup()`
  compiles every instance in parallel (rawkv._compile);
* launching on PyTorch's current stream (or a stream the caller passes), so
  rawkv kernels order with torch work and are captured by torch.cuda.graph;
* the capture rules: nothing is compiled, loaded or allocated while the stream
  is capturing (CaptureError instead); `warmup()` loads everything first;
* launch geometry, derived from the problem size and the device's properties;
* running an op's launch plan (rawkv._plan: launches and memsets, in order);
* the device's error counters, a small int32 buffer the kernels add the bad
  inputs they meet to (the families name its slots: rawkv.nvfp4.counters).

Ops never import CuPy or torch themselves at module import time: `import
rawkv` touches no CUDA API and works on a machine with no GPU.

Launch cost: kernels are CuPy `Function`s (loaded from the verified cubin
bytes). Each kernel's declaration (rawkv.kernels) packs its keyword
arguments into 8-byte slots by their C types with one struct call, and the
launcher (rawkv._launch) calls cuLaunchKernel through CuPy's Cython driver
binding on the raw stream handle. A torch tensor is never converted through
DLPack on this path.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import os
import re
import threading
from typing import Iterable

from . import _cache, _compile, _launch, _plan, _version, kernels
from ._args import callers_stream, check_stream, stream_device
from ._plan import Launch, Memset
from .errors import CaptureError, GpuUnavailableError

#: Slots of a device's error counter buffer (Runtime.counters); the op
#: families name them (rawkv.nvfp4.counters).
COUNTER_SLOTS = 3

# ---------------------------------------------------------------------------
# Kernel registry: rawkv.kernels declares every kernel (plain Python, no
# CUDA); the runtime reads the declarations and imports no op module.
# ---------------------------------------------------------------------------
def registered_kernels() -> dict[str, tuple[str, ...]]:
    """{filename: name expressions} for every kernel rawkv declares."""
    return kernels.registered_kernels()


# Device state an op family must have before a graph is captured (error
# counters, say): families register a function of the Runtime here, the
# runtime calls each from warmup() and knows nothing of what they create.
_WARMUP_HOOKS: list = []


def on_warmup(fn) -> None:
    """Have `warmup()` call fn(runtime) after loading the kernels."""
    if fn not in _WARMUP_HOOKS:
        _WARMUP_HOOKS.append(fn)


def kernel_options(filename: str) -> tuple[str, ...]:
    """The extra NVRTC options of a kernel file (its shared constants)."""
    kf = kernels.files().get(filename)
    return kf.options() if kf is not None else ()


def compile_arch(filename: str, arch: str) -> str | None:
    """The architecture a kernel file is compiled for on a device of `arch`
    (sm_90a for a wgmma file on an H100), or None when it is not built there."""
    kf = kernels.files().get(filename)
    return kf.target(arch) if kf is not None else arch


def instances_for(arch: str, files: Iterable[str] | None = None,
                  instances: Iterable | None = None) -> list[tuple[str, str]]:
    """(filename, name expression) of every kernel instance built on a
    device of `arch` (what warmup() loads), of `files` only when given (a
    file not declared is a KeyError naming it). `instances`: exactly these
    instead (rawkv.kernels instances, or (filename, name expression)
    pairs; with `files` too, both), in order, each once: one that is not
    declared, or whose file is not built for `arch`, is a KeyError naming
    it (a caller's list must name what it launches, not be cut silently).
    A str (or path) for `files`, one instance or pair for `instances`, or
    an element of `instances` that is neither (a Kernel) is a TypeError
    naming the argument."""
    registry = registered_kernels()
    if isinstance(files, (str, bytes, os.PathLike)):
        # (iterated, "fp8.cu" was the files "f", "p", ...: a KeyError naming "f")
        raise TypeError(f"files: expected a list of .cu file names, got {files!r} (pass [{files!r}])")
    if instances is not None and (isinstance(instances, (str, bytes)) or hasattr(instances, "key")
                                  or _is_pair(instances)):
        raise TypeError(f"instances: expected a list of kernel instances or (file, name expression) "
                        f"pairs, got one: {instances!r} (pass [{instances!r}])")
    out = []
    if files is not None or instances is None:
        for filename in (registry if files is None else files):
            if filename not in registry:
                raise KeyError(f"rawkv: no kernels are registered for {filename}")
            if compile_arch(filename, arch) is not None:   # else: another architecture's instructions
                out.extend((filename, name) for name in registry[filename])
    for inst in instances or ():
        pair = getattr(inst, "key", inst)
        if not _is_pair(pair):
            raise TypeError(f"instances: expected kernel instances (Kernel.instance(...)) or (file, name "
                            f"expression) pairs, got {inst!r}")
        filename, name = pair                   # (a list pair, as from JSON, as a tuple below)
        if name not in registry.get(filename, ()):
            raise KeyError(f"rawkv: kernel instance {name!r} is not registered for {filename}")
        if compile_arch(filename, arch) is None:
            raise KeyError(f"rawkv: kernel instance {name!r}: {filename} is not built for {arch}")
        out.append((filename, name))
    return list(dict.fromkeys(out))


def _is_pair(v) -> bool:
    """A (filename, name expression) pair of strings: a tuple, or a list
    (a JSON round trip of instances_for's list gives lists; taken before
    the wrong-shape checks, as any two-item iterable was unpacked)."""
    return isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, str) for x in v)


# Shared memory (static and dynamic) a launch may take without raising the
# kernel's dynamic limit.
_DEFAULT_SMEM_LIMIT = 48 * 1024


# ---------------------------------------------------------------------------
# The GPU stack, imported lazily, with one clear error when any of it is missing.
# ---------------------------------------------------------------------------
def _gpu_stack():
    """(cupy, torch), once both import and torch sees a CUDA device. Otherwise
    one GpuUnavailableError listing everything that is missing: this runs
    before any torch.cuda call, since those fail with a bare AssertionError on
    a CPU-only torch."""
    problems = []
    try:
        import cupy
    except ImportError:
        cupy = None
        problems.append("CuPy is not installed (pip install 'rawkv[cu12]' or 'rawkv[cu13]')")
    try:
        import torch
    except ImportError:
        torch = None
        problems.append("PyTorch is not installed (pip install torch)")
    else:
        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} was built without CUDA "
                            "(install a CUDA build of torch)")
        elif not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) "
                            "finds no CUDA GPU or driver")
    if problems:
        raise GpuUnavailableError(
            "rawkv GPU ops cannot run: " + "; ".join(problems) +
            ". CPU tensors and numpy arrays run the numpy reference instead.")
    return cupy, torch


def arch_for(compute_capability) -> str:
    """The architecture the runtime compiles for on a GPU of this compute
    capability: sm_<major><minor> (sm_100 on a B200). The compile-check
    includes every arch this gives on the GPUs rawkv supports."""
    major, minor = compute_capability
    return "sm_%d%d" % (major, minor)


class _StreamHandle:
    """Minimal CUDA stream protocol object for cupy.cuda.Stream.from_external."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _cupy_stream(cupy, ptr: int, device_id: int):
    """A CuPy stream of handle `ptr` on device `device_id`, which must be
    current: Stream.from_external takes its device from the current one."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)  # CuPy < 14


def refuse_other_device(d, device_index: int) -> None:
    """A stream given to an op on cuda:N must be a stream of cuda:N (`d`:
    stream_device's, None taken): a kernel launched in cuda:N's context on
    another device's stream fails at the driver, after the plan's earlier
    memsets ran (a memset on another device's stream succeeds), and the
    torch work an op runs on its stream (`torch.cuda.stream(...)`) went to
    the tensors' device's current stream instead. A ValueError naming
    stream, before anything is launched or written. (An int handle carries
    no device: it is the caller's to match.)"""
    if d is not None and d != device_index:
        raise ValueError(f"stream: is a stream of cuda:{d} but the op runs on cuda:{device_index} (its "
                         f"tensors' device); pass a stream of cuda:{device_index}")


_runtimes: dict[int, "Runtime"] = {}
_runtimes_lock = threading.Lock()


def _device_index(device):
    """The CUDA device index `device` names: an int, 'cuda' / 'cuda:N', or a
    torch.device of type cuda; None (and 'cuda' without an index) means
    torch's current device. Anything else is refused, naming the argument."""
    if device is None:
        return None
    typ = getattr(device, "type", None)
    if isinstance(typ, str):                    # torch.device
        if typ != "cuda":
            raise ValueError(f"device: rawkv GPU ops run on a CUDA device, got {device}")
        return device.index
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device: expected a CUDA device index >= 0, got {device}")
        return int(device)
    if isinstance(device, str):
        m = re.fullmatch(r"cuda(?::(\d+))?", device.strip())
        if m is None:
            raise ValueError(f"device: expected 'cuda' or 'cuda:N', got {device!r}")
        return None if m.group(1) is None else int(m.group(1))
    raise TypeError(f"device: expected an int, 'cuda:N' or a torch.device, got {type(device).__name__}")


def get_runtime(device=None) -> "Runtime":
    """The Runtime of a CUDA device (an index, 'cuda:N', a torch.device, or
    None for torch's current device). Created on first use; raises
    GpuUnavailableError when the GPU stack is missing."""
    rt = _runtimes.get(device) if type(device) is int else None
    if rt is not None:          # the hot path: ops pass x.get_device()
        return rt
    index = _device_index(device)
    rt = _runtimes.get(index) if index is not None else None
    if rt is not None:
        return rt
    torch = _gpu_stack()[1]
    if index is None:
        index = torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device: cuda:{index} does not exist ({count} CUDA device(s))")
    with _runtimes_lock:
        rt = _runtimes.get(index)
        if rt is None:
            rt = _runtimes[index] = Runtime(index)
    return rt


def warmup(device=None, files: Iterable[str] | None = None, instances: Iterable | None = None) -> "Runtime":
    """Compile (or load from the disk cache) every rawkv kernel for a device,
    so that nothing has to be compiled while a CUDA graph is being captured.
    `files` / `instances`: only those (instances_for), for a caller that
    knows what it launches (python -m rawkv demo)."""
    rt = get_runtime(device)
    rt.warmup(files, instances)
    return rt


# The oldest CUDA driver (cudaDriverGetVersion) whose stream capture records a
# programmatic dependent launch as a graph edge.
PDL_MIN_DRIVER = 12030

_SWITCH = {"0": False, "false": False, "off": False, "no": False,
           "": True, "1": True, "true": True, "on": True, "yes": True}


def pdl_allowed() -> bool:
    """$RAWKV_PDL as a switch (docs/runtime.md): unset, 1 / true / on / yes
    allow the programmatic dependent launch, 0 / false / off / no turn it
    off (any case, spaces around); anything else is a ValueError naming it,
    not a launch mode chosen for a typo."""
    env = os.environ.get("RAWKV_PDL", "")
    on = _SWITCH.get(env.strip().lower())
    if on is None:
        raise ValueError(f"RAWKV_PDL: expected 0 or 1 (false / true, off / on, no / yes), got {env!r}")
    return on


class Runtime:
    """Compilation, module cache, streams, capture rules and launch geometry
    for one CUDA device. Use `get_runtime()`; do not construct directly."""

    def __init__(self, device_index: int):
        cupy, torch = _gpu_stack()
        self._cupy = cupy
        self._torch = torch
        self.device_index = int(device_index)
        props = cupy.cuda.runtime.getDeviceProperties(self.device_index)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.compute_capability = (int(props["major"]), int(props["minor"]))
        self.arch = arch_for(self.compute_capability)
        self.sm_count = int(props["multiProcessorCount"])
        self.max_threads_per_sm = int(props["maxThreadsPerMultiProcessor"])
        self.l2_bytes = int(props["l2CacheSize"])
        self.stats = {"compiles": 0, "disk_hits": 0, "damaged": 0, "modules": 0}
        self._modules: dict[tuple[str, str], object] = {}     # (filename, name expression)
        self._functions: dict[tuple[str, str], object] = {}
        self._streams: dict[int, object] = {}
        self._counters = None       # the error counters (counters()), created on first use
        self._lock = threading.Lock()
        self._get_device = cupy.cuda.runtime.getDevice
        # torch.cuda.device's own switch (torch >= 2.1); plain cudaSetDevice where absent
        set_device = cupy.cuda.runtime.setDevice
        self._exchange_device = getattr(torch.cuda, "_exchange_device", None) or (
            lambda d: (self._get_device(), set_device(d))[0])
        self._maybe_exchange_device = getattr(torch.cuda, "_maybe_exchange_device", None) or (
            lambda d: (self._get_device(), set_device(d))[0])
        # Programmatic dependent launch for the kernels declared `pdl`, on
        # sm_90+ devices with a driver whose graph capture records it (CUDA
        # 12.3+); RAWKV_PDL=0 turns it off (docs/runtime.md; read on every
        # device, so a bad value is refused wherever it is set).
        pdl = (pdl_allowed() and self.compute_capability >= (9, 0)
               and cupy.cuda.runtime.driverGetVersion() >= PDL_MIN_DRIVER)
        self._launcher = _launch.Launcher(pdl=_launch.pdl_launch() if pdl else None)
        self._launch_call = self._plain_launch_call = self._launcher.__call__   # bound method: cheaper than calling the instance
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            self._current_stream_ptr = functools.partial(raw, self.device_index)  # C-level call
        else:
            self._current_stream_ptr = lambda: torch.cuda.current_stream(self.device_index).cuda_stream

    def __repr__(self):
        return f"<rawkv.Runtime cuda:{self.device_index} {self.name} {self.arch} SMs={self.sm_count}>"

    # -- compilation and module cache ------------------------------------
    def function(self, filename: str, name: str, stream=None):
        """The CuPy Function for kernel `name` of rawkv/cu/<filename>.
        `stream` is the stream the op will launch on: loading is refused
        while it (or torch's current stream) is capturing."""
        fn = self._functions.get((filename, name))
        if fn is None:
            fn = self._load_function(filename, name, stream)
        return fn

    def _load_function(self, filename: str, name: str, stream=None):
        if self.capturing(stream):
            raise CaptureError(
                f"rawkv: kernel {name!r} ({filename}) is not loaded yet and the stream is "
                "capturing a CUDA graph; call rawkv.warmup() before capture")
        with self._lock:
            if (filename, name) not in self._functions:
                if name not in registered_kernels().get(filename, ()):
                    raise KeyError(f"rawkv: kernel {name!r} is not registered for {filename}")
                self._load([(filename, name)])
            return self._functions[(filename, name)]

    def _load(self, instances: list[tuple[str, str]]) -> None:
        """Compile (or read from the disk cache) and load one module per
        (filename, name expression), in parallel (rawkv._compile.build).
        Called with self._lock held."""
        entries = []
        sources = _cache.sources_digest()       # one hash of rawkv/cu for every key
        for filename, name in instances:
            arch = compile_arch(filename, self.arch)
            if arch is None:
                raise KeyError(f"rawkv: {filename} is not built for {self.arch}")
            entries.append(_cache.Entry(filename, arch, (name,), kernel_options(filename),
                                        _version.__version__, sources))
        results = _compile.build(entries, self.arch, stats=self.stats)
        for (filename, name), result in zip(instances, results):
            self._load_instance(filename, name, result)

    def _load_instance(self, filename: str, name: str, result) -> None:
        """Load one instance's verified cubin and keep its function, with
        its dynamic shared memory limit raised where it needs more than the
        default."""
        cupy = self._cupy
        # The cache file is a checksummed container, not a bare cubin: load
        # the verified image bytes through CuPy's module loader (the one
        # RawModule uses underneath).
        prev = self._make_current()
        try:
            module = cupy.cuda.function.Module()
            module.load(result.cubin)
            fn = module.get_function(result.lowered[name])
            smem = kernels.dynamic_smem(filename, name)
            if smem:
                # The 48 KB a launch may take without opting in counts the
                # kernel's static shared memory too: an instance of 46 KB
                # dynamic and 4 KB static failed to launch (invalid argument).
                drv = cupy.cuda.driver
                static = drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
                if smem + static > _DEFAULT_SMEM_LIMIT:
                    drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        finally:
            self._restore_current(prev)
        self._modules[(filename, name)] = module
        self._functions[(filename, name)] = fn
        self.stats["modules"] += 1

    def warmup(self, files: Iterable[str] | None = None, instances: Iterable | None = None) -> None:
        """Every kernel instance of `files` (default: all; or exactly
        `instances`: instances_for) built for this device and loaded, their
        launch side prepared, the warm-up hooks run: after it nothing needs
        compiling, loading or allocating before a capture. The instances not
        loaded yet are compiled in parallel, with a progress line on stderr
        when it takes a while."""
        wanted = instances_for(self.arch, files, instances)
        with self._lock:
            todo = [i for i in wanted if i not in self._functions]
            if todo:
                if self.capturing():
                    raise CaptureError(
                        f"rawkv: warmup() would load {len(todo)} kernel(s) while the stream is "
                        "capturing a CUDA graph; call rawkv.warmup() before capture")
                self._load(todo)
        for filename in dict.fromkeys(f for f, _ in wanted):
            # The launch side too: each instance's packing, read from the
            # source, and its launch function, before any capture.
            kernels.prepare(filename)
        self.stream()  # the current stream's CuPy handle too
        for hook in _WARMUP_HOOKS:
            hook(self)

    @contextlib.contextmanager
    def recording(self):
        """Within the block, every launch on this runtime (eager or being
        captured) adds its instance's (filename, name expression) to the set
        it yields, and is made as usual: how a caller holds a list of the
        instances it warms up against what it launched. Not for the hot
        path: a Python call more per launch while it lasts."""
        seen: set = set()
        call = self._launch_call

        def record(fn, grid, block, st, args, shared_mem, ptr, what=None):
            seen.add(getattr(what, "key", None))     # None: a launch without a declaration
            call(fn, grid, block, st, args, shared_mem, ptr, what)

        self._launch_call = record
        try:
            yield seen
        finally:
            self._launch_call = call

    # -- streams and capture ------------------------------------------------
    def stream_ptr(self, stream=None) -> int:
        """Raw cudaStream_t of `stream` (a torch/CuPy stream or an int), or of
        torch's current stream on this device. A torch or CuPy stream of
        another device is a ValueError naming stream (refuse_other_device)."""
        if stream is None:
            return self._current_stream_ptr()
        attr = check_stream(stream)         # (the rule the ops apply on CPU too: a bool is refused)
        if attr is None:
            return stream
        d = stream_device(stream)
        if d is not None:
            refuse_other_device(d, self.device_index)
        return int(getattr(stream, attr))

    def torch_stream(self, stream=None):
        """`stream` as a torch stream, for torch ops that must run on an op's
        stream (`with torch.cuda.stream(...)`): None stays None (torch's
        current stream), a torch stream as it is, a CuPy stream or raw handle
        wrapped as a torch.cuda.ExternalStream of this device."""
        torch = self._torch
        if stream is None:
            return stream
        if isinstance(stream, torch.cuda.Stream):
            refuse_other_device(stream_device(stream), self.device_index)
            return stream
        return torch.cuda.ExternalStream(self.stream_ptr(stream), device=f"cuda:{self.device_index}")

    def stream(self, stream=None):
        """The CuPy stream object for `stream` (default: torch's current)."""
        return self.cupy_stream(self.stream_ptr(stream))

    def cupy_stream(self, ptr: int):
        """The CuPy stream of handle `ptr` of this device (cached): made
        with this device current, which CuPy takes as the stream's device."""
        s = self._streams.get(ptr)
        if s is None:
            prev = self._make_current()
            try:
                s = self._streams[ptr] = _cupy_stream(self._cupy, ptr, self.device_index)
            finally:
                self._restore_current(prev)
        return s

    def capturing(self, stream=None) -> bool:
        """True if torch's current stream or `stream` (the one an op was
        given) is capturing a CUDA graph: the capture rules look at both.
        While an op's body runs on its stream= (made torch's current one:
        _args.stream_current), "torch's current stream" is the caller's,
        which that context remembers."""
        if self.is_capturing():
            return True
        caller = callers_stream()
        if caller is not None and caller.device.index == self.device_index and \
                self.is_capturing(caller.cuda_stream):
            return True
        return stream is not None and self.is_capturing(stream)

    def is_capturing(self, stream=None) -> bool:
        if stream is None:
            with self._torch.cuda.device(self.device_index):
                return bool(self._torch.cuda.is_current_stream_capturing())
        status = self._cupy.cuda.runtime.streamIsCapturing(self.stream_ptr(stream))
        return bool(status)

    # -- launch -------------------------------------------------------------
    def launch(self, fn, grid, block, st, args, stream=None, shared_mem: int = 0, what=None) -> None:
        """Launch `fn` on torch's current stream (or `stream`) with `args`
        packed by the struct `st` (from the kernel's declaration; `what`
        names the kernel in errors). The device is made current if it is not."""
        ptr = self._current_stream_ptr() if stream is None else self.stream_ptr(stream)
        cur = self._get_device()
        if cur == self.device_index:
            self._launch_call(fn, grid, block, st, args, shared_mem, ptr, what)
            return
        # the kernel lives in this device's context: make it current
        prev = self._make_current()
        try:
            self._launch_call(fn, grid, block, st, args, shared_mem, ptr, what)
        finally:
            self._restore_current(prev)

    def memset(self, ptr: int, value: int, nbytes: int, stream=None) -> None:
        """cudaMemsetAsync on the launch stream (capturable as a memset node),
        with this device current, as launch() does."""
        sptr = self.stream_ptr(stream)
        memset = self._cupy.cuda.runtime.memsetAsync
        cur = self._get_device()
        if cur == self.device_index:
            memset(ptr, value, nbytes, sptr)
            return
        prev = self._make_current()
        try:
            memset(ptr, value, nbytes, sptr)
        finally:
            self._restore_current(prev)

    def run(self, plan, stream=None) -> None:
        """Run launch plan `plan` (rawkv._plan: Launch, Memset, Fill) in
        order on `stream` (default: torch's current), each launch with its
        instance's dynamic shared memory."""
        for step in plan:
            cls = step.__class__
            if cls is Launch:
                k = step.kernel
                k.launch(self, step.grid, step.block, stream=stream, shared_mem=k.smem, **step.args)
            elif cls is Memset:
                self.memset(step.dst.data_ptr(), 0, step.nbytes, stream)
            else:
                with self._torch.cuda.stream(self.torch_stream(stream)):
                    step.dst.fill_(step.value)

    def _make_current(self) -> int:
        """Make this device current for a launch, load or memset on it;
        returns the previous device for _restore_current."""
        return self._exchange_device(self.device_index)

    def _restore_current(self, prev: int) -> None:
        """Back to `prev` the way torch.cuda.device restores it: a device
        whose context does not exist yet is not made current (cudaSetDevice
        would create a context there: a worker owning GPU 1 would take
        memory on GPU 0)."""
        self._maybe_exchange_device(prev)

    # -- allocation ---------------------------------------------------------
    def empty(self, shape, dtype, stream=None):
        """A new torch tensor on this device; refused while capturing (torch's
        current stream or `stream`), since a captured step must write into
        buffers the caller owns (out=)."""
        if self.capturing(stream):
            raise CaptureError(
                "rawkv: this op would allocate its output while the stream is capturing "
                "a CUDA graph; pass out= buffers allocated before capture")
        device = f"cuda:{self.device_index}"
        if stream is not None and self.stream_ptr(stream) != self._current_stream_ptr():
            # The caching allocator ties a block to the stream current at
            # allocation: allocate on the op's stream, so the block is not
            # handed to other work while the kernel may still write it.
            with self._torch.cuda.stream(self.torch_stream(stream)):
                return self._torch.empty(tuple(shape), dtype=dtype, device=device)
        return self._torch.empty(tuple(shape), dtype=dtype, device=device)

    # -- error counters -----------------------------------------------------
    def counters(self, stream=None):
        """This device's error counters: an int32 tensor of COUNTER_SLOTS,
        zeroed, created by warmup() or on first use, which is refused while
        `stream` (or torch's current one) is capturing a CUDA graph. Kernels
        add to them with atomics; the caller reads and zeroes them."""
        c = self._counters
        return c if c is not None else self._create_counters(stream)

    def counter(self, slot: int, stream=None) -> int:
        """Device address of error counter `slot`, for a kernel's errors
        pointer (counters())."""
        c = self._counters
        if c is None:
            c = self._create_counters(stream)
        return c.data_ptr() + 4 * slot

    def _create_counters(self, stream):
        if self.capturing(stream):
            raise CaptureError(
                f"rawkv: the error counters of cuda:{self.device_index} do not exist yet and the "
                "stream is capturing a CUDA graph; call rawkv.warmup() before capture")
        torch = self._torch
        with self._lock:
            if self._counters is None:
                c = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=f"cuda:{self.device_index}")
                # zeroed before any stream's kernel adds to them (once per device)
                torch.cuda.synchronize(self.device_index)
                self._counters = c
        return self._counters

    # -- launch geometry ----------------------------------------------------
    def resident_blocks(self, block: int) -> int:
        """How many blocks of `block` threads fill every SM once (_plan.resident_blocks)."""
        return _plan.resident_blocks(self, block)

    def grid_stride(self, work_items: int, block: int = 256, waves: int = 2) -> tuple[int, int]:
        """(grid, block) for a grid-stride loop over `work_items` on this
        device (_plan.grid_stride)."""
        return _plan.grid_stride(self, work_items, block, waves)
