"""Kernel declarations: each `__global__` function rawkv launches, declared
once in Python beside the other kernels of its `.cu` file.

A declaration names the source file, the kernel, its template parameters
(kind, name and the values rawkv instantiates) and the compile-time
constants the file shares with Python. The parameters are not written here:
the `.cu` signature is their one copy, read (rawkv.kernels._signatures) on
the first use of one of the file's kernels and kept. From a declaration come:

* the NVRTC name expressions the runtime compiles and `warmup()` loads
  (these need the template only: no source is read for them);
* the `-D` options that hand the shared constants to the compiler (so the
  value exists once, here, and the `.cu` file reads the macro);
* the argument packing of a launch: ops pass keyword arguments named as in
  the `.cu` signature, the declaration orders them and packs each into an
  8-byte slot exactly as its C type wants it (pointer, 64/32-bit integer,
  double, float); a struct passed by value (a wide kernel's groups of
  parameters) as a dict of its fields, packed at the offsets C gives them
  (the struct's definition in the `.cu` file is their one copy) into as
  many slots as it needs;
* what tests/guards/test_kernel_abi.py holds against the `.cu` sources and the
  launch sites: every kernel declared with its template parameters, every
  parameter's C type packable, every launch's keywords the kernel's
  parameter names, on a CPU.

Nothing here imports torch, CuPy or the runtime: `import rawkv` stays
GPU-free and reads no `.cu` file; the runtime imports this package, never
an op module.
"""
from __future__ import annotations

import functools
import itertools
import struct
from typing import Iterable, Sequence

from .. import _launch
from ._signatures import global_signatures, normalize_ctype, struct_fields

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

# Format of each C scalar type as a struct field (its size is its alignment).
_FIELD = {
    "long long": "q", "i64": "q", "int64_t": "q",
    "unsigned long long": "Q", "u64": "Q",
    "int": "i", "i32": "i", "int32_t": "i",
    "unsigned int": "I", "u32": "I", "uint32_t": "I",
    "double": "d", "float": "f", "bool": "?", "u8": "B", "uint8_t": "B", "unsigned char": "B",
}

# One map from dtype names (as torch spells them) to the C types the kernels
# are instantiated with.
CTYPE = {
    "float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
    "int32": "int", "int64": "long long", "uint8": "u8",
}

# Parameter names the launch call itself uses.
_RESERVED = {"rt", "grid", "block", "targs", "stream", "shared_mem", "self"}


class Field:
    """A field of a struct parameter: name, C type, struct format, byte
    offset in the struct (C's: each field at a multiple of its size)."""
    __slots__ = ("name", "ctype", "fmt", "offset", "pointer")

    def __init__(self, name: str, ctype: str, fmt: str, offset: int):
        self.name, self.ctype, self.fmt, self.offset = name, ctype, fmt, offset
        self.pointer = ctype.endswith("*")

    def __repr__(self):
        return f"{self.ctype} {self.name} @{self.offset}"


def struct_layout(name: str, fields: Sequence[tuple[str, str]]) -> tuple[tuple[Field, ...], int]:
    """(fields with their offsets, sizeof) of a struct of `fields` ((C
    type, name), ...): each field aligned to its size, the size rounded up
    to the largest alignment, as C lays out plain data (pointers 8 bytes)."""
    out, off, align = [], 0, 1
    for ctype, fname in fields:
        ctype = normalize_ctype(ctype)
        fmt = _POINTER_SLOT if ctype.endswith("*") else _FIELD.get(ctype.removeprefix("const "))
        if fmt is None:
            raise ValueError(f"struct {name}: field {fname}: C type {ctype!r} has no launch packing "
                             f"(known: pointers, {', '.join(sorted(_FIELD))})")
        size = struct.calcsize("<" + fmt)
        off += -off % size
        out.append(Field(fname, ctype, fmt, off))
        off, align = off + size, max(align, size)
    return tuple(out), off + -off % align


