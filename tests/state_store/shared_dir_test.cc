// Shared snapshot directory (state_store/session_store.h, "Shared snapshot directory"): stores
// standing for replicas, on one directory, find each other's sessions, continue them bit-exactly
// wherever they were last written, and see deletions. Writes are inline (background false), so
// a session's turn is on disk when its lease is returned.
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "engine/engine.h"
#include "gtest/gtest.h"
#include "state_store/byte_source.h"
#include "state_store/session_key.h"
#include "state_store/session_ownership.h"
#include "state_store/session_store.h"
#include "state_store/state_files.h"
#include "tests/base/captured_log.h"
#include "tests/engine/test_model_util.h"
#include "tests/state_store/fault_injection_files.h"
#include "tests/state_store/snapshot_test_util.h"

namespace sdm {
namespace {

constexpr int32_t kProbe = 42;

// Ownership as etcd would keep it, in memory: one owner per session. Each replica's view is a
// SessionOwnership; Steal() gives a session to another replica behind its owner's back (its
// lease expired while it was paused).
class FakeOwnershipTable {
 public:
  class View : public SessionOwnership {
   public:
    View(FakeOwnershipTable* table, std::string replica) : table_(table), replica_(replica) {}
    absl::Status Claim(const SessionKey& key) override {
      absl::MutexLock lock(&table_->mu_);
      auto [it, inserted] = table_->owners_.emplace(key.id, replica_);
      if (it->second == replica_) return absl::OkStatus();
      return absl::UnavailableError("owned by " + it->second);
    }
    absl::Status CheckWrite(const SessionKey& key) override {
      absl::MutexLock lock(&table_->mu_);
      auto it = table_->owners_.find(key.id);
      if (it != table_->owners_.end() && it->second == replica_) return absl::OkStatus();
      return absl::FailedPreconditionError("lost the session");
    }
    void Release(const SessionKey& key) override {
      absl::MutexLock lock(&table_->mu_);
      auto it = table_->owners_.find(key.id);
      if (it != table_->owners_.end() && it->second == replica_) table_->owners_.erase(it);
    }

   private:
    FakeOwnershipTable* table_;
    std::string replica_;
  };

  void Steal(const std::string& id, const std::string& replica) {
    absl::MutexLock lock(&mu_);
    owners_[id] = replica;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> owners_ ABSL_GUARDED_BY(mu_);
};

// Fenced snapshots as EtcdOwnership keeps them, in memory: an owner per session with a claim
// epoch (etcd's mod revision of the ownership key), and the committed snapshot's name. A view's
// CommitSnapshot compares both in one step under the table's lock, as etcd's transaction does.
// `before_commit` runs once, at the next commit of the view, before the comparison: the replica
// froze between writing its file and committing it.
class FencedTable {
 public:
  class View : public SessionOwnership {
   public:
    View(FencedTable* table, std::string replica) : table_(table), replica_(replica) {}
    absl::Status Claim(const SessionKey& key) override {
      absl::MutexLock lock(&table_->mu_);
      auto [it, inserted] = table_->owners_.emplace(key.id, Owner{replica_, ++table_->epoch_});
      if (it->second.replica != replica_) return absl::UnavailableError("owned by another");
      claims_[key.id] = it->second.epoch;
      seen_[key.id] = table_->committed_[key.id];
      return absl::OkStatus();
    }
    absl::Status CheckWrite(const SessionKey& key) override {
      return absl::InternalError("a fenced store never checks before it writes");
    }
    void Release(const SessionKey& key) override {
      absl::MutexLock lock(&table_->mu_);
      auto it = table_->owners_.find(key.id);
      if (it != table_->owners_.end() && it->second.replica == replica_) table_->owners_.erase(it);
      claims_.erase(key.id);
    }
    bool FencesSnapshots() const override { return true; }
    absl::StatusOr<std::string> Observe(const SessionKey& key) override {
      absl::MutexLock lock(&table_->mu_);
      return seen_[key.id] = table_->committed_[key.id];
    }
    std::optional<std::string> Committed(const SessionKey& key) const override {
      absl::MutexLock lock(&table_->mu_);
      auto it = seen_.find(key.id);
      if (it == seen_.end()) return std::nullopt;
      return it->second;
    }
    int64_t ClaimEpoch(const SessionKey& key) const override {
      absl::MutexLock lock(&table_->mu_);
      auto it = claims_.find(key.id);
      return it == claims_.end() ? 0 : it->second;
    }
    absl::Status VerifyClaim(const SessionKey& key, int64_t claim) override {
      absl::MutexLock lock(&table_->mu_);
      auto owner = table_->owners_.find(key.id);
      if (owner == table_->owners_.end() || owner->second.epoch != claim) {
        return absl::FailedPreconditionError("ownership lost");
      }
      return absl::OkStatus();
    }
    absl::Status CommitSnapshot(const SessionKey& key, int64_t claim, const std::string& base,
                                const std::string& file) override {
      if (before_commit) std::exchange(before_commit, nullptr)();
      return Update(key, claim, base, file);
    }
    absl::Status DeleteCommitted(const SessionKey& key, const std::string& base) override {
      return Update(key, ClaimEpoch(key), base, "");
    }
    std::function<void()> before_commit;

   private:
    absl::Status Update(const SessionKey& key, int64_t claim, const std::string& base,
                        const std::string& file) {
      absl::MutexLock lock(&table_->mu_);
      auto owner = table_->owners_.find(key.id);
      if (owner == table_->owners_.end() || claim == 0 || owner->second.epoch != claim) {
        return absl::FailedPreconditionError("ownership lost");
      }
      if (table_->committed_[key.id] != base) return absl::FailedPreconditionError("stale base");
      seen_[key.id] = table_->committed_[key.id] = file;
      return absl::OkStatus();
    }

    FencedTable* table_;
    std::string replica_;
    std::map<std::string, int64_t> claims_ ABSL_GUARDED_BY(table_->mu_);
    std::map<std::string, std::string> seen_ ABSL_GUARDED_BY(table_->mu_);
  };

  // `replica` takes the session over behind its owner's back (the owner's lease expired).
  void Steal(const std::string& id, const std::string& replica) {
    absl::MutexLock lock(&mu_);
    owners_[id] = Owner{replica, ++epoch_};
  }
  std::string committed(const std::string& id) {
    absl::MutexLock lock(&mu_);
    return committed_[id];
  }
  // Something other than a store writes the committed name (etcd's key edited by hand).
  void SetCommitted(const std::string& id, const std::string& name) {
    absl::MutexLock lock(&mu_);
    committed_[id] = name;
  }

 private:
  struct Owner {
    std::string replica;
    int64_t epoch = 0;
  };
  absl::Mutex mu_;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Owner> owners_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> committed_ ABSL_GUARDED_BY(mu_);
};

class SharedDirTest : public ::testing::Test {
 protected:
  void SetUp() override { engine_ = testing::TinyEngine(); }

  std::unique_ptr<SessionStateStore> OpenStore(bool shared, SessionOwnership* ownership = nullptr,
                                               StateFiles* files = nullptr) {
    SessionStoreOptions options;
    if (files != nullptr) options.files = files;
    options.ownership = ownership;
    options.dir = dir_.path();
    options.persist = PersistPolicy::kTurn;
    options.background = false;
    options.shared_dir = shared;
    auto store = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // One turn on `store`, mirrored on the reference state.
  void Turn(SessionStateStore& store, const std::string& id, const std::vector<int32_t>& tokens) {
    auto lease = store.Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), tokens);
    testing::DecodeEach(*engine_, *reference_, tokens);
  }

  // Whether `id` in `store` is exactly the reference (position and next-token logits).
  void ExpectLikeReference(SessionStateStore& store, const std::string& id) {
    auto lease = store.Acquire(id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), reference_->position());
    auto got_state = lease->state().Clone();
    auto want_state = reference_->Clone();
    EXPECT_TRUE(testing::BitwiseEqual(testing::ProbeLogits(*engine_, *got_state, kProbe),
                                      testing::ProbeLogits(*engine_, *want_state, kProbe)));
  }

