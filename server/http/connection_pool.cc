#include "server/http/connection_pool.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "base/check.h"
#include "base/log.h"
#include "base/thread_name.h"

namespace sdm {
namespace {

thread_local bool refusing = false;

}  // namespace

ConnectionPool::ConnectionPool(int base_threads, int max_threads, std::string thread_name,
                               ConnectionPoolOptions options)
    : base_threads_(base_threads),
      max_threads_(max_threads),
      thread_name_(std::move(thread_name)),
      idle_timeout_(std::max(options.idle_timeout, absl::ZeroDuration())),
      max_wait_(std::max(options.max_wait, absl::ZeroDuration())),
      test_clock_(options.clock != nullptr),
      clock_(test_clock_ ? std::move(options.clock) : [] { return absl::Now(); }) {
  SDM_CHECK(max_threads >= 1 && base_threads >= 0 && base_threads <= max_threads)
      << base_threads << " " << max_threads;
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < options.refusal_threads; ++i) {
    try {
      refusers_.emplace_back([this] { Refuse(); });
    } catch (const std::system_error& e) {
      SDM_LOG(WARNING) << thread_name_ << ": cannot start a thread (" << e.what() << "); "
                       << refusers_.size() << " answer the connections refused";
      break;
    }
  }
  for (int i = 0; i < base_threads; ++i) {
    if (!StartWorkerLocked()) break;  // the others start as connections arrive
  }
}

ConnectionPool::~ConnectionPool() { shutdown(); }

bool ConnectionPool::StartWorkerLocked() {
  Worker& worker = workers_.emplace_back();
  worker.idle_since = clock_();
  try {
    worker.thread = std::thread([this, &worker] { Work(&worker); });
  } catch (const std::system_error& e) {
    workers_.pop_back();
    SDM_LOG(WARNING) << thread_name_ << ": cannot start a thread (" << e.what() << "); "
                     << workers_.size() - exiting_ << " serve the connections";
    return false;
  }
  ++idle_;  // it takes a queued job as soon as it runs
  return true;
}

void ConnectionPool::enqueue(std::function<void()> job) {
  std::vector<std::thread> exited;
  {
    absl::MutexLock lock(&mu_);
    SDM_CHECK(!shutdown_) << "enqueue() after shutdown()";
    exited.swap(exited_);
    jobs_.push_back({std::move(job), clock_()});
    // Each idle worker takes one queued job (it counts as idle until it has taken it).
    if (static_cast<int>(jobs_.size()) > idle_ &&
        static_cast<int>(workers_.size()) - exiting_ < max_threads_ && StartWorkerLocked()) {
      // The new worker takes it.
    } else {
      work_.Signal();
      // None may take it before max_wait_: its refusal is due then.
      if (static_cast<int>(jobs_.size()) > idle_) refuse_.Signal();
    }
  }
  // Threads that have returned from Work(): the joins do not wait.
  for (std::thread& thread : exited) thread.join();
}

void ConnectionPool::shutdown() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    // A worker that sees shutdown_ returns without touching workers_ (even one told to exit), so
    // the entries stay until every thread is joined.
    for (Worker& worker : workers_) threads.push_back(std::move(worker.thread));
    for (std::thread& thread : exited_) threads.push_back(std::move(thread));
    exited_.clear();
    // They answer the jobs already refused, then end.
    for (std::thread& thread : refusers_) threads.push_back(std::move(thread));
    refusers_.clear();
  }
  work_.SignalAll();
  refuse_.SignalAll();
  for (std::thread& thread : threads) thread.join();
  absl::MutexLock lock(&mu_);
  workers_.clear();
  exiting_ = 0;
  idle_ = 0;
}

int ConnectionPool::threads() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(workers_.size()) - exiting_;
}

int ConnectionPool::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(jobs_.size());
}

int64_t ConnectionPool::refused() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

bool ConnectionPool::Refusing() { return refusing; }

void ConnectionPool::ClockAdvancedForTesting() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    RefuseQueuedLocked(now);
    RetireIdleLocked(now);
    auto exited = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return exiting_ == 0 || shutdown_; };
    mu_.Await(absl::Condition(&exited));
    if (!shutdown_) threads.swap(exited_);
  }
  for (std::thread& thread : threads) thread.join();
}

