// RoPE of q and k from one fused q|k|v projection, k and v written into static K/V slots
// (flashrt::rope_qkv; reference: flashrt/nn/fused.py rope_qkv_ref, flashrt/nn/rope.py apply_rope).
//
// qkv (B, L, H + 2 KV, D), cos / sin (B, L, 1, D) tables (cos = [c | c], signed sin = [-s | s]), all in
// T with the last dim contiguous and any other strides; q (B, L, H, D) contiguous; k_out, v_out
// (B, L, KV, D) with any strides but a contiguous last dim (views of the K/V cache). For dim i the
// rotation pairs x[i] with x[(i + D/2) mod D] (`swap_halves`):
//   out[i] = round_T(round_T(x[i] * cos[i]) + x[(i + D/2) mod D] * sin[i])
// the reference's mul (rounded to T) then addcmul_ (rounded again). v is copied unchanged.
// One block per (b, l) token; threads over the (head, dim) elements of q, k and v.
#include "flashrt_csrc.h"

namespace {

struct Strides4 {
  int64_t b, l, h;  // the last dim is contiguous
};

template <typename T>
__global__ void rope_qkv_kernel(const T* __restrict__ qkv, Strides4 sqkv, const T* __restrict__ cos,
                                const T* __restrict__ sin, Strides4 srope, T* __restrict__ q,
                                T* __restrict__ k_out, Strides4 sk, T* __restrict__ v_out, Strides4 sv,
                                int64_t length, int heads, int kv_heads, int64_t dim) {
  const int64_t b = blockIdx.x / length, l = blockIdx.x % length;
  const T* src = qkv + b * sqkv.b + l * sqkv.l;
  const T* c = cos + b * srope.b + l * srope.l;
  const T* s = sin + b * srope.b + l * srope.l;
  const int64_t half = dim / 2, total = static_cast<int64_t>(heads + 2 * kv_heads) * dim;
  for (int64_t idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int h = static_cast<int>(idx / dim);
    const int64_t i = idx % dim;
    const T* xh = src + h * sqkv.h;
    if (h >= heads + kv_heads) {  // v: copied
      v_out[b * sv.b + l * sv.l + (h - heads - kv_heads) * sv.h + i] = xh[i];
      continue;
    }
    const float x = flashrt::to_f32(xh[i]), partner = flashrt::to_f32(xh[(i + half) % dim]);
    const float a = flashrt::round_to<T>(__fmul_rn(x, flashrt::to_f32(c[i])));
    const T r = flashrt::from_f32<T>(__fadd_rn(a, __fmul_rn(partner, flashrt::to_f32(s[i]))));
    if (h < heads)
      q[((b * length + l) * heads + h) * dim + i] = r;
    else
      k_out[b * sk.b + l * sk.l + (h - heads) * sk.h + i] = r;
  }
}

}  // namespace

// Strides in elements: *_b, *_l, *_h of qkv (B, L, H + 2 KV, D), of cos / sin (B, L, 1, D) (h unused),
// of k_out and v_out (B, L, KV, D). heads may be 0 (q unused).
extern "C" int flashrt_rope_qkv(int dtype, const void* qkv, int64_t qkv_b, int64_t qkv_l, int64_t qkv_h,
                                const void* cos, const void* sin, int64_t rope_b, int64_t rope_l, void* q,
                                void* k_out, int64_t k_b, int64_t k_l, int64_t k_h, void* v_out, int64_t v_b,
                                int64_t v_l, int64_t v_h, int64_t batch, int64_t length, int heads, int kv_heads,
                                int64_t dim, void* stream) {
  if (batch * length == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  const Strides4 sqkv{qkv_b, qkv_l, qkv_h}, srope{rope_b, rope_l, 0}, sk{k_b, k_l, k_h}, sv{v_b, v_l, v_h};
  const int threads = dim * (heads + 2 * kv_heads) >= 256 ? 256 : 128;
  FLASHRT_DISPATCH(dtype, T, {
    rope_qkv_kernel<T><<<static_cast<unsigned>(batch * length), threads, 0, st>>>(
        static_cast<const T*>(qkv), sqkv, static_cast<const T*>(cos), static_cast<const T*>(sin), srope,
        static_cast<T*>(q), static_cast<T*>(k_out), sk, static_cast<T*>(v_out), sv, length, heads, kv_heads,
        dim);
  });
  return static_cast<int>(cudaGetLastError());
}
