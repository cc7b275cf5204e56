#include "kernels/cpu/parallel.h"

#include "base/available_cpus.h"
#include "base/log.h"
#include "base/thread_name.h"
#include "base/thread_priority.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace sdm::kernels::cpu {
namespace {

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins at most ThreadPool::kSpinRounds pauses while `waiting()` holds.
template <typename F>
void SpinWhile(F waiting) {
  for (int i = 0; i < ThreadPool::kSpinRounds && waiting(); ++i) CpuRelax();
}

}  // namespace

ThreadPool::ThreadPool(int num_threads, int worker_nice_increment) {
  if (num_threads <= 0) num_threads = AvailableCpus();  // base/available_cpus.h
  // The wait's condition reads workers_.size(), and a worker's unlock may evaluate it; it is
  // registered only once the loop below has finished growing workers_.
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this, worker_nice_increment] { WorkerLoop(worker_nice_increment); });
  }
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &ThreadPool::AllStartedLocked));
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    posted_.fetch_add(1, std::memory_order_release);  // ends the workers' spins
  }
  wake_.SignalAll();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunShare(const std::function<void(int64_t)>& fn, int64_t n) {
  for (int64_t i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) fn(i);
}

void ThreadPool::WorkerLoop(int nice_increment) {
  SetCurrentThreadName("sdm-kernel");
  if (absl::Status lowered = LowerCurrentThreadPriority(nice_increment); !lowered.ok()) {
    SDM_LOG(WARNING) << "sdm kernel thread: " << lowered.message();
  }
  {
    absl::MutexLock lock(&mu_);
    ++started_;
  }
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int64_t)>* job = nullptr;
    int64_t n = 0;
    SpinWhile([&] { return posted_.load(std::memory_order_acquire) == seen; });
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) wake_.Wait(&mu_);
      if (stop_) return;
      seen = generation_;
      // A worker waking after its generation finished finds no job: nothing to do.
      if (job_ == nullptr) continue;
      job = job_;
      n = job_size_;
      ++busy_;
      busy_hint_.store(busy_, std::memory_order_relaxed);
    }
    RunShare(*job, n);
    {
      absl::MutexLock lock(&mu_);
      busy_hint_.store(--busy_, std::memory_order_release);
      if (busy_ == 0) done_.Signal();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  absl::MutexLock call(&call_mu_);
  {
    absl::MutexLock lock(&mu_);
    job_ = &fn;
    job_size_ = n;
    next_.store(0);
    ++generation_;
    posted_.store(generation_, std::memory_order_release);
  }
  wake_.SignalAll();
  RunShare(fn, n);
  SpinWhile([&] { return busy_hint_.load(std::memory_order_acquire) != 0; });
  absl::MutexLock lock(&mu_);
  // Workers that woke for this generation hold busy_ until their share is done. A worker that
  // has not woken yet finds next_ >= n and returns at once, so waiting on busy_ suffices once
  // every index has been claimed.
  while (busy_ != 0) done_.Wait(&mu_);
  job_ = nullptr;
}

}  // namespace sdm::kernels::cpu
