// fp8.cu: element-wise E4M3 encode / decode of whole tensors.
//
// Each thread handles chunks of 16 bytes of E4M3 codes: 16 inputs in, one
// 16-byte store out (or 16 codes in, 16/(16/sizeof(T)) vector stores out).
// VEC=false is the scalar path for inputs not aligned to 16 bytes.
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

template <typename T, bool VEC>
__global__ void rkv_e4m3_decode(const u8* __restrict__ codes, T* __restrict__ out, i64 n) {
    const i64 chunks = VEC ? n / 16 : 0;
    for (i64 c = global_thread(); c < chunks; c += grid_threads()) {
        Vec16<u8> in = load16(codes + c * 16);
#pragma unroll
        for (int h = 0; h < 16 / Vec16<T>::N; ++h) {
            Vec16<T> o;
#pragma unroll
            for (int j = 0; j < Vec16<T>::N; ++j) o.v[j] = from_f32<T>(e4m3_decode(in.v[h * Vec16<T>::N + j]));
            store16(out + c * 16 + h * Vec16<T>::N, o);
        }
    }
    for (i64 i = chunks * 16 + global_thread(); i < n; i += grid_threads())
        out[i] = from_f32<T>(e4m3_decode(codes[i]));
}
