"""The opcheck samples and compiled steps of every family
(tests/support/library_samples_<family>.py), collected for the operator
tests (tests/guards/test_library*.py, tests/test_multi_gpu.py)."""
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _sample_modules():
    for path in sorted(Path(__file__).parent.glob("library_samples_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield path.name, mod


def steps():
    """[(name, make)] of every family's compiled-step checks."""
    return [s for _, mod in _sample_modules() for s in getattr(mod, "STEPS", [])]


def same_bits(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:          # float8/float4 views: compare their bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def samples(rng, device="cpu"):
    """{op name: [argument tuples]} for opcheck, from every
    tests/support/library_samples_<family>.py (each defines samples(rng, device))."""
    out = {}
    for name, mod in _sample_modules():
        got = mod.samples(rng, device)
        assert not set(got) & set(out), f"{name} samples an op another file samples"
        out.update(got)
    return out
