// GeGLU product: gelu_tanh(gate) * up of the two halves of each row (flashrt::gelu_mul; reference:
// flashrt/nn/fused.py gelu_mul_ref = F.gelu(gate, approximate="tanh").mul_(up)).
//
// gate_up (rows, 2M) contiguous in T -> out (rows, M) contiguous in T. gelu as ATen computes it in
// float32, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), rounded to T (the reference's gelu output),
// then the product rounded again (its mul_).
#include "flashrt_csrc.h"

namespace {

template <typename T>
__global__ void gelu_mul_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t m) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const int64_t n = rows * m;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / m, j = idx % m;
    const float x = flashrt::to_f32(gate_up[r * 2 * m + j]);
    const float inner = kBeta * (x + kKappa * (x * x * x));  // ATen's association
    const float g = flashrt::round_to<T>(0.5f * x * (1.f + tanhf(inner)));
    out[idx] = flashrt::from_f32<T>(__fmul_rn(g, flashrt::to_f32(gate_up[r * 2 * m + m + j])));
  }
}

}  // namespace

extern "C" int flashrt_gelu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t m, void* stream) {
  const int64_t n = rows * m;
  if (n == 0) return 0;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads < 65535 ? (n + threads - 1) / threads : 65535;
  auto st = static_cast<cudaStream_t>(stream);
  FLASHRT_DISPATCH(dtype, T, {
    gelu_mul_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, st>>>(static_cast<const T*>(gate_up),
                                                                          static_cast<T*>(out), rows, m);
  });
  return static_cast<int>(cudaGetLastError());
}
