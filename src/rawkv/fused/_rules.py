"""Argument rules of the fused producers (the generic ones, one function
per kind of argument, are rawkv._args): one function per op takes the
operator's arguments and returns the op's placement and its checked
arrays, on CPU and CUDA alike; the body then only chooses the reference or
the launches. Every rule raises before anything is launched or written,
naming the argument (out= entries as out.q, out.sf, ...)."""
from __future__ import annotations

import math
from typing import NamedTuple

from .. import _args as A
from .. import fp8 as FP8
from ..kernels import fused as K
from ..reference import fp8_blocks as ref_fp8
from ..reference import nvfp4 as ref_nvfp4

SCOPES = ("row", "tensor", "given", "none")

# dtype names, as torch spells them. x / h / hidden on CUDA are bfloat16 or
# float16; on CPU float32 too (the reference's own precision: intermediates
# are not rounded; docs/fused.md).
X = ("bfloat16", "float16")
CPU_X = ("bfloat16", "float16", "float32")
PARAM = ("float32", "bfloat16", "float16")     # weight, mix, topk_weights
IDS = ("int32", "int64")                       # topk_ids
OUT_Q = ("uint8", "float4_e2m1fn_x2")          # what out.q may be (the result: float4_e2m1fn_x2)
OUT_SF = ("uint8", "float8_e4m3fn")            # what out.sf may be (the result: float8_e4m3fn)
F32 = ("float32",)
MAX_ROWS = 2 ** 31 - 1     # a launch grid's x dimension: the row producers' rows (one CTA each)


class Rows(NamedTuple):
    """A row producer's checked arguments: `x` (the input, h for SwiGLU)
    read as `rows` rows of width `n` (the quantized width), its dtype name,
    the scope and gs (None, a checked Python float or a float32 array of
    one element), the outputs (inv None for SwiGLU)."""
    where: str
    x: object
    rows: int
    n: int
    xdt: str
    scope: str
    gs: object
    q: object
    sf: object
    gs_out: object
    inv: object


class Fp8Rows(NamedTuple):
    """A row producer's checked arguments with an FP8 block output: `x`
    (h for SwiGLU) read as `rows` rows of width `n` (the quantized width),
    its dtype name, the block, the scale format and the kernels' form of it
    (UE8M0, SBYTE: by out.scales' dtype) and the outputs (inv None for
    SwiGLU)."""
    where: str
    x: object
    rows: int
    n: int
    xdt: str
    block: int
    scale_format: str
    fmt: tuple
    codes: object
    scales: object
    inv: object


# ---- public-only arguments ---------------------------------------------------------------
def split_out(out, names=("q", "sf", "gs", "inv_rms"), least: int = 3):
    """The entries of out=: None (all None), or a tuple / list / NamedTuple
    of `least` to len(names) entries (None: allocate it; the op checks the
    others)."""
    if out is None:
        return (None,) * len(names)
    if not isinstance(out, (tuple, list)) or not least <= len(out) <= len(names):
        count = f"{least}" if least == len(names) else f"{least} or {len(names)}"
        got = f"{len(out)} entries" if isinstance(out, (tuple, list)) else type(out).__name__
        raise TypeError(f"out: expected a tuple of {count} entries ({', '.join(names)}), got {got}")
    return tuple(out) + (None,) * (len(names) - len(out))


def gs_shape(scope: str, lead: tuple, out_gs) -> tuple:
    """Shape of the gs output: `lead` for scope 'row', else () (a given
    out.gs of shape (1,) is filled as it is; its shape read as the rules
    read it, A.as_read: a DLPack array need not have .shape)."""
    if scope == "row":
        return lead
    return (1,) if out_gs is not None and A.dims(A.as_read(out_gs, "out.gs")) == (1,) else ()


