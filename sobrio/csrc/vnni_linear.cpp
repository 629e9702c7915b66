// Matmul on 4- and 8-bit group-wise weights with int8 dot products (AVX512-VNNI), as llama.cpp computes its
// quantized blocks: each row of x is rounded per group of inputs (its own step per group) to 8 bits, or to
// 16 bits as two int8 halves, the products of codes and rounded activations are summed exactly in int32,
// and each group's sum is scaled once in float32. A weight is w = scale * (code - code_zero) + offset per
// group (codes unsigned: 0..15 at 4 bits, 0..255 at 8 bits, where signed codes come shifted by
// code_zero = 128), so
//   y[m, n] = sum_g  scale[n, g] * step[m, g] * (sum_k code[n, k] * xq[m, k] - code_zero * sum_k xq[m, k])
//                  + offset[n, g] * sum_k x[m, k]              (k over group g; offsets may be absent)
// The weights are read once, in a layout made for this loop (layers/vnni.py packs it): tiles of 32 output
// channels; per group, chunks of 64 bytes holding 16 channels x 4 consecutive inputs (8 bits), or 16
// channels x 8 inputs as two nibbles (4 bits: the low nibble input j, the high one input j + 4), so one
// vpdpbusd multiplies 16 channels by 4 broadcast activations. Scales and offsets: fp16, [tiles, G, 32]; or
// one scale a channel, [tiles, 1, 32], and no offsets (the int8 modes' weights): then each group's
// sums are scaled by x's step only, and by the channel's scale once at the end (two vector operations a row,
// half-tile and group instead of four: docs/quantization.md). A group's sums start at the code_zero term.
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "vec.h"

