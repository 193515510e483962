"""The GEMM ops' fast path (rawkv.gemm.fast): a call like one the
checked path launched reuses that launch at its own addresses. It must
launch exactly what the checked path would (the same bits, on every route
the dispatcher takes), and accept nothing the checked path refuses: an out
overlapping an input, a weight changed in place, a tunable set since, a view
the rules copy. It keeps no tensor alive. The tunable hook and the byte
ranges are pure Python and run on a CPU."""
import gc
import weakref

import numpy as np
import pytest

import rawkv
from rawkv.gemm import _rules, fast, linear, plans
from support.gemm import random_weight

torch = pytest.importorskip("torch")


@pytest.fixture
def calls(monkeypatch):
    """Counts of the checked path's argument rules (a call that takes the
    fast path runs none), per op; a fresh fast-path cache."""
    fast.forget()
    seen = {"grouped": 0, "moe": 0, "w4a8_grouped": 0, "w4a8_moe": 0}
    for name in seen:
        real = getattr(_rules, name)

        def counting(*args, _real=real, _name=name):
            seen[_name] += 1
            return _real(*args)
        monkeypatch.setattr(_rules, name, counting)
    yield seen
    fast.forget()


def _bits(t):
    return t.view(torch.int16).cpu().numpy()


def _kept(op):
    """The launches the cache keeps for `op`."""
    return [k for k in fast.LAUNCHES if k[0] == op]


# ---- CPU: the tunables' hook and the byte ranges ---------------------------------------------
def test_setting_a_tunable_forgets_every_launch(monkeypatch):
    fast.LAUNCHES[("grouped",)] = fast.LAUNCHES[("moe8",)] = None
    before = fast._version[0]
    monkeypatch.setattr(linear, "W4A8_PATH", "mma")
    assert not fast.LAUNCHES and fast._version[0] == before + 1
    linear.not_a_tunable = 1                   # other attributes leave them
    fast.LAUNCHES[("grouped",)] = None
    del linear.not_a_tunable
    assert fast.LAUNCHES
    fast.forget()


def test_extent_is_the_bytes_a_view_addresses():
    base = torch.zeros(6, 5, 8, dtype=torch.bfloat16)
    for t in (base, base[1:4], base[:, 1:3], base[..., 2:6], base.transpose(0, 1), base[::2], base[:0]):
        if t.numel() == 0:
            assert fast.extent(t) == (0, 0)
            continue
        lo, hi = fast.extent(t)
        # every element's byte offset from t's start, from its strides
        idx = np.indices(t.shape).reshape(len(t.shape), -1).T
        starts = (idx * np.array(t.stride())).sum(1) * 2
        assert lo == starts.min() and hi == starts.max() + 2, (t.shape, t.stride())


def test_a_tensor_map_the_driver_cannot_encode_sends_the_call_to_the_checked_path(monkeypatch):
    """A kept launch with an activation tensor map (the 256-token tile takes
    its activations no other way, and traps without one) is not launched
    when the map cannot be encoded at the new address: the checked path
    plans the call again. (It was launched with act_tma = 0.)"""
    from rawkv._plan import Launch

    class Kernel:
        smem = 0
        launched = 0

        def launch(self, *args, **kw):
            Kernel.launched += 1

    w = torch.zeros(4, dtype=torch.uint8)
    out, x = torch.zeros(8), torch.zeros(8)
    ln = Launch(Kernel(), (1, 1, 1), (384, 1, 1), {"wq": None, "xmap": None, "act_tma": 1}, ("geometry",))
    k = ("test", 0)
    fast.LAUNCHES[k] = fast._Entry((weakref.ref(w),), (rawkv._args.stamp(w),),
                                   ((w.data_ptr(), w.data_ptr() + 4),), ln, ((0, 32), (0, 32)))
    try:
        monkeypatch.setattr(fast.tma, "encode", lambda ptr, *geo: None)
        assert not fast.try_launch(k, (w,), ("wq",), ("out", "x"), (out, x), 1, lambda d: None)
        assert Kernel.launched == 0
        monkeypatch.setattr(fast.tma, "encode", lambda ptr, *geo: {"map": ptr})
        assert fast.try_launch(k, (w,), ("wq",), ("out", "x"), (out, x), 1, lambda d: None)
        assert Kernel.launched == 1
    finally:
        fast.LAUNCHES.pop(k, None)


