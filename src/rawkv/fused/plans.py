"""The launch plans of the fused producers: pure functions from the checked
arguments and the device properties (`dev`: a rawkv._plan.Device, or the
Runtime) to the launches (rawkv._plan.Launch, Memset). The row producers'
global-scale scopes are rawkv.nvfp4.encode's (plan_scope), shared with
rawkv.nvfp4.quantize; each pass is one launch of a row kernel (one CTA per
row, rawkv.kernels.fused RMS / SWIGLU) in the scope's mode. The FP8 block
outputs (*_fp8) have no global scale: one launch each."""
from __future__ import annotations

from .. import _args as A
from .. import fp8 as FP8
from .._plan import Launch, grid_stride
from ..kernels import fp8_blocks as KB
from ..kernels import fused as K
from ..nvfp4.encode import Gs, Passes, empty_gs, plan_scope


def block_for(dev, rows: int, chunks: int) -> int:
    """Threads per row CTA: one 16-element chunk per thread when rows are few
    (latency), else up to REG chunks per thread (fewer, fuller threads);
    never more than K.MAX_BLOCK."""
    r32 = lambda v: max(32, -(-v // 32) * 32)  # noqa: E731
    if rows < 2 * dev.sm_count:
        return min(K.MAX_BLOCK, r32(chunks))
    return min(K.MAX_BLOCK, max(r32(-(-chunks // K.REG)), min(r32(chunks), 64)))


_NO_GS = Gs(None, 0.0, None)


class _RowPasses(Passes):
    """The passes of row kernel instance `inst` with its other arguments
    `args`: each pass one launch in a mode."""

    def __init__(self, dev, inst, rows, chunks, gs_out, args):
        self.inst, self.args, self.gs_out = inst, args, gs_out
        self.grid, self.block = (rows,), (block_for(dev, rows, chunks),)

    def _pass(self, mode, gs=_NO_GS):
        return [Launch(self.inst, self.grid, self.block, dict(
            self.args, gs_out=self.gs_out, gs_in=gs.ptr, gs_val=gs.value, mode=mode, errors=gs.errors))]

    def row(self):
        return self._pass(K.MODE_ROW)

    def amax(self):
        return self._pass(K.MODE_AMAX)

    def from_amax(self):
        return self._pass(K.MODE_TENSOR)

    def given(self, gs):
        return self._pass(K.MODE_FIXED, gs)


def _rows(dev, inst, a, errors, args) -> list:
    """A row producer's launches (a: rawkv.fused._rules.Rows). No row: no
    row kernel runs, and that is what writes gs; one thread writes it on the
    op's stream (scope 'row': there is no gs)."""
    if a.rows == 0:
        if a.scope == "row":
            return []
        g = empty_gs(a.scope, a.gs)
        return [Launch(K.SET_GS.instance(), (1,), (1,), dict(gs_out=a.gs_out, gs_in=g.ptr, gs_val=g.value))]
    passes = _RowPasses(dev, inst, a.rows, a.n // 16, a.gs_out, args)
    return plan_scope(a.scope, passes, a.gs, errors)


def rms(dev, a, mix, weight, eps, n_hc, errors=None) -> list:
    """rmsnorm_quantize / mhc_rmsnorm_quantize (mix None: the plain form);
    errors: where a device gs's refusal is counted."""
    inst = K.RMS.instance(a.x.dtype, mix is not None, K.REG)
    return _rows(dev, inst, a, errors, dict(_rms_inputs(a, mix, weight, eps, n_hc), q=a.q, sf=a.sf, inv_out=a.inv))


def _rms_inputs(a, mix, weight, eps, n_hc) -> dict:
    """The RMSNorm row kernels' input arguments (NVFP4 and FP8 alike)."""
    mixed = mix is not None
    return dict(x=a.x, mix=mix, mix_kind=K.PARAM_KIND[A.dtype_name(mix)] if mixed else 0, n_hc=n_hc, w=weight,
                w_kind=K.PARAM_KIND[A.dtype_name(weight)], eps=eps, n=a.n)


def swiglu(dev, a, g, vec, errors=None) -> list:
    """swiglu_quantize, granularity g (vec: runs of 8 columns, 16-byte loads)."""
    inst = K.SWIGLU.instance(a.x.dtype, vec, K.REG)
    return _rows(dev, inst, a, errors, dict(h=a.x, inter=a.n, g=g, q=a.q, sf=a.sf))


def moe_stage(dev, hidden, topk_ids, topk_weights, q, sf, ids_out, w_out) -> list:
    """moe_stage: a thread takes half a scale unit (32 elements)."""
    n_units = q.shape[0] * sf.shape[1]          # 64 elements, one scale word
    return _moe(dev, K.MOE_STAGE, 2 * n_units, hidden, topk_ids, topk_weights, ids_out, w_out,
                dict(x=hidden, n_units=n_units, q=q, sf=sf))


def _moe(dev, kernel, units, hidden, topk_ids, topk_weights, ids_out, w_out, args, *targs) -> list:
    """A MoE staging launch of `kernel` (its quantizer's other arguments
    `args`, template arguments past the dtypes `targs`): one grid-stride
    launch over the larger of the quantizer's `units` (one per thread), the
    ids and the weight bytes."""
    n_ids = topk_ids.numel()
    w_bytes = topk_weights.numel() * topk_weights.element_size()
    work = max(units, n_ids, w_bytes)
    if not work:
        return []
    grid, block = grid_stride(dev, work, block=K.MOE_BLOCK)
    return [Launch(kernel.instance(hidden.dtype, topk_ids.dtype, *targs), (grid,), (block,), dict(
        args, ids=topk_ids, n_ids=n_ids, ids_out=ids_out, wts=topk_weights, w_bytes=w_bytes, wts_out=w_out))]


# ---- the FP8 block outputs (one launch; no global scale, so no pass of an amax) --------------------
def _fp8(block, fmt, codes, scales) -> dict:
    """An FP8 kernel's output arguments: the block, SBYTE of the scale
    format (UE8M0, SBYTE) as a run-time flag (UE8M0 is the instance's
    template constant), codes, and scales at their row and block strides
    (rawkv.fp8.scale_strides: any layout check_scales takes)."""
    s_row, s_blk = FP8.scale_strides(scales)
    return dict(blk=block, sbyte=int(fmt[1]), codes=codes, scales=scales, s_row=s_row, s_blk=s_blk)


def _row_launch(dev, inst, a, args) -> list:
    """One CTA per row (none for no rows)."""
    if a.rows == 0:
        return []
    return [Launch(inst, (a.rows,), (block_for(dev, a.rows, a.n // 16),), dict(args, **_fp8(a.block, a.fmt, a.codes, a.scales)))]


def rms_fp8(dev, a, mix, weight, eps, n_hc) -> list:
    """rmsnorm_quantize_fp8 / mhc_rmsnorm_quantize_fp8 (mix None: the plain form)."""
    inst = K.RMS_FP8.instance(a.x.dtype, mix is not None, K.REG, bool(a.fmt[0]))
    return _row_launch(dev, inst, a, dict(_rms_inputs(a, mix, weight, eps, n_hc), inv_out=a.inv))


def swiglu_fp8(dev, a, g, vec) -> list:
    """swiglu_quantize_fp8, granularity g (vec: runs of 8 columns, 16-byte loads)."""
    return _row_launch(dev, K.SWIGLU_FP8.instance(a.x.dtype, vec, K.REG, bool(a.fmt[0])), a,
                       dict(h=a.x, inter=a.n, g=g))


def moe_stage_fp8(dev, hidden, topk_ids, topk_weights, codes, scales, ids_out, w_out, block, fmt) -> list:
    """moe_stage_fp8: fp8_blocks.cuh's quantizer (a thread per 16 channels
    of hidden), the top-k copy in the same launch."""
    rows, k = hidden.shape
    return _moe(dev, K.MOE_STAGE_FP8, KB.quantize_threads(rows, k, block), hidden, topk_ids, topk_weights,
                ids_out, w_out, dict(x=hidden, rows=rows, K=k, **_fp8(block, fmt, codes, scales)), bool(fmt[0]))
