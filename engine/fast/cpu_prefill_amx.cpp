// Prefill attention for bfloat16 pools on the CPU's matrix units (AMX): a request's query rows
// against its keys as tile products, scores and values both, flash attention's order of work.
//
// Built at first use by engine/fast/cpu_prefill.py (the host's C++ compiler, -O3 -march=native)
// and called through ctypes, with the blocked kernel's arguments (cpu_prefill_kernel.cpp). Where
// the build does not target AMX-BF16 (another CPU) or Linux refuses this process the tile state,
// the entry returns -1 / -2 and computes nothing; the Python side then never offers the path.
//
// One work item is (request, kv head); items are shared by torch's OpenMP workers (`share`,
// cpu_kernel_share.h). An item:
//   1. packs the request's visible keys of kv head h once, for every tile of its rows:
//      K transposed into the matrix units' pair layout (a row of a B tile holds, for 16 keys, the
//      pair of head values 2i, 2i+1 of each), and V likewise (a row holds, for 16 head columns,
//      the values of keys 2i and 2i+1); keys outside [first visible, last] are zeros;
//   2. for each tile of 16 query rows (row m = query row i x group + head g, as the blocked
//      kernel orders them), for each chunk of 32 keys some row sees:
//      S = Q K^T as two 16 x 16 float tiles (bf16 products are exact, the sums float: the
//      arithmetic of float attention on bf16 inputs, in another summation order);
//      scaled, masked (key p seen by a row at position pos iff p <= pos and, with a window w,
//      p > pos - w), online softmax per row in AVX-512 floats (running maximum m and sum l, the
//      row's accumulator rescaled by exp(m_old - m_new) when m grows);
//      O += P V, with the float weights P split into two bf16 parts (P = hi + lo, hi = bf16(P),
//      lo = bf16(P - hi): two tile products whose sum carries P to ~16 bits, far below the one
//      rounding of the output), the 16 x 16 float product added into O in memory.
//   3. out row = O / l, rounded to bfloat16 once.
// So the softmax weights are never rounded to bfloat16 on their own, as PyTorch's bfloat16 flash
// attention does; results are those of float attention up to summation order and ~2^-17 of each
// weight.
//
// The tile configuration belongs to the thread: each work loop saves the one in force (oneDNN's,
// or none), loads its own, and puts the saved one back (or releases the tiles) before returning.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_attn_vec.h"
#include "cpu_kernel_share.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define PREFILL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PREFILL_AMX 0
#endif

#if PREFILL_AMX
namespace {

constexpr int64_t kRows = 16;  // rows of a tile (query rows x heads of a work item's tile)
constexpr int64_t kKeys = 32;  // keys per chunk: two score tiles, one value tile's depth

struct TileConfig {  // the LDTILECFG memory layout, palette 1
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Linux hands a process the tile data state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return ok;
}

struct Request {
  int64_t row0, rows, context;  // first row in q / out, how many, cached keys before them
  const int32_t* table;
};

inline uint16_t bits(BF16 x) { return x.bits; }
// Scratch of one thread, grown to the largest item it meets.
struct Scratch {
  std::vector<uint32_t> kt, vp;  // packed K (pairs of head values) and V (pairs of keys)
  std::vector<float> o;          // [16][d] accumulators
  alignas(64) float s[kRows * kKeys];
  alignas(64) float pv[kRows * 16];
  alignas(64) uint16_t q[kRows * 256] = {};
  alignas(64) uint16_t hi[kRows * kKeys], lo[kRows * kKeys];
};

// Step 1: keys k0 .. k0 + n - 1 of kv head h (k0 a multiple of kKeys, n a multiple of kKeys),
// the visible ones being [lo_key, hi_key]. kt: per 16-key block b and 32-value column chunk c, a
// 16 x 16 tile of u32, row i = pairs (K[key][32c + 2i], K[key][32c + 2i + 1]) for its 16 keys.
// vp: per 32-key chunk and 16-column block, row i = pairs (V[2i][col], V[2i + 1][col]).
void pack(const BF16* k_pool, const BF16* v_pool, const Request& req, int64_t h, int64_t hkv, int64_t d,
          int64_t bs, int64_t k0, int64_t n, int64_t lo_key, int64_t hi_key, Scratch& sc) {
  const int64_t chunks = d / 32, cols = d / 16, slot = hkv * d;
  sc.kt.assign(static_cast<size_t>(n / 16 * chunks * 256), 0u);
  sc.vp.assign(static_cast<size_t>(n / 32 * cols * 256), 0u);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = k0 + j;
    if (p < lo_key || p > hi_key) continue;  // zeros (and masked): nothing of it is read
    const int64_t at = (static_cast<int64_t>(req.table[p / bs]) * bs + p % bs) * slot + h * d;
    const BF16* kr = k_pool + at;
    const BF16* vr = v_pool + at;
    uint32_t* kblock = sc.kt.data() + (j / 16) * chunks * 256 + (j % 16);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t i = 0; i < 16; ++i) {
        uint32_t pair;
        std::memcpy(&pair, kr + 32 * c + 2 * i, sizeof pair);
        kblock[c * 256 + i * 16] = pair;
      }
    }
    uint16_t* vblock = reinterpret_cast<uint16_t*>(sc.vp.data() + (j / 32) * cols * 256) + ((j % 32) / 2) * 32 + (j % 2);
    for (int64_t col = 0; col < d; ++col) vblock[(col / 16) * 512 + (col % 16) * 2] = bits(vr[col]);
  }
}

