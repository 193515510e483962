"""W4A8 (issue 23; docs/gemm.md, "W4A8"): MXFP4 weights on Hopper's FP8
tensor cores with FP8 block activations.

    w8 = rawkv.gemm.w4a8_weight(w)                  # w: an MXFP4 Fp4Weight, at load
    xa = rawkv.fp8.quantize_blocks(x)               # (codes, scales): E4M3, FP32 per 128
    y = rawkv.gemm.grouped_linear(xa, w8)           # (T, G, K) -> (T, G, N) BF16
    y = rawkv.gemm.moe_linear(xa, w8, offsets)      # (R, K) -> (R, N)

The weight's form is rawkv.reference.gemm_w4a8's rule (a power of two per
row, the rest folded into E4M3 values exactly; a weight the rule cannot
hold is refused at load, naming its blocks), packed for the kernel
(pack_codes8 / pack_shifts8). On CUDA tensors one launch of
rawkv/cu/gemm_w4a8_sm90.cu, or for few tokens of gemm_w4a8_mma.cu
(rawkv.gemm.plans.w4a8_mma_config; sm_90 only); on CPU tensors the reference's
exact product rounded once to BF16 (gemm_w4a8.form_grouped / form_ragged).

A shift byte past the table (only in a form not built by w4a8_weight:
written by hand, or corrupted memory) is device-side data out of range:
its block reads as zeros and is counted, on CPU and CUDA alike (checking
the bytes on the host before a launch would be a host sync), once per call
in errors[0], an int32 counter both ops take (errors=None: the device's,
or the host's, GEMM_OFFSETS slot of rawkv.nvfp4.error_counts()).
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np

from .. import _args as A
from .. import fp8 as FP8
from .._op import empty, op
from ..reference import gemm_w4a8 as ref8
from ..runtime import get_runtime
from . import _rules as R
from ._body import count_cpu, run_counted, write_bf16
from . import fast
from . import plans as P
from .weights import Fp4Weight


class W4a8Weight(NamedTuple):
    """An MXFP4 weight in its W4A8 form, on the weight's device: n, k the
    sizes; codes uint8 (G, NP/16, C, 2, 32, 16) and shifts uint8
    (G, NP/16, C, 8, 8) (C = ceil(K/128); rawkv.reference.gemm_w4a8's
    pack_codes8 / pack_shifts8: the E2M1 codes and each 32-column block's
    biased shift, the row of SHIFT_TABLE that turns its codes into E4M3;
    a byte past the table, which w4a8_weight never writes, makes its block
    zeros and is counted by the ops);
    row_scale float32 (G, NP), 2^r of each row (padding rows 1); gs a copy
    of the Fp4Weight's float32 (G,) global scales (ones for MXFP4)."""
    n: int
    k: int
    codes: object
    shifts: object
    row_scale: object
    gs: object

    @property
    def groups(self) -> int:
        return self.codes.shape[0]

    @property
    def device(self):
        return self.codes.device


def w4a8_weight(weight) -> W4a8Weight:
    """The W4A8 form of an MXFP4 `weight`, or a ValueError naming the MXFP4
    blocks no per-row power of two holds exactly in E4M3 (the reference's
    rule). NVFP4 weights are refused: e2m1 times an E4M3 scale needs up to 5
    significant bits, E4M3 has 4. Load time: runs the rule on the host (a
    host sync for a CUDA weight, as Fp4Weight.dequantize does)."""
    if not isinstance(weight, Fp4Weight):
        raise TypeError(f"weight: expected a rawkv.gemm.Fp4Weight, got {type(weight).__name__}")
    if weight.fmt != "mxfp4":
        raise ValueError(f"weight: W4A8 takes MXFP4 weights only, got {weight.fmt}: an NVFP4 element "
                         "(e2m1 x E4M3 scale, up to 5 significant bits) is not an E4M3 value; "
                         "use the W4A16 path")
    import torch
    codes, scales, _ = (t.cpu().numpy() for t in weight.unpack())
    shifts, rebase = ref8.w4a8_form(codes, scales, name="weight")
    dev = weight.device
    npad, _ = ref8.padded8(weight.n, weight.k)
    row = np.ones((weight.groups, npad), np.float32)
    row[:, :weight.n] = np.ldexp(np.float32(1.0), rebase)     # 2^r >= 2^-136: an FP32 value exactly
    return W4a8Weight(weight.n, weight.k, torch.from_numpy(ref8.pack_codes8(codes)).to(dev),
                      torch.from_numpy(ref8.pack_shifts8(shifts)).to(dev), torch.from_numpy(row).to(dev),
                      weight.gs.clone())   # (a copy: it was the Fp4Weight's own tensor, as unpack()'s was)


