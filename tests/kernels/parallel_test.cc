#include "kernels/cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "base/thread_priority.h"
#include "gtest/gtest.h"

namespace sdm::kernels::cpu {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (int64_t n : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      for (int rep = 0; rep < 20; ++rep) {
        pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
      }
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 20) << threads << " " << n;
    }
  }
}

TEST(ThreadPoolTest, ReturnsOnlyWhenAllWorkIsDone) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  for (int rep = 0; rep < 200; ++rep) {
    sum = 0;
    pool.ParallelFor(64, [&](int64_t i) { sum.fetch_add(i); });
    ASSERT_EQ(sum.load(), 64 * 63 / 2);
  }
}

TEST(ThreadPoolTest, WorkersRunAtTheirPriorityAndTheCallerAtItsOwn) {
  const int before = CurrentThreadNice();
  constexpr int kThreads = 3;
  ThreadPool pool(kThreads, /*worker_nice_increment=*/4);
  // Each index waits for all the others to be claimed, so every thread of the pool (the caller
  // included) runs exactly one: each reports its own nice value.
  std::atomic<int> arrived{0};
  std::vector<int> nice(kThreads);
  std::vector<std::thread::id> ran_on(kThreads);
  pool.ParallelFor(kThreads, [&](int64_t i) {
    nice[i] = CurrentThreadNice();
    ran_on[i] = std::this_thread::get_id();
    arrived.fetch_add(1);
    while (arrived.load() < kThreads) std::this_thread::yield();
  });
  int workers = 0;
  for (int i = 0; i < kThreads; ++i) {
    if (ran_on[i] == std::this_thread::get_id()) {
      EXPECT_EQ(nice[i], before) << "the caller's priority changed";
    } else {
      ++workers;
      EXPECT_EQ(nice[i], std::min(before + 4, 19)) << "index " << i;
    }
  }
  EXPECT_EQ(workers, kThreads - 1);
  EXPECT_EQ(CurrentThreadNice(), before);
}

}  // namespace
}  // namespace sdm::kernels::cpu