// Steps 2-3 for rows [i0, i1) of the request (at most 16 / group of them: 16 tile rows).
void rows_tile(const BF16* q, BF16* out, const Request& req, int64_t h, int64_t i0, int64_t i1, int64_t hq,
               int64_t hkv, int64_t d, float scale, int64_t window, int64_t k0, int64_t hi_key, Scratch& sc) {
  const int64_t group = hq / hkv, m_rows = (i1 - i0) * group, chunks = d / 32, cols = d / 16;
  // Rows past m_rows keep whatever an earlier tile left (zeros at first): their scores are never
  // used, their weights are zeros.
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const BF16* src = q + (req.row0 + i) * hq * d + (h * group + g) * d;
      std::memcpy(sc.q + ((i - i0) * group + g) * d, src, sizeof(uint16_t) * d);
    }
  }
  sc.o.resize(static_cast<size_t>(kRows * d));
  std::fill(sc.o.begin(), sc.o.begin() + m_rows * d, 0.0f);
  float m[kRows], l[kRows];
  int64_t pos[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0;
    pos[r] = r < m_rows ? req.context + i0 + r / group : -1;
  }
  const int64_t pos_first = req.context + i0, pos_last = req.context + i1 - 1;
  const int64_t key_first = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
  const __m512 lanes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c0 = (key_first - k0) / kKeys * kKeys; k0 + c0 <= std::min(pos_last, hi_key); c0 += kKeys) {
    // S = Q K^T: tiles 0 and 1 (keys c0 .. c0 + 15 and c0 + 16 .. c0 + 31).
    _tile_zero(0);
    _tile_zero(1);
    const uint32_t* kb = sc.kt.data() + (c0 / 16) * chunks * 256;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(2, sc.q + 32 * c, d * 2);
      _tile_loadd(3, kb + c * 256, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(3, kb + (chunks + c) * 256, 64);
      _tile_dpbf16ps(1, 2, 3);
    }
    _tile_stored(0, sc.s, kKeys * 4);
    _tile_stored(1, sc.s + 16, kKeys * 4);
    // Masked online softmax per row; P split into bf16 hi + lo.
    const float key0 = static_cast<float>(k0 + c0);
    for (int64_t r = 0; r < kRows; ++r) {
      __m512i* hi_row = reinterpret_cast<__m512i*>(sc.hi + r * kKeys);
      __m512i* lo_row = reinterpret_cast<__m512i*>(sc.lo + r * kKeys);
      if (pos[r] < 0) {
        _mm512_store_si512(hi_row, _mm512_setzero_si512());
        _mm512_store_si512(lo_row, _mm512_setzero_si512());
        continue;
      }
      const int64_t last = std::min(pos[r], hi_key), first = window > 0 ? pos[r] - window : -1;  // keys in (first, last]
      const __m512 scale_v = _mm512_set1_ps(scale);
      __m512 x[2];
      if (k0 + c0 > first && k0 + c0 + kKeys - 1 <= last) {  // every key of the chunk seen by this row
        x[0] = _mm512_mul_ps(_mm512_load_ps(sc.s + r * kKeys), scale_v);
        x[1] = _mm512_mul_ps(_mm512_load_ps(sc.s + r * kKeys + 16), scale_v);
      } else {
        for (int half = 0; half < 2; ++half) {
          const __m512 p = _mm512_add_ps(lanes, _mm512_set1_ps(key0 + 16 * half));
          const __mmask16 seen = _mm512_cmp_ps_mask(p, _mm512_set1_ps(static_cast<float>(last)), _CMP_LE_OQ) &
                                 _mm512_cmp_ps_mask(p, _mm512_set1_ps(static_cast<float>(first)), _CMP_GT_OQ);
          x[half] = _mm512_mask_mul_ps(neg_inf, seen, _mm512_load_ps(sc.s + r * kKeys + 16 * half), scale_v);
        }
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1])));
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing seen yet by this row
        _mm512_store_si512(hi_row, _mm512_setzero_si512());
        _mm512_store_si512(lo_row, _mm512_setzero_si512());
        continue;
      }
      if (m_new > m[r]) {
        const float alpha = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[r] - m_new);
        l[r] *= alpha;
        float* o = sc.o.data() + r * d;
        const __m512 a = _mm512_set1_ps(alpha);
        for (int64_t col = 0; col < d; col += 16) _mm512_storeu_ps(o + col, _mm512_mul_ps(a, _mm512_loadu_ps(o + col)));
        m[r] = m_new;
      }
      __m512 w[2];
      __m256i hb[2], lb[2];
      for (int half = 0; half < 2; ++half) {
        afloat v;
        const __m512 shifted = _mm512_sub_ps(x[half], _mm512_set1_ps(m_new));
        std::memcpy(&v, &shifted, sizeof v);
        const afloat e = aexp_nonpositive(v);  // masked lanes: -inf -> 0
        std::memcpy(&w[half], &e, sizeof e);
        const __m256bh h16 = _mm512_cvtneps_pbh(w[half]);  // round to nearest even
        std::memcpy(&hb[half], &h16, sizeof h16);
        const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb[half]), 16));
        const __m256bh l16 = _mm512_cvtneps_pbh(_mm512_sub_ps(w[half], hf));
        std::memcpy(&lb[half], &l16, sizeof l16);
      }
      l[r] += _mm512_reduce_add_ps(_mm512_add_ps(w[0], w[1]));
      _mm512_store_si512(hi_row, _mm512_inserti64x4(_mm512_castsi256_si512(hb[0]), hb[1], 1));
      _mm512_store_si512(lo_row, _mm512_inserti64x4(_mm512_castsi256_si512(lb[0]), lb[1], 1));
    }
    // O += (hi + lo) V: per 16 columns, two products into tile 4, added into the rows' O.
    _tile_loadd(5, sc.hi, kKeys * 2);
    _tile_loadd(6, sc.lo, kKeys * 2);
    const uint32_t* vb = sc.vp.data() + (c0 / 32) * cols * 256;
    for (int64_t col = 0; col < cols; ++col) {
      _tile_zero(4);
      _tile_loadd(7, vb + col * 256, 64);
      _tile_dpbf16ps(4, 5, 7);
      _tile_dpbf16ps(4, 6, 7);
      _tile_stored(4, sc.pv, 64);
      for (int64_t r = 0; r < m_rows; ++r) {
        float* o = sc.o.data() + r * d + col * 16;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_load_ps(sc.pv + r * 16)));
      }
    }
  }
  for (int64_t r = 0; r < m_rows; ++r) {
    const int64_t i = i0 + r / group, g = r % group;
    BF16* dst = out + (req.row0 + i) * hq * d + (h * group + g) * d;
    const float inv = 1.0f / l[r];
    for (int64_t col = 0; col < d; ++col) narrow(sc.o[r * d + col] * inv, dst + col);
  }
}

