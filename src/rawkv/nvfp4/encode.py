"""rawkv.nvfp4.quantize: NVFP4 encode under a global-scale scope
(docs/format.md, "NVFP4: tensors and layouts", "global-scale scopes").

The scopes are planned here once for every encoder (quantize and the fused
producers, rawkv.fused.plans): `plan_scope` is a pure function from the
scope, the given gs and an encoder's passes to the launches (rawkv._plan:
Launch, Memset), which the op runs. What each scope launches:

    'row'      one pass; each row's gs from its amax
    'tensor'   gs zeroed, a pass taking the tensor's amax (atomicMax into gs),
               a pass quantizing with it (or one pass for a small tensor)
    'given'    one pass with the given gs: a number (the host checked it)
               or a device tensor (the kernel checks it, flags every block
               of a refused one and counts the call in `errors`)
    'none'     the 'given' pass with gs = 1

An encode of no elements launches nothing: `empty_gs` is the gs it still
writes.
"""
from __future__ import annotations

from typing import NamedTuple

from . import counters
from ._geometry import BLOCK_THREADS, grid, groups
from .. import _args as A
from .._op import empty, op
from .._plan import Fill, Launch, Memset, grid_stride
from ..kernels import nvfp4 as K
from ..reference import nvfp4 as ref
from ..runtime import get_runtime

__all__ = ["quantize", "global_scale", "SCOPES", "SMALL_NUMEL"]       # the family's API (rawkv.nvfp4 exports it)

BLOCK = ref.BLOCK
SCOPES = ref.SCOPES
#: scope 'tensor' inputs with at most this many elements take the one-launch
#: path (each CTA reduces the whole L2-resident tensor itself).
SMALL_NUMEL = 1 << 16
_SMALL_MAX_CTAS = 16


