"""The same inputs are accepted or refused on CPU and CUDA (issue 22 item 2).

Each case calls a public op twice on the same memory: as CPU tensors (the
reference's path) and as CPU tensors that report is_cuda with a runtime
that records launches (tests/support/fake_cuda.py: the CUDA path up to the
launch). Both calls must accept, or both refuse with the same error type and
message. Code that runs on CPU then runs on the GPU, and an input the GPU
refuses is refused on CPU first.

The differences by design are not here: a given gs whose value is
unusable is refused on the host when the host holds it, and flagged and
counted by the kernel when the device does (docs/format.md); the fused
producers take a float32 x / h / hidden on CPU (the reference's precision,
docs/fused.md). The KV-cache ops run where their pool / decode state lives:
a case passes a view of a CPU pool's buffers (rawkv.kvcache.views), and the
CUDA call a view of the same buffers seen as CUDA tensors (a CUDA pool's
rope is bfloat16: a copy); a numpy float32 array stands for bfloat16 on the
host, a torch tensor does not.
"""
from __future__ import annotations

import re

import pytest

import rawkv
from rawkv import _opdecl, fp8
from rawkv.fused import moe, rms, swiglu
from rawkv.gemm import linear
from rawkv.kvcache import assign, bridge, compressor, flush, gather, layouts, prefill, state_ops
from rawkv.kvcache import decode as kv_decode
from rawkv.kvcache import views as V
from rawkv.nvfp4 import activation, decode, encode, scales
from rawkv.reference.kvcache import layouts as RL

torch = pytest.importorskip("torch")
from support.fake_cuda import fake, install  # noqa: E402
from support.library import agreement_cases  # noqa: E402

nv = rawkv.nvfp4
fu = rawkv.fused
f32, f16, u8 = torch.float32, torch.float16, torch.uint8
bf = torch.bfloat16
i32, i64 = torch.int32, torch.int64


def ones(*shape, dtype=f32):
    return torch.ones(shape, dtype=dtype)


def buf(*shape, dtype=u8):
    return torch.zeros(shape, dtype=dtype)


def unaligned(*shape, dtype=f32, by=1):
    """A contiguous view starting `by` elements into a fresh buffer."""
    n = 1
    for s in shape:
        n *= s
    return torch.ones(n + by, dtype=dtype)[by:].view(shape)


def strided_last(*shape, dtype=f32):
    """Every other element of the last dimension."""
    return torch.ones(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]


def stride0(*shape, dtype=f32):
    return torch.ones(shape[-1], dtype=dtype).expand(*shape)


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


def bones(*shape):
    return torch.ones(shape, dtype=bf)


def offs(*v):
    return torch.tensor(v, dtype=torch.int32)


gl, ml = rawkv.gemm.grouped_linear, rawkv.gemm.moe_linear
kvc = rawkv.kvcache


def kpool(kind="csa", layout="model1"):
    """A view of a CPU pool's buffers (8 blocks of 4 entries, 2 requests:
    entries 0..7 and 0..4 prepared); CSA pools have indexer keys."""
    p = kvc.PagedKVPool(kind, 8, 4, 2, 4, device="cpu", layout=layout)
    for _ in range(2):
        p.add_request()
    p.prepare_step([0, 1], [8 * p.m - 1, 5 * p.m - 1])
    return V.pool_view(**V.pool_args(p))


def kstate(kind="csa", head_dim=512):
    """A view of a CPU decode state's buffers, 2 slots."""
    return V.state_view(**V.state_args(kvc.DecodeState(kind, 2, head_dim, device="cpu")))


def ints(*v, dtype=i32):
    return torch.tensor(v, dtype=dtype)


def mask(*v):
    return torch.tensor(v, dtype=torch.bool)


def page(layout, n=2, p=4):
    """A (n, page_bytes) layout cache of pages of p records."""
    return buf(n, RL.LAYOUTS[layout].page_bytes(p))