int64_t run(const BF16* q, const BF16* k_pool, const BF16* v_pool, BF16* out, const int32_t* tables,
            int64_t table_stride, const int64_t* row0, const int64_t* rows, const int64_t* context,
            int64_t num_reqs, int64_t hq, int64_t hkv, int64_t d, int64_t bs, double scale, int64_t window,
            int64_t threads) {
  const int64_t group = hkv > 0 ? hq / hkv : 0;
  if (hkv < 1 || hq % hkv || group > kRows || d % 32 || d > 256) return -1;  // this shape: not served
  if (!tiles_permitted()) return -2;
  std::vector<Request> reqs(num_reqs);
  for (int64_t r = 0; r < num_reqs; ++r) reqs[r] = Request{row0[r], rows[r], context[r], tables + r * table_stride};
  const int64_t per_tile = kRows / group;  // query rows of one tile
  share(num_reqs * hkv, threads, [&](int64_t begin, int64_t end) {
    TileConfig saved, mine{};
    _tile_storeconfig(&saved);
    mine.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      mine.rows[t] = kRows;
      mine.colsb[t] = 64;
    }
    _tile_loadconfig(&mine);
    Scratch sc;
    for (int64_t it = begin; it < end; ++it) {
      const Request& req = reqs[it / hkv];
      const int64_t h = it % hkv;
      if (req.rows <= 0) continue;
      const int64_t last = req.context + req.rows - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, req.context - window + 1) : 0;
      const int64_t k0 = first / kKeys * kKeys, n = (last - k0) / kKeys * kKeys + kKeys;
      pack(k_pool, v_pool, req, h, hkv, d, bs, k0, n, first, last, sc);
      for (int64_t i0 = 0; i0 < req.rows; i0 += per_tile)
        rows_tile(q, out, req, h, i0, std::min(req.rows, i0 + per_tile), hq, hkv, d, static_cast<float>(scale),
                  window, k0, last, sc);
    }
    if (saved.palette_id) {
      _tile_loadconfig(&saved);
    } else {
      _tile_release();
    }
  });
  return 0;
}

}  // namespace
#endif

