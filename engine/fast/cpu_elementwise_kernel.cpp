// The elementwise work between a decoder layer's matmuls, float32 or bfloat16, one pass over memory each:
//   add_rms_norm   residual += hidden (in place), out = RMSNorm(residual) * weight;
//   qk_norm_rope   every q and k head of the merged qkv rows normalised (RMSNorm, its per-head
//                  weight) and rotated (RoPE, rotate-half form, the step's cos / sin rows); q goes
//                  to its own contiguous [N, Hq, Dh] buffer, k is rewritten in place in qkv;
//   silu_mul       out = SiLU(gate) * up for the merged [N, 2I] gate/up rows.
//
// Eager PyTorch runs each of these as 3-12 separate operations (a pass over memory and a few
// microseconds of dispatch each): ~25 per layer. Same arithmetic as the PyTorch code in fused.py up
// to summation order: the sums of squares are float in a different order, SiLU's exponential is
// the polynomial of cpu_kernel_wide.h (under one ulp).
//
// Every kernel is one template instantiated twice (cpu_kernel_wide.h): 8-float vectors (symbols
// ending in _avx2: AVX2 on x86, NEON on ARM) and, where the compile target has AVX-512F, 16-float
// vectors (_avx512, with AVX512-BF16's conversion instruction where present). Both compute the
// same IEEE operations on each element; only the order of a norm's sum of squares differs.
// cpu_elementwise.py picks one (the widest here, or ENGINE_KERNEL_ISA). Built and loaded like
// cpu_paged_kernel.cpp (cpu_build.py: the host's C++ compiler, -O3 -march=native, ctypes); rows
// are shared by torch's OpenMP workers (`share`, cpu_kernel_share.h). Any row width works (the
// vector loops take whole vectors, a scalar loop the rest).
//
// bfloat16: generate()'s bfloat16 model rounds every PyTorch op's result to bfloat16 (RMSNorm
// normalises in float32, rounds, then multiplies by its weight and rounds again; RoPE rounds each
// product and the sum; SiLU rounds, then the product with up). These kernels compute each value in
// float32 and round at exactly those points (the same template: rounding is the identity for
// float32), round-to-nearest-even as PyTorch does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel_share.h"
#include "cpu_kernel_wide.h"

namespace {

// ----- scalar tails: float32 or bfloat16 elements, and rounding to the element type ----------------

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) { *p = to_bf16(x); }

// x rounded to the element type T (the identity for float32).
template <typename T>
inline float rnd(float x) {
  if constexpr (sizeof(T) == 2) return value(to_bf16(x));
  return x;
}
template <typename T, class W>
inline typename W::F rnd(typename W::F v) {
  if constexpr (sizeof(T) == 2) return W::round_bf16(v);
  return v;
}

// ----- the kernels, for element type T and vector width W ------------------------------------------

// out[i] = R(R(x[i] * inv) * w[i]): RMSNorm's roundings (for float32 the order F.rms_norm(x, ..., w)
// computes in; for bfloat16 the model's module: normalised, rounded, times the weight, rounded).
template <typename T, class W>
inline void scale_by(const T* x, float inv, const T* w, T* out, int64_t d) {
  int64_t i = 0;
  for (; i + W::N <= d; i += W::N)
    W::store(out + i, rnd<T, W>(W::load(x + i) * inv) * W::load(w + i));  // the store rounds
  for (; i < d; ++i) put(out + i, rnd<T>(value(x[i]) * inv) * value(w[i]));
}

template <typename T, class W>
inline float sum_of_squares(const T* x, int64_t d) {
  typename W::F acc{};
  int64_t i = 0;
  for (; i + W::N <= d; i += W::N) {
    const auto v = W::load(x + i);
    acc += v * v;
  }
  float s = W::sum(acc);
  for (; i < d; ++i) s += value(x[i]) * value(x[i]);
  return s;
}

inline float inv_rms(float sum_sq, int64_t d, double eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(d) + static_cast<float>(eps));
}

template <typename T, class W>
void add_rms_norm(const T* hidden, T* residual, const T* weight, T* out, int64_t n, int64_t d, double eps,
                  int64_t add, int64_t threads) {
  share(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * d;
      float ss;
      if (add) {  // residual = R(hidden + residual), its squares summed in the same pass
        const T* h = hidden + r * d;
        typename W::F acc{};
        int64_t i = 0;
        for (; i + W::N <= d; i += W::N) {
          const auto v = rnd<T, W>(W::load(h + i) + W::load(res + i));
          W::store_exact(res + i, v);
          acc += v * v;
        }
        ss = W::sum(acc);
        for (; i < d; ++i) {
          const float v = rnd<T>(value(h[i]) + value(res[i]));
          put(res + i, v);
          ss += v * v;
        }
      } else {
        ss = sum_of_squares<T, W>(res, d);
      }
      scale_by<T, W>(res, inv_rms(ss, d, eps), weight, out + r * d, d);
    }
  });
}

// Each row's heads go kHeadGroup at a time: first every head's sum of squares and 1 / rms (chains
// that do not wait on each other), then each head normed and rotated in one pass over its two
// halves. One head at a time, each head's rotation waited on its own sum (a reduction, a square
// root, a division); the bfloat16 kernel ran ~1.3-1.8x slower so (issue 40's AMX Xeon; the float32
// one gained nothing from the groups). bfloat16 cos / sin rows are widened to float once per row,
// not once per head.
template <typename T>
constexpr int64_t kHeadGroup = sizeof(T) == 2 ? 4 : 1;

