// flashrt csrc: the C ABI shared by every kernel file (no torch headers; loaded with ctypes by
// flashrt/runtime/csrc.py). Every entry point launches on the given CUDA stream and returns the
// cudaError_t of the launch (0 = cudaSuccess). Tensors are raw device pointers; the Python side checks
// shapes, dtypes and strides before calling and falls back to the reference otherwise.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define FLASHRT_CSRC_ABI 3

// Activation dtypes (the `dtype` argument of every entry point).
enum FlashrtDtype : int { FLASHRT_F32 = 0, FLASHRT_BF16 = 1, FLASHRT_F16 = 2 };

namespace flashrt {

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Rounds a float to T and back: the value a T-typed intermediate of the reference holds.
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f32<T>(from_f32<T>(v)); }

}  // namespace flashrt

// Dispatch `dtype` to a template instantiation: FLASHRT_DISPATCH(dtype, T, { body using T }).
#define FLASHRT_DISPATCH(dtype, T, ...)                                  \
  switch (dtype) {                                                       \
    case FLASHRT_F32: { using T = float; __VA_ARGS__; break; }           \
    case FLASHRT_BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; }  \
    case FLASHRT_F16: { using T = __half; __VA_ARGS__; break; }          \
    default: return static_cast<int>(cudaErrorInvalidValue);             \
  }
