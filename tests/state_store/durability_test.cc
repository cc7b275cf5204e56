// Durability (state_store/session_store.h, "Durability"; docs/state-format.md): with the turn
// policy a session is on disk from its creation and after every turn, so that what a kill -9
// leaves in the directory restores each session bit-exactly to its last completed turn; failed
// writes are counted once per session, turn the store's health to UNAVAILABLE, and make it
// refuse new work once host memory is full; the store recovers when writes succeed again.
//
// A kill -9 is simulated by copying the state directory while the store is alive (what the disk
// holds at that instant) and opening a second store on the copy, as a restarted server would.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "state_store/session_store.h"
#include "state_store/state_codec.h"
#include "tests/base/captured_log.h"
#include "tests/engine/test_model_util.h"
#include "tests/state_store/fault_injection_files.h"
#include "tests/state_store/power_loss_files.h"
#include "tests/state_store/snapshot_test_util.h"

namespace sdm {
namespace {

using ::testing::Contains;
using testing::FaultInjectionFiles;
using ::testing::HasSubstr;
using testing::SessionWriteFiles;

constexpr int32_t kProbe = 42;

// The answer to a WhenPersisted call, shared with its callback (which a failing test may leave to
// run after the test's own scope is gone).
struct Ack {
  absl::Notification done;
  absl::Status saved = absl::InternalError("not answered");
};

std::shared_ptr<Ack> AskWhenPersisted(SessionStateStore& store, const std::string& id) {
  auto ack = std::make_shared<Ack>();
  store.WhenPersisted(id, [ack](const absl::Status& saved) {
    ack->saved = saved;
    ack->done.Notify();
  });
  return ack;
}

// Releases `lease` asking for the answer for its turn (SessionLease::ReleaseWhenPersisted).
std::shared_ptr<Ack> ReleaseAsking(SessionLease& lease) {
  auto ack = std::make_shared<Ack>();
  lease.ReleaseWhenPersisted([ack](const absl::Status& saved) {
    ack->saved = saved;
    ack->done.Notify();
  });
  return ack;
}

// The answer, waiting for it (a minute at most: never in a passing run).
absl::Status Answer(const Ack& ack) {
  if (!ack.done.WaitForNotificationWithTimeout(absl::Minutes(1))) {
    return absl::DeadlineExceededError("no answer within a minute");
  }
  return ack.saved;
}

// What a kill -9 leaves of `from`: a copy of its files in `to` (created).
void CopyFiles(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::create_directories(to);
  for (const auto& entry : std::filesystem::directory_iterator(from)) {
    if (entry.is_regular_file())
      std::filesystem::copy_file(entry.path(), to / entry.path().filename());
  }
}

class DurabilityTest : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = testing::TinyEngine(); }

  std::unique_ptr<SessionStateStore> OpenStore(const std::filesystem::path& dir,
                                               PersistPolicy persist, StateFiles* files,
                                               PersistSync sync = PersistSync::kWrite,
                                               double compact_ratio = kLogCompactRatio) {
    SessionStoreOptions options;
    options.log_compact_ratio = compact_ratio;
    options.dir = dir;
    options.files = files;
    options.persist = persist;
    options.persist_sync = sync;
    options.background = false;  // writes run inline at each change: deterministic
    options.host_budget_bytes = host_budget_;
    auto store = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // A store with its worker and writers (background), `writers` threads writing in all.
  std::unique_ptr<SessionStateStore> OpenWithWriters(const std::filesystem::path& dir,
                                                     StateFiles* files, int writers) {
    SessionStoreOptions options;
    options.dir = dir;
    options.files = files;
    options.persist_writers = writers;
    auto store = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // Holds the store's only writer (persist_writers 1) in a write of session "blocker", created
  // and written first: while it is held, the writers write nothing else.
  void HoldTheWriter(SessionStateStore& store, SessionWriteFiles& files) {
    ASSERT_TRUE(store.Create("blocker", "").ok());
    ASSERT_TRUE(Answer(*AskWhenPersisted(store, "blocker")).ok());
    files.Hold(SessionFileStem(SessionKey("blocker")));
    Turn(store, "blocker", testing::RandomTokens(2, 99));
    ASSERT_TRUE(files.WaitHeld(absl::Minutes(1)));
  }

  // One turn: feeds `tokens` to the session through a lease (returned at the end of the turn).
  void Turn(SessionStateStore& store, const std::string& id, const std::vector<int32_t>& tokens) {
    auto lease = store.Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), tokens);
  }

  // What a kill -9 at this instant leaves: a copy of the directory's snapshots.
  std::filesystem::path CrashCopy() {
    const std::filesystem::path copy = crash_dir_.path() / std::to_string(++crashes_);
    CopyFiles(dir_.path(), copy);
    return copy;
  }

  // The probe logits of a copy of `id` in `store` (the session itself is left as it is).
  std::vector<float> Probe(SessionStateStore& store, const std::string& id, int64_t* position) {
    auto lease = store.Acquire(id);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return {};
    *position = lease->state().position();
    auto copy = lease->state().Clone();
    return testing::ProbeLogits(*engine_, *copy, kProbe);
  }

  // The session `id` of `store` is `reference`: its position, and bit for bit its logits.
  void ExpectHolds(SessionStateStore& store, const std::string& id, const SessionState& reference) {
    int64_t position = -1;
    const std::vector<float> got = Probe(store, id, &position);
    auto want_state = reference.Clone();
    EXPECT_EQ(position, reference.position());
    EXPECT_TRUE(testing::BitwiseEqual(got, testing::ProbeLogits(*engine_, *want_state, kProbe)));
  }

  // What a kill -9 at this instant leaves of the store's directory restores `id` to `reference`.
  void ExpectCrashCopyHolds(const std::string& id, const SessionState& reference) {
    auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_NE(restarted, nullptr);
    ExpectHolds(*restarted, id, reference);
  }

  // One turn (as Turn) whose lease is released asking for its answer (ReleaseAsking); nullptr
  // (a failure added) when the session cannot be leased.
  std::shared_ptr<Ack> TurnAsking(SessionStateStore& store, const std::string& id,
                                  const std::vector<int32_t>& tokens) {
    auto lease = store.Acquire(id);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return nullptr;
    testing::DecodeEach(*engine_, lease->state(), tokens);
    std::shared_ptr<Ack> ack = ReleaseAsking(*lease);
    EXPECT_FALSE(*lease);  // released
    return ack;
  }

  // The compaction rule's bound on a log (SessionStoreOptions::log_compact_ratio): the ratio
  // times the larger of the snapshot on disk and the snapshot the session would write now (that
  // of `reference`, the same state; a little slack for the record, which names the session).
  double LogBound(double ratio, uint64_t snapshot_file, const SessionState& reference) {
    const uint64_t now = SessionStateSource(reference, SessionRecord{"s", ""}, 0).size() + 64;
    return ratio * static_cast<double>(std::max(snapshot_file, now));
  }

  testing::ScopedTempDir dir_, crash_dir_;
  std::unique_ptr<Engine> engine_;
  int64_t host_budget_ = int64_t{1} << 30;
  int crashes_ = 0;
};

// Property: after every turn of several sessions (fixed and fresh seeds), a crash restores each
// session bit-exactly to a reference that never left the engine.
// Both sync policies: a kill -9 loses nothing the kernel was handed (the copy reads what the
// page cache holds, as a restarted process would).
// Two stores never write one directory unawares: another store is refused before it reads or
// moves anything (here one of another model, which would have quarantined every session),
// naming the process that holds it; once that store is closed, the directory opens.
TEST_F(DurabilityTest, ADirectoryIsHeldByOneStoreAlone) {
  auto first = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_NE(first, nullptr);
  ASSERT_TRUE(first->Create("s", "").ok());
  Turn(*first, "s", testing::RandomTokens(5, 1));
  for (const bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared" : "alone");
    SessionStoreOptions options;
    options.dir = dir_.path();
    options.background = false;
    options.shared_dir = shared;
    auto second =
        SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint() ^ 1, options);
    ASSERT_FALSE(second.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
    EXPECT_THAT(std::string(second.status().message()),
                HasSubstr(absl::StrCat("in use by process ", ::getpid())));
  }
  EXPECT_TRUE(std::filesystem::exists(dir_.path() / "s.sdmstate"));
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path() / "quarantine"));
  first.reset();
  auto again = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(again->Get("s").ok());
}

// A file system without locks (some network file systems): the store opens, and says that
// nothing keeps another server out.
TEST_F(DurabilityTest, AFileSystemWithoutLocksOpensAndSaysSo) {
  FaultInjectionFiles files;
  files.FailNext(FaultInjectionFiles::Op::kLock,
                 {absl::UnimplementedError("cannot lock LOCK: No locks available")});
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files);
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(store->open_errors(), Contains(HasSubstr("nothing stops another server")));
  ASSERT_TRUE(store->Create("s", "").ok());
}

