"""The op wrapper: an op is written once, as the mutating function torch
calls (its outputs are arguments, marked `(a!)` in its schema; it returns
nothing), and is registered once as `torch.ops.rawkv.<name>`.

    @op("e4m3_encode", "Tensor x, Tensor(a!) out")
    def _encode(x, out, stream=None):       # the body: checks, then reference or launch
        ...

    def e4m3_encode(x, *, out=None, stream=None):    # the public function
        if out is None:
            out = empty(x, A.dims(x), "float8_e4m3fn", stream)
        _encode(x, out, stream)
        return out

`_encode(...)` takes the schema's arguments in schema order, then the
stream. In eager mode it calls the body directly: no dispatcher, one Python
frame and the cost of one `torch.compiler.is_dynamo_compiling()` call. While torch.compile
traces the caller it calls the registered operator instead (the stream is
not an operator argument), whose fake implementation returns nothing, so
dynamo puts the call in its graph and never traces the pointer-level body.
The public function only allocates the outputs it was not given (`empty`,
the one allocation helper for every op) and calls the op; it branches on
nothing else. The body's parameters are the schema's, with the same
defaults, plus optional extras (the stream): rawkv.library registers the
body itself as the CPU and CUDA implementation. An op whose schema starts
with an object's buffers (a kvcache pool's or decode state's, 14 of them)
takes the schema's arguments as `*args` and its extras as keywords
(`def _flush_write(*args, stream=None, pool=None)`); rawkv.kvcache.views
takes them apart.

Registration (rawkv.library) needs torch, which `import rawkv` never
imports: it runs when `import rawkv` finds torch loaded, else when torch
is imported later (`when_torch_loads`, an import hook removed once it has
run), else, when rawkv is imported from inside `import torch`, once that
import has finished (_ThenCallSpec), so `torch.ops.rawkv.*` exist whatever
the import order.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
import warnings

import numpy as np

from . import _args as A
from ._opdecl import OpDecl
from .runtime import get_runtime


class _NoTorch:
    """torch.compiler until torch is loaded: nothing compiles without torch.
    is_dynamo_compiling binds the real module for every later call once it
    sees torch."""
    _is_compiling_flag = False

    @staticmethod
    def is_dynamo_compiling() -> bool:
        t = sys.modules.get("torch")
        c = getattr(t, "compiler", None)
        if getattr(c, "is_dynamo_compiling", None) is None:
            return False
        global _compiler
        _compiler = c
        return c.is_dynamo_compiling()


# torch.compiler once torch is loaded. `_compiler.is_dynamo_compiling() or
# _compiler._is_compiling_flag` is torch.compiler.is_compiling() (True
# while dynamo traces, which reads the call as True, or while torch.export
# runs the Python) in one call instead of two: every op call pays it.
_compiler = _NoTorch


def torch_loaded(torch) -> None:
    """Bind torch.compiler (rawkv.library calls this when it registers the
    operators, before anything can be compiled)."""
    global _compiler
    _compiler = torch.compiler
    A.torch_loaded(torch)


def _is_compiling() -> bool:
    return _compiler.is_dynamo_compiling() or _compiler._is_compiling_flag


class Op(OpDecl):
    """The declaration of an op written with @op: its body is the
    implementation rawkv.library registers (called positionally by the
    dispatcher), and `overload` the registered torch.ops.rawkv.<name>.default.
    `host`: the op's own rule for its arguments that are not tensors (a
    scope, a gs given as a number or a bool), a function of the schema's
    arguments by name (a dict) that raises the eager op's error; _traced
    runs it when a tensor argument holds a bool (op())."""

    variadic = False        # the body takes the schema's arguments as *args, its extras by keyword

    def __init__(self, name: str, schema: str, body, host=None):
        super().__init__(name, body, schema)
        self.body = body
        self.host = host
        _check_body(self)
        # A body with a `checks_only` keyword checks its arguments and stops
        # there: the fake implementation runs it on the real tensors of a
        # call dynamo traces, whose memory the written arguments' copies
        # hide once the call is functionalized (rawkv.kvcache.traced).
        self.checks_only = "checks_only" in inspect.signature(body).parameters


def _check_body(decl: Op) -> None:
    """The body takes the schema's arguments in order, with the schema's
    defaults (the dispatcher leaves out trailing defaulted arguments), and
    nothing else without a default: a mismatch is a declaration error. A
    body whose first parameter is `*args` takes the schema's arguments
    through it (an op on a kvcache pool or decode state: the object's
    buffers lead its schema, too many to spell in every signature; such a
    schema has no defaults) and its extras as keywords."""
    params = list(inspect.signature(decl.body).parameters.values())
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        if decl.defaults:
            raise ValueError(f"rawkv::{decl.name}: a *args body takes no schema defaults")
        for p in params[1:]:
            if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty:
                raise ValueError(f"rawkv::{decl.name}: a *args body's extra {p.name} must be a keyword "
                                 "with a default")
        decl.variadic = True
        return
    names = [n for n, _, _ in decl.args]
    if [p.name for p in params[:len(names)]] != names:
        raise ValueError(f"rawkv::{decl.name}: the body's parameters must start with the schema's "
                         f"{names}, got {[p.name for p in params]}")
    for p in params[:len(names)]:
        want = decl.defaults.get(p.name, inspect.Parameter.empty)
        if p.default is not want and p.default != want:
            raise ValueError(f"rawkv::{decl.name}: {p.name}'s default must be the schema's ({want!r})")
    for p in params[len(names):]:
        if p.default is inspect.Parameter.empty:
            raise ValueError(f"rawkv::{decl.name}: extra parameter {p.name} needs a default")


def op(name: str, schema: str, *, host=None):
    """Decorator: declare the body as rawkv::<name>(<schema>) -> () and
    return the function public code calls (see the module docstring).
    `host` (optional): the body's rule for its arguments that are not
    tensors, `host(args)` with the schema's arguments by name, raising what
    the body raises; an op whose public argument may be a number or a
    tensor (a gs: `Tensor? gs, float? gs_value`, where a bool lands in the
    tensor) names it, so a compiled call refuses a bool there with the
    eager op's error (Op)."""
    def wrap(body):
        decl = Op(name, schema, body, host)
        n = len(decl.args)
        params = list(inspect.signature(body).parameters)
        si = params.index("stream") if "stream" in params else len(params)     # (the stream's position)
        nums = decl.numbers

        def call_fixed(*args):
            if _compiler.is_dynamo_compiling() or _compiler._is_compiling_flag:     # _is_compiling(), inlined
                if len(args) > si:
                    _traced_stream(args[si])
                return _traced(decl, args[:n])
            if nums:
                for i in nums:
                    if i < len(args) and args[i].__class__ not in _PLAIN:      # a NumPy scalar, perhaps
                        args = _numbers(decl, args)
                        break
            if len(args) > si and args[si] is not None:
                A.check_stream(args[si])        # (on CPU as the CUDA runtime would)
                with A.stream_current(args[si]):    # (the body's other CUDA work on that stream too)
                    return body(*args)
            return body(*args)

        def call_variadic(*args, **extras):
            if _compiler.is_dynamo_compiling() or _compiler._is_compiling_flag:
                _traced_stream(extras.get("stream"))
                return _traced(decl, args)
            if nums:
                for i in nums:
                    if i < len(args) and args[i].__class__ not in _PLAIN:
                        args = _numbers(decl, args)
                        break
            if extras.get("stream") is not None:
                A.check_stream(extras["stream"])
                with A.stream_current(extras["stream"]):
                    return body(*args, **extras)
            return body(*args, **extras)
        # the schema's arguments in order (and the extras by position), or a
        # *args body's (its extras by keyword)
        call = call_variadic if decl.variadic else call_fixed
        call.op = decl
        call.__name__ = call.__qualname__ = body.__name__
        call.__doc__ = body.__doc__
        return call
    return wrap


