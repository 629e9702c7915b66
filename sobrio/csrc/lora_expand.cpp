// The expand half of a step's LoRA products: y[rows[i]] += h[i] @ bt[slot of i's group], rows grouped by
// adapter slot (layers/lora.py). A packed module's B is block-diagonal (q/k/v, gate/up): `spans[slot, r]`
// gives the output columns rank r writes, so the zero blocks are neither read nor added. The sum runs in
// float32 over r as axpy along the output columns (each rank's row of bt read once for up to 4 rows, front
// to back; no horizontal reductions), and each y element is rounded once. Parallel over (group, column block).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using sobrio_vec::to_float;

constexpr int64_t kBlock = 512;  // output columns a work item adds (4 rows x 512 float32 sums: 8 KB of L1)
constexpr int64_t kRows = 4;

// The scalar form: other CPUs, and the columns past the last full 16 of a block.
template <typename T>
void expand_scalar(T* y, int64_t ldy, const float* hf, int64_t R, const T* bt, const int32_t* spans, int64_t N,
                   const int64_t* rows, int64_t m, int64_t c0, int64_t c1) {
  for (int64_t i = 0; i < m; ++i) {
    T* yr = y + rows[i] * ldy;
    for (int64_t c = c0; c < c1; ++c) {
      float sum = 0.f;
      for (int64_t r = 0; r < R; ++r)
        if (c >= spans[2 * r] && c < spans[2 * r + 1]) sum += hf[i * R + r] * to_float(bt[r * N + c]);
      yr[c] = static_cast<T>(to_float(yr[c]) + sum);
    }
  }
}

// Up to kRows rows of one group against columns [c0, c1) of its bt: rank by rank, each rank's columns in
// its span read front to back (one sequential run of bt a rank: the weights stream from memory) and
// added into float32 sums that stay in L1; y read and rounded once at the end.
template <typename T>
void expand_block(T* y, int64_t ldy, const T* h, int64_t R, const T* bt, const int32_t* spans, int64_t N,
                  const int64_t* rows, int64_t count, int64_t c0, int64_t c1) {
  std::vector<float> hf(kRows * R);
  alignas(64) float acc[kRows][kBlock];
  for (int64_t i0 = 0; i0 < count; i0 += kRows) {
    const int64_t m = std::min(kRows, count - i0);
    for (int64_t i = 0; i < m * R; ++i) hf[i] = to_float(h[i0 * R + i]);
    int64_t full = c0;  // columns [c0, full) go through the vector loop
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (sobrio_vec::kVectorized<T>) {
      full = c0 + (c1 - c0) / 16 * 16;
      for (int64_t i = 0; i < m; ++i) std::fill(acc[i], acc[i] + (full - c0), 0.f);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t lo = std::max<int64_t>(c0, spans[2 * r]), hi = std::min<int64_t>(full, spans[2 * r + 1]);
        if (lo >= hi) continue;
        const T* b = bt + r * N;
        for (int64_t c = c0 + (lo - c0) / 16 * 16; c < hi; c += 16) {  // whole chunks: bt is zero off the span
          const __m512 bv = sobrio_vec::load16(b + c);
          for (int64_t i = 0; i < m; ++i) {
            float* a = acc[i] + (c - c0);
            _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(hf[i * R + r]), bv, _mm512_load_ps(a)));
          }
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        T* yr = y + rows[i0 + i] * ldy;
        for (int64_t c = c0; c < full; c += 16)
          sobrio_vec::store16(yr + c, _mm512_add_ps(sobrio_vec::load16(yr + c), _mm512_load_ps(acc[i] + (c - c0))));
      }
    }
#endif
    expand_scalar<T>(y, ldy, hf.data(), R, bt, spans, N, rows + i0, m, full, c1);
  }
}

template <typename T>
void expand_run(torch::Tensor& y, const torch::Tensor& h, const torch::Tensor& bt, const torch::Tensor& spans,
                const torch::Tensor& rows, const torch::Tensor& slots, const torch::Tensor& offsets) {
  const int64_t groups = slots.numel(), R = bt.size(1), N = bt.size(2), blocks = (N + kBlock - 1) / kBlock;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  T* yp = y.data_ptr<T>();
  const T* hp = h.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  const int32_t* sp = spans.data_ptr<int32_t>();
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, c0 = (item % blocks) * kBlock;
      expand_block<T>(yp, N, hp + off[g] * R, R, bp + slot[g] * R * N, sp + slot[g] * R * 2, N, row + off[g],
                      off[g + 1] - off[g], c0, std::min(N, c0 + kBlock));
    }
  });
}

void lora_expand(torch::Tensor y, torch::Tensor h, torch::Tensor bt, torch::Tensor spans, torch::Tensor rows,
                 torch::Tensor slots, torch::Tensor offsets) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && h.dim() == 2 && h.is_contiguous() && bt.dim() == 3 &&
                  bt.is_contiguous() && y.scalar_type() == h.scalar_type() && h.scalar_type() == bt.scalar_type(),
              "lora_expand: y [T, N], h [rows, R], bt [slots, R, N], contiguous, one dtype");
  TORCH_CHECK(y.size(1) == bt.size(2) && h.size(1) == bt.size(1) && spans.scalar_type() == at::kInt &&
                  spans.is_contiguous() && spans.numel() == bt.size(0) * bt.size(1) * 2,
              "lora_expand: shapes disagree, or spans not int32 [slots, R, 2]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  offsets.scalar_type() == at::kLong && rows.is_contiguous() && slots.is_contiguous() &&
                  offsets.is_contiguous() && offsets.numel() == slots.numel() + 1 && rows.numel() == h.size(0),
              "lora_expand: rows [rows], slots [G], offsets [G + 1]: int64");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[slots.numel()] == h.size(0), "lora_expand: offsets 0 .. rows of h");
  for (int64_t g = 0; g < slots.numel(); ++g)
    TORCH_CHECK(slot[g] >= 0 && slot[g] < bt.size(0) && off[g] <= off[g + 1], "lora_expand: slot or offsets out of range");
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(row[i] >= 0 && row[i] < y.size(0), "lora_expand: row out of range");
  const int32_t* sp = spans.data_ptr<int32_t>();
  for (int64_t i = 0; i < spans.numel(); ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] <= y.size(1), "lora_expand: span out of range");
  switch (y.scalar_type()) {
    case at::kFloat: return expand_run<float>(y, h, bt, spans, rows, slots, offsets);
    case at::kBFloat16: return expand_run<c10::BFloat16>(y, h, bt, spans, rows, slots, offsets);
    default: TORCH_CHECK(false, "lora_expand takes float32 or bf16");
  }
}

}  // namespace

void register_lora_ops(pybind11::module& m) {
  m.def("lora_expand", &lora_expand, "y[rows] += h @ bt[slot] by adapter group, within each rank's column span",
        py::arg("y"), py::arg("h"), py::arg("bt"), py::arg("spans"), py::arg("rows"), py::arg("slots"),
        py::arg("offsets"));
}
