"""The KV-cache ops and the GEMM refuse, by name and before anything is written, outputs
they could not write (a read-only numpy array: issue 21, item 8) and outputs
in the memory of another output or of an input (item 7). CPU pools and
host caches; the rule (rawkv._args.check_outputs) is the same on CUDA."""
from __future__ import annotations

import re

import numpy as np
import pytest

from rawkv import kvcache as kc
from rawkv.reference.kvcache import layouts as R


def _ro(a):
    a.flags.writeable = False
    return a


def _pool():
    p = kc.PagedKVPool("hca", 8, 2, 2, 4, layout="rawkv", device="cpu")
    s = p.add_request()
    p.prepare_step([s], [p.m * 2 - 1])
    return p, s


def _refused(name, other, call):
    msg = "is read-only" if other is None else f"overlaps {re.escape(other)} in memory"
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: {msg}"):
        call()


def test_flush_write_read_only_errors_writes_no_entry():
    """flush_write used to write the entry and then fail adding to errors."""
    p, s = _pool()
    before = p.to_reference()
    ents = np.ones((1, p.head_dim), np.float32)
    args = (p, ents, np.ones(1, bool), np.array([s], np.int32), np.array([0], np.int32))
    _refused("errors", None, lambda: kc.flush_write(*args, errors=_ro(np.zeros(1, np.int32))))
    assert np.array_equal(p.reference_view().kv_fp8, before.kv_fp8) and not p.written.any()
    _refused("errors", "slots", lambda: kc.flush_write(*args[:3], args[3], args[4], errors=args[3]))


def test_gathers_refuse_read_only_or_overlapping_outputs():
    p, s = _pool()
    kc.flush_write(p, np.ones((1, p.head_dim), np.float32), np.ones(1, bool), np.array([s], np.int32),
                   np.array([0], np.int32))
    ids = np.zeros((1, 2), np.int32)
    slots = np.array([s], np.int32)
    out = np.zeros((1, 2, p.head_dim), np.float32)
    _refused("out", None, lambda: kc.gather_topk(p, slots, ids, dtype="float32", out=_ro(out.copy())))
    _refused("errors", None, lambda: kc.gather_topk(p, slots, ids, dtype="float32", errors=_ro(np.zeros(1, np.int32))))
    _refused("errors", "out", lambda: kc.gather_topk(p, slots, ids, dtype="float32", out=out,
                                                     errors=out.reshape(-1)[7:8].view(np.int32)))
    ids_in_out = out.reshape(-1)[:2].view(np.int32).reshape(1, 2)
    _refused("out", "topk_ids", lambda: kc.gather_topk(p, slots, ids_in_out, dtype="float32", out=out))
    dense = np.zeros((1, p.head_dim), np.float32)
    _refused("errors", "out", lambda: kc.gather_dense(p, s, 1, dtype="float32", out=dense,
                                                      errors=dense[0, :1].view(np.int32)))
    batch = np.zeros((1, 1, p.head_dim), np.float32)
    _refused("out", None, lambda: kc.gather_dense_batch(p, slots, np.ones(1, np.int32), dtype="float32",
                                                        out=_ro(batch)))
    idx = np.zeros((1, 2), np.int32)
    _refused("out", "topk_ids", lambda: kc.kvcache_indices(p, slots, idx, out=idx))
    assert not out.any() and not dense.any()


def test_assign_pages_refuses_errors_over_its_inputs():
    """assign_pages checked errors= for writability only: a counter in
    slots' or blocks' memory was accepted (its kernel reads them while
    adding to errors)."""
    p, s = _pool()
    blk = p.blocks_of(s)[0]
    slots_blocks = np.array([s, blk], np.int32)
    before = p.to_reference()
    _refused("errors", "slots", lambda: kc.assign_pages(p, slots_blocks[:1], slots_blocks[1:],
                                                        errors=slots_blocks[:1]))
    _refused("errors", "blocks", lambda: kc.assign_pages(p, slots_blocks[:1], slots_blocks[1:],
                                                         errors=slots_blocks[1:]))
    assert np.array_equal(p.owners, before.owners) and np.array_equal(p.marks, before.marks)
    assert list(slots_blocks) == [s, blk]


