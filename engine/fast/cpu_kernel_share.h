// Shared by the CPU kernels (cpu_paged_kernel.cpp, cpu_linear_kernel.cpp, cpu_elementwise_kernel.cpp):
// how the threads of one call split its work. Part of each kernel's build cache key
// (engine/fast/cpu_build.py).
//
// share(total, threads, run) calls run(begin, end) over chunks of [0, total) through OpenMP. The
// library is linked against the OpenMP runtime torch itself loaded (libgomp.so.1: the loader binds
// the kernel's libgomp.so.1 to the copy already in the process; engine/fast/openmp.py checks it), so
// these are torch's own worker threads: the ones that, between torch's ops, are still spinning for
// the next parallel region pick the chunks up at once. (A pool of our own competed with those
// spinning workers for the same cores: on two threads the kernels ran no faster than on one.)
//
// `threads` (at least 2 to share at all) sets how finely the work is cut, about kChunksPerThread
// chunks per thread; the team is torch's whole thread count (omp_get_max_threads(): what
// torch.set_num_threads set), never a smaller one. libgomp keeps one pool of workers per calling
// thread and ends the workers a smaller team leaves out, so a kernel asking for fewer threads than
// torch's ops would make the next op of torch's start its threads again (an experiment alternating
// teams of 4 and 2 saw a new thread id on every large team). Chunks are handed out dynamically, so a
// thread that starts late finds less left rather than holding the call back, and a team larger
// than the work's chunks leaves its extra threads nothing to do.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kChunksPerThread = 8;

// The team a share() of `threads` runs on: torch's thread count (at least `threads`).
inline int share_team(int64_t threads) {
#ifdef _OPENMP
  return static_cast<int>(std::max<int64_t>(threads, omp_get_max_threads()));
#else
  return 1;  // built without OpenMP: one thread does every chunk
#endif
}