  testing::ScopedTempDir dir_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<SessionState> reference_;
};

TEST_F(SharedDirTest, ASessionCreatedByOneStoreIsFoundByAnother) {
  auto a = OpenStore(true);
  auto b = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("x", "meta").ok());
  Turn(*a, "x", testing::RandomTokens(7, 1));

  auto info = b->Get("x");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->position, reference_->position());
  EXPECT_EQ(info->metadata, "meta");
  EXPECT_TRUE(absl::IsAlreadyExists(b->Create("x", "")));
  ExpectLikeReference(*b, "x");
  EXPECT_TRUE(absl::IsNotFound(b->Get("never-created").status()));
}

// Property (fixed and fresh seeds): a session whose turns go to one store or the other at random
// (as when a router's ring changes back and forth) continues exactly: a store re-reads a session
// the other wrote since, rather than continuing its own older copy.
TEST_F(SharedDirTest, TurnsAlternatingBetweenStoresContinueExactly) {
  const uint32_t fresh = std::random_device{}();
  for (uint32_t seed : {1u, 2u, fresh}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const std::string id = "s" + std::to_string(seed);
    std::vector<std::unique_ptr<SessionStateStore>> stores;
    stores.push_back(OpenStore(true));
    stores.push_back(OpenStore(true));
    reference_ = engine_->NewSession();
    ASSERT_TRUE(stores[0]->Create(id, "").ok());
    std::mt19937 rng(seed);
    for (int turn = 0; turn < 6; ++turn) {
      SessionStateStore& store = *stores[turn < 2 ? turn : rng() % 2];
      Turn(store, id, testing::RandomTokens(1 + static_cast<int>(rng() % 6), rng()));
    }
    ExpectLikeReference(*stores[0], id);
    ExpectLikeReference(*stores[1], id);
  }
}

TEST_F(SharedDirTest, ADeletionByOneStoreIsSeenByTheOther) {
  auto a = OpenStore(true);
  auto b = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("d", "").ok());
  Turn(*a, "d", testing::RandomTokens(3, 5));
  Turn(*b, "d", testing::RandomTokens(3, 6));
  ASSERT_TRUE(b->Delete("d").ok());
  EXPECT_TRUE(absl::IsNotFound(a->Acquire("d").status()));
  EXPECT_TRUE(absl::IsNotFound(a->Get("d").status()));
}

// Get answers what the shared directory holds, not a copy this store read or wrote before
// another store's turn or deletion. Before, b answered its own older position (and after the
// deletion, the session) until its next Acquire re-read the file.
TEST_F(SharedDirTest, GetSeesAnotherStoresTurnAndDeletion) {
  auto a = OpenStore(true);
  auto b = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("g", "").ok());
  Turn(*a, "g", testing::RandomTokens(3, 40));
  Turn(*b, "g", testing::RandomTokens(2, 41));  // b holds a copy
  Turn(*a, "g", testing::RandomTokens(4, 42));
  auto info = b->Get("g");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->position, reference_->position());
  ASSERT_TRUE(a->Delete("g").ok());
  EXPECT_TRUE(absl::IsNotFound(b->Get("g").status())) << b->Get("g").status();
}

// A read of a session's snapshot in the shared directory that fails for a moment (too many open
// files, an I/O error) fails that call; the next call reads the file again. (A snapshot of
// another model is a broken session kept until deleted: a transient failure must not become one,
// whose message says to delete a sound session.)
TEST_F(SharedDirTest, AReadThatFailsForAMomentFailsOnlyThatCall) {
  FencedTable table;
  FencedTable::View own_a(&table, "a"), own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  testing::FaultInjectionFiles files;
  SessionStoreOptions options;
  options.ownership = &own_b;
  options.dir = dir_.path();
  options.files = &files;
  options.background = false;
  options.shared_dir = true;
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<SessionStateStore> b = *std::move(opened);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("r", "").ok());
  Turn(*a, "r", testing::RandomTokens(5, 50));
  ASSERT_TRUE(a->Park("r", Tier::kDisk).ok());  // releases it
  files.FailNext(testing::FaultInjectionFiles::Op::kReadRange,
                 {absl::ResourceExhaustedError("injected: Too many open files"), 0, -1,
                  /*sticky=*/true});
  const absl::Status failed = b->Acquire("r").status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
  files.ClearFaults();
  ExpectLikeReference(*b, "r");
}

TEST_F(SharedDirTest, OnlyTheOwnerTakesASessionUpAndParkingReleasesIt) {
  FakeOwnershipTable table;
  FakeOwnershipTable::View own_a(&table, "a"), own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("o", "").ok());
  Turn(*a, "o", testing::RandomTokens(4, 8));
  EXPECT_TRUE(absl::IsUnavailable(b->Acquire("o").status()));
  EXPECT_TRUE(absl::IsUnavailable(b->Create("o", "")));
  EXPECT_TRUE(absl::IsUnavailable(b->Delete("o")));
  ASSERT_TRUE(a->Park("o", Tier::kDisk).ok());  // hands it over
  Turn(*b, "o", testing::RandomTokens(4, 9));
  ExpectLikeReference(*b, "o");
  EXPECT_TRUE(absl::IsUnavailable(a->Acquire("o").status()));
}

// A Park handing a session over releases its claim after the park, outside the store's lock. An
// Acquire on the same replica whose claim was answered before that release (locally: the
// session was still this replica's) must not take the session up with it: the release ends the
// claim, and another replica may take the session up too. Such an Acquire claims again once the
// release is done. Here the release is held while an Acquire claims; then the Acquire gets the
// session (claimed anew) and the other replica is refused.
TEST_F(SharedDirTest, AnAcquireDuringAHandoffClaimsAgainAfterTheRelease) {
  class GatedView : public FakeOwnershipTable::View {
   public:
    using View::View;
    absl::Status Claim(const SessionKey& key) override {
      absl::Status s = View::Claim(key);
      claims.fetch_add(1);
      return s;
    }
    void Release(const SessionKey& key) override {
      if (!releasing.HasBeenNotified()) releasing.Notify();
      release_gate.WaitForNotification();
      View::Release(key);
    }
    absl::Notification releasing, release_gate;
    std::atomic<int> claims{0};
  };
  FakeOwnershipTable table;
  GatedView own_a(&table, "a");
  FakeOwnershipTable::View own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("x", "").ok());
  Turn(*a, "x", testing::RandomTokens(4, 40));
  const int claims_before = own_a.claims.load();
  absl::Status parked;
  std::thread park([&] { parked = a->Park("x", Tier::kDisk); });
  own_a.releasing.WaitForNotification();  // parked; its claim not released yet
  absl::StatusOr<SessionLease> lease = absl::UnknownError("not acquired");
  std::thread acquire([&] { lease = a->Acquire("x"); });
  // The Acquire's claim is answered (still a's) before the release goes through.
  while (own_a.claims.load() == claims_before) std::this_thread::yield();
  own_a.release_gate.Notify();
  park.join();
  acquire.join();
  ASSERT_TRUE(parked.ok()) << parked;
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_GE(own_a.claims.load(), claims_before + 2) << "claimed again after the release";
  // a holds it (claimed after the release): b may not take it up.
  EXPECT_TRUE(absl::IsUnavailable(b->Acquire("x").status()));
  testing::DecodeEach(*engine_, lease->state(), testing::RandomTokens(2, 41));
}

// A FakeOwnershipTable view with one-shot hooks: AfterNextClaim's runs once the next Claim is
// answered, BeforeNextRelease's before the next Release goes through, each on the thread that
// calls, and is then forgotten. Tests hold a store's call there to order it against another
// thread's calls, without timing.
class HookedView : public FakeOwnershipTable::View {
 public:
  using View::View;
  absl::Status Claim(const SessionKey& key) override {
    absl::Status s = View::Claim(key);
    Take (&Hooks::after_claim)();
    return s;
  }
  void Release(const SessionKey& key) override {
    Take (&Hooks::before_release)();
    View::Release(key);
  }
  void AfterNextClaim(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hooks_.after_claim = std::move(hook);
  }
  void BeforeNextRelease(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hooks_.before_release = std::move(hook);
  }
  // The next Claim, once answered, notifies `reached` and waits for `gate`; likewise the next
  // Release before it goes through.
  void HoldNextClaim(absl::Notification& reached, absl::Notification& gate) {
    AfterNextClaim(Hold(reached, gate));
  }
  void HoldNextRelease(absl::Notification& reached, absl::Notification& gate) {
    BeforeNextRelease(Hold(reached, gate));
  }

