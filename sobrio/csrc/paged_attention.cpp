// Paged decode attention on the CPU: one query per sequence, keys and values read in place from the
// block-paged cache (no gather, no padding), float32 accumulation, one task per (sequence, kv head).
// A quantized cache (int8 or fp8 e4m3 rows, one bf16 scale per token and kv head) is read the same way:
// a key's scale multiplies its score, a value's scale its weight, so no row is dequantized in memory.
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using sobrio_vec::to_float;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

#if defined(__AVX512F__)
// bf16 -> fp32, 16 lanes at a time.
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, sobrio_vec::load16(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// int8 -> fp32 (a quantized cache row, before its scale), 16 lanes at a time.
inline void load_row(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, sobrio_vec::load16(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
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

#if defined(__AVX512F__)
inline float exp_and_sum(float* s, int64_t n, float mx) {
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = sobrio_vec::exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = sobrio_vec::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), vmx));
    _mm512_mask_storeu_ps(s + i, mask, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(sum);
}
#else
inline float exp_and_sum(float* s, int64_t n, float mx) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}
#endif

// Scores of `group` queries (float32, pre-scaled) against one key row, times the row's scale.
template <typename T>
inline void score_row(const float* qf, const T* key, float key_scale, float* row, float* out, int64_t group,
                      int64_t n, int64_t dim) {
  load_row(key, row, dim);
  for (int64_t g = 0; g < group; ++g) out[g * n] = key_scale * dot(qf + g * dim, row, dim);
}

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)  // every CPU with AVX512-BF16 has VNNI
// Lane i of the result is the sum of v[i]'s 16 lanes: 16 horizontal sums in 45 shuffles and adds, where
// one `_mm512_reduce_add_ps` each would take about 160. The order of the additions is fixed per lane.
inline __m512 hsum16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// A kD-dim bf16 query head rounded to int16 on its own symmetric scale (max |q| / 32767), as 32 pairs in
// each of `out`; returns the scale.
template <int kD>
inline float quantize_query_int16(const c10::BFloat16* q, __m512i (&out)[kD / 32]) {
  __m512 v[kD / 16], mx = _mm512_setzero_ps();
  for (int j = 0; j < kD / 16; ++j) v[j] = sobrio_vec::load16(q + 16 * j), mx = _mm512_max_ps(mx, _mm512_abs_ps(v[j]));
  const float qs = std::max(_mm512_reduce_max_ps(mx), std::numeric_limits<float>::min()) / 32767.f;
  const __m512 inv = _mm512_set1_ps(1.f / qs);
  __m256i h[kD / 16];
  for (int j = 0; j < kD / 16; ++j) h[j] = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v[j], inv)));
  for (int j = 0; j < kD / 32; ++j) out[j] = _mm512_inserti64x4(_mm512_castsi256_si512(h[2 * j]), h[2 * j + 1], 1);
  return qs;
}

