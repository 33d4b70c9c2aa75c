// Work items spread over XLA:CPU's intra-op thread pool, the calling thread working too.
//
// Every kernel of this library splits its output into independent items (a chunk of output
// features, a query block's KV head) and runs them through run_items: the pool's tasks and the
// caller take items from one atomic counter until none is left, and the caller returns once
// all are done. A task that starts after the work is done finds nothing left and drops its
// reference to the shared counters.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged_cpu {

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
    auto body = make_body();
    int64_t finished = 0;
    for (int64_t i; (i = work->next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      body(i);
      ++finished;
    }
    work->done.fetch_add(finished, std::memory_order_release);
  };
  const int64_t helpers = std::min({pool.num_threads(), total, max_threads}) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(drain)(drain));
  drain();
  while (work->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

}  // namespace jaxpaged_cpu
