"""RMSNorm + NVFP4 and the mHC pre-block + RMSNorm + NVFP4 (docs/fused.md):
one launch of rkv_fused_rms per call (memset + two for scope 'tensor')."""
from __future__ import annotations

import numpy as np

from . import _rules as R
from . import plans
from .. import fp8 as FP8
from .._op import empties, op
from ..nvfp4 import counters
from ..nvfp4.activation import QuantizedActivation
from ..reference import fused as ref
from ..reference import nvfp4 as ref_nvfp4
from ..runtime import get_runtime
from .. import _args as A


def rmsnorm_quantize(x, weight, eps=1e-6, *, scope=None, gs=None, out=None, stream=None):
    """NVFP4 of y = round_x.dtype((x * inv_rms) * weight), inv_rms = 1/sqrt(mean(x^2) + eps).

    x (..., N) bfloat16/float16, N % 16 == 0; weight (N,) float32/bfloat16/float16;
    eps a finite number > 0. Returns QuantizedActivation(q, sf, gs, inv_rms);
    gs per row by default."""
    s = A.out_lead(x, "x")        # (a layout the op refuses: it names x before the outputs are sized)
    return activation(_rmsnorm_quantize, x, tuple(s[:-1]), s[-1] if s else 0, scope, gs, out, stream,
                      x, weight, number(eps))


def mhc_rmsnorm_quantize(x, mix, weight, eps=1e-6, *, scope=None, gs=None, out=None, stream=None):
    """mHC pre-block + RMSNorm + NVFP4: m = round(sum_h mix[..., h] * x[..., h, :])
    (h order, float32), then rmsnorm_quantize(m, weight, eps).

    x (..., n_hc, N) bfloat16/float16 with n_hc <= 4; mix (..., n_hc)
    float32/bfloat16/float16; weight (N,). Returns QuantizedActivation."""
    s = A.out_lead(x, "x")
    return activation(_mhc_rmsnorm_quantize, x, tuple(s[:-2]), s[-1] if s else 0, scope, gs, out, stream,
                      x, mix, weight, number(eps))


def number(v):
    """A number argument as the operator's float (a numpy scalar is not
    one); anything else, or a number no float holds (2**2000), as it is,
    for the op to refuse by name."""
    if v.__class__ is not float and A.is_number(v):
        try:
            return float(v)
        except OverflowError:
            return v
    return v


