"""The grouped FP4-weight GEMM (docs/gemm.md): rawkv.gemm.grouped_linear
(every token to every group: DeepSeek-V4 wo_a) and rawkv.gemm.moe_linear
(rows sorted by expert). On CUDA tensors one launch of rawkv/cu/gemm_fp4.cu
(mma.sync), or on Hopper of rawkv/cu/gemm_fp4_sm90.cu (wgmma) as the plan
chooses (rawkv.gemm.plans); on CPU tensors the numpy reference (exact
dequantization, float64 product, one rounding to BF16).

Each op is written once, as the mutating operator torch.ops.rawkv.<name>
(rawkv._op), the weight passed as its tensors and sizes and an NVFP4
activation as its codes (x), scales (x_sf) and global scale (x_gs); its
arguments are checked by rawkv.gemm._rules. The public function allocates
out and calls it."""
from __future__ import annotations

import sys
import types

import numpy as np

from .. import _args as A
from .._op import empty, op
from ..reference import formats as F
from ..reference import gemm as ref
from ..runtime import get_runtime
from . import _rules as R
from ._body import ragged_bf16, run_counted, write_bf16
from . import fast
from . import pack
from . import plans as P
from .w4a8 import W4a8Weight, grouped_linear8, moe_linear8
from .weights import Fp4Weight

# ---- the dispatch tunables (rawkv.gemm.plans.Tuning says what each does) ----------------
# Module attributes, read by the plans at each call (this module is the
# plans' `tuning`): tests and tools/probe_gemm_paths.py set them.
# One module attribute per field of P.Tuning (KERNEL_PATH, SM90_MIN_TOKENS, ...),
# at its tuned value: the field list is written once, in P.Tuning.
globals().update(P.TUNED._asdict())
_TUNING = sys.modules[__name__]
_TUNABLES = frozenset(P.Tuning._fields)


