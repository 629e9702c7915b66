// Small fused CPU operators for the decode path, where one aten call per elementwise step costs more
// than the arithmetic: a bandwidth-bound bf16 GEMV for few-row matmuls (which, blocked for any row count,
// is also the batch-invariant matmul), RMSNorm (optionally fused with the residual add), rotary embedding
// in place, and gated activations. Each matches the PyTorch reference it replaces in rounding order
// (float32 math, one rounding to the storage dtype per value that PyTorch would round), so the reference
// path stays the specification. Each computes a row alone, in an order that does not depend on the other
// rows or on the threads, which `--batch-invariant` relies on.
#include "ops.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using sobrio_ops::row_grain;
using sobrio_vec::to_float;
template <typename T>
inline float round_to(float x) { return to_float(static_cast<T>(x)); }

// ---------------------------------------------------------------------------------------------------
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32 accumulation, one rounding to the dtype per output.
// Each output element is one dot product computed in one order whatever M is: two accumulators of 16
// float lanes over alternate K steps (16 elements a step in fp32 lanes, 32 as bf16 pairs), the K tail
// into the first, one fixed horizontal sum, then the bias; never split across threads (parallel over N). So a row's result does not depend on the rows
// beside it, and the few-row GEMV of the default path (bf16, M <= 4: the weight matrix streamed from
// memory once, which bounds a decode step) and the batch-invariant linear (any M) are one kernel.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SOBRIO_LINEAR 1

inline __mmask16 mask16(int64_t remaining) {
  return remaining <= 0 ? 0 : static_cast<__mmask16>((1u << std::min<int64_t>(remaining, 16)) - 1);
}
inline __m256i load16_raw(const void* p, int64_t remaining) {
  return remaining >= 16 ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                         : _mm256_maskz_loadu_epi16(mask16(remaining), p);
}

// The float32 vector the kernel accumulates in: 16 lanes here, 8 on AVX2 (below).
struct Lanes {
  using F = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr bool kPairs = true;  // 32 registers: two weight rows per tile past 4 input rows
  static F zero() { return _mm512_setzero_ps(); }
  static F fmadd(F acc, F x, F w) { return _mm512_fmadd_ps(x, w, acc); }
  static float sum(F a, F b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
  static F load(const float* p, int64_t remaining) {
    return remaining >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask16(remaining), p);
  }
  static F load(const c10::BFloat16* p, int64_t remaining) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16_raw(p, remaining)), 16));
  }
  static F load(const c10::Half* p, int64_t remaining) { return _mm512_cvtph_ps(load16_raw(p, remaining)); }
};

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SOBRIO_LINEAR 1

// AVX2 without AVX-512 (AMD Zen 2/3, older Intel): 8 float lanes, 16 registers. There MKL's float32 matmul
// reads a weight that does not fit the cache at a third of the memory bandwidth for one row and at a sixth
// for 2-16; this kernel streams it once for up to 4 rows, in L2-sized blocks past that, and layers/linear.py
// sends it float32 matmuls of up to 48 rows (`benchmarks/linear_kernels.py --dtype float32`).
struct Lanes {
  using F = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr bool kPairs = false;  // 16 registers: 4 rows x 2 accumulators x 2 weight rows would spill
  static F zero() { return _mm256_setzero_ps(); }
  static F fmadd(F acc, F x, F w) { return _mm256_fmadd_ps(x, w, acc); }
  static float sum(F a, F b) {
    const __m256 s = _mm256_add_ps(a, b);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
  static F load(const float* p, int64_t remaining) {
    if (remaining >= 8) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(remaining, 0))), lanes));
  }
  static __m128i load8_raw(const void* p, int64_t remaining) {
    if (remaining >= 8) return _mm_loadu_si128(static_cast<const __m128i*>(p));
    uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (remaining > 0) std::memcpy(buf, p, remaining * sizeof(uint16_t));
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
  }
  static F load(const c10::BFloat16* p, int64_t remaining) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load8_raw(p, remaining)), 16));
  }
  static F load(const c10::Half* p, int64_t remaining) { return _mm256_cvtph_ps(load8_raw(p, remaining)); }
};
#endif

