"""Kernel launchers: the Python -> cuLaunchKernel step, kept as cheap as possible.

Interchangeable implementations, chosen by the Runtime (`RAWKV_LAUNCHER`,
see `LAUNCHERS`; default `DEFAULT`). Measured on two H100 hosts (bench
`launch_overhead`, e4m3_encode n=4096 with out=, interleaved medians, us per
call): cupy-driver 5.97 / 9.96, cupy 6.80 / 11.79, cuda-bindings 7.09 / 11.75,
driver 8.41 / 13.13; torch add_ 5.55 / 8.82; the bare cuLaunchKernel call
alone 3.3 / 4.75.

* `cupy-driver`: cuLaunchKernel through CuPy's Cython driver binding
  (`cupy.cuda.driver.launchKernel`, plain C integer arguments, no objects
  built per call) with a prebuilt parameter array (see `PackedLauncher`).
* `cuda-bindings`: the same through cuda-python's `cuda.bindings.driver`.
* `driver`: the same through libcuda with ctypes (argument conversion in
  ctypes is the slowest of the three; kept for comparison).
* `cupy`: the CuPy `Function` call with a cached CuPy stream object (CuPy
  builds a parameter object per argument per call).

All launch on exactly the stream given and are captured by CUDA graphs (the
driver copies the parameter values at the call).
"""
from __future__ import annotations

import ctypes
import struct
import threading

# the widest kernel, rkv_kv_compress, takes 40; more would fall back to CuPy
MAX_ARGS = 48

LAUNCHERS = ("cupy-driver", "cuda-bindings", "driver", "cupy")
DEFAULT = "cupy-driver"


class LaunchError(RuntimeError):
    pass


def dim3(d) -> tuple[int, int, int]:
    """(x, y, z) of a grid/block given as an int or a 1-3 tuple."""
    if isinstance(d, int):
        return d, 1, 1
    d = tuple(d)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"grid/block: expected 1 to 3 dimensions, got {d}")
    return (d + (1, 1))[:3]


def layout(args):
    """(struct.Struct, float positions) packing `args` into 8-byte slots, or
    None when an argument is not a Python int/float (the caller falls back to
    CuPy, which converts anything it accepts). ints go to int64 slots (kernel
    scalars are long long or pointers; a narrower int parameter reads the low
    bytes, little-endian), floats to double slots."""
    if len(args) > MAX_ARGS:
        return None
    fmt, floats = ["<"], []
    for i, a in enumerate(args):
        if isinstance(a, float):
            fmt.append("d")
            floats.append(i)
        elif isinstance(a, int):
            fmt.append("q")
        else:
            return None
    return struct.Struct("".join(fmt)), tuple(floats)


class PackedLauncher:
    """Shared per-call path of the driver launchers.

    Each thread owns MAX_ARGS 8-byte value slots and a void* array pointing at
    them, built once (the bindings release the GIL during the call, so another
    thread must not rewrite slots the driver is reading). Per kernel the
    argument layout (a struct.Struct) is cached; a call packs the arguments
    with one pack_into and passes the array's address as kernelParams."""

    name = "?"

    def __init__(self, fallback):
        self._fallback = fallback      # CuPy Function call, for unusual arguments
        self._layouts: dict = {}       # CuPy Function -> (f, nargs, Struct, float positions)
        self._tls = threading.local()

    def _new_slots(self):
        vals = (ctypes.c_uint64 * MAX_ARGS)()
        base = ctypes.addressof(vals)
        ptrs = (ctypes.c_void_p * MAX_ARGS)(*[base + 8 * i for i in range(MAX_ARGS)])
        slots = self._tls.slots = (memoryview(vals).cast("B"), ctypes.addressof(ptrs), vals, ptrs)
        return slots

    def _check(self, err):
        raise LaunchError(f"cuLaunchKernel failed: error {err}")

    def _function(self, fn):
        return fn.ptr                  # what the raw call takes as CUfunction

    def _layout(self, fn, args):
        lay = layout(args)
        if lay is None:
            return None
        entry = self._layouts[fn] = (self._function(fn), len(args), lay[0], lay[1])
        return entry

    def __call__(self, fn, grid, block, args, shared_mem, stream_ptr):
        try:
            slots = self._tls.slots
        except AttributeError:
            slots = self._new_slots()
        lay = self._layouts.get(fn)
        if lay is None or lay[1] != len(args) or (lay[3] and not _floats_at(args, lay[3])):
            lay = self._layout(fn, args)
            if lay is None:
                return self._fallback(fn, grid, block, args, shared_mem, stream_ptr)
        try:
            lay[2].pack_into(slots[0], 0, *args)
        except struct.error:           # a float where an int was: new layout
            lay = self._layout(fn, args)
            try:
                lay[2].pack_into(slots[0], 0, *args)
            except (struct.error, TypeError):   # e.g. an int beyond int64: CuPy decides
                return self._fallback(fn, grid, block, args, shared_mem, stream_ptr)
        try:
            one = len(grid) == 1 and len(block) == 1
        except TypeError:              # ints, as CuPy accepts
            one = False
        if one:
            err = self._raw(lay[0], grid[0], 1, 1, block[0], 1, 1, shared_mem, stream_ptr, slots[1], 0)
        else:
            gx, gy, gz = dim3(grid)
            bx, by, bz = dim3(block)
            err = self._raw(lay[0], gx, gy, gz, bx, by, bz, shared_mem, stream_ptr, slots[1], 0)
        if err:
            self._check(err)


