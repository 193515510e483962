"""rawkv.gemm.Fp4GroupedLinear, the layer over grouped_linear: its checks and
arguments, checkpoints (MXFP4, NVFP4) loaded to the reference's values, on a
GPU the same output from a checkpoint as from set_weight and a call captured in
a CUDA graph."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
from rawkv.reference import gemm as ref  # noqa: E402
from support.gemm import _bits  # noqa: E402


# ---------------------------------------------------------------------------
# reference: CPU tensors run it, exactly
# ---------------------------------------------------------------------------
def test_layer_loads_mxfp4_and_nvfp4_checkpoints(rng):
    g, n, k = 2, 16, 64
    codes = rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)
    scales = rng.integers(120, 130, (g * n, k // 32), dtype=np.uint8)
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu")
    layer.load_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales))
    x = torch.randn(3, g, k).bfloat16()
    w64 = ref.dequantize_weight(codes.reshape(g, n, k // 2), scales.reshape(g, n, k // 32), None, "mxfp4")
    want = ref.round_to_bf16(ref.grouped(x.double().numpy(), w64))
    assert np.array_equal(_bits(layer(x)), want)
    sf = rng.integers(0x20, 0x50, (g * n, k // 16), dtype=np.uint8)
    gs = torch.tensor([0.5, 0.25])
    layer.load_nvfp4(torch.from_numpy(codes), torch.from_numpy(sf), gs)
    w64 = ref.dequantize_weight(codes.reshape(g, n, k // 2), sf.reshape(g, n, k // 16), gs.numpy(), "nvfp4")
    assert np.array_equal(_bits(layer(x)), ref.round_to_bf16(ref.grouped(x.double().numpy(), w64)))
    with pytest.raises(ValueError, match=r"^weight"):
        layer.load_mxfp4(torch.from_numpy(codes[:, :16]), torch.from_numpy(scales[:, :1]))
    # w4a8 is a bool: 'False' (a truthy string) chose the W4A8 form; refused, the layer unchanged
    held = layer.weight
    for bad in ("False", 1, None):
        with pytest.raises(TypeError, match=r"^w4a8: expected a bool"):
            layer.load_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), w4a8=bad)
        assert layer.weight is held


def test_layer_w4a8_takes_fp8_activations(rng):
    from rawkv.reference import gemm_w4a8 as W
    g, n, k = 2, 16, 256
    codes = rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)
    scales = rng.integers(124, 130, (g * n, k // 32), dtype=np.uint8)
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=4, device="cpu")
    layer.load_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), w4a8=True)
    assert isinstance(layer.weight, rawkv.gemm.W4a8Weight)
    xc, xs = rawkv.fp8.quantize_blocks(torch.randn(3, g, k))
    want = W.grouped(xc.view(torch.uint8).numpy(), xs.numpy(), codes.reshape(g, n, k // 2),
                     scales.reshape(g, n, k // 32))
    for x in ((xc, xs), [xc, xs], rawkv.fp8.Fp8Activation(xc, xs)):
        got = layer(x)
        assert got.shape == (3, g, n) and np.array_equal(_bits(got), ref.round_to_bf16(want))
        assert got.data_ptr() == layer.out.data_ptr()           # the layer's buffer, never a new one
    for make in (tuple, list):
        with pytest.raises(ValueError, match="^x: 5 tokens"):
            layer(make(rawkv.fp8.quantize_blocks(torch.randn(5, g, k))))
    # row 0 spans 2^12 (6 x 2^10) down to 2^-18 (0.5 x 2^-17): more than E4M3
    # holds, refused by name (block 1 of row 0, all of its elements 0.5)
    bad_codes, bad = codes.copy(), scales.copy()
    bad_codes[0, 16:32] = 0x11
    bad[0, :2] = (137, 110)
    held = layer.weight
    with pytest.raises(ValueError, match=r"^weight: 1 MXFP4 block.*\(g=0, n=0, block=1: byte 110\)"):
        layer.load_mxfp4(torch.from_numpy(bad_codes), torch.from_numpy(bad), w4a8=True)
    assert layer.weight is held                                   # a refused load changes nothing


# ---------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------
def test_layer_checks(rng):
    with pytest.raises(ValueError, match=r"^in_features"):
        rawkv.gemm.Fp4GroupedLinear(2, 40, 16, max_tokens=4, device="cpu")
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu")
    with pytest.raises(RuntimeError, match="no weight"):
        layer(torch.randn(1, 2, 64).bfloat16())
    with pytest.raises(ValueError, match=r"^w"):
        layer.set_weight(torch.randn(2, 16, 32))
    layer.set_weight(torch.randn(2, 16, 64))
    with pytest.raises(ValueError, match=r"^x: 5 tokens"):
        layer(torch.randn(5, 2, 64).bfloat16())
    y = layer(torch.randn(3, 2, 64).bfloat16())
    assert y.shape == (3, 2, 16) and y.data_ptr() == layer.out.data_ptr()


def test_layer_checks_a_weights_sizes_before_quantizing_or_packing_it(monkeypatch):
    # set_weight quantized every group and the loaders packed the checkpoint
    # before the sizes were compared with the layer's; and a checkpoint of
    # other groups was "groups: 2 does not match weight's 4 groups", naming an
    # argument the layer's caller does not pass
    from rawkv.gemm import weights as W
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu")
    done = []
    monkeypatch.setattr(rawkv.nvfp4, "quantize", lambda *a, **k: done.append("quantize"))
    monkeypatch.setattr(W.Fp4Weight, "_packed", classmethod(lambda cls, *a, **k: done.append("pack")))
    sizes = r"\(groups, out_features, in_features\) \({}\), the layer was built for \(2, 16, 64\)"
    with pytest.raises(ValueError, match="^w: " + sizes.format("4, 16, 64")):
        layer.set_weight(torch.randn(4, 16, 64))
    with pytest.raises(ValueError, match="^w: " + sizes.format("1, 16, 64")):
        layer.set_weight(torch.randn(16, 64))
    codes = torch.zeros(4, 16, 32, dtype=torch.uint8)
    loads = ((layer.load_mxfp4, torch.full((4, 16, 2), 127, dtype=torch.uint8)),
             (lambda c, s: layer.load_nvfp4(c, s, 1.0), torch.full((4, 16, 4), 0x30, dtype=torch.uint8)))
    for load, scale in loads:
        with pytest.raises(ValueError, match="^weight: " + sizes.format("4, 16, 64")):
            load(codes, scale)
        with pytest.raises(ValueError, match=r"^weight: expected shape \(32, 32\) .* or \(2, 16, 32\), got \(64, 32\)"):
            load(codes.reshape(64, 32), scale.reshape(64, -1))
    assert done == [] and layer.weight is None


def test_layer_arguments_are_refused_by_name(rng):
    # a wrong type is a TypeError, a bad value a ValueError (both were
    # ValueErrors); no weight / no activation: TypeErrors naming them (were
    # AttributeErrors from inside the layer)
    for bad, exc in (("2", TypeError), (2.0, TypeError), (True, TypeError), (0, ValueError), (-1, ValueError)):
        with pytest.raises(exc, match=r"^groups"):
            rawkv.gemm.Fp4GroupedLinear(bad, 64, 16, max_tokens=4, device="cpu")
        with pytest.raises(exc, match=r"^max_tokens"):
            rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=bad, device="cpu")
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu")
    with pytest.raises(TypeError, match=r"^w: expected a tensor or array, got None"):
        layer.set_weight(None)
    layer.set_weight(torch.randn(2, 16, 64))
    for bad in (None, 3.0):
        with pytest.raises(TypeError, match=r"^x: expected a tensor"):
            layer(bad)


def test_layer_sizes_past_the_kernels_are_named_and_numpy_ints_taken():
    """A size no weight or call could have is a ValueError naming it before the buffer is allocated
    (max_tokens=2**63 failed in torch.empty unnamed, 2**62 as an allocation error; in_features=2**64
    made a layer that refused every weight); a NumPy int is the size it holds, as PagedKVPool and the
    ops take it (it was a TypeError), a NumPy bool none."""
    L = rawkv.gemm.Fp4GroupedLinear
    for kw, name in ((dict(max_tokens=2 ** 62), "max_tokens"), (dict(max_tokens=2 ** 63), "max_tokens"),
                     (dict(max_tokens=2 ** 64), "max_tokens"), (dict(groups=2 ** 63), "groups"),
                     (dict(groups=65536), "groups"), (dict(in_features=2 ** 64), "in_features"),
                     (dict(in_features=2 ** 27), "in_features"), (dict(out_features=2 ** 40), "out_features")):
        args = {"groups": 2, "in_features": 64, "out_features": 16, "max_tokens": 4, **kw}
        with pytest.raises(ValueError, match=f"^{name}: "):
            L(args["groups"], args["in_features"], args["out_features"], max_tokens=args["max_tokens"],
              device="cpu")
    layer = L(np.int64(2), np.int32(64), np.uint16(16), max_tokens=np.int64(4), device="cpu")
    assert (layer.groups, layer.in_features, layer.out_features, layer.max_tokens) == (2, 64, 16, 4)
    assert all(type(v) is int for v in (layer.groups, layer.in_features, layer.out_features, layer.max_tokens))
    assert layer.out.shape == (4, 2, 16)
    with pytest.raises(TypeError, match="^groups"):
        L(np.True_, 64, 16, max_tokens=4, device="cpu")


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------
def test_layer_checkpoint_equals_set_weight(cuda, rng):
    g, n, k = 2, 48, 128
    wf = torch.randn(g, n, k)
    a = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=4).set_weight(wf.cuda())
    codes, scales, gs = a.weight.unpack()
    b = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=4).load_nvfp4(
        codes.reshape(g * n, k // 2).cpu(), scales.reshape(g * n, k // 16).cpu(), gs.cpu())
    x = torch.randn(4, g, k, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(a(x), b(x))


def _captured(layer, x):
    """(graph, y): layer(x) captured on a side stream; y the graph's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            y = layer(x)
    return graph, y


