"""A bool where an op takes a number (an int or float argument of its
schema: eps, block, granularity, slot, n_entries, page_size, theta, ...)
is refused under torch.compile as the eager op refuses it
(docs/runtime.md, "Numbers"). Before, the op wrapper passed a traced bool
on to the operator, whose argument parser made it 1 or 1.0 (0, 0.0): the
compiled rmsnorm_quantize(x, w, True) normalized with eps 1.0 and
gather_dense(pool, True, n) read slot 1, where the eager ops refuse both.
Now the wrapper refuses it while it traces: without fullgraph dynamo runs
the call eagerly, which raises the eager op's own error; with
fullgraph=True torch reports the wrapper's TypeError naming the argument."""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import rawkv  # noqa: E402
import rawkv._opdecl  # noqa: E402
import rawkv.kvcache as kvc  # noqa: E402
import rawkv.library  # noqa: E402,F401  (torch.ops.rawkv.*)
from rawkv.kvcache import views as V  # noqa: E402
from rawkv.reference.kvcache import layouts as RL  # noqa: E402

X = torch.linspace(-3, 3, 4 * 128).reshape(4, 128)
BF16 = torch.bfloat16


def _gather(index):
    p = kvc.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    p.add_request()
    p.prepare_step([0], [8 * p.m - 1])
    fn = kvc.gather_index_keys if index else kvc.gather_dense
    return (lambda v: fn(p, 0, v)) if index else (lambda v: fn(p, v, 8))


def _state_seed():
    st = kvc.DecodeState("hca", 2, device="cpu")
    rows = torch.zeros(3, st.head_dim)
    return lambda v: kvc.state_seed(st, v, rows, rows)


def _topk():
    ids, table = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)
    return lambda v: kvc.topk_to_kvcache_indices(ids, table, page_size=v, num_pages=50)


# (argument, what the schema takes, the public op with v there: built
# outside the compiled function, as a step's pool and state are)
CASES = [
    ("eps", "a number", lambda: lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), v)),
    ("granularity", "an int", lambda: lambda v: rawkv.fused.swiglu_quantize(torch.ones(4, 64, dtype=BF16), v)),
    ("block", "an int", lambda: lambda v: rawkv.fp8.quantize_blocks(X, block=v)),
    ("slot", "an int", lambda: _gather(False)),
    ("n_entries", "an int", lambda: _gather(True)),
    ("slot", "an int", _state_seed),
    ("page_size", "an int", _topk),
]


def _error(fn):
    with pytest.raises((TypeError, ValueError)) as ei:
        fn()
    return type(ei.value), str(ei.value)


def _compiled(fn, fullgraph):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")()


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("name,what,make", CASES, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(CASES)])
def test_a_compiled_op_refuses_a_bool_number_as_eagerly(name, what, make, value):
    call = make()
    eager = _error(lambda: call(value))
    assert eager[1].startswith(f"{name}: ")
    # without fullgraph: the eager op's own error (dynamo runs the refused call eagerly)
    assert _error(lambda: _compiled(lambda: call(value), False)) == eager
    # fullgraph: torch's report of the wrapper's refusal, naming the argument
    with pytest.raises(Exception, match=re.escape(f"{name}: expected {what}, got bool")):
        _compiled(lambda: call(value), True)


def test_a_refused_bool_writes_nothing():
    out = rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), 1e-6)
    before = [t.clone() for t in out]
    with pytest.raises(Exception, match="eps: expected a number, got bool"):
        _compiled(lambda: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), True, out=out), True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, before))


# ---- a bool gs: where a number or a tensor goes -------------------------------------------
Q = None


def _encoded():
    global Q
    if Q is None:
        Q = rawkv.nvfp4.quantize(X)
    return Q


def _ones_idx():
    return torch.zeros(2, dtype=torch.int32)


