// Reloadable<T>: a value that readers take a snapshot of and a reload replaces whole (the key
// file and the tenant limits, on SIGHUP). A reader keeps its snapshot for as long as it uses it
// (a check runs against the one it took), so a reload never changes a value under a reader; the
// next Get() sees the new one. Two Reloadables are replaced one after the other: a request that
// reads both may see one old and one new.
//
// Thread-safety: Get and Set may run concurrently from any threads.
#ifndef SDMSERVE_BASE_RELOADABLE_H_
#define SDMSERVE_BASE_RELOADABLE_H_

#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace sdm {

template <typename T>
class Reloadable {
 public:
  explicit Reloadable(T initial = T()) : current_(std::make_shared<const T>(std::move(initial))) {}
  Reloadable(const Reloadable&) = delete;
  Reloadable& operator=(const Reloadable&) = delete;

  std::shared_ptr<const T> Get() const {
    absl::MutexLock lock(&mu_);
    return current_;
  }
  void Set(T next) {
    std::shared_ptr<const T> replaced = std::make_shared<const T>(std::move(next));
    absl::MutexLock lock(&mu_);
    current_.swap(replaced);  // the old value is freed after the lock, by its last reader
  }

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<const T> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace sdm

#endif  // SDMSERVE_BASE_RELOADABLE_H_
