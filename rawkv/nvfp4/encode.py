"""rawkv.nvfp4.quantize: NVFP4 encode under a global-scale scope
(docs/format.md, "NVFP4: tensors and layouts", "global-scale scopes")."""
from __future__ import annotations

import numpy as np

from . import _rules as C
from . import counters
from ._geometry import BLOCK_THREADS, grid, groups
from .. import _args as A
from .. import _dispatch as D
from .._op import dims, empty, op
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
    tensor of at least one element, in errors[0]). x's rows must be evenly
    strided with a contiguous last dimension, 16 bytes apart at a multiple.
    q is returned as torch.float4_e2m1fn_x2 and sf as torch.float8_e4m3fn
    where torch has them. out=(q, sf, gs) buffers (uint8 or those dtypes,
    contiguous, q and sf 16-byte aligned; gs float32) are written and
    returned (all three are checked before any is written); for scope
    'given' with a gs tensor and no out gs, the given tensor itself
    (reshaped to ()) is returned as gs."""
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise TypeError("out: expected a tuple (q, sf, gs) of buffers (entries may be None)")
    q, sf, g = out if out is not None else (None, None, None)
    gs_t, gs_v = A.split_number(gs)
    # a gs tensor given without an out gs is the gs
    if q is None or sf is None or (g is None and gs_t is None):
        scope = A.default_scope(scope, gs, "tensor")
        s = dims(x)
        lead, n = s[:-1], (s[-1] if s else 0)
        if q is None:
            q = empty(x, (*lead, n // 2), "uint8", stream)
        if sf is None:
            sf = empty(x, (*lead, n // BLOCK), "uint8", stream)
        if g is None and gs_t is None:
            g = empty(x, lead if scope == "row" else (), "float32", stream)
    _quantize(x, scope, gs_t, gs_v, q, sf, g, errors, stream)
    return C.as_q(q), C.as_sf(sf), g if g is not None else gs_t.reshape(())


@op("nvfp4_quantize", "Tensor x, str scope, Tensor? gs, float? gs_value, Tensor(a!) q, Tensor(b!) sf, "
                      "Tensor(c!)? gs_out, Tensor(d!)? errors")
def _quantize(x, scope, gs, gs_value, q, sf, gs_out, errors, stream=None):
    """rawkv::nvfp4_quantize: writes q, sf and gs_out (which may be None
    only with a gs tensor: that is the gs) and, with a device gs, errors. A
    gs is a tensor `gs` or a number `gs_value`, at most one of them."""
    where, x, m, n, ldx, xdt, scope, gs, q, sf, gs_out, errors = C.quantize(
        x, scope, gs, gs_value, q, sf, gs_out, errors)
    if where == "cpu":
        _reference(x, xdt, scope, gs, q, sf, gs_out)
        return
    rt = get_runtime(x.get_device())
    g = gs_out if gs_out is not None else gs.reshape(())
    if m * n == 0:
        _write_gs_only(rt, g, scope, gs, gs_out is not None, stream)
    else:
        _launch(rt, x, q, sf, g, m, n, ldx, scope, gs, gs_out is not None, errors, stream)


def _reference(x, xdt, scope, gs, q, sf, gs_out):
    """The CPU branch: rawkv.reference.nvfp4.quantize into q, sf and gs_out.
    A given gs the host holds is checked here (a device one by the kernel);
    errors= is never added to."""
    gsv = C.given_gs_host(gs, xdt) if scope == "given" else None
    rq, rsf, rg = ref.quantize(D.to_numpy(x, "x").astype(np.float32, copy=False), scope, gsv, xdt)
    D.from_numpy(rq, x, out=q)
    D.from_numpy(rsf, x, out=sf)
    if gs_out is not None:
        D.from_numpy(np.asarray(rg, np.float32), x, out=gs_out)


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
