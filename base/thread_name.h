// Names the calling thread, as `top -H`, `ps -L`, `perf` and /proc/PID/task/TID/comm show it.
//
// The server's own threads are named "sdm-..." (the step loop, the kernel pool, the state
// store's writers, ...), so that a profile or a per-thread CPU sample says which part of the
// server a thread is, and the soak test can tell the server's threads from gRPC's (which names
// its own pools and starts and stops them with the load; scripts/lib/crash_test.py).
//
// Thread-safety: affects only the calling thread.
#ifndef SDMSERVE_BASE_THREAD_NAME_H_
#define SDMSERVE_BASE_THREAD_NAME_H_

#include "absl/strings/string_view.h"

namespace sdm {

// Linux keeps at most 15 bytes of a thread's name: a longer `name` is cut to its first 15. A
// no-op where the platform cannot name threads.
void SetCurrentThreadName(absl::string_view name);

}  // namespace sdm

#endif  // SDMSERVE_BASE_THREAD_NAME_H_