@pytest.mark.parametrize("change", ["dtype", "shape", "layout", "negative"])
def test_a_weight_whose_data_is_reassigned_is_not_launched(change):
    """`t.data = ...` gives a weight tensor another dtype, shape, layout or
    negative bit at the same address with no new version (torch counts
    in-place ops only): the kept launch, planned for the old tensor (its
    groups, its bytes), is not reused; the checked path decides."""
    from rawkv._plan import Launch

    class Kernel:
        smem = 0
        launched = 0

        def launch(self, *args, **kw):
            Kernel.launched += 1

    w = torch.zeros(2, 8, dtype=torch.float32)
    out, x = torch.zeros(8), torch.zeros(8)
    k = ("probe", id(w))
    try:
        fast.remember(k, (w,), Launch(Kernel(), (1,), (1,), {"w": w, "x": x, "out": out}), ("out", "x"),
                      (out, x), ("w",))
        assert fast.try_launch(k, (w,), ("w",), ("out", "x"), (out, x), 1, lambda d: None)
        before, p = w._version, w.data_ptr()
        w.data = {"dtype": lambda d: d.view(torch.int32), "shape": lambda d: d[:1],
                  "layout": lambda d: d.as_strided((2, 8), (1, 2)), "negative": lambda d: d._neg_view()}[change](w.data)
        assert (w._version, w.data_ptr()) == (before, p)
        assert not fast.try_launch(k, (w,), ("w",), ("out", "x"), (out, x), 1, lambda d: None)
        assert Kernel.launched == 1
    finally:
        fast.forget()


# ---- GPU: the same launch, and nothing the checked path refuses ------------------------------
ROUTES = [  # (name, T or rows, G, N, K, tunables): every kernel and tile family the plan takes
    ("mma decode", 1, 4, 96, 256, {}),
    ("mma 16", 16, 4, 96, 256, {}),
    ("sm90 tma", 300, 2, 300, 512, {"KERNEL_PATH": "sm90"}),
    ("sm90 copy", 300, 2, 300, 512, {"KERNEL_PATH": "sm90", "SM90_ACT_TMA": False}),
    ("sm90 split", 64, 2, 300, 2048, {"KERNEL_PATH": "sm90", "SM90_FORCE_KSPLIT": 2}),
]


def _route(cuda, monkeypatch, tunables):
    if tunables.get("KERNEL_PATH") == "sm90" and cuda.arch != "sm_90":
        pytest.skip(f"the wgmma kernel runs on sm_90 devices; this one is {cuda.arch}")
    for name, value in tunables.items():
        monkeypatch.setattr(linear, name, value)


