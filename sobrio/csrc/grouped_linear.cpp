// Few-row matmul on group-wise int8 weights (GGUF's Q8_0, Q5_0/Q5_1, Q5_K and Q6_K blocks, rearranged at
// load as int8 codes with a float32 scale and offset per group): y[m, n] = sum over groups g of
// scale[n, g] * (x[m, g] . codes[n, g]) + offset[n, g] * sum(x[m, g]) (+ bias). A decode step at a small
// batch is bound by reading the weights, so this reads each code once (one byte a weight, against two for
// bf16), widens it to float32 in registers and accumulates in float32: the activations stay in float (no
// int8 rounding of x), as in the dequantize-then-matmul reference. Parallel over N.
#include "ops.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using sobrio_vec::to_float;

constexpr int64_t kMaxRows = 4;  // rows computed per pass over the weights

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SOBRIO_GROUPED 1

// 16 float32 lanes, 32 registers: 4 channels x 4 rows of sums.
struct Lanes {
  using F = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr int kChannels = 4;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F x, F w, F acc) { return _mm512_fmadd_ps(x, w, acc); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F widen(const int8_t* p) {  // 16 int8 codes as float32 lanes
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static float sum(F a) { return _mm512_reduce_add_ps(a); }
};

#elif defined(__AVX2__) && defined(__FMA__)
#define SOBRIO_GROUPED 1

// AVX2 without AVX-512 (AMD Zen 2/3): 8 lanes, 16 registers, so 2 channels x 4 rows of sums. There
// PyTorch's int8 weight kernels run slower than its float32 matmul (no VNNI): `--quantization
// int8-weight-only` takes this kernel (layers/quantization.py, `grouped_int8_preferred`).
struct Lanes {
  using F = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr int kChannels = 2;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F x, F w, F acc) { return _mm256_fmadd_ps(x, w, acc); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F widen(const int8_t* p) {  // 8 int8 codes as float32 lanes
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static float sum(F a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
};
#endif

#if defined(SOBRIO_GROUPED)
// kM rows of x (float32, [kM, K]) against kN output channels from n: each channel's codes widened once
// and scaled by their group's scale, then one FMA per row; kN channels keep kN * kM independent sums
// (one chain of dependent FMAs per channel would wait on their latency, not on memory).
template <int kM, int kN>
void grouped_tile(const float* x, const float* xsum, const int8_t* codes, const float* scales,
                  const float* offsets, int64_t K, int64_t group, int64_t n, float* y, int64_t ldy) {
  const int64_t groups = K / group;
  Lanes::F acc[kM][kN];
  float off[kM][kN] = {};
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kN; ++j) acc[m][j] = Lanes::zero();
  for (int64_t g = 0; g < groups; ++g) {
    Lanes::F s[kN];
    for (int j = 0; j < kN; ++j) s[j] = Lanes::set1(scales[(n + j) * groups + g]);
    for (int64_t k = g * group; k < (g + 1) * group; k += Lanes::kWidth) {
      for (int j = 0; j < kN; ++j) {
        const Lanes::F w = Lanes::mul(Lanes::widen(codes + (n + j) * K + k), s[j]);
        for (int m = 0; m < kM; ++m) acc[m][j] = Lanes::fmadd(Lanes::load(x + m * K + k), w, acc[m][j]);
      }
    }
    if (offsets)
      for (int j = 0; j < kN; ++j)
        for (int m = 0; m < kM; ++m) off[m][j] += offsets[(n + j) * groups + g] * xsum[m * groups + g];
  }
  for (int m = 0; m < kM; ++m)
    for (int j = 0; j < kN; ++j) y[m * ldy + n + j] = Lanes::sum(acc[m][j]) + off[m][j];
}

template <int kM>
void grouped_rows(const float* x, const float* xsum, const int8_t* codes, const float* scales,
                  const float* offsets, int64_t K, int64_t group, int64_t begin, int64_t end, float* y,
                  int64_t ldy) {
  int64_t n = begin;
  constexpr int kN = Lanes::kChannels;
  for (; n + kN <= end; n += kN) grouped_tile<kM, kN>(x, xsum, codes, scales, offsets, K, group, n, y, ldy);
  for (; n < end; ++n) grouped_tile<kM, 1>(x, xsum, codes, scales, offsets, K, group, n, y, ldy);
}

// Output channels in blocks whose codes stay in L2 (~256 KB) while every group of 4 rows passes over them:
// the codes come from memory once whatever M is.
void grouped_block(const float* x, const float* xsum, const int8_t* codes, const float* scales,
                   const float* offsets, int64_t M, int64_t K, int64_t group, int64_t begin, int64_t end,
                   float* y, int64_t N) {
  const int64_t groups = K / group;
  const int64_t block = M <= kMaxRows ? end - begin : std::max<int64_t>(8, (256 << 10) / K);
  for (int64_t nb = begin; nb < end; nb += block) {
    const int64_t ne = std::min(end, nb + block);
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const float* xm = x + m * K;
      const float* sm = xsum + m * groups;
      float* ym = y + m * N;
      switch (std::min<int64_t>(kMaxRows, M - m)) {
        case 4: grouped_rows<4>(xm, sm, codes, scales, offsets, K, group, nb, ne, ym, N); break;
        case 3: grouped_rows<3>(xm, sm, codes, scales, offsets, K, group, nb, ne, ym, N); break;
        case 2: grouped_rows<2>(xm, sm, codes, scales, offsets, K, group, nb, ne, ym, N); break;
        default: grouped_rows<1>(xm, sm, codes, scales, offsets, K, group, nb, ne, ym, N); break;
      }
    }
  }
}
#endif  // SOBRIO_GROUPED

// [M, N] float32 sums (+ bias) rounded once to x's dtype.
at::Tensor finish(const std::vector<float>& yf, int64_t M, int64_t N, const at::Tensor& x,
                  const c10::optional<at::Tensor>& bias) {
  auto y = at::empty({M, N}, x.options());
  at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "bias: [N]");
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "grouped_linear_y", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * N; ++i) yp[i] = static_cast<scalar_t>(yf[i] + (bp ? bp[i % N] : 0.f));
  });
  return y;
}

}  // namespace

