// The store's typed keys, per-tenant counters, positions without a lease, one-shot sessions, and
// snapshots named by the scheme the server used before keys were typed.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/check.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "gtest/gtest.h"
#include "state_store/session_key.h"
#include "state_store/session_store.h"
#include "state_store/state_codec.h"
#include "state_store/state_files.h"
#include "tests/state_store/snapshot_test_util.h"

namespace sdm {
namespace {

class KeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig c = *PresetConfig("tiny");
    SDM_CHECK(FinalizeModelConfig(c).ok());
    EngineOptions o;
    o.num_threads = 1;
    auto e = Engine::Create(RandomModel(c, 3), o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("sdm_keys_test_", ::getpid(), "_", counter_++);
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<SessionStateStore> Open(SessionStoreOptions o = {}) {
    o.dir = dir_;
    o.background = false;
    auto s = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), o);
    SDM_CHECK(s.ok());
    return *std::move(s);
  }

  void Feed(SessionStateStore& store, const SessionKey& key, int n, uint32_t seed) {
    auto lease = store.Acquire(key);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ASSERT_TRUE(
        engine_->Prefill(lease->state(), testing::RandomTokens(n, seed), false, nullptr).ok());
  }

  static inline int counter_ = 0;
  std::unique_ptr<Engine> engine_;
  std::filesystem::path dir_;
};

TEST_F(KeysTest, KeysThatCollideAsStringsStayDistinctAcrossARestart) {
  const std::vector<SessionKey> keys = {
      {"a", "b-c"},
      {"a-b", "c"},
      {"1-a", "b"},
      {"", "1-a-b"},
      {"a", "1-a-b"},
      {"", "h-x"},
      {"t", std::string(128, 's')},
      {"t", std::string(127, 's') + "z"},
      {std::string(64, 'u'), std::string(128, 's')},
  };
  {
    auto store = Open();
    for (size_t i = 0; i < keys.size(); ++i) {
      ASSERT_TRUE(store->Create(keys[i], DebugString(keys[i])).ok()) << DebugString(keys[i]);
      Feed(*store, keys[i], static_cast<int>(i) + 1, static_cast<uint32_t>(i));
    }
    EXPECT_EQ(store->Create(keys[0], "again").code(), absl::StatusCode::kAlreadyExists);
    ASSERT_TRUE(store->PersistAll().ok());
  }
  auto store = Open();
  EXPECT_TRUE(store->open_errors().empty());
  EXPECT_EQ(store->List().size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<SessionInfo> info = store->Get(keys[i]);
    ASSERT_TRUE(info.ok()) << DebugString(keys[i]);
    EXPECT_EQ(info->key, keys[i]);
    EXPECT_EQ(info->metadata, DebugString(keys[i]));
    EXPECT_EQ(info->tier, Tier::kDisk);
    // Known from the snapshot's record, without a lease.
    EXPECT_EQ(info->position, static_cast<int64_t>(i) + 1);
    auto lease = store->Acquire(keys[i]);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), static_cast<int64_t>(i) + 1);
  }
  // A tenant lists only its own, in id order.
  std::vector<std::string> ids;
  for (const SessionInfo& info : store->List("a")) ids.push_back(info.key.id);
  EXPECT_EQ(ids, (std::vector<std::string>{"1-a-b", "b-c"}));
}

TEST_F(KeysTest, ErrorsNameTheSessionByItsIdOnly) {
  auto store = Open();
  const SessionKey key("secret-tenant", "chat");
  ASSERT_TRUE(store->Create(key, "").ok());
  auto lease = store->Acquire(key);
  ASSERT_TRUE(lease.ok());
  for (const absl::Status& s :
       {store->Acquire(key).status(), store->Delete(key),
        store->Fork(key, {"secret-tenant", "x"}, ""),
        store->Get({"secret-tenant", "nope"}).status(), store->Create(key, "")}) {
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.message().find("secret-tenant"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("'"), absl::string_view::npos) << s;
  }
}

