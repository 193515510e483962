"""Launch geometry of the NVFP4 kernels: row groups and grids."""
from __future__ import annotations

from .._plan import resident_blocks

#: Threads per CTA of the row-group and grid-stride launches.
BLOCK_THREADS = 256


def groups(units_per_row: int, cap: int = BLOCK_THREADS):
    """(tpr, block, rows per CTA) for kernels that give each row a group of
    tpr threads (a power of two below 32, else a multiple of 32)."""
    t = max(1, min(units_per_row, cap))
    tpr = 1 << (t - 1).bit_length() if t < 32 else -(-t // 32) * 32
    gpc = max(1, BLOCK_THREADS // tpr)
    return tpr, tpr * gpc, gpc


def grid(dev, rows, block, gpc):
    """CTAs for `rows` rows, `gpc` per CTA: at most two waves (the kernels
    stride over rows) of device `dev` (rawkv._plan.Device or a Runtime)."""
    return max(1, min(-(-rows // gpc), resident_blocks(dev, block) * 2))
