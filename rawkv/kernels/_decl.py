"""Kernel declarations: each `__global__` function rawkv launches, written
down once in Python beside the other kernels of its `.cu` file.

A declaration names the source file, the template parameters (kind, name and
the values rawkv instantiates), the parameters in order with their C types,
and the compile-time constants the file shares with Python. From it come:

* the NVRTC name expressions the runtime compiles and `warmup()` loads;
* the `-D` options that hand the shared constants to the compiler (so the
  value exists once, here, and the `.cu` file reads the macro);
* the argument packing of a launch: ops pass keyword arguments, the
  declaration orders them and packs each into an 8-byte slot exactly as its
  C type wants it (pointer, 64/32-bit integer, double, float);
* what tests/test_kernel_abi.py holds against the `.cu` sources, so a
  swapped or retyped parameter fails on a CPU, not on a GPU.

Nothing here imports torch, CuPy or the runtime: `import rawkv` stays
GPU-free and the runtime imports this package, never an op module.
"""
from __future__ import annotations

import itertools
import struct
from typing import Iterable, Sequence

# Slot format of each C scalar type (little-endian, one 8-byte slot per
# parameter: the launcher passes an array of pointers to the slots).
_SCALAR_SLOT = {
    "long long": "q", "i64": "q", "int64_t": "q",
    "unsigned long long": "Q", "u64": "Q",
    "int": "i4x", "i32": "i4x", "int32_t": "i4x",
    "unsigned int": "I4x", "u32": "I4x", "uint32_t": "I4x",
    "double": "d", "float": "f4x",
}
_POINTER_SLOT = "Q"

# One map from dtype names (as torch spells them) to the C types the kernels
# are instantiated with.
CTYPE = {
    "float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
    "int32": "int", "int64": "long long", "uint8": "u8",
}

# Parameter names the launch call itself uses.
_RESERVED = {"rt", "grid", "block", "targs", "stream", "shared_mem", "self"}


def normalize_ctype(ctype: str) -> str:
    """A C parameter type as the ABI check compares it: `__restrict__`
    dropped, whitespace collapsed, '*' attached to the type."""
    t = ctype.replace("__restrict__", " ")
    t = " ".join(t.split())
    return t.replace(" *", "*").replace("* ", "*")


class Param:
    __slots__ = ("name", "ctype", "slot", "pointer")

    def __init__(self, name: str, ctype: str):
        self.name = name
        self.ctype = normalize_ctype(ctype)
        self.pointer = self.ctype.endswith("*")
        if self.pointer:
            self.slot = _POINTER_SLOT
        else:
            base = self.ctype.removeprefix("const ")
            if base not in _SCALAR_SLOT:
                raise ValueError(f"parameter {name}: C type {ctype!r} has no launch packing "
                                 f"(known: pointers, {', '.join(sorted(_SCALAR_SLOT))})")
            self.slot = _SCALAR_SLOT[base]

    def __repr__(self):
        return f"{self.ctype} {self.name}"


class TParam:
    """A template parameter: kind ('typename', 'bool', 'int'), name, and the
    Python values rawkv instantiates (dtype names for a typename)."""
    __slots__ = ("kind", "name", "values")

    def __init__(self, kind: str, name: str, values: Sequence):
        if kind not in ("typename", "bool", "int"):
            raise ValueError(f"template parameter {name}: kind {kind!r} is not typename, bool or int")
        self.kind, self.name, self.values = kind, name, tuple(values)

    def spell(self, value) -> str:
        """The C spelling of one template argument."""
        if self.kind == "typename":
            name = value if isinstance(value, str) else str(value).replace("torch.", "")
            try:
                return CTYPE[name]
            except KeyError:
                raise ValueError(f"template parameter {self.name}: no C type for {value!r}") from None
        if self.kind == "bool":
            return "true" if value else "false"
        return str(int(value))


