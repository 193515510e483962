"""The output rules' checks shared by the KV-cache and GEMM tests: a read-only
array, and the refusal an op gives (rawkv._args.check_outputs)."""

from __future__ import annotations

import re

import pytest


def _ro(a):
    a.flags.writeable = False
    return a


def _refused(name, other, call):
    msg = "is read-only" if other is None else f"overlaps {re.escape(other)} in memory"
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: {msg}"):
        call()
