// Crash safety of snapshot writes (state_store/state_files.h, session_store.h): whatever step of
// a snapshot write fails or is interrupted — the write of the temporary file (cut short, or a full
// disk), the rename, the directory fsync, or the process being killed outright — a store opened on
// the directory afterwards restores the session to exactly its previous snapshot or exactly the
// new one, never an error or a mixture, and removes the stray temporary file.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "gtest/gtest.h"
#include "state_store/session_store.h"
#include "state_store/state_codec.h"
#include "state_store/state_files.h"
#include "tests/engine/test_model_util.h"
#include "tests/state_store/fault_injection_files.h"
#include "tests/state_store/snapshot_test_util.h"

namespace sdm {
namespace {

using testing::FaultInjectionFiles;

constexpr char kId[] = "s";
constexpr int32_t kProbe = 42;

std::vector<std::string> TmpFiles(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (absl::EndsWith(entry.path().filename().string(), ".tmp")) {
      out.push_back(entry.path().filename().string());
    }
  }
  return out;
}

// One session's history: a prompt (the old snapshot) and a continuation (the new snapshot), with
// the logits of a probe token after each, computed on sessions that never left the engine.
class SnapshotCrashTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = testing::TinyEngine();
    prompt_ = testing::RandomTokens(21, 1);  // longer than the 16-row SWA rings
    continuation_ = testing::RandomTokens(5, 2);
    auto old_ref = engine_->NewSession();
    ASSERT_TRUE(engine_->Prefill(*old_ref, prompt_, false, nullptr).ok());
    auto new_ref = old_ref->Clone();
    testing::DecodeEach(*engine_, *new_ref, continuation_);
    // The new snapshot's size, for cutting its write short at chosen offsets.
    new_snapshot_bytes_ = static_cast<int64_t>(
        EncodeSessionState(*new_ref, SessionRecord{kId, "meta"}, engine_->fingerprint()).size());
    old_logits_ = testing::ProbeLogits(*engine_, *old_ref, kProbe);
    new_logits_ = testing::ProbeLogits(*engine_, *new_ref, kProbe);
    ASSERT_FALSE(testing::BitwiseEqual(old_logits_, new_logits_));
  }

  std::unique_ptr<SessionStateStore> OpenStore(StateFiles* files) {
    SessionStoreOptions options;
    options.dir = dir_.path();
    options.files = files;
    options.background = false;
    // Writes only when the test parks or persists (per-turn writes: durability_test.cc).
    options.persist = PersistPolicy::kShutdown;
    auto store = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // Creates the session, prefills the prompt and parks it on disk (the old snapshot), then
  // resumes it and decodes the continuation; the session is left resident.
  void WriteOldSnapshotThenContinue(SessionStateStore& store) {
    ASSERT_TRUE(store.Create(kId, "meta").ok());
    {
      auto lease = store.Acquire(kId);
      ASSERT_TRUE(lease.ok()) << lease.status();
      ASSERT_TRUE(engine_->Prefill(lease->state(), prompt_, false, nullptr).ok());
    }
    ASSERT_TRUE(store.Park(kId, Tier::kDisk).ok());
    ASSERT_TRUE(std::filesystem::exists(dir_.path() / "s.sdmstate"));
    auto lease = store.Acquire(kId);
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), continuation_);
  }

  // The probe logits of a copy of the store's session (the session itself is left as it is).
  std::vector<float> ProbeCopy(SessionStateStore& store, int64_t* position) {
    auto lease = store.Acquire(kId);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return {};
    *position = lease->state().position();
    auto copy = lease->state().Clone();
    return testing::ProbeLogits(*engine_, *copy, kProbe);
  }

  enum class Expect { kOld, kNew };

  // Reopens the directory with the real file system, as a restarted server would, and checks
  // the session is exactly the expected one of the two snapshots.
  void ExpectRestoresTo(Expect expect) {
    auto store = OpenStore(StateFiles::Default());
    ASSERT_NE(store, nullptr);
    EXPECT_TRUE(store->open_errors().empty()) << store->open_errors()[0];
    EXPECT_TRUE(TmpFiles(dir_.path()).empty()) << "stray " << TmpFiles(dir_.path())[0];
    EXPECT_TRUE(std::filesystem::is_empty(dir_.path() / "quarantine"));
    int64_t position = -1;
    const std::vector<float> logits = ProbeCopy(*store, &position);
    const bool is_old = testing::BitwiseEqual(logits, old_logits_);
    const bool is_new = testing::BitwiseEqual(logits, new_logits_);
    ASSERT_TRUE(is_old || is_new) << "restored a state that is neither snapshot (position "
                                  << position << ")";
    if (expect == Expect::kOld) {
      EXPECT_TRUE(is_old) << "expected the previous snapshot, got the new one";
      EXPECT_EQ(position, static_cast<int64_t>(prompt_.size()));
    } else {
      EXPECT_TRUE(is_new) << "expected the new snapshot, got the previous one";
      EXPECT_EQ(position, static_cast<int64_t>(prompt_.size() + continuation_.size()));
    }
    auto info = store->Get(kId);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->metadata, "meta");
  }

  testing::ScopedTempDir dir_;
  std::unique_ptr<Engine> engine_;
  std::vector<int32_t> prompt_, continuation_;
  int64_t new_snapshot_bytes_ = 0;
  std::vector<float> old_logits_, new_logits_;
};