TEST_F(DurabilityTest, EveryTurnSurvivesAKill) {
  const uint32_t fresh = std::random_device{}();
  for (auto [seed, sync] : {std::pair{1u, PersistSync::kWrite}, std::pair{2u, PersistSync::kFsync},
                            std::pair{fresh, PersistSync::kWrite}}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << ", sync " << PersistSyncName(sync));
    testing::ScopedTempDir dir;
    auto store = OpenStore(dir.path(), PersistPolicy::kTurn, StateFiles::Default(), sync);
    ASSERT_NE(store, nullptr);
    std::mt19937 rng(seed);
    const std::vector<std::string> ids = {"a", "b", "c"};
    std::vector<std::unique_ptr<SessionState>> reference;
    for (const std::string& id : ids) {
      ASSERT_TRUE(store->Create(id, "meta-" + id).ok());
      reference.push_back(engine_->NewSession());
    }
    for (int turn = 0; turn < 4; ++turn) {
      const int s = static_cast<int>(rng() % ids.size());
      const std::vector<int32_t> tokens =
          testing::RandomTokens(1 + static_cast<int>(rng() % 12), rng());
      Turn(*store, ids[s], tokens);
      testing::DecodeEach(*engine_, *reference[s], tokens);
      EXPECT_EQ(store->Stats().unpersisted, 0);

      // kill -9 now: a store opened on what the disk holds has every session at its last turn.
      testing::ScopedTempDir copy;
      CopyFiles(dir.path(), copy.path());
      auto restarted = OpenStore(copy.path(), PersistPolicy::kTurn, StateFiles::Default());
      ASSERT_NE(restarted, nullptr);
      ASSERT_TRUE(restarted->open_errors().empty());
      for (size_t i = 0; i < ids.size(); ++i) {
        int64_t position = -1;
        const std::vector<float> got = Probe(*restarted, ids[i], &position);
        auto want_state = reference[i]->Clone();
        const std::vector<float> want = testing::ProbeLogits(*engine_, *want_state, kProbe);
        EXPECT_EQ(position, reference[i]->position()) << ids[i];
        EXPECT_TRUE(testing::BitwiseEqual(got, want)) << ids[i] << " after turn " << turn;
        auto info = restarted->Get(ids[i]);
        ASSERT_TRUE(info.ok());
        EXPECT_EQ(info->metadata, "meta-" + ids[i]);
      }
    }
  }
}

TEST_F(DurabilityTest, ASessionIsOnDiskFromItsCreationAndItsFork) {
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_TRUE(store->Create("s", "").ok());
  Turn(*store, "s", testing::RandomTokens(5, 3));
  ASSERT_TRUE(store->Fork("s", "f", "").ok());
  auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
  int64_t position = -1;
  Probe(*restarted, "s", &position);
  EXPECT_EQ(position, 5);
  Probe(*restarted, "f", &position);
  EXPECT_EQ(position, 5);
}

TEST_F(DurabilityTest, TheShutdownPolicyWritesOnlyWhenParkedOrPersisted) {
  auto store = OpenStore(dir_.path(), PersistPolicy::kShutdown, StateFiles::Default());
  ASSERT_TRUE(store->Create("s", "").ok());
  Turn(*store, "s", testing::RandomTokens(5, 3));
  EXPECT_EQ(store->Stats().unpersisted, 1);
  auto lost = OpenStore(CrashCopy(), PersistPolicy::kShutdown, StateFiles::Default());
  EXPECT_EQ(lost->Get("s").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store->PersistAll().ok());
  EXPECT_EQ(store->Stats().unpersisted, 0);
  auto kept = OpenStore(CrashCopy(), PersistPolicy::kShutdown, StateFiles::Default());
  EXPECT_TRUE(kept->Get("s").ok());
}

TEST_F(DurabilityTest, TheIdlePolicyWritesOnceTheSessionHasBeenIdleLongEnough) {
  auto store = OpenStore(dir_.path(), PersistPolicy::kIdle, StateFiles::Default());
  ASSERT_TRUE(store->Create("s", "").ok());
  Turn(*store, "s", testing::RandomTokens(5, 3));
  const absl::Time used = store->Get("s")->last_used;
  const absl::Duration idle = SessionStoreOptions{}.persist_idle;
  EXPECT_EQ(store->PersistChanged(used + idle / 2), 0);
  EXPECT_EQ(store->Stats().unpersisted, 1);
  EXPECT_EQ(store->PersistChanged(used + idle), 1);
  EXPECT_EQ(store->Stats().unpersisted, 0);
  EXPECT_EQ(store->PersistChanged(used + 2 * idle), 0);  // nothing changed since
}

// Writes are coalesced: a session written after its last turn is not written again by a park or
// a shutdown, and each byte of its files was written once. The first turn of a session created
// empty is a delta: the log is bounded by the snapshot the session would write now, not by the
// empty one of its creation.
TEST_F(DurabilityTest, ACurrentSnapshotIsNotWrittenTwice) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files);
  ASSERT_TRUE(store->Create("s", "").ok());
  Turn(*store, "s", testing::RandomTokens(7, 3));
  const int writes = files.calls(FaultInjectionFiles::Op::kWriteAndSync);
  EXPECT_EQ(writes, 1);                                          // created
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAt), 1);  // one turn, appended
  const StoreStats stats = store->Stats();
  EXPECT_EQ(stats.persist_writes, 2);
  EXPECT_EQ(stats.persist_deltas, 1);
  const int64_t file_bytes =
      static_cast<int64_t>(std::filesystem::file_size(dir_.path() / "s.sdmstate") +
                           std::filesystem::file_size(dir_.path() / "s.sdmlog"));
  EXPECT_EQ(stats.persist_bytes, file_bytes);
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  ASSERT_TRUE(store->PersistAll().ok());
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAndSync), writes);
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAt), 1);
  EXPECT_EQ(store->Get("s")->tier, Tier::kDisk);
  EXPECT_EQ(store->Stats().bytes[static_cast<int>(Tier::kDisk)], file_bytes);
  // It resumes from those files, and its next turn is written again: as a delta appended to its
  // log, not as a snapshot.
  Turn(*store, "s", testing::RandomTokens(2, 4));
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAndSync), writes);
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAt), 2);
  EXPECT_EQ(store->Stats().persist_deltas, 2);
}

// New metadata of a parked session reaches its snapshot. Its record (with the metadata) is part
// of the serialised form: the host tier's blob and the disk tier's snapshot (deltas never carry
// it). A session on host memory was written from its blob, old metadata and all; one on disk was
// not written at all (its entry changed, its file did not), so a restart lost the metadata. A
// parked session's record is now written again: on host by the persist policy (here, at once),
// on disk at once, whatever the policy, with the turns its delta log held, and it stays on disk.
TEST_F(DurabilityTest, MetadataSetOnAParkedSessionIsWritten) {
  for (const PersistPolicy persist : {PersistPolicy::kTurn, PersistPolicy::kShutdown}) {
    for (const Tier tier : {Tier::kHost, Tier::kDisk}) {
      if (persist == PersistPolicy::kShutdown && tier == Tier::kHost) continue;  // not written
      SCOPED_TRACE(::testing::Message() << PersistPolicyName(persist) << ", " << TierName(tier));
      testing::ScopedTempDir dir;
      auto store = OpenStore(dir.path(), persist, StateFiles::Default());
      ASSERT_NE(store, nullptr);
      ASSERT_TRUE(store->Create("s", "old").ok());
      // Two turns: with the turn policy the second is a delta in the session's log, which the
      // rewrite must carry.
      auto reference = engine_->NewSession();
      for (const auto& tokens : {testing::RandomTokens(6, 1), testing::RandomTokens(3, 2)}) {
        Turn(*store, "s", tokens);
        testing::DecodeEach(*engine_, *reference, tokens);
      }
      ASSERT_TRUE(store->Park("s", tier).ok());
      if (persist == PersistPolicy::kTurn) {
        ASSERT_TRUE(std::filesystem::exists(dir.path() / "s.sdmlog"));
      }

      ASSERT_TRUE(store->SetMetadata("s", "new").ok());
      EXPECT_EQ(store->Get("s")->metadata, "new");
      EXPECT_EQ(store->Get("s")->tier, tier);
      EXPECT_EQ(store->Stats().unpersisted, 0);
      EXPECT_FALSE(std::filesystem::exists(dir.path() / "s.sdmlog"));  // in the snapshot now

      // A kill -9 now: the files hold the new metadata and every turn.
      const std::filesystem::path copy =
          crash_dir_.path() / absl::StrCat(PersistPolicyName(persist), "-", TierName(tier));
      CopyFiles(dir.path(), copy);
      auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
      ASSERT_NE(restarted, nullptr);
      ASSERT_TRUE(restarted->open_errors().empty()) << restarted->open_errors()[0];
      absl::StatusOr<SessionInfo> info = restarted->Get("s");
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->metadata, "new");
      EXPECT_EQ(info->position, 9);
      int64_t position = -1;
      EXPECT_TRUE(testing::BitwiseEqual(Probe(*restarted, "s", &position),
                                        testing::ProbeLogits(*engine_, *reference, kProbe)));
      EXPECT_EQ(position, 9);
    }
  }
}

// A read-only or full state directory: every write fails. The failure is counted once per
// session, health names the cause, new work is refused once host memory is full, and everything
// recovers when writes succeed again.
TEST_F(DurabilityTest, FailedWritesAreLoudAndBoundedAndRecover) {
  testing::CapturedLog log;
  FaultInjectionFiles files;
  host_budget_ = 1;  // any parked session fills host memory
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files);
  ASSERT_TRUE(store->Create("a", "").ok());
  ASSERT_TRUE(store->PersistHealth().ok());

  files.FailWritesAlways(absl::PermissionDeniedError("injected: Read-only file system"));
  ASSERT_TRUE(store->Create("b", "").ok());  // host memory is still empty: accepted
  Turn(*store, "a", testing::RandomTokens(3, 5));
  Turn(*store, "a", testing::RandomTokens(3, 6));
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.persist_failures, 2);  // a and b, once each however often retried
  EXPECT_GE(stats.snapshot_errors, 3);   // every attempt
  EXPECT_EQ(stats.unpersisted, 2);
  const absl::Status health = store->PersistHealth();
  EXPECT_EQ(health.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(health.message().find("Read-only file system"), std::string::npos) << health;

  // Parking to host memory still works (it is memory, not disk) and fills it.
  ASSERT_TRUE(store->Park("b", Tier::kHost).ok());
  EXPECT_GT(store->Stats().bytes[static_cast<int>(Tier::kHost)], host_budget_);
  // Now the store can neither write nor hold more: new work is refused, retryably.
  EXPECT_EQ(store->Create("c", "").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store->Acquire("a").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store->Get("c").status().code(), absl::StatusCode::kNotFound);
  // Parking to disk fails loudly too, and leaves the session in memory.
  EXPECT_FALSE(store->Park("b", Tier::kDisk).ok());
  EXPECT_EQ(store->Get("b")->tier, Tier::kHost);
  // Loud once: one line for the cause, however many sessions and retries failed.
  EXPECT_EQ(log.With("cannot persist session").size(), 1u);

  // The disk comes back: the next pass writes everything and health recovers, with one line
  // saying how many failures were not logged.
  files.ClearFaults();
  EXPECT_EQ(store->PersistChanged(absl::Now()), 2);
  EXPECT_TRUE(store->PersistHealth().ok());
  const std::vector<std::string> recovered = log.With("session state is written again");
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_THAT(recovered[0], ::testing::HasSubstr("more failed writes meanwhile, not logged"));
  EXPECT_EQ(store->Stats().unpersisted, 0);
  EXPECT_TRUE(store->Create("c", "").ok());
  auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
  int64_t position = -1;
  Probe(*restarted, "a", &position);
  EXPECT_EQ(position, 6);
}

