"""The DeepSeek-V4 KV compressor: token rows -> quantized entries in the paged pool.

    n = compress_prefill(pool, kv, z, ape, norm_weight, slot,
                         index=(kv_i, z_i, ape_i, norm_weight_i))     # CSA; HCA: index=None
    compress_decode(pool, state, norm_weight, valid_mask, slots, positions,
                    index=(index_state, norm_weight_i))               # CSA; HCA: index=None

Each call is ONE kernel launch (rawkv/cu/kv_compress.cu) that does, per
entry: softmax pooling over the m (HCA) or 2m (CSA overlap) rows per channel,
RMSNorm (weight, eps 1e-6), RoPE on the last 64 dims at position entry * m
(from a cos/sin table built on the host once per pool geometry/config,
`rope_table`), for the CSA indexer key a Hadamard rotation, one BF16
rounding, quantization (FP8 entry + BF16 RoPE dims; indexer: one-level
NVFP4) and the scatter into the pool through its block table. Entry ids
outside the block table / pool are skipped and counted in `pool.errors`.

The math is rawkv.reference.kvcache (compress_csa / compress_hca ->
finish_entry / finish_index_key -> flush_write); numpy arrays and CPU pools
run exactly that. The kernel agrees with it within the tolerance stated in
docs/kvcache.md ("Compressor kernel"): only expf (float32) replaces the
reference's float64 exp, and HCA pools with an online softmax.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import _tensors as T
from ..errors import CaptureError
from ..reference import kvcache as ref
from ..runtime import get_runtime, register_kernels
from .ops import mark_written_cpu as _mark_written

__all__ = ["compress_prefill", "compress_decode", "rope_table", "PrefillIndex", "DecodeIndex",
           "reference_prefill"]

_FILE = "kv_compress.cu"
_CT = {"float32": "float", "bfloat16": "__nv_bfloat16"}
_IT = {"int32": "int", "int64": "long long"}
_RG = {"csa": 1, "hca": 4}          # row groups per CTA (kv_compress.cu RG)
_OV = {"csa": "true", "hca": "false"}
_PREFILL = {(dt, kind): f"rkv_kv_compress<{c}, int, false, {_OV[kind]}, {_RG[kind]}>"
            for dt, c in _CT.items() for kind in ("csa", "hca")}
_DECODE = {(it, kind): f"rkv_kv_compress<float, {c}, true, {_OV[kind]}, {_RG[kind]}>"
           for it, c in _IT.items() for kind in ("csa", "hca")}
register_kernels(_FILE, list(_PREFILL.values()) + list(_DECODE.values()))

_CTHREADS = 128
_MAX_D = 512
_INDEX_D = 128


class PrefillIndex(NamedTuple):
    """CSA indexer inputs of compress_prefill: kv, z (T, 2*128) like the
    main rows, ape (m, 256) or None, norm_weight (128,) float32."""
    kv: Any
    z: Any
    ape: Any
    norm_weight: Any


class DecodeIndex(NamedTuple):
    """CSA indexer inputs of compress_decode: the indexer's DecodeState
    (head_dim 128) and its norm_weight (128,) float32."""
    state: Any
    norm_weight: Any


# ---------------------------------------------------------------------------
# pool / state geometry (read from the tensors, so any object with the
# documented buffers works)
# ---------------------------------------------------------------------------
def _pool_kind(pool) -> str:
    kind = getattr(pool, "kind", None)
    if kind in ("csa", "hca"):
        return kind
    return "csa" if getattr(pool, "index_q", None) is not None else "hca"


def _pool_m(pool) -> int:
    m = getattr(pool, "m", None)
    if isinstance(m, int) and m > 0:
        return m
    return ref.CSA_RATIO if _pool_kind(pool) == "csa" else ref.HCA_RATIO


def _geom(pool):
    nb, epb, nope = (int(s) for s in pool.fp8.shape)
    rope_dim = int(pool.rope.shape[2])
    max_requests, max_blocks = (int(s) for s in pool.block_table.shape)
    return nb, epb, nope + rope_dim, rope_dim, max_requests, max_blocks


def _has_index(pool) -> bool:
    return getattr(pool, "index_q", None) is not None


def _on_cpu(t) -> bool:
    return isinstance(t, np.ndarray) or (T.is_torch(t) and not t.is_cuda)


# ---------------------------------------------------------------------------
# RoPE table: host-built once per (device, geometry, config)
# ---------------------------------------------------------------------------
_TABLES: dict = {}


def rope_table(pool, *, theta: float = ref.COMPRESS_ROPE_THETA, yarn=ref.DSV4_YARN, stream=None):
    """(max_blocks * entries_per_block, 2, rope_dim/2) float32 device tensor:
    cos, sin of entry e at position e * m, exactly rawkv.reference.kvcache.
    rope_cos_sin (float64 angles, one rounding). Built on the host and copied
    once per (device, size, m, rope_dim, theta, yarn); call it (or any
    compress_* op) before capturing a CUDA graph. `stream`: the op's stream
    (building the table is refused while it, or the current stream, captures)."""
    nb, epb, d, rope_dim, _, max_blocks = _geom(pool)
    m = _pool_m(pool)
    n_tab = max_blocks * epb
    dev = pool.fp8.device
    key = (str(dev), n_tab, m, rope_dim, float(theta), yarn)
    tab = _TABLES.get(key)
    if tab is None:
        import torch
        if dev.type == "cuda" and get_runtime(dev.index).capturing(stream):
            raise CaptureError("rawkv: the compressor's RoPE table is not built yet and the stream "
                               "is capturing a CUDA graph; call rope_table(pool) (or run the op "
                               "once) before capture")
        cos, sin = ref.rope_cos_sin(np.arange(n_tab, dtype=np.int64) * m, rope_dim, theta, yarn)
        host = np.ascontiguousarray(np.stack([cos, sin], axis=1), dtype=np.float32)
        tab = torch.from_numpy(host).to(dev)
        _TABLES[key] = tab
    return tab


# ---------------------------------------------------------------------------
# argument checks (before anything is launched or written)
# ---------------------------------------------------------------------------
def _check_int(name, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    v = int(v)
    if v < lo or (hi is not None and v >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected a value in {rng}, got {v}")
    return v


def _check_rows(name, x, width, dev):
    import torch
    if not T.is_torch(x):
        raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    T.check_tensor(x, name, (torch.float32, torch.bfloat16), ndim=2, device=dev)
    if x.shape[1] != width:
        raise ValueError(f"{name}: expected shape (T, {width}), got {tuple(x.shape)}")


def _check_f32(name, x, shape, dev):
    import torch
    if not T.is_torch(x):
        raise TypeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    T.check_tensor(x, name, (torch.float32,), shape=shape, device=dev)


def _check_eps(eps):
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")


def _check_pool(pool):
    for name in ("fp8", "scale", "rope", "block_table", "written", "errors"):
        if getattr(pool, name, None) is None:
            raise TypeError(f"pool: expected a PagedKVPool (no .{name})")
    nb, epb, d, rope_dim, _, _ = _geom(pool)
    if d % _CTHREADS or d > _MAX_D:
        raise ValueError(f"pool: head_dim must be a multiple of 128 and <= 512, got {d}")
    if rope_dim % 2 or rope_dim <= 0 or rope_dim >= d:
        raise ValueError(f"pool: rope_dim must be even and in (0, head_dim), got {rope_dim}")
    if _has_index(pool):
        if _pool_kind(pool) != "csa":
            raise ValueError("pool: indexer keys exist only in a CSA pool")
        if int(pool.index_q.shape[2]) * 2 != _INDEX_D:
            raise ValueError(f"pool: the kernel supports index_head_dim {_INDEX_D} only, "
                             f"got {int(pool.index_q.shape[2]) * 2}")
    m = _pool_m(pool)
    if _pool_kind(pool) == "csa" and m > 4:
        raise ValueError(f"pool: CSA needs m <= 4 (2m rows held in registers), got {m}")
    max_requests = int(pool.block_table.shape[0])
    wdt = str(pool.written.dtype).replace("torch.", "")
    if tuple(pool.written.shape) != (max_requests,) or wdt != "int32":
        raise ValueError(f"pool: written must be int32 of shape ({max_requests},), got "
                         f"{pool.written.dtype} {tuple(pool.written.shape)}")


def _check_index_arg(pool, index, cls):
    if _has_index(pool):
        if index is None:
            raise ValueError("index: required for a CSA pool with indexer keys "
                             f"({cls.__name__}(...))")
        if not isinstance(index, tuple) or len(index) != len(cls._fields):
            raise TypeError(f"index: expected a {cls.__name__} ({', '.join(cls._fields)})")
        return cls(*index)
    if index is not None:
        raise ValueError("index: only a CSA pool with indexer keys takes index inputs")
    return None


# ---------------------------------------------------------------------------
# reference composition (CPU path, tests, demo)
# ---------------------------------------------------------------------------
def reference_prefill(kind, kv, z, ape, norm_weight, *, start_entry=0, index=None,
                      m=None, eps=ref.RMS_EPS, theta=ref.COMPRESS_ROPE_THETA, yarn=ref.DSV4_YARN):
    """numpy composition that defines compress_prefill:
    compress_csa/compress_hca -> finish_entry (and for CSA with `index`:
    compress_csa -> finish_index_key). Returns (entry_ids, entries (n, d)
    BF16 values, keys (n, 128) or None), all float32 numpy. For CSA with
    start_entry > 0, kv/z begin one window earlier (the overlap context)."""
    m = m or (ref.CSA_RATIO if kind == "csa" else ref.HCA_RATIO)
    pre = 1 if (kind == "csa" and start_entry > 0) else 0
    pool_fn = ref.compress_csa if kind == "csa" else ref.compress_hca
    pooled = pool_fn(kv, z, ape, m)[pre:]
    ids = start_entry + np.arange(pooled.shape[0], dtype=np.int64)
    ent = ref.finish_entry(pooled, norm_weight, ids, m, eps=eps, theta=theta, yarn=yarn)
    keys = None
    if index is not None:
        ikv, iz, iape, iw = index
        ip = ref.compress_csa(ikv, iz, iape, m)[pre:]
        keys = ref.finish_index_key(ip, iw, ids, m, eps=eps, theta=theta, yarn=yarn)
    return ids, ent, keys


def _np(x, name):
    """float32 numpy array of a CPU array / tensor (None stays None)."""
    if x is None:
        return None
    a = np.asarray(T.to_numpy(x, name))
    return a.astype(np.float32, copy=False) if a.dtype.kind == "f" else a


class _RefPoolView:
    """A PagedPoolRef over a CPU pool's tensors; `commit()` writes back."""

    def __init__(self, pool, m):
        self.pool = pool
        self.rope = np.asarray(T.to_numpy(pool.rope, "pool.rope"), np.float32).copy()
        self.ref = ref.PagedPoolRef(
            m=m, kv_fp8=_npview(pool.fp8), kv_scale=_npview(pool.scale), kv_rope=self.rope,
            idx_q=_npview(pool.index_q) if _has_index(pool) else None,
            idx_sf=_npview(pool.index_sf) if _has_index(pool) else None)

    def commit(self, errors: int):
        p = self.pool
        if T.is_torch(p.rope):
            import torch
            p.rope.copy_(torch.from_numpy(self.rope).to(p.rope.dtype))
        else:
            p.rope[...] = self.rope
        if errors:
            if T.is_torch(p.errors):
                p.errors += errors
            else:
                p.errors[...] += errors


