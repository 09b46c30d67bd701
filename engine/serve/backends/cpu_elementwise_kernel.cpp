// The elementwise work between a decoder layer's matmuls, float32, one pass over memory each:
//   add_rms_norm   residual += hidden (in place), out = RMSNorm(residual) * weight;
//   qk_norm_rope   every q and k head of the merged qkv rows normalised (RMSNorm, its per-head
//                  weight) and rotated (RoPE, rotate-half form, the step's cos / sin rows); q goes
//                  to its own contiguous [N, Hq, Dh] buffer, k is rewritten in place in qkv;
//   silu_mul       out = SiLU(gate) * up for the merged [N, 2I] gate/up rows.
//
// Eager PyTorch runs each of these as 3-12 separate operations (a pass over memory and a few
// microseconds of dispatch each): ~25 per layer. With these kernels (and CPUBackend.write) a decode
// step of the bench's small model at 16 requests took ~2 ms less, of ~15 (`scripts/levers.py step
// --requests 16 --context 64 --variants cpu+fused,cpu+fused/torch-ew`). Same arithmetic as the PyTorch code in fused.py up to summation order: the sums of
// squares are float in a different order, SiLU's exponential is the polynomial of
// cpu_kernel_vec.h (under one ulp). Built and loaded like cpu_paged_kernel.cpp (cpu_attention.py:
// the host's C++ compiler, -O3 -march=native, ctypes); rows are shared by torch's OpenMP workers
// (`share`, cpu_kernel_share.h). Any row width works (the vector loops take whole vectors, a scalar
// loop the rest).
#include <cmath>
#include <cstdint>

#include "cpu_kernel_share.h"
#include "cpu_kernel_vec.h"

namespace {

inline float sum_of_squares(const float* x, int64_t d) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kFloats <= d; i += kFloats) {
    const vfloat v = load(x + i);
    acc += v * v;
  }
  float s = 0;
  for (int j = 0; j < kFloats; ++j) s += acc[j];
  for (; i < d; ++i) s += x[i] * x[i];
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
