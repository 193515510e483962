"""The launcher (rawkv._launch): slots packed by the declaration's C types,
geometry and stream on the CPU; identical results and graph capture on a GPU."""
import ctypes
import struct
import types

import numpy as np
import pytest

from rawkv import _launch, kernels


def test_dim3():
    assert _launch.dim3(7) == (7, 1, 1)
    assert _launch.dim3((2, 3)) == (2, 3, 1)
    with pytest.raises(ValueError, match="grid/block"):
        _launch.dim3((1, 1, 1, 1))


class _Fn:
    ptr = 0x1234


class _Recorder(_launch.Launcher):
    """Reads back what the driver would read: the void* array's slots."""

    def __init__(self):
        self.calls = []

        def raw(f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
            ptrs = (ctypes.c_void_p * 4).from_address(params)
            vals = [ctypes.c_uint64.from_address(p).value for p in ptrs]
            self.calls.append(((f, gx, gy, gz, bx, by, bz, shm, stream, extra), vals))
            return 0
        super().__init__(raw)


def test_launcher_passes_slots_geometry_and_stream():
    r, fn = _Recorder(), _Fn()
    st = struct.Struct("<qi4xd")
    r(fn, (5,), (256,), st, (1 << 40, -7, 2.5), 0, 99)
    r(fn, (2, 3), 64, st, (8, 9, 10.0), 16, 98)
    (geo0, v0), (geo1, v1) = r.calls
    assert geo0 == (0x1234, 5, 1, 1, 256, 1, 1, 0, 99, 0)
    assert v0[0] == 1 << 40 and v0[1] & 0xFFFFFFFF == struct.unpack("<I", struct.pack("<i", -7))[0]
    assert v0[2] == struct.unpack("<Q", struct.pack("<d", 2.5))[0]
    assert geo1 == (0x1234, 2, 3, 1, 64, 1, 1, 16, 98, 0) and v1[:2] == [8, 9]


def test_launcher_names_an_argument_its_c_type_cannot_take():
    f = kernels.KernelFile("test_launch_names.cu", source="__global__ void k(const float* p, long long n) {}")
    try:
        inst = f.kernel("k").instance()
        r = _Recorder()
        with pytest.raises(TypeError, match=r"k: argument n \(long long\) cannot take 1.5"):
            r(_Fn(), (1,), (32,), inst.struct, (0, 1.5), 0, 0, inst)
        with pytest.raises(TypeError, match=r"argument n \(long long\) cannot take 18446744073709551616"):
            r(_Fn(), (1,), (32,), inst.struct, (0, 1 << 64), 0, 0, inst)
        assert not r.calls
    finally:
        kernels._decl._FILES.pop("test_launch_names.cu")


class _BoundRuntime:
    """What bound_launch reads of a Runtime: its launcher, the plain launch
    call, its device and torch's current stream; rt.launch records."""
    device_index = 0

    def __init__(self):
        self._launcher = _Recorder()
        self._launch_call = self._plain_launch_call = self._launcher.__call__
        self.current, self.stream, self.fallbacks = 0, 55, []
        self._get_device = lambda: self.current
        self._current_stream_ptr = lambda: self.stream

    def launch(self, fn, grid, block, st, args, stream=None, shared_mem=0, what=None):
        self.fallbacks.append((grid, block, args, stream, shared_mem, what))


def test_bound_launch_goes_straight_to_the_driver_with_fixed_geometry():
    rt, fn, st = _BoundRuntime(), _Fn(), struct.Struct("<qqq")
    go = _launch.bound_launch(rt, fn, (6,), (256,), st, 32, "what")
    go(1 << 40, 3, 4096)
    rt.stream = 56                     # torch's current stream is read at each call
    go(7, 8, 9)
    (geo0, v0), (geo1, v1) = rt._launcher.calls
    assert geo0 == (0x1234, 6, 1, 1, 256, 1, 1, 32, 55, 0) and v0[:3] == [1 << 40, 3, 4096]
    assert geo1[8] == 56 and v1[:3] == [7, 8, 9] and not rt.fallbacks


def test_bound_launch_takes_rt_launch_for_another_device_or_a_spy():
    """Another device current, or rt._launch_call replaced (a recording, a
    test's spy): the launch goes through rt.launch with the same values."""
    rt, st = _BoundRuntime(), struct.Struct("<qq")
    go = _launch.bound_launch(rt, _Fn(), (2, 3), 64, st, 0, "what")
    rt.current = 1
    go(1, 2)
    rt.current = 0
    rt._launch_call = lambda *a: None
    go(3, 4)
    assert not rt._launcher.calls
    assert rt.fallbacks == [((2, 3), 64, (1, 2), None, 0, "what"), ((2, 3), 64, (3, 4), None, 0, "what")]


def test_bound_launch_names_an_argument_and_refuses_struct_parameters():
    f = kernels.KernelFile("test_bound_names.cu", source="__global__ void k(const float* p, long long n) {}")
    try:
        inst = f.kernel("k").instance()
        rt = _BoundRuntime()
        go = _launch.bound_launch(rt, _Fn(), (1,), (32,), inst.struct, 0, inst)
        with pytest.raises(TypeError, match=r"k: argument n \(long long\) cannot take 1.5"):
            go(0, 1.5)
        assert not rt._launcher.calls
        with pytest.raises(TypeError, match="struct parameter"):
            _launch.bound_launch(rt, _Fn(), (1,), (32,), _launch.WideStruct("<qq", (0, 1)), 0, inst)
    finally:
        kernels._decl._FILES.pop("test_bound_names.cu")


def test_memset_and_launch_make_their_device_current():
    """Runtime.memset and Runtime.launch both run with the runtime's device
    current, on the stream given, and give the caller's device back the way
    torch.cuda.device does (no context is created on a device that had none)."""
    from rawkv.runtime import Runtime
    calls = []
    rt = Runtime.__new__(Runtime)            # no GPU: only the attributes these two use
    rt.device_index = 1
    rt._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        memsetAsync=lambda *a: calls.append(("memsetAsync", *a)))))
    rt._launcher = rt._launch_call = lambda fn, grid, block, st, args, shm, stream, what: calls.append(("launch", stream))
    for current in (1, 0):
        rt._get_device = lambda: current
        rt._exchange_device = lambda d: calls.append(("exchange", d)) or current
        rt._maybe_exchange_device = lambda d: calls.append(("maybe_exchange", d))
        calls.clear()
        rt.memset(0x1000, 0, 64, stream=77)
        rt.launch(None, (1,), (32,), struct.Struct("<"), (), stream=77)
        on, off = ([], []) if current == 1 else ([("exchange", 1)], [("maybe_exchange", 0)])
        assert calls == [*on, ("memsetAsync", 0x1000, 0, 64, 77), *off, *on, ("launch", 77), *off]


