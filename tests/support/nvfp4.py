"""NVFP4 test helpers: comparing CUDA results with the reference bit for bit
(NaN outputs compare as both-NaN), and the launches the recording runtime saw."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from rawkv.reference import nvfp4 as R  # noqa: E402
from rawkv.reference.formats import bf16_bits  # noqa: E402


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def u8(t):
    return t.view(torch.uint8).cpu().numpy()


def f32bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def assert_q_equal(got, want):
    q, sf, gs = got
    rq, rsf, rgs = want
    assert np.array_equal(u8(q), rq), "q differs"
    assert np.array_equal(u8(sf), rsf), "sf differs"
    assert np.array_equal(f32bits(gs.cpu().numpy()), f32bits(rgs)), "gs differs"


def assert_decoded_equal(y, ref, name):
    y = y.cpu()
    if name == "bfloat16":
        got = y.view(torch.int16).numpy().view(np.uint16)
        want = bf16_bits(ref)
        nan_g = np.isnan(y.float().numpy())
    elif name == "float16":
        got = y.numpy().view(np.uint16)
        want = np.asarray(ref, np.float16).view(np.uint16)
        nan_g = np.isnan(y.numpy())
    else:
        got = y.numpy().view(np.uint32)
        want = np.asarray(ref, np.float32).view(np.uint32)
        nan_g = np.isnan(y.numpy())
    nan_w = np.isnan(np.asarray(ref, np.float32))
    assert np.array_equal(nan_g, nan_w), "NaN positions differ"
    assert np.array_equal(got[~nan_w], want[~nan_w]), "values differ"


def ref_of(x_gpu, scope, gs=None):
    xs = x_gpu.float().cpu().numpy()
    g = None if gs is None else np.float32(gs if isinstance(gs, float) else gs.cpu().item())
    return R.quantize(xs, scope, g, str(x_gpu.dtype).replace("torch.", ""))


def names(rt):
    return [c[0] for c in rt.calls]
