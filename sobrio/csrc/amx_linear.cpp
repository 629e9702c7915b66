// bf16 matmul on Intel AMX tiles for the decode batches (5 to a few hundred rows), where oneDNN's kernel
// streams a small weight at about 9 GB/s: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32 accumulation,
// one rounding to bf16 per output.
//
// The weight is read in oneDNN's packed layout on AMX, [N/32, K/32, 16 (input pairs), 32 (columns), 2]: for
// each block of 32 output columns, 2 KB per 32 inputs, one row of 128 bytes per pair of inputs (what
// TDPBF16PS reads, two 16-column tiles side by side). So a Linear keeps oneDNN's copy alone, which its
// GEMM reads past the decode batches (layers/linear.py checks the layout at load). A step reads the weight
// as one sequential stream (a thread's blocks of 32 columns follow each other), prefetched into L2 ahead of
// the tile loads, and every tile product is 16x16x32 at once. x is read in blocks of 32 rows (copied to a
// zero-padded buffer when its rows are not whole tiles of 16), so one tile configuration serves every shape;
// a block of 16 rows or fewer skips its second row tile and its products (on a host whose tile products are
// slow, 4 products a slab made the kernel compute-bound: docs/benchmarks.md).
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SOBRIO_AMX 1
#include <immintrin.h>
#include "amx.h"
#include "vec.h"
#endif
#if defined(SOBRIO_AMX) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define SOBRIO_AMX_INT8 1
#endif

