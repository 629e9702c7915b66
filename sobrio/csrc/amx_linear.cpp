// bf16 matmul on Intel AMX tiles for the decode batches (5 to a few hundred rows), where oneDNN's kernel
// streams a small weight at about 9 GB/s: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), float32 accumulation,
// one rounding to bf16 per output.
//
// The weight is packed once at load into the tile layout, 16 output columns by 32 inputs a tile, each
// tile 1 KB with pairs of inputs side by side (what TDPBF16PS reads), the tiles of 16 output columns
// one after another along K. A step then reads the weight as two sequential streams per block of 32
// columns, prefetched ahead, and every tile product is 16x16x32 at once. x is read in blocks of 32 rows
// (copied to a zero-padded buffer when its rows are not whole blocks), so one tile configuration serves
// every shape.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define SOBRIO_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileRows = 16, kTileK = 32, kBlockN = 32;

#if defined(SOBRIO_AMX)
// Linux hands out the AMX tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM).
bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows of 64 bytes: tmm0-3 the 32x32 float block of y, tmm4-5 two 16-row slices of
// x, tmm6-7 the weight tiles of the block's two 16-column halves.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}

inline void prefetch_tile(const c10::BFloat16* p) {
  for (int line = 0; line < 16; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + line * 32), _MM_HINT_T0);
}

// y rows [m, m+32) x columns [n, n+32): the float block in `acc` [32][32].
void block_product(const c10::BFloat16* xp, const c10::BFloat16* w0, const c10::BFloat16* w1, int64_t K,
                   float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t tile_elems = kTileRows * kTileK, k_tiles = K / kTileK, x_stride = K * 2;
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    if (kt + 4 < k_tiles) prefetch_tile(w0 + (kt + 4) * tile_elems), prefetch_tile(w1 + (kt + 4) * tile_elems);
    _tile_loadd(4, xp + kt * kTileK, x_stride);
    _tile_loadd(5, xp + kTileRows * K + kt * kTileK, x_stride);
    _tile_loadd(6, w0 + kt * tile_elems, 64);
    _tile_loadd(7, w1 + kt * tile_elems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  _tile_stored(2, acc + 16 * 32, 128);
  _tile_stored(3, acc + 16 * 32 + 16, 128);
}

void store_block(const float* acc, const c10::BFloat16* bias, c10::BFloat16* y, int64_t rows, int64_t N, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kBlockN; ++c)
      y[r * N + n + c] = static_cast<c10::BFloat16>(acc[r * kBlockN + c] + (bias ? static_cast<float>(bias[n + c]) : 0.f));
}
#endif

bool amx_supported() {
#if defined(SOBRIO_AMX)
  return request_amx();
#else
  return false;
#endif
}

void check_packable(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx: a 2-D bf16 weight");
  TORCH_CHECK(w.size(0) % kBlockN == 0 && w.size(1) % kTileK == 0, "amx: N a multiple of 32, K of 32");
}

// w [N, K] -> [N/16, K/32, 16 (input pairs), 16 (columns), 2]: tile (n, k) holds w[n*16 + c][k*32 + 2r + e]
// at [r][c][e].
torch::Tensor amx_pack_weight(torch::Tensor w) {
  check_packable(w);
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / kTileRows, kTileRows, K / kTileK, kTileK / 2, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(amx_supported(), "amx_linear needs AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.numel() == N * K && N % kBlockN == 0 && K % kTileK == 0, "amx_linear: packed weight shape");
  auto y = torch::empty({M, N}, x.options());
#if defined(SOBRIO_AMX)
  if (M == 0) return y;
  // Whole 32-row blocks of x: a decode batch of 32 or 64 is read in place, others are padded with zeros.
  const int64_t rows_padded = (M + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  torch::Tensor xpad = x.is_contiguous() && rows_padded == M ? x : torch::zeros({rows_padded, K}, x.options());
  if (!xpad.is_same(x)) xpad.narrow(0, 0, M).copy_(x);
  const auto* xp = xpad.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const auto* b = bias.has_value() ? bc.data_ptr<c10::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Blocks of 32 columns over the threads; split only past ~256 KB of weight a thread (as the GEMV).
  const int64_t blocks = N / kBlockN, grain = std::max<int64_t>(1, (256 << 10) / (kBlockN * K * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float acc[2 * kTileRows * kBlockN];
    for (int64_t nb = begin; nb < end; ++nb) {
      const c10::BFloat16* w0 = wp + (2 * nb) * kTileRows * K;
      for (int64_t m = 0; m < M; m += 2 * kTileRows) {
        block_product(xp + m * K, w0, w0 + kTileRows * K, K, acc);
        store_block(acc, b, yp + m * N, std::min<int64_t>(2 * kTileRows, M - m), N, nb * kBlockN);
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace

void register_amx_ops(pybind11::module& m) {
  m.def("amx_supported", &amx_supported, "whether amx_linear was built and the OS grants AMX");
  m.def("amx_pack_weight", &amx_pack_weight, "a bf16 weight [N, K] in amx_linear's tile layout");
  m.def("amx_linear", &amx_linear, "x @ w.T (+ bias) on AMX tiles, w packed by amx_pack_weight",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
}
