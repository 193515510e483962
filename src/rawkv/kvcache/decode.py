"""compress_decode: the decode windows that are complete -> entries in the
paged pool, one rkv_kv_compress launch per step (capturable;
reference.paged_compress_decode defines the flush rule)."""
from __future__ import annotations

from .. import _args as A
from .._op import op
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
from . import plans as P
from . import views as V
from .compressor import DecodeIndex, rope_table, yarn_list, yarn_of


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
    pool.errors. Duplicate slots (docs/kvcache.md decision 11, as the state
    ops): only the lowest valid row of a slot may flush; every other valid
    row of that slot writes nothing and counts one error, whether or not
    the lowest row flushes. The caller then runs csa_rotate / hca_reset for
    the rows that flushed.

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
    C.pool(pool)
    rope = ref.check_rope(theta, yarn)      # a YarnConfig; the operator takes its values
    index = C.decode_states(pool, state, *C.index_parts(index, DecodeIndex), DecodeIndex)
    ist, inw = (None, None) if index is None else index
    _compress_decode(*V.pool_operands(pool), *V.state_operands(state, counter=False), norm_weight, valid_mask,
                     slots, positions, *V.state_operands(ist, counter=False), inw, eps, rope[0],
                     yarn_list(rope[1]), stream=stream, pool=pool, state=state, index=index, rope=rope)


@op("kv_compress_decode", V.schema(
    V.pool_schema(True), V.state_schema(False, counter=False),
    "Tensor norm_weight, Tensor valid_mask, Tensor slots, Tensor positions",
    V.state_schema(False, "index_", counter=False, optional=True),
    "Tensor? index_norm_weight, Scalar eps, Scalar theta, Scalar[]? yarn"))
def _compress_decode(*args, stream=None, pool=None, state=None, index=None, rope=None, checks_only=False):
    """rawkv::kv_compress_decode: the pool's and the state's buffers, the
    step's rows, the indexer state's buffers (all None: none) and its
    norm_weight, the RoPE parameters. An eager call passes the objects, the
    index and `rope`, the public op checked them (C.decode_states); the
    operator checks its views the same way (`checks_only`: the checks
    alone, rawkv.kvcache.traced)."""
    checked = pool is not None
    pool, errors, rest = V.pool_of(args, pool)
    state, _, rest = V.state_of(rest, state, counter=False)
    norm_weight, valid_mask, slots, positions = rest[:4]
    ist, _, (inw, eps, theta, yarn) = V.state_of(rest[4:], None if index is None else index.state,
                                                 counter=False, optional=True)
    if not checked:
        index = C.decode_states(pool, state, ist, inw, DecodeIndex)
    theta, yarn = rope if rope is not None else ref.check_rope(theta, yarn_of(yarn))
    where, eps, nw, v, s, p, inw = C.compress_decode(pool, state, index, norm_weight, valid_mask, slots, positions, eps)
    if checks_only:
        return
    ist = None if index is None else index.state
    if where == "cpu":
        ix = None if index is None else (ist.reference_view(), *A.host(inw))
        C.add_errors(errors, ref.paged_compress_decode(
            pool.reference_view(), state.reference_view(), *A.host(nw, v, s, p), index=ix, eps=eps,
            theta=theta, yarn=yarn))
        return
    if v.shape[0] == 0:
        return
    tab = rope_table(pool, theta=theta, yarn=yarn, stream=stream)
    get_runtime(pool.device_index).run(P.compress_decode(pool, state, nw, ist, inw, v, s, p, tab, eps), stream)
