"""The packed FP4 weight layout of docs/gemm.md in torch: reshapes, permutes,
an index_select and the codes' bits moved with shifts, so the same code
packs CPU and CUDA tensors (no numpy round trip, no host sync).
rawkv.reference.gemm defines the layout with index formulas;
tests/gemm/test_weights.py checks these equal it.

Axis names used below: a padded row is 16 r + 8 j + q (row tile r, half j:
0 for the lane's r0, 1 for r1, q = lane // 4); a padded column is 64 c +
16 t + 8 h + 2 s + e (chunk c, t = lane % 4: the lane's 16-column block,
word s; p = 2 h + e the word's column of its 4: offset 0, 1, 8 or 9 from
16 t + 2 s). Code n_i of a word (ROW_OF_CODE[i], COL_OF_CODE[i]) has its
bits at CODE_BITS[i]. Lane 4 q + t's 16 bytes sit at slot SLOT_OF_LANE[4 q + t].
"""
from __future__ import annotations

from .._args import is_torch, require_array
from ..reference.gemm import (CHUNK, CODE_BITS, COL_OF_CODE, E4M3_OF_NV_FACTOR, LANE_OF_SLOT, LANES, NV_FACTOR_OF_E4M3,
                              ROW_OF_CODE, ROWS,
                              SCALE_PAD, SLOT_OF_LANE, check_block, check_bytes, check_packed, padded_sizes)


def _dtype(t, name: str) -> str:
    """The dtype name of `t`, which must be a torch tensor (numpy arrays
    are the reference packer's)."""
    require_array(t, name)
    if not is_torch(t):
        raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__} "
                        "(rawkv.reference.gemm packs numpy arrays)")
    return str(t.dtype).replace("torch.", "")


def _unpacked(t, name: str) -> None:
    """codes / scales: the reference's rule (rawkv.reference.gemm.check_bytes)."""
    dtype = _dtype(t, name)
    check_bytes(tuple(t.shape), dtype, 3, name)


def _packed(t, n, k, block=None) -> tuple[int, int]:
    """(n, k) of a packed tensor's arguments, checked as the reference checks
    them (rawkv.reference.gemm.check_packed)."""
    dtype = _dtype(t, "packed")
    return check_packed(tuple(t.shape), dtype, n, k, block)


def _padded(t, rows: int, cols: int, fill: int):
    """t (G, N, C') in a (G, rows, cols) tensor of `fill`, on t's device."""
    out = t.new_full((t.shape[0], rows, cols), fill)
    out[:, :t.shape[1], :t.shape[2]] = t
    return out


#: The column index p of each code n_i (its offset 0, 1, 8 or 9: p = 0, 1, 2, 3).
_P_OF_CODE = [(0, 1, 8, 9).index(int(o)) for o in COL_OF_CODE]


def pack_codes(codes):
    """codes (G, N, K/2) uint8 -> packed (G, NP/16, C, 32, 16) uint8."""
    import torch
    _unpacked(codes, "codes")
    g, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    npad, chunks = padded_sizes(n, k)
    nib = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(g, n, k)
    nib = _padded(nib, npad, chunks * CHUNK, 0)
    # (g, r, j, q, c, t, h, s, e) -> (g, r, c, q, t, s, h, e, j)
    v = nib.reshape(g, npad // ROWS, 2, 8, chunks, 4, 2, 4, 2).permute(0, 1, 4, 3, 5, 7, 6, 8, 2)
    v = v.reshape(g, npad // ROWS, chunks, LANES, 4, 4, 2)       # (g, r, c, lane, s, p, j)
    v = v.index_select(3, torch.as_tensor(LANE_OF_SLOT, device=codes.device))   # slot i holds lane LANE_OF_SLOT[i]
    # each 16-bit half of a word from its four codes' bits (int32: no sign bit reached)
    halves = []
    for lo in (0, 4):
        h = None
        for i in range(lo, lo + 4):
            code = v[..., _P_OF_CODE[i], int(ROW_OF_CODE[i])].to(torch.int32)
            for b in range(4):
                bit = ((code >> b) & 1) << (int(CODE_BITS[i, b]) - 4 * lo)
                h = bit if h is None else h | bit
        halves += [h & 0xFF, h >> 8]
    return torch.stack(halves, dim=-1).to(torch.uint8).reshape(g, npad // ROWS, chunks, LANES, 16).contiguous()


def unpack_codes(packed, n: int, k: int):
    """packed (G, NP/16, C, 32, 16) -> codes (G, N, K/2), padding dropped."""
    import torch
    n, k = _packed(packed, n, k)
    g = packed.shape[0]
    npad, chunks = padded_sizes(n, k)
    b = packed.reshape(g, npad // ROWS, chunks, LANES, 4, 2, 2).to(torch.int32)   # (..., slot, s, half, byte)
    halves = b[..., 0] | (b[..., 1] << 8)
    code = {}
    for i in range(8):
        h = halves[..., i // 4]
        code[_P_OF_CODE[i], int(ROW_OF_CODE[i])] = sum(((h >> (int(CODE_BITS[i, bit]) - 16 * (i // 4))) & 1) << bit
                                                       for bit in range(4))
    v = torch.stack([code[p, j] for p in range(4) for j in range(2)], dim=-1).to(torch.uint8)   # (..., slot, s, p*2+j)
    v = v.index_select(3, torch.as_tensor(SLOT_OF_LANE, device=packed.device))
    v = v.reshape(g, npad // ROWS, chunks, 8, 4, 4, 2, 2, 2)      # (g, r, c, q, t, s, h, e, j)
    nib = v.permute(0, 1, 8, 3, 2, 4, 6, 5, 7).reshape(g, npad, chunks * CHUNK)[:, :n, :k]
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()


def pack_scales(scales, block: int):
    """scales (G, N, K/block) uint8 -> packed (G, NP/16, C, 32, 2) uint8, padding
    SCALE_PAD[block]."""
    _unpacked(scales, "scales")
    block = check_block(block)
    g, n = scales.shape[0], scales.shape[1]
    k = block * scales.shape[2]
    npad, chunks = padded_sizes(n, k)
    # one byte per 16-column unit (an MXFP4 block covers two)
    units = _padded(scales.repeat_interleave(block // 16, dim=-1), npad, chunks * 4, SCALE_PAD[block])
    # (g, r, j, q, c, t) -> (g, r, c, q, t, j)
    v = units.reshape(g, npad // ROWS, 2, 8, chunks, 4).permute(0, 1, 4, 3, 5, 2)
    v = v.reshape(g, npad // ROWS, chunks, LANES, 2)
    return _through(NV_FACTOR_OF_E4M3, v) if block == 16 else v.contiguous()


def _through(table, v):
    """Each byte of uint8 tensor v replaced by table[byte] (on v's device)."""
    import torch
    return torch.as_tensor(table, device=v.device)[v.long()].contiguous()


def unpack_scales(packed, n: int, k: int, block: int):
    """packed (G, NP/16, C, 32, 2) -> scales (G, N, K/block), padding dropped
    (an MXFP4 block's first copy)."""
    n, k = _packed(packed, n, k, block)
    block = int(block)
    g = packed.shape[0]
    npad, chunks = padded_sizes(n, k)
    v = packed.reshape(g, npad // ROWS, chunks, 8, 4, 2).permute(0, 1, 5, 3, 2, 4)
    units = v.reshape(g, npad, chunks * 4)[:, :n, :k // 16]
    units = units[..., ::block // 16]
    return _through(E4M3_OF_NV_FACTOR, units) if block == 16 else units.contiguous()
