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
//     a FIFO queue until a worker finishes its job, at most `options.max_wait` (1 s). A job that
//     has waited longer, and that no idle worker is about to take, is refused: it runs on one of
//     `options.refusal_threads` threads that serve nothing else, with Refusing() true on that
//     thread, and is expected to answer as briefly as it can and end (OpenAiServer answers each
//     request of the connection 503 with Retry-After and `Connection: close`). httplib 0.11's
//     enqueue() cannot decline a job (it returns void and the job owns the accepted socket, which
//     only the job can answer or close), so a refusal still needs a thread: these are started
//     with the pool, so that refusals go on when the system refuses new threads. A slow client
//     holds a refusal thread as long as it would hold a worker (its read timeout), and so does
//     one that ignores `Connection: close` (until its keep-alive timeout: httplib 0.11 closes a
//     connection after a response only when the request asked); refused jobs wait for a free
//     refusal thread, in order, or for a worker that comes free first, which serves the oldest
//     normally (it still counts in refused()). With `refusal_threads` 0 (or none could start) no
//     job is refused.
//   - A worker above `base_threads` that has waited `options.idle_timeout` (60 s) for a job
//     exits (none does while a job is queued), so a burst of connections does not leave its threads
//     behind; the thread count follows the connections open (a worker counts as busy until its job
//     has returned, so a job arriving just then may start one more), at most `max_threads`, and
//     falls back to `base_threads` idle_timeout after they close. A worker that exits is joined by
//     the next enqueue() or shutdown() (a thread that has returned, so the join does not wait),
//     never by itself.
//   - shutdown() lets every queued job run (as httplib's ThreadPool does; none is refused from
//     then on) and every refused one, then ends and joins every thread the pool started. httplib
//     calls it once its accept loop has ended and enqueues nothing after; enqueue() after
//     shutdown() is a programming error (SDM_CHECK). The destructor calls shutdown() when it has
//     not been called.
//   - Workers are named `thread_name`, refusal threads `thread_name` + "-refuse", cut to 15
//     bytes (base/thread_name.h).
//
// Thread-safety: enqueue(), threads(), queued(), refused() and the testing methods may be called
// from any thread but the pool's own, concurrently; Refusing() from any thread; shutdown() from one
// thread, not a worker (it joins them), once (later calls do nothing).
#ifndef SDMSERVE_SERVER_HTTP_CONNECTION_POOL_H_
#define SDMSERVE_SERVER_HTTP_CONNECTION_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "httplib.h"
#include "server/http/connection_pool_options.h"

namespace sdm {

class ConnectionPool : public httplib::TaskQueue {
 public:
  // 0 <= base_threads <= max_threads, max_threads >= 1 (checked).
  ConnectionPool(int base_threads, int max_threads, std::string thread_name,
                 ConnectionPoolOptions options = {});
  ~ConnectionPool() override;
  ConnectionPool(const ConnectionPool&) = delete;
  ConnectionPool& operator=(const ConnectionPool&) = delete;

  void enqueue(std::function<void()> job) override;
  void shutdown() override;

  // Workers that serve jobs, busy or idle, not counting those that are exiting (idle too long)
  // or have exited.
  int threads() const;
  // Jobs enqueued that no worker has taken yet, and that are not refused.
  int queued() const;
  // Jobs refused since the pool started.
  int64_t refused() const;

  // True on a thread while it runs a job that the pool refuses (options.max_wait).
  static bool Refusing();

  // Testing, with options.clock: does what the time it now reads calls for (jobs queued too long
  // are refused, idle workers above the base exit and are joined) and returns once that is done,
  // but for the refused jobs' running.
  void ClockAdvancedForTesting();
  // Testing: waits until at least `n` workers are idle (waiting for a job, or started and not
  // waiting yet), at most `timeout`; false if they were not.
  bool AwaitIdleForTesting(int n, absl::Duration timeout);

 private:
  struct Worker {  // guarded by mu_
    std::thread thread;
    bool idle = true;  // not running a job, since idle_since
    absl::Time idle_since;
    bool exit = false;  // told to exit, idle too long (idle_ no longer counts it)
  };

  // Starts one worker; false when the system refuses a thread.
  bool StartWorkerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refuses (moves to refusals_) queued jobs that have waited max_wait_ at `now`, but those that
  // idle workers are about to take.
  void RefuseQueuedLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells idle workers above the base that have been idle for idle_timeout_ at `now` to exit.
  void RetireIdleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Work(Worker* self);
  // Waits for a job for `self` (after its last one, if any): false when it is to exit.
  bool NextJob(Worker* self, std::function<void()>& job);
  // A refusal thread's loop, and its wait for a refused job: false when it is to exit.
  void Refuse();
  bool NextRefusal(std::function<void()>& job);

  const int base_threads_;
  const int max_threads_;
  const std::string thread_name_;
  const absl::Duration idle_timeout_;
  const absl::Duration max_wait_;
  const bool test_clock_;  // options.clock was given: time is acted on in ClockAdvanced only
  const std::function<absl::Time()> clock_;
  mutable absl::Mutex mu_;
  absl::CondVar work_;  // a job was queued, a worker was told to exit, or shutdown_ was set
  // A job that no idle worker will take was queued, a job was refused, or shutdown_ was set.
  absl::CondVar refuse_;
  struct Queued {
    std::function<void()> job;
    absl::Time since;  // enqueued
  };
  std::deque<Queued> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> refusals_ ABSL_GUARDED_BY(mu_);  // refused, not yet run
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  // Refusals are logged at most once a minute, each line saying how many since the last: an
  // overload days after an earlier one is logged too (a 1, 2, 4, ... schedule was not).
  absl::Time refusal_logged_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t refused_since_logged_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> refusers_ ABSL_GUARDED_BY(mu_);
  // Every worker started and not yet exited (a list: a worker keeps a pointer to its own entry).
  std::list<Worker> workers_ ABSL_GUARDED_BY(mu_);
  // Workers in workers_ told to exit that have not yet left it.
  int exiting_ ABSL_GUARDED_BY(mu_) = 0;
  // Threads of workers that have exited, to be joined by the next enqueue() or shutdown().
  std::vector<std::thread> exited_ ABSL_GUARDED_BY(mu_);
  // Workers that will take a queued job without another being started: those waiting (and not
  // told to exit), and those started but not yet waiting.
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_CONNECTION_POOL_H_