# what a number argument of the schema usually is: nothing to convert (an
# eager test only: dynamo cannot hash the class of a value it traces)
_PLAIN = frozenset((int, float, type(None)))


def _numbers(decl: Op, args: tuple) -> tuple:
    """`args` with a NumPy scalar where the schema takes a number (its int,
    float and Scalar arguments) as the Python number it holds (A.as_number), so
    the body gets what torch.ops.rawkv.* passes it, eagerly and compiled."""
    for i in decl.numbers:
        if i < len(args):
            v = args[i]
            w = A.as_number(v)
            if w is not v:
                args = (*args[:i], w, *args[i + 1:])
    return args


def _traced_stream(stream) -> None:
    """A stream given to an op under torch.compile: the operator has no
    stream argument and runs on torch's current stream (docs/kvcache.md,
    "Custom operators"), but what the eager op refuses as a stream (a bool,
    a string, a float: A.check_stream) is refused here too (until
    session 60 the compiled call took it). A torch stream is not looked
    into (dynamo traces it as its own variable)."""
    if stream is None:
        return
    torch = A._torch_or_none()      # (not sys.modules[...] under dynamo: its guards iterate that dict)
    if not isinstance(stream, (torch.Stream, torch.cuda.Stream)):
        A.check_stream(stream)


