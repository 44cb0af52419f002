// flashrt CPU torch op: the attention of one decode token per row over that row's own keys.
//
//   flashrt_cpu::decode_attention(q, k, v, position, scale) -> out
//   q (B, 1, H, D) float32; k, v (B, KV, S, D) float32 views of a K/V cache (any strides, D contiguous);
//   position (B,) int64; out (B, 1, H*D) float32, new.
//   Row b, head h (group g = h / (H / KV)): softmax over keys j <= position[b] (clamped to [0, S)) of
//   scale * q . k_j, times v_j. Exactly what SDPA computes under `decode_bias` (the keys past the
//   position masked), without reading those keys.
//
// Why: in a slot-batched decode step (`flashrt.runtime.slots`) every row is a request at its own
// position. SDPA's CPU flash kernel runs each (row, K/V head) as small GEMMs with per-call overhead, over
// the whole key bucket; here each (row, K/V head) is one pass over its own keys: scores of 16 keys at a
// time (a product vector per key, reduced across lanes by a shuffle tree), an exact softmax (max
// subtracted; a vectorized exp, Cephes' expf polynomial, <= 2 ulp on the softmax's range), the weighted
// sum of the values. Accuracy against a float64 softmax is SDPA's (tests/ops/test_torch_cpu.py).
//
// Threads: the caller's torch intra-op setting (`torch.set_num_threads`, a stage's `threads`); a large
// call is split over rows x K/V heads on torch's inter-op pool (torch's OpenMP loop is a header
// template that would bring a second OpenMP runtime), a small one (the tiny LM's steps) runs on the
// calling thread. Summation order is fixed: a row's result does not depend on its neighbours, the key
// bucket or the split.
//
// Built against the running torch's headers by `flashrt.ops.torch_cpu` (g++/clang++ -O3 -march=native,
// C++20); the op registers itself when the library is loaded.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <vector>

#define FLASHRT_TORCH_CPU_ABI 1

extern "C" int flashrt_torch_cpu_abi() { return FLASHRT_TORCH_CPU_ABI; }

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

constexpr int64_t MAX_GROUP = 16;  // query heads per K/V head
constexpr int64_t MAX_DIM = 256;   // head_dim (a multiple of 16)

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(v16 v) {  // a fixed pairwise order
  float s[16];
  std::memcpy(s, &v, sizeof s);
  for (int w = 8; w; w >>= 1)
    for (int i = 0; i < w; ++i) s[i] += s[i + w];
  return s[0];
}

inline float hmax(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// One level of the transpose-reduce: ``a`` holds vectors [0, W) and ``b`` vectors [W, 2W), lane l of
// each the partial sum of vector (l % W) over a block of lanes; out lane l: vector l % 2W over twice the
// lanes. After W = 1, 2, 4, 8 lane j holds the sum of all lanes of vector j.
template <int W>
inline v16 combine(v16 a, v16 b) {
  i16 first, second;
  for (int l = 0; l < 16; ++l) {
    const int idx = l % (2 * W), base = l - idx;
    first[l] = idx < W ? base + idx : 16 + base + idx - W;
    second[l] = idx < W ? base + W + idx : 16 + base + idx;
  }
  return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
}

// p[0..16) -> lane j: the sum of p[j]'s lanes
inline v16 reduce16(const v16* p) {
  v16 l1[8], l2[4], l3[2];
  for (int i = 0; i < 8; ++i) l1[i] = combine<1>(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) l2[i] = combine<2>(l1[2 * i], l1[2 * i + 1]);
  for (int i = 0; i < 2; ++i) l3[i] = combine<4>(l2[2 * i], l2[2 * i + 1]);
  return combine<8>(l3[0], l3[1]);
}

// e^x for x <= 0 (Cephes expf: 2^n p(r), |r| <= ln2 / 2), x clamped at -87 (e^-87 ~ 1.6e-38, normal)
inline v16 exp16(v16 x) {
  const v16 floor_ = (v16){} - 87.0f;
  x = x < floor_ ? floor_ : x;
  const i16 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16);  // nearest (x <= 0)
  const v16 fn = __builtin_convertvector(n, v16);
  v16 r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16 bits = (n + 127) << 23;
  return p * (v16)bits;
}

inline v16 dot_product_lanes(const float* q, const float* k, int64_t dim) {
  v16 a = load16(q) * load16(k);
  for (int64_t d = 16; d < dim; d += 16) a += load16(q + d) * load16(k + d);
  return a;
}

// out[0, 16 C) = scale * sum_j w_j v_j[0, 16 C), the accumulators in registers, j in order
template <int C>
inline void weighted_sum(const float* w, const float* values, int64_t stride, int64_t n, float scale,
                         float* out) {
  v16 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = (v16){};
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < C; ++c) acc[c] += w[j] * load16(values + j * stride + 16 * c);
  for (int c = 0; c < C; ++c) store16(out + 16 * c, acc[c] * scale);
}

struct Shape {
  int64_t heads, dim, kv_heads, keys, group;
};