namespace {

constexpr int64_t kTile = 32;    // output channels a tile
constexpr int64_t kRowBlock = 4;  // rows of x computed per pass over a tile (the tile stays in L1/L2)
// Rows a pass in the channel-scale kernel with 8-bit activations, past 8 rows: 16 sums in registers, so each
// tile is read from L2 half as often. Up to 8 rows, two passes of 4 keep the next-tile prefetch that one pass
// of 8 would lose (both measured in docs/quantization.md).
constexpr int64_t kChannelRowBlock = 8;
// Rows of x a pass over the whole weight takes, so their rounded activations stay in the core's L2 while every
// tile reads them (all the rows of a 2,048-token chunk were read from memory once a tile; docs/quantization.md).
constexpr int64_t kRowPass = 256;
// Bytes ahead to prefetch: the hardware prefetchers ramp up too slowly on a decode step's small matrices
// (SmolLM2's 120 layer matmuls from memory: 2.6-2.7 ms with 512 bytes ahead, 3.2-3.8 without, AMD EPYC
// Zen 4, 2 threads). 2 KB ahead into L1 (32 lines; a thread's tiles are one sequential stream): one row 2.56 ->
// 1.70-1.78 ms, 4096 no better (`benchmarks/vnni_kernels.py --rows 1`, Intel Xeon with AMX, 2 threads). 4 KB
// ahead into L2 streamed a few per cent faster than 2 KB into L1 on that Xeon (docs/benchmarks.md): L1's
// fill buffers no longer hold the lines in flight.
constexpr int64_t kPrefetch = 4096;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define SOBRIO_VNNI 1

// x rounded per (row, group) to int8 (`act_bits` 8: llama.cpp's Q8 activations), or to 16 bits held as two
// int8 halves, x16 = 256 * hi + lo with hi in -127..127 and lo in -128..127 (`act_bits` 16: two dot
// products a chunk, 15-bit activations, finer than bf16's 8-bit mantissa; SmolLM2's Q4_1 file: perplexity
// +0.1% against the file dequantized, where 8-bit activations cost +1.6%). Per group: the step, the sum of
// the integer values, the sum of x itself.
// The arrays are left uninitialized (`make_unique_for_overwrite`): every value is written before it is read, and
// zeroing a 2,048-row chunk's 16 MB a down_proj was a memory pass of its own.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> hi, lo;  // lo: null at 8 bits
  std::unique_ptr<float[]> step;
  std::unique_ptr<int32_t[]> qsum;
  std::unique_ptr<float[]> sum;
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K, int64_t group, bool wide) {
  const int64_t G = K / group;
  const float top = wide ? 32512.f : 127.f;  // 127 * 256: hi stays within int8
  QuantizedRows out{std::make_unique_for_overwrite<int8_t[]>(M * K),
                    wide ? std::make_unique_for_overwrite<int8_t[]>(M * K) : nullptr,
                    std::make_unique_for_overwrite<float[]>(M * G), std::make_unique_for_overwrite<int32_t[]>(M * G),
                    std::make_unique_for_overwrite<float[]>(M * G)};
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
  for (int64_t mg = begin; mg < end; ++mg) {
    const T* xg = x + mg * group;  // rows are contiguous: group mg of the flattened [M, K]
    __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < group; k += 16) {
      const __m512 v = sobrio_vec::load16(xg + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      sum = _mm512_add_ps(sum, v);
    }
    const float a = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(a > 0.f ? top / a : 0.f);
    __m512i qsum = _mm512_setzero_si512();
    for (int64_t k = 0; k < group; k += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(sobrio_vec::load16(xg + k), inv));  // nearest even
      qsum = _mm512_add_epi32(qsum, q);
      const __m512i hi = wide ? _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8) : q;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.hi.get() + mg * group + k), _mm512_cvtepi32_epi8(hi));
      if (wide)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.lo.get() + mg * group + k),
                         _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8))));
    }
    out.step[mg] = a / top;
    out.qsum[mg] = _mm512_reduce_add_epi32(qsum);
    out.sum[mg] = _mm512_reduce_add_ps(sum);
  }
  });
  return out;
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A group's int32 sums of kM rows start at -code_zero * sum_k xq[m, k], the code_zero term (in the low half's
// sum with 16-bit activations: hi * 256 + lo): exact, and no operation after the dot products.
template <int kM, bool kWide>
inline void start_sums(const QuantizedRows& xq, int64_t mg, int64_t G, int32_t code_zero, __m512i (&dot)[kM][2],
                       __m512i (&dot_lo)[kM][2]) {
  for (int r = 0; r < kM; ++r) {
    const __m512i term = _mm512_set1_epi32(-code_zero * xq.qsum[mg + r * G]);
    dot[r][0] = dot[r][1] = kWide ? _mm512_setzero_si512() : term;
    dot_lo[r][0] = dot_lo[r][1] = kWide ? term : _mm512_setzero_si512();
  }
}

// Where one of P passes over a tile prefetches the next tile into L2: pass p takes the p-th P-th of it, 1/P
// of a line for each line it reads, so memory streams the next tile at an even rate through all P passes
// (every pass prefetching the whole next tile put all of memory's work in the first pass, while the others
// computed from L2 and memory idled; figures: docs/quantization.md).
struct NextTile {
  const char* at;  // the next line to prefetch
  int64_t step;    // bytes to move on a chunk (128 bytes of this tile): 128 / P, rounded up
};

