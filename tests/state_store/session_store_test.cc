#include "state_store/session_store.h"

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "state_store/state_codec.h"
#include "tests/base/captured_log.h"
#include "tests/base/eventually.h"
#include "tests/state_store/held_read_files.h"

namespace sdm {
namespace {

enum class Kind { kSdm, kFullAttention, kMixed };

ModelConfig ConfigOf(Kind kind) {
  ModelConfig c = *PresetConfig("tiny");
  if (kind == Kind::kFullAttention) {
    c.swa_at.clear();
    c.sdm_at.clear();
    c.attn_at = {0, 1, 2, 3};
  } else if (kind == Kind::kMixed) {
    c.n_layers = 5;
    c.swa_at = {0, 2};
    c.attn_at = {3};
    c.sdm_at = {1, 4};
    c.swa_window = 6;
  }
  SDM_CHECK(FinalizeModelConfig(c).ok());
  return c;
}

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, 257);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            absl::StrCat("sdm_store_test_", ::getpid(), "_", counter_++);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::filesystem::path path_;
};

class StoreTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    config_ = ConfigOf(GetParam());
    EngineOptions o;
    o.num_threads = 2;
    auto e = Engine::Create(RandomModel(config_, 3), o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
  }

  std::unique_ptr<SessionStateStore> OpenStore(const std::filesystem::path& dir,
                                               int64_t resident = int64_t{1} << 30,
                                               int64_t host = int64_t{1} << 30) {
    SessionStoreOptions o;
    o.dir = dir;
    o.resident_budget_bytes = resident;
    o.host_budget_bytes = host;
    o.background = false;
    auto s = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), o);
    SDM_CHECK(s.ok());
    return *std::move(s);
  }

  // Feeds `tokens` one by one (batch 1) and returns every step's logits.
  std::vector<float> DecodeEach(SessionState& s, const std::vector<int32_t>& tokens) {
    std::vector<float> all, step(config_.vocab_size);
    for (int32_t t : tokens) {
      SessionState* p = &s;
      SDM_CHECK(engine_->Decode({&p, 1}, {&t, 1}, step).ok());
      all.insert(all.end(), step.begin(), step.end());
    }
    return all;
  }

  ModelConfig config_;
  std::unique_ptr<Engine> engine_;
};

TEST_P(StoreTest, ResumeFromHostAndDiskAfterRestartIsBitExact) {
  TempDir dir;
  const auto prompt = Tokens(20, 1);  // past the SWA windows
  const auto more = Tokens(8, 2);
  // The reference: a session that never leaves residency.
  auto control = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*control, prompt, false, nullptr).ok());
  const std::vector<float> want = DecodeEach(*control, more);

  {
    auto store = OpenStore(dir.path());
    ASSERT_TRUE(store->Create("s1", "meta-1").ok());
    {
      auto lease = store->Acquire("s1");
      ASSERT_TRUE(lease.ok()) << lease.status();
      ASSERT_TRUE(engine_->Prefill(lease->state(), prompt, false, nullptr).ok());
      lease->state().sampler_draws = 7;
      lease->state().pending_token = 42;
    }
    ASSERT_TRUE(store->Park("s1", Tier::kHost).ok());
    EXPECT_EQ(store->Get("s1")->tier, Tier::kHost);
    ASSERT_TRUE(store->Park("s1", Tier::kDisk).ok());
    EXPECT_EQ(store->Get("s1")->tier, Tier::kDisk);
    const StoreStats st = store->Stats();
    EXPECT_EQ(st.evictions[0], 1);
    EXPECT_EQ(st.evictions[1], 1);
    EXPECT_EQ(st.rows_live, 0);  // nothing of it stays resident
  }
  // A new store object reading the same directory (a restart).
  auto store = OpenStore(dir.path());
  EXPECT_TRUE(store->open_errors().empty());
  auto info = store->Get("s1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tier, Tier::kDisk);
  EXPECT_EQ(info->metadata, "meta-1");
  auto lease = store->Acquire("s1");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), 20);
  EXPECT_EQ(lease->state().sampler_draws, 7u);
  EXPECT_EQ(lease->state().pending_token, 42);
  EXPECT_EQ(DecodeEach(lease->state(), more), want);  // bit-identical
  EXPECT_EQ(store->Stats().restores[2], 1);
}

