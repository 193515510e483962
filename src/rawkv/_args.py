"""The argument layer shared by every public op, on CPU and CUDA alike:
where the arguments live (placement), wrapping DLPack device arrays as
torch tensors, the numpy <-> torch conversions of the CPU path (which runs
rawkv.reference), and the argument rules.

Every rule runs before anything is launched or written and raises a
TypeError / ValueError whose message starts with the argument's name. An op
checks each argument through one of these functions, so the CPU path (the
numpy reference) and the CUDA path accept and refuse the same things.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading

import numpy as np

from .errors import GpuUnavailableError

_NO_CONTEXT = contextlib.nullcontext()


# ---- placement: where the arguments live, and the CPU path's conversions -----------------------
_torch = None       # the torch module, once seen


def torch_loaded(torch) -> None:
    """Bind torch (rawkv.library calls this when it registers the operators):
    code torch.compile traces then reads a global, not sys.modules, which
    dynamo would copy while lazy imports change it ('dictionary changed size
    during iteration')."""
    global _torch
    _torch = torch


def _torch_or_none():
    global _torch
    if _torch is None:      # torch tensors exist only if torch was imported
        _torch = sys.modules.get("torch")
    return _torch


def is_torch(x) -> bool:
    t = _torch_or_none()
    return t is not None and isinstance(x, t.Tensor)


def is_int(v) -> bool:
    """A Python or numpy int, not a bool (a float size passed every shape
    comparison, 2.0 == 2)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def version(t):
    """A tensor's version (torch's count of its in-place changes), or None
    for an inference tensor (one made under torch.inference_mode, as
    serving code loads its weights): torch counts no change of one, and
    reading `_version` raises. *Decision*: a GEMM weight of inference
    tensors is checked once at its addresses like any other; an in-place
    change of its bytes afterwards is not seen (docs/gemm.md, "Arguments")."""
    return None if t.is_inference() else t._version


def stamp(t) -> tuple:
    """What a remembered check of torch tensor t read that its identity
    does not fix: (address, version, dtype, shape, contiguous, negative
    bit). The version counts in-place changes; an assignment to `t.data`
    (a dtype view, a slice, another layout of the same memory) is none, so
    the rest is compared too (rawkv.gemm._rules' memo, rawkv.gemm.fast)."""
    return t.data_ptr(), version(t), t.dtype, t.shape, t.is_contiguous(), t.is_neg()


#: An int stream handle is a CUstream, a pointer: below this (CuPy and the
#: launch take it as a signed intptr_t; no real handle comes near).
STREAM_END = 2 ** 63


def check_stream(stream):
    """The one rule for what a stream argument (not None) may be: an int
    handle (not a bool) in [0, STREAM_END), a torch stream (its handle in
    `cuda_stream`) or a CuPy stream (in `ptr`); anything else is a
    TypeError naming `stream`, an int out of range a ValueError (2**70 or
    -1 failed on CUDA later, in ctypes / CuPy or as the driver's invalid
    handle, naming nothing). Returns the attribute holding the handle, None
    for an int. The CUDA runtime reads a stream through it
    (runtime.Runtime.stream_ptr), and the op wrapper applies it on CPU too:
    a CPU call took any object and a CUDA one refused it."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        if not 0 <= stream < STREAM_END:
            raise ValueError(f"stream: an int stream handle must be in [0, 2**63) (a CUstream is a "
                             f"pointer, which CuPy and the launch take as a signed intptr_t), got {stream}")
        return None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return attr
    raise TypeError(f"stream: expected a torch.cuda.Stream, cupy Stream or int, got {type(stream).__name__}")


def stream_device(stream):
    """The device index of a torch stream (its `device_index`) or CuPy
    stream (its `device_id`), None where it names none (an int handle,
    CuPy's null stream: device_id -1)."""
    d = getattr(stream, "device_index", None)
    if d is None:
        d = getattr(stream, "device_id", None)
    return d if d.__class__ is int and d >= 0 else None


def stream_current(stream):
    """The context an op body runs in when it is given a stream (not None,
    checked by check_stream): that stream made torch's current one on its
    device (torch.cuda.stream), so that the CUDA work a body does beside its
    kernels is ordered on the stream they run on: a DLPack import of a CuPy
    or JAX array (the producer orders its pending writes before the
    consumer's current stream), the copies the rules make of views a kernel
    cannot read as they are, and their memory, which the caching allocator
    ties to the stream current at allocation. On torch's current stream they
    ran unordered with the kernels: a kernel read an array or a copy before
    it was written. An int handle names no device, and a CuPy null stream
    (device_id -1) none either: nothing (the caller orders that work)."""
    torch = _torch_or_none()
    if torch is None or stream.__class__ is int:
        return _NO_CONTEXT
    if isinstance(stream, torch.cuda.Stream):
        return _OnStream(torch, stream)
    dev = stream_device(stream)
    if dev is None:
        return _NO_CONTEXT
    return _OnStream(torch, torch.cuda.ExternalStream(int(stream.ptr), device=f"cuda:{dev}"))


_CALLER = threading.local()     # .stream: the caller's current stream while a body runs on another


class _OnStream:
    """torch.cuda.stream(s), remembering the caller's current stream of s's
    device (callers_stream) while the body runs: the capture rules look at
    the stream an op runs on and at the caller's current one
    (Runtime.capturing), which this context has replaced."""
    __slots__ = ("torch", "s", "ctx", "prev")

    def __init__(self, torch, s):
        self.torch, self.s = torch, s

    def __enter__(self):
        self.prev = getattr(_CALLER, "stream", None)
        _CALLER.stream = self.torch.cuda.current_stream(self.s.device)
        self.ctx = self.torch.cuda.stream(self.s)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        try:
            return self.ctx.__exit__(*exc)
        finally:
            _CALLER.stream = self.prev


def callers_stream():
    """The caller's current stream (of the op's stream's device) while an
    op's body runs on its stream= (stream_current), else None."""
    return getattr(_CALLER, "stream", None)


def placement(*named) -> str:
    """'cpu' if the arrays are numpy arrays / CPU tensors, 'cuda' if they are
    CUDA tensors or other DLPack device arrays; mixing the two is an error.
    `named` is pairs (name, array); None entries are ignored."""
    # Fast path (the hot path): only CUDA tensors, numbers and Nones.
    for _, x in named:
        if not (x is None or getattr(x, "is_cuda", False) is True or isinstance(x, (int, float))):
            break
    else:
        if any(getattr(x, "is_cuda", False) is True for _, x in named):
            return "cuda"
    where = None
    first = None
    for name, x in named:
        if x is None or _is_scalar(x):      # scalars (numpy ones too) live nowhere
            continue
        if isinstance(x, np.ndarray):
            w = "cpu"
        elif is_torch(x):
            w = "cuda" if x.is_cuda else "cpu"
            if not x.is_cuda and x.device.type != "cpu":
                raise ValueError(f"{name}: rawkv runs on CPU or CUDA tensors, got device {x.device}")
        elif hasattr(x, "__dlpack_device__"):
            dev_type = x.__dlpack_device__()[0]
            w = "cpu" if dev_type == 1 else "cuda"
        else:
            raise TypeError(f"{name}: expected a tensor or array, got {type(x).__name__}")
        if where is None:
            where, first = w, name
        elif w != where:
            raise ValueError(f"{name}: is on {w} but {first} is on {where}; rawkv does not move data")
    return where or "cpu"


def as_cuda_tensor(x, name: str):
    """A torch CUDA tensor for `x`: torch tensors as they are, any other DLPack
    device array (CuPy, JAX, ...) wrapped zero-copy."""
    if getattr(x, "is_cuda", False) is True or is_torch(x):
        return x
    try:
        import torch
    except ImportError as exc:
        raise GpuUnavailableError("rawkv GPU ops need PyTorch: pip install torch") from exc
    try:
        return torch.from_dlpack(x)
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument name
        raise TypeError(f"{name}: could not be wrapped through DLPack: {exc}") from exc


def is_cuda_tensor(x) -> bool:
    """Fast test for the hot path: a torch CUDA tensor."""
    return getattr(x, "is_cuda", False) is True


def to_numpy(x, name: str) -> np.ndarray:
    """numpy view/copy of a CPU array; BF16 becomes float32 (exact), FP8/FP4
    tensor dtypes become their uint8 bytes."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        import torch
        if x.dtype == torch.bfloat16:
            return x.detach().float().numpy()
        if x.dtype in byte_dtypes(torch):
            return x.detach().view(torch.uint8).numpy()
        return x.detach().numpy()
    return to_numpy(_dlpack_array(x, name), name)


def byte_dtypes(torch) -> tuple:
    """torch dtypes that are bytes of a packed format (uint8 and the FP8/FP4
    views; float8_e8m0fnu: block scales)."""
    out = [torch.uint8]
    for n in ("float8_e4m3fn", "float4_e2m1fn_x2", "float8_e8m0fnu"):
        if hasattr(torch, n):
            out.append(getattr(torch, n))
    return tuple(out)


def from_numpy(arr: np.ndarray, like, *, torch_dtype=None, out=None):
    """Return `arr` in the library of `like` (numpy or CPU torch). If `out` is
    given, copy into it and return it. `torch_dtype` (a torch dtype or its
    name, resolved only when torch is involved) converts float32 holding BF16
    values to torch.bfloat16 (exactly) or bytes to FP8/FP4 views."""
    if out is not None:
        if isinstance(out, np.ndarray):
            if out.shape != arr.shape:
                raise ValueError(f"out: expected shape {arr.shape}, got {out.shape}")
            out[...] = arr.astype(out.dtype, copy=False)
            return out
        t = _as_torch(arr, torch_dtype)
        if tuple(out.shape) != tuple(t.shape):
            raise ValueError(f"out: expected shape {tuple(t.shape)}, got {tuple(out.shape)}")
        if out.dtype != t.dtype and t.dtype.itemsize == out.dtype.itemsize == 1:
            out.view(t.dtype).copy_(t)
        else:
            out.copy_(t)
        return out
    if is_torch(like):
        return _as_torch(arr, torch_dtype)
    return arr


def _as_torch(arr: np.ndarray, torch_dtype):
    import torch
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    # (np.ascontiguousarray would make a 0-d array 1-d)
    t = torch.from_numpy(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))
    if torch_dtype is None or t.dtype == torch_dtype:
        return t
    if t.dtype == torch.uint8 and torch_dtype.itemsize == 1:
        return t.view(torch_dtype)
    return t.to(torch_dtype)


def _is_scalar(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating, bool, np.bool_))


def dims(a) -> tuple:
    """The shape of an array argument as a tuple; () for anything without
    one, or a tensor the rules refuse as not strided (unstrided: a nested
    tensor has no sizes, or a ragged one; the op's argument checks then
    refuse it, naming it)."""
    if is_torch(a) and not_strided(a):
        return ()
    return _shape(a)


def _shape(a) -> tuple:
    """dims of an argument already known not to be an unstrided tensor."""
    s = getattr(a, "shape", None)
    return tuple(s) if s is not None else ()



def require_array(x, name: str):
    """`x` must be an array (torch tensor, numpy array or DLPack array):
    numbers and None passed where a tensor belongs are a TypeError naming
    the argument. Returns x."""
    if x is None or is_number(x) or isinstance(x, (bool, np.bool_, str, bytes)) or not (
            isinstance(x, np.ndarray) or is_torch(x) or hasattr(x, "__dlpack__")):
        raise TypeError(f"{name}: expected a tensor or array, got "
                        f"{'None' if x is None else type(x).__name__}")
    return x


# ---- the one check of a tensor argument -----------------------------------------------------
# dtype names as torch spells them: numpy arrays need no torch to be checked
FLOATS = ("float32", "float16", "bfloat16")
BYTES = ("uint8", "float8_e4m3fn", "float4_e2m1fn_x2")     # packed codes and scales
INDEX = ("int32", "int64")

# dtype -> 'float32', one dict per library: torch.compile traces lookups in
# the torch one, and dynamo (torch 2.11) cannot hash the numpy dtypes that
# would otherwise sit beside them as keys (a graph break in fullgraph mode).
_NUMPY_NAMES: dict = {}
_TORCH_NAMES: dict = {}


def _dtype_named(d) -> str:
    names = _NUMPY_NAMES if isinstance(d, np.dtype) else _TORCH_NAMES
    name = names.get(d)
    if name is None:
        name = names[d] = str(d).replace("torch.", "")
    return name


class _Host:
    """A numpy array seen through the tensor methods the checks call, so
    one list of rules serves both (a torch tensor is checked as it is)."""
    __slots__ = ("a",)

    def __init__(self, a: np.ndarray):
        self.a = a

    dtype = property(lambda self: self.a.dtype)
    shape = property(lambda self: self.a.shape)
    ndim = property(lambda self: self.a.ndim)

    def get_device(self) -> int:
        return -1

    def is_contiguous(self) -> bool:        # dimensions of size 1 take any stride, as in torch
        return self.a.flags.c_contiguous

    def data_ptr(self) -> int:
        return self.a.__array_interface__["data"][0]

    def numel(self) -> int:
        return self.a.size

    def element_size(self) -> int:
        return self.a.itemsize

    def stride(self) -> tuple:              # in elements, as torch counts them
        return tuple(s // self.a.itemsize for s in self.a.strides)


def _seen(a):
    return _Host(a) if isinstance(a, np.ndarray) else a


def dtype_name(a) -> str:
    """The dtype of a numpy array or torch tensor as torch spells it."""
    return _dtype_named(a.dtype)


def device_of(a) -> int:
    """The CUDA device index of a tensor, -1 for a host array."""
    return -1 if isinstance(a, np.ndarray) else a.get_device()


def address(a) -> int:
    """The address of the first element of a numpy array or torch tensor."""
    return _seen(a).data_ptr()


def strides(a) -> tuple:
    """Strides in elements (numpy's are in bytes)."""
    return tuple(_seen(a).stride())


def itemsize(a) -> int:
    return a.itemsize if isinstance(a, np.ndarray) else a.element_size()


def numel(a) -> int:
    return a.size if isinstance(a, np.ndarray) else a.numel()


def as_read(a, name: str):
    """`a` as the op's rules will read it, for a public function that sizes
    its new outputs before they run: a torch tensor, numpy array or
    non-array (the rules name it) as it is; another DLPack array (CuPy,
    JAX, ...) through the zero-copy view the rules wrap it in. The protocol
    promises such an array no .shape or .dtype: a bare producer sized
    outputs of no rows (then refused as out; where an op trusts the outputs
    it has just sized, a kernel would write past them), and moe_stage gave
    no topk_weights."""
    if is_torch(a) or isinstance(a, np.ndarray) or not hasattr(a, "__dlpack__"):
        return a
    return _dlpack_array(a, name)


def out_lead(ids, name: str) -> tuple:
    """The shape an op's new output takes from an input `ids` (argument
    `name`) the op needs contiguous (an index argument, fp8's x): its shape
    as the rules read it (as_read), or (0,) where the op's rules will
    refuse it as not contiguous, which they check before the output: a
    stride-0 view of 2^32 ids sized terabytes of output before it was
    named."""
    ids = as_read(ids, name)
    if is_torch(ids) and not_strided(ids):
        return (0,)             # (a sparse or nested tensor: the rules refuse it, unstrided)
    if (is_torch(ids) or isinstance(ids, np.ndarray)) and not is_dense(ids):
        return (0,)
    return _shape(ids)


def is_dense(a) -> bool:
    """C-contiguous (dimensions of size 1 take any stride, as in torch)."""
    return a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_contiguous()


def _as_array(a, name: str, where: str):
    """`a` (already an array) as what the op's placement computes on: a torch
    tensor or numpy array as it is, another DLPack array as a torch CUDA
    tensor ('cuda') or a zero-copy CPU torch tensor ('cpu'; a numpy array
    without torch: numpy has no BF16 or FP8)."""
    if isinstance(a, np.ndarray) or is_torch(a):
        return a
    if where == "cuda":
        return as_cuda_tensor(a, name)
    return _dlpack_array(a, name)


#: tensor()'s `align` for an argument a kernel loads, stores or atomically
#: adds to element by element (a float32 gs or scale, an int32 counter, int64
#: indices): its first element aligned to its own size. A misaligned 4- or
#: 8-byte access faults on the GPU (a sticky error), where numpy on the host
#: reads it; torch's views never make one, a DLPack array (CuPy, numpy) or
#: torch.frombuffer at an odd byte offset may.
ELEMENT = -1


def tensor(a, name: str, dtypes, where: str, *, shape=None, min_ndim: int = 0, device=None,
           dense: bool = True, align: int = 1):
    """The check of one tensor argument, the same for every op on CPU and
    CUDA: `a` is an array (require_array), of one of `dtypes` (names as torch
    spells them), at least `min_ndim` dimensions, of `shape` if given, on
    CUDA device `device` (an index; -1 is the host) if given, C-contiguous
    unless `dense` is False (the op then checks the strides it takes
    itself), its first element `align`-byte aligned when it holds any
    (ELEMENT: aligned to its element size). `where` is the op's placement (placement). Numpy arrays
    and CPU tensors are held to the rules the kernels need, so code that
    runs on CPU runs on the GPU. Returns the array: a torch tensor or numpy
    array as given, another DLPack array wrapped (as_cuda_tensor)."""
    t = _torch
    if t is None or not isinstance(a, t.Tensor):            # (a torch tensor: the hot path)
        if not isinstance(a, np.ndarray):
            a = _as_array(require_array(a, name), name, where)
    elif a.layout is not t.strided or a.is_nested:
        unstrided(a, name)
    v = _seen(a)
    d = _TORCH_NAMES.get(v.dtype) or _dtype_named(v.dtype)   # (a torch dtype first: the hot path)
    if d not in dtypes:
        raise TypeError(f"{name}: dtype {d} is not supported (expected {', '.join(dtypes)})")
    if v.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s), got shape {tuple(v.shape)}")
    if shape is not None and v.shape != shape and tuple(v.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(v.shape)}")
    if device is not None and v.get_device() != device:
        raise ValueError(f"{name}: is on {_device_name(v.get_device())} but the op runs on "
                         f"{_device_name(device)}")
    if v is not a and any(st % a.itemsize for st in a.strides):
        # (a numpy view with byte strides that are no whole elements: a record
        # field, an as_strided view; no torch tensor has them, and the stride
        # rules below count elements)
        raise ValueError(f"{name}: strides {a.strides} (bytes) are not whole {a.itemsize}-byte elements; "
                         "pass a copy (numpy.ascontiguousarray)")
    if v is a:
        unaddressable(a, name)
    if dense and not v.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (got strides {tuple(v.stride())}); "
                         "call .contiguous() first")
    if align == ELEMENT:
        align = v.element_size()
    if align > 1 and v.data_ptr() % align and v.numel():
        raise ValueError(f"{name}: data must be {align}-byte aligned for this kernel "
                         f"(address {v.data_ptr():#x}); pass a fresh copy (.clone(): .contiguous() "
                         "returns a contiguous view as it is)")
    return a


def not_strided(t) -> bool:
    """A torch tensor that is not one block of strided memory (unstrided)."""
    return t.layout is not _torch.strided or t.is_nested


def unstrided(t, name: str) -> None:
    """Refuse a torch tensor that is not one block of strided memory: a
    sparse one (COO, CSR, CSC, BSR, BSC), an MKL-DNN one, a nested one
    (strided or jagged). The kernels and the reference address an argument
    through its data pointer, sizes and strides: a sparse or MKL-DNN tensor
    has no data pointer, a nested one no sizes (strided) or a ragged one
    (jagged), and each failed inside the op with torch's RuntimeError
    ('Cannot access data pointer of Tensor that doesn't have storage',
    'NestedTensorImpl doesn't support sizes'), naming no argument; a jagged
    one was 'has no memory'. A TypeError naming the argument (before
    anything is sized, launched or written: tensor() checks it first)."""
    if t.is_nested:
        raise TypeError(f"{name}: is a nested tensor (layout {t.layout}); rawkv's ops take dense, strided "
                        "tensors: pad it (.to_padded_tensor(0)) or call the op per component")
    sparse = "sparse" in str(t.layout)
    raise TypeError(f"{name}: is {'a sparse' if sparse else 'an unstrided'} tensor (layout {t.layout}); rawkv's "
                    "ops take dense, strided tensors: call .to_dense() first")


def unaddressable(t, name: str) -> None:
    """Refuse a torch tensor whose memory is not its values: one with the
    negative bit set (a lazily negated view, such as z.conj().imag: its
    storage holds the values' negation, which a kernel would read or write
    through the data pointer) or one with no memory (data pointer 0 while it
    holds elements: a ZeroTensor, a tensor whose storage was freed: a kernel
    would access address 0). The CPU path refused both too, by an unnamed
    error from numpy()."""
    if t.is_neg():
        raise TypeError(f"{name}: has its negative bit set (a lazily negated view such as "
                        "z.conj().imag: its memory holds the negated values); call .resolve_neg() first")
    if t.data_ptr() == 0 and t.numel():
        raise ValueError(f"{name}: has no memory (data pointer 0 with {t.numel()} element(s): a "
                         "ZeroTensor, or a tensor whose storage was freed); pass a materialized tensor")


def row_stride(a):
    """The elements between the rows of `a` (at least one dimension) read
    as rows (rows()): its last dimension contiguous and its leading
    dimensions collapsing into one evenly strided row index at least a row
    apart; None for any other layout (a stride-0 view among them)."""
    n = a.shape[-1]
    if is_dense(a):
        return n
    st = strides(a)
    if st[-1] != 1:
        return None
    lead = [(s, t) for s, t in zip(a.shape[:-1], st[:-1]) if s != 1]
    ok = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
    if ok and (not lead or lead[-1][1] >= n):
        return lead[-1][1] if lead else n
    return None


def out_rows(x, name: str) -> tuple:
    """The shape new outputs of an op that reads x (argument `name`) as
    rows() are sized from: x's shape as the rules read it (as_read), or
    (0,) where rows() will refuse x's layout, which the op checks before
    its outputs (a stride-0 view of 2^34 rows sized terabytes of output
    before it was named)."""
    x = as_read(x, name)
    if is_torch(x) and not_strided(x):
        return (0,)             # (a sparse or nested tensor: the rules refuse it, unstrided)
    s = _shape(x)
    if s and (is_torch(x) or isinstance(x, np.ndarray)) and row_stride(x) is None:
        return (0,)
    return s


def rows(a, name: str, dtypes, where: str, *, align: int = 1) -> tuple:
    """(array, M, N, ldx) of an input read as rows (an encode's x): `a`
    checked by tensor() (at least one dimension, strides its own), its
    leading dimensions flattened into M rows, evenly strided `ldx` elements
    apart, with a contiguous last dimension of N elements; rows 16 bytes
    apart at a multiple (the kernels load rows 16 bytes at a time). Any
    other layout is a ValueError naming it."""
    a = tensor(a, name, dtypes, where, min_ndim=1, dense=False, align=align)
    n, m = a.shape[-1], math.prod(a.shape[:-1])
    if is_dense(a):
        return a, m, n, n
    ldx = row_stride(a)
    if ldx is None:
        st = strides(a)
        raise ValueError(f"{name}: unsupported strides {st} for shape {tuple(a.shape)}: "
                         "the last dimension must be contiguous and the rows evenly strided "
                         "(e.g. a row slice of a 2-D tensor); call .contiguous() first")
    if m > 1 and (ldx * itemsize(a)) % 16:
        raise ValueError(f"{name}: rows are {ldx * itemsize(a)} bytes apart, not a multiple of 16 "
                         "(the kernels load rows 16 bytes at a time; a view starting mid-row?); "
                         "call .clone() first")
    return a, m, n, ldx


def host(*arrays) -> tuple:
    """The CPU path's checked arrays as numpy (to_numpy: views of the same
    memory, bfloat16 as a float32 copy, FP8 / FP4 as their bytes), for the
    reference to read and write; None and numbers as they are."""
    return tuple(a if a is None or is_number(a) else to_numpy(a, "array") for a in arrays)


def _device_name(index: int) -> str:
    return "cpu" if index < 0 else f"cuda:{index}"


def counter(errors, where: str, device: int, name: str = "errors"):
    """An error counter the op adds to: an int32 tensor of at least one
    element (the kernels add to its first, atomically: 4-byte aligned), on
    the op's device."""
    errors = tensor(errors, name, ("int32",), where, device=device, align=ELEMENT)
    if numel(errors) < 1:
        raise ValueError(f"{name}: expected an int32 tensor with at least 1 element")
    return errors


def decode_dtype(dtype, out, default: str):
    """The dtype name a decode op writes, from its public `dtype`: `dtype`
    (a torch dtype, numpy dtype or name; one of FLOATS, else a TypeError
    naming dtype), `default` when neither dtype nor out is given, None
    when only out is (out's own dtype then decides: decoded())."""
    if dtype is None:
        return default if out is None else None
    try:
        hit = _DECODE_DTYPES.get(dtype)
    except TypeError:           # unhashable: refused below
        hit = None
    if hit is None:
        hit = name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        if name not in FLOATS:
            raise TypeError(f"dtype: expected one of {', '.join(FLOATS)}; got {dtype!r}")
        # remembered for names and torch dtypes only: torch.compile traces this
        # lookup, and dynamo cannot hash a numpy dtype key anywhere in the dict
        if isinstance(dtype, str) or type(dtype).__module__ == "torch":
            _DECODE_DTYPES[dtype] = name
    if out is not None and is_torch(out) and out.dtype is not _torch_dtype(hit):
        # (checked here too: the public function runs under torch.compile,
        # while the operator it calls never sees `dtype`)
        raise TypeError(f"out: dtype {str(out.dtype).replace('torch.', '')} is not supported (expected {hit})")
    return hit


def _torch_dtype(name: str):
    return getattr(_torch, name)


_DECODE_DTYPES: dict = {}


def decoded(out, dtype, where: str, shape, device: int, align: int = 1):
    """(out, dtype name) of a decode op's output: one of FLOATS, `dtype`'s
    if given (decode_dtype; a numpy float32 array holds bfloat16 values,
    numpy having no bfloat16), else out's own."""
    if dtype is None:
        allowed = FLOATS
    elif dtype == "bfloat16" and isinstance(out, np.ndarray):
        allowed = ("bfloat16", "float32")
    else:
        allowed = (dtype,)
    out = tensor(out, "out", allowed, where, shape=shape, device=device, align=align)
    return out, dtype or dtype_name(out)


def split_number(v) -> tuple:
    """A public argument that is a number or a tensor (a gs) as its
    operator's two arguments (`Tensor? gs`, `float? gs_value`), unchecked:
    (None, v) for a number (Python or numpy, a numpy one as a Python float:
    the schema takes no numpy scalar), else (v, None). Plain Python:
    torch.compile traces it (as_number: traced, the 0-d array a NumPy
    scalar becomes is a number too)."""
    n = as_number(v)
    if n is not v:                      # a NumPy scalar
        return None, float(n)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return None, (v if isinstance(v, int) else float(v))
    return v, None


def default_scope(scope, gs, default: str) -> str:
    """scope None means 'given' when gs is given, else the family's default."""
    if scope is None:
        return "given" if gs is not None else default
    return scope


class _TorchDtypes:
    """torch dtype groups and names, built once (rebuilding them per call
    costs microseconds on the launch path)."""

    def __init__(self, torch):
        self.floats = (torch.float32, torch.float16, torch.bfloat16)
        self.bytes = byte_dtypes(torch)
        self.fp8 = tuple(d for d in self.bytes[:2])          # uint8, float8_e4m3fn
        self.e4m3 = getattr(torch, "float8_e4m3fn", None)      # typed views, where torch has them
        self.e2m1x2 = getattr(torch, "float4_e2m1fn_x2", None)
        self.sf_views = tuple(d for d in (torch.uint8, self.e2m1x2) if d is not None)   # viewed as e4m3
        self.name = {d: str(d).replace("torch.", "") for d in (*self.floats, *self.bytes)}


_DTYPES = None


def dtypes() -> _TorchDtypes:
    global _DTYPES
    if _DTYPES is None:
        import torch
        _DTYPES = _TorchDtypes(torch)
    return _DTYPES


def as_q(t):
    """NVFP4 code bytes (uint8 or float8_e4m3fn) as torch.float4_e2m1fn_x2
    where torch has it; anything else as it is (numpy arrays, other
    dtypes): how an encode returns the q it wrote."""
    torch = _torch or _torch_or_none()          # (no call once torch is bound: the hot path)
    if torch is None or not isinstance(t, torch.Tensor):
        return t
    dt = dtypes()
    return t.view(dt.e2m1x2) if dt.e2m1x2 is not None and t.dtype in dt.fp8 else t


def as_sf(t):
    """Block-scale bytes (uint8 or float4_e2m1fn_x2) as torch.float8_e4m3fn
    where torch has it; anything else as it is (see as_q)."""
    torch = _torch or _torch_or_none()
    if torch is None or not isinstance(t, torch.Tensor):
        return t
    dt = dtypes()
    return t.view(dt.e4m3) if dt.e4m3 is not None and t.dtype in dt.sf_views else t


def aligned16(*tensors) -> bool:
    """True if every tensor's data pointer is 16-byte aligned (vector path)."""
    acc = 0
    for t in tensors:
        acc |= t.data_ptr()
    return acc & 15 == 0


def cpu_dtype_name(a, name: str) -> str:
    """dtype of a CPU array (numpy, CPU torch tensor or DLPack array) as torch
    spells it ('float32', 'bfloat16', 'float8_e4m3fn'); numpy arrays need no torch."""
    if isinstance(a, np.ndarray):
        return str(a.dtype)
    if is_torch(a):
        return str(a.dtype).replace("torch.", "")
    return str(to_numpy(a, name).dtype)


def check_cpu_array(a, name: str, allowed, shape=None) -> str:
    """The CUDA path's dtype (and shape) checks for a CPU argument, before
    the reference runs or anything is written; returns the dtype name."""
    d = cpu_dtype_name(a, name)
    if d not in allowed:
        raise TypeError(f"{name}: dtype {d} is not supported (expected {', '.join(allowed)})")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    return d


def is_number(v) -> bool:
    """A Python or numpy real scalar (not a bool, not an array)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def positive_int(name: str, v) -> int:
    """A size an object is built with (a layer's groups, a pool's blocks):
    a Python or NumPy int >= 1, as a Python int; a bool, float or anything
    else a TypeError, 0 or less a ValueError, each naming the argument.
    (One rule: until session 64 the GEMM layer, the weight loaders and the
    KV-cache pool each had their own copy, in three wordings.)"""
    if not is_int(v):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v}")
    return int(v)


def as_number(v):
    """`v`, an argument where a number goes, with a NumPy integer or float
    scalar as the Python int or float it holds (np.int64(64) is 64,
    np.float32(0.5) is 0.5); anything else (a NumPy bool, an array, None)
    as it is, for the op's rules to check.

    *Decision* (docs/runtime.md, "Numbers"): a NumPy scalar is the number it
    holds, eagerly, through torch.ops.rawkv.* (torch converts it) and under
    torch.compile, so the op checks the same value everywhere. Dynamo
    traces a NumPy scalar as a 0-d array, which went on as a tensor (a gs
    of 0 decoded zeros where the eager op refused it) or failed the
    operator call; traced, one of a real dtype becomes the Python number
    (the value of one the compiled function is given, unless int64 or
    float64, is a symbol the operator cannot take: torch names the
    argument). Dynamo cannot tell a 0-d array from a NumPy scalar: compiled,
    a 0-d array where a number goes is one."""
    c = v.__class__
    if c is int or c is float or v is None:                 # (the hot path)
        return v
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, np.ndarray) and _torch is not None and _torch.compiler.is_dynamo_compiling() \
            and v.ndim == 0:
        d = _torch.as_tensor(v).dtype                       # (dynamo reads no ndarray.dtype)
        if d.is_floating_point:
            return float(v)
        if d is not _torch.bool and not d.is_complex:
            return v.tolist()       # (int(v) fails dynamo for a scalar made while it traces)
    return v


# The doubles that round (to nearest, ties to even) to a finite positive
# float32: above 2^-150 (the tie below the smallest subnormal 2^-149 goes to
# 0) and below 2^128 - 2^103 (the tie above FLT_MAX goes to inf). Compared as
# Python floats: np.float32() under np.errstate cost ~1.5 us per op call.
_F32_ZERO_UP_TO = 2.0 ** -150
_F32_INF_FROM = 2.0 ** 128 - 2.0 ** 103


def _positive_float32(v, name: str, what: str) -> float:
    try:
        f = float(v)
    except OverflowError:       # a Python int beyond the double range
        f = float("inf")
    if not _F32_ZERO_UP_TO < f < _F32_INF_FROM:      # NaN fails too
        raise ValueError(f"{name}: {what} must be a finite positive float32 "
                         f"(between {np.finfo(np.float32).smallest_subnormal:.3g} and "
                         f"{np.finfo(np.float32).max:.4g}), got {v!r:.60}")
    return f


#: the classes of a bool, Python's and NumPy's (never a number here)
BOOLS = (bool, np.bool_)


def refuse_bool(v, name: str, what: str) -> None:
    """A bool (Python or NumPy) where a number goes is a TypeError naming the
    argument, in the words the op wrapper uses for a traced one
    (`eps: expected a number, got bool`, `block: expected an int, got
    bool`): never 1 or 0 (docs/runtime.md, "Numbers"; the operators take it
    as a `Scalar`, which keeps it a bool)."""
    if v.__class__ in BOOLS:
        raise TypeError(f"{name}: expected {what}, got bool")


def check_gs_number(gs, name: str = "gs") -> float:
    """A global decode scale given as a number: the kernels read it as float32,
    so it must be finite and > 0 *as a float32* (1e39 would become inf, 1e-46
    would become 0). Returns it as a Python float."""
    if not is_number(gs):
        raise TypeError(f"{name}: expected a float, got {gs!r}")
    return _positive_float32(gs, name, "a global scale")


def check_eps(eps, name: str = "eps") -> float:
    """An RMSNorm epsilon: a real number (Python or numpy, not a bool), finite
    and > 0 as a float32 (eps = 0 would give NaN on an all-zero row). A bool
    is a TypeError naming it (refuse_bool); anything else a ValueError."""
    refuse_bool(eps, name, "a number")
    if not is_number(eps):
        raise ValueError(f"{name}: expected a positive finite number, got {eps!r}")
    return _positive_float32(eps, name, "epsilon")


def check_scope_gs(scope, gs, scopes, default: str):
    """(scope, gs) of an encode op with a choice of global-scale scope.

    scope None means 'given' when gs is given, else `default` (each
    family passes its own documented default); any other scope must be one
    of `scopes`. Scope 'given' needs gs and no other scope takes one. A number
    gs (Python or numpy; a bool is a TypeError) is checked by check_gs_number
    and returned as a Python float; anything else must be an array
    (require_array) of one element, returned as it is: its dtype, device and
    value are the family's to check."""
    scope = default_scope(scope, gs, default)
    if not isinstance(scope, str) or scope not in scopes:     # (an array compares elementwise)
        raise ValueError(f"scope: expected one of {tuple(scopes)}, got {scope!r}")
    if scope != "given":
        if gs is not None:
            raise ValueError(f"gs: only scope 'given' takes a global scale (scope is {scope!r})")
        return scope, None
    if gs is None:
        raise ValueError("gs: scope 'given' needs a global scale (a float or a 1-element float32 tensor)")
    if getattr(gs, "is_cuda", False) is not True:        # (a CUDA tensor: the hot path)
        if is_number(gs) or isinstance(gs, (bool, np.bool_)):
            return scope, check_gs_number(gs, "gs")
        require_array(gs, "gs")
    if is_torch(gs) and not_strided(gs):
        unstrided(gs, "gs")         # (a nested tensor has no .shape to read)
    shape = getattr(gs, "shape", None)
    if shape is not None:
        shape = shape if isinstance(shape, tuple) else tuple(shape)
        if shape.count(1) != len(shape):                   # some dimension is not 1
            raise ValueError(f"gs: expected a float or a 1-element tensor, got shape {shape}")
    return scope, gs


def gs_tensor(gs, where: str, device: int):
    """A given gs that is an array (check_scope_gs let it through): float32,
    one element, on `device`, its element aligned (the kernels load it as a
    float, in place). check_scope_gs refuses a shape of other than ones on
    the .shape it reads, which a DLPack array need not have (with 2
    elements or none the CPU failed in numpy unnamed and a kernel read the
    first float of two, or past an empty gs): the count is checked here, on
    the array the rules read. Returns it (a DLPack array wrapped, tensor())."""
    gs = tensor(gs, "gs", ("float32",), where, device=device, dense=False, align=ELEMENT)
    if numel(gs) != 1:
        raise ValueError(f"gs: expected a float or a 1-element tensor, got shape {tuple(gs.shape)}")
    return gs


def op_gs(gs, gs_value, required: bool = False):
    """A public op's gs from its custom operator's two arguments (a schema
    argument has one type, rawkv._opdecl): a tensor `gs` or a number
    `gs_value`, at most one of them, exactly one when `required` (else
    None: neither). A bool gs_value (the operator's `Scalar? gs_value`
    keeps it) is a TypeError naming it (a bool gs is the op's rule's)."""
    if gs_value is not None:
        refuse_bool(gs_value, "gs_value", "a number")
    if gs is not None and gs_value is not None:
        raise ValueError("gs: expected a gs tensor or a gs_value number, got both")
    if gs is None and gs_value is None and required:
        raise TypeError("gs: expected a gs tensor or a gs_value number, got neither")
    return gs if gs is not None else gs_value


# ---- outputs: writable, and apart from each other and from the inputs ----------------------
def writable_here(outputs) -> bool:
    """Whether torch lets these tensors (or Nones) be written here: none is
    an inference tensor while torch.inference_mode is off. The fast paths
    ask it before a remembered launch (check_outputs names such an output;
    a launch remembered inside inference_mode would write it outside)."""
    for t in outputs:
        if t is not None and t.is_inference():
            return sys.modules["torch"].is_inference_mode_enabled()
    return True


def check_outputs(outputs, inputs=(), owned=(), reads_apart: bool = False) -> None:
    """The arrays an op writes, checked before anything is written.

    `outputs` and `inputs` are (name, array or None) pairs (None and numbers
    are skipped). Each output must be writable (a numpy array with
    flags.writeable False is a ValueError naming it: numpy would raise only
    when the first element is stored, after other outputs were written).
    No output may share memory with another output or with an input: a
    kernel's threads read inputs while others write outputs, and two outputs
    in one place leave whichever was written last (rmsnorm_quantize's
    out=(None, None, g, g) returned inv_rms as gs). `owned` are (name, span)
    pairs (spans()) of the buffers of the object the op works on (a
    pool's, a decode state's: 'pool.written'), which it reads or writes as
    well: an output in one of them (errors=pool.written, an out= that is a
    view of pool.rope) would be overwritten by the op or would corrupt the
    object, so it is refused the same way. Overlap is decided on the bytes
    the arrays address (torch tensors and numpy arrays alike, by data
    pointer, shape and strides; interleaved views that touch no common
    byte do not overlap), and is a ValueError naming both."""
    outs = [(n, a) for n, a in outputs if a is not None and not is_number(a)]
    if not outs:
        if reads_apart:
            check_reads_apart(inputs, owned)
        return
    for name, a in outs:
        if is_torch(a) and not_strided(a):
            unstrided(a, name)          # (before anything reads its data pointer or sizes)
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"{name}: is read-only (a numpy array with flags.writeable False); "
                             "pass a writable array")
        if getattr(a, "requires_grad", False):
            # (the CPU path's copy into it would fail after other outputs were
            # written; a kernel would write behind autograd's back)
            raise ValueError(f"{name}: requires grad; rawkv's ops write their outputs in place, which "
                             "autograd does not track: pass a tensor without requires_grad")
        if is_torch(a):
            unaddressable(a, name)      # (outputs some op checks no further)
        if is_torch(a) and not writable_here((a,)):
            # (the same: torch lets nothing change an inference tensor outside
            # inference_mode; the CPU path raised after writing, a kernel wrote)
            raise ValueError(f"{name}: is an inference tensor (made under torch.inference_mode), which may "
                             "only be written inside torch.inference_mode: call the op there, or pass a plain "
                             "tensor")
    spans_out = spans(outs)
    read = spans(inputs)
    spans_in = read + tuple(owned)
    for i, (name, s) in enumerate(spans_out):
        for other, t in spans_out[:i] + spans_in:
            if _overlap(s, t):
                raise ValueError(f"{name}: overlaps {other} in memory; the op would write one over "
                                 f"the other (pass separate buffers)")
    if reads_apart:
        _reads_apart(read, owned)


