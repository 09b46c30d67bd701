// The paged attention kernel's vectors (cpu_paged_kernel.cpp), at the widest width the build
// targets: 64 bytes (16 floats, 8 doubles: AVX-512) where the compiler was told the CPU has
// AVX-512 F (-march=native on such a CPU), else 32 bytes (AVX2, or two NEON registers). A build
// may force the width with -DATTN_VEC_BYTES=32 (engine/fast/cpu_attention.py's "avx2" decode
// variant, to measure one against the other on the same machine). Also: unaligned loads of a
// row's L values widened to float / double, a horizontal sum by halving, and exp(x) for x <= 0.
// Kept apart from cpu_kernel_vec.h (the elementwise kernels' 32-byte vectors). Part of each
// kernel's build cache key (engine/fast/cpu_build.py).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec_exp.h"

#ifndef ATTN_VEC_BYTES
#if defined(__AVX512F__)
#define ATTN_VEC_BYTES 64
#else
#define ATTN_VEC_BYTES 32
#endif
#endif

// bf16 dot products in one instruction (vdpbf16ps: 32 bf16 pairs into 16 float sums) where the
// build targets AVX512-BF16 at 64 bytes; -DATTN_NO_DPBF16 leaves them out.
#if ATTN_VEC_BYTES == 64 && defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(ATTN_NO_DPBF16)
#define ATTN_DPBF16 1
#include <immintrin.h>
#else
#define ATTN_DPBF16 0
#endif

namespace {

constexpr int kAttnBytes = ATTN_VEC_BYTES;

template <typename T, int B> struct Vec {
  typedef T type __attribute__((vector_size(B)));
};
typedef Vec<float, kAttnBytes>::type afloat;
typedef Vec<double, kAttnBytes>::type adouble;
typedef Vec<int32_t, kAttnBytes>::type aint;
typedef Vec<uint16_t, kAttnBytes / 2>::type ahalf;  // as many 16-bit values as afloat has lanes
typedef Vec<uint32_t, kAttnBytes>::type aword;

struct BF16 {
  uint16_t bits;
};

// The pools' element types to and from the arithmetic's: float for float32 and bfloat16 pools,
// double for float64 ones (VecOf: the vector of that arithmetic at this width).
template <typename W> struct VecOf;
template <> struct VecOf<float> { typedef afloat type; };
template <> struct VecOf<double> { typedef adouble type; };

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

inline afloat aload(const float* p) {
  afloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline adouble aload(const double* p) {
  adouble v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline afloat aload(const BF16* p) {  // bf16 is the top half of a float: widen by a 16-bit shift
  ahalf h;
  std::memcpy(&h, p, sizeof h);
  aword w = __builtin_convertvector(h, aword) << 16;
  afloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// The sum of a vector's lanes: add its halves until one pair is left (log2(lanes) vector adds,
// not one scalar add per lane).
template <typename T, int B>
inline T tree_sum(typename Vec<T, B>::type v) {
  if constexpr (B == 2 * static_cast<int>(sizeof(T))) {
    return v[0] + v[1];
  } else {
    typedef typename Vec<T, B / 2>::type H;
    H lo, hi;
    std::memcpy(&lo, &v, B / 2);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + B / 2, B / 2);
    return tree_sum<T, B / 2>(lo + hi);
  }
}
inline float hsum(afloat v) { return tree_sum<float, kAttnBytes>(v); }
inline double hsum(adouble v) { return tree_sum<double, kAttnBytes>(v); }

// exp(x) for x <= 0 on every lane (cpu_vec_exp.h).
inline afloat aexp_nonpositive(afloat x) { return exp_nonpositive_lanes<afloat, aint>(x); }

}  // namespace