namespace {

constexpr int64_t kTileRows = 16, kTileK = 32, kBlockN = 32;

#if defined(SOBRIO_AMX)
// Tiles (amx.h): tmm0-3 the 32x32 float block of y, tmm4-5 two 16-row slices of x, tmm6-7 the weight tiles of
// the block's two 16-column halves (the int8 kernel's pairs of blocks, 16 rows or fewer: tmm0-3 the sums of
// four halves, tmm4 x, tmm5-7 their weight tiles).
using sobrio_amx::configure_tiles;
using sobrio_amx::padded_x_rows;
using sobrio_amx::request_amx;
using sobrio_amx::store_tiles;
using sobrio_amx::zero_tiles;
using sobrio_ops::row_grain;

inline void prefetch_tile(const void* p) {  // a 1 KB tile: 16 lines of 64 bytes
  for (int line = 0; line < 16; ++line) _mm_prefetch(static_cast<const char*>(p) + line * 64, _MM_HINT_T0);
}

constexpr int64_t kPrefetchSlabs = 8;  // 2 KB slabs of a bf16 weight fetched into L2 ahead of the tile loads

inline void prefetch_slab_l2(const void* p) {  // a 2 KB slab: 32 lines of 64 bytes
  for (int line = 0; line < 32; ++line) _mm_prefetch(static_cast<const char*>(p) + line * 64, _MM_HINT_T1);
}

// y rows [m, m + rows) (rows <= 32) x columns [n, n+32), `w` the block's 32 columns (K/32 slabs of 2 KB): the
// float block in `acc` [32][32] (with 16 `rows` or fewer, its rows 16-31 are left unwritten). The prefetch runs on
// past the block into the next one, which follows it in memory (a prefetch past the weight's end does not
// fault), so no block starts on a miss. `prefetch` false: a later pass over the same block (rows 32 on), whose
// weight the first pass left in L2: its 32 prefetches a slab would only cost time (figures: docs/benchmarks.md).
void block_product(const c10::BFloat16* xp, const c10::BFloat16* w, int64_t K, int64_t rows, bool prefetch,
                   float* acc) {
  const bool both = rows > kTileRows;
  zero_tiles();
  const int64_t slab = kTileRows * kBlockN * 2, k_tiles = K / kTileK, x_stride = K * 2;
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const c10::BFloat16* wt = w + kt * slab;
    if (prefetch) prefetch_slab_l2(wt + kPrefetchSlabs * slab);
    _tile_loadd(4, xp + kt * kTileK, x_stride);
    _tile_loadd(6, wt, 4 * kTileRows * 2);  // columns 0-15 of each 128-byte row
    _tile_loadd(7, wt + kTileRows * 2, 4 * kTileRows * 2);  // columns 16-31
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (both) {
      _tile_loadd(5, xp + kTileRows * K + kt * kTileK, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_tiles(acc, kBlockN, both);
}

void store_block(const float* acc, const c10::BFloat16* bias, c10::BFloat16* y, int64_t rows, int64_t N, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kBlockN; ++c)
      y[r * N + n + c] = static_cast<c10::BFloat16>(acc[r * kBlockN + c] + (bias ? static_cast<float>(bias[n + c]) : 0.f));
}
#endif

// Outside the AMX guards: amx_int8_linear checks its operands on every CPU, and builds on any.
constexpr int64_t kOutlierChannels = 64;  // one tile of inputs

// Input channels rounded apart from the rest, with a per-token scale of their own (their columns of the same
// int8 weight packed on their own): the few channels of the tied LM head's inputs far above the others, which
// would otherwise set every token's step. (A down_proj's inputs are rounded per group of 64 instead.)
struct Outlier {
  const int64_t* index = nullptr;  // [64] the channels
  const int8_t* packed = nullptr;  // w[:, index] packed by amx_pack_weight_int8: [N/16, 1, 16, 16, 4]
};

#if defined(SOBRIO_AMX_INT8)
constexpr int64_t kTileK8 = 64;  // int8 inputs per tile row: 16 quads, what TDPBSSD reads
constexpr int64_t kPrefetchTiles = 6;  // tiles ahead a weight stream is fetched

// Tiles 0-3 += the products of x tiles [kt0, kt1) and the two weight streams' (0-1 only for a block of 16
// rows or fewer, `both` false: its second row tile is padding). A weight stream is K / 64 tiles (9 for
// K = 576): the last iterations fetch the next block's first tiles (it follows w1), or every block would
// start on a miss. A prefetch past the weight's end does not fault. `prefetch` false: the block's weight is
// already in cache (a pass's later row blocks read what its first one fetched), so its 32 prefetches a step
// would buy nothing and cost time (figures: docs/benchmarks.md).
inline void accumulate_tiles(const int8_t* xp, const int8_t* w0, const int8_t* w1, int64_t K, int64_t kt0,
                             int64_t kt1, bool both, bool prefetch) {
  const int64_t tile_bytes = kTileRows * kTileK8, k_tiles = K / kTileK8;
  const int8_t* next = w1 + kTileRows * K;
  for (int64_t kt = kt0; kt < kt1; ++kt) {
    const int64_t ahead = kt + kPrefetchTiles;
    if (prefetch) {
      if (ahead < k_tiles) prefetch_tile(w0 + ahead * tile_bytes), prefetch_tile(w1 + ahead * tile_bytes);
      else prefetch_tile(next + (ahead - k_tiles) * tile_bytes), prefetch_tile(next + ahead * tile_bytes);
    }
    _tile_loadd(4, xp + kt * kTileK8, K);
    _tile_loadd(6, w0 + kt * tile_bytes, 64);
    _tile_loadd(7, w1 + kt * tile_bytes, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (both) {
      _tile_loadd(5, xp + kTileRows * K + kt * kTileK8, K);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
}

// y rows [m, m + rows) (rows <= 32) x columns [n, n+32) as int32 sums in `acc` [32][32]: the bf16 block
// product's loop on int8 tiles of 64 inputs; past 16 `rows`, the padding rows are left unwritten.
void block_product_s8(const int8_t* xp, const int8_t* w0, const int8_t* w1, int64_t K, int64_t rows, bool prefetch,
                      int32_t* acc) {
  const bool both = rows > kTileRows;
  zero_tiles();
  accumulate_tiles(xp, w0, w1, K, 0, K / kTileK8, both, prefetch);
  store_tiles(acc, kBlockN, both);
}

// Two blocks of 32 columns against x of 16 rows or fewer: four 16-column halves, one after another from `w`,
// each x tile loaded once for their four products (tiles 0-3; weight tiles 5-7) instead of once a block (figures:
// docs/benchmarks.md, "A few rows read in place"). The sums in `acc` [32][32]:
// rows 0-15 the first block's, 16-31 the second's. The last iterations fetch the next pair's first tiles, as
// `accumulate_tiles` does.
void pair_product_s8(const int8_t* xp, const int8_t* w, int64_t K, int32_t* acc) {
  const int64_t tile_bytes = kTileRows * kTileK8, k_tiles = K / kTileK8, half = kTileRows * K;
  const int8_t* next = w + 4 * half;
  zero_tiles();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int64_t ahead = kt + kPrefetchTiles;
    for (int64_t h = 0; h < 4; ++h)
      prefetch_tile(ahead < k_tiles ? w + h * half + ahead * tile_bytes : next + h * half + (ahead - k_tiles) * tile_bytes);
    _tile_loadd(4, xp + kt * kTileK8, K);
    _tile_loadd(5, w + kt * tile_bytes, 64);
    _tile_dpbssd(0, 4, 5);
    _tile_loadd(6, w + half + kt * tile_bytes, 64);
    _tile_dpbssd(1, 4, 6);
    _tile_loadd(7, w + 2 * half + kt * tile_bytes, 64);
    _tile_dpbssd(2, 4, 7);
    _tile_loadd(5, w + 3 * half + kt * tile_bytes, 64);
    _tile_dpbssd(3, 4, 5);
  }
  store_tiles(acc, kBlockN, true);
}

// facc [rows][32] (+)= a group's int32 sums times their row's scale for that group (`first`: = instead of +=).
inline void add_group_sums(const int32_t* acc, const float* x_scale, int64_t groups, int64_t g, int64_t rows,
                           bool first, float* facc) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(x_scale[r * groups + g]);
    for (int h = 0; h < 2; ++h) {
      float* f = facc + r * kBlockN + 16 * h;
      const __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + r * kBlockN + 16 * h));
      _mm512_storeu_ps(f, first ? _mm512_mul_ps(v, s) : _mm512_fmadd_ps(v, s, _mm512_loadu_ps(f)));
    }
  }
}

