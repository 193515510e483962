"""The property tests (tests/support/properties.py; each in its op's test file)
checked something: every one that ran had calls accepted and compared with the
reference, not only refused. Marked `last`: tests/conftest.py runs it after
every other test."""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from support.properties import CALLS  # noqa: E402


@pytest.mark.last
def test_every_op_was_accepted_sometimes():
    """Each property test that ran had calls accepted (and compared
    with the reference), not only refused. Runs last (marked `last`)."""
    ran = {t: c for t, c in CALLS.items() if t.startswith("test_")}
    if not ran:
        pytest.skip("no property test ran before this one (-k?)")
    never = sorted(t for t, c in ran.items() if not c["accepted"])
    assert not never, f"every call refused in {never}: {dict(ran)}"
