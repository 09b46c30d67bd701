// Linear layers for the few rows of a CPU decode step: y [M, N] = x [M, K] . W^T in float32.
// The weight's panels hold float32, or bfloat16 (a bfloat16 model on a CPU without bf16 matmul
// units: the weights stay in their 16-bit form, half the bytes to stream, and each panel row is
// widened to float32 in registers, exactly, before the same float32 arithmetic).
//
// Built and loaded like cpu_paged_kernel.cpp (engine/fast/cpu_build.py: the host's C++
// compiler, -O3 -march=native, ctypes). oneDNN's and MKL's matmuls are tuned for many rows; at
// 1-64 rows their blocking leaves the FMA units idle part of the time. Here the weight is packed
// once into panels of 16 output columns: panel j holds W[16 j .. 16 j + 15][k] for k = 0 .. K-1,
// k-major (N padded to a multiple of 16 with zero rows). Each call streams each panel once, and
// the panel meets every row of x while it sits in cache, 6 rows at a time: 12 vector
// accumulators, two vector loads and six broadcasts per k; meanwhile the next panel is prefetched,
// a share of it by each block of rows (at 16 rows, 58 -> 77 GFLOP/s on the course's machine,
// `course/tuning/levers.py linear`). With threads > 1 the panels are
// shared by torch's OpenMP workers (`share`, cpu_kernel_share.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernel_share.h"
#include "cpu_kernel_vec.h"

