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
//   1. packs the request's visible keys of kv head h once, for every tile of its rows, 32 keys at
//      a time with the next 32 keys' pool rows prefetched, with AVX-512 shuffles: K transposed into the matrix units' pair layout (a row of a B tile holds,
//      for 16 keys, the pair of head values 2i, 2i+1 of each: a 16 x 16 transpose of 32-bit
//      pairs), and V likewise (a row holds, for 16 head columns, the values of keys 2i and 2i+1:
//      two key rows interleaved); keys outside [first visible, last] are zeros. Items go kv head
//      by kv head, and the chunks the item before packed from the same pool blocks are kept (a
//      cached prefix several requests share is packed once per kv head, not once per request);
//   2. for each tile of 16 query rows (row m = query row i x group + head g, as the blocked
//      kernel orders them: a kv head's query heads share its tiles), for each block of up to 256
//      keys some row sees:
//      S = Q K^T as 16 x 16 float tiles, four at a time (bf16 products are exact, the sums float:
//      the arithmetic of float attention on bf16 inputs, in another summation order);
//      masked (key p seen by a row at position pos iff p <= pos and, with a window w,
//      p > pos - w), softmax per row in AVX-512 floats: the block's largest score first, then
//      every weight once, 2^(s scale log2 e - m); exact within the block, online between blocks
//      (a row's sums rescaled by 2^(m_old - m_new) when its maximum grows);
//      O += P V, with the float weights P split into two bf16 parts (P = hi + lo, hi = P's top
//      16 bits, lo = bf16(P - hi): two tile products whose sum carries P to ~16 bits, far below
//      the one rounding of the output), summed in four 16 x 16 float tiles over the block's keys;
//   3. out row = O / l, rounded to bfloat16 once.
// So the softmax weights are never rounded to bfloat16 on their own, as PyTorch's bfloat16 flash
// attention does; results are those of float attention up to summation order and ~2^-16 of each
// weight.
//
// The tile configuration belongs to the thread: each work loop holds its own for its duration
// (`OwnTiles`, cpu_amx_tiles.h), then the one in force before it (oneDNN's, or none) is back.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_attn_vec.h"
#include "cpu_kernel_share.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define PREFILL_AMX 1
#include "cpu_amx_tiles.h"
#else
#define PREFILL_AMX 0
#endif

#if PREFILL_AMX
namespace {

constexpr int64_t kRows = 16;    // rows of a tile (query rows x heads of a work item's tile)
constexpr int64_t kChunk = 32;   // keys per value tile (its depth), two score tiles
constexpr int64_t kBlock = 256;  // keys per softmax block: exact within it, online between blocks
constexpr int64_t kSStride = kBlock + 16;  // floats per score row (padded off the 4 KiB set spacing)
constexpr int64_t kPStride = kBlock + 32;  // bf16 per weight row

struct Request {
  int64_t row0, rows, context;  // first row in q / out, how many, cached keys before them
  const int32_t* table;
};

// Scratch of one thread (on the heap: ~50 KB), the packed keys grown to the largest item it meets.
struct Scratch {
  std::vector<uint32_t> kt, vp;  // packed K (pairs of head values) and V (pairs of keys)
  alignas(64) float o[kRows * 256];        // [16][d] the rows' value sums
  alignas(64) float s[kRows * kSStride];   // [16][block] scores
  alignas(64) float pv[kRows * 16];        // one 16 x 16 value product
  alignas(64) uint16_t q[kRows * 256];     // [16][d] the tile's query rows
  alignas(64) uint16_t hi[kRows * kPStride], lo[kRows * kPStride];  // [16][block] weights, two bf16 parts
};

// r[i] <- column i of the 16 x 16 matrix of 32-bit values whose rows r holds.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4a + j], 128-bit lane L: column 4L + j of rows 4a .. 4a + 3.
  for (int a = 0; a < 4; ++a) {
    u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// 2^t for t <= 0 on the lanes of `keep`, zero on the others and below -125 (a weight under
// 2^-125 of the row's largest): t = n + f with n = round(t), |f| <= 1/2, 2^f by a degree-5
// polynomial (fitted here for relative error on [-1/2, 1/2]: under 2.4e-7, two float ulps, in
// float arithmetic), 2^n applied by scalef.
inline __m512 exp2_lanes(__m512 t, __mmask16 keep) {
  keep &= _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.327645848505199e-3f), f, _mm512_set1_ps(9.675541892647743e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713464617729e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022120237350464f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469440460205f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// 16 floats to bf16, round to nearest even, NaN to the quiet NaN (cpu_attn_vec.h's narrow, 16 at
// once): the AVX512-BF16 conversion, which rounds the same but treats subnormals as zero and keeps
// a NaN's payload, where no lane is either; else the integer rounding.
inline __m256i narrow16(__m512 x) {
  if (!_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80)) {  // no quiet NaN, subnormal or signalling NaN
    const __m256bh b = _mm512_cvtneps_pbh(x);
    __m256i r;
    std::memcpy(&r, &b, sizeof r);
    return r;
  }
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16));
  return _mm256_mask_mov_epi16(b, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm256_set1_epi16(0x7FC0));
}