def check_reads_apart(inputs, owned) -> None:
    """The arrays an op reads while it writes the buffers `owned` ((name,
    span) pairs, spans(): a pool's or decode state's) may not lie in them:
    the op would read what it overwrites (a state_seed kv that is a view of
    state.kv_a read rows the op had just cleared; on a GPU, blocks race). A
    ValueError naming both, before anything is written. `inputs` as
    check_outputs takes them (None and numbers skipped); check_outputs(...,
    reads_apart=True) checks the same with the spans it has made."""
    _reads_apart(spans(inputs), owned)


def check_spans_apart(read: tuple, owned) -> None:
    """check_reads_apart of inputs already spanned (spans(): e.g. a decode
    state's buffers, spanned once per object)."""
    _reads_apart(read, owned)


def _reads_apart(read: tuple, owned) -> None:
    for name, s in read:
        for other, t in owned:
            if _overlap(s, t):
                raise ValueError(f"{name}: overlaps {other} in memory; the op writes {other} while it "
                                 f"reads {name} (pass a copy)")


def spans(pairs) -> tuple:
    """((name, span), ...) of the arrays of (name, array or None) `pairs`
    (None and numbers skipped): the memory check_outputs compares. Buffers
    checked on every call (a pool's, fixed when it is built) are spanned
    once and passed as check_outputs' `owned`."""
    return tuple((n, _span(a)) for n, a in pairs if a is not None and not is_number(a))