def test_layer_in_a_cuda_graph(cuda, rng):
    g, n, k = 4, 64, 256
    wf = torch.randn(g, n, k).cuda()
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=8).set_weight(wf)
    x = torch.randn(3, g, k, dtype=torch.bfloat16, device="cuda")
    first = layer(x).clone()
    graph, y = _captured(layer, x)
    x.copy_(torch.randn(3, g, k, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, layer(x))
    assert not torch.equal(y, first)


def _ptrs(w):
    return [t.data_ptr() for t in (w.codes, w.scales, w.gs)]


def test_a_reload_of_the_same_form_is_copied_in_place(rng):
    """A reload (set_weight / load_nvfp4 / load_mxfp4) whose weight has the
    held one's form is copied into the held tensors: the same object and
    addresses, the new values (a captured graph reads those addresses: the
    GPU test below). Another form (format, MXFP4 exp_range, input_scale
    given or not) replaces the weight."""
    g, n, k = 2, 16, 64
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu")
    fresh = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu")
    x = torch.randn(3, g, k).bfloat16()
    layer.set_weight(torch.randn(g, n, k))
    held, ptrs = layer.weight, _ptrs(layer.weight)
    for _ in range(2):
        wf = torch.randn(g, n, k)
        layer.set_weight(wf)
        assert layer.weight is held and _ptrs(layer.weight) == ptrs
        assert torch.equal(layer(x).clone(), fresh.set_weight(wf)(x))
        codes, sf, gs = fresh.weight.unpack()
        layer.load_nvfp4(codes.reshape(g * n, k // 2), sf.reshape(g * n, k // 16), gs)
        assert layer.weight is held and torch.equal(layer(x).clone(), fresh(x))
    layer.load_nvfp4(codes.reshape(g * n, k // 2), sf.reshape(g * n, k // 16), gs, torch.ones(g))
    assert layer.weight is not held                      # input_scale now given: another form
    mx = rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)
    layer.load_mxfp4(torch.from_numpy(mx), torch.full((g * n, k // 32), 127, dtype=torch.uint8))
    held = layer.weight
    layer.load_mxfp4(torch.from_numpy(mx[::-1].copy()), torch.full((g * n, k // 32), 127, dtype=torch.uint8))
    assert layer.weight is held                          # the same exp_range (127, 127)
    layer.load_mxfp4(torch.from_numpy(mx), torch.full((g * n, k // 32), 126, dtype=torch.uint8))
    assert layer.weight is not held                      # another exp_range: replaced


def test_a_reload_in_place_across_inference_mode(rng):
    """Serving code loads under torch.inference_mode, so the held weight's
    tensors are inference tensors; a reload of the same form outside it (a
    weight update) copied into them and torch raised 'Inplace update to
    inference tensor outside InferenceMode' (until the in-place reload the
    tensors were replaced, which worked). Both ways round the reload is
    copied in place and gives the new weight's output."""
    g, n, k = 2, 16, 64
    x = torch.randn(3, g, k).bfloat16()
    codes = torch.from_numpy(rng.integers(0, 256, (2, g * n, k // 2), dtype=np.uint8))
    mx = torch.full((g * n, k // 32), 127, dtype=torch.uint8)
    fresh = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu")
    loads = [(lambda layer, w: layer.set_weight(w), (torch.randn(g, n, k), torch.randn(g, n, k))),
             (lambda layer, c: layer.load_mxfp4(c, mx), tuple(codes)),
             (lambda layer, c: layer.load_mxfp4(c, mx, w4a8=True), tuple(codes))]
    for first_inference in (True, False):
        for load, (a, b) in loads:
            layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu")
            with torch.inference_mode(first_inference):
                load(layer, a)
            held = layer.weight
            with torch.inference_mode(not first_inference):
                load(layer, b)
            assert layer.weight is held
            load(fresh, b)
            xa = rawkv.fp8.quantize_blocks(x) if isinstance(held, rawkv.gemm.W4a8Weight) else x
            assert torch.equal(layer(xa).clone(), fresh(xa))


def test_layer_reloaded_after_capture(cuda, rng):
    """A graph captured with the layer, then a reload of the same form: the
    replay reads the new weight (the reload swapped in new tensors, and the
    replays read the old ones' freed memory)."""
    g, n, k = 4, 64, 256
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=8).set_weight(torch.randn(g, n, k).cuda())
    x = torch.randn(3, g, k, dtype=torch.bfloat16, device="cuda")
    layer(x)
    graph, y = _captured(layer, x)
    wf = torch.randn(g, n, k).cuda()
    layer.set_weight(wf)
    torch.cuda.empty_cache()
    junk = torch.full((1 << 22,), 3.0, device="cuda")    # (the freed weight's memory, reused)
    graph.replay()
    torch.cuda.synchronize()
    want = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=8).set_weight(wf)(x)
    assert torch.equal(y, want)
    del junk
