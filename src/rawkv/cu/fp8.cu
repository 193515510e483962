// fp8.cu: element-wise E4M3 encode / decode of whole tensors.
//
// Encode: each thread handles chunks of 16 codes: 16 inputs in, one 16-byte
// store out. VEC=false is the scalar path for inputs not aligned to 16 bytes.
#include "common.cuh"
using namespace rkv;

template <typename T, bool VEC>
__global__ void rkv_e4m3_encode(const T* __restrict__ x, u8* __restrict__ out, i64 n) {
    const i64 chunks = VEC ? n / 16 : 0;
    for (i64 c = global_thread(); c < chunks; c += grid_threads()) {
        const T* src = x + c * 16;
        Vec16<u8> o;
#pragma unroll
        for (int h = 0; h < 16 / Vec16<T>::N; ++h) {
            Vec16<T> in = load16(src + h * Vec16<T>::N);
#pragma unroll
            for (int j = 0; j < Vec16<T>::N; ++j) o.v[h * Vec16<T>::N + j] = e4m3_encode(to_f32(in.v[j]));
        }
        store16(out + c * 16, o);
    }
    for (i64 i = chunks * 16 + global_thread(); i < n; i += grid_threads())
        out[i] = e4m3_encode(to_f32(x[i]));
}

// Decode: a unit is the codes of one 16-byte output vector (Vec16<T>::N codes:
// 8 for 16-bit T, 4 for float), so consecutive lanes store consecutive 16
// bytes and each warp store instruction covers 512 contiguous bytes (a
// 16-code unit per lane would leave every store instruction half of each
// 32-byte sector, twice the L1/L2 store traffic). Each thread loads its
// kDecodeUnroll units before it converts any: two loads in flight.
constexpr int kDecodeUnroll = 2;

template <int N> struct CodeWord;
template <> struct CodeWord<8> { typedef uint2 type; };
template <> struct CodeWord<4> { typedef u32 type; };

// One unit: its codes as 32-bit words (4 codes each, first code lowest),
// two codes per conversion instruction (the same values as e4m3_decode).
template <typename T>
__device__ __forceinline__ Vec16<T> decode_unit(const u32 (&w)[Vec16<T>::N / 4]) {
    Vec16<T> o;
#pragma unroll
    for (int i = 0; i < Vec16<T>::N / 4; ++i) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] >> (16 * p)), __NV_E4M3);
            const float2 f = __half22float2(__half2(h));
            o.v[4 * i + 2 * p] = from_f32<T>(f.x);
            o.v[4 * i + 2 * p + 1] = from_f32<T>(f.y);
        }
    }
    return o;
}

template <typename T, bool VEC>
__global__ void rkv_e4m3_decode(const u8* __restrict__ codes, T* __restrict__ out, i64 n) {
    constexpr int PER = Vec16<T>::N;
    typedef typename CodeWord<PER>::type W;
    const i64 units = VEC ? n / PER : 0;
    const i64 stride = grid_threads();
    for (i64 u0 = global_thread(); u0 < units; u0 += stride * kDecodeUnroll) {
        union { W v; u32 w[PER / 4]; } in[kDecodeUnroll];
#pragma unroll
        for (int k = 0; k < kDecodeUnroll; ++k) {
            const i64 u = u0 + k * stride;
            if (u < units) in[k].v = reinterpret_cast<const W*>(codes)[u];
        }
#pragma unroll
        for (int k = 0; k < kDecodeUnroll; ++k) {
            const i64 u = u0 + k * stride;
            if (u < units) store16(out + u * PER, decode_unit<T>(in[k].w));
        }
    }
    for (i64 i = units * PER + global_thread(); i < n; i += grid_threads())
        out[i] = from_f32<T>(e4m3_decode(codes[i]));
}
