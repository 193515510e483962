"""rawkv.fp8.e4m3_encode / e4m3_decode (the two ops are tested as a pair: most
tests call both): the reference against independent oracles, exhaustively,
argument errors on CPU and CUDA, and the CUDA kernels against the reference
bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import rawkv  # noqa: E402
from rawkv.reference import formats as ref  # noqa: E402
from rawkv.reference import formats as RF  # noqa: E402
from support.properties import (  # noqa: E402
    BYTES, FLOATS, SETTINGS, WRONG, host, judge, layouts, libs, make, seeds, shapes)


# ---- the reference ----------------------------------------------------------------------------------
ALL_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)


def brute_force_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest finite E4M3 value by search over the 254 finite codes, ties to
    the even code, |x| > 448 saturating, NaN -> 0x7F. Independent of ref."""
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    vals = ref.e4m3_decode(codes).astype(np.float64)
    out = np.empty(x.shape, np.uint8)
    with np.errstate(invalid="ignore"):   # signalling NaNs among the bf16 patterns
        x64 = x.astype(np.float64)
    for i, v in enumerate(x64):
        if np.isnan(v):
            out[i] = 0x7F
            continue
        v = float(np.clip(v, -448.0, 448.0))
        d = np.abs(vals - v)
        best = np.flatnonzero(d == d.min())
        # among equal distances: same value (+0/-0) -> keep v's sign; else even mantissa
        same_sign = [c for c in best if (codes[c] >> 7) == (1 if np.signbit(v) else 0)]
        cands = same_sign or list(best)
        even = [c for c in cands if codes[c] % 2 == 0]
        out[i] = codes[(even or cands)[0]]
    return out


def test_encode_matches_brute_force_on_a_sample_of_all_bf16(rng):
    idx = rng.choice(ALL_BF16.size, 6000, replace=False)
    sample = ALL_BF16[idx]
    assert np.array_equal(ref.e4m3_encode(sample), brute_force_e4m3(sample))


def test_encode_all_bf16_matches_torch_where_torch_saturates_the_same():
    ours = ref.e4m3_encode(ALL_BF16)
    theirs = torch.from_numpy(ALL_BF16.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    in_range = np.abs(ALL_BF16) < 448  # torch maps overflow to NaN, the spec saturates
    assert np.array_equal(ours[in_range], theirs[in_range])
    big = np.isfinite(ALL_BF16) & (np.abs(ALL_BF16) >= 448) | np.isinf(ALL_BF16)
    assert set(ours[big].tolist()) == {0x7E, 0xFE}
    assert np.all(ours[np.isnan(ALL_BF16)] == 0x7F)


def test_ties_round_to_even():
    # midpoints between consecutive E4M3 values, normal and subnormal
    lo = ref.e4m3_decode(np.arange(0, 0x7D, dtype=np.uint8)).astype(np.float64)
    hi = ref.e4m3_decode(np.arange(1, 0x7E, dtype=np.uint8)).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (lo + hi) / 2)  # exact in float32
    got = ref.e4m3_encode(mid)
    expect = np.where(np.arange(0, 0x7D) % 2 == 0, np.arange(0, 0x7D), np.arange(1, 0x7E))
    assert np.array_equal(got, expect.astype(np.uint8))
    assert np.array_equal(ref.e4m3_encode(-mid), expect.astype(np.uint8) | 0x80)


def test_decode_all_bytes_matches_torch():
    mine = ref.e4m3_decode(np.arange(256))
    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(mine, theirs, equal_nan=True)
    assert np.isnan(mine[0x7F]) and np.isnan(mine[0xFF]) and np.isnan(mine).sum() == 2