// The common case, bf16 queries with head_dim kD (64 or 128: most models from 1B up; 96: Phi-3-mini's; 256:
// Gemma's) and at most 8 query heads per kv head (or 16): scores by AVX512-BF16 dot products straight from
// the cache rows, 16 keys at a time summed together (`hsum16`), output accumulated in registers, 64 dims a
// pass over the values, 32 where kD is not a multiple of 64 (at 128 dims and 8 heads, one pass would need 64
// registers of sums). A key's score is computed the same way wherever it
// falls in its group of 16 (absent keys are zeros), so a row's result depends on its sequence alone.
// C = int8_t: a quantized cache, with one bf16 scale per row in `ks` / `vs` (indexed like the rows, by
// offset / kD). Each query head is rounded once to int16 on a scale of its own (15 bits: finer than its bf16
// values), and a key row is sign-extended to int16 in registers for VNNI's exact int16 dot products
// (vpdpwssd; |sum| <= 128 * 32767 * 127 < 2^31): no conversion of the row to floats, half the bytes of a bf16
// row read. A key's scale times the query head's multiplies its score, a value's scale its weight.
template <typename C, int kD, int G>
void decode_task(const c10::BFloat16* q, const C* kc, const C* vc, const c10::BFloat16* ks,
                 const c10::BFloat16* vs, const int64_t* table, int64_t block_size, int64_t kv_stride,
                 int64_t start, int64_t ctx, float scale, float softcap, float* scores, c10::BFloat16* out) {
  constexpr bool kQuantized = std::is_same_v<C, int8_t>;
  constexpr int64_t kRowBytes = kD * static_cast<int64_t>(sizeof(C));
  constexpr int kPass = kD % 64 == 0 ? 64 : 32;  // the values' dims a pass (Phi-3-mini's 96: three of 32)
  constexpr int kPassVectors = kPass / 16;
  constexpr int64_t kPassBytes = kPass * static_cast<int64_t>(sizeof(C));
  const int64_t n = ctx - start;
  __m512i qv[G][kD / 32];  // bf16 pairs, or (quantized cache) int16 pairs
  float q_scale[G];
  for (int g = 0; g < G; ++g) {
    if constexpr (kQuantized) {
      q_scale[g] = quantize_query_int16<kD>(q + g * kD, qv[g]);
    } else {
      for (int j = 0; j < kD / 32; ++j) qv[g][j] = _mm512_loadu_si512(q + g * kD + 32 * j);
      q_scale[g] = 1.f;
    }
  }
  // Cache rows in position order from `start`, without a division per row.
  struct Rows {
    const int64_t* table;
    int64_t block_size, stride, block, offset;
    int64_t next() {
      const int64_t slot = table[block] * block_size + offset;
      if (++offset == block_size) offset = 0, ++block;
      return slot * stride;
    }
  };
  const Rows first{table, block_size, kv_stride, start / block_size, start % block_size};
  // The rows are scattered over blocks and the time goes to waiting on memory: fetch the keys 16 rows
  // ahead into L1, and every value row into L2 while its key is used, for the second pass.
  // The second pass fetches its rows into L1 `kValuesAhead` positions ahead (8 left it waiting on memory at
  // long contexts: docs/benchmarks.md).
  constexpr int64_t kValuesAhead = 32;
  Rows key_rows = first, ahead = first;
  int64_t t_ahead = start;
  auto prefetch_next = [&] {
    if (t_ahead++ >= ctx) return;
    const int64_t r = ahead.next();
    for (int64_t b = 0; b < kRowBytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + r) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vc + r) + b, _MM_HINT_T1);
    }
  };
  for (int i = 0; i < 16; ++i) prefetch_next();
  const __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) float key_scales[16];
  // Each head's largest score so far, kept as the scores are made: a scalar pass over them for the max and
  // scalar bf16 stores of the output took about a fifth of a task (docs/benchmarks.md).
  __m512 row_max[G];
  for (int g = 0; g < G; ++g) row_max[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = start; t0 < ctx; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, ctx - t0));
    const __mmask16 present = static_cast<__mmask16>((1u << m) - 1);  // the group's keys among its 16 lanes
    const C* keys[16];
    for (int i = 0; i < m; ++i) {
      const int64_t r = key_rows.next();
      prefetch_next();
      if constexpr (kQuantized) key_scales[i] = sobrio_vec::to_float(ks[r / kD]);
      keys[i] = kc + r;
    }
    const __m512 row_scales = kQuantized ? _mm512_mul_ps(_mm512_maskz_loadu_ps(present, key_scales), vscale) : vscale;
    for (int g = 0; g < G; ++g) {
      __m512 d[16];
      for (int i = 0; i < 16; ++i) {
        if (i >= m) { d[i] = _mm512_setzero_ps(); continue; }
        if constexpr (kQuantized) {
          const auto* row = reinterpret_cast<const __m256i*>(keys[i]);
          __m512i sum = _mm512_setzero_si512();
          for (int j = 0; j < kD / 32; ++j)
            sum = _mm512_dpwssd_epi32(sum, qv[g][j], _mm512_cvtepi8_epi16(_mm256_loadu_si256(row + j)));
          d[i] = _mm512_cvtepi32_ps(sum);
        } else {
          d[i] = _mm512_setzero_ps();
          for (int j = 0; j < kD / 32; ++j)
            d[i] = _mm512_dpbf16_ps(d[i], (__m512bh)qv[g][j], (__m512bh)_mm512_loadu_si512(keys[i] + 32 * j));
        }
      }
      const __m512 head_scales = kQuantized ? _mm512_mul_ps(row_scales, _mm512_set1_ps(q_scale[g])) : row_scales;
      __m512 s = _mm512_mul_ps(hsum16(d), head_scales);
      if (softcap > 0) s = sobrio_vec::softcap512(s, softcap);  // Gemma 2
      _mm512_mask_storeu_ps(scores + g * n + (t0 - start), present, s);
      row_max[g] = _mm512_mask_max_ps(row_max[g], present, row_max[g], s);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    inv[g] = 1.f / exp_and_sum(sg, n, _mm512_reduce_max_ps(row_max[g]));
  }
  for (int64_t dim0 = 0; dim0 < kD; dim0 += kPass) {
    __m512 acc[G][kPassVectors];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < kPassVectors; ++j) acc[g][j] = _mm512_setzero_ps();
    Rows value_rows = first, value_ahead = first;
    for (int64_t t = start; t < std::min<int64_t>(ctx, start + kValuesAhead); ++t) value_ahead.next();
    for (int64_t t = start; t < ctx; ++t) {
      if (t + kValuesAhead < ctx) {
        const char* ahead_row = reinterpret_cast<const char*>(vc + value_ahead.next() + dim0);
        for (int64_t b = 0; b < kPassBytes; b += 64) _mm_prefetch(ahead_row + b, _MM_HINT_T0);
      }
      const int64_t r = value_rows.next();
      __m512 vf[kPassVectors];
      for (int j = 0; j < kPassVectors; ++j) vf[j] = sobrio_vec::load16(vc + r + dim0 + 16 * j);
      const float value_scale = kQuantized ? sobrio_vec::to_float(vs[r / kD]) : 1.f;
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * n + (t - start)] * value_scale);
        for (int j = 0; j < kPassVectors; ++j) acc[g][j] = _mm512_fmadd_ps(p, vf[j], acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)  // rounded to bf16 16 lanes at a time (see `row_max` for what a scalar loop cost)
      for (int j = 0; j < kPassVectors; ++j)
        sobrio_vec::store16(out + g * kD + dim0 + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));
  }
}

