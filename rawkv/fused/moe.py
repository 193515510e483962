"""MoE input staging (docs/fused.md): one launch of rkv_moe_stage."""
from __future__ import annotations

from typing import Any, NamedTuple

from .. import _args as A
from .. import _dispatch as D
from .._opdecl import OpDecl
from ..kernels import fused as K
from ..reference import fused as ref
from ..runtime import get_runtime
from . import _cpu as C
from . import _rows
from . import _rules as R

_OUT = ("q", "sf", "topk_ids", "topk_weights")


class MoEStaged(NamedTuple):
    """MoE inputs: q (M, K/2) uint8 one-level NVFP4 codes, sf (M, K/64) int32
    (UE4M3 scale of block 4i+j in byte j), topk_ids (M, k) int64, topk_weights."""
    q: Any
    sf: Any
    topk_ids: Any
    topk_weights: Any


def moe_stage(hidden, topk_ids, topk_weights, *, out=None, stream=None):
    """Stage MoE inputs in one launch: hidden (M, K) bfloat16/float16 with
    K % 128 == 0 -> one-level NVFP4 (gs = 1, RNE) codes (M, K/2) uint8 and
    UE4M3 scales packed four per int32 (M, K/64); topk_ids (M, k)
    int32/int64 -> int64 copy; topk_weights (M, k) copied (same dtype).
    Returns MoEStaged(q, sf, topk_ids, topk_weights)."""
    if D.compiling():
        return _traced(hidden, topk_ids, topk_weights, out)
    out_q, out_sf, out_ids, out_w = R.split_out(out, _OUT, least=4)
    R.require_arrays(("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights))
    where = D.placement(("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                        ("out.q", out_q), ("out.sf", out_sf), ("out.topk_ids", out_ids),
                        ("out.topk_weights", out_w))
    hs = tuple(hidden.shape)
    if len(hs) != 2:
        raise ValueError(f"hidden: expected (M, K), got shape {hs}")
    m, k = hs
    if k % 128 or k == 0:
        raise ValueError(f"hidden: K = {k} must be a positive multiple of 128 for MoE staging "
                         "(NVFP4 blocks of 16, scales packed four per int32, 128-wide tiles)")
    ids_s = tuple(topk_ids.shape)
    if len(ids_s) != 2 or ids_s[0] != m:
        raise ValueError(f"topk_ids: expected shape ({m}, top_k), got {ids_s}")
    if tuple(topk_weights.shape) != ids_s:
        raise ValueError(f"topk_weights: expected shape {ids_s} (as topk_ids), got {tuple(topk_weights.shape)}")

    A.check_outputs((("out.q", out_q), ("out.sf", out_sf), ("out.topk_ids", out_ids), ("out.topk_weights", out_w)),
                    (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)))
    if where == "cpu":          # the dtypes the kernel takes (hidden: float32 too, unrounded)
        A.check_cpu_array(hidden, "hidden", R.CPU_X)
        A.check_cpu_array(topk_ids, "topk_ids", R.IDS)
        w_dt = A.check_cpu_array(topk_weights, "topk_weights", R.PARAM)
        q, sf, ids, w = ref.moe_stage(D.to_numpy(hidden, "hidden"), D.to_numpy(topk_ids, "topk_ids"),
                                      D.to_numpy(topk_weights, "topk_weights"))
        C.check_outs((("out.q", q, out_q, R.OUT_Q), ("out.sf", sf, out_sf, ("int32",)),
                      ("out.topk_ids", ids, out_ids, ("int64",)), ("out.topk_weights", w, out_w, (w_dt,))))
        return MoEStaged(C.put(q, hidden, out_q, C.torch_dtype("uint8")), C.put(sf, hidden, out_sf),
                         C.put(ids, hidden, out_ids), C.put(w, hidden, out_w, C.torch_dtype(w_dt)))

    dt = _rows.dtypes()
    hidden = _rows.cuda_arg(hidden, "hidden", dt.x, align=16)
    dev = hidden.get_device()
    topk_ids = _rows.cuda_arg(topk_ids, "topk_ids", dt.ids, dev)
    topk_weights = _rows.cuda_arg(topk_weights, "topk_weights", dt.param, dev)
    w_dt = topk_weights.dtype
    sf_s = (m, k // 64)                 # one int32 of four scales per 64 elements
    q = None if out_q is None else _rows.cuda_arg(out_q, "out.q", dt.q, dev, 16, (m, k // 2))
    sf = None if out_sf is None else _rows.cuda_arg(out_sf, "out.sf", dt.i32, dev, 4, sf_s)
    ids = None if out_ids is None else _rows.cuda_arg(out_ids, "out.topk_ids", dt.i64, dev, 8, ids_s)
    w = None if out_w is None else _rows.cuda_arg(out_w, "out.topk_weights", (w_dt,), dev, 1, ids_s)
    rt = get_runtime(dev)
    q = rt.empty((m, k // 2), dt.u8, stream) if q is None else q
    sf = rt.empty(sf_s, dt.i32[0], stream) if sf is None else sf
    ids = rt.empty(ids_s, dt.i64[0], stream) if ids is None else ids
    w = rt.empty(ids_s, w_dt, stream) if w is None else w
    n_units = m * sf_s[1]               # 64 elements, one scale word; a thread takes half of one
    n_ids = topk_ids.numel()
    w_bytes = topk_weights.numel() * topk_weights.element_size()
    work = max(2 * n_units, n_ids, w_bytes)
    if work:
        grid, block = rt.grid_stride(work, block=K.MOE_BLOCK)
        K.MOE_STAGE.launch(rt, (grid,), (block,), hidden.dtype, topk_ids.dtype, stream=stream,
                           x=hidden, n_units=n_units, q=q, sf=sf, ids=topk_ids, n_ids=n_ids, ids_out=ids,
                           wts=topk_weights, w_bytes=w_bytes, wts_out=w)
    return MoEStaged(q, sf, ids, w)


def _traced(hidden, topk_ids, topk_weights, out) -> MoEStaged:
    """Under torch.compile: the outputs the eager path returns (out= entries
    kept, the others allocated) written by rawkv::moe_stage, which dynamo
    can trace. The operator checks the arguments when it runs."""
    import torch
    out_q, out_sf, out_ids, out_w = R.split_out(out, _OUT, least=4)
    m, k = hidden.shape[0], hidden.shape[-1]
    dev = hidden.device
    q = out_q if out_q is not None else torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    sf = out_sf if out_sf is not None else torch.empty((m, k // 64), dtype=torch.int32, device=dev)
    ids = out_ids if out_ids is not None else torch.empty(topk_ids.shape, dtype=torch.int64, device=dev)
    w = out_w if out_w is not None else torch.empty(topk_weights.shape, dtype=topk_weights.dtype, device=dev)
    MOE_STAGE_OP.call(torch, hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights, q=q, sf=sf,
                      topk_ids_out=ids, topk_weights_out=w)
    return MoEStaged(q, sf, ids, w)


# ---- torch custom operator (rawkv.library): the mutating form -----------------------------
def _moe_stage_op(hidden, topk_ids, topk_weights, q, sf, topk_ids_out, topk_weights_out):
    moe_stage(hidden, topk_ids, topk_weights, out=(q, sf, topk_ids_out, topk_weights_out))


MOE_STAGE_OP = OpDecl(
    "moe_stage", _moe_stage_op,
    "Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor(a!) q, Tensor(b!) sf, "
    "Tensor(c!) topk_ids_out, Tensor(d!) topk_weights_out")
