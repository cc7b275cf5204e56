#include "server/http/connection_pool.h"

#include <system_error>
#include <utility>

#include "base/check.h"
#include "base/log.h"
#include "base/thread_name.h"

namespace sdm {

ConnectionPool::ConnectionPool(int base_threads, int max_threads, std::string thread_name)
    : max_threads_(max_threads), thread_name_(std::move(thread_name)) {
  SDM_CHECK(max_threads >= 1 && base_threads >= 0 && base_threads <= max_threads)
      << base_threads << " " << max_threads;
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < base_threads; ++i) {
    if (!StartWorkerLocked()) break;  // the others start as connections arrive
  }
}

ConnectionPool::~ConnectionPool() { shutdown(); }

bool ConnectionPool::StartWorkerLocked() {
  try {
    workers_.emplace_back([this] { Work(); });
    ++idle_;  // it takes a queued job as soon as it runs
  } catch (const std::system_error& e) {
    SDM_LOG(WARNING) << thread_name_ << ": cannot start a thread (" << e.what() << "); "
                     << workers_.size() << " serve the connections";
    return false;
  }
  return true;
}

void ConnectionPool::enqueue(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  SDM_CHECK(!shutdown_) << "enqueue() after shutdown()";
  jobs_.push_back(std::move(job));
  // Each idle worker takes one queued job (it counts as idle until it has taken it).
  if (static_cast<int>(jobs_.size()) > idle_ && static_cast<int>(workers_.size()) < max_threads_ &&
      StartWorkerLocked()) {
    return;  // the new worker takes it
  }
  work_.Signal();
}

void ConnectionPool::shutdown() {
  std::vector<std::thread> workers;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    workers.swap(workers_);
  }
  work_.SignalAll();
  for (std::thread& worker : workers) worker.join();
}

int ConnectionPool::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(workers_.size());
}

int ConnectionPool::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

void ConnectionPool::Work() {
  SetCurrentThreadName(thread_name_);
  // Counted idle from its start (StartWorkerLocked), and again after each job.
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      while (jobs_.empty() && !shutdown_) work_.Wait(&mu_);
      --idle_;
      if (jobs_.empty()) return;  // shut down, and nothing is left to run
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
    job = nullptr;  // the connection's state goes before the worker is counted idle
    absl::MutexLock lock(&mu_);
    ++idle_;
  }
}

}  // namespace sdm
