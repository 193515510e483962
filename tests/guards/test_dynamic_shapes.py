"""The public ops under torch.compile with dynamic shapes: every family's
compiled step (tests/support/library.py's STEPS) traces with
dynamic=True, and the public functions compiled once with the token /
batch dimension marked dynamic (torch._dynamo.mark_dynamic) serve every
later count without a new compile, giving the eager bits, shapes, dtypes
and strides. Found by a review (helper 97): dynamic=True made a float a
SymFloat, which the RoPE check's math.isfinite cannot take (a graph break
in every compress_prefill / compress_decode); unswizzle_scales' shape
check specialized the rows of sf.shape (one compile per token count, and
a ConstraintViolationError under mark_dynamic). The KV-cache decode steps
also compile with inductor and dynamic=True (helper 99: the gathers sized
a new out with the pool's head_dim, a host int, which failed inductor's
generated code; docs/engines.md)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv.library  # noqa: E402,F401
from support.library import same_bits, steps  # noqa: E402


@pytest.mark.parametrize("name,make", steps(), ids=[n for n, _ in steps()])
def test_steps_compile_with_dynamic_shapes(rng, name, make):
    torch._dynamo.reset()
    step, args = make(rng, "cpu")
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert same_bits(compiled(*args), step(*args))


def _t(rng, shape, dtype=torch.float32, lo=None):
    a = rng.standard_normal(shape).astype(np.float32)
    return torch.from_numpy(np.abs(a) + lo if lo is not None else a).to(dtype)


def _ints(rng, shape, hi, lo=0, dtype=torch.int32):
    return torch.from_numpy(rng.integers(lo, hi, shape)).to(dtype)


def _cases():
    """{name: (function, make(rng, M) -> its arguments)}: dimension 0 of each
    tensor argument of size M is the token (row, batch) dimension."""
    nv, fu, f8, kvc = rawkv.nvfp4, rawkv.fused, rawkv.fp8, rawkv.kvcache
    bf = torch.bfloat16

    def swizzle(x):
        q, sf, gs = nv.quantize(x, scope="row")
        sw = nv.swizzle_scales(sf)
        sf2 = nv.unswizzle_scales(sw, sf.shape)
        return sw, sf2, nv.dequantize(q, sf2, gs)

    w = rawkv.gemm.Fp4Weight.from_float(torch.linspace(-2, 2, 3 * 24 * 64).reshape(3, 24, 64))

    def gemm(x):
        return rawkv.gemm.grouped_linear(x, w)

    def store_gather(e, s):
        c = kvc.new_layout_cache("model1", 8, 4, device="cpu")
        kvc.model1_store(c, e, s, page_size=4)
        return c, kvc.model1_gather(c, s, page_size=4)
    return {
        "fp8": (lambda x: f8.dequantize_blocks(*f8.quantize_blocks(x, block=32, scale_format="ue8m0"), block=32),
                lambda r, M: (_t(r, (M, 96)),)),
        "nvfp4_swizzle": (swizzle, lambda r, M: (_t(r, (M, 64), bf),)),
        "nvfp4_gather": (lambda i, x: nv.gather(*nv.quantize(x), i), lambda r, M: (_ints(r, (M,), 16), _t(r, (16, 64)))),
        "rmsnorm": (lambda x, w: fu.rmsnorm_quantize(x, w), lambda r, M: (_t(r, (M, 128), bf), _t(r, (128,), lo=0.5))),
        "mhc_fp8": (lambda X, m, w: fu.mhc_rmsnorm_quantize_fp8(X, m, w, block=64),
                    lambda r, M: (_t(r, (M, 4, 128), bf), _t(r, (M, 4), lo=0.0), _t(r, (128,), lo=0.5))),
        "swiglu": (lambda h: fu.swiglu_quantize(h, 8, scope="row"), lambda r, M: (_t(r, (M, 256), bf),)),
        "moe_stage": (lambda h, i, w: tuple(fu.moe_stage(h, i, w)),
                      lambda r, M: (_t(r, (M, 128), bf), _ints(r, (M, 4), 64), _t(r, (M, 4), lo=0.0))),
        "grouped_linear": (gemm, lambda r, M: (_t(r, (M, 3, 64), bf),)),
        "model1_store_gather": (store_gather, lambda r, M: (_t(r, (M, 512), bf), _ints(r, (M,), 40, -1))),
        "topk_bridge": (lambda i, b: kvc.topk_to_kvcache_indices(i, b, page_size=4, num_pages=4),
                        lambda r, M: (_ints(r, (M, 4), 8, -1), _ints(r, (M, 2), 4))),
    }


def _meta(x):
    if isinstance(x, (tuple, list)):
        return tuple(_meta(y) for y in x)
    return (tuple(x.shape), x.dtype, x.stride(), x.device) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("name", sorted(_cases()))
def test_token_count_marked_dynamic_compiles_once(rng, name):
    from torch._dynamo.testing import CompileCounterWithBackend
    fn, make = _cases()[name]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    frames = None
    for m in (5, 11, 23):
        args = make(rng, m)
        for a in args:
            if isinstance(a, torch.Tensor) and a.shape[0] == m:
                torch._dynamo.mark_dynamic(a, 0)
        got, want = compiled(*args), fn(*args)
        assert _meta(got) == _meta(want) and same_bits(got, want), m
        frames = counter.frame_count if frames is None else frames
    assert counter.frame_count == frames, "a new compile for a new token count"


def _decode_steps():
    return [(n, m) for n, m in steps() if n.startswith("kvcache_decode_step")]


@pytest.mark.parametrize("name,make", _decode_steps(), ids=[n for n, _ in _decode_steps()])
def test_kvcache_decode_steps_compile_with_inductor_dynamic(rng, name, make, fresh_inductor):
    """The demo's decode step (rawkv/demo.py: state_append, compress_decode,
    csa_rotate, hca_reset, gather_topk, gather_dense_batch) under inductor
    with dynamic=True: the eager bits. Before, the generated code failed
    (`NameError: name 's16' is not defined`): gather_topk sized its new out
    with pool.head_dim, a host int dynamo makes a graph input, which
    compress_decode's rules had equated with the state's head_dim; torch
    2.13's inductor binds that input under its own symbol while the size
    is written with the state's, which dynamo had pruned as unused
    (docs/engines.md). Sizes now come from the pool's buffers' shapes."""
    torch._dynamo.reset()
    step, args = make(rng, "cpu")
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    assert same_bits(compiled(*args), step(*args))


def test_kvcache_gathers_after_compress_decode_compile_with_inductor_dynamic(rng, fresh_inductor):
    """Every gather sizing its own out (gather_topk, gather_dense,
    gather_dense_batch, gather_index_keys, gather_index_keys_batch), after
    compress_decode has equated the pool's head_dim and index_head_dim with
    its states': compiled by inductor with dynamic=True, the eager bits,
    shapes and strides (before, gather_topk's and the dense gathers' widths
    were the pool's host ints: `name 's..' is not defined`)."""
    from rawkv.demo import Decoder
    kvc = rawkv.kvcache
    dec = Decoder(rng, [127, 134], 2, 8, 4, device="cpu", tensors=True)
    dec.prefill()
    dec.prepare(0)
    pool, state, istate = dec.pools["csa"], dec.states["csa"], dec.istate
    bufs = [t for o in (pool, state, istate) for t in o.torch_buffers().values() if t is not None]
    saved = [t.clone() for t in bufs]

    def step(pool, state, istate, w, iw, valid, sl, pos, ids, n):
        for dst, src in zip(bufs, saved):
            dst.copy_(src)
        kvc.compress_decode(pool, state, w, valid, sl, pos, index=(istate, iw))
        got = (kvc.gather_topk(pool, sl, ids, n_entries=n),
               kvc.gather_dense(pool, 0, 3, dtype="float32"),
               kvc.gather_index_keys(pool, 1, 2, dtype="float16"),
               kvc.gather_dense_batch(pool, sl, n, max_entries=5),
               kvc.gather_index_keys_batch(pool, sl, n, max_entries=5, dtype="float16"))
        return (*got, *(t.clone() for t in bufs))
    args = (pool, state, istate, dec.W["csa"], dec.IW, dec.valid, dec.sl, dec.pos, dec.ids, dec.n_csa)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    got = compiled(*args)
    # (eagerly, a CPU pool's gather_dense / gather_index_keys return numpy
    # when no argument is a tensor, compiled a tensor: dtypes numpy has)
    want = tuple(torch.from_numpy(w) if isinstance(w, np.ndarray) else w for w in step(*args))
    assert _meta(got) == _meta(want) and same_bits(got, want)