def test_cpu_op_types_and_out():
    x = torch.tensor([1.0, -2.0, 0.3], dtype=torch.bfloat16)
    codes = rawkv.fp8.e4m3_encode(x)
    assert codes.dtype == torch.float8_e4m3fn
    out = torch.full((3,), 7, dtype=torch.uint8)
    assert rawkv.fp8.e4m3_encode(x, out=out) is out
    assert out.tolist() == codes.view(torch.uint8).tolist()
    y = rawkv.fp8.e4m3_decode(codes, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.tolist() == [1.0, -2.0, 0.3125]
    arr = rawkv.fp8.e4m3_encode(np.array([0.5], np.float32))
    assert isinstance(arr, np.ndarray) and arr.tolist() == [0x30]


def test_cpu_decode_dtype_follows_out():
    codes = np.array([0x38, 0x31], np.uint8)          # 1.0, 0.5625
    out = np.zeros(2, np.float16)
    assert rawkv.fp8.e4m3_decode(codes, out=out) is out and out.tolist() == [1.0, 0.5625]
    t = torch.zeros(2, dtype=torch.bfloat16)
    assert rawkv.fp8.e4m3_decode(torch.from_numpy(codes).view(torch.float8_e4m3fn), out=t) is t
    assert t.tolist() == [1.0, 0.5625]


def test_zero_d_input_keeps_its_shape():
    x = np.array(3.0, np.float32)
    codes = rawkv.fp8.e4m3_encode(x)
    assert codes.shape == () and rawkv.fp8.e4m3_decode(codes).shape == ()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_zero_d_codes_decode_to_every_dtype(dtype):
    """A 0-d codes tensor decodes to each dtype on the CPU path: eagerly, as
    an operator and compiled. Before, bfloat16 failed there with numpy's
    'expected np.ndarray (got numpy.float32)' (the reference's BF16 rounding
    of a 0-d array gave a NumPy scalar), where the kernel decodes it. Found
    by a review."""
    codes = torch.tensor(0x38, dtype=torch.uint8)          # 1.0
    tdt = getattr(torch, dtype)
    got = rawkv.fp8.e4m3_decode(codes, dtype=tdt)
    assert got.shape == () and got.dtype == tdt and got.item() == 1.0
    out = torch.full((), 7.0, dtype=tdt)
    torch.ops.rawkv.e4m3_decode(codes, out)
    assert out.item() == 1.0
    torch._dynamo.reset()
    step = torch.compile(lambda c: rawkv.fp8.e4m3_decode(c, dtype=tdt), fullgraph=True, backend="aot_eager")
    assert step(codes).item() == 1.0
    host = rawkv.fp8.e4m3_decode(np.array(0x38, np.uint8), dtype=tdt)
    assert isinstance(host, np.ndarray) and host.shape == () and float(host) == 1.0


# ---- argument errors --------------------------------------------------------------------------------
def test_cpu_out_shape_is_checked():
    with pytest.raises(ValueError, match="out"):
        rawkv.fp8.e4m3_encode(np.zeros(4, np.float32), out=np.zeros(5, np.uint8))


def test_cpu_bad_arguments_are_refused_and_write_nothing():
    """The CUDA path's dtype and shape checks hold for numpy arrays and CPU
    tensors too; each case's own out buffer (all 7) is checked afterwards."""
    enc, dec = rawkv.fp8.e4m3_encode, rawkv.fp8.e4m3_decode
    x_t, x_np = torch.ones(4), np.ones(4, np.float32)
    c_t, c_np = torch.full((4,), 0x38, dtype=torch.uint8), np.full(4, 0x38, np.uint8)
    cases = [
        (lambda out: enc(x_t, out=out), torch.full((4,), 7.0), TypeError, "^out: dtype float32"),
        (lambda out: enc(x_np, out=out), np.full(4, 7.0, np.float32), TypeError, "^out: dtype float32"),
        (lambda out: enc(x_t, out=out), torch.full((4,), 7, dtype=torch.int32), TypeError,
         "^out: dtype int32"),
        (lambda out: enc(x_np, out=out), np.full(5, 7, np.uint8), ValueError, "^out: expected shape"),
        (lambda out: enc(x_t.int(), out=out), torch.full((4,), 7, dtype=torch.uint8), TypeError,
         "^x: dtype int32"),
        (lambda out: enc(x_np.astype(np.float64), out=out), np.full(4, 7, np.uint8), TypeError,
         "^x: dtype float64"),
        (lambda out: dec(c_t, dtype=torch.int32, out=out), None, TypeError, "^dtype: "),
        (lambda out: dec(c_t.float(), out=out), torch.full((4,), 7.0), TypeError, "^codes: dtype float32"),
        (lambda out: dec(c_np.astype(np.float32), out=out), None, TypeError, "^codes: dtype float32"),
        (lambda out: dec(c_t, out=out), torch.full((4,), 7, dtype=torch.int32), TypeError,
         "^out: dtype int32"),
        (lambda out: dec(c_np, out=out), np.full(4, 7, np.int32), TypeError, "^out: dtype int32"),
        (lambda out: dec(c_t, dtype=torch.float16, out=out), torch.full((4,), 7.0), TypeError,
         "^out: dtype float32"),
        (lambda out: dec(c_np, out=out), np.full(3, 7.0, np.float32), ValueError, "^out: expected shape"),
    ]
    for call, out, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call(out)
        assert out is None or (out == 7).all(), msg


@pytest.mark.parametrize("bad", [1.5, None, 3, "x", [1.0, 2.0]])
def test_numbers_and_none_passed_as_tensors_are_type_errors(bad):
    """A number, None, a string or a list where a tensor belongs: a TypeError
    naming the argument (not an AttributeError about __dlpack__)."""
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="^x: expected a tensor or array"):
        rawkv.fp8.e4m3_encode(bad)
    if bad is not None:                         # out=None means: allocate
        with pytest.raises(TypeError, match="^out: expected a tensor or array"):
            rawkv.fp8.e4m3_encode(x, out=bad)
    with pytest.raises(TypeError, match="^codes: expected a tensor or array"):
        rawkv.fp8.e4m3_decode(bad)