// Where each thread's (sequence, kv head) tasks start, so each gets about as many key rows: the first
// task of thread t is the first whose rows before it reach t / n of them; one thread below `min_rows`.
inline std::vector<int64_t> split_by_rows(const int64_t* lens, int64_t batch, int64_t kv_heads, int64_t window,
                                          int64_t min_rows) {
  std::vector<int64_t> before(batch + 1, 0);  // key rows of the sequences before b, one kv head
  for (int64_t b = 0; b < batch; ++b)
    before[b + 1] = before[b] + (window > 0 ? std::min<int64_t>(lens[b], window) : lens[b]);
  const int64_t rows = before[batch] * kv_heads, tasks = batch * kv_heads;
  const int64_t threads = rows < min_rows ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  std::vector<int64_t> split(threads + 1, tasks);
  split[0] = 0;
  auto rows_before = [&](int64_t task) {  // task = b * kv_heads + kv head
    const int64_t b = task / kv_heads;
    return before[b] * kv_heads + (task % kv_heads) * (before[b + 1] - before[b]);
  };
  int64_t task = 0;
  for (int64_t t = 1; t < threads; ++t) {
    while (task < tasks && rows_before(task) < rows * t / threads) ++task;
    split[t] = task;
  }
  return split;
}

template <typename C>
using FastTask = void (*)(const c10::BFloat16*, const C*, const C*, const c10::BFloat16*, const c10::BFloat16*,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, float, float, float*, c10::BFloat16*);
// The task for head_dim kD and G query heads a kv head (1 to 8, and 16: GLM-4's 32 heads over 2), null for
// the group sizes without one.
constexpr int64_t kMaxFastGroup = 16;
template <typename C, int kD>
constexpr FastTask<C> kFastTasks[kMaxFastGroup + 1] = {
    nullptr, decode_task<C, kD, 1>, decode_task<C, kD, 2>, decode_task<C, kD, 3>, decode_task<C, kD, 4>,
    decode_task<C, kD, 5>, decode_task<C, kD, 6>, decode_task<C, kD, 7>, decode_task<C, kD, 8>,
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, decode_task<C, kD, 16>};

