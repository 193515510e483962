"""The per-request decode state (tail buffers) of one compressor and the
ops on it: append, pool, rotate / reset, clear, seed."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._checks import _f32, _ints, _mask
from .constants import CSA_RATIO, HCA_RATIO, Z_EMPTY
from .pooling import _softmax_pool


@dataclass
class DecodeStateRef:
    """Per-request tail buffers of one compressor, indexed by slot.

    a_kv, a_z (S, m, coff*d) float32: the full rows of the window in
        progress (z with ape added). CSA keeps both halves: the a-half is
        pooled at this window's flush, the b-half is kept for the next one.
    b_kv, b_z (S, m, d) float32 (CSA only): the b-half of the previous window.
    count (S,) int32: rows of the a-stream filled so far.
    Empty rows hold kv = 0 and z = -inf (Z_EMPTY), so an empty b-stream (first
    window) gets weight exactly 0.
    """
    m: int
    head_dim: int
    a_kv: np.ndarray
    a_z: np.ndarray
    count: np.ndarray
    b_kv: np.ndarray | None = None
    b_z: np.ndarray | None = None

    @property
    def overlap(self) -> bool:
        return self.b_kv is not None

    @property
    def num_slots(self) -> int:
        return self.count.shape[0]

    @classmethod
    def create(cls, kind: str, num_slots: int, head_dim: int, m: int | None = None) -> "DecodeStateRef":
        """kind 'csa' (m = 4, overlap) or 'hca' (m = 128); all slots empty."""
        if kind not in ("csa", "hca"):
            raise ValueError(f"kind: expected 'csa' or 'hca', got {kind!r}")
        m = m or (CSA_RATIO if kind == "csa" else HCA_RATIO)
        w = 2 * head_dim if kind == "csa" else head_dim
        st = cls(m=m, head_dim=head_dim,
                 a_kv=np.zeros((num_slots, m, w), np.float32),
                 a_z=np.full((num_slots, m, w), Z_EMPTY, np.float32),
                 count=np.zeros(num_slots, np.int32))
        if kind == "csa":
            st.b_kv = np.zeros((num_slots, m, head_dim), np.float32)
            st.b_z = np.full((num_slots, m, head_dim), Z_EMPTY, np.float32)
        return st

    def copy(self) -> "DecodeStateRef":
        c = lambda a: None if a is None else a.copy()  # noqa: E731
        return DecodeStateRef(self.m, self.head_dim, self.a_kv.copy(), self.a_z.copy(),
                              self.count.copy(), c(self.b_kv), c(self.b_z))


def _slot_ok(state: DecodeStateRef, s: int) -> bool:
    return 0 <= s < state.num_slots


def _clear_a(state: DecodeStateRef, s: int) -> None:
    state.a_kv[s] = 0.0
    state.a_z[s] = Z_EMPTY
    state.count[s] = 0


def _slots_and_mask(state, valid_mask, slots):
    slots = _ints("slots", slots, ndim=1)
    return _mask("valid_mask", valid_mask, slots.shape[0]), slots


def _owner_rows(valid_mask, slots, slot_ok):
    """(rows that own their slot, in batch order; the number of valid rows
    skipped and counted). The duplicate rule of every state op and of
    paged_compress_decode (compressor.py): among the valid rows whose slot
    is in range, the lowest row of a slot owns it; the other rows of that
    slot are skipped and counted, so the result never depends on the order
    rows run in."""
    rows, seen, errors = [], set(), 0
    for b in np.flatnonzero(valid_mask):
        s = int(slots[b])
        if not slot_ok(s) or s in seen:
            errors += 1
            continue
        seen.add(s)
        rows.append(int(b))
    return rows, errors


def _valid_slots(state, valid_mask, slots):
    """(slots owned by a valid row (_owner_rows), in batch order; the number
    of valid rows skipped and counted: slot out of range or a duplicate)."""
    valid_mask, slots = _slots_and_mask(state, valid_mask, slots)
    rows, errors = _owner_rows(valid_mask, slots, lambda s: _slot_ok(state, s))
    return [int(slots[b]) for b in rows], errors


def state_clear(state: DecodeStateRef, slots, valid_mask=None) -> int:
    """New request in `slots` (B,): both streams emptied, count 0, for each
    row with valid_mask (B,) True (None: every row). Returns the number of
    those rows skipped: slot out of range or a duplicate."""
    slots = _ints("slots", slots, ndim=1)
    ok, errors = _valid_slots(state, np.ones(slots.shape[0], bool) if valid_mask is None else valid_mask,
                              slots)
    for s in ok:
        _clear_a(state, s)
        if state.overlap:
            state.b_kv[s] = 0.0
            state.b_z[s] = Z_EMPTY
    return errors


def state_seed(state: DecodeStateRef, slot: int, kv, z, ape=None) -> None:
    """Decode state of a request admitted after prefilling its prompt.

    slot: host int; kv, z (T, coff*d): the prompt's token rows, row 0 at a
    window boundary (the whole prompt is always right; a suffix must start at
    a multiple of m and, for CSA, hold the last full window). ape (m, coff*d)
    or None. The slot is emptied (as state_clear), then, with n = T // m
    full windows and r = T % m trailing rows:
      CSA, n >= 1: b-stream = b-half [0:d] of window n-1 (z + ape[j]);
      a-stream rows 0..r-1 = the trailing rows (z + ape[j]); count = r.
    This is exactly the state that state_clear followed by state_append of
    every row and csa_rotate / hca_reset after each full window leaves (the
    tests check that). Nothing else is touched.
    """
    if isinstance(slot, (bool, np.bool_)) or not isinstance(slot, (int, np.integer)):
        raise TypeError(f"slot: expected an int, got {type(slot).__name__}")
    if not _slot_ok(state, int(slot)):
        raise ValueError(f"slot: {slot} is out of range [0, {state.num_slots})")
    s, m, d = int(slot), state.m, state.head_dim
    w = state.a_kv.shape[2]
    kv = _f32("kv", kv, last=w, ndim=2)
    z = _f32("z", z, last=w, ndim=2)
    if z.shape != kv.shape:
        raise ValueError(f"z: expected the shape of kv {kv.shape}, got {z.shape}")
    if ape is not None:
        ape = _f32("ape", ape, ndim=2)
        if ape.shape != (m, w):
            raise ValueError(f"ape: expected shape ({m}, {w}), got {ape.shape}")
    n, r = divmod(kv.shape[0], m)
    state_clear(state, np.array([s]))
    if state.overlap and n >= 1:
        rows = slice((n - 1) * m, n * m)
        state.b_kv[s] = kv[rows, :d]
        state.b_z[s] = z[rows, :d] if ape is None else z[rows, :d] + ape[:, :d]
    state.a_kv[s, :r] = kv[n * m:]
    state.a_z[s, :r] = z[n * m:] if ape is None else z[n * m:] + ape[:r]
    state.count[s] = r


def state_append(state: DecodeStateRef, kv, z, valid_mask, slots, ape=None) -> int:
    """Append one token row per batch row to its request's a-stream.

    kv, z: (B, coff*d) float32; valid_mask (B,) bool; slots (B,) int;
    ape: (m, coff*d) or None, ape[count] is added to z (count == t mod m for
    windows aligned at multiples of m). Returns the number of valid rows
    skipped: slot out of range, a duplicate slot (only the lowest valid row
    of a slot appends, _owner_rows), window already full (count == m:
    the caller missed a flush), or a count outside 0..m (corrupted memory:
    never followed, as the kernel).
    """
    valid_mask, slots = _slots_and_mask(state, valid_mask, slots)
    w = state.a_kv.shape[2]
    kv = _f32("kv", kv, last=w, ndim=2)
    z = _f32("z", z, last=w, ndim=2)
    if kv.shape[0] != slots.shape[0] or z.shape != kv.shape:
        raise ValueError(f"kv, z: expected ({slots.shape[0]}, {w}), got {kv.shape}, {z.shape}")
    if ape is not None:
        ape = _f32("ape", ape, ndim=2)
        if ape.shape != (state.m, w):
            raise ValueError(f"ape: expected shape ({state.m}, {w}), got {ape.shape}")
    rows, errors = _owner_rows(valid_mask, slots, lambda s: _slot_ok(state, s))
    for b in rows:
        s = int(slots[b])
        if not 0 <= state.count[s] < state.m:    # (a negative count: corrupted memory; never followed)
            errors += 1
            continue
        r = int(state.count[s])
        state.a_kv[s, r] = kv[b]
        state.a_z[s, r] = z[b] if ape is None else z[b] + ape[r]
        state.count[s] = r + 1
    return errors


def state_pool(state: DecodeStateRef, slots) -> np.ndarray:
    """Pool the window held in `slots` (B,) -> (B, d) float32 (before RMSNorm).

    Same arithmetic and row order as compress_csa / compress_hca, so a full
    window pools bit-identically to the prefill path. Unfilled a-rows have
    z = -inf and weigh 0. Out-of-range slots give NaN rows (callers check
    slots first; flush kernels count them).
    """
    slots = _ints("slots", slots, ndim=1)
    d = state.head_dim
    ok = (slots >= 0) & (slots < state.num_slots)
    sl = np.where(ok, slots, 0)
    if state.overlap:
        values = np.concatenate([state.b_kv[sl], state.a_kv[sl][:, :, d:]], axis=1)
        scores = np.concatenate([state.b_z[sl], state.a_z[sl][:, :, d:]], axis=1)
    else:
        values, scores = state.a_kv[sl], state.a_z[sl]
    out = _softmax_pool(values, scores)
    out[~ok] = np.nan
    return out


def csa_rotate(state: DecodeStateRef, valid_mask, slots) -> int:
    """After a CSA flush: b <- b-half of the a rows, a emptied (kv 0, z -inf),
    count 0, for each valid row. Returns the number of valid rows skipped:
    slot out of range or a duplicate (the lowest valid row of a slot acts)."""
    if not state.overlap:
        raise ValueError("state: csa_rotate needs a CSA (overlap) state")
    ok, errors = _valid_slots(state, valid_mask, slots)
    d = state.head_dim
    for s in ok:
        state.b_kv[s] = state.a_kv[s, :, :d]
        state.b_z[s] = state.a_z[s, :, :d]
        _clear_a(state, s)
    return errors


def hca_reset(state: DecodeStateRef, valid_mask, slots) -> int:
    """After an HCA flush: a emptied (kv 0, z -inf), count 0, for each valid
    row. Returns the number of valid rows skipped: slot out of range or a
    duplicate (the lowest valid row of a slot acts)."""
    if state.overlap:
        raise ValueError("state: hca_reset needs an HCA state (use csa_rotate for CSA)")
    ok, errors = _valid_slots(state, valid_mask, slots)
    for s in ok:
        _clear_a(state, s)
    return errors