 private:
  static std::function<void()> Hold(absl::Notification& reached, absl::Notification& gate) {
    return [&reached, &gate] {
      reached.Notify();
      gate.WaitForNotification();
    };
  }
  struct Hooks {
    std::function<void()> after_claim, before_release;
  };
  std::function<void()> Take(std::function<void()> Hooks::*hook) {
    absl::MutexLock lock(&mu_);
    std::function<void()> taken = std::exchange(hooks_.*hook, nullptr);
    return taken ? taken : [] {};
  }
  absl::Mutex mu_;
  Hooks hooks_ ABSL_GUARDED_BY(mu_);
};

// Creates session "x" with metadata "new" on another thread (held where the test holds it).
std::thread CreateXOnAThread(SessionStateStore& store) {
  return std::thread([&store] {
    const absl::Status made = store.Create("x", "new");
    EXPECT_TRUE(made.ok()) << made;
  });
}

// `store` holds "x" ("new") under a claim of its own: `other` may not take it up, and no write of
// it was refused.
void ExpectXHeldWithItsClaim(SessionStateStore& store, SessionOwnership& other) {
  EXPECT_TRUE(absl::IsUnavailable(other.Claim(SessionKey("x"))));
  EXPECT_EQ(store.Stats().fenced_writes, 0);
  ASSERT_TRUE(store.Get("x").ok());
  EXPECT_EQ(store.Get("x")->metadata, "new");
}

// Delete gives the session's claim up (SessionOwnership::Release) after its entry is gone,
// outside the store's lock. A Create (or a Fork into the id) on the same replica whose claim is
// answered while that release is under way (locally: the id is still this replica's) made its
// session under a claim the release then ended: a session this replica held and wrote that no
// replica owned (another could take it up; this one's writes were refused as fenced). Such a
// Create or Fork claims again once the release is done. Here the release is held until the
// Create's (the Fork's) claim is answered, and the Create is held there until the Delete has
// returned: it finds no release under way, but one that ended after its claim was answered.
TEST_F(SharedDirTest, ACreateDuringADeletesReleaseClaimsAgainAfterIt) {
  FakeOwnershipTable table;
  HookedView own_a(&table, "a");
  FakeOwnershipTable::View own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  ASSERT_TRUE(a->Create("src", "").ok());
  for (const bool fork : {false, true}) {
    SCOPED_TRACE(fork ? "fork into it" : "create");
    ASSERT_TRUE(a->Create("x", "old").ok());
    absl::Notification releasing, release_gate, claimed, claim_gate;
    own_a.HoldNextRelease(releasing, release_gate);
    std::thread deleter([&] { EXPECT_TRUE(a->Delete("x").ok()); });
    releasing.WaitForNotification();  // "x" is gone; its claim is not released yet
    own_a.HoldNextClaim(claimed, claim_gate);
    std::thread creator([&] {
      const absl::Status made = fork ? a->Fork("src", "x", "new") : a->Create("x", "new");
      EXPECT_TRUE(made.ok()) << made;
    });
    claimed.WaitForNotification();  // answered: "x" is still a's
    release_gate.Notify();
    deleter.join();
    claim_gate.Notify();
    creator.join();
    ExpectXHeldWithItsClaim(*a, own_b);
    ASSERT_TRUE(a->Delete("x").ok());
  }
}

// The same race the other way round: a Create's claim is answered while "x" still exists, then a
// whole Delete of "x" (its release included) runs before the Create makes its session. The
// Create sees that a release of the id began after its claim, and claims again.
TEST_F(SharedDirTest, ADeleteBetweenACreatesClaimAndItsSessionMakesItClaimAgain) {
  FakeOwnershipTable table;
  HookedView own_a(&table, "a");
  FakeOwnershipTable::View own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  ASSERT_TRUE(a->Create("x", "old").ok());
  absl::Notification claimed, claim_gate;
  own_a.HoldNextClaim(claimed, claim_gate);
  std::thread creator = CreateXOnAThread(*a);
  claimed.WaitForNotification();
  ASSERT_TRUE(a->Delete("x").ok());
  claim_gate.Notify();
  creator.join();
  ExpectXHeldWithItsClaim(*a, own_b);
}

// A Park handing a session over releases its claim late too: deleted meanwhile and created again,
// the new session's claim must outlast that release as well.
TEST_F(SharedDirTest, ACreateDuringAHandoffsReleaseClaimsAgainAfterIt) {
  FakeOwnershipTable table;
  HookedView own_a(&table, "a");
  FakeOwnershipTable::View own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  ASSERT_TRUE(a->Create("x", "old").ok());
  absl::Notification releasing, release_gate, claimed;
  own_a.HoldNextRelease(releasing, release_gate);
  std::thread parker([&] { EXPECT_TRUE(a->Park("x", Tier::kDisk).ok()); });
  releasing.WaitForNotification();   // parked; the hand-off's release is held
  ASSERT_TRUE(a->Delete("x").ok());  // its own release goes through
  own_a.AfterNextClaim([&] { claimed.Notify(); });
  std::thread creator = CreateXOnAThread(*a);
  claimed.WaitForNotification();
  release_gate.Notify();
  parker.join();
  creator.join();
  ExpectXHeldWithItsClaim(*a, own_b);
}

// The hand-off thread parks every session this replica owns that another asked for; a key it
// owns without a session (a claim whose Create failed) answers NOT_FOUND, and Park releases that
// claim itself (else no replica could take the id up until this one stopped). It used to be
// released by the hand-off thread behind the store's back, which also ended the claim of a
// Create between its claim and its session; through the store, such a Create claims again.
TEST_F(SharedDirTest, AParkOfAClaimWithoutASessionReleasesItAndACreateUnderWayClaimsAgain) {
  FakeOwnershipTable table;
  HookedView own_a(&table, "a");
  FakeOwnershipTable::View own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  ASSERT_TRUE(own_a.Claim(SessionKey("orphan")).ok());  // claimed, never made
  EXPECT_TRUE(absl::IsNotFound(a->Park("orphan", Tier::kDisk)));
  EXPECT_TRUE(own_b.Claim(SessionKey("orphan")).ok()) << "the claim was kept";

  absl::Notification claimed, claim_gate;
  own_a.HoldNextClaim(claimed, claim_gate);
  std::thread creator = CreateXOnAThread(*a);
  claimed.WaitForNotification();  // claimed; no session yet
  EXPECT_TRUE(absl::IsNotFound(a->Park("x", Tier::kDisk)));
  claim_gate.Notify();
  creator.join();
  ExpectXHeldWithItsClaim(*a, own_b);
  ASSERT_TRUE(a->Park("x", Tier::kDisk).ok());  // written under its claim
  EXPECT_EQ(a->Stats().fenced_writes, 0);
}