bool ConnectionPool::AwaitIdleForTesting(int n, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return idle_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

void ConnectionPool::RefuseQueuedLocked(absl::Time now) {
  // Without a refusal thread a refused job would never run (nor its socket close); after
  // shutdown() the refusal threads may have ended, and the workers run what is queued.
  if (refusers_.empty() || shutdown_) return;
  const int64_t before = refused_;
  // The first idle_ queued jobs are the idle workers': the oldest others are refused.
  while (static_cast<int>(jobs_.size()) > idle_ && now - jobs_.front().since >= max_wait_) {
    refusals_.push_back(std::move(jobs_.front().job));
    jobs_.pop_front();
    ++refused_;
    ++refused_since_logged_;
    if (now - refusal_logged_ >= absl::Minutes(1)) {
      SDM_LOG(WARNING) << thread_name_ << ": a connection waited " << max_wait_ << " for a thread ("
                       << workers_.size() - exiting_ << " busy, at most " << max_threads_
                       << "), refused; " << refused_since_logged_
                       << " refused since the last such line (at most one a minute), " << refused_
                       << " in all";
      refusal_logged_ = now;
      refused_since_logged_ = 0;
    }
  }
  if (refused_ > before) refuse_.SignalAll();
}

void ConnectionPool::RetireIdleLocked(absl::Time now) {
  // Queued jobs are for the idle workers: none exits while one waits.
  if (!jobs_.empty() || shutdown_) return;
  bool told = false;
  for (Worker& worker : workers_) {
    if (static_cast<int>(workers_.size()) - exiting_ <= base_threads_) break;
    if (worker.idle && !worker.exit && now - worker.idle_since >= idle_timeout_) {
      worker.exit = true;
      ++exiting_;
      --idle_;
      told = true;
    }
  }
  if (told) work_.SignalAll();
}

void ConnectionPool::Work(Worker* self) {
  SetCurrentThreadName(thread_name_);
  std::function<void()> job;
  while (NextJob(self, job)) {
    job();
    job = nullptr;  // the connection's state goes before the worker is counted idle
  }
}

bool ConnectionPool::NextJob(Worker* self, std::function<void()>& job) {
  absl::MutexLock lock(&mu_);
  // Counted idle from its start (StartWorkerLocked), and again after each job.
  if (!self->idle) {
    ++idle_;
    self->idle = true;
    self->idle_since = clock_();
  }
  if (jobs_.empty() && !refusals_.empty() && !shutdown_ && !self->exit) {
    // A refused job no refusal thread has taken yet (they are held by slow clients): served
    // after all, by this worker that came free, rather than left unanswered behind them.
    job = std::move(refusals_.front());
    refusals_.pop_front();
    --idle_;
    self->idle = false;
    return true;
  }
  while (jobs_.empty() && !shutdown_ && !self->exit) {
    if (test_clock_) {
      work_.Wait(&mu_);  // the test's clock moves only in ClockAdvancedForTesting()
      continue;
    }
    const absl::Time now = clock_();
    RetireIdleLocked(now);
    if (self->exit) break;
    const absl::Time deadline = self->idle_since + idle_timeout_;
    if (now<deadline&& static_cast<int>(workers_.size()) - exiting_> base_threads_) {
      work_.WaitWithTimeout(&mu_, deadline - now);
    } else {
      // At the base (it stays, even past its timeout): woken by the next job or by shutdown().
      work_.Wait(&mu_);
    }
  }
  if (self->exit) {
    if (shutdown_) return false;  // shutdown() holds its thread and joins it
    --exiting_;
    exited_.push_back(std::move(self->thread));
    workers_.remove_if([self](const Worker& worker) { return &worker == self; });
    // It may have been woken for a job (Signal wakes one waiter): pass that on.
    if (!jobs_.empty()) work_.Signal();
    return false;
  }
  if (jobs_.empty()) return false;  // shut down, and nothing is left to run
  job = std::move(jobs_.front().job);
  jobs_.pop_front();
  --idle_;
  self->idle = false;
  return true;
}

void ConnectionPool::Refuse() {
  SetCurrentThreadName(thread_name_ + "-refuse");
  std::function<void()> job;
  while (NextRefusal(job)) {
    refusing = true;
    job();
    job = nullptr;
    refusing = false;
  }
}

bool ConnectionPool::NextRefusal(std::function<void()>& job) {
  absl::MutexLock lock(&mu_);
  for (;;) {
    const absl::Time now = clock_();
    if (!test_clock_) RefuseQueuedLocked(now);
    if (!refusals_.empty()) {
      job = std::move(refusals_.front());
      refusals_.pop_front();
      return true;
    }
    if (shutdown_) return false;
    if (!test_clock_ && static_cast<int>(jobs_.size()) > idle_) {
      // Not refused yet: the oldest job's refusal is due at its since + max_wait_.
      refuse_.WaitWithTimeout(&mu_, jobs_.front().since + max_wait_ - now);
    } else {
      // No job waits, but those the idle workers take; or the test's clock, which moves only in
      // ClockAdvancedForTesting().
      refuse_.Wait(&mu_);
    }
  }
}

}  // namespace sdm