#if defined(SOBRIO_LINEAR)
// float32 lanes, one FMA per element; bf16 and fp16 are widened on load.
template <typename T_>
struct LaneDot {
  using T = T_;
  using V = Lanes::F;
  static constexpr int64_t kStep = Lanes::kWidth;
  static V load(const T* p, int64_t remaining) { return Lanes::load(p, remaining); }
  static V madd(V acc, V x, V w) { return Lanes::fmadd(acc, x, w); }
};

#if defined(__AVX512BF16__)
// AVX512-BF16: each lane adds a pair of bf16 products, 32 elements a step.
struct PairDotBf16 {
  using T = c10::BFloat16;
  using V = __m512bh;
  static constexpr int64_t kStep = 32;
  static __m512bh load(const T* p, int64_t remaining) {
    if (remaining >= 32) return (__m512bh)_mm512_loadu_si512(p);
    const __mmask32 mask = (remaining <= 0) ? 0 : static_cast<__mmask32>((1ull << remaining) - 1);
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
  }
  static __m512 madd(__m512 acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// kM input rows against kN weight rows at a time, the weight rows front to back (one sequential stream
// the hardware prefetcher follows). The per-element order is the same for every kM and kN.
template <class Dot, int kM, int kN>
void linear_tile(const typename Dot::T* x, const typename Dot::T* w, const typename Dot::T* bias,
                 typename Dot::T* y, int64_t N, int64_t K, int64_t n_begin, int64_t n_end) {
  using T = typename Dot::T;
  constexpr int64_t S = Dot::kStep;
  for (int64_t n = n_begin; n + kN <= n_end; n += kN) {
    Lanes::F a0[kM][kN], a1[kM][kN];
    for (int m = 0; m < kM; ++m)
      for (int j = 0; j < kN; ++j) a0[m][j] = a1[m][j] = Lanes::zero();
    int64_t k = 0;
    for (; k + 2 * S <= K; k += 2 * S) {
      typename Dot::V w0[kN], w1[kN];
      for (int j = 0; j < kN; ++j) w0[j] = Dot::load(w + (n + j) * K + k, S), w1[j] = Dot::load(w + (n + j) * K + k + S, S);
      for (int m = 0; m < kM; ++m) {
        const auto x0 = Dot::load(x + m * K + k, S), x1 = Dot::load(x + m * K + k + S, S);
        for (int j = 0; j < kN; ++j) a0[m][j] = Dot::madd(a0[m][j], x0, w0[j]), a1[m][j] = Dot::madd(a1[m][j], x1, w1[j]);
      }
    }
    for (; k < K; k += S) {
      for (int m = 0; m < kM; ++m) {
        const auto x0 = Dot::load(x + m * K + k, K - k);
        for (int j = 0; j < kN; ++j) a0[m][j] = Dot::madd(a0[m][j], x0, Dot::load(w + (n + j) * K + k, K - k));
      }
    }
    for (int j = 0; j < kN; ++j) {
      const float b = bias ? to_float(bias[n + j]) : 0.f;
      for (int m = 0; m < kM; ++m) y[m * N + n + j] = static_cast<T>(Lanes::sum(a0[m][j], a1[m][j]) + b);
    }
  }
}

// Up to 4 rows: one pass over the weight rows. Past 4 rows the weight rows go in blocks that stay in L2
// while every group of 4 input rows passes over them, two weight rows at a time (more products per load).
template <class Dot, int kM>
void linear_rows(const typename Dot::T* x, const typename Dot::T* w, const typename Dot::T* bias,
                 typename Dot::T* y, int64_t N, int64_t K, int64_t begin, int64_t end, bool pairs) {
  if (!pairs) return linear_tile<Dot, kM, 1>(x, w, bias, y, N, K, begin, end);
  linear_tile<Dot, kM, 2>(x, w, bias, y, N, K, begin, end);
  if ((end - begin) % 2) linear_tile<Dot, kM, 1>(x, w, bias, y, N, K, end - 1, end);
}

template <class Dot>
void linear_block(const typename Dot::T* x, const typename Dot::T* w, const typename Dot::T* bias,
                  typename Dot::T* y, int64_t M, int64_t N, int64_t K, int64_t begin, int64_t end) {
  const bool many = M > 4;
  const bool pairs = many && Lanes::kPairs;
  const int64_t block = many ? std::max<int64_t>(8, (256 << 10) / (K * sizeof(typename Dot::T))) : end - begin;
  for (int64_t nb = begin; nb < end; nb += block) {
    const int64_t ne = std::min(end, nb + block);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) linear_rows<Dot, 4>(x + m * K, w, bias, y + m * N, N, K, nb, ne, pairs);
    if (M - m == 3) linear_rows<Dot, 3>(x + m * K, w, bias, y + m * N, N, K, nb, ne, pairs);
    if (M - m == 2) linear_rows<Dot, 2>(x + m * K, w, bias, y + m * N, N, K, nb, ne, pairs);
    if (M - m == 1) linear_rows<Dot, 1>(x + m * K, w, bias, y + m * N, N, K, nb, ne, pairs);
  }
}

template <class Dot>
at::Tensor linear_run(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  using T = typename Dot::T;
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = xc.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const T* b = nullptr;
  at::Tensor bc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == x.scalar_type() && bc.numel() == N, "bias: x's dtype, [N]");
    b = bc.data_ptr<T>();
  }
  const T* xp = xc.data_ptr<T>();
  const T* wp = wc.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // Split past ~512 KB of weights (per group of 4 rows) a thread: one core alone streams the weights at
  // about half the memory bandwidth two reach, so a batch-1 decode step takes 23 ms split against 41 ms on
  // one thread (SmolLM2-135M, Xeon with AMX), and 29 against 38 ms through HTTP, where the API process and
  // its client share the cores. Smaller pieces (64 KB) gain nothing more.
  const int64_t grain = std::max<int64_t>(1, (512 << 10) / (K * static_cast<int64_t>(sizeof(T))) / ((M + 3) / 4));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { linear_block<Dot>(xp, wp, b, yp, M, N, K, begin, end); });
  return y;
}
#endif  // SOBRIO_LINEAR: AVX-512 F / BW / VL or AVX2

