// Runs independent tasks on a few short-lived threads: for host work of one call that splits
// into parts with nothing shared but what the caller prepared (e.g. converting each layer of a
// session's state in a park or resume, engine/cuda/device_state.cc), where a pool would be
// idle between calls and spawning a few threads costs little next to the work.
#ifndef SDMSERVE_BASE_PARALLEL_TASKS_H_
#define SDMSERVE_BASE_PARALLEL_TASKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace sdm {

// Calls task(i) exactly once for every i in [0, n), on the calling thread and up to
// max_threads - 1 more (never more threads than tasks), and returns when every call returned.
// The order and the thread of each call are unspecified; tasks must not throw.
inline void RunTasksInParallel(int64_t n, int max_threads, absl::FunctionRef<void(int64_t)> task) {
  const int64_t threads = std::min<int64_t>(n, std::max(1, max_threads));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  std::atomic<int64_t> next{0};
  const auto drain = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) task(i);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) helpers.emplace_back(drain);
  drain();
  for (std::thread& h : helpers) h.join();
}

}  // namespace sdm

#endif  // SDMSERVE_BASE_PARALLEL_TASKS_H_
