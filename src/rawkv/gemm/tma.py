"""Tensor maps (TMA) of the W4A16 wgmma kernel's activation tiles
(rawkv/cu/gemm_fp4_sm90.cu, `xmap`): with one, a single producer thread
brings each stage's tile of 16-bit activations (64 columns, 128 bytes, x BN
token rows, in the 128-byte swizzle wgmma's B operand reads) by one TMA
copy, instead of the producer warpgroup's loads and stores, which cost the
kernel 10-20% at 512-4,096 tokens (docs/gemm.md, "Hopper kernel").

The driver encodes a map (cuTensorMapEncodeTiled, through cuda-python's
driver bindings) from the activations' address, sizes and strides; TMA
needs the address and every stride but the innermost to be multiples of 16
bytes and the innermost stride 1. A view that is not, or a machine whose
driver cannot encode one, gets no map (None): the kernel's producer threads
copy the tile as before, with the same bits. Maps are cached by (address,
sizes, strides, tile rows): an engine that reuses its activation buffers
encodes each once (a CUDA graph holds the map it captured, like every other
argument).
"""
from __future__ import annotations

import ctypes
import functools
import struct

#: The kernel's TmaMap fields (the map's sixteen 8-byte words).
FIELDS = tuple(f"w{i}" for i in range(16))
#: The map argument of a launch without one (act_tma = 0).
NONE = dict.fromkeys(FIELDS, 0)
#: Columns per box: one 64-column chunk of 16-bit values (128 bytes, the
#: swizzle's row).
BOX_K = 64


def activation_map(x, ragged: bool, rows: int) -> dict | None:
    """The TmaMap fields of 16-bit activations `x` (batched (T, G, K) or
    ragged (R, K), bfloat16 or float16 on a CUDA device) for boxes of BOX_K
    columns x one group x `rows` token rows, or None where TMA cannot take x."""
    g = geometry(x, ragged, rows)
    return None if g is None else encode(x.data_ptr(), *g)


def geometry(x, ragged: bool, rows: int) -> tuple | None:
    """(dims, byte strides, rows) of x's activation map (activation_map),
    or None where TMA cannot take x. They depend on x's shape, strides and
    16-byte alignment only, so a call with the same ones at another
    address encodes the same geometry there (rawkv.gemm.fast)."""
    if not x.is_cuda or x.element_size() != 2 or x.numel() == 0 or x.stride(-1) != 1:
        return None
    if ragged:
        r, k = x.shape
        dims, strides = (k, 1, r), (2 * x.stride(0), 2 * x.stride(0))
    else:
        t, g, k = x.shape
        # A dimension of one element: its stride is never stepped.
        st_g = 2 * x.stride(1) if g > 1 else 2 * x.stride(0)
        st_t = 2 * x.stride(0) if t > 1 else st_g
        dims, strides = (k, g, t), (st_g, st_t)
    if x.data_ptr() % 16 or any(s % 16 or s <= 0 or s >= 1 << 40 for s in strides) \
            or any(d >= 1 << 32 for d in dims):
        return None
    return dims, strides, rows


@functools.lru_cache(maxsize=256)
def encode(ptr: int, dims: tuple, strides: tuple, rows: int) -> dict | None:
    """The map of `geometry` at address `ptr` (None if the driver cannot
    encode it), cached by all four."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:                                   # pragma: no cover - cuda-python < 12.6 layout
        return None
    try:
        u32, u64 = drv.cuuint32_t, drv.cuuint64_t
        err, tmap = drv.cuTensorMapEncodeTiled(
            drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, u32(3), ptr, [u64(d) for d in dims],
            [u64(s) for s in strides], [u32(BOX_K), u32(1), u32(rows)], [u32(1)] * 3,
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    except Exception:                                     # no driver library: the threads copy
        return None
    if err != drv.CUresult.CUDA_SUCCESS:
        return None
    words = struct.unpack("<16Q", ctypes.string_at(tmap.getPtr(), 128))
    return dict(zip(FIELDS, words))