def params(spec: str) -> tuple[Param, ...]:
    """Parameters from C-like text: 'const T* x, u8* out, i64 n'."""
    out = []
    for part in spec.split(","):
        part = normalize_ctype(part)
        if not part:
            continue
        cut = max(part.rfind(" "), part.rfind("*"))
        out.append(Param(part[cut + 1:], part[:cut + 1]))
    return tuple(out)


class KernelFile:
    """One rawkv/cu/<filename>: its kernels, the constants it shares with
    Python (handed to NVRTC as -D<name>=<value>) and, for a file that uses
    one architecture's own instructions, `targets`: {device arch: compile
    arch} (e.g. {"sm_90": "sm_90a"} for wgmma); such a file is built only
    for those devices, and nothing else loads it."""

    def __init__(self, filename: str, constants: dict | None = None, targets: dict | None = None):
        self.filename = filename
        self.constants = dict(constants or {})
        self.targets = dict(targets) if targets is not None else None
        self.kernels: dict[str, Kernel] = {}
        _FILES[filename] = self

    def target(self, arch: str) -> str | None:
        """The architecture this file is compiled for on a device of `arch`,
        or None when it is not built there."""
        return arch if self.targets is None else self.targets.get(arch)

    def options(self) -> tuple[str, ...]:
        return tuple(f"-D{k}={int(v) if isinstance(v, bool) else v}"
                     for k, v in sorted(self.constants.items()))

    def name_expressions(self) -> tuple[str, ...]:
        return tuple(e for k in self.kernels.values() for e in k.expressions())

    def kernel(self, name: str, params_spec: str, template: Sequence[TParam] = (),
               instances: Iterable[tuple] | None = None, dynamic_smem=None) -> "Kernel":
        """`dynamic_smem`: a function of an instance's template arguments
        giving the dynamic shared memory its launches take (bytes); the
        runtime raises the kernel's limit to it when loading past 48 KB."""
        k = Kernel(self, name, params(params_spec), tuple(template), instances, dynamic_smem)
        if name in self.kernels:
            raise ValueError(f"{self.filename}: kernel {name} declared twice")
        self.kernels[name] = k
        return k


_FILES: dict[str, KernelFile] = {}


class Instance:
    """One template instantiation: its name expression, slot layout and
    packer. `launch` is the hot path: a function generated for this
    instance (see _make_launch), so a call is one Python frame before the
    runtime's."""
    __slots__ = ("kernel", "file", "expr", "key", "struct", "pack", "launch", "smem")

    def __init__(self, kernel: "Kernel", targs: tuple):
        self.kernel = kernel
        self.file = kernel.file.filename
        self.smem = int(kernel.dynamic_smem(*targs)) if kernel.dynamic_smem else 0
        spelled = [t.spell(v) for t, v in zip(kernel.template, targs)]
        self.expr = f"{kernel.name}<{', '.join(spelled)}>" if kernel.template else kernel.name
        self.key = (self.file, self.expr)
        self.struct = struct.Struct("<" + "".join(p.slot for p in kernel.params))
        self.pack = kernel.packer
        self.launch = _make_launch(self)

    def __repr__(self):
        return f"<kernel instance {self.file}:{self.expr}>"


class Kernel:
    """A `__global__` function of a KernelFile (see the module docstring)."""

    def __init__(self, file: KernelFile, name: str, params_: tuple[Param, ...],
                 template: tuple[TParam, ...], instances, dynamic_smem=None):
        self.file, self.name, self.params, self.template = file, name, params_, template
        self.dynamic_smem = dynamic_smem
        names = [p.name for p in params_]
        bad = sorted(set(names) & _RESERVED)
        if bad or len(set(names)) != len(names):
            raise ValueError(f"{name}: parameter names must be unique and not {sorted(_RESERVED)}")
        if instances is None:
            instances = itertools.product(*(t.values for t in template))
        self._instance_args = [tuple(i) for i in instances]
        self._instances: dict[tuple, Instance] = {}
        self.packer = _make_packer(name, params_)

    def __repr__(self):
        return f"<kernel {self.file.filename}:{self.name}({', '.join(map(repr, self.params))})>"

    def expressions(self) -> tuple[str, ...]:
        return tuple(self.instance(*a).expr for a in self._instance_args)

    def instance(self, *targs) -> Instance:
        """The instantiation for template arguments `targs` (Python values:
        dtype names or torch dtypes, bools, ints), cached."""
        inst = self._instances.get(targs)
        if inst is None:
            if len(targs) != len(self.template):
                raise TypeError(f"{self.name}: expected {len(self.template)} template arguments, "
                                f"got {len(targs)}")
            inst = self._instances[targs] = Instance(self, targs)
        return inst

    def launch(self, rt, grid, block, *targs, stream=None, shared_mem: int = 0, **kw) -> None:
        """Launch on runtime `rt` with the kernel's parameters as keywords
        (tensors or int addresses for pointers, None for a null pointer)."""
        inst = self._instances.get(targs) or self.instance(*targs)
        inst.launch(rt, grid, block, stream=stream, shared_mem=shared_mem, **kw)