namespace {

// A panel row's 16 values as two float32 vectors (columns 0-7, 8-15). float32: two loads.
// bfloat16: one 32-byte load, and each half widened exactly (its bits become a float's upper
// half) by interleaving zeros below it, one unpack instruction per half. The unpacks work within
// 128-bit lanes, so a bfloat16 panel row is stored with columns 4-7 and 8-11 swapped
// (cpu_linear.py's BF16_ORDER), and comes out in order.
typedef uint16_t vbits16 __attribute__((vector_size(kBytes)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC before 12 spells it with a mask vector
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, vbits16{__VA_ARGS__})
#endif
inline void load16(const float* p, vfloat& lo, vfloat& hi) {
  lo = load(p);
  hi = load(p + 8);
}
inline void load16(const uint16_t* p, vfloat& lo, vfloat& hi) {
  vbits16 h;
  std::memcpy(&h, p, sizeof h);
  const vbits16 z{};
  const vbits16 l = SHUFFLE16(z, h, 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27);
  const vbits16 u = SHUFFLE16(z, h, 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31);
  std::memcpy(&lo, &l, sizeof lo);
  std::memcpy(&hi, &u, sizeof hi);
}

// y[0..R) = x[0..R) . panel, for one panel. With PREFETCH, one 64-byte line of the next panel is
// prefetched every `every` k's, from `next` (bytes) on: each of a panel's row blocks fetches its share of
// the next panel, so the next panel arrives spread over the whole pass (one layer's weights do not
// fit in L2, and left to the hardware prefetcher each panel's first pass waits on L3 / memory).
template <int R, bool PREFETCH, typename P>
void panel_rows(const float* x, int64_t ldx, const P* panel, int64_t k_dim, float* y, int64_t ldy,
                int64_t cols, const char* next, int64_t every) {
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  int64_t countdown = every;
  for (int64_t k = 0; k < k_dim; ++k) {
    if (PREFETCH && --countdown == 0) {
      countdown = every;
      __builtin_prefetch(next, 0, 3);
      next += 64;
    }
    vfloat b0, b1;
    load16(panel + k * 16, b0, b1);
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

template <int R, typename P>
void rows(const float* x, int64_t k_dim, const P* panel, float* y, int64_t n, int64_t cols, const char* next,
          int64_t every) {
  if (next != nullptr) {
    panel_rows<R, true, P>(x, k_dim, panel, k_dim, y, n, cols, next, every);
  } else {
    panel_rows<R, false, P>(x, k_dim, panel, k_dim, y, n, cols, next, every);
  }
}

// One row (a lone request's decode step): y[0, cols of panels j .. j + G) = x . those G panels.
// With one row, panel_rows<1> keeps two accumulators, each a chain of dependent FMAs, and reads
// one stream; the step then waits on memory latency rather than bandwidth. Here G panels are read
// side by side (G streams for the hardware prefetcher) and k is unrolled by two, 4 G independent
// accumulators in all. On one Zen 2 core at Qwen3-0.6B's shapes it read the weights at 14.8 GB/s,
// oneDNN's prepacked matmul at 8.0 and F.linear at 11.3 (`course/tuning/levers.py linear --preset
// qwen3-0.6b --rows 1`).
template <int G, typename P>
void one_row_panels(const float* x, const P* panel, int64_t k_dim, float* y, int64_t n, int64_t first) {
  vfloat acc[G][4];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = vfloat{};
  int64_t k = 0;
  for (; k + 2 <= k_dim; k += 2) {
    const float a0 = x[k], a1 = x[k + 1];
    for (int g = 0; g < G; ++g) {
      const P* p = panel + g * k_dim * 16 + k * 16;  // rows k and k + 1 of panel g: 32 values
      vfloat b0, b1, b2, b3;
      load16(p, b0, b1);
      load16(p + 16, b2, b3);
      acc[g][0] += a0 * b0;
      acc[g][1] += a0 * b1;
      acc[g][2] += a1 * b2;
      acc[g][3] += a1 * b3;
    }
  }
  for (; k < k_dim; ++k) {
    for (int g = 0; g < G; ++g) {
      vfloat b0, b1;
      load16(panel + g * k_dim * 16 + k * 16, b0, b1);
      acc[g][0] += x[k] * b0;
      acc[g][1] += x[k] * b1;
    }
  }
  for (int g = 0; g < G; ++g) {
    const vfloat lo = acc[g][0] + acc[g][2], hi = acc[g][1] + acc[g][3];
    const int64_t col = (first + g) * 16, cols = std::min<int64_t>(16, n - col);
    for (int64_t c = 0; c < cols; ++c) y[col + c] = c < 8 ? lo[c] : hi[c - 8];
  }
}

constexpr int64_t kOneRowGroup = 4;  // panels read side by side for a one-row input
// A bfloat16 panel is widened once into a float32 scratch when more than this many rows (three
// 6-row blocks) meet it, and in each block's loop otherwise: timed both ways at Qwen3-0.6B's
// shapes on one thread, the in-loop widening was the faster at 8-16 rows, the two about even at
// 24-32, and widening once the faster from 64.
constexpr int64_t kWidenOnceAfter = 18;

// prefetch = 0: no software prefetch (the hardware's alone; course/tuning/levers.py linear measures both).
// Above kPrefetchMaxRows rows a panel's first pass is a small part of its time, and the prefetch
// measured slower (256 rows) or even (64 rows): it is used at most up to there.
constexpr int64_t kPrefetchMaxRows = 64;

template <typename P>
void linear(const float* x, const P* packed, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t threads,
            int64_t prefetch) {
  const int64_t panels = (n + 15) / 16;
  if (m == 1) {  // groups of kOneRowGroup panels shared among the threads, the leftover ones singly;
                 // no software prefetch here (`prefetch` is ignored): the four streams are the hardware's
    const int64_t groups = (panels + kOneRowGroup - 1) / kOneRowGroup;
    share(groups, threads, [&](int64_t group_begin, int64_t group_end) {
      for (int64_t g = group_begin; g < group_end; ++g) {
        const int64_t j = g * kOneRowGroup;
        if (j + kOneRowGroup <= panels) {
          one_row_panels<kOneRowGroup, P>(x, packed + j * k_dim * 16, k_dim, y, n, j);
        } else {
          for (int64_t jj = j; jj < panels; ++jj) one_row_panels<1, P>(x, packed + jj * k_dim * 16, k_dim, y, n, jj);
        }
      }
    });
    return;
  }
  const int64_t blocks = std::max<int64_t>(1, (m + 5) / 6);  // row blocks per panel: each prefetches 1 / blocks of the next
  const int64_t panel_bytes = k_dim * 16 * static_cast<int64_t>(sizeof(P));
  const int64_t share_lines = (panel_bytes / 64 + blocks - 1) / blocks;  // lines of the next panel per row block
  const int64_t every = std::max<int64_t>(1, (k_dim + share_lines - 1) / std::max<int64_t>(1, share_lines));  // k's per line
  // A 16-bit panel met by many row blocks is widened once into a float32 copy (in cache) and
  // every block reads that: the widening is then paid once per panel, not once per block.
  const bool widen_once = !std::is_same<P, float>::value && m > kWidenOnceAfter;
  share(panels, threads, [&](int64_t panel_begin, int64_t panel_end) {
    std::vector<float> wide(widen_once ? static_cast<size_t>(k_dim * 16) : 0);
    for (int64_t j = panel_begin; j < panel_end; ++j) {
      const P* panel = packed + j * k_dim * 16;
      const int64_t cols = std::min<int64_t>(16, n - j * 16);
      float* yj = y + j * 16;
      const char* next = prefetch && m <= kPrefetchMaxRows && j + 1 < panels
                             ? reinterpret_cast<const char*>(panel + k_dim * 16) : nullptr;
      auto next_share = [&](int64_t block) { return next == nullptr ? nullptr : next + block * share_lines * 64; };
      auto all_rows = [&](auto* pan) {
        typedef std::remove_const_t<std::remove_pointer_t<decltype(pan)>> Q;
        int64_t i = 0, block = 0;
        for (; i + 6 <= m; i += 6, ++block) rows<6, Q>(x + i * k_dim, k_dim, pan, yj + i * n, n, cols, next_share(block), every);
        const char* tail = next_share(block);
        switch (m - i) {
          case 5: rows<5, Q>(x + i * k_dim, k_dim, pan, yj + i * n, n, cols, tail, every); break;
          case 4: rows<4, Q>(x + i * k_dim, k_dim, pan, yj + i * n, n, cols, tail, every); break;
          case 3: rows<3, Q>(x + i * k_dim, k_dim, pan, yj + i * n, n, cols, tail, every); break;
          case 2: rows<2, Q>(x + i * k_dim, k_dim, pan, yj + i * n, n, cols, tail, every); break;
          case 1: rows<1, Q>(x + i * k_dim, k_dim, pan, yj + i * n, n, cols, tail, every); break;
          default: break;
        }
      };
      if (widen_once) {
        for (int64_t e = 0; e < k_dim * 16; e += 16) {
          vfloat lo, hi;
          load16(panel + e, lo, hi);
          store(wide.data() + e, lo);
          store(wide.data() + e + 8, hi);
        }
        all_rows(static_cast<const float*>(wide.data()));
      } else {
        all_rows(panel);
      }
    }
  });
}

}  // namespace

// x float32 [m, k_dim], panels [ceil(n / 16), k_dim, 16] of float32 or bfloat16 -> y float32 [m, n].
extern "C" void linear_float32(const float* x, const float* packed, float* y, int64_t m, int64_t k_dim, int64_t n,
                               int64_t threads, int64_t prefetch) {
  linear<float>(x, packed, y, m, k_dim, n, threads, prefetch);
}

extern "C" void linear_bfloat16(const float* x, const uint16_t* packed, float* y, int64_t m, int64_t k_dim,
                                int64_t n, int64_t threads, int64_t prefetch) {
  linear<uint16_t>(x, packed, y, m, k_dim, n, threads, prefetch);
}