// A turn whose write had not begun when another replica wrote the session (this replica's copy
// is then dropped at its next Acquire) is not in the session: whoever waits for its write (the
// scheduler, before the turn's final chunk) is told ABORTED, as for a write that was refused.
TEST_F(SharedDirTest, ATurnDroppedBecauseAnotherReplicaWroteTheSessionIsNotAcknowledged) {
  testing::SessionWriteFiles files;
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.files = &files;
  options.persist = PersistPolicy::kTurn;
  options.shared_dir = true;
  options.persist_writers = 1;  // the worker alone: held in another session's write
  auto opened = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::unique_ptr<SessionStateStore> a = *std::move(opened);
  absl::Cleanup open_gate = [&] { files.Open(); };  // before the store joins its worker
  auto b = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("other", "").ok());
  // Its creation written before its writes are held below: held during that write instead
  // (the worker may write it after g's turn), the turn on it below would wait for ever.
  absl::Notification other_written;
  a->WhenPersisted("other", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    other_written.Notify();
  });
  other_written.WaitForNotification();
  ASSERT_TRUE(a->Create("g", "").ok());
  absl::Notification written;
  Turn(*a, "g", testing::RandomTokens(4, 60));
  a->WhenPersisted("g", [&](const absl::Status& saved) {
    EXPECT_TRUE(saved.ok()) << saved;
    written.Notify();
  });
  written.WaitForNotification();
  files.Hold(SessionFileStem(SessionKey("other")));
  {
    auto lease = a->Acquire("other");
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), testing::RandomTokens(2, 61));
  }
  ASSERT_TRUE(files.WaitHeld(absl::Minutes(1)));  // the worker is held writing "other"
  {
    auto lease = a->Acquire("g");  // a turn on a that the held worker cannot write yet
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), testing::RandomTokens(3, 62));
  }
  absl::Notification told;
  absl::Status outcome;
  a->WhenPersisted("g", [&](const absl::Status& saved) {
    outcome = saved;
    told.Notify();
  });
  // b writes "g" (from a's first turn, on disk): a's unwritten turn is dropped at a's next
  // Acquire, which continues from b's state.
  Turn(*b, "g", testing::RandomTokens(5, 63));
  {
    auto lease = a->Acquire("g");
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), reference_->position());
  }
  files.Open();
  told.WaitForNotification();
  EXPECT_EQ(outcome.code(), absl::StatusCode::kAborted) << outcome;
}

// SetMetadata does not claim a session: on a replica that handed it over it is refused up front
// (it was written at once for a disk session, refused as fenced, counted and logged as such, and
// the session left in host memory).
TEST_F(SharedDirTest, SetMetadataOfASessionHandedOverIsRefused) {
  FencedTable table;
  FencedTable::View own_a(&table, "a");
  auto a = OpenStore(true, &own_a);
  ASSERT_TRUE(a->Create("x", "old").ok());
  ASSERT_TRUE(a->SetMetadata("x", "held").ok());  // its claim is a's
  ASSERT_TRUE(a->Park("x", Tier::kDisk).ok());    // handed over: released
  const absl::Status refused = a->SetMetadata("x", "new");
  EXPECT_TRUE(absl::IsFailedPrecondition(refused)) << refused;
  EXPECT_EQ(a->Stats().fenced_writes, 0);
  ASSERT_TRUE(a->Acquire("x").ok());  // claimed again by a turn
  EXPECT_EQ(a->Get("x")->metadata, "held");
}

// A replica that handed a session over keeps its copy's record at the disk tier; once another
// replica has run turns on the session, that record is stale, and Get there must answer the
// committed snapshot's position and pending token, not the old ones (the service decides from
// Get whether a turn starts the sequence: a stale position 0 added a BOS to a conversation's
// third turn when a session created on one replica came back to it, deploy.nginx_scale).
TEST_F(SharedDirTest, GetOnAReplicaThatHandedASessionOverAnswersTheCommittedState) {
  FencedTable table;
  FencedTable::View own_a(&table, "a"), own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("h", "").ok());
  ASSERT_TRUE(a->Park("h", Tier::kDisk).ok());  // hands it over before its first turn
  Turn(*b, "h", testing::RandomTokens(5, 30));
  {
    auto lease = b->Acquire("h");
    ASSERT_TRUE(lease.ok()) << lease.status();
    lease->state().pending_token = 7;  // what a turn that ends on a sampled token leaves
  }
  ASSERT_TRUE(b->Park("h", Tier::kDisk).ok());  // writes it, and hands it back
  absl::StatusOr<SessionInfo> seen = a->Get("h");
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(seen->position, reference_->position());
  EXPECT_TRUE(seen->pending_token);
  // b, which wrote it last and holds its copy without the claim, answers the same.
  absl::StatusOr<SessionInfo> on_b = b->Get("h");
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  EXPECT_EQ(on_b->position, reference_->position());
  // And a's next turn continues b's state.
  Turn(*a, "h", testing::RandomTokens(3, 31));
  ExpectLikeReference(*a, "h");
}

// A replica paused past its lease (its session given to another meanwhile) finishes its turn
// when it resumes: its write is refused and counted, the new owner's state stays on disk, and
// whoever waits for that turn's write is told it was not saved.
TEST_F(SharedDirTest, AWriteOfAReplicaThatLostTheSessionIsRefused) {
  FakeOwnershipTable table;
  FakeOwnershipTable::View own_a(&table, "a"), own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("f", "").ok());
  Turn(*a, "f", testing::RandomTokens(5, 10));
  {
    auto paused = a->Acquire("f");  // a turn starts on a, then a is paused...
    ASSERT_TRUE(paused.ok()) << paused.status();
    table.Steal("f", "b");  // ... past its lease: b takes the session up and moves on
    Turn(*b, "f", testing::RandomTokens(5, 11));
    testing::DecodeEach(*engine_, paused->state(), testing::RandomTokens(9, 12));
  }  // a's turn ends: its write is fenced
  EXPECT_EQ(a->Stats().fenced_writes, 1);
  EXPECT_EQ(b->Stats().fenced_writes, 0);
  // Asked after the refused write (as the scheduler asks before a turn's final chunk): a's turn
  // is not saved, b's is.
  absl::Status on_a = absl::UnknownError("not called"), on_b = on_a;
  a->WhenPersisted("f", [&](const absl::Status& saved) { on_a = saved; });
  b->WhenPersisted("f", [&](const absl::Status& saved) { on_b = saved; });
  EXPECT_EQ(on_a.code(), absl::StatusCode::kAborted) << on_a;
  EXPECT_TRUE(on_b.ok()) << on_b;
  auto reader = OpenStore(true);  // what the directory holds
  ExpectLikeReference(*reader, "f");
}

// Fenced snapshots: a replica frozen after it wrote its snapshot file but before it committed it
// (the step check-then-write cannot cover) resumes after another replica took the session over
// and moved it on: its commit is refused, its file removed, and the committed state is the newer
// one, which a third replica continues exactly.
TEST_F(SharedDirTest, AFencedCommitOfAFrozenReplicaCannotReplaceTheNewerState) {
  FencedTable table;
  FencedTable::View own_a(&table, "a"), own_b(&table, "b"), own_c(&table, "c");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("f", "").ok());
  Turn(*a, "f", testing::RandomTokens(5, 20));
  const std::string first = table.committed("f");
  ASSERT_FALSE(first.empty());
  std::string taken_over;
  own_a.before_commit = [&] {
    // a froze with its file written; its lease expired and b took the session over.
    table.Steal("f", "b");
    Turn(*b, "f", testing::RandomTokens(5, 21));
    taken_over = table.committed("f");
  };
  {
    auto stale = a->Acquire("f");
    ASSERT_TRUE(stale.ok()) << stale.status();
    // a's turn (not mirrored on the reference, which follows b's turn inside a's commit).
    testing::DecodeEach(*engine_, stale->state(), testing::RandomTokens(9, 22));
  }
  // a's lease was returned above: its write ran, b's turn ran inside it, a's commit was refused.
  EXPECT_EQ(a->Stats().fenced_writes, 1);
  EXPECT_EQ(b->Stats().fenced_writes, 0);
  EXPECT_NE(taken_over, first);
  EXPECT_EQ(table.committed("f"), taken_over);
  int files = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir_.path() / "generations")) {
    (void)f;
    ++files;
  }
  EXPECT_EQ(files, 1);  // b's: a's refused file and the superseded first one are removed
  ASSERT_TRUE(b->Park("f", Tier::kDisk).ok());  // releases it
  auto c = OpenStore(true, &own_c);
  ExpectLikeReference(*c, "f");
}

