// The matrix units' (AMX) state of a thread, for the kernels that use tiles (cpu_prefill_amx.cpp,
// cpu_linear_amx.cpp). Include where AMX-TILE is targeted on Linux (the kernels check).
//
// Linux hands a process the tile data state only when asked (`tiles_permitted`, once). The tile
// configuration belongs to the thread, and oneDNN's bf16 matmuls keep theirs there between calls,
// so a kernel never leaves its own behind: `OwnTiles` loads the kernel's for the life of a scope and
// then puts back the one that was in force (or releases the tiles, if none was).
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

struct TileConfig {  // the LDTILECFG memory layout, palette 1
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kXtileData = 18;  // arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return ok;
}

// Tiles 0 .. count-1 configured as 16 rows of 64 bytes while this object lives, on this thread.
class OwnTiles {
 public:
  explicit OwnTiles(int count) {
    _tile_storeconfig(&saved_);
    alignas(64) TileConfig mine{};
    mine.palette_id = 1;
    for (int t = 0; t < count; ++t) {
      mine.rows[t] = 16;
      mine.colsb[t] = 64;
    }
    _tile_loadconfig(&mine);
  }
  ~OwnTiles() {
    if (saved_.palette_id) {
      _tile_loadconfig(&saved_);
    } else {
      _tile_release();
    }
  }
  OwnTiles(const OwnTiles&) = delete;
  OwnTiles& operator=(const OwnTiles&) = delete;

 private:
  alignas(64) TileConfig saved_;
};

}  // namespace
