// A module's LoRA products for the step's adapters in one call: y[rows[i]] += scales[s] * (x[rows[i]] @ A[s].T)
// @ B[s].T, s the adapter slot of row i's group (layers/lora.py groups the step's rows by slot once a step).
//
// A decode step is bound by reading the adapters' matrices (8 adapters of rank 16 on every target: about a
// third of the base model's bytes), so both halves read them front to back and keep their sums in registers:
// - the shrink h = x @ A.T reads each rank's row of A ([slots, S * R, K]: slice j's ranks at rows j*R ..)
//   against up to 4 rows of x in float32 (h never becomes a tensor);
// - the expand reads B packed per slice in tiles of 64 output columns ([tiles, R, 64] a slice, the slices one
//   after another: `b` [slots, P]), so a tile's ranks are one sequential run and its 64 sums (4 vectors a row)
//   stay in registers over the ranks, and each y element is read, added and rounded once.
// `ranks[s, j]` is the rank slot s's adapter has in slice j (0: that projection is not targeted); only those
// rows of A and B are read. `scales[s]` is the adapter's scaling (alpha / r), applied to h in float32 as PEFT
// applies it to the product, so B is placed as the file stores it. A packed module (q/k/v, gate/up) has one slice a projection, `widths` their
// output columns. Work items are (group, up to kRowBlock of its rows) over the threads; where there are fewer
// items than threads, each item's tiles are split in parts (a part computes h for its slices only).
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using sobrio_vec::to_float;

constexpr int64_t kRows = 4;       // rows that share one pass over A and B
constexpr int64_t kRowBlock = 32;  // rows of one work item: a prompt chunk's group is spread over the threads
constexpr int64_t kTile = 64;      // output columns of a tile of B (layers/lora.py packs B so)

struct Slice {
  int64_t column, width, tiles, packed;  // first output column, columns, tiles, offset of its tiles in b[s]
};

template <typename T>
struct Operands {
  T* y;
  const T* x;
  const T* a;
  const T* b;
  const int32_t* ranks;      // [slots, S]
  const float* scales;       // [slots]
  std::vector<Slice> slices;
  int64_t K, N, R, P;        // in, out features; rank capacity a slice; packed elements of b a slot
};

// h[i * S*R + j*R + r] = x row i . A[j*R + r] for slice j's ranks in use, M rows (xf: x rows in float32).
template <typename T, int M>
void shrink(const Operands<T>& p, const float* xf, const T* a, const int32_t* ranks, int64_t j, float scale,
            float* h) {
  const int64_t stride = static_cast<int64_t>(p.slices.size()) * p.R;
  for (int64_t r = j * p.R; r < j * p.R + ranks[j]; ++r) {
    const T* ar = a + r * p.K;
    float sum[M] = {};
    int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (sobrio_vec::kVectorized<T>) {
      __m512 acc[M][2];  // two sums a row: 2M independent chains of FMAs
      for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
      for (; k + 32 <= p.K; k += 32) {
        const __m512 a0 = sobrio_vec::load16(ar + k), a1 = sobrio_vec::load16(ar + k + 16);
        for (int i = 0; i < M; ++i) {
          acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + i * p.K + k), a0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + i * p.K + k + 16), a1, acc[i][1]);
        }
      }
      for (int i = 0; i < M; ++i) sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
    }
#endif
    for (; k < p.K; ++k)
      for (int i = 0; i < M; ++i) sum[i] += xf[i * p.K + k] * to_float(ar[k]);
    for (int i = 0; i < M; ++i) h[i * stride + r] = sum[i] * scale;
  }
}

