// Gated-MLP products of the two halves of each row: gelu_tanh(gate) * up (flashrt::gelu_mul; reference:
// flashrt/nn/fused.py gelu_mul_ref = F.gelu(gate, approximate="tanh").mul_(up)) and silu(gate) * up
// (flashrt::silu_mul; silu_mul_ref = F.silu(gate).mul_(up)).
//
// gate_up (rows, 2M) contiguous in T -> out (rows, M) contiguous in T. The activation as ATen computes
// it in float32 -- gelu: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); silu: x / (1 + exp(-x)) --
// rounded to T (the reference's activation output), then the product rounded again (its mul_).
#include "flashrt_csrc.h"

namespace {

struct GeluTanh {
  __device__ __forceinline__ float operator()(float x) const {
    constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
    constexpr float kKappa = 0.044715f;
    const float inner = kBeta * (x + kKappa * (x * x * x));  // ATen's association
    return 0.5f * x * (1.f + tanhf(inner));
  }
};

struct Silu {
  __device__ __forceinline__ float operator()(float x) const { return x / (1.f + expf(-x)); }
};

template <typename T, typename Act>
__global__ void act_mul_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int64_t m) {
  const int64_t n = rows * m;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / m, j = idx % m;
    const float g = flashrt::round_to<T>(Act()(flashrt::to_f32(gate_up[r * 2 * m + j])));
    out[idx] = flashrt::from_f32<T>(__fmul_rn(g, flashrt::to_f32(gate_up[r * 2 * m + m + j])));
  }
}

template <typename Act>
int act_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t m, void* stream) {
  const int64_t n = rows * m;
  if (n == 0) return 0;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads < 65535 ? (n + threads - 1) / threads : 65535;
  auto st = static_cast<cudaStream_t>(stream);
  FLASHRT_DISPATCH(dtype, T, {
    act_mul_kernel<T, Act><<<static_cast<unsigned>(blocks), threads, 0, st>>>(
        static_cast<const T*>(gate_up), static_cast<T*>(out), rows, m);
  });
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int flashrt_gelu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t m, void* stream) {
  return act_mul<GeluTanh>(dtype, gate_up, out, rows, m, stream);
}

extern "C" int flashrt_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t m, void* stream) {
  return act_mul<Silu>(dtype, gate_up, out, rows, m, stream);
}
