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
// products (FMAs on q held in registers, each key row read and widened once for both heads: a
// bfloat16 row as 32-bit words, shift and mask, its even and odd elements in two instructions per
// 32 values, q's values reordered to match once per row; the "dpbf16" build instead takes
// vdpbf16ps on q's and k's own bf16 bits, where the CPU has AVX512-BF16: on the Xeon below one
// vdpbf16ps ran at about 1 per 3.5 cycles against 2 FMAs a cycle (independent ones in a loop),
// and with K/V in cache its pass 1 took ~1.15x as long as widening's, the call ~1.07x), folded by a shuffle-and-add network into one vector of the 16 scores: about 3
// instructions a score where a horizontal sum per score took about 10. The softmax runs a vector
// at a time, the row's last chunk masked (the maximum, then exp by a polynomial within 2 ulp of
// std::exp). Pass 2, per kv head: each V row widened once for all its query heads (as the keys:
// even and odd elements, put back in order once at the output) and accumulated into up to 16
// registers per 16 keys. One rounding at the output (bfloat16: to nearest even, vectorised).
// While a pass works on one chunk it prefetches the next one's rows, one row per row read, in
// address order (ChunkPrefetch; `paged_set_prefetch`); pass 1's last chunk prefetches pass 2's
// first, and pass 2's last the first keys of the next row the thread attends, so no pass starts
// on keys nobody asked for. `paged_set_blocked(0)` switches the path off, to measure the
// difference (course/tuning/levers.py attention). Measured on a 2-core Sapphire Rapids-class
// Xeon, one thread: with a row's K/V in L2, bf16 rows ~1.9x (8 query / 4 kv heads of 64) and
// ~1.6x (16 / 8 of 128) as fast as one score at a time, float32 ~1.4x / ~1.0x; a decode step's
// rows come from L3 or memory, whose load time neither path hides, and there the whole call ran
// 1.1-1.4x as fast. Since (the widened bf16 scores, the masked softmax tail, the prefetch by rows
// and across passes and rows, two kv heads per pass-2 loop at d <= 64), one thread, interleaved
// against 665590f: 16 rows of ~220 keys at 8 / 4 heads of 64 with most keys shared (in cache)
// bf16 ~1.28x, float32 ~1.4x the call; in an engine step (pools on huge pages) the shared-prefix
// workload's attention 1.15x (bf16) / 1.10x (float32), distinct contexts 0.96-1.02x, Qwen3-0.6B's
// shape 1.02-1.10x; `levers prefill-attention` (pools on 4 KiB pages, out of cache) 0.98-1.08x,
// except small float32 0.92-0.96x (there the unrolled row prefetch loses to the loop form that
// the L2 case keeps, which in turn costs ~13% with K/V in cache: not taken).
// Tried and not kept: the scores on AMX tiles, twice. First (16 keys' rows x q's pairs: +-8%);
// then as C [16 keys, hq] = K [16 keys, d] . Q^T with K's tile loaded straight from the pool,
// every kv head into one C through a block-diagonal Q^T, two C tiles in turn, the softmax and
// the weighted sum reading the key-major scores: ~1.06x with K/V in cache, 0.91x out of it (the
// tile products of 16 rows ran ~20-30 cycles each, not 16, and a tile load waits out its misses).
// Also the weighted sum with each weight split into three bf16 terms that sum to it exactly (as
// written, C tiles through memory every 32 keys: 1.4-1.9x slower than the vectors), two kv
// heads' scores interleaved in one pass (no faster: pass 1 is not latency-bound), and prefetch
// two or three chunks ahead, or into L2 only (3-9% slower out of cache).
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