def detached_spans(pairs) -> tuple:
    """spans(pairs) holding no reference to the arrays (their geometry read
    now): for a cache that must not keep the arrays alive."""
    return tuple((n, s if s is None or s[4].__class__ is tuple else (*s[:4], _array_geometry(s[4])))
                 for n, s in spans(pairs))


def apart(shape, strides) -> bool:
    """Whether no two elements of a strided view share memory, by the usual
    sufficient rule: each dimension's stride, smallest first, steps past
    everything the smaller ones span. (A view it refuses may still be
    apart in an exotic interleaving; none a caller needs.) The dimensions
    are tried in their own order first, innermost first: the usual layout
    passes without a sort (this runs on every GEMM call)."""
    span, i = 0, len(shape)
    while i:
        i -= 1
        if shape[i] > 1:
            if strides[i] <= span:
                break
            span += (shape[i] - 1) * strides[i]
    else:
        return True
    span = 0
    for st, d in sorted(zip(map(abs, strides), shape)):
        if d > 1:
            if st <= span:
                return False
            span += (d - 1) * st
    return True


def same_memory(a, b) -> bool:
    """`a` and `b` address the same bytes the same way (one array, or two
    views of it alike: a numpy array and torch.from_numpy of it)."""
    s, t = _span(a), _span(b)
    return s is not None and t is not None and _geometry(s) == _geometry(t)


