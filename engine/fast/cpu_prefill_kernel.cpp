// Blocked prefill attention for the CPU: a tile of one request's query rows against its keys,
// chunk by chunk, as small matrix products in registers (flash attention's order of work).
//
// Built at first use by engine/fast/cpu_prefill.py (the host's C++ compiler, -O3 -march=native)
// and called through ctypes. One call serves every request the step sends to it; its work items
// (request, kv head, tile of kTileRows query rows) are shared by torch's OpenMP workers
// (`share`, cpu_kernel_share.h). A tile holds the tile's rows for every query head of the kv
// head's group (M = rows x group), scaled by `scale`, widened to float (double for double pools).
// For each chunk of C = 2 vectors' lanes of keys that some row of the tile sees:
//   1. the chunk's K, transposed ([D][C]) and widened, and its V rows ([C][D]) are packed once;
//   2. S = Q K^T [M][C]: four rows x two vectors of keys per register block, each q value
//      broadcast against a packed K row;
//   3. masked (key p seen by row i at position pos_i iff p <= pos_i and, with a window w,
//      p > pos_i - w), then the online softmax: each row's running maximum m and sum l, its
//      accumulator O rescaled by exp(m_old - m_new) when m grows, P = exp(S - m);
//   4. O += P V: two rows at a time, the packed V row loaded once for both.
// Out row = O / l, rounded to the pool's dtype. The same arithmetic as the reference up to the
// order of additions (float sums, double for double pools).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <type_traits>

#include "cpu_attn_vec.h"
#include "cpu_kernel_share.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 32;  // query rows of one request per work item



