// Attention for one sequence's prompt chunk on the CPU, flash-attention style: the chunk's query rows over
// its whole context, keys and values read from the paged bf16 cache (the chunk's own already written),
// causal at the bottom right (query i of a chunk of L rows sits at position ctx - L + i and sees the keys up
// to it; under a sliding window of W, only the last W of them). Scores and probabilities never leave the
// cache: per task (a kv head and 16 query positions, with every query head of that kv head) the keys go by in
// blocks of 32 under an online softmax, and both products are AVX512-BF16 dot products (vdpbf16ps) summed in
// float32. Blocks above the diagonal are skipped, and blocks below every row's window.
// PyTorch's CPU flash attention runs at about a quarter of the bf16 peak on AVX512-BF16 without AMX, and
// with a chunk's mask computes the masked blocks too (docs/benchmarks.md, benchmarks/prompt_chunk_attention.py).
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "vec.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SOBRIO_PROMPT_ATTENTION 1

constexpr int64_t kKeys = 32;        // keys a block: two vectors of 16 scores
constexpr int64_t kPositions = 16;   // query positions a task
constexpr int64_t kRows = 4;         // query rows a pass of the products' inner loops (registers)

inline __m512bh pair_of(const uint16_t* p) {  // two bf16 broadcast to all 16 lanes
  int32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// One block of keys and values of one kv head, laid out for the dot products: keys as [D/2][32 keys][2] (a
// vector: 16 keys' pair of dims), values as [16 key pairs][D][2] (a vector: 16 dims' pair of keys). Keys past
// the context are zeros (their scores are masked).
void pack_block(const uint16_t* key_cache, const uint16_t* value_cache, const int64_t* table, int64_t block_size,
                int64_t kv_heads, int64_t kh, int64_t dim, int64_t first_key, int64_t ctx, uint16_t* keys,
                uint16_t* values) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t t = first_key + j;
    if (t >= ctx) {
      for (int64_t d = 0; d < dim; ++d) keys[((d >> 1) * kKeys + j) * 2 + (d & 1)] = 0;
      for (int64_t d = 0; d < dim; ++d) values[((j >> 1) * dim + d) * 2 + (j & 1)] = 0;
      continue;
    }
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const uint16_t* k = key_cache + (slot * kv_heads + kh) * dim;
    const uint16_t* v = value_cache + (slot * kv_heads + kh) * dim;
    for (int64_t d = 0; d < dim; ++d) keys[((d >> 1) * kKeys + j) * 2 + (d & 1)] = k[d];
    for (int64_t d = 0; d < dim; ++d) values[((j >> 1) * dim + d) * 2 + (j & 1)] = v[d];
  }
}

// scores [kRows][32] = q [kRows][D] . keys (one packed block)
inline void block_scores(const uint16_t* q, int64_t dim, const uint16_t* keys, float* scores) {
  __m512 acc[kRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    const __m512bh k0 = load_bh(keys + p * 2 * kKeys), k1 = load_bh(keys + p * 2 * kKeys + 32);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512bh qq = pair_of(q + r * dim + 2 * p);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qq, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qq, k1);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(scores + r * kKeys, acc[r][0]);
    _mm512_storeu_ps(scores + r * kKeys + 16, acc[r][1]);
  }
}

// out [kRows][16 V dims from d0] = out * keep[r] + probs [kRows][32] (bf16) . values (one packed block)
template <int V>
inline void block_values_pass(const uint16_t* probs, const float* keep, const uint16_t* values, int64_t dim,
                              int64_t d0, float* out) {
  __m512 acc[kRows][V];
  for (int64_t r = 0; r < kRows; ++r) {
    const __m512 c = _mm512_set1_ps(keep[r]);
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_mul_ps(c, _mm512_loadu_ps(out + r * dim + d0 + 16 * v));
  }
  for (int64_t p = 0; p < kKeys / 2; ++p) {
    const uint16_t* vp = values + (p * dim + d0) * 2;
    __m512bh vv[V];
    for (int v = 0; v < V; ++v) vv[v] = load_bh(vp + 32 * v);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512bh pp = pair_of(probs + r * kKeys + 2 * p);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pp, vv[v]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + r * dim + d0 + 16 * v, acc[r][v]);
}

