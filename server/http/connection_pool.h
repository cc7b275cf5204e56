// ConnectionPool: the threads of the HTTP API (server/http/openai_server.h), as cpp-httplib's
// TaskQueue. httplib hands each accepted connection to the queue as one job, which holds its
// thread for as long as the connection stays open: while a request is read, run and answered,
// and while the connection is idle between requests (keep-alive). A fixed pool therefore lets a
// few idle keep-alive connections (an SDK client keeps a pool of them) make a new connection wait
// with no answer; this pool starts a thread for it instead, so that how many requests run or are
// refused at once is the scheduler's decision (max_running, max_waiting: 429 when full), not the
// thread count's.
//
// Contract:
//   - The constructor starts `base_threads` workers.
//   - enqueue() starts another worker when no worker is idle to take the job, unless
//     `max_threads` are running; then (or when the system refuses a new thread) the job waits in
//     a FIFO queue, without bound as in httplib's ThreadPool, until a worker finishes its job.
//   - A worker started above the base stays until shutdown(), idle between jobs, so the thread
//     count only grows: to about the most connections open at once (a worker counts as busy
//     until its job has returned, so a job arriving just then may start one more), at most
//     `max_threads`. No timer retires threads: the simpler design, and an idle worker only waits
//     on a condition variable.
//   - shutdown() lets every queued job run (as httplib's ThreadPool does), then ends and joins
//     every worker the pool started. httplib calls it once its accept loop has ended and enqueues
//     nothing after; enqueue() after shutdown() is a programming error (SDM_CHECK). The
//     destructor calls shutdown() when it has not been called.
//   - Workers are named `thread_name` (base/thread_name.h).
//
// Thread-safety: enqueue(), threads() and queued() may be called from any thread, concurrently;
// shutdown() from one thread, not a worker (it joins them), once (later calls do nothing).
#ifndef SDMSERVE_SERVER_HTTP_CONNECTION_POOL_H_
#define SDMSERVE_SERVER_HTTP_CONNECTION_POOL_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "httplib.h"

namespace sdm {

class ConnectionPool : public httplib::TaskQueue {
 public:
  // 0 <= base_threads <= max_threads, max_threads >= 1 (checked).
  ConnectionPool(int base_threads, int max_threads, std::string thread_name);
  ~ConnectionPool() override;
  ConnectionPool(const ConnectionPool&) = delete;
  ConnectionPool& operator=(const ConnectionPool&) = delete;

  void enqueue(std::function<void()> job) override;
  void shutdown() override;

  // Workers started and not yet joined.
  int threads() const;
  // Jobs enqueued that no worker has taken yet.
  int queued() const;

 private:
  // Starts one worker; false when the system refuses a thread.
  bool StartWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Work();

  const int max_threads_;
  const std::string thread_name_;
  mutable absl::Mutex mu_;
  absl::CondVar work_;  // a job was queued, or shutdown_ was set
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_ ABSL_GUARDED_BY(mu_);
  // Workers that will take a queued job without another being started: those waiting, and
  // those started but not yet waiting.
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_CONNECTION_POOL_H_