def _traced(decl: Op, args):
    """Under torch.compile: the registered operator (with the schema's
    arguments only), which dynamo records in its graph. A bool, an array or
    a tensor where the schema takes a number is refused here, by name; a
    bool where it takes a tensor (a gs) by the op's own rule (Op.host, the
    eager error), else by name."""
    ov = decl.overload
    if ov is None:
        raise RuntimeError(f"rawkv::{decl.name} is not registered with torch: import rawkv.library "
                           "before torch.compile")
    args = _numbers(decl, args)
    for i in decl.numbers:
        v = args[i] if i < len(args) else None
        if isinstance(v, bool):
            # (torch's argument parser would make it 1 or 1.0, which the op
            # then takes, where the eager op refuses the bool: docs/runtime.md,
            # "Numbers". Without fullgraph, dynamo then runs the call eagerly.)
            what = "an int" if i in decl.ints else "a number"
            raise TypeError(f"{decl.args[i][0]}: expected {what}, got bool")
        if isinstance(v, np.ndarray) or A.is_torch(v):
            # (a NumPy bool, an array or a tensor where the schema takes a number:
            # the eager op refuses it by name, the operator call would fail
            # making its fake tensor call)
            raise TypeError(f"{decl.args[i][0]}: expected a number, got "
                            f"{'a tensor' if A.is_torch(v) else 'a NumPy bool or array'}")
        if i in decl.ints and decl.args[i][1].rstrip("?") == "Scalar" and isinstance(v, (float, complex)):
            # (a float where an integer Scalar goes: the fake call would take
            # it, the op refuses it when it runs; refused here as eagerly, in
            # kvcache's host_int's words. A dynamic int is a SymInt: taken.
            # A float Scalar, FLOAT_SCALARS, takes it.)
            raise TypeError(f"{decl.args[i][0]}: expected an int, got {type(v).__name__}")
    for i in decl.tensors:
        v = args[i] if i < len(args) else None
        if isinstance(v, (bool, np.bool_)):
            # (a bool where a number or a tensor goes, a gs: split_number puts
            # it in the tensor argument, which torch's parser refuses in its
            # own words while dynamo makes the fake call. The op's own rule
            # refuses it as eagerly: docs/runtime.md, "Numbers".)
            if decl.host is not None:
                decl.host(dict(zip((a[0] for a in decl.args), args)))
            A.require_array(v, decl.args[i][0])     # (the argument layer's error, by name)
    ov(*args)


# ---- outputs --------------------------------------------------------------------------------
# Output dtypes numpy lacks: bfloat16 values are held in float32 (exactly),
# FP8 / FP4 codes as their bytes.
_NUMPY_DTYPE = {"bfloat16": np.float32, "float8_e4m3fn": np.uint8, "float4_e2m1fn_x2": np.uint8,
                "float8_e8m0fnu": np.uint8}


def empty(like, shape, dtype: str, stream=None):
    """A new output of `shape` and dtype `dtype` (torch's name) where `like`,
    the op's first input, lives: a numpy array for numpy input (bfloat16 as
    float32, FP8 / FP4 as uint8), a CPU tensor for a CPU tensor, a CUDA
    tensor from the device's runtime for a CUDA tensor or DLPack device
    array (refused while capturing, allocated on `stream`), a torch.empty
    under torch.compile. None when `like` is not an array: nothing is
    allocated for an argument the op will refuse."""
    if _is_compiling():
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if isinstance(like, np.ndarray):
        return np.empty(shape, _NUMPY_DTYPE.get(dtype, dtype))
    if A.is_torch(like):
        torch = sys.modules["torch"]
        if like.is_cuda:
            return get_runtime(like.get_device()).empty(shape, getattr(torch, dtype), stream=stream)
        if like.device.type != "cpu":
            return None                     # the op names the device it does not run on
        return torch.empty(shape, dtype=getattr(torch, dtype))
    dev = getattr(like, "__dlpack_device__", None)
    if dev is None or isinstance(like, (int, float, bool, np.generic)):
        return None
    if dev()[0] == 1:                       # a host DLPack array: the reference's placement
        return np.empty(shape, _NUMPY_DTYPE.get(dtype, dtype))
    return empty(A.as_cuda_tensor(like, "input"), shape, dtype, stream)