def test_pool_ops_refuse_outputs_in_the_pools_buffers():
    """out= / errors= in the memory of a buffer of the pool the op reads or
    writes (pool.written, pool.block_table, ...) was accepted: the op wrote
    its rows or counts into the pool's own bookkeeping."""
    p, s = _pool()
    ents = np.ones((1, p.head_dim), np.float32)
    slots = np.array([s], np.int32)
    kc.flush_write(p, ents, np.ones(1, bool), slots, np.array([0], np.int32))
    before = p.to_reference()
    ids = np.zeros((1, 2), np.int32)
    flush = (p, ents, np.ones(1, bool), slots, np.array([p.m], np.int32))
    _refused("errors", "pool.written", lambda: kc.flush_write(*flush, errors=p.written[s:s + 1]))
    _refused("errors", "pool.owners", lambda: kc.gather_topk(p, slots, ids, errors=p.owners[:1]))
    _refused("errors", "pool.request_ids", lambda: kc.assign_pages(p, slots, slots * 0, errors=p.request_ids))
    _refused("out", "pool.block_table", lambda: kc.kvcache_indices(p, slots, ids, out=p.block_table[:1, :2]))
    rope = p.rope.reshape(-1)          # float32 on a CPU pool: the rows' dtype
    _refused("out", "pool.rope", lambda: kc.gather_dense(p, s, 1, dtype="float32",
                                                         out=rope[:p.head_dim].reshape(1, -1)))
    _refused("out", "pool.rope", lambda: kc.gather_dense_batch(p, slots, np.ones(1, np.int32), dtype="float32",
                                                               out=rope[:2 * p.head_dim].reshape(1, 2, -1)))
    _refused("out", "pool.rope", lambda: kc.gather_topk(
        p, slots, ids[:, :1], dtype="float32", out=rope[-p.head_dim:].reshape(1, 1, -1)))
    _refused("errors", "pool.marks", lambda: kc.gather_dense(p, s, 1, errors=p.marks.reshape(-1)[:4].view(np.int32)))
    got = p.reference_view()
    for f in ("kv_fp8", "kv_scale", "kv_rope", "block_table", "written", "marks", "request_ids", "owners"):
        assert np.array_equal(getattr(got, f), getattr(before, f)), f
    assert p.read_errors() == 0


def test_state_ops_refuse_errors_in_the_states_buffers():
    st = kc.DecodeState("csa", 2, head_dim=128, device="cpu")
    rows = np.ones((1, st.width), np.float32)
    slots, valid = np.zeros(1, np.int32), np.ones(1, bool)
    _refused("errors", "state.count", lambda: kc.state_append(st, rows, rows, valid, slots, errors=st.count[:1]))
    _refused("errors", "state.count", lambda: kc.state_clear(st, slots, errors=st.count[1:]))
    z_a = st.z_a.reshape(-1)[:1].view(np.int32)
    _refused("errors", "state.z_a", lambda: kc.csa_rotate(st, valid, slots, errors=z_a))
    assert not st.count.any() and np.isneginf(st.z_a).all()


def test_the_objects_own_counter_given_explicitly_is_the_default():
    """errors=pool.errors / state.errors (or a tensor over it) is the op's
    default counter, not an overlap."""
    torch = pytest.importorskip("torch")
    p, s = _pool()
    slots = np.array([s], np.int32)
    kc.gather_topk(p, slots, np.array([[5]], np.int32), errors=p.errors)
    kc.gather_topk(p, slots, np.array([[5]], np.int32), errors=torch.from_numpy(p.errors))
    assert p.read_errors() == 2
    st = kc.DecodeState("hca", 2, head_dim=128, device="cpu")
    kc.hca_reset(st, np.ones(1, bool), np.array([7], np.int32), errors=st.errors)
    assert st.read_errors() == 1