// One group of a tile (32 channels, `group` inputs from w) against kM rows of int8 activations (row stride
// K): dot[r][half] += codes . hi, 16 channels a half; with kWide also dot_lo[r][half] += codes . lo, a
// chain of its own (one chain twice as long waited on vpdpbusd's latency at one row). kNextTile: one of
// several passes over a tile, which also prefetches its share of the next tile (`next`) into L2.
template <int kBits, int kM, bool kWide, bool kNextTile>
inline void group_dot(const uint8_t* w, const int8_t* hi_x, const int8_t* lo_x, int64_t K, int64_t group,
                      NextTile& next, __m512i (&dot)[kM][2], __m512i (&dot_lo)[kM][2]) {
  const int64_t per_chunk = kBits == 4 ? 8 : 4;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // At 4 bits and one or two rows, the high nibbles' products go to chains of their own, summed at the
  // end: two dependent vpdpbusd a chunk into one accumulator waited on its latency (more rows have chains
  // enough, and registers for no more).
  constexpr bool kSplit = kBits == 4 && kM <= 2;
  __m512i dot_b[kM][2], dot_lo_b[kM][2];
  if constexpr (kSplit)
    for (int r = 0; r < kM; ++r) dot_b[r][0] = dot_b[r][1] = dot_lo_b[r][0] = dot_lo_b[r][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < group; k += per_chunk) {
    if constexpr (kNextTile) {
      _mm_prefetch(next.at, _MM_HINT_T1);
      next.at += next.step;
    }
    for (int h = 0; h < 2; ++h, w += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T1);
      const __m512i raw = _mm512_loadu_si512(w);
      if constexpr (kBits == 4) {
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int r = 0; r < kM; ++r) {
          __m512i& high = kSplit ? dot_b[r][h] : dot[r][h];
          dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], lo, broadcast4(hi_x + r * K + k));
          high = _mm512_dpbusd_epi32(high, hi, broadcast4(hi_x + r * K + k + 4));
          if constexpr (kWide) {
            __m512i& high_lo = kSplit ? dot_lo_b[r][h] : dot_lo[r][h];
            dot_lo[r][h] = _mm512_dpbusd_epi32(dot_lo[r][h], lo, broadcast4(lo_x + r * K + k));
            high_lo = _mm512_dpbusd_epi32(high_lo, hi, broadcast4(lo_x + r * K + k + 4));
          }
        }
      } else {
        for (int r = 0; r < kM; ++r) {
          dot[r][h] = _mm512_dpbusd_epi32(dot[r][h], raw, broadcast4(hi_x + r * K + k));
          if constexpr (kWide) dot_lo[r][h] = _mm512_dpbusd_epi32(dot_lo[r][h], raw, broadcast4(lo_x + r * K + k));
        }
      }
    }
  }
  // The sums leave the loop in registers (an empty asm that reads and writes each): without it GCC 12 gave a
  // sum's value inside and after the loop different registers and copied every accumulator twice a chunk
  // (32 copies to 16 vpdpbusd at 4 rows with 16-bit activations): the results are the same, bit for bit.
  for (int r = 0; r < kM; ++r)
    for (int h = 0; h < 2; ++h) {
      asm("" : "+v"(dot[r][h]));
      if constexpr (kWide) asm("" : "+v"(dot_lo[r][h]));
      if constexpr (kSplit) {
        asm("" : "+v"(dot_b[r][h]));
        if constexpr (kWide) asm("" : "+v"(dot_lo_b[r][h]));
        dot[r][h] = _mm512_add_epi32(dot[r][h], dot_b[r][h]);
        dot_lo[r][h] = _mm512_add_epi32(dot_lo[r][h], dot_lo_b[r][h]);
      }
    }
}

// Group g of a tile (at w) against rows m0.. (kM of them): the sums, started at the code_zero term.
template <int kBits, int kM, bool kWide, bool kNextTile>
inline void group_sums(const uint8_t* w, const QuantizedRows& xq, int64_t m0, int64_t K, int64_t g, int64_t group,
                       int32_t code_zero, NextTile& next, __m512i (&dot)[kM][2], __m512i (&dot_lo)[kM][2]) {
  const int64_t G = K / group, first = m0 * K + g * group;
  start_sums<kM, kWide>(xq, m0 * G + g, G, code_zero, dot, dot_lo);
  group_dot<kBits, kM, kWide, kNextTile>(w, xq.hi.get() + first, kWide ? xq.lo.get() + first : nullptr, K, group,
                                         next, dot, dot_lo);
}

// The first `n` of 16 lanes.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// 16 outputs of a row, the first `valid` of them, in y's dtype (as a float32 stored there rounds: to nearest
// even for bf16).
inline void store_outputs(float* y, __m512 v, int64_t valid) { _mm512_mask_storeu_ps(y, first_lanes(valid), v); }
inline void store_outputs(c10::BFloat16* y, __m512 v, int64_t valid) {
#if defined(__AVX512BF16__)
  if (valid >= 16) return sobrio_vec::store16(y, v);
#endif
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int64_t c = 0; c < std::min<int64_t>(valid, 16); ++c) y[c] = static_cast<c10::BFloat16>(f[c]);
}

