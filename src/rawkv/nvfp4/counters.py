"""Counters of bad inputs the NVFP4 ops met where no error could be raised
(docs/format.md, "NVFP4: error counters").

    errs = rawkv.nvfp4.error_counts()            # int32 CUDA tensor (3,), torch's current device
    bad_rows = int(errs[rawkv.nvfp4.GATHER_INDEX])   # a host sync, when the caller chooses
    errs.zero_()
    rawkv.nvfp4.error_counts("cpu")              # the CPU paths' counter: numpy int32 (3,)

Slots: GATHER_INDEX counts the gather output rows whose index was outside
[0, rows) in calls that passed no errors= (rows written as zeros);
GIVEN_GS counts the quantize calls whose device gs the kernel found unusable
(every block flagged). GEMM_OFFSETS counts the GEMM's bad device inputs in
calls that passed no errors=: the ragged rawkv.gemm offsets that were out of
order or out of [0, rows) (clamped, docs/gemm.md), and the W4A8 weight
blocks whose shift byte is past the table (read as zeros, rawkv.gemm.w4a8).
Kernels add with atomics on the op's stream; nothing
here synchronizes on the hot path. The CUDA counters are the device's
runtime's (rawkv.runtime.Runtime.counters), created zeroed by rawkv.warmup()
(or on first use outside graph capture).
"""
from __future__ import annotations

import numpy as np

from ..runtime import COUNTER_SLOTS, get_runtime, on_warmup

__all__ = ["error_counts", "GATHER_INDEX", "GEMM_OFFSETS", "GIVEN_GS"]       # the family's API (rawkv.nvfp4 exports it)

# the slots of the runtime's counter buffer (Runtime.counter(slot) is a
# slot's address for a kernel's errors pointer)
GATHER_INDEX = 0
GIVEN_GS = 1
GEMM_OFFSETS = 2

_CPU = np.zeros(COUNTER_SLOTS, np.int32)


def error_counts(device=None):
    """The error counters of a CUDA device (an index, 'cuda:N', a
    torch.device; None: torch's current device) as an int32 CUDA tensor of
    3 slots (GATHER_INDEX, GIVEN_GS, GEMM_OFFSETS), or with device 'cpu' those of the CPU
    paths as a numpy int32 array. The caller reads and zeroes them."""
    if device == "cpu" or getattr(device, "type", None) == "cpu":
        return _CPU
    return get_runtime(device).counters()


def add_cpu(slot: int, n: int) -> None:
    """Count `n` bad inputs the CPU path met in counter `slot`."""
    if n:
        _CPU[slot] += n


on_warmup(lambda rt: rt.counters())
