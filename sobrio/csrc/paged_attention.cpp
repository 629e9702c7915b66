// Paged decode attention on the CPU: one query per sequence, keys and values read in place from the
// block-paged cache (no gather, no padding), float32 accumulation, one task per (sequence, kv head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

#if defined(__AVX512F__)
// bf16 -> fp32 is a 16-bit left shift; 16 lanes at a time.
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  const __m512 va = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
#endif

// exp over a row, written so the compiler can use its vector math library.
inline float exp_and_sum(float* s, int64_t n, float mx) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

template <typename T>
void decode_kernel(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                   const torch::Tensor& block_tables, const torch::Tensor& context_lens, torch::Tensor& out,
                   int64_t block_size, double scale, int64_t window) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kh = task % kv_heads;
      const int64_t ctx = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - start;
      scores.assign(group * n, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q + (b * heads + kh * group + g) * dim, qf.data() + g * dim, dim);
        for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] *= static_cast<float>(scale);
      }
      for (int64_t t = start; t < ctx; ++t) {
        const int64_t slot = tables[b * max_blocks + t / block_size] * block_size + t % block_size;
        load_row(kc + (slot * kv_heads + kh) * dim, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) scores[g * n + (t - start)] = dot(qf.data() + g * dim, row.data(), dim);
      }
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        denom[g] = exp_and_sum(s, n, *std::max_element(s, s + n));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < ctx; ++t) {
        const int64_t slot = tables[b * max_blocks + t / block_size] * block_size + t % block_size;
        load_row(vc + (slot * kv_heads + kh) * dim, row.data(), dim);
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * n + (t - start)], row.data(), acc.data() + g * dim, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o + (b * heads + kh * group + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<T>(acc[g * dim + i] * inv);
      }
    }
  });
}

// query [B, H, D]; key_cache / value_cache [num_slots, Hkv, D]; block_tables [B, max_blocks] int64;
// context_lens [B] int64; window <= 0 means full attention. Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong);
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window);
  });
  return out;
}

}  // namespace

void register_cpu_ops(pybind11::module& m);  // cpu_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  register_cpu_ops(m);
}
