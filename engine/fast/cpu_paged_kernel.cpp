// Paged attention for the CPU: each query row reads its request's K/V where they lie in the pool,
// through its block table, and nothing of the context is copied out first.
//
// Built at first use by engine/fast/cpu_attention.py (the host's C++ compiler, -O3
// -march=native) and called through ctypes; it depends on no header beyond the C++ standard
// library and OpenMP. With threads > 1 the batch's rows are shared by torch's OpenMP workers
// (`share`, cpu_kernel_share.h). A row is any query: a decode,
// or one row of a prefill chunk (its q_pos tells how many keys it sees); q_pos < 0 marks a
// padding row, whose output is zeros.
//
// For row r, kv head h and each of its `group` query heads, over the visible key positions p
// (window_start <= p <= q_pos[r]; key p sits at pool slot tables[r][p / bs] * bs + p % bs):
//   pass 1: s[p] = dot(scale * q, k_p), and the maximum m;
//   pass 2: w[p] = exp(s[p] - m), their sum l, and out = sum_p w[p] * v_p / l.
// The same arithmetic as the reference (a softmax, then a weighted sum), in float (double for
// double pools); bfloat16 pools are read as bfloat16 and widened in registers.
//
// Speed, AVX-512 builds (float and bfloat16 pools of head size 32, 64, 96, 128 or 256: the
// "blocked" path, attend_row_blocked): a row's visible keys are taken 16 positions at a time (a
// chunk may span blocks: each key's slot offset is looked up once per row, one table read per
// block). Pass 1, per kv head and pair of its query heads: for each head, 16 vectors of partial
// products (FMAs on q held in registers; for bfloat16 pools where the CPU has AVX512-BF16,
// vdpbf16ps on q's and k's own bf16 bits: the products exact, summed in float, then scaled),
// each key row read once for both heads, folded by a shuffle-and-add network into one vector of
// the 16 scores: about 3 instructions a score where a horizontal sum per score took about 10.
// The softmax runs a vector at a time (the maximum, then exp by a polynomial within 2 ulp of
// std::exp). Pass 2, per kv head: each V row widened once for all its query heads (a bfloat16
// row as 32-bit words, shift and mask: even and odd elements in two instructions per 32 values,
// put back in order once at the output) and accumulated into up to 16 registers per 16 keys. One
// rounding at the output (bfloat16: to nearest even, vectorised). While a pass works on one
// chunk it prefetches the next chunk's slots a few lines per 4 keys visited (ChunkPrefetch;
// `paged_set_prefetch`). `paged_set_blocked(0)` switches the path off, to measure the difference
// (course/tuning/levers.py attention). Measured on a 2-core Sapphire Rapids-class Xeon, one
// thread: with a row's K/V in L2, bf16 rows ~1.9x (8 query / 4 kv heads of 64) and ~1.6x (16 / 8
// of 128) as fast as one score at a time, float32 ~1.4x / ~1.0x; a decode step's rows come from
// L3 or memory, whose load time neither path hides, and there the whole call ran 1.1-1.4x as
// fast. Tried on AMX tiles and not kept: the scores (16 keys' rows x q's pairs: +-8%), and the
// weighted sum with each weight split into three bf16 terms that sum to it exactly (as written,
// C tiles through memory every 32 keys: 1.4-1.9x slower than the vectors).
// Other builds and head sizes (and float64 pools) take the older loops: the widest vectors the
// build targets (cpu_attn_vec.h: 16 floats or 8 doubles with AVX-512, else 32 bytes, AVX2 or two
// NEON registers) when the head size is a multiple of the lanes, one score at a time summed by
// halving, K rows walked block by block with the next block prefetched; else one lane at a time.
// Prefill requests may instead be served as matrix products (engine/fast/cpu_prefill.py).
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <type_traits>

#include "cpu_attn_vec.h"
#include "cpu_kernel_share.h"

// The blocked path (16 keys at a time) needs AVX-512 F; the other builds take the loops below it.
#if ATTN_VEC_BYTES == 64 && defined(__AVX512F__)
#define ATTN_BLOCKED 1
#include <immintrin.h>
#else
#define ATTN_BLOCKED 0
#endif

