"""The sizes an object is built with (a GEMM layer's groups and features, a
weight loader's groups, a KV-cache pool's and decode state's geometry) follow
one rule, rawkv._args.positive_int: a Python or NumPy int >= 1; a bool or a
float is a TypeError and 0 or less a ValueError, each naming the argument in
the same words. (Until session 64 three copies said it three ways: the layer
took a float 2.0 for a TypeError "expected a positive int, got 2.0", the
loader said "groups: must be >= 1".)"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rawkv  # noqa: E402
from rawkv.gemm import Fp4GroupedLinear, Fp4Weight  # noqa: E402
from rawkv.kvcache import DecodeState, PagedKVPool  # noqa: E402

_LAYER = dict(groups=2, in_features=32, out_features=16, max_tokens=4)
_POOL = dict(num_blocks=4, entries_per_block=8, max_requests=2, max_blocks_per_request=2)


def _layer(**kw):
    return Fp4GroupedLinear(**{**_LAYER, **kw}, device="cpu")


def _pool(**kw):
    return PagedKVPool("hca", **{**_POOL, **kw}, device="cpu")


def _state(**kw):
    return DecodeState("hca", **{"max_requests": 2, **kw}, device="cpu")


def _loader(groups):
    codes = torch.zeros((4, 16), dtype=torch.uint8)
    scales = torch.ones((4, 2), dtype=torch.float8_e4m3fn)
    return Fp4Weight.from_nvfp4(codes, scales, torch.tensor(1.0), groups=groups)


BUILDERS = [(_layer, name) for name in _LAYER] + [(_pool, name) for name in _POOL] \
    + [(_pool, "head_dim"), (_state, "max_requests"), (_state, "head_dim")] \
    + [(lambda groups: _loader(groups), "groups")]


def _call(build, name, v):
    return build(v) if name == "groups" and build is not _layer else build(**{name: v})


@pytest.mark.parametrize("build,name", BUILDERS, ids=lambda x: x if isinstance(x, str) else None)
@pytest.mark.parametrize("v,typename", [(True, "bool"), (np.bool_(True), "bool"), (2.0, "float"),
                                        ("2", "str"), (None, "NoneType")])
def test_not_an_int_is_a_type_error_naming_it(build, name, v, typename):
    with pytest.raises(TypeError, match=f"^{name}: expected an int, got {typename}$"):
        _call(build, name, v)


@pytest.mark.parametrize("build,name", BUILDERS, ids=lambda x: x if isinstance(x, str) else None)
@pytest.mark.parametrize("v", [0, -1, np.int64(0)])
def test_zero_or_less_is_a_value_error_naming_it(build, name, v):
    with pytest.raises(ValueError, match=f"^{name}: expected a positive int, got {int(v)}$"):
        _call(build, name, v)


def test_numpy_ints_are_the_ints_they_hold():
    layer = _layer(groups=np.int64(2), out_features=np.int32(16))
    assert (layer.groups, layer.out_features) == (2, 16) and type(layer.groups) is int
    pool = _pool(num_blocks=np.int16(4))
    assert pool.num_blocks == 4 and type(pool.num_blocks) is int
    assert rawkv._args.positive_int("n", np.uint8(3)) == 3
