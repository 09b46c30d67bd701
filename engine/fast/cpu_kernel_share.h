// Shared by the CPU kernels (cpu_paged_kernel.cpp, cpu_linear_kernel.cpp): how the threads of
// one call split its work. Part of each kernel's build cache key (engine/fast/cpu_attention.py).
//
// share(total, threads, run) calls run(begin, end) over chunks of [0, total) on `threads`
// threads through OpenMP. The library is linked against the OpenMP runtime torch itself loaded
// (libgomp.so.1), so these are torch's own worker threads: the ones that, between torch's ops,
// are still spinning for the next parallel region pick the chunks up at once. (A pool of our own
// competed with those spinning workers for the same cores: on two threads the kernels ran no
// faster than on one.) Chunks are handed out dynamically, several per thread, so a thread that
// starts late finds less left rather than holding the call back.
#pragma once
#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kChunksPerThread = 8;

template <typename F>
void share(int64_t total, int64_t threads, F&& run) {
  if (threads <= 1 || total < 2) {
    run(0, total);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, (total + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
  const int64_t chunks = (total + chunk - 1) / chunk;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    run(c * chunk, std::min(total, (c + 1) * chunk));
  }
}

}  // namespace
