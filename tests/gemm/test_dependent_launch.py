"""Programmatic dependent launch of the GEMMs (docs/runtime.md): a GEMM that
reads the output of the GEMM before it, both captured in one CUDA graph (the
second may start while the first finishes), gives the same bits as the two
run one at a time with a device sync between them, on every kernel the
dispatcher routes to (the W4A16 mma.sync kernel and the W4A8 mma.sync
kernel, which take the programmatic launch on sm_90+, batched and ragged,
the W4A8 one where plans' W4A8_MMA_PDL rule takes it; the wgmma kernels,
which launch the plain way), and with the producers between them
(quantize_blocks, rmsnorm_quantize: programmatic too, waiting first); the
outputs start as NaN, so a read before the first GEMM's writes would show."""
import types

import numpy as np
import pytest

import rawkv
from rawkv.gemm import linear, plans
from rawkv.kernels import gemm_w4a8 as K8
from support.gemm import random_weight

torch = pytest.importorskip("torch")


def _chain(steps, x, outs, sync):
    """outs[i] = steps[i](input), the input x, then outs[i - 1]."""
    src = x
    for step, out in zip(steps, outs):
        step(src, out)
        if sync:
            torch.cuda.synchronize()
        src = out


def _graph_and_one_at_a_time(steps, x, outs):
    """The chain's outputs run one call at a time, then from NaN in a graph."""
    _chain(steps, x, outs, sync=True)
    want = [o.clone() for o in outs]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(steps, x, outs, sync=False)     # (loads the kernels before capture)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            _chain(steps, x, outs, sync=False)
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for i, (o, w) in enumerate(zip(outs, want)):
            diff = o.view(torch.int16) != w.view(torch.int16)
            assert not diff.any(), (f"step {i}: {int(diff.sum())} of {diff.numel()} differ, "
                                    f"{int(o.isnan().sum())} NaN (want {int(w.isnan().sum())})")


def _w4a8_weights(rng, groups, k, count=3):
    """`count` W4A8 weights (groups, K x K) on the GPU, from random MXFP4
    codes and block scales near 2^0."""
    ws = []
    for _ in range(count):
        codes = rng.integers(0, 256, (groups, k, k // 2), dtype=np.uint8)
        scales = (127 + rng.integers(-3, 4, (groups, k, k // 32))).astype(np.uint8)
        w8 = rawkv.gemm.w4a8_weight(rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales),
                                                                     groups=groups))
        ws.append(rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:])))
    return ws