// out [kRows][D] = out * keep[r] + probs [kRows][32] (bf16) . values (one packed block), 64 dims at a time
// (and the last 32 of a head size such as Phi-3's 96)
inline void block_values(const uint16_t* probs, const float* keep, const uint16_t* values, int64_t dim, float* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= dim; d0 += 64) block_values_pass<4>(probs, keep, values, dim, d0, out);
  if (d0 < dim) block_values_pass<2>(probs, keep, values, dim, d0, out);
}

inline __mmask16 lanes_below(int64_t n) {  // the first n lanes of 16 (none for n <= 0, all from 16)
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
}

// Lanes [low, valid) of the 16 starting at lane `first` of a block or span: the keys a row sees there.
inline __mmask16 lanes_seen(int64_t low, int64_t valid, int64_t first) {
  return lanes_below(valid - first) & static_cast<__mmask16>(~lanes_below(low - first));
}

// One row's online softmax step over a block: scores scaled and masked outside keys [low, valid) of the
// block, the running max and sum updated; writes the bf16 probabilities and returns the factor that rescales
// the row's output so far (a row that has seen no key yet keeps max -inf and sum 0).
inline float softmax_step(float* s, int64_t low, int64_t valid, float scale, float& max, float& sum,
                          uint16_t* probs) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __mmask16 m0 = lanes_seen(low, valid, 0), m1 = lanes_seen(low, valid, 16);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 s0 = _mm512_mask_mul_ps(ninf, m0, _mm512_loadu_ps(s), vscale);
  const __m512 s1 = _mm512_mask_mul_ps(ninf, m1, _mm512_loadu_ps(s + 16), vscale);
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
  const float new_max = std::max(max, block_max);
  if (new_max == -std::numeric_limits<float>::infinity()) {  // no key of the row's window yet
    std::memset(probs, 0, kKeys * sizeof(uint16_t));
    return 0.f;
  }
  const float keep = max == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(max - new_max);
  const __m512 vmax = _mm512_set1_ps(new_max);
  const __m512 e0 = _mm512_maskz_mov_ps(m0, sobrio_vec::exp512(_mm512_sub_ps(s0, vmax)));
  const __m512 e1 = _mm512_maskz_mov_ps(m1, sobrio_vec::exp512(_mm512_sub_ps(s1, vmax)));
  sum = sum * keep + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
  max = new_max;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs), (__m256i)_mm512_cvtneps_pbh(e0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + 16), (__m256i)_mm512_cvtneps_pbh(e1));
  return keep;
}

// scores [n] (n a multiple of 16) := softcap(scores * scale) / scale: Gemma 2's logit softcap on the raw
// scores, so that the softmax's own multiplication by `scale` gives cap * tanh(s * scale / cap).
inline void softcap_scores(float* s, int64_t n, float scale, float cap) {
  const __m512 into = _mm512_set1_ps(scale), back = _mm512_set1_ps(1.f / scale);
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(s + i, _mm512_mul_ps(sobrio_vec::softcap512(_mm512_mul_ps(_mm512_loadu_ps(s + i), into), cap),
                                          back));
}

struct Shape {
  int64_t rows, heads, kv_heads, dim, ctx, block_size, window;  // window <= 0: none
  float softcap;  // <= 0: none
  int64_t lowest_key(int64_t position) const {  // the first key the query at `position` sees
    return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  }
};

// A task's query rows (positions [i0, i0 + n), each with the `group` query heads of kv head `kh` side by
// side) copied out of q [L, H, D] into qr [n * group][D].
inline void gather_queries(const uint16_t* q, const Shape& s, int64_t kh, int64_t i0, int64_t n, uint16_t* qr) {
  const int64_t group = s.heads / s.kv_heads;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g)
      std::memcpy(qr + (i * group + g) * s.dim, q + ((i0 + i) * s.heads + kh * group + g) * s.dim, s.dim * 2);
}

