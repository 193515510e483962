"""rawkv.gemm.grouped_linear / moe_linear / Fp4GroupedLinear on CPU tensors
(the reference, exactly) and their argument checks (raised before any
launch, naming the argument; the CUDA path runs the same checks first)."""
import numpy as np
import pytest

import rawkv
from rawkv.reference import gemm as ref

torch = pytest.importorskip("torch")


def _weight(rng, g, n, k):
    return rawkv.gemm.Fp4Weight.from_float(torch.from_numpy(rng.standard_normal((g, n, k)).astype(np.float32)))


def _exact(w):
    codes, scales, gs = (t.numpy() for t in w.unpack())
    return ref.dequantize_weight(codes, scales, gs, w.fmt)


def _bits(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def test_cpu_grouped_is_the_reference_rounded_once(rng):
    w = _weight(rng, 3, 40, 96)
    x = torch.randn(5, 3, 96).bfloat16()
    want = ref.round_to_bf16(ref.grouped(x.double().numpy(), _exact(w)))
    assert np.array_equal(_bits(rawkv.gemm.grouped_linear(x, w)), want)
    out = torch.empty(5, 3, 40, dtype=torch.bfloat16)
    assert rawkv.gemm.grouped_linear(x, w, out=out) is out
    assert np.array_equal(_bits(out), want)


def test_cpu_nvfp4_activation_is_its_exact_value(rng):
    w = _weight(rng, 2, 24, 64)
    x = torch.randn(4, 2, 64)
    qa = rawkv.nvfp4.QuantizedActivation(*rawkv.nvfp4.quantize(x, scope="given", gs=0.25))
    xv = qa.dequantize(torch.float32).double().numpy()        # e2m1 * sf * 2^-2: exact in float32
    want = ref.round_to_bf16(ref.grouped(xv, _exact(w)))
    assert np.array_equal(_bits(rawkv.gemm.grouped_linear(qa, w)), want)


def test_cpu_moe_offsets_are_clamped_and_counted(rng):
    w = _weight(rng, 4, 16, 32)
    x = torch.randn(9, 32).bfloat16()
    offsets = torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32)
    want, bad = ref.ragged(x.double().numpy(), _exact(w), offsets.numpy())
    assert bad == 2                   # 3 < 5 and 12 > rows
    errors = np.zeros(1, np.int32)
    got = rawkv.gemm.moe_linear(x, w, offsets, errors=errors)
    assert np.array_equal(_bits(got), ref.round_to_bf16(want)) and errors[0] == 2
    before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
    rawkv.gemm.moe_linear(x, w, offsets)
    assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) == before + 2


@pytest.mark.parametrize("make,name", [
    (lambda x: x.float(), "x"),                                  # float32 is refused on CPU as on CUDA
    (lambda x: x[..., :32], "x"),                                # K mismatch
    (lambda x: x[:, :2], "x"),                                   # groups mismatch
    (lambda x: x[0], "x"),                                       # wrong rank
    (lambda x: 3.0, "x"),
])
def test_bad_activations_name_the_argument(rng, make, name):
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises((TypeError, ValueError), match=rf"^{name}"):
        rawkv.gemm.grouped_linear(make(x), w)


def test_nvfp4_activation_parts_are_checked(rng):
    w = _weight(rng, 3, 16, 64)
    q, sf, gs = rawkv.nvfp4.quantize(torch.randn(2, 3, 64), scope="row")
    with pytest.raises(TypeError, match=r"^x.q"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q.view(torch.uint8).float(), sf, gs), w)
    with pytest.raises(ValueError, match=r"^x.sf"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q, sf[..., :2], gs), w)
    with pytest.raises(ValueError, match=r"^x.gs"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q, sf, gs[:1]), w)


def test_bad_out_and_offsets_name_the_argument(rng):
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises(ValueError, match=r"^out"):
        rawkv.gemm.grouped_linear(x, w, out=torch.empty(2, 3, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^offsets"):
        rawkv.gemm.moe_linear(x[:, 0], w, torch.tensor([0, 1, 2], dtype=torch.int32))


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


def test_a_bad_out_writes_nothing(rng):
    w = _weight(rng, 4, 16, 32)
    x = torch.randn(9, 32).bfloat16()
    errors = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match=r"^out"):
        rawkv.gemm.moe_linear(x, w, torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32), errors=errors,
                              out=torch.empty(9, 15, dtype=torch.bfloat16))
    assert errors[0] == 0             # the clamps are not counted by a call that raised


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
