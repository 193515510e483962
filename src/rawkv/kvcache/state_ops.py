"""Ops on the decode state: admission (state_seed), append, and the resets
after a flush (csa_rotate, hca_reset) or for a new request (state_clear).
Kernels: rkv_kv_state_append, rkv_kv_state_reset; state_seed is a few torch
ops. reference.state_* define them. Each op is written once on rawkv._op
(its schema: the state's buffers, then its own arguments; views.py); the
public function passes the state and calls it."""
from __future__ import annotations

from .. import _args as A
from .._op import op
from ..kernels import kv_cache as K
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
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
    C.state(state)
    _state_seed(*V.state_operands(state, counter=False), slot, kv, z, ape, stream=stream, state=state)


def state_append(state, kv, z, valid_mask, slots, *, ape=None, errors=None, stream=None):
    """Append one token row per batch row to its request's a-stream
    (reference.state_append): row count[s] of slot s = kv[b], z[b] + ape[count[s]],
    count[s] += 1. kv, z (B, coff*head_dim) float32 or bfloat16; ape
    (m, coff*head_dim) float32 or None; valid_mask (B,) bool; slots (B,)
    int32. A valid row with an out-of-range slot or a full window
    (count == m: a missed flush) is skipped and adds 1 to errors. Duplicate
    slots among valid rows (a caller error): the lowest row appends, the
    others are skipped and add 1 each. One launch."""
    C.state(state)
    _state_append(*V.state_operands(state, errors), kv, z, valid_mask, slots, ape, stream=stream, state=state)


def csa_rotate(state, valid_mask, slots, *, errors=None, stream=None):
    """After a CSA flush, for each valid row: b <- b-half of the a rows
    (channels [0:head_dim]), a emptied (kv 0, z -inf), count 0
    (reference.csa_rotate). Out-of-range slot, or a duplicate of a lower
    valid row's slot: skipped, errors += 1. One launch."""
    C.state(state)
    _csa_rotate(*V.state_operands(state, errors), valid_mask, slots, stream=stream, state=state)


def hca_reset(state, valid_mask, slots, *, errors=None, stream=None):
    """After an HCA flush, for each valid row: a emptied (kv 0, z -inf),
    count 0 (reference.hca_reset). Out-of-range slot: skipped, counted."""
    C.state(state)
    _hca_reset(*V.state_operands(state, errors), valid_mask, slots, stream=stream, state=state)


def state_clear(state, slots, *, valid_mask=None, errors=None, stream=None):
    """New requests in `slots`: both streams emptied, count 0
    (reference.state_clear); valid_mask None = every row. Out-of-range slot:
    skipped, counted. state_seed does this and seeds the prompt's tail."""
    C.state(state)
    _state_clear(*V.state_operands(state, errors), valid_mask, slots, stream=stream, state=state)


# ---- the ops ----------------------------------------------------------------------------------
# A body takes the schema's arguments as *args (the state's buffers first:
# V.state_of) and, from an eager call, the state itself; with checks_only
# it checks them and stops (rawkv.kvcache.traced).
@op("kv_state_seed", V.schema(V.state_schema(True, counter=False), "Scalar slot, Tensor kv, Tensor z, Tensor? ape"))
def _state_seed(*args, stream=None, state=None, checks_only=False):
    """rawkv::kv_state_seed: the prompt's tail into a slot of the state
    (`checks_only`: the checks alone, rawkv.kvcache.traced)."""
    state, _, (slot, kv, z, ape) = V.state_of(args, state, counter=False)
    where, slot, k, zz, a = C.state_seed(state, slot, kv, z, ape)
    if checks_only:
        return
    if where == "cpu":
        ref.state_seed(state.reference_view(), slot, *A.host(k, zz, a))
        return
    import torch
    m, d = state.m, state.head_dim
    n, r = divmod(k.shape[0], m)

    def put_z(dst, src, ape_rows):
        # z + ape in float32 (BF16 z converts exactly): the reference's add
        if ape_rows is None:
            dst.copy_(src)
        else:
            torch.add(src, ape_rows, out=dst)

    # torch.cuda.stream(None) leaves the device's current stream
    with torch.cuda.device(state.device_index), \
            torch.cuda.stream(get_runtime(state.device_index).torch_stream(stream)):
        state._empty(slot)
        if state.overlap and n >= 1:
            rows = slice((n - 1) * m, n * m)
            state.kv_b[slot].copy_(k[rows, :d])
            put_z(state.z_b[slot], zz[rows, :d], None if a is None else a[:, :d])
        if r:
            state.kv_a[slot, :r].copy_(k[n * m:])
            put_z(state.z_a[slot, :r], zz[n * m:], None if a is None else a[:r])
            state.count[slot:slot + 1].fill_(r)


@op("kv_state_append", V.schema(V.state_schema(True, b_writes=False), "Tensor kv, Tensor z, Tensor valid_mask, "
                                                                      "Tensor slots", "Tensor? ape"))
def _state_append(*args, stream=None, state=None, checks_only=False):
    """rawkv::kv_state_append: one token row per batch row into its slot's
    a-stream (`checks_only`: the checks alone)."""
    state, errors, (kv, z, valid_mask, slots, ape) = V.state_of(args, state)
    where, k, zz, v, s, a, err = C.state_append(state, errors, kv, z, valid_mask, slots, ape)
    if checks_only:
        return
    if where == "cpu":
        C.add_errors(err, ref.state_append(state.reference_view(), *A.host(k, zz, v, s), ape=A.host(a)[0]))
        return
    if k.shape[0]:
        get_runtime(state.device_index).run(P.state_append(state, k, zz, a, v, s, err), stream)


def _reset_op(name: str, mode: int, optional_mask: str):
    """csa_rotate / hca_reset / state_clear (`mode`, K.RESET_*): one body,
    rkv_kv_state_reset's mode; state_clear's valid_mask is optional."""
    @op("kv_" + name, V.schema(V.state_schema(True), f"Tensor{optional_mask} valid_mask, Tensor slots"))
    def body(*args, stream=None, state=None, checks_only=False):
        state, errors, (valid_mask, slots) = V.state_of(args, state)
        where, v, s, err = C.state_reset(state, name, errors, valid_mask, slots)
        if checks_only:
            return
        if where == "cpu":
            st, (s, v) = state.reference_view(), A.host(s, v)
            if mode == K.RESET_CLEAR:
                n = ref.state_clear(st, s, v)
            else:
                n = (ref.csa_rotate if mode == K.RESET_CSA else ref.hca_reset)(st, v, s)
            C.add_errors(err, n)
            return
        if s.shape[0]:
            get_runtime(state.device_index).run(P.state_reset(state, mode, v, s, err), stream)
    body.__doc__ = f"rawkv::kv_{name}: the rows of `slots` reset (reference.{name})."
    return body


_csa_rotate = _reset_op("csa_rotate", K.RESET_CSA, "")
_hca_reset = _reset_op("hca_reset", K.RESET_HCA, "")
_state_clear = _reset_op("state_clear", K.RESET_CLEAR, "?")
