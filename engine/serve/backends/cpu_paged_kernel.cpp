// Paged decode attention for the CPU: each query row reads its request's K/V where they lie in
// the pool, through its block table, and nothing of the context is copied out first.
//
// Built at first use by engine/serve/cpu_attention.py (the host's C++ compiler, -O3
// -march=native) and called through ctypes; it depends on no header beyond the C++ standard
// library. One call serves rows [row_begin, row_end) of a decode group, so that the caller can
// split a step's rows over threads (ctypes releases the GIL for the call).
//
// For row r, kv head h and each of its `group` query heads, over the visible key positions p
// (window_start <= p <= q_pos[r]; key p sits at pool slot tables[r][p / bs] * bs + p % bs):
//   pass 1: s[p] = scale * dot(q, k_p), and the maximum m;
//   pass 2: w[p] = exp(s[p] - m), their sum l, and out = sum_p w[p] * v_p / l.
// The same arithmetic as the reference (a softmax, then a weighted sum), in float (double for
// double pools); bfloat16 pools are read as bfloat16 and widened in registers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct BF16 {
  uint16_t bits;
};

inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(BF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(double x, double* out) { *out = x; }
inline void narrow(float x, BF16* out) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) {
    out->bits = 0x7FC0;
    return;
  }
  u += 0x7FFF + ((u >> 16) & 1);
  out->bits = static_cast<uint16_t>(u >> 16);
}

template <typename T, typename W>
void decode_rows(const T* q, const T* k_pool, const T* v_pool, T* out, const int32_t* tables,
                 int64_t table_stride, const int64_t* q_pos, int64_t row_begin, int64_t row_end,
                 int64_t hq, int64_t hkv, int64_t d, int64_t bs, double scale, int64_t window) {
  const int64_t group = hq / hkv;
  std::vector<W> qv(group * d), acc(group * d), scores, maxes(group), sums(group);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t last = q_pos[r];
    const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
    const int64_t n = last - first + 1;
    scores.resize(static_cast<size_t>(n * group));
    const int32_t* table = tables + r * table_stride;
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + (r * hq + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) qv[g * d + i] = widen(src[i]);
        maxes[g] = -INFINITY;
      }
      // Pass 1: scores and their maxima; one K row serves every query head of the group.
      for (int64_t p = first; p <= last; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / bs]) * bs + p % bs;
        const T* krow = k_pool + (slot * hkv + h) * d;
        for (int64_t g = 0; g < group; ++g) {
          const W* qg = qv.data() + g * d;
          W dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * widen(krow[i]);
          const W s = dot * static_cast<W>(scale);
          scores[(p - first) * group + g] = s;
          if (s > maxes[g]) maxes[g] = s;
        }
      }
      // Pass 2: softmax weights and the weighted sum of V rows.
      std::fill(acc.begin(), acc.end(), W(0));
      std::fill(sums.begin(), sums.end(), W(0));
      for (int64_t p = first; p <= last; ++p) {
        const int64_t slot = static_cast<int64_t>(table[p / bs]) * bs + p % bs;
        const T* vrow = v_pool + (slot * hkv + h) * d;
        for (int64_t g = 0; g < group; ++g) {
          const W w = std::exp(scores[(p - first) * group + g] - maxes[g]);
          sums[g] += w;
          W* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * widen(vrow[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out + (r * hq + h * group + g) * d;
        const W inv = W(1) / sums[g];
        for (int64_t i = 0; i < d; ++i) narrow(acc[g * d + i] * inv, dst + i);
      }
    }
  }
}

}  // namespace

#define ENTRY(NAME, T, W)                                                                        \
  extern "C" void NAME(const void* q, const void* k, const void* v, void* out,                  \
                       const int32_t* tables, int64_t table_stride, const int64_t* q_pos,       \
                       int64_t row_begin, int64_t row_end, int64_t hq, int64_t hkv, int64_t d,  \
                       int64_t bs, double scale, int64_t window) {                             \
    decode_rows<T, W>(static_cast<const T*>(q), static_cast<const T*>(k),                       \
                      static_cast<const T*>(v), static_cast<T*>(out), tables, table_stride,     \
                      q_pos, row_begin, row_end, hq, hkv, d, bs, scale, window);                \
  }

ENTRY(paged_decode_float32, float, float)
ENTRY(paged_decode_bfloat16, BF16, float)
ENTRY(paged_decode_float64, double, double)