// Step 1: keys k0 .. k0 + n - 1 of kv head h (k0 and n multiples of kChunk), the visible ones
// being [lo_key, hi_key] (the others zeros). kt: per 16-key block b and 32-value chunk c, a
// 16 x 16 tile of u32, row i = pairs (K[key][32c + 2i], K[key][32c + 2i + 1]) for its 16 keys
// (a transpose of the keys' rows). vp: per 32-key chunk and 16-column block, row i = pairs
// (V[2i][col], V[2i + 1][col]) for its 16 columns (two key rows interleaved).
// Keys before k0 + from (from a multiple of kChunk) are taken as packed already (an earlier item's:
// `reusable`).
void pack(const BF16* k_pool, const BF16* v_pool, const Request& req, int64_t h, int64_t hkv, int64_t d,
          int64_t bs, int64_t k0, int64_t n, int64_t lo_key, int64_t hi_key, int64_t from, Scratch& sc) {
  const int64_t chunks = d / 32, cols = d / 16, slot = hkv * d;
  sc.kt.resize(static_cast<size_t>(n / 16 * chunks * 256));
  sc.vp.resize(static_cast<size_t>(n / 32 * cols * 256));
  auto at = [&](int64_t p) -> int64_t {  // element offset of key p's row of head h, -1: not visible
    return p < lo_key || p > hi_key ? -1 : (static_cast<int64_t>(req.table[p / bs]) * bs + p % bs) * slot + h * d;
  };
  const __m512i first16 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                           5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i last16 = _mm512_add_epi16(first16, _mm512_set1_epi16(16));
  int64_t off[kChunk], next[kChunk];  // this chunk's and the next one's key rows (-1: not visible)
  for (int i = 0; i < kChunk; ++i) next[i] = from < n ? at(k0 + from + i) : -1;
  for (int64_t j = from; j < n; j += kChunk) {
    std::memcpy(off, next, sizeof off);
    for (int i = 0; i < kChunk; ++i) {  // the next chunk's rows on their way (the pool is rarely in cache)
      next[i] = j + kChunk < n ? at(k0 + j + kChunk + i) : -1;
      if (next[i] < 0) continue;
      for (int64_t byte = 0; byte < d * 2; byte += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_pool + next[i]) + byte, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v_pool + next[i]) + byte, _MM_HINT_T0);
      }
    }
    for (int64_t half = 0; half < 2; ++half) {  // K: one transpose per 16 keys and 32 head values
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t o = off[16 * half + i];
          r[i] = o < 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(k_pool + o + 32 * c);
        }
        transpose16(r);
        uint32_t* dst = sc.kt.data() + ((j / 16 + half) * chunks + c) * 256;
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + 16 * i, r[i]);
      }
    }
    for (int i = 0; i < 16; ++i) {  // V: keys 2i, 2i + 1 interleaved, 32 columns at a time
      const int64_t oa = off[2 * i], ob = off[2 * i + 1];
      uint32_t* dst = sc.vp.data() + (j / kChunk) * cols * 256 + i * 16;
      for (int64_t c = 0; c < d; c += 32) {
        const __m512i a = oa < 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(v_pool + oa + c);
        const __m512i b = ob < 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(v_pool + ob + c);
        _mm512_storeu_si512(dst + (c / 16) * 256, _mm512_permutex2var_epi16(a, first16, b));
        _mm512_storeu_si512(dst + (c / 16 + 1) * 256, _mm512_permutex2var_epi16(a, last16, b));
      }
    }
  }
}

// The packed item in sc: its request, kv head and key range, for `reusable`.
struct Packed {
  const Request* req = nullptr;
  int64_t h = -1, k0 = 0, first = 0, last = -1;
};