def test_operators_refuse_outputs_in_the_objects_buffers():
    """The torch.compile path: a public op's errors= becomes the counter of
    the view its rawkv:: operator runs on (views.pool_args), and out= is
    the operator's; the same refusals, naming the same buffers."""
    torch = pytest.importorskip("torch")
    from rawkv.kvcache import views as V
    p, s = _pool()
    slots, ids = torch.tensor([s], dtype=torch.int32), torch.zeros((1, 1), dtype=torch.int32)
    written = torch.from_numpy(p.written)
    out = torch.zeros((1, 1, p.head_dim), dtype=torch.float32)
    gather = torch.ops.rawkv.kv_gather_topk
    _refused("errors", "pool.written", lambda: gather(**V.pool_args(p, written[s:s + 1]), slots=slots, topk_ids=ids,
                                                      n_entries=None, valid_mask=None, out=out))
    rope = torch.from_numpy(p.rope).view(-1)[:p.head_dim].view(1, 1, -1)
    _refused("out", "pool.rope", lambda: gather(**V.pool_args(p), slots=slots, topk_ids=ids, n_entries=None,
                                                valid_mask=None, out=rope))
    st = kc.DecodeState("hca", 2, head_dim=128, device="cpu")
    count = torch.from_numpy(st.count)
    _refused("errors", "state.count", lambda: torch.ops.rawkv.kv_state_clear(
        **V.state_args(st, count[1:]), valid_mask=None, slots=slots))
    assert not p.written.any() and not out.any() and p.read_errors() == 0


def test_layout_ops_refuse_read_only_or_overlapping_outputs():
    """model1_store into a read-only cache raised numpy's message, naming no
    argument."""
    p, n = 4, 2
    x = np.ones((1, 512), np.float32)
    slots = np.array([1], np.int32)
    cache = kc.new_layout_cache("model1", n, p)
    _refused("cache", None, lambda: kc.model1_store(_ro(cache.copy()), x, slots, page_size=p))
    _refused("cache", None, lambda: kc.model1_window_insert(_ro(cache.copy()), x, slots, page_size=p))
    _refused("errors", None, lambda: kc.index_fp8_store(kc.new_layout_cache("index_fp8", n, p),
                                                        np.ones((1, 128), np.float32), slots, page_size=p,
                                                        errors=_ro(np.zeros(1, np.int32))))
    _refused("errors", "cache", lambda: kc.model1_store(cache, x, slots, page_size=p,
                                                        errors=cache[1, :4].view(np.int32)))
    assert not cache.any()
    rows = np.zeros((1, 512), np.float32)
    _refused("out", None, lambda: kc.model1_gather(cache, slots, page_size=p, dtype="float32", out=_ro(rows)))
    table = np.zeros((1, 2), np.int32)
    _refused("out", "block_table", lambda: kc.topk_to_kvcache_indices(
        np.zeros((1, 2), np.int32), table, page_size=p, num_pages=n, out=table))
    kc.model1_store(cache, x, slots, page_size=p, errors=np.zeros(1, np.int32))       # apart: fine
    assert cache[0].any() and not cache[1].any()
    assert R.MODEL1.page_bytes(p) == cache.shape[1]


def test_gemm_refuses_out_over_x_and_errors_over_out():
    torch = pytest.importorskip("torch")
    import rawkv
    w = rawkv.gemm.Fp4Weight.from_float(torch.ones(2, 16, 32))
    buf = torch.zeros(4 * 2 * 32, dtype=torch.bfloat16)
    x = buf.view(4, 2, 32)
    x.fill_(1)
    _refused("out", "x", lambda: rawkv.gemm.grouped_linear(x, w, out=buf[:4 * 2 * 16].view(4, 2, 16)))
    assert (x == 1).all()
    x2 = torch.ones(4, 32, dtype=torch.bfloat16)
    out = torch.zeros(4, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 4], dtype=torch.int32)
    _refused("errors", "out", lambda: rawkv.gemm.moe_linear(x2, w, offsets, out=out,
                                                            errors=out.view(torch.int32)[0, :1]))
    _refused("errors", None, lambda: rawkv.gemm.moe_linear(x2, w, offsets, errors=_ro(np.zeros(1, np.int32))))
    assert not out.any()