TEST_F(DurabilityTest, HealthRecoversWhenTheFailingSessionsAreGone) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files);
  files.FailWritesAlways(absl::ResourceExhaustedError("injected: No space left on device"));
  ASSERT_TRUE(store->Create("a", "").ok());
  EXPECT_FALSE(store->PersistHealth().ok());
  ASSERT_TRUE(store->Delete("a").ok());
  store->PersistChanged(absl::Now());
  EXPECT_TRUE(store->PersistHealth().ok());
}

// A crash in the middle of appending a turn's delta: the restarted store has the session at its
// previous turn, bit-exactly, and its next turn is appended after the last good record (the torn
// bytes are overwritten), so a second restart has that turn too.
TEST_F(DurabilityTest, ATornDeltaLeavesThePreviousTurnAndIsWrittenOver) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  for (const auto& tokens : {testing::RandomTokens(40, 1), testing::RandomTokens(2, 2)}) {
    Turn(*store, "s", tokens);
    testing::DecodeEach(*engine_, *reference, tokens);
  }
  ASSERT_GT(store->Stats().persist_deltas, 0) << "the second turn should have been a delta";
  const int64_t turn2 = reference->position();
  auto want2_state = reference->Clone();
  const std::vector<float> want2 = testing::ProbeLogits(*engine_, *want2_state, kProbe);

  files.set_crash_at_fault(true);
  files.FailNext(FaultInjectionFiles::Op::kWriteAt,
                 {absl::InternalError("injected: killed mid-append"), 0, /*partial_bytes=*/30});
  Turn(*store, "s", testing::RandomTokens(3, 3));
  ASSERT_TRUE(files.crashed());

  const std::filesystem::path crashed = CrashCopy();
  {
    FaultInjectionFiles files2;
    auto restarted = OpenStore(crashed, PersistPolicy::kTurn, &files2);
    // Said at start-up: a session behind what a client saw can be explained.
    ASSERT_EQ(restarted->open_errors().size(), 1u);
    EXPECT_THAT(restarted->open_errors()[0],
                HasSubstr("its last 30 bytes are not a whole record (a write cut short: a torn "
                          "tail), dropped"));
    int64_t position = -1;
    EXPECT_TRUE(testing::BitwiseEqual(Probe(*restarted, "s", &position), want2));
    EXPECT_EQ(position, turn2);
    // Another turn: appended where the last good record ends.
    const std::vector<int32_t> next = testing::RandomTokens(4, 4);
    Turn(*restarted, "s", next);
    testing::DecodeEach(*engine_, *reference, next);
    // Appended (the probe's lease and this turn each append a record: the log may grow to
    // kLogCompactRatio times the snapshot), never as a snapshot; the restart below reads them
    // after the last good record, where the torn bytes were.
    EXPECT_EQ(files2.calls(FaultInjectionFiles::Op::kWriteAt), 2);
    EXPECT_EQ(files2.calls(FaultInjectionFiles::Op::kWriteAndSync), 0);
  }
  const std::filesystem::path again = crash_dir_.path() / "again";
  CopyFiles(crashed, again);
  auto restarted = OpenStore(again, PersistPolicy::kTurn, StateFiles::Default());
  int64_t position = -1;
  const std::vector<float> got = Probe(*restarted, "s", &position);
  auto want_state = reference->Clone();
  EXPECT_TRUE(testing::BitwiseEqual(got, testing::ProbeLogits(*engine_, *want_state, kProbe)));
  EXPECT_EQ(position, reference->position());
}

// A flipped bit in the size of a record in the middle of a session's log: the session is
// quarantined (DATA_LOSS at Open and at Acquire, its files kept), not rolled back silently to the
// turn before that record, as when the size was taken on trust and read as a torn tail.
TEST_F(DurabilityTest, ADamagedRecordSizeInTheLogQuarantinesTheSession) {
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_TRUE(store->Create("s", "").ok());
  for (uint32_t turn = 0; turn < 3; ++turn) Turn(*store, "s", testing::RandomTokens(2, turn));
  ASSERT_EQ(store->Stats().persist_deltas, 3);
  const std::filesystem::path copy = CrashCopy();
  std::string log = testing::ReadFile(copy / "s.sdmlog");
  const std::vector<size_t> records = testing::LogRecordOffsets(log);
  ASSERT_EQ(records.size(), 3u);
  log[records[1] + 7] ^= 0x40;  // the size claims far more than the log holds
  testing::WriteFile(copy / "s.sdmlog", log);

  auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_EQ(restarted->open_errors().size(), 1u);
  EXPECT_NE(restarted->open_errors()[0].find("failed its checksum"), std::string::npos)
      << restarted->open_errors()[0];
  EXPECT_EQ(restarted->Acquire("s").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(std::filesystem::exists(copy / "s.sdmlog"));    // moved to quarantine/, with
  EXPECT_FALSE(std::filesystem::exists(copy / "s.sdmstate"));  // its snapshot
}

// A session whose log a previous build wrote (version 1: docs/state-format.md, "Delta log") is
// read with it, and its next write is a full snapshot that replaces that log: a record of the
// current version is never appended to a log of another.
TEST_F(DurabilityTest, AVersionOneLogIsReadAndReplacedByTheNextWrite) {
  auto reference = engine_->NewSession();
  {
    auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_TRUE(store->Create("s", "").ok());
    for (uint32_t turn = 0; turn < 2; ++turn) {
      const std::vector<int32_t> tokens = testing::RandomTokens(3, turn);
      Turn(*store, "s", tokens);
      testing::DecodeEach(*engine_, *reference, tokens);
    }
    ASSERT_EQ(store->Stats().persist_deltas, 2);
  }
  const std::filesystem::path log = dir_.path() / "s.sdmlog";
  testing::WriteFile(log, testing::ToVersion1Log(testing::ReadFile(log)));
  {
    FaultInjectionFiles files;
    auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files);
    ASSERT_TRUE(store->open_errors().empty()) << store->open_errors()[0];
    EXPECT_EQ(store->Get("s")->position, 6);
    const std::vector<int32_t> tokens = testing::RandomTokens(4, 9);
    Turn(*store, "s", tokens);
    testing::DecodeEach(*engine_, *reference, tokens);
    EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAt), 0);
    EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAndSync), 1);
    EXPECT_FALSE(std::filesystem::exists(log));
    // The turn after it is a delta again, in a log of the current version.
    Turn(*store, "s", {});
    EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAt), 1);
  }
  auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_TRUE(restarted->open_errors().empty()) << restarted->open_errors()[0];
  int64_t position = -1;
  EXPECT_TRUE(testing::BitwiseEqual(Probe(*restarted, "s", &position),
                                    testing::ProbeLogits(*engine_, *reference, kProbe)));
  EXPECT_EQ(position, 10);
}

// A crash during a log's first append (its header and first record, written together) can leave
// the log shorter than its header, or (a power loss that kept the file's size, not its data) a
// header of zeros. It held no acknowledged record: the session restarts from its snapshot with
// no open error (it was quarantined, answering DATA_LOSS, though the snapshot held every
// acknowledged turn), and its later turns are written and restored.
TEST_F(DurabilityTest, ACrashDuringALogsFirstAppendLeavesTheSnapshot) {
  struct Cut {
    int64_t partial_bytes;
    bool zero_header;
  };
  for (const Cut cut : {Cut{0, false}, Cut{20, false}, Cut{39, false}, Cut{0, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << "cut at " << cut.partial_bytes << (cut.zero_header ? ", header of zeros" : ""));
    const std::filesystem::path dir =
        dir_.path() / absl::StrCat("cut", cut.partial_bytes, cut.zero_header ? "z" : "");
    FaultInjectionFiles files;
    auto store = OpenStore(dir, PersistPolicy::kTurn, &files);
    auto reference = engine_->NewSession();
    // Created: a snapshot of the empty session, no log. Its first turn is the log's first
    // append (a session created empty logs its first turns), killed part-way.
    ASSERT_TRUE(store->Create("s", "").ok());
    files.set_crash_at_fault(true);
    files.FailNext(
        FaultInjectionFiles::Op::kWriteAt,
        {absl::InternalError("injected: killed in the first append"), 0, cut.partial_bytes});
    Turn(*store, "s", testing::RandomTokens(2, 2));
    ASSERT_TRUE(files.crashed()) << "the turn should have been the log's first append";
    store.reset();

    const std::filesystem::path crashed = crash_dir_.path() / dir.filename();
    CopyFiles(dir, crashed);
    int logs = 0;
    for (const auto& f : std::filesystem::directory_iterator(crashed)) {
      if (f.path().extension() != ".sdmlog") continue;
      ++logs;
      EXPECT_EQ(std::filesystem::file_size(f.path()), cut.partial_bytes);
      if (cut.zero_header) std::filesystem::resize_file(f.path(), 64);  // zeros
    }
    ASSERT_EQ(logs, 1) << "the torn first append left its log";
    auto restarted = OpenStore(crashed, PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_TRUE(restarted->open_errors().empty()) << restarted->open_errors()[0];
    int64_t position = -1;
    auto empty = engine_->NewSession();
    EXPECT_TRUE(testing::BitwiseEqual(Probe(*restarted, "s", &position),
                                      testing::ProbeLogits(*engine_, *empty, kProbe)));
    EXPECT_EQ(position, 0);
    // The next turns are written (a new log) and restore after another restart.
    for (uint32_t seed : {3u, 4u}) {
      const std::vector<int32_t> next = testing::RandomTokens(3, seed);
      Turn(*restarted, "s", next);
      testing::DecodeEach(*engine_, *reference, next);
    }
    restarted.reset();
    auto again = OpenStore(crashed, PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_TRUE(again->open_errors().empty()) << again->open_errors()[0];
    auto want_state = reference->Clone();
    EXPECT_TRUE(testing::BitwiseEqual(Probe(*again, "s", &position),
                                      testing::ProbeLogits(*engine_, *want_state, kProbe)));
    EXPECT_EQ(position, reference->position());
  }
}

// --persist_sync=fsync: a log's first append that failed after creating the file is retried;
// the retry finds the file there, and must still fsync the directory (the file's entry never
// was), or a power loss could lose the log with its acknowledged turn.
TEST_F(DurabilityTest, ARetriedFirstLogAppendFsyncsTheDirectory) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kFsync);
  ASSERT_TRUE(store->Create("s", "").ok());
  files.FailNext(FaultInjectionFiles::Op::kWriteAt,
                 {absl::InternalError("injected: I/O error"), 0, /*partial_bytes=*/0});
  Turn(*store, "s", testing::RandomTokens(3, 50));  // the log's first append: fails
  ASSERT_EQ(files.faults_fired(), 1);
  ASSERT_EQ(store->Stats().unpersisted, 1);
  const int dir_syncs = files.calls(FaultInjectionFiles::Op::kSyncDir);
  const int64_t deltas = store->Stats().persist_deltas;
  EXPECT_EQ(store->PersistChanged(absl::Now()), 1);
  ASSERT_EQ(store->Stats().persist_deltas, deltas + 1) << "the retry should append the log";
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kSyncDir), dir_syncs + 1);
  EXPECT_TRUE(store->PersistHealth().ok());
}