def counter_in(obj, name):
    """errors= over one of obj's own buffers (whichever side the call is on)."""
    args = V.pool_args(obj) if isinstance(obj, kvc.PagedKVPool) else V.state_args(obj)
    return args[name].view(-1)[:4].view(u8).view(i32) if args[name].dtype != i32 else args[name][:1]


def rows_kv(n, w=1024, dtype=f32):
    return torch.ones((n, w), dtype=dtype)


IDS = lambda: torch.zeros((2, 3), dtype=i32)       # noqa: E731
PI = kvc.PrefillIndex

# op name -> [(case id, lambda: (public function, args, kwargs))]; the args
# are CPU tensors (the CUDA call gets the same memory seen as CUDA tensors)
CASES = {
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
        ("scales-strided", lambda: (fp8.dequantize_blocks, (buf(4, 256), strided_last(4, 2)), {})),
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
    # ---- rawkv.kvcache: pool ops ----
    "kv_flush_write": [
        ("ok", lambda: (kvc.flush_write, (kpool(), bones(2, 512), mask(1, 1), ints(0, 1), ints(0, 4)),
                        {"index_keys": bones(2, 128)})),
        ("ok-hca-rawkv", lambda: (kvc.flush_write, (kpool("hca", "rawkv"), bones(2, 512), mask(1, 0), ints(0, 1),
                                                    ints(0, 128)), {})),
        ("entries-float32", lambda: (kvc.flush_write, (kpool("hca"), ones(2, 512), mask(1, 1), ints(0, 1),
                                                       ints(0, 128)), {})),
        ("entries-strided", lambda: (kvc.flush_write, (kpool("hca"), strided_last(2, 512, dtype=bf), mask(1, 1),
                                                       ints(0, 1), ints(0, 128)), {})),
        ("entries-unaligned", lambda: (kvc.flush_write, (kpool("hca"), unaligned(2, 512, dtype=bf), mask(1, 1),
                                                         ints(0, 1), ints(0, 128)), {})),
        ("slots-int64", lambda: (kvc.flush_write, (kpool("hca"), bones(2, 512), mask(1, 1), ints(0, 1, dtype=i64),
                                                   ints(0, 128)), {})),
        ("valid_mask-stride-0", lambda: (kvc.flush_write, (kpool("hca"), bones(2, 512), mask(1).expand(2),
                                                           ints(0, 1), ints(0, 128)), {})),
        ("index_keys-missing", lambda: (kvc.flush_write, (kpool(), bones(2, 512), mask(1, 1), ints(0, 1),
                                                          ints(0, 4)), {})),
        ("errors-over-written", lambda: (lambda p, *a: kvc.flush_write(p, *a, errors=counter_in(p, "written")),
                                         (kpool("hca"), bones(2, 512), mask(1, 1), ints(0, 1), ints(0, 128)), {})),
    ],
    "kv_assign_pages": [
        ("ok", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5, 6)), {})),
        ("ok-errors", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5, 9)), {"errors": buf(1, dtype=i32)})),
        ("blocks-shape", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5)), {})),
        ("slots-2d", lambda: (kvc.assign_pages, (kpool(), buf(2, 1, dtype=i32), ints(5, 6)), {})),
        ("errors-int64", lambda: (kvc.assign_pages, (kpool(), ints(0, 1), ints(5, 6)), {"errors": buf(1, dtype=i64)})),
        ("errors-over-owners", lambda: (lambda p, *a: kvc.assign_pages(p, *a, errors=counter_in(p, "owners")),
                                        (kpool(), ints(0, 1), ints(5, 6)), {})),
    ],
    "kv_kvcache_indices": [
        ("ok", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), IDS()), {})),
        ("ok-int64-out", lambda: (kvc.kvcache_indices, (kpool("hca"), ints(0, 1), IDS().long()),
                                  {"out": buf(2, 3, dtype=i32), "n_entries": ints(3, 1), "valid_mask": mask(1, 0)})),
        ("topk_ids-transposed", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), buf(3, 2, dtype=i32).t()), {})),
        ("out-strided", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), IDS()),
                                 {"out": strided_last(2, 3, dtype=i32)})),
        ("n_entries-int64", lambda: (kvc.kvcache_indices, (kpool(), ints(0, 1), IDS()),
                                     {"n_entries": ints(3, 1, dtype=i64)})),
    ],
    "kv_gather_topk": [
        ("ok", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()), {})),
        ("ok-float32-rawkv", lambda: (kvc.gather_topk, (kpool("csa", "rawkv"), ints(0, 1), IDS().long()),
                                      {"dtype": "float32", "valid_mask": mask(0, 1)})),
        ("ok-out", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()), {"out": ones(2, 3, 512, dtype=f16)})),
        ("out-unaligned", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()),
                                   {"out": unaligned(2, 3, 512, dtype=bf)})),
        ("out-not-dtype", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()),
                                   {"dtype": "float16", "out": bones(2, 3, 512)})),
        ("topk_ids-float", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), ones(2, 3)), {})),
        ("valid_mask-shape", lambda: (kvc.gather_topk, (kpool(), ints(0, 1), IDS()), {"valid_mask": mask(1)})),
    ],
    "kv_gather_dense": [
        ("ok", lambda: (kvc.gather_dense, (kpool("hca"), 0, 2), {})),
        ("ok-out", lambda: (kvc.gather_dense, (kpool("hca", "rawkv"), 1, 2), {"out": ones(2, 512)})),
        ("slot-out-of-range", lambda: (kvc.gather_dense, (kpool("hca"), 5, 2), {})),
        ("n_entries-negative", lambda: (kvc.gather_dense, (kpool("hca"), 0, -1), {})),
        ("out-strided", lambda: (kvc.gather_dense, (kpool("hca"), 0, 2), {"out": strided_last(2, 512, dtype=bf)})),
    ],
    "kv_gather_index_keys": [
        ("ok", lambda: (kvc.gather_index_keys, (kpool(), 0, 3), {})),
        ("ok-rawkv-f16", lambda: (kvc.gather_index_keys, (kpool("csa", "rawkv"), 0, 3), {"dtype": f16})),
        ("pool-without-keys", lambda: (kvc.gather_index_keys, (kpool("hca"), 0, 3), {})),
        ("out-shape", lambda: (kvc.gather_index_keys, (kpool(), 0, 3), {"out": bones(3, 64)})),
    ],
    "kv_gather_dense_batch": [
        ("ok", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)), {"max_entries": 3})),
        ("ok-out", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)),
                            {"out": bones(2, 3, 512), "valid_mask": mask(1, 0)})),
        ("max_entries-missing", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)), {})),
        ("n_entries-int64", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1, dtype=i64)),
                                     {"max_entries": 3})),
        ("out-stride-0", lambda: (kvc.gather_dense_batch, (kpool("hca"), ints(0, 1), ints(2, 1)),
                                  {"out": stride0(2, 3, 512, dtype=bf)})),
    ],
    "kv_gather_index_keys_batch": [
        ("ok", lambda: (kvc.gather_index_keys_batch, (kpool(), ints(0, 1), ints(2, 1)), {"max_entries": 3})),
        ("out-K-not-max_entries", lambda: (kvc.gather_index_keys_batch, (kpool(), ints(0, 1), ints(2, 1)),
                                           {"max_entries": 3, "out": bones(2, 4, 128)})),
        ("slots-strided", lambda: (kvc.gather_index_keys_batch, (kpool(), strided_last(2, dtype=i32), ints(2, 1)),
                                   {"max_entries": 3})),
    ],
    "kv_compress_prefill": [
        ("ok-hca", lambda: (kvc.compress_prefill, (kpool("hca"), rows_kv(256, 512), rows_kv(256, 512), None,
                                                   ones(512), 0), {})),
        ("ok-csa", lambda: (kvc.compress_prefill, (kpool("csa", "rawkv"), rows_kv(8, dtype=bf), rows_kv(8, dtype=bf),
                                                   ones(4, 1024), ones(512), 1),
                            {"index": PI(rows_kv(8, 256, bf), rows_kv(8, 256, bf), None, ones(128))})),
        ("z-float32-beside-bf16-kv", lambda: (kvc.compress_prefill, (kpool("hca"), rows_kv(256, 512, bf),
                                                                     rows_kv(256, 512), None, ones(512), 0), {})),
        ("kv-strided", lambda: (kvc.compress_prefill, (kpool("hca"), strided_last(256, 512), rows_kv(256, 512),
                                                       None, ones(512), 0), {})),
        ("norm_weight-shape", lambda: (kvc.compress_prefill, (kpool("hca"), rows_kv(256, 512), rows_kv(256, 512),
                                                              None, ones(513), 0), {})),
        ("index.kv-transposed", lambda: (kvc.compress_prefill, (kpool(), rows_kv(8), rows_kv(8), None, ones(512), 0),
                                         {"index": PI(ones(256, 8).t(), rows_kv(8, 256), None, ones(128))})),
        ("index-missing", lambda: (kvc.compress_prefill, (kpool(), rows_kv(8), rows_kv(8), None, ones(512), 0), {})),
    ],
    "kv_compress_decode": [
        ("ok-hca", lambda: (kvc.compress_decode, (kpool("hca"), kstate("hca"), ones(512), mask(1, 1), ints(0, 1),
                                                  ints(127, 5)), {})),
        ("ok-csa", lambda: (kvc.compress_decode, (kpool(), kstate(), ones(512), mask(1, 1), ints(0, 1, dtype=i64),
                                                  ints(3, 7, dtype=i64)),
                            {"index": kvc.DecodeIndex(kstate("csa", 128), ones(128))})),
        ("positions-not-slots-dtype", lambda: (kvc.compress_decode, (kpool("hca"), kstate("hca"), ones(512),
                                                                     mask(1, 1), ints(0, 1), ints(0, 1, dtype=i64)), {})),
        ("state-kind", lambda: (kvc.compress_decode, (kpool("hca"), kstate("csa"), ones(512), mask(1, 1), ints(0, 1),
                                                      ints(0, 1)), {})),
        ("valid_mask-strided", lambda: (kvc.compress_decode, (kpool("hca"), kstate("hca"), ones(512),
                                                              strided_last(2, dtype=torch.bool), ints(0, 1),
                                                              ints(0, 1)), {})),
        ("index.norm_weight-unaligned-shape", lambda: (kvc.compress_decode, (kpool(), kstate(), ones(512), mask(1, 1),
                                                                             ints(0, 1), ints(3, 7)),
                                                       {"index": kvc.DecodeIndex(kstate("csa", 128), ones(64))})),
    ],
    # ---- rawkv.kvcache: decode-state ops ----
    "kv_state_seed": [
        ("ok", lambda: (kvc.state_seed, (kstate(), 0, rows_kv(6), rows_kv(6)), {})),
        ("ok-bf16-ape", lambda: (kvc.state_seed, (kstate(), 1, rows_kv(6, dtype=bf), rows_kv(6, dtype=bf)),
                                 {"ape": ones(4, 1024)})),
        ("slot-2", lambda: (kvc.state_seed, (kstate(), 2, rows_kv(6), rows_kv(6)), {})),
        ("kv-strided", lambda: (kvc.state_seed, (kstate(), 0, strided_last(6, 1024), rows_kv(6)), {})),
        ("ape-bf16", lambda: (kvc.state_seed, (kstate(), 0, rows_kv(6), rows_kv(6)), {"ape": bones(4, 1024)})),
    ],
    "kv_state_append": [
        ("ok", lambda: (kvc.state_append, (kstate(), rows_kv(2), rows_kv(2), mask(1, 1), ints(0, 1)), {})),
        ("ok-hca-ape", lambda: (kvc.state_append, (kstate("hca"), rows_kv(2, 512, bf), rows_kv(2, 512), mask(1, 0),
                                                   ints(0, 1)), {"ape": ones(128, 512)})),
        ("kv-unaligned", lambda: (kvc.state_append, (kstate(), unaligned(2, 1024), rows_kv(2), mask(1, 1), ints(0, 1)),
                                  {})),
        ("z-shape", lambda: (kvc.state_append, (kstate(), rows_kv(2), rows_kv(3), mask(1, 1), ints(0, 1)), {})),
        ("slots-int64", lambda: (kvc.state_append, (kstate(), rows_kv(2), rows_kv(2), mask(1, 1),
                                                    ints(0, 1, dtype=i64)), {})),
        ("errors-over-count", lambda: (lambda st, *a: kvc.state_append(st, *a, errors=counter_in(st, "count")),
                                       (kstate(), rows_kv(2), rows_kv(2), mask(1, 1), ints(0, 1)), {})),
    ],
    "kv_csa_rotate": [
        ("ok", lambda: (kvc.csa_rotate, (kstate(), mask(1, 0), ints(0, 1)), {})),
        ("state-hca", lambda: (kvc.csa_rotate, (kstate("hca"), mask(1, 0), ints(0, 1)), {})),
        ("valid_mask-none", lambda: (kvc.csa_rotate, (kstate(), None, ints(0, 1)), {})),
        ("slots-stride-0", lambda: (kvc.csa_rotate, (kstate(), mask(1, 0), ints(0).expand(2)), {})),
    ],
    "kv_hca_reset": [
        ("ok", lambda: (kvc.hca_reset, (kstate("hca"), mask(1, 1), ints(0, 1)), {"errors": buf(1, dtype=i32)})),
        ("state-csa", lambda: (kvc.hca_reset, (kstate(), mask(1, 1), ints(0, 1)), {})),
        ("errors-empty", lambda: (kvc.hca_reset, (kstate("hca"), mask(1, 1), ints(0, 1)),
                                  {"errors": buf(0, dtype=i32)})),
    ],
    "kv_state_clear": [
        ("ok", lambda: (kvc.state_clear, (kstate(), ints(0, 1)), {})),
        ("ok-mask", lambda: (kvc.state_clear, (kstate("hca"), ints(1)), {"valid_mask": mask(0)})),
        ("slots-2d", lambda: (kvc.state_clear, (kstate(), buf(2, 1, dtype=i32)), {})),
        ("valid_mask-int32", lambda: (kvc.state_clear, (kstate(), ints(0, 1)), {"valid_mask": ints(1, 0)})),
    ],
    # ---- rawkv.kvcache: the ecosystem layouts ----
    "kv_model1_store": [
        ("ok", lambda: (kvc.model1_store, (page("model1", 3), ones(2, 512), ints(0, 5)), {"page_size": 4})),
        ("ok-offsets-errors", lambda: (kvc.model1_store, (page("model1"), bones(2, 512), ints(0, 1, dtype=i64)),
                                       {"page_size": 4, "offsets": ints(0, 9), "errors": buf(1, dtype=i32)})),
        ("cache-unaligned", lambda: (kvc.model1_store, (buf(2 * RL.MODEL1.page_bytes(4) + 8)[8:].view(2, -1),
                                                        ones(2, 512), ints(0, 5)), {"page_size": 4})),
        ("entries-strided", lambda: (kvc.model1_store, (page("model1"), strided_last(2, 512), ints(0, 5)),
                                     {"page_size": 4})),
        ("slots-float", lambda: (kvc.model1_store, (page("model1"), ones(2, 512), ones(2)), {"page_size": 4})),
        ("errors-over-cache", lambda: (lambda c, x, sl: kvc.model1_store(c, x, sl, page_size=4,
                                                                         errors=c.view(-1)[:4].view(i32)),
                                       (page("model1"), ones(2, 512), ints(0, 5)), {})),
    ],
    "kv_model1_window_insert": [
        ("ok", lambda: (kvc.model1_window_insert, (page("model1"), bones(3, 512), ints(6, -1, 8, dtype=i64)),
                        {"page_size": 4})),
        ("slot_mapping-shape", lambda: (kvc.model1_window_insert, (page("model1"), bones(3, 512), ints(6, -1)),
                                        {"page_size": 4})),
        ("rows-unaligned", lambda: (kvc.model1_window_insert, (page("model1"), unaligned(3, 512, dtype=bf),
                                                               ints(6, -1, 8)), {"page_size": 4})),
    ],
    "kv_index_fp8_store": [
        ("ok", lambda: (kvc.index_fp8_store, (page("index_fp8"), ones(2, 128), ints(0, 1)), {"page_size": 4})),
        ("ok-deepgemm-shape", lambda: (kvc.index_fp8_store, (buf(2, 4, 1, 132), bones(2, 128), ints(7, 1)),
                                       {"page_size": 4})),
        ("cache-page-stride", lambda: (kvc.index_fp8_store, (buf(2, RL.INDEX_FP8.page_bytes(4) + 4), ones(2, 128),
                                                             ints(0, 1)), {"page_size": 4})),
        ("keys-width", lambda: (kvc.index_fp8_store, (page("index_fp8"), ones(2, 64), ints(0, 1)), {"page_size": 4})),
    ],
    "kv_index_mxfp4_store": [
        ("ok", lambda: (kvc.index_mxfp4_store, (page("index_mxfp4"), bones(2, 128), ints(1, -1)), {"page_size": 4})),
        ("keys-float16", lambda: (kvc.index_mxfp4_store, (page("index_mxfp4"), ones(2, 128, dtype=f16), ints(1, -1)),
                                  {"page_size": 4})),
        ("cache-int32", lambda: (kvc.index_mxfp4_store, (buf(2, RL.INDEX_MXFP4.page_bytes(4) // 4, dtype=i32),
                                                         bones(2, 128), ints(1, -1)), {"page_size": 4})),
    ],
    "kv_model1_gather": [
        ("ok", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5, -1)), {"page_size": 4})),
        ("ok-out-f32", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5)), {"page_size": 4, "out": ones(2, 512)})),
        ("indices-int64", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5, dtype=i64)), {"page_size": 4})),
        ("out-unaligned", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5)),
                                   {"page_size": 4, "out": unaligned(2, 512)})),
        ("out-not-dtype", lambda: (kvc.model1_gather, (page("model1"), ints(0, 5)),
                                   {"page_size": 4, "dtype": "float16", "out": ones(2, 512)})),
    ],
    "kv_topk_to_kvcache_indices": [
        ("ok", lambda: (kvc.topk_to_kvcache_indices, (torch.tensor([[0, 5, -1], [3, 1, 2]], dtype=i32),
                                                      torch.tensor([[1, 0], [0, 1]], dtype=i32)),
                        {"page_size": 4, "num_pages": 2})),
        ("ok-3d-slots", lambda: (kvc.topk_to_kvcache_indices, (buf(2, 2, 3, dtype=i64), buf(3, 2, dtype=i32)),
                                 {"page_size": 4, "num_pages": 2, "slots": ints(2, 0), "errors": buf(1, dtype=i32)})),
        ("block_table-int64", lambda: (kvc.topk_to_kvcache_indices, (buf(2, 3, dtype=i32), buf(2, 2, dtype=i64)),
                                       {"page_size": 4, "num_pages": 2})),
        ("topk_ids-1d", lambda: (kvc.topk_to_kvcache_indices, (buf(3, dtype=i32), buf(2, 2, dtype=i32)),
                                 {"page_size": 4, "num_pages": 2})),
        ("out-strided", lambda: (kvc.topk_to_kvcache_indices, (buf(2, 3, dtype=i32), buf(2, 2, dtype=i32)),
                                 {"page_size": 4, "num_pages": 2, "out": strided_last(2, 3, dtype=i32)})),
    ],
}
# an op's own test file may hold its cases (AGREEMENT, tests/support/library.py)
CASES.update(agreement_cases())

