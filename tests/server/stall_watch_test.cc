#include "server/stall_watch.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

// The watched age, set by the test; the changes the watch reported, in order.
struct Watched {
  absl::Mutex mu;
  absl::Duration pending ABSL_GUARDED_BY(mu) = absl::ZeroDuration();
  std::vector<bool> changes ABSL_GUARDED_BY(mu);

  void Set(absl::Duration d) {
    absl::MutexLock lock(&mu);
    pending = d;
  }
  // Blocks until `n` changes were reported (no timeout: ctest's ends a hung test).
  std::vector<bool> AwaitChanges(size_t n) {
    absl::MutexLock lock(&mu);
    want = n;
    mu.Await(absl::Condition(this, &Watched::Enough));
    return changes;
  }
  bool Enough() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return changes.size() >= want; }
  size_t want ABSL_GUARDED_BY(mu) = 0;
};

TEST(StallWatchTest, ReportsEachFlipOnceAndNothingWhileTheStateHolds) {
  Watched w;
  {
    StallWatch watch(
        absl::Milliseconds(40),
        [&w] {
          absl::MutexLock lock(&w.mu);
          return w.pending;
        },
        [&w](bool stalled) {
          absl::MutexLock lock(&w.mu);
          w.changes.push_back(stalled);
        });
    w.Set(absl::Milliseconds(40));  // at the limit: stalled
    EXPECT_EQ(w.AwaitChanges(1), std::vector<bool>({true}));
    w.Set(absl::Milliseconds(39));
    EXPECT_EQ(w.AwaitChanges(2), std::vector<bool>({true, false}));
    w.Set(absl::Hours(1));
    EXPECT_EQ(w.AwaitChanges(3), std::vector<bool>({true, false, true}));
  }
  // Stopped: no more callbacks, and the state held in between was not reported again.
  absl::MutexLock lock(&w.mu);
  EXPECT_EQ(w.changes, std::vector<bool>({true, false, true}));
}

TEST(StallWatchTest, NothingPendingIsNeverReported) {
  Watched w;
  int polls = 0;
  absl::Mutex polls_mu;
  {
    StallWatch watch(
        absl::Milliseconds(40),
        [&] {
          absl::MutexLock lock(&polls_mu);
          ++polls;
          return absl::ZeroDuration();
        },
        [&w](bool stalled) {
          absl::MutexLock lock(&w.mu);
          w.changes.push_back(stalled);
        });
    // Several polls, however long the machine takes to run them.
    absl::MutexLock lock(&polls_mu);
    polls_mu.Await(absl::Condition(
        +[](int* p) { return *p >= 3; }, &polls));
  }
  absl::MutexLock lock(&w.mu);
  EXPECT_TRUE(w.changes.empty());
}

}  // namespace
}  // namespace sdm