TEST_P(StoreTest, ForkContinuesLikeAReplayAndSharesUntouchedRows) {
  auto store = OpenStore({});
  const auto prefix = Tokens(12, 3), a = Tokens(6, 4), b = Tokens(6, 5);
  ASSERT_TRUE(store->Create("orig", "").ok());
  {
    auto lease = store->Acquire("orig");
    ASSERT_TRUE(engine_->Prefill(lease->state(), prefix, false, nullptr).ok());
  }
  const int64_t rows_before = store->Stats().rows_live;
  ASSERT_TRUE(store->Fork("orig", "copy", "forked").ok());
  EXPECT_EQ(store->Stats().rows_live, rows_before);  // nothing copied yet
  if (GetParam() != Kind::kFullAttention) {
    EXPECT_GT(rows_before, 0);
    EXPECT_EQ(store->Stats().rows_shared, rows_before);  // every row shared
    EXPECT_EQ(store->Get("copy")->shared_rows, rows_before);
  }
  std::vector<float> got_a, got_b;
  {
    auto lease = store->Acquire("orig");
    got_a = DecodeEach(lease->state(), a);
  }
  {
    auto lease = store->Acquire("copy");
    got_b = DecodeEach(lease->state(), b);
  }
  // Replays from scratch with the same calls.
  auto ra = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*ra, prefix, false, nullptr).ok());
  EXPECT_EQ(got_a, DecodeEach(*ra, a));
  auto rb = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*rb, prefix, false, nullptr).ok());
  EXPECT_EQ(got_b, DecodeEach(*rb, b));
  if (GetParam() != Kind::kFullAttention) {
    // Writing copied only the rows each side wrote; the rest stay shared.
    const StoreStats st = store->Stats();
    EXPECT_GT(st.rows_shared, 0);
    EXPECT_LT(st.rows_shared, rows_before);
    // Each shared row is referenced by exactly the two sessions.
    const int64_t mapped = store->Get("orig")->private_rows + store->Get("copy")->private_rows;
    EXPECT_EQ(st.rows_live, mapped - st.rows_shared);
  }
}

// A shutdown's PersistAll says what it is about to write and when it is done, so an operator
// waiting on a long shutdown sees it working; a store with nothing in memory says nothing.
TEST_P(StoreTest, PersistAllSaysWhatItWritesAndWhenItIsDone) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_TRUE(store->Create("s1", "").ok());
  ASSERT_TRUE(store->Create("s2", "").ok());
  {
    testing::CapturedLog log;
    ASSERT_TRUE(store->PersistAll().ok());
    EXPECT_EQ(log.With("sdm state store: writing 2 sessions in memory (").size(), 1u);
    EXPECT_EQ(log.With("sdm state store: wrote 2 sessions in ").size(), 1u);
  }
  testing::CapturedLog log;
  ASSERT_TRUE(store->PersistAll().ok());  // everything is on disk now
  EXPECT_TRUE(log.With("sdm state store: w").empty());
}

TEST_P(StoreTest, EvictionUnderPressureKeepsEverySessionExact) {
  TempDir dir;
  // Room for about two resident sessions and less than one serialised one: the rest go to disk
  // and come back.
  auto probe = engine_->NewSession();
  ASSERT_TRUE(engine_->Prefill(*probe, Tokens(10, 9), false, nullptr).ok());
  const int64_t one = probe->ResidentBytes();
  const int64_t blob = EncodeSessionState(*probe, {}, 0).size();
  auto store = OpenStore(dir.path(), 2 * one + 1, blob + blob / 2);
  const int kSessions = 8, kRounds = 3;
  std::vector<std::unique_ptr<SessionState>> controls;
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_TRUE(store->Create(absl::StrCat("s", i), "").ok());
    controls.push_back(engine_->NewSession());
  }
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < kSessions; ++i) {
      const auto toks = Tokens(4, 100 * round + i);
      auto lease = store->Acquire(absl::StrCat("s", i));
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(DecodeEach(lease->state(), toks), DecodeEach(*controls[i], toks))
          << "session " << i << " round " << round;
    }
  }
  const StoreStats st = store->Stats();
  EXPECT_GT(st.evictions[0], 0);
  EXPECT_GT(st.evictions[1], 0);
  EXPECT_GT(st.restores[2], 0);
  EXPECT_LE(st.bytes[0], 2 * one + 1 + one);  // the budget, plus the one just released
  EXPECT_EQ(st.sessions[0] + st.sessions[1] + st.sessions[2], kSessions);
}

