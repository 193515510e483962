"""Format ops of the DeepSeek-V4 compressed KV cache: flush, gathers, state.

    flush_write(pool, entries, valid_mask, slots, positions, index_keys=keys)
    rows = gather_topk(pool, slots, topk_ids, out=buf)
    rows = gather_dense(pool, slot, n)             # one request, host ints
    gather_dense_batch(pool, slots, n_entries, out=buf)
    keys = gather_index_keys(pool, slot, n)
    state_seed(state, slot, prompt_kv, prompt_z, ape=ape)   # admission, after prefill
    state_append(state, kv, z, valid_mask, slots, ape=ape)
    csa_rotate(state, valid_mask, slots) / hca_reset(state, valid_mask, slots)
    state_clear(state, slots)

rawkv.reference.kvcache defines every result bit for bit (docs/kvcache.md).
On a CUDA pool/state each op is ONE kernel launch on torch's current stream
(or `stream`): no allocation when out= is given, no host synchronization, no
host branching on device data, so a decode step captures into one CUDA graph.
Every argument is checked (dtype, shape, device, contiguity, alignment)
before anything is launched; the error names the argument. Device-side
indices are bounds-checked by the kernels: a bad row is skipped and counted
in `errors` (default: pool.errors for pool ops, state.errors for state ops).
Every gather bounds entry ids by pool.written[slot] (the entries the slot's
request has written; the flushes raise it, free_request zeroes it), so bytes
an earlier request left in a reused block are never returned.
On a CPU pool/state (device="cpu") the ops run the numpy reference in place.
"""
from __future__ import annotations

import sys

import numpy as np

from .. import _tensors as T
from ..reference import kvcache as ref
from ..runtime import get_runtime, register_kernels
from .pool import PagedKVPool
from .state import DecodeState

_FILE = "kv_cache.cu"
_CT = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
_IN_CT = {"float32": "float", "bfloat16": "__nv_bfloat16"}
_K_FLUSH = {True: "rkv_kv_flush_write<true>", False: "rkv_kv_flush_write<false>"}
_K_APPEND = {(a, b): f"rkv_kv_state_append<{_IN_CT[a]}, {_IN_CT[b]}>" for a in _IN_CT for b in _IN_CT}
_RESET_HCA, _RESET_CSA, _RESET_CLEAR = 0, 1, 2
_K_RESET = {mode: f"rkv_kv_state_reset<{mode}>" for mode in (0, 1, 2)}
_K_GATHER = {}
for _o, _c in _CT.items():
    _K_GATHER[_o, "int32"] = f"rkv_kv_gather<{_c}, int, false>"
    _K_GATHER[_o, "int64"] = f"rkv_kv_gather<{_c}, long long, false>"
    _K_GATHER[_o, "dense"] = f"rkv_kv_gather<{_c}, int, true>"
_K_INDEX = {o: f"rkv_kv_gather_index<{c}>" for o, c in _CT.items()}
register_kernels(_FILE, [*_K_FLUSH.values(), *_K_APPEND.values(), *_K_RESET.values(),
                         *_K_GATHER.values(), *_K_INDEX.values()])

_FLUSH_ROWS_PER_CTA = 4      # one warp per row
_BLOCK = 256

__all__ = ["flush_write", "gather_topk", "gather_dense", "gather_dense_batch",
           "gather_index_keys", "gather_index_keys_batch", "state_seed", "state_append",
           "csa_rotate", "hca_reset", "state_clear"]


# ---------------------------------------------------------------------------
# argument helpers
# ---------------------------------------------------------------------------
def _torch():
    return sys.modules.get("torch") or __import__("torch")


def _check_pool(pool):
    if not isinstance(pool, PagedKVPool):
        raise TypeError(f"pool: expected a PagedKVPool, got {type(pool).__name__}")


def _check_state(state):
    if not isinstance(state, DecodeState):
        raise TypeError(f"state: expected a DecodeState, got {type(state).__name__}")


