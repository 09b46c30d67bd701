// The elementwise work between a decoder layer's matmuls, float32, one pass over memory each:
//   add_rms_norm   residual += hidden (in place), out = RMSNorm(residual) * weight;
//   qk_norm_rope   every q and k head of the merged qkv rows normalised (RMSNorm, its per-head
//                  weight) and rotated (RoPE, rotate-half form, the step's cos / sin rows); q goes
//                  to its own contiguous [N, Hq, Dh] buffer, k is rewritten in place in qkv;
//   silu_mul       out = SiLU(gate) * up for the merged [N, 2I] gate/up rows.
//
// Eager PyTorch runs each of these as 3-12 separate operations (a pass over memory and a few
// microseconds of dispatch each): ~25 per layer. With these kernels (and CPUBackend.write) a decode
// step of the bench's small model at 16 requests took ~2 ms less, of ~15 (`course/bench/levers.py step
// --requests 16 --context 64 --variants cpu+fused,cpu+fused/torch-ew`). Same arithmetic as the PyTorch code in fused.py up to summation order: the sums of
// squares are float in a different order, SiLU's exponential is the polynomial of
// cpu_kernel_vec.h (under one ulp). Built and loaded like cpu_paged_kernel.cpp (cpu_attention.py:
// the host's C++ compiler, -O3 -march=native, ctypes); rows are shared by torch's OpenMP workers
// (`share`, cpu_kernel_share.h). Any row width works (the vector loops take whole vectors, a scalar
// loop the rest).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernel_share.h"
#include "cpu_kernel_vec.h"

namespace {

// bfloat16 <-> float32 (bfloat16 is a float32's high half), rounding to nearest even as PyTorch does.
typedef uint32_t vu32 __attribute__((vector_size(kBytes)));

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

inline vfloat load_bf16(const uint16_t* p) {
  vu32 u;
  for (int j = 0; j < kFloats; ++j) u[j] = static_cast<uint32_t>(p[j]) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline vu32 bf16_bits(vfloat v) {  // round-to-nearest-even to bfloat16, in the high half of each lane
  vu32 u;
  std::memcpy(&u, &v, sizeof u);
  const auto nan = (u & 0x7fffffffu) > 0x7f800000u;
  const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return nan ? ((u | 0x400000u) & 0xffff0000u) : rounded;
}

inline vfloat round_bf16(vfloat v) {
  const vu32 u = bf16_bits(v);
  vfloat r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

inline void store_bf16(uint16_t* p, vfloat v) {
  const vu32 u = bf16_bits(v);
  for (int j = 0; j < kFloats; ++j) p[j] = static_cast<uint16_t>(u[j] >> 16);
}

inline vfloat load_any(const float* p) { return load(p); }
inline vfloat load_any(const uint16_t* p) { return load_bf16(p); }
inline float value(float x) { return x; }
inline float value(uint16_t h) { return from_bf16(h); }

// The sum of x[i]^2 in float32, for float32 or bfloat16 rows.
template <typename T>
inline float sum_of_squares(const T* x, int64_t d) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kFloats <= d; i += kFloats) {
    const vfloat v = load_any(x + i);
    acc += v * v;
  }
  float s = 0;
  for (int j = 0; j < kFloats; ++j) s += acc[j];
  for (; i < d; ++i) s += value(x[i]) * value(x[i]);
  return s;
}

// out[i] = (x[i] * inv) * w[i]: the order F.rms_norm(x, ..., w) rounds in.
inline void scale_by(const float* x, float inv, const float* w, float* out, int64_t d) {
  int64_t i = 0;
  for (; i + kFloats <= d; i += kFloats) store(out + i, (load(x + i) * inv) * load(w + i));
  for (; i < d; ++i) out[i] = (x[i] * inv) * w[i];
}

}  // namespace

extern "C" void add_rms_norm_float32(const float* hidden, float* residual, const float* weight, float* out,
                                     int64_t n, int64_t d, double eps, int64_t add, int64_t threads) {
  share(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = residual + r * d;
      if (add) {
        const float* h = hidden + r * d;
        int64_t i = 0;
        for (; i + kFloats <= d; i += kFloats) store(res + i, load(h + i) + load(res + i));
        for (; i < d; ++i) res[i] = h[i] + res[i];
      }
      const float inv = 1.0f / std::sqrt(sum_of_squares(res, d) / static_cast<float>(d) + static_cast<float>(eps));
      scale_by(res, inv, weight, out + r * d, d);
    }
  });
}

extern "C" void qk_norm_rope_float32(float* qkv, int64_t ld, int64_t n, int64_t hq, int64_t hkv, int64_t dh,
                                     const float* weight, const float* cos, const float* sin, float* q_out,
                                     double eps, int64_t threads) {
  const int64_t half = dh / 2;
  share(n, threads, [&](int64_t begin, int64_t end) {
    float y[1024];  // one normalised head (dh <= 1024, checked by the caller)
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + r * dh;
      const float* s = sin + r * dh;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        float* x = qkv + r * ld + h * dh;
        const float inv =
            1.0f / std::sqrt(sum_of_squares(x, dh) / static_cast<float>(dh) + static_cast<float>(eps));
        for (int64_t i = 0; i < dh; ++i) y[i] = (x[i] * inv) * weight[h * dh + i];
        float* o = h < hq ? q_out + (r * hq + h) * dh : x;  // k: in place (y holds its inputs)
        // rotate-half RoPE: o = y * cos + [-y2, y1] * sin
        for (int64_t i = 0; i < half; ++i) o[i] = y[i] * c[i] + (-y[i + half]) * s[i];
        for (int64_t i = half; i < dh; ++i) o[i] = y[i] * c[i] + y[i - half] * s[i];
      }
    }
  });
}