def test_a_stream_of_another_device_is_refused_before_anything_runs():
    """stream= a torch stream (device_index) or CuPy stream (device_id) of
    another device than the op's: a ValueError naming stream before any
    memset or launch (a kernel launched on another device's stream fails at
    the driver, after a plan's memsets ran; a Fill or state_seed's torch
    work went to the tensors' device's current stream). The op's device's
    streams, CuPy's null stream (device_id -1) and int handles are taken."""
    import torch

    from rawkv._plan import Launch, Memset
    from rawkv.runtime import Runtime
    calls = []
    rt = Runtime.__new__(Runtime)            # no GPU: only the attributes these use
    rt.device_index, rt._torch = 1, torch
    rt._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        memsetAsync=lambda *a: calls.append(("memsetAsync", *a)))))
    rt._launcher = rt._launch_call = lambda fn, grid, block, st, args, shm, stream, what: calls.append(("launch", stream))
    rt._get_device = lambda: 1

    class K:                                  # a plan's kernel instance: launches through rt.launch
        smem = 0

        @staticmethod
        def launch(rt, grid, block, stream=None, shared_mem=0):
            rt.launch(None, grid, block, struct.Struct("<"), (), stream, shared_mem)
    dst = types.SimpleNamespace(data_ptr=lambda: 0x1000)
    plan = [Memset(dst, 4), Launch(K, (1,), (32,), {})]
    for other in (types.SimpleNamespace(cuda_stream=77, device_index=0),     # torch's
                  types.SimpleNamespace(ptr=77, device_id=2)):               # CuPy's
        d = getattr(other, "device_index", getattr(other, "device_id", None))
        with pytest.raises(ValueError, match=rf"^stream: is a stream of cuda:{d} but the op runs on cuda:1"):
            rt.run(plan, stream=other)
        for call in (lambda: rt.memset(0x1000, 0, 4, stream=other), lambda: rt.torch_stream(other),
                     lambda: rt.launch(None, (1,), (32,), struct.Struct("<"), (), stream=other)):
            with pytest.raises(ValueError, match="^stream: "):
                call()
        assert not calls
    for mine in (types.SimpleNamespace(cuda_stream=78, device_index=1), types.SimpleNamespace(ptr=78, device_id=1),
                 types.SimpleNamespace(ptr=0, device_id=-1), 78):
        calls.clear()
        rt.run(plan, stream=mine)
        want = 0 if getattr(mine, "device_id", None) == -1 else 78
        assert calls == [("memsetAsync", 0x1000, 0, 4, want), ("launch", want)]


