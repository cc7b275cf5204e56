// A StateFiles for tests whose reads of snapshots are held until the test releases them, so that
// a restore of a disk session is in progress for as long as a test wants, without sleeps.
//
// Read() of a *.sdmstate file (the whole snapshot, as a restore reads it; Open reads records with
// ReadRange, which is not held) counts itself and waits for Release(). It gives up after 60
// seconds and records that (timed_out()), so that code waiting for the restore fails a test
// instead of hanging it. Everything else is the real POSIX implementation. Thread-safe.
#ifndef SDMSERVE_TESTS_STATE_STORE_HELD_READ_FILES_H_
#define SDMSERVE_TESTS_STATE_STORE_HELD_READ_FILES_H_

#include <filesystem>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "state_store/state_files.h"

namespace sdm::testing {

class HeldReadFiles : public StateFiles {
 public:
  absl::StatusOr<std::string> Read(const std::filesystem::path& path) override {
    if (absl::EndsWith(path.string(), ".sdmstate")) {
      absl::MutexLock lock(&mu_);
      ++reads_held_;
      if (!mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Seconds(60))) timed_out_ = true;
    }
    return StateFiles::Read(path);
  }
  // Returns once a snapshot read is being held.
  void WaitUntilHeld() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* held) { return *held > 0; }, &reads_held_));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }
  // A held read gave up waiting for Release().
  bool timed_out() {
    absl::MutexLock lock(&mu_);
    return timed_out_;
  }

 private:
  absl::Mutex mu_;
  int reads_held_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace sdm::testing

#endif  // SDMSERVE_TESTS_STATE_STORE_HELD_READ_FILES_H_