// One query head held in registers as its dot products read it, and a key row as they take it
// (Key, from take()): part(key) is 16 lanes of partial sums of q . k, folded into scores by
// scores16. Each key row is taken once for all the query heads of its kv head.
//   float pools: NV vectors of 16 floats, q scaled; the key row as it lies.
//   bf16 pools: the same, but each 32 head values split into their 16 even and 16 odd elements
//     (q once per row, by split_q: kSplit), so that a key row is widened as pass 2 widens a V row,
//     its 32-bit words shifted (even elements) and masked (odd ones): two instructions per 32
//     values, then one FMA per 16 products as for float;
//   bf16 pools, the "dpbf16" build (-DATTN_SCORES_DPBF16, where the CPU has AVX512-BF16): q's own
//     bf16 bits and vdpbf16ps on the key row's (kRaw: the products exact, summed in float, then
//     scaled). On the Sapphire Rapids-class Xeon of issue 40 vdpbf16ps ran at about a seventh of
//     the FMAs' rate (see the file's head); cpu_decode_variant's probe measures both builds on
//     the machine at hand.
template <typename T, int NV> struct HeldQ {
  static constexpr bool kRaw = false;  // q is read scaled, in float
  static constexpr bool kSplit = !std::is_same<T, float>::value;  // q's 32-value blocks as [16 even, 16 odd]
  struct Key {
    __m512 v[kSplit ? NV : 1];  // bf16: the widened row
    const float* row = nullptr;  // float: the row where it lies (the FMAs read it from memory)
  };
  __m512 r[NV];
  void load(const float* q, const T*) {
    for (int c = 0; c < NV; ++c) r[c] = _mm512_loadu_ps(q + 16 * c);
  }
  static void take(const float* k, Key& key) { key.row = k; }
  static void take(const BF16* k, Key& key) {  // as v_row: [16 even, 16 odd] per 32 values
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int c = 0; c < NV / 2; ++c) {
      const __m512i w = _mm512_loadu_si512(k + 32 * c);
      key.v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      key.v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    }
  }
  __m512 part(const Key& key) const {
    if constexpr (kSplit) {
      __m512 a = _mm512_mul_ps(r[0], key.v[0]);
      for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(r[c], key.v[c], a);
      return a;
    } else {
      __m512 a = _mm512_mul_ps(r[0], _mm512_loadu_ps(key.row));
      for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(r[c], _mm512_loadu_ps(key.row + 16 * c), a);
      return a;
    }
  }
};
#if ATTN_DPBF16 && defined(ATTN_SCORES_DPBF16)
template <int NV> struct HeldQ<BF16, NV> {  // q's own bf16 bits: the products exact, summed in float, then scaled
  static constexpr bool kRaw = true;
  static constexpr bool kSplit = false;
  struct Key {
    __m512bh v[NV / 2];
  };
  __m512bh r[NV / 2];
  void load(const float*, const BF16* qraw) {
    for (int c = 0; c < NV / 2; ++c) r[c] = (__m512bh)_mm512_loadu_si512(qraw + 32 * c);
  }
  static void take(const BF16* k, Key& key) {
    for (int c = 0; c < NV / 2; ++c) key.v[c] = (__m512bh)_mm512_loadu_si512(k + 32 * c);
  }
  __m512 part(const Key& key) const {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), r[0], key.v[0]);
    for (int c = 1; c < NV / 2; ++c) a = _mm512_dpbf16_ps(a, r[c], key.v[c]);
    return a;
  }
};
#endif

// q's rows (hq x d floats) with each 32 values reordered as [16 even, 16 odd] (HeldQ::kSplit).
inline void split_q(const float* q, int64_t values, float* out) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t i = 0; i < values; i += 32) {
    const __m512 lo = _mm512_loadu_ps(q + i), hi = _mm512_loadu_ps(q + i + 16);
    _mm512_storeu_ps(out + i, _mm512_permutex2var_ps(lo, even, hi));
    _mm512_storeu_ps(out + i + 16, _mm512_permutex2var_ps(lo, odd, hi));
  }
}