void check_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w: one dtype");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes: x [M, K], w [N, K]");
}

#if defined(SOBRIO_LINEAR)
// Routed experts (layers/moe.py): x's rows come grouped by expert, group g = rows offsets[g] .. offsets[g+1]
// through expert ids[g]'s weight w[ids[g]] ([E, N, K]). Every group's blocks of weight rows share one parallel
// region: a decode step's 8-80 small matmuls per layer were as many regions (and Python calls) before. Each
// row's result is the batch-invariant kernel's, whatever the group sizes.
template <class Dot>
at::Tensor expert_linear_run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids,
                             const at::Tensor& offsets) {
  using T = typename Dot::T;
  auto xc = x.contiguous();
  const int64_t groups = ids.size(0), N = w.size(1), K = w.size(2);
  auto y = at::empty({xc.size(0), N}, x.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t block = std::max<int64_t>(16, (256 << 10) / (K * static_cast<int64_t>(sizeof(T))));
  const int64_t blocks = (N + block - 1) / block;
  const T* xp = xc.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, n0 = (item % blocks) * block, rows = off[g + 1] - off[g];
      if (rows > 0)
        linear_block<Dot>(xp + off[g] * K, wp + id[g] * N * K, nullptr, yp + off[g] * N, rows, N, K, n0,
                          std::min(N, n0 + block));
    }
  });
  return y;
}
#endif

