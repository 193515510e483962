"""Property-based tests (hypothesis, tests/support/properties.py) of
rawkv.gemm.grouped_linear and moe_linear on CPU: every call returns the
reference's bits or refuses an argument by name."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import formats as RF  # noqa: E402
from rawkv.reference import gemm as RG  # noqa: E402
from rawkv.reference import nvfp4 as RN  # noqa: E402
from support.properties import SETTINGS, host, judge, layouts, libs, make, seeds  # noqa: E402


_WEIGHTS: dict = {}


def _weight(g, n, k):
    """A small Fp4Weight (from_float of fixed values), made once per shape."""
    key = (g, n, k)
    if key not in _WEIGHTS:
        v = np.random.default_rng(g * 1000 + n * 10 + k).standard_normal((g, n, k)).astype(np.float32)
        _WEIGHTS[key] = rawkv.gemm.Fp4Weight.from_float(torch.from_numpy(v))
    return _WEIGHTS[key]


def _bf16(bits16) -> np.ndarray:
    """BF16 bit patterns (RG.round_to_bf16's result) as float32 values."""
    return (np.asarray(bits16, np.uint32) << 16).view(np.float32)


def _exact(w):
    codes, scales, gs = (t.numpy() for t in w.unpack())
    return RG.dequantize_weight(codes, scales, gs, w.fmt)


@SETTINGS
@given(seed=seeds, t=st.integers(0, 3), g=st.sampled_from([2, 2, 1]), k_delta=st.sampled_from([0, 0, 16, -32]),
       xdt=st.sampled_from(("bfloat16", "float16", "float32")), layout=layouts, special=st.booleans())
def test_gemm_grouped_linear(seed, t, g, k_delta, xdt, layout, special):
    # numpy activations and wrong-typed weights crash today: test_gemm_known_crashes
    w = _weight(2, 16, 64)
    x = make(seed, (t, g, 64 + k_delta), xdt, "torch", layout, special)
    judge(lambda: rawkv.gemm.grouped_linear(x, w), ("x", "weight", "out"),
          lambda: _bf16(RG.round_to_bf16(RG.grouped(host(x).astype(np.float64), _exact(w)))))


@SETTINGS
@given(seed=seeds, r=st.integers(0, 5), xdt=st.sampled_from(("bfloat16", "float16")), layout=layouts,
       special=st.booleans(), offs=st.lists(st.integers(-2, 7), min_size=3, max_size=3))
def test_gemm_moe_linear(seed, r, xdt, layout, special, offs):
    w = _weight(2, 16, 64)
    x = make(seed, (r, 64), xdt, "torch", layout, special)
    offsets = torch.tensor(offs, dtype=torch.int32)
    err = np.zeros(1, np.int32)

    def reference():
        y, bad = RG.ragged(host(x).astype(np.float64), _exact(w), np.asarray(offs, np.int32))
        assert err[0] == bad
        return _bf16(RG.round_to_bf16(y))
    judge(lambda: rawkv.gemm.moe_linear(x, w, offsets, errors=err), ("x", "weight", "offsets", "errors"),
          reference)


def _quantized_values(q, sf, gs) -> np.ndarray:
    """An NVFP4 activation's values as float64, exactly: e2m1[q] * sf * gs
    (gs one value, or one per row)."""
    v = RF.e2m1_decode(RN.unpack_nibbles(q)).astype(np.float64)
    v = v * np.repeat(RF.e4m3_decode(sf).astype(np.float64), 16, axis=-1)
    gs = np.asarray(gs, np.float64)
    return v * (gs if gs.ndim == 0 else gs[..., None])


@SETTINGS
@given(seed=seeds, lib=libs, weight=st.sampled_from(["fp4", "fp4", None, "tensor"]),
       xdt=st.sampled_from(["float16", "float32", "bfloat16", "float64"]), bf16_values=st.booleans(),
       quantized=st.sampled_from([None, None, "tensor", "row"]), special=st.booleans())
def test_gemm_any_activation_and_weight(seed, lib, weight, xdt, bf16_values, quantized, special):
    """numpy activations (a float32 one stands for BF16 and must hold BF16
    values), QuantizedActivations of numpy arrays or CPU tensors, and
    weights that are not Fp4Weights (issue 21 item 5: AttributeErrors)."""
    w = {"fp4": _weight(2, 16, 64), None: None, "tensor": torch.ones(2, 16, 64)}[weight]
    x = make(seed, (2, 2, 64), xdt, lib, special=special)
    if bf16_values and xdt == "float32":        # low 16 bits cleared: BF16 values
        (x.view(np.int32) if lib == "numpy" else x.view(torch.int32))[...] &= -65536
    if quantized is not None:
        q, sf, g = RN.quantize(host(x).astype(np.float32), quantized)
        conv = (lambda a: a) if lib == "numpy" else torch.from_numpy
        x = rawkv.nvfp4.QuantizedActivation(conv(q), conv(sf), conv(np.ascontiguousarray(g)))

    def reference():
        v = _quantized_values(host(x.q), host(x.sf), host(x.gs)) if quantized else host(x).astype(np.float64)
        return _bf16(RG.round_to_bf16(RG.grouped(v, _exact(w))))
    judge(lambda: rawkv.gemm.grouped_linear(x, w), ("x", "weight"), reference)