def _span(a):
    """(address space, first byte, end byte, dense, source) of the memory
    `a` addresses; None for an empty array or one that is neither a numpy
    array, a torch tensor nor a DLPack array either library can view.
    `source` is the array when it is dense (its bytes are the range: its
    geometry is read only if an overlap test needs it; every op call spans
    its arrays), else its geometry (_geometry; a detached span has it for a
    dense array too)."""
    if isinstance(a, np.ndarray):
        if a.size == 0:
            return None
        if a.flags.c_contiguous or a.flags.f_contiguous:
            ptr = a.__array_interface__["data"][0]
            return "host", ptr, ptr + a.nbytes, True, a
    elif is_torch(a):
        n = a.numel()
        if n == 0:
            return None
        try:
            ptr = a.data_ptr()
        except RuntimeError:             # a tensor without storage (meta, fake)
            return None
        if a.is_contiguous():
            return ("host" if a.device.type == "cpu" else str(a.device)), ptr, ptr + n * a.element_size(), True, a
    elif hasattr(a, "__dlpack__"):
        # Another library's array (CuPy, JAX, ...): the ops accept them, so
        # their memory is compared too, through a zero-copy view.
        view = _dlpack_view(a)
        return None if view is None else _span(view)
    else:
        return None
    g = _array_geometry(a)
    space, ptr, shape, strides, item = g
    lo = ptr + sum(s * (d - 1) for d, s in zip(shape, strides) if s < 0)
    hi = ptr + sum(s * (d - 1) for d, s in zip(shape, strides) if s > 0) + item
    return space, lo, hi, False, g