def _cu(x, name, dtypes, shape, dev, *, ndim=None, aligned=False):
    """A CUDA tensor argument on device `dev`, checked (docs/format.md)."""
    if x is None:
        raise TypeError(f"{name}: is required")
    if not T.is_cuda_tensor(x):
        if isinstance(x, (np.ndarray, list, tuple, int, float)) or T.is_torch(x):
            raise ValueError(f"{name}: expected a CUDA tensor on cuda:{dev} (the pool/state is on CUDA), "
                             f"got {type(x).__name__}{' on cpu' if T.is_torch(x) else ''}")
        x = T.as_cuda_tensor(x, name)
    T.check_tensor(x, name, dtypes, shape=shape, ndim=ndim, device=dev)
    if aligned and x.data_ptr() % 16:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned (a view starting mid-row?); "
                         "call .clone() first")
    return x


def _errors_cu(errors, default, dev):
    if errors is None:
        return default
    torch = _torch()
    e = _cu(errors, "errors", (torch.int32,), None, dev)
    if e.numel() < 1:
        raise ValueError("errors: expected an int32 tensor with at least 1 element")
    return e


def _np(x, name):
    """numpy view of a CPU argument (numpy array, CPU tensor, list)."""
    if x is None:
        return None
    if getattr(x, "is_cuda", False) is True:
        raise ValueError(f"{name}: is a CUDA tensor but the pool/state is on cpu")
    if T.is_torch(x) or isinstance(x, np.ndarray):
        return T.to_numpy(x, name)
    return np.asarray(x)


def _np_ints(name, x, shape):
    a = _np(x, name)
    if a is None:
        raise TypeError(f"{name}: is required")
    if a.dtype == np.bool_ or a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")
    return a.astype(np.int64)


def _np_mask(name, x, n):
    a = _np(x, name)
    if a is None:
        return np.ones(n, bool)
    if a.dtype != np.bool_:
        raise TypeError(f"{name}: expected a bool array, got dtype {a.dtype}")
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
    return a


def _errors_np(errors, default):
    if errors is None:
        return default
    if getattr(errors, "is_cuda", False) is True:
        raise ValueError("errors: is a CUDA tensor but the pool/state is on cpu")
    a = T.to_numpy(errors, "errors") if T.is_torch(errors) else np.asarray(errors)
    if a.dtype != np.int32 or a.size < 1:
        raise ValueError("errors: expected an int32 array with at least 1 element")
    return errors


def _add_errors(errors, n):
    if n:
        if T.is_torch(errors):
            errors.view(-1)[0] += int(n)
        else:
            errors.reshape(-1)[0] += n


def _table_rows(pool, slots):
    """(B, max_blocks) block-table rows of `slots` (rows of -1 for a slot out
    of range: every entry of it is then skipped and counted, like the kernel)."""
    ok = (slots >= 0) & (slots < pool.max_requests)
    rows = np.full((slots.shape[0], pool.max_blocks_per_request), -1, np.int64)
    rows[ok] = pool.block_table[slots[ok]]
    return rows


def _written_of(pool, slots):
    """(B,) pool.written of `slots` (0 for a slot out of range, as the kernels)."""
    ok = (slots >= 0) & (slots < pool.max_requests)
    w = np.zeros(slots.shape[0], np.int64)
    w[ok] = pool.written[slots[ok]]
    return w


def _dtype_name(dtype, out):
    if dtype is None:
        if out is not None and T.is_torch(out):
            dtype = out.dtype
        else:
            return "bfloat16"
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    if name not in _CT:
        raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype!r}")
    return name


def _host_int(name, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v >= hi):
        raise ValueError(f"{name}: {v} is out of range [{lo}, {hi if hi is not None else 'inf'})")
    return int(v)


def _check_rows(name, n):
    if n >= 2 ** 31:
        raise ValueError(f"{name}: {n} output rows/blocks; at most 2^31 - 1 per launch")


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _pool_geom(pool):
    return (pool.max_requests, pool.max_blocks_per_request, pool.num_blocks,
            pool.entries_per_block)


