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
// shared by torch's OpenMP workers (`share`, cpu_kernel_share.h). Where the compiler targets
// AVX-512F the same panels are also read at 16-float width (namespace w512 below: `_avx512`),
// which can also return a SwiGLU gate/up weight's SiLU(gate) * up as it writes its outputs.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernel_share.h"
#include "cpu_kernel_vec.h"
#include "cpu_kernel_wide.h"  // the gated mode's SiLU (cpu_elementwise_kernel.cpp's), and immintrin.h

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
struct Paced {  // one 64-byte line from `next` on every `every` calls of step()
  const char* next;
  int64_t every, countdown;
  Paced(const char* from, int64_t period) : next(from), every(period), countdown(period) {}
  void step() {
    if (--countdown == 0) {
      countdown = every;
      __builtin_prefetch(next, 0, 3);
      next += 64;
    }
  }
};

template <int R, bool PREFETCH, typename P>
void panel_rows(const float* x, int64_t ldx, const P* panel, int64_t k_dim, float* y, int64_t ldy,
                int64_t cols, const char* next, int64_t every) {
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  Paced pace(next, every);
  for (int64_t k = 0; k < k_dim; ++k) {
    if (PREFETCH) pace.step();
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
  share_runs(panels, threads, [&](int64_t panel_begin, int64_t panel_end) {
    std::vector<float> wide(widen_once ? static_cast<size_t>(k_dim * 16) : 0);
    for (int64_t j = panel_begin; j < panel_end; ++j) {
      const P* panel = packed + j * k_dim * 16;
      const int64_t cols = std::min<int64_t>(16, n - j * 16);
      float* yj = y + j * 16;
      const char* next = prefetch && m <= kPrefetchMaxRows && j + 1 < panel_end
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

#if defined(__AVX512F__)
// ----- the same panels at AVX-512's width: a panel row is one 16-float register -------------------
// At 8-float width the FMA units do half the work they could on an AVX-512 CPU, and past ~32
// rows the kernel is bound by them (64 rows of the small preset's weights: 94 GFLOP/s, the 8-wide
// peak, against oneDNN's 125). Here a row block meets TWO panels side by side (32 columns): R
// rows x 2 registers of accumulators (R up to 14: 28 of the 32 registers; ~2% faster than 12),
// two panel loads and R broadcasts per k. The panels, the packing and the results' summation order (k ascending, one
// FMA per product) are the 8-wide kernel's, so both widths give the same float32 outputs bit for bit.
namespace w512 {

constexpr int kRows = 14;  // rows per block at most

inline __m512 row16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 row16(const uint16_t* p) {  // 16 bfloat16 in BF16_ORDER -> 16 floats in column order, exactly
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  h = _mm256_permute4x64_epi64(h, 0xD8);  // 64-bit quarters 0, 2, 1, 3: undoes the 4-7 / 8-11 swap
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __mmask16 first(int64_t cols) { return cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1); }

// The float32 SiLU(gate) * up of cpu_elementwise_kernel.cpp's silu_mul at this width.
inline __m512 silu_mul(__m512 gate, __m512 up) {
  typedef Wide<64> W;
  W::F g, u;
  std::memcpy(&g, &gate, sizeof g);
  std::memcpy(&u, &up, sizeof u);
  const W::F o = W::silu(g) * u;
  __m512 out;
  std::memcpy(&out, &o, sizeof out);
  return out;
}

// y[0..R) x [NP panels of 16 columns] = x[0..R) . panels (NP = 1 or 2, the second `stride` after the first).
// `cols`: the valid columns of the last panel (16 but at the weight's ragged end). Prefetch as above.
// GATED: the two panels are a gate panel and its up panel, and y gets SiLU(gate) * up (16 columns).
template <int R, int NP, bool PREFETCH, bool GATED, typename P>
void tile(const float* x, int64_t ldx, const P* panel, int64_t stride, int64_t k_dim, float* y, int64_t ldy,
          int64_t cols, const char* next, int64_t every) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  Paced pace(next, every);
  for (int64_t k = 0; k < k_dim; ++k) {
    if (PREFETCH) pace.step();
    __m512 b[NP];
    for (int p = 0; p < NP; ++p) b[p] = row16(panel + p * stride + k * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(a, b[p], acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (GATED) {
      _mm512_storeu_ps(y + r * ldy, silu_mul(acc[r][0], acc[r][NP - 1]));
    } else {
      for (int p = 0; p < NP; ++p)
        _mm512_mask_storeu_ps(y + r * ldy + p * 16, first(p + 1 == NP ? cols : 16), acc[r][p]);
    }
  }
}

// One row: G panels read side by side, k unrolled by two (2 G independent accumulators), summed in
// the 8-wide one_row_panels' order. GATED: the G panels are G / 2 (gate, up) pairs, and output
// 16-column group `first_panel / 2 + g` gets SiLU(gate) * up.
template <int G, bool GATED, typename P>
void one_row(const float* x, const P* panel, int64_t k_dim, float* y, int64_t n, int64_t first_panel) {
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= k_dim; k += 2) {
    const __m512 a0 = _mm512_set1_ps(x[k]), a1 = _mm512_set1_ps(x[k + 1]);
    for (int g = 0; g < G; ++g) {
      const P* p = panel + g * k_dim * 16 + k * 16;
      acc[g][0] = _mm512_fmadd_ps(a0, row16(p), acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(a1, row16(p + 16), acc[g][1]);
    }
  }
  for (; k < k_dim; ++k)
    for (int g = 0; g < G; ++g)
      acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), row16(panel + g * k_dim * 16 + k * 16), acc[g][0]);
  if (GATED) {
    for (int g = 0; g + 1 < G; g += 2)
      _mm512_storeu_ps(y + (first_panel + g) / 2 * 16, silu_mul(_mm512_add_ps(acc[g][0], acc[g][1]),
                                                                _mm512_add_ps(acc[g + 1][0], acc[g + 1][1])));
    return;
  }
  for (int g = 0; g < G; ++g) {
    const int64_t col = (first_panel + g) * 16;
    _mm512_mask_storeu_ps(y + col, first(n - col), _mm512_add_ps(acc[g][0], acc[g][1]));
  }
}

template <int NP, bool GATED, typename P>
void block(int64_t r, const float* x, int64_t ldx, const P* panel, int64_t stride, int64_t k_dim, float* y,
           int64_t ldy, int64_t cols, const char* next, int64_t every) {
#define W512_ROWS(R)                                                                                          \
  case R:                                                                                                    \
    if (next != nullptr)                                                                                     \
      tile<R, NP, true, GATED, P>(x, ldx, panel, stride, k_dim, y, ldy, cols, next, every);                  \
    else                                                                                                     \
      tile<R, NP, false, GATED, P>(x, ldx, panel, stride, k_dim, y, ldy, cols, next, every);                 \
    break;
  switch (r) {
    W512_ROWS(1) W512_ROWS(2) W512_ROWS(3) W512_ROWS(4) W512_ROWS(5) W512_ROWS(6)
    W512_ROWS(7) W512_ROWS(8) W512_ROWS(9) W512_ROWS(10) W512_ROWS(11) W512_ROWS(12) W512_ROWS(13) W512_ROWS(14)
    default: break;
  }
#undef W512_ROWS
}

// gated: the panels alternate gate / up (cpu_linear.py packs them so), n counts both, y is [m, n / 2].
template <typename P>
void linear(const float* x, const P* packed, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t threads,
            int64_t prefetch, bool gated) {
  const int64_t panels = (n + 15) / 16, panel_elems = k_dim * 16;
  const int64_t ldy = gated ? n / 2 : n;
  if (m == 1) {  // kOneRowGroup panels side by side (gated: pairs), the leftover ones singly (pairs)
    const int64_t groups = (panels + kOneRowGroup - 1) / kOneRowGroup;
    share(groups, threads, [&](int64_t group_begin, int64_t group_end) {
      for (int64_t g = group_begin; g < group_end; ++g) {
        const int64_t j = g * kOneRowGroup;
        if (j + kOneRowGroup <= panels) {
          if (gated)
            one_row<kOneRowGroup, true, P>(x, packed + j * panel_elems, k_dim, y, n, j);
          else
            one_row<kOneRowGroup, false, P>(x, packed + j * panel_elems, k_dim, y, n, j);
        } else if (gated) {
          for (int64_t jj = j; jj < panels; jj += 2) one_row<2, true, P>(x, packed + jj * panel_elems, k_dim, y, n, jj);
        } else {
          for (int64_t jj = j; jj < panels; ++jj) one_row<1, false, P>(x, packed + jj * panel_elems, k_dim, y, n, jj);
        }
      }
    });
    return;
  }
  // Row blocks of at most kRows, as even as can be (16 rows: 8 + 8, not 14 + 2). (Tried and not
  // kept: each block packed k-major, one stream of broadcasts: no faster, and its copy cost ~15% at
  // [512, 1536]; k in chunks so that a pair's chunk stays in L1 for every block: 0.94 -> 0.84-0.88x
  // oneDNN at 256 rows.)
  const int64_t blocks = (m + kRows - 1) / kRows, base = m / blocks, longer = m % blocks;
  const int64_t pairs = (panels + 1) / 2, pair_bytes = 2 * panel_elems * static_cast<int64_t>(sizeof(P));
  const int64_t share_lines = (pair_bytes / 64 + blocks - 1) / blocks;  // lines of the next pair per row block
  const int64_t every = std::max<int64_t>(1, (k_dim + share_lines - 1) / std::max<int64_t>(1, share_lines));
  const bool widen_once = !std::is_same<P, float>::value && m > kWidenOnceAfter;
  share_runs(pairs, threads, [&](int64_t pair_begin, int64_t pair_end) {
    std::vector<float> wide(widen_once ? static_cast<size_t>(2 * panel_elems) : 0);
    for (int64_t q = pair_begin; q < pair_end; ++q) {
      const int64_t j = 2 * q;
      const P* pair = packed + j * panel_elems;
      const bool two = j + 1 < panels;
      const int64_t cols = gated ? 16 : std::min<int64_t>(16, n - (two ? j + 1 : j) * 16);
      float* yq = y + (gated ? q * 16 : j * 16);
      // At every row count (the 8-float kernel stops at kPrefetchMaxRows): at 256 rows 0.88 -> 0.96x oneDNN.
      const char* next = prefetch && q + 1 < pair_end ? reinterpret_cast<const char*>(pair + 2 * panel_elems) : nullptr;
      auto all_rows = [&](auto* pan) {
        typedef std::remove_const_t<std::remove_pointer_t<decltype(pan)>> Q;
        int64_t i = 0;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t r = base + (b < longer ? 1 : 0);
          const char* share_next = next == nullptr ? nullptr : next + b * share_lines * 64;
          const float* xb = x + i * k_dim;
          if (gated)
            block<2, true, Q>(r, xb, k_dim, pan, panel_elems, k_dim, yq + i * ldy, ldy, cols, share_next, every);
          else if (two)
            block<2, false, Q>(r, xb, k_dim, pan, panel_elems, k_dim, yq + i * ldy, ldy, cols, share_next, every);
          else
            block<1, false, Q>(r, xb, k_dim, pan, panel_elems, k_dim, yq + i * ldy, ldy, cols, share_next, every);
          i += r;
        }
      };
      if (widen_once) {
        const int64_t count = (two ? 2 : 1) * panel_elems;
        for (int64_t e = 0; e < count; e += 16) _mm512_storeu_ps(wide.data() + e, row16(pair + e));
        all_rows(static_cast<const float*>(wide.data()));
      } else {
        all_rows(pair);
      }
    }
  });
}

}  // namespace w512
#endif  // __AVX512F__

}  // namespace

// x float32 [m, k_dim], panels [ceil(n / 16), k_dim, 16] of float32 or bfloat16 -> y float32 [m, n].
// _avx2: 8-float vectors (any x86-64-v3 CPU; ARM: NEON pairs); _avx512: 16-float ones, built where
// the compiler targets AVX-512F (linear_isas() says which exist). Both give the same outputs.
extern "C" void linear_float32_avx2(const float* x, const float* packed, float* y, int64_t m, int64_t k_dim,
                                    int64_t n, int64_t threads, int64_t prefetch) {
  linear<float>(x, packed, y, m, k_dim, n, threads, prefetch);
}

extern "C" void linear_bfloat16_avx2(const float* x, const uint16_t* packed, float* y, int64_t m, int64_t k_dim,
                                     int64_t n, int64_t threads, int64_t prefetch) {
  linear<uint16_t>(x, packed, y, m, k_dim, n, threads, prefetch);
}

#if defined(__AVX512F__)
// KIND linear: y [m, n]; KIND gated (a SwiGLU gate/up weight packed gate panel, up panel, ...:
// n = 2 I): y [m, I] = SiLU(gate) * up.
#define W512_ENTRY(KIND, DTYPE, T, GATED)                                                                    \
  extern "C" void KIND##_##DTYPE##_avx512(const float* x, const T* packed, float* y, int64_t m, int64_t k_dim, \
                                          int64_t n, int64_t threads, int64_t prefetch) {                   \
    w512::linear<T>(x, packed, y, m, k_dim, n, threads, prefetch, GATED);                                   \
  }
W512_ENTRY(linear, float32, float, false)
W512_ENTRY(linear, bfloat16, uint16_t, false)
W512_ENTRY(gated, float32, float, true)
W512_ENTRY(gated, bfloat16, uint16_t, true)
#undef W512_ENTRY
#endif

extern "C" const char* linear_isas() { return kBuiltWidths; }
