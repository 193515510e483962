"""compress_prefill: a prompt's token rows -> its entries in the paged pool,
one rkv_kv_compress launch (reference.paged_compress_prefill)."""
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
    PrefillIndex, check_compressible, index_arg, rope_table, yarn_list, yarn_of,
)


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
    C.check_pool(pool)
    check_compressible(pool)
    theta, yarn = ref.check_rope(theta, yarn)      # every path, before any launch
    if D.compiling():
        return _traced(pool, kv, z, ape, norm_weight, slot, start_entry, index, eps, theta, yarn)
    d, m, dev = pool.head_dim, pool.m, pool.device_index
    w = (2 if pool.kind == "csa" else 1) * d
    slot = C.host_int("slot", slot, 0, pool.max_requests)
    start_entry = C.host_int("start_entry", start_entry, 0)
    eps = A.check_eps(eps)
    index = index_arg(pool, index, PrefillIndex)
    k = C.arg(kv, "kv", C.ROWS, dev, ndim=2)
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape (T, {w}), got {tuple(k.shape)}")
    # z and the indexer's rows: kv's dtype
    rows = (A.cpu_dtype_name(kv, "kv") if dev is None else str(k.dtype).replace("torch.", ""),)
    zz = _rows_arg(z, "z", rows, dev, tuple(k.shape))
    a = C.opt(ape, "ape", C.F32, dev, shape=(m, w))
    nw = C.arg(norm_weight, "norm_weight", C.F32, dev, shape=(d,))
    if index is not None:
        iw = 2 * K.INDEX_HEAD_DIM
        index = PrefillIndex(_rows_arg(index.kv, "index.kv", rows, dev, (k.shape[0], iw)),
                             _rows_arg(index.z, "index.z", rows, dev, (k.shape[0], iw)),
                             C.opt(index.ape, "index.ape", C.F32, dev, shape=(m, iw)),
                             C.arg(index.norm_weight, "index.norm_weight", C.F32, dev,
                                   shape=(K.INDEX_HEAD_DIM,)))
    if dev is None:
        n, errors = ref.paged_compress_prefill(pool.reference_view(), pool.kind, slot, k, zz, a, nw,
                                               start_entry=start_entry, index=index, eps=eps,
                                               theta=theta, yarn=yarn)
        C.add_errors(pool.errors, errors)
        return n
    n, _ = P.prefill_entries(pool, k.shape[0], start_entry)
    if n <= 0:
        return 0
    tab = rope_table(pool, theta=theta, yarn=yarn, stream=stream)
    _plan.run(get_runtime(dev), P.compress_prefill(pool, k, zz, a, nw, index, slot, start_entry, tab, eps), stream)
    return n


def _rows_arg(x, name: str, rows: tuple, dev, shape):
    """Token rows of kv's dtype (`rows`), exactly: the kernel reads every
    row as kv's dtype, so on the host too, where C.arg would take a float32
    for a bfloat16 (numpy has none), a float32 z beside a bfloat16 kv is
    refused, as on CUDA."""
    if dev is None:
        A.check_cpu_array(A.require_array(x, name), name, rows)
    return C.arg(x, name, rows, dev, shape=shape)


def _traced(pool, kv, z, ape, norm_weight, slot, start_entry, index, eps, theta, yarn) -> int:
    """Under torch.compile: the operator, and n from the shapes (the eager
    path's count)."""
    ix = PrefillIndex(None, None, None, None) if index is None else PrefillIndex(*index)
    V.call(PREFILL_OP, **V.pool_args(pool), kv=kv, z=z, ape=ape, norm_weight=norm_weight, slot=slot,
           start_entry=start_entry, index_kv=ix.kv, index_z=ix.z, index_ape=ix.ape,
           index_norm_weight=ix.norm_weight, eps=eps, theta=theta, yarn=yarn_list(yarn))
    return max(0, P.prefill_entries(pool, kv.shape[0], start_entry)[0])


def _prefill_op(kv, z, ape, norm_weight, slot, start_entry, index_kv, index_z, index_ape,
                index_norm_weight, eps, theta, yarn, **pool):
    ix = (index_kv, index_z, index_ape, index_norm_weight)
    compress_prefill(V.pool_view(**pool), kv, z, ape, norm_weight, slot, start_entry=start_entry,
                     index=None if all(t is None for t in ix) else PrefillIndex(*ix), eps=eps, theta=theta,
                     yarn=yarn_of(yarn))


PREFILL_OP = OpDecl("kv_compress_prefill", _prefill_op, V.schema(
    V.pool_schema(True), "Tensor kv, Tensor z, Tensor? ape, Tensor norm_weight, int slot, int start_entry",
    "Tensor? index_kv, Tensor? index_z, Tensor? index_ape, Tensor? index_norm_weight",
    "float eps, float theta, float[]? yarn"))
