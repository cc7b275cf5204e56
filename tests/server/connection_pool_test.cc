// ConnectionPool (server/http/connection_pool.h): a job arriving while every worker is busy gets a
// new worker up to the cap, waits past it, and shutdown() runs what is queued and joins every
// worker. Jobs stand for httplib's connections: each blocks on a gate until the test opens it.
// Waits are bounded (a minute), so that a pool that never runs a job fails instead of hanging, and
// a test that fails early opens its gates before its pool joins its workers.
#include "server/http/connection_pool.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

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
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/2, "sdm-test-pool");
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
  ConnectionPool pool(/*base_threads=*/1, /*max_threads=*/3, "sdm-test-pool");
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

}  // namespace
}  // namespace sdm::testing