# ---------------------------------------------------------------------------
# flush
# ---------------------------------------------------------------------------
def flush_write(pool, entries, valid_mask, slots, positions, *, index_keys=None, errors=None,
                stream=None):
    """Quantize finished entries and scatter them into the pool: one row per
    batch row, entry e = positions[b] // m of the request in slots[b], at
    block_table[slot, e // epb], row e % epb (reference.flush_write).

    entries (B, head_dim) bfloat16 (RMSNormed + RoPEd); valid_mask (B,) bool
    (False: skipped silently); slots, positions (B,) int32; index_keys
    (B, index_head_dim) bfloat16, required exactly for a pool with indexer
    keys. The 448 non-RoPE dims become E4M3 with one FP32 decode scale
    (docs/format.md; NaN/Inf -> scale NaN, codes 0), the RoPE dims are stored as
    BF16, the indexer key as one-level NVFP4; pool.written[slot] becomes at
    least e + 1. A valid row whose slot, position or block is out of range
    writes nothing and adds 1 to errors. Two valid rows aimed at one entry:
    undefined. One launch."""
    _check_pool(pool)
    if not pool.is_cuda:
        return _flush_cpu(pool, entries, valid_mask, slots, positions, index_keys, errors)
    torch = _torch()
    dev = pool.device_index
    e = _cu(entries, "entries", (torch.bfloat16,), None, dev, ndim=2, aligned=True)
    B = e.shape[0]
    if e.shape[1] != pool.head_dim:
        raise ValueError(f"entries: expected shape ({B}, {pool.head_dim}), got {tuple(e.shape)}")
    v = _cu(valid_mask, "valid_mask", (torch.bool,), (B,), dev)
    s = _cu(slots, "slots", (torch.int32,), (B,), dev)
    p = _cu(positions, "positions", (torch.int32,), (B,), dev)
    if pool.has_index:
        if index_keys is None:
            raise ValueError("index_keys: required for a CSA pool with indexer keys")
        k = _cu(index_keys, "index_keys", (torch.bfloat16,), (B, pool.index_head_dim), dev, aligned=True)
    else:
        if index_keys is not None:
            raise ValueError("index_keys: this pool has no indexer keys (HCA, or index_head_dim=None)")
        k = None
    err = _errors_cu(errors, pool.errors, dev)
    if B == 0:
        return
    rt = get_runtime(dev)
    fn = rt.function(_FILE, _K_FLUSH[pool.has_index], stream=stream)
    grid = -(-B // _FLUSH_ROWS_PER_CTA)
    rt.launch_args(fn, (grid,), (32 * _FLUSH_ROWS_PER_CTA,),
              (e.data_ptr(), _ptr(k), v.data_ptr(), s.data_ptr(), p.data_ptr(),
               pool.block_table.data_ptr(), pool.fp8.data_ptr(), pool.scale.data_ptr(),
               pool.rope.data_ptr(), _ptr(pool.index_q), _ptr(pool.index_sf),
               pool.written.data_ptr(), err.data_ptr(),
               B, *_pool_geom(pool), pool.m, pool.nope_dim, pool.rope_dim,
               pool.index_head_dim or 0), stream)


def _flush_cpu(pool, entries, valid_mask, slots, positions, index_keys, errors):
    ents = ref._f32("entries", _np(entries, "entries"), last=pool.head_dim, ndim=2)
    B = ents.shape[0]
    sl = _np_ints("slots", slots, (B,))
    err = _errors_np(errors, pool.errors)
    rpool = pool.reference_view()
    table = _table_rows(pool, sl)
    n = ref.flush_write(rpool, ents, _np(valid_mask, "valid_mask"), _np(positions, "positions"),
                        table, index_keys=_np(index_keys, "index_keys"))
    _add_errors(err, n)
    valid = np.asarray(_np(valid_mask, "valid_mask"))
    pos = _np_ints("positions", positions, (B,))
    for b in np.flatnonzero(valid):
        if pos[b] >= 0:
            mark_written_cpu(pool, rpool, int(sl[b]), table[b], [int(pos[b]) // pool.m])


def mark_written_cpu(pool, rpool, row: int, table_row, entry_ids) -> None:
    """CPU twin of the kernels' atomicMax on pool.written[row]: 1 + the
    highest of `entry_ids` that has a block (the ones flush_write wrote)."""
    ok = [int(e) for e in entry_ids if ref._locate(rpool, table_row, int(e)) is not None]
    if ok:
        w = pool.written if isinstance(pool.written, np.ndarray) else pool.written.numpy()
        w[row] = max(int(w[row]), max(ok) + 1)


# ---------------------------------------------------------------------------
# gathers
# ---------------------------------------------------------------------------
def gather_topk(pool, slots, topk_ids, *, n_entries=None, valid_mask=None, out=None, dtype=None,
                errors=None, stream=None):
    """Decode the selected entries back to rows (CSA reader):
    out[b, j] = entry topk_ids[b, j] of the request in slots[b].

    slots (B,) int32; topk_ids (B, K) int32 or int64; n_entries (B,) int32 or
    None (an optional tighter bound: ids >= n_entries[b] are errors);
    valid_mask (B,) bool or None (False: zero rows, not counted);
    out (B, K, head_dim) of `dtype` (bfloat16 default, float16, float32).
    Id -1 is padding: zero row, not counted. Any other negative id, an id
    >= n_entries, an id >= pool.written[slot] (not written by this request:
    a reused block may hold an earlier request's entry there), or an id
    mapped to an out-of-range slot/block gives a zero row and adds 1 to
    errors (reference.gather_topk with n_entries = min(n_entries, written)).
    One launch."""
    _check_pool(pool)
    name = _dtype_name(dtype, out)
    if not pool.is_cuda:
        return _gather_topk_cpu(pool, slots, topk_ids, n_entries, valid_mask, out, name, errors)
    torch = _torch()
    dev = pool.device_index
    ids = _cu(topk_ids, "topk_ids", (torch.int32, torch.int64), None, dev, ndim=2)
    B, K = ids.shape
    s = _cu(slots, "slots", (torch.int32,), (B,), dev)
    ne = None if n_entries is None else _cu(n_entries, "n_entries", (torch.int32,), (B,), dev)
    v = None if valid_mask is None else _cu(valid_mask, "valid_mask", (torch.bool,), (B,), dev)
    tdt = getattr(torch, name)
    if out is not None:
        out = _cu(out, "out", (tdt,), (B, K, pool.head_dim), dev, aligned=True)
    err = _errors_cu(errors, pool.errors, dev)
    _check_rows("topk_ids", B * K)
    rt = get_runtime(dev)
    if out is None:
        out = rt.empty((B, K, pool.head_dim), tdt, stream=stream)
    if B * K == 0:
        return out
    fn = rt.function(_FILE, _K_GATHER[name, "int64" if ids.dtype == torch.int64 else "int32"],
                     stream=stream)
    grid, block = rt.grid_stride(B * K * 32, _BLOCK)
    rt.launch_args(fn, (grid,), (block,),
              (pool.fp8.data_ptr(), pool.scale.data_ptr(), pool.rope.data_ptr(),
               pool.block_table.data_ptr(), s.data_ptr(), ids.data_ptr(), _ptr(ne), _ptr(v),
               pool.written.data_ptr(), out.data_ptr(), err.data_ptr(), B, K, 0, -1,
               *_pool_geom(pool), pool.nope_dim, pool.rope_dim), stream)
    return out


def _gather_topk_cpu(pool, slots, topk_ids, n_entries, valid_mask, out, name, errors):
    ids = _np_ints("topk_ids", topk_ids, None)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids: expected 2 dimensions, got shape {ids.shape}")
    B, K = ids.shape
    sl = _np_ints("slots", slots, (B,))
    ne = None if n_entries is None else _np_ints("n_entries", n_entries, (B,))
    valid = _np_mask("valid_mask", valid_mask, B)
    err = _errors_np(errors, pool.errors)
    _check_out_np(out, (B, K, pool.head_dim))
    rows = np.zeros((B, K, pool.head_dim), np.float32)
    sel = np.flatnonzero(valid)
    n = 0
    if sel.size:
        lim = _written_of(pool, sl[sel])
        if ne is not None:
            lim = np.minimum(lim, ne[sel])
        rows[sel], n = ref.gather_topk(pool.reference_view(), _table_rows(pool, sl[sel]), ids[sel],
                                       lim, dtype=name)
    _add_errors(err, n)
    return T.from_numpy(rows, topk_ids, torch_dtype=name, out=out)


def _check_out_np(out, shape):
    if out is not None:
        if getattr(out, "is_cuda", False) is True:
            raise ValueError("out: is a CUDA tensor but the pool is on cpu")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")


def _dense_launch(pool, index, slots_t, ne_t, valid_t, slot0, n0, B, K, out, err, name, stream):
    _check_rows("out", B * K * (pool.index_head_dim // 16 if index else 1))
    rt = get_runtime(pool.device_index)
    if B * K == 0:
        return
    if index:
        fn = rt.function(_FILE, _K_INDEX[name], stream=stream)
        nb = pool.index_head_dim // 16
        grid, block = rt.grid_stride(B * K * nb, _BLOCK)
        rt.launch_args(fn, (grid,), (block,),
                  (pool.index_q.data_ptr(), pool.index_sf.data_ptr(), pool.block_table.data_ptr(),
                   _ptr(slots_t), _ptr(ne_t), _ptr(valid_t), pool.written.data_ptr(),
                   out.data_ptr(), err.data_ptr(),
                   B, K, slot0, n0, *_pool_geom(pool), pool.index_head_dim), stream)
    else:
        fn = rt.function(_FILE, _K_GATHER[name, "dense"], stream=stream)
        grid, block = rt.grid_stride(B * K * 32, _BLOCK)
        rt.launch_args(fn, (grid,), (block,),
                  (pool.fp8.data_ptr(), pool.scale.data_ptr(), pool.rope.data_ptr(),
                   pool.block_table.data_ptr(), _ptr(slots_t), 0, _ptr(ne_t), _ptr(valid_t),
                   pool.written.data_ptr(), out.data_ptr(), err.data_ptr(), B, K, slot0, n0,
                   *_pool_geom(pool), pool.nope_dim, pool.rope_dim), stream)


def _dense_one(pool, slot, n_entries, out, dtype, errors, stream, index):
    _check_pool(pool)
    if index and not pool.has_index:
        raise ValueError("pool: has no indexer keys (not a CSA pool with index_head_dim)")
    slot = _host_int("slot", slot, 0, pool.max_requests)
    # n is a host int, so it is checked against the host's count of the slot's
    # entries (0 for a free slot); the kernel still bounds by pool.written,
    # which also catches entries prepared but not yet flushed.
    n = _host_int("n_entries", n_entries, 0)
    have = int(pool._n_entries[slot])
    if n > have:
        raise ValueError(f"n_entries: {n} entries asked of slot {slot}, which holds {have} after the "
                         "steps prepared so far (pool.n_entries); the rest would be bytes this "
                         "request never wrote")
    width = pool.index_head_dim if index else pool.head_dim
    name = _dtype_name(dtype, out)
    if not pool.is_cuda:
        _check_out_np(out, (n, width))
        err = _errors_np(errors, pool.errors)
        fn = ref.gather_index_keys if index else ref.gather_dense
        rows, ne = fn(pool.reference_view(), pool.block_table[slot], n, dtype=name,
                      written=int(pool.written[slot]))
        _add_errors(err, ne)
        return T.from_numpy(rows, out, torch_dtype=name, out=out)
    torch = _torch()
    dev = pool.device_index
    tdt = getattr(torch, name)
    if out is not None:
        out = _cu(out, "out", (tdt,), (n, width), dev, aligned=True)
    err = _errors_cu(errors, pool.errors, dev)
    if out is None:
        out = get_runtime(dev).empty((n, width), tdt, stream=stream)
    _dense_launch(pool, index, None, None, None, slot, n, 1, n, out, err, name, stream)
    return out


def _dense_batch(pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors, stream, index):
    _check_pool(pool)
    if index and not pool.has_index:
        raise ValueError("pool: has no indexer keys (not a CSA pool with index_head_dim)")
    width = pool.index_head_dim if index else pool.head_dim
    name = _dtype_name(dtype, out)
    if out is None and max_entries is None:
        raise ValueError("max_entries: required when out is not given")
    if max_entries is not None:
        max_entries = _host_int("max_entries", max_entries, 0)
    if not pool.is_cuda:
        sl = _np_ints("slots", slots, None)
        if sl.ndim != 1:
            raise ValueError(f"slots: expected 1 dimension, got shape {sl.shape}")
        B = sl.shape[0]
        K = max_entries if max_entries is not None else out.shape[1]
        _check_out_np(out, (B, K, width))
        ne = _np_ints("n_entries", n_entries, (B,))
        valid = _np_mask("valid_mask", valid_mask, B)
        err = _errors_np(errors, pool.errors)
        rows = np.zeros((B, K, width), np.float32)
        table = _table_rows(pool, sl)
        written = _written_of(pool, sl)
        fn = ref.gather_index_keys if index else ref.gather_dense
        total = 0
        for b in np.flatnonzero(valid):
            n = int(ne[b])
            total += n < 0 or n > K
            nn = min(max(n, 0), K)
            rows[b, :nn], e = fn(pool.reference_view(), table[b], nn, dtype=name,
                                 written=int(written[b]))
            total += e
        _add_errors(err, total)
        return T.from_numpy(rows, slots, torch_dtype=name, out=out)
    torch = _torch()
    dev = pool.device_index
    s = _cu(slots, "slots", (torch.int32,), None, dev, ndim=1)
    B = s.shape[0]
    ne = _cu(n_entries, "n_entries", (torch.int32,), (B,), dev)
    v = None if valid_mask is None else _cu(valid_mask, "valid_mask", (torch.bool,), (B,), dev)
    tdt = getattr(torch, name)
    if out is not None:
        out = _cu(out, "out", (tdt,), None, dev, ndim=3, aligned=True)
        K = out.shape[1]
        if tuple(out.shape) != (B, K, width) or (max_entries is not None and K != max_entries):
            raise ValueError(f"out: expected shape ({B}, {max_entries if max_entries is not None else 'K'}, "
                             f"{width}), got {tuple(out.shape)}")
    else:
        K = max_entries
    err = _errors_cu(errors, pool.errors, dev)
    if out is None:
        out = get_runtime(dev).empty((B, K, width), tdt, stream=stream)
    _dense_launch(pool, index, s, ne, v, 0, 0, B, K, out, err, name, stream)
    return out


def gather_dense(pool, slot, n_entries, *, out=None, dtype=None, errors=None, stream=None):
    """Entries 0 .. n_entries-1 of the request in `slot` (host ints) as rows
    (n_entries, head_dim) of `dtype` (HCA reader; reference.gather_dense).
    n_entries > pool.n_entries(slot) (more than the prepared steps make; 0
    for a free slot) is a ValueError. An entry >= pool.written[slot] (not
    flushed yet) or whose block is out of range is a zero row and adds 1 to
    errors. One launch, capturable with out=."""
    return _dense_one(pool, slot, n_entries, out, dtype, errors, stream, index=False)


def gather_dense_batch(pool, slots, n_entries, *, max_entries=None, out=None, valid_mask=None,
                       dtype=None, errors=None, stream=None):
    """Batched gather_dense with device-side lengths: out[b, j] = entry j of
    the request in slots[b] for j < n_entries[b], zero rows (not counted) for
    j >= n_entries[b]. slots, n_entries (B,) int32 on the device; out
    (B, K, head_dim) (or max_entries=K for a new one). n_entries[b] < 0 or
    > K adds 1 to errors and gathers the first min(n, K) entries; entries
    j >= pool.written[slot] and bad slots/blocks: zero rows, 1 error each.
    valid_mask False: zero rows."""
    return _dense_batch(pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors,
                        stream, index=False)


def gather_index_keys(pool, slot, n_entries, *, out=None, dtype=None, errors=None, stream=None):
    """CSA indexer keys of entries 0 .. n_entries-1 of the request in `slot`:
    (n_entries, index_head_dim) of `dtype` (reference.gather_index_keys)."""
    return _dense_one(pool, slot, n_entries, out, dtype, errors, stream, index=True)


def gather_index_keys_batch(pool, slots, n_entries, *, max_entries=None, out=None,
                            valid_mask=None, dtype=None, errors=None, stream=None):
    """Batched gather_index_keys, rules of gather_dense_batch:
    out (B, K, index_head_dim)."""
    return _dense_batch(pool, slots, n_entries, max_entries, valid_mask, out, dtype, errors,
                        stream, index=True)


# ---------------------------------------------------------------------------
# decode state
# ---------------------------------------------------------------------------
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
    Run it at every admission: free_request does not reset decode states.
    CUDA: a few small torch ops (fills, copies, adds) on the current stream
    (or `stream`): no allocation, no host synchronization, capturable."""
    _check_state(state)
    slot = _host_int("slot", slot, 0, state.max_requests)
    m, d, w = state.m, state.head_dim, state.width
    if not state.is_cuda:
        ref.state_seed(state.reference_view(), slot, _np(kv, "kv"), _np(z, "z"), ape=_np(ape, "ape"))
        return
    torch = _torch()
    dev = state.device_index
    fl = (torch.float32, torch.bfloat16)
    k = _cu(kv, "kv", fl, None, dev, ndim=2)
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape (T, {w}), got {tuple(k.shape)}")
    zz = _cu(z, "z", fl, tuple(k.shape), dev)
    a = None if ape is None else _cu(ape, "ape", (torch.float32,), (m, w), dev)
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
        state.kv_a[slot].zero_()
        state.z_a[slot].fill_(float("-inf"))
        if state.overlap:
            if n >= 1:
                rows = slice((n - 1) * m, n * m)
                state.kv_b[slot].copy_(k[rows, :d])
                put_z(state.z_b[slot], zz[rows, :d], None if a is None else a[:, :d])
            else:
                state.kv_b[slot].zero_()
                state.z_b[slot].fill_(float("-inf"))
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
    (count == m: a missed flush) is skipped and adds 1 to errors. Slots must
    be distinct among valid rows. One launch."""
    _check_state(state)
    if not state.is_cuda:
        st = state.reference_view()
        kvn = _np(kv, "kv")
        B = kvn.shape[0] if kvn is not None and kvn.ndim >= 1 else 0
        sl = _np_ints("slots", slots, None)
        if sl.shape != (B,):
            raise ValueError(f"slots: expected shape ({B},), got {sl.shape}")
        err = _errors_np(errors, state.errors)
        n = ref.state_append(st, kvn, _np(z, "z"), _np(valid_mask, "valid_mask"), sl,
                             ape=_np(ape, "ape"))
        _add_errors(err, n)
        return
    torch = _torch()
    dev = state.device_index
    w = state.width
    fl = (torch.float32, torch.bfloat16)
    k = _cu(kv, "kv", fl, None, dev, ndim=2, aligned=True)
    B = k.shape[0]
    if k.shape[1] != w:
        raise ValueError(f"kv: expected shape ({B}, {w}), got {tuple(k.shape)}")
    zz = _cu(z, "z", fl, (B, w), dev, aligned=True)
    v = _cu(valid_mask, "valid_mask", (torch.bool,), (B,), dev)
    s = _cu(slots, "slots", (torch.int32,), (B,), dev)
    a = None if ape is None else _cu(ape, "ape", (torch.float32,), (state.m, w), dev, aligned=True)
    err = _errors_cu(errors, state.errors, dev)
    if B == 0:
        return
    rt = get_runtime(dev)
    fn = rt.function(_FILE, _K_APPEND[str(k.dtype)[6:], str(zz.dtype)[6:]], stream=stream)
    rt.launch_args(fn, (B,), (_state_block(w),),
              (k.data_ptr(), zz.data_ptr(), _ptr(a), v.data_ptr(), s.data_ptr(),
               state.kv_a.data_ptr(), state.z_a.data_ptr(), state.count.data_ptr(), err.data_ptr(),
               state.max_requests, state.m, w), stream)


def _state_block(w):
    return max(32, min(_BLOCK, -(-(w // 4) // 32) * 32))


def _reset(state, mode, valid_mask, slots, errors, stream, what):
    if not state.is_cuda:
        st = state.reference_view()
        sl = _np_ints("slots", slots, None)
        if sl.ndim != 1:
            raise ValueError(f"slots: expected 1 dimension, got shape {sl.shape}")
        err = _errors_np(errors, state.errors)
        if mode == _RESET_CLEAR:
            valid = _np_mask("valid_mask", valid_mask, sl.shape[0])
            n = ref.state_clear(st, sl[valid])
        else:
            fn = ref.csa_rotate if mode == _RESET_CSA else ref.hca_reset
            n = fn(st, _np(valid_mask, "valid_mask"), sl)
        _add_errors(err, n)
        return
    torch = _torch()
    dev = state.device_index
    s = _cu(slots, "slots", (torch.int32,), None, dev, ndim=1)
    B = s.shape[0]
    if valid_mask is None and mode != _RESET_CLEAR:
        raise TypeError("valid_mask: is required")
    v = None if valid_mask is None else _cu(valid_mask, "valid_mask", (torch.bool,), (B,), dev)
    err = _errors_cu(errors, state.errors, dev)
    if B == 0:
        return
    rt = get_runtime(dev)
    fn = rt.function(_FILE, _K_RESET[mode], stream=stream)
    rt.launch_args(fn, (B,), (_state_block(state.m * state.width),),
              (_ptr(v), s.data_ptr(), state.kv_a.data_ptr(), state.z_a.data_ptr(),
               _ptr(state.kv_b), _ptr(state.z_b), state.count.data_ptr(), err.data_ptr(),
               state.max_requests, state.m, state.head_dim, state.width), stream)


def csa_rotate(state, valid_mask, slots, *, errors=None, stream=None):
    """After a CSA flush, for each valid row: b <- b-half of the a rows
    (channels [0:head_dim]), a emptied (kv 0, z -inf), count 0
    (reference.csa_rotate). Out-of-range slot: skipped, errors += 1. Slots
    distinct among valid rows. One launch."""
    _check_state(state)
    if not state.overlap:
        raise ValueError("state: csa_rotate needs a CSA state (use hca_reset for HCA)")
    _reset(state, _RESET_CSA, valid_mask, slots, errors, stream, "csa_rotate")


def hca_reset(state, valid_mask, slots, *, errors=None, stream=None):
    """After an HCA flush, for each valid row: a emptied (kv 0, z -inf),
    count 0 (reference.hca_reset). Out-of-range slot: skipped, counted."""
    _check_state(state)
    if state.overlap:
        raise ValueError("state: hca_reset needs an HCA state (use csa_rotate for CSA)")
    _reset(state, _RESET_HCA, valid_mask, slots, errors, stream, "hca_reset")


def state_clear(state, slots, *, valid_mask=None, errors=None, stream=None):
    """New requests in `slots`: both streams emptied, count 0
    (reference.state_clear); valid_mask None = every row. Out-of-range slot:
    skipped, counted. state_seed does this and seeds the prompt's tail."""
    _check_state(state)
    _reset(state, _RESET_CLEAR, valid_mask, slots, errors, stream, "state_clear")
