"""The SwiGLU producers' silu (fused.cu, silu_f32_n): the quotient a / (1 +
exp_f32(-a)) without a check and a branch per value, and with 1 + exp_f32's
one-fma form for |x| <= 87, against the IEEE division by the
reference's exp_f32 on the GPU for every float32 its range test lets through, and
against the reference (rawkv.reference.fused.silu) for every BF16 and FP16
input, bit for bit. Exhaustive: the domain is small enough (2^32 float32
patterns take about a second on an H200)."""
from __future__ import annotations

import numpy as np
import pytest

from rawkv.reference import fused as R

F32 = np.float32

# (appended to fused.cu, compiled with its constants and numeric options)
_TEST_KERNELS = r"""
// Every float32 bit pattern with |a| <= 87 or a NaN (what silu_f32_n's range
// test lets through to its fast path): silu_quotient of one_plus_exp_f32_normal(-a)
// against the division by 1 + exp_f32(-a), the reference's (NaN against NaN),
// mismatches counted and the least bits of one kept.
__global__ void rkv_test_silu_quotient_sweep(unsigned long long* bad, u32* first) {
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long mine = 0;
    u32 least = 0xFFFFFFFFu;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 32); i += step) {
        const u32 bits = (u32)i;
        const float a = __uint_as_float(bits);
        if (fabsf(a) > kSiluQuotientMax) continue;
        const float got = silu_quotient(a, one_plus_exp_f32_normal(-a));
        const float want = __fdiv_rn(a, __fadd_rn(1.0f, exp_f32(-a)));
        if (__float_as_uint(got) != __float_as_uint(want) && !(got != got && want != want)) {
            ++mine;
            least = min(least, bits);
        }
    }
    if (mine) {
        atomicAdd(bad, mine);
        atomicMin(first, least);
    }
}

// silu of n float32 values in groups of 8, as the VEC producer takes them.
__global__ void rkv_test_silu_groups(const float* x, float* y, int n) {
    const int i = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = x[i + j];
    silu_f32_n(v);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[i + j] = v[j];
}
"""


def test_range_test_is_the_kernels():
    """The sweep skips exactly what fused.cu's range test sends to the division."""
    from rawkv.kernels import _abi
    src = (_abi.CU_DIR / "fused.cu").read_text()
    assert "constexpr float kSiluQuotientMax = 87.0f;" in src
    assert "for (int j = 1; j < N; ++j) m = fmaxf(m, fabsf(v[j]));" in src
    assert "if (m > kSiluQuotientMax) {" in src
    assert "v[j] = silu_quotient(v[j], one_plus_exp_f32_normal(-v[j]));" in src


@pytest.fixture
def silu_module(cuda):
    import cupy
    from rawkv import _nvrtc, runtime
    from rawkv.kernels import _abi
    src = (_abi.CU_DIR / "fused.cu").read_text() + _TEST_KERNELS
    names = ["rkv_test_silu_quotient_sweep", "rkv_test_silu_groups"]
    res = _nvrtc.compile_cu(src, "fused.cu", runtime.compile_arch("fused.cu", cuda.arch), names,
                            runtime.kernel_options("fused.cu"))
    module = cupy.cuda.function.Module()
    module.load(res.cubin)
    return cupy, {n: module.get_function(res.lowered[n]) for n in names}


def test_quotient_is_the_division_for_every_float32_it_takes(silu_module):
    """Every float32 bit pattern (2^32: those the range test passes, about
    2.25e9, NaNs included): not one bit differs from the IEEE quotient by
    the reference's exp_f32."""
    cupy, fns = silu_module
    bad = cupy.zeros(1, cupy.uint64)
    first = cupy.full(1, 0xFFFFFFFF, cupy.uint32)
    with cupy.cuda.Device(0):
        fns["rkv_test_silu_quotient_sweep"]((132 * 32,), (256,), (bad, first))
        cupy.cuda.runtime.deviceSynchronize()
    n_bad, least = int(bad.get()[0]), int(first.get()[0])
    assert n_bad == 0, f"{n_bad} quotients differ, the least bits {least:#010x}"


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_every_16_bit_input_gives_the_reference_bits(silu_module, dtype):
    """Every BF16 / FP16 bit pattern (what the producers' silu takes), in
    their order in groups of 8: the groups holding a value of magnitude
    above 87 (the Infs included) take the division, the rest (zeros,
    subnormals, NaN included) the sequence."""
    cupy, fns = silu_module
    bits = np.arange(1 << 16, dtype=np.uint32)
    if dtype == "bfloat16":
        x = (bits << 16).view(F32)
    else:
        x = bits.astype(np.uint16).view(np.float16).astype(F32)
    want = R.silu(x)
    xd = cupy.asarray(x)
    yd = cupy.empty_like(xd)
    with cupy.cuda.Device(0):
        fns["rkv_test_silu_groups"](((x.size // 8 + 127) // 128,), (128,), (xd, yd, np.int32(x.size)))
    got = yd.get()
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), [(hex(int(b)), float(g), float(w)) for b, g, w in
                        zip(bits[~same][:8], got[~same][:8], want[~same][:8])]
    groups = x.reshape(-1, 8)
    divided = (np.abs(groups) > F32(87.0)).any(axis=1)
    assert 0 < divided.sum() < divided.size        # both paths ran