def quantize(x, *, scope: str = "tensor", gs=None, out=None, errors=None, stream=None):
    """NVFP4-encode x (..., N), N % 16 == 0 -> (q (..., N/2), sf (..., N/16), gs).

    scope: 'tensor' (gs = amax(x)/2688, shape ()), 'row' (one gs per row,
    shape x.shape[:-1]), 'given' (gs: a number, Python or numpy, or a
    1-element float32 tensor), 'none' (gs = 1); scope=None: 'given' when
    gs is given, else 'tensor' (the default stays 'tensor', so a gs passed
    without a scope is refused, naming gs: say scope='given', or None). A
    given gs must satisfy 0 < gs < the bound of x's
    dtype (docs/format.md): a number or a host array outside it is a
    ValueError; a device tensor is checked by the kernel, which then flags
    every block (sf 0x7F, codes 0) and counts the call in
    rawkv.nvfp4.error_counts()[GIVEN_GS] (or, given errors, an int32
    tensor of at least one element, in errors[0]). x's rows must be evenly
    strided with a contiguous last dimension, 16 bytes apart at a multiple.
    q is returned as torch.float4_e2m1fn_x2 and sf as torch.float8_e4m3fn
    where torch has them. out=(q, sf, gs) buffers (uint8 or those dtypes,
    contiguous, q and sf 16-byte aligned; gs float32) are written and
    returned (all three are checked before any is written); for scope
    'given' with a gs tensor and no out gs, the given tensor itself
    (reshaped to (); a DLPack array as the torch view of it) is returned
    as gs."""
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise TypeError("out: expected a tuple (q, sf, gs) of buffers (entries may be None)")
    q, sf, g = out if out is not None else (None, None, None)
    gs_t, gs_v = A.split_number(gs)
    # (resolved before any branch: the operator's schema takes a str, and
    # scope=None must reach it as the eager op reads it, whatever out= holds)
    scope = A.default_scope(scope, gs, "tensor")
    # a gs tensor given without an out gs is the gs
    if q is None or sf is None or (g is None and gs_t is None):
        s = A.out_rows(x, "x")      # (no shape, or a layout the op refuses: the op names x)
        lead, n = s[:-1], (s[-1] if s else 0)
        if q is None:
            q = empty(x, (*lead, n // 2), "uint8", stream)
        if sf is None:
            sf = empty(x, (*lead, n // BLOCK), "uint8", stream)
        if g is None and gs_t is None:
            # (a str first: an array scope compares elementwise; the op names it)
            g = empty(x, lead if isinstance(scope, str) and scope == "row" else (), "float32", stream)
    _quantize(x, scope, gs_t, gs_v, q, sf, g, errors, stream)
    return A.as_q(q), A.as_sf(sf), g if g is not None else _given(gs_t)


def _given(gs):
    """The given gs tensor as the result's gs, shape (): a DLPack array as the
    view of it the rules read (A.as_read), the protocol promising no
    .reshape (a bare producer's raised AttributeError after the encode)."""
    return A.as_read(gs, "gs").reshape(())


def _scalars(a):
    """_arguments' first rule, on the scope and the gs alone (the op
    wrapper's host rule: a compiled call's bool gs gets the eager error)."""
    A.check_scope_gs(a["scope"], A.op_gs(a["gs"], a["gs_value"]), SCOPES, "tensor")


@op("nvfp4_quantize", "Tensor x, str scope, Tensor? gs, Scalar? gs_value, Tensor(a!) q, Tensor(b!) sf, "
                      "Tensor(c!)? gs_out, Tensor(d!)? errors", host=_scalars)
def _quantize(x, scope, gs, gs_value, q, sf, gs_out, errors, stream=None):
    """rawkv::nvfp4_quantize: writes q, sf and gs_out (which may be None
    only with a gs tensor: that is the gs) and, with a device gs, errors. A
    gs is a tensor `gs` or a number `gs_value`, at most one of them."""
    where, x, m, n, ldx, xdt, scope, gs, q, sf, gs_out, errors = _arguments(
        x, scope, gs, gs_value, q, sf, gs_out, errors)
    if where == "cpu":
        # the reference, written through host views of the outputs; errors=
        # is never added to (a host gs was checked)
        q[...], sf[...], g = ref.quantize(x, scope, gs, xdt)
        if gs_out is not None:
            gs_out[...] = g
        return
    rt = get_runtime(x.get_device())
    if errors is None and m * n and scope == "given" and gs.__class__ is not float:
        errors = rt.counter(counters.GIVEN_GS, stream)
    rt.run(plan(rt, x, q, sf, gs_out, m, n, ldx, scope, gs, errors), stream)


def _arguments(x, scope, gs, gs_value, q, sf, gs_out, errors):
    """(where, x, M, N, ldx, x's dtype name, scope, gs, q, sf, gs_out,
    errors) of rawkv::nvfp4_quantize, checked going down: the op's own
    rules, the argument layer's (each array; on CPU numpy views of them),
    then the format's (the reference's: N % 16, a gs the host holds). gs:
    None, a Python float or a float32 array of one element (a device one is
    the kernel's to check)."""
    scope, gs = A.check_scope_gs(scope, A.op_gs(gs, gs_value), SCOPES, "tensor")
    where = A.placement(("x", x), ("gs", gs), ("out[0]", q), ("out[1]", sf), ("out[2]", gs_out),
                        ("errors", errors))
    A.check_outputs((("out[0]", q), ("out[1]", sf), ("out[2]", gs_out), ("errors", errors)),
                    (("x", x), ("gs", gs)))
    x, m, n, ldx = A.rows(x, "x", A.FLOATS, where, align=16)
    xdt, dev, lead = A.dtype_name(x), A.device_of(x), tuple(x.shape[:-1])
    if gs is not None and gs.__class__ is not float:
        gs = A.gs_tensor(gs, where, dev)
    q = A.tensor(q, "out[0]", A.BYTES, where, shape=(*lead, n // 2), device=dev, align=16)
    sf = A.tensor(sf, "out[1]", A.BYTES, where, shape=(*lead, n // BLOCK), device=dev, align=16)
    if gs_out is None and (gs is None or gs.__class__ is float):
        raise ValueError("gs_out: required unless gs is a tensor (scope 'given'), which is then the gs")
    if gs_out is not None:
        gs_out = A.tensor(gs_out, "out[2]", ("float32",), where, shape=lead if scope == "row" else (),
                          device=dev, align=A.ELEMENT)
    if errors is not None:
        errors = A.counter(errors, where, dev)
    if where == "cpu":
        x, gs, q, sf, gs_out = A.host(x, gs, q, sf, gs_out)
    ref.check_last_dim(n, "x")
    if scope == "given" and (where == "cpu" or gs.__class__ is float):
        ref.check_given_gs(gs, xdt)
    return where, x, m, n, ldx, xdt, scope, gs, q, sf, gs_out, errors


# ---- global_scale: the gs alone ----------------------------------------------------------
def global_scale(x, *, out=None, stream=None):
    """The decode global scale of x (..., N), N % 16 == 0, under scope
    'tensor': amax over x's finite elements / 2688 (6 * 448: ModelOpt's
    weights_scaling_factor_2), 1 where that is 0, as a float32 tensor of
    shape () (numpy: a 0-d array), the gs quantize(x) returns, without
    encoding x. A calibration step takes it once, then quantizes with
    scope='given' (a computed gs is always usable for x's dtype). x as
    quantize takes it; out= a float32 buffer of shape ()."""
    if out is None:
        out = empty(x, (), "float32", stream)
    _global_scale(x, out, stream)
    return out


@op("nvfp4_global_scale", "Tensor x, Tensor(a!) gs_out")
def _global_scale(x, gs_out, stream=None):
    """rawkv::nvfp4_global_scale: x's scope-'tensor' gs into gs_out."""
    where, x, m, n, ldx, gs_out = _global_scale_arguments(x, gs_out)
    if where == "cpu":
        gs_out[...] = ref.global_scale(x, "tensor")
        return
    rt = get_runtime(x.get_device())
    rt.run(gs_plan(rt, x, gs_out, m, n, ldx), stream)


def _global_scale_arguments(x, gs_out):
    """(where, x, M, N, ldx, gs_out) of rawkv::nvfp4_global_scale (on CPU
    numpy views), checked as quantize's x and out gs."""
    where = A.placement(("x", x), ("out", gs_out))
    A.check_outputs((("out", gs_out),), (("x", x),))
    x, m, n, ldx = A.rows(x, "x", A.FLOATS, where, align=16)
    gs_out = A.tensor(gs_out, "out", ("float32",), where, shape=(), device=A.device_of(x), align=A.ELEMENT)
    if where == "cpu":
        x, gs_out = A.host(x, gs_out)
    ref.check_last_dim(n, "x")
    return where, x, m, n, ldx, gs_out


# ---- the global-scale scopes, planned once for every encoder --------------------------------
class Gs(NamedTuple):
    """The gs a 'given' / 'none' pass reads: `ptr` a device float32
    tensor (the kernel checks its value and adds refused calls to `errors`)
    or None, then `value`, a number the host checked."""
    ptr: object
    value: float
    errors: object


class Passes:
    """An encoder's passes, each a list of launches (rawkv._plan.Launch);
    `gs_out` is where the gs is written (scope 'tensor' zeroes it first)."""
    gs_out = None

    def row(self) -> list:
        raise NotImplementedError

    def whole_tensor(self) -> list | None:
        """Scope 'tensor' in one pass (a small tensor), or None: two passes."""
        return None

    def amax(self) -> list:
        raise NotImplementedError

    def from_amax(self) -> list:
        raise NotImplementedError

    def given(self, gs: Gs) -> list:
        raise NotImplementedError


def given(scope: str, gs, errors) -> Gs:
    """The Gs of scope 'given' (gs a checked Python float or a device
    tensor, whose refusals go to `errors`) or 'none' (1)."""
    if scope == "none" or gs is None:
        return Gs(None, 1.0, None)
    if gs.__class__ is float:
        return Gs(None, gs, None)
    return Gs(gs, 0.0, errors)


def empty_gs(scope: str, gs) -> Gs:
    """The gs an encode of no elements writes: 1 for 'row' and 'tensor'
    (the amax of nothing is 0, whose gs is 1), else the given one (a device
    gs copied unchecked: no block uses it)."""
    if scope in ("row", "tensor"):
        return Gs(None, 1.0, None)
    return given(scope, gs, None)


def plan_scope(scope: str, passes: Passes, gs=None, errors=None) -> list:
    """The launches of an encode of at least one element under `scope`
    (gs / errors: given()'s)."""
    if scope == "row":
        return passes.row()
    if scope == "tensor":
        one = passes.whole_tensor()
        if one is not None:
            return one
        return [Memset(passes.gs_out, 4), *passes.amax(), *passes.from_amax()]
    return passes.given(given(scope, gs, errors))


def gs_plan(dev, x, gs_out, m, n, ldx) -> list:
    """The launches of global_scale over (M, N) elements: scope 'tensor''s
    amax pass, then gs from it (no quantize pass); no element: gs 1."""
    if m * n == 0:
        return _no_elements(gs_out, "tensor", None)
    p = _Passes(dev, x, None, None, gs_out, m, n, ldx)
    return [Memset(gs_out, 4), *p.amax(), p.finalize()]


def _no_elements(gs_out, scope, gs) -> list:
    """The plan of an encode of no elements: only gs_out is written
    (empty_gs's gs, a Fill on the op's stream), if there is one (a device
    gs without gs_out is the gs)."""
    g = empty_gs(scope, gs)
    if gs_out is None:
        return []
    return [Fill(gs_out, g.value if g.ptr is None else g.ptr.reshape(()))]


def _io(p) -> dict:
    """The arguments every quantize kernel takes, of _Passes p."""
    return dict(x=p.x, q=p.q, sf=p.sf, M=p.m, upr=p.upr, ldx=p.ldx)


class _Passes(Passes):
    """rawkv.nvfp4.quantize's passes (rawkv.kernels.nvfp4) over x (M, N)
    rows `ldx` elements apart, on device `dev`."""

    def __init__(self, dev, x, q, sf, g, m, n, ldx):
        self.dev, self.gs_out = dev, g
        self.bpt = 2 if n % 32 == 0 else 1          # NVFP4 blocks per thread step
        self.upr = n // (BLOCK * self.bpt)
        self.x, self.q, self.sf, self.m, self.n, self.ldx, self.dt = x, q, sf, m, n, ldx, x.dtype

    def _rows(self, cap=BLOCK_THREADS):
        tpr, block, gpc = groups(self.upr, cap)
        return (grid(self.dev, self.m, block, gpc),), (block,), tpr

    def row(self):
        r = 1 if self.upr <= K.MAX_BLOCK_THREADS else 0
        g, b, tpr = self._rows(K.MAX_BLOCK_THREADS if r else BLOCK_THREADS)
        return [Launch(K.QUANTIZE_ROWS.instance(self.dt, self.bpt, r), g, b,
                       dict(_io(self), gs_out=self.gs_out, tpr_=tpr))]

    def whole_tensor(self):
        if self.m * self.n > SMALL_NUMEL:
            return None
        # Every CTA reduces the whole tensor before it quantizes: a chain of
        # dependent loads and maxima per thread, so the most threads a CTA
        # can have (at M = 8 rows of 7168: 10.6 us with 256, 7 per thread).
        block = K.MAX_BLOCK_THREADS
        ctas = max(1, min(-(-(self.m * self.upr) // block), _SMALL_MAX_CTAS))
        return [Launch(K.QUANTIZE_SMALL.instance(self.dt, self.bpt), (ctas,), (block,),
                       dict(_io(self), gs_out=self.gs_out))]

    def amax(self):
        vecs = self.m * self.n * self.x.element_size() // 16
        ctas, block = grid_stride(self.dev, vecs, BLOCK_THREADS, waves=1)
        return [Launch(K.AMAX.instance(self.dt), (ctas,), (block,),
                       dict(x=self.x, M=self.m, N=self.n, ldx=self.ldx, amax_bits=self.gs_out))]

    def from_amax(self):
        g, b, tpr = self._rows()
        return [Launch(K.QUANTIZE.instance(self.dt, self.bpt, K.MODE_AMAX), g, b,
                       dict(_io(self), tpr_=tpr, gs_ptr=self.gs_out, gs_val=0.0, gs_out=None, errors=None)),
                self.finalize()]

    def finalize(self):
        """gs from the amax the amax pass left in gs_out."""
        return Launch(K.FINALIZE_GS.instance(), (1,), (32,), dict(gs=self.gs_out))

    def given(self, gs):
        g, b, tpr = self._rows()
        return [Launch(K.QUANTIZE.instance(self.dt, self.bpt, K.MODE_GIVEN), g, b,
                       dict(_io(self), tpr_=tpr, gs_ptr=gs.ptr, gs_val=gs.value, gs_out=self.gs_out,
                            errors=gs.errors))]


def plan(dev, x, q, sf, gs_out, m, n, ldx, scope, gs=None, errors=None) -> list:
    """The launches of a quantize of (M, N) elements on device `dev`
    (rawkv._plan.Device or a Runtime): gs is written to gs_out (None only
    with a device gs, which is then the gs); errors is where a device gs's
    refusal is counted."""
    if m * n == 0:
        return _no_elements(gs_out, scope, gs)
    return plan_scope(scope, _Passes(dev, x, q, sf, gs_out, m, n, ldx), gs, errors)
