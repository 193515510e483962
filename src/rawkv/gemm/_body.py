"""What the GEMM ops' bodies (rawkv.gemm.linear, rawkv.gemm.w4a8) share: the
CPU output (the reference's float64 result rounded once to BF16, written
into out: a bfloat16 tensor, or a numpy float32 array holding the BF16
values), the CPU count of bad inputs (offsets clamped, W4A8 shift bytes
past the table), the ragged product's CPU branch with its clamp count, and
the launch of an op that counts (run_counted), with its error counter."""
from __future__ import annotations

import numpy as np

from .. import _args as A
from ..nvfp4 import counters
from ..reference import gemm as ref


def write_bf16(y: np.ndarray, out) -> None:
    vals = (ref.round_to_bf16(y).astype(np.uint32) << 16).view(np.float32)
    A.from_numpy(vals, out, torch_dtype="bfloat16", out=out)


def count_cpu(errors, bad: int) -> None:
    """Count `bad` inputs a CPU path met in errors[0] (an int32 tensor), or
    with errors None in the host's GEMM_OFFSETS counter (the slot of the
    GEMM ops' counts: ragged offsets clamped, W4A8 shift bytes past the
    table)."""
    if errors is None:
        counters.add_cpu(counters.GEMM_OFFSETS, bad)
    elif bad:
        errors.reshape(-1)[0] += bad         # (contiguous: a view) the kernel's errors[0]


def ragged_bf16(x: np.ndarray, w: np.ndarray, offsets, errors, out) -> None:
    """The ragged product of float64 activations and weights by the
    reference's offsets rule, into out; the clamps counted in errors[0] (an
    int32 tensor), or with errors None in the host's GEMM_OFFSETS counter."""
    y, bad = ref.ragged(x, w, A.to_numpy(offsets, "offsets").astype(np.int64))
    count_cpu(errors, bad)
    write_bf16(y, out)


def run_counted(rt, act, w, errors, stream, plan) -> list:
    """The launches of a call that counts bad device inputs (a ragged call;
    W4A8's batched one too) on runtime rt (act's device): plan(rt, errors) with errors the
    caller's counter or, when None, the device's GEMM_OFFSETS counter;
    nothing for no rows (tokens) or no features. Returns the launches run."""
    if not (act.lead[0] and w.n):
        return []
    if errors is None:
        errors = rt.counter(counters.GEMM_OFFSETS, stream)
    launches = plan(rt, errors)
    rt.run(launches, stream)
    return launches