def _ordered_args(params_: tuple[Param, ...]) -> tuple[str, str]:
    """(keyword-only parameter list, tuple expression of the values in
    order, pointers as int addresses: a tensor's data_ptr(), None -> 0)."""
    items = []
    for p in params_:
        n = p.name
        if p.pointer:
            items.append(f"(0 if {n} is None else {n} if {n}.__class__ is int else {n}.data_ptr())")
        else:
            items.append(n)
    return ", ".join(p.name for p in params_), f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _generate(name: str, src: str, env: dict):
    exec(compile(src, f"<rawkv kernel {name}>", "exec"), env)  # noqa: S102 - generated from declarations
    return env[name]


def _make_packer(kernel_name: str, params_: tuple[Param, ...]):
    """A function taking the parameters by keyword (all required) and
    returning them in order, pointers as int addresses."""
    arglist, values = _ordered_args(params_)
    star = f"*, {arglist}" if params_ else ""
    return _generate(kernel_name, f"def {kernel_name}({star}):\n    return {values}\n", {})


def _make_launch(inst: "Instance"):
    """launch(rt, grid, block, *, stream=None, shared_mem=0, <parameters>):
    the instance's function, argument order and slot struct bound as
    constants, the parameters taken by keyword (a missing or unknown one is
    Python's TypeError naming the kernel and the parameter)."""
    params_ = inst.kernel.params
    arglist, values = _ordered_args(params_)
    name = inst.kernel.name
    # The common case (torch's current stream, the tensors' device current)
    # goes straight to the launcher: one Python frame fewer than rt.launch,
    # which handles the rest (a given stream, another device current).
    src = (f"def {name}(rt, grid, block, *, stream=None, shared_mem=0{', ' + arglist if params_ else ''}):\n"
           f"    fn = rt._functions.get(KEY) or rt.function(FILE, EXPR, stream=stream)\n"
           f"    if stream is None and rt._get_device() == rt.device_index:\n"
           f"        rt._launch_call(fn, grid, block, STRUCT, {values}, shared_mem, rt._current_stream_ptr(), INST)\n"
           f"    else:\n"
           f"        rt.launch(fn, grid, block, STRUCT, {values}, stream, shared_mem, INST)\n")
    return _generate(name, src, {"KEY": inst.key, "FILE": inst.file, "EXPR": inst.expr,
                                 "STRUCT": inst.struct, "INST": inst})


def files() -> dict[str, KernelFile]:
    """{filename: KernelFile} of every declared kernel file."""
    return dict(_FILES)


def registered_kernels() -> dict[str, tuple[str, ...]]:
    """{filename: name expressions} of every declared kernel."""
    return {f: kf.name_expressions() for f, kf in _FILES.items()}


def dynamic_smem(filename: str, expr: str) -> int:
    """The dynamic shared memory (bytes) the instance `expr` of a kernel of
    `filename` is launched with (0 when it declares none)."""
    kf = _FILES.get(filename)
    if kf is None:
        return 0
    for k in kf.kernels.values():
        for targs in k._instance_args:
            inst = k.instance(*targs)
            if inst.expr == expr:
                return inst.smem
    return 0