// A snapshot write that fails after its rename (the directory's fsync) may have replaced the
// snapshot the session's log extends: the log's base is then unknown, and a delta appended to it
// would be dropped as stale at the next read, taking every turn since with it. So the next write
// after a failed snapshot is a snapshot. Here with full attention (the snapshot grows with every
// token, so a long turn after the failure fits the log's bound and, before, was appended).
TEST_F(DurabilityTest, AfterASnapshotWriteFailsTheNextWriteIsASnapshot) {
  absl::StatusOr<ModelConfig> config = PresetConfig("tiny");
  ASSERT_TRUE(config.ok());
  ASSERT_TRUE(ApplyConfigOverrides(*config, {"swa_at=[0,1]", "attn_at=[2]"}).ok());
  EngineOptions engine_options;
  engine_options.num_threads = 1;
  engine_options.prefill_chunk = 8;
  absl::StatusOr<std::unique_ptr<Engine>> full =
      Engine::Create(RandomModel(*config, 11), engine_options);
  ASSERT_TRUE(full.ok()) << full.status();
  engine_ = *std::move(full);
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kFsync);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  uint32_t seed = 10;
  const auto turn = [&](int tokens) {
    const std::vector<int32_t> t = testing::RandomTokens(tokens, ++seed);
    Turn(*store, "s", t);
    testing::DecodeEach(*engine_, *reference, t);
  };
  turn(16);  // the log's first append (it fsyncs the directory: a new entry)
  ASSERT_EQ(store->Stats().persist_deltas, 1);
  // Short turns until one is written as a snapshot (the log outgrew its bound), its directory
  // fsync failing.
  files.FailSyncDir();
  for (int i = 0; i < 64 && store->Stats().snapshot_errors == 0; ++i) turn(4);
  ASSERT_EQ(store->Stats().snapshot_errors, 1) << "no snapshot write was tried";
  ASSERT_EQ(files.faults_fired(), 1);
  const int64_t deltas = store->Stats().persist_deltas;
  // Long turns: each would fit the log's bound (and was appended to the old log).
  for (int i = 0; i < 3; ++i) turn(256);
  EXPECT_EQ(store->Stats().persist_deltas - deltas, 2) << "the first write after the failure "
                                                          "should have been a snapshot";
  EXPECT_TRUE(store->PersistHealth().ok());
  // Out of memory and back, and after a restart: every turn.
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  auto want_state = reference->Clone();
  const std::vector<float> want = testing::ProbeLogits(*engine_, *want_state, kProbe);
  int64_t position = -1;
  EXPECT_TRUE(testing::BitwiseEqual(Probe(*store, "s", &position), want));
  EXPECT_EQ(position, reference->position());
  store.reset();
  auto restarted = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_TRUE(restarted->open_errors().empty()) << restarted->open_errors()[0];
  EXPECT_TRUE(testing::BitwiseEqual(Probe(*restarted, "s", &position), want));
  EXPECT_EQ(position, reference->position());
}

// Several writers (persist_writers) write different sessions at once and call each waiter when
// its own write is done: whatever the order, every acknowledged turn of every session is on disk,
// so a kill -9 right after the acknowledgements restores each session bit-exactly.
TEST_F(DurabilityTest, AcknowledgedTurnsOfManySessionsAreOnDiskWithSeveralWriters) {
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.persist = PersistPolicy::kTurn;
  options.persist_writers = 4;  // background: the worker and three writers
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SessionStateStore& store = **opened;
  constexpr int kSessions = 8;
  std::vector<std::string> ids;
  std::vector<std::unique_ptr<SessionState>> reference;
  for (int s = 0; s < kSessions; ++s) {
    ids.push_back("s" + std::to_string(s));
    ASSERT_TRUE(store.Create(ids.back(), "").ok());
    reference.push_back(engine_->NewSession());
  }
  std::mt19937 rng(7);
  for (int turn = 0; turn < 3; ++turn) {
    std::vector<std::unique_ptr<absl::Notification>> acked;
    for (int s = 0; s < kSessions; ++s) {
      const std::vector<int32_t> tokens =
          testing::RandomTokens(1 + static_cast<int>(rng() % 20), rng());
      Turn(store, ids[s], tokens);
      testing::DecodeEach(*engine_, *reference[s], tokens);
      acked.push_back(std::make_unique<absl::Notification>());
      store.WhenPersisted(ids[s], [n = acked.back().get()](const absl::Status& saved) {
        EXPECT_TRUE(saved.ok()) << saved;
        n->Notify();
      });
    }
    for (auto& n : acked) n->WaitForNotification();
    EXPECT_TRUE(store.PersistHealth().ok());

    auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_NE(restarted, nullptr);
    ASSERT_TRUE(restarted->open_errors().empty()) << restarted->open_errors()[0];
    for (int s = 0; s < kSessions; ++s) {
      int64_t position = -1;
      const std::vector<float> got = Probe(*restarted, ids[s], &position);
      auto want_state = reference[s]->Clone();
      EXPECT_EQ(position, reference[s]->position()) << ids[s];
      EXPECT_TRUE(testing::BitwiseEqual(got, testing::ProbeLogits(*engine_, *want_state, kProbe)))
          << ids[s] << " after turn " << turn;
    }
  }
}

// A session's delta log grows until the next delta would take it past kLogCompactRatio times
// its snapshot; then a full snapshot replaces snapshot and log. Each turn restores bit-exactly
// whichever was written.
TEST_F(DurabilityTest, TheLogIsCompactedOnceItWouldPassTheRatioOfTheSnapshot) {
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_TRUE(store->Create("s", "").ok());
  auto reference = engine_->NewSession();
  const std::filesystem::path snapshot = dir_.path() / "s.sdmstate";
  const std::filesystem::path log = dir_.path() / "s.sdmlog";
  uint64_t largest_log = 0, snapshot_then = 0;
  int compactions = 0, deltas = 0;
  for (int turn = 0; turn < 48; ++turn) {
    const std::vector<int32_t> tokens = testing::RandomTokens(16, 100 + turn);
    const StoreStats before = store->Stats();
    Turn(*store, "s", tokens);
    testing::DecodeEach(*engine_, *reference, tokens);
    const StoreStats after = store->Stats();
    ASSERT_EQ(after.persist_writes, before.persist_writes + 1);
    const uint64_t snapshot_bytes = std::filesystem::file_size(snapshot);
    const uint64_t log_bytes = std::filesystem::exists(log) ? std::filesystem::file_size(log) : 0;
    EXPECT_LE(static_cast<double>(log_bytes),
              LogBound(kLogCompactRatio, snapshot_bytes, *reference))
        << "turn " << turn;
    if (after.persist_deltas > before.persist_deltas) {
      ++deltas;
      EXPECT_GT(log_bytes, 0u);
      if (log_bytes > largest_log) {
        largest_log = log_bytes;
        snapshot_then = snapshot_bytes;
      }
    } else {
      ++compactions;
      EXPECT_EQ(log_bytes, 0u) << "a compaction removes the log";
    }
  }
  EXPECT_GT(deltas, 0);
  EXPECT_GE(compactions, 1);
  // The log grew past the snapshot itself (the rule is not the old "half the snapshot").
  EXPECT_GT(largest_log, snapshot_then);
  auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
  ExpectHolds(*restarted, "s", *reference);
}