def test_cpu_out_overlapping_the_input_or_read_only_is_refused():
    """issue 21, items 7 and 8: an out= in the input's memory (decode wrote
    over the codes it was reading) or a read-only numpy out= is refused by
    name, before anything is written."""
    enc, dec = rawkv.fp8.e4m3_encode, rawkv.fp8.e4m3_decode
    x = torch.ones(4)
    with pytest.raises(ValueError, match="^out: overlaps x in memory"):
        enc(x, out=x.view(torch.uint8)[4:8])
    assert (x == 1).all()
    buf = torch.zeros(4)
    codes = buf.view(torch.uint8)[:4]          # the codes, in the first value of out
    codes.fill_(0x38)
    with pytest.raises(ValueError, match="^out: overlaps codes in memory"):
        dec(codes, out=buf)
    assert (codes == 0x38).all()
    out = np.zeros(4, np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="^out: is read-only"):
        enc(np.ones(4, np.float32), out=out)
    with pytest.raises(ValueError, match="^out: is read-only"):
        dec(np.zeros(4, np.uint8), out=_read_only(np.zeros(4, np.float32)))


def _read_only(a):
    a.flags.writeable = False
    return a


def test_inputs_the_rules_refuse_are_named_before_out_is_sized():
    """e4m3_encode / e4m3_decode sized a new out from the input's shape before
    the rules read it: a stride-0 view of 2^40 elements allocated terabytes
    (an allocator error naming nothing) before x / codes was refused, and a
    DLPack producer without .shape (the protocol promises none) sized an out
    of shape () that was then refused as `out`. Both now size out as the
    rules read the input (rawkv._args.out_lead)."""
    from support.dlpack import Bare
    with pytest.raises(ValueError, match="^x: must be contiguous"):
        rawkv.fp8.e4m3_encode(torch.zeros(1, dtype=torch.bfloat16).expand(2 ** 40))
    with pytest.raises(ValueError, match="^codes: must be contiguous"):
        rawkv.fp8.e4m3_decode(torch.zeros(1, dtype=torch.uint8).expand(2 ** 40))
    x = torch.linspace(-500, 500, 96).reshape(4, 24)
    codes = rawkv.fp8.e4m3_encode(x)
    got = rawkv.fp8.e4m3_encode(Bare(x))
    assert got.shape == (4, 24) and np.array_equal(np.asarray(got), codes.view(torch.uint8).numpy())
    got = rawkv.fp8.e4m3_decode(Bare(codes.view(torch.uint8)))
    assert got.shape == (4, 24) and np.array_equal(np.asarray(got), rawkv.fp8.e4m3_decode(codes).numpy())


@SETTINGS
@given(seed=seeds, shape=shapes, dt=st.sampled_from(FLOATS + WRONG), lib=libs, layout=layouts,
       special=st.booleans(), out_dt=st.sampled_from([None, "uint8", "float8_e4m3fn", "float32"]))
def test_fp8_encode(seed, shape, dt, lib, layout, special, out_dt):
    x = make(seed, shape, dt, lib, layout, special)
    out = None if out_dt is None else make(seed + 1, shape, out_dt, lib)
    judge(lambda: rawkv.fp8.e4m3_encode(x, out=out), ("x", "out"), lambda: RF.e4m3_encode(host(x)))


@SETTINGS
@given(seed=seeds, shape=shapes, dt=st.sampled_from(BYTES + ("int8", "float32")), lib=libs,
       layout=layouts, dtype=st.sampled_from([None, "float32", "float16", "bfloat16", "float64"]))