// ---------------------------------------------------------------------------------------------------
// RMSNorm over the last dimension. Llama (offset 0): w * bf16(x / rms) with the product rounded once,
// as `weight * x.to(dtype)`. Gemma (offset 1): (x / rms) * (1 + w) in float32, rounded once.
// With a residual: residual = x + residual (rounded to the dtype), then the norm of that sum.
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t dim, double eps, bool gemma) {
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      float sq = 0.f;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      __m512 sqv = _mm512_setzero_ps();
      if constexpr (sobrio_vec::kVectorized<T>) for (; i + 16 <= dim; i += 16) {
        __m512 v = sobrio_vec::load16(xr + i);
        if (residual) {
          v = sobrio_vec::round16<T>(_mm512_add_ps(v, sobrio_vec::load16(residual + r * dim + i)));
          sobrio_vec::store16(residual + r * dim + i, v);
        }
        _mm512_storeu_ps(buf.data() + i, v);
        sqv = _mm512_fmadd_ps(v, v, sqv);
      }
      sq = _mm512_reduce_add_ps(sqv);
#endif
      for (; i < dim; ++i) {
        float v = to_float(xr[i]);
        if (residual) {
          v = round_to<T>(v + to_float(residual[r * dim + i]));
          residual[r * dim + i] = static_cast<T>(v);
        }
        buf[i] = v;
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      i = 0;
#if defined(__AVX512BF16__)
      const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
      if constexpr (sobrio_vec::kVectorized<T>) for (; i + 16 <= dim; i += 16) {
        const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(buf.data() + i), vinv);
        const __m512 wv = sobrio_vec::load16(w + i);
        sobrio_vec::store16(o + i, gemma ? _mm512_mul_ps(normed, _mm512_add_ps(one, wv))
                                         : _mm512_mul_ps(wv, sobrio_vec::round16<T>(normed)));
      }
#endif
      for (; i < dim; ++i) {
        const float normed = buf[i] * inv;
        o[i] = gemma ? static_cast<T>(normed * (1.f + to_float(w[i]))) : static_cast<T>(to_float(w[i]) * round_to<T>(normed));
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// Rotary embedding in place, rotate-half layout: x1' = x1 c - x2 s, x2' = x2 c + x1 s, with cos/sin
// rounded to the dtype first and each product rounded, as the PyTorch reference computes them.
template <typename T, typename C>
void rope_heads(T* x, int64_t tokens, int64_t heads, int64_t dim, int64_t stride, const int64_t* pos,
                const C* cos, const C* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C* c = cos + pos[t] * dim;
      const C* s = sin + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * stride + h * dim;
        int64_t i = 0;
#if defined(__AVX512BF16__)
        using sobrio_vec::load16;
        using sobrio_vec::round16;
        if constexpr (sobrio_vec::kVectorized<T> && sobrio_vec::kVectorized<C>) for (; i + 16 <= half; i += 16) {
          const __m512 a = load16(v + i), b = load16(v + i + half);
          const __m512 c1 = round16<T>(load16(c + i)), s1 = round16<T>(load16(s + i));
          const __m512 c2 = round16<T>(load16(c + i + half)), s2 = round16<T>(load16(s + i + half));
          const __m512 nb = _mm512_sub_ps(_mm512_setzero_ps(), b);
          sobrio_vec::store16(v + i, _mm512_add_ps(round16<T>(_mm512_mul_ps(a, c1)), round16<T>(_mm512_mul_ps(nb, s1))));
          sobrio_vec::store16(v + i + half, _mm512_add_ps(round16<T>(_mm512_mul_ps(b, c2)), round16<T>(_mm512_mul_ps(a, s2))));
        }
#endif
        for (; i < half; ++i) {
          const float a = to_float(v[i]), b = to_float(v[i + half]);
          const float c1 = round_to<T>(to_float(c[i])), s1 = round_to<T>(to_float(s[i]));
          const float c2 = round_to<T>(to_float(c[i + half])), s2 = round_to<T>(to_float(s[i + half]));
          v[i] = static_cast<T>(round_to<T>(a * c1) + round_to<T>(-b * s1));
          v[i + half] = static_cast<T>(round_to<T>(b * c2) + round_to<T>(a * s2));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// x [T, 2I] = [gate | up] -> act(gate) * up, [T, I]; act silu (0) or gelu-tanh (1), each result rounded
// as PyTorch rounds act(gate) and then the product.
template <typename T>
void act_and_mul_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t act) {
  at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
      if constexpr (sobrio_vec::kVectorized<T>) for (; i + 16 <= inter; i += 16) {
        const __m512 a = sobrio_vec::load16(g + i);
        __m512 y;
        if (act == 0) {
          y = _mm512_div_ps(a, _mm512_add_ps(one, sobrio_vec::exp512(_mm512_sub_ps(zero, a))));
        } else {  // tanh(z) = 1 - 2 / (exp(2z) + 1)
          const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                         _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), a), _mm512_mul_ps(a, a), a));
          const __m512 e = sobrio_vec::exp512(_mm512_add_ps(z, z));
          const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
          y = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), a), _mm512_add_ps(one, th));
        }
        sobrio_vec::store16(o + i, _mm512_mul_ps(sobrio_vec::round16<T>(y), sobrio_vec::load16(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float a = to_float(g[i]);
        float y;
        if (act == 0) {
          y = a / (1.f + std::exp(-a));
        } else {
          const float inner = 0.7978845608028654f * (a + 0.044715f * a * a * a);
          y = 0.5f * a * (1.f + std::tanh(inner));
        }
        o[i] = static_cast<T>(round_to<T>(y) * to_float(u[i]));
      }
    }
  });
}