# (the op, the public call with v as its gs: a bool lands in the operator's
# `Tensor? gs` (A.split_number), refused by the op's own rule, Op.host)
GS_CASES = [
    ("nvfp4.quantize", lambda v: rawkv.nvfp4.quantize(X, scope="given", gs=v)),
    ("nvfp4.quantize-no-scope", lambda v: rawkv.nvfp4.quantize(X, scope=None, gs=v)),
    ("nvfp4.quantize-tensor-scope", lambda v: rawkv.nvfp4.quantize(X, scope="tensor", gs=v)),
    ("nvfp4.dequantize", lambda v: rawkv.nvfp4.dequantize(*_encoded()[:2], v)),
    ("nvfp4.gather", lambda v: rawkv.nvfp4.gather(*_encoded()[:2], v, _ones_idx())),
    ("fused.rmsnorm_quantize", lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), 1e-6,
                                                                     scope="given", gs=v)),
    ("fused.rmsnorm_quantize-bad-eps", lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), -1.0,
                                                                             scope="given", gs=v)),
    ("fused.mhc_rmsnorm_quantize", lambda v: rawkv.fused.mhc_rmsnorm_quantize(
        X.to(BF16).reshape(2, 2, 128), torch.ones(2, 2), torch.ones(128), 1e-6, scope="given", gs=v)),
    ("fused.swiglu_quantize", lambda v: rawkv.fused.swiglu_quantize(torch.ones(4, 64, dtype=BF16), 1,
                                                                    scope="given", gs=v)),
]


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("call", [c for _, c in GS_CASES], ids=[n for n, _ in GS_CASES])
def test_a_compiled_op_refuses_a_bool_gs_with_the_eager_error(call, value):
    """gs=True under torch.compile(fullgraph=True) was torch's own error (the
    fake call of the operator, whose `Tensor? gs` took the bool); now the op
    wrapper runs the op's rule for its arguments that are no tensor (Op.host)
    while it traces, so the compiled call raises the eager op's error, naming
    gs (or the argument the eager op names first: a scope that takes no gs,
    a bad eps)."""
    eager = _error(lambda: call(value))
    assert re.match(r"^(gs|eps): ", eager[1]), eager
    assert _error(lambda: _compiled(lambda: call(value), False)) == eager
    with pytest.raises(Exception, match=re.escape(eager[1])):
        _compiled(lambda: call(value), True)


def test_a_bool_gs_refused_when_compiled_writes_nothing():
    out = tuple(t.clone() for t in rawkv.nvfp4.quantize(X))
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    before = [raw(t).clone() for t in out]
    with pytest.raises(Exception, match="gs: expected a float, got True"):
        _compiled(lambda: rawkv.nvfp4.quantize(X, scope="given", gs=True, out=out), True)
    assert all(torch.equal(raw(a), b) for a, b in zip(out, before))


def test_a_bool_tensor_argument_without_a_host_rule_is_refused_by_name():
    """An op with no rule of its own for a bool in a tensor argument: the
    argument layer's error (A.require_array), as the eager op raises it."""
    pool = rawkv.kvcache.PagedKVPool("csa", 8, 4, 2, 4, device="cpu")
    pool.add_request()
    pool.prepare_step([0], [31])
    sl, ids = torch.zeros(1, dtype=torch.int32), torch.zeros((1, 2), dtype=torch.int32)
    call = lambda: kvc.gather_topk(pool, sl, ids, n_entries=True)  # noqa: E731
    eager = _error(call)
    assert eager == (TypeError, "n_entries: expected a tensor or array, got bool")
    assert _error(lambda: _compiled(call, False)) == eager
    with pytest.raises(Exception, match=re.escape(eager[1])):
        _compiled(call, True)


# ---- kvcache's integer arguments through the operator -------------------------------------
# slot, n_entries, start_entry, page_size, num_pages are `Scalar` in the
# operators' schemas (rawkv._opdecl.NUMBER_TYPES): torch's parser keeps a
# bool a bool there, so torch.ops.rawkv.kv_* refuses it with the public op's
# TypeError. As `int`, the parser made it 1 or 0 first: kv_gather_dense with
# slot=True read slot 1's request.
OPS = torch.ops.rawkv


def _kv_pool(kind="hca"):
    p = kvc.PagedKVPool(kind, 8, 4, 2, 4, device="cpu")
    for _ in range(2):
        p.add_request()
    p.prepare_step([0, 1], [8 * p.m - 1, 5 * p.m - 1])
    return p


