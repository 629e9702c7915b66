// Few-row matmul on group-wise int8 weights (GGUF's Q8_0, Q5_0/Q5_1, Q5_K and Q6_K blocks, rearranged at
// load as int8 codes plus a float scale and offset per group): y[m, n] = sum over groups g of
// scale[n, g] * (x[m, g] . codes[n, g]) + offset[n, g] * sum(x[m, g]) (+ bias). A decode step at a small
// batch is bound by reading the weights, so this reads each code once (one byte a weight, against two
// for bf16), widens it to float32 in registers, and accumulates in float32: the activations stay in
// float (no int8 rounding of x), as in the dequantize-then-matmul reference. Parallel over N.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
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
#define SOBRIO_GROUPED_INT8 1

inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// kM rows of x (float32, [kM, K]) against output channels begin .. end; group % 16 == 0.
template <int kM>
void grouped_rows(const float* x, const float* xsum, const int8_t* codes, const float* scales,
                  const float* offsets, int64_t K, int64_t group, int64_t begin, int64_t end, float* y,
                  int64_t ldy) {
  const int64_t groups = K / group;
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* w = codes + n * K;
    __m512 acc[kM];
    float off[kM] = {};
    for (int m = 0; m < kM; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 part[kM];
      for (int m = 0; m < kM; ++m) part[m] = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        const __m512 wv = widen16(w + k);
        for (int m = 0; m < kM; ++m) part[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, part[m]);
      }
      const __m512 s = _mm512_set1_ps(scales[n * groups + g]);
      for (int m = 0; m < kM; ++m) acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
      if (offsets)
        for (int m = 0; m < kM; ++m) off[m] += offsets[n * groups + g] * xsum[m * groups + g];
    }
    for (int m = 0; m < kM; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m]) + off[m];
  }
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
#endif  // AVX512 F / BW

bool grouped_int8_supported() {
#if defined(SOBRIO_GROUPED_INT8)
  return true;
#else
  return false;
#endif
}

// x [M, K] (float, bf16 or fp16), codes int8 [N, K], scales and offsets float32 [N, K / group];
// returns [M, N] in x's dtype (the bias, in x's dtype, added in float32 before the one rounding).
torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  c10::optional<torch::Tensor> offsets, int64_t group,
                                  c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(grouped_int8_supported(), "grouped_int8_linear needs AVX-512");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1), "shapes: x [M, K], codes [N, K]");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes: contiguous int8");
  const int64_t M = x.size(0), N = codes.size(0), K = codes.size(1);
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
  auto xf = x.to(at::kFloat).contiguous();
  auto xsum = xf.view({M, groups, group}).sum(-1).contiguous();
  auto y = torch::empty({M, N}, xf.options());
#if defined(SOBRIO_GROUPED_INT8)
  const float* xp = xf.data_ptr<float>();
  const float* sp = xsum.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* scp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / K);  // ~256 KB of codes a task
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    grouped_block(xp, sp, cp, scp, off, M, K, group, begin, end, yp, N);
  });
#endif
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y.to(x.scalar_type());
}

}  // namespace

void register_grouped_int8_ops(pybind11::module& m) {
  m.def("grouped_int8_supported", &grouped_int8_supported, "whether grouped_int8_linear was built (AVX-512)");
  m.def("grouped_int8_linear", &grouped_int8_linear,
        "few-row x @ W.T for group-wise int8 W = codes * scale + offset per group (+ bias)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("offsets") = py::none(), py::arg("group"),
        py::arg("bias") = py::none());
}
