// Random sampling of a step's float32 logits rows: temperature, top-k, top-p and min-p, then one draw by
// inverse CDF over the kept tokens in vocabulary order, each row on its own (so a seeded row's token does not
// depend on its batch). The PyTorch path (sample/sampler.py) makes several [B, V] tensors a step and, for
// top-k or top-p, a top-k of 256 candidates and a sort of the whole row when the nucleus is wider; at a real
// vocabulary (128k-256k) that cost more than a decode step's matmuls (docs/benchmarks.md). Here a row is read
// three or four times and nothing is sorted but the tokens of the one bucket where the nucleus ends.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

// A weight's bucket: its float32 bits' top 13 (sign, exponent and 4 mantissa bits). Weights lie in [0, 1],
// whose bits order as the values do, so the buckets are in value order, 16 an octave.
constexpr int kBucketShift = 19;
constexpr int kBuckets = (0x3F800000 >> kBucketShift) + 1;  // 1.0f's bucket is the last

inline uint32_t bits_of(float w) {
  uint32_t b;
  std::memcpy(&b, &w, sizeof(b));
  return b;
}

// The row's largest logit, NaNs left out (-inf if it has no other).
float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    mv = _mm512_mask_max_ps(mv, _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), mv, v);
  }
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; i < n; ++i)
    if (x[i] > m) m = x[i];
  return m;
}

// Below this exp512 clamps (to ~1.2e-38): such weights are 0 here, as for -inf and NaN logits.
constexpr float kExpFloor = -87.3f;

// w[i] = exp((x[i] - m) * inv_t), 0 for -inf and NaN logits and below kExpFloor; returns their sum. An
// infinite maximum gives its tokens weight 1 and the others 0.
double weights(const float* x, int64_t n, float m, float inv_t, float* w) {
  double total = 0;
  int64_t i = 0;
  if (std::isinf(m)) {
    for (; i < n; ++i) total += w[i] = x[i] == m ? 1.f : 0.f;
    return total;
  }
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), tv = _mm512_set1_ps(inv_t);
  const __m512 floor = _mm512_set1_ps(kExpFloor);
  while (i + 16 <= n) {  // float sums of 64 vectors a lane at most, added up in double
    __m512 sum = _mm512_setzero_ps();
    for (const int64_t stop = std::min(n - 15, i + 1024); i < stop; i += 16) {
      const __m512 a = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), tv);  // NaN for a NaN logit
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, floor, _CMP_GE_OQ), sobrio_vec::exp512(a));
      _mm512_storeu_ps(w + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    total += _mm512_reduce_add_ps(sum);
  }
#endif
  for (; i < n; ++i) {
    const float a = (x[i] - m) * inv_t;
    w[i] = a >= kExpFloor ? std::exp(a) : 0.f;
    total += w[i];
  }
  return total;
}

// f(i) for each i, in order, with lo <= w[i] < hi: 16 weights compared at a time and the few that pass
// handed on (a peaked row has most of its tokens far below the cut).
template <typename F>
void for_each_between(const float* w, int64_t n, float lo, float hi, F&& f) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 lv = _mm512_set1_ps(lo), hv = _mm512_set1_ps(hi);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) int32_t picked[16];
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(w + i);
    const __mmask16 m = _mm512_cmp_ps_mask(v, lv, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, hv, _CMP_LT_OQ);
    if (!m) continue;
    _mm512_mask_compressstoreu_epi32(picked, m, lanes);
    for (int j = 0, c = __builtin_popcount(m); j < c; ++j) f(i + picked[j]);
  }
#endif
  for (; i < n; ++i)
    if (w[i] >= lo && w[i] < hi) f(i);
}

// The last token top-k and top-p keep, in the order of decreasing weight (equal weights by index): keep rank r
// while r < k and the weight of the ranks before it is below top_p of the total, as `_keep_top_k_top_p`. A
// histogram of the weights' buckets finds the bucket where that stops, and only its tokens are sorted.
struct Cut {
  float weight;   // the last kept token's weight: kept are the heavier ones,
  int64_t index;  // and those of equal weight up to this index
};

