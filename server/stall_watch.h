// Turns a polled duration into events: whether the oldest unfinished write (or any other work
// measured by its age) has been pending for `limit` or longer. For health that a failure never
// reports: a stalled volume blocks a write instead of failing it, so nothing calls back; this
// polls, and says when the state flips.
//
// Thread-safety: the callbacks run on the watch's own thread, one at a time; the destructor
// stops and joins it (no callback runs after it returns).
#ifndef SDMSERVE_SERVER_STALL_WATCH_H_
#define SDMSERVE_SERVER_STALL_WATCH_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace sdm {

class StallWatch {
 public:
  // Polls `pending_for` every limit / 4 (at least every second, at most every 10 ms) and calls
  // `on_change(stalled)` when `pending_for() >= limit` differs from the previous poll's answer
  // (the first poll's counts from "not stalled"). `limit` must be positive.
  StallWatch(absl::Duration limit, std::function<absl::Duration()> pending_for,
             std::function<void(bool stalled)> on_change);
  ~StallWatch();
  StallWatch(const StallWatch&) = delete;
  StallWatch& operator=(const StallWatch&) = delete;

 private:
  void Loop();

  const absl::Duration limit_;
  const std::function<absl::Duration()> pending_for_;
  const std::function<void(bool)> on_change_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_STALL_WATCH_H_