// kM rows of x against one tile of 32 channels: y[r, 0..valid) in y's dtype (row stride ldy), plus the bias
// (float32, this tile's, or null).
template <int kBits, int kM, bool kWide, bool kNextTile, typename T>
void tile_rows(const uint8_t* w, const uint16_t* scales, const uint16_t* offsets, const QuantizedRows& xq,
               int64_t m0, int64_t K, int64_t group, int32_t code_zero, T* y, int64_t ldy, const float* bias,
               int64_t valid, NextTile next) {
  const int64_t G = K / group, group_bytes = kTile * group * kBits / 8;
  __m512 acc[kM][2];
  for (int r = 0; r < kM; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, w += group_bytes) {
    __m512i dot[kM][2], dot_lo[kM][2];
    group_sums<kBits, kM, kWide, kNextTile>(w, xq, m0, K, g, group, code_zero, next, dot, dot_lo);
    for (int h = 0; h < 2; ++h) {
      const __m512 s = load_half16(scales + (g * 2 + h) * 16);
      const __m512 o = offsets ? load_half16(offsets + (g * 2 + h) * 16) : _mm512_setzero_ps();
      for (int r = 0; r < kM; ++r) {
        const int64_t mg = (m0 + r) * G + g;
        const __m512i d = kWide ? _mm512_add_epi32(_mm512_slli_epi32(dot[r][h], 8), dot_lo[r][h]) : dot[r][h];
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(xq.step[mg])), acc[r][h]);
        if (offsets) acc[r][h] = _mm512_fmadd_ps(o, _mm512_set1_ps(xq.sum[mg]), acc[r][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t left = valid - h * 16;
    if (left <= 0) break;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(first_lanes(left), bias + h * 16) : _mm512_setzero_ps();
    for (int r = 0; r < kM; ++r) store_outputs(y + r * ldy + h * 16, _mm512_add_ps(acc[r][h], b), left);
  }
}

// tile_rows for weights with one scale a channel (scales [tiles, 1, 32], no offsets): a group's int32 sums
// are scaled by x's step alone (cvt, fma) into float sums held in L1, which leaves the registers to the int32
// sums of up to 8 rows, and by the channel's scale once at the end.
template <int kBits, int kM, bool kWide, bool kNextTile, typename T>
void tile_rows_channel(const uint8_t* w, const uint16_t* scales, const uint16_t*, const QuantizedRows& xq,
                       int64_t m0, int64_t K, int64_t group, int32_t code_zero, T* y, int64_t ldy, const float* bias,
                       int64_t valid, NextTile next) {
  const int64_t G = K / group, group_bytes = kTile * group * kBits / 8;
  const float* step = xq.step.get() + m0 * G;
  alignas(64) float acc[kM][kTile];
  for (int r = 0; r < kM; ++r)
    for (int h = 0; h < 2; ++h) _mm512_store_ps(acc[r] + h * 16, _mm512_setzero_ps());
  for (int64_t g = 0; g < G; ++g, w += group_bytes) {
    __m512i dot[kM][2], dot_lo[kM][2];
    group_sums<kBits, kM, kWide, kNextTile>(w, xq, m0, K, g, group, code_zero, next, dot, dot_lo);
    for (int r = 0; r < kM; ++r) {
      const __m512 s = _mm512_set1_ps(step[r * G + g]);
      for (int h = 0; h < 2; ++h) {
        const __m512i d = kWide ? _mm512_add_epi32(_mm512_slli_epi32(dot[r][h], 8), dot_lo[r][h]) : dot[r][h];
        float* sums = acc[r] + h * 16;
        _mm512_store_ps(sums, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, _mm512_load_ps(sums)));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t left = valid - h * 16;
    if (left <= 0) break;
    const __m512 b = bias ? _mm512_maskz_loadu_ps(first_lanes(left), bias + h * 16) : _mm512_setzero_ps();
    const __m512 s = load_half16(scales + h * 16);
    for (int r = 0; r < kM; ++r)
      store_outputs(y + r * ldy + h * 16, _mm512_fmadd_ps(_mm512_load_ps(acc[r] + h * 16), s, b), left);
  }
}

// One pass of `rows` (1 to kRowBlock, or kChannelRowBlock in the channel kernel with 8-bit activations) rows
// from m against one tile.
template <int kBits, bool kWide, bool kNextTile, bool kChannel, typename T>
void tile_pass(int64_t rows, const uint8_t* w, const uint16_t* scales, const uint16_t* offsets,
               const QuantizedRows& xq, int64_t m, int64_t K, int64_t group, int32_t code_zero, T* ym, int64_t ldy,
               const float* bias, int64_t valid, NextTile next) {
#define SOBRIO_TILE_ROWS(kM)                                                                                    \
  if constexpr (kChannel)                                                                                       \
    return tile_rows_channel<kBits, kM, kWide, kNextTile, T>(w, scales, offsets, xq, m, K, group, code_zero, ym, \
                                                            ldy, bias, valid, next);                            \
  else                                                                                                          \
    return tile_rows<kBits, kM, kWide, kNextTile, T>(w, scales, offsets, xq, m, K, group, code_zero, ym, ldy,   \
                                                    bias, valid, next)
  if constexpr (kChannel && !kWide) {
    switch (rows) {
      case 8: SOBRIO_TILE_ROWS(8);
      case 7: SOBRIO_TILE_ROWS(7);
      case 6: SOBRIO_TILE_ROWS(6);
      case 5: SOBRIO_TILE_ROWS(5);
      default: break;
    }
  }
  switch (rows) {
    case 4: SOBRIO_TILE_ROWS(4);
    case 3: SOBRIO_TILE_ROWS(3);
    case 2: SOBRIO_TILE_ROWS(2);
    default: SOBRIO_TILE_ROWS(1);
  }
#undef SOBRIO_TILE_ROWS
}

// Rows [m_begin, m_end) against one tile, kRowBlock rows a pass over it. Where there is more than one pass,
// the passes prefetch the next tile into L2, each its share (NextTile), so at 5-16 rows (decode batches)
// memory and dot products overlap instead of taking turns; one pass streams its own tile.
template <int kBits, bool kWide, bool kChannel, typename T>
void tile_all_rows(const uint8_t* w, const uint16_t* scales, const uint16_t* offsets, const QuantizedRows& xq,
                   int64_t m_begin, int64_t m_end, int64_t K, int64_t group, int32_t code_zero, T* y, int64_t ldy,
                   const float* bias, int64_t valid) {
  const int64_t block = kChannel && !kWide && m_end - m_begin > kChannelRowBlock ? kChannelRowBlock : kRowBlock;
  const auto pass = m_end - m_begin <= block ? tile_pass<kBits, kWide, false, kChannel, T>
                                              : tile_pass<kBits, kWide, true, kChannel, T>;
  const int64_t passes = (m_end - m_begin + block - 1) / block, tile_bytes = kTile * K * kBits / 8;
  const char* next_tile = reinterpret_cast<const char*>(w) + tile_bytes;
  for (int64_t m = m_begin, p = 0; m < m_end; m += block, ++p)
    pass(std::min<int64_t>(block, m_end - m), w, scales, offsets, xq, m, K, group, code_zero, y + m * ldy, ldy,
         bias, valid, NextTile{next_tile + p * tile_bytes / passes, (128 + passes - 1) / passes});
}

// One tile, a range of rows: the kernel for these bits, activation width, scales (per group or channel) and
// output dtype.
template <typename T>
using TileKernel = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, const QuantizedRows&, int64_t,
                            int64_t, int64_t, int64_t, int32_t, T*, int64_t, const float*, int64_t);

template <int kBits, typename T>
TileKernel<T> tile_kernel_of(bool wide, bool channel) {
  if (channel) return wide ? tile_all_rows<kBits, true, true, T> : tile_all_rows<kBits, false, true, T>;
  return wide ? tile_all_rows<kBits, true, false, T> : tile_all_rows<kBits, false, false, T>;
}

template <typename T>
TileKernel<T> tile_kernel(int64_t bits, bool wide, bool channel) {
  return bits == 4 ? tile_kernel_of<4, T>(wide, channel) : tile_kernel_of<8, T>(wide, channel);
}
#endif  // AVX512 F / BW / VNNI, F16C

// How many scales a tile's channel has: G (one a group, [tiles, G, 32]) or 1 (one a channel, [tiles, 1, 32],
// which takes no offsets); offsets, where given, are laid out as the scales.
int64_t scale_groups(const at::Tensor& scales, const c10::optional<at::Tensor>& offsets, int64_t tiles,
                     int64_t G) {
  TORCH_CHECK(scales.is_contiguous() && scales.element_size() == 2 &&
                  (scales.numel() == tiles * G * kTile || scales.numel() == tiles * kTile),
              "scales: contiguous fp16 [tiles, K / group, 32] or [tiles, 1, 32]");
  const int64_t groups = scales.numel() == tiles * G * kTile ? G : 1;
  TORCH_CHECK(!offsets.has_value() || (groups == G && offsets->is_contiguous() && offsets->element_size() == 2 &&
                                       offsets->numel() == scales.numel()),
              "offsets: as scales, one a group");
  return groups;
}

// The weight these codes stand for, w[n, k] = scale * (code - code_zero) + offset in float32, stored in
// bf16 or float32 as [N, K]: what `vnni_linear` multiplies prompt chunks by. Row by row within a tile and
// group, so each channel's outputs are written in order.
template <typename T>
void dequantize_tiles(const uint8_t* w, const uint16_t* scales, const uint16_t* offsets, int64_t N, int64_t K,
                      int64_t bits, int64_t group, int64_t scale_groups, int32_t code_zero, T* out) {
  const int64_t G = K / group, tiles = (N + kTile - 1) / kTile, per_chunk = bits == 4 ? 8 : 4;
  const int64_t group_bytes = kTile * group * bits / 8;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* wg = w + (t * G + g) * group_bytes;
        const uint16_t* sg = scales + (t * scale_groups + (scale_groups == 1 ? 0 : g)) * kTile;  // this group's
        for (int64_t c = 0; c < kTile && t * kTile + c < N; ++c) {
          const int64_t at = (t * G + g) * kTile + c;  // offsets: one a group
          const float s = c10::Half(sg[c], c10::Half::from_bits());
          const float o = offsets ? static_cast<float>(c10::Half(offsets[at], c10::Half::from_bits())) : 0.f;
          T* row = out + (t * kTile + c) * K + g * group;
          const uint8_t* p = wg + (c / 16) * 64 + (c % 16) * 4;  // this channel's 4 bytes in chunk 0
          for (int64_t ch = 0; ch < group / per_chunk; ++ch, p += 128)
            for (int j = 0; j < 4; ++j) {
              const int32_t low = bits == 4 ? (p[j] & 0x0F) : p[j];
              row[ch * per_chunk + j] = static_cast<T>(s * static_cast<float>(low - code_zero) + o);
              if (bits == 4) row[ch * per_chunk + j + 4] = static_cast<T>(s * static_cast<float>((p[j] >> 4) - code_zero) + o);
            }
        }
      }
  });
}

}  // namespace

