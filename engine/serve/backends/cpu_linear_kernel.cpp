// Linear layers for the few rows of a CPU decode step: y [M, N] = x [M, K] . W^T in float32.
//
// Built and loaded like cpu_paged_kernel.cpp (engine/serve/backends/cpu_attention.py: the host's C++
// compiler, -O3 -march=native, ctypes). oneDNN's and MKL's matmuls are tuned for many rows; at
// 1-64 rows their blocking leaves the FMA units idle part of the time. Here the weight is packed
// once into panels of 16 output columns: panel j holds W[16 j .. 16 j + 15][k] for k = 0 .. K-1,
// k-major (N padded to a multiple of 16 with zero rows). Each call streams each panel once, and
// the panel meets every row of x while it sits in cache, 6 rows at a time: 12 vector
// accumulators, two vector loads and six broadcasts per k. With threads > 1 the panels are
// shared by torch's OpenMP workers (`share`, cpu_kernel_share.h).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_kernel_share.h"

namespace {

typedef float vfloat __attribute__((vector_size(32)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int R>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k_dim, float* y, int64_t ldy,
                int64_t cols) {
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  for (int64_t k = 0; k < k_dim; ++k) {
    const vfloat b0 = load(panel + k * 16), b1 = load(panel + k * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      acc[r][0] += a * b0;
      acc[r][1] += a * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (cols == 16) {
      std::memcpy(y + r * ldy, &acc[r][0], sizeof(vfloat));
      std::memcpy(y + r * ldy + 8, &acc[r][1], sizeof(vfloat));
    } else {
      for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = c < 8 ? acc[r][0][c] : acc[r][1][c - 8];
    }
  }
}

}  // namespace

extern "C" void linear_float32(const float* x, const float* packed, float* y, int64_t m, int64_t k_dim, int64_t n,
                               int64_t threads) {
  const int64_t panels = (n + 15) / 16;
  share(panels, threads, [&](int64_t panel_begin, int64_t panel_end) {
    for (int64_t j = panel_begin; j < panel_end; ++j) {
      const float* panel = packed + j * k_dim * 16;
      const int64_t cols = std::min<int64_t>(16, n - j * 16);
      float* yj = y + j * 16;
      int64_t i = 0;
      for (; i + 6 <= m; i += 6) panel_rows<6>(x + i * k_dim, k_dim, panel, k_dim, yj + i * n, n, cols);
      switch (m - i) {
        case 5: panel_rows<5>(x + i * k_dim, k_dim, panel, k_dim, yj + i * n, n, cols); break;
        case 4: panel_rows<4>(x + i * k_dim, k_dim, panel, k_dim, yj + i * n, n, cols); break;
        case 3: panel_rows<3>(x + i * k_dim, k_dim, panel, k_dim, yj + i * n, n, cols); break;
        case 2: panel_rows<2>(x + i * k_dim, k_dim, panel, k_dim, yj + i * n, n, cols); break;
        case 1: panel_rows<1>(x + i * k_dim, k_dim, panel, k_dim, yj + i * n, n, cols); break;
        default: break;
      }
    }
  });
}
