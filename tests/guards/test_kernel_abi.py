"""The kernel declarations (rawkv.kernels) against the CUDA sources and the
launch sites, on a CPU: every __global__ in rawkv/cu/*.cu is declared with
the same template parameters, its parameters (read from the source) pack as
their C types, and every launch passes the parameter names as keywords."""
import ctypes
import struct
import subprocess
import sys
import threading

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


@pytest.fixture
def declare():
    """declare(filename, source) -> a KernelFile reading its signatures
    from `source`, removed again after the test."""
    made = []

    def declare(filename, source):
        made.append(filename)
        return kernels.KernelFile(filename, source=source)
    yield declare
    for f in made:
        kernels._decl._FILES.pop(f, None)


def test_the_declarations_read_their_parameters_from_the_source():
    assert [repr(p) for p in kernels.fp8.ENCODE.params] == ["const T* x", "u8* out", "i64 n"]
    assert kernels.fp8.ENCODE.instance("float32", True).struct.format == "<QQq"


def test_a_swapped_or_retyped_parameter_is_launched_as_the_source_says(declare):
    """The .cu signature is the only copy of the parameters: a swap or a new
    C type in the source changes the packing, with no declaration to edit."""
    src = _fp8_with("const T* __restrict__ x, u8* __restrict__ out, i64 n)",
                    "u8* __restrict__ out, const T* __restrict__ x, int n)")["fp8.cu"]
    k = declare("test_abi_swapped.cu", src).kernel("rkv_e4m3_encode", kernels.fp8.ENCODE.template)
    inst = k.instance("float32", True)
    assert [p.name for p in k.params] == ["out", "x", "n"]
    assert inst.struct.format == "<QQi4x"
    assert inst.pack(x=1, out=2, n=3) == (2, 1, 3)


def test_a_parameter_type_with_no_packing_fails_the_check():
    problems = _abi.mismatches(_fp8_with("u8* __restrict__ out, i64 n)", "u8* __restrict__ out, half n)"))
    assert any("rkv_e4m3_encode: parameter n: C type 'half' has no launch packing" in p for p in problems), \
        problems


def test_more_parameters_than_launcher_slots_fail_the_check(declare):
    n = _launch.MAX_ARGS + 1
    src = "__global__ void k(" + ", ".join(f"int a{i}" for i in range(n)) + ") {}"
    declare("test_abi_wide.cu", src).kernel("k")
    problems = _abi.mismatches({"test_abi_wide.cu": src})
    assert f"test_abi_wide.cu: k takes {n} parameter slots, the launcher has {_launch.MAX_ARGS} " \
           "(rawkv._launch.MAX_ARGS)" in problems, problems


def test_first_use_refuses_a_source_that_disagrees_with_the_declaration(declare):
    """At run time too, not only in the ABI test: a kernel the source lacks,
    or whose template differs, is refused by name before any launch."""
    f = declare("test_abi_disagree.cu", "template <typename T> __global__ void k(const T* x) {}")
    bad_template = f.kernel("k", (kernels.TParam("int", "T", (1,)),))
    with pytest.raises(ValueError, match=r"test_abi_disagree.cu: k template"):
        bad_template.instance(1)
    missing = f.kernel("gone")
    with pytest.raises(ValueError, match="gone is declared but the source defines no such __global__"):
        missing.instance()


def test_a_declaration_takes_no_parameter_list(declare):
    with pytest.raises(TypeError, match="takes no parameter list"):
        declare("test_abi_old.cu", "").kernel("k", "const float* p, int n")


