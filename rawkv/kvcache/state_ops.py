"""Ops on the decode state: admission (state_seed), append, and the resets
after a flush (csa_rotate, hca_reset) or for a new request (state_clear).
Kernels: rkv_kv_state_append, rkv_kv_state_reset; state_seed is a few torch
ops. reference.state_* define them."""
from __future__ import annotations

from .. import _dispatch as D
from .. import _plan
from .._opdecl import OpDecl
from ..kernels import kv_cache as K
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import checks as C
from . import plans as P
from . import views as V


def state_seed(state, slot, kv, z, *, ape=None, stream=None):
    """Admit a request into `slot` of the decode state after its prompt was
    prefilled (reference.state_seed): the slot is emptied, then seeded with
    the tail the prompt leaves, exactly as if every prompt token had gone
    through state_append and every full window through csa_rotate /
    hca_reset: with n = T // m, r = T % m, CSA's b-stream = b-half of window
    n-1 (z + ape), a-stream rows 0..r-1 = the trailing r rows (z + ape),
    count = r. T = 0 (a request with no prompt) just empties the slot.

    slot: host int in [0, max_requests) (ValueError otherwise); kv, z
    (T, coff*head_dim) float32 or bfloat16, row 0 at a window boundary (the
    whole prompt, or a suffix starting at a multiple of m that holds, for
    CSA, the last full window); ape (m, coff*head_dim) float32 or None.
    Run it at every admission: the pool's free_request empties the slot of
    its attached states, but only state_seed puts the prompt's tail there.
    CUDA: a few small torch ops (fills, copies, adds) on the current stream
    (or `stream`): no allocation, no host synchronization, capturable."""
    C.check_state(state)
    if D.compiling():
        return V.call(SEED_OP, **V.state_args(state, counter=False), slot=slot, kv=kv, z=z, ape=ape)
    slot = C.host_int("slot", slot, 0, state.max_requests)
    m, d, w = state.m, state.head_dim, state.width
    dev = state.device_index
    k = C.arg(kv, "kv", C.ROWS, dev, ndim=2)
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape (T, {w}), got {tuple(k.shape)}")
    zz = C.arg(z, "z", C.ROWS, dev, shape=tuple(k.shape))
    a = C.opt(ape, "ape", C.F32, dev, shape=(m, w))
    if dev is None:
        ref.state_seed(state.reference_view(), slot, k, zz, ape=a)
        return
    import torch
    n, r = divmod(k.shape[0], m)
    ts = get_runtime(dev).torch_stream(stream)
    if ts is None:
        ts = torch.cuda.current_stream(dev)

    def put_z(dst, src, ape_rows):
        # z + ape in float32 (BF16 z converts exactly): the reference's add
        if ape_rows is None:
            dst.copy_(src)
        else:
            torch.add(src, ape_rows, out=dst)

    with torch.cuda.device(dev), torch.cuda.stream(ts):
        state._empty(slot)
        if state.overlap and n >= 1:
            rows = slice((n - 1) * m, n * m)
            state.kv_b[slot].copy_(k[rows, :d])
            put_z(state.z_b[slot], zz[rows, :d], None if a is None else a[:, :d])
        if r:
            state.kv_a[slot, :r].copy_(k[n * m:])
            put_z(state.z_a[slot, :r], zz[n * m:], None if a is None else a[:r])
            state.count[slot:slot + 1].fill_(r)


def state_append(state, kv, z, valid_mask, slots, *, ape=None, errors=None, stream=None):
    """Append one token row per batch row to its request's a-stream
    (reference.state_append): row count[s] of slot s = kv[b], z[b] + ape[count[s]],
    count[s] += 1. kv, z (B, coff*head_dim) float32 or bfloat16; ape
    (m, coff*head_dim) float32 or None; valid_mask (B,) bool; slots (B,)
    int32. A valid row with an out-of-range slot or a full window
    (count == m: a missed flush) is skipped and adds 1 to errors. Duplicate
    slots among valid rows (a caller error): the lowest row appends, the
    others are skipped and add 1 each. One launch."""
    C.check_state(state)
    if D.compiling():
        return V.call(APPEND_OP, **V.state_args(state, errors), kv=kv, z=z, valid_mask=valid_mask,
                      slots=slots, ape=ape)
    dev = state.device_index
    w = state.width
    k = C.arg(kv, "kv", C.ROWS, dev, ndim=2, aligned=True)
    B = k.shape[0]
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape ({B}, {w}), got {tuple(k.shape)}")
    zz = C.arg(z, "z", C.ROWS, dev, shape=(B, w), aligned=True)
    v = C.arg(valid_mask, "valid_mask", C.BOOL, dev, shape=(B,))
    s = C.arg(slots, "slots", C.I32, dev, shape=(B,))
    a = C.opt(ape, "ape", C.F32, dev, shape=(state.m, w), aligned=True)
    err = C.errors_arg(errors, state.errors, dev)
    C.check_outputs((("errors", C.counter(errors, state)),),
                    (("kv", k), ("z", zz), ("valid_mask", v), ("slots", s), ("ape", a)), C.owned(state, "state"))
    if dev is None:
        C.add_errors(err, ref.state_append(state.reference_view(), k, zz, v, s, ape=a))
        return
    if B:
        _plan.run(get_runtime(dev), P.state_append(state, k, zz, a, v, s, err), stream)


