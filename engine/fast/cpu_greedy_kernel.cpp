// Greedy token selection over logits rows in one pass: each row's argmax (the first index on a
// tie, as torch.argmax and max(dim=-1).indices give it; a row holding NaN answers its first NaN,
// as torch's max does), for float32 or bfloat16 rows. A bfloat16 value widens to float32 exactly,
// so the argmax of bfloat16 rows equals the argmax of their float32 widening, ties included.
// Vectors of cpu_kernel_wide.h: 16 floats where the target has AVX-512F, else 8. Rows are shared
// by torch's OpenMP workers (cpu_kernel_share.h). Built and loaded like the other CPU kernels.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel_share.h"
#include "cpu_kernel_wide.h"

namespace {

#if defined(__AVX512F__)
using W = Wide<64>;
#else
using W = Wide<32>;
#endif


// Row x[0..v) -> its argmax.
template <typename T>
int64_t argmax_row(const T* x, int64_t v) {
  W::F best;
  W::I at;  // per lane: the first index at which that lane saw its maximum
  W::I nan{};  // per lane: saw a NaN
  for (int j = 0; j < W::N; ++j) {
    best[j] = -INFINITY;
    at[j] = -1;
  }
  W::I lane;
  for (int j = 0; j < W::N; ++j) lane[j] = j;
  int64_t i = 0;
  for (; i + W::N <= v && i + W::N <= INT32_MAX; i += W::N) {
    const W::F f = W::load(x + i);
    const W::I more = f > best;  // strictly: an equal value later keeps the earlier index
    best = more ? f : best;
    at = more ? lane + static_cast<int32_t>(i) : at;
    nan |= f != f;
  }
  float top = -INFINITY;
  int64_t arg = -1;
  bool any_nan = false;
  for (int j = 0; j < W::N; ++j) {
    any_nan |= nan[j] != 0;
    if (at[j] >= 0 && (best[j] > top || (best[j] == top && at[j] < arg))) {
      top = best[j];
      arg = at[j];
    }
  }
  for (int64_t k = i; k < v; ++k) {  // the tail, in order
    const float f = value(x[k]);
    if (f != f) any_nan = true;
    if (f > top) {
      top = f;
      arg = k;
    }
  }
  if (any_nan) {  // the first NaN, as torch's max reports it
    for (int64_t k = 0; k < v; ++k)
      if (value(x[k]) != value(x[k])) return k;
  }
  return arg < 0 ? 0 : arg;  // every value -inf: index 0
}

template <typename T>
void argmax_rows(const T* x, int64_t m, int64_t v, int64_t* out, int64_t threads) {
  share(m, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * v, v);
  });
}

}  // namespace

extern "C" void argmax_rows_float32(const float* x, int64_t m, int64_t v, int64_t* out, int64_t threads) {
  argmax_rows(x, m, v, out, threads);
}

extern "C" void argmax_rows_bfloat16(const uint16_t* x, int64_t m, int64_t v, int64_t* out, int64_t threads) {
  argmax_rows(x, m, v, out, threads);
}

