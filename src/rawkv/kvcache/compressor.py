"""What compress_prefill and compress_decode share: the indexer argument
types, the RoPE table and its parameters as the operators take them, and
the pool-side arguments of rkv_kv_compress (the pool geometry the kernel
supports: _rules.compressible)."""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..errors import CaptureError
from ..kernels import kv_compress as K
from ..reference import kvcache as ref
from ..runtime import get_runtime
from ._rules import compressible
from ._rules import pool as check_pool


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


# (device, table rows, m, rope_dim, theta, yarn) -> the device table
_TABLES: dict = {}


def rope_table(pool, *, theta: float = ref.COMPRESS_ROPE_THETA, yarn=ref.DSV4_YARN, stream=None):
    """(max_blocks * entries_per_block, 2, rope_dim/2) float32 device tensor:
    cos, sin of entry e at position e * m, exactly rawkv.reference.kvcache.
    rope_cos_sin (float64 angles, one rounding). Built on the host and copied
    once per (device, size, m, rope_dim, theta, yarn); call it (or any
    compress_* op) before capturing a CUDA graph. `stream`: the op's stream
    (building the table is refused while it, or the current stream, captures)."""
    check_pool(pool)
    compressible(pool)      # the compressor's pools only (rope_dim 64): no op reads another table
    if not pool.is_cuda:
        raise ValueError("pool: rope_table is the kernel's table; a CPU pool runs the reference")
    theta, yarn = ref.check_rope(theta, yarn)
    n_tab = pool.max_blocks_per_request * pool.entries_per_block
    key = (pool.device_index, n_tab, pool.m, pool.rope_dim, theta, yarn)
    tab = _TABLES.get(key)
    if tab is None:
        if get_runtime(pool.device_index).capturing(stream):
            raise CaptureError("rawkv: the compressor's RoPE table is not built yet and the stream "
                               "is capturing a CUDA graph; call rope_table(pool) (or run the op "
                               "once) before capture")
        import torch
        cos, sin = ref.rope_cos_sin(np.arange(n_tab, dtype=np.int64) * pool.m, pool.rope_dim, theta, yarn)
        host = np.ascontiguousarray(np.stack([cos, sin], axis=1), dtype=np.float32)
        tab = _TABLES[key] = torch.from_numpy(host).to(pool.device)
    return tab


def yarn_list(yarn):
    """A YarnConfig as the operators' `Scalar[]? yarn`: [factor,
    original_seq_len, beta_fast, beta_slow] (None stays None)."""
    if yarn is None:
        return None
    return [float(yarn.factor), float(yarn.original_seq_len), float(yarn.beta_fast), float(yarn.beta_slow)]


def yarn_of(values):
    """The YarnConfig of an operator's `yarn` (yarn_list's inverse; its
    values are checked by ref.check_rope, with the public op's theta: a
    bool, which the operator's `Scalar[]?` keeps, is refused there by its
    field's name, never read as 1 or 0)."""
    if values is None:
        return None
    if len(values) != 4:
        raise ValueError(f"yarn: expected [factor, original_seq_len, beta_fast, beta_slow], got "
                         f"{len(values)} values")
    factor, n, fast, slow = values
    if isinstance(n, float) and n.is_integer():     # (yarn_list's float of the int; an int is kept)
        n = int(n)
    return ref.YarnConfig(factor, n, fast, slow)


def part(d, kv=None, z=None, kvb=None, zb=None, ape=None, w=None, count=None) -> dict:
    """A CompressPart of rkv_kv_compress (its struct in kv_compress.cu), of
    width d: part 0 the attention entry, part 1 the CSA indexer key (all
    null when the pool has no indexer keys: the launch has no part 1 then)."""
    return dict(kv=kv, z=z, kvb=kvb, zb=zb, ape=ape, w=w, count=count, d=d)


def index_part(kv=None, z=None, kvb=None, zb=None, ape=None, w=None, count=None) -> dict:
    """rkv_kv_compress's part 1, the CSA indexer key (part)."""
    return part(K.INDEX_HEAD_DIM, kv, z, kvb, zb, ape, w, count)


def geometry(pool) -> dict:
    """rkv_kv_compress's PoolGeometry (its struct in kv_compress.cu): the
    pool's block table, page owners and what is written."""
    return dict(block_table=pool.block_table, request_ids=pool.request_ids, owners=pool.owners,
                bt_rows=pool.max_requests, bt_stride=pool.max_blocks_per_request, num_blocks=pool.num_blocks,
                epb=pool.entries_per_block, m=pool.m, written=pool.written, marks=pool.marks)


def pool_args(pool, tab, errors, eps) -> dict:
    """rkv_kv_compress's arguments that come from the pool (outputs, its
    geometry, RoPE table) and the scalars every launch sets."""
    return dict(
        out_fp8=pool.fp8, out_scale=pool.scale, out_rope=pool.rope, out_iq=pool.index_q, out_isf=pool.index_sf,
        rope_tab=tab, n_tab=tab.shape[0], rope_dim=pool.rope_dim, pool=geometry(pool), errors=errors,
        eps=eps, out_pages=pool.pages, out_index_pages=pool.index_pages, page_bytes=pool.page_bytes or 0,
        index_page_bytes=pool.index_page_bytes or 0)


def layout_targ(pool) -> int:
    """rkv_kv_compress's LAYOUT: what it writes into this pool."""
    return K.LAYOUTS[pool.layout, pool.index_layout]