// One (row, K/V head): its G queries (pre-scaled) over its n keys -> out rows (G, D)
void attend_row(const float* q, const float* keys, int64_t key_stride, const float* values,
                int64_t value_stride, int64_t n, const Shape& s, float* scores, int64_t padded,
                float* out) {
  const int64_t full = n / 16 * 16, blocks = (n + 15) / 16, dim = s.dim;
  for (int64_t g = 0; g < s.group; ++g) {
    const float* qg = q + g * dim;
    float* row = scores + g * padded;
    v16 prod[16];
    for (int64_t j0 = 0; j0 < full; j0 += 16) {
      for (int j = 0; j < 16; ++j) prod[j] = dot_product_lanes(qg, keys + (j0 + j) * key_stride, dim);
      store16(row + j0, reduce16(prod));
    }
    for (int64_t j = full; j < n; ++j) row[j] = hsum(dot_product_lanes(qg, keys + j * key_stride, dim));
    for (int64_t j = n; j < blocks * 16; ++j) row[j] = -3.0e38f;
  }
  float inverse[MAX_GROUP];
  for (int64_t g = 0; g < s.group; ++g) {
    float* row = scores + g * padded;
    v16 m = load16(row);
    for (int64_t c = 1; c < blocks; ++c) {
      const v16 x = load16(row + 16 * c);
      m = x > m ? x : m;
    }
    const float top = hmax(m);
    v16 total = {};
    for (int64_t c = 0; c < blocks; ++c) {
      const v16 x = load16(row + 16 * c);
      v16 e = exp16(x - top);
      e = x < -1.0e38f ? (v16){} : e;  // the padding past n
      store16(row + 16 * c, e);
      total += e;
    }
    inverse[g] = 1.0f / hsum(total);
  }
  for (int64_t g = 0; g < s.group; ++g) {
    const float* weights = scores + g * padded;
    int64_t c = 0;
    float* o = out + g * dim;
    for (; c + 4 <= dim / 16; c += 4)
      weighted_sum<4>(weights, values + 16 * c, value_stride, n, inverse[g], o + 16 * c);
    for (; c < dim / 16; ++c)
      weighted_sum<1>(weights, values + 16 * c, value_stride, n, inverse[g], o + 16 * c);
  }
}

constexpr double PARALLEL_WORK = 1 << 20;  // rows x heads x keys x dim below which one thread runs it all

// fn(begin, end) over [0, tasks): on the calling thread, or, where torch's intra-op setting allows more
// threads and the work is large enough, split into that many contiguous ranges, all but the first run on
// torch's inter-op pool (`at::launch`). Each (row, K/V head) is computed by the same code either way, so
// the result does not depend on the split.
template <typename Fn>
void run_split(int64_t tasks, double work, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  if (threads < 2 || work < PARALLEL_WORK || at::in_parallel_region()) {
    fn(0, tasks);
    return;
  }
  const int64_t chunk = (tasks + threads - 1) / threads;
  std::mutex mutex;
  std::condition_variable done;
  int64_t left = 0;
  std::exception_ptr error;
  for (int64_t begin = chunk; begin < tasks; begin += chunk) {
    const int64_t end = std::min(tasks, begin + chunk);
    {
      std::lock_guard<std::mutex> lock(mutex);
      ++left;
    }
    at::launch([&, begin, end] {
      std::exception_ptr failed;
      try {
        fn(begin, end);
      } catch (...) {
        failed = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (failed && !error) error = failed;
      if (--left == 0) done.notify_one();
    });
  }
  fn(0, std::min(tasks, chunk));
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [&] { return left == 0; });
  if (error) std::rethrow_exception(error);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& position, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(1) == 1, "decode_attention: q must be (B, 1, H, D), got ", q.sizes());
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(),
              "decode_attention: k, v must be (B, KV, S, D) alike, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode_attention: float32 q, k, v only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && position.device().is_cpu(),
              "decode_attention: CPU tensors only");
  const int64_t heads = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3) && kv_heads > 0 && heads % kv_heads == 0,
              "decode_attention: q ", q.sizes(), " does not match k ", k.sizes());
  const Shape s{heads, q.size(3), kv_heads, k.size(2), heads / kv_heads};
  const int64_t group = s.group;
  TORCH_CHECK(s.dim % 16 == 0 && s.dim <= MAX_DIM && group <= MAX_GROUP && s.keys > 0,
              "decode_attention: head_dim a multiple of 16 up to ", MAX_DIM, ", at most ", MAX_GROUP,
              " query heads per K/V head, keys > 0");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: head_dim must be dense");
  TORCH_CHECK(position.scalar_type() == at::kLong && position.numel() == q.size(0),
              "decode_attention: position must be (B,) int64");
  const int64_t rows = q.size(0), padded = (s.keys + 15) / 16 * 16;
  const at::Tensor pos = position.contiguous();
  at::Tensor out = at::empty({rows, 1, s.heads * s.dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // rows x K/V heads [begin, end), with this task's own scratch
  auto attend_range = [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * padded), queries(group * s.dim);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.kv_heads, h = bh % s.kv_heads;
      int64_t n = pp[b] + 1;
      n = n < 1 ? 1 : (n > s.keys ? s.keys : n);
      for (int64_t g = 0; g < group; ++g) {
        const float* src = qp + b * q.stride(0) + (h * group + g) * q.stride(2);
        for (int64_t d = 0; d < s.dim; ++d) queries[g * s.dim + d] = src[d] * static_cast<float>(scale);
      }
      attend_row(queries.data(), kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
                 vp + b * v.stride(0) + h * v.stride(1), v.stride(2), n, s, scores.data(), padded,
                 op + b * s.heads * s.dim + h * group * s.dim);
    }
  };
  run_split(rows * s.kv_heads, static_cast<double>(rows) * s.heads * s.keys * s.dim, attend_range);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashrt_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor position, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashrt_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
