"""compress_decode: the decode windows that are complete -> entries in the
paged pool, one rkv_kv_compress launch per step (capturable;
reference.paged_compress_decode defines the flush rule)."""
from __future__ import annotations

from .. import _args as A
from .. import _dispatch as D
from .. import _plan
from .._opdecl import OpDecl
from ..kernels import kv_compress as K
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import checks as C
from . import plans as P
from . import views as V
from .compressor import (
    DecodeIndex, check_compressible, index_arg, rope_table, yarn_list, yarn_of,
)


def _check_state_of(pool, state, name: str, kind: str, head_dim: int) -> None:
    """A decode state that belongs to `pool`: its kind and head_dim, one row
    per request slot of the pool (slots index the state AND the block
    table), on the pool's device."""
    C.check_state(state, name)
    if state.kind != kind:
        raise ValueError(f"{name}: is a {state.kind!r} state but the pool needs a {kind!r} one")
    if state.head_dim != head_dim:
        raise ValueError(f"{name}: has head_dim {state.head_dim}, expected {head_dim}")
    if state.max_requests != pool.max_requests:
        raise ValueError(f"{name}: has {state.max_requests} slots but the pool has max_requests = "
                         f"{pool.max_requests}; a decode state must have one row per request slot "
                         "of its pool")
    if state.device_index != pool.device_index:
        raise ValueError(f"{name}: is on {state.device} but the pool is on {pool.device}")


def _check_attached(pool, state, name: str) -> None:
    """A pool object's decode state is attached to it (pool.attach), so its
    slots are emptied when they change owner. A view (the kv_compress_decode
    operator's buffers) has no host bookkeeping: its engine owns admission
    (docs/kvcache.md, "Admission")."""
    if pool._states is None:
        return
    C.check_state(state, name)
    if state._pool is not pool:
        raise ValueError(f"{name}: is not attached to this pool; call pool.attach(state) when the layer "
                         "is built (the pool then empties a slot's decode state when the slot changes "
                         "owner, so no request's entry is pooled from another's rows)")


def compress_decode(pool, state, norm_weight, valid_mask, slots, positions, *, index=None,
                    eps: float = ref.RMS_EPS, theta: float = ref.COMPRESS_ROPE_THETA,
                    yarn=ref.DSV4_YARN, stream=None) -> None:
    """Flush the decode windows that are complete, in one launch (capturable).

    For each batch row b with valid_mask[b] and slot s = slots[b] whose window
    is complete (state.count[s] == m, read on the device; incomplete windows
    are skipped silently), pool the tail state (CSA: b-stream, then the
    a-half of the a-stream; HCA: the a-stream), finish and quantize the entry
    e = positions[b] // m, write it through pool.block_table[s] and raise
    pool.written[s] to e + 1. An out-of-range slot, a negative position, or
    an entry outside the block table / pool is skipped and counted in
    pool.errors. The caller then runs csa_rotate / hca_reset for the rows
    that flushed.

    state:       DecodeState of the pool's kind and head_dim, one row per
                 request slot of the pool (max_requests rows: slot s of the
                 state is slot s of the block table), attached to the pool
                 (pool.attach; ValueError otherwise).
    norm_weight: (d,) float32.
    valid_mask:  (B,) bool; slots, positions: (B,) int32 or int64 (same dtype).
    index:       CSA: DecodeIndex(index_state, index_norm_weight), the same
                 number of rows. The entry and its key are one unit: a row
                 flushes when both windows are complete; when exactly one is
                 (the two states are out of step, a caller error) nothing is
                 written and one error is counted.
    eps:         RMSNorm epsilon, a finite number > 0.
    """
    C.check_pool(pool)
    check_compressible(pool)
    theta, yarn = ref.check_rope(theta, yarn)      # every path, before any launch
    if D.compiling():
        ist, inw = (None, None) if index is None else index
        _check_attached(pool, state, "state")
        if ist is not None:
            _check_attached(pool, ist, "index.state")
        return V.call(DECODE_OP, **V.pool_args(pool), **V.state_args(state, counter=False),
                      **V.state_args(ist, prefix="index_", counter=False), norm_weight=norm_weight,
                      valid_mask=valid_mask, slots=slots, positions=positions, index_norm_weight=inw,
                      eps=eps, theta=theta, yarn=yarn_list(yarn))
    eps = A.check_eps(eps)
    index = index_arg(pool, index, DecodeIndex)
    _check_state_of(pool, state, "state", pool.kind, pool.head_dim)
    if index is not None:
        _check_state_of(pool, index.state, "index.state", "csa", K.INDEX_HEAD_DIM)
    _check_attached(pool, state, "state")
    if index is not None:
        _check_attached(pool, index.state, "index.state")
    dev = pool.device_index
    v = C.arg(valid_mask, "valid_mask", C.BOOL, dev, ndim=1)
    B = v.shape[0]
    s = C.arg(slots, "slots", C.IDS, dev, shape=(B,))
    p = C.arg(positions, "positions", (str(s.dtype).replace("torch.", ""),), dev, shape=(B,))
    nw = C.arg(norm_weight, "norm_weight", C.F32, dev, shape=(pool.head_dim,))
    inw = None if index is None else C.arg(index.norm_weight, "index.norm_weight", C.F32, dev,
                                           shape=(K.INDEX_HEAD_DIM,))
    if dev is None:
        ix = None if index is None else (index.state.reference_view(), inw)
        C.add_errors(pool.errors, ref.paged_compress_decode(
            pool.reference_view(), state.reference_view(), nw, v, s, p, index=ix, eps=eps,
            theta=theta, yarn=yarn))
        return None
    if B == 0:
        return None
    tab = rope_table(pool, theta=theta, yarn=yarn, stream=stream)
    _plan.run(get_runtime(dev), P.compress_decode(pool, state, nw, None if index is None else index.state, inw,
                                                  v, s, p, tab, eps), stream)
    return None


def _decode_op(norm_weight, valid_mask, slots, positions, index_norm_weight, eps, theta, yarn, **kw):
    state, ist = V.take_state(kw), V.take_state(kw, "index_")
    index = None if ist is None and index_norm_weight is None else DecodeIndex(ist, index_norm_weight)
    compress_decode(V.pool_view(**kw), state, norm_weight, valid_mask, slots, positions, index=index,
                    eps=eps, theta=theta, yarn=yarn_of(yarn))


DECODE_OP = OpDecl("kv_compress_decode", _decode_op, V.schema(
    V.pool_schema(True), V.state_schema(False, counter=False),
    "Tensor norm_weight, Tensor valid_mask, Tensor slots, Tensor positions",
    V.state_schema(False, "index_", counter=False, optional=True),
    "Tensor? index_norm_weight, float eps, float theta, float[]? yarn"))
