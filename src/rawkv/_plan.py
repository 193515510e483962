"""Launch plans as data: what an op launches, computed by a pure function of
sizes and device properties, then run.

A plan is a list of `Launch`es (kernel instance, grid, block, keyword
arguments), `Memset`s (bytes zeroed on the launch stream between them) and
`Fill`s (a tensor set to one value: the gs an encode of no elements still
writes). A family's planners build them from the checked arguments and a
`Device` (or anything with its fields: a Runtime has them); the Runtime
runs them in order (rawkv.runtime.Runtime.run). Tests read plans as data,
with no runtime.
"""
from __future__ import annotations

from typing import NamedTuple


class Device(NamedTuple):
    """The device properties a plan depends on (a Runtime has the same
    fields); `arch` ('sm_90') for the plans that choose a kernel by it."""
    sm_count: int
    max_threads_per_sm: int
    arch: str = ""


class Launch(NamedTuple):
    """One kernel launch: `kernel` a rawkv.kernels Instance, `args` its
    parameters by name (tensors, None for a null pointer, numbers). `tma`:
    the geometry of a tensor map among the args (rawkv.gemm.tma.geometry),
    for a fast path that encodes it again at a new address; None for most."""
    kernel: object
    grid: tuple
    block: tuple
    args: dict
    tma: tuple | None = None


class Memset(NamedTuple):
    """Zero the first `nbytes` of tensor `dst` on the plan's stream (in
    order with the launches: an accumulator the next launch atomically adds
    to)."""
    dst: object
    nbytes: int


class Fill(NamedTuple):
    """Set every element of tensor `dst` to `value` (a number or a 0-d
    tensor of the same device) on the plan's stream."""
    dst: object
    value: object


def resident_blocks(dev, block: int) -> int:
    """How many blocks of `block` threads fill every SM once (by threads)."""
    return dev.sm_count * max(1, dev.max_threads_per_sm // block)


def grid_stride(dev, work_items: int, block: int = 256, waves: int = 2) -> tuple[int, int]:
    """(grid, block) for a grid-stride loop over `work_items`, one item per
    thread per iteration: enough blocks to fill the device `waves` times,
    never more than there is work."""
    blocks = -(-max(int(work_items), 1) // block)
    return min(blocks, resident_blocks(dev, block) * waves), block