// etcd down: every lookup of a session fails, and any client can make lookups (a GET of ids it
// makes up). One warning per cause, then one line when lookups succeed again, saying how many
// failures were not logged; a line per lookup flooded the log.
TEST_F(SharedDirTest, FailedEtcdLookupsAreLoggedOncePerCause) {
  class FlakyView : public FencedTable::View {
   public:
    using View::View;
    absl::StatusOr<std::string> Observe(const SessionKey& key) override {
      if (failing) return absl::UnavailableError("etcd unreachable (injected)");
      return View::Observe(key);
    }
    std::atomic<bool> failing{false};
  };
  FencedTable table;
  FlakyView own_a(&table, "a");
  auto a = OpenStore(true, &own_a);
  testing::CapturedLog log;
  own_a.failing = true;
  for (int i = 0; i < 20; ++i) a->Get(absl::StrCat("nope", i)).IgnoreError();
  EXPECT_EQ(log.With("could not look up session").size(), 1u);
  EXPECT_EQ(log.With("etcd unreachable (injected)").size(), 1u);
  own_a.failing = false;
  a->Get("nope").IgnoreError();
  a->Get("nope").IgnoreError();
  const std::vector<std::string> recovered = log.With("etcd lookups succeed again");
  ASSERT_EQ(recovered.size(), 1u);
  EXPECT_TRUE(absl::StrContains(recovered[0], "more failed meanwhile")) << recovered[0];
  // A new episode is logged again.
  own_a.failing = true;
  a->Get("nope").IgnoreError();
  EXPECT_EQ(log.With("could not look up session").size(), 2u);
}

// A replica whose copy is older than the committed snapshot cannot commit it even while it owns
// the session again (it lost the session, another replica wrote it, it claimed it back while a
// write of its old copy was pending): the commit also compares the snapshot it derives from.
TEST_F(SharedDirTest, AFencedCommitOfAnOutdatedCopyIsRefusedEvenByTheOwner) {
  FencedTable table;
  FencedTable::View own_a(&table, "a"), own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("g", "").ok());
  Turn(*a, "g", testing::RandomTokens(4, 30));
  own_a.before_commit = [&] {
    table.Steal("g", "b");
    Turn(*b, "g", testing::RandomTokens(4, 31));
    ASSERT_TRUE(b->Park("g", Tier::kDisk).ok());     // b releases it...
    ASSERT_TRUE(own_a.Claim(SessionKey("g")).ok());  // ... and a owns it again (a new claim)
  };
  {
    auto stale = a->Acquire("g");
    ASSERT_TRUE(stale.ok()) << stale.status();
    testing::DecodeEach(*engine_, stale->state(), testing::RandomTokens(6, 32));
  }
  EXPECT_EQ(a->Stats().fenced_writes, 1);
  ExpectLikeReference(*a, "g");  // a re-reads the committed state at its next turn
}

// Files of writes that were never committed (a replica crashed between writing its file and
// committing it; a refused file whose removal failed) are removed by the store that next takes
// the session up under a new claim, and only that session's: the committed file, another
// session's files (even one whose id extends this one's) and foreign files stay. The owner does
// not sweep again under the same claim; Delete sweeps what its session left.
TEST_F(SharedDirTest, UncommittedFilesAreSweptUnderTheNextClaim) {
  FencedTable table;
  FencedTable::View own_a(&table, "a"), own_b(&table, "b");
  auto a = OpenStore(true, &own_a);
  auto b = OpenStore(true, &own_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("g", "").ok());
  ASSERT_TRUE(a->Create("g2", "").ok());  // written at once (--persist turn)
  Turn(*a, "g", testing::RandomTokens(4, 40));
  const std::filesystem::path gen = dir_.path() / "generations";
  const std::string stem = SessionFileStem(SessionKey("g"));
  const std::string stem2 = SessionFileStem(SessionKey("g2"));
  const std::vector<std::string> orphans = {
      stem + "." + std::string(32, 'a') + ".sdmstate",      // written, never committed
      stem + "." + std::string(32, 'b') + ".sdmstate.tmp",  // cut short by a crash (old name)
      stem + "." + std::string(32, 'd') + ".sdmstate.7-00000000000000ab-3.tmp"};  // the same
  const std::string others = stem2 + "." + std::string(32, 'c') + ".sdmstate";
  for (const std::string& name :
       {orphans[0], orphans[1], orphans[2], others, std::string("notes.txt")}) {
    ASSERT_TRUE(StateFiles::Default()->WriteAt(gen / name, 0, "not a snapshot").ok());
  }
  auto exists = [&](const std::string& name) { return std::filesystem::exists(gen / name); };

  Turn(*a, "g", testing::RandomTokens(4, 41));  // the same claim: a swept when it took it up
  EXPECT_TRUE(exists(orphans[0]) && exists(orphans[1]) && exists(orphans[2]));
  EXPECT_EQ(a->Stats().orphans_removed, 0);
  ASSERT_TRUE(a->Park("g", Tier::kDisk).ok());  // releases it

  Turn(*b, "g", testing::RandomTokens(4, 42));  // b's new claim: it sweeps
  EXPECT_FALSE(exists(orphans[0]));
  EXPECT_FALSE(exists(orphans[1]));
  EXPECT_FALSE(exists(orphans[2]));
  EXPECT_EQ(b->Stats().orphans_removed, 3);
  EXPECT_TRUE(exists(table.committed("g")));
  EXPECT_TRUE(exists(table.committed("g2")));
  EXPECT_TRUE(exists(others));
  EXPECT_TRUE(exists("notes.txt"));
  ExpectLikeReference(*b, "g");
  int files_of_g = 0;
  for (const auto& f : std::filesystem::directory_iterator(gen)) {
    if (f.path().filename().string().starts_with(stem + ".")) ++files_of_g;
  }
  EXPECT_EQ(files_of_g, 1);  // the committed one

  ASSERT_TRUE(a->Delete("g2").ok());  // the committed file and what the session left
  EXPECT_FALSE(exists(others));
  EXPECT_EQ(a->Stats().orphans_removed, 1);
  EXPECT_TRUE(exists("notes.txt"));
}

// A store of another model (a rolling upgrade that changed the weights) finds a session in the
// shared directory whose snapshot fails its checks: the session is broken there as a quarantined
// one is (listed with its error, refused, deletable), its file left in place for the replicas of
// the model that wrote it. Before, the check's error answered every call on the id, Get and Delete
// included: its id could never be freed.
TEST_F(SharedDirTest, ASnapshotOfAnotherModelIsRefusedButCanBeDeleted) {
  for (const bool fenced : {false, true}) {
    SCOPED_TRACE(fenced ? "fenced" : "not fenced");
    testing::ScopedTempDir dir;
    FencedTable table;
    FencedTable::View own_old(&table, "old"), own_new(&table, "new");
    auto open = [&](const Engine& engine, SessionOwnership* ownership) {
      SessionStoreOptions options;
      options.ownership = fenced ? ownership : nullptr;
      options.dir = dir.path();
      options.background = false;
      options.shared_dir = true;
      auto store = SessionStateStore::Open(engine.state_layout(), engine.fingerprint(), options);
      EXPECT_TRUE(store.ok()) << store.status();
      return store.ok() ? *std::move(store) : nullptr;
    };
    auto old_model = open(*engine_, &own_old);
    ASSERT_NE(old_model, nullptr);
    reference_ = engine_->NewSession();
    ASSERT_TRUE(old_model->Create("u", "").ok());
    Turn(*old_model, "u", testing::RandomTokens(4, 30));
    ASSERT_TRUE(old_model->Park("u", Tier::kDisk).ok());  // releases it

    auto other = testing::TinyEngine(/*weight_seed=*/12);
    auto new_model = open(*other, &own_new);
    ASSERT_NE(new_model, nullptr);
    const absl::Status refused = new_model->Acquire("u").status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find("different model"), std::string::npos) << refused;
    EXPECT_NE(refused.message().find("delete the session"), std::string::npos) << refused;
    auto info = new_model->Get("u");
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_NE(info->error.find("different model"), std::string::npos) << info->error;
    // Left in place: the old model's replicas still serve it.
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "quarantine") &&
                 !std::filesystem::is_empty(dir.path() / "quarantine"));
    EXPECT_TRUE(std::filesystem::exists(fenced ? dir.path() / "generations" / table.committed("u")
                                               : dir.path() / "u.sdmstate"));
    EXPECT_TRUE(old_model->Get("u").ok());
    // Deleted through the new model's replica: gone, its id free.
    ASSERT_TRUE(new_model->Delete("u").ok());
    EXPECT_TRUE(absl::IsNotFound(new_model->Get("u").status()));
    if (fenced) {
      EXPECT_TRUE(table.committed("u").empty());
    }
    EXPECT_TRUE(new_model->Create("u", "").ok());  // the id is free
  }
}