template <typename V, typename W> inline V splat(W x) { return x - V{}; }  // x - 0 == x for every x: no add left
template <typename V, typename W> inline V iota() {  // 0, 1, 2, ... in the lanes
  V v{};
  for (unsigned i = 0; i < sizeof(V) / sizeof(W); ++i) v[i] = W(i);
  return v;
}
template <typename V, typename W> inline V vload(const W* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V, typename W> inline void vstore(W* p, V v) { std::memcpy(p, &v, sizeof v); }

struct Request {
  int64_t row0, rows, context;  // its first row in q / out, how many, its cached keys before them
  const int32_t* table;
};

// The keys k0 + j0 .. k0 + kn - 1 of kv head h (0 <= j0 < kn <= C): K transposed into kt [d][C],
// V into vp [C][d], widened; columns / rows outside [j0, kn) are zeros and nothing of their keys
// is read (below j0: before a sliding window, whose blocks the table may no longer hold).
template <typename T, typename W, int64_t C>
void pack(const T* k_pool, const T* v_pool, const Request& req, int64_t h, int64_t k0, int64_t j0, int64_t kn,
          int64_t d, int64_t bs, int64_t slot, W* kt, W* vp) {
  alignas(64) int64_t at[C];
  for (int64_t j = j0; j < kn; ++j) {
    const int64_t p = k0 + j;
    at[j] = (static_cast<int64_t>(req.table[p / bs]) * bs + p % bs) * slot + h * d;
  }
#if ATTN_VEC_BYTES == 64 && defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value && C % 8 == 0) {
    if (j0 == 0 && kn == C) {  // K transposed by gathers: 8 keys' value c per instruction, not one
      for (int64_t j = 0; j < C; ++j) std::memcpy(vp + j * d, v_pool + at[j], sizeof(float) * d);
      for (int64_t c = 0; c < d; ++c) {
        for (int64_t j = 0; j < C; j += 8) {
          const __m512i idx = _mm512_add_epi64(_mm512_load_si512(at + j), _mm512_set1_epi64(c));
          _mm256_storeu_ps(kt + c * C + j, _mm512_i64gather_ps(idx, k_pool, 4));
        }
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < C; ++j) {
    if (j >= j0 && j < kn) {
      const T* kr = k_pool + at[j];
      const T* vr = v_pool + at[j];
      for (int64_t c = 0; c < d; ++c) kt[c * C + j] = widen(kr[c]);
      for (int64_t c = 0; c < d; ++c) vp[j * d + c] = widen(vr[c]);
    } else {
      for (int64_t c = 0; c < d; ++c) kt[c * C + j] = W(0);
      for (int64_t c = 0; c < d; ++c) vp[j * d + c] = W(0);
    }
  }
}

// One work item: request `req`, kv head h, rows [i0, i1) of the request. Scratch buffers are the
// calling thread's. NV = D / L vectors per head row.
template <typename T, typename W, int NV>
void tile(const T* q, const T* k_pool, const T* v_pool, T* out, const Request& req, int64_t h, int64_t i0,
          int64_t i1, int64_t hq, int64_t hkv, int64_t d, int64_t bs, W scale, int64_t window, std::vector<W>& buf) {
  typedef typename VecOf<W>::type V;
  constexpr int64_t L = kAttnBytes / sizeof(W), C = 2 * L;
  const int64_t group = hq / hkv, rows = i1 - i0, m_rows = rows * group, slot = hkv * d;
  const int64_t mp = (m_rows + 3) / 4 * 4;  // padded to the score block's 4 rows
  // Scratch: Q [mp][d], O [mp][d], S [mp][C], Kt [d][C], Vp [C][d], row max / sum [mp].
  buf.resize(static_cast<size_t>(2 * mp * d + mp * C + 2 * d * C + 2 * mp));
  W* qs = buf.data();
  W* o = qs + mp * d;
  W* s = o + mp * d;
  W* kt = s + mp * C;
  W* vp = kt + d * C;
  W* mx = vp + C * d;
  W* sum = mx + mp;
  for (int64_t i = 0; i < rows; ++i) {  // row m = i * group + g: query head h * group + g at row i
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + (req.row0 + i0 + i) * hq * d + (h * group + g) * d;
      W* dst = qs + (i * group + g) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = widen(src[c]) * scale;
    }
  }
  std::fill(qs + m_rows * d, qs + mp * d, W(0));
  std::fill(o, o + mp * d, W(0));
  std::fill(mx, mx + mp, -std::numeric_limits<W>::infinity());
  std::fill(sum, sum + mp, W(0));
  const int64_t pos_first = req.context + i0, pos_last = req.context + i1 - 1;  // the tile's rows' positions
  const int64_t key_first = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
  for (int64_t k0 = key_first / C * C; k0 <= pos_last; k0 += C) {
    const int64_t kn = std::min<int64_t>(C, pos_last + 1 - k0);  // keys of this chunk that exist (<= pos_last)
    // 1. pack K transposed and V, widened; keys past kn are zeros (and masked below).
    pack<T, W, C>(k_pool, v_pool, req, h, k0, std::max<int64_t>(0, key_first - k0), kn, d, bs, slot, kt, vp);
    // 2. S = Q Kt, 4 rows x 2 vectors at a time.
    // Causal: keys past the block's last row are masked below, so a block whose rows see none of
    // the chunk's second half (or none of it) skips that product; its scores are overwritten.
    for (int64_t m = 0; m < mp; m += 4) {
      const int64_t seen = pos_first + std::min(m + 3, m_rows - 1) / group - k0 + 1;  // keys the block's last row sees
      const W* q0 = qs + m * d;
      if (seen > L) {
        V a[4][2] = {};
        for (int64_t c = 0; c < d; ++c) {
          const V b0 = vload<V>(kt + c * C), b1 = vload<V>(kt + c * C + L);
          for (int r = 0; r < 4; ++r) {
            const V x = splat<V>(q0[r * d + c]);
            a[r][0] += x * b0;
            a[r][1] += x * b1;
          }
        }
        for (int r = 0; r < 4; ++r) {
          vstore(s + (m + r) * C, a[r][0]);
          vstore(s + (m + r) * C + L, a[r][1]);
        }
      } else if (seen > 0) {
        V a[4] = {};
        for (int64_t c = 0; c < d; ++c) {
          const V b0 = vload<V>(kt + c * C);
          for (int r = 0; r < 4; ++r) a[r] += splat<V>(q0[r * d + c]) * b0;
        }
        for (int r = 0; r < 4; ++r) vstore(s + (m + r) * C, a[r]);
      }
    }
    // 3. mask and online softmax, row by row.
    const bool all_seen = k0 + C - 1 <= pos_first && (window <= 0 || k0 > pos_last - window);
    const V lanes0 = iota<V, W>(), lanes1 = lanes0 + W(L);  // j within the chunk, per lane
    const V hidden = splat<V>(-std::numeric_limits<W>::infinity());
    for (int64_t m = 0; m < m_rows; ++m) {
      W* sr = s + m * C;
      const int64_t pos = pos_first + m / group;
      V s0 = vload<V>(sr), s1 = vload<V>(sr + L);
      if (!all_seen) {  // visible: lo <= j <= hi, j counted from k0 (exact in W: |j| < 2^24)
        const W hi = W(std::min<int64_t>(pos - k0, kn - 1));
        const W lo = window > 0 ? W(pos - window + 1 - k0) : W(-1);
        s0 = (lanes0 <= hi) & (lanes0 >= lo) ? s0 : hidden;
        s1 = (lanes1 <= hi) & (lanes1 >= lo) ? s1 : hidden;
        vstore(sr, s0);
        vstore(sr + L, s1);
      }
      const V both = s0 > s1 ? s0 : s1;
      W top = mx[m];
      for (int64_t j = 0; j < L; ++j) top = both[j] > top ? both[j] : top;
      if (top == -std::numeric_limits<W>::infinity()) {  // this row sees none of the chunk
        for (int64_t j = 0; j < C; ++j) sr[j] = W(0);
        continue;
      }
      const W alpha = std::exp(mx[m] - top);  // 0 for the first chunk the row sees (mx = -inf)
      W total = 0;
      if constexpr (sizeof(W) == 4) {
        for (int64_t j = 0; j < C; j += L) {
          const V y = aexp_nonpositive(vload<V>(sr + j) - top);
          vstore(sr + j, y);
          total += hsum(y);
        }
      } else {
        for (int64_t j = 0; j < C; ++j) {
          sr[j] = std::exp(sr[j] - top);
          total += sr[j];
        }
      }
      sum[m] = sum[m] * alpha + total;
      mx[m] = top;
      if (alpha != W(1)) {
        W* orow = o + m * d;
        for (int64_t c = 0; c < d; c += L) vstore(orow + c, vload<V>(orow + c) * alpha);
      }
    }
    // 4. O += P V, two rows at a time.
    int64_t m = 0;
    for (; m + 1 < m_rows; m += 2) {
      // P is 0 past kn and past the second row's position (causal): those keys add nothing.
      const int64_t jn = std::min<int64_t>(kn, pos_first + (m + 1) / group - k0 + 1);
      V a0[NV], a1[NV];
      W* o0 = o + m * d;
      W* o1 = o0 + d;
      for (int v = 0; v < NV; ++v) {
        a0[v] = vload<V>(o0 + v * L);
        a1[v] = vload<V>(o1 + v * L);
      }
      const W* p0 = s + m * C;
      const W* p1 = p0 + C;
      for (int64_t j = 0; j < jn; ++j) {
        const V x0 = splat<V>(p0[j]), x1 = splat<V>(p1[j]);
        const W* vr = vp + j * d;
        for (int v = 0; v < NV; ++v) {
          const V y = vload<V>(vr + v * L);
          a0[v] += x0 * y;
          a1[v] += x1 * y;
        }
      }
      for (int v = 0; v < NV; ++v) {
        vstore(o0 + v * L, a0[v]);
        vstore(o1 + v * L, a1[v]);
      }
    }
    for (; m < m_rows; ++m) {
      const int64_t jn = std::min<int64_t>(kn, pos_first + m / group - k0 + 1);
      V a0[NV];
      W* o0 = o + m * d;
      for (int v = 0; v < NV; ++v) a0[v] = vload<V>(o0 + v * L);
      const W* p0 = s + m * C;
      for (int64_t j = 0; j < jn; ++j) {
        const V x0 = splat<V>(p0[j]);
        for (int v = 0; v < NV; ++v) a0[v] += x0 * vload<V>(vp + j * d + v * L);
      }
      for (int v = 0; v < NV; ++v) vstore(o0 + v * L, a0[v]);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t m = i * group + g;
      const W inv = W(1) / sum[m];
      T* dst = out + (req.row0 + i0 + i) * hq * d + (h * group + g) * d;
      for (int64_t c = 0; c < d; ++c) narrow(o[m * d + c] * inv, dst + c);
    }
  }
}

template <typename T, typename W>
int64_t run(const T* q, const T* k_pool, const T* v_pool, T* out, const int32_t* tables, int64_t table_stride,
            const int64_t* row0, const int64_t* rows, const int64_t* context, int64_t num_reqs, int64_t hq,
            int64_t hkv, int64_t d, int64_t bs, double scale, int64_t window, int64_t threads) {
  constexpr int64_t L = kAttnBytes / sizeof(W);
  const int64_t nv = d / L;
  if (d % L || !(nv == 1 || nv == 2 || nv == 4 || nv == 8 || nv == 16)) return -1;  // this head size: not served
  std::vector<Request> reqs(num_reqs);
  std::vector<int64_t> first_item(num_reqs + 1, 0);  // items: (request, kv head, tile)
  for (int64_t r = 0; r < num_reqs; ++r) {
    reqs[r] = Request{row0[r], rows[r], context[r], tables + r * table_stride};
    first_item[r + 1] = first_item[r] + hkv * ((rows[r] + kTileRows - 1) / kTileRows);
  }
  const int64_t items = first_item[num_reqs];
  share(items, threads, [&](int64_t begin, int64_t end) {
    std::vector<W> buf;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t r = std::upper_bound(first_item.begin(), first_item.end(), it) - first_item.begin() - 1;
      const int64_t local = it - first_item[r], tiles = (reqs[r].rows + kTileRows - 1) / kTileRows;
      const int64_t h = local / tiles, t = local % tiles;
      const int64_t i0 = t * kTileRows, i1 = std::min(reqs[r].rows, i0 + kTileRows);
#define TILE(N) tile<T, W, N>(q, k_pool, v_pool, out, reqs[r], h, i0, i1, hq, hkv, d, bs, W(scale), window, buf)
      switch (nv) {
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        case 4: TILE(4); break;
        case 8: TILE(8); break;
        default: TILE(16); break;
      }
#undef TILE
    }
  });
  return 0;
}

}  // namespace

// Returns 0, or -1 where the head size is not a multiple of the vector lanes (nothing computed).
#define PREFILL_ENTRY(NAME, T, W)                                                                            \
  extern "C" int64_t NAME(const void* q, const void* k, const void* v, void* out, const int32_t* tables,     \
                          int64_t table_stride, const int64_t* row0, const int64_t* rows, const int64_t* ctx,\
                          int64_t num_reqs, int64_t hq, int64_t hkv, int64_t d, int64_t bs, double scale,   \
                          int64_t window, int64_t threads) {                                                 \
    return run<T, W>(static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),           \
                     static_cast<T*>(out), tables, table_stride, row0, rows, ctx, num_reqs, hq, hkv, d, bs,  \
                     scale, window, threads);                                                                \
  }

PREFILL_ENTRY(prefill_blocked_float32, float, float)
PREFILL_ENTRY(prefill_blocked_bfloat16, BF16, float)
PREFILL_ENTRY(prefill_blocked_float64, double, double)