# ---- shared by the row producers ---------------------------------------------------------
def _x(x, name, where, min_ndim, align):
    """The input of a row producer: bfloat16 / float16 (CPU: float32 too),
    contiguous, `align`-byte aligned."""
    return A.tensor(x, name, CPU_X if where == "cpu" else X, where, min_ndim=min_ndim, align=align)


def _rows(lead: tuple, name: str) -> int:
    """The rows of a row producer's input: the row kernels run one CTA per
    row, and a launch grid's x dimension holds at most MAX_ROWS blocks (past
    it the launch failed on the GPU, after the memset of scope 'tensor' had
    written out.gs; the CPU took it): refused on CPU and CUDA alike."""
    rows = math.prod(lead)
    if rows > MAX_ROWS:
        raise ValueError(f"{name}: {rows} rows; at most 2^31 - 1 (the row kernels run one CTA per row)")
    return rows


def _width(n: int, name: str) -> None:
    """The quantized width: a positive multiple of 16 (N == 0 has no row to
    normalize and would leave gs / inv_rms unwritten on CUDA)."""
    if n == 0:
        raise ValueError(f"{name}: the last dimension is 0; expected a positive multiple of 16")
    ref_nvfp4.check_last_dim(n, name)


def _gs(gs, xdt, where, dev):
    """A given gs: a Python float checked under the bound of `xdt` inputs
    (rawkv.nvfp4's rule), or a float32 array of one element on the op's
    device, aligned to its element (A.gs_tensor, quantize's rule: the
    kernels load it in place; its value is the CPU branch's to check,
    rms.host_gs, or the kernel's)."""
    if gs is None:
        return None
    if gs.__class__ is float:
        ref_nvfp4.check_given_gs(gs, xdt)
        return gs
    return A.gs_tensor(gs, where, dev)


