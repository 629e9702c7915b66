// What every AMX kernel here needs before its first tile instruction: the process's permission to use the
// tile state, and each thread's tile configuration (8 tiles of 64-byte rows, as every kernel here uses them: an A
// tile of 16 rows x 32 bf16, a B tile of 16 pairs x 16 columns, a C tile of 16 x 16 float; A and C fewer rows
// for a matmul of fewer rows).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace sobrio_amx {

// Linux hands out the AMX tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM).
inline bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The calling thread's 8 tiles, each 16 rows of 64 bytes (release them with _tile_release() when done).
// `x_rows` below 16 (a matmul of that many rows): the tiles of sums and of x (0-4) take that many rows, so a
// tile product reads and writes only x's own rows and x needs no zero padding; tiles 5-7 keep 16 (the
// weight's; tile 5, x's second slice past 16 rows, is a weight tile below them).
inline void configure_tiles(int x_rows = 16) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = t < 5 ? x_rows : 16;
  _tile_loadconfig(&config);
}

// Rows x's buffer needs for the tiles: below 16 rows (`configure_tiles(M)`) none beyond its own, else whole
// blocks of `block` rows.
inline int64_t padded_x_rows(int64_t M, int64_t block) { return M < 16 ? M : (M + block - 1) / block * block; }

// Tiles 0-3, the four 16x16 sums of a 32x32 block (rows 0-15 | 16-31) x (columns 0-15 | 16-31), to zero.
inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Tiles 0-3 into c, `ld` elements a row (float or int32 sums): 0-1 its rows 0-15, 2-3 its rows 16-31 (only
// with `both`: a block of 16 rows or fewer leaves them unwritten).
template <typename T>
inline void store_tiles(T* c, int64_t ld, bool both = true) {
  _tile_stored(0, c, ld * sizeof(T));
  _tile_stored(1, c + 16, ld * sizeof(T));
  if (both) {
    _tile_stored(2, c + 16 * ld, ld * sizeof(T));
    _tile_stored(3, c + 16 * ld + 16, ld * sizeof(T));
  }
}

}  // namespace sobrio_amx
#endif