// Sessions never expire on a shared directory (a replica would expire a session by its own view
// of its last use while another replica serves it): a finite default ttl and a Create's or
// Fork's finite ttl are refused, a ttl in a snapshot written by a store running alone is ignored,
// and ExpireIdle removes nothing; the store running alone does expire that session.
// Stores that share a directory exclude one that would hold it alone, and the other way round.
TEST_F(SharedDirTest, StoresSharingADirectoryAndOneAloneExcludeEachOther) {
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.background = false;
  {
    auto a = OpenStore(true);
    auto b = OpenStore(true);
    ASSERT_NE(b, nullptr);
    auto alone = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
    ASSERT_FALSE(alone.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(alone.status())) << alone.status();
    EXPECT_NE(alone.status().message().find("in use by processes that share it"), std::string::npos)
        << alone.status();
  }
  auto alone = OpenStore(false);
  ASSERT_NE(alone, nullptr);
  options.shared_dir = true;
  auto shared = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_FALSE(shared.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(shared.status())) << shared.status();
}

// Another store's action at one point of this store's file operations: `hook` runs once, the
// first time RunOnceFor() is given a path named `name`.
class OneShotHook {
 public:
  OneShotHook(std::string name, std::function<void()> hook)
      : name_(std::move(name)), hook_(std::move(hook)) {}
  void RunOnceFor(const std::filesystem::path& path) {
    if (path.filename() == name_ && !ran_.exchange(true)) hook_();
  }
  bool ran() const { return ran_.load(); }

 private:
  const std::string name_;
  const std::function<void()> hook_;
  std::atomic<bool> ran_{false};
};

// A StateFiles whose reads of the file named `name` run `hook` once, when `after_reads` reads of
// it are done: before the first (0), or after the record's two (2, ReadRecord). Open reads on
// the caller's thread; the hook is another store's turn, on its own files.
class RacingReadFiles : public testing::FaultInjectionFiles {
 public:
  RacingReadFiles(std::string name, int after_reads, std::function<void()> hook)
      : name_(std::move(name)), after_reads_(after_reads), hook_(std::move(hook)) {}
  absl::StatusOr<std::string> ReadRange(const std::filesystem::path& path, uint64_t offset,
                                        uint64_t n) override {
    const bool of_file = path.filename() == name_;
    if (of_file) MaybeRunHook();
    absl::StatusOr<std::string> got = FaultInjectionFiles::ReadRange(path, offset, n);
    if (of_file) {
      reads_.fetch_add(1);
      MaybeRunHook();
    }
    return got;
  }
  bool ran() const { return ran_.load(); }

 private:
  void MaybeRunHook() {
    if (reads_.load() == after_reads_ && !ran_.exchange(true)) hook_();
  }

  const std::string name_;
  const int after_reads_;
  const std::function<void()> hook_;
  std::atomic<int> reads_{0};
  std::atomic<bool> ran_{false};
};

// A snapshot that another store replaces (a turn, written) while a store opening the directory
// reads it is read again: between the size and the reads (0), the record failed against the old
// size; right after them (2), the copy took the new file's stamp for the one it read. Before, the
// first quarantined the sound, live snapshot (the session was gone on every replica), the second
// left a copy that answered its old position as current.
TEST_F(SharedDirTest, ASnapshotReplacedWhileAStoreOpensIsReadAgain) {
  for (const int after_reads : {0, 2}) {
    SCOPED_TRACE(::testing::Message() << "replaced after " << after_reads << " reads");
    const std::string id = "x" + std::to_string(after_reads);
    auto a = OpenStore(true);
    reference_ = engine_->NewSession();
    ASSERT_TRUE(a->Create(id, "").ok());
    Turn(*a, id, testing::RandomTokens(5, 70));
    const std::filesystem::path file = dir_.path() / (id + ".sdmstate");
    const uintmax_t size_before = std::filesystem::file_size(file);
    uintmax_t size_after = size_before;
    RacingReadFiles files(file.filename().string(), after_reads, [&] {
      Turn(*a, id, testing::RandomTokens(3, 71));
      size_after = std::filesystem::file_size(file);
    });
    auto b = OpenStore(true, nullptr, &files);
    ASSERT_NE(b, nullptr);
    ASSERT_TRUE(files.ran());
    ASSERT_NE(size_after, size_before);  // the old size fails the new file
    EXPECT_TRUE(std::filesystem::exists(file));
    EXPECT_TRUE(b->open_errors().empty()) << b->open_errors()[0];
    EXPECT_EQ(b->Stats().quarantined, 0);
    for (const auto& f : std::filesystem::directory_iterator(dir_.path() / "quarantine")) {
      EXPECT_FALSE(f.path().filename().string().starts_with(id + ".")) << f.path();
    }
    auto info = b->Get(id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->position, reference_->position());
    ExpectLikeReference(*b, id);
    ExpectLikeReference(*a, id);
  }
}

// A snapshot in the shared directory that fails its checks at Open is not quarantined (another
// replica may be serving it, or about to replace it): it is left in place and reported, and each
// lookup reads it again, as for a snapshot found on demand. Once sound (replaced), it is served.
TEST_F(SharedDirTest, ADamagedSnapshotAtOpenIsLeftInPlace) {
  auto a = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("d", "").ok());
  Turn(*a, "d", testing::RandomTokens(4, 80));
  a.reset();
  const std::filesystem::path file = dir_.path() / "d.sdmstate";
  const std::string sound = testing::ReadFile(file);
  ASSERT_TRUE(StateFiles::Default()->WriteAtomically(file, sound.substr(0, sound.size() - 1)).ok());

  auto b = OpenStore(true);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->open_errors().size(), 1u);
  EXPECT_NE(b->open_errors()[0].find("left in place"), std::string::npos) << b->open_errors()[0];
  EXPECT_EQ(b->Stats().quarantined, 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path() / "quarantine"));
  EXPECT_TRUE(std::filesystem::exists(file));
  EXPECT_EQ(b->Acquire("d").status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(StateFiles::Default()->WriteAtomically(file, sound).ok());
  ExpectLikeReference(*b, "d");
}

// A snapshot that another store replaces (a turn, written) while a store looks it up (Discover:
// it holds no copy) is read again: before the record's first read (0) the old size fails the new
// file, and after its first record read (2) the next read is of the new file. Before, Discover
// took the stamp (stat, then a record read) and then read the record a second time with the
// stamp's size: a replacement before or between them answered DATA_LOSS ("truncated or padded")
// for two sound files (of equal sizes, the entry kept one file's record under the other's stamp).
TEST_F(SharedDirTest, ASnapshotReplacedWhileAStoreLooksItUpIsReadAgain) {
  for (const int after_reads : {0, 2}) {
    SCOPED_TRACE(::testing::Message() << "replaced after " << after_reads << " reads");
    const std::string id = "y" + std::to_string(after_reads);
    const std::filesystem::path file = dir_.path() / (id + ".sdmstate");
    auto a = OpenStore(true);
    uintmax_t size_before = 0, size_after = 0;
    RacingReadFiles files(file.filename().string(), after_reads, [&] {
      size_before = std::filesystem::file_size(file);
      Turn(*a, id, testing::RandomTokens(3, 131));
      size_after = std::filesystem::file_size(file);
    });
    auto b = OpenStore(true, nullptr, &files);  // before the session: it finds it on demand
    ASSERT_NE(b, nullptr);
    reference_ = engine_->NewSession();
    ASSERT_TRUE(a->Create(id, "").ok());
    Turn(*a, id, testing::RandomTokens(5, 130));
    auto info = b->Get(id);
    ASSERT_TRUE(files.ran());
    ASSERT_NE(size_after, size_before);       // the old size fails the new file
    EXPECT_TRUE(info.ok()) << info.status();  // the other case runs too
    if (info.ok()) {
      EXPECT_EQ(info->position, reference_->position());
    }
    ExpectLikeReference(*b, id);
    ExpectLikeReference(*a, id);
  }
}