TEST_F(SnapshotCrashTest, CleanParkThenCrashRestoresTheNewState) {
  FaultInjectionFiles files;
  auto store = OpenStore(&files);
  ASSERT_NE(store, nullptr);
  ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
  ASSERT_TRUE(store->Park(kId, Tier::kDisk).ok());
  store.reset();  // crash: no PersistAll
  ExpectRestoresTo(Expect::kNew);
}

TEST_F(SnapshotCrashTest, UnsavedProgressIsLostButTheOldSnapshotSurvives) {
  FaultInjectionFiles files;
  auto store = OpenStore(&files);
  ASSERT_NE(store, nullptr);
  ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
  store.reset();  // crash while the continued session was resident
  ExpectRestoresTo(Expect::kOld);
}

// A crash in the middle of writing the temporary file: whatever prefix of the new snapshot
// reached the disk, the old snapshot is intact under the final name and the .tmp is removed.
TEST_F(SnapshotCrashTest, CrashDuringWriteLeavesTheOldSnapshot) {
  const int64_t size = new_snapshot_bytes_;
  const std::vector<int64_t> cuts = {0,  1,  8,        40,       47,        48,       71,  72,
                                     73, 99, size / 3, size / 2, size - 24, size - 1, size};
  for (int64_t cut : cuts) {
    SCOPED_TRACE(absl::StrCat("write cut after ", cut, " of ", size, " bytes"));
    std::filesystem::remove_all(dir_.path());
    std::filesystem::create_directories(dir_.path());
    FaultInjectionFiles files;
    auto store = OpenStore(&files);
    ASSERT_NE(store, nullptr);
    ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
    files.set_crash_at_fault(true);
    files.FailWriteAfter(cut);
    EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
    EXPECT_TRUE(files.crashed());
    store.reset();
    // The crash left the partial temporary file behind, of exactly the bytes written.
    const std::vector<std::string> temps = TmpFiles(dir_.path());
    ASSERT_EQ(temps.size(), 1u);
    EXPECT_TRUE(absl::StartsWith(temps[0], "s.sdmstate.")) << temps[0];
    EXPECT_EQ(std::filesystem::file_size(dir_.path() / temps[0]), static_cast<uint64_t>(cut));
    ExpectRestoresTo(Expect::kOld);
  }
}

TEST_F(SnapshotCrashTest, FailedRenameLeavesTheOldSnapshot) {
  for (bool crash : {false, true}) {
    SCOPED_TRACE(crash ? "crash at the rename" : "rename fails, process survives");
    std::filesystem::remove_all(dir_.path());
    std::filesystem::create_directories(dir_.path());
    FaultInjectionFiles files;
    auto store = OpenStore(&files);
    ASSERT_NE(store, nullptr);
    ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
    files.set_crash_at_fault(crash);
    files.FailRename();
    EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
    EXPECT_EQ(store->Stats().snapshot_errors, 1);
    // A complete temporary file is left only when the process died before cleaning up.
    EXPECT_EQ(TmpFiles(dir_.path()).size(), crash ? 1u : 0u);
    if (!crash) {
      // The live store still serves the new state (from its host copy).
      int64_t position = -1;
      EXPECT_TRUE(testing::BitwiseEqual(ProbeCopy(*store, &position), new_logits_));
    }
    store.reset();
    ExpectRestoresTo(Expect::kOld);
  }
}