// log_compact_ratio is an option: with 5 the log grows past twice the snapshot (the default's
// bound) and never past 5 times; with 0 every write is a full snapshot and there is no log. The
// direct-I/O file system (StateFiles::Direct, the server's default) writes the same sessions:
// each run restores bit-exactly after a kill -9 at its end.
TEST_F(DurabilityTest, TheCompactionRatioIsAnOptionAndDirectIoRestoresExactly) {
  for (double ratio : {5.0, 0.0}) {
    SCOPED_TRACE(::testing::Message() << "ratio " << ratio);
    testing::ScopedTempDir dir;
    auto store = OpenStore(dir.path(), PersistPolicy::kTurn, StateFiles::Direct(),
                           PersistSync::kWrite, ratio);
    ASSERT_TRUE(store->Create("s", "").ok());
    auto reference = engine_->NewSession();
    const std::filesystem::path snapshot = dir.path() / "s.sdmstate";
    const std::filesystem::path log = dir.path() / "s.sdmlog";
    double largest = 0;
    for (int turn = 0; turn < 40; ++turn) {
      const std::vector<int32_t> tokens = testing::RandomTokens(16, 300 + turn);
      const StoreStats before = store->Stats();
      Turn(*store, "s", tokens);
      testing::DecodeEach(*engine_, *reference, tokens);
      const StoreStats after = store->Stats();
      ASSERT_EQ(after.persist_writes, before.persist_writes + 1);
      const double snapshot_bytes = static_cast<double>(std::filesystem::file_size(snapshot));
      const double log_bytes =
          std::filesystem::exists(log) ? static_cast<double>(std::filesystem::file_size(log)) : 0;
      EXPECT_LE(log_bytes, LogBound(ratio, snapshot_bytes, *reference)) << "turn " << turn;
      largest = std::max(largest, log_bytes / snapshot_bytes);
      if (ratio == 0) {
        EXPECT_EQ(after.persist_deltas, 0) << "turn " << turn;
      }
    }
    if (ratio > kLogCompactRatio) {
      EXPECT_GT(largest, kLogCompactRatio);
    }
    const std::filesystem::path copy = crash_dir_.path() / absl::StrCat("ratio", ratio);
    CopyFiles(dir.path(), copy);
    auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
    ExpectHolds(*restarted, "s", *reference);
  }
}

// A StateFiles whose Sync() (the background fsync) blocks until Open() is called, and which records
// whether each write asked for an fsync.
class GatedSyncFiles : public FaultInjectionFiles {
 public:
  absl::Status Sync(const std::filesystem::path& path) override {
    if (!entered_.HasBeenNotified()) entered_.Notify();
    gate_.WaitForNotification();
    return FaultInjectionFiles::Sync(path);
  }
  void Open() {
    if (!gate_.HasBeenNotified()) gate_.Notify();
  }
  // Until a Sync() reached the gate.
  void WaitEntered() { entered_.WaitForNotification(); }

 private:
  absl::Notification gate_, entered_;
};

// Once armed, holds every write of session data (snapshot or log append) until opened, and
// counts the writes that reached the gate.
class GatedWriteFiles : public FaultInjectionFiles {
 public:
  using StateFiles::WriteAt;
  absl::Status WriteAt(const std::filesystem::path& path, uint64_t offset, const ByteSource& data,
                       bool sync) override {
    Hold();
    return FaultInjectionFiles::WriteAt(path, offset, data, sync);
  }
  void Arm() { armed_ = true; }
  void Open() {
    if (!gate_.HasBeenNotified()) gate_.Notify();
  }
  int held() const { return held_.load(); }

 protected:
  absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                            bool sync) override {
    Hold();
    return FaultInjectionFiles::WriteAndSync(path, data, sync);
  }

 private:
  void Hold() {
    if (!armed_.load()) return;
    held_.fetch_add(1);
    gate_.WaitForNotification();
  }

  std::atomic<bool> armed_{false};
  std::atomic<int> held_{0};
  absl::Notification gate_;
};

// A turn is acknowledged once its own state is written, whatever the next turn on its session
// does: a next turn that takes the session before any writer got to it (here the only writer is
// held in another session's write throughout) writes it first, so the acknowledgement does not
// wait for the next turn to end (before, the writers skipped the session while the next turn held
// it: the first turn's final chunk waited for the whole next turn). What is acknowledged is the
// first turn's state: a crash copy taken while the next turn holds the session with tokens fed
// restores it bit-exactly. Both orders: the acknowledgement asked for before the next turn takes
// the session, and once it holds it.
TEST_F(DurabilityTest, ATurnIsAcknowledgedWithoutWaitingForTheNextTurnOnItsSession) {
  for (const bool asked_first : {true, false}) {
    SCOPED_TRACE(asked_first ? "asked before the next turn" : "asked once the next turn runs");
    testing::ScopedTempDir dir;
    SessionWriteFiles files;
    auto store = OpenWithWriters(dir.path(), &files, /*writers=*/1);
    ASSERT_NE(store, nullptr);
    absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
    ASSERT_TRUE(store->Create("s", "").ok());
    ASSERT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
    ASSERT_NO_FATAL_FAILURE(HoldTheWriter(*store, files));
    auto reference = engine_->NewSession();
    const std::vector<int32_t> tokens = testing::RandomTokens(5, 61);
    Turn(*store, "s", tokens);
    testing::DecodeEach(*engine_, *reference, tokens);
    std::shared_ptr<Ack> first;
    if (asked_first) first = AskWhenPersisted(*store, "s");
    auto next = store->Acquire("s");
    ASSERT_TRUE(next.ok()) << next.status();
    testing::DecodeEach(*engine_, next->state(), testing::RandomTokens(3, 62));
    if (!asked_first) first = AskWhenPersisted(*store, "s");
    if (const absl::Status saved = Answer(*first); !saved.ok()) {
      ADD_FAILURE() << saved;
      continue;
    }
    // A kill -9 now (the next turn under way, the writer still held): the first turn survives.
    const std::filesystem::path copy = crash_dir_.path() / (asked_first ? "first" : "then");
    CopyFiles(dir.path(), copy);
    auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_NE(restarted, nullptr);
    ExpectHolds(*restarted, "s", *reference);
  }
}

// A turn whose write fails is not acknowledged as saved: it is answered UNAVAILABLE, saying that
// the turn was generated and the session continues with it in memory, that it is not on disk
// (and why), that it is written once writes succeed again, and that a crash before then loses it.
// So is a turn that ends while writes fail (answered at once, health being UNAVAILABLE), and a
// turn still waiting when the worker finds writes failing. Before, each of these was answered
// OK: its client got a normal final chunk for a turn not on disk. Once the disk is back, the
// turns kept in memory are written and a new turn is answered OK.
TEST_F(DurabilityTest, ATurnWhoseWriteFailsIsAnsweredAsNotSaved) {
  SessionWriteFiles files;
  auto store = OpenWithWriters(dir_.path(), &files, /*writers=*/1);
  ASSERT_NE(store, nullptr);
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
  ASSERT_TRUE(store->Create("s", "").ok());
  ASSERT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
  auto reference = engine_->NewSession();
  const std::vector<int32_t> tokens = testing::RandomTokens(5, 71);
  testing::DecodeEach(*engine_, *reference, tokens);
  // The turn's write is held until it was asked for, then fails.
  files.Hold(SessionFileStem(SessionKey("s")));
  Turn(*store, "s", tokens);
  ASSERT_TRUE(files.WaitHeld(absl::Minutes(1)));
  const std::shared_ptr<Ack> waiting = AskWhenPersisted(*store, "s");
  files.FailWritesAlways(absl::ResourceExhaustedError("injected: No space left on device"));
  files.Open();
  const auto expect_not_saved = [](const absl::Status& saved) {
    EXPECT_EQ(saved.code(), absl::StatusCode::kUnavailable) << saved;
    for (const char* says : {"session 's'", "continues with it", "in memory", "not saved",
                             "No space left on device", "once writes succeed again", "crash"}) {
      EXPECT_NE(saved.message().find(says), std::string::npos) << says << ": " << saved;
    }
    EXPECT_EQ(saved.message().find("again:"), std::string::npos) << saved;  // no "send it again"
  };
  expect_not_saved(Answer(*waiting));
  EXPECT_EQ(store->PersistHealth().code(), absl::StatusCode::kUnavailable);

  // While writes fail, a turn that ends is answered so at once.
  const std::vector<int32_t> more = testing::RandomTokens(3, 72);
  testing::DecodeEach(*engine_, *reference, more);
  Turn(*store, "s", more);
  const std::shared_ptr<Ack> failing = AskWhenPersisted(*store, "s");
  ASSERT_TRUE(failing->done.HasBeenNotified());
  expect_not_saved(failing->saved);

  // The disk comes back: the turns kept in memory are written, and a new turn is saved.
  files.ClearFaults();
  const std::vector<int32_t> last = testing::RandomTokens(2, 73);
  testing::DecodeEach(*engine_, *reference, last);
  Turn(*store, "s", last);
  EXPECT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
  EXPECT_TRUE(store->PersistHealth().ok());
  ExpectCrashCopyHolds("s", *reference);
}

// One session's writes failing turns health, but says nothing of the other sessions' writes:
// their turns are written and answered OK; the failing session's turns are answered UNAVAILABLE
// at once. Before, every turn that ended while health was bad was answered "not saved" at once,
// though its write would have succeeded (and was, moments later).
TEST_F(DurabilityTest, OneSessionsFailingWritesDoNotAnswerOtherTurnsAsUnsaved) {
  SessionWriteFiles files;
  auto store = OpenWithWriters(dir_.path(), &files, /*writers=*/1);
  ASSERT_NE(store, nullptr);
  for (const char* id : {"a", "b"}) {
    ASSERT_TRUE(store->Create(id, "").ok());
    ASSERT_TRUE(Answer(*AskWhenPersisted(*store, id)).ok()) << id;
  }
  files.Fail(SessionFileStem(SessionKey("a")));
  Turn(*store, "a", testing::RandomTokens(3, 81));
  EXPECT_EQ(Answer(*AskWhenPersisted(*store, "a")).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store->PersistHealth().code(), absl::StatusCode::kUnavailable);
  // Health is bad; b's turn is written all the same.
  Turn(*store, "b", testing::RandomTokens(3, 82));
  EXPECT_TRUE(Answer(*AskWhenPersisted(*store, "b")).ok());
  // a's next turn is answered at once (its writes fail; the worker retries them).
  Turn(*store, "a", testing::RandomTokens(2, 83));
  const std::shared_ptr<Ack> failing = AskWhenPersisted(*store, "a");
  ASSERT_TRUE(failing->done.HasBeenNotified());
  EXPECT_EQ(failing->saved.code(), absl::StatusCode::kUnavailable) << failing->saved;
  files.ClearFailing();
}

