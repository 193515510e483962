"""The fused producers' CUDA paths on a CPU: `rt`, the recording runtime
(tests/support/fake_cuda.py: CPU tensors that report is_cuda, launches
recorded through their declarations) installed in the fused op modules."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from rawkv.fused import moe, rms, swiglu  # noqa: E402
from support.fake_cuda import install  # noqa: E402


@pytest.fixture
def rt(monkeypatch):
    return install(monkeypatch, (rms, swiglu, moe))