// The task's rows of out [L, H, D]: each accumulated row of acc [n * group][D] over its softmax sum, in bf16.
inline void write_rows(const float* acc, const float* sum, const Shape& s, int64_t kh, int64_t i0, int64_t n,
                       uint16_t* out) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = i * group + g;
      const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
      auto* dst = reinterpret_cast<c10::BFloat16*>(out + ((i0 + i) * s.heads + kh * group + g) * dim);
      for (int64_t d = 0; d < dim; d += 16)
        sobrio_vec::store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + d), inv));
    }
}

// One task: kv head `kh`, query positions [i0, i0 + n) of the chunk, all `group` query heads of that kv head.
void attend_task(const uint16_t* q, const uint16_t* keys, const uint16_t* values, const Shape& s, double scale,
                 int64_t kh, int64_t i0, int64_t n, uint16_t* out) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  const int64_t rows = (n * group + kRows - 1) / kRows * kRows;  // padded to whole passes
  const int64_t first = s.ctx - s.rows;  // position of the chunk's first query
  std::vector<uint16_t> qr(rows * dim, 0), probs(rows * kKeys);
  std::vector<float> acc(rows * dim, 0.f), scores(rows * kKeys), max(rows, -std::numeric_limits<float>::infinity()),
      sum(rows, 0.f), keep(rows);
  gather_queries(q, s, kh, i0, n, qr.data());
  const int64_t blocks = (first + i0 + n - 1) / kKeys + 1;  // up to the last query's own key
  const int64_t block_elems = kKeys * dim;
  const int64_t num_blocks = (s.ctx + kKeys - 1) / kKeys;
  for (int64_t b = s.lowest_key(first + i0) / kKeys; b < blocks; ++b) {  // from the first query's window
    const uint16_t* kb = keys + (kh * num_blocks + b) * block_elems;
    const uint16_t* vb = values + (kh * num_blocks + b) * block_elems;
    for (int64_t r = 0; r < rows; r += kRows) block_scores(&qr[r * dim], dim, kb, &scores[r * kKeys]);
    if (s.softcap > 0) softcap_scores(scores.data(), rows * kKeys, static_cast<float>(scale), s.softcap);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first + i0 + std::min(r / group, n - 1);
      const int64_t valid = std::min(position, s.ctx - 1) - b * kKeys + 1;  // keys of this block it sees
      const int64_t low = s.lowest_key(position) - b * kKeys;
      keep[r] = softmax_step(&scores[r * kKeys], low, valid, static_cast<float>(scale), max[r], sum[r],
                             &probs[r * kKeys]);
    }
    for (int64_t r = 0; r < rows; r += kRows)
      block_values(&probs[r * kKeys], &keep[r], vb, dim, &acc[r * dim]);
  }
  write_rows(acc.data(), sum.data(), s, kh, i0, n, out);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SOBRIO_PROMPT_ATTENTION_AMX 1
// On Intel AMX both products run on tiles (TDPBF16PS, 16x16x32 a product) and the online softmax goes by
// `kSpan` keys at a time (4 packed blocks), so its row maxima and sums, and the rescaling of a row's output
// so far, come once per 128 keys; a task's rows go 32 at a time (two row tiles). The packed blocks are
// already what the tiles read: a key block's [D/2][32][2] is a B tile per 32 dims and 16 keys (rows 128
// bytes apart), a value block's [16][D][2] a B tile per 16 dims (rows 4D bytes apart).
constexpr int64_t kSpan = 4 * kKeys;
constexpr int64_t kTile = 16;
constexpr int64_t kPair = 2 * kTile;     // rows a pass of the products: two row tiles
constexpr int64_t kAmxPositions = 32;   // query positions a task