def _npview(t):
    """Writable numpy view of a CPU tensor / array (uint8, float32)."""
    if isinstance(t, np.ndarray):
        return t
    import torch
    if t.dtype not in (torch.uint8, torch.float32, torch.int32):
        t = t.view(torch.uint8)
    return t.detach().numpy()


def _cpu_prefill(pool, kv, z, ape, norm_weight, slot, start_entry, index, eps, theta, yarn):
    kind = _pool_kind(pool)
    m = _pool_m(pool)
    idx = None
    if index is not None:
        idx = (_np(index.kv, "index.kv"), _np(index.z, "index.z"), _np(index.ape, "index.ape"),
               _np(index.norm_weight, "index.norm_weight"))
    ids, ent, keys = reference_prefill(kind, _np(kv, "kv"), _np(z, "z"), _np(ape, "ape"),
                                       _np(norm_weight, "norm_weight"), start_entry=start_entry,
                                       index=idx, m=m, eps=eps, theta=theta, yarn=yarn)
    n = ids.shape[0]
    if n == 0:
        return 0
    view = _RefPoolView(pool, m)
    table_row = np.asarray(_npview(pool.block_table))[slot]
    err = ref.flush_write(view.ref, ent, np.ones(n, bool), ids * m, table_row[None, :].repeat(n, 0), keys)
    view.commit(err)
    _mark_written(pool, view.ref, slot, table_row, ids)
    return n


