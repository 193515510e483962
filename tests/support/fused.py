"""Fused-producer test helpers: inputs with edge blocks planted, and the
comparisons of CUDA results with the reference (docs/fused.md, "Tolerances").

GPU tolerances (the comparisons below):
* swiglu_quantize, moe_stage, and every scope: bit-exact. Their math has no
  reduction other than max (order-independent) and silu uses rawkv's
  deterministic float32 exp, identical op by op in kernel and reference.
* rmsnorm_quantize / mhc_rmsnorm_quantize: the sum of squares is a float64
  reduction in another order than numpy's. inv_rms must be within 1 float32
  ulp of the reference on every row (in practice equal: the float64 sums agree
  to ~1e-16 relative, so f32(ss/N) only differs when ss/N lies that close to
  a float32 rounding boundary), and the whole output must be bit-exact
  against the reference evaluated with the kernel's own inv_rms. Against the
  plain reference, codes may differ only on rows whose inv_rms differs (scope
  row / given / none: rows are independent; scope tensor: one such row can
  move the shared gs, so then any row may differ). Those rows are reported (a
  warning) and bounded: <= max(1, rows // 100). Why that bound: a row differs
  only when ss/N lies within ~1e-16 (relative) of a float32 rounding boundary
  (spacing 2^-24 ~ 6e-8), about 3e-9 per row, so 0 is expected; the bound lets
  one such rare row pass and fails anything systematic (a float32 sum, another
  eps) that would change most rows."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv.fused import plans as _rows  # noqa: E402
from rawkv.kernels import fused as K  # noqa: E402


def _np(t):
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.float().cpu().numpy()
    if t.dtype == getattr(torch, "float8_e4m3fn", None) or t.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


def _b(t):
    """Byte view of FP8/FP4 tensors (few torch ops support those dtypes)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _dt(t):
    return str(t.dtype).replace("torch.", "")


F32 = np.float32


