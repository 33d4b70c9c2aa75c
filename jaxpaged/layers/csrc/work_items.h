// Work items spread over XLA:CPU's intra-op thread pool, the calling thread working too.
//
// Every kernel of this library splits its output into independent items (a chunk of output
// features, a query block's KV head) and runs them through run_items: the pool's tasks and the
// caller take items from one atomic counter until none is left, and the caller returns once
// all are done. A task that starts after the work is done finds nothing left and drops its
// reference to the shared counters.
//
// A decode step at one row calls the packed matmul many times for a short while each, and a
// pool task woken for each call started too late to take many items (docs/measurements.md,
// "Packed matmul kernel"). So a helper lingers: having drained a call's items it polls for
// the next call's work for up to kLingerMicros before it goes back to the pool, and a call
// that finds a helper lingering hands it the work instead of scheduling a task.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged_cpu {

// How long a helper polls for more work after finishing some.
constexpr int64_t kLingerMicros = 300;

// The latest call's drain function, for lingering helpers (one slot: a call made while
// another runs on a second thread may go unseen, and its caller then works alone).
class LingeringHelpers {
 public:
  static LingeringHelpers& get() {
    static LingeringHelpers helpers;
    return helpers;
  }

  // Offers `task` to a lingering helper; false when none is lingering (schedule one).
  bool offer(const std::shared_ptr<std::function<void()>>& task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = task;
    }
    seq_.fetch_add(1, std::memory_order_release);
    return idle_.load(std::memory_order_acquire) > 0;
  }

  // A pool task: runs `first`, then whatever is offered while it lingers.
  void serve(std::shared_ptr<std::function<void()>> task) {
    for (;;) {
      (*task)();
      task.reset();
      const uint64_t seen = seq_.load(std::memory_order_acquire);
      idle_.fetch_add(1, std::memory_order_acq_rel);
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::microseconds(kLingerMicros);
      while (seq_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
      idle_.fetch_sub(1, std::memory_order_acq_rel);
      if (seq_.load(std::memory_order_acquire) == seen) return;
      std::lock_guard<std::mutex> lock(mu_);
      task = task_;
      if (!task) return;
    }
  }

 private:
  std::mutex mu_;
  std::shared_ptr<std::function<void()>> task_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<int> idle_{0};
};

// Runs body(i) for every i in [0, total). `make_body()` is called once on each thread that
// takes part and returns that thread's body (so each owns its scratch); it must capture by
// value, since a late task may call it after the caller has returned.
template <typename MakeBody>
void run_items(xla::ffi::ThreadPool& pool, int64_t total, MakeBody make_body,
               int64_t max_threads = INT64_MAX) {
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto work = std::make_shared<Work>();
  auto drain = [work, total, make_body] {
    if (work->next.load(std::memory_order_relaxed) >= total) return;
    auto body = make_body();
    int64_t finished = 0;
    for (int64_t i; (i = work->next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      body(i);
      ++finished;
    }
    work->done.fetch_add(finished, std::memory_order_release);
  };
  const int64_t helpers = std::min({pool.num_threads(), total, max_threads}) - 1;
  if (helpers > 0) {
    auto task = std::make_shared<std::function<void()>>(drain);
    LingeringHelpers& lingering = LingeringHelpers::get();
    if (!lingering.offer(task)) {
      for (int64_t i = 0; i < helpers; ++i) {
        pool.Schedule([task, &lingering] { lingering.serve(task); });
      }
    }
  }
  drain();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace jaxpaged_cpu
