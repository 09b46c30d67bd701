// Width-generic float vectors for the CPU kernels that come in two widths: Wide<32> (8 floats:
// AVX2 on x86, two NEON registers on ARM) and Wide<64> (16 floats: one AVX-512 register, used
// only where the compile target has AVX-512F). GCC/Clang vector extensions carry the arithmetic,
// so both widths compute the same operations lane by lane; only the number of lanes, and so the
// order of a sum's partial sums, differs. GCC contracts a * b + c into one fused multiply-add in
// C++ (one rounding, where PyTorch's eager ops may round twice) at either width: building with
// -ffp-contract=off gave the same test results and ~15% slower kernels (issue 40's AMX Xeon), so
// the contraction stays. Part of each kernel's build cache key.
//
// bfloat16 <-> float32: widening is exact (a bfloat16 is a float32's high half); narrowing rounds
// to nearest even as PyTorch does, NaN staying a quiet NaN. On an AVX512-BF16 target Wide<64>
// narrows (stores) with VCVTNEPS2BF16, which rounds the same way but flushes subnormal inputs to
// zero; PyTorch keeps them, so a vector holding one (|x| < 2^-126, not 0) takes the integer path.
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu_vec_exp.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the AVX2 and AVX-512 widening loads and narrowing stores below
#endif

namespace {

// The widths a kernel library built with this header has, as its `*_isas()` entry reports them:
// "avx2,avx512" where the target has AVX-512F (the only targets its 16-float code is built for),
// else "avx2".
#if defined(__AVX512F__)
constexpr const char* kBuiltWidths = "avx2,avx512";
#else
constexpr const char* kBuiltWidths = "avx2";
#endif

// A float32 or bfloat16 element as a float (bfloat16: its bits are a float's upper half).
inline float value(float x) { return x; }
inline float value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The vector types of a width: float / int32 / uint32 lanes, and as many bfloat16 bit patterns.
template <int Bytes>
struct WideTypes {
  typedef float F __attribute__((vector_size(Bytes)));
  typedef int32_t I __attribute__((vector_size(Bytes)));
  typedef uint32_t U __attribute__((vector_size(Bytes)));
  typedef uint16_t H __attribute__((vector_size(Bytes / 2)));
};

template <int Bytes>
struct Wide {
  static constexpr int N = Bytes / 4;  // lanes
  using F = typename WideTypes<Bytes>::F;
  using I = typename WideTypes<Bytes>::I;
  using U = typename WideTypes<Bytes>::U;
  using H = typename WideTypes<Bytes>::H;

  static F load(const float* p) {
    F v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, F v) { std::memcpy(p, &v, sizeof v); }

  static F load(const uint16_t* p) {  // N bfloat16 -> float32, exact
#if defined(__AVX512F__)
    if constexpr (Bytes == 64)
      return (F)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#endif
#if defined(__AVX2__)
    if constexpr (Bytes == 32)
      return (F)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#endif
    H h;
    std::memcpy(&h, p, sizeof h);
    return (F)(__builtin_convertvector(h, U) << 16);
  }

  // Round-to-nearest-even to bfloat16, as the bit pattern in each lane's high half (integer path).
  static U bf16_bits(F v) {
    const U u = (U)v;
    const I nan = v != v;
    const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return nan ? ((u | 0x400000u) & 0xffff0000u) : rounded;
  }

#if defined(__AVX512BF16__)
  // VCVTNEPS2BF16 (AVX512-BF16), unless a lane is subnormal (that instruction flushes it to zero).
  static bool narrow_natively(F v, __m256i& out) {
    if constexpr (Bytes == 64) {
      if (_mm512_fpclass_ps_mask((__m512)v, 0x20)) return false;  // 0x20: subnormal
      out = (__m256i)_mm512_cvtneps_pbh((__m512)v);
      return true;
    }
    return false;
  }
#endif

  static H narrow(F v) {  // N float32 -> N bfloat16, rounded to nearest even
#if defined(__AVX512BF16__)
    if constexpr (Bytes == 64) {
      __m256i h;
      if (narrow_natively(v, h)) return (H)h;
    }
#endif
#if defined(__AVX512F__)
    if constexpr (Bytes == 64) return (H)_mm512_cvtepi32_epi16((__m512i)(bf16_bits(v) >> 16));
#endif
#if defined(__AVX2__)
    if constexpr (Bytes == 32) {
      const __m256i s = (__m256i)(bf16_bits(v) >> 16);  // each lane <= 0xffff: packing saturates nothing
      return (H)_mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    }
#endif
    return __builtin_convertvector(bf16_bits(v) >> 16, H);
  }

  static void store(uint16_t* p, F v) {
    const H h = narrow(v);
    std::memcpy(p, &h, sizeof h);
  }

  // Store values that are bfloat16 already (round_bf16's results): their high halves, no rounding.
  static void store_exact(uint16_t* p, F v) {
#if defined(__AVX512BW__)
    if constexpr (Bytes == 64) {
      const __m512i odd = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31, 29, 27, 25, 23, 21,
                                           19, 17, 15, 13, 11, 9, 7, 5, 3, 1);  // each lane's high half
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                          _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, (__m512i)v)));
      return;
    }
#endif
    const H h = __builtin_convertvector((U)v >> 16, H);
    std::memcpy(p, &h, sizeof h);
  }
  static void store_exact(float* p, F v) { store(p, v); }

  // v rounded to the nearest bfloat16 (ties to even), as a float32: the integer form, which here
  // costs fewer instructions than a conversion and back. It skips bf16_bits' NaN test: the kernels
  // round only results of float32 arithmetic on bfloat16 values, and every NaN those yield has its
  // low 16 bits zero (the CPU's default NaN, or an input's payload, quieted), so adding at most
  // 0x8000 never carries into the high half: a NaN stays that quiet NaN, as PyTorch's rounding keeps it.
  static F round_bf16(F v) {
    const U u = (U)v;
    return (F)((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  }

  // The lanes' sum as a tree: the upper half of the lanes added onto the lower half (lane j + N/2
  // onto lane j) until one lane is left: log2(N) adds of ever narrower vectors, not a chain of N
  // scalar ones (which held a q/k head's norm back: issue 40's qk_norm_rope, ~1.3-1.8x in bfloat16).
  static float sum(F v) {
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector: the halves as register extracts
    const auto sum8 = [](auto v8) {  // 8 lanes: 4, 2, then 1
      const auto v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
      const auto v2 = __builtin_shufflevector(v4, v4, 0, 1) + __builtin_shufflevector(v4, v4, 2, 3);
      return v2[0] + v2[1];
    };
    if constexpr (N == 16)
      return sum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
    else if constexpr (N == 8)
      return sum8(v);
#endif
    for (int half = N / 2; half >= 1; half /= 2)  // the same tree through memory (an older compiler)
      for (int j = 0; j < half; ++j) v[j] += v[j + half];
    return v[0];
  }

  // exp(x) for x <= 0 on every lane (cpu_vec_exp.h).
  static F exp_nonpositive(F x) { return exp_nonpositive_lanes<F, I>(x); }

  // silu(x) = x / (1 + exp(-x)): for x >= 0 directly, for x < 0 as x e / (1 + e), e = exp(-|x|).
  static F silu(F x) {
    const I negative = x < 0;
    const F neg = negative ? x : -x;
    const F e = exp_nonpositive(neg);
    return (negative ? x * e : x) / (1.0f + e);
  }
};

}  // namespace