// One row of D values into int8 with a bf16 scale, as `sobrio.kv.cache.quantize_rows` does: scale =
// max |x| / 127 rounded to bf16, values rounded half to even against that scale.
template <typename T>
void quantize_row_int8(const T* x, int64_t dim, int8_t* q, c10::BFloat16* scale) {
  float absmax = 0.f;
  for (int64_t i = 0; i < dim; ++i) absmax = std::max(absmax, std::fabs(sobrio_vec::to_float(x[i])));
  const c10::BFloat16 s(std::max(absmax / 127.f, 1e-30f));
  const float sf = static_cast<float>(s);
  for (int64_t i = 0; i < dim; ++i)
    q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(sobrio_vec::to_float(x[i]) / sf), -127.f, 127.f));
  *scale = s;
}

// ---------------------------------------------------------------------------------------------------
// Greedy tokens: each row's index of its largest value, as torch.max(dim=-1) picks it (the first of equal
// maxima; a row with a NaN gives its first NaN). One pass per row, each lane keeping its largest value and
// where it was first seen; rows split over the threads. torch.max on a batch-32 step's [32, 49152] float
// logits ran in one thread at ~1 ms, 4% of the step.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_index = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 lane_best = _mm512_loadu_ps(x);
    __m512i lane_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 unordered = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
    __m512i index = lane_index;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      index = _mm512_add_epi32(index, step);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
    }
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(indices, lane_index);
    nan = unordered != 0;
    best = values[0], best_index = indices[0];
    for (int l = 1; l < 16; ++l)
      if (values[l] > best || (values[l] == best && indices[l] < best_index)) best = values[l], best_index = indices[l];
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = true;
    if (x[i] > best) best = x[i], best_index = i;
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  return best_index;
}

}  // namespace

