"""rawkv.gemm.grouped_linear / moe_linear / Fp4GroupedLinear on CPU tensors
(the reference, exactly) and their argument checks (raised before any
launch, naming the argument; the CUDA path runs the same checks first), the
dispatch rules (their property tests: test_linear_properties.py)."""
import re

import numpy as np
import pytest

import rawkv
from rawkv._plan import Device
from rawkv.gemm import linear, plans
from rawkv.reference import gemm as ref

torch = pytest.importorskip("torch")


def _weight(rng, g, n, k):
    return rawkv.gemm.Fp4Weight.from_float(torch.from_numpy(rng.standard_normal((g, n, k)).astype(np.float32)))


def _exact(w):
    codes, scales, gs = (t.numpy() for t in w.unpack())
    return ref.dequantize_weight(codes, scales, gs, w.fmt)


def _bits(t):
    return t.view(torch.int16).numpy().view(np.uint16)


def test_cpu_grouped_is_the_reference_rounded_once(rng):
    w = _weight(rng, 3, 40, 96)
    x = torch.randn(5, 3, 96).bfloat16()
    want = ref.round_to_bf16(ref.grouped(x.double().numpy(), _exact(w)))
    assert np.array_equal(_bits(rawkv.gemm.grouped_linear(x, w)), want)
    out = torch.empty(5, 3, 40, dtype=torch.bfloat16)
    assert rawkv.gemm.grouped_linear(x, w, out=out) is out
    assert np.array_equal(_bits(out), want)


def test_cpu_nvfp4_activation_is_its_exact_value(rng):
    w = _weight(rng, 2, 24, 64)
    x = torch.randn(4, 2, 64)
    qa = rawkv.nvfp4.QuantizedActivation(*rawkv.nvfp4.quantize(x, scope="given", gs=0.25))
    xv = qa.dequantize(torch.float32).double().numpy()        # e2m1 * sf * 2^-2: exact in float32
    want = ref.round_to_bf16(ref.grouped(xv, _exact(w)))
    assert np.array_equal(_bits(rawkv.gemm.grouped_linear(qa, w)), want)


def test_cpu_moe_offsets_are_clamped_and_counted(rng):
    w = _weight(rng, 4, 16, 32)
    x = torch.randn(9, 32).bfloat16()
    offsets = torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32)
    want, bad = ref.ragged(x.double().numpy(), _exact(w), offsets.numpy())
    assert bad == 2                   # 3 < 5 and 12 > rows
    errors = np.zeros(1, np.int32)
    got = rawkv.gemm.moe_linear(x, w, offsets, errors=errors)
    assert np.array_equal(_bits(got), ref.round_to_bf16(want)) and errors[0] == 2
    before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
    rawkv.gemm.moe_linear(x, w, offsets)
    assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) == before + 2


@pytest.mark.parametrize("make,name", [
    (lambda x: x.float(), "x"),                                  # float32 is refused on CPU as on CUDA
    (lambda x: x[..., :32], "x"),                                # K mismatch
    (lambda x: x[:, :2], "x"),                                   # groups mismatch
    (lambda x: x[0], "x"),                                       # wrong rank
    (lambda x: 3.0, "x"),
])
def test_bad_activations_name_the_argument(rng, make, name):
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises((TypeError, ValueError), match=rf"^{name}"):
        rawkv.gemm.grouped_linear(make(x), w)


def test_nvfp4_activation_parts_are_checked(rng):
    w = _weight(rng, 3, 16, 64)
    q, sf, gs = rawkv.nvfp4.quantize(torch.randn(2, 3, 64), scope="row")
    with pytest.raises(TypeError, match=r"^x.q"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q.view(torch.uint8).float(), sf, gs), w)
    with pytest.raises(ValueError, match=r"^x.sf"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q, sf[..., :2], gs), w)
    with pytest.raises(ValueError, match=r"^x.gs"):
        rawkv.gemm.grouped_linear(rawkv.nvfp4.QuantizedActivation(q, sf, gs[:1]), w)