// Only weights of at least `floor` are looked at: the caller's bound below which no kept token lies.
Cut top_k_top_p_cut(const float* w, int64_t n, int64_t k, double mass_limit, float floor) {
  std::vector<int64_t> count(kBuckets, 0);
  std::vector<double> mass(kBuckets, 0.0);
  auto add = [&](int64_t i) {
    const int b = static_cast<int>(bits_of(w[i]) >> kBucketShift);
    ++count[b];
    mass[b] += w[i];
  };
  for_each_between(w, n, floor, std::numeric_limits<float>::infinity(), add);
  int64_t rank = 0;
  double before = 0;
  int b = kBuckets - 1;
  for (; b > 0; --b) {  // bucket 0 holds the zero weights (and denormals): never kept
    if (rank + count[b] >= k || before + mass[b] >= mass_limit) break;
    rank += count[b];
    before += mass[b];
  }
  if (b == 0) {  // every token of positive weight is kept
    return Cut{0.f, n};  // weight 0 is never kept (`kept`), so this keeps w > 0
  }
  std::vector<std::pair<float, int64_t>> tokens;
  tokens.reserve(count[b]);
  float low, high;  // the bucket's weights: [low, high)
  const uint32_t low_bits = static_cast<uint32_t>(b) << kBucketShift, high_bits = low_bits + (1u << kBucketShift);
  std::memcpy(&low, &low_bits, sizeof(low));
  std::memcpy(&high, &high_bits, sizeof(high));
  for_each_between(w, n, std::max(low, floor), high, [&](int64_t j) { tokens.emplace_back(w[j], j); });
  std::sort(tokens.begin(), tokens.end(), [](const auto& a, const auto& c) {
    return a.first > c.first || (a.first == c.first && a.second < c.second);
  });
  Cut cut{tokens.front().first, tokens.front().second};  // the bucket's first token is kept: the walk stopped here
  for (const auto& [weight, index] : tokens) {
    if (rank >= k || before >= mass_limit) break;
    cut = Cut{weight, index};
    ++rank;
    before += weight;
  }
  return cut;
}

// Top-k alone looks only at tokens of at least this weight (relative to the largest) when k of them are.
constexpr float kTopKFloor = 1e-4f;

int64_t count_at_least(const float* w, int64_t n, float floor) {
  int64_t count = 0, i = 0;
#if defined(__AVX512F__)
  const __m512 fv = _mm512_set1_ps(floor);
  for (; i + 16 <= n; i += 16) count += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(w + i), fv, _CMP_GE_OQ));
#endif
  for (; i < n; ++i) count += w[i] >= floor;
  return count;
}

// Whether token i of weight wi is kept: above the cut (or at it, up to its index), at least min_p of the
// largest weight (1), and of positive weight.
inline bool kept(float wi, int64_t i, const Cut& cut, float min_p) {
  return wi > 0.f && wi >= min_p && (wi > cut.weight || (wi == cut.weight && i <= cut.index));
}

#if defined(__AVX512F__)
// `kept` for the 16 weights v of tokens i to i + 15.
inline __mmask16 kept16(__m512 v, int64_t i, const Cut& cut, float min_p) {
  const __m512 cw = _mm512_set1_ps(cut.weight);
  __mmask16 keep = _mm512_cmp_ps_mask(v, cw, _CMP_GT_OQ);
  if (const __mmask16 tie = _mm512_cmp_ps_mask(v, cw, _CMP_EQ_OQ)) {  // rare: equal weights at the cut
    const __m512i lo = _mm512_add_epi64(_mm512_set1_epi64(i), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
    const __m512i limit = _mm512_set1_epi64(cut.index);
    const __mmask8 a = _mm512_cmple_epi64_mask(lo, limit);
    const __mmask8 c = _mm512_cmple_epi64_mask(_mm512_add_epi64(lo, _mm512_set1_epi64(8)), limit);
    keep |= tie & static_cast<__mmask16>(a | (c << 8));
  }
  return keep & _mm512_cmp_ps_mask(v, _mm512_set1_ps(min_p), _CMP_GE_OQ) &
         _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
}
#endif

constexpr int64_t kBlock = 1024;

// The kept weights of tokens [begin, end) summed in float (a block of kBlock at most; callers add the blocks'
// sums in double); kZero: the other weights set to 0 in place.
template <bool kZero, typename W>
float kept_sum(W* w, int64_t begin, int64_t end, const Cut& cut, float min_p) {
  float s = 0;
  int64_t i = begin;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= end; i += 16) {
    const __m512 v = _mm512_loadu_ps(w + i);
    const __mmask16 keep = kept16(v, i, cut, min_p);
    if constexpr (kZero) _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(keep, v));
    acc = _mm512_mask_add_ps(acc, keep, acc, v);
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < end; ++i) {
    if (kept(w[i], i, cut, min_p)) s += w[i];
    else if constexpr (kZero) w[i] = 0.f;
  }
  return s;
}

// The draw: the first token, in vocabulary order, where the running sum of kept weights passes u times their
// total (the last kept token if rounding leaves none).
int64_t draw(const float* w, int64_t n, const Cut& cut, float min_p, double u, std::vector<double>& sums) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  sums.assign(blocks, 0.0);
  double total = 0;
  int64_t last_block = -1;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float s = kept_sum<false>(w, blk * kBlock, std::min(n, (blk + 1) * kBlock), cut, min_p);
    sums[blk] = s;
    total += s;
    if (s > 0) last_block = blk;
  }
  if (last_block < 0) return 0;  // nothing kept: no logit above -inf
  const double target = u * total;
  double running = 0;
  for (int64_t blk = 0; blk <= last_block; ++blk) {
    if (running + sums[blk] <= target && blk < last_block) {
      running += sums[blk];
      continue;
    }
    int64_t last = -1;
    for (int64_t i = blk * kBlock; i < std::min(n, (blk + 1) * kBlock); ++i) {
      if (!kept(w[i], i, cut, min_p)) continue;
      last = i;
      running += w[i];
      if (running > target) return i;
    }
    if (last >= 0 && blk == last_block) return last;
    // rounding: the block's sum passed the target, its tokens one by one did not; the next block's first
    // kept token follows (running now holds this block's tokens)
  }
  return n - 1;  // not reached: the last block returns
}

