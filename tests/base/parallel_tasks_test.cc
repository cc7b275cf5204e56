#include "base/parallel_tasks.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace sdm {
namespace {

// Every index runs exactly once, whatever the thread count; with several threads allowed and
// tasks that wait for each other, the calls run on more than one thread at once.
TEST(RunTasksInParallelTest, RunsEveryTaskExactlyOnce) {
  for (int64_t n : {0, 1, 2, 7, 100}) {
    for (int threads : {0, 1, 3, 16}) {
      std::vector<std::atomic<int>> calls(n);
      RunTasksInParallel(n, threads, [&](int64_t i) { calls[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(calls[i].load(), 1) << "n " << n << ", threads " << threads << ", task " << i;
      }
    }
  }
}

TEST(RunTasksInParallelTest, RunsTasksConcurrently) {
  // Two tasks that each wait until both have started: only concurrent calls finish.
  std::atomic<int> started{0};
  std::mutex mu;
  std::set<std::thread::id> ids;
  RunTasksInParallel(2, 2, [&](int64_t) {
    started.fetch_add(1);
    while (started.load() < 2) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 2u);
  // One thread allowed: the caller runs them all, in order.
  std::vector<int64_t> order;
  RunTasksInParallel(4, 1, [&](int64_t i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace sdm
