// ConnectionPool (server/http/connection_pool.h): a job arriving while every worker is busy gets a
// new worker up to the cap, waits past it (and is refused once it has waited max_wait), workers
// above the base exit once idle too long, and
// shutdown() runs what is queued and joins every worker. Jobs stand for httplib's connections:
// each blocks on a gate until the test opens it. Waits are bounded (a minute), so that a pool that
// never runs a job fails instead of hanging, and a test that fails early opens its gates before
// its pool joins its workers. Timeouts are decided on a fake clock that only the test moves
// (ConnectionPoolOptions::clock), never on the machine's.
#include "server/http/connection_pool.h"

#include <atomic>
#include <filesystem>
#include <iterator>
#include <memory>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/base/eventually.h"

namespace sdm::testing {
namespace {

constexpr absl::Duration kBound = absl::Minutes(1);

// Opens `gate` unless it is open: a test that ends early opens its gates before its pool joins.
void Open(absl::Notification& gate) {
  if (!gate.HasBeenNotified()) gate.Notify();
}

// A job that says when it has started, blocks until `gate` opens (at most kBound), and says when
// it has finished.
struct Job {
  absl::Notification started;
  absl::Notification finished;
};

std::function<void()> Blocking(Job& job, absl::Notification& gate) {
  return [&job, &gate] {
    job.started.Notify();
    gate.WaitForNotificationWithTimeout(kBound);
    job.finished.Notify();
  };
}

std::function<void()> Quick(Job& job) {
  return [&job] {
    job.started.Notify();
    job.finished.Notify();
  };
}

// For tests on the machine's clock that look at queued jobs: none is refused however long the
// machine stalls.
ConnectionPoolOptions NeverRefused() {
  ConnectionPoolOptions options;
  options.max_wait = absl::InfiniteDuration();
  return options;
}

// The time the pool reads (ConnectionPoolOptions::clock): it moves only when the test says so.
class FakeClock {
 public:
  std::function<absl::Time()> Function() {
    return [this] {
      absl::MutexLock lock(&mu_);
      return now_;
    };
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::FromUnixSeconds(1'000'000'000);
};

ConnectionPoolOptions WithClock(FakeClock& clock, absl::Duration idle_timeout,
                                absl::Duration max_wait = absl::Seconds(1)) {
  ConnectionPoolOptions options;
  options.clock = clock.Function();
  options.idle_timeout = idle_timeout;
  options.max_wait = max_wait;
  return options;
}

// A job that records whether the pool ran it as refused (ConnectionPool::Refusing()).
std::function<void()> Recording(Job& job, std::atomic<bool>& refused) {
  return [&job, &refused] {
    refused = ConnectionPool::Refusing();
    job.started.Notify();
    job.finished.Notify();
  };
}

// Threads of this process, as the kernel counts them: a worker that has exited is gone from it.
int ProcessThreads() {
  const std::filesystem::directory_iterator tasks("/proc/self/task");
  return static_cast<int>(std::distance(begin(tasks), end(tasks)));
}

TEST(ConnectionPoolTest, AJobArrivingWhileEveryWorkerIsBusyRunsOnANewOne) {
  constexpr int kBase = 3;
  absl::Notification gate;
  std::vector<Job> blocked(kBase);
  Job extra;
  ConnectionPool pool(kBase, /*max_threads=*/8, "sdm-test-pool");
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  EXPECT_EQ(pool.threads(), kBase);
  for (Job& job : blocked) pool.enqueue(Blocking(job, gate));
  for (Job& job : blocked) ASSERT_TRUE(job.started.WaitForNotificationWithTimeout(kBound));
  // Every worker holds a job that cannot end before the gate opens: a fixed pool of kBase would
  // leave the extra job queued until then.
  pool.enqueue(Quick(extra));
  EXPECT_TRUE(extra.finished.WaitForNotificationWithTimeout(kBound))
      << "the job waited for a busy worker";
  EXPECT_EQ(pool.threads(), kBase + 1);
  for (const Job& job : blocked) EXPECT_FALSE(job.finished.HasBeenNotified());
  Open(gate);
  pool.shutdown();
  for (const Job& job : blocked) EXPECT_TRUE(job.finished.HasBeenNotified());
}

TEST(ConnectionPoolTest, AtTheCapAJobWaitsForAWorkerToFinish) {
  absl::Notification first_gate, second_gate;
  Job first, second, waiting;
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/2, "sdm-test-pool", NeverRefused());
  absl::Cleanup open_gates = [&] {
    Open(first_gate);
    Open(second_gate);
  };
  pool.enqueue(Blocking(first, first_gate));
  pool.enqueue(Blocking(second, second_gate));
  ASSERT_TRUE(first.started.WaitForNotificationWithTimeout(kBound));
  ASSERT_TRUE(second.started.WaitForNotificationWithTimeout(kBound));
  EXPECT_EQ(pool.threads(), 2);
  // Both workers are busy and there are max_threads of them: the job is queued, no worker starts.
  pool.enqueue(Quick(waiting));
  EXPECT_EQ(pool.threads(), 2);
  EXPECT_EQ(pool.queued(), 1);
  EXPECT_FALSE(waiting.started.HasBeenNotified());
  // Once a worker is free it takes the job (while the other still blocks).
  Open(first_gate);
  EXPECT_TRUE(waiting.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_FALSE(second.finished.HasBeenNotified());
  EXPECT_EQ(pool.threads(), 2);
  EXPECT_EQ(pool.queued(), 0);
  Open(second_gate);
}

TEST(ConnectionPoolTest, JobsArrivingWhileWorkersAreIdleStartNone) {
  Job first, second;
  ConnectionPool pool(/*base_threads=*/2, /*max_threads=*/4, "sdm-test-pool");
  // The base workers count as idle from the start, before they first wait.
  pool.enqueue(Quick(first));
  pool.enqueue(Quick(second));
  EXPECT_EQ(pool.threads(), 2);
  EXPECT_TRUE(first.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_TRUE(second.finished.WaitForNotificationWithTimeout(kBound));
}

TEST(ConnectionPoolTest, ShutdownRunsQueuedJobsAndJoinsEveryWorker) {
  absl::Notification gate;
  std::vector<Job> jobs(5);
  std::atomic<int> finished = 0;
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/3, "sdm-test-pool", NeverRefused());
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  for (Job& job : jobs) {
    pool.enqueue([&job, &gate, &finished] {
      job.started.Notify();
      gate.WaitForNotificationWithTimeout(kBound);
      finished.fetch_add(1);
    });
  }
  // Three run (the base worker and two started for them); two are queued.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(jobs[i].started.WaitForNotificationWithTimeout(kBound));
  EXPECT_EQ(pool.threads(), 3);
  EXPECT_EQ(pool.queued(), 2);
  std::thread stopper([&pool] { pool.shutdown(); });
  Open(gate);
  stopper.join();
  // shutdown() returned only after the queued jobs ran and every worker ended.
  EXPECT_EQ(finished.load(), 5);
  EXPECT_EQ(pool.threads(), 0);
  EXPECT_EQ(pool.queued(), 0);
  pool.shutdown();  // again: nothing to do
}

TEST(ConnectionPoolTest, TheDestructorJoinsWithoutShutdown) {
  std::atomic<int> finished = 0;
  {
    ConnectionPool pool(/*base_threads=*/2, /*max_threads=*/4, "sdm-test-pool");
    for (int i = 0; i < 6; ++i) pool.enqueue([&finished] { finished.fetch_add(1); });
  }
  EXPECT_EQ(finished.load(), 6);
}

// A burst of connections left its threads until shutdown: a pool that had served 4 at once kept 4
// threads, idle, with 1 connection open or none.
TEST(ConnectionPoolTest, WorkersAboveTheBaseExitOnceIdleForTheTimeout) {
  constexpr absl::Duration kIdle = absl::Seconds(60);
  FakeClock clock;
  absl::Notification gate;
  std::vector<Job> burst(4);
  ConnectionPoolOptions options = WithClock(clock, kIdle);
  options.refusal_threads = 0;  // the process's threads are the workers' and the test's
  const int threads_before = ProcessThreads();
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/8, "sdm-test-pool", options);
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  for (Job& job : burst) pool.enqueue(Blocking(job, gate));
  for (Job& job : burst) ASSERT_TRUE(job.started.WaitForNotificationWithTimeout(kBound));
  EXPECT_EQ(pool.threads(), 4);
  Open(gate);
  ASSERT_TRUE(pool.AwaitIdleForTesting(4, kBound));
  // (/proc lists a thread a moment after its join returns: waited for, not raced.)
  EXPECT_TRUE(Eventually([&] { return ProcessThreads() == threads_before + 4; }));
  // Idle for less than the timeout: every worker stays.
  clock.Advance(kIdle - absl::Nanoseconds(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.threads(), 4);
  // Idle for the timeout: the three above the base exit, and are joined.
  clock.Advance(absl::Nanoseconds(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.threads(), 1);
  EXPECT_TRUE(Eventually([&] { return ProcessThreads() == threads_before + 1; }));
  // The base worker stays however long it is idle.
  clock.Advance(absl::Hours(24));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.threads(), 1);
  // The pool grows again with the next burst.
  absl::Notification second_gate;
  absl::Cleanup open_second_gate = [&second_gate] { Open(second_gate); };
  std::vector<Job> again(3);
  for (Job& job : again) pool.enqueue(Blocking(job, second_gate));
  for (Job& job : again) ASSERT_TRUE(job.started.WaitForNotificationWithTimeout(kBound));
  EXPECT_EQ(pool.threads(), 3);
  Open(second_gate);
  pool.shutdown();
  EXPECT_EQ(pool.threads(), 0);
  EXPECT_TRUE(Eventually([&] { return ProcessThreads() == threads_before; }));
}

// The idle time starts again after each job: a worker that served a connection 30 s ago, after
// 30 s idle, stays. With no base, the last worker exits too, and a later job starts a new one.
TEST(ConnectionPoolTest, TheIdleTimeCountsFromTheLastJob) {
  constexpr absl::Duration kIdle = absl::Seconds(60);
  FakeClock clock;
  Job first, second, third;
  ConnectionPool pool(/*base_threads=*/0, /*max_threads=*/2, "sdm-test-pool",
                      WithClock(clock, kIdle));
  EXPECT_EQ(pool.threads(), 0);
  pool.enqueue(Quick(first));
  ASSERT_TRUE(first.finished.WaitForNotificationWithTimeout(kBound));
  ASSERT_TRUE(pool.AwaitIdleForTesting(1, kBound));
  EXPECT_EQ(pool.threads(), 1);
  clock.Advance(absl::Seconds(30));
  pool.enqueue(Quick(second));  // taken by the idle worker
  ASSERT_TRUE(second.finished.WaitForNotificationWithTimeout(kBound));
  ASSERT_TRUE(pool.AwaitIdleForTesting(1, kBound));
  EXPECT_EQ(pool.threads(), 1);
  clock.Advance(absl::Seconds(30));  // 60 s since the worker started, 30 s since its last job
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.threads(), 1);
  clock.Advance(absl::Seconds(30));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.threads(), 0);
  pool.enqueue(Quick(third));
  EXPECT_TRUE(third.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_EQ(pool.threads(), 1);
}

// On the machine's clock, the workers decide for themselves (no test hook): with a zero timeout
// the workers above the base exit as soon as they are idle, and the next enqueue() joins them.
TEST(ConnectionPoolTest, OnTheRealClockIdleWorkersExitOnTheirOwn) {
  absl::Notification gate;
  std::vector<Job> burst(3);
  ConnectionPoolOptions options;
  options.idle_timeout = absl::ZeroDuration();
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/4, "sdm-test-pool", options);
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  for (Job& job : burst) pool.enqueue(Blocking(job, gate));
  for (Job& job : burst) ASSERT_TRUE(job.started.WaitForNotificationWithTimeout(kBound));
  EXPECT_EQ(pool.threads(), 3);
  Open(gate);
  EXPECT_TRUE(Eventually([&pool] { return pool.threads() == 1; }));
  Job after;
  pool.enqueue(Quick(after));
  EXPECT_TRUE(after.finished.WaitForNotificationWithTimeout(kBound));
}

// shutdown() racing workers that are exiting: every thread is joined once (a thread joined twice,
// or destroyed unjoined, aborts the test).
TEST(ConnectionPoolTest, ShutdownWhileWorkersExitJoinsEachOnce) {
  for (int round = 0; round < 50; ++round) {
    absl::Notification gate;
    std::vector<Job> burst(4);
    ConnectionPoolOptions options;
    options.idle_timeout = absl::ZeroDuration();
    ConnectionPool pool(/*base_threads=*/0, /*max_threads=*/4, "sdm-test-pool", options);
    absl::Cleanup open_gate = [&gate] { Open(gate); };
    for (Job& job : burst) pool.enqueue(Blocking(job, gate));
    for (Job& job : burst) ASSERT_TRUE(job.started.WaitForNotificationWithTimeout(kBound));
    Open(gate);
    if (round % 2 == 1) {
      Job next;
      pool.enqueue(Quick(next));  // joins those that have exited
      ASSERT_TRUE(next.finished.WaitForNotificationWithTimeout(kBound));
    }
    pool.shutdown();
    EXPECT_EQ(pool.threads(), 0);
  }
}

// At the cap (or when the system refuses a thread) a job waited without bound: a connection got
// no answer until another closed. Once it has waited max_wait it is run as refused (the server
// answers 503), on a refusal thread, while the only worker is still busy.
TEST(ConnectionPoolTest, AJobThatWaitedMaxWaitIsRefused) {
  constexpr absl::Duration kMaxWait = absl::Seconds(1);
  FakeClock clock;
  absl::Notification gate;
  Job holder, waiting, later;
  std::atomic<bool> waiting_refused = false, later_refused = true;
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/1, "sdm-test-pool",
                      WithClock(clock, absl::Seconds(60), kMaxWait));
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  pool.enqueue(Blocking(holder, gate));
  ASSERT_TRUE(holder.started.WaitForNotificationWithTimeout(kBound));
  pool.enqueue(Recording(waiting, waiting_refused));
  EXPECT_EQ(pool.queued(), 1);
  clock.Advance(kMaxWait - absl::Nanoseconds(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.queued(), 1);
  EXPECT_EQ(pool.refused(), 0);
  EXPECT_FALSE(waiting.started.HasBeenNotified());
  clock.Advance(absl::Nanoseconds(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.queued(), 0);
  EXPECT_EQ(pool.refused(), 1);
  ASSERT_TRUE(waiting.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_TRUE(waiting_refused.load());
  EXPECT_FALSE(holder.finished.HasBeenNotified()) << "it ran on the only worker";
  EXPECT_EQ(pool.threads(), 1);
  // Once the worker is free, a job runs on it as usual.
  Open(gate);
  pool.enqueue(Recording(later, later_refused));
  ASSERT_TRUE(later.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_FALSE(later_refused.load());
  EXPECT_EQ(pool.refused(), 1);
}

// Refused jobs are run in order, each on a refusal thread, never on the workers' (here one
// refusal thread for three); shutdown() runs those left, then joins the refusal thread.
TEST(ConnectionPoolTest, RefusedJobsRunInOrderAndShutdownRunsThoseLeft) {
  FakeClock clock;
  absl::Notification holder_gate, refused_gate;
  Job holder;
  std::vector<Job> refused(3);
  std::vector<int> order;
  absl::Mutex order_mu;
  ConnectionPoolOptions options = WithClock(clock, absl::Seconds(60), absl::Seconds(1));
  options.refusal_threads = 1;
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/1, "sdm-test-pool", options);
  absl::Cleanup open_gates = [&] {
    Open(holder_gate);
    Open(refused_gate);
  };
  pool.enqueue(Blocking(holder, holder_gate));
  ASSERT_TRUE(holder.started.WaitForNotificationWithTimeout(kBound));
  for (int i = 0; i < 3; ++i) {
    pool.enqueue([&, i] {
      EXPECT_TRUE(ConnectionPool::Refusing());
      {
        absl::MutexLock lock(&order_mu);
        order.push_back(i);
      }
      refused[i].started.Notify();
      refused_gate.WaitForNotificationWithTimeout(kBound);
      refused[i].finished.Notify();
    });
  }
  clock.Advance(absl::Seconds(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.refused(), 3);
  ASSERT_TRUE(refused[0].started.WaitForNotificationWithTimeout(kBound));
  EXPECT_FALSE(refused[1].started.HasBeenNotified()) << "one refusal thread";
  std::thread stopper([&pool] { pool.shutdown(); });
  Open(refused_gate);
  for (Job& job : refused) EXPECT_TRUE(job.finished.WaitForNotificationWithTimeout(kBound));
  Open(holder_gate);
  stopper.join();
  absl::MutexLock lock(&order_mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

// A worker that comes free while refused jobs wait for the refusal threads (held by slow
// clients) serves the oldest of them normally. Before, they waited behind the refusal threads,
// unanswered, while the worker sat idle.
TEST(ConnectionPoolTest, AWorkerThatComesFreeServesARefusedJobStillWaiting) {
  FakeClock clock;
  absl::Notification holder_gate, refusal_gate;
  Job holder, stuck, waiting;
  std::atomic<bool> stuck_refused = false, waiting_refused = true;
  ConnectionPoolOptions options = WithClock(clock, absl::Seconds(60), absl::Seconds(1));
  options.refusal_threads = 1;
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/1, "sdm-test-pool", options);
  absl::Cleanup open_gates = [&] {
    Open(holder_gate);
    Open(refusal_gate);
  };
  pool.enqueue(Blocking(holder, holder_gate));
  ASSERT_TRUE(holder.started.WaitForNotificationWithTimeout(kBound));
  pool.enqueue([&] {
    stuck_refused = ConnectionPool::Refusing();
    stuck.started.Notify();
    refusal_gate.WaitForNotificationWithTimeout(kBound);  // a slow client
    stuck.finished.Notify();
  });
  pool.enqueue(Recording(waiting, waiting_refused));
  clock.Advance(absl::Seconds(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.refused(), 2);
  ASSERT_TRUE(stuck.started.WaitForNotificationWithTimeout(kBound));
  EXPECT_TRUE(stuck_refused.load());
  EXPECT_FALSE(waiting.started.HasBeenNotified());
  Open(holder_gate);  // the worker comes free; the refusal thread is still held
  ASSERT_TRUE(waiting.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_FALSE(waiting_refused.load()) << "served on the worker";
  EXPECT_FALSE(stuck.finished.HasBeenNotified());
  Open(refusal_gate);
  pool.shutdown();
}

// refusal_threads 0: a job waits for a worker however long, as in httplib's ThreadPool.
TEST(ConnectionPoolTest, WithoutRefusalThreadsAJobWaitsForAWorker) {
  FakeClock clock;
  absl::Notification gate;
  Job holder, waiting;
  std::atomic<bool> waiting_refused = true;
  ConnectionPoolOptions options = WithClock(clock, absl::Seconds(60), absl::Seconds(1));
  options.refusal_threads = 0;
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/1, "sdm-test-pool", options);
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  pool.enqueue(Blocking(holder, gate));
  ASSERT_TRUE(holder.started.WaitForNotificationWithTimeout(kBound));
  pool.enqueue(Recording(waiting, waiting_refused));
  clock.Advance(absl::Hours(1));
  pool.ClockAdvancedForTesting();
  EXPECT_EQ(pool.queued(), 1);
  EXPECT_EQ(pool.refused(), 0);
  Open(gate);
  ASSERT_TRUE(waiting.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_FALSE(waiting_refused.load());
}

// On the machine's clock the refusal threads act on their own: with max_wait 0 a job that no
// worker can take is refused at once.
TEST(ConnectionPoolTest, OnTheRealClockAJobIsRefusedWithoutAHook) {
  absl::Notification gate;
  Job holder, waiting;
  std::atomic<bool> waiting_refused = false;
  ConnectionPoolOptions options;
  options.max_wait = absl::ZeroDuration();
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/1, "sdm-test-pool", options);
  absl::Cleanup open_gate = [&gate] { Open(gate); };
  pool.enqueue(Blocking(holder, gate));
  ASSERT_TRUE(holder.started.WaitForNotificationWithTimeout(kBound));
  pool.enqueue(Recording(waiting, waiting_refused));
  ASSERT_TRUE(waiting.finished.WaitForNotificationWithTimeout(kBound));
  EXPECT_TRUE(waiting_refused.load());
  EXPECT_FALSE(holder.finished.HasBeenNotified());
}

}  // namespace
}  // namespace sdm::testing
