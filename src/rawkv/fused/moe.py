"""MoE input staging (docs/fused.md): one launch of rkv_moe_stage (NVFP4) or
rkv_moe_stage_fp8 (FP8 block output)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _rules as R
from . import plans
from .._op import empties, op
from ..reference import fused as ref
from ..runtime import get_runtime
from .. import _args as A
from .. import fp8 as FP8

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
    q, sf, ids, w = R.split_out(out, _OUT, least=4)
    (m, k), ids_s, wdt = _sizes(hidden, topk_ids, topk_weights)
    q, sf, ids, w = (o if o is not None else s_ for o, s_ in zip((q, sf, ids, w), empties(
        hidden, stream, ((m, k // 2), "uint8") if q is None else None, ((m, k // 64), "int32") if sf is None else None,
        (ids_s, "int64") if ids is None else None,
        (ids_s, wdt) if w is None and wdt is not None else None)))
    _moe_stage(hidden, topk_ids, topk_weights, q, sf, ids, w, stream, out is None)
    return MoEStaged(q, sf, ids, w)


def _sizes(hidden, topk_ids, topk_weights) -> tuple:
    """(hidden's (M, K), topk_ids' shape, topk_weights' dtype name) that a
    call's new outputs are sized from, as the rules will read the inputs
    (A.out_lead, A.as_read: a DLPack array without .dtype is read as the rules
    wrap it, where it gave no topk_weights); where the rules will refuse an
    input, which they check before the outputs, a stand-in that sizes
    nothing: (0, 0) for a hidden not 2-D or not contiguous (a 1-D hidden of
    2^17 sized a q of 2^33 bytes, a stride-0 view of 2^34 rows terabytes),
    (0,) for topk_ids not contiguous, None (no output) for weights of a
    dtype they refuse or no array (a numpy string dtype failed in torch)."""
    hs = A.out_lead(hidden, "hidden")
    w = A.as_read(topk_weights, "topk_weights")
    wdt = A.dtype_name(w) if A.is_torch(w) or isinstance(w, np.ndarray) else None
    return (hs if len(hs) == 2 else (0, 0)), A.out_lead(topk_ids, "topk_ids"), (wdt if wdt in R.PARAM else None)


@op("moe_stage", "Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor(a!) q, Tensor(b!) sf, "
                 "Tensor(c!) topk_ids_out, Tensor(d!) topk_weights_out")
def _moe_stage(hidden, topk_ids, topk_weights, q, sf, topk_ids_out, topk_weights_out, stream=None, fresh=False):
    """rawkv::moe_stage: writes q, sf and the top-k copies; fresh: the
    public function allocated every output (no memory check)."""
    where, hidden, topk_ids, topk_weights, q, sf, ids, w = R.moe_stage(
        hidden, topk_ids, topk_weights, q, sf, topk_ids_out, topk_weights_out, fresh)
    if where == "cpu":
        res = ref.moe_stage(A.to_numpy(hidden, "hidden"), A.to_numpy(topk_ids, "topk_ids"),
                            A.to_numpy(topk_weights, "topk_weights"))
        for arr, o in zip(res, (q, sf, ids, w)):
            A.from_numpy(arr, hidden, out=o)
        return
    rt = get_runtime(hidden.get_device())
    rt.run(plans.moe_stage(rt, hidden, topk_ids, topk_weights, q, sf, ids, w), stream)


class MoEStagedFp8(NamedTuple):
    """MoE inputs with FP8 block activations: codes (M, K) E4M3
    (float8_e4m3fn), scales (M, ceil(K/block)) as rawkv.fp8.quantize_blocks
    returns them, topk_ids (M, k) int64, topk_weights (a copy)."""
    codes: Any
    scales: Any
    topk_ids: Any
    topk_weights: Any


_OUT_FP8 = ("codes", "scales", "topk_ids", "topk_weights")


def moe_stage_fp8(hidden, topk_ids, topk_weights, *, block=128, scale_format="fp32", out=None, stream=None):
    """Stage MoE inputs in one launch with FP8 block activations: hidden
    (M, K) bfloat16/float16, K % 128 == 0 -> rawkv.fp8.quantize_blocks(hidden,
    block=, scale_format=), bit for bit; topk_ids (M, k) int32/int64 -> int64
    copy; topk_weights (M, k) copied (same dtype). Returns
    MoEStagedFp8(codes, scales, topk_ids, topk_weights)."""
    codes, scales, ids, w = R.split_out(out, _OUT_FP8, least=4)
    s, ids_s, wdt = _sizes(hidden, topk_ids, topk_weights)
    new_bytes = scales is None and scale_format != "fp32"
    codes, ids, w = (o if o is not None else s_ for o, s_ in zip((codes, ids, w), empties(
        hidden, stream, (s, "float8_e4m3fn") if codes is None else None,
        (ids_s, "int64") if ids is None else None,
        (ids_s, wdt) if w is None and wdt is not None else None)))
    if scales is None:
        scales = FP8.new_scales(hidden, s, block, scale_format, stream)
    _moe_stage_fp8(hidden, topk_ids, topk_weights, block, scale_format, codes,
                   FP8.scales_bytes(scales, scale_format, "out.scales"), ids, w, stream, out is None)
    return MoEStagedFp8(codes, FP8.as_e8m0(scales) if new_bytes else scales, ids, w)


@op("moe_stage_fp8", "Tensor hidden, Tensor topk_ids, Tensor topk_weights, Scalar block, str scale_format, "
                     "Tensor(a!) codes, Tensor(b!) scales, Tensor(c!) topk_ids_out, Tensor(d!) topk_weights_out")
def _moe_stage_fp8(hidden, topk_ids, topk_weights, block, scale_format, codes, scales, topk_ids_out,
                   topk_weights_out, stream=None, fresh=False):
    """rawkv::moe_stage_fp8: writes codes, scales and the top-k copies;
    fresh: the public function allocated every output (no memory check)."""
    where, hidden, topk_ids, topk_weights, codes, scales, ids, w, fmt = R.moe_stage_fp8(
        hidden, topk_ids, topk_weights, block, scale_format, codes, scales, topk_ids_out, topk_weights_out, fresh)
    if where == "cpu":
        c, sc, i, wt = ref.moe_stage_fp8(A.to_numpy(hidden, "hidden"), A.to_numpy(topk_ids, "topk_ids"),
                                         A.to_numpy(topk_weights, "topk_weights"), block, scale_format)
        for arr, o in zip((c, FP8.host_scales(sc, fmt), i, wt), (codes, scales, ids, w)):
            A.from_numpy(arr, hidden, out=o)
        return
    rt = get_runtime(hidden.get_device())
    rt.run(plans.moe_stage_fp8(rt, hidden, topk_ids, topk_weights, codes, scales, ids, w, block, fmt), stream)