// A store without a directory writes nothing, whatever its turns: the Acquire of a session with
// a turn "not written yet" (always, without a directory) wrote it first, into the process's
// working directory (a relative path under an empty directory).
TEST_F(DurabilityTest, AStoreWithoutADirectoryWritesNothing) {
  FaultInjectionFiles files;
  auto store = OpenWithWriters("", &files, /*writers=*/1);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Create("s", "").ok());
  for (int turn = 0; turn < 3; ++turn) {
    Turn(*store, "s", testing::RandomTokens(2, 90 + turn));
    EXPECT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
  }
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAndSync), 0);
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kWriteAt), 0);
  EXPECT_EQ(store->Stats().persist_writes, 0);
}

// A turn whose session breaks after it (the next turn on the session takes it and fails part-way:
// the engine marks the state failed, and the store refuses the session from then on and never
// writes it) is answered at once, and truthfully. Before, nothing answered a turn still waiting
// for its write then (the writers skip a broken session): its client waited until the session
// was deleted, which answered OK for a state never written, and a server's shutdown waited for
// its stream. The writer is held in another session's write throughout, so the next turn takes
// the session before any writer got to the first. Since the next turn writes the first before
// it takes the session (ATurnIsAcknowledgedWithoutWaitingForTheNextTurnOnItsSession), the first
// is saved and answered OK, before the failure or after it; when that write fails, the first turn
// is not saved, and asked after the failure it is answered DATA_LOSS (never OK). (A release that
// breaks a session also answers the turns still waiting then with DATA_LOSS; with the next turn's
// write first, none is left waiting: the first version of this test, on code without that write,
// waited for it.)
TEST_F(DurabilityTest, ATurnWaitingWhenTheNextTurnBreaksItsSessionIsAnswered) {
  for (const bool writes_fail : {false, true}) {
    SCOPED_TRACE(writes_fail ? "the first turn's write fails" : "writes succeed");
    testing::ScopedTempDir dir;
    SessionWriteFiles files;
    auto store = OpenWithWriters(dir.path(), &files, /*writers=*/1);
    ASSERT_NE(store, nullptr);
    absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
    ASSERT_TRUE(store->Create("s", "").ok());
    ASSERT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
    ASSERT_NO_FATAL_FAILURE(HoldTheWriter(*store, files));
    const std::vector<int32_t> tokens = testing::RandomTokens(5, 51);
    Turn(*store, "s", tokens);
    std::shared_ptr<Ack> first;
    if (writes_fail) {
      files.FailWritesAlways(absl::ResourceExhaustedError("injected: No space left on device"));
    } else {
      first = AskWhenPersisted(*store, "s");
    }
    {
      auto next = store->Acquire("s");
      ASSERT_TRUE(next.ok()) << next.status();
      testing::DecodeEach(*engine_, next->state(), testing::RandomTokens(2, 52));
      next->state().MarkFailed(absl::InternalError("injected: a step failed part-way"));
    }
    if (!writes_fail) {
      EXPECT_TRUE(Answer(*first).ok()) << first->saved;
      // Asked again now, the same answer, at once; and the crash copy has the first turn.
      const std::shared_ptr<Ack> again = AskWhenPersisted(*store, "s");
      ASSERT_TRUE(again->done.HasBeenNotified());
      EXPECT_TRUE(again->saved.ok()) << again->saved;
      const std::filesystem::path copy = crash_dir_.path() / "broken";
      CopyFiles(dir.path(), copy);
      auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
      ASSERT_NE(restarted, nullptr);
      auto lease = restarted->Acquire("s");
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(lease->state().position(), static_cast<int64_t>(tokens.size()));
    } else {
      const std::shared_ptr<Ack> late = AskWhenPersisted(*store, "s");
      ASSERT_TRUE(late->done.HasBeenNotified());
      const absl::Status saved = late->saved;
      EXPECT_EQ(saved.code(), absl::StatusCode::kDataLoss) << saved;
      EXPECT_NE(saved.message().find("not saved"), std::string::npos) << saved;
      EXPECT_NE(saved.message().find("'s'"), std::string::npos) << saved;
    }
    EXPECT_EQ(store->Acquire("s").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(store->Delete("s").ok());
  }
}

// A turn asked for with its release (SessionLease::ReleaseWhenPersisted) is answered for that
// turn: OK once it is written (a crash copy then has it), and ABORTED when the session is deleted
// before its write, even though the Delete came right after the release. Before, the scheduler
// released the lease and then called WhenPersisted: a Delete between the two left no entry to
// wait on, and the turn, never written, was answered OK.
TEST_F(DurabilityTest, ATurnAskedWithItsReleaseIsAnsweredForThatTurn) {
  SessionWriteFiles files;
  auto store = OpenWithWriters(dir_.path(), &files, /*writers=*/1);
  ASSERT_NE(store, nullptr);
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
  ASSERT_TRUE(store->Create("s", "").ok());
  ASSERT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
  auto reference = engine_->NewSession();
  const std::vector<int32_t> tokens = testing::RandomTokens(4, 91);
  testing::DecodeEach(*engine_, *reference, tokens);
  const std::shared_ptr<Ack> saved = TurnAsking(*store, "s", tokens);
  ASSERT_NE(saved, nullptr);
  ASSERT_TRUE(Answer(*saved).ok()) << saved->saved;
  ExpectCrashCopyHolds("s", *reference);

  // The writer held: the next turn's write cannot happen before the Delete.
  ASSERT_NO_FATAL_FAILURE(HoldTheWriter(*store, files));
  const std::shared_ptr<Ack> deleted = TurnAsking(*store, "s", testing::RandomTokens(2, 92));
  ASSERT_NE(deleted, nullptr);
  EXPECT_FALSE(deleted->done.HasBeenNotified());
  ASSERT_TRUE(store->Delete("s").ok());
  const absl::Status answer = Answer(*deleted);
  EXPECT_EQ(answer.code(), absl::StatusCode::kAborted) << answer;
  EXPECT_NE(answer.message().find("deleted before the turn was written"), std::string::npos)
      << answer;

  // A one-shot session has nothing to write: answered OK at once.
  SessionLease one_shot = store->NewSession();
  ASSERT_TRUE(one_shot);
  const std::shared_ptr<Ack> nothing = ReleaseAsking(one_shot);
  ASSERT_TRUE(nothing->done.HasBeenNotified());
  EXPECT_TRUE(nothing->saved.ok()) << nothing->saved;
}

// A turn whose write is under way when a background fsync of its session's earlier writes fails
// (PersistSync::kWrite) is answered by that write: OK, its delta handed to the kernel (the
// session is written in full again later). Before, the worker, finding the session failing,
// answered the turn UNAVAILABLE ("not saved") while its write was still under way (here on the
// thread of the next turn's Acquire, which writes it first), and the write then succeeded: a
// client told to send a saved turn again.
TEST_F(DurabilityTest, ATurnBeingWrittenWhenAnFsyncFailsIsAnsweredByItsWrite) {
  SessionWriteFiles files;
  absl::Notification unhealthy;
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.files = &files;
  options.persist_writers = 1;  // the worker
  options.persist_sync = PersistSync::kWrite;
  options.persist_sync_interval = absl::Hours(1);  // a round at the first write, then ours only
  options.on_persist_health = [&](const absl::Status& health) {
    if (!health.ok() && !unhealthy.HasBeenNotified()) unhealthy.Notify();
  };
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<SessionStateStore> store = *std::move(opened);
  absl::Cleanup open_gates = [&] { files.Open(); };  // before the store joins its worker
  const std::string blocker = SessionFileStem(SessionKey("blocker"));
  const std::string stem = SessionFileStem(SessionKey("s"));

  auto reference = engine_->NewSession();
  for (const char* id : {"blocker", "s"}) {
    ASSERT_TRUE(store->Create(id, "").ok());
    ASSERT_TRUE(Answer(*AskWhenPersisted(*store, id)).ok());
  }
  // The syncer's first round began at the first creation (its next is an hour away); ours
  // (after it: one round at a time) takes what is left.
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  while (files.calls(FaultInjectionFiles::Op::kSync) == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  store->SyncWritten();
  ASSERT_EQ(store->Stats().unsynced, 0);
  const std::vector<int32_t> first = testing::RandomTokens(4, 95);
  testing::DecodeEach(*engine_, *reference, first);
  Turn(*store, "s", first);
  ASSERT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
  ASSERT_EQ(store->Stats().unsynced, 1);  // its delta, not fsynced

  // The worker held in a write of another session.
  files.Hold(blocker);
  Turn(*store, "blocker", testing::RandomTokens(2, 97));
  ASSERT_TRUE(files.WaitHeld(blocker, absl::Minutes(1)));
  // The next turn of "s" ends, asked with its release; the Acquire of the turn after it writes
  // it first, on its own thread: held too.
  const std::vector<int32_t> second = testing::RandomTokens(3, 96);
  testing::DecodeEach(*engine_, *reference, second);
  const std::shared_ptr<Ack> ack = TurnAsking(*store, "s", second);
  ASSERT_NE(ack, nullptr);
  files.Hold(stem);
  absl::Status next_turn = absl::InternalError("not run");
  std::thread next([&] { next_turn = store->Acquire("s").status(); });
  absl::Cleanup join = [&] {
    files.Open();
    next.join();
  };
  ASSERT_TRUE(files.WaitHeld(stem, absl::Minutes(1)));
  // The fsync of the first turn's delta fails meanwhile; the worker, let go, sees it (it tells
  // health after answering the turns of failing sessions).
  files.FailSync();
  store->SyncWritten();
  files.Open(blocker);
  ASSERT_TRUE(unhealthy.WaitForNotificationWithTimeout(absl::Minutes(1)));
  files.Open(stem);
  const absl::Status saved = Answer(*ack);
  EXPECT_TRUE(saved.ok()) << saved;
  std::move(join).Invoke();
  EXPECT_TRUE(next_turn.ok()) << next_turn;
  // Parked (written in full and fsynced, the worker's rewrite done): the copy is stable.
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  ExpectCrashCopyHolds("s", *reference);
}

// A turn of a session whose writes fail is told that session's cause, not the last one the store
// logged (another session's, here an I/O error where this one's disk is full).
TEST_F(DurabilityTest, ATurnNotWrittenIsToldItsOwnSessionsCause) {
  SessionWriteFiles files;
  auto store = OpenWithWriters(dir_.path(), &files, /*writers=*/1);
  ASSERT_NE(store, nullptr);
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
  for (const char* id : {"a", "b"}) {
    ASSERT_TRUE(store->Create(id, "").ok());
    ASSERT_TRUE(Answer(*AskWhenPersisted(*store, id)).ok());
  }
  files.Fail(SessionFileStem(SessionKey("a")));
  std::shared_ptr<Ack> ack = TurnAsking(*store, "a", testing::RandomTokens(2, 70));
  ASSERT_NE(ack, nullptr);
  absl::Status saved = Answer(*ack);
  ASSERT_EQ(saved.code(), absl::StatusCode::kUnavailable) << saved;
  ASSERT_THAT(std::string(saved.message()), HasSubstr("this session's writes fail"));
  // The next turn of "a" runs (its lease held: the store does not retry its write meanwhile)
  // while "b" fails with another cause, logged last.
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok()) << lease.status();
  testing::DecodeEach(*engine_, lease->state(), testing::RandomTokens(2, 72));
  files.FailNext(FaultInjectionFiles::Op::kWriteAt,
                 {absl::InternalError("injected: Input/output error")});
  ack = TurnAsking(*store, "b", testing::RandomTokens(2, 71));
  ASSERT_NE(ack, nullptr);
  saved = Answer(*ack);
  ASSERT_EQ(saved.code(), absl::StatusCode::kUnavailable) << saved;
  ASSERT_THAT(std::string(saved.message()), HasSubstr("Input/output error"));
  // "a" fails still: its turn is answered at once, with its own cause.
  ack = ReleaseAsking(*lease);
  saved = Answer(*ack);
  EXPECT_EQ(saved.code(), absl::StatusCode::kUnavailable) << saved;
  EXPECT_THAT(std::string(saved.message()), HasSubstr("this session's writes fail"));
  EXPECT_THAT(std::string(saved.message()), ::testing::Not(HasSubstr("Input/output")));
  files.ClearFailing();
}

// A park that writes a session answers its turns waiting for that write when it returns.
// Before, their callbacks waited in the store's ready list until the worker or a writer was next
// done with a write: behind another session's long write (held here: for as long as it is held).
// (PersistAll flushes them the same way.)
TEST_F(DurabilityTest, AParkAnswersTheTurnsItWrites) {
  SessionWriteFiles files;
  auto store = OpenWithWriters(dir_.path(), &files, /*writers=*/1);
  ASSERT_NE(store, nullptr);
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
  ASSERT_TRUE(store->Create("s", "").ok());
  ASSERT_TRUE(Answer(*AskWhenPersisted(*store, "s")).ok());
  ASSERT_NO_FATAL_FAILURE(HoldTheWriter(*store, files));
  const std::shared_ptr<Ack> ack = TurnAsking(*store, "s", testing::RandomTokens(3, 98));
  ASSERT_NE(ack, nullptr);
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  ASSERT_TRUE(ack->done.HasBeenNotified());
  EXPECT_TRUE(ack->saved.ok()) << ack->saved;
}

// What durability costs a turn's acknowledgement is counted (StoreStats::persist_waits,
// persist_wait_us): a WhenPersisted call that waits, with at least the time its write was held;
// one with nothing to wait for, not at all. No timing races: the test waits for the write to
// reach the gate, and the store's wait must cover the test's own measure of the hold.
TEST_F(DurabilityTest, AcknowledgementWaitsAreCountedWithTheirTime) {
  GatedWriteFiles files;
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.files = &files;
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SessionStateStore& store = **opened;
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its writers
  ASSERT_TRUE(store.Create("s", "").ok());
  absl::Notification created;
  store.WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    created.Notify();
  });
  created.WaitForNotification();
  const StoreStats before = store.Stats();
  // Written already: called at once, not counted.
  bool at_once = false;
  store.WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    at_once = true;
  });
  EXPECT_TRUE(at_once);
  EXPECT_EQ(store.Stats().persist_waits, before.persist_waits);

  files.Arm();
  Turn(store, "s", testing::RandomTokens(5, 31));
  absl::Notification acked;
  store.WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    acked.Notify();
  });
  const auto asked = std::chrono::steady_clock::now();
  while (files.held() == 0) std::this_thread::yield();  // the turn's write is at the gate
  EXPECT_FALSE(acked.HasBeenNotified());
  // Held for at least 2 ms (measured, not slept): a wait recorded as nothing cannot pass below.
  auto opening = std::chrono::steady_clock::now();
  while (opening - asked < std::chrono::milliseconds(2)) {
    std::this_thread::yield();
    opening = std::chrono::steady_clock::now();
  }
  files.Open();
  acked.WaitForNotification();
  const StoreStats after = store.Stats();
  EXPECT_EQ(after.persist_waits, before.persist_waits + 1);
  EXPECT_GE(after.persist_wait_us - before.persist_wait_us,
            std::chrono::duration_cast<std::chrono::microseconds>(opening - asked).count());
}

