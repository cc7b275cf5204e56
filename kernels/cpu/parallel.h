// A fixed pool of worker threads running index ranges: the "threads for the rest" of the CPU
// engine (OpenBLAS has its own threads for GEMMs).
//
// ParallelFor(n, fn) calls fn(i) for every i in [0, n), spread over the pool and the calling
// thread, and returns when all calls have returned. Concurrent callers are served one after the
// other (fn must not call ParallelFor on the same pool).
//
// Wake-up latency: a decode step makes hundreds of short ParallelFor calls (one per GEMM), so an
// idle worker first spins for a bounded while (kSpinRounds pause instructions, tens of
// microseconds) watching for the next call before it blocks on the condition variable, and the
// caller likewise spins a while for the workers to finish before blocking. Both then fall back to
// the mutex-protected protocol; the spin never decides anything, it only finds out sooner.
//
// Priority: the workers can run nicer than the thread that made the pool (worker_nice_increment,
// base/thread_priority.h): the server runs its decode below its front end
// (EngineOptions::decode_nice, engine/engine.h). The constructor returns once every worker runs
// at its priority.
#ifndef SDMSERVE_KERNELS_CPU_PARALLEL_H_
#define SDMSERVE_KERNELS_CPU_PARALLEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace sdm::kernels::cpu {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means run everything on the calling thread. Each worker
  // adds worker_nice_increment (0 to kMaxNiceIncrement) to the nice value it starts with; one
  // the system refuses is logged, and the worker runs at the priority it had.
  explicit ThreadPool(int num_threads, int worker_nice_increment = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

  // Pause instructions an idle thread spins before blocking.
  static constexpr int kSpinRounds = 2000;

 private:
  void WorkerLoop(int nice_increment);
  bool AllStartedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return started_ == static_cast<int>(workers_.size());
  }
  void RunShare(const std::function<void(int64_t)>& fn, int64_t n);

  std::vector<std::thread> workers_;
  absl::Mutex call_mu_;  // one ParallelFor at a time
  absl::Mutex mu_ ABSL_ACQUIRED_AFTER(call_mu_);
  absl::CondVar wake_;  // a new generation or stop_
  absl::CondVar done_;  // busy_ dropped to 0
  const std::function<void(int64_t)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t job_size_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int started_ ABSL_GUARDED_BY(mu_) = 0;  // workers named and at their priority
  std::atomic<int64_t> next_{0};          // the next index to claim of the current job
  // Copies of generation_ and busy_, written under mu_ with them, read without it by spinning
  // threads (hints only: every decision is taken again under mu_).
  std::atomic<uint64_t> posted_{0};
  std::atomic<int> busy_hint_{0};
};

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_PARALLEL_H_