// 2^x for x <= 0 as 2^n * p(f), f in [-1/2, 1/2], p of degree 3 fitted for relative error (7.5e-5 at most,
// 50x below the bf16 rounding of the probabilities); inputs below -126 give 2^-126.
inline __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.517822131514549e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4261167645454407e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.932597756385803e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999279975891113e-1f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax step of a row tile over a span: 16 rows of kSpan raw scores, row r seeing its keys
// [low[r], valid[r]). The running maxima are kept in base 2 (max * scale * log2 e), so each probability is one
// fused multiply-subtract and a 2^x: the bf16 probabilities go to `probs`, the sums are updated, and `keep`
// gets each row's factor for its output so far (all 16 rows' at once: one vector 2^x; 0 for a row that has
// seen no key yet, whose max stays -inf and sum 0).
inline void softmax_span(const float* s, const int64_t* low, const int64_t* valid, float scale, float* max,
                         float* sum, uint16_t* probs, float* keep) {
  constexpr int64_t kVectors = kSpan / 16;
  const float c = scale * 1.44269504088896341f;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float top[kTile];
  for (int64_t r = 0; r < kTile; ++r) {
    const float* row = s + r * kSpan;
    __m512 m = ninf;
    if (valid[r] >= kSpan && low[r] <= 0) {
      for (int64_t v = 0; v < kVectors; ++v) m = _mm512_max_ps(m, _mm512_loadu_ps(row + 16 * v));
    } else {
      for (int64_t v = 0; v < kVectors; ++v)
        m = _mm512_mask_max_ps(m, lanes_seen(low[r], valid[r], 16 * v), m, _mm512_loadu_ps(row + 16 * v));
    }
    top[r] = _mm512_reduce_max_ps(m);
  }
  const __m512 old = _mm512_loadu_ps(max);
  const __m512 updated = _mm512_max_ps(old, _mm512_mul_ps(_mm512_load_ps(top), _mm512_set1_ps(c)));
  _mm512_storeu_ps(max, updated);
  const __mmask16 seen = _mm512_cmp_ps_mask(updated, ninf, _CMP_NEQ_OQ);  // rows with a key so far
  _mm512_storeu_ps(keep, _mm512_maskz_mov_ps(seen, exp2_512(_mm512_sub_ps(old, updated))));  // a first: 2^-126 x 0
  for (int64_t r = 0; r < kTile; ++r) {
    const float* row = s + r * kSpan;
    const __m512 vc = _mm512_set1_ps(c), m = _mm512_set1_ps(max[r]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t v = 0; v < kVectors; ++v) {
      __m512 e = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * v), vc, m));
      if (valid[r] < kSpan || low[r] > 0) e = _mm512_maskz_mov_ps(lanes_seen(low[r], valid[r], 16 * v), e);
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * kSpan + 16 * v), (__m256i)_mm512_cvtneps_pbh(e));
    }
    sum[r] = sum[r] * keep[r] + _mm512_reduce_add_ps(total);
  }
}

// Tiles 0-3 (zeroed by sobrio_amx::zero_tiles) += one pass of a 32x32 block over 32 inputs: a [32 rows][32]
// bf16 (`lda` elements a row: tiles 4-5 its rows 0-15 and 16-31) times b [16 input pairs][32 columns][2] (`ldb`
// elements a pair: tiles 6-7 its columns 0-15 and 16-31). Four independent sums, so the products' latency
// overlaps (as amx_linear's block product).
inline void multiply_pass(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb) {
  _tile_loadd(4, a, lda * 2);
  _tile_loadd(5, a + kTile * lda, lda * 2);
  _tile_loadd(6, b, ldb * 2);
  _tile_loadd(7, b + 32, ldb * 2);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// scores [32][kSpan] = 32 query rows (q, D apart) . the span's `count` packed key blocks: per block, tiles
// 0-3 its 32 keys' scores, summed over the dims 32 at a time.
inline void span_scores(const uint16_t* q, const uint16_t* keys, int64_t count, int64_t dim, float* scores) {
  const int64_t block_elems = kKeys * dim;
  for (int64_t b = 0; b < count; ++b) {
    sobrio_amx::zero_tiles();
    for (int64_t c = 0; c < dim / 32; ++c) {
      const uint16_t* kt = keys + b * block_elems + c * 16 * 2 * kKeys;  // 16 dim pairs of 32 keys
      multiply_pass(q + c * 32, dim, kt, 2 * kKeys);
    }
    sobrio_amx::store_tiles(scores + b * kKeys, kSpan);
  }
}

// out [32][D] = out * keep[r] + probs [32][kSpan] (bf16) . the span's `count` packed value blocks: per 32
// dims, tiles 0-3 summed over the blocks 32 keys at a time, then added to the rescaled rows.
inline void span_values(const uint16_t* probs, const float* keep, const uint16_t* values, int64_t count,
                        int64_t dim, float* out) {
  alignas(64) float product[kPair * 32];
  const int64_t block_elems = kKeys * dim;
  for (int64_t d0 = 0; d0 < dim; d0 += 32) {
    sobrio_amx::zero_tiles();
    for (int64_t b = 0; b < count; ++b) {
      const uint16_t* vb = values + b * block_elems + d0 * 2;
      multiply_pass(probs + b * kKeys, kSpan, vb, 2 * dim);
    }
    sobrio_amx::store_tiles(product, 32);
    for (int64_t r = 0; r < kPair; ++r) {
      const __m512 c = _mm512_set1_ps(keep[r]);
      for (int64_t v = 0; v < 2; ++v) {
        float* o = out + r * dim + d0 + 16 * v;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(c, _mm512_loadu_ps(o), _mm512_load_ps(product + r * 32 + 16 * v)));
      }
    }
  }
}

