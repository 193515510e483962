"""The opcheck samples and compiled steps of every family
(tests/support/library_samples_<family>.py, and an op's own test file,
tests/<family>/test_<op>.py, where it defines `opcheck_samples(rng,
device)`), collected for the operator tests (tests/guards/test_library*.py,
tests/test_multi_gpu.py); an op's test file may hold its CPU/CUDA agreement
cases too (`AGREEMENT`, collected by tests/guards/test_cpu_cuda_agreement.py),
so a new op of an existing family adds one test file and edits no other
(docs/runtime.md, "Adding an op")."""
import importlib
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


def _op_test_modules():
    """The tests/<family>/test_<op>.py modules that hold their op's
    operator samples or agreement cases, imported as pytest imports them
    (tests/ on sys.path, each family a package)."""
    for path in sorted(Path(__file__).parent.parent.glob("*/test_*.py")):
        text = path.read_text()
        if "\ndef opcheck_samples(" in text or "\nAGREEMENT = " in text:
            yield path.name, importlib.import_module(f"{path.parent.name}.{path.stem}")


def agreement_cases() -> dict:
    """{op name: [(case id, build)]} of the op test files' AGREEMENT."""
    out = {}
    for _, mod in _op_test_modules():
        out.update(getattr(mod, "AGREEMENT", {}))
    return out


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
    tests/support/library_samples_<family>.py (each defines samples(rng, device))
    and every op test file that defines opcheck_samples(rng, device)."""
    out = {}
    for name, mod in _sample_modules():
        got = mod.samples(rng, device)
        assert not set(got) & set(out), f"{name} samples an op another file samples"
        out.update(got)
    for name, mod in _op_test_modules():
        got = mod.opcheck_samples(rng, device) if hasattr(mod, "opcheck_samples") else {}
        assert not set(got) & set(out), f"{name} samples an op another file samples"
        out.update(got)
    return out
