"""Shared fixtures.

GPU tests take the `cuda` fixture (or use the `gpu` marker with it): they are
skipped, with the reason, when torch has no CUDA device or CuPy / cuda-python
is missing. Every test that takes `cuda` carries the `gpu` marker, so
`pytest -m "not gpu"` runs the CPU tests only (README). Random tests take `rng`: a fresh seed each run, printed on failure
so a failing case can be replayed with RAWKV_TEST_SEED=<seed>.
"""
from __future__ import annotations

import os
import secrets

import numpy as np
import pytest


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    for mod, pip in (("cupy", "cupy-cuda12x / cupy-cuda13x"), ("cuda.bindings", "cuda-python")):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed (pip install {pip})"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()


@pytest.fixture
def cuda():
    """The rawkv Runtime of cuda:0; skips the test when no GPU stack exists."""
    if GPU_SKIP_REASON:
        pytest.skip(GPU_SKIP_REASON)
    import rawkv
    return rawkv.get_runtime(0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Mark every test that takes the `cuda` fixture (directly or through
    another fixture) `gpu`, before `-m` selects: the fixture is how a test
    says it needs a GPU, and a marker written by hand would be forgotten."""
    for item in items:
        if "cuda" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
    # a test marked `last` reads what the others recorded (the property tests'
    # calls, tests/guards/test_properties.py), wherever its file sorts
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


@pytest.fixture
def seed(request):
    s = int(os.environ.get("RAWKV_TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", s))
    return s


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        for k, v in item.user_properties:
            if k == "seed":
                rep.sections.append(("rawkv", f"replay with RAWKV_TEST_SEED={v}"))