def _buffers(*objs):
    """Every tensor the case may write (a pool's, a state's, caches, outs)."""
    out = []
    for o in objs:
        out += list(o.torch_buffers().values()) if hasattr(o, "torch_buffers") else [o]
    return [t for t in out if t is not None]


def _gather_case(arg, index):
    p = _kv_pool("csa" if index else "hca")
    width = p.index_head_dim if index else p.head_dim
    public, op = ((kvc.gather_index_keys, OPS.kv_gather_index_keys) if index else
                  (kvc.gather_dense, OPS.kv_gather_dense))
    out = torch.zeros(2, width, dtype=BF16)
    a = {"slot": 0, "n_entries": 2}
    return (lambda v: public(p, *{**a, arg: v}.values()),
            lambda v: op(**V.pool_args(p), **{**a, arg: v}, out=out),
            a[arg], _buffers(p, out))


def _seed_case(arg):
    st = kvc.DecodeState("hca", 2, device="cpu")
    rows = torch.zeros(3, st.head_dim)
    return (lambda v: kvc.state_seed(st, v, rows, rows),
            lambda v: OPS.kv_state_seed(**V.state_args(st, counter=False), slot=v, kv=rows, z=rows, ape=None),
            0, _buffers(st))


def _prefill_case(arg):
    p = _kv_pool("hca")
    rows, nw = torch.ones(2 * p.m, p.head_dim), torch.ones(p.head_dim)
    a = {"slot": 0, "start_entry": 0}
    none = {f"index_{n}": None for n in ("kv", "z", "ape", "norm_weight")}
    return (lambda v: kvc.compress_prefill(p, rows, rows, None, nw, **{**a, arg: v}),
            lambda v: OPS.kv_compress_prefill(**V.pool_args(p), kv=rows, z=rows, ape=None, norm_weight=nw,
                                              **{**a, arg: v}, **none, eps=1e-6, theta=10000.0, yarn=None),
            0, _buffers(p))


def _layout_case(name):
    lay = RL.LAYOUTS["model1" if name.startswith("model1") else name.removesuffix("_store")]
    cache = torch.zeros(2, lay.page_bytes(4), dtype=torch.uint8)
    width = 512 if lay is RL.MODEL1 else 128
    rows, slots, err = torch.ones(2, width, dtype=BF16), torch.tensor([0, 5], dtype=torch.int32), None
    if name == "model1_gather":
        out = torch.zeros(2, 512, dtype=BF16)
        return (lambda v: kvc.model1_gather(cache, slots, page_size=v),
                lambda v: OPS.kv_model1_gather(cache, slots, v, out, err), 4, _buffers(cache, out))
    if name == "model1_window_insert":
        return (lambda v: kvc.model1_window_insert(cache, rows, slots, page_size=v),
                lambda v: OPS.kv_model1_window_insert(cache, rows, slots, v, err), 4, _buffers(cache))
    return (lambda v: getattr(kvc, name)(cache, rows, slots, page_size=v),
            lambda v: getattr(OPS, "kv_" + name)(cache, rows, slots, v, None, err), 4, _buffers(cache))


def _bridge_case(arg):
    ids, table = torch.tensor([[0, 5, -1], [3, 1, 2]], dtype=torch.int32), torch.tensor([[1, 0], [0, 1]],
                                                                                        dtype=torch.int32)
    out = torch.zeros(2, 3, dtype=torch.int32)
    a = {"page_size": 4, "num_pages": 2}
    return (lambda v: kvc.topk_to_kvcache_indices(ids, table, **{**a, arg: v}),
            lambda v: OPS.kv_topk_to_kvcache_indices(ids, table, **{**a, arg: v}, slots=None, n_entries=None,
                                                     out=out, errors=None),
            a[arg], _buffers(out))


