// Shared by the CPU kernels: 32-byte float vectors (GCC/Clang vector extensions: AVX2 on x86, two
// NEON registers on ARM), their unaligned loads and stores, and exp(x) for x <= 0, 8 lanes at a
// time. Part of each kernel's build cache key (engine/fast/cpu_build.py).
#pragma once
#include <cstdint>
#include <cstring>

namespace {

constexpr int kBytes = 32;  // one vector
typedef float vfloat __attribute__((vector_size(kBytes)));
typedef int32_t vint __attribute__((vector_size(kBytes)));
constexpr int kFloats = kBytes / sizeof(float);

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor
// polynomial (relative error < 1e-8, under one ulp), times 2^n built in the exponent bits.
// Below -87 (a weight under 2^-125 of the largest) the result is 0.
inline vfloat exp_nonpositive(vfloat x) {
  const vint under = x < -87.0f;
  x = under ? vfloat{} - 87.0f : x;
  const vint n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint);  // round(x / ln2), x <= 0
  const vfloat nf = __builtin_convertvector(n, vfloat);
  const vfloat r = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;  // ln2 in two parts
  vfloat p = vfloat{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vint bits = (n + 127) << 23;  // 2^n, n in [-126, 0]
  vfloat two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return under ? vfloat{} : p * two_n;
}

}  // namespace