// attend_task on tiles (the calling thread's tiles configured), kAmxPositions positions: 32 rows a pass over
// spans of kSpan keys.
void attend_task_amx(const uint16_t* q, const uint16_t* keys, const uint16_t* values, const Shape& s,
                     double scale, int64_t kh, int64_t i0, int64_t n, uint16_t* out) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  const int64_t rows = (n * group + kPair - 1) / kPair * kPair;
  const int64_t first = s.ctx - s.rows;
  const int64_t num_blocks = (s.ctx + kKeys - 1) / kKeys, block_elems = kKeys * dim;
  std::vector<uint16_t> qr(rows * dim, 0), probs(kPair * kSpan);
  std::vector<float> acc(rows * dim, 0.f), scores(kPair * kSpan), max(rows, -std::numeric_limits<float>::infinity()),
      sum(rows, 0.f), keep(kPair);
  int64_t low[kPair], valid[kPair];
  gather_queries(q, s, kh, i0, n, qr.data());
  const uint16_t* kh_keys = keys + kh * num_blocks * block_elems;
  const uint16_t* kh_values = values + kh * num_blocks * block_elems;
  // Spans outside, row passes inside: a span's keys and values (32 KB at D = 64) are read from L2 once and
  // stay in L1 for the task's other rows.
  const int64_t position = first + i0;  // of the task's first query
  for (int64_t k0 = s.lowest_key(position) / kSpan * kSpan; k0 <= position + n - 1; k0 += kSpan) {
    const int64_t b0 = k0 / kKeys, count = std::min(kSpan / kKeys, num_blocks - b0);
    for (int64_t r0 = 0; r0 < rows; r0 += kPair) {
      if (k0 > position + std::min((r0 + kPair - 1) / group, n - 1)) continue;  // above these rows' diagonal
      if (k0 + kSpan <= s.lowest_key(position + std::min(r0 / group, n - 1))) continue;  // below their windows
      span_scores(&qr[r0 * dim], kh_keys + b0 * block_elems, count, dim, scores.data());
      if (s.softcap > 0) softcap_scores(scores.data(), kPair * kSpan, static_cast<float>(scale), s.softcap);
      for (int64_t r = 0; r < kPair; ++r) {
        const int64_t row_position = position + std::min((r0 + r) / group, n - 1);
        valid[r] = std::min(row_position, s.ctx - 1) - k0 + 1;
        low[r] = s.lowest_key(row_position) - k0;
      }
      for (int64_t t = 0; t < kPair; t += kTile)
        softmax_span(&scores[t * kSpan], low + t, valid + t, static_cast<float>(scale), &max[r0 + t], &sum[r0 + t],
                     &probs[t * kSpan], &keep[t]);
      span_values(probs.data(), keep.data(), kh_values + b0 * block_elems, count, dim, &acc[r0 * dim]);
    }
  }
  write_rows(acc.data(), sum.data(), s, kh, i0, n, out);
}
#endif  // AMX
#endif  // AVX512-BF16

}  // namespace

