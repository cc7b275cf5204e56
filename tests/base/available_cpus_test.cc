#include "base/available_cpus.h"

#include <sched.h>

#include <random>
#include <thread>

#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(CpusOfCgroupQuotaTest, RoundsTheQuotaUpAndReadsNoLimitAsNone) {
  EXPECT_EQ(CpusOfCgroupQuota("800000 100000\n"), 8);
  EXPECT_EQ(CpusOfCgroupQuota("150000 100000"), 2);  // 1.5 CPUs: two threads
  EXPECT_EQ(CpusOfCgroupQuota("50000 100000"), 1);
  EXPECT_EQ(CpusOfCgroupQuota("1 100000"), 1);
  EXPECT_EQ(CpusOfCgroupQuota("max 100000\n"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota(""), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("100000"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("0 100000"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("200000 0"), std::nullopt);
  EXPECT_EQ(CpusOfCgroupQuota("x y"), std::nullopt);
}

// A thread limited to one CPU (taskset, a cpuset) gets one, whatever the machine has; a fresh
// random CPU of the allowed ones each run.
TEST(AvailableCpusTest, CountsTheAffinityMaskNotTheMachine) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const int before = AvailableCpus();
  EXPECT_GE(before, 1);
  EXPECT_LE(before, CPU_COUNT(&allowed));
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  const int one = cpus[std::random_device{}() % cpus.size()];
  int seen = 0;
  std::thread pinned([&] {
    cpu_set_t mask;
    CPU_ZERO(&mask);
    CPU_SET(one, &mask);
    ASSERT_EQ(sched_setaffinity(0, sizeof(mask), &mask), 0);
    seen = AvailableCpus();
  });
  pinned.join();
  EXPECT_EQ(seen, 1) << "pinned to CPU " << one;
  EXPECT_EQ(AvailableCpus(), before);  // only that thread was pinned
}

}  // namespace
}  // namespace sdm