// The same block with the activations rounded per group of `group_tiles` x 64 inputs (a scale per token and
// group, `x_scale` [rows][groups]): each group's int32 sums leave the tiles and are added in float32 times
// their row's scale, so an outlier channel sets the step of its own 64 inputs only. Software-pipelined: the
// vector work on group g - 1's sums comes after group g's tile products are issued, so it runs while the tiles
// compute instead of after them. `acc` is scratch for two blocks of sums.
void block_product_s8_grouped(const int8_t* xp, const int8_t* w0, const int8_t* w1, int64_t K, int64_t group_tiles,
                              const float* x_scale, int64_t rows, bool prefetch, int32_t* acc, float* facc) {
  const int64_t groups = K / kTileK8 / group_tiles, block = 2 * kTileRows * kBlockN;
  const bool both = rows > kTileRows;
  for (int64_t g = 0; g < groups; ++g) {
    zero_tiles();
    accumulate_tiles(xp, w0, w1, K, g * group_tiles, (g + 1) * group_tiles, both, prefetch);
    if (g > 0) add_group_sums(acc + ((g - 1) & 1) * block, x_scale, groups, g - 1, rows, g == 1, facc);
    store_tiles(acc + (g & 1) * block, kBlockN, both);
  }
  add_group_sums(acc + ((groups - 1) & 1) * block, x_scale, groups, groups - 1, rows, groups == 1, facc);
}

// A 32x32 block of float sums (already times the rows' scales) to TOut: times each column's scale, plus the bias.
template <typename TB, typename TOut>
void store_block_f32(const float* facc, const float* w_scale, const TB* bias, TOut* y, int64_t rows, int64_t N,
                     int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const __m512 b = bias ? sobrio_vec::load16(bias + n + 16 * h) : _mm512_setzero_ps();
      sobrio_vec::store16(y + r * N + n + 16 * h, _mm512_fmadd_ps(_mm512_loadu_ps(facc + r * kBlockN + 16 * h),
                                                                  _mm512_loadu_ps(w_scale + n + 16 * h), b));
    }
}

