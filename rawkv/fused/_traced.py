"""The fused producers under torch.compile: each public op allocates its
outputs with torch.empty, with the shapes and dtypes the eager path returns,
and calls its rawkv:: operator (rawkv.library), which dynamo can trace.
Only torch ops, shapes and plain Python here: the arguments are checked when
the operator runs (the public op, eagerly)."""
from __future__ import annotations

from .. import _args as A
from ..nvfp4.activation import QuantizedActivation
from . import _rules as R


def activation(decl, like, lead, n, scope, gs, out, want_inv, **inputs) -> QuantizedActivation:
    """A row producer's QuantizedActivation for rows `lead` of width `n`
    (out= entries kept, the others allocated on like's device), written by
    operator `decl` called with `inputs` and the scope / gs / outputs."""
    import torch
    out_q, out_sf, out_gs, out_inv = R.split_out(out)
    if out_inv is not None and not want_inv:
        raise ValueError(f"out.inv_rms: {decl.name} has no inv_rms output")
    if scope is None:
        scope = "given" if gs is not None else "row"
    dev = like.device
    q = out_q if out_q is not None else torch.empty((*lead, n // 2), dtype=torch.uint8, device=dev)
    sf = out_sf if out_sf is not None else torch.empty((*lead, n // 16), dtype=torch.uint8, device=dev)
    g = out_gs if out_gs is not None else torch.empty(R.gs_shape(scope, lead, None), dtype=torch.float32,
                                                       device=dev)
    inv = None
    if want_inv:
        inv = inputs["inv_rms"] = out_inv if out_inv is not None else torch.empty(lead, dtype=torch.float32,
                                                                                  device=dev)
    gs_t, gs_v = A.split_gs(gs, torch.Tensor)
    decl.call(torch, **inputs, scope=scope, gs=gs_t, gs_value=gs_v, q=q, sf=sf, gs_out=g)
    # the dtypes the eager path returns for what it allocates (rawkv.fused._rows.Dtypes)
    if out_q is None:
        q = q.view(getattr(torch, "float4_e2m1fn_x2", torch.uint8))
    if out_sf is None:
        sf = sf.view(getattr(torch, "float8_e4m3fn", torch.uint8))
    return QuantizedActivation(q, sf, g, inv)
