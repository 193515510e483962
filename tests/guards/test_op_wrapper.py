"""rawkv._op.op's two wrappers, one per kind of body: the schema's arguments
in order (`call_fixed`, extras such as the stream by position) or a *args
body's (`call_variadic`, its extras by keyword). op() binds the one its
declaration needs once; before, the variadic wrapper was bound by
assigning over the fixed one's name, which pyflakes reports as a
redefinition of `call`."""
from __future__ import annotations

from pathlib import Path

import pytest

import rawkv
from rawkv import _op, _opdecl

OP_SOURCE = Path(rawkv.__file__).resolve().parent / "_op.py"


def test_op_module_has_no_pyflakes_warning():
    api = pytest.importorskip("pyflakes.api")
    reporter = pytest.importorskip("pyflakes.reporter")
    import io
    out, err = io.StringIO(), io.StringIO()
    n = api.checkPath(str(OP_SOURCE), reporter.Reporter(out, err))
    assert n == 0 and not err.getvalue(), out.getvalue() + err.getvalue()


def test_op_binds_the_wrapper_of_its_body_kind():
    seen = []

    @_op.op("test_fixed_wrapper", "Tensor x, int k, Tensor(a!) out")
    def fixed(x, k, out, stream=None):
        seen.append(("fixed", x, k, out, stream))

    @_op.op("test_variadic_wrapper", "Tensor x, int k, Tensor(a!) out")
    def variadic(*args, stream=None, extra=None):
        seen.append(("variadic", *args, stream, extra))
    try:
        assert not fixed.op.variadic and variadic.op.variadic
        assert fixed.__code__.co_name == "call_fixed" and variadic.__code__.co_name == "call_variadic"
        assert (fixed.__name__, variadic.__name__) == ("fixed", "variadic")
        assert fixed.op.name == "test_fixed_wrapper" and variadic.op.name == "test_variadic_wrapper"
        fixed("x", 1, "o")
        variadic("x", 2, "o", extra="e")
    finally:
        _opdecl._OPS.pop("test_fixed_wrapper")
        _opdecl._OPS.pop("test_variadic_wrapper")
    assert seen == [("fixed", "x", 1, "o", None), ("variadic", "x", 2, "o", None, "e")]