// One token's row to int8 with its own symmetric scale (max |x| / 127; rounding to nearest even, as
// torch.round): what `quantize_per_token` computes in Python.
template <typename T>
float quantize_row(const T* x, int64_t K, int8_t* q) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(sobrio_vec::load16(x + k)));
  const float scale = std::max(_mm512_reduce_max_ps(mx), std::numeric_limits<float>::min()) / 127.f;
  const __m512 step = _mm512_set1_ps(scale);  // divided, not multiplied by 1 / scale: the same ties as Python
  for (int64_t k = 0; k < K; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(sobrio_vec::load16(x + k), step),
                                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtsepi32_epi8(v));
  }
  return scale;
}

// A 32x32 block of sums to TOut: times each row's and column's scale, plus the bias. `acc2`, where an outlier
// group was computed apart (see `Outlier`), adds its sums times its own row scales before the column's.
template <typename TB, typename TOut>
void store_block_s8(const int32_t* acc, const float* x_scale, const int32_t* acc2, const float* x_scale2,
                    const float* w_scale, const TB* bias, TOut* y, int64_t rows, int64_t N, int64_t n) {
  __m512 ws[2], b[2];
  for (int h = 0; h < 2; ++h) {
    ws[h] = _mm512_loadu_ps(w_scale + n + 16 * h);
    b[h] = bias ? sobrio_vec::load16(bias + n + 16 * h) : _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + r * kBlockN + 16 * h)),
                               _mm512_set1_ps(x_scale[r]));
      if (acc2)
        s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc2 + r * kBlockN + 16 * h)),
                            _mm512_set1_ps(x_scale2[r]), s);
      sobrio_vec::store16(y + r * N + n + 16 * h, _mm512_fmadd_ps(s, ws[h], b[h]));
    }
}

constexpr int64_t kRowsPerPass = 256;  // x rows a thread keeps in L2 while it sweeps its columns

// Row m of x into qp (its outlier channels zeroed there and rounded into qo on their own scale, *scale2).
template <typename T>
void quantize_token(const T* x, int64_t K, const Outlier& outlier, int8_t* qp, float* scale, int8_t* qo,
                    float* scale2, float* buffer) {
  if (!outlier.index) {
    *scale = quantize_row(x, K, qp);
    return;
  }
  float picked[kOutlierChannels];
  for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(buffer + k, sobrio_vec::load16(x + k));
  for (int64_t j = 0; j < kOutlierChannels; ++j) picked[j] = buffer[outlier.index[j]], buffer[outlier.index[j]] = 0.f;
  *scale = quantize_row(buffer, K, qp);
  *scale2 = quantize_row(picked, kOutlierChannels, qo);
}

// What both int8 kernels read and write besides x: the packed weight, its scales, the bias, y, and how the
// blocks of 32 output columns split over the threads (only past ~256 KB of weight a thread, as the GEMV).
template <typename T, typename TOut>
struct Int8Operands {
  at::Tensor bias_c;  // keeps a contiguous copy of the bias alive
  const int8_t* wp;
  const float* wsp;
  const T* b;
  TOut* yp;
  int64_t blocks, grain;
  Int8Operands(const at::Tensor& packed, const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
               at::Tensor& y, int64_t K)
      : bias_c(bias.has_value() ? bias->contiguous() : at::Tensor()),
        wp(packed.data_ptr<int8_t>()),
        wsp(w_scale.data_ptr<float>()),
        b(bias.has_value() ? bias_c.data_ptr<T>() : nullptr),
        yp(y.data_ptr<TOut>()),
        blocks(y.size(1) / kBlockN),
        grain(std::max<int64_t>(1, (256 << 10) / (kBlockN * K))) {}
};