# ---- the public ops (rawkv.gemm.grouped_linear / moe_linear with a W4a8Weight) --------------
def split8(x) -> tuple:
    """(codes, scales) of FP8 block activations: a rawkv.fp8.Fp8Activation,
    a (codes, scales) pair as rawkv.fp8.quantize_blocks returns it; E8M0
    scales as their uint8 bytes (what the operators take: FP8.e8m0_bytes)."""
    if hasattr(x, "codes") and hasattr(x, "scales"):
        return x.codes, FP8.e8m0_bytes(x.scales)
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return x[0], FP8.e8m0_bytes(x[1])
    raise TypeError("x: a W4A8 weight takes FP8 block activations: (codes, scales) from "
                    "rawkv.fp8.quantize_blocks or an Fp8Activation, got "
                    f"{'a tensor' if A.is_torch(x) else type(x).__name__}")


def _new_out(codes, weight: W4a8Weight, ndim: int, stream):
    """A call's out when it gives none (R.out_shape: sized only where the
    rules will take the call)."""
    ws, s = A.dims(weight.codes), A.dims(A.as_read(codes, "x.codes"))
    return empty(codes, R.out_shape(s, ndim, ws[0] if ws else None, weight.n), "bfloat16", stream)


def grouped_linear8(x, weight: W4a8Weight, out=None, errors=None, stream=None):
    """grouped_linear for a W4A8 weight (rawkv.gemm.grouped_linear calls it);
    errors as moe_linear8's (shift bytes past the table)."""
    codes, scales = split8(x)
    if out is None:
        out = _new_out(codes, weight, 3, stream)
    _grouped8(codes, scales, weight.codes, weight.shifts, weight.row_scale, weight.gs, weight.n, weight.k, out,
              errors, stream)
    return out


def moe_linear8(x, weight: W4a8Weight, offsets, out=None, errors=None, stream=None):
    """moe_linear for a W4A8 weight (rawkv.gemm.moe_linear calls it)."""
    codes, scales = split8(x)
    if out is None:
        out = _new_out(codes, weight, 2, stream)
    _moe8(codes, scales, weight.codes, weight.shifts, weight.row_scale, weight.gs, weight.n, weight.k, offsets,
          out, errors, stream)
    return out


def operator_args8(x, weight: W4a8Weight) -> dict:
    """The keyword arguments of torch.ops.rawkv.gemm_grouped_linear_w4a8 /
    gemm_moe_linear_w4a8 (add out= and errors=, and offsets= for MoE).
    A weight other than a W4a8Weight is a TypeError naming weight (an
    Fp4Weight's operators take rawkv.gemm.operator_args's arguments)."""
    if isinstance(weight, Fp4Weight):       # (an AttributeError on shifts before)
        raise TypeError("weight: an Fp4Weight's operators take other arguments: rawkv.gemm.operator_args(x, "
                        "weight); rawkv.gemm.w4a8_weight(weight) gives an MXFP4 weight's W4A8 form")
    if not isinstance(weight, W4a8Weight):
        raise TypeError(f"weight: expected a rawkv.gemm.W4a8Weight, got {type(weight).__name__}")
    codes, scales = split8(x)
    return dict(x=codes, x_sf=scales, codes=weight.codes, shifts=weight.shifts, row_scale=weight.row_scale,
                gs=weight.gs, n=weight.n, k=weight.k)


# ---- the operators -------------------------------------------------------------------------
_SCHEMA = "Tensor x, Tensor x_sf, Tensor codes, Tensor shifts, Tensor row_scale, Tensor gs, Scalar n, Scalar k"
# The kernels' arguments of the weight's tensors and of the call's others,
# outputs first (rawkv.gemm.fast).
_WEIGHT_ARGS = ("wq", "wsh", "wrow", "wgs")
_GROUPED_ARGS = ("out", "errors", "x", "xsf")
_MOE_ARGS = ("out", "errors", "x", "xsf", "offsets")


