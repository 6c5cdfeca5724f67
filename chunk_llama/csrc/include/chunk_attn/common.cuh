// Small device helpers shared by the kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace chunk_attn {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<half>(half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_max(float x, int width = 32) {
#pragma unroll
  for (int offset = width / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x, int width = 32) {
#pragma unroll
  for (int offset = width / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// exp(a - b) that is 0 when a is -inf (an empty partial), never NaN.
__device__ __forceinline__ float rescale(float a, float b) { return a == -INFINITY ? 0.f : __expf(a - b); }

// 16-byte vector of 8 half-precision values.
struct alignas(16) Vec8 {
  uint4 raw;
};

template <typename T>
__device__ __forceinline__ void load8(const T* ptr, float out[8]) {
  Vec8 v;
  v.raw = *reinterpret_cast<const uint4*>(ptr);
  const T* x = reinterpret_cast<const T*>(&v.raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float<T>(x[i]);
}

}  // namespace chunk_attn
