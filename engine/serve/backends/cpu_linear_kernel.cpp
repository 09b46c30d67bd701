// Linear layers for the few rows of a CPU decode step: y [M, N] = x [M, K] . W^T in float32.
//
// Built and loaded like cpu_paged_kernel.cpp (engine/serve/backends/cpu_attention.py: the host's C++
// compiler, -O3 -march=native, ctypes). oneDNN's and MKL's matmuls are tuned for many rows; at
// 1-64 rows their blocking leaves the FMA units idle part of the time. Here the weight is packed
// once into panels of 16 output columns: panel j holds W[16 j .. 16 j + 15][k] for k = 0 .. K-1,
// k-major (N padded to a multiple of 16 with zero rows). Each call streams each panel once, and
// the panel meets every row of x while it sits in cache, 6 rows at a time: 12 vector
// accumulators, two vector loads and six broadcasts per k; meanwhile the next panel is prefetched,
// a share of it by each block of rows (at 16 rows, 58 -> 77 GFLOP/s on the course's machine,
// `scripts/levers.py linear`). With threads > 1 the panels are
// shared by torch's OpenMP workers (`share`, cpu_kernel_share.h).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_kernel_share.h"
#include "cpu_kernel_vec.h"

namespace {

// y[0..R) = x[0..R) . panel, for one panel. With PREFETCH, one 64-byte line of the next panel is
// prefetched every `every` k's, from `next` on: each of a panel's row blocks fetches its share of
// the next panel, so the next panel arrives spread over the whole pass (one layer's weights do not
// fit in L2, and left to the hardware prefetcher each panel's first pass waits on L3 / memory).
template <int R, bool PREFETCH>
void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k_dim, float* y, int64_t ldy,
                int64_t cols, const float* next, int64_t every) {
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  int64_t countdown = every;
  for (int64_t k = 0; k < k_dim; ++k) {
    if (PREFETCH && --countdown == 0) {
      countdown = every;
      __builtin_prefetch(next, 0, 3);
      next += 16;
    }
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

template <int R>
void rows(const float* x, int64_t k_dim, const float* panel, float* y, int64_t n, int64_t cols, const float* next,
          int64_t every) {
  if (next != nullptr) {
    panel_rows<R, true>(x, k_dim, panel, k_dim, y, n, cols, next, every);
  } else {
    panel_rows<R, false>(x, k_dim, panel, k_dim, y, n, cols, next, every);
  }
}

// One row (a lone request's decode step): y[0, cols of panels j .. j + G) = x . those G panels.
// With one row, panel_rows<1> keeps two accumulators, each a chain of dependent FMAs, and reads
// one stream; the step then waits on memory latency rather than bandwidth. Here G panels are read
// side by side (G streams for the hardware prefetcher) and k is unrolled by two, 4 G independent
// accumulators in all. On one Zen 2 core at Qwen3-0.6B's shapes it read the weights at 14.8 GB/s,
// oneDNN's prepacked matmul at 8.0 and F.linear at 11.3 (`scripts/levers.py linear --preset
// qwen3-0.6b --rows 1`).
template <int G>
void one_row_panels(const float* x, const float* panel, int64_t k_dim, float* y, int64_t n, int64_t first) {
  vfloat acc[G][4];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = vfloat{};
  int64_t k = 0;
  for (; k + 2 <= k_dim; k += 2) {
    const float a0 = x[k], a1 = x[k + 1];
    for (int g = 0; g < G; ++g) {
      const float* p = panel + g * k_dim * 16 + k * 16;  // rows k and k + 1 of panel g: 32 floats
      acc[g][0] += a0 * load(p);
      acc[g][1] += a0 * load(p + 8);
      acc[g][2] += a1 * load(p + 16);
      acc[g][3] += a1 * load(p + 24);
    }
  }
  for (; k < k_dim; ++k) {
    for (int g = 0; g < G; ++g) {
      const float* p = panel + g * k_dim * 16 + k * 16;
      acc[g][0] += x[k] * load(p);
      acc[g][1] += x[k] * load(p + 8);
    }
  }
  for (int g = 0; g < G; ++g) {
    const vfloat lo = acc[g][0] + acc[g][2], hi = acc[g][1] + acc[g][3];
    const int64_t col = (first + g) * 16, cols = std::min<int64_t>(16, n - col);
    for (int64_t c = 0; c < cols; ++c) y[col + c] = c < 8 ? lo[c] : hi[c - 8];
  }
}

constexpr int64_t kOneRowGroup = 4;  // panels read side by side for a one-row input

}  // namespace

// prefetch = 0: no software prefetch (the hardware's alone; scripts/levers.py linear measures both).
// Above kPrefetchMaxRows rows a panel's first pass is a small part of its time, and the prefetch
// measured slower (256 rows) or even (64 rows): it is used at most up to there.
constexpr int64_t kPrefetchMaxRows = 64;

extern "C" void linear_float32(const float* x, const float* packed, float* y, int64_t m, int64_t k_dim, int64_t n,
                               int64_t threads, int64_t prefetch) {
  const int64_t panels = (n + 15) / 16;
  if (m == 1) {  // groups of kOneRowGroup panels shared among the threads, the leftover ones singly;
                 // no software prefetch here (`prefetch` is ignored): the four streams are the hardware's
    const int64_t groups = (panels + kOneRowGroup - 1) / kOneRowGroup;
    share(groups, threads, [&](int64_t group_begin, int64_t group_end) {
      for (int64_t g = group_begin; g < group_end; ++g) {
        const int64_t j = g * kOneRowGroup;
        if (j + kOneRowGroup <= panels) {
          one_row_panels<kOneRowGroup>(x, packed + j * k_dim * 16, k_dim, y, n, j);
        } else {
          for (int64_t jj = j; jj < panels; ++jj) one_row_panels<1>(x, packed + jj * k_dim * 16, k_dim, y, n, jj);
        }
      }
    });
    return;
  }
  const int64_t blocks = std::max<int64_t>(1, (m + 5) / 6);  // row blocks per panel: each prefetches 1 / blocks of the next
  const int64_t share_lines = (k_dim + blocks - 1) / blocks;
  share(panels, threads, [&](int64_t panel_begin, int64_t panel_end) {
    for (int64_t j = panel_begin; j < panel_end; ++j) {
      const float* panel = packed + j * k_dim * 16;
      const int64_t cols = std::min<int64_t>(16, n - j * 16);
      float* yj = y + j * 16;
      const float* next = prefetch && m <= kPrefetchMaxRows && j + 1 < panels ? panel + k_dim * 16 : nullptr;
      auto next_share = [&](int64_t block) { return next == nullptr ? nullptr : next + block * share_lines * 16; };
      int64_t i = 0, block = 0;
      for (; i + 6 <= m; i += 6, ++block) rows<6>(x + i * k_dim, k_dim, panel, yj + i * n, n, cols, next_share(block), blocks);
      const float* tail = next_share(block);
      switch (m - i) {
        case 5: rows<5>(x + i * k_dim, k_dim, panel, yj + i * n, n, cols, tail, blocks); break;
        case 4: rows<4>(x + i * k_dim, k_dim, panel, yj + i * n, n, cols, tail, blocks); break;
        case 3: rows<3>(x + i * k_dim, k_dim, panel, yj + i * n, n, cols, tail, blocks); break;
        case 2: rows<2>(x + i * k_dim, k_dim, panel, yj + i * n, n, cols, tail, blocks); break;
        case 1: rows<1>(x + i * k_dim, k_dim, panel, yj + i * n, n, cols, tail, blocks); break;
        default: break;
      }
    }
  });
}