@op("gemm_grouped_linear_w4a8", f"{_SCHEMA}, Tensor(a!) out, Tensor(b!)? errors")
def _grouped8(x, x_sf, codes, shifts, row_scale, gs, n, k, out, errors, stream=None):
    """rawkv::gemm_grouped_linear_w4a8: FP8 x (T, G, K) with its block
    scales times each group's W4A8 weight into out (T, G, N); the weight's
    blocks whose shift byte is past the table read as zeros and are counted
    in errors[0] (None: the device's GEMM_OFFSETS counter), as
    rawkv::gemm_moe_linear_w4a8 counts them."""
    weight, call = (codes, shifts, row_scale, gs), (out, errors, x, x_sf)
    if stream is None and fast.launched("grouped8", call, 2, weight, (n, k), _GROUPED_ARGS, _WEIGHT_ARGS):
        return                                  # the fast path (rawkv.gemm.fast), as W4A16's
    given = (x, x_sf, errors)
    where, act, w, out, errors = R.w4a8_grouped(x, x_sf, codes, shifts, row_scale, gs, n, k, out, errors)
    if where == "cpu":
        y, bad = ref8.form_grouped(*_activation(act), *_form(w))
        count_cpu(errors, bad)
        write_bf16(y, out)
        return
    rt = get_runtime(act.device)
    act = P.w4a8_scales_read(rt, act, w, None, _tuning())
    plan = run_counted(rt, act, w, errors, stream, lambda rt, e: P.w4a8_grouped(rt, act, w, out, e, _tuning()))
    if stream is None and fast.as_given(given, (act.x, act.sf, errors), out, weight):
        fast.keep("grouped8", call, weight, (n, k), plan, _GROUPED_ARGS, _WEIGHT_ARGS)


@op("gemm_moe_linear_w4a8", f"{_SCHEMA}, Tensor offsets, Tensor(a!) out, Tensor(b!)? errors")
def _moe8(x, x_sf, codes, shifts, row_scale, gs, n, k, offsets, out, errors, stream=None):
    """rawkv::gemm_moe_linear_w4a8: the rows of FP8 x (R, K) of expert e
    (offsets as rawkv::gemm_moe_linear takes them) times its W4A8 weight
    into out (R, N); the clamps and the blocks past the table of the experts
    that own a row counted in errors[0] (None: the device's GEMM_OFFSETS
    counter)."""
    weight, call = (codes, shifts, row_scale, gs), (out, errors, x, x_sf, offsets)
    if stream is None and fast.launched("moe8", call, 2, weight, (n, k), _MOE_ARGS, _WEIGHT_ARGS):
        return                                  # the fast path, as the batched op's
    given = (x, x_sf, errors, offsets)
    where, act, w, offsets, out, errors = R.w4a8_moe(x, x_sf, codes, shifts, row_scale, gs, n, k, offsets, out,
                                                     errors)
    if where == "cpu":
        offs = A.to_numpy(offsets, "offsets").astype(np.int64)
        y, bad = ref8.form_ragged(*_activation(act), *_form(w), offs)
        count_cpu(errors, bad)
        write_bf16(y, out)
        return
    rt = get_runtime(act.device)
    act = P.w4a8_scales_read(rt, act, w, offsets, _tuning())
    plan = run_counted(rt, act, w, errors, stream, lambda rt, e: P.w4a8_moe(rt, act, w, offsets, out, e, _tuning()))
    if stream is None and fast.as_given(given, (act.x, act.sf, errors, offsets), out, weight):
        fast.keep("moe8", call, weight, (n, k), plan, _MOE_ARGS, _WEIGHT_ARGS)


def _tuning():
    """The dispatch tunables: rawkv.gemm.linear's module attributes (plans.Tuning
    says what each does; linear imports this module, so it is read here)."""
    return sys.modules[__package__ + ".linear"]


# ---- CPU ---------------------------------------------------------------------------------------
def _activation(act) -> tuple:
    """(codes uint8, scales float32 or E8M0 bytes uint8: what the reference
    takes) of the FP8 activation as numpy arrays."""
    sf = A.to_numpy(act.sf, "x.scales")
    return A.to_numpy(act.x, "x.codes").view(np.uint8), sf if sf.dtype == np.float32 else sf.view(np.uint8)


def _form(w) -> tuple:
    """(codes, shifts, row_scale, gs) of the W4A8 weight unpacked, the
    arguments of the reference's form_grouped / form_ragged (padding
    dropped: its bytes are not the weight's, and are never counted)."""
    codes = ref8.unpack_codes8(A.to_numpy(w.codes, "weight.codes"), w.n, w.k)
    shifts = ref8.unpack_shifts8(A.to_numpy(w.shifts, "weight.shifts"), w.n, w.k)
    rows = A.to_numpy(w.row_scale, "weight.row_scale")[:, :w.n]
    return codes, shifts, rows, A.to_numpy(w.gs, "weight.gs")