// The next chunk's rows to prefetch, one row (one kv head's d values of one key) for each row the
// pass reads, in address order (slot after slot, kv head after kv head), so that the requests go
// out at the pace of the work rather than in one burst the CPU's miss buffers cannot hold (a burst
// of a chunk's lines at its start was measured no faster than no prefetch at all). The order
// matters: asking for each kv head's rows of the next chunk while reading that kv head's rows of
// this one (a stride of one slot) ran ~15% slower with K/V out of cache. A chunk of more than 16
// KiB goes to L2 only: into L1 it would push out the chunk being read (float32 at the 0.6B shape,
// 64 KiB chunks over 1,000 keys: ~20% faster so).
template <typename T, int NV> struct ChunkPrefetch {
  static constexpr int64_t kRowBytes = 16 * NV * sizeof(T);  // one kv head's row of one key
  const char* slot[16];
  int64_t keys = 0, hkv = 1, key = 0, part = 0;  // next: kv head `part` of slot `key` (key == keys: done)
  bool to_l2 = false;
  void reset(const T* pool, const int64_t* off, int64_t i, int64_t n, int64_t hkv_) {
    keys = kv_prefetch ? std::max<int64_t>(0, std::min<int64_t>(16, n - i)) : 0;
    for (int64_t j = 0; j < keys; ++j) slot[j] = reinterpret_cast<const char*>(pool + off[i + j]);
    hkv = hkv_;
    key = part = line_at = 0;
    to_l2 = 16 * hkv * kRowBytes > (16 << 10);  // a chunk larger than a third to half of L1: into L2 only
  }
  int64_t line_at = 0;  // to_l2: the next line within the current slot (bytes)
  // The next row's lines. Into L2 (large chunks), a line at a time through a loop that keeps its
  // place by bytes: the same lines as the unrolled row below, yet at 16 / 8 heads of 128 with K/V
  // out of cache the unrolled form ran the call ~5-8% slower (float32) than this one (measured,
  // not understood: perhaps its bursts of 8 prefetches hold the fill buffers demand loads wait for).
  void step() {
    if (key >= keys) return;
    if (to_l2) {
      const int64_t slot_bytes = hkv * kRowBytes;
      for (int64_t k = kRowBytes / 64; k > 0 && key < keys; --k) {
        __builtin_prefetch(slot[key] + line_at, 0, 2);
        line_at += 64;
        if (line_at >= slot_bytes) {
          line_at = 0;
          ++key;
        }
      }
      return;
    }
    const char* line = slot[key] + part * kRowBytes;
    for (int64_t b = 0; b < kRowBytes; b += 64) __builtin_prefetch(line + b, 0, 3);
    if (++part == hkv) {
      part = 0;
      ++key;
    }
  }
  void rest() {  // what is left of the chunk (a pass's last chunk may read fewer rows than the next one has)
    while (key < keys) step();
  }
};

// The row a thread attends after this one (table, first, last: as attend_row_blocked's), whose first
// chunk of keys the end of this row's pass 2 prefetches; table nullptr: none.
struct NextRow {
  const int32_t* table = nullptr;
  int64_t first = 0, last = -1;
};

// off[j] = the slot (element offset) of visible key first + j, for j < count (count <= last - first + 1).
inline void key_offsets(const int32_t* table, int64_t first, int64_t count, int64_t bs, int64_t stride,
                        int64_t* off) {
  for (int64_t p = first, i = 0; i < count;) {
    const int64_t within = p % bs, run = std::min<int64_t>(count - i, bs - within);
    const int64_t base = (static_cast<int64_t>(table[p / bs]) * bs + within) * stride;
    for (int64_t j = 0; j < run; ++j) off[i + j] = base + j * stride;
    p += run;
    i += run;
  }
}