// A session a failed engine step left half-updated (SessionState::MarkFailed, as the backends'
// ForwardCommit does) is refused from then on, never written over its last good snapshot, never
// parked; deleting it resets the name.
TEST_P(StoreTest, ASessionDamagedByAFailedStepIsRefusedAndItsSnapshotKept) {
  TempDir dir;
  const auto prompt = Tokens(7, 11);
  {
    auto store = OpenStore(dir.path());
    ASSERT_TRUE(store->Create("s1", "").ok());
    {
      auto lease = store->Acquire("s1");
      ASSERT_TRUE(lease.ok()) << lease.status();
      ASSERT_TRUE(engine_->Prefill(lease->state(), prompt, false, nullptr).ok());
    }
    ASSERT_TRUE(store->PersistAll().ok());
    {
      auto lease = store->Acquire("s1");
      ASSERT_TRUE(lease.ok()) << lease.status();
      // What a failed step leaves: more consumed in the layers, the mark on the state.
      ASSERT_TRUE(engine_->Prefill(lease->state(), Tokens(3, 12), false, nullptr).ok());
      lease->state().MarkFailed(absl::InternalError("a failed step left this session x"));
    }
    const absl::StatusOr<SessionLease> again = store->Acquire("s1");
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
    EXPECT_NE(again.status().message().find("session 's1'"), std::string::npos);
    EXPECT_NE(again.status().message().find("a failed step left this session x"),
              std::string::npos);
    EXPECT_NE(again.status().message().find("delete"), std::string::npos);
    EXPECT_EQ(store->Park("s1", Tier::kHost).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_FALSE(store->Get("s1")->error.empty());
    ASSERT_TRUE(store->PersistAll().ok());  // skips it
  }
  {
    // The snapshot on disk is the last good copy: the prompt, not the damaged turn.
    auto store = OpenStore(dir.path());
    {
      auto lease = store->Acquire("s1");
      ASSERT_TRUE(lease.ok()) << lease.status();
      EXPECT_EQ(lease->state().position(), 7);
      EXPECT_FALSE(lease->state().failed());
    }
    ASSERT_TRUE(store->Delete("s1").ok());
    ASSERT_TRUE(store->Create("s1", "").ok());
  }
  {
    // Deleting a damaged session resets its name.
    auto store = OpenStore(dir.path());
    {
      auto lease = store->Acquire("s1");
      ASSERT_TRUE(lease.ok());
      lease->state().MarkFailed(absl::InternalError("broken"));
    }
    ASSERT_FALSE(store->Acquire("s1").ok());
    ASSERT_TRUE(store->Delete("s1").ok());
    ASSERT_TRUE(store->Create("s1", "").ok());
    auto lease = store->Acquire("s1");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, StoreTest,
                         ::testing::Values(Kind::kSdm, Kind::kFullAttention, Kind::kMixed));

class StoreLimitsTest : public StoreTest {};

TEST_P(StoreLimitsTest, ClearErrorsAndNothingLost) {
  TempDir dir;
  SessionStoreOptions o;
  o.dir = dir.path();
  o.background = false;
  o.resident_budget_bytes = 1;
  {
    auto too_small = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), o);
    if (GetParam() != Kind::kFullAttention) {
      EXPECT_EQ(too_small.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(too_small.status().message().find("smaller than one session"), std::string::npos);
    }
  }  // (an open store holds its directory for itself)
  auto store = OpenStore(dir.path());
  EXPECT_EQ(store->Acquire("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Create("bad id!", "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Create("../x", "").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store->Create("a", "").ok());
  EXPECT_EQ(store->Create("a", "").code(), absl::StatusCode::kAlreadyExists);
  {
    auto lease = store->Acquire("a");
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(store->Acquire("a").status().code(), absl::StatusCode::kAborted);
    EXPECT_EQ(store->Delete("a").code(), absl::StatusCode::kAborted);
    EXPECT_EQ(store->Fork("a", "b", "").code(), absl::StatusCode::kAborted);
    EXPECT_EQ(store->Park("a", Tier::kDisk).code(), absl::StatusCode::kAborted);
  }
  EXPECT_EQ(store->Fork("missing", "b", "").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store->Park("a", Tier::kDisk).ok());
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "a.sdmstate"));
  ASSERT_TRUE(store->Delete("a").ok());
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "a.sdmstate"));
  EXPECT_EQ(store->Delete("a").code(), absl::StatusCode::kNotFound);  // double delete
}