# ---- GPU ---------------------------------------------------------------------------
def test_launch_same_bits_eager_and_in_a_graph(cuda, rng):
    import torch
    import rawkv
    rawkv.warmup()
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


def test_launch_takes_a_double_scalar(cuda, rng):
    """nvfp4 'given' passes gs as a double: the declaration puts it in a double slot."""
    import torch
    import rawkv
    x = torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).cuda()
    ref = rawkv.nvfp4.quantize(x.cpu(), scope="given", gs=0.37)
    got = [t.cpu() for t in rawkv.nvfp4.quantize(x, scope="given", gs=0.37)]
    for a, b in zip(ref, got):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b.to(a.dtype))


def test_pdl_instances_take_the_programmatic_launch_the_rest_the_plain_one():
    # the mma.sync GEMM is declared `pdl` (it waits with griddepcontrol.wait
    # before it reads anything but its weights); fp8's encoder is not
    plain, pdl = [], []
    launcher = _launch.Launcher(raw=lambda *a: plain.append(a) or 0, pdl=lambda *a: pdl.append(a) or 0)
    gemm = kernels.gemm_fp4.GEMM.instance(*kernels.gemm_fp4.GEMM._instance_args[0])
    enc = kernels.fp8.ENCODE.instance("float32", True)
    assert gemm.pdl and not enc.pdl
    assert not kernels.gemm_fp4.GEMM_SM90.instance(*kernels.gemm_fp4.GEMM_SM90._instance_args[0]).pdl
    launcher(_Fn(), (3, 2, 1), (128,), enc.struct, (0, 0, 5), 0, 77, enc)
    assert len(plain) == 1 and not pdl
    zeros = tuple(0 for _ in range(gemm.struct.size // 8))
    launcher(_Fn(), (3, 2, 1), (128,), gemm.struct, zeros, 512, 77, gemm)
    assert len(pdl) == 1 and pdl[0][:9] == (0x1234, 3, 2, 1, 128, 1, 1, 512, 77)
    # no programmatic launch given (not sm_90+, RAWKV_PDL=0, no cuLaunchKernelEx): the plain one
    only = _launch.Launcher(raw=lambda *a: plain.append(a) or 0)
    only(_Fn(), (3, 2, 1), (128,), gemm.struct, zeros, 512, 77, gemm)
    assert len(plain) == 2 and len(pdl) == 1
    # a plan's per-call choice: the same function, launched the plain way
    # (Kernel.instance(..., pdl=False)); True or None: as declared
    w8 = kernels.gemm_w4a8.GEMM_MMA
    targs = w8._instance_args[0]
    sibling = w8.instance(*targs, pdl=False)
    assert w8.instance(*targs).pdl and w8.instance(*targs, pdl=True) is w8.instance(*targs)
    assert not sibling.pdl and sibling is w8.instance(*targs, pdl=False) and sibling.key == w8.instance(*targs).key
    launcher(_Fn(), (3, 2, 1), (128,), sibling.struct, zeros[:sibling.struct.size // 8], 0, 77, sibling)
    assert len(plain) == 3 and len(pdl) == 1
    assert not enc.kernel.instance("float32", True, pdl=False).pdl and enc.kernel.instance("float32", True) is enc


def test_pdl_launch_config_is_the_driver_struct():
    # CUlaunchConfig (cuda.h): 7 unsigned ints, then the stream handle at
    # 32, the attribute pointer at 40, their count at 48; CUlaunchAttribute:
    # the id, 4 bytes of padding, a 64-byte value union
    c = _launch._LaunchConfig
    assert ctypes.sizeof(c) == 56 == _launch._CONFIG_PACK.size
    assert (c.hStream.offset, c.attrs.offset, c.numAttrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(_launch._LaunchAttribute) == 72 and _launch._LaunchAttribute.value.offset == 8
    seen = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    def fake(cfg, f, params, extra):
        conf = _launch._LaunchConfig.from_address(cfg)
        attr = conf.attrs[0]
        seen.append(((conf.gridDimX, conf.gridDimY, conf.gridDimZ, conf.blockDimX, conf.blockDimY,
                      conf.blockDimZ, conf.sharedMemBytes, conf.hStream, conf.numAttrs), attr.id,
                     attr.value[0], f, params, extra))
        return 0
    cb = proto(fake)
    launch = _launch.PdlLaunch(types.SimpleNamespace(cuLaunchKernelEx=cb))
    assert launch(0x1234, 4, 5, 6, 128, 1, 1, 1024, 0x99, 0x5678, 0) == 0
    assert launch(0x1234, 7, 1, 1, 32, 2, 1, 0, 0x98, 0x5678, 0) == 0        # (the same config, rewritten)
    assert seen == [((4, 5, 6, 128, 1, 1, 1024, 0x99, 1), 6, 1, 0x1234, 0x5678, None),
                    ((7, 1, 1, 32, 2, 1, 0, 0x98, 1), 6, 1, 0x1234, 0x5678, None)]


def test_no_driver_means_no_programmatic_launch(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(_launch.ctypes, "CDLL", missing)
    assert _launch.pdl_launch() is None


@pytest.mark.parametrize("cupy_14", [True, False])
def test_cupy_stream_of_a_runtime_is_a_stream_of_its_device(cupy_14):
    """Runtime.stream() / cupy_stream(ptr) wrap a handle of this runtime's
    device. CuPy's Stream.from_external takes the device from the current
    one (ExternalStream from its argument, default -1: unknown), so
    warmup(1) or rt.stream() on cuda:1 with cuda:0 current gave a CuPy
    stream of device 0, kept for that handle, which CuPy then refuses
    ('with s:', s.use()) or uses on the wrong device."""
    from rawkv.runtime import Runtime
    current = [0]

    class Stream:
        @staticmethod
        def from_external(obj):
            return types.SimpleNamespace(ptr=obj.__cuda_stream__()[1], device_id=current[0])

    def external(ptr, device_id=-1):
        return types.SimpleNamespace(ptr=ptr, device_id=device_id)
    cuda = types.SimpleNamespace(Stream=Stream if cupy_14 else types.SimpleNamespace(), ExternalStream=external)
    rt = Runtime.__new__(Runtime)            # no GPU: only the attributes cupy_stream uses
    rt.device_index, rt._streams, rt._cupy = 1, {}, types.SimpleNamespace(cuda=cuda)

    def exchange(d):
        prev, current[0] = current[0], d
        return prev
    rt._exchange_device = rt._maybe_exchange_device = exchange
    s = rt.cupy_stream(0x77)
    assert (s.ptr, s.device_id) == (0x77, 1) and current == [0]       # the caller's device back
    assert rt.cupy_stream(0x77) is s


def _runtime_on_a_stand_in(monkeypatch, cc=(9, 0), driver=12080):
    """A Runtime created through its __init__ on stand-ins of CuPy and torch
    (a device of compute capability `cc`, a driver of version `driver`): its
    launcher records the programmatic launch it is given."""
    from rawkv import runtime
    props = {"name": b"stand-in", "major": cc[0], "minor": cc[1], "multiProcessorCount": 132,
             "maxThreadsPerMultiProcessor": 2048, "l2CacheSize": 50 << 20}
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
        getDeviceProperties=lambda i: props, getDevice=lambda: 0, setDevice=lambda d: None,
        driverGetVersion=lambda: driver)))
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(),
                                  _C=types.SimpleNamespace(_cuda_getCurrentRawStream=lambda i: 0))
    monkeypatch.setattr(runtime, "_gpu_stack", lambda: (cupy, torch))
    monkeypatch.setattr(_launch, "pdl_launch", lambda: "programmatic")

    class Launcher:
        def __init__(self, pdl=None):
            self.pdl = pdl

        def __call__(self, *a):
            raise AssertionError("no launch here")
    monkeypatch.setattr(_launch, "Launcher", Launcher)
    return runtime.Runtime(0)


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("", True), ("true", True), ("On", True),
                                      ("0", False), (" 0 ", False), ("false", False), ("OFF", False),
                                      ("no", False)])