extern "C" void silu_mul_float32(const float* gate_up, float* out, int64_t n, int64_t width, int64_t threads) {
  share(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up + r * 2 * width;
      const float* u = g + width;
      float* o = out + r * width;
      int64_t i = 0;
      for (; i + kFloats <= width; i += kFloats) {
        const vfloat x = load(g + i);
        const vfloat neg = x < 0 ? x : -x;  // -|x|
        const vfloat e = exp_nonpositive(neg);  // exp(-|x|)
        // silu(x) = x / (1 + exp(-x)): for x >= 0 directly, for x < 0 as x e / (1 + e)
        const vfloat silu = (x < 0 ? x * e : x) / (1.0f + e);
        store(o + i, silu * load(u + i));
      }
      for (; i < width; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

// ----- bfloat16: the same three seams on bfloat16 tensors, rounding where generate() rounds -------
// generate()'s bfloat16 model rounds every PyTorch op's result to bfloat16 (RMSNorm normalises in
// float32, rounds, then multiplies by its weight and rounds again; RoPE rounds each product and the
// sum; SiLU rounds, then the product with up). These kernels compute each value in float32 and
// round at exactly those points, round-to-nearest-even as PyTorch does, so their results equal the
// PyTorch ops' up to the float32 summation order of the norms and the exponential's last ulp.
namespace {

// out[i] = bf16(w[i] * bf16(x[i] * inv)): RMSNorm's two roundings.
inline void scale_by_bf16(const uint16_t* x, float inv, const uint16_t* w, uint16_t* out, int64_t d) {
  int64_t i = 0;
  for (; i + kFloats <= d; i += kFloats) store_bf16(out + i, load_bf16(w + i) * round_bf16(load_bf16(x + i) * inv));
  for (; i < d; ++i) out[i] = to_bf16(from_bf16(w[i]) * round_bf16(from_bf16(x[i]) * inv));
}

inline float inv_rms(float sum_sq, int64_t d, double eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(d) + static_cast<float>(eps));
}

}  // namespace

extern "C" void add_rms_norm_bfloat16(const uint16_t* hidden, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                                      int64_t n, int64_t d, double eps, int64_t add, int64_t threads) {
  share(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* res = residual + r * d;
      if (add) {  // residual = bf16(hidden + residual)
        const uint16_t* h = hidden + r * d;
        int64_t i = 0;
        for (; i + kFloats <= d; i += kFloats) store_bf16(res + i, load_bf16(h + i) + load_bf16(res + i));
        for (; i < d; ++i) res[i] = to_bf16(from_bf16(h[i]) + from_bf16(res[i]));
      }
      scale_by_bf16(res, inv_rms(sum_of_squares(res, d), d, eps), weight, out + r * d, d);
    }
  });
}

extern "C" void qk_norm_rope_bfloat16(uint16_t* qkv, int64_t ld, int64_t n, int64_t hq, int64_t hkv, int64_t dh,
                                      const uint16_t* weight, const uint16_t* cos, const uint16_t* sin,
                                      uint16_t* q_out, double eps, int64_t threads) {
  const int64_t half = dh / 2;
  share(n, threads, [&](int64_t begin, int64_t end) {
    uint16_t y[1024];  // one normalised head, bfloat16 (dh <= 1024, checked by the caller)
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* c = cos + r * dh;
      const uint16_t* s = sin + r * dh;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        uint16_t* x = qkv + r * ld + h * dh;
        scale_by_bf16(x, inv_rms(sum_of_squares(x, dh), dh, eps), weight + h * dh, y, dh);
        uint16_t* o = h < hq ? q_out + (r * hq + h) * dh : x;  // k: in place (y holds its inputs)
        // o = bf16(bf16(y * cos) + bf16([-y2, y1] * sin)), as apply_rope's three ops round
        for (int64_t i = 0; i < half; ++i)
          o[i] = to_bf16(round_bf16(from_bf16(y[i]) * from_bf16(c[i])) + round_bf16(-from_bf16(y[i + half]) * from_bf16(s[i])));
        for (int64_t i = half; i < dh; ++i)
          o[i] = to_bf16(round_bf16(from_bf16(y[i]) * from_bf16(c[i])) + round_bf16(from_bf16(y[i - half]) * from_bf16(s[i])));
      }
    }
  });
}

extern "C" void silu_mul_bfloat16(const uint16_t* gate_up, uint16_t* out, int64_t n, int64_t width, int64_t threads) {
  share(n, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = gate_up + r * 2 * width;
      const uint16_t* u = g + width;
      uint16_t* o = out + r * width;
      int64_t i = 0;
      for (; i + kFloats <= width; i += kFloats) {  // o = bf16(bf16(silu(g)) * u)
        const vfloat x = load_bf16(g + i);
        const vfloat neg = x < 0 ? x : -x;
        const vfloat e = exp_nonpositive(neg);
        const vfloat silu = (x < 0 ? x * e : x) / (1.0f + e);
        store_bf16(o + i, round_bf16(silu) * load_bf16(u + i));
      }
      for (; i < width; ++i) {
        const float x = from_bf16(g[i]);
        o[i] = to_bf16(round_bf16(x / (1.0f + std::exp(-x))) * from_bf16(u[i]));
      }
    }
  });
}