TEST_P(StoreLimitsTest, IdleSessionsExpireAfterTheirTtl) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  const absl::Time before = absl::Now();  // "short" was last used at or after this
  ASSERT_TRUE(store->Create("short", "", absl::Seconds(5)).ok());
  ASSERT_TRUE(store->Create("forever", "").ok());
  ASSERT_TRUE(store->Park("short", Tier::kDisk).ok());
  EXPECT_EQ(store->ExpireIdle(before + absl::Seconds(1)), 0);
  EXPECT_EQ(store->ExpireIdle(absl::Now() + absl::Seconds(10)), 1);
  EXPECT_EQ(store->Get("short").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "short.sdmstate"));
  EXPECT_TRUE(store->Get("forever").ok());
  EXPECT_EQ(store->Stats().expired, 1);
}

TEST_P(StoreLimitsTest, PersistAllThenRestartKeepsEverySession) {
  TempDir dir;
  std::vector<float> want;
  const auto toks = Tokens(5, 77);
  {
    auto store = OpenStore(dir.path());
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(store->Create(absl::StrCat("p", i), absl::StrCat("m", i)).ok());
      auto lease = store->Acquire(absl::StrCat("p", i));
      ASSERT_TRUE(engine_->Prefill(lease->state(), Tokens(7, i), false, nullptr).ok());
    }
    ASSERT_TRUE(store->Fork("p1", "p1-fork", "f").ok());
    ASSERT_TRUE(store->PersistAll().ok());
    auto lease = store->Acquire("p1-fork");
    auto copy = lease->state().Clone();
    want = DecodeEach(*copy, toks);
  }
  auto store = OpenStore(dir.path());
  EXPECT_EQ(store->List().size(), 4u);
  EXPECT_EQ(store->Get("p2")->metadata, "m2");
  auto lease = store->Acquire("p1-fork");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(DecodeEach(lease->state(), toks), want);
}

INSTANTIATE_TEST_SUITE_P(Models, StoreLimitsTest,
                         ::testing::Values(Kind::kSdm, Kind::kFullAttention));

TEST(StoreBackgroundTest, WorkerParksIdleSessionsOffTheCallingThread) {
  ModelConfig c = ConfigOf(Kind::kSdm);
  auto engine = *Engine::Create(RandomModel(c, 4), EngineOptions{});
  TempDir dir;
  SessionStoreOptions o;
  o.dir = dir.path();
  o.background = true;
  auto probe = engine->NewSession();
  ASSERT_TRUE(engine->Prefill(*probe, Tokens(6, 1), false, nullptr).ok());
  o.resident_budget_bytes = probe->ResidentBytes() + 1;
  o.host_budget_bytes = 1;  // everything parked goes on to disk
  auto store = *SessionStateStore::Open(engine->state_layout(), engine->fingerprint(), o);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(store->Create(absl::StrCat("b", i), "").ok());
    auto lease = store->Acquire(absl::StrCat("b", i));
    ASSERT_TRUE(engine->Prefill(lease->state(), Tokens(6, i), false, nullptr).ok());
  }
  // The worker moves the idle sessions down within a few of its one-second rounds.
  EXPECT_TRUE(testing::Eventually([&] { return store->Stats().sessions[2] >= 3; }));
  auto lease = store->Acquire("b0");
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), 6);
}

