// Few-row bf16 matmul on oneDNN's packed weight, so a Linear keeps one copy of its weight (the packed one that
// oneDNN's GEMM reads past a few rows) and decode still streams it at memory bandwidth.
//
// The layout (what `torch.ops.mkldnn._reorder_linear_weight` gives on AVX512-BF16 without AMX, checked in
// Python against the weight before the plain copy is dropped: layers/linear.py `blocked_view`):
// W[N/64][K/2][64][2], each block of 64 outputs holding, for each pair of inputs, the 64 outputs' two weights
// side by side: what one vdpbf16ps multiplies with a broadcast pair of x. Each block is one contiguous stream,
// read once for up to 4 input rows (16 accumulators of 16 outputs); float32 accumulation, one rounding to bf16
// per output after the bias. Parallel over blocks of outputs.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // outputs per block
constexpr int kMaxRows = 4;     // input rows per pass over a block

#if defined(__AVX512BF16__)
inline __m512 bf16_to_f32(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// kM rows of x against output blocks [begin, end).
template <int kM>
void blocked_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                  int64_t N, int64_t K, int64_t begin, int64_t end) {
  const int64_t pairs = K / 2;
  for (int64_t b = begin; b < end; ++b) {
    const c10::BFloat16* wb = w + b * kBlock * K;
    __m512 acc[kM][4];
    for (int m = 0; m < kM; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const c10::BFloat16* wp = wb + p * 2 * kBlock;  // one stream: the hardware prefetcher keeps ahead
      __m512bh wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + 32 * j);
      for (int m = 0; m < kM; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + 2 * p, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t n = b * kBlock + 16 * j;
      const __m512 bv = bias ? bf16_to_f32(bias + n) : _mm512_setzero_ps();
      for (int m = 0; m < kM; ++m)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + n),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], bv)));
    }
  }
}
#endif  // __AVX512BF16__

}  // namespace

namespace sobrio_ops {

bool blocked_gemv_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// y[M, N] = x[M, K] @ W^T (+ bias), W given as its blocked view [N/64, K/2, 64, 2] (bf16).
at::Tensor blocked_gemv_bf16(at::Tensor x, at::Tensor blocks, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(blocked_gemv_supported(), "blocked_gemv_bf16 needs AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && blocks.scalar_type() == at::kBFloat16, "bf16 x and weight");
  TORCH_CHECK(blocks.dim() == 4 && blocks.size(2) == kBlock && blocks.size(3) == 2 && blocks.is_contiguous(),
              "weight: a contiguous [N/64, K/2, 64, 2] view");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == blocks.size(1) * 2, "x: [M, K] with K = 2 * blocks.size(1)");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), nblocks = blocks.size(0), N = nblocks * kBlock;
  auto y = at::empty({M, N}, x.options());
  at::Tensor bc;
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16 && bc.numel() == N, "bias: bf16 [N]");
    bp = bc.data_ptr<c10::BFloat16>();
  }
#if defined(__AVX512BF16__)
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = blocks.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // About 512 KB of weights a thread at least: smaller pieces cost more in waking threads than they gain.
  const int64_t grain = std::max<int64_t>(1, (512 << 10) / (kBlock * K * 2));
  at::parallel_for(0, nblocks, grain, [&](int64_t begin, int64_t end) {
    int64_t m = 0;
    for (; m + kMaxRows <= M; m += kMaxRows) blocked_rows<4>(xp + m * K, wp, bp, yp + m * N, N, K, begin, end);
    if (M - m == 3) blocked_rows<3>(xp + m * K, wp, bp, yp + m * N, N, K, begin, end);
    if (M - m == 2) blocked_rows<2>(xp + m * K, wp, bp, yp + m * N, N, K, begin, end);
    if (M - m == 1) blocked_rows<1>(xp + m * K, wp, bp, yp + m * N, N, K, begin, end);
  });
#endif
  return y;
}

// oneDNN's GEMM on its packed copy: `torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")`,
// the same operator through the dispatcher (no ATen C++ function declares it).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor blocked_linear(at::Tensor x, at::Tensor packed, at::Tensor blocks, std::optional<at::Tensor> bias,
                          int64_t max_rows) {
  TORCH_CHECK(blocks.dim() == 4 && (blocks.size(2) == kBlock || blocks.size(2) == kBlock / 2),
              "blocked_linear: blocks [N/B, K/2, B, 2] with B 64 or 32");
  const int64_t block = blocks.size(2), N = blocks.size(0) * block;
  const auto rows = x.reshape({-1, x.size(-1)});
  at::Tensor y;
  if (rows.size(0) > max_rows)
    y = onednn_linear(rows, packed, bias);
  else if (block == kBlock / 2)
    y = amx_linear(rows, blocks, N, bias);
  else
    y = blocked_gemv_bf16(rows, blocks, bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// blocks[N/B, K/2, B, 2] = weight[N, K] in the layout above (B = 64), or in oneDNN's on AMX (B = 32, the same
// bytes as [N/32, K/32, 16, 32, 2]: csrc/amx_linear.cpp): what oneDNN's reorder writes, at several times its
// speed (the reorder transposes element by element). Each block of B rows is transposed as 32-bit pairs, 16
// pairs at a time through a tile of at most 4 KB (one cache line of each of the B rows in, 16 runs of 4B
// bytes out).
void pack_blocked_bf16(at::Tensor weight, at::Tensor blocks) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && blocks.scalar_type() == at::kBFloat16, "bf16 weight");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: a contiguous [N, K] tensor");
  const int64_t N = weight.size(0), K = weight.size(1), pairs = K / 2;
  TORCH_CHECK(blocks.dim() == 4 && (blocks.size(2) == kBlock || blocks.size(2) == kBlock / 2),
              "blocks: [N/B, K/2, B, 2] with B 64 or 32");
  const int64_t block = blocks.size(2);
  TORCH_CHECK(N % block == 0 && K % 2 == 0, "weight: N a multiple of the block, K even");
  TORCH_CHECK(blocks.is_contiguous() && blocks.size(0) * block == N && blocks.size(1) == pairs && blocks.size(3) == 2,
              "blocks: a contiguous [N/B, K/2, B, 2] tensor of the weight's shape");
  const uint32_t* src = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(blocks.data_ptr());
  at::parallel_for(0, N / block, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t tile[kBlock][16];
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* s = src + b * block * pairs;
      uint32_t* d = dst + b * block * pairs;
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int64_t n = std::min<int64_t>(16, pairs - p0);
        for (int64_t j = 0; j < block; ++j) std::memcpy(tile[j], s + j * pairs + p0, n * sizeof(uint32_t));
        for (int64_t p = 0; p < n; ++p) {
          uint32_t* o = d + (p0 + p) * block;
          for (int64_t j = 0; j < block; ++j) o[j] = tile[j][p];
        }
      }
    }
  });
}

}  // namespace sobrio_ops