class Param:
    """A kernel parameter: a scalar or pointer in one 8-byte slot, or a
    struct passed by value (`fields` not None) in `slots` slots, its
    fields at their C offsets (`fmt`: the struct format of its slots)."""
    __slots__ = ("name", "ctype", "slot", "pointer", "fields", "slots", "fmt", "size")

    def __init__(self, name: str, ctype: str, structs: dict | None = None):
        self.name = name
        self.ctype = normalize_ctype(ctype)
        self.pointer = self.ctype.endswith("*")
        self.fields, self.slots, self.size = None, 1, 8
        if self.pointer:
            self.slot = _POINTER_SLOT
        else:
            base = self.ctype.removeprefix("const ")
            if base not in _SCALAR_SLOT:
                sdef = (structs or {}).get(base.split("<")[0].strip())
                if sdef is None or sdef["fields"] is None:
                    raise ValueError(f"parameter {name}: C type {ctype!r} has no launch packing "
                                     f"(known: pointers, {', '.join(sorted(_SCALAR_SLOT))}, and the "
                                     "plain-data structs of the kernel's file)")
                self._struct(base, sdef["fields"])
                return
            self.slot = _SCALAR_SLOT[base]
        self.fmt = self.slot

    def _struct(self, base: str, fields) -> None:
        self.fields, self.size = struct_layout(base, fields)
        self.slots = -(-self.size // 8)
        fmt, end = [], 0
        for f in self.fields:
            fmt.append(f"{f.offset - end}x" if f.offset > end else "")
            fmt.append(f.fmt)
            end = f.offset + struct.calcsize("<" + f.fmt)
        pad = 8 * self.slots - end
        self.fmt = self.slot = "".join(fmt) + (f"{pad}x" if pad else "")

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


def bind_params(kernel: str, parsed: Sequence[tuple[str, str]], structs: dict | None = None
                ) -> tuple[Param, ...]:
    """The launch parameters of `kernel` from its parsed signature
    ((C type, name), ...) and its file's structs (struct_fields): every C
    type must have a packing, every name be unique and none a name the
    launch call itself takes (ValueError)."""
    out = []
    for ctype, name in parsed:
        try:
            out.append(Param(name, ctype, structs))
        except ValueError as exc:
            raise ValueError(f"{kernel}: {exc}") from None
    names = [p.name for p in out]
    bad = sorted(set(names) & _RESERVED)
    if bad or len(set(names)) != len(names):
        raise ValueError(f"{kernel}: parameter names must be unique and not {sorted(_RESERVED)}")
    return tuple(out)


def template_problem(kernel: str, template: Sequence[TParam], parsed: Sequence[tuple[str, str]]):
    """How the declared template parameters differ from the source's
    ((kind, name), ...), or None when they agree."""
    want = tuple((t.kind, t.name) for t in template)
    if tuple(parsed) != want:
        return f"{kernel} template {tuple(parsed)} != declared {want}"
    return None


class KernelFile:
    """One rawkv/cu/<filename>: its kernels, the constants it shares with
    Python (handed to NVRTC as -D<name>=<value>) and, for a file that uses
    one architecture's own instructions, `targets`: {device arch: compile
    arch} (e.g. {"sm_90": "sm_90a"} for wgmma); such a file is built only
    for those devices, and nothing else loads it.

    `source`: the CUDA text the kernels' signatures are read from instead of
    rawkv/cu/<filename> (a test's own kernels)."""

    def __init__(self, filename: str, constants: dict | None = None, targets: dict | None = None,
                 source: str | None = None):
        self.filename = filename
        self.constants = dict(constants or {})
        self.targets = dict(targets) if targets is not None else None
        self.kernels: dict[str, Kernel] = {}
        self._source = source
        self._signatures: dict | None = None
        self._structs: dict | None = None
        _FILES[filename] = self

    def signatures(self) -> dict[str, dict]:
        """The file's `__global__` signatures (_signatures.global_signatures),
        read on first use and kept: a launch, not `import rawkv`, reads them."""
        if self._signatures is None:
            text = self.source()
            self._structs = struct_fields(text)
            self._signatures = global_signatures(text)
        return self._signatures

    def structs(self) -> dict[str, dict]:
        """The file's structs (_signatures.struct_fields), read with the
        signatures."""
        self.signatures()
        return self._structs

    def source(self) -> str:
        if self._source is not None:
            return self._source
        from .. import _nvrtc       # the directory the runtime compiles from
        return (_nvrtc.CU_DIR / self.filename).read_text()

    def target(self, arch: str) -> str | None:
        """The architecture this file is compiled for on a device of `arch`,
        or None when it is not built there."""
        return arch if self.targets is None else self.targets.get(arch)

    def options(self) -> tuple[str, ...]:
        return tuple(f"-D{k}={int(v) if isinstance(v, bool) else v}"
                     for k, v in sorted(self.constants.items()))

    def name_expressions(self) -> tuple[str, ...]:
        return tuple(e for k in self.kernels.values() for e in k.expressions())

    def prepare(self) -> None:
        """Build every declared instance (signatures read, packers and launch
        functions generated), so that a first launch does none of it."""
        for k in self.kernels.values():
            for targs in k._instance_args:
                k.instance(*targs)

    def kernel(self, name: str, template: Sequence[TParam] = (),
               instances: Iterable[tuple] | None = None, dynamic_smem=None, pdl: bool = False) -> "Kernel":
        """Declare the `__global__` function `name` of this file with its
        template parameters; its parameters are the source's.
        `instances`: the template arguments rawkv compiles (default: every
        combination of the values). `dynamic_smem`: a function of an
        instance's template arguments giving the dynamic shared memory its
        launches take (bytes); the runtime raises the kernel's limit to it
        when loading past 48 KB. `pdl`: launched as a programmatic dependent
        launch on sm_90+ devices (docs/runtime.md): the kernel reads nothing
        but its weights before griddepcontrol.wait (common.cuh, pdl_wait)."""
        if isinstance(template, str):
            raise TypeError(f"{self.filename}: {name}: a declaration takes no parameter list "
                            "(the .cu signature is read); pass the template parameters only")
        k = Kernel(self, name, tuple(template), instances, dynamic_smem, pdl)
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
    __slots__ = ("kernel", "file", "expr", "key", "struct", "pack", "launch", "smem", "pdl")

    def __init__(self, kernel: "Kernel", targs: tuple, pdl: bool | None = None):
        self.kernel = kernel
        self.file = kernel.file.filename
        self.smem = kernel.smem(targs)
        self.pdl = kernel.pdl if pdl is None else pdl
        self.expr = kernel.expr(targs)
        self.key = (self.file, self.expr)
        self.struct = _launch.slot_struct("".join(p.slot for p in kernel.params),
                                          tuple(p.slots for p in kernel.params))
        self.pack = kernel.packer
        self.launch = _make_launch(self)

    def __repr__(self):
        return f"<kernel instance {self.file}:{self.expr}>"

    def bind(self, rt, grid, block, shared_mem: int = 0):
        """This instance's launch on runtime `rt` with its geometry fixed,
        as a function of the parameters' values alone, positional, in the
        `.cu` order, pointers as int addresses (rawkv._launch.bound_launch):
        for an op's fast path, which calls it with values it has checked.
        The kernel is loaded now."""
        fn = rt._functions.get(self.key) or rt.function(self.file, self.expr)
        return _launch.bound_launch(rt, fn, grid, block, self.struct, shared_mem, self)


class Kernel:
    """A `__global__` function of a KernelFile (see the module docstring).
    `params` and `packer` come from the file's source on first use."""

    def __init__(self, file: KernelFile, name: str, template: tuple[TParam, ...], instances,
                 dynamic_smem=None, pdl: bool = False):
        self.file, self.name, self.template = file, name, template
        self.dynamic_smem = dynamic_smem
        self.pdl = pdl
        if instances is None:
            instances = itertools.product(*(t.values for t in template))
        self._instance_args = [tuple(i) for i in instances]
        self._instances: dict[tuple, Instance] = {}

    @functools.cached_property
    def params(self) -> tuple[Param, ...]:
        """The parameters in order, from the `.cu` signature (read once per
        file); a kernel the source lacks, or whose template differs from the
        declaration's, is a ValueError naming it."""
        sig = self.file.signatures().get(self.name)
        if sig is None:
            raise ValueError(f"{self.file.filename}: {self.name} is declared but the source "
                             "defines no such __global__")
        problem = template_problem(self.name, self.template, sig["template"])
        if problem:
            raise ValueError(f"{self.file.filename}: {problem}")
        return bind_params(self.name, sig["params"], self.file.structs())

    @functools.cached_property
    def packer(self):
        return _make_packer(self.name, self.params)

    def __repr__(self):
        return f"<kernel {self.file.filename}:{self.name}>"

    def expr(self, targs: tuple) -> str:
        """The NVRTC name expression of the instance `targs`."""
        if len(targs) != len(self.template):
            raise TypeError(f"{self.name}: expected {len(self.template)} template arguments, "
                            f"got {len(targs)}")
        spelled = [t.spell(v) for t, v in zip(self.template, targs)]
        return f"{self.name}<{', '.join(spelled)}>" if self.template else self.name

    def smem(self, targs: tuple) -> int:
        """The dynamic shared memory (bytes) the instance `targs` launches with."""
        return int(self.dynamic_smem(*targs)) if self.dynamic_smem else 0

    def expressions(self) -> tuple[str, ...]:
        return tuple(self.expr(a) for a in self._instance_args)

    def instance(self, *targs, pdl: bool | None = None) -> Instance:
        """The instantiation for template arguments `targs` (Python values:
        dtype names or torch dtypes, bools, ints), cached. `pdl`: for a
        kernel declared `pdl`, False gives the same function launched the
        plain way (a plan that chooses per call); None or True, as declared."""
        if pdl is False and self.pdl:
            key = (*targs, "plain")
            inst = self._instances.get(key)
            if inst is None:
                inst = self._instances[key] = Instance(self, targs, pdl=False)
            return inst
        inst = self._instances.get(targs)
        if inst is None:
            inst = self._instances[targs] = Instance(self, targs)
        return inst

    def launch(self, rt, grid, block, *targs, stream=None, shared_mem: int = 0, **kw) -> None:
        """Launch on runtime `rt` with the kernel's parameters as keywords
        (tensors or int addresses for pointers, None for a null pointer)."""
        inst = self._instances.get(targs) or self.instance(*targs)
        inst.launch(rt, grid, block, stream=stream, shared_mem=shared_mem, **kw)


def _address(v: str, first: str | None = None) -> str:
    """The expression of pointer value `v` as an int address: a tensor's
    data_ptr(), an int as it is, None -> 0 (`first`: the expression that
    binds v, evaluated once)."""
    return f"(0 if {first or v} is None else {v} if {v}.__class__ is int else {v}.data_ptr())"


def _ordered_args(params_: tuple[Param, ...]) -> tuple[str, str]:
    """(keyword-only parameter list, tuple expression of the values in
    order, pointers as int addresses; a struct parameter's fields in order,
    from the dict it is given)."""
    items = []
    for p in params_:
        n = p.name
        if p.fields is not None:
            for f in p.fields:
                v = f"{n}[{f.name!r}]"
                items.append(_address("_v", f"(_v := {v})") if f.pointer else v)
        elif p.pointer:
            items.append(_address(n))
        else:
            items.append(n)
    return ", ".join(p.name for p in params_), f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _field_checks(params_: tuple[Param, ...]) -> str:
    """Lines checking that each struct parameter is a dict of exactly its
    fields (else a TypeError naming the kernel, the parameter and the
    fields), for a generated function's body."""
    return "".join(f"    if {p.name}.__class__ is not dict or {p.name}.keys() != FIELDS[{p.name!r}]:\n"
                   f"        bad_fields(NAME, {p.name!r}, FIELDS[{p.name!r}], {p.name})\n"
                   for p in params_ if p.fields is not None)


def _bad_fields(kernel: str, param: str, fields: frozenset, value) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{kernel}: argument {param} is a struct: expected a dict of its fields "
                        f"({', '.join(sorted(fields))}), got {type(value).__name__}")
    missing, unknown = sorted(fields - value.keys()), sorted(value.keys() - fields)
    raise TypeError(f"{kernel}: argument {param}: " + "; ".join(
        ([f"missing field {', '.join(missing)}"] if missing else []) +
        ([f"no field {', '.join(unknown)}"] if unknown else [])))