def _floats_at(args, positions) -> bool:
    for i in positions:
        if not isinstance(args[i], float):
            return False
    return True


class CupyDriverLauncher(PackedLauncher):
    name = "cupy-driver"

    def __init__(self, fallback):
        super().__init__(fallback)
        import cupy
        self._raw = cupy.cuda.driver.launchKernel   # raises CUDADriverError itself


class BindingsLauncher(PackedLauncher):
    name = "cuda-bindings"

    def __init__(self, fallback):
        super().__init__(fallback)
        from cuda.bindings import driver
        self._drv = driver
        self._streams: dict = {}
        launch = driver.cuLaunchKernel

        def raw(f, gx, gy, gz, bx, by, bz, shm, stream_ptr, params, extra):
            s = self._streams.get(stream_ptr)
            if s is None:
                s = self._streams[stream_ptr] = driver.CUstream(stream_ptr)
            return launch(f, gx, gy, gz, bx, by, bz, shm, s, params, extra)[0]
        self._raw = raw

    def _function(self, fn):
        return self._drv.CUfunction(fn.ptr)

    def _check(self, err):
        _, name = self._drv.cuGetErrorName(err)
        raise LaunchError(f"cuLaunchKernel failed: {name.decode() if name else err}")


class DriverLauncher(PackedLauncher):
    """cuLaunchKernel from libcuda through ctypes."""
    name = "driver"

    def __init__(self, fallback):
        super().__init__(fallback)
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuLaunchKernel
        f.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                      ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        self._raw = f
        self._err_name = lib.cuGetErrorName
        self._err_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def _check(self, err):
        name = ctypes.c_char_p()
        self._err_name(err, ctypes.byref(name))
        raise LaunchError(f"cuLaunchKernel failed: {name.value.decode() if name.value else err}")


class CupyLauncher:
    name = "cupy"

    def __init__(self, runtime):
        self._rt = runtime

    def __call__(self, fn, grid, block, args, shared_mem, stream_ptr):
        fn(grid, block, args, shared_mem, self._rt.cupy_stream(stream_ptr))


def make(name: str, runtime):
    """The launcher called `name` for `runtime` (ValueError for unknown names;
    OSError/ImportError/AttributeError when its library is missing)."""
    cupy_launcher = CupyLauncher(runtime)
    if name == "cupy":
        return cupy_launcher
    if name == "cupy-driver":
        return CupyDriverLauncher(cupy_launcher)
    if name == "cuda-bindings":
        return BindingsLauncher(cupy_launcher)
    if name == "driver":
        return DriverLauncher(cupy_launcher)
    raise ValueError(f"launcher: expected one of {', '.join(LAUNCHERS)}, got {name!r}")
