"""An op given stream=s runs the CUDA work its body does beside its kernels
on s (rawkv._args.stream_current, applied by the op wrapper): a DLPack
import of another library's array, whose producer orders its pending writes
before the consumer's current stream, and the copies the rules make of
views. On torch's current stream that work ran unordered with the kernels
on s, which read an array or a copy before it was written. (The GEMM's
copies on s: tests/gemm/test_arguments.py,
test_a_view_the_rules_copy_is_copied_on_the_stream_argument.)"""
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402


def _pending_write(cp, producer, x, new):
    """On CuPy stream `producer`: tens of milliseconds of sleep, then x = new."""
    xt = torch.from_dlpack(x)                    # (a view made before the producer's work)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(producer.ptr)):
        torch.cuda._sleep(100_000_000)
        xt.copy_(new)


@pytest.mark.parametrize("stream_kind", ["torch", "cupy"])
def test_a_dlpack_input_is_read_after_its_producers_writes_on_the_op_stream(cuda, stream_kind):
    """A CuPy array whose values CuPy's current stream is still writing,
    given to an op with stream=s (a torch or a CuPy stream): the import
    makes s wait for that work, so the op encodes the written values (it
    encoded zeros: the import made torch's current stream wait, not s)."""
    cp = pytest.importorskip("cupy")
    n = 1 << 16
    new = torch.randn(n, device="cuda")
    want = rawkv.fp8.e4m3_encode(new)
    x = cp.zeros(n, dtype=cp.float32)
    rawkv.fp8.e4m3_encode(x)                     # (compiled before the sleep)
    producer = cp.cuda.Stream(non_blocking=True)
    s = torch.cuda.Stream() if stream_kind == "torch" else cp.cuda.Stream(non_blocking=True)
    _pending_write(cp, producer, x, new)
    with producer:                               # CuPy's current stream: the one still writing x
        got = rawkv.fp8.e4m3_encode(x, stream=s)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_an_int_stream_handle_leaves_torchs_current_stream_alone(cuda):
    """An int handle names no device: the body runs with torch's current
    stream as it is (the caller orders the work around it)."""
    s = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    seen = []
    from rawkv import _args as A
    with A.stream_current(s.cuda_stream):
        seen.append(torch.cuda.current_stream())
    with A.stream_current(s):
        seen.append(torch.cuda.current_stream())
    assert seen[0] == cur and seen[1] == s and torch.cuda.current_stream() == cur


# ---- under torch.compile ---------------------------------------------------------------------
def _compiled_error(fn, fullgraph):
    torch._dynamo.reset()
    with pytest.raises(Exception) as ei:
        torch.compile(fn, fullgraph=fullgraph, backend="eager")()
    return ei.value


@pytest.mark.parametrize("stream", [True, "s", 1.5], ids=["bool", "str", "float"])
@pytest.mark.parametrize("op", ["fixed", "variadic"])
def test_a_compiled_op_refuses_a_stream_the_eager_op_refuses(op, stream):
    """The operator has no stream argument: compiled, an op runs on torch's
    current stream whatever stream= was (docs/kvcache.md), but a value the
    eager op refuses as a stream (a bool, a string, a float) is refused
    compiled too. The compiled call took it and ran."""
    import rawkv.kvcache as kc
    if op == "fixed":
        x = torch.ones(32)
        call = lambda: rawkv.fp8.e4m3_encode(x, stream=stream)         # noqa: E731
    else:
        pool = kc.PagedKVPool("hca", 8, 2, 2, 4, layout="rawkv", device="cpu")
        slot = pool.add_request()
        blocks = torch.tensor([0], dtype=torch.int32)
        slots = torch.tensor([slot], dtype=torch.int32)
        call = lambda: kc.assign_pages(pool, slots, blocks, stream=stream)    # noqa: E731
    with pytest.raises(TypeError, match="^stream: expected") as eager:
        call()
    assert str(_compiled_error(call, False)) == str(eager.value)
    assert str(eager.value) in str(_compiled_error(call, True))


def test_gpu_a_compiled_op_takes_a_torch_stream(cuda):
    """A torch stream given under torch.compile is not looked into (the
    check above leaves it to dynamo): fullgraph compiles, the op runs on
    torch's current stream, the same bits as eagerly."""
    x = torch.randn(4096, device="cuda")
    s = torch.cuda.Stream()
    torch._dynamo.reset()
    got = torch.compile(lambda x: rawkv.fp8.e4m3_encode(x, stream=s), fullgraph=True, backend="eager")(x)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), rawkv.fp8.e4m3_encode(x).view(torch.uint8))
