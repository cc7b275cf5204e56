// Eventually: polls a condition until it holds, for tests that wait on another thread or process
// (a server recording a metric just after its reply, a session leaving "generating", a store
// moving a session to disk in the background). The limit is generous on purpose: a loaded 2-core
// CI machine can stall a thread for seconds, and tests assert that the condition came to hold,
// never how soon (a passing run takes as long as the event takes).
#ifndef SDMSERVE_TESTS_BASE_EVENTUALLY_H_
#define SDMSERVE_TESTS_BASE_EVENTUALLY_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace sdm::testing {

inline constexpr absl::Duration kEventuallyLimit = absl::Seconds(60);

// Calls `condition` (a callable returning bool) until it returns true or `limit` has passed,
// every 10 ms; returns its last answer. Thread-compatible: `condition` runs on the caller's
// thread only.
template <typename Condition>
bool Eventually(Condition&& condition, absl::Duration limit = kEventuallyLimit) {
  const absl::Time deadline = absl::Now() + limit;
  while (!condition()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_BASE_EVENTUALLY_H_