// The rename reached the disk but the directory fsync failed: the write is reported as failed,
// yet the new snapshot is complete under the final name (on a real power loss the rename might
// not survive, leaving the old snapshot instead; either is a whole snapshot).
TEST_F(SnapshotCrashTest, FailedDirectorySyncLeavesACompleteSnapshot) {
  FaultInjectionFiles files;
  auto store = OpenStore(&files);
  ASSERT_NE(store, nullptr);
  ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
  files.set_crash_at_fault(true);
  files.FailSyncDir();
  EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
  EXPECT_EQ(files.faults_fired(), 1);
  store.reset();
  EXPECT_TRUE(TmpFiles(dir_.path()).empty());
  ExpectRestoresTo(Expect::kNew);
}

// A full disk: the write fails part-way with RESOURCE_EXHAUSTED. The process survives, the live
// session is untouched, the partial file is cleaned up; a later crash restores the old snapshot,
// and once space is back the next park succeeds.
TEST_F(SnapshotCrashTest, FullDiskKeepsTheOldSnapshotAndTheLiveSession) {
  for (int64_t written : {int64_t{-1}, int64_t{0}, new_snapshot_bytes_ / 2}) {
    SCOPED_TRACE(absl::StrCat("disk full after ", written, " bytes"));
    std::filesystem::remove_all(dir_.path());
    std::filesystem::create_directories(dir_.path());
    FaultInjectionFiles files;
    auto store = OpenStore(&files);
    ASSERT_NE(store, nullptr);
    ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
    files.FailWriteNoSpace(written);
    EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
    EXPECT_EQ(store->Stats().snapshot_errors, 1);
    EXPECT_TRUE(TmpFiles(dir_.path()).empty());
    auto info = store->Get(kId);
    ASSERT_TRUE(info.ok());
    EXPECT_NE(info->tier, Tier::kDisk);  // kept in memory, not lost
    int64_t position = -1;
    EXPECT_TRUE(testing::BitwiseEqual(ProbeCopy(*store, &position), new_logits_));
    store.reset();
    ExpectRestoresTo(Expect::kOld);
  }
}

TEST_F(SnapshotCrashTest, FullDiskThenSpaceFreedPersistsTheNewState) {
  FaultInjectionFiles files;
  auto store = OpenStore(&files);
  ASSERT_NE(store, nullptr);
  ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
  files.FailWriteNoSpace(100);
  EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
  ASSERT_TRUE(store->Park(kId, Tier::kDisk).ok());  // the fault fires once
  store.reset();
  ExpectRestoresTo(Expect::kNew);
}

// The first snapshot of a session is cut short by a crash: there is nothing to restore, and the
// directory opens cleanly (no error, no quarantine, the .tmp removed).
TEST_F(SnapshotCrashTest, CrashDuringFirstSnapshotLeavesNoSession) {
  FaultInjectionFiles files;
  auto store = OpenStore(&files);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Create(kId, "meta").ok());
  {
    auto lease = store->Acquire(kId);
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(engine_->Prefill(lease->state(), prompt_, false, nullptr).ok());
  }
  files.set_crash_at_fault(true);
  files.FailWriteAfter(100);
  EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
  store.reset();
  ASSERT_EQ(TmpFiles(dir_.path()).size(), 1u);
  auto reopened = OpenStore(StateFiles::Default());
  ASSERT_NE(reopened, nullptr);
  EXPECT_TRUE(reopened->open_errors().empty());
  EXPECT_TRUE(TmpFiles(dir_.path()).empty());
  EXPECT_EQ(reopened->Acquire(kId).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reopened->Stats().quarantined, 0);
}

// A failed snapshot of one session does not disturb the snapshots of others.
TEST_F(SnapshotCrashTest, CrashWritingOneSessionLeavesOthersIntact) {
  FaultInjectionFiles files;
  auto store = OpenStore(&files);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Create("other", "").ok());
  {
    auto lease = store->Acquire("other");
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(engine_->Prefill(lease->state(), continuation_, false, nullptr).ok());
  }
  ASSERT_TRUE(store->Park("other", Tier::kDisk).ok());
  ASSERT_NO_FATAL_FAILURE(WriteOldSnapshotThenContinue(*store));
  files.set_crash_at_fault(true);
  files.FailWriteAfter(new_snapshot_bytes_ / 2);
  EXPECT_FALSE(store->Park(kId, Tier::kDisk).ok());
  store.reset();

  auto other_ref = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*other_ref, continuation_, false, nullptr).ok());
  const std::vector<float> other_logits = testing::ProbeLogits(*engine_, *other_ref, kProbe);
  ExpectRestoresTo(Expect::kOld);
  auto reopened = OpenStore(StateFiles::Default());
  ASSERT_NE(reopened, nullptr);
  auto lease = reopened->Acquire("other");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(
      testing::BitwiseEqual(testing::ProbeLogits(*engine_, lease->state(), kProbe), other_logits));
}