def _dlpack_view(a):
    """A zero-copy torch tensor over a DLPack array (numpy array where torch
    is missing or cannot take it); None where neither can."""
    try:
        import torch
        return torch.from_dlpack(a)
    except Exception:  # noqa: BLE001 - not every producer suits torch
        pass
    try:
        return np.from_dlpack(a)
    except Exception:  # noqa: BLE001 - nor numpy: the array cannot be compared
        return None


def _dlpack_array(a, name: str):
    """_dlpack_view of a DLPack array an op computes on (torch first: numpy
    has no BF16 or FP8), or a TypeError naming it."""
    view = _dlpack_view(a)
    if view is None:
        raise TypeError(f"{name}: could not be read through DLPack (neither torch nor numpy takes it)")
    return view


def _array_geometry(a) -> tuple:
    """(address space, pointer, shape, byte strides, item size) of a
    non-empty numpy array or torch tensor with storage."""
    if isinstance(a, np.ndarray):
        return "host", a.__array_interface__["data"][0], a.shape, a.strides, a.itemsize
    item = a.element_size()
    return (("host" if a.device.type == "cpu" else str(a.device)), a.data_ptr(), tuple(a.shape),
            tuple(s * item for s in a.stride()), item)


def _geometry(span) -> tuple:
    """The geometry (_array_geometry) of a span."""
    src = span[4]
    return src if src.__class__ is tuple else _array_geometry(src)


_TOO_HARD = getattr(np, "exceptions", np).TooHardError     # numpy < 1.25: np.TooHardError


class _Addresses:
    """A numpy array over another array's addresses (never read): numpy's
    exact overlap test (np.shares_memory) works on addresses alone."""

    def __init__(self, ptr, shape, strides, item):
        self.__array_interface__ = {"version": 3, "data": (ptr, False), "shape": tuple(shape),
                                    "strides": tuple(strides), "typestr": f"|V{item}"}


def _overlap(s, t) -> bool:
    if s is None or t is None or s[0] != t[0] or s[2] <= t[1] or t[2] <= s[1]:
        return False
    if s[3] and t[3]:                   # both dense: the ranges intersect, so the bytes do
        return True
    a, b = (np.asarray(_Addresses(*_geometry(u)[1:])) for u in (s, t))
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 16))
    except _TOO_HARD:
        return True                     # undecided within the budget: refuse
