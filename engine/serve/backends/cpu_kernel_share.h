// Shared by the CPU kernels (cpu_paged_kernel.cpp, cpu_linear_kernel.cpp): how the threads of
// one call split its work. Part of each kernel's build cache key (engine/serve/backends/cpu_attention.py).
//
// share(total, threads, run) calls run(begin, end) over chunks of [0, total) on `threads`
// threads: the caller and threads - 1 helpers kept alive by the library (one pool per library).
// Every thread claims chunks from one atomic counter until none are left, so a helper that
// wakes late (a busy machine) finds nothing to do rather than holding the step back. Helpers spin
// for a short while after a job (decode steps call the kernels every few hundred microseconds)
// and then sleep on a condition variable.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kChunksPerThread = 8;
constexpr auto kSpin = std::chrono::microseconds(300);

class Helpers {
 public:
  // Runs job(helper) on `count` helpers and job(-1) here; returns when every job has returned.
  void run(int count, const std::function<void()>& job) {
    grow(count);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      wanted_ = count;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job();
    std::unique_lock<std::mutex> lock(mutex_);
    wanted_ = 0;  // from now on no helper picks this job up
    job_ = nullptr;
    done_.wait(lock, [&] { return busy_ == 0; });  // helpers that did pick it up are finishing
  }

 private:
  void grow(int count) {
    while (static_cast<int>(threads_.size()) < count) {
      threads_.emplace_back([this] { loop(); });
      threads_.back().detach();  // lives as long as the process (the library is never unloaded)
    }
  }

  void loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
      }
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
      seen = generation_.load(std::memory_order_relaxed);
      if (wanted_ == 0 || job_ == nullptr) continue;  // that job is over already
      --wanted_;
      ++busy_;
      const std::function<void()>* job = job_;
      lock.unlock();
      (*job)();
      lock.lock();
      if (--busy_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> generation_{0};
  const std::function<void()>* job_ = nullptr;
  int wanted_ = 0, busy_ = 0;
};

Helpers& helpers() {
  static Helpers* pool = new Helpers();  // never destroyed: detached helpers may still use it at exit
  return *pool;
}

template <typename F>
void share(int64_t total, int64_t threads, F&& run) {
  if (threads <= 1 || total < 2) {
    run(0, total);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, (total + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
  std::atomic<int64_t> next{0};
  const std::function<void()> job = [&] {
    for (;;) {
      const int64_t begin = next.fetch_add(1, std::memory_order_relaxed) * chunk;
      if (begin >= total) return;
      run(begin, std::min(total, begin + chunk));
    }
  };
  static std::mutex one_call;  // one job at a time per library (callers are the engine's one thread)
  std::lock_guard<std::mutex> lock(one_call);
  helpers().run(static_cast<int>(threads - 1), job);
}

}  // namespace