namespace {



#if ATTN_DPBF16
// dot(a, b) of two bf16 rows of d values (d a multiple of 32): the products exact, summed in float.
inline float dot_bf16(const BF16* a, const BF16* b, int64_t d) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + c), (__m512bh)_mm512_loadu_si512(b + c));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + c + 32), (__m512bh)_mm512_loadu_si512(b + c + 32));
  }
  if (c < d) acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + c), (__m512bh)_mm512_loadu_si512(b + c));
  const __m512 both = _mm512_add_ps(acc0, acc1);
  afloat v;
  std::memcpy(&v, &both, sizeof v);
  return hsum(v);
}
#endif


// w[i] = exp(s[i] - m) for i < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  constexpr int L = kAttnBytes / sizeof(float);
  afloat total{};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    afloat y = aexp_nonpositive(aload(s + i) - m);
    std::memcpy(s + i, &y, sizeof y);
    total += y;
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}
inline double exp_shifted(double* s, int64_t n, double m) {  // float64: the library's exp
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// Calls fn(slot, i) for the visible key positions first..last in order (i = p - first), one
// block-table lookup per block. While it walks a block it prefetches the next one's slots from
// `pool` (slots of `slot_bytes`), key for key: the blocks of a request lie anywhere in the pool,
// so the hardware prefetcher cannot see the next one coming.
bool kv_prefetch = true;  // paged_set_prefetch(0): the hardware prefetcher alone (to measure the difference)
bool blocked_path = true;  // paged_set_blocked(0): the loops of one score at a time instead (to measure the difference)

template <typename T, typename F>
inline void for_each_key(const int32_t* table, int64_t bs, int64_t first, int64_t last, const T* pool,
                         int64_t slot_bytes, F&& fn) {
  int64_t p = first;
  while (p <= last) {
    const int64_t block = p / bs, within = p % bs;
    const int64_t base = static_cast<int64_t>(table[block]) * bs;
    const int64_t count = std::min<int64_t>(last - p + 1, bs - within);
    const bool has_next = kv_prefetch && (block + 1) * bs <= last;
    const char* next = has_next ? reinterpret_cast<const char*>(pool) + static_cast<int64_t>(table[block + 1]) * bs * slot_bytes
                                : nullptr;
    for (int64_t j = 0; j < count; ++j) {
      if (has_next) {
        const char* line = next + (within + j) * slot_bytes;
        for (int64_t b = 0; b < slot_bytes; b += 64) __builtin_prefetch(line + b, 0, 3);
      }
      fn(base + within + j, p - first + j);
    }
    p += count;
  }
}

// One row: its hq query heads at q ([hq, d], already scaled, W) against keys first..last.
// Every pass walks the keys in position order and reads each key's whole slot (all kv heads,
// contiguous in the pool), so a block's K or V is one sequential 16-32 KiB read.
// NV = d / L when it is known at compile time (the inner loops unroll), else 0.
template <typename T, typename W, int NV>
void attend_row(const W* q, const T* qraw, W scale, const T* k_pool, const T* v_pool, T* out, const int32_t* table,
                int64_t first, int64_t last, int64_t hq, int64_t hkv, int64_t d, int64_t bs,
                std::vector<W>& scores, std::vector<typename VecOf<W>::type>& accs) {
  typedef typename VecOf<W>::type V;
  constexpr int L = kAttnBytes / sizeof(W);
  const int64_t n = last - first + 1, nv = NV ? NV : d / L, group = hq / hkv;
  const int64_t stride = hkv * d;  // one slot of the pool
  scores.resize(static_cast<size_t>(n * hq));
  W* s = scores.data();
  // Pass 1: s[j][i] = q_j . k_i (q pre-scaled), query head j reading kv head j / group.
  for_each_key(table, bs, first, last, k_pool, stride * sizeof(T), [&](int64_t slot, int64_t i) {
    const T* kslot = k_pool + slot * stride;
    for (int64_t j = 0; j < hq; ++j) {
      const W* qj = q + j * d;
      const T* krow = kslot + (j / group) * d;
#if ATTN_DPBF16
      if constexpr (std::is_same<T, BF16>::value) {  // bf16 pairs straight from q's and k's own bits
        if (d % 32 == 0) {
          s[j * n + i] = scale * dot_bf16(qraw + j * d, krow, d);
          continue;
        }
      }
#endif
      V a0{}, a1{};
      int64_t c = 0;
      for (; c + 1 < nv; c += 2) {
        a0 += aload(qj + c * L) * aload(krow + c * L);
        a1 += aload(qj + (c + 1) * L) * aload(krow + (c + 1) * L);
      }
      if (c < nv) a0 += aload(qj + c * L) * aload(krow + c * L);
      s[j * n + i] = hsum(a0 + a1);
    }
  });
  // Softmax weights, per query head; inv[j] = 1 / their sum.
  W inv[256];
  for (int64_t j = 0; j < hq; ++j) {
    W* sj = s + j * n;
    W m = sj[0];
    for (int64_t i = 1; i < n; ++i) m = sj[i] > m ? sj[i] : m;
    inv[j] = W(1) / exp_shifted(sj, n, m);
  }
  // Pass 2: out_j = sum_i w[j][i] v_i / l_j; accs [hq, nv] vectors.
  accs.assign(static_cast<size_t>(hq * nv), V{});
  V* acc = accs.data();
  for_each_key(table, bs, first, last, v_pool, stride * sizeof(T), [&](int64_t slot, int64_t i) {
    const T* vslot = v_pool + slot * stride;
    for (int64_t h = 0; h < hkv; ++h) {
      V vr[NV ? NV : 1];
      const T* vrow = vslot + h * d;
      if (NV) {
        for (int64_t c = 0; c < nv; ++c) vr[c] = aload(vrow + c * L);
      }
      for (int64_t j = h * group; j < (h + 1) * group; ++j) {
        const W w = s[j * n + i];
        V* a = acc + j * nv;
        for (int64_t c = 0; c < nv; ++c) a[c] += w * (NV ? vr[c] : aload(vrow + c * L));
      }
    }
  });
  for (int64_t j = 0; j < hq; ++j) {
    for (int64_t c = 0; c < nv; ++c) {
      const V r = acc[j * nv + c] * inv[j];
      for (int l = 0; l < L; ++l) narrow(r[l], out + j * d + c * L + l);
    }
  }
}

#if ATTN_BLOCKED
// ---- The blocked path (AVX-512): 16 keys at a time --------------------------------------------
// A row's visible keys are taken in chunks of 16 consecutive positions (a chunk may span blocks:
// each key has its own slot offset). Scores: for one query head, the 16 keys' vectors of partial
// products are folded into ONE vector whose lane j is key j's score, by four levels of pairwise
// shuffles and adds (15 steps of 3 instructions for 16 scores, not a horizontal sum per score).

// Level 1: in each 128-bit quarter, [a0+a2, b0+b2, a1+a3, b1+b3] (lanes of a and b alternate).
inline __m512 fold1(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
// Level 2, of fold1(v0, v1) and fold1(v2, v3): quarter q holds [v0, v1, v2, v3], each summed over its quarter q.
inline __m512 fold2(__m512 x, __m512 y) {
  const __m512d a = _mm512_castps_pd(x), b = _mm512_castps_pd(y);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}
// Levels 3 and 4: quarters paired across two vectors, [x0+x1, x2+x3, y0+y1, y2+y3] (xi: quarter i of x).
inline __m512 fold34(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query head held in registers as its dot products read it: NV vectors of 16 floats (float
// pools; bf16 pools without vdpbf16ps, their keys widened on load), or NV / 2 of 32 bf16 (vdpbf16ps).
template <typename T, int NV> struct HeldQ {
  static constexpr bool kRaw = false;  // q is read scaled, in float
  __m512 r[NV];
  void load(const float* q, const T*) {
    for (int c = 0; c < NV; ++c) r[c] = _mm512_loadu_ps(q + 16 * c);
  }
  // 16 lanes of partial sums of q * k over the row k (d = 16 NV values).
  __m512 part(const T* k) const {
    __m512 a = _mm512_mul_ps(r[0], row16(k));
    for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(r[c], row16(k + 16 * c), a);
    return a;
  }
  static __m512 row16(const float* k) { return _mm512_loadu_ps(k); }
  static __m512 row16(const BF16* k) {  // 16 bf16 -> 16 floats
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
};
#if ATTN_DPBF16
template <int NV> struct HeldQ<BF16, NV> {  // q's own bf16 bits: the products exact, summed in float, then scaled
  static constexpr bool kRaw = true;
  __m512bh r[NV / 2];
  void load(const float*, const BF16* qraw) {
    for (int c = 0; c < NV / 2; ++c) r[c] = (__m512bh)_mm512_loadu_si512(qraw + 32 * c);
  }
  __m512 part(const BF16* k) const {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), r[0], (__m512bh)_mm512_loadu_si512(k));
    for (int c = 1; c < NV / 2; ++c) a = _mm512_dpbf16_ps(a, r[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return a;
  }
};
#endif

// The next chunk's slots (every kv head) to prefetch, a few lines at a time between the current
// chunk's loads (step(k): the next k lines, slot after slot), so that the requests go out at the
// pace of the work rather than in one burst the CPU's miss buffers cannot hold (a burst of a
// chunk's lines at its start was measured no faster than no prefetch at all). A chunk of more
// than 16 KiB goes to L2 only: into L1 it would push out the chunk being read (float32 at the
// 0.6B shape, 64 KiB chunks over 1,000 keys: ~20% faster so).
struct ChunkPrefetch {
  const char* slot[16];
  int64_t count = 0, slot_bytes = 0, at = 0, line = 0;  // next: line `line` of slot `at`
  template <typename T>
  void reset(const T* pool, const int64_t* off, int64_t i, int64_t n, int64_t slot_bytes_) {
    count = kv_prefetch ? std::max<int64_t>(0, std::min<int64_t>(16, n - i)) : 0;
    for (int64_t j = 0; j < count; ++j) slot[j] = reinterpret_cast<const char*>(pool + off[i + j]);
    slot_bytes = slot_bytes_;
    to_l2 = 16 * slot_bytes > (16 << 10);  // a chunk larger than a third to half of L1: into L2 only
    at = line = 0;
  }
  bool to_l2 = false;
  void step(int64_t k) {
    for (; k > 0 && at < count; --k) {
      if (to_l2) __builtin_prefetch(slot[at] + line, 0, 2);
      else __builtin_prefetch(slot[at] + line, 0, 3);
      line += 64;
      if (line >= slot_bytes) {
        line = 0;
        ++at;
      }
    }
  }
};

// Lane j of out[g]: the dot product of q[g] with the key row kp[j], for GT query heads at once
// (each key row read once for all of them; a chunk's missing keys point at kZeroRow). A quarter
// of the chunk's prefetch between each 4 keys.
template <typename T, int NV, int GT>
inline void scores16(const HeldQ<T, NV>* q, const T* const* kp, ChunkPrefetch& ahead, int64_t lines, __m512* out) {
  __m512 quad[GT][4];
  for (int u = 0; u < 4; ++u) {
    ahead.step(lines);
    const T* const* k = kp + 4 * u;
    for (int g = 0; g < GT; ++g)
      quad[g][u] = fold2(fold1(q[g].part(k[0]), q[g].part(k[1])), fold1(q[g].part(k[2]), q[g].part(k[3])));
  }
  for (int g = 0; g < GT; ++g) out[g] = fold34(fold34(quad[g][0], quad[g][1]), fold34(quad[g][2], quad[g][3]));
}
alignas(64) const float kZeroRow[256] = {};  // zeros for any row of d <= 256 (float or bf16)

// A V row widened to floats, NV vectors of 16. A float row as it lies; a bf16 row 32 values at a
// time, loaded as 16 32-bit words: the low halves shifted up are its 16 even elements, the high
// halves masked its 16 odd ones (two instructions per 32 values). So a bf16 pool's accumulators
// hold each 32 output values as [16 even, 16 odd], put back in order once, at the end (store_out).
inline void v_row(const float* v, __m512* out, int nv) {
  for (int c = 0; c < nv; ++c) out[c] = _mm512_loadu_ps(v + 16 * c);
}
inline void v_row(const BF16* v, __m512* out, int nv) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < nv / 2; ++c) {
    const __m512i w = _mm512_loadu_si512(v + 32 * c);
    out[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    out[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
  }
}

// Output values 16 c16 .. 16 c16 + 15 of one head: its accumulators acc times inv, stored (the one rounding, for bf16).
inline void store_out(const float* acc, int c16, __m512 inv, float* out) {
  _mm512_storeu_ps(out + 16 * c16, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c16), inv));
}
inline void store_out(const float* acc, int c16, __m512 inv, BF16* out) {
  // acc holds [16 even, 16 odd] per 32 values: these 16 are lanes 8 (c16 % 2) .. + 7 of each, interleaved
  const float* pair = acc + 32 * (c16 / 2);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512 r = _mm512_mul_ps(_mm512_permutex2var_ps(_mm512_loadu_ps(pair), c16 % 2 ? hi : lo,
                                                        _mm512_loadu_ps(pair + 16)), inv);
  // to bfloat16 as narrow() does: round to nearest even, NaN -> 0x7FC0
  const __m512i u = _mm512_castps_si512(r);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i b = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * c16), _mm512_cvtepi32_epi16(b));
}

// Pass 2 for GT query heads of one kv head over a chunk's keys 0 .. count - 1 (V rows vp[j]):
// acc[g] += w[g][j] * v_j, w with a row stride of np; the GT * NV accumulators stay in registers
// over the chunk (loaded and stored once per 16 keys), each V row widened once for the GT heads.
template <typename T, int NV, int GT>
inline void weigh16(const float* w, int64_t np, const T* const* vp, int count, float* acc, ChunkPrefetch& ahead,
                    int64_t lines) {
  __m512 a[GT][NV];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * NV + 16 * c);
  for (int j = 0; j < count; ++j) {
    __m512 v[NV];
    ahead.step(lines);
    v_row(vp[j], v, NV);
    for (int g = 0; g < GT; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * np + j]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(wg, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * 16 * NV + 16 * c, a[g][c]);
}

// Prefetches the whole slots (every kv head) of keys i .. i + 15 (of n) from pool, at once (a row's first chunk).
template <typename T>
inline void prefetch16(const T* pool, const int64_t* off, int64_t i, int64_t n, int64_t slot_bytes) {
  if (!kv_prefetch) return;
  for (int64_t j = i; j < std::min<int64_t>(n, i + 16); ++j) {
    const char* slot = reinterpret_cast<const char*>(pool + off[j]);
    for (int64_t b = 0; b < slot_bytes; b += 64) __builtin_prefetch(slot + b, 0, 3);
  }
}

// One row (hq <= 512 query heads of d = 16 NV; float arithmetic) against keys first..last, 16 at a
// time: pass 1 writes every score (np floats per head), the softmax turns them into weights in
// place, pass 2 sums the weighted V rows; one rounding at the output. qf: q scaled, in float;
// qraw: q as stored. While a pass works on one chunk it prefetches the next chunk's slots.
template <typename T, int NV>
void attend_row_blocked(const float* qf, const T* qraw, float scale, const T* k_pool, const T* v_pool, T* out,
                        const int32_t* table, int64_t first, int64_t last, int64_t hq, int64_t hkv, int64_t bs,
                        std::vector<float>& scores, std::vector<float>& accs, std::vector<int64_t>& offs) {
  constexpr int64_t d = 16 * NV;
  const int64_t n = last - first + 1, np = (n + 15) & ~int64_t{15}, group = hq / hkv, stride = hkv * d;
  const int64_t slot_bytes = stride * static_cast<int64_t>(sizeof(T));
  offs.resize(static_cast<size_t>(n));
  int64_t* off = offs.data();  // [n] each visible key's slot (element offset), one table lookup per block
  for (int64_t p = first, i = 0; p <= last;) {
    const int64_t within = p % bs, count = std::min<int64_t>(last - p + 1, bs - within);
    const int64_t base = (static_cast<int64_t>(table[p / bs]) * bs + within) * stride;
    for (int64_t j = 0; j < count; ++j) off[i + j] = base + j * stride;
    p += count;
    i += count;
  }
  scores.resize(static_cast<size_t>(hq * np));
  float* s = scores.data();  // [hq, np]
  const __m512 post = _mm512_set1_ps(HeldQ<T, NV>::kRaw ? scale : 1.0f);
  const T* kp[16];
  // prefetch lines per quarter of a scores16 call: a chunk's slots over its hq calls
  const int64_t k_lines = (16 * ((slot_bytes + 63) / 64) + 4 * hq - 1) / (4 * hq);
  ChunkPrefetch ahead;
  prefetch16(k_pool, off, 0, n, slot_bytes);  // the first chunk: at once
  for (int64_t i = 0; i < n; i += 16) {  // pass 1
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    ahead.reset(k_pool, off, i + 16, n, slot_bytes);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t h = 0; h < hkv; ++h) {
      for (int j = 0; j < count; ++j) kp[j] = k_pool + off[i + j] + h * d;
      for (int j = count; j < 16; ++j) kp[j] = reinterpret_cast<const T*>(kZeroRow);
      for (int64_t j = h * group, end = (h + 1) * group; j < end;) {  // query heads in pairs, then one
        const int pair = end - j >= 2 ? 2 : 1;
        HeldQ<T, NV> q[2];
        __m512 sc[2];
        for (int g = 0; g < pair; ++g) q[g].load(qf + (j + g) * d, qraw + (j + g) * d);
        if (pair == 2) {
          scores16<T, NV, 2>(q, kp, ahead, 2 * k_lines, sc);
        } else {
          scores16<T, NV, 1>(q, kp, ahead, k_lines, sc);
        }
        for (int g = 0; g < pair; ++g) {
          if (HeldQ<T, NV>::kRaw) sc[g] = _mm512_mul_ps(sc[g], post);
          _mm512_mask_storeu_ps(s + (j + g) * np + i, valid, sc[g]);
        }
        j += pair;
      }
    }
  }
  float inv[512];  // per head, 1 / the sum of its weights
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < hq; ++j) {  // softmax weights, in place
    float* sj = s + j * np;
    __m512 m = lowest;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - i)) - 1);
      m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, valid, sj + i));
    }
    inv[j] = 1.0f / exp_shifted(sj, n, _mm512_reduce_max_ps(m));
  }
  // Pass 2; a kv head's query heads in tiles of GT (GT * NV <= 16 accumulators in registers).
  accs.assign(static_cast<size_t>(hq * d), 0.0f);
  float* acc = accs.data();  // [hq, d] (bf16 pools: each 32 as [16 even, 16 odd])
  constexpr int GT = NV >= 16 ? 1 : NV >= 8 ? 2 : NV >= 4 ? 4 : 8;
  const T* vp[16];
  // prefetch lines per V row read: a chunk's slots over its hkv x 16 rows
  const int64_t v_lines = (16 * ((slot_bytes + 63) / 64) + 16 * hkv - 1) / (16 * hkv);
  prefetch16(v_pool, off, 0, n, slot_bytes);
  for (int64_t i = 0; i < n; i += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    ahead.reset(v_pool, off, i + 16, n, slot_bytes);
    for (int64_t h = 0; h < hkv; ++h) {
      for (int j = 0; j < count; ++j) vp[j] = v_pool + off[i + j] + h * d;
      for (int64_t j = h * group, end = (h + 1) * group; j < end;) {
        const float* w = s + j * np + i;
        const int64_t left = end - j;
        if (left >= GT) {
          weigh16<T, NV, GT>(w, np, vp, count, acc + j * d, ahead, v_lines);
          j += GT;
        } else if (GT > 4 && left >= 4) {
          weigh16<T, NV, (GT > 4 ? 4 : 1)>(w, np, vp, count, acc + j * d, ahead, v_lines);
          j += 4;
        } else if (GT > 2 && left >= 2) {
          weigh16<T, NV, (GT > 2 ? 2 : 1)>(w, np, vp, count, acc + j * d, ahead, v_lines);
          j += 2;
        } else {
          weigh16<T, NV, 1>(w, np, vp, count, acc + j * d, ahead, v_lines);
          j += 1;
        }
      }
    }
  }
  for (int64_t j = 0; j < hq; ++j) {
    const __m512 r = _mm512_set1_ps(inv[j]);
    for (int c = 0; c < NV; ++c) store_out(acc + j * d, c, r, out + j * d);
  }
}

