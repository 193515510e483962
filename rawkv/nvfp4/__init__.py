"""NVFP4 quantize / dequantize / gather and the tensor-core scale layout
(docs/format.md, "NVFP4").

    q, sf, gs = rawkv.nvfp4.quantize(x)                  # scope="tensor"
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="row")     # gs: one per row
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="given", gs=g)   # float or device tensor
    q, sf, gs = rawkv.nvfp4.quantize(x, scope="none")    # one-level NVFP4, gs = 1
    y = rawkv.nvfp4.dequantize(q, sf, gs)                # bfloat16 (float16 / float32)
    y = rawkv.nvfp4.gather(q, sf, gs, idx, errors=err)   # rows idx of q, bounds-checked
    sw = rawkv.nvfp4.swizzle_scales(sf); sf2 = rawkv.nvfp4.unswizzle_scales(sw, sf.shape)

CUDA tensors run rawkv/cu/nvfp4.cu on torch's current stream (or `stream`);
numpy arrays and CPU tensors run rawkv.reference (nvfp4.py, layouts.py), which
defines every result bit for bit. Every argument is checked before anything is
launched or written. Every op takes out= buffers, so a CUDA-graph-captured step
allocates nothing; nothing here synchronizes with the host.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from .activation import QuantizedActivation
from .. import _tensors as T
from ..reference import layouts as ref_layouts
from ..reference import nvfp4 as ref
from ..runtime import get_runtime, register_kernels

_FILE = "nvfp4.cu"
_CT = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
SCOPES = ("tensor", "row", "given", "none")
BLOCK = 16
#: scope 'tensor' inputs with at most this many elements take the one-launch
#: path (each CTA reduces the whole L2-resident tensor itself).
SMALL_NUMEL = 1 << 16
_SMALL_MAX_CTAS = 16
_BLOCK_THREADS = 256

register_kernels(_FILE, [f"rkv_nvfp4_amax<{t}>" for t in _CT.values()]
                 + [f"rkv_nvfp4_quantize<{t}, {b}, {m}>" for t in _CT.values() for b in (1, 2) for m in (0, 1)]
                 + ["rkv_nvfp4_finalize_gs"]
                 + [f"rkv_nvfp4_quantize_small<{t}, {b}>" for t in _CT.values() for b in (1, 2)]
                 + [f"rkv_nvfp4_quantize_rows<{t}, {b}, {r}>" for t in _CT.values() for b in (1, 2) for r in (0, 1)]
                 + [f"rkv_nvfp4_gather<{t}, {i}, {g}>" for t in _CT.values()
                    for i in ("int", "long long") for g in ("false", "true")]
                 + ["rkv_nvfp4_swizzle", "rkv_nvfp4_unswizzle"])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _torch():
    import torch
    return torch


def _name(dtype) -> str:
    return T.dtypes().name.get(dtype) or str(dtype).replace("torch.", "")


def _q_dtype_name():
    t = sys.modules.get("torch")
    return "float4_e2m1fn_x2" if t is not None and hasattr(t, "float4_e2m1fn_x2") else None


def _sf_dtype_name():
    t = sys.modules.get("torch")
    return "float8_e4m3fn" if t is not None and hasattr(t, "float8_e4m3fn") else None


def _as_q(t):
    d = T.dtypes().e2m1x2
    return t if d is None or t.dtype is d else t.view(d)


def _as_sf(t):
    d = T.dtypes().e4m3
    return t if d is None or t.dtype is d else t.view(d)


def _byte_dtypes():
    return T.dtypes().bytes


_is_number = T.is_number


def _check_scope(scope, gs):
    """The encode gs as the op uses it: a number (Python or numpy scalar)
    checked as a float32 and returned as a Python float, else as given."""
    if scope not in SCOPES:
        raise ValueError(f"scope: expected one of {SCOPES}, got {scope!r}")
    if scope == "given" and gs is None:
        raise ValueError("gs: scope 'given' needs a global scale (a float or a 1-element float32 tensor)")
    if scope != "given" and gs is not None:
        raise ValueError(f"gs: only scope 'given' takes a global scale (scope is {scope!r})")
    if _is_number(gs) or isinstance(gs, (bool, np.bool_)):
        # a Python float from here on: T.placement and the kernel launch
        # take Python numbers, not numpy scalars
        return T.check_scale_value(gs, "gs")
    return gs


def _decode_gs(gs):
    """A decode gs given as a number (numpy scalars included) as a Python
    float, so that it flows like one through placement and the launch."""
    return float(gs) if _is_number(gs) else gs


def _out_dtype(dtype, default_name="bfloat16"):
    """(name, torch dtype or None) of a decode output dtype."""
    if dtype is None:
        name = default_name
    elif isinstance(dtype, str):
        name = dtype
    else:
        name = _name(dtype)
    if name not in _CT:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype!r}")
    t = sys.modules.get("torch")
    return name, (getattr(t, name) if t is not None else None)


def _row_view(x, name):
    """(M, N, ldx) of a CUDA tensor whose rows (all leading dims flattened)
    are evenly strided with a contiguous last dim; else ValueError."""
    if x.dim() == 0:
        raise ValueError(f"{name}: expected at least 1 dimension, got a 0-d tensor")
    n = x.shape[-1]
    m = math.prod(x.shape[:-1])
    if x.is_contiguous():
        return m, n, n
    if x.stride(-1) == 1 and x.dim() == 2:
        return m, n, x.stride(0)
    if x.stride(-1) == 1:
        # leading dims that collapse into one evenly strided row index
        lead = [(s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1]
        ok = all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))
        if ok and (not lead or lead[-1][1] >= n):
            return m, n, (lead[-1][1] if lead else n)
    raise ValueError(f"{name}: unsupported strides {tuple(x.stride())} for shape {tuple(x.shape)}: "
                     "the last dimension must be contiguous and the rows evenly strided "
                     "(e.g. a row slice of a 2-D tensor); call .contiguous() first")


def _check_aligned(name, *ptr_and_bytes, align=16):
    """ValueError naming `name` unless every address / byte stride given is a
    multiple of `align` (the widest load or store the kernel makes on it)."""
    for p in ptr_and_bytes:
        if p % align:
            raise ValueError(f"{name}: address or row stride {p} is not a multiple of {align} bytes "
                             f"(the kernel accesses it {align} bytes at a time; a view starting "
                             "mid-row?); call .clone() first")


# rkv_nvfp4_gather loads the codes of q as 4-byte words; q rows are n/2
# bytes (a multiple of 8) apart, so the data pointer decides. sf is read
# byte by byte (any address); out is written with 16-byte stores.
_Q_ALIGN = 4


_GATHER_UNROLL = 4   # kGatherUnroll in nvfp4.cu: units each thread keeps in flight


def _groups(units_per_row: int, cap: int = _BLOCK_THREADS):
    """(tpr, block, rows per CTA) for kernels that give each row a group of
    tpr threads (a power of two below 32, else a multiple of 32)."""
    t = max(1, min(units_per_row, cap))
    tpr = 1 << (t - 1).bit_length() if t < 32 else -(-t // 32) * 32
    gpc = max(1, _BLOCK_THREADS // tpr)
    return tpr, tpr * gpc, gpc


def _grid(rt, rows, block, gpc):
    return max(1, min(-(-rows // gpc), rt.resident_blocks(block) * 2))


def _index(device):
    return device.index if hasattr(device, "index") else device


def _check_out(t, name, dtypes, shape, device):
    t = T.as_cuda_tensor(t, name)
    T.check_tensor(t, name, dtypes, shape=shape, device=_index(device))
    return t


def _scalar_or_rows_gs(gs, lead_shape, device, name="gs"):
    """Classify a decode gs on CUDA: ('value', float) | ('scalar', tensor) | ('row', tensor)."""
    if _is_number(gs):
        return "value", float(gs)
    torch = _torch()
    gs = T.as_cuda_tensor(gs, name)
    if gs.dtype != torch.float32:
        raise TypeError(f"{name}: dtype {_name(gs.dtype)} is not supported (expected float32)")
    if gs.device != device:
        raise ValueError(f"{name}: is on {gs.device} but the op runs on {device}")
    if tuple(gs.shape) == tuple(lead_shape) and gs.numel() != 1:
        if not gs.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (got strides {tuple(gs.stride())})")
        return "row", gs
    if gs.numel() == 1:
        return "scalar", gs
    raise ValueError(f"{name}: expected a scalar (1 element) or one scale per row, shape "
                     f"{tuple(lead_shape)}; got shape {tuple(gs.shape)}")


# ---------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------
def quantize(x, *, scope: str = "tensor", gs=None, out=None, stream=None):
    """NVFP4-encode x (..., N), N % 16 == 0 -> (q (..., N/2), sf (..., N/16), gs).

    scope: 'tensor' (gs = amax(x)/2688, shape ()), 'row' (one gs per row,
    shape x.shape[:-1]), 'given' (gs: a number, Python or numpy, that must be
    finite and > 0 as a float32, or a 1-element float32 tensor read on the
    device), 'none' (gs = 1). q is returned as
    torch.float4_e2m1fn_x2 and sf as torch.float8_e4m3fn where torch has
    them. out=(q, sf, gs) buffers (uint8 or those dtypes; gs float32) are
    written and returned (all three are checked before any is written); for
    scope 'given' with a device gs and no out gs, the given tensor itself is
    returned as gs."""
    gs = _check_scope(scope, gs)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise TypeError("out: expected a tuple (q, sf, gs) of buffers (entries may be None)")
    oq, osf, ogs = out if out is not None else (None, None, None)
    where = T.placement(("x", x), ("gs", gs), ("out[0]", oq), ("out[1]", osf), ("out[2]", ogs))
    if where == "cpu":
        return _quantize_cpu(x, scope, gs, oq, osf, ogs)
    torch = _torch()
    x = T.as_cuda_tensor(x, "x")
    T.check_tensor(x, "x", (torch.float32, torch.float16, torch.bfloat16), contiguous=False)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dimension, got a 0-d tensor")
    n = x.shape[-1]
    ref.check_last_dim(n, "x")
    m, n, ldx = _row_view(x, "x")
    lead = tuple(x.shape[:-1])
    dev = x.device
    if m * n:
        _check_aligned("x", x.data_ptr(), ldx * x.element_size())
    gs_kind, gs_in = ("none", None)
    if scope == "given":
        if _is_number(gs):
            gs_kind, gs_in = "value", float(gs)
        else:
            gs_t = T.as_cuda_tensor(gs, "gs")
            if gs_t.dtype != torch.float32 or gs_t.numel() != 1:
                raise ValueError(f"gs: expected a 1-element float32 tensor, got {_name(gs_t.dtype)} "
                                 f"shape {tuple(gs_t.shape)}")
            if gs_t.device != dev:
                raise ValueError(f"gs: is on {gs_t.device} but x is on {dev}")
            gs_kind, gs_in = "tensor", gs_t
    gs_shape = lead if scope == "row" else ()
    if oq is not None:
        oq = _check_out(oq, "out[0]", _byte_dtypes(), (*lead, n // 2), dev)
    if osf is not None:
        osf = _check_out(osf, "out[1]", _byte_dtypes(), (*lead, n // BLOCK), dev)
    if ogs is not None:
        ogs = _check_out(ogs, "out[2]", (torch.float32,), gs_shape, dev)
    for nm, t in (("out[0]", oq), ("out[1]", osf)):
        if t is not None and t.numel():
            _check_aligned(nm, t.data_ptr())
    # -- everything is checked: allocate and launch ----------------------------
    rt = get_runtime(dev)
    q = oq if oq is not None else rt.empty((*lead, n // 2), torch.uint8, stream=stream)
    sf = osf if osf is not None else rt.empty((*lead, n // BLOCK), torch.uint8, stream=stream)
    if ogs is not None:
        g = ogs
    elif gs_kind == "tensor":
        g = gs_in.reshape(())
    else:
        g = rt.empty(gs_shape, torch.float32, stream=stream)
    _launch_quantize(rt, x, q, sf, g, m, n, ldx, scope, gs_kind, gs_in, ogs is not None, stream)
    return _as_q(q), _as_sf(sf), g


def _launch_quantize(rt, x, q, sf, g, m, n, ldx, scope, gs_kind, gs_in, own_gs, stream):
    ct = _CT[_name(x.dtype)]
    bpt = 2 if n % 32 == 0 else 1
    upr = n // (BLOCK * bpt)
    xp, qp, sp, gp = x.data_ptr(), q.data_ptr(), sf.data_ptr(), g.data_ptr()
    if m * n == 0:
        # No elements: only gs is written, with torch ops on the op's stream
        # (not torch's current one), ordered like every other write.
        with _torch().cuda.stream(rt.torch_stream(stream)):
            if scope in ("row", "tensor"):          # amax 0 -> gs 1
                g.fill_(1.0)
            elif gs_kind == "tensor":
                if own_gs:
                    g.copy_(gs_in.reshape(()))
            else:
                g.fill_(gs_in if gs_kind == "value" else 1.0)
        return
    if scope == "row":
        r = 1 if upr <= 1024 else 0
        tpr, block, gpc = _groups(upr, cap=1024 if r else _BLOCK_THREADS)
        fn = rt.function(_FILE, f"rkv_nvfp4_quantize_rows<{ct}, {bpt}, {r}>", stream=stream)
        rt.launch_args(fn, (_grid(rt, m, block, gpc),), (block,), (xp, qp, sp, gp, m, upr, ldx, tpr), stream)
        return
    if scope == "tensor":
        if m * n <= SMALL_NUMEL:
            units = m * upr
            grid = max(1, min(-(-units // _BLOCK_THREADS), _SMALL_MAX_CTAS))
            fn = rt.function(_FILE, f"rkv_nvfp4_quantize_small<{ct}, {bpt}>", stream=stream)
            rt.launch_args(fn, (grid,), (_BLOCK_THREADS,), (xp, qp, sp, m, upr, ldx, gp), stream)
            return
        rt.memset(gp, 0, 4, stream)
        vecs = m * n * x.element_size() // 16
        grid, block = rt.grid_stride(vecs, _BLOCK_THREADS, waves=1)
        fn = rt.function(_FILE, f"rkv_nvfp4_amax<{ct}>", stream=stream)
        rt.launch_args(fn, (grid,), (block,), (xp, m, n, ldx, gp), stream)
        tpr, block, gpc = _groups(upr)
        fn = rt.function(_FILE, f"rkv_nvfp4_quantize<{ct}, {bpt}, 1>", stream=stream)
        rt.launch_args(fn, (_grid(rt, m, block, gpc),), (block,), (xp, qp, sp, m, upr, ldx, tpr, gp, 0.0, 0), stream)
        fn = rt.function(_FILE, "rkv_nvfp4_finalize_gs", stream=stream)
        rt.launch_args(fn, (1,), (32,), (gp,), stream)
        return
    # 'given' / 'none'
    if gs_kind == "tensor":
        gs_ptr, gs_val = gs_in.data_ptr(), 0.0
        gs_out = gp if own_gs else 0
    else:
        gs_ptr, gs_val = 0, (gs_in if gs_kind == "value" else 1.0)
        gs_out = gp
    tpr, block, gpc = _groups(upr)
    fn = rt.function(_FILE, f"rkv_nvfp4_quantize<{ct}, {bpt}, 0>", stream=stream)
    rt.launch_args(fn, (_grid(rt, m, block, gpc),), (block,),
              (xp, qp, sp, m, upr, ldx, tpr, gs_ptr, gs_val, gs_out), stream)


def _quantize_cpu(x, scope, gs, oq, osf, ogs):
    xa = T.to_numpy(x, "x")
    if xa.ndim == 0:
        raise ValueError("x: expected at least 1 dimension, got a 0-d array")
    if xa.dtype not in (np.float32, np.float16, np.float64):
        raise TypeError(f"x: dtype {xa.dtype} is not supported (expected a float dtype)")
    ref.check_last_dim(xa.shape[-1], "x")
    lead, n = xa.shape[:-1], xa.shape[-1]
    # every out part is checked before the first one is written
    _check_out_cpu(oq, "out[0]", (*lead, n // 2), byte=True)
    _check_out_cpu(osf, "out[1]", (*lead, n // BLOCK), byte=True)
    _check_out_cpu(ogs, "out[2]", lead if scope == "row" else (), byte=False)
    gsv = None
    if gs is not None:
        gsv = np.asarray(T.to_numpy(gs, "gs") if not _is_number(gs) else gs, dtype=np.float32)
        if gsv.size != 1:
            raise ValueError(f"gs: expected 1 element, got shape {gsv.shape}")
    q, sf, g = ref.quantize(xa.astype(np.float32, copy=False), scope, gsv)
    return (T.from_numpy(q, x, torch_dtype=_q_dtype_name(), out=oq),
            T.from_numpy(sf, x, torch_dtype=_sf_dtype_name(), out=osf),
            _gs_from_numpy(np.asarray(g, dtype=np.float32), x, ogs))


def _check_out_cpu(t, name, shape, byte):
    """A CPU out buffer: uint8 bytes (torch: also the FP8/FP4 byte views) or
    float32 (gs), of `shape`."""
    if t is None:
        return
    if not (isinstance(t, np.ndarray) or T.is_torch(t)):
        raise TypeError(f"{name}: expected a numpy array or a CPU torch tensor, got {type(t).__name__}")
    T.check_cpu_array(t, name, ("uint8", "float8_e4m3fn", "float4_e2m1fn_x2") if byte else ("float32",), shape)


def _gs_from_numpy(g, like, out):
    # T.from_numpy goes through np.ascontiguousarray, which turns a 0-d gs
    # into shape (1,); keep the shape here.
    if out is None:
        if T.is_torch(like):
            import torch
            return torch.from_numpy(np.array(g, dtype=np.float32))
        return g
    if tuple(out.shape) != g.shape:
        raise ValueError(f"out[2]: expected shape {g.shape}, got {tuple(out.shape)}")
    if isinstance(out, np.ndarray):
        out[...] = g
    else:
        import torch
        out.copy_(torch.from_numpy(np.array(g, dtype=np.float32)))
    return out


# ---------------------------------------------------------------------------
# dequantize and gather
# ---------------------------------------------------------------------------
def _check_q_sf(q, sf):
    torch = _torch()
    q = T.as_cuda_tensor(q, "q")
    sf = T.as_cuda_tensor(sf, "sf")
    T.check_tensor(q, "q", _byte_dtypes())
    if q.dim() == 0:
        raise ValueError("q: expected at least 1 dimension, got a 0-d tensor")
    n = q.shape[-1] * 2
    ref.check_last_dim(n, "q (2 elements per byte)")
    T.check_tensor(sf, "sf", _byte_dtypes(), shape=(*q.shape[:-1], n // BLOCK), device=_index(q.device))
    if q.numel():
        _check_aligned("q", q.data_ptr(), align=_Q_ALIGN)
    return q.view(torch.uint8), sf.view(torch.uint8), n


def dequantize(q, sf=None, gs=None, *, dtype=None, out=None, stream=None):
    """y (..., N) = e2m1[q] * (float(sf) * gs), rounded to `dtype` (bfloat16
    default, float16, float32). gs: a float, a 1-element float32 tensor, or
    one per row (shape q.shape[:-1]). q may instead be a
    rawkv.nvfp4.QuantizedActivation, with sf and gs left out."""
    if sf is None or gs is None:
        q, sf, gs = _activation_parts(q, sf, gs)
    name, tdt = _out_dtype(dtype if dtype is not None else (out.dtype if out is not None else None))
    gs = _decode_gs(gs)
    where = T.placement(("q", q), ("sf", sf), ("gs", gs), ("out", out))
    if where == "cpu":
        qa, sfa = T.to_numpy(q, "q"), T.to_numpy(sf, "sf")
        ga = np.asarray(gs if _is_number(gs) else T.to_numpy(gs, "gs"), dtype=np.float32)
        if ga.size == 1:
            ga = ga.reshape(())
        elif ga.shape != qa.shape[:-1]:
            raise ValueError(f"gs: expected 1 element or shape {qa.shape[:-1]}, got {ga.shape}")
        y = ref.dequantize(qa, sfa, ga, name)
        return T.from_numpy(y, q, torch_dtype=tdt, out=out)
    q8, sf8, n = _check_q_sf(q, sf)
    lead = tuple(q8.shape[:-1])
    kind, gsv = _scalar_or_rows_gs(gs, lead, q8.device)
    if out is not None:
        out = _check_out(out, "out", (tdt,), (*lead, n), q8.device)
        if out.numel():
            _check_aligned("out", out.data_ptr())
    rt = get_runtime(q8.device)
    if out is None:
        out = rt.empty((*lead, n), tdt, stream=stream)
    m = math.prod(lead)
    _launch_gather(rt, q8, sf8, kind, gsv, None, out, None, m, m, n, stream)
    return out


def _activation_parts(q, sf, gs):
    """(q, sf, gs) for dequantize(qa): a rawkv.nvfp4.QuantizedActivation, sf and gs left out."""
    if not isinstance(q, QuantizedActivation) or sf is not None or gs is not None:
        raise TypeError("sf, gs: both required, unless q is a rawkv.nvfp4.QuantizedActivation "
                        f"(then neither); got q of type {type(q).__name__}")
    return q.q, q.sf, q.gs


def gather(q, sf, gs, indices, *, dtype=None, out=None, errors=None, stream=None):
    """Dequantize the rows `indices` (int32/int64, any shape; values index the
    rows of q with its leading dims flattened) -> out (*indices.shape, N).

    An index outside [0, rows) is skipped: its output row is left untouched
    (zeros when out is None: the new output is zero-filled) and counted: the
    kernel atomically adds the number of skipped rows to errors[0] (an int32
    CUDA tensor the caller zeroes and reads when it likes; None: not
    counted). On CPU, errors (a numpy array / CPU tensor) is added to the same
    way. gs: a float, a 1-element float32 tensor, or one per source row."""
    name, tdt = _out_dtype(dtype if dtype is not None else (out.dtype if out is not None else None))
    gs = _decode_gs(gs)
    where = T.placement(("q", q), ("sf", sf), ("gs", gs), ("indices", indices), ("out", out),
                        ("errors", errors))
    if where == "cpu":
        return _gather_cpu(q, sf, gs, indices, name, tdt, out, errors)
    torch = _torch()
    q8, sf8, n = _check_q_sf(q, sf)
    lead = tuple(q8.shape[:-1])
    kind, gsv = _scalar_or_rows_gs(gs, lead, q8.device)
    idx = T.as_cuda_tensor(indices, "indices")
    T.check_tensor(idx, "indices", (torch.int32, torch.int64), device=_index(q8.device))
    rows_out = idx.numel()
    if out is not None:
        out = _check_out(out, "out", (tdt,), (*idx.shape, n), q8.device)
        if out.numel():
            _check_aligned("out", out.data_ptr())
    if errors is not None:
        errors = T.as_cuda_tensor(errors, "errors")
        T.check_tensor(errors, "errors", (torch.int32,), device=_index(q8.device))
        if errors.numel() < 1:
            raise ValueError("errors: expected an int32 tensor with at least 1 element")
    rt = get_runtime(q8.device)
    if out is None:
        out = rt.empty((*idx.shape, n), tdt, stream=stream)
        if out.numel():
            rt.memset(out.data_ptr(), 0, out.numel() * out.element_size(), stream)
    _launch_gather(rt, q8, sf8, kind, gsv, idx, out, errors, math.prod(lead), rows_out, n, stream)
    return out


def _launch_gather(rt, q8, sf8, kind, gsv, idx, out, errors, m, rows_out, n, stream):
    if rows_out == 0 or n == 0:
        return
    ct = _CT[_name(out.dtype)]
    n8 = n // 8                           # 8-element (4-byte) units per row
    it = "long long" if idx is not None and idx.element_size() == 8 else "int"
    rowgs = "true" if kind == "row" else "false"
    gs_ptr = gsv.data_ptr() if kind in ("row", "scalar") else 0
    gs_val = gsv if kind == "value" else 0.0
    tpr, block, gpc = _groups(-(-n8 // _GATHER_UNROLL))
    fn = rt.function(_FILE, f"rkv_nvfp4_gather<{ct}, {it}, {rowgs}>", stream=stream)
    rt.launch_args(fn, (_grid(rt, rows_out, block, gpc),), (block,),
              (q8.data_ptr(), sf8.data_ptr(), gs_ptr, gs_val,
               idx.data_ptr() if idx is not None else 0, out.data_ptr(),
               errors.data_ptr() if errors is not None else 0, m, rows_out, n8, n, tpr), stream)


def _gather_cpu(q, sf, gs, indices, name, tdt, out, errors):
    qa, sfa = T.to_numpy(q, "q"), T.to_numpy(sf, "sf")
    n = qa.shape[-1] * 2
    ref.check_last_dim(n, "q (2 elements per byte)")
    if sfa.shape != (*qa.shape[:-1], n // BLOCK):
        raise ValueError(f"sf: expected shape {(*qa.shape[:-1], n // BLOCK)}, got {sfa.shape}")
    idx = T.to_numpy(indices, "indices")
    if idx.dtype not in (np.int32, np.int64):
        raise TypeError(f"indices: dtype {idx.dtype} is not supported (expected int32 or int64)")
    ga = np.asarray(gs if _is_number(gs) else T.to_numpy(gs, "gs"), dtype=np.float32)
    q2, sf2 = qa.reshape(-1, qa.shape[-1]), sfa.reshape(-1, sfa.shape[-1])
    if ga.size == 1:
        ga = ga.reshape(())
    elif ga.shape == qa.shape[:-1]:
        ga = ga.reshape(-1)
    else:
        raise ValueError(f"gs: expected 1 element or shape {qa.shape[:-1]}, got {ga.shape}")
    if errors is not None:
        err = T.to_numpy(errors, "errors")
        if err.dtype != np.int32 or err.size < 1:
            raise ValueError("errors: expected an int32 array with at least 1 element")
    if out is not None:
        exp = (*idx.shape, n)
        if tuple(out.shape) != exp:
            raise ValueError(f"out: expected shape {exp}, got {tuple(out.shape)}")
        base = T.to_numpy(out, "out").astype(np.float32).reshape(-1, n)
    else:
        base = None
    y, nerr = ref_layouts.gather(q2, sf2, ga, idx.reshape(-1), name, out=base)
    if errors is not None:
        if T.is_torch(errors):
            errors.view(-1)[0] += nerr
        else:
            errors.reshape(-1)[0] += nerr
    return T.from_numpy(np.asarray(y).reshape(*idx.shape, n), q, torch_dtype=tdt, out=out)


# ---------------------------------------------------------------------------
# scale swizzle
# ---------------------------------------------------------------------------
def swizzled_size(rows: int, cols: int) -> int:
    """Bytes of the 128x4-tile layout of (rows, cols) scales."""
    return ref_layouts.swizzled_size(rows, cols)


def swizzle_scales(sf, *, out=None, stream=None):
    """Linear scales (..., cols) (leading dims flattened into rows) -> the 1-D
    tensor-core layout of swizzled_size(rows, cols) bytes (zero padding)."""
    where = T.placement(("sf", sf), ("out", out))
    if where == "cpu":
        sw = ref_layouts.swizzle_scales(T.to_numpy(sf, "sf"))
        return T.from_numpy(sw, sf, torch_dtype=_sf_dtype_name(), out=out)
    torch = _torch()
    sf = T.as_cuda_tensor(sf, "sf")
    T.check_tensor(sf, "sf", _byte_dtypes())
    if sf.dim() == 0:
        raise ValueError("sf: expected at least 1 dimension")
    cols = sf.shape[-1]
    rows = math.prod(sf.shape[:-1])
    size = swizzled_size(rows, cols)
    if out is not None:
        out = _check_out(out, "out", _byte_dtypes(), (size,), sf.device)
        if size:
            _check_aligned("out", out.data_ptr())
    rt = get_runtime(sf.device)
    if out is None:
        out = rt.empty((size,), torch.uint8, stream=stream)
    if size:
        nwords = size // 4
        grid, block = rt.grid_stride(nwords, _BLOCK_THREADS)
        rt.launch_args(rt.function(_FILE, "rkv_nvfp4_swizzle", stream=stream), (grid,), (block,),
                  (sf.data_ptr(), out.data_ptr(), rows, cols, -(-cols // 4), nwords), stream)
    return _as_sf(out)


def unswizzle_scales(sw, shape, *, out=None, stream=None):
    """Tensor-core layout -> linear scales of `shape` (..., cols)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape: expected at least 1 dimension")
    rows, cols = math.prod(shape[:-1]), shape[-1]
    size = swizzled_size(rows, cols)
    where = T.placement(("sw", sw), ("out", out))
    if where == "cpu":
        swa = T.to_numpy(sw, "sw")
        if swa.size != size:
            raise ValueError(f"sw: expected {size} bytes for scales of shape {shape}, got {swa.size}")
        lin = ref_layouts.unswizzle_scales(swa, rows, cols).reshape(shape)
        return T.from_numpy(lin, sw, torch_dtype=_sf_dtype_name(), out=out)
    torch = _torch()
    sw = T.as_cuda_tensor(sw, "sw")
    T.check_tensor(sw, "sw", _byte_dtypes())
    if sw.numel() != size:
        raise ValueError(f"sw: expected {size} bytes for scales of shape {shape}, got {sw.numel()}")
    if size:
        _check_aligned("sw", sw.data_ptr())
    if out is not None:
        out = _check_out(out, "out", _byte_dtypes(), shape, sw.device)
    rt = get_runtime(sw.device)
    if out is None:
        out = rt.empty(shape, torch.uint8, stream=stream)
    if rows * cols:
        ncb = -(-cols // 4)
        grid, block = rt.grid_stride(rows * ncb, _BLOCK_THREADS)
        rt.launch_args(rt.function(_FILE, "rkv_nvfp4_unswizzle", stream=stream), (grid,), (block,),
                  (sw.data_ptr(), out.data_ptr(), rows, cols, ncb), stream)
    return _as_sf(out)


__all__ = ["quantize", "dequantize", "gather", "swizzle_scales", "unswizzle_scales",
           "swizzled_size", "SCOPES", "SMALL_NUMEL"]
