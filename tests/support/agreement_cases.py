"""The CPU / CUDA agreement cases of the fp8, nvfp4, fused and gemm operators
(tests/guards/test_cpu_cuda_agreement.py runs them): each op's accepted
arguments and the ones both placements must refuse alike."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv import fp8  # noqa: E402
from support.agreement import (  # noqa: E402
    bf, bones, buf, f16, f32, i32, i64, ones, stride0, strided_last, u8, unaligned,
)


nv = rawkv.nvfp4


fu = rawkv.fused


def _q_sf():
    q, sf, _ = nv.quantize(torch.linspace(-3, 3, 128).reshape(4, 32), scope="tensor")
    return q.view(u8), sf.view(u8)


def q():
    return _q_sf()[0]


def sf():
    return _q_sf()[1]


_WEIGHTS: dict = {}


def weight(fmt="nvfp4", g=3, n=24, k=64):
    """An Fp4Weight of CPU tensors (built once per shape)."""
    key = (fmt, g, n, k)
    if key not in _WEIGHTS:
        if fmt == "nvfp4":
            w = rawkv.gemm.Fp4Weight.from_float(torch.linspace(-2, 2, g * n * k).reshape(g, n, k))
        else:           # scale bytes 100 .. 110: outside the FP16 window
            w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.full((g, n, k // 2), 0x25, dtype=u8),
                                                torch.arange(g * n * k // 32).remainder(11).add(100)
                                                .to(u8).reshape(g, n, k // 32), groups=g)
        _WEIGHTS[key] = w
    return _WEIGHTS[key]


def retyped_weight():
    """A weight whose gs is float64 (Fp4Weight's constructor checks shapes only)."""
    w = weight()
    return rawkv.gemm.Fp4Weight(w.fmt, w.n, w.k, w.codes, w.scales, w.gs.double())


def qact(*lead, k=64):
    """An NVFP4 activation (uint8 q and sf, a gs per row) of shape (*lead, k)."""
    lead = lead or (5, 3)
    n = 1
    for s in lead:
        n *= s
    q, sf, gs = nv.quantize(torch.linspace(-3, 3, n * k).reshape(*lead, k), scope="row")
    return nv.QuantizedActivation(q.view(u8), sf.view(u8), gs)


def offs(*v):
    return torch.tensor(v, dtype=torch.int32)


gl, ml = rawkv.gemm.grouped_linear, rawkv.gemm.moe_linear


# op name -> [(case id, lambda: (public function, args, kwargs))]; the args
# are CPU tensors (the CUDA call gets the same memory seen as CUDA tensors)
OP_CASES = {
    "e4m3_encode": [
        ("ok", lambda: (fp8.e4m3_encode, (ones(4, 8),), {})),
        ("ok-out", lambda: (fp8.e4m3_encode, (ones(4, 8),), {"out": buf(4, 8)})),
        ("ok-0d", lambda: (fp8.e4m3_encode, (torch.tensor(2.0),), {})),
        ("ok-empty", lambda: (fp8.e4m3_encode, (ones(0, 8),), {})),
        ("ok-unaligned", lambda: (fp8.e4m3_encode, (unaligned(4, 8),), {"out": unaligned(4, 8, dtype=u8)})),
        ("x-strided-last-dim", lambda: (fp8.e4m3_encode, (strided_last(4, 8),), {})),
        ("x-stride-0", lambda: (fp8.e4m3_encode, (stride0(4, 8),), {})),
        ("x-transposed", lambda: (fp8.e4m3_encode, (ones(8, 4).t(),), {})),
        ("x-float64", lambda: (fp8.e4m3_encode, (ones(4, 8, dtype=torch.float64),), {})),
        ("out-strided", lambda: (fp8.e4m3_encode, (ones(4, 8),), {"out": strided_last(4, 8, dtype=u8)})),
        ("out-stride-0", lambda: (fp8.e4m3_encode, (ones(4, 8),), {"out": stride0(4, 8, dtype=u8)})),
        ("out-shape", lambda: (fp8.e4m3_encode, (ones(4, 8),), {"out": buf(32)})),
        ("out-int32", lambda: (fp8.e4m3_encode, (ones(4, 8),), {"out": buf(4, 8, dtype=torch.int32)})),
        ("out-over-x", lambda: (lambda x: fp8.e4m3_encode(x, out=x.view(u8)[:, :8]), (ones(4, 8),), {})),
    ],
    "e4m3_decode": [
        ("ok", lambda: (fp8.e4m3_decode, (buf(4, 8),), {})),
        ("ok-fp8-bf16", lambda: (fp8.e4m3_decode, (buf(4, 8).view(torch.float8_e4m3fn),),
                                 {"dtype": torch.bfloat16})),
        ("ok-out", lambda: (fp8.e4m3_decode, (buf(4, 8),), {"out": ones(4, 8, dtype=f16)})),
        ("codes-strided", lambda: (fp8.e4m3_decode, (strided_last(4, 8, dtype=u8),), {})),
        ("codes-stride-0", lambda: (fp8.e4m3_decode, (stride0(4, 8, dtype=u8),), {})),
        ("codes-float32", lambda: (fp8.e4m3_decode, (ones(4, 8),), {})),
        ("dtype-int32", lambda: (fp8.e4m3_decode, (buf(4, 8),), {"dtype": torch.int32})),
        ("out-strided", lambda: (fp8.e4m3_decode, (buf(4, 8),), {"out": strided_last(4, 8)})),
        ("out-not-dtype", lambda: (fp8.e4m3_decode, (buf(4, 8),), {"dtype": f16, "out": ones(4, 8)})),
        ("out-int32", lambda: (fp8.e4m3_decode, (buf(4, 8),), {"out": buf(4, 8, dtype=torch.int32)})),
    ],
    "fp8_quantize_blocks": [
        ("ok", lambda: (fp8.quantize_blocks, (ones(4, 256),), {})),
        ("ok-ue8m0-bf16", lambda: (fp8.quantize_blocks, (ones(4, 144, dtype=bf),), {"scale_format": "ue8m0"})),
        ("ok-ue8m0-f32-scales", lambda: (fp8.quantize_blocks, (ones(2, 3, 64, dtype=f16),),
                                         {"block": 32, "scale_format": "ue8m0", "out": (None, ones(2, 3, 2))})),
        ("ok-out", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"out": (buf(4, 128), ones(4, 1))})),
        ("ok-empty", lambda: (fp8.quantize_blocks, (ones(0, 128),), {})),
        ("ok-out-scales-mn-major", lambda: (fp8.quantize_blocks, (ones(6, 256),),
                                            {"out": (None, torch.ones(2, 8)[:, :6].t())})),
        ("out-scales-stride-0", lambda: (fp8.quantize_blocks, (ones(4, 256),), {"out": (None, stride0(4, 2))})),
        ("out-scales-rows-not-one-index", lambda: (fp8.quantize_blocks, (ones(2, 2, 256),),
                                                   {"out": (None, torch.ones(2, 2, 4).permute(2, 0, 1)[:2])})),
        ("x-unaligned", lambda: (fp8.quantize_blocks, (unaligned(4, 128),), {})),
        ("x-strided-last-dim", lambda: (fp8.quantize_blocks, (strided_last(4, 128),), {})),
        ("x-stride-0", lambda: (fp8.quantize_blocks, (stride0(4, 128),), {})),
        ("x-float64", lambda: (fp8.quantize_blocks, (ones(4, 128, dtype=torch.float64),), {})),
        ("x-last-dim-24", lambda: (fp8.quantize_blocks, (ones(4, 24),), {})),
        ("x-0d", lambda: (fp8.quantize_blocks, (torch.tensor(1.0),), {})),
        ("block-96", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"block": 96})),
        ("scale_format-bad", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"scale_format": "e8m0"})),
        ("codes-unaligned", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"out": (unaligned(4, 128, dtype=u8), None)})),
        ("codes-strided", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"out": (strided_last(4, 128, dtype=u8), None)})),
        ("scales-uint8-for-fp32", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"out": (None, buf(4, 1))})),
        ("scales-shape", lambda: (fp8.quantize_blocks, (ones(4, 128),), {"out": (None, ones(4, 2))})),
        ("scales-stride-0", lambda: (fp8.quantize_blocks, (ones(4, 256),), {"out": (None, stride0(4, 2))})),
    ],
    "fp8_dequantize_blocks": [
        ("ok", lambda: (fp8.dequantize_blocks, (buf(4, 128), ones(4, 1)), {})),
        ("ok-ue8m0-bf16", lambda: (fp8.dequantize_blocks, (buf(4, 144), buf(4, 5)), {"block": 32, "dtype": bf})),
        ("ok-out", lambda: (fp8.dequantize_blocks, (buf(4, 128), ones(4, 1)), {"out": ones(4, 128, dtype=f16)})),
        ("codes-unaligned", lambda: (fp8.dequantize_blocks, (unaligned(4, 128, dtype=u8), ones(4, 1)), {})),
        ("codes-float32", lambda: (fp8.dequantize_blocks, (ones(4, 128), ones(4, 1)), {})),
        ("scales-float16", lambda: (fp8.dequantize_blocks, (buf(4, 128), ones(4, 1, dtype=f16)), {})),
        ("ok-scales-strided", lambda: (fp8.dequantize_blocks, (buf(4, 256), strided_last(4, 2)), {})),
        ("ok-scales-mn-major", lambda: (fp8.dequantize_blocks, (buf(6, 256), torch.ones(2, 8)[:, :6].t()), {})),
        ("scales-rows-not-one-index", lambda: (fp8.dequantize_blocks,
                                               (buf(2, 2, 256), torch.ones(2, 2, 4).permute(2, 0, 1)[:2]), {})),
        ("out-unaligned", lambda: (fp8.dequantize_blocks, (buf(4, 128), ones(4, 1)), {"out": unaligned(4, 128)})),
        ("out-not-dtype", lambda: (fp8.dequantize_blocks, (buf(4, 128), ones(4, 1)), {"dtype": f16, "out": ones(4, 128)})),
    ],
    "nvfp4_quantize": [
        ("ok-tensor", lambda: (nv.quantize, (ones(4, 32),), {})),
        ("ok-row", lambda: (nv.quantize, (ones(4, 32, dtype=torch.bfloat16),), {"scope": "row"})),
        ("ok-given-number", lambda: (nv.quantize, (ones(4, 32),), {"scope": "given", "gs": 0.5})),
        ("ok-given-tensor", lambda: (nv.quantize, (ones(4, 32),), {"scope": None, "gs": torch.tensor([0.5])})),
        ("ok-none", lambda: (nv.quantize, (ones(4, 32),), {"scope": "none"})),
        ("ok-row-slice", lambda: (nv.quantize, (ones(4, 48)[:, :32],), {})),
        ("ok-out", lambda: (nv.quantize, (ones(4, 32),), {"out": (buf(4, 16), buf(4, 2), buf(dtype=f32))})),
        ("ok-empty", lambda: (nv.quantize, (ones(0, 32),), {})),
        ("x-rows-36-bytes-apart", lambda: (nv.quantize, (ones(4, 18, dtype=f16)[:, :16],), {})),
        ("x-strided-last-dim", lambda: (nv.quantize, (strided_last(4, 32),), {})),
        ("x-rows-stride-0", lambda: (nv.quantize, (stride0(4, 32),), {})),
        ("x-unaligned", lambda: (nv.quantize, (unaligned(4, 32),), {})),
        ("x-float64", lambda: (nv.quantize, (ones(4, 32, dtype=torch.float64),), {})),
        ("x-last-dim-24", lambda: (nv.quantize, (ones(4, 24),), {})),
        ("x-0d", lambda: (nv.quantize, (torch.tensor(1.0),), {})),
        ("scope-bad", lambda: (nv.quantize, (ones(4, 32),), {"scope": "col"})),
        ("gs-float64", lambda: (nv.quantize, (ones(4, 32),), {"scope": "given",
                                                            "gs": torch.tensor([0.5], dtype=torch.float64)})),
        ("gs-2-elements", lambda: (nv.quantize, (ones(4, 32),), {"scope": "given",
                                                                 "gs": torch.tensor([0.5, 0.5])})),
        ("gs-number-over-f16-bound", lambda: (nv.quantize, (ones(4, 32, dtype=f16),), {"scope": "given", "gs": 2e7})),
        ("q-strided", lambda: (nv.quantize, (ones(4, 32),), {"out": (strided_last(4, 16, dtype=u8), None, None)})),
        ("q-unaligned", lambda: (nv.quantize, (ones(4, 32),), {"out": (unaligned(4, 16, dtype=u8), None, None)})),
        ("sf-strided", lambda: (nv.quantize, (ones(4, 32),), {"out": (None, strided_last(4, 2, dtype=u8), None)})),
        ("gs-out-shape", lambda: (nv.quantize, (ones(4, 32),), {"scope": "row", "out": (None, None, ones(1))})),
        ("errors-int64", lambda: (nv.quantize, (ones(4, 32),), {"scope": "given", "gs": torch.tensor([0.5]),
                                                               "errors": buf(1, dtype=torch.int64)})),
        ("errors-empty", lambda: (nv.quantize, (ones(4, 32),), {"scope": "given", "gs": torch.tensor([0.5]),
                                                               "errors": buf(0, dtype=torch.int32)})),
    ],
    "nvfp4_dequantize": [
        ("ok-number", lambda: (nv.dequantize, (q(), sf(), 0.5), {})),
        ("ok-scalar-tensor", lambda: (nv.dequantize, (q(), sf(), torch.tensor(0.5)), {"dtype": f32})),
        ("ok-row", lambda: (nv.dequantize, (q(), sf(), ones(4)), {"dtype": f16})),
        ("ok-out", lambda: (nv.dequantize, (q(), sf(), 0.5), {"out": ones(4, 32)})),
        ("q-strided", lambda: (nv.dequantize, (strided_last(4, 16, dtype=u8), sf(), 0.5), {})),
        ("q-unaligned", lambda: (nv.dequantize, (unaligned(4, 16, dtype=u8), sf(), 0.5), {})),
        ("q-float32", lambda: (nv.dequantize, (ones(4, 16), sf(), 0.5), {})),
        ("sf-strided", lambda: (nv.dequantize, (q(), strided_last(4, 2, dtype=u8), 0.5), {})),
        ("sf-shape", lambda: (nv.dequantize, (q(), buf(4, 3), 0.5), {})),
        ("gs-row-strided", lambda: (nv.dequantize, (q(), sf(), ones(4, 2)[:, 0]), {})),
        ("gs-float64", lambda: (nv.dequantize, (q(), sf(), torch.tensor(0.5, dtype=torch.float64)), {})),
        ("gs-shape", lambda: (nv.dequantize, (q(), sf(), ones(3)), {})),
        ("gs-bool", lambda: (nv.dequantize, (q(), sf(), True), {})),
        ("out-strided", lambda: (nv.dequantize, (q(), sf(), 0.5), {"out": strided_last(4, 32)})),
        ("out-unaligned", lambda: (nv.dequantize, (q(), sf(), 0.5), {"out": unaligned(4, 32)})),
        ("out-not-dtype", lambda: (nv.dequantize, (q(), sf(), 0.5), {"dtype": f16, "out": ones(4, 32)})),
        ("dtype-int8", lambda: (nv.dequantize, (q(), sf(), 0.5), {"dtype": torch.int8})),
    ],
    "nvfp4_gather": [
        ("ok-int32", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([3, 0, 9], dtype=torch.int32)), {})),
        ("ok-int64-errors", lambda: (nv.gather, (q(), sf(), ones(4), torch.tensor([[1], [5]])),
                                     {"errors": buf(1, dtype=torch.int32)})),
        ("indices-strided", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([[0, 1], [2, 3]]).t()), {})),
        ("indices-float", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([0.0])), {})),
        ("indices-int16", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([0], dtype=torch.int16)), {})),
        ("errors-int64", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([0])),
                                  {"errors": buf(1, dtype=torch.int64)})),
        ("errors-strided", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([0])),
                                    {"errors": strided_last(2, dtype=torch.int32)})),
        ("out-unaligned", lambda: (nv.gather, (q(), sf(), 0.5, torch.tensor([0])), {"out": unaligned(1, 32)})),
        ("q-strided", lambda: (nv.gather, (strided_last(4, 16, dtype=u8), sf(), 0.5, torch.tensor([0])), {})),
    ],
    "nvfp4_swizzle_scales": [
        ("ok", lambda: (nv.swizzle_scales, (buf(130, 7),), {})),
        ("ok-out", lambda: (nv.swizzle_scales, (buf(4, 4),), {"out": buf(512)})),
        ("sf-strided", lambda: (nv.swizzle_scales, (strided_last(130, 7, dtype=u8),), {})),
        ("sf-float32", lambda: (nv.swizzle_scales, (ones(4, 4),), {})),
        ("sf-0d", lambda: (nv.swizzle_scales, (torch.tensor(1, dtype=u8),), {})),
        ("out-unaligned", lambda: (nv.swizzle_scales, (buf(4, 4),), {"out": unaligned(512, dtype=u8)})),
        ("out-size", lambda: (nv.swizzle_scales, (buf(4, 4),), {"out": buf(7)})),
    ],
    "nvfp4_unswizzle_scales": [
        ("ok", lambda: (nv.unswizzle_scales, (buf(2048), (130, 7)), {})),
        ("ok-out", lambda: (nv.unswizzle_scales, (buf(512), (2, 2)), {"out": buf(2, 2)})),
        ("sw-strided", lambda: (nv.unswizzle_scales, (strided_last(512, dtype=u8), (2, 2)), {})),
        ("sw-unaligned", lambda: (nv.unswizzle_scales, (unaligned(512, dtype=u8), (2, 2)), {})),
        ("sw-size", lambda: (nv.unswizzle_scales, (buf(500), (2, 2)), {})),
        ("out-strided", lambda: (nv.unswizzle_scales, (buf(512), (2, 2)), {"out": strided_last(2, 2, dtype=u8)})),
        ("out-shape", lambda: (nv.unswizzle_scales, (buf(512), (2, 2)), {"out": buf(4)})),
    ],
    "rmsnorm_quantize": [
        ("ok", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)), {})),
        ("ok-tensor-f16-weight", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=f16), ones(32, dtype=f16)),
                                          {"scope": "tensor"})),
        ("ok-given-tensor", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                                     {"gs": torch.tensor([0.5])})),
        ("ok-out", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                            {"out": (buf(4, 16), buf(4, 2), ones(4), ones(4))})),
        ("ok-empty", lambda: (fu.rmsnorm_quantize, (ones(0, 32, dtype=bf), ones(32)), {"scope": "none"})),
        ("x-strided", lambda: (fu.rmsnorm_quantize, (strided_last(4, 32, dtype=bf), ones(32)), {})),
        ("x-stride-0", lambda: (fu.rmsnorm_quantize, (stride0(4, 32, dtype=bf), ones(32)), {})),
        ("x-unaligned", lambda: (fu.rmsnorm_quantize, (unaligned(4, 32, dtype=bf), ones(32)), {})),
        # (a float32 or float64 x: the lists of dtypes in the messages differ, CPU taking float32 too)
        ("x-0d", lambda: (fu.rmsnorm_quantize, (torch.tensor(1.0, dtype=bf), ones(32)), {})),
        ("weight-unaligned", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), unaligned(32)), {})),
        ("weight-strided", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), strided_last(32)), {})),
        ("eps-0", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)), {"eps": 0.0})),
        ("gs-float64", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                                {"gs": torch.tensor([0.5], dtype=torch.float64)})),
        ("gs-number-over-f16-bound", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=f16), ones(32)),
                                              {"gs": 2e7})),
        ("out.q-strided", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                                   {"out": (strided_last(4, 16, dtype=u8), None, None)})),
        ("out.q-unaligned", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                                     {"out": (unaligned(4, 16, dtype=u8), None, None)})),
        ("out.inv_rms-stride-0", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                                          {"out": (None, None, None, ones(1).expand(4))})),
        ("out.gs-shape", lambda: (fu.rmsnorm_quantize, (ones(4, 32, dtype=bf), ones(32)),
                                  {"out": (None, None, ones(1))})),
    ],
    "mhc_rmsnorm_quantize": [
        ("ok", lambda: (fu.mhc_rmsnorm_quantize, (ones(4, 2, 32, dtype=bf), ones(4, 2), ones(32)), {})),
        ("ok-bf16-mix", lambda: (fu.mhc_rmsnorm_quantize, (ones(4, 2, 32, dtype=bf), ones(4, 2, dtype=bf),
                                                           ones(32)), {"scope": "tensor"})),
        ("x-strided", lambda: (fu.mhc_rmsnorm_quantize, (strided_last(4, 2, 32, dtype=bf), ones(4, 2), ones(32)), {})),
        ("x-n_hc-5", lambda: (fu.mhc_rmsnorm_quantize, (ones(4, 5, 32, dtype=bf), ones(4, 5), ones(32)), {})),
        ("mix-transposed", lambda: (fu.mhc_rmsnorm_quantize, (ones(4, 2, 32, dtype=bf), ones(2, 4).t(), ones(32)), {})),
        ("mix-int32", lambda: (fu.mhc_rmsnorm_quantize, (ones(4, 2, 32, dtype=bf), buf(4, 2, dtype=i32), ones(32)), {})),
    ],
    "swiglu_quantize": [
        ("ok", lambda: (fu.swiglu_quantize, (ones(4, 64, dtype=bf),), {})),
        ("ok-g4-given", lambda: (fu.swiglu_quantize, (ones(4, 64, dtype=f16), 4), {"gs": 0.5})),
        ("ok-g1-2-byte-aligned", lambda: (fu.swiglu_quantize, (unaligned(4, 64, dtype=bf), 1), {})),
        ("h-unaligned-g8", lambda: (fu.swiglu_quantize, (unaligned(4, 64, dtype=bf),), {})),
        ("h-strided", lambda: (fu.swiglu_quantize, (strided_last(4, 64, dtype=bf),), {})),
        ("h-stride-0", lambda: (fu.swiglu_quantize, (stride0(4, 64, dtype=bf),), {})),
        ("h-odd", lambda: (fu.swiglu_quantize, (ones(4, 66, dtype=bf),), {})),
        ("granularity-3", lambda: (fu.swiglu_quantize, (ones(4, 64, dtype=bf), 3), {})),
        ("out.sf-strided", lambda: (fu.swiglu_quantize, (ones(4, 64, dtype=bf),),
                                    {"out": (None, strided_last(4, 2, dtype=u8), None)})),
        ("out.inv_rms", lambda: (fu.swiglu_quantize, (ones(4, 64, dtype=bf),), {"out": (None, None, None, ones(4))})),
    ],
    "moe_stage": [
        ("ok", lambda: (fu.moe_stage, (ones(2, 128, dtype=bf), buf(2, 4, dtype=i32), ones(2, 4)), {})),
        ("ok-out", lambda: (fu.moe_stage, (ones(2, 128, dtype=f16), buf(2, 4, dtype=i64), ones(2, 4, dtype=bf)),
                            {"out": (buf(2, 64), buf(2, 2, dtype=i32), buf(2, 4, dtype=i64), ones(2, 4, dtype=bf))})),
        ("hidden-unaligned", lambda: (fu.moe_stage, (unaligned(2, 128, dtype=bf), buf(2, 4, dtype=i32), ones(2, 4)), {})),
        ("hidden-strided", lambda: (fu.moe_stage, (strided_last(2, 128, dtype=bf), buf(2, 4, dtype=i32), ones(2, 4)), {})),
        ("topk_ids-transposed", lambda: (fu.moe_stage, (ones(2, 128, dtype=bf), buf(4, 2, dtype=i32).t(), ones(2, 4)), {})),
        ("topk_weights-stride-0", lambda: (fu.moe_stage, (ones(2, 128, dtype=bf), buf(2, 4, dtype=i32), stride0(2, 4)), {})),
        ("out.q-unaligned", lambda: (fu.moe_stage, (ones(2, 128, dtype=bf), buf(2, 4, dtype=i32), ones(2, 4)),
                                     {"out": (unaligned(2, 64, dtype=u8), None, None, None)})),
        ("out.topk_ids-int32", lambda: (fu.moe_stage, (ones(2, 128, dtype=bf), buf(2, 4, dtype=i32), ones(2, 4)),
                                        {"out": (None, None, buf(2, 4, dtype=i32), None)})),
    ],
    "gemm_grouped_linear": [
        ("ok", lambda: (gl, (bones(5, 3, 64), weight()), {})),
        ("ok-f16", lambda: (gl, (ones(5, 3, 64, dtype=f16), weight()), {})),
        ("ok-nvfp4", lambda: (gl, (qact(), weight()), {})),
        ("ok-nvfp4-mxfp4", lambda: (gl, (qact(), weight("mxfp4")), {})),
        ("ok-out", lambda: (gl, (bones(5, 3, 64), weight()), {"out": bones(5, 3, 24)})),
        ("ok-out-strided-rows", lambda: (gl, (bones(5, 3, 64), weight()), {"out": bones(5, 3, 30)[..., :24]})),
        ("ok-x-strided-last-dim", lambda: (gl, (strided_last(5, 3, 64, dtype=bf), weight()), {})),
        ("ok-x-unaligned", lambda: (gl, (unaligned(5, 3, 64, dtype=bf), weight()), {})),
        ("ok-x-stride-0", lambda: (gl, (stride0(5, 3, 64, dtype=bf), weight()), {})),
        ("ok-empty", lambda: (gl, (bones(0, 3, 64), weight()), {})),
        ("x-float32", lambda: (gl, (ones(5, 3, 64), weight()), {})),
        ("x-rank", lambda: (gl, (bones(5, 64), weight()), {})),
        ("x-groups", lambda: (gl, (bones(5, 2, 64), weight()), {})),
        ("x-K", lambda: (gl, (bones(5, 3, 32), weight()), {})),
        ("x-f16-mxfp4-outside-window", lambda: (gl, (ones(5, 3, 64, dtype=f16), weight("mxfp4")), {})),
        ("x-number", lambda: (gl, (2.0, weight()), {})),
        ("x.q-float32", lambda: (gl, (nv.QuantizedActivation(ones(5, 3, 32), *qact()[1:3]), weight()), {})),
        ("x.sf-shape", lambda: (gl, (nv.QuantizedActivation(qact().q, buf(5, 3, 2), qact().gs), weight()), {})),
        ("x.gs-float64", lambda: (gl, (nv.QuantizedActivation(*qact()[:2], qact().gs.double()), weight()), {})),
        ("x.gs-shape", lambda: (gl, (nv.QuantizedActivation(*qact()[:2], ones(5)), weight()), {})),
        ("weight-none", lambda: (gl, (bones(5, 3, 64), None), {})),
        ("weight.gs-float64", lambda: (gl, (bones(5, 3, 64), retyped_weight()), {})),
        # (errors= counts a W4a8Weight's shift bytes past the table; an Fp4Weight has none)
        ("errors-with-an-fp4-weight", lambda: (gl, (bones(5, 3, 64), weight()), {"errors": buf(1, dtype=torch.int32)})),
        ("out-float32", lambda: (gl, (bones(5, 3, 64), weight()), {"out": ones(5, 3, 24)})),
        ("out-shape", lambda: (gl, (bones(5, 3, 64), weight()), {"out": bones(5, 3, 23)})),
        ("out-strided-last-dim", lambda: (gl, (bones(5, 3, 64), weight()), {"out": strided_last(5, 3, 24, dtype=bf)})),
        ("out-stride-0", lambda: (gl, (bones(5, 3, 64), weight()), {"out": stride0(5, 3, 24, dtype=bf)})),
        ("out-over-x", lambda: (lambda x, w: gl(x, w, out=x[..., :24]), (bones(5, 3, 64), weight()), {})),
    ],
    "gemm_moe_linear": [
        ("ok", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {})),
        ("ok-clamped-errors", lambda: (ml, (bones(7, 64), weight(), offs(0, 5, 2, 9)), {"errors": buf(1, dtype=torch.int32)})),
        ("ok-nvfp4", lambda: (ml, (qact(5), weight(), offs(0, 1, 3, 5)), {})),
        ("ok-out", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {"out": bones(7, 24)})),
        ("x-rank", lambda: (ml, (bones(7, 3, 64), weight(), offs(0, 2, 2, 7)), {})),
        ("offsets-int64", lambda: (ml, (bones(7, 64), weight(), torch.tensor([0, 2, 2, 7])), {})),
        ("offsets-shape", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 7)), {})),
        ("offsets-strided", lambda: (ml, (bones(7, 64), weight(), strided_last(4, dtype=torch.int32)), {})),
        ("offsets-list", lambda: (ml, (bones(7, 64), weight(), [0, 2, 2, 7]), {})),
        ("errors-int64", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {"errors": buf(1, dtype=torch.int64)})),
        ("errors-empty", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {"errors": buf(0, dtype=torch.int32)})),
        ("errors-strided", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {"errors": strided_last(2, dtype=torch.int32)})),
        ("errors-over-offsets", lambda: (lambda x, w, o: ml(x, w, o, errors=o[:1]), (bones(7, 64), weight(), offs(0, 2, 2, 7)), {})),
        ("out-shape", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {"out": bones(7, 23)})),
        ("out-stride-0", lambda: (ml, (bones(7, 64), weight(), offs(0, 2, 2, 7)), {"out": stride0(7, 24, dtype=bf)})),
    ],
}
