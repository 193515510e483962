"""The launcher: the Python -> cuLaunchKernel step, kept as cheap as possible.

A kernel's declaration (rawkv.kernels) gives the struct that packs its
arguments, one 8-byte slot per parameter in the parameter's C type. A launch
packs them with one `pack_into` into a per-thread slot array and calls
cuLaunchKernel through CuPy's Cython driver binding
(`cupy.cuda.driver.launchKernel`: plain C integer arguments, no objects built
per call) on the raw stream handle, with an array of pointers to the slots as
kernelParams. The driver copies the values at the call, so CUDA graphs
capture them. Other ways to launch (cuda-python bindings, ctypes, CuPy's
Function call) measured slower (docs/runtime.md) and are not in the product.
"""
from __future__ import annotations

import ctypes
import struct
import threading

# Slots per thread: the widest kernel, rkv_kv_compress, takes 47 parameters
# (tests/guards/test_kernel_abi.py holds every kernel to this).
MAX_ARGS = 64


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


def describe_bad_argument(what, args, exc) -> str:
    """Which argument of a launch could not be packed, named by the kernel's
    declaration (`what`: an Instance) when there is one."""
    params = getattr(getattr(what, "kernel", None), "params", None)
    if params is not None:
        for p, a in zip(params, args):
            try:
                struct.pack("<" + p.slot, a)
            except struct.error:
                return f"{what.expr}: argument {p.name} ({p.ctype}) cannot take {a!r}"
    return f"kernel arguments could not be packed: {exc}"


class Launcher:
    """Each thread owns MAX_ARGS 8-byte value slots and a void* array
    pointing at them, built once (the binding releases the GIL during the
    call, so another thread must not rewrite slots the driver is reading)."""

    name = "cupy-driver"

    def __init__(self, raw=None):
        if raw is None:
            import cupy
            raw = cupy.cuda.driver.launchKernel   # raises CUDADriverError itself
        self._raw = raw
        self._tls = threading.local()

    def _new_slots(self):
        vals = (ctypes.c_uint64 * MAX_ARGS)()
        base = ctypes.addressof(vals)
        ptrs = (ctypes.c_void_p * MAX_ARGS)(*[base + 8 * i for i in range(MAX_ARGS)])
        slots = self._tls.slots = (memoryview(vals).cast("B"), ctypes.addressof(ptrs), vals, ptrs)
        return slots

    def __call__(self, fn, grid, block, st, args, shared_mem, stream_ptr, what=None):
        try:
            slots = self._tls.slots
        except AttributeError:
            slots = self._new_slots()
        try:
            st.pack_into(slots[0], 0, *args)
        except struct.error as exc:
            raise TypeError(describe_bad_argument(what, args, exc)) from None
        if type(grid) is tuple and type(block) is tuple and len(grid) == 1 and len(block) == 1:
            err = self._raw(fn.ptr, grid[0], 1, 1, block[0], 1, 1, shared_mem, stream_ptr, slots[1], 0)
        else:
            gx, gy, gz = dim3(grid)
            bx, by, bz = dim3(block)
            err = self._raw(fn.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr, slots[1], 0)
        if err:
            raise LaunchError(f"cuLaunchKernel failed: error {err}")