// How many keys from k0 on (a multiple of kChunk) the item packed before (`was`) left in sc as
// this one (request `req`, kv head h, keys k0 .. with [first, last] visible) would pack them:
// the same kv head and k0, whole chunks visible to both, read through the same pool blocks (a
// prefix the requests share, as the prefix cache hands it out). 0 where nothing is shared.
int64_t reusable(const Packed& was, const Request& req, int64_t h, int64_t k0, int64_t first, int64_t last,
                 int64_t bs) {
  if (was.req == nullptr || was.h != h || was.k0 != k0) return 0;
  const int64_t lo = std::max(first, was.first), hi = std::min(last, was.last);
  if (lo > k0) return 0;  // the first chunk holds zeros for one of them
  int64_t keys = 0;
  for (int64_t block = k0 / bs; keys + kChunk <= hi + 1 - k0; ++block) {
    if (req.table[block] != was.req->table[block]) break;
    keys = std::min(hi + 1, (block + 1) * bs) - k0;  // keys k0 .. these read through equal blocks
    keys = std::max<int64_t>(0, keys) / kChunk * kChunk;
  }
  return keys;
}

// O += (hi + lo) V over the block's keys [b0, b0 + nk) for the 16-column blocks cg .. cg + 3
// (cg .. cg + 1 where `two`), the products summed in tiles 0-3 (zeroed first). Two column blocks
// at a time, so that no product waits on the one just before it (hi then lo into one sum).
inline void values(const Scratch& sc, int64_t b0, int64_t nk, int64_t cols, int64_t cg, bool two) {
  _tile_zero(0);
  _tile_zero(1);
  if (!two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < nk; j += kChunk) {
    _tile_loadd(4, sc.hi + j, kPStride * 2);
    _tile_loadd(5, sc.lo + j, kPStride * 2);
    const uint32_t* vb = sc.vp.data() + ((b0 + j) / kChunk * cols + cg) * 256;
    _tile_loadd(6, vb, 64);
    _tile_loadd(7, vb + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    if (!two) {
      _tile_loadd(6, vb + 512, 64);
      _tile_loadd(7, vb + 768, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// 16 x 16 T score tiles (T = 4: keys j .. j + 63, four independent sums; T = 2: the last 32) from
// the query's 32-value chunks (tile 6) and the packed keys at `kb` (tiles 4 / 5), into sc.s at j.
template <int T>
inline void score_tiles(Scratch& sc, const uint32_t* kb, int64_t j, int64_t chunks, int64_t d) {
  _tile_zero(0);
  _tile_zero(1);
  if (T > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(6, sc.q + 32 * c, d * 2);
    _tile_loadd(4, kb + c * 256, 64);
    _tile_loadd(5, kb + (chunks + c) * 256, 64);
    _tile_dpbf16ps(0, 6, 4);
    _tile_dpbf16ps(1, 6, 5);
    if (T > 2) {
      _tile_loadd(4, kb + (2 * chunks + c) * 256, 64);
      _tile_loadd(5, kb + (3 * chunks + c) * 256, 64);
      _tile_dpbf16ps(2, 6, 4);
      _tile_dpbf16ps(3, 6, 5);
    }
  }
  _tile_stored(0, sc.s + j, kSStride * 4);
  _tile_stored(1, sc.s + j + 16, kSStride * 4);
  if (T > 2) {
    _tile_stored(2, sc.s + j + 32, kSStride * 4);
    _tile_stored(3, sc.s + j + 48, kSStride * 4);
  }
}

// S = Q K^T for the block's keys [b0, b0 + nk) into sc.s: 64 keys at a time, a last 32 (score_tiles).
inline void scores(Scratch& sc, int64_t b0, int64_t nk, int64_t d) {
  const int64_t chunks = d / 32;
  int64_t j = 0;
  for (; j + 64 <= nk; j += 64) score_tiles<4>(sc, sc.kt.data() + (b0 + j) / 16 * chunks * 256, j, chunks, d);
  if (j < nk) score_tiles<2>(sc, sc.kt.data() + (b0 + j) / 16 * chunks * 256, j, chunks, d);
}

// Steps 2-3 for rows [i0, i1) of the request (at most 16 / group of them: 16 tile rows), its keys
// packed from k0 on, the last one hi_key.
void rows_tile(const BF16* q, BF16* out, const Request& req, int64_t h, int64_t i0, int64_t i1, int64_t hq,
               int64_t hkv, int64_t d, float scale, int64_t window, int64_t k0, int64_t hi_key, Scratch& sc) {
  const int64_t group = hq / hkv, m_rows = (i1 - i0) * group, cols = d / 16;
  // Rows past m_rows keep whatever an earlier tile left: a tile row's scores, weights and sums
  // depend on that row alone, and these are never read.
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const BF16* src = q + (req.row0 + i) * hq * d + (h * group + g) * d;
      std::memcpy(sc.q + ((i - i0) * group + g) * d, src, sizeof(uint16_t) * d);
    }
  }
  const float scale2 = scale * 1.44269504088896341f;  // the scores' scale times log2(e): weights as powers of 2
  float m[kRows], l[kRows];  // per row: the largest scaled score (times log2 e) so far, the weights' sum
  int64_t pos[kRows], seen_from[kRows];  // row r sees keys [seen_from, pos]
  for (int64_t r = 0; r < m_rows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0;
    pos[r] = req.context + i0 + r / group;
    seen_from[r] = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
  }
  const int64_t c_begin = (seen_from[0] - k0) / kChunk * kChunk;  // row 0 sees the first key any row does
  const int64_t c_end = (std::min(pos[m_rows - 1], hi_key) - k0) / kChunk * kChunk + kChunk;
  bool summed = false;  // whether sc.o holds an earlier block's value sums
  for (int64_t b0 = c_begin; b0 < c_end; b0 += kBlock) {
    const int64_t nk = std::min(kBlock, c_end - b0), key0 = k0 + b0;
    scores(sc, b0, nk, d);
    // Softmax per row over the block: its maximum, then every weight once, split into bf16 hi + lo.
    for (int64_t r = 0; r < m_rows; ++r) {
      const float* srow = sc.s + r * kSStride;
      uint16_t* hrow = sc.hi + r * kPStride;
      uint16_t* lrow = sc.lo + r * kPStride;
      const int64_t a = std::max(seen_from[r], key0) - key0, b = std::min(pos[r], key0 + nk - 1) - key0;
      if (a > b) {  // none of the block's keys seen by this row
        std::memset(hrow, 0, sizeof(uint16_t) * nk);
        std::memset(lrow, 0, sizeof(uint16_t) * nk);
        continue;
      }
      // The largest scaled score among the seen keys [a, b] (from the largest or, scale < 0, smallest score).
      const int64_t va = a / 16, vb = b / 16;
      const __mmask16 mask_a = static_cast<__mmask16>(0xFFFFu << (a % 16));
      const __mmask16 mask_b = static_cast<__mmask16>(0xFFFFu >> (15 - b % 16));
      const bool up = scale2 > 0;
      __m512 ex = _mm512_set1_ps(up ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity());
      for (int64_t v = va; v <= vb; ++v) {
        const __mmask16 keep = (v == va ? mask_a : 0xFFFF) & (v == vb ? mask_b : 0xFFFF);
        const __m512 x = _mm512_load_ps(srow + 16 * v);
        ex = up ? _mm512_mask_max_ps(ex, keep, ex, x) : _mm512_mask_min_ps(ex, keep, ex, x);
      }
      const float m_new = std::max(m[r], (up ? _mm512_reduce_max_ps(ex) : _mm512_reduce_min_ps(ex)) * scale2);
      if (m_new > m[r]) {
        if (summed && l[r] > 0) {  // an earlier block's sums, relative to the smaller maximum
          const float alpha = std::exp2(m[r] - m_new);
          l[r] *= alpha;
          const __m512 av = _mm512_set1_ps(alpha);
          for (int64_t col = 0; col < d; col += 16)
            _mm512_store_ps(sc.o + r * d + col, _mm512_mul_ps(av, _mm512_load_ps(sc.o + r * d + col)));
        }
        m[r] = m_new;
      }
      // Weights w = 2^(s c1 - m), 32 keys at a time: hi = w's top 16 bits, lo = bf16(w - hi); zeros
      // outside the seen keys.
      const __m512 c1 = _mm512_set1_ps(scale2), c0 = _mm512_set1_ps(-m_new);
      const __m512 hi_bits = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
      const int64_t pa = a / 32, pb = b / 32;
      for (int64_t p = 0; p < pa; ++p) {
        _mm512_store_si512(hrow + 32 * p, _mm512_setzero_si512());
        _mm512_store_si512(lrow + 32 * p, _mm512_setzero_si512());
      }
      __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
      for (int64_t p = pa; p <= pb; ++p) {
        uint32_t keep = ~0u;
        if (p == pa) keep <<= a % 32;
        if (p == pb) keep &= ~0u >> (31 - b % 32);
        const __m512 w0 = exp2_lanes(_mm512_fmadd_ps(_mm512_load_ps(srow + 32 * p), c1, c0), static_cast<__mmask16>(keep));
        const __m512 w1 = exp2_lanes(_mm512_fmadd_ps(_mm512_load_ps(srow + 32 * p + 16), c1, c0),
                                     static_cast<__mmask16>(keep >> 16));
        sum0 = _mm512_add_ps(sum0, w0);
        sum1 = _mm512_add_ps(sum1, w1);
        const __m512 h0 = _mm512_and_ps(w0, hi_bits), h1 = _mm512_and_ps(w1, hi_bits);
        const __m512bh h32 = _mm512_cvtne2ps_pbh(h1, h0);
        const __m512bh l32 = _mm512_cvtne2ps_pbh(_mm512_sub_ps(w1, h1), _mm512_sub_ps(w0, h0));
        _mm512_store_si512(hrow + 32 * p, reinterpret_cast<const __m512i&>(h32));
        _mm512_store_si512(lrow + 32 * p, reinterpret_cast<const __m512i&>(l32));
      }
      for (int64_t p = pb + 1; p < nk / 32; ++p) {
        _mm512_store_si512(hrow + 32 * p, _mm512_setzero_si512());
        _mm512_store_si512(lrow + 32 * p, _mm512_setzero_si512());
      }
      const __m512 sum = _mm512_add_ps(sum0, sum1);
      l[r] += _mm512_reduce_add_ps(sum);
    }
    // O += (hi + lo) V, four 16-column blocks at a time in tiles 0-3.
    for (int64_t cg = 0; cg < cols; cg += 4) {
      const bool two = cols - cg == 2;
      values(sc, b0, nk, cols, cg, two);
      if (!summed) {  // the first block: the products are the sums
        _tile_stored(0, sc.o + cg * 16, d * 4);
        _tile_stored(1, sc.o + cg * 16 + 16, d * 4);
        if (!two) {
          _tile_stored(2, sc.o + cg * 16 + 32, d * 4);
          _tile_stored(3, sc.o + cg * 16 + 48, d * 4);
        }
        continue;
      }
      for (int64_t t = 0; t < (two ? 2 : 4); ++t) {
        switch (t) {  // tile numbers are immediates
          case 0: _tile_stored(0, sc.pv, 64); break;
          case 1: _tile_stored(1, sc.pv, 64); break;
          case 2: _tile_stored(2, sc.pv, 64); break;
          default: _tile_stored(3, sc.pv, 64); break;
        }
        for (int64_t r = 0; r < m_rows; ++r) {
          float* o = sc.o + r * d + (cg + t) * 16;
          _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), _mm512_load_ps(sc.pv + r * 16)));
        }
      }
    }
    summed = true;
  }
  for (int64_t r = 0; r < m_rows; ++r) {
    const int64_t i = i0 + r / group, g = r % group;
    BF16* dst = out + (req.row0 + i) * hq * d + (h * group + g) * d;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int64_t col = 0; col < d; col += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + col), narrow16(_mm512_mul_ps(_mm512_load_ps(sc.o + r * d + col), inv)));
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
    OwnTiles tiles(8);  // 16 rows x 64 bytes each (kRows), the thread's own setup back at the end
    const std::unique_ptr<Scratch> sc(new Scratch());
    Packed packed;
    for (int64_t it = begin; it < end; ++it) {  // kv head by kv head: consecutive requests may share keys
      const Request& req = reqs[it % num_reqs];
      const int64_t h = it / num_reqs;
      if (req.rows <= 0) continue;
      const int64_t last = req.context + req.rows - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, req.context - window + 1) : 0;
      const int64_t k0 = first / kChunk * kChunk, n = (last - k0) / kChunk * kChunk + kChunk;
      const int64_t from = std::min(n, reusable(packed, req, h, k0, first, last, bs));
      pack(k_pool, v_pool, req, h, hkv, d, bs, k0, n, first, last, from, *sc);
      packed = Packed{&req, h, k0, first, last};
      // Tiles of equal row counts (a request of 25 rows in tiles of 8: 7 + 6 + 6 + 6, not 8 + 8 + 8 + 1).
      const int64_t tiles = (req.rows + per_tile - 1) / per_tile;
      for (int64_t k = 0; k < tiles; ++k)
        rows_tile(q, out, req, h, req.rows * k / tiles, req.rows * (k + 1) / tiles, hq, hkv, d,
                  static_cast<float>(scale), window, k0, last, *sc);
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
