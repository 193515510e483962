"""Shared fixtures.

GPU tests take the `cuda` fixture (or use the `gpu` marker with it): they are
skipped, with the reason, when torch has no CUDA device or CuPy / cuda-python
is missing. Every test that takes `cuda` carries the `gpu` marker, so
`pytest -m "not gpu"` runs the CPU tests only (README). Random tests take `rng`: a fresh seed each run, printed on failure
so a failing case can be replayed with RAWKV_TEST_SEED=<seed>. A test that
compiles with inductor takes `fresh_inductor`.
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


def _has_cxx() -> bool:
    import shutil
    return any(shutil.which(c) for c in ("g++", "clang++", "c++"))


@pytest.fixture
def fresh_inductor():
    """Inductor's CPU backend with its caches off, for a test that compiles
    with it (tests/guards/test_dynamic_shapes.py, tests/kvcache/
    test_compiled_rules.py): it compiles C++ (skipped where the machine has
    no compiler), and a warm cache could hand back code compiled from an
    identical graph before, so a test could pass without compiling (helper
    99 saw it do so)."""
    if not _has_cxx():
        pytest.skip("inductor's CPU backend needs a C++ compiler (g++ / clang++ / c++ on PATH)")
    import torch._inductor.config as config
    with config.patch(force_disable_caches=True):
        yield


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