// Returns 0; -1 where this build or shape is not served (no AMX-BF16 here, a head size not a
// multiple of 32 up to 256, more than 16 query heads per kv head); -2 where Linux refused the
// tile state. Nothing is computed unless it returns 0.
extern "C" int64_t prefill_amx_bfloat16(const void* q, const void* k, const void* v, void* out, const int32_t* tables,
                                        int64_t table_stride, const int64_t* row0, const int64_t* rows,
                                        const int64_t* ctx, int64_t num_reqs, int64_t hq, int64_t hkv, int64_t d,
                                        int64_t bs, double scale, int64_t window, int64_t threads) {
#if PREFILL_AMX
  return run(static_cast<const BF16*>(q), static_cast<const BF16*>(k), static_cast<const BF16*>(v),
             static_cast<BF16*>(out), tables, table_stride, row0, rows, ctx, num_reqs, hq, hkv, d, bs, scale, window,
             threads);
#else
  (void)q, (void)k, (void)v, (void)out, (void)tables, (void)table_stride, (void)row0, (void)rows, (void)ctx;
  (void)num_reqs, (void)hq, (void)hkv, (void)d, (void)bs, (void)scale, (void)window, (void)threads;
  return -1;
#endif
}

extern "C" int64_t prefill_amx_available() { return PREFILL_AMX; }

// The calling thread's tile configuration, as 64 bytes into `out` (all zeros: no tiles configured),
// for tests that the kernel leaves it as it found it. Returns 0; -1 where this build has no AMX.
extern "C" int64_t prefill_amx_tile_config(void* out) {
#if PREFILL_AMX
  if (!tiles_permitted()) return -1;
  alignas(64) TileConfig now;
  _tile_storeconfig(&now);
  std::memcpy(out, &now, sizeof now);
  return 0;
#else
  (void)out;
  return -1;
#endif
}
