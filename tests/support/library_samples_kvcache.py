"""opcheck samples and compiled steps of the KV-cache operators
(rawkv.kvcache; tests/guards/test_library*.py collect them).

The operators take a pool's / decode state's buffers (rawkv.kvcache.views):
the samples pass real pools and states, filled by the eager ops, through
views.pool_args / state_args, exactly what the public ops pass under
torch.compile. The compiled steps restore every pool and state buffer from
a snapshot first, so each call (eager or compiled, once or repeated) starts
from the same state and the results and buffers can be compared bit for bit.
"""
import numpy as np
import torch

import rawkv.kvcache as kvc
from rawkv import _opdecl
from rawkv.kvcache import views as V
from rawkv.reference import kvcache as ref

D, DI, M = ref.HEAD_DIM, ref.INDEX_HEAD_DIM, {"csa": ref.CSA_RATIO, "hca": ref.HCA_RATIO}


def _args(name, **kw):
    """The operator's arguments in schema order (opcheck calls it positionally)."""
    return tuple(kw[n] for n, _, _ in _opdecl.declared()["kv_" + name].args)


class _Data:
    """Random inputs on one device."""

    def __init__(self, rng, device):
        self.rng, self.device = rng, device

    def t(self, a, dtype=None):
        x = torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        return x if dtype is None else x.to(dtype)

    def rows(self, *shape, dtype=None, scale=1.0):
        return self.t((scale * self.rng.standard_normal(shape)).astype(np.float32), dtype)

    def ints(self, values):
        return self.t(np.asarray(values, np.int32))

    def mask(self, values):
        return self.t(np.asarray(values, bool))

    def counter(self):
        """A caller's errors= counter."""
        return torch.zeros(1, dtype=torch.int32, device=self.device)

    def layer(self, kind, w):
        """ape (m, w) and norm_weight (w / coff)."""
        return self.rows(M[kind], w, scale=0.5), self.t((1 + 0.1 * self.rng.standard_normal(
            w // (2 if kind == "csa" else 1))).astype(np.float32))


def _pools(d: _Data, layout="rawkv", **index_layout):
    """A CSA pool (indexer keys) and an HCA pool, two requests each, with
    entries written by flush_write (one bad slot: one error each); `layout`:
    PagedKVPool's layout / index_layout."""
    pools = {}
    for kind, (nb, epb, mb, last) in {"csa": (8, 4, 4, [27, 13]), "hca": (6, 2, 3, [511, 300])}.items():
        p = kvc.PagedKVPool(kind, nb, epb, 2, mb, device=d.device, layout=layout, **index_layout)
        slots = [p.add_request(), p.add_request()]
        p.prepare_step(slots, last)
        n = [(x + 1) // M[kind] for x in last]
        sl = sum(([s] * k for s, k in zip(slots, n)), []) + [-1]
        pos = sum(([e * M[kind] for e in range(k)] for k in n), []) + [0]
        B = len(sl)
        keys = d.rows(B, DI, dtype=torch.bfloat16) if p.has_index else None
        kvc.flush_write(p, d.rows(B, D, dtype=torch.bfloat16), d.mask([True] * B), d.ints(sl), d.ints(pos),
                        index_keys=keys)
        pools[kind] = p
    return pools


def _states(d: _Data):
    """CSA and HCA decode states (and a CSA indexer state) whose slot 0 holds
    a complete window and slot 1 a partial one."""
    out = {}
    for name, kind, hd in (("csa", "csa", D), ("hca", "hca", D), ("index", "csa", DI)):
        st = kvc.DecodeState(kind, 2, hd, device=d.device)
        w, m = st.width, M[kind]
        kvc.state_seed(st, 0, d.rows(2 * m - 1, w), d.rows(2 * m - 1, w))
        kvc.state_seed(st, 1, d.rows(m + 1, w), d.rows(m + 1, w))
        kvc.state_append(st, d.rows(2, w), d.rows(2, w), d.mask([True, False]), d.ints([0, 1]))
        out[name] = st
    return out


def samples(rng, device="cpu"):
    d = _Data(rng, device)
    pools, states = _pools(d), _states(d)
    # blocks past the entries written, for the compressor's samples to raise `written`
    pools["csa"].prepare_step([1], [23])
    pools["hca"].prepare_step([0], [639])
    P = {k: V.pool_args(p) for k, p in pools.items()}
    S = {k: V.state_args(s) for k, s in states.items()}
    bf16, f32 = torch.bfloat16, torch.float32
    empty = lambda *shape, dtype=bf16: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
    sl = d.ints([0, 1])
    csa_w, hca_w = 2 * D, D
    out = {
        "flush_write": [
            _args("flush_write", **P["csa"], entries=d.rows(3, D, dtype=bf16), valid_mask=d.mask([1, 0, 1]),
                  slots=d.ints([1, 0, 7]), positions=d.ints([12, 4, 0]),
                  index_keys=d.rows(3, DI, dtype=bf16)),
            _args("flush_write", **P["hca"], entries=d.rows(2, D, dtype=bf16), valid_mask=d.mask([1, 1]),
                  slots=d.ints([0, 1]), positions=d.ints([384, 128]), index_keys=None)],
        "gather_topk": [
            _args("gather_topk", **P["csa"], slots=sl, topk_ids=d.ints([[0, 6, -1, 3], [2, 9, 1, -1]]),
                  n_entries=None, valid_mask=None, out=empty(2, 4, D)),
            _args("gather_topk", **P["csa"], slots=sl, topk_ids=d.ints([[5, 1, -3], [0, 2, 3]]).long(),
                  n_entries=d.ints([7, 2]), valid_mask=d.mask([1, 0]), out=empty(2, 3, D, dtype=f32)),
            # a caller's errors= counter, a float16 out; no rows
            _args("gather_topk", **V.pool_args(pools["hca"], d.counter()), slots=d.ints([1]),
                  topk_ids=d.ints([[1, 0, 2, -1, 5]]), n_entries=None, valid_mask=d.mask([1]),
                  out=empty(1, 5, D, dtype=torch.float16)),
            _args("gather_topk", **P["csa"], slots=d.ints([]), topk_ids=d.ints(np.zeros((0, 4))), n_entries=None,
                  valid_mask=None, out=empty(0, 4, D))],
        "gather_dense": [
            _args("gather_dense", **P["hca"], slot=0, n_entries=4, out=empty(4, D)),
            _args("gather_dense", **P["csa"], slot=1, n_entries=3, out=empty(3, D, dtype=f32)),
            _args("gather_dense", **V.pool_args(pools["csa"], d.counter()), slot=0, n_entries=0, out=empty(0, D))],
        "gather_index_keys": [
            _args("gather_index_keys", **P["csa"], slot=0, n_entries=7, out=empty(7, DI)),
            _args("gather_index_keys", **V.pool_args(pools["csa"], d.counter()), slot=1, n_entries=6,
                  out=empty(6, DI, dtype=f32)),
            _args("gather_index_keys", **P["csa"], slot=1, n_entries=0, out=empty(0, DI, dtype=torch.float16))],
        "gather_dense_batch": [
            _args("gather_dense_batch", **P["hca"], slots=sl, n_entries=d.ints([4, 3]), valid_mask=None,
                  out=empty(2, 4, D)),
            _args("gather_dense_batch", **P["csa"], slots=sl, n_entries=d.ints([5, 9]),
                  valid_mask=d.mask([1, 1]), out=empty(2, 6, D, dtype=f32)),
            # a float16 out; no entries per row (K = 0: nothing gathered, nothing counted); no rows
            _args("gather_dense_batch", **V.pool_args(pools["csa"], d.counter()), slots=d.ints([1, 0, 1]),
                  n_entries=d.ints([2, -1, 3]), valid_mask=None, out=empty(3, 3, D, dtype=torch.float16)),
            _args("gather_dense_batch", **P["hca"], slots=sl, n_entries=d.ints([4, 9]), valid_mask=None,
                  out=empty(2, 0, D)),
            _args("gather_dense_batch", **P["hca"], slots=d.ints([]), n_entries=d.ints([]),
                  valid_mask=d.mask([]), out=empty(0, 4, D))],
        "gather_index_keys_batch": [
            _args("gather_index_keys_batch", **P["csa"], slots=sl, n_entries=d.ints([7, 2]),
                  valid_mask=d.mask([0, 1]), out=empty(2, 7, DI)),
            _args("gather_index_keys_batch", **P["csa"], slots=d.ints([1]), n_entries=d.ints([4]),
                  valid_mask=None, out=empty(1, 4, DI, dtype=torch.float16)),
            _args("gather_index_keys_batch", **P["csa"], slots=d.ints([]), n_entries=d.ints([]),
                  valid_mask=None, out=empty(0, 7, DI))],
        "state_append": [
            _args("state_append", **S["csa"], kv=d.rows(2, csa_w), z=d.rows(2, csa_w, dtype=bf16),
                  valid_mask=d.mask([1, 1]), slots=d.ints([1, 0]), ape=d.rows(M["csa"], csa_w)),
            _args("state_append", **S["hca"], kv=d.rows(1, hca_w, dtype=bf16), z=d.rows(1, hca_w),
                  valid_mask=d.mask([1]), slots=d.ints([1]), ape=None),
            # the indexer's state, a caller's counter: an out-of-range slot and a duplicate (counted)
            _args("state_append", **V.state_args(states["index"], d.counter()), kv=d.rows(3, 2 * DI),
                  z=d.rows(3, 2 * DI), valid_mask=d.mask([1, 1, 1]), slots=d.ints([1, 2, 1]),
                  ape=d.rows(M["csa"], 2 * DI)),
            _args("state_append", **S["csa"], kv=d.rows(0, csa_w), z=d.rows(0, csa_w), valid_mask=d.mask([]),
                  slots=d.ints([]), ape=None)],
        # a caller's errors= counter (the public op's errors=: the view's counter), the indexer's
        # state (a CSA state of another head_dim), a duplicate slot and an out-of-range one (counted),
        # and no rows at all
        "csa_rotate": [_args("csa_rotate", **S["csa"], valid_mask=d.mask([1, 1]), slots=d.ints([0, 5])),
                       _args("csa_rotate", **V.state_args(states["index"], d.counter()),
                             valid_mask=d.mask([1, 0, 1]), slots=d.ints([1, 0, 1])),
                       _args("csa_rotate", **S["csa"], valid_mask=d.mask([]), slots=d.ints([]))],
        "hca_reset": [_args("hca_reset", **S["hca"], valid_mask=d.mask([0, 1]), slots=sl),
                      _args("hca_reset", **V.state_args(states["hca"], d.counter()), valid_mask=d.mask([1, 1, 1]),
                            slots=d.ints([1, 4, 0])),
                      _args("hca_reset", **S["hca"], valid_mask=d.mask([]), slots=d.ints([]))],
        "state_clear": [_args("state_clear", **S["index"], valid_mask=None, slots=d.ints([1])),
                        _args("state_clear", **S["hca"], valid_mask=d.mask([1]), slots=d.ints([0])),
                        _args("state_clear", **V.state_args(states["csa"], d.counter()), valid_mask=d.mask([0, 1]),
                              slots=d.ints([0, 3])),
                        _args("state_clear", **S["csa"], valid_mask=None, slots=d.ints([]))],
        "state_seed": [
            _args("state_seed", **V.state_args(states["csa"], counter=False), slot=1, kv=d.rows(10, csa_w),
                  z=d.rows(10, csa_w), ape=d.rows(M["csa"], csa_w)),
            _args("state_seed", **V.state_args(states["hca"], counter=False), slot=0,
                  kv=d.rows(5, hca_w, dtype=bf16), z=d.rows(5, hca_w, dtype=bf16), ape=None),
            # the indexer's state; a request with no prompt (T = 0: the slot emptied)
            _args("state_seed", **V.state_args(states["index"], counter=False), slot=0, kv=d.rows(9, 2 * DI),
                  z=d.rows(9, 2 * DI, dtype=bf16), ape=d.rows(M["csa"], 2 * DI)),
            _args("state_seed", **V.state_args(states["csa"], counter=False), slot=0, kv=d.rows(0, csa_w),
                  z=d.rows(0, csa_w), ape=None)],
    }
    yarn = [16.0, 65536.0, 32.0, 1.0]
    ape, nw = d.layer("csa", csa_w)
    iape, inw = d.layer("csa", 2 * DI)
    out["compress_prefill"] = [
        _args("compress_prefill", **P["csa"], kv=d.rows(24, csa_w), z=d.rows(24, csa_w), ape=ape,
              norm_weight=nw, slot=1, start_entry=0, index_kv=d.rows(24, 2 * DI), index_z=d.rows(24, 2 * DI),
              index_ape=iape, index_norm_weight=inw, eps=1e-6, theta=ref.COMPRESS_ROPE_THETA, yarn=yarn),
        _args("compress_prefill", **P["hca"], kv=d.rows(130, hca_w, dtype=bf16),
              z=d.rows(130, hca_w, dtype=bf16), ape=None, norm_weight=d.layer("hca", hca_w)[1], slot=1,
              start_entry=2, index_kv=None, index_z=None, index_ape=None, index_norm_weight=None,
              eps=1e-5, theta=10000.0, yarn=None)]
    no_index = V.state_args(None, prefix="index_", counter=False)
    out["compress_decode"] = [
        _args("compress_decode", **P["csa"], **V.state_args(states["csa"], counter=False),
              **V.state_args(states["index"], prefix="index_", counter=False), norm_weight=nw,
              valid_mask=d.mask([1, 1]), slots=sl, positions=d.ints([31, 13]), index_norm_weight=inw,
              eps=1e-6, theta=ref.COMPRESS_ROPE_THETA, yarn=yarn),
        _args("compress_decode", **P["hca"], **V.state_args(states["hca"], counter=False), **no_index,
              norm_weight=d.layer("hca", hca_w)[1], valid_mask=d.mask([1, 1]), slots=sl.long(),
              positions=d.ints([639, 300]).long(), index_norm_weight=None, eps=1e-6,
              theta=ref.COMPRESS_ROPE_THETA, yarn=yarn)]
    out["kvcache_indices"] = [
        _args("kvcache_indices", **P["csa"], slots=sl, topk_ids=d.ints([[0, 6, -1, 3], [2, 9, 1, -1]]),
              n_entries=None, valid_mask=None, out=empty(2, 4, dtype=torch.int32)),
        _args("kvcache_indices", **P["hca"], slots=sl, topk_ids=d.ints([[1, 0, -2]]).long().expand(2, 3).contiguous(),
              n_entries=d.ints([2, 1]), valid_mask=d.mask([1, 0]), out=empty(2, 3, dtype=torch.int32))]
    # blocks 5 and 6 of the CSA pool (free) to slots 1 and 0; -1 padding; slot 9: counted
    out["assign_pages"] = [
        _args("assign_pages", **P["csa"], slots=d.ints([1, 0, 0, 9]), blocks=d.ints([5, -1, 6, 7])),
        _args("assign_pages", **P["hca"], slots=d.ints([0]), blocks=d.ints([5]))]
    # the pool's "model1" layout (MODEL1 pages; FP8 / MXFP4 / MXFP8 indexer-key pages)
    for il in ("fp8", "mxfp4", "mxfp8"):
        pm = _pools(d, layout="model1", index_layout=il)
        pm["csa"].prepare_step([1], [23])
        pm["hca"].prepare_step([0], [639])
        Q = {k: V.pool_args(p) for k, p in pm.items()}
        out["flush_write"].append(
            _args("flush_write", **Q["csa"], entries=d.rows(3, D, dtype=bf16), valid_mask=d.mask([1, 0, 1]),
                  slots=d.ints([1, 0, 7]), positions=d.ints([12, 4, 0]), index_keys=d.rows(3, DI, dtype=bf16)))
        out["gather_topk"].append(
            _args("gather_topk", **Q["csa"], slots=sl, topk_ids=d.ints([[0, 6, -1, 3], [2, 9, 1, -1]]),
                  n_entries=None, valid_mask=None, out=empty(2, 4, D)))
        out["gather_index_keys_batch"].append(
            _args("gather_index_keys_batch", **Q["csa"], slots=sl, n_entries=d.ints([7, 2]),
                  valid_mask=d.mask([0, 1]), out=empty(2, 7, DI, dtype=f32)))
        out["gather_index_keys"].append(_args("gather_index_keys", **Q["csa"], slot=0, n_entries=7, out=empty(7, DI)))
        # entries read from the MODEL1 pages (the "rawkv" samples read fp8 / scale / rope): the HCA
        # pool's, and the CSA pool's slot 1 past its 3 written entries (zero rows, counted)
        out["gather_dense"].append(
            _args("gather_dense", **Q["hca"], slot=0, n_entries=4, out=empty(4, D)) if il == "fp8" else
            _args("gather_dense", **Q["csa"], slot=1, n_entries=5, out=empty(5, D, dtype=torch.float16)))
        out["gather_dense_batch"].append(
            _args("gather_dense_batch", **Q["hca"], slots=sl, n_entries=d.ints([4, 3]), valid_mask=None,
                  out=empty(2, 4, D)) if il == "fp8" else
            _args("gather_dense_batch", **Q["csa"], slots=sl, n_entries=d.ints([7, 5]), valid_mask=d.mask([1, 1]),
                  out=empty(2, 7, D, dtype=f32)))
        out["assign_pages"].append(
            _args("assign_pages", **Q["csa"], slots=d.ints([1, 0]), blocks=d.ints([6, 6])))
        out["kvcache_indices"].append(
            _args("kvcache_indices", **Q["csa"], slots=sl, topk_ids=d.ints([[0, 6, -1, 3], [2, 9, 1, -1]]),
                  n_entries=None, valid_mask=None, out=empty(2, 4, dtype=torch.int32)))
        out["compress_prefill"].append(
            _args("compress_prefill", **Q["csa"], kv=d.rows(24, csa_w), z=d.rows(24, csa_w), ape=ape,
                  norm_weight=nw, slot=1, start_entry=0, index_kv=d.rows(24, 2 * DI),
                  index_z=d.rows(24, 2 * DI), index_ape=iape, index_norm_weight=inw, eps=1e-6,
                  theta=ref.COMPRESS_ROPE_THETA, yarn=yarn))
        out["compress_decode"].append(
            _args("compress_decode", **Q["csa"], **V.state_args(states["csa"], counter=False),
                  **V.state_args(states["index"], prefix="index_", counter=False), norm_weight=nw,
                  valid_mask=d.mask([1, 1]), slots=sl, positions=d.ints([31, 13]), index_norm_weight=inw,
                  eps=1e-6, theta=ref.COMPRESS_ROPE_THETA, yarn=yarn))
    out["compress_decode"].append(
        _args("compress_decode", **Q["hca"], **V.state_args(states["hca"], counter=False), **no_index,
              norm_weight=d.layer("hca", hca_w)[1], valid_mask=d.mask([1, 1]), slots=sl,
              positions=d.ints([639, 300]), index_norm_weight=None, eps=1e-6, theta=ref.COMPRESS_ROPE_THETA,
              yarn=None))
    # the writers on a "model1" HCA pool (its pages, no index_pages)
    out["flush_write"].append(
        _args("flush_write", **Q["hca"], entries=d.rows(2, D, dtype=bf16), valid_mask=d.mask([1, 1]),
              slots=d.ints([0, 1]), positions=d.ints([512, 3 * 128]), index_keys=None))
    hca_ape, hca_nw = d.layer("hca", hca_w)
    # bfloat16 rows for the entry and the indexer key (the index rows take kv's dtype), no ape
    out["compress_prefill"].append(
        _args("compress_prefill", **P["csa"], kv=d.rows(16, csa_w, dtype=bf16), z=d.rows(16, csa_w, dtype=bf16),
              ape=None, norm_weight=nw, slot=1, start_entry=2, index_kv=d.rows(16, 2 * DI, dtype=bf16),
              index_z=d.rows(16, 2 * DI, dtype=bf16), index_ape=None, index_norm_weight=inw, eps=1e-5,
              theta=ref.COMPRESS_ROPE_THETA, yarn=yarn))
    out["compress_prefill"].append(
        _args("compress_prefill", **Q["hca"], kv=d.rows(130, hca_w), z=d.rows(130, hca_w), ape=hca_ape,
              norm_weight=hca_nw, slot=0, start_entry=4, index_kv=None, index_z=None,
              index_ape=None, index_norm_weight=None, eps=1e-6, theta=ref.COMPRESS_ROPE_THETA, yarn=yarn))
    # block 5 (free) to slot 1; its duplicate (the lowest row wins) counted in a caller's counter
    out["assign_pages"].append(_args("assign_pages", **V.pool_args(pm["hca"], d.counter()), slots=d.ints([1, 0, 0]),
                                     blocks=d.ints([5, -1, 5])))
    # a CSA pool without indexer keys (index_head_dim=None: index_q / index_sf None, no index inputs)
    nk = _pools(d, index_head_dim=None)["csa"]
    nk.prepare_step([1], [23])
    N = V.pool_args(nk)
    out["flush_write"].append(
        _args("flush_write", **N, entries=d.rows(2, D, dtype=bf16), valid_mask=d.mask([1, 1]), slots=d.ints([1, 0]),
              positions=d.ints([16, 8]), index_keys=None))
    out["compress_prefill"].append(
        _args("compress_prefill", **N, kv=d.rows(9, csa_w, dtype=bf16), z=d.rows(9, csa_w, dtype=bf16), ape=None,
              norm_weight=nw, slot=1, start_entry=3, index_kv=None, index_z=None, index_ape=None,
              index_norm_weight=None, eps=1e-6, theta=ref.COMPRESS_ROPE_THETA, yarn=None))
    out["compress_decode"].append(
        _args("compress_decode", **N, **V.state_args(states["csa"], counter=False), **no_index, norm_weight=nw,
              valid_mask=d.mask([1, 1]), slots=sl, positions=d.ints([31, 13]), index_norm_weight=None, eps=1e-6,
              theta=ref.COMPRESS_ROPE_THETA, yarn=yarn))
    # no rows: a step of no requests, a prompt of no tokens
    none, empty_ids = d.ints([]), d.ints(np.zeros((0, 4)))
    out["flush_write"].append(
        _args("flush_write", **P["csa"], entries=d.rows(0, D, dtype=bf16), valid_mask=d.mask([]), slots=none,
              positions=none, index_keys=d.rows(0, DI, dtype=bf16)))
    out["assign_pages"].append(_args("assign_pages", **P["hca"], slots=none, blocks=none))
    out["kvcache_indices"].append(
        _args("kvcache_indices", **P["csa"], slots=none, topk_ids=empty_ids, n_entries=none, valid_mask=d.mask([]),
              out=empty(0, 4, dtype=torch.int32)))
    out["compress_prefill"].append(
        _args("compress_prefill", **P["hca"], kv=d.rows(0, hca_w), z=d.rows(0, hca_w), ape=None, norm_weight=hca_nw,
              slot=0, start_entry=0, index_kv=None, index_z=None, index_ape=None, index_norm_weight=None, eps=1e-6,
              theta=ref.COMPRESS_ROPE_THETA, yarn=None))
    out["compress_decode"].append(
        _args("compress_decode", **P["csa"], **V.state_args(states["csa"], counter=False),
              **V.state_args(states["index"], prefix="index_", counter=False), norm_weight=nw,
              valid_mask=d.mask([]), slots=none, positions=none, index_norm_weight=inw, eps=1e-6,
              theta=ref.COMPRESS_ROPE_THETA, yarn=yarn))
    return {"kv_" + k: v for k, v in out.items()}


def _snapshot(objs, device, outs=()):
    """(buffers, restore): every buffer of the pools / states and a function
    that copies their snapshot back (the first thing each step does)."""
    bufs = [t for o in objs for t in o.torch_buffers().values() if t is not None]
    saved = [t.clone() for t in bufs]
    if device != "cpu":
        # the pool / state buffers and the step's outputs never move: static
        # inputs, which CUDA graphs (mode="reduce-overhead") may write in place
        for t in (*bufs, *outs):
            torch._dynamo.mark_static_address(t)

    def restore():
        for dst, src in zip(bufs, saved):
            dst.copy_(src)
    return bufs, restore


def _decode_step(rng, device, layout="rawkv"):
    """The decode step of rawkv/demo.py (state_append, compress_decode,
    csa_rotate, hca_reset, gather_topk, gather_dense_batch) at a small size;
    request 0's step flushes a CSA and an HCA entry."""
    from rawkv.demo import Decoder
    dec = Decoder(rng, [127, 134], 2, 8, 4, device=device, tensors=True, layout=layout)
    dec.prefill()
    dec.prepare(0)
    bufs, restore = _snapshot([*dec.pools.values(), *dec.states.values(), dec.istate], device,
                              (dec.out or {}).values())

    def step():
        restore()
        rows = dec.step()
        return (*(r.clone() for r in rows), *(t.clone() for t in bufs))
    return step, ()


def _prefill_step(rng, device, layout="rawkv", **index_layout):
    """Admission and the format ops: compress_prefill, state_seed,
    state_clear, flush_write, then every gather of the CSA pool and the
    top-k bridge; `layout`: the pool's (PagedKVPool layout=, index_layout=)."""
    d = _Data(rng, device)
    pool = kvc.PagedKVPool("csa", 16, 4, 2, 8, device=device, layout=layout, **index_layout)
    state = kvc.DecodeState("csa", 2, device=device)
    istate = kvc.DecodeState("csa", 2, DI, device=device)
    slots = [pool.add_request(), pool.add_request()]
    T = 22
    pool.prepare_step(slots, [T - 1, 11])
    ape, nw = d.layer("csa", 2 * D)
    iape, inw = d.layer("csa", 2 * DI)
    kv, z, ikv, iz = d.rows(T, 2 * D), d.rows(T, 2 * D), d.rows(T, 2 * DI), d.rows(T, 2 * DI)
    ents, keys = d.rows(3, D, dtype=torch.bfloat16), d.rows(3, DI, dtype=torch.bfloat16)
    valid, sl, pos = d.mask([1, 1, 1]), d.ints([1, 1, 1]), d.ints([0, 4, 8])
    bslots, ne, ids = d.ints(slots), d.ints([5, 3]), d.ints([[4, 0, -1], [2, 1, 0]])
    dense = torch.empty((T // 4, D), dtype=torch.bfloat16, device=device)
    index_keys = torch.empty((T // 4, DI), dtype=torch.float32, device=device)
    if device != "cpu":
        kvc.rope_table(pool)       # the compressor's table, built before any capture
    bufs, restore = _snapshot([pool, state, istate], device, (dense, index_keys))

    def step():
        restore()
        kvc.state_clear(state, bslots)
        n = kvc.compress_prefill(pool, kv, z, ape, nw, slots[0], index=kvc.PrefillIndex(ikv, iz, iape, inw))
        kvc.state_seed(state, slots[0], kv, z, ape=ape)
        kvc.state_seed(istate, slots[0], ikv, iz, ape=iape)
        kvc.flush_write(pool, ents, valid, sl, pos, index_keys=keys)
        # out= given: without it and without a tensor argument, a CPU pool's
        # eager gather_dense returns numpy (compiled: a tensor)
        got = (kvc.gather_dense(pool, slots[0], n, out=dense),
               kvc.gather_index_keys(pool, slots[0], n, out=index_keys),
               kvc.gather_dense_batch(pool, bslots, ne, max_entries=5),
               kvc.gather_index_keys_batch(pool, bslots, ne, max_entries=5),
               kvc.gather_topk(pool, bslots, ids, dtype="float16"),
               kvc.kvcache_indices(pool, bslots, ids))
        return (*got, *(t.clone() for t in bufs))
    return step, ()


def _prefill_step_model1(rng, device):
    return _prefill_step(rng, device, layout="model1", index_layout="mxfp4")


def _prefill_step_mxfp8(rng, device):
    return _prefill_step(rng, device, layout="model1", index_layout="mxfp8")


def _decode_step_model1(rng, device):
    return _decode_step(rng, device, layout="model1")


STEPS = [("kvcache_decode_step", _decode_step), ("kvcache_decode_step_model1", _decode_step_model1),
         ("kvcache_prefill_admission", _prefill_step),
         ("kvcache_prefill_admission_model1", _prefill_step_model1),
         ("kvcache_prefill_admission_mxfp8", _prefill_step_mxfp8)]