// --persist_sync=fsync: a turn is acknowledged (WhenPersisted) only once its write was fsynced:
// every write asks for the fsync and none is left to the background syncer.
TEST_F(DurabilityTest, WithFsyncATurnIsAcknowledgedOnlyOnceItsWriteIsSynced) {
  FaultInjectionFiles files;
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.files = &files;
  options.persist_sync = PersistSync::kFsync;
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SessionStateStore& store = **opened;
  ASSERT_TRUE(store.Create("s", "").ok());
  for (int turn = 0; turn < 3; ++turn) {
    const int synced_before = files.synced_writes();  // (the turn's write may start at once)
    Turn(store, "s", testing::RandomTokens(4, 10 + turn));
    absl::Notification acked;
    int synced_at_ack = -1, unsynced_at_ack = -1;
    store.WhenPersisted("s", [&](const absl::Status& saved) {
      EXPECT_TRUE(saved.ok()) << saved;
      synced_at_ack = files.synced_writes();
      unsynced_at_ack = files.unsynced_writes();
      acked.Notify();
    });
    acked.WaitForNotification();
    EXPECT_GT(synced_at_ack, synced_before) << "turn " << turn;  // this turn's write, fsynced
    EXPECT_EQ(unsynced_at_ack, 0);
  }
  EXPECT_EQ(files.calls(FaultInjectionFiles::Op::kSync), 0);
  EXPECT_EQ(store.Stats().unsynced, 0);
  EXPECT_EQ(store.Stats().persist_syncs, 0);
}

// --persist_sync=write: a turn is acknowledged once its write is handed to the kernel, while the
// background fsync is still to come (here held up): a kill -9 at that moment keeps the turn.
// Then the syncer's round fsyncs the session's files.
TEST_F(DurabilityTest, WithWriteATurnIsAcknowledgedBeforeItsBackgroundFsync) {
  GatedSyncFiles files;
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.files = &files;
  options.persist_sync = PersistSync::kWrite;
  options.persist_sync_interval = absl::ZeroDuration();
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  SessionStateStore& store = **opened;
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its syncer
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store.Create("s", "").ok());
  const std::vector<int32_t> tokens = testing::RandomTokens(6, 21);
  Turn(store, "s", tokens);
  testing::DecodeEach(*engine_, *reference, tokens);
  absl::Notification acked;
  store.WhenPersisted("s", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    acked.Notify();
  });
  // The syncer is held in its first fsync; the acknowledgement does not wait for it.
  acked.WaitForNotification();
  EXPECT_EQ(files.synced_writes(), 0);
  EXPECT_GE(files.unsynced_writes(), 1);  // its creation and its turn (perhaps coalesced)
  EXPECT_GE(store.Stats().unsynced, 1);
  {
    auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
    ExpectHolds(*restarted, "s", *reference);
  }
  files.Open();
  store.SyncWritten();  // waits for the syncer's round, then runs its own
  EXPECT_GE(files.calls(FaultInjectionFiles::Op::kSync), 1);
  EXPECT_GE(store.Stats().persist_syncs, 1);
  EXPECT_EQ(store.Stats().unsynced, 0);
  EXPECT_TRUE(store.PersistHealth().ok());
}

// --persist_sync=write and a power loss (or kernel crash) on a file system that may commit a
// rename before the renamed file's data (XFS; PowerLossFiles): a snapshot renamed over the synced
// one comes back whole. Before, nothing wrote its data out before the rename, and the power loss
// left the session's file empty: the session quarantined, every turn lost, where the contract
// loses only the writes since the last sync round.
TEST_F(DurabilityTest, APowerLossFindsASnapshotRenamedOverAnotherWhole) {
  testing::PowerLossFiles files;
  // Ratio 0: every write is a full snapshot, renamed over the session's file.
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kWrite,
                         /*compact_ratio=*/0);
  ASSERT_NE(store, nullptr);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  store->SyncWritten();
  const std::vector<int32_t> tokens = testing::RandomTokens(5, 31);
  testing::DecodeEach(*engine_, *reference, tokens);
  Turn(*store, "s", tokens);  // written at once (background false), not fsynced
  ASSERT_EQ(store->Stats().unsynced, 1);
  ASSERT_EQ(store->Stats().persist_deltas, 0);
  EXPECT_GE(files.calls(FaultInjectionFiles::Op::kWriteBack), 1);

  const std::filesystem::path copy = crash_dir_.path() / "power-loss";
  files.CopyDurable(dir_.path(), copy);
  auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
  ASSERT_NE(restarted, nullptr);
  EXPECT_EQ(restarted->Stats().quarantined, 0);
  ExpectHolds(*restarted, "s", *reference);
}

