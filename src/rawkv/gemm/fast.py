"""The fast path of the GEMM ops (rawkv.gemm.grouped_linear / moe_linear,
W4A16 and W4A8, and their operators) for CUDA tensors on torch's current
stream (docs/runtime.md, "Streams and launches").

The checked path (argument rules, plan, launch) costs 45-80 us of host time
per call on an H100 host, several times a decode step's kernel. After it
has launched a call, the call's launch is remembered under what the rules
and the plan read: the weight's tensors (by identity), the dtype, shape,
strides, device, 16-byte alignment and requires_grad of every other tensor
(activation, its scales, offsets, out, errors; or that it is None), the
sizes, and the dispatch tunables' version (rawkv.gemm.linear bumps it when
one is set). A later call with the same key reuses the launch with its own
tensors, after what depends on their addresses alone:

* the weight's tensors are the same objects, at the same addresses, of the
  same versions (torch counts every in-place change), dtypes, shapes,
  contiguity and negative bits (rawkv._args.stamp: an assignment to
  `t.data` changes those at the same address with no new version);
* no output is an inference tensor outside torch.inference_mode (the
  checked path refuses it by name; the key does not tell the mode);
* no output's byte range meets an input's or another output's. Ranges that
  meet send the call to the checked path, which decides with the exact
  test (interleaved views may touch no common byte) and names the
  arguments when they do overlap;
* the activation's tensor map (TMA, rawkv.gemm.tma), encoded for its
  address (Launch.tma: the same geometry); where the driver cannot encode
  it, the checked path plans the call again.

Anything else (CPU tensors, NVFP4 activations, a stream argument, a view
the rules copy, a combination not seen yet) takes the checked path, which
raises the error naming the argument: the fast path accepts nothing the
checked path refuses, and launches what it would have. The cache holds no
tensor alive (weak references to the weight, no activation).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

from .. import _args as A
from .._plan import Launch
from ..runtime import get_runtime
from . import tma

#: The dispatch tunables' version: part of every key, bumped by forget().
_version = [0]
#: key -> _Entry: one cache for every GEMM op (the key starts with the op's name);
#: cleared when it grows past _MAX.
LAUNCHES: dict = {}
_MAX = 1024


class _Entry(NamedTuple):
    weights: tuple          # weak references to the weight's tensors
    stamp: tuple            # their rawkv._args.stamp (address, version, dtype, shape, contiguous, neg)
    weight_ranges: tuple    # their byte ranges [lo, hi)
    launch: Launch          # the checked path's launch less the call's tensors
    extents: tuple          # each call tensor's byte range relative to its address (None: absent)


def forget() -> None:
    """Drop every remembered launch (a dispatch tunable changed)."""
    _version[0] += 1
    LAUNCHES.clear()


def extent(t) -> tuple:
    """The byte range a tensor addresses, relative to its data pointer:
    (lo, hi), hi exclusive ((0, 0) when empty); rawkv._args.spans' range."""
    span = A.spans((("t", t),))[0][1]
    return (0, 0) if span is None else (span[1] - t.data_ptr(), span[2] - t.data_ptr())


def as_given(given: tuple, checked: tuple, out, weight: tuple) -> bool:
    """Whether the checked path launched the caller's own torch tensors (its
    rules copied no view and wrapped no DLPack array): only such a launch is
    kept. `given` / `checked`: the call's tensors before and after the rules."""
    return all(a is b for a, b in zip(given, checked)) and A.is_torch(out) and all(map(A.is_torch, weight))


def key(op: str, tensors: tuple, weight: tuple, sizes: tuple) -> tuple:
    """The key of a call of `op`: its per-call tensors' (CUDA tensors or
    None) metadata, its weight tensors' identities, its other arguments."""
    return (op, _version[0], *map(id, weight), *sizes, *(None if t is None else _meta(t) for t in tensors))


def _meta(t) -> tuple:
    """A call tensor's part of the key. A set negative bit and a zero
    pointer (a tensor with no memory) are parts the checked path, which
    refuses them (rawkv._args.unaddressable), never remembers: such a call
    takes it."""
    p = t.data_ptr()
    return (t.dtype, t.shape, t.stride(), t.get_device(), p & 15 if p or not t.numel() else -1,
            t.requires_grad, t.is_neg())


