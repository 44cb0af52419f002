// Gemma RMSNorm rows, optionally fused with the residual add before it (flashrt::rms_norm,
// flashrt::add_rms_norm; reference: flashrt/nn/norms.py rms_norm_ref / add_rms_norm_ref).
//
//   s = x [+ y [* gate]]                      in T, as the reference's add / addcmul rounds it
//   n = s / sqrt(mean(s^2) + eps) * scale [+ shift]   in float32, then rounded to T
//   cast_first: s / sqrt(mean(s^2) + eps) rounded to T before the scale (Llama's form)
//
// One block per row of width D; float32 statistics; y, sum_out, out (rows, D) contiguous; x the same, or
// (without y) rows in groups of `inner` contiguous rows, groups `outer_stride` elements apart (a head
// split of a fused projection: q (B, L, H, D) of qkv (B, L, H + 2 KV, D)); gate (D,)
// in T; scale, shift (D,) float32. The products follow the reference's order (normalize, then scale,
// then shift) with explicit _rn intrinsics so no FMA contraction changes the rounding.
#include "flashrt_csrc.h"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : 0.f;
  if (warp == 0)
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  return shared[0];
}

template <typename T>
__global__ void add_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ y, const T* __restrict__ gate,
                                    const float* __restrict__ scale, const float* __restrict__ shift,
                                    T* __restrict__ sum_out, T* __restrict__ out, int64_t dim, float eps,
                                    int cast_first, int64_t inner, int64_t outer_stride) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + (row / inner) * outer_stride + (row % inner) * dim;
  const T* yr = y ? y + row * dim : nullptr;
  T* sr = sum_out ? sum_out + row * dim : nullptr;
  float squares = 0.f;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    float s = flashrt::to_f32(xr[j]);
    if (yr) {
      const float yj = flashrt::to_f32(yr[j]);
      s = flashrt::round_to<T>(__fadd_rn(s, gate ? __fmul_rn(yj, flashrt::to_f32(gate[j])) : yj));
      sr[j] = flashrt::from_f32<T>(s);
    }
    squares = __fadd_rn(squares, __fmul_rn(s, s));
  }
  const float inv = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(squares, shared), static_cast<float>(dim)), eps));
  const T* src = sr ? sr : xr;
  T* dst = out + row * dim;
  for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) {
    float n = __fmul_rn(flashrt::to_f32(src[j]), inv);
    if (cast_first) n = flashrt::round_to<T>(n);
    n = __fmul_rn(n, scale[j]);
    if (shift) n = __fadd_rn(shift[j], n);
    dst[j] = flashrt::from_f32<T>(n);
  }
}

}  // namespace

extern "C" int flashrt_csrc_abi() { return FLASHRT_CSRC_ABI; }

// y == nullptr: a plain rms_norm of x (sum_out unused); else s = x + y [* gate] goes to sum_out and
// is normalized. gate and shift may be nullptr. cast_first != 0: the Llama rounding (file comment).
// inner, outer_stride: x's row layout (file comment); contiguous x: 1, dim.
extern "C" int flashrt_add_rms_norm(int dtype, const void* x, const void* y, const void* gate,
                                    const float* scale, const float* shift, void* sum_out, void* out,
                                    int64_t rows, int64_t dim, float eps, int cast_first, int64_t inner,
                                    int64_t outer_stride, void* stream) {
  if (rows == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  FLASHRT_DISPATCH(dtype, T, {
    add_rms_norm_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(y), static_cast<const T*>(gate), scale, shift,
        static_cast<T*>(sum_out), static_cast<T*>(out), dim, eps, cast_first, inner, outer_stride);
  });
  return static_cast<int>(cudaGetLastError());
}