@pytest.mark.parametrize("route", ROUTES, ids=[r[0] for r in ROUTES])
def test_grouped_fast_path_launches_what_the_checked_path_does(cuda, monkeypatch, calls, rng, route):
    _, t, g, n, k, tunables = route
    _route(cuda, monkeypatch, tunables)
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    xs = [torch.randn(t, g, k, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    out = torch.empty(t, g, n, dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.grouped_linear(xs[0], w, out=out)
    assert calls["grouped"] == 1 and len(_kept("grouped")) == 1
    got = [_bits(rawkv.gemm.grouped_linear(x, w, out=out)) for x in xs[1:]]
    assert calls["grouped"] == 1                          # both took the fast path
    want = []
    for x in xs[1:]:
        fast.forget()                                     # each through the checked path
        want.append(_bits(rawkv.gemm.grouped_linear(x, w)))
    assert calls["grouped"] == 3
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # the operator's calls share the cache
    torch.ops.rawkv.gemm_grouped_linear(out=out, **linear.operator_args(xs[1], w))
    assert calls["grouped"] == 3
    np.testing.assert_array_equal(_bits(out), want[0])


@pytest.mark.parametrize("rows,tunables", [(6, {}), (600, {}), (2000, {"KERNEL_PATH": "sm90"})],
                         ids=["mma small", "mma ragged", "sm90"])
@pytest.mark.parametrize("with_errors", [False, True])
def test_moe_fast_path_launches_and_counts_as_the_checked_path(cuda, monkeypatch, calls, rng, rows, tunables,
                                                                 with_errors):
    _route(cuda, monkeypatch, tunables)
    e, n, k = 40, 200, 512
    w, _ = random_weight(rng, e, n, k, "nvfp4")
    cuts = np.sort(rng.integers(0, rows + 1, e - 1))
    offsets = torch.tensor([0, *cuts, rows + 3], dtype=torch.int32, device="cuda")   # last clamped: 1 count
    errors = torch.zeros(4, dtype=torch.int32, device="cuda") if with_errors else None
    slot = rawkv.nvfp4.GEMM_OFFSETS
    counter = lambda: int(errors[0]) if with_errors else int(rawkv.nvfp4.error_counts(0)[slot])  # noqa: E731
    xs = [torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    before = counter()
    rawkv.gemm.moe_linear(xs[0], w, offsets, out=out, errors=errors)
    got = [_bits(rawkv.gemm.moe_linear(x, w, offsets, out=out, errors=errors)) for x in xs[1:]]
    assert calls["moe"] == 1
    assert counter() == before + 3                        # each call counts its clamp
    want = []
    for x in xs[1:]:
        fast.forget()
        want.append(_bits(rawkv.gemm.moe_linear(x, w, offsets, errors=errors)))
    assert calls["moe"] == 3
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_an_out_overlapping_x_on_a_known_call_is_refused(cuda, calls, rng):
    t, g, n, k = 4, 2, 64, 256
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    flat = torch.zeros(t * g * (k + n) + 64, dtype=torch.bfloat16, device="cuda")
    x = flat[:t * g * k].view(t, g, k)
    rawkv.gemm.grouped_linear(x, w, out=flat[t * g * k:t * g * (k + n)].view(t, g, n))
    assert len(_kept("grouped")) == 1
    before = flat.clone()
    with pytest.raises(ValueError, match="out: overlaps x"):
        rawkv.gemm.grouped_linear(x, w, out=flat[8:8 + t * g * n].view(t, g, n))   # same key, inside x
    assert torch.equal(flat, before)                      # nothing written
    assert calls["grouped"] == 2


def test_moe_errors_overlapping_offsets_on_a_known_call_is_refused(cuda, calls, rng):
    e, n, k, rows = 8, 64, 256, 5
    w, _ = random_weight(rng, e, n, k, "nvfp4")
    buf = torch.zeros(64, dtype=torch.int32, device="cuda")
    offsets = buf[:e + 1]
    offsets.copy_(torch.tensor([0, 1, 1, 2, 3, 3, 4, 5, 5], dtype=torch.int32))
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.moe_linear(x, w, offsets, errors=buf[16:20])
    rawkv.gemm.moe_linear(x, w, offsets, errors=buf[20:24])
    assert calls["moe"] == 1
    with pytest.raises(ValueError, match="errors: overlaps offsets"):
        rawkv.gemm.moe_linear(x, w, offsets, errors=buf[4:8])


def test_a_weight_changed_in_place_is_checked_again(cuda, calls, rng):
    g, n, k = 2, 64, 256
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(1, g, k, dtype=torch.bfloat16, device="cuda")
    first = _bits(rawkv.gemm.grouped_linear(x, w))
    w.codes.bitwise_xor_(0)                              # same bytes, a new version
    again = _bits(rawkv.gemm.grouped_linear(x, w))
    assert calls["grouped"] == 2
    np.testing.assert_array_equal(first, again)
    w.gs.mul_(2.0)
    doubled = rawkv.gemm.grouped_linear(x, w)
    assert calls["grouped"] == 3
    np.testing.assert_array_equal(_bits(doubled), _bits(rawkv.gemm.grouped_linear(x, w)))
    assert not np.array_equal(_bits(doubled), first)


def test_a_tunable_set_after_a_call_plans_again(cuda, monkeypatch, calls, rng):
    g, n, k = 2, 64, 256
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(300, g, k, dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.grouped_linear(x, w)
    rawkv.gemm.grouped_linear(x, w)
    assert calls["grouped"] == 1
    monkeypatch.setattr(linear, "KERNEL_PATH", "mma")
    launched = []
    real = plans.grouped
    monkeypatch.setattr(plans, "grouped", lambda *a: launched.extend(real(*a)) or launched)
    rawkv.gemm.grouped_linear(x, w)
    assert calls["grouped"] == 2 and launched[0].kernel.expr.startswith("rkv_gemm_fp4<")


def test_a_view_the_rules_copy_is_not_remembered(cuda, calls, rng):
    g, n, k = 2, 64, 256
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(3, g, k + 2, dtype=torch.bfloat16, device="cuda")[..., 1:k + 1]   # rows 2 bytes off
    a = rawkv.gemm.grouped_linear(x, w)
    b = rawkv.gemm.grouped_linear(x, w)
    assert calls["grouped"] == 2 and not fast.LAUNCHES
    np.testing.assert_array_equal(_bits(a), _bits(b))


def test_the_cache_keeps_no_tensor_alive(cuda, calls, rng):
    g, n, k = 2, 64, 256
    w, _ = random_weight(rng, g, n, k, "nvfp4")
    x = torch.randn(1, g, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, g, n, dtype=torch.bfloat16, device="cuda")
    rawkv.gemm.grouped_linear(x, w, out=out)
    refs = [weakref.ref(t) for t in (x, out, w.codes, w.scales, w.gs)]
    del x, out, w
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(_kept("grouped")) == 1                     # its entry stays, and can no longer match


# ---- W4A8 -------------------------------------------------------------------------------------
def _w4a8_weight(rng, g, n, k):
    codes = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scales = (127 + rng.integers(-3, 4, (g, n, k // 32))).astype(np.uint8)
    w = rawkv.gemm.Fp4Weight.from_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales), groups=g)
    w8 = rawkv.gemm.w4a8_weight(w)
    return rawkv.gemm.W4a8Weight(w8.n, w8.k, *(t.cuda() for t in w8[2:]))


def _fp8(*shape):
    codes, scales = rawkv.fp8.quantize_blocks(torch.randn(*shape, device="cuda") * 3)
    return codes.view(torch.uint8), scales


@pytest.mark.parametrize("path,tokens", [("mma", 4), ("sm90", 200)])
@pytest.mark.parametrize("with_errors", [False, True])
def test_w4a8_fast_path_launches_and_counts_as_the_checked_path(cuda, monkeypatch, calls, rng, path, tokens,
                                                                 with_errors):
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 kernels run on sm_90 devices; this one is {cuda.arch}")
    monkeypatch.setattr(linear, "W4A8_PATH", path)
    g, e, n, k = 2, 12, 200, 512
    w8, m8 = _w4a8_weight(rng, g, n, k), _w4a8_weight(rng, e, n, k)
    errors = torch.zeros(4, dtype=torch.int32, device="cuda") if with_errors else None
    xs = [_fp8(tokens, g, k) for _ in range(3)]
    out = torch.empty(tokens, g, n, dtype=torch.bfloat16, device="cuda")
    rows = tokens * 3
    cuts = np.sort(rng.integers(0, rows + 1, e - 1))
    offsets = torch.tensor([0, *cuts, rows + 5], dtype=torch.int32, device="cuda")    # one clamp per call
    ms = [_fp8(rows, k) for _ in range(3)]
    mout = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    got = [_bits(rawkv.gemm.grouped_linear(x, w8, out=out, errors=errors)) for x in xs][1:]
    mgot = [_bits(rawkv.gemm.moe_linear(x, m8, offsets, out=mout, errors=errors)) for x in ms][1:]
    assert calls["w4a8_grouped"] == 1 and calls["w4a8_moe"] == 1
    if with_errors:
        assert int(errors[0]) == 3
    want, mwant = [], []
    for x, m in zip(xs[1:], ms[1:]):
        fast.forget()
        want.append(_bits(rawkv.gemm.grouped_linear(x, w8, errors=errors)))
        mwant.append(_bits(rawkv.gemm.moe_linear(m, m8, offsets, errors=errors)))
    assert calls["w4a8_grouped"] == 3 and calls["w4a8_moe"] == 3
    for a, b in zip(got + mgot, want + mwant):
        np.testing.assert_array_equal(a, b)


def test_w4a8_errors_overlapping_the_activation_scales_is_refused(cuda, calls, rng):
    if cuda.arch != "sm_90":
        pytest.skip(f"the W4A8 kernels run on sm_90 devices; this one is {cuda.arch}")
    g, n, k, t = 2, 64, 256, 3
    w8 = _w4a8_weight(rng, g, n, k)
    codes, scales = _fp8(t, g, k)
    flat = torch.zeros(64, dtype=torch.float32, device="cuda")
    sc = flat[:t * g * 2].view(t, g, 2)
    sc.copy_(scales)
    errors = flat[32:36].view(torch.int32)
    rawkv.gemm.grouped_linear((codes, sc), w8, errors=errors)
    rawkv.gemm.grouped_linear((codes, sc), w8, errors=flat[40:44].view(torch.int32))
    assert calls["w4a8_grouped"] == 1
    with pytest.raises(ValueError, match="errors: overlaps x.scales"):
        rawkv.gemm.grouped_linear((codes, sc), w8, errors=flat[4:8].view(torch.int32))


def test_a_float_size_on_a_known_call_is_refused(cuda, calls, rng):
    """The operators' sizes are `Scalar`s, which keep a float: 48.0 == 48
    (and hashes the same) in a key, so a call the checked path refuses by
    name ("weight: N = 48.0 ...: expected integers") was launched by the
    fast path once the same call with ints had been made. Every size that
    is not an int goes to the checked path (bools were already sent there)."""
    g, n, k, t = 2, 64, 256, 3
    w, _ = random_weight(rng, g, n, k, "mxfp4")
    x = torch.randn(t, g, k, dtype=torch.bfloat16, device="cuda")
    args = rawkv.gemm.operator_args(x, w)
    out = torch.empty(t, g, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        torch.ops.rawkv.gemm_grouped_linear(**args, out=out)
    assert calls["grouped"] == 1 and len(_kept("grouped")) == 1
    for key in ("n", "k", "exp_lo", "exp_hi"):
        with pytest.raises(TypeError, match="^weight: .*expected integers"):
            torch.ops.rawkv.gemm_grouped_linear(**{**args, key: float(args[key])}, out=out)
    if cuda.arch != "sm_90":
        return
    w8 = _w4a8_weight(rng, g, n, k)
    codes, scales = _fp8(t, g, k)
    args8 = rawkv.gemm.w4a8.operator_args8((codes, scales), w8)
    for _ in range(2):
        torch.ops.rawkv.gemm_grouped_linear_w4a8(**args8, out=out, errors=None)
    assert calls["w4a8_grouped"] == 1
    for key in ("n", "k"):
        with pytest.raises(TypeError, match="^weight: N = .*expected integers"):
            torch.ops.rawkv.gemm_grouped_linear_w4a8(**{**args8, key: float(args8[key])}, out=out, errors=None)
