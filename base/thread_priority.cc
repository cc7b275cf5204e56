#include "base/thread_priority.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

#if defined(__linux__)
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sdm {
namespace {

#if defined(__linux__)
// PRIO_PROCESS with a thread id addresses that one thread (Linux keeps nice values per task);
// with 0 it would also mean the calling thread, but the id states it.
id_t CurrentThreadId() { return static_cast<id_t>(syscall(SYS_gettid)); }
#endif

}  // namespace

int CurrentThreadNice() {
#if defined(__linux__)
  // -1 is both a valid nice value and getpriority's error return; an error cannot happen for
  // the calling thread's own id.
  return getpriority(PRIO_PROCESS, CurrentThreadId());
#else
  return 0;
#endif
}

absl::Status CheckNiceIncrement(int increment) {
  if (increment < 0 || increment > kMaxNiceIncrement) {
    return absl::InvalidArgumentError(
        absl::StrCat("a nice increment must be 0 to ", kMaxNiceIncrement, ", not ", increment));
  }
  return absl::OkStatus();
}

absl::Status LowerCurrentThreadPriority(int increment) {
  if (absl::Status valid = CheckNiceIncrement(increment); !valid.ok()) return valid;
  if (increment == 0) return absl::OkStatus();
#if defined(__linux__)
  const int target = std::min(CurrentThreadNice() + increment, 19);
  if (setpriority(PRIO_PROCESS, CurrentThreadId(), target) != 0) {
    return absl::InternalError(
        absl::StrCat("setpriority(", target, ") for this thread: ", std::strerror(errno)));
  }
#endif
  return absl::OkStatus();
}

}  // namespace sdm
