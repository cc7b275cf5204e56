// FailureEpisode: when to log a failure that may repeat at every call (a device error at every
// step, etcd down at every lookup): the first failure of each cause, nothing while that cause
// repeats, and one line when a success ends the episode, with how many failures were not logged.
// The caller logs; this only decides when.
//
// Thread-compatible: the caller serialises calls.
#ifndef SDMSERVE_BASE_FAILURE_EPISODE_H_
#define SDMSERVE_BASE_FAILURE_EPISODE_H_

#include <cstdint>
#include <string>
#include <utility>

namespace sdm {

class FailureEpisode {
 public:
  // A failure of `cause` (not empty): true when it is to be logged, i.e. its cause differs from
  // the one logged last; otherwise it is counted as not logged.
  bool Failed(std::string cause) {
    if (cause == logged_cause_) {
      ++unlogged_;
      return false;
    }
    logged_cause_ = std::move(cause);
    return true;
  }

  // A success: true when it ends an episode (a failure was logged since the last success), to be
  // logged too; then `*unlogged`, when not null, is how many failures were not logged.
  bool Succeeded(int64_t* unlogged = nullptr) {
    if (logged_cause_.empty()) return false;
    if (unlogged != nullptr) *unlogged = unlogged_;
    logged_cause_.clear();
    unlogged_ = 0;
    return true;
  }

 private:
  std::string logged_cause_;  // empty: no episode
  int64_t unlogged_ = 0;
};

}  // namespace sdm

#endif  // SDMSERVE_BASE_FAILURE_EPISODE_H_
