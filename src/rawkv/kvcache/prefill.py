"""compress_prefill: a prompt's token rows -> its entries in the paged pool,
one rkv_kv_compress launch (reference.paged_compress_prefill)."""
from __future__ import annotations

from .. import _args as A
from .._op import op
from .._args import dims
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import _rules as C
from . import plans as P
from . import views as V
from .compressor import PrefillIndex, rope_table, yarn_list, yarn_of


def compress_prefill(pool, kv, z, ape, norm_weight, slot, *, start_entry: int = 0, index=None,
                     eps: float = ref.RMS_EPS, theta: float = ref.COMPRESS_ROPE_THETA,
                     yarn=ref.DSV4_YARN, stream=None) -> int:
    """Compress a prompt of request `slot` into its pool entries, in one launch.

    pool:        PagedKVPool ('csa' m = 4 or 'hca' m = 128); blocks for the
                 entries written must be in pool.block_table[slot] (entries
                 past the table or mapped to a block outside the pool are
                 skipped and counted in pool.errors).
    kv, z:       (T, coff*d) float32 or bfloat16 token rows (value, gate),
                 coff = 2 (CSA: [b-half | a-half]) or 1 (HCA); row 0 is the
                 token at position start_entry * m. CSA with start_entry > 0:
                 row 0 is at (start_entry - 1) * m instead, the window before
                 the first entry (its b-half is the first entry's overlap).
    ape:         (m, coff*d) float32 gate position bias (added to z), or None.
    norm_weight: (d,) float32 RMSNorm weight.
    slot:        the request's row of pool.block_table (host int).
    index:       CSA: PrefillIndex(kv, z, ape, norm_weight) of the indexer
                 (width 2*128); required iff the pool has indexer keys.
    eps:         RMSNorm epsilon, a finite number > 0.
    Writes entries start_entry .. start_entry + n - 1 with n = T // m (CSA
    with start_entry > 0: T // m - 1) and raises pool.written[slot] to the
    last one + 1; a trailing partial window is left to the decode state
    (state_seed). Returns n. A CPU pool runs the reference.
    """
    C.pool(pool)
    rope = ref.check_rope(theta, yarn)      # a YarnConfig; the operator takes its values
    _compress_prefill(*V.pool_operands(pool), kv, z, ape, norm_weight, slot, start_entry,
                      *C.index_parts(index, PrefillIndex), eps, rope[0], yarn_list(rope[1]),
                      stream=stream, pool=pool, rope=rope)
    return max(0, P.prefill_entries(pool, dims(kv)[0], int(start_entry))[0])


@op("kv_compress_prefill", V.schema(
    V.pool_schema(True), "Tensor kv, Tensor z, Tensor? ape, Tensor norm_weight, Scalar slot, Scalar start_entry",
    "Tensor? index_kv, Tensor? index_z, Tensor? index_ape, Tensor? index_norm_weight",
    "Scalar eps, Scalar theta, Scalar[]? yarn"))
def _compress_prefill(*args, stream=None, pool=None, rope=None, checks_only=False):
    """rawkv::kv_compress_prefill: the pool's buffers (V.pool_of; `pool`
    the object of an eager call), then the prompt's rows, the indexer's
    (all None: none) and the RoPE parameters (`rope`: the public op's,
    checked; `checks_only`: the checks alone, rawkv.kvcache.traced)."""
    pool, errors, rest = V.pool_of(args, pool)
    kv, z, ape, norm_weight, slot, start_entry, *parts, eps, theta, yarn = rest
    theta, yarn = rope if rope is not None else ref.check_rope(theta, yarn_of(yarn))
    where, slot, start_entry, eps, k, zz, a, nw, index = C.compress_prefill(
        pool, kv, z, ape, norm_weight, slot, start_entry, tuple(parts), eps, PrefillIndex)
    if checks_only:
        return
    if where == "cpu":
        _, bad = ref.paged_compress_prefill(
            pool.reference_view(), pool.kind, slot, *A.host(k, zz, a, nw), start_entry=start_entry,
            index=None if index is None else A.host(*index), eps=eps, theta=theta, yarn=yarn)
        C.add_errors(errors, bad)
        return
    if P.prefill_entries(pool, k.shape[0], start_entry)[0] <= 0:
        return
    tab = rope_table(pool, theta=theta, yarn=yarn, stream=stream)
    get_runtime(pool.device_index).run(
        P.compress_prefill(pool, k, zz, a, nw, index, slot, start_entry, tab, eps), stream)
