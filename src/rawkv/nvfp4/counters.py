"""Counters of bad inputs the NVFP4 ops met where no error could be raised
(docs/format.md, "NVFP4: error counters").

    errs = rawkv.nvfp4.error_counts()            # int32 CUDA tensor (3,), torch's current device
    bad_rows = int(errs[rawkv.nvfp4.GATHER_INDEX])   # a host sync, when the caller chooses
    errs.zero_()
    rawkv.nvfp4.error_counts("cpu")              # the CPU paths' counter: numpy int32 (3,)

Slots: GATHER_INDEX counts the gather output rows whose index was outside
[0, rows) in calls that passed no errors= (rows written as zeros);
GIVEN_GS counts the quantize calls whose device gs the kernel found unusable
(every block flagged). GEMM_OFFSETS counts the ragged rawkv.gemm offsets that
were out of order or out of [0, rows) (clamped, docs/gemm.md), in calls that
passed no errors=. Kernels add with atomics on the op's stream; nothing
here synchronizes on the hot path. The CUDA counter of a device is created,
zeroed, by rawkv.warmup() (or on first use outside graph capture).
"""
from __future__ import annotations

import threading

import numpy as np

from ..errors import CaptureError
from ..runtime import get_runtime, on_warmup

__all__ = ["error_counts", "GATHER_INDEX", "GEMM_OFFSETS", "GIVEN_GS"]       # the family's API (rawkv.nvfp4 exports it)

GATHER_INDEX = 0
GIVEN_GS = 1
GEMM_OFFSETS = 2
_SLOTS = 3

_CPU = np.zeros(_SLOTS, np.int32)
_CUDA: dict = {}          # device index -> int32 tensor (_SLOTS,)
_LOCK = threading.Lock()


def error_counts(device=None):
    """The error counters of a CUDA device (an index, 'cuda:N', a
    torch.device; None: torch's current device) as an int32 CUDA tensor of
    3 slots (GATHER_INDEX, GIVEN_GS, GEMM_OFFSETS), or with device 'cpu' those of the CPU
    paths as a numpy int32 array. The caller reads and zeroes them."""
    if device == "cpu" or getattr(device, "type", None) == "cpu":
        return _CPU
    rt = get_runtime(device)
    c = _CUDA.get(rt.device_index)
    return c if c is not None else _create(rt, None)


def address(rt, slot: int, stream=None) -> int:
    """Device address of counter `slot` of rt's device, for a kernel's
    errors pointer (the counter is created on first use)."""
    c = _CUDA.get(rt.device_index)
    if c is None:
        c = _create(rt, stream)
    return c.data_ptr() + 4 * slot


def add_cpu(slot: int, n: int) -> None:
    """Count `n` bad inputs the CPU path met in counter `slot`."""
    if n:
        _CPU[slot] += n


def _create(rt, stream):
    if rt.capturing(stream):
        raise CaptureError(
            f"rawkv.nvfp4: the error counter of cuda:{rt.device_index} does not exist yet and the "
            "stream is capturing a CUDA graph; call rawkv.warmup() before capture")
    import torch
    with _LOCK:
        c = _CUDA.get(rt.device_index)
        if c is None:
            c = torch.zeros(_SLOTS, dtype=torch.int32, device=f"cuda:{rt.device_index}")
            # zeroed before any stream's kernel adds to it (once per device)
            torch.cuda.synchronize(rt.device_index)
            _CUDA[rt.device_index] = c
    return c


on_warmup(lambda rt: address(rt, 0))