def test_fp8_decode(seed, shape, dt, lib, layout, dtype):
    codes = make(seed, shape, dt, lib, layout)
    judge(lambda: rawkv.fp8.e4m3_decode(codes, dtype=dtype), ("codes", "dtype"),
          lambda: RF.round_to_dtype(RF.e4m3_decode(host(codes).astype(np.uint8)), dtype or "float32"))


def test_gpu_bad_arguments_write_nothing(cuda):
    x = torch.randn(64, 2, device="cuda")
    codes = torch.zeros(64, 2, dtype=torch.uint8, device="cuda")

    def u8(*shape, device="cuda"):
        return torch.full(shape, 0xAB, dtype=torch.uint8, device=device)
    # each case gets its own buffer, and that very buffer is checked afterwards
    cases = [
        (lambda out: rawkv.fp8.e4m3_encode(x.t(), out=out), u8(2, 64), ValueError, "^x: must be contiguous"),
        (lambda out: rawkv.fp8.e4m3_encode(x, out=out), u8(10, 2), ValueError, "^out: expected shape"),
        (lambda out: rawkv.fp8.e4m3_encode(x.int(), out=out), u8(64, 2), TypeError, "^x: dtype int32"),
        (lambda out: rawkv.fp8.e4m3_encode(x, out=out), u8(64, 2, device="cpu"), ValueError,
         "^out: is on cpu"),
        (lambda out: rawkv.fp8.e4m3_decode(codes, out=out), u8(64, 2), TypeError, "^out: dtype uint8"),
        (lambda out: rawkv.fp8.e4m3_decode(codes.float(), out=out), u8(64, 2), TypeError,
         "^codes: dtype float32"),
    ]
    for call, out, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call(out)
    torch.cuda.synchronize()
    for _, out, _, msg in cases:
        assert (out == 0xAB).all(), msg


def test_gpu_out_overlapping_the_input_is_refused(cuda):
    """The same on CUDA, on the checked path and on the fast path (a
    combination accepted before)."""
    enc = rawkv.fp8.e4m3_encode
    x = torch.ones(64, device="cuda")
    enc(x, out=torch.empty(64, dtype=torch.uint8, device="cuda"))    # the fast path knows the combination
    for view in (x.view(torch.uint8)[:64], x.view(torch.uint8)[192:]):
        with pytest.raises(ValueError, match="^out: overlaps x in memory"):
            enc(x, out=view)
    assert (x == 1).all()
    c = torch.full((32,), 0x38, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="^out: overlaps codes in memory"):
        rawkv.fp8.e4m3_decode(c[:16], out=c.view(torch.bfloat16))