def test_rawkv_pdl_is_read_as_a_switch(monkeypatch, value, on):
    """RAWKV_PDL=0 turns the programmatic launch off (docs/runtime.md); so
    do false / off / no, any case, spaces around. Only "0" exactly did:
    RAWKV_PDL=off or false left it on, silently."""
    if value is None:
        monkeypatch.delenv("RAWKV_PDL", raising=False)
    else:
        monkeypatch.setenv("RAWKV_PDL", value)
    assert _runtime_on_a_stand_in(monkeypatch)._launcher.pdl == ("programmatic" if on else None)
    # the device and the driver decide as before
    assert _runtime_on_a_stand_in(monkeypatch, cc=(8, 0))._launcher.pdl is None
    assert _runtime_on_a_stand_in(monkeypatch, driver=12020)._launcher.pdl is None


@pytest.mark.parametrize("value", ["2", "maybe", "disable"])
def test_rawkv_pdl_of_another_value_is_refused_by_name(monkeypatch, value):
    """A value that is no switch is a ValueError naming RAWKV_PDL (as
    RAWKV_COMPILE_JOBS's), on any device, not a launch mode chosen for it."""
    monkeypatch.setenv("RAWKV_PDL", value)
    for cc in ((9, 0), (8, 0)):
        with pytest.raises(ValueError, match=rf"^RAWKV_PDL: .*got {value!r}"):
            _runtime_on_a_stand_in(monkeypatch, cc=cc)