def test_bad_out_and_offsets_name_the_argument(rng):
    w = _weight(rng, 3, 16, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises(ValueError, match=r"^out"):
        rawkv.gemm.grouped_linear(x, w, out=torch.empty(2, 3, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^offsets"):
        rawkv.gemm.moe_linear(x[:, 0], w, torch.tensor([0, 1, 2], dtype=torch.int32))


def test_layer_checks(rng):
    with pytest.raises(ValueError, match=r"^in_features"):
        rawkv.gemm.Fp4GroupedLinear(2, 40, 16, max_tokens=4, device="cpu")
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu")
    with pytest.raises(RuntimeError, match="no weight"):
        layer(torch.randn(1, 2, 64).bfloat16())
    with pytest.raises(ValueError, match=r"^w"):
        layer.set_weight(torch.randn(2, 16, 32))
    layer.set_weight(torch.randn(2, 16, 64))
    with pytest.raises(ValueError, match=r"^x: 5 tokens"):
        layer(torch.randn(5, 2, 64).bfloat16())
    y = layer(torch.randn(3, 2, 64).bfloat16())
    assert y.shape == (3, 2, 16) and y.data_ptr() == layer.out.data_ptr()


def test_layer_loads_mxfp4_and_nvfp4_checkpoints(rng):
    g, n, k = 2, 16, 64
    codes = rng.integers(0, 256, (g * n, k // 2), dtype=np.uint8)
    scales = rng.integers(120, 130, (g * n, k // 32), dtype=np.uint8)
    layer = rawkv.gemm.Fp4GroupedLinear(g, k, n, max_tokens=3, device="cpu")
    layer.load_mxfp4(torch.from_numpy(codes), torch.from_numpy(scales))
    x = torch.randn(3, g, k).bfloat16()
    w64 = ref.dequantize_weight(codes.reshape(g, n, k // 2), scales.reshape(g, n, k // 32), None, "mxfp4")
    want = ref.round_to_bf16(ref.grouped(x.double().numpy(), w64))
    assert np.array_equal(_bits(layer(x)), want)
    sf = rng.integers(0x20, 0x50, (g * n, k // 16), dtype=np.uint8)
    gs = torch.tensor([0.5, 0.25])
    layer.load_nvfp4(torch.from_numpy(codes), torch.from_numpy(sf), gs)
    w64 = ref.dequantize_weight(codes.reshape(g, n, k // 2), sf.reshape(g, n, k // 16), gs.numpy(), "nvfp4")
    assert np.array_equal(_bits(layer(x)), ref.round_to_bf16(ref.grouped(x.double().numpy(), w64)))
    with pytest.raises(ValueError, match=r"^weight"):
        layer.load_mxfp4(torch.from_numpy(codes[:, :16]), torch.from_numpy(scales[:, :1]))


def test_a_bad_out_writes_nothing(rng):
    w = _weight(rng, 4, 16, 32)
    x = torch.randn(9, 32).bfloat16()
    errors = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match=r"^out"):
        rawkv.gemm.moe_linear(x, w, torch.tensor([1, 5, 3, 12, 9], dtype=torch.int32), errors=errors,
                              out=torch.empty(9, 15, dtype=torch.bfloat16))
    assert errors[0] == 0             # the clamps are not counted by a call that raised


def test_layer_arguments_are_refused_by_name(rng):
    # a wrong type is a TypeError, a bad value a ValueError (both were
    # ValueErrors); no weight / no activation: TypeErrors naming them (were
    # AttributeErrors from inside the layer)
    for bad, exc in (("2", TypeError), (2.0, TypeError), (True, TypeError), (0, ValueError), (-1, ValueError)):
        with pytest.raises(exc, match=r"^groups"):
            rawkv.gemm.Fp4GroupedLinear(bad, 64, 16, max_tokens=4, device="cpu")
        with pytest.raises(exc, match=r"^max_tokens"):
            rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=bad, device="cpu")
    layer = rawkv.gemm.Fp4GroupedLinear(2, 64, 16, max_tokens=4, device="cpu")
    with pytest.raises(TypeError, match=r"^w: expected a tensor or array, got None"):
        layer.set_weight(None)
    layer.set_weight(torch.randn(2, 16, 64))
    for bad in (None, 3.0):
        with pytest.raises(TypeError, match=r"^x: expected a tensor"):
            layer(bad)


# -- issue 21 item 5: one set of argument rules on CPU and CUDA ----------------------

def bad_argument_cases(rng, device):
    """(what, call, exception, message prefix): arguments the ops refuse,
    on `device`. The CPU path accepted several that CUDA refuses (int64
    offsets, int64 / float32 errors, a float64 / int32 gs) or crashed on
    them (weight=None, an empty or bool errors): tests/gemm/test_linear_gpu.py
    runs the same table on CUDA."""
    w = _weight(rng, 3, 16, 64).to(device)
    x = torch.randn(2, 3, 64, device=device).bfloat16()
    xm = x[:, 0]
    offs = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=device)
    q, sf, gs = rawkv.nvfp4.quantize(torch.randn(2, 3, 64, device=device), scope="row")
    qa = rawkv.nvfp4.QuantizedActivation
    gl, ml = rawkv.gemm.grouped_linear, rawkv.gemm.moe_linear
    i32 = dict(dtype=torch.int32, device=device)
    bf = dict(dtype=torch.bfloat16, device=device)
    return [
        ("weight None", lambda: gl(x, None), TypeError, "weight: expected a rawkv.gemm.Fp4Weight"),
        ("weight a tensor", lambda: gl(x, w.codes), TypeError, "weight: expected a rawkv.gemm.Fp4Weight"),
        ("moe weight None", lambda: ml(xm, None, offs), TypeError, "weight: expected a rawkv.gemm.Fp4Weight"),
        ("x float32", lambda: gl(x.float(), w), TypeError, "x: dtype float32"),
        ("x None", lambda: gl(None, w), TypeError, "x: expected a tensor"),
        ("gs float64", lambda: gl(qa(q, sf, gs.double()), w), TypeError, "x.gs: dtype float64"),
        ("gs int32", lambda: gl(qa(q, sf, gs.int()), w), TypeError, "x.gs: dtype int32"),
        ("q float32", lambda: gl(qa(q.view(torch.uint8).float(), sf, gs), w), TypeError, "x.q: dtype float32"),
        ("offsets int64", lambda: ml(xm, w, offs.long()), TypeError, "offsets: dtype int64"),
        ("offsets float32", lambda: ml(xm, w, offs.float()), TypeError, "offsets: dtype float32"),
        ("offsets shape", lambda: ml(xm, w, offs[:3]), ValueError, "offsets: expected shape"),
        ("offsets strided", lambda: ml(xm, w, torch.zeros(8, **i32)[::2]), ValueError, "offsets: must be contiguous"),
        ("offsets None", lambda: ml(xm, w, None), TypeError, "offsets: expected a tensor"),
        ("offsets a list", lambda: ml(xm, w, [0, 1, 1, 2]), TypeError, "offsets: expected a tensor"),
        ("errors empty", lambda: ml(xm, w, offs, errors=torch.zeros(0, **i32)), ValueError, "errors: expected an int32 tensor with at least 1 element"),
        ("errors bool", lambda: ml(xm, w, offs, errors=torch.zeros(1, dtype=torch.bool, device=device)),
         TypeError, "errors: dtype bool"),
        ("errors int64", lambda: ml(xm, w, offs, errors=torch.zeros(1, dtype=torch.int64, device=device)),
         TypeError, "errors: dtype int64"),
        ("errors float32", lambda: ml(xm, w, offs, errors=torch.zeros(1, device=device)),
         TypeError, "errors: dtype float32"),
        ("errors strided", lambda: ml(xm, w, offs, errors=torch.zeros(4, **i32)[::2]), ValueError,
         "errors: must be contiguous"),
        ("errors a number", lambda: ml(xm, w, offs, errors=0), TypeError, "errors: expected a tensor"),
        ("out float32", lambda: gl(x, w, out=torch.empty(2, 3, 16, device=device)), TypeError, "out: dtype float32"),
        ("out shape", lambda: gl(x, w, out=torch.empty(2, 3, 15, **bf)), ValueError, "out: expected shape"),
        ("out last dim strided", lambda: gl(x, w, out=torch.empty(2, 3, 32, **bf)[..., ::2]),
         ValueError, "out: the last dimension"),
        ("out a number", lambda: gl(x, w, out=1.0), TypeError, "out: expected a tensor"),
        ("moe out shape", lambda: ml(xm, w, offs, out=torch.empty(2, 15, **bf)), ValueError, "out: expected shape"),
    ]


def check_bad_argument_cases(rng, device):
    for what, call, exc, msg in bad_argument_cases(rng, device):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            call()
        print("refused:", what)


def test_bad_arguments_are_refused_by_name_as_on_cuda(rng):
    check_bad_argument_cases(rng, "cpu")


def test_too_many_experts_are_refused_on_cpu_too(rng, monkeypatch):
    # the ragged kernel's limit (MAX_SEGMENTS - 1 experts) was checked on CUDA only
    monkeypatch.setattr(rawkv.kernels.gemm_fp4, "MAX_SEGMENTS", 3)
    w = _weight(rng, 3, 16, 32)
    with pytest.raises(ValueError, match=r"^weight: 3 experts"):
        rawkv.gemm.moe_linear(torch.randn(4, 32).bfloat16(), w, torch.zeros(4, dtype=torch.int32))


def test_a_refused_errors_counts_nothing(rng):
    w = _weight(rng, 2, 16, 32)
    before = int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS])
    bad_offsets = torch.tensor([5, 0, 9], dtype=torch.int32)        # would count clamps
    with pytest.raises(TypeError, match=r"^errors"):
        rawkv.gemm.moe_linear(torch.randn(4, 32).bfloat16(), w, bad_offsets, errors=np.zeros(1, np.int64))
    assert int(rawkv.nvfp4.error_counts("cpu")[rawkv.nvfp4.GEMM_OFFSETS]) == before


def _f32_bits(a):
    """numpy's BF16 stand-in (float32 holding BF16 values) as BF16 bits."""
    b = a.view(np.uint32)
    assert not (b & 0xFFFF).any()
    return (b >> 16).astype(np.uint16)


def test_numpy_activations_run_the_reference(rng):
    # docs/gemm.md "Arguments": numpy arrays run the reference like CPU
    # tensors (they crashed: 'numpy.ndarray' object has no attribute 'dim').
    # numpy has no bfloat16: a float32 array holding BF16 values stands for
    # one, and the result is such an array.
    w = _weight(rng, 3, 40, 96)
    xt = torch.randn(5, 3, 96).bfloat16()
    want = _bits(rawkv.gemm.grouped_linear(xt, w))
    x32 = xt.float().numpy()
    got = rawkv.gemm.grouped_linear(x32, w)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (5, 3, 40)
    assert np.array_equal(_f32_bits(got), want)
    out = np.full((5, 3, 40), np.nan, np.float32)
    assert rawkv.gemm.grouped_linear(x32, w, out=out) is out and np.array_equal(_f32_bits(out), want)
    tout = torch.empty(5, 3, 40, dtype=torch.bfloat16)
    assert rawkv.gemm.grouped_linear(x32, w, out=tout) is tout and np.array_equal(_bits(tout), want)
    x16 = x32.astype(np.float16)
    assert np.array_equal(_f32_bits(rawkv.gemm.grouped_linear(x16, w)),
                          _bits(rawkv.gemm.grouped_linear(torch.from_numpy(x16), w)))
    bad = x32.copy()
    bad[1, 2, 3] = 0.1                              # not a BF16 value
    with pytest.raises(ValueError, match=r"^x: .*BF16 values; x\[1, 2, 3\]"):
        rawkv.gemm.grouped_linear(bad, w)
    with pytest.raises(TypeError, match=r"^x: dtype float64"):
        rawkv.gemm.grouped_linear(x32.astype(np.float64), w)
    with pytest.raises(TypeError, match=r"^out: dtype float64"):
        rawkv.gemm.grouped_linear(x32, w, out=np.empty((5, 3, 40)))


def test_numpy_nvfp4_activations_and_moe(rng):
    # a QuantizedActivation of numpy arrays (what rawkv.nvfp4.quantize and
    # the fused producers return for numpy input) gives the bits of the same
    # activation as CPU tensors; moe_linear takes numpy offsets / errors.
    w = _weight(rng, 3, 24, 64)
    xf = rng.standard_normal((4, 3, 64)).astype(np.float32)
    qa = rawkv.nvfp4.QuantizedActivation
    qn = qa(*rawkv.nvfp4.quantize(xf, scope="row")[:3])
    qt = qa(*rawkv.nvfp4.quantize(torch.from_numpy(xf), scope="row")[:3])
    assert isinstance(qn.q, np.ndarray)
    assert np.array_equal(_f32_bits(rawkv.gemm.grouped_linear(qn, w)), _bits(rawkv.gemm.grouped_linear(qt, w)))
    with pytest.raises(TypeError, match=r"^x.gs: dtype float64"):
        rawkv.gemm.grouped_linear(qa(qn.q, qn.sf, qn.gs.astype(np.float64)), w)
    xm = torch.randn(7, 64).bfloat16()
    offsets = np.array([0, 2, 1, 9], np.int32)                      # two clamps
    errors = np.zeros((1, 2), np.int32)                             # errors[0] is the first element
    got = rawkv.gemm.moe_linear(xm.float().numpy(), w, offsets, errors=errors)
    want = rawkv.gemm.moe_linear(xm, w, torch.from_numpy(offsets))
    assert np.array_equal(_f32_bits(got), _bits(want)) and errors.tolist() == [[2, 0]]
    with pytest.raises(TypeError, match=r"^offsets: dtype int64"):
        rawkv.gemm.moe_linear(xm.float().numpy(), w, offsets.astype(np.int64))


class _Sizes:
    def __init__(self, groups, n, k=4096):
        self.groups, self.n, self.k = groups, n, k


@pytest.mark.parametrize("groups,n,tokens,expected", [
    (8, 1024, 127, False), (8, 1024, 128, False),     # Flash wo_a at 128 tokens: 32 blocks
    (16, 1024, 128, True), (8, 1536, 128, True),      # Pro (64 blocks), seed 004 (48)
    (1, 16, 255, False), (1, 16, 256, True)])
def test_the_batched_dispatch_rule(groups, n, tokens, expected):
    """Which kernel an sm_90 device runs: arithmetic on the sizes, no GPU
    needed (docs/gemm.md), with the tunables rawkv.gemm.linear holds."""
    assert plans.takes_sm90(_Sizes(groups, n), tokens, False, linear) is expected


@pytest.mark.parametrize("tokens,expected", [(1, False), (12, False), (24, False), (27, False), (28, True), (96, True)])
def test_the_ragged_dispatch_rule(tokens, expected):
    assert plans.takes_sm90(_Sizes(256, 4096), tokens, True, linear) is expected


H100 = Device(sm_count=132, max_threads_per_sm=2048, arch="sm_90")


@pytest.mark.parametrize("groups,n,k,tokens,tile", [
    # (groups, n, k, tokens): (BN, BM, splits) or "mma", from the H200 sweep
    # of 2026-11-26 (docs/gemm.md, "Dispatch"): the best measured tile in
    # every case, and the mma.sync kernel below 48 tokens
    (8, 1024, 4096, 32, "mma"),
    (8, 1024, 4096, 64, (64, 256, 2)),        # Flash: 32 blocks of 256 x 64 -> 64 half-K blocks
    (8, 1536, 8192, 64, (64, 256, 2)),        # seed 004: 48 -> 96
    (8, 1024, 4096, 96, (128, 128, 2)),       # 64 blocks of 128 x 128 -> 128
    (16, 1024, 4096, 128, (128, 256, 2)),     # Pro: 64 blocks of 256 x 128 -> 128
    (8, 1024, 4096, 256, (128, 256, 2)),
    (8, 1536, 8192, 256, (128, 256, 1)),      # 96 blocks: split, 192 would end in a thin second wave
    (8, 1536, 8192, 512, (128, 256, 2)),      # 192 blocks (1.45 waves) -> 384 (2.9)
    (8, 1024, 4096, 512, (128, 256, 1)),      # 128 blocks: one wave already
    (8, 1024, 1024, 256, (128, 128, 1)),      # K = 1024: too few chunks to split; 128-feature blocks instead
    (8, 1024, 4096, 4096, (128, 256, 1))])
def test_the_wgmma_tile_is_the_modelled_fastest(groups, n, k, tokens, tile):
    t = plans.tile(H100, _Sizes(groups, n, k), tokens, tuning=linear)
    if tile == "mma":
        assert t.kernel is plans.K.GEMM
        return
    assert (t.tokens, t.rows, t.splits) == tile
    assert t.kernel is (plans.K.GEMM_SM90_SPLITK if tile[2] > 1 else plans.K.GEMM_SM90)
    assert t.targs[2] == t.rows and t.targs[0] == t.tokens


def test_the_tunables_set_on_linear_steer_the_plan(monkeypatch):
    # tests/gemm/test_linear_sm90.py and tools/probe_gemm_paths.py set them there
    w = _Sizes(8, 1024)
    assert plans.tile(H100, w, 16, tuning=linear).kernel is plans.K.GEMM
    monkeypatch.setattr(linear, "KERNEL_PATH", "sm90")
    monkeypatch.setattr(linear, "SM90_FORCE_BM", 256)
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", 1)
    t = plans.tile(H100, w, 16, tuning=linear)
    assert t.kernel is plans.K.GEMM_SM90 and t.rows == 256 and t.tokens == 64
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", 2)
    t = plans.tile(H100, w, 16, tuning=linear)
    assert t.kernel is plans.K.GEMM_SM90_SPLITK and t.splits == 2 and t.targs == (64, 6, 256, 2)
    monkeypatch.setattr(linear, "SM90_FORCE_KSPLIT", None)
    monkeypatch.setattr(linear, "SM90_FORCE_BN", 128)
    assert plans.tile(H100, w, 16, tuning=linear).tokens == 128
    monkeypatch.setattr(linear, "SM90_MIN_EXPERT_TOKENS", 4)
    monkeypatch.setattr(linear, "KERNEL_PATH", "auto")
    assert plans.takes_sm90(w, 4, True, linear) and not plans.takes_sm90(w, 4, True)


def test_a_weights_tensors_are_checked_again_when_they_change(rng):
    # rawkv.gemm._rules keeps a weight's check for its next call; another
    # tensor, or the same one moved to other memory (set_), is checked anew
    w = _weight(rng, 2, 16, 64)
    x = torch.randn(3, 2, 64).bfloat16()
    rawkv.gemm.grouped_linear(x, w)
    bad = rawkv.gemm.Fp4Weight(w.fmt, w.n, w.k, w.codes, w.scales, w.gs.double())
    with pytest.raises(TypeError, match=r"^weight.gs: dtype float64"):
        rawkv.gemm.grouped_linear(x, bad)
    w.scales.set_(w.scales.clone()[..., :1])             # the same object, other memory and shape
    with pytest.raises(ValueError, match=r"^weight.scales: expected shape"):
        rawkv.gemm.grouped_linear(x, w)


def test_the_operators_check_the_weight_tensors(rng):
    # engines call torch.ops.rawkv.gemm_* with a weight's tensors: they are
    # checked as the public ops check them (they were not: a float64 gs or
    # int8 codes reached the kernel)
    import rawkv.library  # noqa: F401
    w = _weight(rng, 2, 16, 64)
    x = torch.randn(3, 2, 64).bfloat16()
    out = torch.empty(3, 2, 16, dtype=torch.bfloat16)
    args = rawkv.gemm.operator_args(x, w)
    for key, bad, exc, msg in (("gs", w.gs.double(), TypeError, "weight.gs: dtype float64"),
                               ("codes", w.codes.view(torch.int8), TypeError, "weight.codes: dtype int8"),
                               ("scales", w.scales[..., :1], ValueError, "weight.scales: expected shape"),
                               ("fmt", "fp4", ValueError, "weight: format 'fp4'"),
                               ("k", 72, ValueError, "weight: N = 16, K = 72")):
        with pytest.raises(exc, match="^" + re.escape(msg)):
            torch.ops.rawkv.gemm_grouped_linear(**{**args, key: bad}, out=out)
    torch.ops.rawkv.gemm_grouped_linear(**args, out=out)
    assert torch.equal(out.view(torch.int16), rawkv.gemm.grouped_linear(x, w).view(torch.int16))
