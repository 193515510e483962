"""The global-scale scopes of an NVFP4 encode, planned once for every
encoder (rawkv.nvfp4.quantize and the fused producers, rawkv.fused):
`plan` is a pure function from the scope, the given gs and an encoder's
passes to the launches (rawkv._plan: Launch, Memset), which the op runs.
What each scope launches (docs/format.md, "global-scale scopes"):

    'row'      one pass; each row's gs from its amax
    'tensor'   gs zeroed, a pass taking the tensor's amax (atomicMax into gs),
               a pass quantizing with it (or one pass for a small tensor)
    'given'    one pass with the given gs: a number (the host checked it)
               or a device tensor (the kernel checks it, flags every block
               of a refused one and counts the call in `errors`)
    'none'     the 'given' pass with gs = 1

An encode of no elements launches nothing: `empty_gs` is the gs it still
writes.
"""
from __future__ import annotations

from typing import NamedTuple

from .._plan import Memset


class Gs(NamedTuple):
    """The gs a 'given' / 'none' pass reads: `ptr` a device float32
    tensor (the kernel checks its value and adds refused calls to `errors`)
    or None, then `value`, a number the host checked."""
    ptr: object
    value: float
    errors: object


class Passes:
    """An encoder's passes, each a list of launches (rawkv._plan.Launch);
    `gs_out` is where the gs is written (scope 'tensor' zeroes it first)."""
    gs_out = None

    def row(self) -> list:
        raise NotImplementedError

    def whole_tensor(self) -> list | None:
        """Scope 'tensor' in one pass (a small tensor), or None: two passes."""
        return None

    def amax(self) -> list:
        raise NotImplementedError

    def from_amax(self) -> list:
        raise NotImplementedError

    def given(self, gs: Gs) -> list:
        raise NotImplementedError


def given(scope: str, gs, errors) -> Gs:
    """The Gs of scope 'given' (gs a checked Python float or a device
    tensor, whose refusals go to `errors`) or 'none' (1)."""
    if scope == "none" or gs is None:
        return Gs(None, 1.0, None)
    if gs.__class__ is float:
        return Gs(None, gs, None)
    return Gs(gs, 0.0, errors)


def empty_gs(scope: str, gs) -> Gs:
    """The gs an encode of no elements writes: 1 for 'row' and 'tensor'
    (the amax of nothing is 0, whose gs is 1), else the given one (a device
    gs copied unchecked: no block uses it)."""
    if scope in ("row", "tensor"):
        return Gs(None, 1.0, None)
    return given(scope, gs, None)


def plan(scope: str, passes: Passes, gs=None, errors=None) -> list:
    """The launches of an encode of at least one element under `scope`
    (gs / errors: given()'s)."""
    if scope == "row":
        return passes.row()
    if scope == "tensor":
        one = passes.whole_tensor()
        if one is not None:
            return one
        return [Memset(passes.gs_out, 4), *passes.amax(), *passes.from_amax()]
    return passes.given(given(scope, gs, errors))