// C: the cache's rows, bf16 or int8 (then with `key_scales` / `value_scales`, else null).
template <typename C>
bool decode_fast(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                 int64_t block_size, double scale, int64_t window, double softcap, const c10::BFloat16* key_scales,
                 const c10::BFloat16* value_scales) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  if (query.scalar_type() != at::kBFloat16 || (dim != 64 && dim != 96 && dim != 128 && dim != 256) ||
      group > kMaxFastGroup)
    return false;
  const FastTask<C> task_of_group = dim == 64    ? kFastTasks<C, 64>[group]
                                    : dim == 96  ? kFastTasks<C, 96>[group]
                                    : dim == 128 ? kFastTasks<C, 128>[group]
                                                 : kFastTasks<C, 256>[group];
  if (task_of_group == nullptr) return false;
  const auto* q = query.data_ptr<c10::BFloat16>();
  const C* kc = key_cache.data_ptr<C>();
  const C* vc = value_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  auto* o = out.data_ptr<c10::BFloat16>();
  // Tasks go to the threads by their key rows, not their count (a batch's contexts differ). Below 512 key
  // rows the other thread's start costs more than it takes (a batch-1 decode of under ~170 positions):
  // those stay inline. SmolLM2 batch 1 (3 kv heads), `benchmarks/attention_backends.py --seqs 1 --min-ctx C
  // --max-ctx C+1`: 300 positions 0.036 -> 0.027-0.029 ms a layer, 1,000 0.057 -> 0.046-0.056, against
  // 4,096 rows inline before (the threads then spin in a fused decode step, models/fused_decode.py).
  const std::vector<int64_t> split = split_by_rows(lens, batch, kv_heads, window, 512);
  at::parallel_for(0, static_cast<int64_t>(split.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t task = split[first]; task < split[last]; ++task) {
      const int64_t b = task / kv_heads, kh = task % kv_heads, ctx = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      scores.resize(group * (ctx - start));
      const int64_t first = (b * heads + kh * group) * dim;
      // Scales are indexed by row offset / dim: shifted by kh here, as the rows are by kh * dim.
      task_of_group(q + first, kc + kh * dim, vc + kh * dim, key_scales ? key_scales + kh : nullptr,
                           value_scales ? value_scales + kh : nullptr, tables + b * max_blocks, block_size,
                           kv_heads * dim, start, ctx, static_cast<float>(scale), static_cast<float>(softcap),
                           scores.data(), o + first);
    }
  });
  return true;
}
#else
template <typename C>
bool decode_fast(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const at::Tensor&, at::Tensor&, int64_t, double, int64_t, double, const c10::BFloat16*,
                 const c10::BFloat16*) {
  return false;
}
#endif

// Each 64-byte line of [p, p + bytes) towards L1 (level 0) or L2 (level 1).
inline void prefetch_bytes(const void* p, int64_t bytes, int level) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (level == 0) __builtin_prefetch(c + off, 0, 3);
    else __builtin_prefetch(c + off, 0, 2);
  }
}