// The head sizes the blocked path is built for (d = 16 NV): it serves a row of float or bf16 of
// one of them; false: the loops below serve it.
template <typename T>
bool attend_row_blocked_any(int64_t d, const float* qf, const T* qraw, float scale, const T* k_pool, const T* v_pool,
                            T* out, const int32_t* table, int64_t first, int64_t last, int64_t hq, int64_t hkv,
                            int64_t bs, std::vector<float>& scores, std::vector<float>& accs,
                            std::vector<int64_t>& offs) {
  switch (d) {
#define ATTN_BLOCKED_CASE(D)                                                                                         \
  case D:                                                                                                            \
    attend_row_blocked<T, D / 16>(qf, qraw, scale, k_pool, v_pool, out, table, first, last, hq, hkv, bs, scores, accs, \
                                  offs);                                                                             \
    return true;
    ATTN_BLOCKED_CASE(32)
    ATTN_BLOCKED_CASE(64)
    ATTN_BLOCKED_CASE(96)
    ATTN_BLOCKED_CASE(128)
    ATTN_BLOCKED_CASE(256)
#undef ATTN_BLOCKED_CASE
    default:
      return false;
  }
}
#endif

// Any head size, one lane at a time (the vector loops need d to be a multiple of the lanes).
template <typename T, typename W>
void attend_head_scalar(const W* q, const T* k_pool, const T* v_pool, T* out, const int32_t* table,
                        int64_t first, int64_t last, int64_t group, int64_t hkv, int64_t h, int64_t d,
                        int64_t bs, std::vector<W>& scores) {
  const int64_t n = last - first + 1, stride = hkv * d;
  scores.resize(static_cast<size_t>(n * group));
  W* s = scores.data();
  for_each_key(table, bs, first, last, k_pool, stride * sizeof(T), [&](int64_t slot, int64_t i) {
    const T* krow = k_pool + slot * stride + h * d;
    for (int64_t g = 0; g < group; ++g) {
      W dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += q[g * d + c] * widen(krow[c]);
      s[g * n + i] = dot;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    W* sg = s + g * n;
    W m = sg[0];
    for (int64_t i = 1; i < n; ++i) m = sg[i] > m ? sg[i] : m;
    const W inv = W(1) / exp_shifted(sg, n, m);
    std::vector<W> acc(d, W(0));
    for_each_key(table, bs, first, last, v_pool, stride * sizeof(T), [&](int64_t slot, int64_t i) {
      const T* vrow = v_pool + slot * stride + h * d;
      for (int64_t c = 0; c < d; ++c) acc[c] += sg[i] * widen(vrow[c]);
    });
    for (int64_t c = 0; c < d; ++c) narrow(acc[c] * inv, out + g * d + c);
  }
}

template <typename T, typename W>
void attend_rows(const T* q, const T* k_pool, const T* v_pool, T* out, const int32_t* tables,
                 int64_t table_stride, const int64_t* q_pos, int64_t row_begin, int64_t row_end,
                 int64_t hq, int64_t hkv, int64_t d, int64_t bs, double scale, int64_t window) {
  constexpr int L = kAttnBytes / sizeof(W);
  const int64_t group = hq / hkv;
  std::vector<W> qv(hq * d), scores;
  std::vector<typename VecOf<W>::type> accs;
#if ATTN_BLOCKED
  std::vector<float> flat;
  std::vector<int64_t> offs;
#endif
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t last = q_pos[r];
    const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
    const int32_t* table = tables + r * table_stride;
    if (last < 0) {  // a padding row (no keys): zeros
      std::memset(static_cast<void*>(out + r * hq * d), 0, sizeof(T) * hq * d);
      continue;
    }
    const T* src = q + r * hq * d;
    for (int64_t i = 0; i < hq * d; ++i) qv[i] = widen(src[i]) * static_cast<W>(scale);
    T* dst = out + r * hq * d;
#if ATTN_BLOCKED
    if constexpr (std::is_same<W, float>::value) {
      if (blocked_path && hq <= 512 &&
          attend_row_blocked_any<T>(d, qv.data(), src, float(scale), k_pool, v_pool, dst, table, first, last, hq, hkv,
                                    bs, scores, flat, offs))
        continue;
    }
#endif
    if (d % L || hq > 256) {
      for (int64_t h = 0; h < hkv; ++h)
        attend_head_scalar<T, W>(qv.data() + h * group * d, k_pool, v_pool, dst + h * group * d, table, first,
                                 last, group, hkv, h, d, bs, scores);
    } else if (d == 8 * L) {
      attend_row<T, W, 8>(qv.data(), src, W(scale), k_pool, v_pool, dst, table, first, last, hq, hkv, d, bs, scores, accs);
    } else if (d == 16 * L) {
      attend_row<T, W, 16>(qv.data(), src, W(scale), k_pool, v_pool, dst, table, first, last, hq, hkv, d, bs, scores, accs);
    } else if (d == 4 * L) {
      attend_row<T, W, 4>(qv.data(), src, W(scale), k_pool, v_pool, dst, table, first, last, hq, hkv, d, bs, scores, accs);
    } else if (d == 2 * L) {
      attend_row<T, W, 2>(qv.data(), src, W(scale), k_pool, v_pool, dst, table, first, last, hq, hkv, d, bs, scores, accs);
    } else {
      attend_row<T, W, 0>(qv.data(), src, W(scale), k_pool, v_pool, dst, table, first, last, hq, hkv, d, bs, scores, accs);
    }
  }
}

// The rows whose keys would be read from outside the pool or the table: a visible key position
// past the table's `width` columns, or a table entry it uses outside [0, num_blocks). The entry
// points check every row before reading any key and return this count (then they compute nothing).
int64_t count_bad_rows(const int32_t* tables, int64_t table_stride, int64_t width, const int64_t* q_pos,
                       int64_t rows, int64_t bs, int64_t window, int64_t num_blocks) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t last = q_pos[r];
    if (last < 0) continue;  // a padding row reads nothing
    const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
    if (last / bs >= width) {
      ++bad;
      continue;
    }
    const int32_t* table = tables + r * table_stride;
    for (int64_t b = first / bs; b <= last / bs; ++b) {
      if (table[b] < 0 || table[b] >= num_blocks) {
        ++bad;
        break;
      }
    }
  }
  return bad;
}

}  // namespace

