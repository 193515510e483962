"""Property-based tests (hypothesis) of every public op on CPU (issue 21): the
inputs and the judge that each op's property test (in its op's test file) uses.
Random shapes (0-size and odd ones included), non-contiguous views, dtypes
(wrong ones included), NaN / Inf values, numpy arrays and CPU tensors.

Each call must either return what rawkv.reference computes from the same
inputs, bit for bit (docs/format.md: the CPU path is the reference; NaN
matches NaN, signed zeros must match), or raise a TypeError / ValueError
whose message starts with the name of one of the call's arguments (as
rawkv._args's rules write them: 'x:', 'out.q:', 'out[0]:', 'sf, gs:').
Any other exception (AttributeError, IndexError, numpy's own errors) is a
failure. The runs are derandomized (the same examples every run, so a
failure replays; hypothesis prints the falsifying example) and kept small
(max_examples per op) so they take well under a minute in CI.

Inputs are built from a seed hypothesis draws: the seed, the shape, the
dtype, the library and the layout appear in the falsifying example.
tests/guards/test_properties.py checks, after them all, that every property
test had calls accepted."""
from __future__ import annotations

import collections
import os
import re

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rawkv import _args as D  # noqa: E402


SETTINGS = settings(max_examples=100, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FLOATS = ("float32", "float16", "bfloat16")
WRONG = ("float64", "int32", "int64", "uint8", "bool")
BYTES = ("uint8", "float8_e4m3fn")
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e-30, 448.0, 6.0], np.float64)


def make(seed: int, shape, dtype: str, lib: str = "numpy", layout: str = "contiguous",
         special: bool = False, lo=None, hi=None):
    """An array of `shape` and `dtype` (torch's dtype names) from `seed`: a
    numpy array (lib 'numpy'; bfloat16 / FP8 are torch-only and come as CPU
    tensors) or a CPU tensor; layout 'rows' (rows further apart than their
    length), 'every_other' (the leading dimension strided by 2) or
    'contiguous'. special: some values NaN / Inf / huge / signed zeros."""
    rng = np.random.default_rng(seed)
    shape = tuple(shape)
    big = list(shape)
    if layout == "rows" and shape:
        big[-1] += 3
    elif layout == "every_other" and shape:
        big[0] *= 2
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        v = rng.standard_normal(big) * rng.choice([1.0, 1e-3, 100.0])
        if special and v.size:
            pick = rng.random(big) < 0.1
            v = np.where(pick, rng.choice(SPECIALS, size=big), v)
    elif dtype == "bool":
        v = rng.random(big) < 0.5
    else:
        lo = 0 if lo is None else lo
        hi = 256 if hi is None else hi
        v = rng.integers(lo, hi, size=big)
    torch_only = dtype in ("bfloat16", "float8_e4m3fn")
    if lib == "numpy" and not torch_only:
        with np.errstate(over="ignore", invalid="ignore"):     # 1e30 as float16: inf, as wanted
            full = np.asarray(v, dtype=dtype)
    elif dtype == "float8_e4m3fn":
        full = torch.from_numpy(np.asarray(v, np.uint8)).view(torch.float8_e4m3fn)
    else:
        full = torch.from_numpy(np.asarray(v)).to(getattr(torch, dtype))
    if layout == "rows" and shape:
        return full[..., :shape[-1]]
    if layout == "every_other" and shape:
        return full[::2]
    return full


def host(a) -> np.ndarray:
    """The values an op reads from `a`, as numpy (BF16 as float32, exactly;
    FP8 as its bytes)."""
    return np.ascontiguousarray(D.to_numpy(a, "a"))


def dtype_of(a) -> str:
    return str(a.dtype).replace("torch.", "")


seeds = st.integers(0, 2 ** 32 - 1)
libs = st.sampled_from(["numpy", "torch"])
layouts = st.sampled_from(["contiguous", "contiguous", "rows", "every_other"])


# ---- the judge ----------------------------------------------------------------------------
# test -> Counter of 'accepted' / 'refused' calls: a property test whose
# every call is refused would check nothing (test_every_op_was_accepted).
CALLS: dict = collections.defaultdict(collections.Counter)