// `amx_int8_kernel` with the activations rounded per token and group of `group_k` inputs (a multiple of 64).
template <typename T, typename TOut>
void amx_int8_grouped_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                             const c10::optional<at::Tensor>& bias, int64_t group_k, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), groups = K / group_k;
  const int64_t rows_padded = padded_x_rows(M, 2 * kTileRows);
  auto xq = at::empty({rows_padded, K}, x.options().dtype(at::kChar));
  auto xs = at::zeros({rows_padded, groups}, x.options().dtype(at::kFloat));  // padding rows: scale 0
  const T* xp = x.data_ptr<T>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = xs.data_ptr<float>();
  std::memset(qp + M * K, 0, (rows_padded - M) * K);
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g)
        sp[m * groups + g] = quantize_row(xp + m * x.stride(0) + g * group_k, group_k, qp + m * K + g * group_k);
  });
  const Int8Operands<T, TOut> op(packed, w_scale, bias, y, K);
  const int8_t* wp = op.wp;
  at::parallel_for(0, op.blocks, op.grain, [&](int64_t begin, int64_t end) {
    configure_tiles(static_cast<int>(std::min(M, kTileRows)));
    alignas(64) int32_t acc[2 * 2 * kTileRows * kBlockN];
    alignas(64) float facc[2 * kTileRows * kBlockN];
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
      for (int64_t nb = begin; nb < end; ++nb) {
        const int8_t* w0 = wp + (2 * nb) * kTileRows * K;
        for (int64_t m = m0; m < std::min(M, m0 + kRowsPerPass); m += 2 * kTileRows) {
          const int64_t rows = std::min<int64_t>(2 * kTileRows, M - m);
          block_product_s8_grouped(qp + m * K, w0, w0 + kTileRows * K, K, group_k / kTileK8, sp + m * groups, rows,
                                   m == m0, acc, facc);
          store_block_f32(facc, op.wsp, op.b, op.yp + m * N, rows, N, nb * kBlockN);
        }
      }
    _tile_release();
  });
}

template <typename T, typename TOut>
void amx_int8_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                     const c10::optional<at::Tensor>& bias, const Outlier& outlier, int64_t group_k, at::Tensor& y) {
  if (group_k) return amx_int8_grouped_kernel<T, TOut>(x, packed, w_scale, bias, group_k, y);
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t rows_padded = padded_x_rows(M, 2 * kTileRows);
  const bool split = outlier.index != nullptr;
  auto xq = at::empty({rows_padded, K + (split ? kOutlierChannels : 0)}, x.options().dtype(at::kChar));
  auto xs = at::empty({2, rows_padded}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  int8_t* qp = xq.data_ptr<int8_t>();
  int8_t* qo = qp + rows_padded * K;  // the outlier group's rows, 64 bytes each, after the others
  float *sp = xs.data_ptr<float>(), *sp2 = sp + rows_padded;
  std::memset(qp + M * K, 0, (rows_padded - M) * K);  // the padding rows only: the others are written below
  if (split) std::memset(qo + M * kOutlierChannels, 0, (rows_padded - M) * kOutlierChannels);
  at::parallel_for(0, M, row_grain(K), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(split ? K : 0);
    for (int64_t m = begin; m < end; ++m)
      quantize_token(xp + m * x.stride(0), K, outlier, qp + m * K, sp + m, qo + m * kOutlierChannels, sp2 + m,
                     buffer.data());
  });
  const Int8Operands<T, TOut> op(packed, w_scale, bias, y, K);
  const int8_t* wp = op.wp;
  at::parallel_for(0, op.blocks, op.grain, [&](int64_t begin, int64_t end) {
    configure_tiles(static_cast<int>(std::min(M, kTileRows)));
    alignas(64) int32_t acc[2 * kTileRows * kBlockN], acc2[split ? 2 * kTileRows * kBlockN : 1];
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass)
      for (int64_t nb = begin; nb < end; ++nb) {
        const int8_t* w0 = wp + (2 * nb) * kTileRows * K;
        const int8_t* o0 = split ? outlier.packed + (2 * nb) * kTileRows * kOutlierChannels : nullptr;
        if (M <= kTileRows && nb + 1 < end) {  // a decode batch: two blocks at a time
          pair_product_s8(qp, w0, K, acc);
          for (int64_t b = 0; b < 2; ++b) {
            if (split)
              block_product_s8(qo, o0 + 2 * b * kTileRows * kOutlierChannels,
                               o0 + (2 * b + 1) * kTileRows * kOutlierChannels, kOutlierChannels, M, true, acc2);
            store_block_s8(acc + b * kTileRows * kBlockN, sp, split ? acc2 : nullptr, sp2, op.wsp, op.b, op.yp, M, N,
                           (nb + b) * kBlockN);
          }
          ++nb;
          continue;
        }
        for (int64_t m = m0; m < std::min(M, m0 + kRowsPerPass); m += 2 * kTileRows) {
          const int64_t rows = std::min<int64_t>(2 * kTileRows, M - m);
          block_product_s8(qp + m * K, w0, w0 + kTileRows * K, K, rows, m == m0, acc);
          if (split)
            block_product_s8(qo + m * kOutlierChannels, o0, o0 + kTileRows * kOutlierChannels, kOutlierChannels, rows,
                             m == m0, acc2);
          store_block_s8(acc, sp + m, split ? acc2 : nullptr, sp2 + m, op.wsp, op.b, op.yp + m * N, rows, N,
                         nb * kBlockN);
        }
      }
    _tile_release();
  });
}
#endif