#define ENTRY(NAME, T, W)                                                                        \
  extern "C" int64_t NAME(const void* q, const void* k, const void* v, void* out,               \
                          const int32_t* tables, int64_t table_stride, int64_t width,           \
                          const int64_t* q_pos, int64_t rows, int64_t threads, int64_t hq,      \
                          int64_t hkv, int64_t d, int64_t bs, int64_t num_blocks, double scale, \
                          int64_t window) {                                                      \
    const int64_t bad = count_bad_rows(tables, table_stride, width, q_pos, rows, bs, window, num_blocks); \
    if (bad) return bad;                                                                         \
    share(rows, threads, [&](int64_t begin, int64_t end) {                                       \
      attend_rows<T, W>(static_cast<const T*>(q), static_cast<const T*>(k),                     \
                        static_cast<const T*>(v), static_cast<T*>(out), tables, table_stride,   \
                        q_pos, begin, end, hq, hkv, d, bs, scale, window);                      \
    });                                                                                          \
    return 0;                                                                                    \
  }

ENTRY(paged_decode_float32, float, float)
ENTRY(paged_decode_bfloat16, BF16, float)
ENTRY(paged_decode_float64, double, double)

// The step's K/V rows into their pool slots: row r of k / v ([rows, width] with row strides
// ldk / ldv, width = Hkv * D) goes to slot slots[r] of each pool ([num_slots, width]); slot -1 (a
// padding row) is the pool's last slot, as in the reference's write_kv. Stored in the pool's dtype
// (bfloat16: rounded to nearest even, as torch's .to(bfloat16)). Returns the number of slots out of
// [-1, num_slots), and then writes nothing.
namespace {

template <typename S, typename T>
void write_rows(const S* k, int64_t ldk, const S* v, int64_t ldv, const int64_t* slots, int64_t begin, int64_t end,
                int64_t width, T* k_pool, T* v_pool, int64_t num_slots) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t slot = slots[r] < 0 ? num_slots - 1 : slots[r];
    T* kd = k_pool + slot * width;
    T* vd = v_pool + slot * width;
    const S* ks = k + r * ldk;
    const S* vs = v + r * ldv;
    for (int64_t i = 0; i < width; ++i) narrow(ks[i], kd + i);
    for (int64_t i = 0; i < width; ++i) narrow(vs[i], vd + i);
  }
}

}  // namespace

