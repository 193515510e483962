"""The NVFP4 ops' CUDA paths on a CPU: `rt`, the recording runtime
(tests/support/fake_cuda.py) installed in the NVFP4 op modules."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from rawkv.nvfp4 import activation, decode, encode, scales  # noqa: E402
from support.fake_cuda import install  # noqa: E402


@pytest.fixture
def rt(monkeypatch):
    return install(monkeypatch, (encode, activation, decode, scales))