namespace sobrio_ops {

// query [L, H, D] bf16 (the chunk's rows, the last at position ctx - 1); key_cache / value_cache
// [num_slots, Hkv, D] bf16; block_table [>= ctx / block_size] int64. D a multiple of 32. window > 0: the query
// at position p sees keys p - window + 1 .. p (transformers' sliding_window). softcap > 0: each scaled score
// s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). Returns [L, H, D].
at::Tensor prompt_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_table, int64_t ctx, int64_t block_size, double scale,
                            int64_t window, double softcap) {
  TORCH_CHECK(prompt_attention_supported(), "prompt_attention needs AVX512-BF16");
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16, "prompt_attention: bf16 query [L, H, D] and cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && block_table.scalar_type() == at::kLong);
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2), kv_heads = key_cache.size(1);
  TORCH_CHECK(dim % 32 == 0 && key_cache.size(2) == dim, "prompt_attention: head size a multiple of 32");
  TORCH_CHECK(heads % kv_heads == 0 && rows >= 1 && rows <= ctx, "prompt_attention: heads or rows");
  TORCH_CHECK(block_table.numel() * block_size >= ctx, "prompt_attention: the block table is shorter than ctx");
  auto q = query.contiguous();
  auto table = block_table.contiguous();
  auto out = at::empty_like(q);
#if defined(SOBRIO_PROMPT_ATTENTION)
  const Shape s{rows, heads, kv_heads, dim, ctx, block_size, window, static_cast<float>(softcap)};
  const int64_t num_blocks = (ctx + kKeys - 1) / kKeys, block_elems = kKeys * dim;
  const int64_t first_block = s.lowest_key(ctx - rows) / kKeys;  // below it, no query's window reaches
  std::vector<uint16_t> keys(kv_heads * num_blocks * block_elems), values(keys.size());
  const auto* kc = reinterpret_cast<const uint16_t*>(key_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(value_cache.data_ptr());
  const int64_t* tb = table.data_ptr<int64_t>();
  at::parallel_for(0, kv_heads * num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (t % num_blocks >= first_block)
        pack_block(kc, vc, tb, block_size, kv_heads, t / num_blocks, dim, (t % num_blocks) * kKeys, ctx,
                   &keys[t * block_elems], &values[t * block_elems]);
  });
  // Tasks by kv head (a thread's next task reads the keys and values its last one left in its cache), and
  // within a head ordered short, long, short, long... so that contiguous ranges of them weigh about the same.
#if defined(SOBRIO_PROMPT_ATTENTION_AMX)
  const bool tiles = sobrio_amx::request_amx();
  const int64_t positions = tiles ? kAmxPositions : kPositions;
#else
  const int64_t positions = kPositions;  // AVX512-BF16 without AMX (AMD Zen 4): the vector path alone
#endif
  const int64_t spans = (rows + positions - 1) / positions, tasks = kv_heads * spans;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
#if defined(SOBRIO_PROMPT_ATTENTION_AMX)
    if (tiles) sobrio_amx::configure_tiles();
#endif
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kh = t / spans, k = t % spans;
      const int64_t span = k % 2 == 0 ? k / 2 : spans - 1 - k / 2;
      const int64_t i0 = span * positions, n = std::min(positions, rows - i0);
#if defined(SOBRIO_PROMPT_ATTENTION_AMX)
      if (tiles) {
        attend_task_amx(qp, keys.data(), values.data(), s, scale, kh, i0, n, op);
        continue;
      }
#endif
      attend_task(qp, keys.data(), values.data(), s, scale, kh, i0, n, op);
    }
#if defined(SOBRIO_PROMPT_ATTENTION_AMX)
    if (tiles) _tile_release();
#endif
  });
#endif
  return out;
}

bool prompt_attention_supported() {
#if defined(SOBRIO_PROMPT_ATTENTION)
  return true;
#else
  return false;
#endif
}

}  // namespace sobrio_ops