FAMILIES = ("rawkv.fp8", "rawkv.nvfp4", "rawkv.fused", "rawkv.gemm", "rawkv.kvcache")
KV_MODULES = (layouts, flush, gather, assign, bridge, state_ops, prefill, kv_decode, compressor)


def _as_cuda(v):
    return _each(v, fake)


def _each(v, move):
    """v with `move` applied to each tensor in it (a tuple's, a
    QuantizedActivation's, an Fp4Weight's, a kvcache pool's or decode
    state's buffers: a view over the moved ones)."""
    if isinstance(v, torch.Tensor):
        return move(v)
    if isinstance(v, kvc.PagedKVPool):
        args = V.pool_args(v)
        if args["rope"] is not None:
            args["rope"] = args["rope"].bfloat16()      # a CUDA pool's rope is bfloat16, a CPU one's float32
        return V.pool_view(**{k: _each(a, move) for k, a in args.items()})
    if isinstance(v, kvc.DecodeState):
        return V.state_view(**{k: _each(a, move) for k, a in V.state_args(v).items()})
    if isinstance(v, rawkv.gemm.Fp4Weight):
        return rawkv.gemm.Fp4Weight(v.fmt, v.n, v.k, move(v.codes), move(v.scales), move(v.gs),
                                    exp_range=v.exp_range)
    if isinstance(v, tuple) and any(isinstance(t, torch.Tensor) for t in v):
        moved = (_each(t, move) for t in v)
        return type(v)(*moved) if hasattr(v, "_fields") else tuple(moved)
    return v