// y rows += h @ B.T over one tile (columns tile*64 .. of slice j): the tile's ranks read in order, 64 sums a row.
template <typename T, int M>
void expand_tile(const Operands<T>& p, T* const* yr, const T* b, const int32_t* ranks, int64_t j, int64_t tile,
                 const float* h) {
  const Slice& sl = p.slices[j];
  const int64_t stride = static_cast<int64_t>(p.slices.size()) * p.R, rank = ranks[j];
  const int64_t c0 = sl.column + tile * kTile, width = std::min(kTile, sl.width - tile * kTile);
  const T* bt = b + sl.packed + tile * p.R * kTile;  // [R, 64]
  const float* hj = h + j * p.R;
  float sums[M][kTile];
  int64_t done = 0;  // columns of the tile summed by the vector loop
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (sobrio_vec::kVectorized<T>) {
    __m512 acc[M][4];
    for (int i = 0; i < M; ++i)
      for (int q = 0; q < 4; ++q) acc[i][q] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const T* row = bt + r * kTile;
      const __m512 b0 = sobrio_vec::load16(row), b1 = sobrio_vec::load16(row + 16),
                   b2 = sobrio_vec::load16(row + 32), b3 = sobrio_vec::load16(row + 48);
      for (int i = 0; i < M; ++i) {
        const __m512 hv = _mm512_set1_ps(hj[i * stride + r]);
        acc[i][0] = _mm512_fmadd_ps(hv, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(hv, b1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(hv, b2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(hv, b3, acc[i][3]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int q = 0; q < 4; ++q) _mm512_storeu_ps(sums[i] + 16 * q, acc[i][q]);
    done = kTile;
  }
#endif
  if (done == 0) {
    for (int i = 0; i < M; ++i) std::fill(sums[i], sums[i] + kTile, 0.f);
    for (int64_t r = 0; r < rank; ++r)
      for (int i = 0; i < M; ++i)
        for (int64_t c = 0; c < width; ++c) sums[i][c] += hj[i * stride + r] * to_float(bt[r * kTile + c]);
  }
  for (int i = 0; i < M; ++i) {
    T* yi = yr[i] + c0;
    int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (sobrio_vec::kVectorized<T>)
      for (; c + 16 <= width; c += 16)
        sobrio_vec::store16(yi + c, _mm512_add_ps(sobrio_vec::load16(yi + c), _mm512_loadu_ps(sums[i] + c)));
#endif
    for (; c < width; ++c) yi[c] = static_cast<T>(to_float(yi[c]) + sums[i][c]);
  }
}

// The slice and tile of global tile n (the slices' tiles numbered one after another).
std::pair<int64_t, int64_t> locate(const std::vector<Slice>& slices, int64_t n) {
  int64_t j = 0;
  while (n >= slices[j].tiles) n -= slices[j++].tiles;
  return {j, n};
}

// M rows of one group (`rows`: their indices in x and y) through slot `slot`, global tiles [t0, t1).
template <typename T, int M>
void rows_through(const Operands<T>& p, int64_t slot, const int64_t* rows, int64_t t0, int64_t t1,
                  std::vector<float>& buffer) {
  const int64_t S = static_cast<int64_t>(p.slices.size());
  buffer.resize(M * (p.K + S * p.R));
  float* xf = buffer.data();
  float* h = xf + M * p.K;
  T* yr[M];
  for (int i = 0; i < M; ++i) {
    const T* xi = p.x + rows[i] * p.K;
    for (int64_t k = 0; k < p.K; ++k) xf[i * p.K + k] = to_float(xi[k]);
    yr[i] = p.y + rows[i] * p.N;
  }
  const T* a = p.a + slot * S * p.R * p.K;
  const T* b = p.b + slot * p.P;
  const int32_t* ranks = p.ranks + slot * S;
  const auto [j0, first] = locate(p.slices, t0);
  const auto [j1, last] = locate(p.slices, t1 - 1);
  for (int64_t j = j0; j <= j1; ++j)
    if (ranks[j] > 0) shrink<T, M>(p, xf, a, ranks, j, p.scales[slot], h);
  for (int64_t j = j0; j <= j1; ++j) {
    if (ranks[j] == 0) continue;
    const int64_t begin = j == j0 ? first : 0, end = j == j1 ? last + 1 : p.slices[j].tiles;
    for (int64_t tile = begin; tile < end; ++tile) expand_tile<T, M>(p, yr, b, ranks, j, tile, h);
  }
}

struct Item {
  int64_t slot, begin, end, t0, t1;  // rows[begin:end] through `slot`, global tiles [t0, t1)
};

std::vector<Item> work_items(const int64_t* slot, const int64_t* off, int64_t groups, int64_t tiles) {
  std::vector<Item> items;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = off[g]; b < off[g + 1]; b += kRowBlock)
      items.push_back({slot[g], b, std::min(off[g + 1], b + kRowBlock), 0, tiles});
  const int64_t threads = at::get_num_threads(), count = static_cast<int64_t>(items.size());
  if (count == 0 || count >= threads) return items;
  const int64_t width = (tiles + (threads + count - 1) / count - 1) / ((threads + count - 1) / count);
  std::vector<Item> split;
  for (const Item& it : items)
    for (int64_t t = 0; t < tiles; t += width) split.push_back({it.slot, it.begin, it.end, t, std::min(tiles, t + width)});
  return split;
}

template <typename T>
void apply_run(const Operands<T>& p, const int64_t* rows, const std::vector<Item>& items) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t n = begin; n < end; ++n) {
      const Item& it = items[n];
      for (int64_t i = it.begin; i < it.end; i += kRows) {
        switch (std::min(kRows, it.end - i)) {
          case 4: rows_through<T, 4>(p, it.slot, rows + i, it.t0, it.t1, buffer); break;
          case 3: rows_through<T, 3>(p, it.slot, rows + i, it.t0, it.t1, buffer); break;
          case 2: rows_through<T, 2>(p, it.slot, rows + i, it.t0, it.t1, buffer); break;
          default: rows_through<T, 1>(p, it.slot, rows + i, it.t0, it.t1, buffer); break;
        }
      }
    }
  });
}