namespace sobrio_ops {

bool gemv_supported() {
#if defined(SOBRIO_LINEAR) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor gemv_bf16(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(gemv_supported(), "gemv_bf16 needs AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemv_bf16 takes bf16");
  check_linear(x, w);
#if defined(SOBRIO_LINEAR) && defined(__AVX512BF16__)
  return linear_run<PairDotBf16>(x, w, bias);
#else
  return x;
#endif
}

bool invariant_linear_supported() {
#if defined(SOBRIO_LINEAR)
  return true;
#else
  return false;
#endif
}

// The batch-invariant linear: float32, bf16 or fp16. For bf16 on AVX512-BF16 it is gemv_bf16 itself.
at::Tensor invariant_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(invariant_linear_supported(), "invariant_linear needs AVX-512 (F, BW, VL) or AVX2 with FMA");
  check_linear(x, w);
#if defined(SOBRIO_LINEAR)
  switch (x.scalar_type()) {
    case at::kFloat: return linear_run<LaneDot<float>>(x, w, bias);
    case at::kHalf: return linear_run<LaneDot<c10::Half>>(x, w, bias);
#if defined(__AVX512BF16__)
    case at::kBFloat16: return linear_run<PairDotBf16>(x, w, bias);
#else
    case at::kBFloat16: return linear_run<LaneDot<c10::BFloat16>>(x, w, bias);
#endif
    default: TORCH_CHECK(false, "invariant_linear takes float32, bf16 or fp16");
  }
#endif
  return x;
}

at::Tensor expert_linear(at::Tensor x, at::Tensor w, at::Tensor ids, at::Tensor offsets) {
  TORCH_CHECK(invariant_linear_supported(), "expert_linear needs AVX-512 (F, BW, VL) or AVX2 with FMA");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.dim() == 2 && w.dim() == 3 && w.is_contiguous() &&
                  x.size(1) == w.size(2), "expert_linear: x [R, K], w [E, N, K] contiguous, one dtype");
  TORCH_CHECK(ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && ids.is_contiguous() &&
                  offsets.is_contiguous() && offsets.numel() == ids.numel() + 1, "ids [G], offsets [G + 1]: int64");
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[ids.numel()] == x.size(0), "offsets: 0 .. rows of x");
  for (int64_t g = 0; g < ids.numel(); ++g)
    TORCH_CHECK(id[g] >= 0 && id[g] < w.size(0) && off[g] <= off[g + 1], "expert id or offsets out of range");
#if defined(SOBRIO_LINEAR)
  switch (x.scalar_type()) {
    case at::kFloat: return expert_linear_run<LaneDot<float>>(x, w, ids, offsets);
#if defined(__AVX512BF16__)
    case at::kBFloat16: return expert_linear_run<PairDotBf16>(x, w, ids, offsets);
#else
    case at::kBFloat16: return expert_linear_run<LaneDot<c10::BFloat16>>(x, w, ids, offsets);
#endif
    default: TORCH_CHECK(false, "expert_linear takes float32 or bf16");
  }
#endif
  return x;
}

// Returns the normed rows; with `residual` given, also adds x into it in place first.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps,
                    bool gemma) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim && weight.scalar_type() == x.scalar_type(), "rms_norm: weight [dim], x's dtype");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    scalar_t* res = nullptr;
    if (residual.has_value()) {
      TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual: x's shape");
      res = residual->data_ptr<scalar_t>();
    }
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            rows, dim, eps, gemma);
  });
  return out;
}

// q [T, Hq, D] and k [T, Hk, D] may be views into the packed qkv output (row stride given by stride(0)).
// cos / sin [max_pos, D]: float32, or q's dtype when the model was cast with its buffers.
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions: int64");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == sin.scalar_type());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2));
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t rows = cos.size(0);
  // A position past the tables would read other memory as cos / sin (a calibration prompt longer than the
  // model's positions once did, silently): a scan of T integers, nothing next to the rotation.
  TORCH_CHECK(std::all_of(pp, pp + pos.numel(), [rows](int64_t p) { return p >= 0 && p < rows; }),
              "rotary_embedding: a position outside 0..", rows - 1, " (the model's rotary table)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    for (auto* t : {&q, &k}) {
      if (cos.scalar_type() == at::kFloat) {
        rope_heads<scalar_t, float>(t->data_ptr<scalar_t>(), t->size(0), t->size(1), t->size(2), t->stride(0),
                                    pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
      } else {
        TORCH_CHECK(cos.scalar_type() == q.scalar_type(), "cos / sin: float32 or q's dtype");
        rope_heads<scalar_t, scalar_t>(t->data_ptr<scalar_t>(), t->size(0), t->size(1), t->size(2), t->stride(0),
                                       pos.data_ptr<int64_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
      }
    }
  });
}