void check_packable(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx: a 2-D bf16 weight");
  TORCH_CHECK(w.size(0) % kBlockN == 0 && w.size(1) % kTileK == 0, "amx: N a multiple of 32, K of 32");
}

}  // namespace

namespace sobrio_ops {

bool amx_supported() {
#if defined(SOBRIO_AMX)
  return request_amx();
#else
  return false;
#endif
}

// w [N, K] -> [N/32, K/32, 16 (input pairs), 32 (columns), 2]: slab (n, k) holds w[n*32 + c][k*32 + 2r + e]
// at [r][c][e]; the bytes oneDNN's reorder writes on AMX.
at::Tensor amx_pack_weight(at::Tensor w) {
  check_packable(w);
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / kBlockN, kBlockN, K / kTileK, kTileK / 2, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

at::Tensor amx_linear(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(amx_supported(), "amx_linear needs AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.numel() == N * K &&
                  N % kBlockN == 0 && K % kTileK == 0,
              "amx_linear: a contiguous bf16 weight packed by amx_pack_weight, N a multiple of 32, K of 32");
  auto y = at::empty({M, N}, x.options());
#if defined(SOBRIO_AMX)
  if (M == 0) return y;
  // Whole 16-row tiles of x (a last block of 16 rows or fewer reads no second tile): fewer than 16 rows, or a
  // decode batch of 16, 32, 48 or 64, is read in place, others are padded with zeros.
  const int64_t rows_padded = padded_x_rows(M, kTileRows);
  at::Tensor xpad = x.is_contiguous() && rows_padded == M ? x : at::empty({rows_padded, K}, x.options());
  if (!xpad.is_same(x)) {  // x's rows copied, only the padding rows zeroed (not the whole buffer first)
    xpad.narrow(0, 0, M).copy_(x);
    xpad.narrow(0, M, rows_padded - M).zero_();
  }
  const auto* xp = xpad.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const auto* b = bias.has_value() ? bc.data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Blocks of 32 columns over the threads; split only past ~256 KB of weight a thread (as the GEMV).
  const int64_t blocks = N / kBlockN, grain = std::max<int64_t>(1, (256 << 10) / (kBlockN * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    configure_tiles(static_cast<int>(std::min(M, kTileRows)));
    alignas(64) float acc[2 * kTileRows * kBlockN];
    for (int64_t nb = begin; nb < end; ++nb) {
      const c10::BFloat16* w = wp + nb * kBlockN * K;
      for (int64_t m = 0; m < M; m += 2 * kTileRows) {
        const int64_t rows = std::min<int64_t>(2 * kTileRows, M - m);
        block_product(xp + m * K, w, K, rows, m == 0, acc);
        store_block(acc, b, yp + m * N, rows, N, nb * kBlockN);
      }
    }
    _tile_release();
  });
#endif
  return y;
}

bool amx_int8_supported() {
#if defined(SOBRIO_AMX_INT8)
  return request_amx();
#else
  return false;
#endif
}

// w [N, K] int8 -> [N/16, K/64, 16 (input quads), 16 (columns), 4]: tile (n, k) holds w[n*16 + c][k*64 + 4r + e]
// at [r][c][e].
at::Tensor amx_pack_weight_int8(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "amx int8: a 2-D int8 weight");
  TORCH_CHECK(w.size(0) % kBlockN == 0 && w.size(1) % 64 == 0, "amx int8: N a multiple of 32, K of 64");
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / kTileRows, kTileRows, K / 64, 16, 4}).permute({0, 2, 3, 1, 4}).contiguous();
}