// The chunk size share() cuts `total` items into for `threads`: about kChunksPerThread a thread.
inline int64_t share_chunk(int64_t total, int64_t threads) {
  return std::max<int64_t>(1, (total + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
}

template <typename F>
void share(int64_t total, int64_t threads, F&& run) {
  if (threads <= 1 || total < 2) {
    run(0, total);
    return;
  }
  const int64_t chunk = share_chunk(total, threads);
  const int64_t chunks = (total + chunk - 1) / chunk;
#pragma omp parallel for num_threads(share_team(threads)) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    run(c * chunk, std::min(total, (c + 1) * chunk));
  }
}

// The runs of one parallel region, each handed out once: thread t's own run (run t) first, then
// any run not yet taken. A call of the same shape so gives each thread the same run every time, the
// part of a weight it read the call before (a run taken by whichever thread asked first went to
// either core, call by call: the AMX [512, 512] linear at 40 rows on two threads, weight in cache,
// 15.9 us a call; each thread its own run, 13.5); a thread that starts late still finds its run done
// by another rather than holding the call back. Runs past kOwnRuns are handed out in order.
constexpr int64_t kOwnRuns = 256;

class OwnRuns {
 public:
  explicit OwnRuns(int64_t runs) : runs_(runs) {
    for (int64_t r = 0; r < std::min(runs, kOwnRuns); ++r) taken_[r].store(false, std::memory_order_relaxed);
  }
  // The next run for thread `me` (its `tries`-th ask; start at 0), or -1 when none is left.
  int64_t next(int64_t me, int64_t& tries) {
    const int64_t own = std::min(runs_, kOwnRuns);
    for (; tries < own; ++tries) {
      const int64_t r = (me + tries) % own;
      if (!taken_[r].exchange(true, std::memory_order_relaxed)) {
        ++tries;
        return r;
      }
    }
    const int64_t r = own + rest_.fetch_add(1, std::memory_order_relaxed);
    return r < runs_ ? r : -1;
  }

 private:
  int64_t runs_;
  std::atomic<bool> taken_[kOwnRuns];
  std::atomic<int64_t> rest_{0};
};

inline int64_t thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// share() preceded by a first phase every chunk of the second needs done, and with a scope per
// thread: prep(begin, end) over [0, prep_total) shared as share() does, then (all of it done) each
// thread of the team calls per_thread(next) once, where next(begin, end) hands it the next chunk of
// [0, total) (false when none is left): one run of neighbours per thread, its own first (`OwnRuns`:
// a weight's columns read front to back by each core, the same columns every call; the AMX linear's
// small calls on two threads 1.41-1.47x -> 1.66-1.75x one thread, against ~8 chunks per thread). One
// team for both phases (one fork and join, a barrier between), so a call's preparation (the AMX
// linear packing its input rows into tiles) is not left to one thread, and what a thread sets up
// for its chunks (the AMX tile configuration, a write-out pipeline) is set up once per thread, not
// once per chunk.
template <typename Prep, typename F>
void share_after(int64_t prep_total, Prep&& prep, int64_t total, int64_t threads, F&& per_thread) {
  if (threads <= 1 || total < 2) {
    prep(0, prep_total);
    bool given = false;
    per_thread([&](int64_t& begin, int64_t& end) {
      if (given || total <= 0) return false;
      given = true, begin = 0, end = total;
      return true;
    });
    return;
  }
  const int64_t prep_chunk = share_chunk(prep_total, threads), chunk = (total + threads - 1) / threads;
  const int64_t prep_chunks = (prep_total + prep_chunk - 1) / prep_chunk, chunks = (total + chunk - 1) / chunk;
  OwnRuns handout(chunks);
#pragma omp parallel num_threads(share_team(threads))
  {
    if (prep_chunks > 0) {  // (every thread of the team takes this branch or none does)
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < prep_chunks; ++c) prep(c * prep_chunk, std::min(prep_total, (c + 1) * prep_chunk));
      // the loop's implicit barrier: every chunk prepared before any runs (nothing to prepare: no barrier)
    }
    const int64_t me = thread_index();
    int64_t tries = 0;
    per_thread([&](int64_t& begin, int64_t& end) {
      const int64_t c = handout.next(me, tries);
      if (c < 0) return false;
      begin = c * chunk, end = std::min(total, (c + 1) * chunk);
      return true;
    });
  }
}

// run(begin, end) over [0, total) in as many contiguous runs as threads (at most), each thread its
// own run first (`OwnRuns`). For work where each item prefetches the next (the small-batch linear's
// panels): within its run the next is read by the same thread. (Cut finer, as share() does, the next
// is often another core's and its prefetch wasted: two threads ran the float32 [512, 512] linear at
// 16 rows 1.13x one thread; in one run each, 1.84x; two runs each, 1.72x.)
template <typename F>
void share_runs(int64_t total, int64_t threads, F&& run) {
  share_after(0, [](int64_t, int64_t) {}, total, threads, [&](auto&& next) {
    for (int64_t begin, end; next(begin, end);) run(begin, end);
  });
}

}  // namespace

// What the kernels' OpenMP runtime says, for engine/fast/openmp.py (one runtime, one thread count).
// share_max_threads: the runtime's thread count as this kernel sees it (torch.set_num_threads sets it
// in torch's runtime: a kernel bound to another runtime would not follow). share_team_size: the
// threads a share() of `threads` really runs on. share_runtime_address: where this kernel's
// omp_get_max_threads lives (dladdr names the library). Each is 1 / 0 in a build without OpenMP.
extern "C" int64_t share_max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

extern "C" int64_t share_team_size(int64_t threads) {
  int64_t seen = 1;
  share(threads, threads, [&](int64_t, int64_t) {
#ifdef _OPENMP
#pragma omp critical(share_team_size)
    seen = std::max<int64_t>(seen, omp_get_num_threads());
#endif
  });
  return seen;
}

extern "C" const void* share_runtime_address() {
#ifdef _OPENMP
  return reinterpret_cast<const void*>(&omp_get_max_threads);
#else
  return nullptr;
#endif
}