def judge(call, names, reference, fault=None):
    """Run `call`: a TypeError / ValueError must name one of `names` (its
    message starts with it); a result must equal reference() bit for bit.
    `fault`: the argument made wrong on purpose, whose call must be refused.
    Returns the result (True for an op that returns None), or None when
    refused."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].split(" ")[0]
    try:
        got = call()
    except (TypeError, ValueError) as exc:
        pat = "|".join(re.escape(n) for n in names)
        assert re.match(rf"({pat})\b", str(exc)), \
            f"{type(exc).__name__} names none of {names}: {exc}"
        CALLS[test]["refused"] += 1
        return None
    assert fault is None, f"accepted a wrong {fault}"
    CALLS[test]["accepted"] += 1
    want = reference()
    if want is not None:            # None: an op that writes in place, compared by the caller
        same(got, want)
    return True if got is None else got


def bits(a) -> np.ndarray:
    """An array's values as numpy, exactly (BF16 -> float32, FP8 / FP4 -> bytes)."""
    if D.is_torch(a):
        if a.dtype == torch.bfloat16:
            return a.float().numpy()
        if a.element_size() == 1 and a.dtype not in (torch.uint8, torch.int8, torch.bool):
            return a.view(torch.uint8).numpy()
        return a.numpy()
    return np.asarray(a)


def same(got, want, what="result"):
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) >= len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            if w is not None:
                same(g, w, f"{what}[{i}]")
        return
    g, w = bits(got), np.asarray(want)
    assert g.size == w.size, f"{what}: {g.shape} vs {w.shape}"
    g, w = g.reshape(-1), w.reshape(-1)
    if w.dtype.kind == "f":
        g = g.astype(w.dtype) if g.dtype.kind == "f" else g
        gn, wn = np.isnan(g), np.isnan(w)
        assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
        bad = ~gn & (g.view(np.uint8).reshape(g.size, w.itemsize) !=
                     w.view(np.uint8).reshape(w.size, w.itemsize)).any(-1)
        assert not bad.any(), f"{what}: {int(bad.sum())} values differ, e.g. {g[bad][:3]} vs {w[bad][:3]}"
    else:
        assert np.array_equal(g.astype(np.int64), w.astype(np.int64)), f"{what}: values differ"


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


widths = st.sampled_from([16, 32, 48, 64] * 2 + [0, 8, 17, 24])        # valid ones twice as likely
leads = st.lists(st.integers(0, 4), min_size=0, max_size=2)
GS = [None, 0.5, 2.0 ** -10, 1, 0.0, -1.0, float("nan"), float("inf"), 1e-45, 1e39, True, "0.5",
      np.float32(0.25), "array", "array2", "array-f64"]


def _gs(v, seed, lib):
    """A gs from GS: the strings 'array*' become host arrays."""
    if v == "array":
        return make(seed, (1,), "float32", lib) * 0 + 0.125
    if v == "array2":
        return make(seed, (2,), "float32", lib) * 0 + 0.125
    if v == "array-f64":
        return np.array(0.125)
    return v


def _gs_ref(g):
    """What the reference takes for a gs the op accepted: float32."""
    return None if g is None else np.float32(host(g).reshape(()) if not isinstance(g, (int, float, np.floating))
                                             else g)


def _q_sf(seed, lead, n, lib, layout, sf_dt="uint8"):
    q = make(seed, (*lead, n // 2), "uint8", lib, layout)
    sf = make(seed + 1, (*lead, n // 16), sf_dt, lib, layout)
    return q, sf


x_dtypes = st.sampled_from(FLOATS * 2 + ("float64", "int32"))
p_dtypes = st.sampled_from(("float32", "bfloat16", "float16") * 2 + ("float64", "int32"))
f_scopes = st.sampled_from([None, "row", "tensor", "given", "none", "bogus"])
f_gs = st.sampled_from(GS[:7] + ["array", "array2", "array-f64"])


def _fused_gs(scope, g):
    sc = scope or ("given" if g is not None else "row")
    return sc, (_gs_ref(g) if sc == "given" else None)


def _activation_ref(lead, n, q, sf, g, inv=None):
    return (q.reshape(*lead, n // 2), sf.reshape(*lead, n // 16), np.asarray(g, np.float32),
            None if inv is None else inv.reshape(lead))