std::vector<Slice> slices_of(const std::vector<int64_t>& widths, int64_t R) {
  std::vector<Slice> slices;
  int64_t column = 0, packed = 0;
  for (const int64_t w : widths) {
    TORCH_CHECK(w > 0, "lora_apply: widths must be positive");
    const int64_t tiles = (w + kTile - 1) / kTile;
    slices.push_back({column, w, tiles, packed});
    column += w;
    packed += tiles * R * kTile;
  }
  return slices;
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
           const at::Tensor& ranks, const at::Tensor& scales, const std::vector<Slice>& slices, int64_t R, const at::Tensor& rows,
           const at::Tensor& slots, const at::Tensor& offsets) {
  const auto dtype = y.scalar_type();
  const int64_t S = static_cast<int64_t>(slices.size());
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 2 && y.is_contiguous() &&
                  x.is_contiguous() && a.is_contiguous() && b.is_contiguous() && x.scalar_type() == dtype &&
                  a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_apply: y [T, N], x [T, K], a [slots, S * R, K], b [slots, P]: contiguous, one dtype");
  TORCH_CHECK(S > 0 && x.size(0) == y.size(0) && a.size(2) == x.size(1) && a.size(0) == b.size(0) &&
                  a.size(1) == S * R && slices.back().column + slices.back().width == y.size(1) &&
                  b.size(1) == slices.back().packed + slices.back().tiles * R * kTile,
              "lora_apply: shapes disagree (widths, a, b, y)");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.numel() == a.size(0) * S,
              "lora_apply: ranks int32 [slots, S]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == a.size(0),
              "lora_apply: scales float32 [slots]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  offsets.scalar_type() == at::kLong && rows.is_contiguous() && slots.is_contiguous() &&
                  offsets.is_contiguous() && offsets.numel() == slots.numel() + 1,
              "lora_apply: rows [rows], slots [G], offsets [G + 1]: int64");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[slots.numel()] == rows.numel(), "lora_apply: offsets 0 .. rows");
  for (int64_t g = 0; g < slots.numel(); ++g)
    TORCH_CHECK(slot[g] >= 0 && slot[g] < a.size(0) && off[g] <= off[g + 1], "lora_apply: slot or offsets out of range");
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(row[i] >= 0 && row[i] < y.size(0), "lora_apply: row out of range");
  const int32_t* rk = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < ranks.numel(); ++i) TORCH_CHECK(rk[i] >= 0 && rk[i] <= R, "lora_apply: rank out of range");
}

template <typename T>
void apply_typed(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& ranks, const at::Tensor& scales, std::vector<Slice> slices, int64_t R, const at::Tensor& rows,
                 const std::vector<Item>& items) {
  const Operands<T> p{y.data_ptr<T>(), x.data_ptr<T>(), a.data_ptr<T>(), b.data_ptr<T>(), ranks.data_ptr<int32_t>(),
                      scales.data_ptr<float>(), std::move(slices), x.size(1), y.size(1), R, b.size(1)};
  apply_run<T>(p, rows.data_ptr<int64_t>(), items);
}

}  // namespace

namespace sobrio_ops {

void lora_apply(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
                at::Tensor scales, std::vector<int64_t> widths, at::Tensor rows, at::Tensor slots, at::Tensor offsets) {
  TORCH_CHECK(!widths.empty() && a.dim() == 3 && a.size(1) % static_cast<int64_t>(widths.size()) == 0,
              "lora_apply: a [slots, S * R, K] for S = len(widths) slices");
  const int64_t R = a.size(1) / static_cast<int64_t>(widths.size());
  auto slices = slices_of(widths, R);
  check(y, x, a, b, ranks, scales, slices, R, rows, slots, offsets);
  int64_t tiles = 0;
  for (const Slice& s : slices) tiles += s.tiles;
  const auto items = work_items(slots.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), slots.numel(), tiles);
  switch (y.scalar_type()) {
    case at::kFloat: return apply_typed<float>(y, x, a, b, ranks, scales, std::move(slices), R, rows, items);
    case at::kBFloat16:
      return apply_typed<c10::BFloat16>(y, x, a, b, ranks, scales, std::move(slices), R, rows, items);
    default: TORCH_CHECK(false, "lora_apply takes float32 or bf16");
  }
}

}  // namespace sobrio_ops