at::Tensor act_and_mul(at::Tensor x, int64_t act) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "act_and_mul: contiguous [T, 2I]");
  const int64_t inter = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "act_and_mul", [&] {
    act_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter, act);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// The step's new keys and values into their cache slots: one row copy per token and tensor, where two
// index_copy_ calls per layer cost ~40 us each in dispatch at decode sizes. Rows may be strided views of
// the fused qkv output; inside a row the [heads, head_dim] block must be contiguous.
void write_kv(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
              at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "write_kv: key, value [T, Hkv, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "write_kv: contiguous caches");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "write_kv: dtype mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0), "write_kv: slots");
  const int64_t row = key.size(1) * key.size(2), num_slots = key_cache.numel() / row;
  for (const auto& t : {key, value})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "write_kv: [Hkv, D] contiguous per token");
  const int64_t bytes = row * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  const int64_t tokens = key.size(0);
  TORCH_CHECK(std::all_of(slots, slots + tokens, [num_slots](int64_t s) { return s >= 0 && s < num_slots; }),
              "write_kv: slot out of range");
  // A prompt chunk's rows over both threads (its copies into cold cache lines kept the other thread waiting:
  // docs/benchmarks.md, "Per-row operators at 16 rows"); a decode's few rows inline.
  at::parallel_for(0, tokens, std::max<int64_t>(1, (64 << 10) / (2 * bytes)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slots[t] * bytes, k + t * ks, bytes);
      std::memcpy(vc + slots[t] * bytes, v + t * vs, bytes);
    }
  });
}

// write_kv for an int8 cache: each new (token, kv head) row quantized into its slot, its scale beside it.
void write_kv_int8(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                   at::Tensor key_scales, at::Tensor value_scales, at::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type(),
              "write_kv_int8: key, value [T, Hkv, D] of one dtype");
  TORCH_CHECK(key_cache.scalar_type() == at::kChar && value_cache.scalar_type() == at::kChar &&
                  key_scales.scalar_type() == at::kBFloat16 && value_scales.scalar_type() == at::kBFloat16,
              "write_kv_int8: int8 caches, bf16 scales");
  for (const auto& t : {key_cache, value_cache, key_scales, value_scales})
    TORCH_CHECK(t.is_contiguous(), "write_kv_int8: contiguous caches and scales");
  for (const auto& t : {key, value})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "write_kv_int8: [Hkv, D] contiguous per token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == key.size(0), "write_kv_int8: slots");
  const int64_t heads = key.size(1), dim = key.size(2), num_slots = key_scales.numel() / heads;
  TORCH_CHECK(key_cache.numel() == num_slots * heads * dim, "write_kv_int8: scales do not match the cache");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv_int8", [&] {
    for (int64_t t = 0; t < key.size(0); ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_int8: slot out of range");
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t row = slots[t] * heads + h;
        quantize_row_int8(key.data_ptr<scalar_t>() + t * key.stride(0) + h * dim, dim,
                          key_cache.data_ptr<int8_t>() + row * dim, key_scales.data_ptr<c10::BFloat16>() + row);
        quantize_row_int8(value.data_ptr<scalar_t>() + t * value.stride(0) + h * dim, dim,
                          value_cache.data_ptr<int8_t>() + row * dim, value_scales.data_ptr<c10::BFloat16>() + row);
      }
    }
  });
}

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "argmax_rows: float32 logits [B, V], unit stride along V, 0 < V < 2^31");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * stride, n);
  });
  return out;
}

}  // namespace sobrio_ops
