// EtcdOwnership (server/cluster/etcd_ownership.h) against a real etcd started by the test on
// loopback ports with a temporary data directory; skipped when `etcd` is not installed.
// Expiry of a paused replica's lease is simulated by revoking it (no waiting for a TTL).
#include "server/cluster/etcd_ownership.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "server/grpc_status.h"
#include "tests/base/eventually.h"
#include "tests/server/server_test_util.h"

namespace sdm {
namespace {

using ::sdm::testing::Eventually;

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

bool EtcdInstalled() { return std::system("command -v etcd >/dev/null 2>&1") == 0; }

class EtcdOwnershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdInstalled()) GTEST_SKIP() << "etcd is not installed";
    const int client_port = FreePort();
    const int peer_port = FreePort();
    endpoint_ = absl::StrCat("http://127.0.0.1:", client_port);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port);
    const std::string data = (dir_.path() / "etcd").string();
    const std::string log = (dir_.path() / "etcd.log").string();
    pid_ = fork();
    if (pid_ == 0) {
      freopen(log.c_str(), "w", stdout);
      freopen(log.c_str(), "a", stderr);
      execlp("etcd", "etcd", "--data-dir", data.c_str(), "--listen-client-urls", endpoint_.c_str(),
             "--advertise-client-urls", endpoint_.c_str(), "--listen-peer-urls", peer.c_str(),
             "--initial-advertise-peer-urls", peer.c_str(), "--initial-cluster",
             ("default=" + peer).c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    ASSERT_GT(pid_, 0);
    // Up when it grants a lease (bounded: a broken etcd fails the test, it does not hang).
    ASSERT_TRUE(Eventually([&] { return EtcdOwnership::Start(Options("probe")).ok(); }))
        << "etcd did not start; see " << log;
  }

  void TearDown() override {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  EtcdOwnershipOptions Options(const std::string& replica) const {
    EtcdOwnershipOptions o;
    o.endpoint = endpoint_;
    o.replica_id = replica;
    o.lease_ttl = absl::Seconds(30);           // never expires during a test: expiry is a revoke
    o.request_timeout = absl::Seconds(30);     // etcd answers slowly on a loaded machine
    o.handoff_wait = absl::Milliseconds(200);  // refusals come quickly (no handler answers)
    return o;
  }

  std::unique_ptr<EtcdOwnership> StartReplica(const std::string& replica) {
    auto r = EtcdOwnership::Start(Options(replica));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  void Revoke(int64_t lease) {
    httplib::Client client(endpoint_);
    auto r = client.Post("/v3/lease/revoke", absl::StrCat("{\"ID\":\"", lease, "\"}"),
                         "application/json");
    ASSERT_TRUE(r && r->status == 200);
  }

  testing::ScopedTempDir dir_;
  std::string endpoint_;
  pid_t pid_ = -1;
};

TEST_F(EtcdOwnershipTest, OneOwnerAtATimeAndReleaseHandsOver) {
  auto a = StartReplica("a");
  auto b = StartReplica("b");
  ASSERT_TRUE(a && b);
  const SessionKey x("x");
  ASSERT_TRUE(a->Claim(x).ok());
  EXPECT_TRUE(a->Claim(x).ok());  // already its own
  const absl::Status refused = b->Claim(x);
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_NE(refused.message().find("'a'"), std::string::npos) << refused;
  EXPECT_TRUE(a->CheckWrite(x).ok());
  EXPECT_FALSE(b->CheckWrite(x).ok());  // never claimed
  a->Release(x);
  ASSERT_TRUE(b->Claim(x).ok());
  EXPECT_TRUE(b->CheckWrite(x).ok());
  EXPECT_FALSE(a->CheckWrite(x).ok());
}

// Keepalives that fail (etcd unreachable a moment) are retried soon, not a third of the TTL
// later: five failed in a row and the lease is still alive. Before, each failure waited TTL/3
// (3.3 s here), and the third in a row let the 10 s lease expire with every session of the
// replica.
TEST_F(EtcdOwnershipTest, FailedKeepalivesAreRetriedBeforeTheLeaseExpires) {
  using Fault = EtcdOwnershipOptions::RequestFault;
  std::atomic<int> to_drop{0};
  absl::Notification dropped_all;
  EtcdOwnershipOptions o = Options("a");
  o.lease_ttl = absl::Seconds(10);
  o.keepalive_retry = absl::Milliseconds(10);
  o.testing_request_fault = [&](const std::string& path, const std::string&) {
    if (path != "/v3/lease/keepalive" || to_drop.load() <= 0) return Fault::kNone;
    if (to_drop.fetch_sub(1) == 1) dropped_all.Notify();
    return Fault::kDropped;
  };
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  const int64_t lease = (*a)->lease_id();
  to_drop.store(5);
  ASSERT_TRUE(dropped_all.WaitForNotificationWithTimeout(absl::Minutes(1)));
  // Alive in etcd's own view (its remaining TTL), and the same lease.
  httplib::Client client(endpoint_);
  client.set_read_timeout(60, 0);
  auto r = client.Post("/v3/lease/timetolive", absl::StrCat("{\"ID\":\"", lease, "\"}"),
                       "application/json");
  ASSERT_TRUE(r && r->status == 200);
  const nlohmann::json ttl = nlohmann::json::parse(r->body, nullptr, false);
  ASSERT_TRUE(ttl.is_object()) << r->body;
  EXPECT_GT(std::stoll(ttl.value("TTL", std::string("-1"))), 0) << r->body;
  EXPECT_EQ((*a)->lease_id(), lease);
}

// Deployments sharing one etcd keep their keys under prefixes of their own: the same session id
// is owned in each, without handoffs between them; within one prefix the owner is exclusive.
TEST_F(EtcdOwnershipTest, DeploymentsWithTheirOwnPrefixesDoNotShareSessions) {
  EtcdOwnershipOptions blue = Options("blue-0");
  blue.key_prefix = "/blue/";
  EtcdOwnershipOptions green = Options("green-0");
  green.key_prefix = "/green/";
  auto b = EtcdOwnership::Start(blue);
  auto g = EtcdOwnership::Start(green);
  ASSERT_TRUE(b.ok() && g.ok());
  const SessionKey x("x");
  ASSERT_TRUE((*b)->Claim(x).ok());
  EXPECT_TRUE((*g)->Claim(x).ok());  // another deployment's session of the same id
  EXPECT_TRUE((*b)->CheckWrite(x).ok());
  EXPECT_TRUE((*g)->CheckWrite(x).ok());
  EtcdOwnershipOptions blue1 = Options("blue-1");
  blue1.key_prefix = "/blue/";
  auto b1 = EtcdOwnership::Start(blue1);
  ASSERT_TRUE(b1.ok());
  const absl::Status refused = (*b1)->Claim(x);
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_NE(refused.message().find("'blue-0'"), std::string::npos) << refused;
  for (const char* bad : {"", "/", "sdm/", "/sdm"}) {
    EtcdOwnershipOptions o = Options("bad");
    o.key_prefix = bad;
    EXPECT_EQ(EtcdOwnership::Start(o).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// A replica paused past its lease: its key is gone, another replica claims the session, and the
// paused one's write is refused when it resumes.
TEST_F(EtcdOwnershipTest, AnExpiredLeaseFencesWrites) {
  auto a = StartReplica("a");
  auto b = StartReplica("b");
  ASSERT_TRUE(a && b);
  const SessionKey f("f");
  ASSERT_TRUE(a->Claim(f).ok());
  Revoke(a->lease_id());
  ASSERT_TRUE(b->Claim(f).ok());
  const absl::Status fenced = a->CheckWrite(f);
  EXPECT_TRUE(absl::IsFailedPrecondition(fenced)) << fenced;
  EXPECT_TRUE(b->CheckWrite(f).ok());
}

TEST_F(EtcdOwnershipTest, AStoppedReplicaReleasesEverythingAtOnce) {
  auto a = StartReplica("a");
  auto b = StartReplica("b");
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->Claim(SessionKey("p")).ok());
  ASSERT_TRUE(a->Claim(SessionKey("q")).ok());
  EXPECT_FALSE(b->Claim(SessionKey("p")).ok());
  a.reset();  // drained: its lease is revoked
  EXPECT_TRUE(b->Claim(SessionKey("p")).ok());
  EXPECT_TRUE(b->Claim(SessionKey("q")).ok());
}

// Fenced snapshots: a commit passes only with this replica's current claim and the committed name
// its copy derives from; a replica whose lease was lost cannot commit, even after the new owner
// moved on; deletion is fenced the same way.
TEST_F(EtcdOwnershipTest, ACommitNeedsTheClaimAndTheCommittedBase) {
  auto a = StartReplica("a");
  auto b = StartReplica("b");
  ASSERT_TRUE(a && b);
  const SessionKey x("x");
  EXPECT_TRUE(
      absl::IsFailedPrecondition(a->CommitSnapshot(x, a->ClaimEpoch(x), "", "never-claimed")));
  ASSERT_TRUE(a->Claim(x).ok());
  EXPECT_EQ(a->Committed(x), std::optional<std::string>(""));
  ASSERT_TRUE(a->CommitSnapshot(x, a->ClaimEpoch(x), "", "one").ok());
  EXPECT_EQ(a->Committed(x), std::optional<std::string>("one"));
  const absl::Status stale = a->CommitSnapshot(x, a->ClaimEpoch(x), "", "two");
  EXPECT_TRUE(absl::IsFailedPrecondition(stale)) << stale;
  Revoke(a->lease_id());  // a paused past its lease
  ASSERT_TRUE(b->Claim(x).ok());
  EXPECT_EQ(b->Committed(x), std::optional<std::string>("one"));
  ASSERT_TRUE(b->CommitSnapshot(x, b->ClaimEpoch(x), "one", "three").ok());
  const absl::Status fenced = a->CommitSnapshot(x, a->ClaimEpoch(x), "one", "late");
  EXPECT_TRUE(absl::IsFailedPrecondition(fenced)) << fenced;
  EXPECT_NE(fenced.message().find("ownership lost"), std::string::npos) << fenced;
  auto seen = a->Observe(x);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, "three");
  EXPECT_TRUE(absl::IsFailedPrecondition(b->DeleteCommitted(x, "one")));
  ASSERT_TRUE(b->DeleteCommitted(x, "three").ok());
  seen = a->Observe(x);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, "");
}

// Handoff: a claim of a session a live replica owns asks it (through etcd) to hand it over; the
// owner's handler parks and releases it, and the claim succeeds. Without a handler the claim
// gives up after handoff_wait with UNAVAILABLE and a retry hint.
TEST_F(EtcdOwnershipTest, AClaimAsksALiveOwnerToHandTheSessionOver) {
  auto a = StartReplica("a");
  auto b = StartReplica("b");
  ASSERT_TRUE(a && b);
  const SessionKey h("h");
  ASSERT_TRUE(a->Claim(h).ok());
  const absl::Status refused = b->Claim(h);  // a has no handler: nobody answers
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_TRUE(RetryAfter(refused).has_value()) << refused;
  std::vector<std::string> parked;
  a->SetHandoffHandler([&](const SessionKey& key) {
    parked.push_back(key.id);  // on a's handoff thread; read once the handler is cleared
    a->Release(key);           // what the store's Park to disk does
    return absl::OkStatus();
  });
  EtcdOwnershipOptions patient = Options("c");
  patient.handoff_wait = absl::Seconds(60);  // a bound: the handoff ends the wait
  auto c = EtcdOwnership::Start(patient);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE((*c)->Claim(h).ok());
  a->SetHandoffHandler(nullptr);  // after this, the handler does not run any more
  EXPECT_EQ(parked, std::vector<std::string>{"h"});
  EXPECT_EQ(a->handoffs(), 1);
  EXPECT_TRUE(absl::IsUnavailable(a->Claim(h)));  // c owns it now
}

// A release whose request failed, or a claim whose answer was lost after etcd applied it, leaves
// the session's key bound to this replica's live lease while the replica does not count it as
// its own: no one would hand it over, and every other replica's claim would be refused until
// this one stopped. The replica's handoff thread finds such keys and deletes them, so another
// replica's claim goes through.
TEST_F(EtcdOwnershipTest, AKeyLeftByAnUnansweredReleaseOrClaimIsReleased) {
  using Fault = EtcdOwnershipOptions::RequestFault;
  struct Case {
    std::string name;
    Fault fault;
    bool in_release;  // else in the claim
  };
  for (const Case& c : {Case{"release-dropped", Fault::kDropped, true},
                        Case{"claim-answer-lost", Fault::kAnswerLost, false}}) {
    SCOPED_TRACE(c.name);
    std::atomic<bool> armed{false};
    EtcdOwnershipOptions oa = Options("a-" + c.name);
    oa.testing_request_fault = [&](const std::string& path, const std::string& body) {
      const bool target =
          path == "/v3/kv/txn" &&
          body.find(c.in_release ? "request_delete_range" : "request_put") != std::string::npos;
      return target && armed.exchange(false) ? c.fault : Fault::kNone;
    };
    auto a = EtcdOwnership::Start(oa);
    ASSERT_TRUE(a.ok()) << a.status();
    EtcdOwnershipOptions ob = Options("b-" + c.name);
    ob.handoff_wait = absl::Seconds(60);  // a bound: the settled key ends the wait
    auto b = EtcdOwnership::Start(ob);
    ASSERT_TRUE(b.ok()) << b.status();
    const SessionKey x(c.name);
    if (c.in_release) {
      ASSERT_TRUE((*a)->Claim(x).ok());
      armed.store(true);
      (*a)->Release(x);  // its request never reached etcd: the key is still a's
    } else {
      armed.store(true);
      EXPECT_TRUE(absl::IsUnavailable((*a)->Claim(x)));  // etcd made the key a's
    }
    EXPECT_FALSE(armed.load()) << "the fault did not fire";
    EXPECT_FALSE((*a)->CheckWrite(x).ok());  // a does not count it as its own
    // a has no handoff handler: only the look-up of the unsure key lets b in.
    const absl::Status claimed = (*b)->Claim(x);
    EXPECT_TRUE(claimed.ok()) << claimed;
    EXPECT_TRUE((*b)->CheckWrite(x).ok());
  }
}

// A replica whose keepalive found its lease expired (revoked here) forgets its claims, so its
// later commit is refused before etcd is asked. With testing_keep_stale_claims it keeps them and
// the commit reaches etcd, whose transaction refuses it and names the owner now (what
// deploy.etcd_fencing relies on to prove the refusal is etcd's).
TEST_F(EtcdOwnershipTest, AStaleClaimIsRefusedLocallyOrByEtcdWithTheTestingOption) {
  for (const bool keep : {false, true}) {
    SCOPED_TRACE(keep ? "keep stale claims" : "forget stale claims");
    EtcdOwnershipOptions paused = Options(keep ? "kept" : "forgot");
    // Keepalive every 3 s: it finds the revoked lease soon, and a stall of the test shorter than
    // the TTL does not let the lease expire by itself between the claim and its commit.
    paused.lease_ttl = absl::Seconds(9);
    paused.testing_keep_stale_claims = keep;
    auto a = EtcdOwnership::Start(paused);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = StartReplica(keep ? "b-kept" : "b-forgot");
    ASSERT_TRUE(b);
    const SessionKey s(keep ? "kept" : "forgot");
    ASSERT_TRUE((*a)->Claim(s).ok());
    ASSERT_TRUE((*a)->CommitSnapshot(s, (*a)->ClaimEpoch(s), "", "one").ok());
    const int64_t old_lease = (*a)->lease_id();
    Revoke(old_lease);
    // Bounded wait for the keepalive to notice and grant a new lease (not a timing assertion).
    ASSERT_TRUE(Eventually([&] { return (*a)->lease_id() != old_lease; }));
    ASSERT_TRUE(b->Claim(s).ok());
    ASSERT_TRUE(b->CommitSnapshot(s, b->ClaimEpoch(s), "one", "two").ok());
    const absl::Status late = (*a)->CommitSnapshot(s, (*a)->ClaimEpoch(s), "one", "late");
    EXPECT_TRUE(absl::IsFailedPrecondition(late)) << late;
    if (keep) {
      EXPECT_NE(late.message().find("etcd refused the transaction: ownership lost"),
                std::string::npos)
          << late;
      EXPECT_NE(late.message().find("owner now: b-kept"), std::string::npos) << late;
    } else {
      EXPECT_NE(late.message().find("hold a claim"), std::string::npos) << late;
    }
    auto seen = b->Observe(s);
    ASSERT_TRUE(seen.ok()) << seen.status();
    EXPECT_EQ(*seen, "two");
  }
}

// A commit passes only under the claim its file was written under: once a replica lost a claim,
// a file it wrote under it can never be committed, even after it claims the session again (what
// makes the store's sweep of uncommitted files safe). VerifyClaim tells whether a claim is
// current.
TEST_F(EtcdOwnershipTest, ACommitNeedsTheClaimItsFileWasWrittenUnder) {
  auto a = StartReplica("a");
  auto b = StartReplica("b");
  ASSERT_TRUE(a && b);
  const SessionKey x("x");
  ASSERT_TRUE(a->Claim(x).ok());
  const int64_t first = a->ClaimEpoch(x);
  ASSERT_NE(first, 0);
  EXPECT_TRUE(a->VerifyClaim(x, first).ok());
  a->Release(x);
  EXPECT_EQ(a->ClaimEpoch(x), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(a->VerifyClaim(x, first)));
  ASSERT_TRUE(b->Claim(x).ok());
  b->Release(x);
  ASSERT_TRUE(a->Claim(x).ok());  // a owns it again, under a new claim
  const int64_t second = a->ClaimEpoch(x);
  EXPECT_GT(second, first);
  const absl::Status late = a->CommitSnapshot(x, first, "", "written-under-the-first-claim");
  EXPECT_TRUE(absl::IsFailedPrecondition(late)) << late;
  EXPECT_NE(late.message().find("etcd refused the transaction"), std::string::npos) << late;
  EXPECT_EQ(a->ClaimEpoch(x), second);  // a refusal of an old claim keeps the current one
  EXPECT_TRUE(a->VerifyClaim(x, second).ok());
  ASSERT_TRUE(a->CommitSnapshot(x, second, "", "written-under-the-second-claim").ok());
  auto seen = b->Observe(x);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, "written-under-the-second-claim");
}

}  // namespace
}  // namespace sdm