class _TunableModule(types.ModuleType):
    """This module's class: setting one of the dispatch tunables (a test's
    monkeypatch, tools/probe_gemm_paths.py) drops the fast path's launches,
    planned with the values before (rawkv.gemm.fast)."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in _TUNABLES:
            fast.forget()


_TUNING.__class__ = _TunableModule


# ---- the public ops ------------------------------------------------------------------------
def grouped_linear(x, weight, *, out=None, errors=None, stream=None):
    """out (T, G, N) BF16 = x[t, g, :] . weight[g, n, :] for every token t
    and group g, accumulated in FP32.

    x: (T, G, K) bfloat16 / float16, or a rawkv.nvfp4.QuantizedActivation of
    such an x (q (T, G, K/2), sf (T, G, K/16), gs a float32 tensor of shape
    () / (1,) or (T, G)); numpy arrays too (docs/gemm.md, "Arguments").
    weight: a rawkv.gemm.Fp4Weight of G groups; or a rawkv.gemm.W4a8Weight
    with x FP8 block activations (codes, scales) (rawkv.gemm.w4a8), whose
    blocks with a shift byte past the table read as zeros and are counted
    in errors[0] (an int32 tensor) or, with errors=None, in
    rawkv.nvfp4.error_counts()[GEMM_OFFSETS], as moe_linear counts. An
    Fp4Weight's batched product reads no device data that can be out of
    range: errors is taken with a W4a8Weight only."""
    if weight.__class__ is W4a8Weight:
        return grouped_linear8(x, weight, out, errors, stream)
    _check_weight(weight)
    if errors is not None:
        raise TypeError("errors: the batched product counts bad inputs of a rawkv.gemm.W4a8Weight only "
                        "(an Fp4Weight has none to count); pass errors=None")
    x, x_sf, x_gs = _split(x)
    if out is None:
        out = empty(x, R.out_shape(A.dims(A.as_read(x, "x")), 3, weight.groups, weight.n), "bfloat16", stream)
    lo, hi = weight.exp_range or (0, 0)
    _grouped(x, x_sf, x_gs, weight.codes, weight.scales, weight.gs, weight.fmt, weight.n, weight.k, lo, hi,
             out, stream)
    return out


def moe_linear(x, weight, offsets, *, out=None, errors=None, stream=None):
    """out (R, N) BF16: row r of x times expert e's weight, for the rows
    offsets[e] <= r < offsets[e+1] (rows sorted by expert).

    x: (R, K) bfloat16 / float16, or a QuantizedActivation (q (R, K/2),
    sf (R, K/16), gs () / (1,) / (R,)). offsets: int32 (E+1,) on the
    device, E = weight.groups, read only by the kernel: out-of-order or
    out-of-range offsets are clamped (docs/gemm.md), rows no expert owns are
    written as zeros, and each clamp is counted in errors[0] (an int32
    tensor) or, with errors=None, in rawkv.nvfp4.error_counts()[GEMM_OFFSETS].
    A rawkv.gemm.W4a8Weight takes FP8 block activations (rawkv.gemm.w4a8)."""
    if weight.__class__ is W4a8Weight:
        return moe_linear8(x, weight, offsets, out, errors, stream)
    _check_weight(weight)
    x, x_sf, x_gs = _split(x)
    if out is None:
        out = empty(x, R.out_shape(A.dims(A.as_read(x, "x")), 2, weight.groups, weight.n), "bfloat16", stream)
    lo, hi = weight.exp_range or (0, 0)
    _moe(x, x_sf, x_gs, weight.codes, weight.scales, weight.gs, weight.fmt, weight.n, weight.k, lo, hi,
         offsets, out, errors, stream)
    return out


def _check_weight(weight) -> None:
    if not isinstance(weight, Fp4Weight):
        raise TypeError(f"weight: expected a rawkv.gemm.Fp4Weight or W4a8Weight, got {type(weight).__name__}")


def _split(x) -> tuple:
    """(x, x_sf, x_gs): an NVFP4 activation (a QuantizedActivation, or
    anything with q, sf and gs) as its parts, any other x as it is."""
    if A.is_torch(x) or isinstance(x, np.ndarray) or not (
            hasattr(x, "q") and hasattr(x, "sf") and hasattr(x, "gs")):
        return x, None, None
    return x.q, x.sf, x.gs


def operator_args(x, weight) -> dict:
    """The keyword arguments of torch.ops.rawkv.gemm_grouped_linear /
    gemm_moe_linear for activation x and weight (add out=, and offsets= /
    errors= for the MoE operator)."""
    if weight.__class__ is W4a8Weight:       # (an AttributeError on exp_range before)
        raise TypeError("weight: a W4a8Weight's operators take other arguments: "
                        "rawkv.gemm.w4a8.operator_args8(x, weight)")
    _check_weight(weight)
    x, x_sf, x_gs = _split(x)
    lo, hi = weight.exp_range or (0, 0)
    return dict(x=x, x_sf=x_sf, x_gs=x_gs, codes=weight.codes, scales=weight.scales, gs=weight.gs,
                fmt=weight.fmt, n=weight.n, k=weight.k, exp_lo=lo, exp_hi=hi)


# ---- the operators -------------------------------------------------------------------------
# The weight travels as its tensors and sizes (exp_lo / exp_hi: an MXFP4
# weight's scale-byte range, which must lie in MX_WINDOW (0, 0: unknown,
# refused); 0 for NVFP4); an NVFP4 activation as q (in x), sf and gs.
_WEIGHT_SCHEMA = "Tensor codes, Tensor scales, Tensor gs, str fmt, Scalar n, Scalar k, Scalar exp_lo, Scalar exp_hi"
# The kernels' arguments of the weight's tensors and of the call's others,
# outputs first, in the order the fast path (rawkv.gemm.fast) takes them.
_WEIGHT_ARGS = ("wq", "wsf", "wgs")
_GROUPED_ARGS = ("out", "x")
_MOE_ARGS = ("out", "errors", "x", "offsets")
_X_SCHEMA = "Tensor x, Tensor? x_sf, Tensor? x_gs"


@op("gemm_grouped_linear", f"{_X_SCHEMA}, {_WEIGHT_SCHEMA}, Tensor(a!) out")
def _grouped(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out, stream=None):
    """rawkv::gemm_grouped_linear: x (T, G, K) times each group's weight
    into out (T, G, N)."""
    # Fast path (rawkv.gemm.fast): 16-bit CUDA activations on torch's
    # stream, arguments like a call the checked path launched; anything it
    # does not take comes through the checked path, which names the argument.
    weight, call, sizes = (codes, scales, gs), (out, x), (fmt, n, k, exp_lo, exp_hi)
    fastable = stream is None and x_sf is None and x_gs is None
    if fastable and fast.launched("grouped", call, 1, weight, sizes, _GROUPED_ARGS, _WEIGHT_ARGS):
        return
    where, act, w, out = R.grouped(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out)
    if where == "cpu":
        write_bf16(ref.grouped(_values(act), _weight_values(w)), out)
        return
    rt = get_runtime(act.device)
    plan = P.grouped(rt, act, w, out, _TUNING)
    rt.run(plan, stream)
    if fastable and fast.as_given((x,), (act.x,), out, weight):
        fast.keep("grouped", call, weight, sizes, plan, _GROUPED_ARGS, _WEIGHT_ARGS)


@op("gemm_moe_linear", f"{_X_SCHEMA}, {_WEIGHT_SCHEMA}, Tensor offsets, Tensor(a!) out, Tensor(b!)? errors")
def _moe(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, offsets, out, errors, stream=None):
    """rawkv::gemm_moe_linear: the rows of x (R, K) of expert e (offsets[e]
    <= r < offsets[e+1], clamped and counted in errors[0], or with errors
    None in the device's GEMM_OFFSETS counter) times its weight into out
    (R, N)."""
    weight, call, sizes = (codes, scales, gs), (out, errors, x, offsets), (fmt, n, k, exp_lo, exp_hi)
    fastable = stream is None and x_sf is None and x_gs is None      # the fast path: as _grouped's
    if fastable and fast.launched("moe", call, 2, weight, sizes, _MOE_ARGS, _WEIGHT_ARGS):
        return
    given = (offsets, errors)
    where, act, w, offsets, out, errors = R.moe(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi,
                                                offsets, out, errors)
    if where == "cpu":
        ragged_bf16(_values(act), _weight_values(w), offsets, errors, out)
        return
    plan = run_counted(get_runtime(act.device), act, w, errors, stream,
                       lambda rt, e: P.moe(rt, act, w, offsets, out, e, _TUNING))
    if fastable and fast.as_given((x, *given), (act.x, offsets, errors), out, weight):
        fast.keep("moe", call, weight, sizes, plan, _MOE_ARGS, _WEIGHT_ARGS)


# ---- CPU ---------------------------------------------------------------------------------------
def _values(act) -> np.ndarray:
    """The activation as float64, exactly."""
    if act.kind != R.NVFP4:
        return A.to_numpy(act.x, "x").astype(np.float64)
    codes = ref.unpack_nibbles(A.to_numpy(act.x, "x.q"))
    sf = F.e4m3_decode(A.to_numpy(act.sf, "x.sf")).astype(np.float64)
    gs = A.to_numpy(act.gs, "x.gs").astype(np.float64)
    gs = gs.reshape(()) if gs.size == 1 else gs[..., None]
    return F.e2m1_decode(codes).astype(np.float64) * np.repeat(sf, 16, axis=-1) * gs


def _weight_values(w) -> np.ndarray:
    """The weight as float64, exactly (from its packed tensors)."""
    codes = pack.unpack_codes(w.codes, w.n, w.k)
    scales = pack.unpack_scales(w.scales, w.n, w.k, ref.BLOCKS[w.fmt])
    return ref.dequantize_weight(A.to_numpy(codes, "weight"), A.to_numpy(scales, "weight"),
                                 A.to_numpy(w.gs, "weight"), w.fmt)
