// exp(x) for x <= 0 on every lane of a GCC/Clang float vector F (I: the int32 vector of as many
// lanes), shared by the attention kernels (cpu_attn_vec.h) and the elementwise ones
// (cpu_kernel_wide.h) at whatever width they are built for. Part of each kernel's build cache key
// (engine/fast/cpu_build.py).
//
// x = n ln2 + r with |r| <= ln2 / 2; exp(r) by its degree-7 Taylor polynomial (relative error
// under 1e-8, below one float ulp), times 2^n written straight into the exponent bits. Below -87
// (a weight under 2^-125 of the largest) the result is 0, so 2^n never leaves the normal range.
#pragma once
#include <cstring>

template <typename F, typename I>
inline F exp_nonpositive_lanes(F x) {
  const I under = x < -87.0f;
  x = under ? F{} - 87.0f : x;
  const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);  // round(x / ln2), x <= 0
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693145751953125f - nf * 1.428606765330187045e-06f;  // ln2 in two parts
  F p = F{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const I bits = (n + 127) << 23;  // 2^n, n in [-126, 0]
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return under ? F{} : p * two_n;
}
