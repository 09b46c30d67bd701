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
// Speed: the inner loops run on the widest vectors the build targets (cpu_attn_vec.h: 64 bytes,
// 16 floats or 8 doubles, with AVX-512; else 32 bytes, AVX2 or two NEON registers) when the head
// size is a multiple of the lanes; a bfloat16 pool's scores are vdpbf16ps dot products of q's and
// k's own bf16 bits where the CPU has AVX512-BF16 (the products exact, summed in float, then
// scaled). K rows are walked block by block (one table lookup per block, not per key, and the
// next block's slots prefetched during the walk: 4 layers' decode attention at R = 256, one
// thread, ~10% faster, `course/tuning/levers.py attention`); a score's lanes are summed by
// halving; the exponentials of a row's scores are computed a vector at a time by a polynomial
// (within 2 ulp of std::exp) and the accumulators of the weighted sum stay in registers for head
// sizes up to 128. Other head sizes take the same loops one lane at a time. Prefill requests may
// instead be served as matrix products (engine/fast/cpu_prefill.py).
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <type_traits>

#include "cpu_attn_vec.h"
#include "cpu_kernel_share.h"

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

WRITE_ENTRY(write_kv_float32, float, float)
WRITE_ENTRY(write_kv_bfloat16, float, BF16)
WRITE_ENTRY(write_kv_float64, double, double)
