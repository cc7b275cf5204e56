#include "kernels/cpu/parallel.h"

#include <atomic>
#include <vector>

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

}  // namespace
}  // namespace sdm::kernels::cpu