def _outcome(call):
    try:
        call()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "accepted"


def _on_gpu(v):
    """A CPU tensor's whole storage copied to the GPU, seen with the same
    shape, strides and offset (a CUDA allocation's alignment keeps the
    offsets' alignment)."""
    return _each(v, _tensor_on_gpu)


def _tensor_on_gpu(v):
    whole = torch.as_strided(v, (v.untyped_storage().nbytes() // v.element_size(),), (1,), 0)
    return whole.cuda().as_strided(v.shape, v.stride(), v.storage_offset())


def _no_address(outcome):
    return outcome if outcome == "accepted" else (outcome[0], re.sub(r"0x[0-9a-f]+", "ADDR", outcome[1]))


@pytest.mark.parametrize("name,case,build", [(n, c, b) for n, cases in CASES.items() for c, b in cases],
                         ids=[f"{n}-{c}" for n, cases in CASES.items() for c, _ in cases])
def test_cpu_and_cuda_accept_and_refuse_alike(monkeypatch, name, case, build):
    fn, args, kw = build()
    cpu = _outcome(lambda: fn(*args, **kw))
    install(monkeypatch, (fp8, encode, activation, decode, scales, rms, swiglu, moe, linear, *KV_MODULES))
    monkeypatch.setattr(fp8, "_ENCODE_FAST", {})         # a combination the real runtime has seen
    cuda = _outcome(lambda: fn(*map(_as_cuda, args), **{k: _as_cuda(v) for k, v in kw.items()}))
    assert cpu == cuda
    assert (cpu == "accepted") == case.startswith("ok"), cpu


@pytest.mark.parametrize("name,case,build", [(n, c, b) for n, cases in CASES.items() for c, b in cases],
                         ids=[f"{n}-{c}" for n, cases in CASES.items() for c, _ in cases])
def test_gpu_accepts_and_refuses_as_the_cpu(cuda, name, case, build):
    """The same cases on real CUDA tensors (addresses aside in the messages)."""
    fn, args, kw = build()
    cpu = _outcome(lambda: fn(*args, **kw))
    gpu = _outcome(lambda: fn(*map(_on_gpu, args), **{k: _on_gpu(v) for k, v in kw.items()}))
    torch.cuda.synchronize()
    assert _no_address(cpu) == _no_address(gpu)


def test_every_operator_of_the_families_has_cases():
    """A new fp8 / nvfp4 / fused / gemm / kvcache operator needs its cases, accepted and refused:
    here, or in its own test file (AGREEMENT)."""
    ops = {n for n, d in _opdecl.declared().items() if d.impl.__module__.startswith(FAMILIES)}
    assert ops == set(CASES)
    for name, cases in CASES.items():
        kinds = {c.startswith("ok") for c, _ in cases}
        assert kinds == {True, False}, name