#define WRITE_ENTRY(NAME, S, T)                                                                         \
  extern "C" int64_t NAME(const void* k, int64_t ldk, const void* v, int64_t ldv, const int64_t* slots, \
                          int64_t rows, int64_t width, void* k_pool, void* v_pool, int64_t num_slots,   \
                          int64_t threads) {                                                            \
    int64_t bad = 0;                                                                                    \
    for (int64_t r = 0; r < rows; ++r) bad += slots[r] < -1 || slots[r] >= num_slots;                   \
    if (bad) return bad;                                                                                \
    share(rows, threads, [&](int64_t begin, int64_t end) {                                              \
      write_rows<S, T>(static_cast<const S*>(k), ldk, static_cast<const S*>(v), ldv, slots, begin, end, \
                       width, static_cast<T*>(k_pool), static_cast<T*>(v_pool), num_slots);            \
    });                                                                                                 \
    return 0;                                                                                           \
  }

extern "C" void paged_set_prefetch(int64_t on) { kv_prefetch = on != 0; }
extern "C" void paged_set_blocked(int64_t on) { blocked_path = on != 0; }

WRITE_ENTRY(write_kv_float32, float, float)
WRITE_ENTRY(write_kv_bfloat16, float, BF16)
WRITE_ENTRY(write_kv_float64, double, double)
