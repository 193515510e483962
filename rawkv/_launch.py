"""Kernel launchers: the Python -> cuLaunchKernel step, kept as cheap as possible.

Two interchangeable implementations, chosen by the Runtime (`RAWKV_LAUNCHER`
= cupy | driver; default cupy, which measured faster on an H100 host: see
bench results `launch_overhead`; driver falls back to cupy if libcuda cannot
be opened through ctypes):

* `DriverLauncher` calls libcuda's cuLaunchKernel through ctypes with
  parameter slots built once per thread: each argument is written into a
  preallocated 8-byte slot (all rawkv kernel scalars are pointers, long long
  or double), and the raw stream handle is passed as is.
* `CupyLauncher` calls the CuPy Function with a cached CuPy stream object.

Both launch on exactly the stream given and are captured by CUDA graphs.
"""
from __future__ import annotations

import ctypes
import struct
import threading

MAX_ARGS = 32
_U64 = 0xFFFFFFFFFFFFFFFF


class LaunchError(RuntimeError):
    pass


class DriverLauncher:
    name = "driver"

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuLaunchKernel
        f.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                      ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        self._launch = f
        self._err_name = lib.cuGetErrorName
        self._err_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._tls = threading.local()

    def _slots(self):
        # Per thread: ctypes releases the GIL during the call, so slots shared
        # between threads could be rewritten while the driver reads them.
        t = self._tls
        vals = getattr(t, "vals", None)
        if vals is None:
            vals = t.vals = (ctypes.c_uint64 * MAX_ARGS)()
            base = ctypes.addressof(vals)
            t.ptrs = (ctypes.c_void_p * MAX_ARGS)(*[base + 8 * i for i in range(MAX_ARGS)])
        return vals, t.ptrs

    def __call__(self, fn, grid, block, args, shared_mem, stream_ptr):
        vals, ptrs = self._slots()
        for i, a in enumerate(args):
            if type(a) is float:
                vals[i] = struct.unpack("<Q", struct.pack("<d", a))[0]
            else:
                vals[i] = a & _U64
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        err = self._launch(fn.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr, ptrs, None)
        if err:
            name = ctypes.c_char_p()
            self._err_name(err, ctypes.byref(name))
            raise LaunchError(f"cuLaunchKernel failed: {name.value.decode() if name.value else err}")


class CupyLauncher:
    name = "cupy"

    def __init__(self, runtime):
        self._rt = runtime

    def __call__(self, fn, grid, block, args, shared_mem, stream_ptr):
        fn(grid, block, args, shared_mem, self._rt.cupy_stream(stream_ptr))