def empties(like, stream, *specs) -> list:
    """empty(like, shape, dtype, stream) of each (shape, dtype) in `specs`
    (None: None), with where `like` lives decided once: an op allocating
    several outputs pays for one lookup of its runtime."""
    if not _is_compiling() and A.is_torch(like) and like.is_cuda:
        rt, torch = get_runtime(like.get_device()), sys.modules["torch"]
        return [None if s is None else rt.empty(s[0], getattr(torch, s[1]), stream=stream) for s in specs]
    return [None if s is None else empty(like, s[0], s[1], stream) for s in specs]


# ---- registration whatever the import order ------------------------------------------------
class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `import torch` starts, it wraps torch's
    loader so that `callback` runs once torch's module has executed, then
    leaves sys.meta_path."""

    def __init__(self, callback):
        self.callback = callback

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        self._remove()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenCall(spec.loader, self.callback)
        return spec

    def _remove(self):
        while self in sys.meta_path:
            sys.meta_path.remove(self)


class _ThenCall(importlib.abc.Loader):
    """torch's own loader, then the callback; the module keeps its own loader."""

    def __init__(self, loader, callback):
        self.loader, self.callback = loader, callback

    def __getattr__(self, attr):            # resource readers and the like: torch's loader's
        return getattr(self.loader, attr)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        try:
            self.callback()
        except Exception as exc:  # noqa: BLE001 - `import torch` must not fail because of rawkv
            warnings.warn(f"rawkv: registering torch.ops.rawkv.* after `import torch` failed ({exc!r}); "
                          "`import rawkv.library` raises the error", RuntimeWarning, stacklevel=2)


class _ThenCallSpec(importlib.machinery.ModuleSpec):
    """torch's spec while `import torch` runs, when rawkv was imported from
    inside that import (a torch.backends autoload plugin, a module torch's
    import runs): the import system sets `spec._initializing = False` once
    torch's module has executed (importlib._bootstrap._load_unlocked, in a
    finally), and that assignment runs the callbacks, after the spec has
    become a plain ModuleSpec again. Nothing runs if torch's import failed
    (its module is no longer sys.modules[name])."""

    @property
    def _initializing(self):
        return self.__dict__.get("_initializing", False)

    @_initializing.setter
    def _initializing(self, value):
        self.__dict__["_initializing"] = value
        if value:
            return
        self.__class__ = importlib.machinery.ModuleSpec
        callbacks = self.__dict__.pop("_rawkv_callbacks", ())
        module = sys.modules.get(self.name)
        if module is None or getattr(module, "__spec__", None) is not self:
            return      # torch's import failed: nothing to register with
        for callback in callbacks:
            _call_after_torch(callback)


def _call_after_torch(callback) -> None:
    try:
        callback()
    except Exception as exc:  # noqa: BLE001 - `import torch` must not fail because of rawkv
        warnings.warn(f"rawkv: registering torch.ops.rawkv.* after `import torch` failed ({exc!r}); "
                      "`import rawkv.library` raises the error", RuntimeWarning, stacklevel=3)


def _after_initializing(spec, callback) -> bool:
    """Run `callback` once the import of the module whose spec is `spec`
    (initializing) has finished (_ThenCallSpec); False where its spec is
    not a plain ModuleSpec this can hook."""
    if type(spec) is _ThenCallSpec:
        spec.__dict__.setdefault("_rawkv_callbacks", []).append(callback)
        return True
    if type(spec) is not importlib.machinery.ModuleSpec:
        return False
    spec.__dict__["_rawkv_callbacks"] = [callback]
    init = spec.__dict__.pop("_initializing", True)
    spec.__class__ = _ThenCallSpec
    spec.__dict__["_initializing"] = init
    return True


def when_torch_loads(callback) -> None:
    """Call `callback` now if torch is loaded, else as soon as `import
    torch` has run (`import rawkv` registers the operators this way),
    including when rawkv is imported from inside `import torch` (torch is
    in sys.modules but not usable yet: _ThenCallSpec)."""
    t = sys.modules.get("torch")
    if t is not None:
        spec = getattr(t, "__spec__", None)
        if getattr(spec, "_initializing", False):
            # rawkv imported from inside torch's own import: torch is not
            # usable yet, so register once its import has finished.
            if not _after_initializing(spec, callback):
                warnings.warn("rawkv: imported while `import torch` runs, and torch's import cannot be "
                              "followed; `import rawkv.library` after it registers torch.ops.rawkv.*",
                              RuntimeWarning, stacklevel=2)
            return
        callback()
        return
    if not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch(callback))
