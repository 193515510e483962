"""Argument rules of the fused producers that are theirs alone (the generic
ones are rawkv._args). Every op runs these before its CPU / CUDA branch, so
both accept and refuse the same arguments."""
from __future__ import annotations

from .. import _args as A
from ..nvfp4 import _checks as NC
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


def scope_gs(scope, gs):
    """(scope, gs) of a producer: A.check_scope_gs with the family's default
    scope 'row' (a number gs comes back a checked Python float; an array gs
    is checked where it is read: given_gs_host, rawkv.fused._rows.gs_arg)."""
    if gs is None and scope is None:                     # the defaults
        return "row", None
    return A.check_scope_gs(scope, gs, SCOPES, "row")


def given_gs_host(scope: str, gs, dtype: str):
    """The reference's gs on the CPU path: None unless scope is 'given';
    then a float32 0-d array, a number or a host array (float32, one
    element) whose value rawkv.nvfp4's rule refuses being a ValueError
    naming gs, as on CUDA (where a device gs is checked by the kernel)."""
    return NC.given_gs_host(gs, dtype) if scope == "given" else None


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