// A row's weights into w and what its rules keep of them: `Cut{0, n}` keeps every token of positive weight.
// Returns false for a row with no logit above -inf (nothing to keep).
bool filter_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p, float* w, Cut& cut) {
  const float m = row_max(x, n);
  if (m == -std::numeric_limits<float>::infinity()) return false;
  const double total = weights(x, n, m, 1.f / temperature, w);
  const int64_t k = top_k > 0 && top_k < n ? top_k : n;
  cut = Cut{0.f, n};
  if (top_p < 1.f) {
    // Tokens below (1 - top_p) / n of the total weigh less than 1 - top_p together: the nucleus lies above
    // them (half that, for rounding), and so does whatever top-k keeps of it.
    cut = top_k_top_p_cut(w, n, k, top_p * total, static_cast<float>(0.5 * (1 - top_p) * total / n));
  } else if (k < n) {
    cut = top_k_top_p_cut(w, n, k, 2 * total, count_at_least(w, n, kTopKFloor) >= k ? kTopKFloor : 0.f);
  }
  return true;
}

// The per-row rules of both operators, checked: one value a row, temperature > 0, 0 < top_p, 0 <= min_p <= 1.
struct RowRules {
  const float *temperature, *top_p, *min_p;
  const int64_t* top_k;
  RowRules(const char* op, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
           const at::Tensor& top_p, const at::Tensor& min_p) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                    logits.size(1) > 0,
                op, ": float32 logits [B, V], unit stride along V");
    for (const auto* t : {&temperature, &top_k, &top_p, &min_p})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0) && t->is_contiguous(), op, ": one value a row");
    TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                    min_p.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong,
                op, ": float32 temperature, top_p and min_p; int64 top_k");
    this->temperature = temperature.data_ptr<float>();
    this->top_p = top_p.data_ptr<float>();
    this->min_p = min_p.data_ptr<float>();
    this->top_k = top_k.data_ptr<int64_t>();
    for (int64_t r = 0; r < logits.size(0); ++r)
      TORCH_CHECK(this->temperature[r] > 0 && this->top_p[r] > 0 && this->min_p[r] >= 0 && this->min_p[r] <= 1, op,
                  ": temperature > 0, 0 < top_p, 0 <= min_p <= 1");
  }
};

}  // namespace

namespace sobrio_ops {

at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                       at::Tensor min_p, at::Tensor uniform) {
  const RowRules rules("sample_rows", logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == rows && uniform.is_contiguous() &&
                  uniform.scalar_type() == at::kFloat,
              "sample_rows: one float32 uniform a row");
  const float* x = logits.data_ptr<float>();
  const float* up = uniform.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(up[r] >= 0 && up[r] < 1, "sample_rows: 0 <= uniform < 1");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> w;  // a row's weights: kept between steps (a fresh 0.5-1 MB faults its pages in)
    thread_local std::vector<double> sums;
    w.resize(n);
    for (int64_t r = begin; r < end; ++r) {
      Cut cut{0.f, n};
      o[r] = filter_row(x + r * stride, n, rules.temperature[r], rules.top_k[r], rules.top_p[r], w.data(), cut)
                 ? draw(w.data(), n, cut, rules.min_p[r], up[r], sums)
                 : 0;  // no token possible: as torch's argmax of the row
    }
  });
  return out;
}

at::Tensor top_k_top_p_probs(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                             at::Tensor min_p) {
  const RowRules rules("top_k_top_p_probs", logits, temperature, top_k, top_p, min_p);
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  const float* x = logits.data_ptr<float>();
  auto out = at::empty({rows, n}, logits.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* w = o + r * n;  // the weights, then the probabilities in place
      Cut cut{0.f, n};
      if (!filter_row(x + r * stride, n, rules.temperature[r], rules.top_k[r], rules.top_p[r], w, cut)) {
        std::fill(w, w + n, 0.f);  // nothing kept
        continue;
      }
      double total = 0;  // the kept weights' sum, the others zeroed
      for (int64_t begin = 0; begin < n; begin += kBlock)
        total += kept_sum<true>(w, begin, std::min(n, begin + kBlock), cut, rules.min_p[r]);
      const float inv = static_cast<float>(1.0 / total);
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) _mm512_storeu_ps(w + i, _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_set1_ps(inv)));
#endif
      for (; i < n; ++i) w[i] *= inv;
    }
  });
  return out;
}

}  // namespace sobrio_ops
