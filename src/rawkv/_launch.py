"""The launcher: the Python -> cuLaunchKernel step, kept as cheap as possible.

A kernel's declaration (rawkv.kernels) gives the struct that packs its
arguments, one 8-byte slot per parameter in the parameter's C type (a
struct parameter passed by value: as many slots as its size needs, its
fields at their C offsets). A launch packs them with one `pack_into` into a
per-thread slot array and calls cuLaunchKernel through CuPy's Cython driver
binding (`cupy.cuda.driver.launchKernel`: plain C integer arguments, no
objects built per call) on the raw stream handle, with an array of pointers
to the slots as kernelParams: one per slot when every parameter is one
slot, else (a WideStruct) one per parameter, at its first slot. The driver copies the values at the call, so CUDA graphs
capture them. Other ways to launch (cuda-python bindings, ctypes, CuPy's
Function call) measured slower (docs/runtime.md) and are not in the product.
"""
from __future__ import annotations

import ctypes
import struct
import threading

# Slots per thread: the widest kernel, rkv_kv_compress, takes 47 slots
# (tests/guards/test_kernel_abi.py holds every kernel to this).
MAX_ARGS = 64


class WideStruct(struct.Struct):
    """The slot struct of a kernel with a parameter of several slots (a
    struct passed by value): `starts`, each parameter's first slot."""

    def __init__(self, fmt: str, starts: tuple):
        super().__init__(fmt)
        self.starts = starts


def slot_struct(fmt: str, slots: tuple) -> struct.Struct:
    """The struct packing a kernel's parameters (their formats `fmt`, in
    order, `slots` 8-byte slots each): a plain Struct when every parameter
    is one slot (the launcher's pointers are then the slots'), else a
    WideStruct."""
    if all(n == 1 for n in slots):
        return struct.Struct("<" + fmt)
    starts, at = [], 0
    for n in slots:
        starts.append(at)
        at += n
    return WideStruct("<" + fmt, tuple(starts))


class LaunchError(RuntimeError):
    pass


