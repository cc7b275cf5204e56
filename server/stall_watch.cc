#include "server/stall_watch.h"

#include <algorithm>
#include <utility>

#include "base/check.h"

namespace sdm {

StallWatch::StallWatch(absl::Duration limit, std::function<absl::Duration()> pending_for,
                       std::function<void(bool stalled)> on_change)
    : limit_(limit), pending_for_(std::move(pending_for)), on_change_(std::move(on_change)) {
  SDM_CHECK(limit_ > absl::ZeroDuration());
  thread_ = std::thread([this] { Loop(); });
}

StallWatch::~StallWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StallWatch::Loop() {
  const absl::Duration period = std::clamp(limit_ / 4, absl::Milliseconds(10), absl::Seconds(1));
  bool stalled = false;
  while (true) {
    const bool now = pending_for_() >= limit_;
    if (now != stalled) {
      stalled = now;
      on_change_(stalled);
    }
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) return;
  }
}

}  // namespace sdm