// A StateFiles whose first full read (Read: a restore's) of the file named `name` runs `hook`
// right after it, before the caller decodes what it read. The hook is another replica's write of
// the file (a new file renamed over it).
class ReplacedAfterFullReadFiles : public testing::FaultInjectionFiles {
 public:
  ReplacedAfterFullReadFiles(std::string name, std::function<void()> hook)
      : hook_(std::move(name), std::move(hook)) {}
  absl::StatusOr<std::string> Read(const std::filesystem::path& path) override {
    absl::StatusOr<std::string> got = FaultInjectionFiles::Read(path);
    hook_.RunOnceFor(path);
    return got;
  }
  bool ran() const { return hook_.ran(); }

 private:
  OneShotHook hook_;
};

// A snapshot whose full read (an Acquire's restore) finds it damaged, replaced by another replica
// with a sound one right after that read, is read again: the failure was the old file's. Before,
// the store quarantined by path: it moved the new, sound file away, and the session was gone from
// every replica (its writer's next Acquire answered NOT_FOUND).
TEST_F(SharedDirTest, ASnapshotReplacedAfterAnAcquireReadItIsReadAgain) {
  auto a = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("q", "").ok());
  Turn(*a, "q", testing::RandomTokens(5, 110));
  const std::filesystem::path file = dir_.path() / "q.sdmstate";
  const std::string sound = testing::ReadFile(file);
  std::string damaged = sound;
  damaged[damaged.size() - 10] ^= 0x55;  // past the record: only the full read finds it
  ASSERT_TRUE(StateFiles::Default()->WriteAtomically(file, damaged).ok());
  ReplacedAfterFullReadFiles files(file.filename().string(), [&] {
    ASSERT_TRUE(StateFiles::Default()->WriteAtomically(file, sound).ok());
  });
  auto b = OpenStore(true, nullptr, &files);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(b->open_errors().empty()) << b->open_errors()[0];
  {
    auto lease = b->Acquire("q");
    ASSERT_TRUE(files.ran());
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->state().position(), reference_->position());
  }
  EXPECT_TRUE(std::filesystem::exists(file));
  EXPECT_EQ(b->Stats().quarantined, 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path() / "quarantine"));
  ExpectLikeReference(*b, "q");
  ExpectLikeReference(*a, "q");
}

// A snapshot in the shared directory whose full read (an Acquire's restore) finds it damaged is
// not quarantined, fenced or not: another replica may be serving it or about to replace it. The
// call answers DATA_LOSS, the file stays, and the next call reads it again; once sound (replaced),
// it is served. Before, it was moved to quarantine/, which took the session from every replica.
TEST_F(SharedDirTest, ADamagedSnapshotAtAcquireIsLeftInPlace) {
  for (const bool fenced : {false, true}) {
    SCOPED_TRACE(fenced ? "fenced" : "not fenced");
    const std::string id = fenced ? "df" : "d";
    FencedTable table;
    FencedTable::View own_a(&table, "a"), own_b(&table, "b");
    auto a = OpenStore(true, fenced ? &own_a : nullptr);
    reference_ = engine_->NewSession();
    ASSERT_TRUE(a->Create(id, "").ok());
    Turn(*a, id, testing::RandomTokens(4, 120));
    ASSERT_TRUE(a->Park(id, Tier::kDisk).ok());  // releases it (fenced)
    const std::filesystem::path file = fenced ? dir_.path() / "generations" / table.committed(id)
                                              : dir_.path() / (id + ".sdmstate");
    const std::string sound = testing::ReadFile(file);
    std::string damaged = sound;
    damaged[damaged.size() - 10] ^= 0x55;  // past the record: only the full read finds it
    ASSERT_TRUE(StateFiles::Default()->WriteAtomically(file, damaged).ok());

    auto b = OpenStore(true, fenced ? &own_b : nullptr);
    ASSERT_NE(b, nullptr);
    for (int call = 0; call < 2; ++call) {
      const absl::Status refused = b->Acquire(id).status();
      EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
      EXPECT_NE(refused.message().find("in the shared directory"), std::string::npos) << refused;
      EXPECT_TRUE(std::filesystem::exists(file));
    }
    EXPECT_EQ(b->Stats().quarantined, 0);
    EXPECT_TRUE(std::filesystem::is_empty(dir_.path() / "quarantine"));
    ASSERT_TRUE(StateFiles::Default()->WriteAtomically(file, sound).ok());
    ExpectLikeReference(*b, id);
  }
}

// Holds the first data write to a temporary file of a snapshot whose name starts with `stem`
// half-way, once HoldNext(stem) is called: half of it is in the file, the rest waits for
// Release(). Keeps the bytes of each snapshot write (the data given to WriteAndSync).
class HalfWayWriteFiles : public testing::FaultInjectionFiles {
 public:
  void HoldNext(std::string stem) {
    absl::MutexLock lock(&mu_);
    held_stem_ = std::move(stem);
  }
  void WaitHeld() { held_.WaitForNotification(); }
  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
  }
  std::string last_written() const {
    absl::MutexLock lock(&mu_);
    return last_written_;
  }

 protected:
  absl::Status WriteAndSync(const std::filesystem::path& path, const ByteSource& data,
                            bool sync) override {
    {
      absl::MutexLock lock(&mu_);
      last_written_ = SourceBytes(data);
    }
    return FaultInjectionFiles::WriteAndSync(path, data, sync);
  }
  absl::Status WriteFd(int fd, const std::filesystem::path& path, uint64_t offset,
                       absl::string_view data) override {
    bool hold = false;
    {
      absl::MutexLock lock(&mu_);
      if (!held_stem_.empty() && absl::StartsWith(path.filename().string(), held_stem_) &&
          absl::EndsWith(path.filename().string(), ".tmp") && data.size() >= 2) {
        hold = true;
        held_stem_.clear();
      }
    }
    if (!hold) return StateFiles::WriteFd(fd, path, offset, data);
    const size_t half = data.size() / 2;
    SDM_RETURN_IF_ERROR(StateFiles::WriteFd(fd, path, offset, data.substr(0, half)));
    held_.Notify();
    release_.WaitForNotification();
    return StateFiles::WriteFd(fd, path, offset + half, data.substr(half));
  }

 private:
  mutable absl::Mutex mu_;
  std::string held_stem_ ABSL_GUARDED_BY(mu_);
  std::string last_written_ ABSL_GUARDED_BY(mu_);
  absl::Notification held_, release_;
};

// Two stores writing one session at the same time (possible without etcd: docs/replicas.md, "Not
// done") leave one whole write of the two: the last renamed. Before, both wrote `<path>.tmp`: the
// second cut and rewrote the file the first was writing, renamed it, and the rest of the first
// write went into the renamed file, which then held a mixture of the two (DATA_LOSS at its next
// read), while the first write's rename failed.
TEST_F(SharedDirTest, ConcurrentWritesOfOneSessionLeaveOneOfThem) {
  HalfWayWriteFiles files_a, files_b;
  auto a = OpenStore(true, nullptr, &files_a);
  auto b = OpenStore(true, nullptr, &files_b);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("w", "").ok());
  Turn(*a, "w", testing::RandomTokens(6, 90));
  Turn(*b, "w", testing::RandomTokens(2, 91));  // both hold it now, as written
  absl::Cleanup release = [&] { files_a.Release(); };
  files_a.HoldNext(SessionFileStem(SessionKey("w")));
  std::thread writer([&] {
    auto lease = a->Acquire("w");
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), testing::RandomTokens(5, 92));
  });  // its release writes the turn: held half-way
  files_a.WaitHeld();
  {
    auto lease = b->Acquire("w");  // a's write is not renamed yet: b's copy is current
    ASSERT_TRUE(lease.ok()) << lease.status();
    testing::DecodeEach(*engine_, lease->state(), testing::RandomTokens(3, 93));
  }
  files_a.Release();
  writer.join();
  const std::string found = testing::ReadFile(dir_.path() / "w.sdmstate");
  const std::string by_a = files_a.last_written(), by_b = files_b.last_written();
  ASSERT_NE(by_a, by_b);
  EXPECT_TRUE(found == by_a || found == by_b)
      << "a mixture of " << found.size() << " bytes (a wrote " << by_a.size() << ", b "
      << by_b.size() << ")";
  EXPECT_EQ(a->Stats().snapshot_errors, 0);
  EXPECT_EQ(b->Stats().snapshot_errors, 0);
  auto c = OpenStore(true);
  EXPECT_TRUE(c->open_errors().empty()) << c->open_errors()[0];
  EXPECT_TRUE(c->Acquire("w").ok());
}