# ---- launch plan (on the GPU) -----------------------------------------------------------------------
def test_gpu_launch_geometry_is_the_runtimes(cuda, monkeypatch):
    """The checked path and the fast path (out= given, second call) both
    launch rt.grid_stride's geometry: one 16-byte chunk per thread."""
    launches = []
    real = cuda._launch_call       # what every launch on the current device ends in

    def record(fn, grid, block, st, args, shared_mem, stream_ptr, what=None):
        launches.append((grid, block))
        real(fn, grid, block, st, args, shared_mem, stream_ptr, what)
    monkeypatch.setattr(cuda, "_launch_call", record)
    for n in (1, 4096, 4097, 1 << 24):
        x = torch.zeros(n, device="cuda")
        out = torch.empty(n, dtype=torch.uint8, device="cuda")
        rawkv.fp8.e4m3_encode(x, out=out)
        rawkv.fp8.e4m3_encode(x, out=out)
        grid, block = cuda.grid_stride(-(-n // 16), 256)
        assert launches[-2:] == [((grid,), (block,))] * 2, n


@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_fast_path_writes_the_references_bytes_and_is_captured(cuda, offset):
    """The checked path remembers a combination (fp8._ENCODE_FAST /
    _DECODE_FAST); later calls with other tensors of it take the bound
    launch: the reference's bytes, at new addresses each call, aligned or
    not (offset 1: x starts 4 bytes off a 16-byte boundary), and recorded
    into a CUDA graph that replays with new data."""
    n = 4096 + 16

    def tensors():
        x = (torch.randn(n + offset, device="cuda") * 300)[offset:]
        return x, torch.empty(n + offset, dtype=torch.uint8, device="cuda")[offset:], \
            torch.empty(n, dtype=torch.bfloat16, device="cuda")

    def check(x, codes, y):
        want = ref.e4m3_encode(x.cpu().numpy())
        assert np.array_equal(codes.cpu().numpy(), want)
        assert np.array_equal(y.float().cpu().numpy(), RF.round_to_dtype(ref.e4m3_decode(want), "bfloat16"))

    def both(x, codes, y):
        rawkv.fp8.e4m3_encode(x, out=codes)
        rawkv.fp8.e4m3_decode(codes, out=y)
    both(*tensors())
    # (the key holds the pointers' low four bits: x 4 * offset bytes off, codes offset)
    assert any(k[4] == n and k[5] == 4 * offset and k[6] == offset for k in rawkv.fp8._ENCODE_FAST)
    assert any(k[4] == n for k in rawkv.fp8._DECODE_FAST)
    for _ in range(2):
        t = tensors()
        both(*t)
        check(*t)
    x, codes, y = tensors()
    both(x, codes, y)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        both(x, codes, y)
    x.copy_(torch.randn(n, device="cuda") * 3)
    g.replay()
    torch.cuda.synchronize()
    check(x, codes, y)


# ---- GPU: bit for bit against the reference ---------------------------------------------------------
ALL_FP16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _gpu_encode(x_np, dtype):
    return rawkv.fp8.e4m3_encode(torch.from_numpy(x_np).to(dtype).cuda()).view(torch.uint8).cpu().numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_encode_exhaustive(cuda, dtype):
    src = ALL_FP16 if dtype == "float16" else ALL_BF16
    tdtype = getattr(torch, dtype)
    got = _gpu_encode(src, tdtype)
    assert np.array_equal(got, ref.e4m3_encode(src)), np.flatnonzero(got != ref.e4m3_encode(src))[:10]


def test_gpu_encode_random_float32_and_specials(cuda, rng):
    x = (rng.standard_normal(1 << 20) * np.exp2(rng.integers(-20, 12, 1 << 20))).astype(np.float32)
    x[:8] = [np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 464.0, -463.99]
    assert np.array_equal(_gpu_encode(x, torch.float32), ref.e4m3_encode(x))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n, offset", [(8448, 0), (8453, 0), (8453, 3)],
                         ids=["vector", "vector+tail", "unaligned"])
def test_gpu_decode_all_bytes(cuda, dtype, n, offset):
    # 8448 = 528 chunks of 16; 8453 leaves a 5-code tail; a 3-byte offset
    # makes the codes unaligned, which runs the scalar kernel
    codes = np.resize(np.arange(256, dtype=np.uint8), n + offset)
    view = torch.from_numpy(codes).cuda()[offset:]
    got = rawkv.fp8.e4m3_decode(view, dtype=getattr(torch, dtype)).float().cpu().numpy()
    assert np.array_equal(got, ref.e4m3_decode(codes[offset:]), equal_nan=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_decode_many_grid_strides(cuda, rng, dtype):
    # 2^24 + 13 codes: more units than the grid has threads (the runtime caps
    # it at two waves), so every thread runs several grid-stride iterations,
    # the last one partial, then a 5-code (float32: 1-code) tail.
    codes = rng.integers(0, 256, (1 << 24) + 13, dtype=np.uint8)
    got = rawkv.fp8.e4m3_decode(torch.from_numpy(codes).cuda(), dtype=getattr(torch, dtype))
    assert np.array_equal(got.float().cpu().numpy(), ref.e4m3_decode(codes), equal_nan=True)


@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 4097])
def test_gpu_views_and_tails(cuda, rng, n, offset):
    base = torch.from_numpy(rng.standard_normal(n + offset).astype(np.float32)).cuda()
    x = base[offset:]              # offset 3 = 12 bytes: scalar kernel; 0: vector kernel + tail
    got = rawkv.fp8.e4m3_encode(x).view(torch.uint8).cpu().numpy()
    assert np.array_equal(got, ref.e4m3_encode(x.cpu().numpy()))


def test_gpu_cupy_input_through_dlpack(cuda):
    cupy = pytest.importorskip("cupy")
    x = cupy.asarray(np.linspace(-500, 500, 1000, dtype=np.float32))
    got = rawkv.fp8.e4m3_encode(x).view(torch.uint8).cpu().numpy()
    assert np.array_equal(got, ref.e4m3_encode(cupy.asnumpy(x)))


# ---- the operator -----------------------------------------------------------------------------------
def test_operator_writes_what_the_public_op_returns(rng):
    x = torch.from_numpy(rng.standard_normal(100).astype(np.float32))
    out = torch.empty(100, dtype=torch.uint8)
    torch.ops.rawkv.e4m3_encode(x, out)
    assert torch.equal(out, rawkv.fp8.e4m3_encode(x).view(torch.uint8))
