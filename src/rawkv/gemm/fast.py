"""The fast path of the W4A16 GEMM ops (rawkv.gemm.grouped_linear /
moe_linear and their operators) for CUDA tensors on torch's current stream
(docs/runtime.md, "Fast paths").

The checked path (argument rules, plan, launch) costs 45-60 us of host time
per call on an H100 host, several times a decode step's kernel. After it
has launched a call, the call's launch is remembered under what the rules
and the plan read: the weight tensors (by identity), the activation's and
out's dtype, shape, strides, device and 16-byte alignment, the offsets'
and errors' likewise, the format and sizes, and the dispatch tunables'
version (rawkv.gemm.linear bumps it when one is set). A later call with
the same key reuses the launch with its own addresses, after what depends
on the addresses alone:

* the weight tensors are the same objects, at the same addresses, of the
  same versions (torch counts every in-place change);
* no output's byte range meets an input's or another output's. Ranges that
  meet send the call to the checked path, which decides with the exact
  test (interleaved views may touch no common byte) and names the
  arguments when they do overlap;
* the activation's tensor map (TMA, rawkv.gemm.tma) for its new address.

Anything else (CPU tensors, NVFP4 activations, a stream argument, a view
the rules copy, a combination not seen yet) takes the checked path, which
raises the error naming the argument; so the fast path accepts nothing the
checked path refuses, and launches what the checked path would have.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

from .._plan import Launch
from . import tma

#: The dispatch tunables' version: part of every key, bumped by forget().
_version = [0]
#: key -> _Entry, per op; cleared when it grows past _MAX.
GROUPED: dict = {}
MOE: dict = {}
_MAX = 1024
#: The launch arguments each call brings (its tensors).
_PER_CALL = frozenset(("x", "out", "offsets", "errors", "wq", "wsf", "wgs"))


class _Entry(NamedTuple):
    weights: tuple          # weak references to the weight's tensors
    stamp: tuple            # their (address, version)
    weight_ranges: tuple    # their byte ranges [lo, hi)
    launch: Launch          # the checked path's launch, less the call's tensors (_PER_CALL)
    x_ext: tuple            # the activation's byte range relative to its address
    out_ext: tuple
    off_ext: tuple | None   # (ragged) offsets'
    err_ext: tuple | None   # (ragged) errors', None when the device counter is used


def forget() -> None:
    """Drop every remembered launch (a dispatch tunable changed)."""
    _version[0] += 1
    GROUPED.clear()
    MOE.clear()


def extent(t) -> tuple:
    """The byte range a strided tensor addresses, relative to its data
    pointer: (lo, hi), hi exclusive ((0, 0) when empty)."""
    if t.numel() == 0:
        return 0, 0
    es, lo, hi = t.element_size(), 0, 0
    for d, s in zip(t.shape, t.stride()):
        if s < 0:
            lo += s * (d - 1)
        else:
            hi += s * (d - 1)
    return lo * es, (hi + 1) * es


def _meta(t) -> tuple:
    return t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr() & 15


def grouped_key(x, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out) -> tuple:
    """The key of a grouped call (x and out CUDA tensors)."""
    return (*_meta(x), *_meta(out), out.requires_grad, id(codes), id(scales), id(gs), fmt, n, k, exp_lo, exp_hi,
            _version[0])


def moe_key(x, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, offsets, out, errors) -> tuple:
    """The key of a ragged call (x, offsets, out CUDA tensors; errors None or one)."""
    e = None if errors is None else (*_meta(errors), errors.requires_grad)
    return (*_meta(x), *_meta(out), out.requires_grad, *_meta(offsets), e, id(codes), id(scales), id(gs), fmt, n,
            k, exp_lo, exp_hi, _version[0])


def remember(cache: dict, key: tuple, weight: tuple, launch: Launch, x, out, offsets=None, errors=None) -> None:
    """Keep the checked path's launch of `key` (`weight`: its codes, scales,
    gs tensors; x, out, offsets, errors the tensors it launched with)."""
    if len(cache) >= _MAX:
        cache.clear()
    # (the call's tensors leave the arguments kept: the cache holds none alive)
    args = {k: v for k, v in launch.args.items() if k not in _PER_CALL}
    if errors is None and "errors" in launch.args:
        args["errors"] = launch.args["errors"]          # the device counter's address
    cache[key] = _Entry(tuple(weakref.ref(t) for t in weight), tuple((t.data_ptr(), t._version) for t in weight),
                        tuple((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in weight),
                        launch._replace(args=args), extent(x), extent(out),
                        None if offsets is None else extent(offsets), None if errors is None else extent(errors))


def _same_weight(entry: _Entry, codes, scales, gs) -> bool:
    r, st = entry.weights, entry.stamp
    return (r[0]() is codes and r[1]() is scales and r[2]() is gs
            and st[0] == (codes.data_ptr(), codes._version) and st[1] == (scales.data_ptr(), scales._version)
            and st[2] == (gs.data_ptr(), gs._version))


def _meets(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _apart(outs: list, ins: list) -> bool:
    """No output range meets an input range or another output's."""
    for i, o in enumerate(outs):
        for other in outs[:i]:
            if _meets(o, other):
                return False
        for r in ins:
            if _meets(o, r):
                return False
    return True


def _args(entry: _Entry, x, codes, scales, gs, out, offsets=None, errors=None) -> dict:
    args = dict(entry.launch.args)
    args.update(x=x, wq=codes, wsf=scales, wgs=gs, out=out, offsets=offsets)
    if errors is not None:
        args["errors"] = errors
    if entry.launch.tma is not None:
        m = tma.encode(x.data_ptr(), *entry.launch.tma)
        args["xmap"], args["act_tma"] = (m, 1) if m is not None else (tma.NONE, 0)
    return args


def _run(rt, ln: Launch, args: dict) -> None:
    """Runtime.run of the one launch, on torch's current stream."""
    k = ln.kernel
    k.launch(rt, ln.grid, ln.block, stream=None, shared_mem=k.smem, **args)


def _range(t, ext: tuple) -> tuple:
    p = t.data_ptr()
    return p + ext[0], p + ext[1]


def try_grouped(rt_of, x, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out) -> bool:
    """Launch a grouped call the fast way; False when it must take the
    checked path. `rt_of`: the device index -> runtime function."""
    entry = GROUPED.get(grouped_key(x, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, out))
    if entry is None or not _same_weight(entry, codes, scales, gs):
        return False
    xr, orr = _range(x, entry.x_ext), _range(out, entry.out_ext)
    if not _apart([orr], [xr, *entry.weight_ranges]):
        return False
    _run(rt_of(x.get_device()), entry.launch, _args(entry, x, codes, scales, gs, out))
    return True


def try_moe(rt_of, x, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, offsets, out, errors) -> bool:
    """Launch a ragged call the fast way; False when it must take the
    checked path."""
    entry = MOE.get(moe_key(x, codes, scales, gs, fmt, n, k, exp_lo, exp_hi, offsets, out, errors))
    if entry is None or not _same_weight(entry, codes, scales, gs):
        return False
    outs = [_range(out, entry.out_ext)]
    if errors is not None:
        outs.append(_range(errors, entry.err_ext))
    if not _apart(outs, [_range(x, entry.x_ext), _range(offsets, entry.off_ext), *entry.weight_ranges]):
        return False
    _run(rt_of(x.get_device()), entry.launch, _args(entry, x, codes, scales, gs, out, offsets, errors))
    return True