def test_a_failed_launch_names_its_kernel_geometry_and_what_is_out_of_range():
    """A launch the driver refuses (a grid's y past 65535, a zero
    dimension, a block of more than 1024 threads) said 'cuLaunchKernel
    failed: error 1' (cuLaunchKernelEx) or CuPy's bare 'CUDA_ERROR_INVALID_VALUE:
    invalid argument': no kernel, no geometry. It is a LaunchError naming
    both and the dimension out of range, the driver's error kept as its cause."""
    enc = kernels.fp8.ENCODE.instance("float32", True)
    gemm = kernels.gemm_fp4.GEMM.instance(*kernels.gemm_fp4.GEMM._instance_args[0])
    zeros = tuple(0 for _ in range(gemm.struct.size // 8))

    def cupy_raw(*a):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE: invalid argument")
    launcher = _launch.Launcher(raw=cupy_raw, pdl=lambda *a: 1)
    with pytest.raises(_launch.LaunchError, match=r"rkv_e4m3_encode<float, true>.*grid \(3, 70000, 1\), block "
                       r"\(128, 1, 1\).*CUDA_ERROR_INVALID_VALUE.*grid y 70000 is outside 1\.\.65535") as e:
        launcher(_Fn(), (3, 70000, 1), (128,), enc.struct, (0, 0, 5), 0, 77, enc)
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(_launch.LaunchError, match=r"grid \(0, 1, 1\).*grid x 0 is outside 1\.\."):
        launcher(_Fn(), (0,), (128,), enc.struct, (0, 0, 5), 0, 77, enc)
    with pytest.raises(_launch.LaunchError, match=rf"{gemm.kernel.name}<.*block \(2048, 1, 1\).*error 1.*"
                       r"block of 2048 threads is more than 1024"):
        launcher(_Fn(), (3, 2, 1), (2048,), gemm.struct, zeros, 0, 77, gemm)
    rt = _BoundRuntime()
    rt._launcher = _launch.Launcher(raw=cupy_raw)
    rt._launch_call = rt._plain_launch_call = rt._launcher.__call__
    go = _launch.bound_launch(rt, _Fn(), (1, 1, 65536), (32,), enc.struct, 0, enc)
    with pytest.raises(_launch.LaunchError, match=r"rkv_e4m3_encode<float, true>.*grid z 65536 is outside"):
        go(0, 0, 5)