def _outputs(where, dev, lead, n, scope, q, sf, gs_out, inv, fresh):
    """The outputs of rows `lead` of width n (inv None: SwiGLU); `fresh`:
    allocated by the public function for these inputs (right by
    construction, not checked again)."""
    if fresh:
        return q, sf, gs_out, inv
    q = A.tensor(q, "out.q", OUT_Q, where, shape=(*lead, n // 2), device=dev, align=8)
    sf = A.tensor(sf, "out.sf", OUT_SF, where, shape=(*lead, n // 16), device=dev)
    gs_out = A.tensor(gs_out, "out.gs", F32, where, shape=gs_shape(scope, lead, gs_out), device=dev, align=4)
    if inv is not None:
        inv = A.tensor(inv, "out.inv_rms", F32, where, shape=lead, device=dev, align=4)
    return q, sf, gs_out, inv


def _scope(scope, gs, gs_value):
    return A.check_scope_gs(scope, A.op_gs(gs, gs_value), SCOPES, "row")


# The op wrapper's host rules (rawkv._op.op): rms's and swiglu's first
# checks, on their arguments that are no tensor, in their order, so a
# compiled call's bool gs gets the eager error.
def rms_scalars(a) -> None:
    A.check_eps(a["eps"])
    _scope(a["scope"], a["gs"], a["gs_value"])


def swiglu_scalars(a) -> None:
    granularity(a["granularity"])
    _scope(a["scope"], a["gs"], a["gs_value"])


# ---- one function per op ----------------------------------------------------------------
def _rms_inputs(x, mix, weight, where):
    """(x, mix, weight, lead, n_hc, N, device) of rmsnorm_quantize (mix
    None) and mhc_rmsnorm_quantize, checked."""
    mixed = mix is not None
    x = _x(x, "x", where, 2 if mixed else 1, 16)
    xs, dev = tuple(x.shape), A.device_of(x)
    lead, n_hc, n = (xs[:-2], xs[-2], xs[-1]) if mixed else (xs[:-1], 1, xs[-1])
    if not 1 <= n_hc <= K.MAX_HC:
        raise ValueError(f"x: n_hc = x.shape[-2] = {n_hc} must be in 1..{K.MAX_HC}")
    _width(n, "x")
    _rows(lead, "x")
    weight = A.tensor(weight, "weight", PARAM, where, shape=(n,), device=dev, align=16)
    if mixed:
        # (element-aligned: the kernel loads each weight as a float / half, in place)
        mix = A.tensor(mix, "mix", PARAM, where, shape=(*lead, n_hc), device=dev, align=A.ELEMENT)
    return x, mix, weight, lead, n_hc, n, dev


def rms(x, mix, weight, eps, scope, gs, gs_value, q, sf, gs_out, inv_rms, fresh=False):
    """(Rows, mix, weight, eps, n_hc) of rawkv::rmsnorm_quantize (mix None)
    and rawkv::mhc_rmsnorm_quantize. `fresh`: every output was just
    allocated by the public function (so apart from everything: the memory
    check is skipped)."""
    eps = A.check_eps(eps)
    scope, gs = _scope(scope, gs, gs_value)
    inputs = (("x", x), ("mix", mix), ("weight", weight), ("gs", gs))
    outs = (("out.q", q), ("out.sf", sf), ("out.gs", gs_out), ("out.inv_rms", inv_rms))
    where = A.placement(*inputs, *outs)
    if not fresh:
        A.check_outputs(outs, inputs)
    x, mix, weight, lead, n_hc, n, dev = _rms_inputs(x, mix, weight, where)
    xdt = A.dtype_name(x)
    gs = _gs(gs, xdt, where, dev)
    q, sf, gs_out, inv_rms = _outputs(where, dev, lead, n, scope, q, sf, gs_out, inv_rms, fresh)
    return Rows(where, x, math.prod(lead), n, xdt, scope, gs, q, sf, gs_out, inv_rms), mix, weight, eps, n_hc


is_int = A.is_int


def granularity(g) -> int:
    """SwiGLU's interleave: a positive int (Python or numpy; a bool is a
    TypeError, A.refuse_bool)."""
    A.refuse_bool(g, "granularity", "an int")
    if not is_int(g) or g < 1:
        raise ValueError(f"granularity: expected a positive int, got {g!r}")
    return int(g)


def _swiglu_input(h, granularity_, where):
    """(h, granularity, 16-byte loads?, lead, I, device) of swiglu_quantize,
    checked: h (..., 2I), I a positive multiple of 16 and of granularity."""
    g = granularity(granularity_)
    vec = g % 8 == 0            # runs of 8 gate / up columns: 16-byte loads
    h = _x(h, "h", where, 1, 16 if vec else 2)
    two_i = h.shape[-1]
    if two_i == 0:              # no row to quantize (CUDA would leave gs unwritten)
        raise ValueError("h: the last dimension is 0; expected 2I with I a positive multiple of 16")
    if two_i % 2:
        raise ValueError(f"h: the fused width {two_i} must be even (gate and up halves)")
    inter = two_i // 2
    ref_nvfp4.check_last_dim(inter, "h (the intermediate width h.shape[-1] / 2)")
    if inter % g:
        raise ValueError(f"granularity: {g} must divide the intermediate width {inter}")
    if two_i >= 2 ** 31:
        raise ValueError(f"h: the fused width {two_i} must be < 2^31")
    _rows(h.shape[:-1], "h")
    return h, g, vec, tuple(h.shape[:-1]), inter, A.device_of(h)


def swiglu(h, granularity_, scope, gs, gs_value, q, sf, gs_out, fresh=False):
    """(Rows, granularity, 16-byte loads?) of rawkv::swiglu_quantize; Rows.n
    is the intermediate width I (h is (..., 2I)); `fresh` as for rms."""
    granularity(granularity_)
    scope, gs = _scope(scope, gs, gs_value)
    outs = (("out.q", q), ("out.sf", sf), ("out.gs", gs_out))
    where = A.placement(("h", h), ("gs", gs), *outs)
    if not fresh:
        A.check_outputs(outs, (("h", h), ("gs", gs)))
    h, g, vec, lead, inter, dev = _swiglu_input(h, granularity_, where)
    xdt = A.dtype_name(h)
    gs = _gs(gs, xdt, where, dev)
    q, sf, gs_out, _ = _outputs(where, dev, lead, inter, scope, q, sf, gs_out, None, fresh)
    return Rows(where, h, math.prod(lead), inter, xdt, scope, gs, q, sf, gs_out, None), g, vec


def _moe_inputs(hidden, topk_ids, topk_weights, where):
    """(hidden, topk_ids, topk_weights, M, K, device) of MoE staging,
    checked: hidden (M, K), K a positive multiple of 128; ids and weights
    (M, top_k)."""
    hidden = A.tensor(hidden, "hidden", CPU_X if where == "cpu" else X, where, align=16)
    hs, dev = tuple(hidden.shape), A.device_of(hidden)
    if len(hs) != 2:
        raise ValueError(f"hidden: expected (M, K), got shape {hs}")
    m, k = hs
    if k % 128 or k == 0:
        raise ValueError(f"hidden: K = {k} must be a positive multiple of 128 for MoE staging "
                         "(NVFP4 blocks of 16, scales packed four per int32, 128-wide tiles)")
    # (element-aligned: the kernel loads each id, 4 or 8 bytes, in place; the
    # weights it copies byte by byte)
    topk_ids = A.tensor(topk_ids, "topk_ids", IDS, where, device=dev, align=A.ELEMENT)
    ids_s = tuple(topk_ids.shape)
    if len(ids_s) != 2 or ids_s[0] != m:
        raise ValueError(f"topk_ids: expected shape ({m}, top_k), got {ids_s}")
    topk_weights = A.tensor(topk_weights, "topk_weights", PARAM, where, shape=ids_s, device=dev)
    return hidden, topk_ids, topk_weights, m, k, dev


def _topk_outputs(where, dev, topk_ids, topk_weights, ids_out, w_out):
    """The top-k copies' outputs: int64 ids, weights of the input's dtype."""
    ids_s = tuple(topk_ids.shape)
    ids = A.tensor(ids_out, "out.topk_ids", ("int64",), where, shape=ids_s, device=dev, align=8)
    w = A.tensor(w_out, "out.topk_weights", (A.dtype_name(topk_weights),), where, shape=ids_s, device=dev)
    return ids, w


def moe_stage(hidden, topk_ids, topk_weights, q, sf, topk_ids_out, topk_weights_out, fresh=False):
    """(where, hidden, topk_ids, topk_weights, q, sf, ids_out, weights_out)
    of rawkv::moe_stage; `fresh` as for rms."""
    inputs = (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights))
    outs = (("out.q", q), ("out.sf", sf), ("out.topk_ids", topk_ids_out), ("out.topk_weights", topk_weights_out))
    where = A.placement(*inputs, *outs)
    if not fresh:
        A.check_outputs(outs, inputs)
    hidden, topk_ids, topk_weights, m, k, dev = _moe_inputs(hidden, topk_ids, topk_weights, where)
    if fresh:
        return where, hidden, topk_ids, topk_weights, q, sf, topk_ids_out, topk_weights_out
    q = A.tensor(q, "out.q", OUT_Q, where, shape=(m, k // 2), device=dev, align=16)
    sf = A.tensor(sf, "out.sf", ("int32",), where, shape=(m, k // 64), device=dev, align=4)
    ids, w = _topk_outputs(where, dev, topk_ids, topk_weights, topk_ids_out, topk_weights_out)
    return where, hidden, topk_ids, topk_weights, q, sf, ids, w


# ---- the FP8 block outputs ----------------------------------------------------------------
def _fp8_format(block, scale_format) -> None:
    FP8.check_block(block)
    FP8.check_scale_format(scale_format)


def _fp8_outputs(where, dev, lead, n, block, scale_format, codes, scales, fresh):
    """(codes, scales, (UE8M0, SBYTE)): the FP8 outputs of rows `lead` of
    width n, checked unless `fresh` (allocated by the public function for
    these inputs: right by construction)."""
    if fresh:
        return codes, scales, FP8.scales_kind(scale_format, scales)
    codes = A.tensor(codes, "out.codes", FP8.CODES, where, shape=(*lead, n), device=dev, align=16)
    scales, fmt = FP8.check_scales(scales, "out.scales", scale_format, where,
                                   (*lead, ref_fp8.block_count(n, block)), dev)
    return codes, scales, fmt


def rms_fp8(x, mix, weight, eps, block, scale_format, codes, scales, inv_rms, fresh=False):
    """(Fp8Rows, mix, weight, eps, n_hc) of rawkv::rmsnorm_quantize_fp8 (mix
    None) and rawkv::mhc_rmsnorm_quantize_fp8; `fresh` as for rms."""
    eps = A.check_eps(eps)
    _fp8_format(block, scale_format)
    inputs = (("x", x), ("mix", mix), ("weight", weight))
    outs = (("out.codes", codes), ("out.scales", scales), ("out.inv_rms", inv_rms))
    where = A.placement(*inputs, *outs)
    if not fresh:
        A.check_outputs(outs, inputs)
    x, mix, weight, lead, n_hc, n, dev = _rms_inputs(x, mix, weight, where)
    codes, scales, fmt = _fp8_outputs(where, dev, lead, n, block, scale_format, codes, scales, fresh)
    if not fresh:
        inv_rms = A.tensor(inv_rms, "out.inv_rms", F32, where, shape=lead, device=dev, align=4)
    rows = Fp8Rows(where, x, math.prod(lead), n, A.dtype_name(x), block, scale_format, fmt, codes, scales,
                   inv_rms)
    return rows, mix, weight, eps, n_hc


def swiglu_fp8(h, granularity_, block, scale_format, codes, scales, fresh=False):
    """(Fp8Rows, granularity, 16-byte loads?) of rawkv::swiglu_quantize_fp8;
    `fresh` as for rms."""
    granularity(granularity_)
    _fp8_format(block, scale_format)
    outs = (("out.codes", codes), ("out.scales", scales))
    where = A.placement(("h", h), *outs)
    if not fresh:
        A.check_outputs(outs, (("h", h),))
    h, g, vec, lead, inter, dev = _swiglu_input(h, granularity_, where)
    codes, scales, fmt = _fp8_outputs(where, dev, lead, inter, block, scale_format, codes, scales, fresh)
    return Fp8Rows(where, h, math.prod(lead), inter, A.dtype_name(h), block, scale_format, fmt, codes, scales,
                   None), g, vec


def moe_stage_fp8(hidden, topk_ids, topk_weights, block, scale_format, codes, scales, topk_ids_out,
                  topk_weights_out, fresh=False):
    """(where, hidden, topk_ids, topk_weights, codes, scales, ids_out,
    weights_out, (UE8M0, SBYTE)) of rawkv::moe_stage_fp8; `fresh` as for rms."""
    _fp8_format(block, scale_format)
    inputs = (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights))
    outs = (("out.codes", codes), ("out.scales", scales), ("out.topk_ids", topk_ids_out),
            ("out.topk_weights", topk_weights_out))
    where = A.placement(*inputs, *outs)
    if not fresh:
        A.check_outputs(outs, inputs)
    hidden, topk_ids, topk_weights, m, k, dev = _moe_inputs(hidden, topk_ids, topk_weights, where)
    codes, scales, fmt = _fp8_outputs(where, dev, (m,), k, block, scale_format, codes, scales, fresh)
    ids, w = topk_ids_out, topk_weights_out
    if not fresh:
        ids, w = _topk_outputs(where, dev, topk_ids, topk_weights, ids, w)
    return where, hidden, topk_ids, topk_weights, codes, scales, ids, w, fmt