# (operator, argument, lambda: (public(v), operator(v), a good value, the tensors it may write))
KV_INT_CASES = [
    ("kv_gather_dense", "slot", lambda: _gather_case("slot", False)),
    ("kv_gather_dense", "n_entries", lambda: _gather_case("n_entries", False)),
    ("kv_gather_index_keys", "slot", lambda: _gather_case("slot", True)),
    ("kv_gather_index_keys", "n_entries", lambda: _gather_case("n_entries", True)),
    ("kv_state_seed", "slot", lambda: _seed_case("slot")),
    ("kv_compress_prefill", "slot", lambda: _prefill_case("slot")),
    ("kv_compress_prefill", "start_entry", lambda: _prefill_case("start_entry")),
    ("kv_model1_store", "page_size", lambda: _layout_case("model1_store")),
    ("kv_model1_window_insert", "page_size", lambda: _layout_case("model1_window_insert")),
    ("kv_index_fp8_store", "page_size", lambda: _layout_case("index_fp8_store")),
    ("kv_index_mxfp4_store", "page_size", lambda: _layout_case("index_mxfp4_store")),
    ("kv_index_mxfp8_store", "page_size", lambda: _layout_case("index_mxfp8_store")),
    ("kv_model1_gather", "page_size", lambda: _layout_case("model1_gather")),
    ("kv_topk_to_kvcache_indices", "page_size", lambda: _bridge_case("page_size")),
    ("kv_topk_to_kvcache_indices", "num_pages", lambda: _bridge_case("num_pages")),
]
KV_IDS = [f"{o}-{a}" for o, a, _ in KV_INT_CASES]


def test_the_cases_are_every_kvcache_integer_argument():
    """Every integer argument of a kv_* operator is a case here (a new
    one is a Scalar, refused as a bool, and tested; eps and theta are float
    Scalars, rawkv._opdecl.FLOAT_SCALARS: below)."""
    want = {(n, d.args[i][0]) for n, d in rawkv._opdecl.declared().items() if n.startswith("kv_")
            for i in d.ints}
    assert want == {(o, a) for o, a, _ in KV_INT_CASES}


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("name,arg,make", KV_INT_CASES, ids=KV_IDS)
def test_a_kvcache_operator_refuses_a_bool_integer_as_its_public_op(name, arg, make, value):
    """torch.ops.rawkv.kv_* given True / False where an integer goes: the
    public op's TypeError naming the argument (kvcache's host_int), before
    anything is written; before, the operator read it as 1 / 0."""
    public, operator, _, written = make()
    before = [t.clone() for t in written]
    for call in (public, operator):
        with pytest.raises(TypeError, match=f"^{arg}: expected an int, got bool$"):
            call(value)
    assert all(torch.equal(a, b) for a, b in zip(written, before))


@pytest.mark.parametrize("name,arg,make", KV_INT_CASES, ids=KV_IDS)
def test_a_kvcache_integer_argument_takes_an_int(name, arg, make):
    """A Python int runs through both (a NumPy one through the public op);
    a float is the public op's TypeError through both."""
    public, operator, good, _ = make()
    public(good)
    public(np.int64(good))
    operator(good)
    for call in (public, operator):
        with pytest.raises(TypeError, match=f"^{arg}: expected an int, got float$"):
            call(float(good))


def test_a_numpy_integer_through_a_kvcache_operator_is_torchs_error():
    """The price of `Scalar`: torch's parser refuses a NumPy integer there
    (naming the argument), where an `int` took it; the public op and a
    compiled call take it (the op wrapper passes the int it holds). Pass
    int(v) to torch.ops.rawkv.kv_* (docs/runtime.md, "Numbers")."""
    public, operator, _, _ = _gather_case("slot", False)
    public(np.int64(1))
    with pytest.raises(RuntimeError, match="argument 'slot'"):
        operator(np.int64(1))


def test_a_compiled_kvcache_op_refuses_a_float_integer_and_takes_a_given_int32():
    """Compiled, a float slot is the eager TypeError (the op wrapper refuses it
    while it traces: a Scalar's fake call would take it), and a NumPy int32
    the compiled function is given (an unbacked symbol, which an `int` took
    only without fullgraph) runs."""
    public, _, _, _ = _gather_case("slot", False)
    eager = _error(lambda: public(1.5))
    assert eager == (TypeError, "slot: expected an int, got float")
    assert _error(lambda: _compiled(lambda: public(1.5), False)) == eager
    with pytest.raises(Exception, match=re.escape(eager[1])):
        _compiled(lambda: public(1.5), True)
    torch._dynamo.reset()
    got = torch.compile(public, fullgraph=True, backend="eager")(np.int32(1))
    assert np.array_equal(got.float().numpy(), public(1))       # (eager: the CPU pool's numpy rows)




