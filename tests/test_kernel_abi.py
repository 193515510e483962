"""The kernel declarations (rawkv.kernels) against the CUDA sources, on a
CPU: every __global__ in rawkv/cu/*.cu is declared with the same template
parameters and the same parameters (names, C types, order), and the
declaration packs a launch's arguments as those C types."""
import struct

import pytest

from rawkv import _launch, kernels, runtime
from rawkv.kernels import _abi


def _sources():
    return {p.name: p.read_text() for p in sorted(_abi.CU_DIR.glob("*.cu"))}


def test_every_kernel_is_declared_as_its_source_defines_it():
    assert _abi.mismatches() == []


def test_every_cu_file_has_kernels_the_runtime_knows():
    registered = runtime.registered_kernels()
    for name in _sources():
        assert registered.get(name), f"{name}: no kernel of it is registered"


def _fp8_with(old, new):
    src = _sources()["fp8.cu"]
    assert old in src
    return {"fp8.cu": src.replace(old, new, 1)}


def test_a_swapped_parameter_fails_the_check():
    swapped = _fp8_with("const T* __restrict__ x, u8* __restrict__ out,",
                        "u8* __restrict__ out, const T* __restrict__ x,")
    problems = _abi.mismatches(swapped)
    assert any("rkv_e4m3_encode parameter 0" in p for p in problems), problems
    assert any("rkv_e4m3_encode parameter 1" in p for p in problems), problems


def test_a_retyped_parameter_fails_the_check():
    problems = _abi.mismatches(_fp8_with("u8* __restrict__ out, i64 n)", "u8* __restrict__ out, int n)"))
    assert any("parameter 2: source 'int n' != declared 'i64 n'" in p for p in problems), problems


def test_a_changed_template_fails_the_check():
    problems = _abi.mismatches(_fp8_with("template <typename T, bool VEC>", "template <typename T, int VEC>"))
    assert any("rkv_e4m3_encode template" in p for p in problems), problems


def test_an_undeclared_or_missing_kernel_fails_the_check():
    extra = _fp8_with("using namespace rkv;", "using namespace rkv;\n__global__ void rkv_new(int* p) {}")
    assert any("rkv_new has no declaration" in p for p in _abi.mismatches(extra))
    renamed = _fp8_with("rkv_e4m3_decode(", "rkv_e4m3_decode2(")
    problems = _abi.mismatches(renamed)
    assert any("rkv_e4m3_decode is declared but" in p for p in problems)


def test_parser_reads_launch_bounds_comments_and_templates():
    src = """
    // __global__ void commented_out(int x) {}
    template <typename T, int R = 2>
    __global__ void __launch_bounds__(kMax / (R + 1), 1) k(const T* __restrict__ a, /* note */ long long n,
                                                     double eps) {}
    __global__ void plain(void) {}
    """
    sigs = _abi.global_signatures(src)
    assert set(sigs) == {"k", "plain"}
    assert sigs["k"]["template"] == (("typename", "T"), ("int", "R"))
    assert sigs["k"]["params"] == (("const T*", "a"), ("long long", "n"), ("double", "eps"))
    assert sigs["plain"] == {"template": (), "params": ()}


def test_packing_follows_the_c_types():
    f = kernels.KernelFile("test_abi_packing.cu")
    try:
        k = f.kernel("k", "const float* p, int a, long long b, double c, float d, u32 e")
        inst = k.instance()
        assert inst.struct.format == "<Qi4xqdf4xI4x" and inst.struct.size == 6 * 8
        args = inst.pack(e=7, d=0.5, c=1.5, b=-(1 << 40), a=-3, p=None)
        assert args == (0, -3, -(1 << 40), 1.5, 0.5, 7)
        raw = inst.struct.pack(*args)
        assert struct.unpack_from("<i", raw, 8)[0] == -3          # int reads the low 4 bytes
        assert struct.unpack_from("<f", raw, 32)[0] == 0.5
        with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'e'"):
            inst.pack(p=0, a=1, b=2, c=3.0, d=4.0)
        with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
            inst.pack(p=0, a=1, b=2, c=3.0, d=4.0, e=5, bogus=1)
        msg = _launch.describe_bad_argument(inst, (0, 1.5, 2, 3.0, 4.0, 5), struct.error("x"))
        assert msg.startswith("k: argument a (int) cannot take 1.5")
    finally:
        kernels._decl._FILES.pop("test_abi_packing.cu")


def test_declarations_refuse_what_cannot_be_packed():
    f = kernels.KernelFile("test_abi_refuse.cu")
    try:
        with pytest.raises(ValueError, match="no launch packing"):
            f.kernel("k", "my_struct s")
        with pytest.raises(ValueError, match="unique"):
            f.kernel("k2", "int* stream")
    finally:
        kernels._decl._FILES.pop("test_abi_refuse.cu")


def test_template_arguments_spell_c_types():
    inst = kernels.fp8.ENCODE.instance("bfloat16", False)
    assert inst.expr == "rkv_e4m3_encode<__nv_bfloat16, false>"
    assert inst.expr in runtime.registered_kernels()["fp8.cu"]
    with pytest.raises(TypeError, match="expected 2 template arguments"):
        kernels.fp8.ENCODE.instance("float32")
