"""The paged-pool ops' launch plans (rawkv.kvcache.plans) as data: which
kernel instance, grid, block and arguments each plan holds, from the pool's
sizes and the device properties, with no runtime. Every launch's arguments
are exactly its kernel's parameters (read from the .cu signature) and each
scalar fits its C type. What the kernels compute: the GPU tests."""
import struct

import pytest

torch = pytest.importorskip("torch")
import rawkv.kvcache as kvc  # noqa: E402
from rawkv._plan import Device, grid_stride  # noqa: E402
from rawkv.kvcache import plans as P  # noqa: E402

H100 = Device(sm_count=132, max_threads_per_sm=2048)
SMALL = Device(sm_count=2, max_threads_per_sm=1024)


def _t(shape, dtype=torch.int32):
    return torch.zeros(shape, dtype=dtype)


def _pool(kind="csa", layout="rawkv", **kw):
    return kvc.PagedKVPool(kind, 8, 4, 2, 4, device="cpu", layout=layout, **kw)


def _checked(plan):
    """The plan, after checking each launch's arguments against its kernel."""
    for launch in plan:
        params = launch.kernel.kernel.params
        assert list(launch.args) != [] and set(launch.args) == {p.name for p in params}, launch.kernel
        for p in params:
            value = launch.args[p.name]
            if p.fields is None:
                items = [(p, value, p.slot)]
            else:                                       # a struct: a dict of its fields
                assert set(value) == {f.name for f in p.fields}, p
                items = [(f, value[f.name], f.fmt) for f in p.fields]
            for what, v, fmt in items:
                if what.pointer:
                    assert v is None or hasattr(v, "shape"), what
                else:
                    struct.pack("<" + fmt, v)           # fits its C type
        assert all(isinstance(d, int) and d > 0 for d in (*launch.grid, *launch.block)), launch
    return plan


def _one(plan):
    (launch,) = _checked(plan)
    return launch


def test_grid_stride_follows_the_device():
    assert grid_stride(H100, 5 * 32, 256) == (1, 256)
    assert grid_stride(H100, 0, 256) == (1, 256)
    assert grid_stride(H100, 10 ** 9, 256) == (132 * 8 * 2, 256)       # two waves of resident blocks
    assert grid_stride(SMALL, 10 ** 9, 256, waves=1) == (2 * 4, 256)


def test_assign_pages():
    pool, s, b, err = _pool(), _t(5), _t(5), _t(1)
    assert P.assign_pages(H100, pool, s[:0], b[:0], err) == []
    a = _one(P.assign_pages(H100, pool, s, b, err))
    assert a.kernel.expr == "rkv_kv_assign_pages" and (a.grid, a.block) == ((1,), (256,))
    assert a.args["slots"] is s and a.args["blocks"] is b and a.args["errors"] is err
    assert a.args["owners"] is pool.owners and a.args["marks"] is pool.marks
    assert (a.args["B"], a.args["num_requests"], a.args["num_blocks"], a.args["epb"]) == (5, 2, 8, 4)
    big = _one(P.assign_pages(SMALL, pool, _t(10 ** 5), _t(10 ** 5), err))
    assert big.grid == (2 * 4 * 2,)                 # a warp per row, capped at two waves of SMALL


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_flush_write_rawkv_layout(kind):
    pool = _pool(kind)
    e, k = _t((6, 512), torch.bfloat16), (_t((6, 128), torch.bfloat16) if kind == "csa" else None)
    v, s, pos, err = _t(6, torch.bool), _t(6), _t(6), _t(1)
    assert P.flush_write(pool, e[:0], k, v, s, pos, err) == []
    f = _one(P.flush_write(pool, e, k, v, s, pos, err))
    assert f.kernel.expr == f"rkv_kv_flush_write<{'true' if kind == 'csa' else 'false'}>"
    assert (f.grid, f.block) == ((2,), (128,))       # 4 rows (warps) per CTA
    assert f.args["entries"] is e and f.args["index_keys"] is k and f.args["fp8"] is pool.fp8
    assert f.args["table"] is pool.block_table and f.args["written"] is pool.written
    assert (f.args["index_dim"], f.args["m"], f.args["B"]) == (128 if kind == "csa" else 0, pool.m, 6)