namespace sobrio_ops {

bool grouped_linear_supported() {
#if defined(SOBRIO_GROUPED)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float, bf16 or fp16); codes int8 [N, K]; scales and offsets float32 [N, K / group]; returns
// [M, N] in x's dtype (the bias added in float32 before the one rounding).
at::Tensor grouped_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> offsets,
                          int64_t group, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(grouped_linear_supported(), "grouped_linear needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.dim() == 2,
              "codes: contiguous int8 [N, K]");
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "shapes: x [M, K]");
  TORCH_CHECK(group > 0 && group % 16 == 0 && K % group == 0, "group: a multiple of 16 that divides K");
  const int64_t groups = K / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * groups,
              "scales: contiguous float32 [N, K / group]");
  const float* off = nullptr;
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->numel() == N * groups,
                "offsets: contiguous float32 [N, K / group]");
    off = offsets->data_ptr<float>();
  }
  // x in float32 and its sums per group, by hand: a few aten calls here would cost more than a small
  // matrix's whole product (120 of them a decode step).
  auto xc = x.contiguous();
  std::vector<float> xf(M * K), xsum(M * groups, 0.f);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "grouped_linear_x", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(xp[i]);
  });
  for (int64_t i = 0; i < M * K; ++i) xsum[i / group] += xf[i];
  std::vector<float> yf(M * N);
#if defined(SOBRIO_GROUPED)
  const float* scp = scales.data_ptr<float>();
  // ~256 KB of codes a task, but every thread a share of a small matrix
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(4, std::min<int64_t>((256 << 10) / codes.size(1), (N + threads - 1) / threads));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    grouped_block(xf.data(), xsum.data(), codes.data_ptr<int8_t>(), scp, off, M, K, group, begin, end, yf.data(), N);
  });
#endif
  return finish(yf, M, N, x, bias);
}

}  // namespace sobrio_ops