// T: the query's and output's type; C: the cache's (T itself, or int8 / fp8 with per-row scales).
template <typename T, typename C>
void decode_kernel(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
                   int64_t block_size, double scale, int64_t window, double softcap,
                   const c10::BFloat16* key_scales, const c10::BFloat16* value_scales) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const T* q = query.data_ptr<T>();
  const C* kc = key_cache.data_ptr<C>();
  const C* vc = value_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), scores, denom(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kh = task % kv_heads;
      const int64_t ctx = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - start;
      const int64_t* table = tables + b * max_blocks;
      auto index_of = [&](int64_t t) { return (table[t / block_size] * block_size + t % block_size) * kv_heads + kh; };
      auto row_of = [&](const C* cache, int64_t t) { return cache + index_of(t) * dim; };
      auto scale_of = [&](const c10::BFloat16* scales, int64_t t) {
        return scales == nullptr ? 1.f : sobrio_vec::to_float(scales[index_of(t)]);
      };
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q + (b * heads + kh * group + g) * dim, qf.data() + g * dim, dim);
        for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] *= static_cast<float>(scale);
      }
      // Scattered rows: fetch each key row 4 ahead, and its value row into L2 for the second pass.
      const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(C));
      for (int64_t t = start; t < ctx; ++t) {
        if (t + 4 < ctx) {
          prefetch_bytes(row_of(kc, t + 4), row_bytes, 0);
          prefetch_bytes(row_of(vc, t + 4), row_bytes, 1);
        }
        score_row(qf.data(), row_of(kc, t), scale_of(key_scales, t), row.data(), scores.data() + (t - start), group,
                  n, dim);
      }
      if (softcap > 0)  // Gemma 2: each scaled score s becomes cap * tanh(s / cap)
        for (float& s : scores) s = static_cast<float>(softcap * std::tanh(s / softcap));
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        denom[g] = exp_and_sum(s, n, *std::max_element(s, s + n));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < ctx; ++t) {
        if (t + 4 < ctx) prefetch_bytes(row_of(vc, t + 4), row_bytes, 0);
        load_row(row_of(vc, t), row.data(), dim);
        const float value_scale = scale_of(value_scales, t);
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * n + (t - start)] * value_scale, row.data(), acc.data() + g * dim, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o + (b * heads + kh * group + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<T>(acc[g * dim + i] * inv);
      }
    }
  });
}

// A quantized cache: int8 or fp8 rows, with `[num_slots, Hkv]` bf16 scales for keys and values.
template <typename T>
void decode_quantized(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, int64_t block_size,
                      double scale, int64_t window, double softcap, const at::Tensor& key_scales,
                      const at::Tensor& value_scales) {
  TORCH_CHECK(key_scales.scalar_type() == at::kBFloat16 && value_scales.scalar_type() == at::kBFloat16 &&
                  key_scales.is_contiguous() && value_scales.is_contiguous() &&
                  key_scales.numel() * key_cache.size(2) == key_cache.numel() &&
                  value_scales.numel() * value_cache.size(2) == value_cache.numel(),
              "paged_decode_attention: contiguous bf16 scales, one per cache row");
  const auto* ks = key_scales.data_ptr<c10::BFloat16>();
  const auto* vs = value_scales.data_ptr<c10::BFloat16>();
  if (key_cache.scalar_type() == at::kChar &&
      decode_fast<int8_t>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window, softcap, ks,
                          vs))
    return;
  if (key_cache.scalar_type() == at::kChar)
    decode_kernel<T, int8_t>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window, softcap, ks,
                             vs);
  else
    decode_kernel<T, c10::Float8_e4m3fn>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window,
                                         softcap, ks, vs);
}

}  // namespace

namespace sobrio_ops {

// query [B, H, D]; key_cache / value_cache [num_slots, Hkv, D]; block_tables [B, max_blocks] int64;
// context_lens [B] int64; window <= 0 means full attention. A cache of int8 or fp8 e4m3 rows comes with
// key_scales / value_scales [num_slots, Hkv] (bf16). softcap > 0: each scaled score s becomes
// softcap * tanh(s / softcap) before the softmax (Gemma 2). Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor context_lens, int64_t block_size,
                                  double scale, int64_t window, std::optional<at::Tensor> key_scales,
                                  std::optional<at::Tensor> value_scales, double softcap) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "keys and values of one cache dtype");
  const bool quantized = key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized ? key_scales.has_value() && value_scales.has_value() :
                          key_cache.scalar_type() == query.scalar_type() && !key_scales.has_value(),
              "paged_decode_attention: an int8/fp8 cache with its scales, or a cache of the query's dtype");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty_like(query);
  if (!quantized && key_cache.scalar_type() == at::kBFloat16 &&
      decode_fast<c10::BFloat16>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window,
                                 softcap, nullptr, nullptr))
    return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    if (quantized)
      decode_quantized<scalar_t>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window,
                                 softcap, *key_scales, *value_scales);
    else
      decode_kernel<scalar_t, scalar_t>(query, key_cache, value_cache, tables, lens, out, block_size, scale, window,
                                        softcap, nullptr, nullptr);
  });
  return out;
}

}  // namespace sobrio_ops
