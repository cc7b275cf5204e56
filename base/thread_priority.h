// Lowers the CPU priority of the calling thread (Linux nice values).
//
// The server runs its decode threads (the scheduler's step thread, the CPU engine's kernel
// threads) below its front end (gRPC's threads, the HTTP endpoints), so that on a machine whose
// cores the decode fills, a refusal, a health check or a cancellation is answered ahead of the
// next step rather than after it (EngineOptions::decode_nice, engine/engine.h; measured in
// docs/benchmarks.md, "Overload rejection latency").
//
// On Linux a nice value belongs to a thread, not to its process: raising it here leaves the
// process's other threads as they were, and threads the caller starts afterwards inherit it.
// Only raising is offered: it needs no privilege, where lowering a nice value needs
// CAP_SYS_NICE (or RLIMIT_NICE).
//
// Thread-safety: affects only the calling thread.
#ifndef SDMSERVE_BASE_THREAD_PRIORITY_H_
#define SDMSERVE_BASE_THREAD_PRIORITY_H_

#include "absl/status/status.h"

namespace sdm {

// The largest increment accepted, the span of Linux nice values (-20 .. 19) above 0.
inline constexpr int kMaxNiceIncrement = 19;

// OK if 0 <= increment <= kMaxNiceIncrement, else INVALID_ARGUMENT saying so: the increments
// LowerCurrentThreadPriority takes (for options checked before any thread starts).
absl::Status CheckNiceIncrement(int increment);

// Adds `increment` to the calling thread's nice value, stopping at 19 (the lowest priority).
// CheckNiceIncrement's error for an increment out of range; INTERNAL if the system refuses
// (errno's text). 0 changes nothing. A no-op (OK) where threads have no nice value of their own.
absl::Status LowerCurrentThreadPriority(int increment);

// The calling thread's nice value (Linux); 0 where threads have none.
int CurrentThreadNice();

}  // namespace sdm

#endif  // SDMSERVE_BASE_THREAD_PRIORITY_H_