# ---- the other operators' numbers through the operator ------------------------------------
# Every number argument of an operator is a `Scalar` (kvcache's yarn `Scalar[]?`), as
# kvcache's integers above: torch's parser keeps a bool a bool, and the body refuses it with a
# TypeError naming the argument, on CPU and CUDA alike, before anything is written. As `int` /
# `float` the parser made it 1 or 1.0 first: fp8_quantize_blocks(x, True, ...) was `block:
# expected one of (32, 64, 128), got 1`, nvfp4_dequantize(q, sf, None, True, out) decoded with
# gs 1.0 (docs/runtime.md, "Numbers").
_SAMPLES: dict = {}


def _samples() -> dict:
    """The opcheck samples (tests/support/library.py), built once here."""
    if not _SAMPLES:
        from support.library import samples
        _SAMPLES.update(samples(np.random.default_rng(7)))
    return _SAMPLES


def _decl(name):
    return rawkv._opdecl.declared()[name]


def _with(name, args, **values) -> tuple:
    """`args` of operator `name` with the arguments named in `values` replaced."""
    names = [a for a, _, _ in _decl(name).args]
    args = list(args)
    for k, v in values.items():
        args[names.index(k)] = v
    return tuple(args)


def _sample(name, arg) -> tuple:
    """A sample of `name` whose `arg` holds a value."""
    i = [a for a, _, _ in _decl(name).args].index(arg)
    for args in _samples()[name]:
        if args[i] is not None:
            return args
    raise AssertionError(f"no opcheck sample of {name} gives {arg} (tests/support/library.py)")


def _raw(t):
    return t.reshape(-1).view(torch.uint8)


def _wrapped(name):
    """The op wrapper's function of operator `name` (rawkv._op.op: what the
    public op calls), which passes a NumPy number on as the number it holds."""
    body = _decl(name).body
    return getattr(sys.modules[body.__module__], body.__name__)


def _written(name, args) -> list:
    """The tensors `name` may write, filled with a sentinel (0xAB bytes; a
    kvcache pool's buffers as they are: the pool reads them first)."""
    d = _decl(name)
    out = [args[i] for i, (a, _, w) in enumerate(d.args) if w and args[i] is not None]
    if not name.startswith("kv_"):
        for t in out:
            _raw(t).fill_(0xAB)
    return out


_INT, _NUM = "expected an int, got bool", "expected a number, got bool"


def _n_k(arg):
    """GEMM's weight rule (gemm._rules.weight / weight8 / mx_span): its TypeError names the sizes."""
    if arg in ("n", "k"):
        return r"^weight: N = [\w.]+, K = [\w.]+: expected integers$"
    return r"^weight: exp_range \([\w.]+, [\w.]+\): expected integers$"


# (operator, argument, the TypeError's message for a bool there)
NUMBER_CASES = [
    ("fp8_quantize_blocks", "block", f"^block: {_INT}$"),
    ("fp8_dequantize_blocks", "block", f"^block: {_INT}$"),
    ("nvfp4_quantize", "gs_value", f"^gs_value: {_NUM}$"),
    ("nvfp4_dequantize", "gs_value", f"^gs_value: {_NUM}$"),
    ("nvfp4_gather", "gs_value", f"^gs_value: {_NUM}$"),
    ("rmsnorm_quantize", "eps", f"^eps: {_NUM}$"),
    ("rmsnorm_quantize", "gs_value", f"^gs_value: {_NUM}$"),
    ("mhc_rmsnorm_quantize", "eps", f"^eps: {_NUM}$"),
    ("mhc_rmsnorm_quantize", "gs_value", f"^gs_value: {_NUM}$"),
    ("swiglu_quantize", "granularity", f"^granularity: {_INT}$"),
    ("swiglu_quantize", "gs_value", f"^gs_value: {_NUM}$"),
    ("rmsnorm_quantize_fp8", "eps", f"^eps: {_NUM}$"),
    ("rmsnorm_quantize_fp8", "block", f"^block: {_INT}$"),
    ("mhc_rmsnorm_quantize_fp8", "eps", f"^eps: {_NUM}$"),
    ("mhc_rmsnorm_quantize_fp8", "block", f"^block: {_INT}$"),
    ("swiglu_quantize_fp8", "granularity", f"^granularity: {_INT}$"),
    ("swiglu_quantize_fp8", "block", f"^block: {_INT}$"),
    ("moe_stage_fp8", "block", f"^block: {_INT}$"),
    ("kv_compress_prefill", "eps", f"^eps: {_NUM}$"),
    ("kv_compress_prefill", "theta", "^theta: expected a real number, got bool$"),
    ("kv_compress_decode", "eps", f"^eps: {_NUM}$"),
    ("kv_compress_decode", "theta", "^theta: expected a real number, got bool$"),
    *[(op, a, _n_k(a)) for op in ("gemm_grouped_linear", "gemm_moe_linear") for a in ("n", "k", "exp_lo", "exp_hi")],
    *[(op, a, _n_k(a)) for op in ("gemm_grouped_linear_w4a8", "gemm_moe_linear_w4a8") for a in ("n", "k")],
]
NUMBER_IDS = [f"{o}-{a}" for o, a, _ in NUMBER_CASES]