def activation(call, like, lead, n, scope, gs, out, stream, *inputs, inv=True):
    """A row producer's public function: `call` (the op) on `inputs` with
    the outputs of rows `lead` of width n, out= entries kept and the others
    allocated where `like` lives; q and sf are returned as
    float4_e2m1fn_x2 / float8_e4m3fn where torch has them, as
    rawkv.nvfp4.quantize returns them."""
    q, sf, g, i = R.split_out(out)
    fresh = out is None             # every output allocated here: nothing to check for overlaps
    if i is not None and not inv:
        raise ValueError(f"out.inv_rms: {call.__name__.lstrip('_')} has no inv_rms output")
    scope = A.default_scope(scope, gs, "row")
    new_q, new_sf = q is None, sf is None
    q, sf, g, i = (o if o is not None else s_ for o, s_ in zip((q, sf, g, i), empties(
        like, stream, ((*lead, n // 2), "uint8") if new_q else None, ((*lead, n // 16), "uint8") if new_sf else None,
        (lead if scope == "row" else (), "float32") if g is None else None,
        (lead, "float32") if inv and i is None else None)))
    gs_t, gs_v = A.split_number(gs)
    if inv:
        call(*inputs, scope, gs_t, gs_v, q, sf, g, i, stream, fresh)
    else:
        call(*inputs, scope, gs_t, gs_v, q, sf, g, stream, fresh)
    return QuantizedActivation(A.as_q(q) if new_q else q, A.as_sf(sf) if new_sf else sf, g, i if inv else None)


def rmsnorm_quantize_fp8(x, weight, eps=1e-6, *, block=128, scale_format="fp32", out=None, stream=None):
    """FP8 block activations of y = round_x.dtype((x * inv_rms) * weight):
    bit for bit rawkv.fp8.quantize_blocks(y, block=, scale_format=) of the
    BF16 (FP16) y the unfused RMSNorm stores, DeepSeek's act_quant of it.

    x, weight, eps as rmsnorm_quantize's; block 32, 64 or 128; scale_format
    'fp32' or 'ue8m0'. Returns rawkv.fp8.Fp8Activation(codes, scales,
    inv_rms); out= takes (codes, scales[, inv_rms])."""
    s = A.out_lead(x, "x")
    return fp8_activation(_rmsnorm_quantize_fp8, x, s[:-1], s[-1] if s else 0, block, scale_format, out, stream,
                          x, weight, number(eps))


def mhc_rmsnorm_quantize_fp8(x, mix, weight, eps=1e-6, *, block=128, scale_format="fp32", out=None, stream=None):
    """mHC pre-block + RMSNorm with an FP8 block output: quantize_blocks of
    the y mhc_rmsnorm_quantize quantizes. Returns Fp8Activation."""
    s = A.out_lead(x, "x")
    return fp8_activation(_mhc_rmsnorm_quantize_fp8, x, s[:-2], s[-1] if s else 0, block, scale_format, out,
                          stream, x, mix, weight, number(eps))


def fp8_activation(call, like, lead, n, block, scale_format, out, stream, *inputs, inv=True):
    """A row producer's public function with an FP8 block output: `call`
    (the op) on `inputs` with the outputs of rows `lead` of width n, out=
    entries (codes, scales[, inv_rms]) kept and the others allocated where
    `like` lives. New codes are float8_e4m3fn; new 'ue8m0' scales are
    written as uint8 and returned as float8_e8m0fnu (rawkv.fp8.new_scales),
    and a float8_e8m0fnu out.scales reaches the op as its bytes (for
    scale_format 'fp32' refused by its own dtype: rawkv.fp8.scales_bytes)."""
    codes, scales, i = R.split_out(out, ("codes", "scales", "inv_rms"), least=2)
    if i is not None and not inv:
        raise ValueError(f"out.inv_rms: {call.__name__.lstrip('_')} has no inv_rms output")
    fresh = out is None
    new_bytes = scales is None and scale_format != "fp32"
    codes, i = (o if o is not None else s_ for o, s_ in zip((codes, i), empties(
        like, stream, ((*lead, n), "float8_e4m3fn") if codes is None else None,
        (lead, "float32") if inv and i is None else None)))
    if scales is None:
        scales = FP8.new_scales(like, (*lead, n), block, scale_format, stream)
    byte_scales = FP8.scales_bytes(scales, scale_format, "out.scales")
    if inv:
        call(*inputs, block, scale_format, codes, byte_scales, i, stream, fresh)
    else:
        call(*inputs, block, scale_format, codes, byte_scales, stream, fresh)
    return FP8.Fp8Activation(codes, FP8.as_e8m0(scales) if new_bytes else scales, i if inv else None)


_OUTS = "Tensor(a!) q, Tensor(b!) sf, Tensor(c!) gs_out, Tensor(d!) inv_rms"


@op("rmsnorm_quantize", f"Tensor x, Tensor weight, Scalar eps, str scope, Tensor? gs, Scalar? gs_value, {_OUTS}",
    host=R.rms_scalars)
def _rmsnorm_quantize(x, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms, stream=None, fresh=False):
    """rawkv::rmsnorm_quantize: writes q, sf, gs_out and inv_rms; a gs is a
    tensor `gs` or a number `gs_value`. fresh: the public function
    allocated every output (R.rms)."""
    _run(R.rms(x, None, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms, fresh), stream)


@op("mhc_rmsnorm_quantize",
    f"Tensor x, Tensor mix, Tensor weight, Scalar eps, str scope, Tensor? gs, Scalar? gs_value, {_OUTS}",
    host=R.rms_scalars)
def _mhc_rmsnorm_quantize(x, mix, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms, stream=None,
                          fresh=False):
    """rawkv::mhc_rmsnorm_quantize: as rmsnorm_quantize, of the mix of x's
    n_hc streams; mix is required (R.rms reads None as the plain form)."""
    if mix is None:
        A.require_array(mix, "mix")
    _run(R.rms(x, mix, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms, fresh), stream)


_FP8_OUTS = "Scalar block, str scale_format, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!) inv_rms"


@op("rmsnorm_quantize_fp8", f"Tensor x, Tensor weight, Scalar eps, {_FP8_OUTS}")
def _rmsnorm_quantize_fp8(x, weight, eps, block, scale_format, codes, scales, inv_rms, stream=None, fresh=False):
    """rawkv::rmsnorm_quantize_fp8: writes codes, scales and inv_rms; fresh
    as for rmsnorm_quantize."""
    _run_fp8(R.rms_fp8(x, None, weight, eps, block, scale_format, codes, scales, inv_rms, fresh), stream)


@op("mhc_rmsnorm_quantize_fp8", f"Tensor x, Tensor mix, Tensor weight, Scalar eps, {_FP8_OUTS}")
def _mhc_rmsnorm_quantize_fp8(x, mix, weight, eps, block, scale_format, codes, scales, inv_rms, stream=None,
                              fresh=False):
    """rawkv::mhc_rmsnorm_quantize_fp8: as rmsnorm_quantize_fp8, of the mix
    of x's n_hc streams; mix is required."""
    if mix is None:
        A.require_array(mix, "mix")
    _run_fp8(R.rms_fp8(x, mix, weight, eps, block, scale_format, codes, scales, inv_rms, fresh), stream)


def _run_fp8(checked, stream):
    a, mix, weight, eps, n_hc = checked
    if a.where == "cpu":
        x, w = A.to_numpy(a.x, "x"), A.to_numpy(weight, "weight")
        if mix is not None:
            m = A.to_numpy(mix, "mix").reshape(a.rows, n_hc)
            res = ref.mhc_rmsnorm_quantize_fp8(x.reshape(a.rows, n_hc, a.n), m, w, eps, a.block,
                                               a.scale_format, a.xdt)
        else:
            res = ref.rmsnorm_quantize_fp8(x.reshape(a.rows, a.n), w, eps, a.block, a.scale_format, a.xdt)
        put_fp8(a, *res)
        return
    rt = get_runtime(a.x.get_device())
    rt.run(plans.rms_fp8(rt, a, mix, weight, eps, n_hc), stream)


def put_fp8(a, codes, scales, inv=None) -> None:
    """The reference's FP8 results into a row producer's outputs (E8M0
    bytes as float32 powers of two where out.scales is float32)."""
    A.from_numpy(codes.reshape(a.codes.shape), a.x, out=a.codes)
    A.from_numpy(FP8.host_scales(scales, a.fmt).reshape(a.scales.shape), a.x, out=a.scales)
    if inv is not None:
        A.from_numpy(inv.reshape(a.inv.shape), a.x, out=a.inv)


def _run(checked, stream):
    a, mix, weight, eps, n_hc = checked
    if a.where == "cpu":
        _reference(a, mix, weight, eps, n_hc)
        return
    rt = get_runtime(a.x.get_device())
    rt.run(plans.rms(rt, a, mix, weight, eps, n_hc, given_counter(rt, a, stream)), stream)


def given_counter(rt, a, stream):
    """Where the kernel counts a refused device gs: rawkv.nvfp4's
    error counter, slot GIVEN_GS (a number was checked on the host)."""
    if a.gs is None or a.gs.__class__ is float:
        return None
    return rt.counter(counters.GIVEN_GS, stream)


def host_gs(a):
    """The reference's gs: None unless scope is 'given'; then the number or
    host array (numpy), refused (ValueError naming gs) where rawkv.nvfp4's
    rule would not use it, as the kernel would flag it."""
    if a.scope != "given":
        return None
    (gs,) = A.host(a.gs)
    ref_nvfp4.check_given_gs(gs, a.xdt)
    return gs


def put(a, q, sf, g, inv=None) -> None:
    """The reference's results into a row producer's outputs."""
    lead = tuple(a.q.shape[:-1])
    A.from_numpy(q.reshape(a.q.shape), a.x, out=a.q)
    A.from_numpy(sf.reshape(a.sf.shape), a.x, out=a.sf)
    A.from_numpy(np.asarray(g, np.float32).reshape(a.gs_out.shape), a.x, out=a.gs_out)
    if inv is not None:
        A.from_numpy(inv.reshape(lead), a.x, out=a.inv)


def _reference(a, mix, weight, eps, n_hc):
    x, w = A.to_numpy(a.x, "x"), A.to_numpy(weight, "weight")
    gsv = host_gs(a)
    if mix is not None:
        m = A.to_numpy(mix, "mix").reshape(a.rows, n_hc)
        res = ref.mhc_rmsnorm_quantize(x.reshape(a.rows, n_hc, a.n), m, w, eps, a.scope, gsv, a.xdt)
    else:
        res = ref.rmsnorm_quantize(x.reshape(a.rows, a.n), w, eps, a.scope, gsv, a.xdt)
    put(a, *res)