def remember(k: tuple, weight: tuple, launch: Launch, names: tuple, tensors: tuple, weight_names: tuple) -> None:
    """Keep the checked path's launch under key `k`: `weight` its weight
    tensors (launch arguments `weight_names`), `tensors` the call's other
    tensors or None (arguments `names`), which the kept launch leaves out
    (a None keeps the launch's own value: the device counter's address for
    errors=None)."""
    if len(LAUNCHES) >= _MAX:
        LAUNCHES.clear()
    drop = {*weight_names, *(n for n, t in zip(names, tensors) if t is not None)}
    args = {n: v for n, v in launch.args.items() if n not in drop}
    LAUNCHES[k] = _Entry(tuple(weakref.ref(t) for t in weight), tuple(map(A.stamp, weight)),
                         tuple((t.data_ptr() + e[0], t.data_ptr() + e[1]) for t, e in zip(weight, map(extent, weight))),
                         launch._replace(args=args), tuple(None if t is None else extent(t) for t in tensors))


def try_launch(k: tuple, weight: tuple, weight_names: tuple, names: tuple, tensors: tuple, outputs: int,
               rt_of) -> bool:
    """Launch the call of key `k` the fast way; False when it must take the
    checked path. `tensors`: the call's tensors in `names` order (as
    remembered), its first `outputs` of them written (out, errors), the
    rest read; `rt_of`: device index -> runtime."""
    entry = LAUNCHES.get(k)
    if entry is None or not A.writable_here(tensors[:outputs]):
        return False
    refs, stamp = entry.weights, entry.stamp
    for r, t, s in zip(refs, weight, stamp):
        if r() is not t or s[0] != t.data_ptr() or (s[1] is not None and s[1] != t._version) \
                or s[2] is not t.dtype or s[3] != t.shape or s[4] != t.is_contiguous() or s[5] != t.is_neg():
            return False
    ranges = [None if t is None else (t.data_ptr() + e[0], t.data_ptr() + e[1])
              for t, e in zip(tensors, entry.extents)]
    ins = [r for r in ranges[outputs:] if r is not None] + list(entry.weight_ranges)
    outs = [r for r in ranges[:outputs] if r is not None]
    for i, o in enumerate(outs):
        for other in (*outs[:i], *ins):
            if o[0] < other[1] and other[0] < o[1]:
                return False
    ln = entry.launch
    args = dict(ln.args)
    args.update(zip(weight_names, weight))
    for n, t in zip(names, tensors):
        if t is not None:
            args[n] = t
    if ln.tma is not None:
        m = tma.encode(tensors[outputs].data_ptr(), *ln.tma)     # the activation: the first input
        if m is None:
            # (the checked path plans again: its 256-token tile has no way but
            # the map to bring the activations, and traps without one)
            return False
        args["xmap"], args["act_tma"] = m, 1
    kernel = ln.kernel
    kernel.launch(rt_of(tensors[0].get_device()), ln.grid, ln.block, stream=None, shared_mem=kernel.smem, **args)
    return True


def launched(op: str, call: tuple, outputs: int, weight: tuple, sizes: tuple, names: tuple,
             weight_names: tuple) -> bool:
    """An op's fast path: whether its call (CUDA tensors or None, in `names`
    order, the first `outputs` of them written) was launched here. False
    sends it to the checked path, which also names a bad argument (a
    non-tensor reads as one the fast path does not take)."""
    try:
        if not all(t is None or t.is_cuda is True for t in call):
            return False
        for s in sizes:
            if s.__class__ is not int and s.__class__ is not str:
                # (the operators' `Scalar` sizes keep a bool or a float, and
                # True == 1, 48.0 == 48 in a key: the checked path refuses
                # them by name; the op wrapper makes a NumPy integer an int)
                return False
        try:
            k = key(op, call, weight, sizes)
        except RuntimeError:
            # (a sparse or nested tensor: no data pointer or sizes to key it
            # by; the checked path names it, rawkv._args.unstrided)
            return False
        return try_launch(k, weight, weight_names, names, call, outputs, get_runtime)
    except AttributeError:
        return False


def keep(op: str, call: tuple, weight: tuple, sizes: tuple, plan: list, names: tuple, weight_names: tuple) -> None:
    """After the checked path ran `plan` for a call the fast path may take
    (the caller has checked as_given): remember its one launch."""
    if len(plan) == 1:
        remember(key(op, call, weight, sizes), weight, plan[0], names, call, weight_names)