// Lane j of out[g]: the dot product of q[g] with the key row kp[j], for GT query heads at once
// (each key row read once for all of them; a chunk's missing keys point at kZeroRow). ahead (or
// nullptr: none): one row of the next chunk prefetched per key row read.
template <typename T, int NV, int GT>
inline void scores16(const HeldQ<T, NV>* q, const T* const* kp, ChunkPrefetch<T, NV>* ahead, __m512* out) {
  __m512 quad[GT][4];
  for (int u = 0; u < 4; ++u) {
    if (ahead)
      for (int j = 0; j < 4; ++j) ahead->step();
    __m512 p[GT][4];
    for (int x = 0; x < 4; ++x) {
      typename HeldQ<T, NV>::Key key;
      HeldQ<T, NV>::take(kp[4 * u + x], key);
      for (int g = 0; g < GT; ++g) p[g][x] = q[g].part(key);
    }
    for (int g = 0; g < GT; ++g) quad[g][u] = fold2(fold1(p[g][0], p[g][1]), fold1(p[g][2], p[g][3]));
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
inline void weigh16(const float* w, int64_t np, const T* const* vp, int count, float* acc,
                    ChunkPrefetch<T, NV>* ahead) {
  __m512 a[GT][NV];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * NV + 16 * c);
  for (int j = 0; j < count; ++j) {
    __m512 v[NV];
    if (ahead) ahead->step();
    v_row(vp[j], v, NV);
    for (int g = 0; g < GT; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * np + j]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(wg, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * 16 * NV + 16 * c, a[g][c]);
}

// weigh16 for the two query heads (G = 2) of each of two kv heads at once (a chunk's V rows vp[j]
// of the first; the second's lie d values on, in the same slot): 4 NV <= 16 accumulators, twice
// the work per key for the same loop and prefetch overhead (~3% of a call at 8 / 4 heads of 64,
// K/V in cache). w, acc: the first kv head's (the second's 2 np and 2 d on). The next chunk's
// prefetch: two rows per key, the two kv heads' shares.
template <typename T, int NV>
inline void weigh16_pair(const float* w, int64_t np, const T* const* vp, int count, float* acc,
                         ChunkPrefetch<T, NV>* ahead) {
  constexpr int64_t d = 16 * NV;
  __m512 a[4][NV];
  for (int g = 0; g < 4; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + g * d + 16 * c);
  for (int j = 0; j < count; ++j) {
    __m512 v0[NV], v1[NV];
    if (ahead) {
      ahead->step();
      ahead->step();
    }
    v_row(vp[j], v0, NV);
    v_row(vp[j] + d, v1, NV);
    for (int g = 0; g < 4; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * np + j]);
      const __m512* v = g < 2 ? v0 : v1;
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(wg, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < 4; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + g * d + 16 * c, a[g][c]);
}

// w[i] = exp(s[i] - m) for i < n, 16 at a time (the last 16 masked: its lanes past n read as
// -inf, so their weights are 0); returns the weights' sum. s holds a multiple of 16 values (the
// lanes past n are written: 0). Not the scalar std::exp on a row's last n % 16 scores, which took
// ~10% of a call at 8 / 4 heads of 64 and ~220 keys.
inline float exp_shifted16(float* s, int64_t n, float m) {
  const __m512 lowest = _mm512_set1_ps(-INFINITY), mv = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - i)) - 1);
    const afloat x = (afloat)_mm512_sub_ps(_mm512_mask_loadu_ps(lowest, valid, s + i), mv);
    const __m512 y = (__m512)aexp_nonpositive(x);
    _mm512_storeu_ps(s + i, y);
    total = _mm512_add_ps(total, y);
  }
  return _mm512_reduce_add_ps(total);
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
                        std::vector<float>& scores, std::vector<float>& accs, std::vector<int64_t>& offs,
                        std::vector<float>& qsplit, const NextRow& next, bool primed) {
  constexpr int64_t d = 16 * NV;
  const int64_t n = last - first + 1, np = (n + 15) & ~int64_t{15}, group = hq / hkv, stride = hkv * d;
  const int64_t slot_bytes = stride * static_cast<int64_t>(sizeof(T));
  offs.resize(static_cast<size_t>(n));
  int64_t* off = offs.data();  // [n] each visible key's slot (element offset), one table lookup per block
  key_offsets(table, first, n, bs, stride, off);
  scores.resize(static_cast<size_t>(hq * np));
  float* s = scores.data();  // [hq, np]
  const __m512 post = _mm512_set1_ps(HeldQ<T, NV>::kRaw ? scale : 1.0f);
  if (HeldQ<T, NV>::kSplit) {  // q as the split key rows pair with it
    qsplit.resize(static_cast<size_t>(hq * d));
    split_q(qf, hq * d, qsplit.data());
    qf = qsplit.data();
  }
  const T* kp[16];
  ChunkPrefetch<T, NV> ahead;
  if (!primed) prefetch16(k_pool, off, 0, n, slot_bytes);  // the first chunk at once, unless the row before asked for it
  for (int64_t i = 0; i < n; i += 16) {  // pass 1
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    if (i + 16 < n) ahead.reset(k_pool, off, i + 16, n, hkv);
    else ahead.reset(v_pool, off, 0, n, hkv);  // the last chunk: pass 2's first
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t h = 0; h < hkv; ++h) {
      for (int j = 0; j < count; ++j) kp[j] = k_pool + off[i + j] + h * d;
      for (int j = count; j < 16; ++j) kp[j] = reinterpret_cast<const T*>(kZeroRow);
      for (int64_t j = h * group, end = (h + 1) * group; j < end;) {  // query heads in pairs, then one
        const int pair = end - j >= 2 ? 2 : 1;
        HeldQ<T, NV> q[2];
        __m512 sc[2];
        for (int g = 0; g < pair; ++g) q[g].load(qf + (j + g) * d, qraw + (j + g) * d);
        ChunkPrefetch<T, NV>* pf = j == h * group ? &ahead : nullptr;  // the kv head's first pair: its 16 rows
        if (pair == 2) {
          scores16<T, NV, 2>(q, kp, pf, sc);
        } else {
          scores16<T, NV, 1>(q, kp, pf, sc);
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
    inv[j] = 1.0f / exp_shifted16(sj, n, _mm512_reduce_max_ps(m));
  }
  // Pass 2; a kv head's query heads in tiles of GT (GT * NV <= 16 accumulators in registers).
  accs.assign(static_cast<size_t>(hq * d), 0.0f);
  float* acc = accs.data();  // [hq, d] (bf16 pools: each 32 as [16 even, 16 odd])
  constexpr int GT = NV >= 16 ? 1 : NV >= 8 ? 2 : NV >= 4 ? 4 : 8;
  const T* vp[16];
  ahead.rest();
  int64_t next_off[16];
  const int64_t next_keys = next.table ? std::min<int64_t>(16, next.last - next.first + 1) : 0;
  if (next_keys > 0) key_offsets(next.table, next.first, next_keys, bs, stride, next_off);
  for (int64_t i = 0; i < n; i += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, n - i));
    if (i + 16 < n) ahead.reset(v_pool, off, i + 16, n, hkv);
    else ahead.reset(k_pool, next_off, 0, next_keys, hkv);  // the last chunk: the next row's first keys
    if (NV <= 4 && group == 2 && hkv % 2 == 0) {  // two kv heads at a time (16 accumulators)
      for (int64_t h = 0; h < hkv; h += 2) {
        for (int j = 0; j < count; ++j) vp[j] = v_pool + off[i + j] + h * d;
        weigh16_pair<T, NV>(s + 2 * h * np + i, np, vp, count, acc + 2 * h * d, &ahead);
      }
      continue;
    }
    for (int64_t h = 0; h < hkv; ++h) {
      for (int j = 0; j < count; ++j) vp[j] = v_pool + off[i + j] + h * d;
      for (int64_t j = h * group, end = (h + 1) * group; j < end;) {
        const float* w = s + j * np + i;
        const int64_t left = end - j;
        ChunkPrefetch<T, NV>* pf = j == h * group ? &ahead : nullptr;  // the kv head's first tile: its 16 rows
        if (left >= GT) {
          weigh16<T, NV, GT>(w, np, vp, count, acc + j * d, pf);
          j += GT;
        } else if (GT > 4 && left >= 4) {
          weigh16<T, NV, (GT > 4 ? 4 : 1)>(w, np, vp, count, acc + j * d, pf);
          j += 4;
        } else if (GT > 2 && left >= 2) {
          weigh16<T, NV, (GT > 2 ? 2 : 1)>(w, np, vp, count, acc + j * d, pf);
          j += 2;
        } else {
          weigh16<T, NV, 1>(w, np, vp, count, acc + j * d, pf);
          j += 1;
        }
      }
    }
  }
  ahead.rest();
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
                            std::vector<int64_t>& offs, std::vector<float>& qsplit, const NextRow& next,
                            bool primed) {
  switch (d) {
#define ATTN_BLOCKED_CASE(D)                                                                                         \
  case D:                                                                                                            \
    attend_row_blocked<T, D / 16>(qf, qraw, scale, k_pool, v_pool, out, table, first, last, hq, hkv, bs, scores, accs, \
                                  offs, qsplit, next, primed);                                                       \
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
  std::vector<float> qsplit;
  bool primed = false;  // the row before asked for this row's first chunk of keys
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
      NextRow next;  // the next row with keys, if this thread attends it
      if (r + 1 < row_end && q_pos[r + 1] >= 0) {
        next.table = tables + (r + 1) * table_stride;
        next.last = q_pos[r + 1];
        next.first = window > 0 ? std::max<int64_t>(0, next.last - window + 1) : 0;
      }
      const bool was_primed = primed;
      primed = false;
      if (blocked_path && hq <= 512 &&
          attend_row_blocked_any<T>(d, qv.data(), src, float(scale), k_pool, v_pool, dst, table, first, last, hq, hkv,
                                    bs, scores, flat, offs, qsplit, next, was_primed)) {
        primed = next.table != nullptr && kv_prefetch;
        continue;
      }
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