// ---- Real crashes: a child process rewriting a snapshot is killed with SIGKILL ----

// The child alternates snapshots A and B of the same session at one path until it is killed.
[[noreturn]] void RewriteForever(const std::filesystem::path& path, const std::string& a,
                                 const std::string& b) {
  for (uint64_t i = 0;; ++i) {
    if (!StateFiles::Default()->WriteAtomically(path, i % 2 == 0 ? b : a).ok()) _exit(3);
  }
}

TEST(SnapshotKillTest, KilledWriterLeavesExactlyOneOfTheSnapshots) {
  testing::ScopedTempDir dir;
  const std::filesystem::path path = dir.path() / "s.sdmstate";
  std::string a, b;
  int64_t position_a = 0, position_b = 0;
  std::vector<float> logits_a, logits_b;
  {
    auto engine = testing::TinyEngine();
    auto session = engine->NewSession();
    ASSERT_TRUE(engine->Prefill(*session, testing::RandomTokens(40, 3), false, nullptr).ok());
    a = EncodeSessionState(*session, SessionRecord{"s", "A"}, engine->fingerprint());
    position_a = session->position();
    // B: a longer history, so that a torn write could not pass for A by its size.
    testing::DecodeEach(*engine, *session, testing::RandomTokens(30, 4));
    b = EncodeSessionState(*session, SessionRecord{"s", "B"}, engine->fingerprint());
    position_b = session->position();
  }
  ASSERT_NE(a.size(), b.size());
  ASSERT_TRUE(StateFiles::Default()->WriteAtomically(path, a).ok());

  auto engine = testing::TinyEngine();
  std::vector<uint32_t> seeds;
  for (uint32_t s = 1; s <= 40; ++s) seeds.push_back(s);
  std::random_device fresh;
  for (int i = 0; i < 8; ++i) seeds.push_back(fresh());
  int saw_a = 0, saw_b = 0, saw_tmp = 0;
  size_t temps = 0;  // each write has a temporary file of its own: a killed one's stays
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t seed : seeds) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    std::mt19937 rng(seed);
    const int delay_us = std::uniform_int_distribution<int>(0, 30000)(rng);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) RewriteForever(path, a, b);
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the writer stopped by itself (exit " << WEXITSTATUS(status) << ")";

    // The final name holds one whole snapshot, byte for byte.
    const std::string found = testing::ReadFile(path);
    ASSERT_TRUE(found == a || found == b) << "torn snapshot of " << found.size() << " bytes";
    (found == a ? saw_a : saw_b)++;
    if (TmpFiles(dir.path()).size() > temps) ++saw_tmp;
    temps = TmpFiles(dir.path()).size();
    auto decoded = DecodeSessionState(found, engine->state_layout(), engine->fingerprint());
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->state->position(), found == a ? position_a : position_b);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << seeds.size() << " kills in " << seconds << " s: final file A " << saw_a
            << " times, B " << saw_b << " times; a .tmp was left " << saw_tmp << " times\n";

  // A store opened on the directory removes the leftover .tmp and restores the session exactly.
  SessionStoreOptions options;
  options.dir = dir.path();
  options.background = false;
  auto store = SessionStateStore::Open(engine->state_layout(), engine->fingerprint(), options);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->open_errors().empty());
  EXPECT_TRUE(TmpFiles(dir.path()).empty());
  auto lease = (*store)->Acquire("s");
  ASSERT_TRUE(lease.ok()) << lease.status();
  const bool is_a = testing::ReadFile(path) == a;
  EXPECT_EQ(lease->state().position(), is_a ? position_a : position_b);
  auto info = (*store)->Get("s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->metadata, is_a ? "A" : "B");
}

}  // namespace
}  // namespace sdm