def _types() -> dict:
    return {(n, a): t for n, d in rawkv._opdecl.declared().items() for a, t, _ in d.args}


def test_every_scalar_number_argument_is_a_case():
    """Every `Scalar` argument of an operator is a case here or with
    kvcache's integers above (a new one: refused as a bool, and tested)."""
    scalars = {k for k, t in _types().items() if t.rstrip("?") == "Scalar"}
    assert scalars == {(o, a) for o, a, _ in NUMBER_CASES} | {(o, a) for o, a, _ in KV_INT_CASES}


def test_no_operator_takes_an_int_or_a_float():
    """An `int` or `float` argument (or a list of them) makes a bool 1 or 1.0
    before the op's rule sees it: every number is a `Scalar` (yarn `Scalar[]?`)."""
    assert not {k for k, t in _types().items() if t.rstrip("?") in ("int", "float", "int[]", "float[]")}


def _cuda_view(v):
    """A tensor seen as a CUDA tensor (tests/support/fake_cuda.py), anything else as it is."""
    from support.fake_cuda import fake
    return fake(v) if isinstance(v, torch.Tensor) else v


@pytest.mark.parametrize("value", [True, False, np.True_])
@pytest.mark.parametrize("name,arg,msg", NUMBER_CASES, ids=NUMBER_IDS)
def test_an_operator_refuses_a_bool_number_by_name_and_writes_nothing(monkeypatch, name, arg, msg, value):
    """torch.ops.rawkv.<name> with True / False where a number goes: a
    TypeError naming it, before anything is written (the outputs keep their
    sentinel), on CPU tensors and on the same memory seen as CUDA tensors
    (the CUDA path's rules, up to its launches). A NumPy bool is torch's
    error in a `Scalar`; through the op wrapper (the public op) it is the
    same TypeError."""
    args = _with(name, _sample(name, arg), **{arg: value})
    written = _written(name, args)
    before = [_raw(t).clone() for t in written]
    op = getattr(OPS, name)
    if isinstance(value, np.bool_):
        with pytest.raises(RuntimeError, match=f"argument '{arg}'"):
            op(*args)
        with pytest.raises(TypeError, match=msg):
            _wrapped(name)(*args)
        return
    with pytest.raises(TypeError, match=msg):
        op(*args)
    if not name.startswith("kv_"):      # (kvcache's CUDA path: tests/support/agreement_cases_kvcache.py)
        from support.fake_cuda import install
        from rawkv import fp8, gemm
        from rawkv.fused import moe, rms, swiglu
        from rawkv.nvfp4 import activation, decode, encode
        install(monkeypatch, (fp8, encode, activation, decode, rms, swiglu, moe, gemm.linear, gemm.w4a8))
        with pytest.raises(TypeError, match=msg):
            op(*map(_cuda_view, args))
    assert all(torch.equal(_raw(t), b) for t, b in zip(written, before))