// Usage() kept by the store equals a recount over List(tenant) after every operation.
void CheckCounters(const SessionStateStore& store, const std::vector<std::string>& tenants,
                   const std::string& context) {
  int64_t all = 0;
  for (const std::string& tenant : tenants) {
    TenantUsage recount;
    for (const SessionInfo& info : store.List(tenant)) {
      ++recount.sessions;
      recount.state_bytes += info.bytes;
    }
    all += recount.sessions;
    const TenantUsage kept = store.Usage(tenant);
    ASSERT_EQ(kept.sessions, recount.sessions) << context << " tenant '" << tenant << "'";
    ASSERT_EQ(kept.state_bytes, recount.state_bytes) << context << " tenant '" << tenant << "'";
  }
  ASSERT_EQ(all, static_cast<int64_t>(store.List().size())) << context;
}

void RandomOperations(Engine& engine, SessionStateStore& store, uint32_t seed) {
  const std::vector<std::string> tenants = {"", "a", "a-b", "b"};
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  auto key = [&] { return SessionKey(tenants[pick(4)], absl::StrCat("s", pick(5))); };
  for (int step = 0; step < 150; ++step) {
    const SessionKey k = key();
    const int op = pick(7);
    std::string what;
    switch (op) {
      case 0:
        what = "create";
        store.Create(k, "m").IgnoreError();
        break;
      case 1:
        what = "fork";
        store.Fork(key(), k, "f").IgnoreError();
        break;
      case 2:
        what = "delete";
        store.Delete(k).IgnoreError();
        break;
      case 3:
      case 4: {
        what = "turn";
        auto lease = store.Acquire(k);
        if (lease.ok()) {
          ASSERT_TRUE(engine
                          .Prefill(lease->state(), testing::RandomTokens(1 + pick(12), rng()),
                                   false, nullptr)
                          .ok());
        }
        break;
      }
      case 5:
        what = "park";
        store.Park(k, pick(2) == 0 ? Tier::kHost : Tier::kDisk).IgnoreError();
        break;
      case 6: {
        what = "resume";
        auto lease = store.Acquire(k);
        break;
      }
    }
    CheckCounters(store, tenants,
                  absl::StrCat("seed ", seed, " step ", step, " ", what, " ", DebugString(k)));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_F(KeysTest, TenantCountersEqualAFullRecount) {
  std::vector<uint32_t> seeds = {1, 2, 3};
  const uint32_t fresh = std::random_device{}();
  std::printf("fresh seed: %u\n", fresh);
  seeds.push_back(fresh);
  for (uint32_t seed : seeds) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    SessionStoreOptions o;
    // Tight budgets: the store parks sessions on its own too.
    o.resident_budget_bytes = 40'000;
    o.host_budget_bytes = 20'000;
    auto store = Open(o);
    RandomOperations(*engine_, *store, seed);
    if (HasFatalFailure()) return;
  }
}

TEST_F(KeysTest, OneShotSessionsAreCountedWhileTheyLive) {
  auto store = Open();
  const StoreStats before = store->Stats();
  EXPECT_EQ(before.one_shot, 0);
  EXPECT_EQ(before.rows_live, 0);
  {
    SessionLease one_shot = store->NewSession();
    ASSERT_TRUE(one_shot);
    EXPECT_TRUE(one_shot.one_shot());
    const StoreStats fresh = store->Stats();
    EXPECT_EQ(fresh.one_shot, 1);
    EXPECT_EQ(fresh.bytes[0], before.bytes[0] + one_shot.state().ResidentBytes());
    EXPECT_GE(fresh.bytes[0], before.bytes[0] + store->MinSessionBytes());
    ASSERT_TRUE(
        engine_->Prefill(one_shot.state(), testing::RandomTokens(16, 9), false, nullptr).ok());
    const StoreStats running = store->Stats();
    // Its SDM rows come from the store's pool and count while it runs.
    EXPECT_GT(running.rows_live, 0);
    EXPECT_GT(running.bytes[0], fresh.bytes[0]);
    EXPECT_TRUE(store->List().empty());  // it has no key
  }
  const StoreStats after = store->Stats();
  EXPECT_EQ(after.one_shot, 0);
  EXPECT_EQ(after.rows_live, 0);
  EXPECT_EQ(after.bytes[0], before.bytes[0]);
}

// Snapshots as the server wrote them before keys were typed: the record's id was the file stem,
// "<n>-<tenant>-<id>", or "h-" + SHA-256 of that for long pairs.
class OldSnapshotTest : public KeysTest {
 protected:
  void WriteOld(const std::string& stem, const std::string& metadata, int tokens) {
    auto state = engine_->NewSession();
    ASSERT_TRUE(engine_->Prefill(*state, testing::RandomTokens(tokens, 5), false, nullptr).ok());
    const std::string blob =
        EncodeSessionState(*state, SessionRecord{stem, metadata, -1, 0}, engine_->fingerprint());
    ASSERT_TRUE(StateFiles::Default()->WriteAtomically(dir_ / (stem + ".sdmstate"), blob).ok());
  }
  void SetUp() override {
    KeysTest::SetUp();
    WriteOld("7-default-chat-1", "default/chat-1", 11);
    // sha256sum of "1-t-" followed by 125 'x'.
    WriteOld("h-672e651a4eabe51a10defe7d98535428f321a1b98e2654008c25177d9e75a9a4", "t/" + long_id_,
             13);
  }
  const std::string long_id_ = std::string(125, 'x');
};

TEST_F(OldSnapshotTest, ResumeWithTheirKeysFromTheMetadata) {
  SessionStoreOptions o;
  o.legacy_key = [](absl::string_view metadata) -> std::optional<SessionKey> {
    std::vector<std::string> parts = absl::StrSplit(metadata, '/');
    if (parts.size() != 2) return std::nullopt;
    return SessionKey(parts[0], parts[1]);
  };
  auto store = Open(o);
  EXPECT_TRUE(store->open_errors().empty());
  EXPECT_EQ(store->Usage("t").sessions, 1);
  ASSERT_EQ(store->List("t").size(), 1u);
  EXPECT_EQ(store->List("t")[0].key.id, long_id_);
  EXPECT_EQ(store->Get({"default", "chat-1"})->position, 11);
  EXPECT_EQ(store->Get({"t", long_id_})->position, 13);
  for (const SessionKey& key : {SessionKey("default", "chat-1"), SessionKey("t", long_id_)}) {
    auto lease = store->Acquire(key);
    ASSERT_TRUE(lease.ok()) << lease.status();
  }
  // Written again, under the same names (no second snapshot; a delta log may sit beside one).
  ASSERT_TRUE(store->PersistAll().ok());
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    files += e.is_regular_file() && e.path().extension() == ".sdmstate";
  }
  EXPECT_EQ(files, 2);
  store.reset();
  auto reopened = Open();  // no resolver needed now: the record names the key
  EXPECT_EQ(reopened->Get({"t", long_id_})->position, 13);
  EXPECT_EQ(reopened->Usage("t").sessions, 1);
}

TEST_F(OldSnapshotTest, WithoutAResolverAHashedOneIsFoundByItsKey) {
  auto store = Open();
  EXPECT_TRUE(store->open_errors().empty());
  EXPECT_EQ(store->Get({"default", "chat-1"})->position, 11);
  EXPECT_EQ(store->Get({"t", long_id_})->position, 13);
  EXPECT_FALSE(store->Get({"t", long_id_ + "y"}).ok());
  auto lease = store->Acquire({"t", long_id_});
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->state().position(), 13);
  EXPECT_EQ(store->Usage("t").sessions, 1);  // adopted
}

}  // namespace
}  // namespace sdm