def _rand(rng, shape, dtype, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(F32)
    return torch.from_numpy(x).to(dtype).cuda()


def _with_edges(x, kind):
    """Plant edge values in rows of a 2-D (or 3-D: along the last axis) tensor."""
    x = x.clone()
    v = x.view(-1, x.shape[-1])
    r = v.shape[0]
    if kind == "zero_row":
        v[0] = 0
        if r > 2:
            v[r // 2] = -0.0
    elif kind == "nan":
        v[0, 3] = float("nan")
        if r > 1:
            v[r - 1, 17 % v.shape[1]] = float("inf")
            v[r - 1, 0] = float("-inf")
    elif kind == "huge":
        v[0] *= 1e30 if x.dtype == torch.bfloat16 else 100.0
        v[0, 5] = 3.0e38 if x.dtype == torch.bfloat16 else 60000.0
    elif kind == "tiny":
        v[0] *= 1e-35 if x.dtype == torch.bfloat16 else 1e-6
        if r > 1:
            v[1, :16] = 1e-38 if x.dtype == torch.bfloat16 else 6e-8
    return x


def _assert_equal(name, got, want, extra=""):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if got.dtype.kind == "f":
        same = (got.view(np.uint32) == want.astype(got.dtype).view(np.uint32))
    else:
        same = got == want
    n = int((~same).sum())
    assert n == 0, f"{name}: {n} of {same.size} differ {extra}; first at {np.argwhere(~same)[:5].tolist()}"


def _check_rms(qa, ref_fn, rows, lead, scope="row"):
    """Check a RMSNorm producer's result against the reference (see module doc)."""
    inv_k = _np(qa.inv_rms).reshape(rows)
    q0, sf0, gs0, inv0 = ref_fn(None)
    inv0 = np.asarray(inv0).reshape(rows)
    fin = np.isfinite(inv0)
    assert np.array_equal(np.isfinite(inv_k), fin)
    ulp = np.abs(inv_k[fin].astype(np.float64) - inv0[fin]) / np.spacing(inv0[fin]).astype(np.float64)
    assert ulp.size == 0 or ulp.max() <= 1.0, f"inv_rms differs by {ulp.max()} ulp"
    inv_diff = fin & (inv_k.view(np.uint32) != inv0.view(np.uint32))    # NaN rows: any NaN is equal
    # bit-exact against the reference with the kernel's inv_rms
    q1, sf1, gs1, _ = ref_fn(inv_k.reshape(lead))
    _assert_equal("q", _np(qa.q).reshape(rows, -1), q1.reshape(rows, -1))
    _assert_equal("sf", _np(qa.sf).reshape(rows, -1), sf1.reshape(rows, -1))
    _assert_equal("gs", _np(qa.gs), np.asarray(gs1, F32).reshape(_np(qa.gs).shape))
    # against the plain reference: which rows' codes / scales differ, and why
    code_diff = ((_np(qa.q).reshape(rows, -1) != q0.reshape(rows, -1)).any(axis=1)
                 | (_np(qa.sf).reshape(rows, -1) != sf0.reshape(rows, -1)).any(axis=1))
    n_inv = int(inv_diff.sum())
    if n_inv:
        warnings.warn(f"{n_inv} of {rows} rows have an inv_rms 1 ulp from the reference "
                      f"(rows {np.flatnonzero(inv_diff)[:5].tolist()}); {int(code_diff.sum())} rows' "
                      "codes differ from the plain reference")
    assert n_inv <= max(1, rows // 100), f"{n_inv} of {rows} rows have another inv_rms (see module doc)"
    if scope == "tensor":        # one shared gs: a changed row may move every row's codes
        assert n_inv or not code_diff.any(), "codes differ though every inv_rms is equal"
    else:                        # rows are independent
        bad = np.flatnonzero(code_diff & ~inv_diff)
        assert bad.size == 0, f"rows {bad[:5].tolist()} differ from the reference with an equal inv_rms"


# ---- long rows (chunks past REG * blockDim are recomputed from memory) with
# Inf/NaN blocks that also hold finite values, in both ranges ------------------------
_LONG = 40960            # 2560 chunks; 3 rows get 768-thread CTAs, 2 chunks each in registers


_BIG_COLS = (100, 103, 30001, 30007, _LONG - 2)    # chunks 6, 6, 1875, 1875, 2559


def _huge_weight(rng, x, dtype):
    """RMSNorm weight (float32) whose few huge entries overflow y in T where
    x is set to 8 (columns 100, 30001, n-2): Inf elements next to finite ones
    (huge or not) in register-held and recomputed blocks."""
    w = rng.random(_LONG).astype(F32) + 0.5
    big = 1e38 if dtype == torch.bfloat16 else 1e6
    for c in _BIG_COLS:
        w[c] = big
    for c in _BIG_COLS[::2]:
        x[..., c] = 8.0
    return torch.from_numpy(w).cuda()


# ---- prefill launch layout: rows >= 2 x SMs switch block_for to REG (2) chunks per
# thread; at N = 2064 (129 chunks, 96 threads) the last thread's second chunk is
# absent. Scope tensor: every row CTA adds to the cross-CTA atomic amax. ----------
_PREFILL_N = [2064, 7168]


def _prefill_rows(cuda, n):
    """Rows that take the prefill layout on this GPU (any SM count), checked."""
    rows = 2 * cuda.sm_count + 37
    chunks = n // 16
    block = _rows.block_for(cuda, rows, chunks)
    assert block != _rows.block_for(cuda, 1, chunks)        # not the decode layout
    assert block < chunks <= K.REG * block                  # two chunks per thread, all in registers
    return rows


def _plant(x):
    """Edges in a (rows, ..., N) tensor: NaN / Inf blocks, a zero row, and a NaN in
    the last column (the partial second chunk at N = 2064)."""
    x = _with_edges(x, "nan")
    x[2] = 0
    x[3, ..., -1] = float("nan")
    return x


def _inputs(rng, m, n, n_hc, two_i, h_dtype, topk):
    """x (m, n), weight (n,), X (m, n_hc, n), mix (m, n_hc), h (m, two_i),
    hidden (m, n), topk_ids (m, topk) int32 and topk_weights of every op."""
    return (_rand(rng, (m, n), torch.bfloat16), torch.from_numpy(rng.random(n).astype(F32) + 0.5).cuda(),
            _rand(rng, (m, n_hc, n), torch.bfloat16), torch.from_numpy(rng.random((m, n_hc)).astype(F32)).cuda(),
            _rand(rng, (m, two_i), h_dtype), _rand(rng, (m, n), torch.bfloat16),
            torch.zeros(m, topk, dtype=torch.int32, device="cuda"), torch.rand(m, topk, device="cuda"))


def _names(msg: str, arg: str) -> bool:
    """The message starts with the argument's name (then ':', ' ' or '(')."""
    return re.match(rf"{re.escape(arg)}[:\s(]", msg) is not None


def _x(*s):
    return np.zeros(s, F32)


def same_result(a, b) -> bool:
    """Same structure, types, shapes, dtypes and bits (a traced op's result
    against the eager one's)."""
    if isinstance(a, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_result(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    u8 = torch.uint8
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(u8) if a.element_size() == 1 else a, b.view(u8) if b.element_size() == 1 else b))