def test_import_and_the_name_expressions_read_no_source():
    """`import rawkv` and what warmup() compiles need the template only: the
    .cu files are read on a kernel's first launch."""
    code = ("import rawkv\nfrom rawkv import kernels, runtime\n"
            "assert runtime.registered_kernels()['fp8.cu']\n"
            "assert all(f._signatures is None for f in kernels.files().values())\n"
            "kernels.fp8.ENCODE.instance('float32', True)\n"
            "print(sorted(n for n, f in kernels.files().items() if f._signatures is not None))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['fp8.cu']"


def test_a_changed_template_fails_the_check():
    problems = _abi.mismatches(_fp8_with("template <typename T, bool VEC>", "template <typename T, int VEC>"))
    assert any("rkv_e4m3_encode template" in p for p in problems), problems


def test_an_undeclared_or_missing_kernel_fails_the_check():
    extra = _fp8_with("using namespace rkv;", "using namespace rkv;\n__global__ void rkv_new(int* p) {}")
    assert any("rkv_new has no declaration" in p for p in _abi.mismatches(extra))
    renamed = _fp8_with("rkv_e4m3_decode(", "rkv_e4m3_decode2(")
    problems = _abi.mismatches(renamed)
    assert any("rkv_e4m3_decode is declared but" in p for p in problems)


def test_parser_reads_launch_attributes_comments_and_templates():
    src = """
    // __global__ void commented_out(int x) {}
    template <typename T, int R = 2>
    __global__ void __launch_bounds__(kMax / (R + 1), 1) k(const T* __restrict__ a, /* note */ long long n,
                                                     double eps) {}
    __global__ void plain(void) {}
    template <typename T, bool M>
    __global__ void __maxnreg__((kRegs<T, M>)) capped(const T* x, int m) {}
    """
    sigs = _abi.global_signatures(src)
    assert set(sigs) == {"k", "plain", "capped"}
    assert sigs["capped"]["params"] == (("const T*", "x"), ("int", "m"))
    assert sigs["k"]["template"] == (("typename", "T"), ("int", "R"))
    assert sigs["k"]["params"] == (("const T*", "a"), ("long long", "n"), ("double", "eps"))
    assert sigs["plain"] == {"template": (), "params": ()}


def test_packing_follows_the_c_types(declare):
    f = declare("test_abi_packing.cu",
                "__global__ void k(const float* p, int a, long long b, double c, float d, u32 e) {}")
    inst = f.kernel("k").instance()
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


_STRUCTS = """
template <typename T>
struct Part {
    const T* kv;
    int n;            // 4 bytes of padding follow
    long long d;
    bool flag;
    float f;          // at 20: the struct is 24 bytes
};
struct Small { int a, b; u8* p; u8 c; };      // 24 bytes: a, b at 0, 4; p at 8; c at 16
"""


def test_a_struct_parameter_packs_its_fields_at_their_c_offsets(declare):
    """A struct passed by value (the .cu definition is the one copy of its
    fields) takes its fields as a dict, packed at C's offsets into as many
    slots as it needs; the launcher points each parameter at its first
    slot."""
    f = declare("test_abi_struct.cu", _STRUCTS + "template <typename T> __global__ void k(int a, Part<T> p, "
                "const Small s, double e) {}")
    k = f.kernel("k", (kernels.TParam("typename", "T", ("float32",)),))
    part, small = k.params[1], k.params[2]
    assert [(x.name, x.offset) for x in part.fields] == [("kv", 0), ("n", 8), ("d", 16), ("flag", 24), ("f", 28)]
    assert part.slots == 4 and small.slots == 3
    assert [(x.name, x.ctype, x.offset) for x in small.fields] == [
        ("a", "int", 0), ("b", "int", 4), ("p", "u8*", 8), ("c", "u8", 16)]
    inst = k.instance("float32")
    assert inst.struct.starts == (0, 1, 5, 8) and inst.struct.size == 9 * 8
    args = inst.pack(a=1, p=dict(kv=None, n=-2, d=1 << 40, flag=True, f=0.5), s=dict(a=3, b=4, p=4096, c=255),
                     e=2.5)
    raw = inst.struct.pack(*args)
    assert struct.unpack_from("<i", raw, 0)[0] == 1
    assert struct.unpack_from("<Q", raw, 8)[0] == 0                 # p.kv: None is a null pointer
    assert struct.unpack_from("<i", raw, 8 + 8)[0] == -2 and struct.unpack_from("<q", raw, 8 + 16)[0] == 1 << 40
    assert raw[8 + 24] == 1 and struct.unpack_from("<f", raw, 8 + 28)[0] == 0.5
    assert struct.unpack_from("<iiQB", raw, 40) == (3, 4, 4096, 255)
    assert struct.unpack_from("<d", raw, 64)[0] == 2.5
    with pytest.raises(TypeError, match=r"^k: argument s: missing field c; no field d$"):
        inst.pack(a=1, p=dict(kv=None, n=0, d=0, flag=False, f=0.0), s=dict(a=3, b=4, p=0, d=1), e=0.0)
    with pytest.raises(TypeError, match=r"^k: argument p is a struct: expected a dict"):
        inst.pack(a=1, p=(None, 0, 0, False, 0.0), s=dict(a=3, b=4, p=0, c=0), e=0.0)
    msg = _launch.describe_bad_argument(inst, (1, 0, 1.5, 0, False, 0.0, 3, 4, 0, 0, 0.0), struct.error("x"))
    assert msg == "k<float>: argument p.n (int) cannot take 1.5"


def test_the_launcher_points_each_parameter_at_its_first_slot(declare):
    f = declare("test_abi_struct_launch.cu", _STRUCTS + "__global__ void k(int a, Small s, double e) {}")
    inst = f.kernel("k").instance()
    seen = []
    launcher = _launch.Launcher(raw=lambda *a: seen.append(a) or 0)
    launcher(type("Fn", (), {"ptr": 1})(), (1,), (1,), inst.struct,
             inst.pack(a=7, s=dict(a=1, b=2, p=3, c=4), e=0.5), 0, 0, inst)
    params = seen[0][9]
    slots = launcher._tls.slots
    addresses = (ctypes.c_void_p * 3).from_address(params)
    assert [a - slots[4] for a in addresses] == [0, 8, 32]          # a, s (3 slots), e
    assert list(slots[2][:4]) == [7, 1 + (2 << 32), 3, 4]           # a; s.a, s.b; s.p; s.c
    one = kernels.fp8.ENCODE.instance("float32", True)            # every parameter one slot: the slots' own
    launcher(type("Fn", (), {"ptr": 1})(), (1,), (1,), one.struct, (0, 0, 5), 0, 0, one)
    assert seen[1][9] == slots[1]


def test_a_struct_field_type_with_no_packing_fails_the_check(declare):
    src = "struct Bad { const int* p; half h; };\n__global__ void k(Bad b) {}"
    declare("test_abi_bad_struct.cu", src).kernel("k")
    problems = _abi.mismatches({"test_abi_bad_struct.cu": src})
    assert any("field h: C type 'half' has no launch packing" in p for p in problems), problems


def test_declarations_refuse_what_cannot_be_packed(declare):
    f = declare("test_abi_refuse.cu", "__global__ void k(my_struct s) {}\n__global__ void k2(int* stream) {}")
    with pytest.raises(ValueError, match="k: parameter s: C type 'my_struct' has no launch packing"):
        f.kernel("k").instance()
    with pytest.raises(ValueError, match="unique"):
        f.kernel("k2").instance()


def test_template_arguments_spell_c_types():
    inst = kernels.fp8.ENCODE.instance("bfloat16", False)
    assert inst.expr == "rkv_e4m3_encode<__nv_bfloat16, false>"
    assert inst.expr in runtime.registered_kernels()["fp8.cu"]
    with pytest.raises(TypeError, match="expected 2 template arguments"):
        kernels.fp8.ENCODE.instance("float32")


# ---------------------------------------------------------------------------
# Launch sites: the keywords each launch passes are its kernel's parameters.
# ---------------------------------------------------------------------------
def test_every_launch_passes_its_kernels_parameter_names():
    assert _abi.launch_keyword_mismatches() == []


def test_every_declared_kernel_has_a_launch_the_check_reads():
    """The keyword check is not vacuous: each kernel is launched by a site
    it reads (named, or the only kernels whose parameters fit)."""
    sites = _abi.launch_sites()
    launched = {id(k) for s in sites for k in s.fits}
    unlaunched = [k.name for f in kernels.files().values() for k in f.kernels.values() if id(k) not in launched]
    assert unlaunched == []
    assert sum(s.named is not None and s.complete for s in sites) >= 25


_SITE = "from ..kernels import fp8 as K\n\n\ndef run(rt, x, out, n, inst, kw):\n"


def _site_problems(body, extra=""):
    return _abi.launch_keyword_mismatches({"rawkv/fake.py": extra + _SITE + "    " + body + "\n"})


def test_a_wrong_or_missing_keyword_fails_the_check():
    assert _site_problems("K.ENCODE.launch(rt, 1, 1, 'float32', True, stream=None, x=x, out=out, n=n)") == []
    assert _site_problems("K.ENCODE.instance('float32', True).launch(rt, 1, 1, x=x, out=out, m=n)") == [
        "rawkv/fake.py:5: rkv_e4m3_encode has no parameter m",
        "rawkv/fake.py:5: rkv_e4m3_encode's parameter n is not passed"]
    assert _site_problems("K.DECODE.launch(rt, 1, 1, 'float32', True, x=x, out=out, n=n)") == [
        "rawkv/fake.py:5: rkv_e4m3_decode has no parameter x",
        "rawkv/fake.py:5: rkv_e4m3_decode's parameter codes is not passed"]


def test_an_instance_in_a_variable_must_fit_one_kernel():
    assert _site_problems("inst.launch(rt, 1, 1, codes=x, out=out, n=n)") == []
    problems = _site_problems("inst.launch(rt, 1, 1, codes=x, out=out, count=n)")
    assert problems == ["rawkv/fake.py:5: the keywords are no kernel's of rawkv.kernels.fp8 (closest: "
                        "rkv_e4m3_decode has no parameter count; rkv_e4m3_decode's parameter n is not passed)"]


def test_splatted_keywords_are_counted_when_they_can_be_read():
    helper = "def part(out):\n    return dict(out=out, n=1)\n\n\n"
    assert _site_problems("K.ENCODE.launch(rt, 1, 1, 'float32', True, x=x, **part(out))", helper) == []
    assert _site_problems("K.ENCODE.launch(rt, 1, 1, 'float32', True, x=x, out=out, **part(out))", helper) == [
        "rawkv/fake.py:9: out passed twice"]
    bound = "p = part(out) if n else part(x)\n    "
    assert _site_problems(bound + "K.ENCODE.launch(rt, 1, 1, 'float32', True, **p)", helper) == [
        "rawkv/fake.py:10: rkv_e4m3_encode's parameter x is not passed"]
    # an unknown splat: only a keyword no parameter has is found
    assert _site_problems("K.ENCODE.launch(rt, 1, 1, 'float32', True, x=x, **kw)") == []
    assert _site_problems("K.ENCODE.launch(rt, 1, 1, 'float32', True, y=x, **kw)") == [
        "rawkv/fake.py:5: rkv_e4m3_encode has no parameter y"]


def test_warmup_builds_every_instance_before_a_launch(declare, monkeypatch):
    """warmup() leaves nothing for a first launch to do: the instances'
    packing (read from the source) and launch functions exist."""
    f = declare("test_abi_warm.cu", "template <bool B> __global__ void k(int* p, i64 n) {}")
    k = f.kernel("k", (kernels.TParam("bool", "B", (False, True)),))
    rt = runtime.Runtime.__new__(runtime.Runtime)     # no GPU: what warmup itself touches
    rt.arch, loaded = "sm_90", []
    rt._lock, rt._functions, rt.capturing = threading.Lock(), {}, lambda stream=None: False
    rt._load = loaded.extend                          # what it compiles and loads, in one batch
    rt.stream = lambda: None
    monkeypatch.setattr(runtime, "_WARMUP_HOOKS", [])   # the families' device state needs a GPU
    rt.warmup(["test_abi_warm.cu"])
    assert loaded == [("test_abi_warm.cu", "k<false>"), ("test_abi_warm.cu", "k<true>")]
    assert sorted(k._instances) == [(False,), (True,)]
    assert k.instance(True).struct.format == "<Qq"


def test_a_plans_launch_arguments_are_checked_too():
    """rawkv._plan's Launch(kernel, grid, block, mapping): the mapping's keys
    (dict(m, key=...), a helper's, a variable's of the same function) are
    the keywords."""
    helper = "def part(out):\n    return dict(out=out, n=1)\n\n\n"
    body = ("common = dict(part(out), x=x)\n    "
            "return [Launch(K.ENCODE.instance('float32', True), (1,), (1,), dict(common, {}))]")
    assert _site_problems(body.format(""), helper) == []
    assert _site_problems(body.format("m=n"), helper) == ["rawkv/fake.py:10: rkv_e4m3_encode has no parameter m"]
    other = "\n\ndef g():\n    common = dict(x=1)\n"         # another function's 'common' does not count
    assert _site_problems(body.format("") + other, helper) == []
