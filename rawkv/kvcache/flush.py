"""flush_write: finished entries -> the paged pool (rkv_kv_flush_write)."""
from __future__ import annotations

from .. import _dispatch as D
from .. import _plan
from .._opdecl import OpDecl
from ..reference import kvcache as ref
from ..runtime import get_runtime
from . import checks as C
from . import plans as P
from . import views as V


def flush_write(pool, entries, valid_mask, slots, positions, *, index_keys=None, errors=None,
                stream=None):
    """Quantize finished entries and scatter them into the pool: one row per
    batch row, entry e = positions[b] // m of the request in slots[b], at
    block_table[slot, e // epb], row e % epb (reference.paged_flush_write).

    entries (B, head_dim) bfloat16 (RMSNormed + RoPEd); valid_mask (B,) bool
    (False: skipped silently); slots, positions (B,) int32; index_keys
    (B, index_head_dim) bfloat16, required exactly for a pool with indexer
    keys. Layout "rawkv": the non-RoPE dims become E4M3 with one FP32
    decode scale (docs/format.md; NaN/Inf -> scale NaN, codes 0), the RoPE
    dims are stored as BF16, the indexer key as one-level NVFP4. Layout
    "model1": a MODEL1_FP8Sparse record in pool.pages and the key as
    DeepGEMM's FP8 / MXFP4 record in pool.index_pages (the rules of
    layouts.model1_store / index_*_store). pool.written[slot]
    becomes at least e + 1 and the entry is marked written (pool.marks). A
    valid row whose slot, position or block is out of range writes nothing
    and adds 1 to errors. Two valid rows aimed at one entry: the lowest
    writes it, the others write nothing and add 1 each. One launch."""
    C.check_pool(pool)
    if D.compiling():
        return V.call(FLUSH_WRITE_OP, **V.pool_args(pool, errors), entries=entries, valid_mask=valid_mask,
                      slots=slots, positions=positions, index_keys=index_keys)
    dev = pool.device_index
    e = C.arg(entries, "entries", C.BF16, dev, ndim=2, aligned=True)
    B = e.shape[0]
    if e.shape[1] != pool.head_dim:
        raise ValueError(f"entries: expected shape ({B}, {pool.head_dim}), got {tuple(e.shape)}")
    v = C.arg(valid_mask, "valid_mask", C.BOOL, dev, shape=(B,))
    s = C.arg(slots, "slots", C.I32, dev, shape=(B,))
    p = C.arg(positions, "positions", C.I32, dev, shape=(B,))
    if pool.has_index:
        if index_keys is None:
            raise ValueError("index_keys: required for a CSA pool with indexer keys")
        k = C.arg(index_keys, "index_keys", C.BF16, dev, shape=(B, pool.index_head_dim), aligned=True)
    elif index_keys is not None:
        raise ValueError("index_keys: this pool has no indexer keys (HCA, or index_head_dim=None)")
    else:
        k = None
    err = C.errors_arg(errors, pool.errors, dev)
    C.check_outputs((("errors", C.counter(errors, pool)),),
                    (("entries", e), ("valid_mask", v), ("slots", s), ("positions", p), ("index_keys", k)),
                    C.owned(pool, "pool"))
    if dev is None:
        C.add_errors(err, ref.paged_flush_write(pool.reference_view(), e, v, s, p, k))
        return
    if B:
        _plan.run(get_runtime(dev), P.flush_write(pool, e, k, v, s, p, err), stream)


def _flush_write_op(entries, valid_mask, slots, positions, index_keys, **pool):
    flush_write(V.pool_view(**pool), entries, valid_mask, slots, positions, index_keys=index_keys)


FLUSH_WRITE_OP = OpDecl("kv_flush_write", _flush_write_op, V.schema(
    V.pool_schema(True), "Tensor entries, Tensor valid_mask, Tensor slots, Tensor positions",
    "Tensor? index_keys"))