# What the driver takes of a launch's geometry on every CUDA GPU: grid x up
# to 2^31 - 1, y and z up to 65535; a block of at most 1024 threads (z at
# most 64); no dimension 0.
GRID_MAX = (2 ** 31 - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
BLOCK_THREADS = 1024


def launch_failure(what, grid, block, shared_mem, err) -> str:
    """The message of a launch the driver refused (`err`: its error): the
    kernel (`what`, an Instance, names it), the geometry, and any dimension
    outside what every GPU takes (the usual cause of CUDA_ERROR_INVALID_VALUE)."""
    name = getattr(what, "expr", None) or "a kernel"
    out = []
    try:
        g, b = dim3(grid), dim3(block)
        for kind, dims, limits in (("grid", g, GRID_MAX), ("block", b, BLOCK_MAX)):
            out += [f"{kind} {axis} {v} is outside 1..{m}" for axis, v, m in zip("xyz", dims, limits)
                    if not 1 <= v <= m]
        if b[0] * b[1] * b[2] > BLOCK_THREADS:
            out.append(f"a block of {b[0] * b[1] * b[2]} threads is more than {BLOCK_THREADS}")
    except (TypeError, ValueError):
        g, b = grid, block
    return (f"launch of {name} failed (grid {g}, block {b}, {shared_mem} bytes of dynamic shared "
            f"memory): {err}" + "".join(f"; {p}" for p in out))


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
    declaration (`what`: an Instance) when there is one (a struct's field
    as param.field)."""
    params = getattr(getattr(what, "kernel", None), "params", None)
    if params is not None:
        flat = [(p.name, p.ctype, p.slot) if p.fields is None else (f"{p.name}.{f.name}", f.ctype, f.fmt)
                for p in params for f in (p.fields or (None,))]
        for (name, ctype, fmt), a in zip(flat, args):
            try:
                struct.pack("<" + fmt, a)
            except struct.error:
                return f"{what.expr}: argument {name} ({ctype}) cannot take {a!r}"
    return f"kernel arguments could not be packed: {exc}"


# Programmatic dependent launch (docs/runtime.md): cuLaunchKernelEx with
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, for the instances
# declared `pdl` (they wait with griddepcontrol.wait before they read
# anything but their weights) on sm_90+ devices. CuPy's binding has no
# cuLaunchKernelEx; ctypes calls the driver's on a per-thread config.
_PDL_ATTRIBUTE = 6          # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (56 bytes: hStream 8-byte aligned at 32)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


# The same 56 bytes written by one pack_into per launch (the geometry, the
# shared memory, the stream, the attribute array's address and count).
_CONFIG_PACK = struct.Struct("<7I4xQQI4x")


class PdlLaunch:
    """raw(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra) as the
    plain launch takes it, through cuLaunchKernelEx with the programmatic
    stream serialization attribute set; returns the CUresult. Each thread
    owns its config and attribute, built once."""

    def __init__(self, lib=None):
        if lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
        self._fn = lib.cuLaunchKernelEx
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int
        self._tls = threading.local()

    def _config(self):
        attr = _LaunchAttribute()
        attr.id = _PDL_ATTRIBUTE
        attr.value[0] = 1   # programmaticStreamSerializationAllowed
        cfg = _LaunchConfig()
        made = self._tls.made = (memoryview(cfg).cast("B"), ctypes.addressof(cfg), ctypes.addressof(attr), cfg, attr)
        return made

    def __call__(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        try:
            buf, addr, attr, _, _ = self._tls.made
        except AttributeError:
            buf, addr, attr, _, _ = self._config()
        _CONFIG_PACK.pack_into(buf, 0, gx, gy, gz, bx, by, bz, smem, stream, attr, 1)
        return self._fn(addr, f, params, extra or None)


def pdl_launch():
    """The programmatic launch where the driver has cuLaunchKernelEx (CUDA
    12+), else None (the GEMMs then launch as the rest)."""
    try:
        return PdlLaunch()
    except (OSError, AttributeError):
        return None


class Launcher:
    """Each thread owns MAX_ARGS 8-byte value slots and a void* array
    pointing at them, built once (the binding releases the GIL during the
    call, so another thread must not rewrite slots the driver is reading)."""

    name = "cupy-driver"

    def __init__(self, raw=None, pdl=None):
        if raw is None:
            import cupy
            raw = cupy.cuda.driver.launchKernel   # raises CUDADriverError itself
        self._raw = raw
        # The launch of instances declared `pdl` (None: they launch as the rest).
        self._pdl = pdl
        self._tls = threading.local()

    def raw_for(self, what):
        """The driver call that launches instance `what`: the programmatic
        one for a `pdl` instance where there is one, else the plain one."""
        return self._pdl if self._pdl is not None and getattr(what, "pdl", False) else self._raw

    def _new_slots(self):
        vals = (ctypes.c_uint64 * MAX_ARGS)()
        base = ctypes.addressof(vals)
        ptrs = (ctypes.c_void_p * MAX_ARGS)(*[base + 8 * i for i in range(MAX_ARGS)])
        slots = self._tls.slots = (memoryview(vals).cast("B"), ctypes.addressof(ptrs), vals, ptrs, base, {})
        return slots

    @staticmethod
    def _params_at(slots, starts: tuple) -> int:
        """The address of a kernelParams array pointing at slots `starts`
        (each parameter's first), made once per thread and layout."""
        made = slots[5].get(starts)
        if made is None:
            ptrs = (ctypes.c_void_p * len(starts))(*[slots[4] + 8 * i for i in starts])
            made = slots[5][starts] = (ctypes.addressof(ptrs), ptrs)
        return made[0]

    def __call__(self, fn, grid, block, st, args, shared_mem, stream_ptr, what=None):
        try:
            slots = self._tls.slots
        except AttributeError:
            slots = self._new_slots()
        try:
            st.pack_into(slots[0], 0, *args)
        except struct.error as exc:
            raise TypeError(describe_bad_argument(what, args, exc)) from None
        params = slots[1] if st.__class__ is not WideStruct else self._params_at(slots, st.starts)
        raw = self.raw_for(what)
        if type(grid) is tuple and type(block) is tuple and len(grid) == 1 and len(block) == 1:
            try:
                err = raw(fn.ptr, grid[0], 1, 1, block[0], 1, 1, shared_mem, stream_ptr, params, 0)
            except Exception as exc:        # CuPy's binding raises CUDADriverError itself
                raise LaunchError(launch_failure(what, grid, block, shared_mem, exc)) from exc
        else:
            gx, gy, gz = dim3(grid)
            bx, by, bz = dim3(block)
            try:
                err = raw(fn.ptr, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr, params, 0)
            except Exception as exc:
                raise LaunchError(launch_failure(what, grid, block, shared_mem, exc)) from exc
        if err:                             # cuLaunchKernelEx's CUresult
            raise LaunchError(launch_failure(what, grid, block, shared_mem, f"error {err}"))


def bound_launch(rt, fn, grid, block, st, shared_mem: int, what):
    """A launch of `fn` with its geometry fixed, as a function of the
    kernel's parameter values alone (positional, pointers as int
    addresses): `go(*values)` is rt.launch(fn, grid, block, st, values,
    None, shared_mem, what), with the lookups done once. What it binds:
    the runtime's launcher, its device, the kernel's address. It launches
    straight through the driver while the runtime's device is current and
    its launch call is the plain launcher's; otherwise (another device
    current, a recording or a test's spy on rt._launch_call) it takes
    rt.launch. A struct parameter (a WideStruct) is not taken."""
    if isinstance(st, WideStruct):
        raise TypeError(f"{getattr(what, 'expr', 'kernel')}: a bound launch takes no struct parameter")
    plain = getattr(rt, "_plain_launch_call", None)
    if plain is None:               # a runtime without rawkv's launcher (a test's): its own launch
        return lambda *values: rt.launch(fn, grid, block, st, values, None, shared_mem, what)
    launcher = rt._launcher
    tls, new_slots, raw = launcher._tls, launcher._new_slots, launcher.raw_for(what)
    get_device, device, stream_ptr = rt._get_device, rt.device_index, rt._current_stream_ptr
    pack, fptr = st.pack_into, fn.ptr
    (gx, gy, gz), (bx, by, bz) = dim3(grid), dim3(block)

    def go(*values):
        if get_device() != device or rt._launch_call is not plain:
            rt.launch(fn, grid, block, st, values, None, shared_mem, what)
            return
        try:
            slots = tls.slots
        except AttributeError:
            slots = new_slots()
        try:
            pack(slots[0], 0, *values)
        except struct.error as exc:
            raise TypeError(describe_bad_argument(what, values, exc)) from None
        try:
            err = raw(fptr, gx, gy, gz, bx, by, bz, shared_mem, stream_ptr(), slots[1], 0)
        except Exception as exc:
            raise LaunchError(launch_failure(what, grid, block, shared_mem, exc)) from exc
        if err:
            raise LaunchError(launch_failure(what, grid, block, shared_mem, f"error {err}"))
    go.fn = fn          # holds the module: its address stays valid while go lives
    return go