// A store opening the shared directory removes a `.tmp` left by a crash, but not one that a
// writer holds (another replica's write under way, whose rename would fail): the writer's lock
// tells them apart. Here the writers are another store held half-way through its write, and a
// process simulated by a lock on a file.
TEST_F(SharedDirTest, AStoreOpeningTheDirectoryLeavesWritesUnderWay) {
  HalfWayWriteFiles files_a;
  auto a = OpenStore(true, nullptr, &files_a);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(a->Create("t", "").ok());
  Turn(*a, "t", testing::RandomTokens(4, 100));
  const std::filesystem::path leftover = dir_.path() / "t.sdmstate.1-00000000000000ab-7.tmp";
  const std::filesystem::path held = dir_.path() / "t.sdmstate.2-00000000000000cd-9.tmp";
  ASSERT_TRUE(StateFiles::Default()->WriteAt(leftover, 0, "cut short").ok());
  ASSERT_TRUE(StateFiles::Default()->WriteAt(held, 0, "being written").ok());
  // The simulated writer's open and flock (as StateFiles::Lock makes them), held to the end.
  absl::StatusOr<std::unique_ptr<FileLock>> held_lock = StateFiles::Default()->Lock(held, true);
  ASSERT_TRUE(held_lock.ok()) << held_lock.status();
  const auto temps = [&] {
    int n = 0;
    for (const auto& f : std::filesystem::directory_iterator(dir_.path())) {
      if (absl::EndsWith(f.path().filename().string(), ".tmp")) ++n;
    }
    return n;
  };

  absl::Cleanup release = [&] { files_a.Release(); };
  files_a.HoldNext(SessionFileStem(SessionKey("t")));
  std::thread writer([&] { Turn(*a, "t", testing::RandomTokens(3, 101)); });
  files_a.WaitHeld();
  ASSERT_EQ(temps(), 3);  // a's, the leftover, the simulated writer's
  auto b = OpenStore(true);
  ASSERT_NE(b, nullptr);
  EXPECT_FALSE(std::filesystem::exists(leftover));
  EXPECT_TRUE(std::filesystem::exists(held));
  EXPECT_EQ(temps(), 2);  // a's and the simulated writer's
  files_a.Release();
  writer.join();
  EXPECT_EQ(a->Stats().snapshot_errors, 0);
  // Not EXPECT_EQ: a failure would print kilobytes.
  EXPECT_TRUE(testing::ReadFile(dir_.path() / "t.sdmstate") == files_a.last_written());
  auto info = b->Get("t");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->position, reference_->position());
  ExpectLikeReference(*b, "t");
}

TEST_F(SharedDirTest, SessionsNeverExpireOnASharedDirectory) {
  SessionStoreOptions options;
  options.dir = dir_.path();
  options.background = false;
  options.shared_dir = true;
  options.default_ttl = absl::Minutes(30);
  auto refused = SessionStateStore::Open(engine_->state_layout(), engine_->fingerprint(), options);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("not supported on a shared state directory"),
            std::string::npos)
      << refused.status();

  auto alone = OpenStore(false);
  ASSERT_TRUE(alone->Create("t", "", absl::Seconds(1)).ok());  // written with its ttl
  alone.reset();  // (a store alone holds its directory for itself)
  auto a = OpenStore(true);
  EXPECT_TRUE(absl::IsInvalidArgument(a->Create("u", "", absl::Minutes(5))));
  ASSERT_TRUE(a->Create("u", "").ok());
  EXPECT_TRUE(absl::IsInvalidArgument(a->Fork("u", "v", "", absl::Minutes(5))));
  auto t = a->Get("t");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->ttl, absl::InfiniteDuration());
  ASSERT_TRUE(a->Acquire("t").ok());  // taken up: an entry of this store now
  EXPECT_EQ(a->ExpireIdle(absl::Now() + absl::Hours(24)), 0);
  EXPECT_TRUE(a->Get("t").ok());
  EXPECT_TRUE(a->Get("u").ok());
}

// A committed name in etcd that is not one of the session's snapshot names (put there by
// something else) is refused, never made a path: '../x' would otherwise be read as the session,
// and removed once its next snapshot replaced it.
TEST_F(SharedDirTest, ACommittedNameThatIsNotTheSessionsIsRefused) {
  FencedTable table;
  FencedTable::View view(&table, "a");
  auto store = OpenStore(/*shared=*/true, &view);
  ASSERT_NE(store, nullptr);
  const std::filesystem::path outside = dir_.path() / "outside.sdmstate";
  testing::WriteFile(outside, "precious");
  const std::string others =
      absl::StrCat(SessionFileStem(SessionKey("other")), ".", std::string(32, 'a'), ".sdmstate");
  for (const std::string& name :
       {std::string("../outside.sdmstate"), std::string("x/../../outside.sdmstate"), others,
        absl::StrCat(SessionFileStem(SessionKey("s")), ".", std::string(32, 'a'),
                     ".sdmstate.1-2-3.tmp")}) {
    SCOPED_TRACE(name);
    table.SetCommitted("s", name);
    const absl::Status got = store->Acquire("s").status();
    EXPECT_EQ(got.code(), absl::StatusCode::kDataLoss) << got;
    EXPECT_TRUE(absl::StrContains(got.message(), "not a snapshot name of that session")) << got;
  }
  EXPECT_EQ(testing::ReadFile(outside), "precious");
}

// Runs `hook` once, right after a rename onto a file named `name` (another store's write landing
// between this store's rename and what it does next).
class AfterRenameFiles : public testing::FaultInjectionFiles {
 public:
  AfterRenameFiles(std::string name, std::function<void()> hook)
      : hook_(std::move(name), std::move(hook)) {}
  absl::Status Rename(const std::filesystem::path& from, const std::filesystem::path& to) override {
    absl::Status renamed = FaultInjectionFiles::Rename(from, to);
    if (renamed.ok()) hook_.RunOnceFor(to);
    return renamed;
  }
  bool ran() const { return hook_.ran(); }

 private:
  OneShotHook hook_;
};

// Without fencing two stores may serve one session, and the last write wins. A store's own write
// is stamped as its own: when the other store's write lands between its rename and its stamp, its
// next use reads that later write. Before, it took the other's file for its own and went on from
// its older copy, that turn lost to it.
TEST_F(SharedDirTest, AWriteReplacedBeforeItsStampIsNotTakenForTheStoresOwn) {
  auto b = OpenStore(true);
  reference_ = engine_->NewSession();
  ASSERT_TRUE(b->Create("w", "").ok());
  Turn(*b, "w", testing::RandomTokens(4, 90));
  AfterRenameFiles files("w.sdmstate", [&] { Turn(*b, "w", testing::RandomTokens(3, 92)); });
  auto a = OpenStore(true, nullptr, &files);
  ASSERT_NE(a, nullptr);
  Turn(*a, "w", testing::RandomTokens(2, 91));  // its write: b's turn lands after the rename
  ASSERT_TRUE(files.ran());
  ExpectLikeReference(*a, "w");  // all three turns
  ExpectLikeReference(*b, "w");
}

}  // namespace
}  // namespace sdm