// Get, List and Usage answer from the session's record while its state is being read back from
// disk (issue 11: a Get once waited 4.6 s for the restore of a 1 GB session). The restore's read
// is held until Get has answered: a Get that waited for it would never answer (the read gives up
// after 60 s and the test fails).
TEST(StoreRestoreTest, GetAnswersWhileTheSessionIsBeingRestored) {
  ModelConfig c = ConfigOf(Kind::kSdm);
  auto engine = *Engine::Create(RandomModel(c, 5), EngineOptions{.num_threads = 1});
  TempDir dir;
  testing::HeldReadFiles files;
  SessionStoreOptions o;
  o.dir = dir.path();
  o.background = false;
  o.files = &files;
  {
    auto store = *SessionStateStore::Open(engine->state_layout(), engine->fingerprint(), o);
    ASSERT_TRUE(store->Create("big", "meta").ok());
    auto lease = store->Acquire("big");
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_TRUE(engine->Prefill(lease->state(), Tokens(12, 3), false, nullptr).ok());
  }
  auto store = *SessionStateStore::Open(engine->state_layout(), engine->fingerprint(), o);
  ASSERT_EQ(store->Get("big")->tier, Tier::kDisk);
  absl::StatusOr<SessionLease> restored;
  std::thread restore([&] { restored = store->Acquire("big"); });
  files.WaitUntilHeld();  // the restore is reading the snapshot now
  const absl::StatusOr<SessionInfo> info = store->Get("big");
  const std::vector<SessionInfo> listed = store->List();
  const TenantUsage usage = store->Usage("");
  files.Release();
  restore.join();
  EXPECT_FALSE(files.timed_out()) << "Get waited for the restore";
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->position, 12);
  EXPECT_EQ(info->metadata, "meta");
  EXPECT_TRUE(info->in_use);  // the restore holds it for its caller
  EXPECT_TRUE(info->error.empty());
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].key.id, "big");
  EXPECT_EQ(usage.sessions, 1);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->state().position(), 12);
}

}  // namespace
}  // namespace sdm

namespace sdm {
namespace {

// The SWA ring is sized window + prefill chunk: a snapshot taken by an engine with one chunk size
// resumes exactly in an engine with another.
TEST(StoreRingTest, SnapshotResumesUnderAnotherPrefillChunk) {
  ModelConfig c = ConfigOf(Kind::kMixed);
  auto model = RandomModel(c, 8);
  EngineOptions small, large;
  small.prefill_chunk = 4;
  large.prefill_chunk = 64;
  auto a = *Engine::Create(model, small);
  auto b = *Engine::Create(model, large);
  ASSERT_EQ(a->fingerprint(), b->fingerprint());
  TempDir dir;
  SessionStoreOptions o;
  o.dir = dir.path();
  o.background = false;
  const auto prompt = Tokens(23, 4), more = Tokens(6, 5);
  std::vector<float> want;
  {
    auto store = *SessionStateStore::Open(a->state_layout(), a->fingerprint(), o);
    ASSERT_TRUE(store->Create("r", "").ok());
    auto lease = store->Acquire("r");
    ASSERT_TRUE(a->Prefill(lease->state(), prompt, false, nullptr).ok());
    auto copy = lease->state().Clone();
    for (int32_t t : more) {
      std::vector<float> step(c.vocab_size);
      SessionState* p = copy.get();
      ASSERT_TRUE(a->Decode({&p, 1}, {&t, 1}, step).ok());
      want.insert(want.end(), step.begin(), step.end());
    }
    lease = SessionLease();
    ASSERT_TRUE(store->Park("r", Tier::kDisk).ok());
  }
  auto store = *SessionStateStore::Open(b->state_layout(), b->fingerprint(), o);
  EXPECT_TRUE(store->open_errors().empty());
  auto lease = store->Acquire("r");
  ASSERT_TRUE(lease.ok()) << lease.status();
  std::vector<float> got;
  for (int32_t t : more) {
    std::vector<float> step(c.vocab_size);
    SessionState* p = &lease->state();
    ASSERT_TRUE(b->Decode({&p, 1}, {&t, 1}, step).ok());
    got.insert(got.end(), step.begin(), step.end());
  }
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace sdm
