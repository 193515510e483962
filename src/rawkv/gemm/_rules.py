"""Argument rules of the grouped FP4 GEMM ops (the generic ones are
rawkv._args): one function per op takes the operator's arguments (the
activation as x, x_sf, x_gs; the weight as its tensors and sizes) and
returns the op's placement and its checked arrays, on CPU and CUDA alike;
the body then only chooses the reference or the launch. Every rule raises
before anything is launched or written, naming the argument as the public
ops spell it (x, x.q / x.sf / x.gs for an NVFP4 activation, weight,
offsets, out, errors)."""
from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np

from .. import _args as A
from ..errors import CaptureError
from ..fp8 import UE8M0_SCALES      # (the W4A8 activations' scales: E8M0 bytes or float32)
from ..kernels import gemm_fp4 as K
from ..reference import gemm as ref
from ..reference import gemm_w4a8 as ref8
from ..runtime import get_runtime
from .weights import FORMATS, MX_WINDOW, MX_WINDOW_FP16

X_DTYPES = ("bfloat16", "float16")
#: numpy has no bfloat16: a numpy float32 x stands for one, holding BF16
#: values (rawkv's host convention; other values are refused), and a numpy
#: out is float32 holding the BF16 results.
X_DTYPES_NUMPY = ("float32", "float16")
OUT_DTYPES = ("bfloat16",)
OUT_DTYPES_NUMPY = ("bfloat16", "float32")
_BYTE = ("uint8",)                  # the packed weight's codes and scales
_F32 = ("float32",)
_I32 = ("int32",)
#: The activation kinds the kernels take (template argument ACT).
BF16, FP16, NVFP4 = K.ACT_CODES["bfloat16"], K.ACT_CODES["float16"], K.ACT_CODES["nvfp4"]


class Weight(NamedTuple):
    """A checked weight: its format, sizes, packed tensors and device
    index (-1 for the host), and the spans of its tensors (rawkv._args.spans:
    an output may not overlap them)."""
    fmt: str
    groups: int
    n: int
    k: int
    codes: object
    scales: object
    gs: object
    device: int
    spans: tuple


class Act:
    """A checked activation: kind (BF16, FP16, NVFP4), its arrays as the
    kernel reads them (sf and gs None for BF16 / FP16), the leading shape
    ((T, G) or (R,)) and the device index (-1 for the host)."""
    __slots__ = ("kind", "x", "sf", "gs", "lead", "device")

    def __init__(self, kind, x, sf, gs, lead, device):
        self.kind, self.x, self.sf, self.gs, self.lead, self.device = kind, x, sf, gs, lead, device


#: The launch grid's limit in y and z (the token tiles or ragged slots, the
#: groups).
MAX_GRID_YZ = 65535
#: The fewest tokens a tile of any kernel and GPU takes once a call has more
#: than 64 tokens per group or expert (the mma.sync kernel's CONFIGS["large"]).
_LARGE_TILE_TOKENS = 32
#: N and K of a weight (both forms) stay below this: the kernels take them as
#: int and do 32-bit arithmetic on them. The W4A8 wgmma producer's step of two
#: row tiles, 2 * ceil(K / 128) * 1024 bytes, is held in 32 bits: past
#: K = 2^28 - 128 it wraps and the producer copies another row tile's weights.
#: The W4A16 split-K column offsets (2 K bytes) pass 2^31 near K = 2^30, the
#: epilogue's row + 128 near N = 2^31. 2^27 leaves a margin past any layer.
MAX_NK = 2 ** 27