// W8A8: x [M, K] (bf16 or float32, rows with unit stride) rounded to int8 per token in the kernel, times the
// int8 weight packed by amx_pack_weight_int8 with its float32 scale per output channel; y in x's dtype, or
// float32 with `float_out`. `outlier_index` (64 channels) and `outlier_packed` (the weight's columns there,
// packed): those channels rounded on a per-token scale of their own. `group_k` > 0: x rounded per token and
// group of that many inputs instead (no outliers then: each group has its own step).
at::Tensor amx_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor w_scale, int64_t N,
                           c10::optional<at::Tensor> bias, c10::optional<at::Tensor> outlier_index,
                           c10::optional<at::Tensor> outlier_packed, bool float_out, int64_t group_k) {
  TORCH_CHECK(amx_int8_supported(), "amx_int8_linear needs AMX-INT8");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "amx_int8_linear: x [M, K] bf16 or float32, unit stride along K");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.numel() == N * K && N % kBlockN == 0 && K % 64 == 0,
              "amx_int8_linear: packed weight shape");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
              "amx_int8_linear: float32 scales, one per output channel");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->numel() == N),
              "amx_int8_linear: a bias of x's dtype, one per output channel");
  TORCH_CHECK(outlier_index.has_value() == outlier_packed.has_value(), "amx_int8_linear: outlier index and weight");
  TORCH_CHECK(group_k == 0 || (group_k % 64 == 0 && K % group_k == 0 && !outlier_index.has_value()),
              "amx_int8_linear: group_k 0 (a scale a token) or a multiple of 64 dividing K, without outliers");
  Outlier outlier;
  at::Tensor index;
  if (outlier_index.has_value()) {
    index = outlier_index->contiguous();
    TORCH_CHECK(index.scalar_type() == at::kLong && index.numel() == kOutlierChannels &&
                    index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < K,
                "amx_int8_linear: 64 outlier channels of x, each < K");
    TORCH_CHECK(outlier_packed->scalar_type() == at::kChar && outlier_packed->numel() == N * kOutlierChannels &&
                    outlier_packed->is_contiguous(),
                "amx_int8_linear: the outlier channels' weight, packed");
    outlier = {index.data_ptr<int64_t>(), outlier_packed->data_ptr<int8_t>()};
  }
  auto y = at::empty({x.size(0), N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
#if defined(SOBRIO_AMX_INT8)
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kFloat) amx_int8_kernel<float, float>(x, packed, w_scale, bias, outlier, group_k, y);
  else if (float_out) amx_int8_kernel<c10::BFloat16, float>(x, packed, w_scale, bias, outlier, group_k, y);
  else amx_int8_kernel<c10::BFloat16, c10::BFloat16>(x, packed, w_scale, bias, outlier, group_k, y);
#endif
  return y;
}

}  // namespace sobrio_ops