def _state_ref(state, m, d):
    return ref.DecodeStateRef(
        m=m, head_dim=d, a_kv=_npview(state.kv_a), a_z=_npview(state.z_a),
        count=_npview(state.count),
        b_kv=_npview(state.kv_b) if getattr(state, "kv_b", None) is not None else None,
        b_z=_npview(state.z_b) if getattr(state, "z_b", None) is not None else None)


def _cpu_decode(pool, state, norm_weight, valid_mask, slots, positions, index, eps, theta, yarn):
    """The kernel's rules, row by row (kv_compress.cu step 6): slot out of
    range -> counted; neither window complete -> skipped silently; exactly
    one of the main / indexer windows complete -> nothing written, counted;
    negative position -> counted; else entry (and key) pooled and written."""
    m = _pool_m(pool)
    _, _, d, _, _, _ = _geom(pool)
    st = _state_ref(state, m, d)
    ist = _state_ref(index.state, m, _INDEX_D) if index is not None else None
    valid = np.asarray(T.to_numpy(valid_mask, "valid_mask")).astype(bool)
    sl = np.asarray(T.to_numpy(slots, "slots")).astype(np.int64)
    pos = np.asarray(T.to_numpy(positions, "positions")).astype(np.int64)
    table_all = np.asarray(_npview(pool.block_table))
    w = _np(norm_weight, "norm_weight")
    rows, errors = [], 0
    for b in range(sl.shape[0]):
        if not valid[b]:
            continue
        s = int(sl[b])
        if not (0 <= s < st.num_slots and s < table_all.shape[0]):
            errors += 1
            continue
        full0 = int(st.count[s]) == m
        full1 = int(ist.count[s]) == m if ist is not None else full0
        if not (full0 or full1):
            continue
        if full0 != full1 or pos[b] < 0:
            errors += 1
            continue
        rows.append(b)
    view = _RefPoolView(pool, m)
    if rows:
        rows = np.asarray(rows)
        e = pos[rows] // m
        ent = ref.finish_entry(ref.state_pool(st, sl[rows]), w, e, m, eps=eps, theta=theta, yarn=yarn)
        keys = None
        if ist is not None:
            keys = ref.finish_index_key(ref.state_pool(ist, sl[rows]),
                                        _np(index.norm_weight, "index.norm_weight"),
                                        e, m, eps=eps, theta=theta, yarn=yarn)
        errors += ref.flush_write(view.ref, ent, np.ones(len(rows), bool), pos[rows],
                                  table_all[sl[rows]], keys)
    view.commit(errors)
    for b in rows:
        _mark_written(pool, view.ref, int(sl[b]), table_all[sl[b]], [pos[b] // m])


# ---------------------------------------------------------------------------
# public ops
# ---------------------------------------------------------------------------
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
    Writes entries start_entry .. start_entry + n - 1 with n = T // m (CSA
    with start_entry > 0: T // m - 1) and raises pool.written[slot] to the
    last one + 1; a trailing partial window is left to the decode state
    (state_seed). Returns n. CPU tensors / numpy run the reference.
    """
    _check_pool(pool)
    kind = _pool_kind(pool)
    m = _pool_m(pool)
    nb, epb, d, rope_dim, max_requests, max_blocks = _geom(pool)
    coff = 2 if kind == "csa" else 1
    slot = _check_int("slot", slot, 0, max_requests)
    start_entry = _check_int("start_entry", start_entry, 0)
    _check_eps(eps)
    index = _check_index_arg(pool, index, PrefillIndex)
    pre = 1 if (kind == "csa" and start_entry > 0) else 0

    if _on_cpu(pool.fp8):
        T.placement(("kv", kv), ("z", z), ("ape", ape), ("norm_weight", norm_weight))
        if T.placement(("kv", kv)) != "cpu":
            raise ValueError("kv: is on cuda but the pool is on the CPU; rawkv does not move data")
        kvn = _np(kv, "kv")
        if kvn.ndim != 2 or kvn.shape[1] != coff * d:
            raise ValueError(f"kv: expected shape (T, {coff * d}), got {kvn.shape}")
        if _np(z, "z").shape != kvn.shape:
            raise ValueError(f"z: expected the shape of kv {kvn.shape}, got {_np(z, 'z').shape}")
        if ape is not None and _np(ape, "ape").shape != (m, coff * d):
            raise ValueError(f"ape: expected shape ({m}, {coff * d}), got {_np(ape, 'ape').shape}")
        if _np(norm_weight, "norm_weight").shape != (d,):
            raise ValueError(f"norm_weight: expected shape ({d},), got "
                             f"{_np(norm_weight, 'norm_weight').shape}")
        return _cpu_prefill(pool, kv, z, ape, norm_weight, slot, start_entry, index, eps, theta, yarn)

    dev = pool.fp8.get_device()
    _check_rows("kv", kv, coff * d, dev)
    _check_rows("z", z, coff * d, dev)
    if z.shape != kv.shape or z.dtype != kv.dtype:
        raise ValueError(f"z: expected the shape and dtype of kv ({tuple(kv.shape)}, {kv.dtype}), "
                         f"got {tuple(z.shape)}, {z.dtype}")
    if ape is not None:
        _check_f32("ape", ape, (m, coff * d), dev)
    _check_f32("norm_weight", norm_weight, (d,), dev)
    n = kv.shape[0] // m - pre
    if index is not None:
        iw = 2 * _INDEX_D
        _check_rows("index.kv", index.kv, iw, dev)
        _check_rows("index.z", index.z, iw, dev)
        for nm, t in (("index.kv", index.kv), ("index.z", index.z)):
            if t.shape[0] != kv.shape[0] or t.dtype != kv.dtype:
                raise ValueError(f"{nm}: expected {kv.shape[0]} rows of {kv.dtype}, got "
                                 f"{tuple(t.shape)} {t.dtype}")
        if index.ape is not None:
            _check_f32("index.ape", index.ape, (m, iw), dev)
        _check_f32("index.norm_weight", index.norm_weight, (_INDEX_D,), dev)
    if n <= 0:
        return 0
    tab = rope_table(pool, theta=theta, yarn=yarn, stream=stream)
    rt = get_runtime(dev)
    fn = rt.function(_FILE, _PREFILL[str(kv.dtype).replace("torch.", ""), kind], stream=stream)
    p = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    if index is not None:
        part1 = (p(index.kv), p(index.z), 0, 0, p(index.ape), p(index.norm_weight), 0,
                 pool.index_q.data_ptr(), pool.index_sf.data_ptr(), _INDEX_D)
    else:
        part1 = (0, 0, 0, 0, 0, 0, 0, 0, 0, _INDEX_D)
    args = ((p(kv), p(z), 0, 0, p(ape), norm_weight.data_ptr(), 0,
             pool.fp8.data_ptr(), pool.scale.data_ptr(), pool.rope.data_ptr(), d)
            + part1
            + (tab.data_ptr(), tab.shape[0], rope_dim,
               pool.block_table.data_ptr(), max_requests, max_blocks, nb, epb, m,
               pool.written.data_ptr(),
               0, 0, 0, 0,
               slot, start_entry, pre, pool.errors.data_ptr(), float(eps)))
    rt.launch_args(fn, (n, 2 if index is not None else 1), (_CTHREADS * _RG[kind],), args, stream)
    return n


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

    state:       DecodeState of the pool's kind and head_dim (float32), one
                 row per request slot of the pool (max_requests rows: slot s
                 of the state is slot s of the block table).
    norm_weight: (d,) float32.
    valid_mask:  (B,) bool; slots, positions: (B,) int32 or int64 (same dtype).
    index:       CSA: DecodeIndex(index_state, index_norm_weight), the same
                 number of rows. The entry and its key are one unit: a row
                 flushes when both windows are complete; when exactly one is
                 (the two states are out of step, a caller error) nothing is
                 written and one error is counted.
    """
    _check_pool(pool)
    kind = _pool_kind(pool)
    m = _pool_m(pool)
    nb, epb, d, rope_dim, max_requests, max_blocks = _geom(pool)
    coff = 2 if kind == "csa" else 1
    _check_eps(eps)
    index = _check_index_arg(pool, index, DecodeIndex)
    skind = getattr(state, "kind", None)
    if skind is not None and skind != kind:
        raise ValueError(f"state: is a {skind!r} state but the pool is {kind!r}")
    for nm in ("kv_a", "z_a", "count"):
        if getattr(state, nm, None) is None:
            raise TypeError(f"state: expected a DecodeState (no .{nm})")
    if kind == "csa" and getattr(state, "kv_b", None) is None:
        raise ValueError("state: a CSA pool needs a CSA state (with kv_b / z_b)")

    def state_shapes(st, dd, name):
        R = int(st.count.shape[0])
        if tuple(st.kv_a.shape) != (R, m, coff * dd) or tuple(st.z_a.shape) != (R, m, coff * dd):
            raise ValueError(f"{name}: expected kv_a, z_a of shape ({R}, {m}, {coff * dd}), got "
                             f"{tuple(st.kv_a.shape)}, {tuple(st.z_a.shape)}")
        if kind == "csa" and (tuple(st.kv_b.shape) != (R, m, dd) or tuple(st.z_b.shape) != (R, m, dd)):
            raise ValueError(f"{name}: expected kv_b, z_b of shape ({R}, {m}, {dd})")
        return R

    # Slots index the states AND the block table: a state with more rows than
    # the pool would let a valid state slot read past the block table.
    R = state_shapes(state, d, "state")
    if R != max_requests:
        raise ValueError(f"state: has {R} slots but the pool has max_requests = {max_requests}; "
                         "a decode state must have one row per request slot of its pool")
    if index is not None:
        if int(index.state.count.shape[0]) != max_requests:
            raise ValueError(f"index.state: has {int(index.state.count.shape[0])} slots but the pool "
                             f"has max_requests = {max_requests}")
        state_shapes(index.state, _INDEX_D, "index.state")

    if _on_cpu(pool.fp8):
        vm = np.asarray(T.to_numpy(valid_mask, "valid_mask"))
        if vm.dtype != np.bool_ or vm.ndim != 1:
            raise TypeError(f"valid_mask: expected a 1-d bool array, got {vm.dtype} {vm.shape}")
        for nm, t in (("slots", slots), ("positions", positions)):
            a = np.asarray(T.to_numpy(t, nm))
            if a.dtype.kind not in "iu":
                raise TypeError(f"{nm}: expected an integer array, got dtype {a.dtype}")
            if a.shape != vm.shape:
                raise ValueError(f"{nm}: expected shape {vm.shape}, got {a.shape}")
        if _np(norm_weight, "norm_weight").shape != (d,):
            raise ValueError(f"norm_weight: expected shape ({d},)")
        _cpu_decode(pool, state, norm_weight, valid_mask, slots, positions, index, eps, theta, yarn)
        return None

    import torch
    dev = pool.fp8.get_device()
    if not T.is_torch(valid_mask):
        raise TypeError(f"valid_mask: expected a torch tensor, got {type(valid_mask).__name__}")
    T.check_tensor(valid_mask, "valid_mask", (torch.bool,), ndim=1, device=dev)
    B = valid_mask.shape[0]
    T.check_tensor(slots, "slots", (torch.int32, torch.int64), shape=(B,), device=dev)
    T.check_tensor(positions, "positions", (slots.dtype,), shape=(B,), device=dev)
    for nm in ("kv_a", "z_a") + (("kv_b", "z_b") if kind == "csa" else ()):
        T.check_tensor(getattr(state, nm), f"state.{nm}", (torch.float32,), device=dev)
    T.check_tensor(state.count, "state.count", (torch.int32,), ndim=1, device=dev)
    _check_f32("norm_weight", norm_weight, (d,), dev)
    if index is not None:
        for nm in ("kv_a", "z_a", "kv_b", "z_b"):
            T.check_tensor(getattr(index.state, nm), f"index.state.{nm}", (torch.float32,), device=dev)
        T.check_tensor(index.state.count, "index.state.count", (torch.int32,), ndim=1, device=dev)
        _check_f32("index.norm_weight", index.norm_weight, (_INDEX_D,), dev)
    if B == 0:
        return None
    tab = rope_table(pool, theta=theta, yarn=yarn, stream=stream)
    rt = get_runtime(dev)
    fn = rt.function(_FILE, _DECODE[str(slots.dtype).replace("torch.", ""), kind], stream=stream)
    p = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    kvb = p(getattr(state, "kv_b", None)) if kind == "csa" else 0
    zb = p(getattr(state, "z_b", None)) if kind == "csa" else 0
    if index is not None:
        s1 = index.state
        part1 = (s1.kv_a.data_ptr(), s1.z_a.data_ptr(), s1.kv_b.data_ptr(), s1.z_b.data_ptr(), 0,
                 index.norm_weight.data_ptr(), s1.count.data_ptr(),
                 pool.index_q.data_ptr(), pool.index_sf.data_ptr(), _INDEX_D)
    else:
        part1 = (0, 0, 0, 0, 0, 0, 0, 0, 0, _INDEX_D)
    args = ((state.kv_a.data_ptr(), state.z_a.data_ptr(), kvb, zb, 0, norm_weight.data_ptr(),
             state.count.data_ptr(), pool.fp8.data_ptr(), pool.scale.data_ptr(),
             pool.rope.data_ptr(), d)
            + part1
            + (tab.data_ptr(), tab.shape[0], rope_dim,
               pool.block_table.data_ptr(), max_requests, max_blocks, nb, epb, m,
               pool.written.data_ptr(),
               valid_mask.data_ptr(), slots.data_ptr(), positions.data_ptr(), R,
               0, 0, 0, pool.errors.data_ptr(), float(eps)))
    rt.launch_args(fn, (B, 2 if index is not None else 1), (_CTHREADS * _RG[kind],), args, stream)
    return None