template <typename T, class W>
void qk_norm_rope(T* qkv, int64_t ld, int64_t n, int64_t hq, int64_t hkv, int64_t dh, const T* weight,
                  const T* cos, const T* sin, T* q_out, double eps, int64_t threads) {
  const int64_t half = dh / 2, heads = hq + hkv;
  constexpr bool widen = sizeof(T) == 2;
  share(n, threads, [&](int64_t begin, int64_t end) {
    float cf[1024], sf[1024];  // bfloat16: the row's cos and sin as floats (dh <= 1024, checked by the caller)
    float inv[kHeadGroup<T>];
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * dh;
      const T* s = sin + r * dh;
      if constexpr (widen) {
        int64_t i = 0;
        for (; i + W::N <= dh; i += W::N) {
          W::store(cf + i, W::load(c + i));
          W::store(sf + i, W::load(s + i));
        }
        for (; i < dh; ++i) cf[i] = value(c[i]), sf[i] = value(s[i]);
      }
      const float* const cr = [&] { if constexpr (widen) return cf; else return c; }();  // the row's cos, float
      const float* const sr = [&] { if constexpr (widen) return sf; else return s; }();
      for (int64_t h0 = 0; h0 < heads; h0 += kHeadGroup<T>) {
        const int64_t h1 = std::min(heads, h0 + kHeadGroup<T>);
        for (int64_t h = h0; h < h1; ++h) inv[h - h0] = inv_rms(sum_of_squares<T, W>(qkv + r * ld + h * dh, dh), dh, eps);
        for (int64_t h = h0; h < h1; ++h) {
          T* x = qkv + r * ld + h * dh;
          const T* w = weight + h * dh;
          const float a = inv[h - h0];
          T* o = h < hq ? q_out + (r * hq + h) * dh : x;  // k: in place (both halves read before either is written)
          // y = R(R(x * inv) * w), then rotate-half RoPE, o = R(R(y * cos) + R([-y2, y1] * sin)): both halves at once
          int64_t i = 0;
          for (; i + W::N <= half; i += W::N) {
            const auto y1 = rnd<T, W>(rnd<T, W>(W::load(x + i) * a) * W::load(w + i));
            const auto y2 = rnd<T, W>(rnd<T, W>(W::load(x + i + half) * a) * W::load(w + i + half));
            W::store(o + i, rnd<T, W>(y1 * W::load(cr + i)) - rnd<T, W>(y2 * W::load(sr + i)));  // the store rounds
            W::store(o + i + half, rnd<T, W>(y2 * W::load(cr + i + half)) + rnd<T, W>(y1 * W::load(sr + i + half)));
          }
          for (; i < half; ++i) {
            const float y1 = rnd<T>(rnd<T>(value(x[i]) * a) * value(w[i]));
            const float y2 = rnd<T>(rnd<T>(value(x[i + half]) * a) * value(w[i + half]));
            put(o + i, rnd<T>(y1 * cr[i]) - rnd<T>(y2 * sr[i]));
            put(o + i + half, rnd<T>(y2 * cr[i + half]) + rnd<T>(y1 * sr[i + half]));
          }
        }
      }
    }
  });
}

template <typename T, class W>
void silu_mul(const T* gate_up, T* out, int64_t n, int64_t width, int64_t threads) {
  share(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * width;
      const T* u = g + width;
      T* o = out + r * width;
      int64_t i = 0;
      for (; i + W::N <= width; i += W::N)  // o = R(R(silu(g)) * u)
        W::store(o + i, rnd<T, W>(W::silu(W::load(g + i))) * W::load(u + i));  // the store rounds the product
      for (; i < width; ++i) {
        const float x = value(g[i]);
        put(o + i, rnd<T>(x / (1.0f + std::exp(-x))) * value(u[i]));
      }
    }
  });
}

}  // namespace

// ----- the C entry points: <kernel>_<dtype>_<isa> -------------------------------------------------
#define ELEMENTWISE_ENTRY_POINTS(T, DTYPE, W, ISA)                                                              \
  extern "C" void add_rms_norm_##DTYPE##_##ISA(const T* hidden, T* residual, const T* weight, T* out,          \
                                               int64_t n, int64_t d, double eps, int64_t add, int64_t threads) { \
    add_rms_norm<T, W>(hidden, residual, weight, out, n, d, eps, add, threads);                                  \
  }                                                                                                              \
  extern "C" void qk_norm_rope_##DTYPE##_##ISA(T* qkv, int64_t ld, int64_t n, int64_t hq, int64_t hkv,         \
                                               int64_t dh, const T* weight, const T* cos, const T* sin,          \
                                               T* q_out, double eps, int64_t threads) {                          \
    qk_norm_rope<T, W>(qkv, ld, n, hq, hkv, dh, weight, cos, sin, q_out, eps, threads);                          \
  }                                                                                                              \
  extern "C" void silu_mul_##DTYPE##_##ISA(const T* gate_up, T* out, int64_t n, int64_t width,                 \
                                           int64_t threads) {                                                    \
    silu_mul<T, W>(gate_up, out, n, width, threads);                                                             \
  }

ELEMENTWISE_ENTRY_POINTS(float, float32, Wide<32>, avx2)
ELEMENTWISE_ENTRY_POINTS(uint16_t, bfloat16, Wide<32>, avx2)
#if defined(__AVX512F__)
ELEMENTWISE_ENTRY_POINTS(float, float32, Wide<64>, avx512)
ELEMENTWISE_ENTRY_POINTS(uint16_t, bfloat16, Wide<64>, avx512)
#endif

// Which widths this build has (cpu_kernel_wide.h's kBuiltWidths).
extern "C" const char* elementwise_isas() { return kBuiltWidths; }