// --persist_sync=write and a power loss: each session comes back as of its last sync round or
// later, whole (a log's unsynced records are a torn tail, dropped): deltas appended since the
// round are lost, as documented (docs/state-format.md, Durability), and nothing else.
TEST_F(DurabilityTest, APowerLossLosesOnlyTheWritesSinceTheLastSyncRound) {
  testing::PowerLossFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kWrite);
  ASSERT_NE(store, nullptr);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  store->SyncWritten();
  int losses = 0;
  auto expect_after_power_loss = [&](const SessionState& want) {
    const std::filesystem::path copy = crash_dir_.path() / absl::StrCat("power-loss-", ++losses);
    files.CopyDurable(dir_.path(), copy);
    auto restarted = OpenStore(copy, PersistPolicy::kTurn, StateFiles::Default());
    ASSERT_NE(restarted, nullptr);
    EXPECT_EQ(restarted->Stats().quarantined, 0);
    ExpectHolds(*restarted, "s", want);
  };
  for (int turn = 0; turn < 3; ++turn) {
    SCOPED_TRACE(absl::StrCat("turn ", turn));
    const std::unique_ptr<SessionState> synced = reference->Clone();
    const std::vector<int32_t> tokens = testing::RandomTokens(3, 40 + turn);
    testing::DecodeEach(*engine_, *reference, tokens);
    Turn(*store, "s", tokens);
    ASSERT_EQ(store->Stats().persist_deltas, turn + 1);  // appended to the log, not fsynced
    expect_after_power_loss(*synced);
    store->SyncWritten();
    expect_after_power_loss(*reference);
  }
}

// A snapshot whose data could not be written out before its rename (WriteBack failed: an I/O
// error) is a failed write: the previous snapshot stays the session's, no `.tmp` is left, and
// the next write succeeds.
TEST_F(DurabilityTest, AFailedWriteBackLeavesThePreviousSnapshot) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kWrite,
                         /*compact_ratio=*/0);
  ASSERT_NE(store, nullptr);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  files.FailNext(FaultInjectionFiles::Op::kWriteBack,
                 {absl::InternalError("injected: Input/output error")});
  const std::vector<int32_t> tokens = testing::RandomTokens(4, 51);
  Turn(*store, "s", tokens);
  EXPECT_EQ(files.faults_fired(), 1);
  EXPECT_EQ(store->Stats().snapshot_errors, 1);
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path())) {
    EXPECT_NE(entry.path().extension(), ".tmp") << entry.path();
  }
  ExpectCrashCopyHolds("s", *reference);  // as created
  testing::DecodeEach(*engine_, *reference, tokens);
  ASSERT_TRUE(store->PersistAll().ok());
  EXPECT_TRUE(store->PersistHealth().ok());
  ExpectCrashCopyHolds("s", *reference);
}

// --persist_sync=write: a park to disk while a background round fsyncs the session (its files
// taken out of the unsynced set, not yet fsynced) keeps the memory copy's place: it writes and
// fsyncs a full snapshot, so the round's fsync failing afterwards loses nothing (before, the park
// dropped the memory copy at once, and the failed round left the session on disk, due again with
// nothing to write it from: health failing until the session was next used).
TEST_F(DurabilityTest, AParkDuringABackgroundFsyncRoundKeepsWhatTheRoundMayLose) {
  GatedSyncFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kWrite);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  const std::vector<int32_t> tokens = testing::RandomTokens(6, 31);
  Turn(*store, "s", tokens);
  testing::DecodeEach(*engine_, *reference, tokens);
  ASSERT_EQ(store->Stats().unsynced, 1);
  files.FailSync();  // the round's first fsync
  std::thread round([&] { store->SyncWritten(); });
  absl::Cleanup join = [&] {
    files.Open();
    round.join();
  };
  files.WaitEntered();
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  std::move(join).Invoke();
  EXPECT_EQ(files.faults_fired(), 1);
  EXPECT_TRUE(store->PersistHealth().ok()) << store->PersistHealth();
  EXPECT_EQ(store->Stats().unpersisted, 0);
  EXPECT_EQ(store->Stats().unsynced, 0);
  auto want_state = reference->Clone();
  const std::vector<float> want = testing::ProbeLogits(*engine_, *want_state, kProbe);
  auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
  int64_t position = -1;
  EXPECT_TRUE(testing::BitwiseEqual(Probe(*restarted, "s", &position), want));
  EXPECT_EQ(position, reference->position());
}

// --persist_sync=write: the sync round that fsyncs the full snapshot which ends a failed fsync
// does not end a failure of a later write (that session's latest turn is not on disk). Before,
// the round declared the store healthy: health flapped, and the failing session was handed
// straight back to the writers as if healthy.
TEST_F(DurabilityTest, ASyncRoundDoesNotEndALaterWritesFailure) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kWrite);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  std::vector<int32_t> tokens = testing::RandomTokens(5, 60);
  Turn(*store, "s", tokens);
  testing::DecodeEach(*engine_, *reference, tokens);
  files.FailSync();
  store->SyncWritten();  // fails; the session is written again in full at once (inline)
  ASSERT_FALSE(store->PersistHealth().ok());
  ASSERT_EQ(store->Stats().unsynced, 1);  // that snapshot, not fsynced yet

  files.FailWritesAlways(absl::ResourceExhaustedError("injected: No space left on device"));
  tokens = testing::RandomTokens(3, 61);
  Turn(*store, "s", tokens);  // its write fails
  testing::DecodeEach(*engine_, *reference, tokens);
  store->SyncWritten();  // fsyncs the full snapshot of before the turn
  const absl::Status health = store->PersistHealth();
  EXPECT_EQ(health.code(), absl::StatusCode::kUnavailable) << health;
  EXPECT_NE(health.message().find("No space left"), std::string::npos) << health;

  files.ClearFaults();
  ASSERT_TRUE(store->PersistAll().ok());  // writes the turn (and fsyncs it: a park to disk)
  EXPECT_TRUE(store->PersistHealth().ok());
  ExpectCrashCopyHolds("s", *reference);
}

// --persist_sync=write: a background fsync that fails (a disk error) is a failed write: counted
// once, health UNAVAILABLE naming the cause; the session is written again in full, and health
// recovers only once that snapshot has been fsynced. A park to disk fsyncs what is unsynced.
TEST_F(DurabilityTest, WithWriteAFailedBackgroundFsyncIsLoudAndTheSessionIsRewritten) {
  FaultInjectionFiles files;
  auto store = OpenStore(dir_.path(), PersistPolicy::kTurn, &files, PersistSync::kWrite);
  auto reference = engine_->NewSession();
  ASSERT_TRUE(store->Create("s", "").ok());
  for (int turn = 0; turn < 2; ++turn) {
    const std::vector<int32_t> tokens = testing::RandomTokens(5, 30 + turn);
    Turn(*store, "s", tokens);
    testing::DecodeEach(*engine_, *reference, tokens);
  }
  EXPECT_EQ(files.synced_writes(), 0);
  EXPECT_EQ(store->Stats().unsynced, 1);
  ASSERT_GT(store->Stats().persist_deltas, 0);

  const StoreStats before = store->Stats();
  files.FailSync();
  store->SyncWritten();
  StoreStats stats = store->Stats();
  EXPECT_EQ(stats.persist_failures, 1);
  EXPECT_GE(stats.snapshot_errors, 1);
  const absl::Status health = store->PersistHealth();
  EXPECT_EQ(health.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(health.message().find("Input/output error"), std::string::npos) << health;
  // Written again at once (no worker here: inline), in full, not as a delta; still failing
  // until that snapshot is fsynced.
  EXPECT_EQ(stats.persist_writes, before.persist_writes + 1);
  EXPECT_EQ(stats.persist_deltas, before.persist_deltas);
  EXPECT_EQ(stats.unsynced, 1);
  EXPECT_FALSE(store->PersistHealth().ok());

  store->SyncWritten();
  EXPECT_TRUE(store->PersistHealth().ok());
  EXPECT_EQ(store->Stats().unsynced, 0);
  EXPECT_EQ(store->Stats().persist_failures, 1);

  // Another turn (a delta, unsynced), then a park to disk: its files are fsynced first.
  const std::vector<int32_t> tokens = testing::RandomTokens(3, 40);
  Turn(*store, "s", tokens);
  testing::DecodeEach(*engine_, *reference, tokens);
  EXPECT_EQ(store->Stats().unsynced, 1);
  const int syncs = files.calls(FaultInjectionFiles::Op::kSync);
  ASSERT_TRUE(store->Park("s", Tier::kDisk).ok());
  EXPECT_GT(files.calls(FaultInjectionFiles::Op::kSync), syncs);
  EXPECT_EQ(store->Stats().unsynced, 0);

  auto restarted = OpenStore(CrashCopy(), PersistPolicy::kTurn, StateFiles::Default());
  ExpectHolds(*restarted, "s", *reference);
}

TEST(PersistSyncTest, NamesRoundTrip) {
  for (PersistSync p : {PersistSync::kWrite, PersistSync::kFsync}) {
    auto parsed = ParsePersistSync(PersistSyncName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_EQ(ParsePersistSync("sometimes").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SessionStoreOptions{}.persist_sync, PersistSync::kWrite);
}

TEST(PersistPolicyTest, NamesRoundTrip) {
  for (PersistPolicy p : {PersistPolicy::kTurn, PersistPolicy::kIdle, PersistPolicy::kShutdown}) {
    auto parsed = ParsePersistPolicy(PersistPolicyName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_EQ(ParsePersistPolicy("always").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sdm