@pytest.mark.parametrize("index_layout, targs", [("fp8", "true, 0"), ("mxfp4", "true, 1"), ("mxfp8", "true, 2")])
def test_flush_write_model1_layout(index_layout, targs):
    pool = _pool("csa", "model1", index_layout=index_layout)
    e, k = _t((9, 512), torch.bfloat16), _t((9, 128), torch.bfloat16)
    f = _one(P.flush_write(pool, e, k, _t(9, torch.bool), _t(9), _t(9), _t(1)))
    assert f.kernel.expr == f"rkv_kv_flush_pages<{targs}>" and f.grid == (3,)
    assert f.args["pages"] is pool.pages and f.args["index_pages"] is pool.index_pages
    assert (f.args["page_bytes"], f.args["index_page_bytes"]) == (pool.page_bytes, pool.index_page_bytes)


def test_gathers_by_ids_and_dense():
    pool = _pool()
    ids, s, ne, v = _t((3, 7), torch.int64), _t(3), _t(3), _t(3, torch.bool)
    out, err = _t((3, 7, 512), torch.bfloat16), _t(1)
    g = _one(P.gather(H100, pool, ids, s, ne, v, out, err, 3, 7))
    assert g.kernel.expr == "rkv_kv_gather<__nv_bfloat16, long long, false>"
    assert (g.grid, g.block) == ((3,), (256,))              # a warp per row: 3 * 7 * 32 threads
    assert g.args["ids"] is ids and g.args["out"] is out and (g.args["slot0"], g.args["n0"]) == (0, -1)
    assert (g.args["B"], g.args["K"], g.args["nope_dim"], g.args["rope_dim"]) == (3, 7, 448, 64)
    d = _one(P.gather(H100, pool, None, None, None, None, _t((1, 5, 512), torch.float32), err, 1, 5, 1, 5))
    assert d.kernel.expr == "rkv_kv_gather<float, int, true>" and d.args["ids"] is None
    assert (d.args["slot0"], d.args["n0"]) == (1, 5)
    assert P.gather(H100, pool, ids[:0], s[:0], ne[:0], v[:0], out[:0], err, 0, 7) == []
    m1 = _pool("csa", "model1")
    p = _one(P.gather(H100, m1, ids, s, ne, v, out, err, 3, 7))
    assert p.kernel.expr == "rkv_kv_gather_pages<__nv_bfloat16, long long, false>"
    assert p.args["pages"] is m1.pages and p.args["page_bytes"] == m1.page_bytes


