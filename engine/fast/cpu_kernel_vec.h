// Shared by the CPU kernels: 32-byte float vectors (GCC/Clang vector extensions: AVX2 on x86, two
// NEON registers on ARM) and their unaligned loads and stores. Part of each kernel's build cache
// key (engine/fast/cpu_build.py).
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

}  // namespace
