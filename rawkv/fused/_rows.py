"""The CUDA side of the row producers: their dtypes, out= buffers checked or
allocated, the launch geometry, and the launches of one scope (one CTA per
row, rawkv.kernels.fused RMS / SWIGLU; SET_GS when there is no row)."""
from __future__ import annotations

from .. import _args as A
from .. import _dispatch as D
from ..kernels import fused as K
from ..nvfp4 import _checks as NC
from ..nvfp4 import counters
from . import _rules as R


class Dtypes:
    """torch dtype groups of the fused ops, built once (per call they would
    cost microseconds on the launch path)."""

    def __init__(self, torch):
        d = A.dtypes()
        self.x = (torch.bfloat16, torch.float16)
        self.param = (torch.float32, torch.bfloat16, torch.float16)
        self.f32 = (torch.float32,)
        self.ids = (torch.int32, torch.int64)
        self.i32 = (torch.int32,)
        self.i64 = (torch.int64,)
        self.q = tuple(t for t in d.bytes if t is not d.e4m3)
        self.sf = tuple(t for t in d.bytes if t is not d.e2m1x2)
        self.u8 = torch.uint8
        self.q_view = d.e2m1x2 or torch.uint8       # the dtypes rawkv.nvfp4.quantize returns
        self.sf_view = d.e4m3 or torch.uint8
        self.kind = {getattr(torch, n): k for n, k in K.PARAM_KIND.items()}
        self.name = d.name


_DT = None


def dtypes() -> Dtypes:
    global _DT
    if _DT is None:
        import torch
        _DT = Dtypes(torch)
    return _DT


def cuda_arg(t, name, dts, dev=None, align=0, shape=None):
    """A CUDA tensor argument (DLPack arrays wrapped): one of dtypes `dts`,
    on device `dev`, contiguous, of `shape` and its data `align`-byte
    aligned where those are given."""
    t = D.as_cuda_tensor(t, name)
    A.check_tensor(t, name, dts, shape=shape, device=dev)
    if align:
        A.check_aligned(name, t, align)
    return t


def gs_arg(gs, x_dtype, dev):
    """(pointer, value) of a given gs for the kernels: (a 1-element device
    float32 tensor, 0.0), which the kernel checks (launch_rows), or (None,
    the number), checked here under the bound of x_dtype inputs."""
    if gs.__class__ is float:
        NC.check_given_gs_number(gs, dtypes().name[x_dtype])     # rawkv.nvfp4's rule
        return None, gs
    return cuda_arg(gs, "gs", dtypes().f32, dev), 0.0


def outputs(rt, lead, n, scope, dev, out_q, out_sf, out_gs, out_inv, want_inv, stream):
    """q, sf, gs (and inv_rms) for rows `lead` of width n: the out= buffers
    checked (all of them before anything is allocated), the rest allocated."""
    dt = dtypes()
    if out_inv is not None and not want_inv:
        raise ValueError("out.inv_rms: this op has no inv_rms output")
    gshape = R.gs_shape(scope, lead, out_gs)
    q = None if out_q is None else cuda_arg(out_q, "out.q", dt.q, dev, 8, (*lead, n // 2))
    sf = None if out_sf is None else cuda_arg(out_sf, "out.sf", dt.sf, dev, 1, (*lead, n // 16))
    gs = None if out_gs is None else cuda_arg(out_gs, "out.gs", dt.f32, dev, 4, gshape)
    inv = None if out_inv is None else cuda_arg(out_inv, "out.inv_rms", dt.f32, dev, 4, lead)
    if q is None:
        q = rt.empty((*lead, n // 2), dt.u8, stream).view(dt.q_view)
    if sf is None:
        sf = rt.empty((*lead, n // 16), dt.u8, stream).view(dt.sf_view)
    if gs is None:
        gs = rt.empty(gshape, dt.f32[0], stream)
    if want_inv and inv is None:
        inv = rt.empty(lead, dt.f32[0], stream)
    return q, sf, gs, inv


def block_for(rt, rows: int, chunks: int) -> int:
    """Threads per row CTA: one 16-element chunk per thread when rows are few
    (latency), else up to REG chunks per thread (fewer, fuller threads);
    never more than K.MAX_BLOCK."""
    r32 = lambda v: max(32, -(-v // 32) * 32)  # noqa: E731
    if rows < 2 * rt.sm_count:
        return min(K.MAX_BLOCK, r32(chunks))
    return min(K.MAX_BLOCK, max(r32(-(-chunks // K.REG)), min(r32(chunks), 64)))


# scope -> the row kernel's mode(s), in launch order
_MODES = {"row": (K.MODE_ROW,), "tensor": (K.MODE_AMAX, K.MODE_TENSOR),
          "given": (K.MODE_FIXED,), "none": (K.MODE_FIXED,)}


def launch_rows(rt, inst, rows, chunks, scope, gs_in, gs_val, gs_out, stream, **kw) -> None:
    """Launch row kernel `inst` (an Instance of K.RMS or K.SWIGLU) with the
    mode(s) of `scope`; `kw` are its other parameters. (gs_in, gs_val) is
    gs_arg's pair for scope 'given'; 'none' is the value 1. A device gs_in
    that the kernel finds unusable is counted in rawkv.nvfp4's error
    counter, slot GIVEN_GS (a number was checked on the host)."""
    if scope == "none":
        gs_val = 1.0
    if rows == 0:
        # No row CTA runs, and the row kernel is what writes gs: one thread
        # writes it on `stream` (a torch fill_ would run on torch's current
        # stream, out of order with the caller's `stream`). Scope 'row': no gs.
        if scope != "row":
            K.SET_GS.instance().launch(rt, (1,), (1,), stream=stream, gs_out=gs_out,
                                       gs_in=gs_in, gs_val=1.0 if scope == "tensor" else gs_val)
        return
    block = (block_for(rt, rows, chunks),)
    if scope == "tensor":
        rt.memset(gs_out.data_ptr(), 0, 4, stream)
    errors = None if gs_in is None else counters.address(rt, counters.GIVEN_GS, stream)
    for mode in _MODES[scope]:
        inst.launch(rt, (rows,), block, stream=stream, gs_out=gs_out, gs_in=gs_in, gs_val=gs_val,
                    mode=mode, errors=errors, **kw)
