"""rawkv.nvfp4.gather, and the decode launch it shares with dequantize
(docs/format.md, "NVFP4: gather")."""
from __future__ import annotations

import math

import numpy as np

from . import _checks as C
from . import counters
from ._geometry import grid, groups
from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import nvfp4 as K
from ..reference import layouts as ref_layouts
from ..runtime import get_runtime


def launch_decode(rt, q8, sf8, kind, gsv, idx, out, errors, m, rows_out, n, stream):
    """Decode rows of (q8, sf8) into out: row o from source row idx[o]
    (idx None: o itself); gs as decode_gs_cuda classified it."""
    if rows_out == 0 or n == 0:
        return
    n8 = n // 8                           # 8-element (4-byte) units per row
    tpr, block, gpc = groups(-(-n8 // K.GATHER_UNROLL))
    value = kind == "value"
    K.GATHER.launch(rt, (grid(rt, rows_out, block, gpc),), (block,), out.dtype,
                    "int32" if idx is None else idx.dtype, kind == "row", stream=stream,
                    q=q8, sf=sf8, gs_ptr=None if value else gsv, gs_val=gsv if value else 0.0,
                    idx=idx, out=out, errors=errors, M=m, rows_out=rows_out, n8=n8, ldo=n, tpr_=tpr)


def traced_decode(op, out, shape, tdt, gs, **inputs):
    """Under torch.compile: allocate out as the eager path does (`shape`,
    dtype `tdt`) and call the rawkv:: operator `op`, which dynamo can trace."""
    import torch
    # a number gs is checked when the operator runs (a float argument of the
    # compiled function is a symbolic float here: only its type is known)
    gs = float(gs) if A.is_number(gs) else C.decode_gs(gs)
    if out is None:
        out = torch.empty(shape, dtype=tdt, device=inputs["q"].device)
    gs_t, gs_v = A.split_gs(gs, torch.Tensor)
    op.call(torch, **inputs, gs=gs_t, gs_value=gs_v, out=out)
    return out


def gather(q, sf, gs, indices, *, dtype=None, out=None, errors=None, stream=None):
    """Dequantize the rows `indices` (int32/int64, any shape; values index the
    rows of q with its leading dims flattened) -> out (*indices.shape, N).

    An index outside [0, rows) is not read: its output row is written as
    zeros and counted: the kernel atomically adds the number of such rows to
    errors[0] (an int32 tensor the caller zeroes and reads when it likes),
    or, with errors=None, to rawkv.nvfp4.error_counts(device)[GATHER_INDEX].
    On CPU, errors (a numpy array / CPU tensor) is added to the same way
    (errors=None: error_counts('cpu')). gs: a float, a 1-element float32
    tensor, or one per source row."""
    name, tdt = C.decode_dtype(dtype, out)
    if D.compiling():
        return traced_decode(GATHER_OP, out, (*indices.shape, q.shape[-1] * 2), tdt, gs,
                             q=q, sf=sf, indices=indices, errors=errors)
    gs = C.decode_gs(gs)
    where = D.placement(("q", q), ("sf", sf), ("gs", gs), ("indices", indices), ("out", out),
                        ("errors", errors))
    A.check_outputs((("out", out), ("errors", errors)), (("q", q), ("sf", sf), ("gs", gs), ("indices", indices)))
    if where == "cpu":
        return _gather_cpu(q, sf, gs, indices, name, tdt, out, errors)
    ints = C.int_dtypes()
    q8, sf8, n = C.check_q_sf(q, sf)
    dev = q8.get_device()
    lead = tuple(q8.shape[:-1])
    kind, gsv = C.decode_gs_cuda(gs, lead, dev)
    idx = C.cuda_array(indices, "indices")
    A.check_tensor(idx, "indices", ints, device=dev)
    if out is not None:
        out = C.check_out(out, "out", (tdt,), (*idx.shape, n), dev, align=16)
    if errors is not None:
        errors = C.cuda_errors(errors, dev)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty((*idx.shape, n), tdt, stream=stream)      # every row is written
    if out.numel():
        err = errors if errors is not None else counters.address(rt, counters.GATHER_INDEX, stream)
        launch_decode(rt, q8, sf8, kind, gsv, idx, out, err, math.prod(lead), idx.numel(), n, stream)
    return out


def _gather_cpu(q, sf, gs, indices, name, tdt, out, errors):
    qa, sfa, n = C.cpu_q_sf(q, sf)
    A.check_cpu_array(A.require_array(indices, "indices"), "indices", ("int32", "int64"))
    idx = D.to_numpy(indices, "indices")
    ga = C.cpu_decode_gs(gs, qa.shape[:-1])
    if errors is not None:
        C.check_cpu_errors(errors)
    C.cpu_decode_out(out, name, (*idx.shape, n))
    m = math.prod(qa.shape[:-1])          # (not -1: q may hold no element)
    y, nerr = ref_layouts.gather(qa.reshape(m, qa.shape[-1]), sfa.reshape(m, sfa.shape[-1]),
                                 ga.reshape(-1) if ga.ndim else ga, idx.reshape(-1), name)
    if errors is None:
        counters.add_cpu(counters.GATHER_INDEX, nerr)
    elif nerr:
        if D.is_torch(errors):
            errors.view(-1)[0] += nerr
        else:
            errors.reshape(-1)[0] += nerr
    return D.from_numpy(np.asarray(y).reshape(*idx.shape, n), q, torch_dtype=tdt, out=out)


def _gather_op(q, sf, gs, gs_value, indices, out, errors):
    """rawkv::nvfp4_gather: out's dtype is the decode dtype."""
    gather(q, sf, A.op_gs(gs, gs_value, required=True), indices, out=out, errors=errors)


GATHER_OP = OpDecl("nvfp4_gather", _gather_op,
                   "Tensor q, Tensor sf, Tensor? gs, float? gs_value, Tensor indices, Tensor(a!) out, "
                   "Tensor(b!)? errors")
