"""rawkv.nvfp4.gather, and the decode launch it shares with dequantize
(docs/format.md, "NVFP4: gather")."""
from __future__ import annotations

import math

import numpy as np

from . import _rules as C
from . import counters
from ._geometry import grid, groups
from .. import _args as A
from .._op import empty, op
from ..kernels import nvfp4 as K
from ..reference import layouts as ref_layouts
from ..runtime import get_runtime

__all__ = ["gather"]       # the family's API (rawkv.nvfp4 exports it)


def launch_decode(rt, q, sf, kind, gsv, idx, out, errors, m, rows_out, n, stream):
    """Decode rows of (q, sf) into out: row o from source row idx[o]
    (idx None: o itself); gs as _rules.decode_gs classified it."""
    if rows_out == 0 or n == 0:
        return
    n8 = n // 8                           # 8-element (4-byte) units per row
    tpr, block, gpc = groups(-(-n8 // K.GATHER_UNROLL))
    value = kind == "value"
    K.GATHER.launch(rt, (grid(rt, rows_out, block, gpc),), (block,), out.dtype,
                    "int32" if idx is None else idx.dtype, kind == "row", stream=stream,
                    q=q, sf=sf, gs_ptr=None if value else gsv, gs_val=gsv if value else 0.0,
                    idx=idx, out=out, errors=errors, M=m, rows_out=rows_out, n8=n8, ldo=n, tpr_=tpr)


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
    name = A.decode_dtype(dtype, out, "bfloat16")
    if out is None:
        # (q or indices in a layout the op refuses: it names them before out is sized)
        sq = A.out_lead(q, "q")
        out = empty(q, (*A.out_lead(indices, "indices"), sq[-1] * 2 if sq else 0), name, stream)
    gs_t, gs_v = A.split_number(gs)
    _gather(q, sf, gs_t, gs_v, indices, out, errors, stream, name)
    return out


@op("nvfp4_gather", "Tensor q, Tensor sf, Tensor? gs, Scalar? gs_value, Tensor indices, Tensor(a!) out, "
                    "Tensor(b!)? errors", host=C.decode_scalars)
def _gather(q, sf, gs, gs_value, indices, out, errors, stream=None, dtype=None):
    """rawkv::nvfp4_gather: the rows `indices` of (q, sf) decoded into out,
    in out's dtype (`dtype`, the public op's, when out is a numpy float32
    array holding bfloat16 values); a gs is a tensor `gs` or a number
    `gs_value`."""
    where, q, sf, n, kind, gs, idx, out, name, errors = _arguments(q, sf, gs, gs_value, indices, out, errors,
                                                               dtype)
    m = math.prod(q.shape[:-1])          # (not -1: q may hold no element)
    if where == "cpu":
        _reference(q, sf, kind, gs, idx, out, name, errors, m, n)
        return
    if A.numel(out):
        rt = get_runtime(q.get_device())
        err = errors if errors is not None else rt.counter(counters.GATHER_INDEX, stream)
        launch_decode(rt, q, sf, kind, gs, idx, out, err, m, idx.numel(), n, stream)


def _arguments(q, sf, gs, gs_value, indices, out, errors, dtype):
    """(where, q, sf, N, gs kind, gs, indices, out, dtype name, errors) of
    rawkv::nvfp4_gather."""
    gs = C.decode_scale(gs, gs_value)
    where = A.placement(("q", q), ("sf", sf), ("gs", gs), ("indices", indices), ("out", out),
                        ("errors", errors))
    A.check_outputs((("out", out), ("errors", errors)), (("q", q), ("sf", sf), ("gs", gs), ("indices", indices)))
    q, sf, n = C.q_sf(q, sf, where)
    dev, lead = A.device_of(q), tuple(q.shape[:-1])
    kind, gs = C.decode_gs(gs, lead, where, dev)
    idx = A.tensor(indices, "indices", A.INDEX, where, device=dev, align=A.ELEMENT)
    out, name = A.decoded(out, dtype, where, (*idx.shape, n), dev, align=16)
    if errors is not None:
        errors = A.counter(errors, where, dev)
    return where, q, sf, n, kind, gs, idx, out, name, errors


def host_gs(kind, gs) -> np.ndarray:
    """A checked decode gs (_rules.decode_gs) as the reference takes it:
    float32, 0-d, or 1-d with one per row."""
    g = np.asarray(gs if kind == "value" else A.to_numpy(gs, "gs"), np.float32)
    return g.reshape(-1) if kind == "row" else g.reshape(())


def _reference(q, sf, kind, gs, idx, out, name, errors, m, n):
    """The CPU branch: rawkv.reference.layouts.gather into out; the rows
    whose index is out of range are counted in errors[0], or, with no
    errors=, in error_counts('cpu')."""
    qa, sfa = A.to_numpy(q, "q"), A.to_numpy(sf, "sf")
    ia = A.to_numpy(idx, "indices")
    y, nerr = ref_layouts.gather(qa.reshape(m, qa.shape[-1]), sfa.reshape(m, sfa.shape[-1]),
                                 host_gs(kind, gs), ia.reshape(-1), name)
    if errors is None:
        counters.add_cpu(counters.GATHER_INDEX, nerr)
    elif nerr:
        if A.is_torch(errors):
            errors.view(-1)[0] += nerr
        else:
            errors.reshape(-1)[0] += nerr
    A.from_numpy(np.asarray(y).reshape(*ia.shape, n), q, torch_dtype=name, out=out)