def _fp8_buffers(lead, k, count=3):
    """quantize_blocks' out= pairs (codes, float32 scales per 128) for `count` steps."""
    return [(torch.empty(*lead, k, dtype=torch.float8_e4m3fn, device="cuda"),
             torch.empty(*lead, k // 128, dtype=torch.float32, device="cuda")) for _ in range(count)]


def _w4a8_chain(rng, ws, tokens, g, k):
    """A batched W4A8 chain over the weights `ws` (groups g, K x K): its
    input x (tokens, g, k) BF16, each step's output buffer, and the steps,
    each quantizing the output before (quantize_blocks into buffers of its
    own: a capture allocates nothing) and multiplying it by its weight."""
    x = torch.from_numpy(rng.standard_normal((tokens, g, k)).astype(np.float32)).to(torch.bfloat16).cuda()
    outs = [torch.empty(tokens, g, k, dtype=torch.bfloat16, device="cuda") for _ in ws]
    qs = _fp8_buffers((tokens, g), k)
    steps = [lambda a, o, w=w, q=q: rawkv.gemm.grouped_linear(rawkv.fp8.quantize_blocks(a, out=q), w, out=o)
             for w, q in zip(ws, qs)]
    return x, outs, steps


@pytest.mark.parametrize("tokens,k", [(1, 1024), (8, 1024), (16, 1024), (300, 1024), (1, 2048), (16, 2048)])
def test_dependent_gemms_same_bits_in_a_graph(cuda, rng, tokens, k):
    # (G, K, N = K): each GEMM's output is the next one's activations; 1-16
    # tokens take the mma.sync kernel (weights streamed before the wait; at
    # K = 2,048 its small-grid tiles on sm_90, eight warps along K), 300 the
    # wgmma kernel on sm_90
    if cuda.compute_capability >= (9, 0) and rawkv.runtime.pdl_allowed():
        assert cuda._launcher._pdl is not None          # (so the chain below is programmatic)
    g = 4
    ws = [random_weight(rng, g, k, k, "nvfp4")[0] for _ in range(4)]
    x = torch.from_numpy(rng.standard_normal((tokens, g, k)).astype(np.float32)).to(torch.bfloat16).cuda()
    outs = [torch.empty(tokens, g, k, dtype=torch.bfloat16, device="cuda") for _ in ws]
    steps = [lambda a, o, w=w: rawkv.gemm.grouped_linear(a, w, out=o) for w in ws]
    _graph_and_one_at_a_time(steps, x, outs)


def test_dependent_ragged_gemms_same_bits_in_a_graph(cuda, rng):
    # MoE: the offsets are read (and unowned rows zeroed) after the wait
    e, k, rows = 8, 512, 40
    ws = [random_weight(rng, e, k, k, "nvfp4")[0] for _ in range(3)]
    counts = rng.multinomial(rows - 4, np.full(e, 1 / e))
    offsets = torch.from_numpy(np.concatenate([[2], 2 + np.cumsum(counts)]).astype(np.int32)).cuda()
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16).cuda()
    outs = [torch.empty(rows, k, dtype=torch.bfloat16, device="cuda") for _ in ws]
    steps = [lambda a, o, w=w: rawkv.gemm.moe_linear(a, w, offsets, out=o) for w in ws]
    _graph_and_one_at_a_time(steps, x, outs)


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_dependent_w4a8_gemms_same_bits_in_a_graph(cuda, rng, monkeypatch, tokens):
    # W4A8: each step's activations are quantized by rawkv.fp8.quantize_blocks
    # (into buffers of its own: a capture allocates nothing) from the GEMM
    # before's output; the mma.sync kernel launched plainly (its grid, 128
    # blocks, is below W4A8_MMA_PDL_MIN_BLOCKS_PER_SM) and programmatically
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 GEMM runs on sm_90 devices; this one is {cuda.arch}")
    g, k = 4, 1024
    x, outs, steps = _w4a8_chain(rng, _w4a8_weights(rng, g, k), tokens, g, k)
    _graph_and_one_at_a_time(steps, x, outs)
    monkeypatch.setattr(linear, "W4A8_PATH", "mma")       # (the mma.sync kernel at every token count)
    _graph_and_one_at_a_time(steps, x, outs)
    monkeypatch.setattr(linear, "W4A8_MMA_PDL_MIN_BLOCKS_PER_SM", 0)
    _graph_and_one_at_a_time(steps, x, outs)


def test_dependent_w4a8_ragged_gemms_same_bits_in_a_graph(cuda, rng, monkeypatch):
    # the W4A8 mma.sync kernel in ragged calls (programmatic on sm_90): offsets
    # read and unowned rows zeroed after the wait
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 GEMM runs on sm_90 devices; this one is {cuda.arch}")
    e, k, rows = 8, 512, 40
    ws = _w4a8_weights(rng, e, k)
    counts = rng.multinomial(rows - 4, np.full(e, 1 / e))
    offsets = torch.from_numpy(np.concatenate([[2], 2 + np.cumsum(counts)]).astype(np.int32)).cuda()
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(torch.bfloat16).cuda()
    outs = [torch.empty(rows, k, dtype=torch.bfloat16, device="cuda") for _ in ws]
    qs = _fp8_buffers((rows,), k)
    steps = [lambda a, o, w=w, q=q: rawkv.gemm.moe_linear(rawkv.fp8.quantize_blocks(a, out=q), w, offsets, out=o)
             for w, q in zip(ws, qs)]
    monkeypatch.setattr(linear, "W4A8_PATH", "mma")
    _graph_and_one_at_a_time(steps, x, outs)


@pytest.mark.parametrize("tokens", [1, 8])
def test_dependent_producer_and_gemm_chain_same_bits_in_a_graph(cuda, rng, tokens):
    # rmsnorm_quantize (a producer: it waits for the GEMM before it, then lets
    # the next GEMM start) feeding each GEMM its NVFP4 activations from the
    # GEMM before's output
    from rawkv.fused import rmsnorm_quantize
    from rawkv.nvfp4 import QuantizedActivation
    k = 2048
    ws = [random_weight(rng, 1, k, k, "nvfp4")[0] for _ in range(3)]
    norm = torch.from_numpy(rng.standard_normal(k).astype(np.float32)).cuda()
    x = torch.from_numpy(rng.standard_normal((tokens, 1, k)).astype(np.float32)).to(torch.bfloat16).cuda()
    outs = [torch.empty(tokens, 1, k, dtype=torch.bfloat16, device="cuda") for _ in ws]
    bufs = [tuple(t for t in rmsnorm_quantize(x.view(tokens, k), norm) if t is not None) for _ in ws]

    def step(a, o, w, buf):
        r = rmsnorm_quantize(a.view(tokens, k), norm, out=buf)
        act = QuantizedActivation(r.q.view(tokens, 1, -1), r.sf.view(tokens, 1, -1), r.gs.view(tokens, 1))
        rawkv.gemm.grouped_linear(act, w, out=o)

    steps = [lambda a, o, w=w, b=b: step(a, o, w, b) for w, b in zip(ws, bufs)]
    _graph_and_one_at_a_time(steps, x, outs)


@pytest.mark.parametrize("tile", ["small", "wide"])
def test_dependent_w4a8_decode_tiles_same_bits_in_a_graph(cuda, rng, monkeypatch, tile):
    # W4A8 at 1 and 8 tokens on the batched decode tiles the grid rule takes
    # (plans._w4a8_tile_by_grid; always programmatic): G = 4, K = N = 2,048
    # takes the small-grid one where 256 blocks are below two per SM (an
    # H100's 132 SMs), the wide one forced through the tunables
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 GEMM runs on sm_90 devices; this one is {cuda.arch}")
    g, k = 4, 2048
    if tile == "wide":
        monkeypatch.setattr(linear, "W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM", 0)
        monkeypatch.setattr(linear, "W4A8_MMA_WIDE_MIN_BLOCKS_PER_SM", -1)
        monkeypatch.setattr(linear, "W4A8_MMA_WIDE_MAX_BLOCKS_PER_SM", 1e9)
    else:
        monkeypatch.setattr(linear, "W4A8_MMA_SMALL_GRID_BLOCKS_PER_SM", 1e9)
    want = K8.MMA_WIDE_CONFIG if tile == "wide" else K8.MMA_SMALL_GRID_CONFIG
    assert plans._w4a8_tile_by_grid(types.SimpleNamespace(n=k, k=k, groups=g), cuda, linear) == want
    ws = _w4a8_weights(rng, g, k)
    for tokens in (1, 8):
        x, outs, steps = _w4a8_chain(rng, ws, tokens, g, k)
        _graph_and_one_at_a_time(steps, x, outs)