@pytest.mark.parametrize("name,arg,msg", NUMBER_CASES, ids=NUMBER_IDS)
def test_an_operator_takes_an_ordinary_number(name, arg, msg):
    """A Python number runs through the operator as before: an int where an
    integer goes, a float or an int where a float goes (eps=1, theta=160000,
    gs_value=1 are numbers their rules take), NumPy's float64 (a Python
    float's subclass) too, with the float's result."""
    args = _sample(name, arg)
    v = args[[a for a, _, _ in _decl(name).args].index(arg)]
    op = getattr(OPS, name)
    written = _written(name, args)
    op(*args)
    if arg not in rawkv._opdecl.FLOAT_SCALARS:
        assert type(v) is int
        return
    want = [_raw(t).clone() for t in written]
    if not name.startswith("kv_"):      # (a pool's entries move on: the compressor's own tests compare values)
        _written(name, args)
    op(*_with(name, args, **{arg: np.float64(v)}))
    if not name.startswith("kv_"):
        assert all(torch.equal(_raw(t), w) for t, w in zip(written, want))
    op(*_with(name, args, **{arg: round(v) or 1}))


@pytest.mark.parametrize("name,arg,msg", NUMBER_CASES, ids=NUMBER_IDS)
def test_a_numpy_number_through_an_operator_is_torchs_error(name, arg, msg):
    """The price of `Scalar`: torch's parser refuses a NumPy integer (and any
    NumPy float but float64, a Python float's subclass), naming the argument,
    where `int` / `float` took it; pass int(v) / float(v). The public ops
    take NumPy numbers (the op wrapper passes the number it holds)."""
    args = _sample(name, arg)
    v = args[[a for a, _, _ in _decl(name).args].index(arg)]
    given = np.float32(v) if arg in rawkv._opdecl.FLOAT_SCALARS else np.int64(v)
    with pytest.raises(RuntimeError, match=f"argument '{arg}'"):
        getattr(OPS, name)(*_with(name, args, **{arg: given}))
    _wrapped(name)(*_with(name, args, **{arg: given}))     # (the op wrapper: the number it holds)


@pytest.mark.parametrize("name", ["kv_compress_prefill", "kv_compress_decode"])
def test_a_kvcache_compressor_refuses_a_bool_in_yarn_and_takes_its_ints(name):
    """yarn is `Scalar[]?`: a bool among its values is refused by its field's
    name (the public op's check_rope rule); as `float[]?` torch made it 1.0
    (original_seq_len True was a YaRN context of 1). Its integers (65536) are
    taken as the floats yarn_list passes."""
    assert _types()[(name, "yarn")] == "Scalar[]?"
    args = _sample(name, "yarn")
    buffers = [t for t in args if isinstance(t, torch.Tensor)]
    before = [_raw(t).clone() for t in buffers]
    for values, msg in (([True, 65536, 32, 1], "^yarn.factor: expected a real number, got bool$"),
                        ([16.0, True, 32.0, 1.0], "^yarn.original_seq_len: expected an int, got bool$"),
                        ([16.0, 65536.0, 32.0, False], "^yarn.beta_slow: expected a real number, got bool$")):
        with pytest.raises(TypeError, match=msg):
            getattr(OPS, name)(*_with(name, args, yarn=values))
    assert all(torch.equal(_raw(t), b) for t, b in zip(buffers, before))
    getattr(OPS, name)(*_with(name, args, yarn=[16, 65536, 32, 1]))


def _prefill_call(arg):
    p = _kv_pool("hca")
    rows, nw = torch.ones(2 * p.m, p.head_dim), torch.ones(p.head_dim)
    return lambda v: kvc.compress_prefill(p, rows, rows, None, nw, 0, **{arg: v})


def _decode_call(arg):
    st = kvc.DecodeState("hca", 2, device="cpu")
    p = _kv_pool("hca")
    p.attach(st)
    st.count[0] = p.m
    nw, valid, slots = torch.ones(p.head_dim), torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.int32)
    return lambda v: kvc.compress_decode(p, st, nw, valid, slots, torch.tensor([p.m - 1], dtype=torch.int32),
                                         **{arg: v})