def _reset(state, mode, valid_mask, slots, errors, stream):
    if valid_mask is None and mode != K.RESET_CLEAR:
        raise TypeError("valid_mask: is required")
    if D.compiling():
        return V.call(RESET_OPS[mode], **V.state_args(state, errors), valid_mask=valid_mask, slots=slots)
    dev = state.device_index
    s = C.arg(slots, "slots", C.I32, dev, ndim=1)
    B = s.shape[0]
    v = C.opt(valid_mask, "valid_mask", C.BOOL, dev, shape=(B,))
    err = C.errors_arg(errors, state.errors, dev)
    C.check_outputs((("errors", C.counter(errors, state)),), (("slots", s), ("valid_mask", v)),
                    C.owned(state, "state"))
    if dev is None:
        st = state.reference_view()
        if mode == K.RESET_CLEAR:
            n = ref.state_clear(st, s, v)
        else:
            n = (ref.csa_rotate if mode == K.RESET_CSA else ref.hca_reset)(st, v, s)
        C.add_errors(err, n)
        return
    if B:
        _plan.run(get_runtime(dev), P.state_reset(state, mode, v, s, err), stream)


def csa_rotate(state, valid_mask, slots, *, errors=None, stream=None):
    """After a CSA flush, for each valid row: b <- b-half of the a rows
    (channels [0:head_dim]), a emptied (kv 0, z -inf), count 0
    (reference.csa_rotate). Out-of-range slot, or a duplicate of a lower
    valid row's slot: skipped, errors += 1. One launch."""
    C.check_state(state)
    if not state.overlap:
        raise ValueError("state: csa_rotate needs a CSA state (use hca_reset for HCA)")
    _reset(state, K.RESET_CSA, valid_mask, slots, errors, stream)


def hca_reset(state, valid_mask, slots, *, errors=None, stream=None):
    """After an HCA flush, for each valid row: a emptied (kv 0, z -inf),
    count 0 (reference.hca_reset). Out-of-range slot: skipped, counted."""
    C.check_state(state)
    if state.overlap:
        raise ValueError("state: hca_reset needs an HCA state (use csa_rotate for CSA)")
    _reset(state, K.RESET_HCA, valid_mask, slots, errors, stream)


def state_clear(state, slots, *, valid_mask=None, errors=None, stream=None):
    """New requests in `slots`: both streams emptied, count 0
    (reference.state_clear); valid_mask None = every row. Out-of-range slot:
    skipped, counted. state_seed does this and seeds the prompt's tail."""
    C.check_state(state)
    _reset(state, K.RESET_CLEAR, valid_mask, slots, errors, stream)


def _seed_op(slot, kv, z, ape, **state):
    state_seed(V.state_view(**state), slot, kv, z, ape=ape)


def _append_op(kv, z, valid_mask, slots, ape, **state):
    state_append(V.state_view(**state), kv, z, valid_mask, slots, ape=ape)


def _reset_op(public):
    def op(valid_mask, slots, **state):
        public(V.state_view(**state), valid_mask=valid_mask, slots=slots)
    return op


SEED_OP = OpDecl("kv_state_seed", _seed_op, V.schema(
    V.state_schema(True, counter=False), "int slot, Tensor kv, Tensor z, Tensor? ape"))
APPEND_OP = OpDecl("kv_state_append", _append_op, V.schema(
    V.state_schema(True, b_writes=False), "Tensor kv, Tensor z, Tensor valid_mask, Tensor slots",
    "Tensor? ape"))
# mode -> declaration; state_clear's valid_mask is optional (None: every row)
RESET_OPS = {mode: OpDecl(name, _reset_op(public),
                          V.schema(V.state_schema(True), f"Tensor{q} valid_mask, Tensor slots"))
             for mode, name, public, q in ((K.RESET_CSA, "kv_csa_rotate", csa_rotate, ""),
                                          (K.RESET_HCA, "kv_hca_reset", hca_reset, ""),
                                          (K.RESET_CLEAR, "kv_state_clear", state_clear, "?"))}