def test_index_key_gathers():
    out, err = _t((2, 40, 128), torch.float16), _t(1)
    g = _one(P.gather_index(H100, _pool(), _t(2), _t(2), None, out, err, 2, 40))
    assert g.kernel.expr == "rkv_kv_gather_index<__half>"
    assert g.grid == (-(-2 * 40 * 8 // 256),) and g.args["index_dim"] == 128   # a thread per 16 dims
    m1 = _pool("csa", "model1", index_layout="mxfp4")
    p = _one(P.gather_index(H100, m1, None, None, None, out, err, 1, 40, 1, 40))
    assert p.kernel.expr == "rkv_kv_gather_index_pages<__half, 1>" and p.grid == (-(-40 * 32 // 256),)
    assert p.args["index_pages"] is m1.index_pages and (p.args["slot0"], p.args["n0"]) == (1, 40)
    m8 = _pool("csa", "model1", index_layout="mxfp8")
    p = _one(P.gather_index(H100, m8, None, None, None, out, err, 1, 40, 1, 40))
    assert p.kernel.expr == "rkv_kv_gather_index_pages<__half, 2>"
    assert p.args["index_page_bytes"] == m8.index_page_bytes == kvc.layout_page_bytes("index_mxfp8", 4)


def test_kvcache_indices():
    pool, ids, out = _pool(), _t((4, 600)), _t((4, 600))
    b = _one(P.kvcache_indices(H100, pool, ids, None, None, None, out, _t(1)))
    assert b.kernel.expr == "rkv_kv_topk_indices<int>" and b.grid == (-(-2400 // 256),)
    assert (b.args["B"], b.args["K"], b.args["out"]) == (4, 600, out)
    assert P.kvcache_indices(H100, pool, ids[:0], None, None, None, out[:0], _t(1)) == []


@pytest.mark.parametrize("w, block", [(8, 32), (512, 128), (1024, 256), (4096, 256)])
def test_state_block(w, block):
    assert P.state_block(w) == block


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_state_ops(kind):
    st = kvc.DecodeState(kind, 3, device="cpu")
    kv = _t((2, st.width), torch.bfloat16)
    z = _t((2, st.width), torch.float32)
    a = _one(P.state_append(st, kv, z, None, _t(2, torch.bool), _t(2), _t(1)))
    assert a.kernel.expr == "rkv_kv_state_append<__nv_bfloat16, float>"
    assert (a.grid, a.block) == ((2,), (P.state_block(st.width),))
    assert a.args["a_kv"] is st.kv_a and (a.args["S"], a.args["m"], a.args["w"]) == (3, st.m, st.width)
    r = _one(P.state_reset(st, kvc.plans.K.RESET_CLEAR, None, _t(5), _t(1)))
    assert r.kernel.expr == "rkv_kv_state_reset<2>" and (r.grid, r.block) == ((5,), (256,))
    assert r.args["b_kv"] is st.kv_b and r.args["d"] == st.head_dim
    assert P.state_append(st, kv[:0], z[:0], None, _t(0, torch.bool), _t(0), _t(1)) == []
    assert P.state_reset(st, 0, None, _t(0), _t(1)) == []


def test_compress_prefill():
    pool, tab = _pool("csa"), _t((16, 2, 32), torch.float32)
    kv, z = _t((4 * 5, 1024), torch.bfloat16), _t((4 * 5, 1024), torch.bfloat16)
    nw = _t(512, torch.float32)
    c = _one(P.compress_prefill(pool, kv, z, None, nw, None, 1, 0, tab, 1e-6))
    assert c.kernel.expr == "rkv_kv_compress<__nv_bfloat16, int, false, true, 1, 0>"
    assert (c.grid, c.block) == ((5, 1), (128,))               # an entry per CTA, the entry part only
    assert (c.args["slot"], c.args["start_entry"], c.args["pre"], c.args["p1"]["kv"]) == (1, 0, 0, None)
    assert c.args["p0"] == dict(kv=kv, z=z, kvb=None, zb=None, ape=None, w=nw, count=None, d=512)
    assert c.args["p1"]["d"] == 128 and c.args["rope_tab"] is tab and c.args["n_tab"] == 16
    g = c.args["pool"]
    assert (g["block_table"], g["bt_rows"], g["epb"], g["m"]) == (pool.block_table, pool.max_requests,
                                                                  pool.entries_per_block, pool.m)
    idx = kvc.PrefillIndex(_t((20, 256), torch.bfloat16), _t((20, 256), torch.bfloat16), None,
                           _t(128, torch.float32))
    c = _one(P.compress_prefill(pool, kv, z, None, nw, idx, 1, 3, tab, 1e-6))
    assert (c.grid, c.args["pre"], c.args["p1"]["kv"]) == ((4, 2), 1, idx.kv)   # one window of context before
    assert P.compress_prefill(pool, kv[:4], z[:4], None, nw, None, 1, 3, tab, 1e-6) == []
    hca = _pool("hca")
    h = _one(P.compress_prefill(hca, _t((256, 512), torch.float32), _t((256, 512), torch.float32), None, nw,
                                None, 0, 0, tab, 1e-6))
    assert h.kernel.expr == "rkv_kv_compress<float, int, false, false, 4, 0>" and h.block == (512,)
    assert h.grid == (2, 1)


def test_compress_decode():
    pool, tab = _pool("csa", "model1", index_layout="mxfp4"), _t((16, 2, 32), torch.float32)
    st, ist = kvc.DecodeState("csa", 2, device="cpu"), kvc.DecodeState("csa", 2, 128, device="cpu")
    v, s, p = _t(3, torch.bool), _t(3, torch.int64), _t(3, torch.int64)
    c = _one(P.compress_decode(pool, st, _t(512, torch.float32), ist, _t(128, torch.float32), v, s, p, tab, 1e-6))
    assert c.kernel.expr == "rkv_kv_compress<float, long long, true, true, 1, 2>"
    assert (c.grid, c.block) == ((3, 2), (128,))
    assert c.args["p0"]["kv"] is st.kv_a and c.args["p0"]["kvb"] is st.kv_b and c.args["p0"]["count"] is st.count
    assert c.args["p1"]["count"] is ist.count and c.args["p1"]["zb"] is ist.z_b and c.args["n_slots"] == 2
    assert c.args["out_pages"] is pool.pages and c.args["slots"] is s
    assert P.compress_decode(pool, st, None, None, None, v[:0], s[:0], p[:0], tab, 1e-6) == []
    # MXFP8 keys: LAYOUT 3 (1 + the key kernels' KEY), the pool's padded key pages
    m8 = _pool("csa", "model1", index_layout="mxfp8")
    c = _one(P.compress_decode(m8, st, _t(512, torch.float32), ist, _t(128, torch.float32), v, s, p, tab, 1e-6))
    assert c.kernel.expr == "rkv_kv_compress<float, long long, true, true, 1, 3>"
    assert c.args["out_index_pages"] is m8.index_pages and c.args["index_page_bytes"] == m8.index_page_bytes