def _struct_env(params_: tuple[Param, ...], name: str) -> dict:
    return {"FIELDS": {p.name: frozenset(f.name for f in p.fields) for p in params_ if p.fields is not None},
            "bad_fields": _bad_fields, "NAME": name}


def _generate(name: str, src: str, env: dict):
    exec(compile(src, f"<rawkv kernel {name}>", "exec"), env)  # noqa: S102 - generated from declarations
    return env[name]


def _make_packer(kernel_name: str, params_: tuple[Param, ...]):
    """A function taking the parameters by keyword (all required) and
    returning them in order, pointers as int addresses."""
    arglist, values = _ordered_args(params_)
    star = f"*, {arglist}" if params_ else ""
    return _generate(kernel_name, f"def {kernel_name}({star}):\n{_field_checks(params_)}    return {values}\n",
                     _struct_env(params_, kernel_name))


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
           f"{_field_checks(params_)}"
           f"    fn = rt._functions.get(KEY) or rt.function(FILE, EXPR, stream=stream)\n"
           f"    if stream is None and rt._get_device() == rt.device_index:\n"
           f"        rt._launch_call(fn, grid, block, STRUCT, {values}, shared_mem, rt._current_stream_ptr(), INST)\n"
           f"    else:\n"
           f"        rt.launch(fn, grid, block, STRUCT, {values}, stream, shared_mem, INST)\n")
    return _generate(name, src, {"KEY": inst.key, "FILE": inst.file, "EXPR": inst.expr,
                                 "STRUCT": inst.struct, "INST": inst, **_struct_env(params_, name)})


def files() -> dict[str, KernelFile]:
    """{filename: KernelFile} of every declared kernel file."""
    return dict(_FILES)


def prepare(filename: str) -> None:
    """KernelFile.prepare of a declared file (nothing for an unknown one)."""
    kf = _FILES.get(filename)
    if kf is not None:
        kf.prepare()


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
            if k.expr(targs) == expr:
                return k.smem(targs)
    return 0
