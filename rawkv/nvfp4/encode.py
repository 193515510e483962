"""rawkv.nvfp4.quantize: NVFP4 encode under a global-scale scope
(docs/format.md, "NVFP4: tensors and layouts", "global-scale scopes")."""
from __future__ import annotations

import numpy as np

from . import _checks as C
from . import counters
from ._geometry import BLOCK_THREADS, grid, groups
from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import nvfp4 as K
from ..reference import nvfp4 as ref
from ..runtime import get_runtime

BLOCK = C.BLOCK
SCOPES = C.SCOPES
#: scope 'tensor' inputs with at most this many elements take the one-launch
#: path (each CTA reduces the whole L2-resident tensor itself).
SMALL_NUMEL = 1 << 16
_SMALL_MAX_CTAS = 16


def quantize(x, *, scope: str = "tensor", gs=None, out=None, errors=None, stream=None):
    """NVFP4-encode x (..., N), N % 16 == 0 -> (q (..., N/2), sf (..., N/16), gs).

    scope: 'tensor' (gs = amax(x)/2688, shape ()), 'row' (one gs per row,
    shape x.shape[:-1]), 'given' (gs: a number, Python or numpy, or a
    1-element float32 tensor), 'none' (gs = 1); None: 'given' when gs is
    given, else 'tensor'. A given gs must satisfy 0 < gs < the bound of x's
    dtype (docs/format.md): a number or a host array outside it is a
    ValueError; a device tensor is checked by the kernel, which then flags
    every block (sf 0x7F, codes 0) and counts the call in
    rawkv.nvfp4.error_counts()[GIVEN_GS] (or, given errors, an int32
    tensor of at least one element, in errors[0]). q is returned as
    torch.float4_e2m1fn_x2 and sf as torch.float8_e4m3fn where torch has
    them. out=(q, sf, gs) buffers (uint8 or those dtypes; gs float32) are
    written and returned (all three are checked before any is written); for
    scope 'given' with a gs tensor and no out gs, the given tensor itself
    (reshaped to ()) is returned as gs."""
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise TypeError("out: expected a tuple (q, sf, gs) of buffers (entries may be None)")
    oq, osf, ogs = out if out is not None else (None, None, None)
    if D.compiling():
        return _traced(x, scope, gs, oq, osf, ogs, errors)
    scope, gs = A.check_scope_gs(scope, gs, SCOPES, "tensor")
    where = D.placement(("x", x), ("gs", gs), ("out[0]", oq), ("out[1]", osf), ("out[2]", ogs),
                        ("errors", errors))
    A.check_outputs((("out[0]", oq), ("out[1]", osf), ("out[2]", ogs), ("errors", errors)), (("x", x), ("gs", gs)))
    if where == "cpu":
        return _quantize_cpu(x, scope, gs, oq, osf, ogs, errors)
    dt = A.dtypes()
    x = C.cuda_array(x, "x")
    A.check_tensor(x, "x", dt.floats, contiguous=False)
    m, n, ldx = C.row_view(x, "x")
    lead = tuple(x.shape[:-1])
    dev = x.get_device()
    if m * n:
        A.check_aligned("x", x)
    if isinstance(gs, float):
        C.check_given_gs_number(gs, dt.name[x.dtype])
    elif gs is not None:
        gs = C.float32_gs(gs, dev)
    gs_shape = lead if scope == "row" else ()
    if oq is not None:
        oq = C.check_out(oq, "out[0]", dt.bytes, (*lead, n // 2), dev, align=16)
    if osf is not None:
        osf = C.check_out(osf, "out[1]", dt.bytes, (*lead, n // BLOCK), dev, align=16)
    if ogs is not None:
        ogs = C.check_out(ogs, "out[2]", dt.floats[:1], gs_shape, dev)
    if errors is not None:
        errors = C.cuda_errors(errors, dev)
    # -- everything is checked: allocate and launch ----------------------------
    rt = get_runtime(dev)
    u8 = dt.bytes[0]
    q = oq if oq is not None else rt.empty((*lead, n // 2), u8, stream=stream)
    sf = osf if osf is not None else rt.empty((*lead, n // BLOCK), u8, stream=stream)
    if ogs is not None:
        g = ogs
    elif gs is not None and not isinstance(gs, float):
        g = gs.reshape(())
    else:
        g = rt.empty(gs_shape, dt.floats[0], stream=stream)
    if m * n == 0:
        _write_gs_only(rt, g, scope, gs, ogs is not None, stream)
    else:
        _launch(rt, x, q, sf, g, m, n, ldx, scope, gs, ogs is not None, errors, stream)
    return C.as_q(q), C.as_sf(sf), g


def _write_gs_only(rt, g, scope, gs, own_gs, stream):
    """No elements: only gs is written, with torch ops on the op's stream
    (not torch's current one), ordered like every other write."""
    import torch
    with torch.cuda.stream(rt.torch_stream(stream)):
        if scope in ("row", "tensor"):          # amax 0 -> gs 1
            g.fill_(1.0)
        elif isinstance(gs, float) or gs is None:
            g.fill_(1.0 if gs is None else gs)
        elif own_gs:
            g.copy_(gs.reshape(()))


def _launch(rt, x, q, sf, g, m, n, ldx, scope, gs, own_gs, errors, stream):
    bpt = 2 if n % 32 == 0 else 1
    upr = n // (BLOCK * bpt)
    if scope == "row":
        r = 1 if upr <= K.MAX_BLOCK_THREADS else 0
        tpr, block, gpc = groups(upr, cap=K.MAX_BLOCK_THREADS if r else BLOCK_THREADS)
        K.QUANTIZE_ROWS.launch(rt, (grid(rt, m, block, gpc),), (block,), x.dtype, bpt, r, stream=stream,
                               x=x, q=q, sf=sf, gs_out=g, M=m, upr=upr, ldx=ldx, tpr_=tpr)
        return
    if scope == "tensor":
        if m * n <= SMALL_NUMEL:
            # Every CTA reduces the whole tensor before it quantizes: a chain of
            # dependent loads and maxima per thread, so the most threads a CTA
            # can have (at M = 8 rows of 7168: 10.6 us with 256, 7 per thread).
            block = K.MAX_BLOCK_THREADS
            ctas = max(1, min(-(-(m * upr) // block), _SMALL_MAX_CTAS))
            K.QUANTIZE_SMALL.launch(rt, (ctas,), (block,), x.dtype, bpt, stream=stream,
                                    x=x, q=q, sf=sf, M=m, upr=upr, ldx=ldx, gs_out=g)
            return
        rt.memset(g.data_ptr(), 0, 4, stream)
        vecs = m * n * x.element_size() // 16
        ctas, block = rt.grid_stride(vecs, BLOCK_THREADS, waves=1)
        K.AMAX.launch(rt, (ctas,), (block,), x.dtype, stream=stream, x=x, M=m, N=n, ldx=ldx, amax_bits=g)
        tpr, block, gpc = groups(upr)
        K.QUANTIZE.launch(rt, (grid(rt, m, block, gpc),), (block,), x.dtype, bpt, K.MODE_AMAX, stream=stream,
                          x=x, q=q, sf=sf, M=m, upr=upr, ldx=ldx, tpr_=tpr, gs_ptr=g, gs_val=0.0,
                          gs_out=None, errors=None)
        K.FINALIZE_GS.launch(rt, (1,), (32,), stream=stream, gs=g)
        return
    # 'given' / 'none'
    if gs is None or isinstance(gs, float):
        gs_ptr, gs_val, gs_out, errors = None, (1.0 if gs is None else gs), g, None
    else:       # a device gs: the kernel checks it and counts an unusable one
        gs_ptr, gs_val, gs_out = gs, 0.0, (g if own_gs else None)
        if errors is None:
            errors = counters.address(rt, counters.GIVEN_GS, stream)
    tpr, block, gpc = groups(upr)
    K.QUANTIZE.launch(rt, (grid(rt, m, block, gpc),), (block,), x.dtype, bpt, K.MODE_GIVEN, stream=stream,
                      x=x, q=q, sf=sf, M=m, upr=upr, ldx=ldx, tpr_=tpr, gs_ptr=gs_ptr, gs_val=gs_val,
                      gs_out=gs_out, errors=errors)


def _quantize_cpu(x, scope, gs, oq, osf, ogs, errors):
    xname = A.check_cpu_array(A.require_array(x, "x"), "x", C.FLOATS)
    xa = D.to_numpy(x, "x")
    if xa.ndim == 0:
        raise ValueError("x: expected at least 1 dimension, got a 0-d array")
    ref.check_last_dim(xa.shape[-1], "x")
    lead, n = xa.shape[:-1], xa.shape[-1]
    # every out part is checked before the first one is written
    C.check_cpu_out(oq, "out[0]", C.BYTES, (*lead, n // 2))
    C.check_cpu_out(osf, "out[1]", C.BYTES, (*lead, n // BLOCK))
    C.check_cpu_out(ogs, "out[2]", ("float32",), lead if scope == "row" else ())
    if errors is not None:      # never added to: a host gs is checked here, not counted
        C.check_cpu_errors(errors)
    gsv = C.given_gs_host(gs, xname) if scope == "given" else None
    q, sf, g = ref.quantize(xa.astype(np.float32, copy=False), scope, gsv, xname)
    if ogs is None and D.is_torch(gs):      # as on CUDA: the given tensor is the gs
        g = gs.reshape(())
    else:
        g = _gs_from_numpy(np.asarray(g, dtype=np.float32), x, ogs)
    return (C.cpu_result(D.from_numpy(q, x, torch_dtype=C.cpu_byte_dtype("q"), out=oq), C.as_q),
            C.cpu_result(D.from_numpy(sf, x, torch_dtype=C.cpu_byte_dtype("sf"), out=osf), C.as_sf), g)


def _gs_from_numpy(g, like, out):
    # D.from_numpy goes through np.ascontiguousarray, which turns a 0-d gs
    # into shape (1,); keep the shape here.
    if out is None:
        if D.is_torch(like):
            import torch
            return torch.from_numpy(np.array(g, dtype=np.float32))
        return g
    if isinstance(out, np.ndarray):
        out[...] = g
    else:
        import torch
        out.copy_(torch.from_numpy(np.array(g, dtype=np.float32)))
    return out


def _traced(x, scope, gs, oq, osf, ogs, errors):
    """Under torch.compile: allocate what the eager path returns (q, sf
    as uint8 seen as FP4 / FP8; a gs tensor given with no out gs is itself
    the result's gs) and call rawkv::nvfp4_quantize, which dynamo can trace."""
    import torch
    if A.is_number(gs):     # checked when the operator runs: numpy's float32 rules do not trace
        scope, gs = "given" if scope is None else scope, float(gs)
    else:
        scope, gs = A.check_scope_gs(scope, gs, SCOPES, "tensor")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    q = oq if oq is not None else torch.empty((*lead, n // 2), dtype=torch.uint8, device=x.device)
    sf = osf if osf is not None else torch.empty((*lead, n // BLOCK), dtype=torch.uint8, device=x.device)
    if ogs is None and (gs is None or isinstance(gs, float)):
        ogs = torch.empty(lead if scope == "row" else (), dtype=torch.float32, device=x.device)
    gs_t, gs_v = A.split_gs(gs, torch.Tensor)
    QUANTIZE_OP.call(torch, x=x, scope=scope, gs=gs_t, gs_value=gs_v, q=q, sf=sf, gs_out=ogs, errors=errors)
    return C.as_q(q), C.as_sf(sf), ogs if ogs is not None else gs.reshape(())


def _quantize_op(x, scope, gs, gs_value, q, sf, gs_out, errors):
    """rawkv::nvfp4_quantize: writes q, sf and gs_out (which may be None
    only with a gs tensor: that is the gs) and, with a device gs, errors."""
    if gs_out is None and gs is None:
        raise ValueError("gs_out: required unless gs is a tensor (scope 'given'), which is then the gs")
    quantize(x, scope=scope, gs=A.op_gs(gs, gs_value), out=(q, sf, gs_out), errors=errors)


QUANTIZE_OP = OpDecl("nvfp4_quantize", _quantize_op,
                     "Tensor x, str scope, Tensor? gs, float? gs_value, Tensor(a!) q, Tensor(b!) sf, "
                     "Tensor(c!)? gs_out, Tensor(d!)? errors")
