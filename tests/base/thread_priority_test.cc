#include "base/thread_priority.h"

#include <algorithm>
#include <thread>

#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(ThreadPriorityTest, LowersTheCallingThreadOnly) {
  const int before = CurrentThreadNice();
  int inside = before;
  absl::Status status;
  std::thread t([&] {
    status = LowerCurrentThreadPriority(3);
    inside = CurrentThreadNice();
  });
  t.join();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(inside, std::min(before + 3, 19));
  EXPECT_EQ(CurrentThreadNice(), before);
}

TEST(ThreadPriorityTest, ThreadsStartedAfterwardsInheritIt) {
  const int before = CurrentThreadNice();
  int child = before;
  std::thread t([&] {
    ASSERT_TRUE(LowerCurrentThreadPriority(2).ok());
    std::thread grandchild([&] { child = CurrentThreadNice(); });
    grandchild.join();
  });
  t.join();
  EXPECT_EQ(child, std::min(before + 2, 19));
}

TEST(ThreadPriorityTest, StopsAtTheLowestPriority) {
  int inside = 0;
  absl::Status first, second;
  std::thread t([&] {
    first = LowerCurrentThreadPriority(kMaxNiceIncrement);
    second = LowerCurrentThreadPriority(5);  // already at 19: stays there
    inside = CurrentThreadNice();
  });
  t.join();
  EXPECT_TRUE(first.ok()) << first;
  EXPECT_TRUE(second.ok()) << second;
  EXPECT_EQ(inside, 19);
}

TEST(ThreadPriorityTest, RefusesIncrementsOutsideTheRange) {
  const int before = CurrentThreadNice();
  EXPECT_EQ(LowerCurrentThreadPriority(-1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LowerCurrentThreadPriority(kMaxNiceIncrement + 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(LowerCurrentThreadPriority(0).ok());
  EXPECT_EQ(CurrentThreadNice(), before);
}

}  // namespace
}  // namespace sdm
