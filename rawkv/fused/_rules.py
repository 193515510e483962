"""Argument rules of the fused producers that are theirs alone (the generic
ones are rawkv._args). Every op runs these before its CPU / CUDA branch, so
both accept and refuse the same arguments."""
from __future__ import annotations

import numpy as np

from .. import _args as A
from .. import _dispatch as D
from ..reference import nvfp4 as ref_nvfp4

SCOPES = ("row", "tensor", "given", "none")

# dtype names, as torch spells them. x / h / hidden on CUDA are bfloat16 or
# float16; on CPU float32 too (the reference's own precision: intermediates
# are not rounded).
CPU_X = ("bfloat16", "float16", "float32")
PARAM = ("float32", "bfloat16", "float16")     # weight, mix, topk_weights
IDS = ("int32", "int64")                       # topk_ids
OUT_Q = ("uint8", "float4_e2m1fn_x2")          # what out.q may be (the result: float4_e2m1fn_x2)
OUT_SF = ("uint8", "float8_e4m3fn")            # what out.sf may be (the result: float8_e4m3fn)


# Python floats that A.check_eps / A.check_gs_number accepted: the same
# value passes again, and a set lookup costs nothing where the check costs
# ~2 us of the launch path. Bounded, for callers that vary them.
_GOOD_EPS: set = set()
_GOOD_GS: set = set()


def _remember(good: set, v: float) -> float:
    if len(good) < 256:
        good.add(v)
    return v


def check_eps(eps) -> float:
    """A.check_eps, remembered for the Python floats it accepted."""
    if eps.__class__ is float and eps in _GOOD_EPS:
        return eps
    return _remember(_GOOD_EPS, A.check_eps(eps))


def parse_scope(scope, gs):
    """(scope, gs) of a producer. scope None means 'given' when gs is given,
    else 'row'. A number gs comes back as a Python float, checked as the
    float32 the kernels read (A.check_gs_number); any other gs must be a
    1-element array (its dtype, device and, on the host, its value are
    checked where it is read: see cpu_gs and rawkv.fused._rows.gs_arg).

    Kept to this one function on purpose: rawkv._args is to get one scope /
    gs parser shared with rawkv.nvfp4, which replaces it (with this default
    scope; the _GOOD_GS memo may stay in front of its number check)."""
    if scope is None:
        scope = "given" if gs is not None else "row"
    if scope not in SCOPES:
        raise ValueError(f"scope: expected one of {SCOPES}, got {scope!r}")
    if scope == "given" and gs is None:
        raise ValueError("gs: scope 'given' needs a global scale (a float or a 1-element tensor)")
    if scope != "given" and gs is not None:
        raise ValueError(f"gs: a global scale is only used with scope='given' (got scope={scope!r})")
    if gs is None:
        return scope, None
    if gs.__class__ is float and gs in _GOOD_GS:
        return scope, gs
    if A.is_number(gs) or isinstance(gs, (bool, np.bool_)):
        return scope, _remember(_GOOD_GS, A.check_gs_number(gs, "gs"))   # bool: TypeError
    A.require_array(gs, "gs")
    shape = tuple(gs.shape)
    if int(np.prod(shape)) != 1:
        raise ValueError(f"gs: expected a float or a 1-element tensor, got shape {shape}")
    return scope, gs


def require_arrays(*named, optional: bool = False) -> None:
    """Each (name, value) must be an array (A.require_array: a number or
    None is a TypeError naming it); with `optional`, None is allowed (an
    out= entry to allocate). CUDA tensors pass at the cost of one getattr."""
    for name, v in named:
        if getattr(v, "is_cuda", False) is True or (optional and v is None):
            continue
        A.require_array(v, name)


def check_width(n: int, name: str) -> None:
    """The last dimension: a positive multiple of 16 (N == 0 has no row to
    normalize and would leave gs / inv_rms unwritten on CUDA)."""
    if n == 0:
        raise ValueError(f"{name}: the last dimension is 0; expected a positive multiple of 16")
    ref_nvfp4.check_last_dim(n, name)


def split_out(out, names=("q", "sf", "gs", "inv_rms"), least: int = 3):
    """The entries of out=: None (all None), or a tuple / list / NamedTuple
    of `least` to len(names) entries, each None (allocate it) or an array."""
    if out is None:
        return (None,) * len(names)
    if not isinstance(out, (tuple, list)) or not least <= len(out) <= len(names):
        count = f"{least}" if least == len(names) else f"{least} or {len(names)}"
        got = f"{len(out)} entries" if isinstance(out, (tuple, list)) else type(out).__name__
        raise TypeError(f"out: expected a tuple of {count} entries ({', '.join(names)}), got {got}")
    out = tuple(out) + (None,) * (len(names) - len(out))
    for n, o in zip(names, out):
        if o is not None and getattr(o, "is_cuda", False) is not True:
            A.require_array(o, "out." + n)
    return out


def gs_shape(scope: str, lead: tuple, out_gs) -> tuple:
    """Shape of the gs output: `lead` for scope 'row', else () (a given
    out.gs of shape (1,) is filled as it is)."""
    if scope == "row":
        return lead
    return (1,) if out_gs is not None and tuple(out_gs.shape) == (1,) else ()


def cpu_gs(gs):
    """A given gs for the reference: a float32 0-d array (or None). A host
    array must be float32, as on CUDA, and its value is checked as a
    number's is (it is already on the host)."""
    if gs is None or isinstance(gs, float):
        return None if gs is None else np.asarray(gs, np.float32)
    A.check_cpu_array(gs, "gs", ("float32",))
    g = np.asarray(D.to_numpy(gs, "gs"), np.float32).reshape(())
    A.check_gs_number(g[()], "gs")
    return g
