"""The packed-parameter launchers (rawkv._launch): argument layout and
fallbacks on the CPU, identical results and graph capture on a GPU."""
import ctypes
import struct
import types

import numpy as np
import pytest

from rawkv import _launch


def test_layout_packs_ints_as_int64_and_floats_as_double():
    st, floats = _launch.layout((1 << 40, -3, 2.5, True))
    assert st.format == "<qqdq" and floats == (2,)
    assert _launch.layout((np.int32(1),)) is None           # CuPy decides its width
    assert _launch.layout(tuple(range(_launch.MAX_ARGS + 1))) is None
    assert _launch.layout(tuple(range(40))) is not None     # rkv_kv_compress: 40 parameters


def test_dim3():
    assert _launch.dim3(7) == (7, 1, 1)
    assert _launch.dim3((2, 3)) == (2, 3, 1)
    with pytest.raises(ValueError, match="grid/block"):
        _launch.dim3((1, 1, 1, 1))


class _Fn:
    ptr = 0x1234


class _Recorder(_launch.PackedLauncher):
    """Reads back what the driver would read: the void* array's slots."""
    name = "test"

    def __init__(self):
        self.calls, self.fallbacks = [], []
        super().__init__(lambda *a: self.fallbacks.append(a))

        def raw(f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
            ptrs = (ctypes.c_void_p * 4).from_address(params)
            vals = [ctypes.c_uint64.from_address(p).value for p in ptrs]
            self.calls.append(((f, gx, gy, gz, bx, by, bz, shm, stream, extra), vals))
            return 0
        self._raw = raw


def _u64(v):
    return struct.unpack("<Q", struct.pack("<q", v))[0] if isinstance(v, int) else \
        struct.unpack("<Q", struct.pack("<d", v))[0]


def test_packed_launcher_passes_values_geometry_and_stream():
    r, fn = _Recorder(), _Fn()
    r(fn, (5,), (256,), (1 << 40, 7, -1), 0, 99)
    r(fn, (2, 3), 64, (8, 9, 10), 16, 98)
    (geo0, v0), (geo1, v1) = r.calls
    assert geo0 == (0x1234, 5, 1, 1, 256, 1, 1, 0, 99, 0)
    assert v0[:3] == [_u64(1 << 40), 7, _u64(-1)]
    assert geo1 == (0x1234, 2, 3, 1, 64, 1, 1, 16, 98, 0) and v1[:3] == [8, 9, 10]


def test_packed_launcher_relayouts_when_types_change():
    r, fn = _Recorder(), _Fn()
    r(fn, (1,), (32,), (1, 2.0), 0, 0)
    r(fn, (1,), (32,), (1, 2), 0, 0)        # int where a double was: int64 slot
    r(fn, (1,), (32,), (1.5, 2), 0, 0)      # float where an int was: double slot
    assert [v[:2] for _, v in r.calls] == [[1, _u64(2.0)], [1, 2], [_u64(1.5), 2]]
    assert not r.fallbacks


def test_packed_launcher_falls_back_to_cupy_for_other_arguments():
    r, fn = _Recorder(), _Fn()
    r(fn, (1,), (32,), (np.int32(3),), 0, 0)
    r(fn, (1,), (32,), (1 << 64,), 0, 0)     # beyond int64
    assert len(r.fallbacks) == 2 and not r.calls


def test_unknown_launcher_is_refused():
    with pytest.raises(ValueError, match="launcher"):
        _launch.make("nope", None)


def test_memset_makes_its_device_current_like_launch():
    """Runtime.memset and Runtime.launch both run with the runtime's device
    current (restoring the caller's), on the stream given."""
    from rawkv.runtime import Runtime
    calls = []
    rt = Runtime.__new__(Runtime)            # no GPU: only the attributes these two use
    rt.device_index = 1
    rt._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        setDevice=lambda d: calls.append(("setDevice", d)),
        memsetAsync=lambda *a: calls.append(("memsetAsync", *a)))))
    rt._launcher = lambda fn, grid, block, args, shm, stream: calls.append(("launch", stream))
    rt._launch_call, rt._direct = rt._launcher, False
    for current in (1, 0):
        rt._get_device = lambda: current
        calls.clear()
        rt.memset(0x1000, 0, 64, stream=77)
        rt.launch(None, (1,), (32,), (), stream=77)
        on, off = ([], []) if current == 1 else ([("setDevice", 1)], [("setDevice", 0)])
        assert calls == [*on, ("memsetAsync", 0x1000, 0, 64, 77), *off, *on, ("launch", 77), *off]


# ---- GPU ---------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", _launch.LAUNCHERS)
def test_launchers_same_bits_eager_and_in_a_graph(cuda, rng, launcher):
    import torch
    import rawkv
    rt = cuda
    before = rt.launcher
    rawkv.warmup()
    try:
        rt.set_launcher(launcher)
        x = torch.from_numpy(rng.standard_normal(4099).astype(np.float32)).cuda()
        want = rawkv.fp8.e4m3_encode(x.cpu()).view(torch.uint8)
        for view in (x, x[1:]):              # vector and unaligned kernels
            out = torch.empty(view.shape, dtype=torch.uint8, device="cuda")
            rawkv.fp8.e4m3_encode(view, out=out)
            assert torch.equal(out.cpu(), want[-view.numel():])
        out = torch.zeros(x.shape, dtype=torch.uint8, device="cuda")
        back = torch.empty(x.shape, dtype=torch.float32, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            rawkv.fp8.e4m3_encode(x, out=out)
            rawkv.fp8.e4m3_decode(out, out=back)
        assert not out.any()                   # captured, not run
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), want)
        assert torch.equal(back.cpu(), rawkv.fp8.e4m3_decode(want, dtype=torch.float32))
    finally:
        rt.set_launcher(before)


@pytest.mark.parametrize("launcher", _launch.LAUNCHERS)
def test_launchers_take_a_double_scalar(cuda, rng, launcher):
    """nvfp4 'given' passes gs as a double: the packed launchers put it in a double slot."""
    import torch
    import rawkv
    rt = cuda
    before = rt.launcher
    x = torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).cuda()
    ref = rawkv.nvfp4.quantize(x.cpu(), scope="given", gs=0.37)
    try:
        rt.set_launcher(launcher)
        got = [t.cpu() for t in rawkv.nvfp4.quantize(x, scope="given", gs=0.37)]
    finally:
        rt.set_launcher(before)
    for a, b in zip(ref, got):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b.to(a.dtype))
