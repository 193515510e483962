"""Per-request decode state (tail buffers) of one compressor.

    state = DecodeState("csa", max_requests=64)          # head_dim=512
    rawkv.kvcache.state_append(state, kv, z, valid, slots, ape=ape)
    ...  flush_write(...); csa_rotate(state, valid, slots)

float32 buffers, laid out as rawkv.reference.kvcache.DecodeStateRef:

    kv_a, z_a (max_requests, m, coff*head_dim)  the full rows of the window in
                                                progress (z with ape added)
    kv_b, z_b (max_requests, m, head_dim)       CSA only: b-half of the
                                                previous window
    count     (max_requests,) int32             rows of the a-stream filled
    errors    (1,) int32                        rows the state kernels skipped

Empty rows hold kv = 0 and z = -inf (docs/kvcache.md, decision 4); every slot
starts empty. Slot s is the pool's slot s: a state used with a pool has
max_requests rows and is attached to it (pool.attach(state), once, when the
layer is built; compress_decode refuses anything else). The pool empties the
slot of every attached state when it frees the slot, so a slot's next request
never starts from the previous one's rows; state_seed then gives it its own
prompt's tail. device="cpu" keeps numpy arrays and runs the reference.
"""
from __future__ import annotations

import numpy as np

from .. import _args as A
from ..reference import kvcache as ref
from .pool import ErrorCounter, _kind, _max_requests, plain_tensors, register_buffers, resolve_device


class DecodeState(ErrorCounter):
    """Tail buffers of the CSA (m = 4, two streams) or HCA (m = 128) compressor."""

    BUFFERS = ("kv_a", "z_a", "kv_b", "z_b", "count", "errors")
    _pool = None        # the PagedKVPool it is attached to (PagedKVPool.attach)
    _owner = None       # a view's: the state whose buffers it is over (pool.check_one_owner), or None

    def __init__(self, kind, max_requests, head_dim=ref.HEAD_DIM, *, device="cuda"):
        self._set_geometry(kind, max_requests, head_dim)
        self.is_cuda, self.device_index = resolve_device(device)
        R, m, w, d = self.max_requests, self.m, self.width, self.head_dim
        if self.is_cuda:
            import torch
            with plain_tensors():      # (pool.plain_tensors: a layer built under inference_mode)
                dev = torch.device("cuda", self.device_index)
                self.device = dev
                f32 = torch.float32
                self.kv_a = torch.zeros((R, m, w), dtype=f32, device=dev)
                self.z_a = torch.full((R, m, w), float("-inf"), dtype=f32, device=dev)
                if kind == "csa":
                    self.kv_b = torch.zeros((R, m, d), dtype=f32, device=dev)
                    self.z_b = torch.full((R, m, d), float("-inf"), dtype=f32, device=dev)
                else:
                    self.kv_b = self.z_b = None
                self.count = torch.zeros(R, dtype=torch.int32, device=dev)
                self.errors = torch.zeros(1, dtype=torch.int32, device=dev)
        else:
            self.device = "cpu"
            st = ref.DecodeStateRef.create(kind, R, d)
            self.kv_a, self.z_a, self.count = st.a_kv, st.a_z, st.count
            self.kv_b, self.z_b = st.b_kv, st.b_z
            self.errors = np.zeros(1, np.int32)
        self._init_torch_buffers()
        self._seal()
        register_buffers(self)

    def _set_geometry(self, kind, max_requests, head_dim) -> None:
        """The state's sizes, checked (the constructor's rules, and
        views.state_view's)."""
        self.kind = kind
        self.m = _kind(kind)
        self.max_requests = _max_requests(max_requests)
        self.head_dim = A.positive_int("head_dim", head_dim)
        if self.head_dim % 4:
            raise ValueError(f"head_dim: expected a multiple of 4, got {head_dim}")
        self.coff = 2 if kind == "csa" else 1
        self.width = self.coff * self.head_dim
        if self.m * self.width >= 1 << 32:
            # (the state kernels find a row of the window with a 32-bit division)
            raise ValueError(f"head_dim: {head_dim} makes a {kind.upper()} window of {self.m} x {self.width} "
                             "values, past the kernels' 2^32")

    def __repr__(self):
        return (f"<DecodeState {self.kind} m={self.m} requests={self.max_requests} "
                f"head_dim={self.head_dim} device={self.device}>")

    @property
    def overlap(self) -> bool:
        return self.kind == "csa"

    def _holds_rows(self) -> bool:
        """Some slot has a-stream rows (count != 0) or a CSA b-stream.
        Synchronizes on CUDA."""
        # numpy arrays and torch tensors alike
        return bool(self.count.any()) or (self.z_b is not None and bool((self.z_b != float("-inf")).any()))

    def _empty(self, slot=None) -> None:
        """Empty `slot` (a host int; None: every slot), both streams: kv 0,
        z -inf, count 0 (reference.state_clear). CUDA: fills on the current
        stream (no allocation, no synchronization). The one emptying of
        state_seed and of the pool's free_request."""
        s = slice(None) if slot is None else slot
        for buf, v in ((self.kv_a, 0.0), (self.z_a, float("-inf")), (self.kv_b, 0.0),
                       (self.z_b, float("-inf")), (self.count, 0)):
            if buf is None:
                continue
            if self.is_cuda:
                buf[s].fill_(v)
            else:
                buf[s] = v

    def to_reference(self) -> ref.DecodeStateRef:
        """Host copy as a DecodeStateRef (CUDA: synchronizes; tests only)."""
        if not self.is_cuda:
            return self.reference_view().copy()
        c = lambda t: None if t is None else t.cpu().numpy()  # noqa: E731
        return ref.DecodeStateRef(self.m, self.head_dim, c(self.kv_a), c(self.z_a), c(self.count),
                                  c(self.kv_b), c(self.z_b))

    def reference_view(self) -> ref.DecodeStateRef:
        """CPU states: a DecodeStateRef sharing this state's arrays."""
        if self.is_cuda:
            raise ValueError("state: reference_view() is for CPU states; use to_reference()")
        return ref.DecodeStateRef(self.m, self.head_dim, self.kv_a, self.z_a, self.count,
                                  self.kv_b, self.z_b)