def grid_fits(tokens: int, groups: int, ragged: bool) -> None:
    """A call whose launch grid could pass MAX_GRID_YZ on some GPU or kernel
    path is refused on every placement (the plans, which know the tile, find
    the same; the CPU path launches nothing but refuses alike): batched,
    ceil(T / 32) token tiles and G groups; ragged, the slot bound
    (plans.ragged_slots) at 32 tokens a tile, whatever E experts give."""
    tiles = -(-tokens // _LARGE_TILE_TOKENS)
    if ragged:
        over = min(tokens, tiles + groups + 2) > MAX_GRID_YZ
    else:
        over = tiles > MAX_GRID_YZ or groups > MAX_GRID_YZ
    if over:
        raise ValueError(f"x: {tokens} tokens x {groups} groups is past the launch grid's limit")


def out_shape(s: tuple, ndim: int, groups, n) -> tuple:
    """The shape of a call's new output from x's shape `s`: (T, G, N)
    batched (ndim 3) or (R, N) ragged (ndim 2); (0,), an empty stand-in,
    where the rules will refuse the call before they read out (x's rank, a
    launch grid past the limit, N not a size, no weight groups), so that
    they name the argument before anything is allocated (a stride-0 view of
    2^40 codes sized terabytes of output first)."""
    if len(s) != ndim or groups is None or not A.is_int(n) or n < 0:
        return (0,)
    try:
        grid_fits(s[0], groups, ndim == 2)
    except ValueError:
        return (0,)
    return (s[0], groups, n) if ndim == 3 else (s[0], n)


# ---- one function per op --------------------------------------------------------------------
def mx_span(fmt, exp_lo, exp_hi) -> None:
    """An MXFP4 weight's scale bytes span [exp_lo, exp_hi] (its exp_range;
    (0, 0) when unknown), which must lie in MX_WINDOW, where the kernels'
    dequantization is exact whatever the activations (past it their scale
    factor's exponent overflows its field): Fp4Weight.from_mxfp4 measures
    and checks it; a weight built otherwise is refused here. Integers, not
    bools, for every format (the operator's int arguments: a bool is refused
    under torch.compile by the op wrapper, so eagerly too)."""
    if not (A.is_int(exp_lo) and A.is_int(exp_hi)):
        raise TypeError(f"weight: exp_range ({exp_lo!r}, {exp_hi!r}): expected integers")
    if fmt == "mxfp4" and not MX_WINDOW[0] <= exp_lo <= exp_hi <= MX_WINDOW[1]:
        raise ValueError(f"weight: MXFP4 scale bytes must lie in [{MX_WINDOW[0]}, {MX_WINDOW[1]}], this weight's "
                         f"exp_range is [{exp_lo}, {exp_hi}] (build it with rawkv.gemm.Fp4Weight.from_mxfp4, "
                         "which measures and checks it)")


def grouped(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out):
    """(where, activation, weight, out) of rawkv::gemm_grouped_linear: x
    (T, G, K) against a weight of G groups, out (T, G, N)."""
    parts = _parts(x, x_sf, x_gs)
    where = A.placement(*parts, ("weight", codes), ("out", out))
    w = weight(codes, scales, gs, fmt, n, k, where)
    mx_span(fmt, exp_lo, exp_hi)
    A.check_outputs((("out", out),), parts, w.spans)
    act = activation(x, x_sf, x_gs, 3, k, fmt, exp_lo, exp_hi, where, w.device)
    t, g = act.lead
    if g != w.groups:
        raise ValueError(f"x: has {g} groups, the weight {w.groups}")
    grid_fits(t, g, False)
    return where, act, w, output(out, (t, g, n), where, act.device)


def moe(x, x_sf, x_gs, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, offsets, out, errors):
    """(where, activation, weight, offsets, out, errors) of
    rawkv::gemm_moe_linear: x (R, K), offsets int32 (E+1,) for a weight of
    E experts, out (R, N), errors None or an int32 counter."""
    parts = _parts(x, x_sf, x_gs)
    where = A.placement(*parts, ("offsets", offsets), ("errors", errors), ("out", out), ("weight", codes))
    w = weight(codes, scales, gs, fmt, n, k, where)
    mx_span(fmt, exp_lo, exp_hi)
    A.check_outputs((("out", out), ("errors", errors)), (*parts, ("offsets", offsets)), w.spans)
    act = activation(x, x_sf, x_gs, 2, k, fmt, exp_lo, exp_hi, where, w.device)
    return (where, act, w, *ragged(w.groups, offsets, out, errors, (act.lead[0], n), where, act.device))


def ragged(experts, offsets, out, errors, out_shape, where, device) -> tuple:
    """(offsets, out, errors) of a ragged call (both weight forms): offsets
    int32 (E+1,), out of `out_shape`, errors None or an int32 counter."""
    if experts + 1 > K.MAX_SEGMENTS:
        raise ValueError(f"weight: {experts} experts; the ragged kernel takes at most {K.MAX_SEGMENTS - 1}")
    grid_fits(out_shape[0], experts, True)
    offsets = A.tensor(offsets, "offsets", _I32, where, shape=(experts + 1,), device=device, align=A.ELEMENT)
    if errors is not None:
        errors = A.counter(errors, where, device)
    return offsets, output(out, out_shape, where, device), errors


def _parts(x, x_sf, x_gs) -> tuple:
    """The activation's (name, array) pairs, named as the public op's user
    knows them."""
    if x_sf is None and x_gs is None:
        return (("x", x),)
    return ("x.q", x), ("x.sf", x_sf), ("x.gs", x_gs)


# ---- the weight ------------------------------------------------------------------------------
# Weights whose tensors passed the checks, by id of their first tensor:
# (weak references to the tensors, what else was checked (the form and
# sizes), their stamps, (G, device, detached spans)): nothing that keeps
# a tensor alive. A weight's packed tensors are fixed once it is loaded and
# an op sees the same ones on every step (the public ops from an
# Fp4Weight / W4a8Weight, an engine's graph through the operator): a call
# with the same live tensors at the same addresses, of the same versions
# (torch counts every in-place change, of the data or of the shape and
# strides: an unsqueeze_ or resize_ of a weight tensor is checked again),
# dtypes, shapes, contiguity and negative bits (A.stamp: `t.data = ...`
# changes those with no new version) and the same sizes skips their checks.
_CHECKED: dict = {}
_CHECKED_MAX = 1024


def _stamp(given: tuple) -> tuple:
    """What must not have changed since the check: each tensor's A.stamp."""
    return tuple(map(A.stamp, given))


def _checked_before(given: tuple, what: tuple):
    """(G, device, spans) remembered for these tensors and `what`, or None."""
    hit = _CHECKED.get(id(given[0]))
    if hit is None or hit[1] != what:
        return None
    for ref_, t in zip(hit[0], given):
        if ref_() is not t:
            return None
    return hit[3] if hit[2] == _stamp(given) else None


def _remember(given: tuple, what: tuple, found: tuple) -> None:
    if all(map(A.is_torch, given)):         # (a DLPack array checked here is a new tensor each call)
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[id(given[0])] = (tuple(weakref.ref(t) for t in given), what, _stamp(given), found)


def weight(codes, scales, gs, fmt, n, k, where) -> Weight:
    """The packed weight (rawkv.gemm.Fp4Weight's tensors and sizes): codes
    uint8 (G, NP/16, C, 32, 16), scales uint8 (G, NP/16, C, 32, 2), gs
    float32 (G,), all contiguous on one device; fmt one of FORMATS; K a
    multiple of the format's block."""
    if not (A.is_int(n) and A.is_int(k)):         # (before the memo, as weight8: 24.0 == 24 would find a check)
        raise TypeError(f"weight: N = {n!r}, K = {k!r}: expected integers")
    given, what = (codes, scales, gs), ("w4a16", fmt, n, k)
    hit = _checked_before(given, what)
    if hit is not None:
        return Weight(fmt, hit[0], n, k, codes, scales, gs, hit[1], hit[2])
    if fmt not in FORMATS:
        raise ValueError(f"weight: format {fmt!r} is not one of {FORMATS}")
    if n < 0 or k < 0 or k % ref.BLOCKS[fmt]:
        raise ValueError(f"weight: N = {n}, K = {k}: expected sizes >= 0, K a multiple of "
                         f"{ref.BLOCKS[fmt]} for {fmt}")
    _below_limit(n, k)
    # (16-byte aligned: both kernels copy codes and scales 16 bytes at a time,
    # which a misaligned view, e.g. sliced out of one blob of packed tensors,
    # would fault on the GPU where the CPU path gave the product)
    codes = A.tensor(codes, "weight.codes", _BYTE, where, min_ndim=1, align=16)
    g, dev = codes.shape[0], A.device_of(codes)
    tile = (g, -(-n // ref.ROWS), -(-k // ref.CHUNK), ref.LANES)
    if tuple(codes.shape) != (*tile, 16):
        raise ValueError(f"weight.codes: expected shape {(*tile, 16)} for N = {n}, K = {k}, "
                         f"got {tuple(codes.shape)}")
    scales = A.tensor(scales, "weight.scales", _BYTE, where, shape=(*tile, 2), device=dev, align=16)
    # (element-aligned: the kernels load each group's float in place)
    gs = A.tensor(gs, "weight.gs", _F32, where, shape=(g,), device=dev, align=A.ELEMENT)
    spans = A.detached_spans((("weight.codes", codes), ("weight.scales", scales), ("weight.gs", gs)))
    _remember(given, what, (g, dev, spans))
    return Weight(fmt, g, n, k, codes, scales, gs, dev, spans)


def _below_limit(n: int, k: int) -> None:
    """N and K below MAX_NK (the kernels' 32-bit arithmetic), on every placement."""
    if n >= MAX_NK or k >= MAX_NK:
        raise ValueError(f"weight: N = {n}, K = {k}: each must be below 2^27 = {MAX_NK} (the GEMM "
                         "kernels' 32-bit index arithmetic)")


# ---- the activation --------------------------------------------------------------------------
def activation(x, x_sf, x_gs, ndim, k, fmt, exp_lo, exp_hi, where, device) -> Act:
    """x (..., K) BF16 / FP16 with `ndim` dimensions, or an NVFP4 activation
    (x its codes (..., K/2), x_sf (..., K/16), x_gs one float32 value or one
    per row). On CUDA, a view whose rows the kernel cannot read as they are
    (last dimension strided, rows not 16 bytes (codes: 8) aligned) is
    copied once (docs/gemm.md: a documented cost, not an error). `device`:
    the weight's (rawkv does not move data)."""
    if x_sf is None and x_gs is None:
        act = _dense(x, ndim, k, fmt, exp_lo, exp_hi, where)
    else:
        act = _nvfp4(x, x_sf, x_gs, ndim, k, where)
    if act.device != device:
        raise ValueError(f"weight: is on {_device_name(device)}, x on {_device_name(act.device)}; "
                         "rawkv does not move data")
    return act


def _device_name(index: int) -> str:
    return "cpu" if index < 0 else f"cuda:{index}"


def _dense(x, ndim, k, fmt, exp_lo, exp_hi, where) -> Act:
    x = A.tensor(x, "x", X_DTYPES_NUMPY if isinstance(x, np.ndarray) else X_DTYPES, where, dense=False)
    s = x.shape
    if len(s) != ndim or s[-1] != k:
        raise ValueError(f"x: expected shape (..., {k}) with {ndim} dimensions for K = {k}, got {tuple(s)}")
    d = A.dtype_name(x)
    if d == "float32":
        _check_bf16_values(x)
    elif d == "float16" and fmt == "mxfp4" and (exp_lo < MX_WINDOW_FP16[0] or exp_hi > MX_WINDOW_FP16[1]):
        raise ValueError(f"x: FP16 activations need MXFP4 scale bytes in {list(MX_WINDOW_FP16)} "
                         f"(this weight's span [{exp_lo}, {exp_hi}]); pass BF16 activations")
    dev = A.device_of(x)
    if where == "cuda":
        x = rows_aligned(x, 16, "x")
    return Act(FP16 if d == "float16" else BF16, x, None, None, tuple(s[:-1]), dev)


def _nvfp4(q, sf, gs, ndim, k, where) -> Act:
    q = A.tensor(q, "x.q", A.BYTES, where, dense=False)
    if len(q.shape) != ndim or q.shape[-1] != k // 2:
        raise ValueError(f"x.q: expected shape (..., {k // 2}) with {ndim} dimensions for K = {k}, "
                         f"got {tuple(q.shape)}")
    lead, dev = tuple(q.shape[:-1]), A.device_of(q)
    sf = A.tensor(sf, "x.sf", A.BYTES, where, shape=(*lead, k // 16), device=dev, dense=False)
    # (read in place, a float per row or one for all, at any strides: element-
    # aligned, or refused; the copies below are the rows' and the scales', and
    # a kernel's misaligned 4-byte load faults)
    gs = A.tensor(gs, "x.gs", _F32, where, device=dev, dense=False, align=A.ELEMENT)
    if A.numel(gs) != 1 and tuple(gs.shape) != lead:
        raise ValueError(f"x.gs: expected one value or shape {lead}, got {tuple(gs.shape)}")
    if where == "cuda":
        q = rows_aligned(q, 8, "x.q")
        if sf.stride(-1) != 1:
            copy_outside_capture(sf, "x.sf", "a strided last dimension")
            sf = sf.contiguous()
    return Act(NVFP4, q, sf, gs, lead, dev)


def _check_bf16_values(x: np.ndarray) -> None:
    """A numpy float32 x stands for bfloat16: each value must be one (its
    low 16 bits zero), as a BF16 tensor's would be; rounding here would
    hide a caller's mistake."""
    low = x.view(np.uint32) & 0xFFFF
    if low.any():
        at = tuple(int(i) for i in np.argwhere(low)[0])
        raise ValueError(f"x: a numpy float32 x stands for bfloat16 (numpy has none) and must hold "
                         f"BF16 values; x{list(at)} = {x[at]!r} is not one")


def rows_aligned(x, align: int, name: str):
    """x itself when each row (last dimension) is contiguous and starts
    `align`-byte aligned; else a fresh contiguous copy (a clone: .contiguous()
    would keep a misaligned start), refused while a graph is captured
    (copy_outside_capture)."""
    es = x.element_size()
    st = x.stride()
    if st[-1] == 1 and x.data_ptr() % align == 0 and all((s * es) % align == 0 for s in st[:-1]):
        return x
    copy_outside_capture(x, name, f"rows not contiguous and {align}-byte aligned")
    return x.clone(memory_format=A._torch.contiguous_format)


def copy_outside_capture(x, name: str, why: str, rt=None) -> None:
    """A view a kernel cannot read as it is is copied (rows_aligned, an
    NVFP4 activation's strided scales, plans.w4a8_scales_read), which is an
    allocation: refused while torch's current stream, the op's stream
    (made current: _args.stream_current) or the caller's is capturing a
    CUDA graph, as every op's allocations are (docs/format.md: no op
    allocates during capture). Under a capture torch does not manage the
    copy's block went back to the caching pool after the call while the
    graph's replays still read it. A CaptureError naming the argument.
    `rt`: x's device's runtime, if the caller holds it. (A host tensor, the
    CUDA path's stand-in in tests, allocates no device memory.)"""
    if rt is None:
        if x.get_device() < 0:
            return
        rt = get_runtime(x.get_device())
    if rt.capturing():
        raise CaptureError(f"{name}: would be copied ({why}: the kernel cannot read it as it is) while "
                           "the stream is capturing a CUDA graph, and no op allocates during capture; pass "
                           "a layout the kernel reads as it is (docs/gemm.md, \"Ops\"), or copy it before capture")


# ---- out ---------------------------------------------------------------------------------------
def output(out, shape, where, device):
    """out: bfloat16 (a numpy out: float32 holding BF16 values) of `shape`
    on `device`, its last dimension contiguous (the kernel takes the other
    strides; a last dimension of one feature has no step, so any stride
    there, as torch's contiguity has it) and no two rows in one place (an
    expanded view, or strides smaller than the rows they step over: the
    kernel's blocks would race, the reference's copy write over itself),
    starting element-aligned (a partial block or unaligned view is stored
    value by value, 2 bytes each, which faults at an odd address). An out
    of no elements has no layout to check: numpy gives one strides of 0
    (np.empty((0, 3, 24)): the op's own output for a numpy x of no rows
    was refused as 'not contiguous', where torch's was taken)."""
    out = A.tensor(out, "out", OUT_DTYPES_NUMPY if isinstance(out, np.ndarray) else OUT_DTYPES, where,
                   shape=shape, device=device, dense=False, align=A.ELEMENT)
    if not A.numel(out):
        return out
    st = A.strides(out)
    if st[-1] != 1 and shape[-1] > 1:
        raise ValueError("out: the last dimension must be contiguous")
    if not A.apart(shape, st):
        raise ValueError(f"out: rows overlap (strides {st} for shape {tuple(shape)}); "
                         "pass a tensor whose elements each have their own memory")
    return out


# ---- W4A8 (rawkv.gemm.w4a8) --------------------------------------------------------------------
#: FP8 activation codes (E4M3 bytes) and their block scales.
FP8_CODES = ("uint8", "float8_e4m3fn")


class Weight8(NamedTuple):
    """A checked W4A8 weight (rawkv.gemm.W4a8Weight's tensors and sizes)."""
    groups: int
    n: int
    k: int
    codes: object
    shifts: object
    row_scale: object
    gs: object
    device: int
    spans: tuple


class Act8(NamedTuple):
    """Checked FP8 block activations: codes (..., K), scales (..., ceil(K/128))
    float32, the leading shape and the device index."""
    x: object
    sf: object
    lead: tuple
    device: int


def w4a8_grouped(x, x_sf, codes, shifts, row_scale, gs, n, k, out, errors):
    """(where, activation, weight, out, errors) of
    rawkv::gemm_grouped_linear_w4a8: x (T, G, K) FP8 codes with scales
    (T, G, ceil(K/128)), out (T, G, N), errors None or an int32 counter (the
    ragged op's)."""
    parts = (("x.codes", x), ("x.scales", x_sf))
    where = A.placement(*parts, ("weight", codes), ("out", out), ("errors", errors))
    w = weight8(codes, shifts, row_scale, gs, n, k, where)
    A.check_outputs((("out", out), ("errors", errors)), parts, w.spans)
    act = activation8(x, x_sf, 3, k, where, w.device)
    t, g = act.lead
    if g != w.groups:
        raise ValueError(f"x: has {g} groups, the weight {w.groups}")
    grid_fits(t, g, False)
    if errors is not None:
        errors = A.counter(errors, where, act.device)
    return where, act, w, output(out, (t, g, n), where, act.device), errors


def w4a8_moe(x, x_sf, codes, shifts, row_scale, gs, n, k, offsets, out, errors):
    """(where, activation, weight, offsets, out, errors) of
    rawkv::gemm_moe_linear_w4a8: x (R, K) FP8 codes with scales
    (R, ceil(K/128)), offsets int32 (E+1,), out (R, N)."""
    parts = (("x.codes", x), ("x.scales", x_sf))
    where = A.placement(*parts, ("offsets", offsets), ("errors", errors), ("out", out), ("weight", codes))
    w = weight8(codes, shifts, row_scale, gs, n, k, where)
    A.check_outputs((("out", out), ("errors", errors)), (*parts, ("offsets", offsets)), w.spans)
    act = activation8(x, x_sf, 2, k, where, w.device)
    return (where, act, w, *ragged(w.groups, offsets, out, errors, (act.lead[0], n), where, act.device))


def weight8(codes, shifts, row_scale, gs, n, k, where) -> Weight8:
    """The W4A8 form's tensors: codes uint8 (G, NP/16, C, 2, 32, 16), shifts
    uint8 (G, NP/16, C, 8, 8), row_scale float32 (G, NP), gs float32 (G,),
    contiguous on one device; K a multiple of 32 (the MXFP4 block)."""
    if not (A.is_int(n) and A.is_int(k)):         # (before the memo: 24.0 == 24 would find the weight's check)
        raise TypeError(f"weight: N = {n!r}, K = {k!r}: expected integers")
    given, what = (codes, shifts, row_scale, gs), ("w4a8", n, k)
    hit = _checked_before(given, what)
    if hit is not None:
        return Weight8(hit[0], n, k, codes, shifts, row_scale, gs, hit[1], hit[2])
    if n < 0 or k < 0 or k % ref8.W_BLOCK:
        raise ValueError(f"weight: N = {n}, K = {k}: expected sizes >= 0, K a multiple of {ref8.W_BLOCK}")
    _below_limit(n, k)
    # (16-byte aligned: the kernel copies them 16 bytes at a time)
    codes = A.tensor(codes, "weight.codes", _BYTE, where, min_ndim=1, align=16)
    g, dev = codes.shape[0], A.device_of(codes)
    npad, chunks = ref8.padded8(n, k)
    tile = (g, npad // ref.ROWS, chunks)
    want = (*tile, ref8.PLANES, 32, ref8.LANE_BYTES // ref8.PLANES)
    if tuple(codes.shape) != want:
        raise ValueError(f"weight.codes: expected shape {want} for N = {n}, K = {k}, got {tuple(codes.shape)}")
    shifts = A.tensor(shifts, "weight.shifts", _BYTE, where, shape=(*tile, 8, ref8.SHIFT_BYTES), device=dev,
                      align=16)
    # (element-aligned: the kernels load each row's and group's float in place)
    row_scale = A.tensor(row_scale, "weight.row_scale", _F32, where, shape=(g, npad), device=dev, align=A.ELEMENT)
    gs = A.tensor(gs, "weight.gs", _F32, where, shape=(g,), device=dev, align=A.ELEMENT)
    spans = A.detached_spans((("weight.codes", codes), ("weight.shifts", shifts),
                              ("weight.row_scale", row_scale), ("weight.gs", gs)))
    _remember(given, what, (g, dev, spans))
    return Weight8(g, n, k, codes, shifts, row_scale, gs, dev, spans)


def activation8(x, x_sf, ndim, k, where, device) -> Act8:
    """x (..., K) E4M3 codes with `ndim` dimensions and x_sf (..., ceil(K/128))
    scales (rawkv.fp8.quantize_blocks with block 128): float32, or E8M0
    bytes (uint8 / float8_e8m0fnu, 'ue8m0'), which the kernels read as
    their float32 powers of two. On CUDA, codes whose rows are not 16-byte
    aligned and contiguous are copied once (as for the W4A16 activations);
    the scales are taken at any strides (DeepGEMM's MN-major, TMA-aligned
    layout included): the wgmma kernel reads them in place, and
    plans.w4a8_scales_read copies a view with non-adjacent blocks for the
    mma.sync kernel (docs/gemm.md, "Scale layouts")."""
    x = A.tensor(x, "x.codes", FP8_CODES, where, dense=False)
    s = tuple(x.shape)
    if len(s) != ndim or s[-1] != k:
        raise ValueError(f"x.codes: expected shape (..., {k}) with {ndim} dimensions for K = {k}, got {s}")
    dev = A.device_of(x)
    nb = -(-k // 128)
    # (float32 scales element-aligned: either kernel loads them in place, the
    # few-token one from a copy only where the blocks are not adjacent)
    x_sf = A.tensor(x_sf, "x.scales", UE8M0_SCALES, where, shape=(*s[:-1], nb), device=dev, dense=False,
                    align=A.ELEMENT)
    if dev != device:
        raise ValueError(f"weight: is on {_device_name(device)}, x on {_device_name(dev)}; rawkv does not move data")
    if where == "cuda":
        x = rows_aligned(x, 16, "x.codes")
    return Act8(x, x_sf, s[:-1], dev)