_CODES = rawkv.fp8.quantize_blocks(X, block=64, scale_format="ue8m0")
_H = torch.ones(4, 64, dtype=BF16)
_MOE = (torch.ones(4, 128, dtype=BF16), torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2))
# (argument, the public op with v there, a NumPy number it takes: the operators' cases' public side)
PUBLIC = [
    ("block", lambda v: rawkv.fp8.quantize_blocks(X, block=v), np.int64(64)),
    ("block", lambda v: rawkv.fp8.dequantize_blocks(*_CODES, block=v), np.int64(64)),
    ("eps", lambda v: rawkv.fused.rmsnorm_quantize(X.to(BF16), torch.ones(128), v), np.float32(1e-5)),
    ("eps", lambda v: rawkv.fused.mhc_rmsnorm_quantize(X.to(BF16).reshape(2, 2, 128), torch.ones(2, 2),
                                                        torch.ones(128), v), np.float32(1e-5)),
    ("eps", lambda v: rawkv.fused.rmsnorm_quantize_fp8(X.to(BF16), torch.ones(128), v), np.float32(1e-5)),
    ("block", lambda v: rawkv.fused.rmsnorm_quantize_fp8(X.to(BF16), torch.ones(128), block=v), np.int64(32)),
    ("granularity", lambda v: rawkv.fused.swiglu_quantize(_H, v), np.int64(8)),
    ("granularity", lambda v: rawkv.fused.swiglu_quantize_fp8(_H, v), np.int64(8)),
    ("block", lambda v: rawkv.fused.swiglu_quantize_fp8(_H, block=v), np.int64(32)),
    ("block", lambda v: rawkv.fused.moe_stage_fp8(*_MOE, block=v), np.int64(64)),
    ("eps", lambda v: _prefill_call("eps")(v), np.float32(1e-5)),
    ("theta", lambda v: _prefill_call("theta")(v), np.float32(10000.0)),
    ("eps", lambda v: _decode_call("eps")(v), np.float32(1e-5)),
    ("theta", lambda v: _decode_call("theta")(v), np.int64(10000)),
]


@pytest.mark.parametrize("value", [True, False, np.True_])
@pytest.mark.parametrize("arg,call,good", PUBLIC, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(PUBLIC)])
def test_a_public_op_refuses_a_bool_number_as_its_operator(arg, call, good, value):
    """The public op's error for a bool is its operator's (one rule: a
    TypeError naming the argument, A.refuse_bool; theta's check_rope), and
    it takes a NumPy number as before."""
    msg = {"eps": f"^eps: {_NUM}$", "theta": "^theta: expected a real number, got bool$"}.get(arg, f"^{arg}: {_INT}$")
    with pytest.raises(TypeError, match=msg):
        call(value)
    call(good)


def test_the_gemm_fast_path_takes_no_bool_size():
    """rawkv.gemm.fast keys a remembered launch by the call's sizes, where
    True == 1 and False == 0: a bool n / k / exp_lo / exp_hi (which the
    operators' `Scalar` keeps) goes to the checked path, which refuses it by
    name, instead of launching the kept call of 1 / 0 (an NVFP4 weight's
    exp_range is (0, 0))."""
    from rawkv._plan import Launch
    from rawkv.gemm import fast
    from support.fake_cuda import fake

    class Kernel:
        smem = 0
        calls = 0

        def launch(self, *a, **k):
            Kernel.calls += 1

    w, x, out = torch.zeros(4, dtype=torch.uint8), fake(torch.zeros(8)), fake(torch.zeros(8))
    sizes = ("nvfp4", 24, 64, 0, 0)
    try:
        fast.remember(fast.key("probe", (out, x), (w,), sizes), (w,), Launch(Kernel(), (1,), (1,), {}),
                      ("out", "x"), (out, x), ("w",))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(fast, "get_runtime", lambda d: None)
            assert fast.launched("probe", (out, x), 1, (w,), sizes, ("out", "x"), ("w",))
            for bad in (("nvfp4", 24, 64, False, False), ("nvfp4", 24, 64, np.False_, 0), ("nvfp4", 24, 64, 0, False)):
                assert not fast.launched("probe", (out, x), 1, (w,), bad, ("out", "x"), ("w",))
        assert Kernel.calls == 1
    finally:
        fast.forget()