namespace sobrio_ops {

bool vnni_linear_supported() {
#if defined(SOBRIO_VNNI)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float32 or bf16); weight uint8 [tiles, G, chunks, 2, 64] as layers/vnni.py packs it; scales and
// offsets fp16 (stored as int16) [tiles, G, 32], or scales [tiles, 1, 32] alone; returns [M, N] in x's dtype, the bias added in float32 (from
// `dense_min_rows` rows: x times the dequantized weight by aten, the bias in x's dtype).
at::Tensor vnni_linear(at::Tensor x, at::Tensor weight, at::Tensor scales,
                       c10::optional<at::Tensor> offsets, int64_t N, int64_t bits, int64_t group,
                       int64_t code_zero, int64_t act_bits, c10::optional<at::Tensor> bias,
                       int64_t dense_min_rows) {
  TORCH_CHECK(vnni_linear_supported(), "vnni_linear needs AVX512-VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "act_bits: 8 or 16");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: [M, K] float32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(group > 0 && group % 16 == 0 && K % group == 0, "group: a multiple of 16 that divides K");
  // a group's int32 sum, hi times 256 plus lo (plus the code_zero term), must not overflow
  TORCH_CHECK(act_bits == 8 || group * ((1 << bits) - 1) * 128.0 * 257 < 2147483647.0,
              "act_bits 16: group ", group, " too large for ", bits, "-bit codes");
  const int64_t G = K / group, tile_bytes = kTile * K * bits / 8;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.numel() == tiles * tile_bytes,
              "weight: contiguous uint8, ", tiles * tile_bytes, " bytes for N, K = ", N, ", ", K);
  const int64_t groups = scale_groups(scales, offsets, tiles, G);
  [[maybe_unused]] const bool channel = groups == 1 && G > 1;  // (one group: the two kernels are the same)
  const uint16_t* off = offsets.has_value() ? reinterpret_cast<const uint16_t*>(offsets->data_ptr()) : nullptr;
  if (M >= dense_min_rows) {
    const auto dense = vnni_dequantize(weight, scales, offsets, N, K, bits, group, code_zero,
                                       x.scalar_type() == at::kBFloat16);
    return at::linear(x, dense, bias.has_value() ? c10::optional<at::Tensor>(bias->to(x.scalar_type())) : bias);
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(SOBRIO_VNNI)
  auto xc = x.contiguous();
  const QuantizedRows xq = x.scalar_type() == at::kFloat
                               ? quantize_rows(xc.data_ptr<float>(), M, K, group, act_bits == 16)
                               : quantize_rows(xc.data_ptr<c10::BFloat16>(), M, K, group, act_bits == 16);
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "bias: [N]");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  // each tile writes its own outputs of y (float32 sums rounded once into y's dtype, the bias added first)
  auto run = [&](auto* yp) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const TileKernel<T> kernel = tile_kernel<T>(bits, act_bits == 16, channel);
    for (int64_t m = 0; m < M; m += kRowPass) {
      const int64_t m_end = std::min(M, m + kRowPass);
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const uint16_t* ot = off ? off + t * G * kTile : nullptr;
          kernel(wp + t * tile_bytes, sp + t * groups * kTile, ot, xq, m, m_end, K, group, code_zero, yp + t * kTile, N,
                 bp ? bp + t * kTile : nullptr, std::min(kTile, N - t * kTile));
        }
      });
    }
  };
  if (x.scalar_type() == at::kFloat)
    run(y.data_ptr<float>());
  else
    run(y.data_ptr<c10::BFloat16>());
#endif
  return y;
}

at::Tensor vnni_dequantize(at::Tensor weight, at::Tensor scales, c10::optional<at::Tensor> offsets,
                           int64_t N, int64_t K, int64_t bits, int64_t group, int64_t code_zero, bool bf16) {
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(group > 0 && group % 16 == 0 && K % group == 0, "group: a multiple of 16 that divides K");
  const int64_t tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.numel() == tiles * kTile * K * bits / 8,
              "weight: contiguous uint8 codes for N, K = ", N, ", ", K);
  const int64_t groups = scale_groups(scales, offsets, tiles, K / group);
  auto out = at::empty({N, K}, at::TensorOptions().dtype(dtype));
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* op = offsets.has_value() ? reinterpret_cast<const uint16_t*>(offsets->data_ptr()) : nullptr;
  const int32_t cz = static_cast<int32_t>(code_zero);
  if (dtype == at::kFloat)
    dequantize_tiles(weight.data_ptr<uint8_t>(), sp, op, N, K, bits, group, groups, cz, out.data_ptr<float>());
  else
    dequantize_tiles(weight.data_ptr<uint8_t>(), sp, op, N, K, bits, group, groups, cz, out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace sobrio_ops
