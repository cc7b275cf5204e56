// EtcdOwnership (server/cluster/etcd_ownership.h) against a real etcd started by the test on
// loopback ports with a temporary data directory; skipped when `etcd` is not installed.
// Expiry of a paused replica's lease is simulated by revoking it (no waiting for a TTL).
#include "server/cluster/etcd_ownership.h"

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "server/grpc_status.h"
#include "tests/base/eventually.h"
#include "tests/server/server_test_util.h"

namespace sdm {
namespace {

using ::sdm::testing::Eventually;

// Binds a loopback TCP socket to `port` (0: any) and releases it; the port bound, or 0 when the
// bind failed.
int BindAndRelease(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int bound = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    bound = ntohs(addr.sin_port);
  }
  close(fd);
  return bound;
}

// A free loopback port for etcd to bind later. Port 0 would come from the ephemeral range, from
// which every outgoing connection (of this test and the tests beside it) takes its local port
// too, and one could take it before etcd binds it: a random port below that range, checked
// free, instead (as tests/deploy/replica_cluster.sh's free_port).
int FreePort() {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  if (low > 10001) {
    std::mt19937 random(std::random_device{}());
    std::uniform_int_distribution<int> below_ephemeral(10000, low - 1);
    for (int attempt = 0; attempt < 100; ++attempt) {
      if (const int port = BindAndRelease(below_ephemeral(random)); port > 0) return port;
    }
  }
  return BindAndRelease(0);
}

bool EtcdInstalled() { return std::system("command -v etcd >/dev/null 2>&1") == 0; }

// One etcd member on loopback ports with its data under `dir`, killed when destroyed. `scheme`
// is its client URLs' ("https" needs `extra` to name the certificate).
class EtcdProcess {
 public:
  EtcdProcess(const std::filesystem::path& dir, const std::string& scheme,
              const std::vector<std::string>& extra = {}) {
    endpoint_ = absl::StrCat(scheme, "://127.0.0.1:", FreePort());
    const std::string peer = absl::StrCat("http://127.0.0.1:", FreePort());
    const std::string data = (dir / "etcd").string();
    log_ = (dir / "etcd.log").string();
    std::vector<std::string> args = {"etcd",
                                     "--data-dir",
                                     data,
                                     "--listen-client-urls",
                                     endpoint_,
                                     "--advertise-client-urls",
                                     endpoint_,
                                     "--listen-peer-urls",
                                     peer,
                                     "--initial-advertise-peer-urls",
                                     peer,
                                     "--initial-cluster",
                                     "default=" + peer};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      freopen(log_.c_str(), "w", stdout);
      freopen(log_.c_str(), "a", stderr);
      execvp("etcd", argv.data());
      _exit(127);
    }
  }
  ~EtcdProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;

  bool started() const { return pid_ > 0; }
  const std::string& endpoint() const { return endpoint_; }
  int port() const { return std::stoi(endpoint_.substr(endpoint_.rfind(':') + 1)); }
  const std::string& log() const { return log_; }

 private:
  std::string endpoint_;
  std::string log_;
  pid_t pid_ = -1;
};

// A TCP proxy on a loopback port to 127.0.0.1:`target_port`, counting the connections it
// accepts. A black hole (`target_port` 0) accepts connections and never answers. Stop() closes
// the port and every connection: the port then refuses connections. A stall marker holds a
// request containing it (bytes from the client) until Unstall().
class TcpProxy {
 public:
  explicit TcpProxy(int target_port) : target_port_(target_port) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    listen(listener_, 64);
    accepter_ = std::thread([this] { Accept(); });
  }
  ~TcpProxy() { Stop(); }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  std::string endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }
  int accepted() const {
    absl::MutexLock lock(&mu_);
    return accepted_;
  }
  void StallRequestsContaining(const std::string& marker) {
    absl::MutexLock lock(&mu_);
    stall_marker_ = marker;
  }
  // True once a request was held (and is still being held).
  bool stalled() const {
    absl::MutexLock lock(&mu_);
    return stalled_;
  }
  void Unstall() {
    absl::MutexLock lock(&mu_);
    stall_marker_.clear();
  }
  void Stop() {
    std::vector<std::thread> pumps;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      stopped_ = true;
      stall_marker_.clear();
      shutdown(listener_, SHUT_RDWR);
      for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    }
    accepter_.join();
    {
      absl::MutexLock lock(&mu_);
      pumps.swap(pumps_);
    }
    for (std::thread& t : pumps) t.join();
    close(listener_);
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) close(fd);
  }

 private:
  void Accept() {
    while (true) {
      const int client = accept(listener_, nullptr, nullptr);
      absl::MutexLock lock(&mu_);
      if (client < 0 || stopped_) {
        if (client >= 0) close(client);
        return;
      }
      ++accepted_;
      fds_.push_back(client);
      if (target_port_ == 0) continue;  // a black hole
      const int server = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(target_port_);
      if (connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        close(server);
        shutdown(client, SHUT_RDWR);
        continue;
      }
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server] { Pump(client, server); });
    }
  }

  // Copies both ways until either side closes.
  void Pump(int client, int server) {
    char buf[16384];
    while (true) {
      pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) return;
      for (int i = 0; i < 2; ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        if (n <= 0) {
          shutdown(client, SHUT_RDWR);
          shutdown(server, SHUT_RDWR);
          return;
        }
        if (i == 0) HoldIfMarked(absl::string_view(buf, n));
        const int to = i == 0 ? server : client;
        for (ssize_t sent = 0; sent < n;) {
          const ssize_t w = send(to, buf + sent, n - sent, MSG_NOSIGNAL);
          if (w <= 0) return;
          sent += w;
        }
      }
    }
  }

  void HoldIfMarked(absl::string_view data) {
    absl::MutexLock lock(&mu_);
    if (stall_marker_.empty() || !absl::StrContains(data, stall_marker_)) return;
    stalled_ = true;
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stall_marker_.empty(); };
    mu_.Await(absl::Condition(&released));
    stalled_ = false;
  }

  const int target_port_;
  int listener_ = -1;
  int port_ = 0;
  std::thread accepter_;
  mutable absl::Mutex mu_;
  int accepted_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::string stall_marker_ ABSL_GUARDED_BY(mu_);
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
};

// POSTs to etcd's gateway from the test (no EtcdOwnership): the answer's body, or "" on failure.
std::string Gateway(const std::string& endpoint, const std::string& path, const std::string& body,
                    const std::string& token = "") {
  httplib::Client client(endpoint);
  client.set_read_timeout(60, 0);
  httplib::Headers headers;
  if (!token.empty()) headers.emplace("Authorization", token);
  auto r = client.Post(path, headers, body, "application/json");
  return r && r->status == 200 ? r->body : "";
}

// etcd's remaining TTL of `lease` (-1: expired or unknown).
int64_t LeaseTtl(const std::string& endpoint, int64_t lease) {
  const nlohmann::json ttl = nlohmann::json::parse(
      Gateway(endpoint, "/v3/lease/timetolive", absl::StrCat("{\"ID\":\"", lease, "\"}")), nullptr,
      false);
  if (!ttl.is_object()) return -1;
  return std::stoll(ttl.value("TTL", std::string("-1")));
}

class EtcdOwnershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdInstalled()) GTEST_SKIP() << "etcd is not installed";
    etcd_ = std::make_unique<EtcdProcess>(dir_.path(), "http");
    ASSERT_TRUE(etcd_->started());
    endpoint_ = etcd_->endpoint();
    // Up when it grants a lease (bounded: a broken etcd fails the test, it does not hang).
    ASSERT_TRUE(Eventually([&] { return EtcdOwnership::Start(Options("probe")).ok(); }))
        << "etcd did not start; see " << etcd_->log();
  }

  void TearDown() override { etcd_.reset(); }

  EtcdOwnershipOptions Options(const std::string& replica) const {
    EtcdOwnershipOptions o;
    o.client.endpoints = {endpoint_};
    o.replica_id = replica;
    o.lease_ttl = absl::Seconds(30);  // never expires during a test: expiry is a revoke
    o.client.request_timeout = absl::Seconds(30);  // etcd answers slowly on a loaded machine
    o.handoff_wait = absl::Milliseconds(200);      // refusals come quickly (no handler answers)
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
  std::unique_ptr<EtcdProcess> etcd_;
  std::string endpoint_;
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
  using Fault = EtcdRequestFault;
  std::atomic<int> to_drop{0};
  absl::Notification dropped_all;
  EtcdOwnershipOptions o = Options("a");
  o.lease_ttl = absl::Seconds(10);
  o.keepalive_retry = absl::Milliseconds(10);
  o.client.testing_request_fault = [&](const std::string& path, const std::string&) {
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
  using Fault = EtcdRequestFault;
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
    oa.client.testing_request_fault = [&](const std::string& path, const std::string& body) {
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

// Bad endpoint lists and TLS or authentication options fail the start with INVALID_ARGUMENT
// naming the problem, before etcd is asked (no etcd runs here).
TEST(EtcdOwnershipOptionsTest, BadEndpointsAndCredentialsFailTheStart) {
  using ::testing::HasSubstr;
  auto start = [](const std::function<void(EtcdOwnershipOptions&)>& edit) {
    EtcdOwnershipOptions o;
    o.replica_id = "a";
    o.client.endpoints = {"http://127.0.0.1:1"};
    edit(o);
    return EtcdOwnership::Start(o).status();
  };
  struct Case {
    std::vector<std::string> endpoints;
    std::string says;
  };
  for (const Case& c : {
           Case{{}, "no etcd endpoint given"},
           Case{{""}, "an etcd endpoint is empty"},
           Case{{"127.0.0.1:2379"}, "'127.0.0.1:2379': no scheme"},
           Case{{"http://127.0.0.1:2379", "etcd-1:2379"}, "'etcd-1:2379': no scheme"},
           Case{{"ftp://etcd:2379"}, "no scheme"},
           Case{{"http://etcd:2379/v3"}, "a path"},
           Case{{"http://:2379"}, "no host"},
           Case{{"http://etcd:99999"}, "a bad port"},
           Case{{"http://etcd:"}, "no port"},
           // A password written into the URL is not repeated in the message (it is logged).
           Case{{"http://user:secretpw@etcd:2379"},
                "etcd endpoint 'http://***@etcd:2379': user information in the URL"},
       }) {
    const absl::Status s =
        start([&](EtcdOwnershipOptions& o) { o.client.endpoints = c.endpoints; });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.says));
    EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("secretpw")));
  }
  struct Edit {
    std::function<void(EtcdOwnershipOptions&)> edit;
    std::string says;
  };
  for (const Edit& e : {
           Edit{[](EtcdOwnershipOptions& o) { o.client.ca_file = "/etc/hostname"; },
                "no etcd endpoint is https://"},
           Edit{[](EtcdOwnershipOptions& o) {
                  o.client.endpoints = {"https://127.0.0.1:1"};
                  o.client.ca_file = "/nonexistent/ca.pem";
                },
                "'/nonexistent/ca.pem' cannot be read"},
           Edit{[](EtcdOwnershipOptions& o) {
                  o.client.endpoints = {"https://127.0.0.1:1"};
                  o.client.cert_file = "/etc/hostname";
                },
                "needs its key"},
           Edit{[](EtcdOwnershipOptions& o) { o.client.username = "root"; }, "needs a password"},
           Edit{[](EtcdOwnershipOptions& o) { o.client.password = "secret"; },
                "without a user name"},
           Edit{[](EtcdOwnershipOptions& o) {
                  o.client.username = "root";
                  o.client.password = std::string("s") + char(0xff) + "cret";  // the encoder threw
                },
                "the etcd password is not valid UTF-8"},
       }) {
    const absl::Status s = start(e.edit);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << e.says << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(e.says));
  }
  for (const char* list : {"", " ", "http://a:1,,http://b:2", "http://a:1,", ",http://a:1"}) {
    const auto parsed = ParseEtcdEndpoints(list);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << "'" << list << "'";
  }
  const auto parsed = ParseEtcdEndpoints(" http://a:1 ,https://b:2");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, (std::vector<std::string>{"http://a:1", "https://b:2"}));
}

// Two endpoints, the first a closed port: the start, claims, commits and keepalives go to the
// second, and the lease outlives its TTL (a keepalive that failed would let it expire, and the
// replica would then hold a new lease). The TTL is long enough that only a hang of the keepalive
// thread or etcd (about 20 s) could let it lapse.
TEST_F(EtcdOwnershipTest, ADeadFirstEndpointFailsOverAndTheLeaseSurvives) {
  std::atomic<int> keepalives{0};
  absl::Notification enough;
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {absl::StrCat("http://127.0.0.1:", FreePort()), endpoint_};
  o.lease_ttl = absl::Seconds(30);  // a keepalive every 10 s
  o.client.testing_request_fault = [&](const std::string& path, const std::string&) {
    if (path == "/v3/lease/keepalive" && keepalives.fetch_add(1) + 1 == 4) enough.Notify();
    return EtcdRequestFault::kNone;
  };
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  const int64_t lease = (*a)->lease_id();
  const SessionKey x("x");
  ASSERT_TRUE((*a)->Claim(x).ok());
  ASSERT_TRUE((*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "", "one").ok());
  auto b = StartReplica("b");
  ASSERT_TRUE(b);
  EXPECT_TRUE(absl::IsUnavailable(b->Claim(x)));  // a's claim is in etcd
  // The fourth keepalive comes at least four periods after the grant: 40 s, more than the TTL.
  ASSERT_TRUE(enough.WaitForNotificationWithTimeout(absl::Minutes(5)));
  EXPECT_EQ((*a)->lease_id(), lease);
  EXPECT_GT(LeaseTtl(endpoint_, lease), 0);
  EXPECT_TRUE((*a)->CheckWrite(x).ok());
}

// Two endpoints of one etcd, the first through a proxy that counts connections: requests go
// there over reused connections (at most one per thread speaking to etcd at once: the caller,
// the keepalive and the handoff thread, not one per request) until the proxy stops; then they
// go to the second endpoint, and the replica keeps its claims and its lease (a TTL long enough
// that only a hang of the keepalive thread or etcd, about 20 s, could let it lapse).
TEST_F(EtcdOwnershipTest, ConnectionsAreReusedAndAStoppedEndpointFailsOver) {
  TcpProxy proxy(etcd_->port());
  std::atomic<int> keepalives{0};
  std::atomic<int> wanted{1 << 30};
  absl::Notification enough;
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {proxy.endpoint(), endpoint_};
  o.lease_ttl = absl::Seconds(30);  // a keepalive every 10 s
  o.client.testing_request_fault = [&](const std::string& path, const std::string&) {
    if (path == "/v3/lease/keepalive" && keepalives.fetch_add(1) + 1 == wanted.load()) {
      enough.Notify();
    }
    return EtcdRequestFault::kNone;
  };
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  const int64_t lease = (*a)->lease_id();
  constexpr int kSessions = 20;
  for (int i = 0; i < kSessions; ++i) {
    ASSERT_TRUE((*a)->Claim(SessionKey(absl::StrCat("s", i))).ok()) << i;
  }
  EXPECT_GE(proxy.accepted(), 1);
  EXPECT_LE(proxy.accepted(), 3) << "a connection per request";
  proxy.Stop();  // its connections are closed, its port refuses
  for (int i = 0; i < kSessions; ++i) {
    const SessionKey s(absl::StrCat("s", i));
    const absl::Status committed = (*a)->CommitSnapshot(s, (*a)->ClaimEpoch(s), "", "one");
    ASSERT_TRUE(committed.ok()) << i << ": " << committed;
  }
  // Counted from here, each keepalive is one attempt (the second endpoint, which answered the
  // commits, is tried first): the fifth is at least four periods after the stop.
  wanted.store(keepalives.load() + 5);
  auto b = StartReplica("b");
  ASSERT_TRUE(b);
  EXPECT_TRUE(absl::IsUnavailable(b->Claim(SessionKey("s0"))));
  // Five keepalives after the commits, the fifth at least 40 s after the stop: more than the TTL
  // after the last renewal before the stop. The lease never lapsed.
  ASSERT_TRUE(enough.WaitForNotificationWithTimeout(absl::Minutes(5)));
  EXPECT_EQ((*a)->lease_id(), lease);
  EXPECT_GT(LeaseTtl(endpoint_, lease), 0);
}

// An endpoint that accepts connections and never answers: the request times out there and goes
// to the next endpoint, which later requests then try first (the black hole gets no other
// connection from a request that succeeded). A request that etcd itself answers later than the
// timeout goes on to the hole and fails (the hole never answers): it is retried, and counted, as
// it may have given the hole one connection. A request that tried the hole first would succeed
// after it, and give it one more connection than the failures account for.
TEST_F(EtcdOwnershipTest, ATimedOutEndpointFailsOverAndIsNotTriedFirstAgain) {
  TcpProxy hole(0);
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {hole.endpoint(), endpoint_};
  o.client.request_timeout = absl::Seconds(3);
  absl::StatusOr<std::unique_ptr<EtcdOwnership>> a;
  // Bounded retries: on a loaded machine etcd itself may once take longer than the timeout.
  ASSERT_TRUE(Eventually([&] {
    a = EtcdOwnership::Start(o);
    return a.ok();
  })) << a.status();
  const int holes = hole.accepted();
  EXPECT_GE(holes, 1);
  int failed = 0;  // requests that went on to the hole (etcd answered too late): one try each
  auto until_ok = [&](const std::function<absl::Status()>& request) {
    absl::Status s;
    const bool ok = Eventually([&] {
      s = request();
      if (!s.ok()) ++failed;
      return s.ok();
    });
    EXPECT_TRUE(ok) << s;
    return ok;
  };
  const SessionKey x("x");
  ASSERT_TRUE(until_ok([&] { return (*a)->Claim(x); }));  // a claim finds its own key
  // A commit whose first copy was applied sees its own name committed (success).
  ASSERT_TRUE(until_ok([&] { return (*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "", "one"); }));
  ASSERT_TRUE(until_ok([&] { return (*a)->Claim(SessionKey("y")); }));
  EXPECT_LE(hole.accepted(), holes + failed);  // none at all when etcd was not slow
}

// An etcd that never answers is named as such, with the timeout, not by cpp-httplib's "Read".
TEST_F(EtcdOwnershipTest, AnEtcdThatNeverAnswersIsSaidSo) {
  TcpProxy hole(0);
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {hole.endpoint()};
  o.client.request_timeout = absl::Seconds(1);
  const absl::StatusOr<std::unique_ptr<EtcdOwnership>> a = EtcdOwnership::Start(o);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kUnavailable) << a.status();
  EXPECT_THAT(a.status().message(),
              ::testing::HasSubstr("no answer within 1s (--etcd_request_timeout), or the "
                                   "connection broke (Read)"));
}

// A request held up on the wire (a claim whose transaction the proxy holds) does not hold up the
// lease's keepalive: each request has a connection of its own.
TEST_F(EtcdOwnershipTest, AKeepaliveIsNotHeldUpByASlowRequest) {
  TcpProxy proxy(etcd_->port());
  std::atomic<int> keepalives{0};
  std::atomic<int> wanted{1 << 30};
  absl::Notification two_more;
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {proxy.endpoint()};
  o.lease_ttl = absl::Seconds(6);  // a keepalive every 2 s
  // The held claim does not time out before the keepalives are waited for (a minute): a
  // keepalive queued behind it would then run only after the wait.
  o.client.request_timeout = absl::Minutes(3);
  o.client.testing_request_fault = [&](const std::string& path, const std::string&) {
    if (path == "/v3/lease/keepalive" && keepalives.fetch_add(1) + 1 == wanted.load()) {
      two_more.Notify();
    }
    return EtcdRequestFault::kNone;
  };
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  proxy.StallRequestsContaining("request_put");
  absl::Status claimed;
  std::thread claim([&] { claimed = (*a)->Claim(SessionKey("x")); });
  ASSERT_TRUE(Eventually([&] { return proxy.stalled(); }));
  wanted.store(keepalives.load() + 2);  // the first of them has finished when the second starts
  const bool kept_alive = two_more.WaitForNotificationWithTimeout(absl::Minutes(1));
  proxy.Unstall();
  claim.join();
  EXPECT_TRUE(kept_alive) << "the keepalive waited for the claim";
  EXPECT_TRUE(claimed.ok()) << claimed;
}

// A claim, a commit and a delete whose first copy etcd applied with the answer lost, sent again
// to the next endpoint: the claim finds the key its own, and the commit and delete are refused
// (their base is no longer committed) with this request's own result committed under this
// replica's claim, which counts as success. Both endpoints are the one etcd here.
TEST_F(EtcdOwnershipTest, ARequestAppliedWithoutAnAnswerAndSentAgainCountsOnce) {
  std::atomic<bool> armed{false};
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {endpoint_, endpoint_};
  o.client.testing_request_fault = [&](const std::string& path, const std::string&) {
    return path == "/v3/kv/txn" && armed.exchange(false) ? EtcdRequestFault::kAnswerLost
                                                         : EtcdRequestFault::kNone;
  };
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = StartReplica("b");
  ASSERT_TRUE(b);
  const SessionKey x("x");
  armed.store(true);
  const absl::Status claimed = (*a)->Claim(x);
  EXPECT_FALSE(armed.load()) << "the fault did not fire";
  ASSERT_TRUE(claimed.ok()) << claimed;
  EXPECT_TRUE((*a)->CheckWrite(x).ok());
  EXPECT_TRUE(absl::IsUnavailable(b->Claim(x)));
  armed.store(true);
  const absl::Status committed = (*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "", "one");
  EXPECT_FALSE(armed.load()) << "the fault did not fire";
  EXPECT_TRUE(committed.ok()) << committed;
  EXPECT_EQ((*a)->Committed(x), std::optional<std::string>("one"));
  auto seen = b->Observe(x);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, "one");
  armed.store(true);
  const absl::Status deleted = (*a)->DeleteCommitted(x, "one");
  EXPECT_FALSE(armed.load()) << "the fault did not fire";
  EXPECT_TRUE(deleted.ok()) << deleted;
  seen = b->Observe(x);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, "");
}

// A commit whose first copy etcd applied without its answer reaching the replica, and whose
// second copy (to the next endpoint) is refused because the claim ended in between (the lease
// revoked here; a replica paused past its TTL), is the committed state: OK. Before, it answered
// FAILED_PRECONDITION ("never becomes the state"), and the store removed the file etcd names.
TEST_F(EtcdOwnershipTest, ACommitAppliedBeforeTheClaimEndedIsCommitted) {
  enum Stage { kOff, kLoseTheAnswer, kEndTheClaim };
  std::atomic<int> stage{kOff};
  std::atomic<int64_t> lease{0};
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {endpoint_, endpoint_};
  o.client.testing_request_fault = [&](const std::string& path, const std::string&) {
    if (path != "/v3/kv/txn") return EtcdRequestFault::kNone;
    int lose = kLoseTheAnswer;
    if (stage.compare_exchange_strong(lose, kEndTheClaim)) return EtcdRequestFault::kAnswerLost;
    int end = kEndTheClaim;
    if (stage.compare_exchange_strong(end, kOff)) {
      Gateway(endpoint_, "/v3/lease/revoke", absl::StrCat("{\"ID\":\"", lease.load(), "\"}"));
    }
    return EtcdRequestFault::kNone;
  };
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  lease.store((*a)->lease_id());
  auto b = StartReplica("b");
  ASSERT_TRUE(b);
  const SessionKey x("x");
  ASSERT_TRUE((*a)->Claim(x).ok());
  stage.store(kLoseTheAnswer);
  const absl::Status committed = (*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "", "one");
  EXPECT_EQ(stage.load(), kOff) << "the faults did not fire";
  EXPECT_TRUE(committed.ok()) << committed;
  auto seen = b->Observe(x);
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(*seen, "one");
  EXPECT_EQ((*a)->ClaimEpoch(x), 0);  // the claim is gone
}

// A member that answers that it cannot serve now (cut off from the leader: "no leader", which it
// answers at once because every request asks for a leader, Grpc-Metadata-Hasleader) is passed
// over: the request goes to the next member. Before, the answer was taken as etcd's, and the
// replica could not start while such a member came first.
TEST_F(EtcdOwnershipTest, AMemberWithoutALeaderIsPassedOver) {
  httplib::Server leaderless;
  std::atomic<int> asked_for_a_leader{0};
  leaderless.Post(R"(/v3/.*)", [&](const httplib::Request& req, httplib::Response& r) {
    if (req.get_header_value("Grpc-Metadata-Hasleader") == "true") ++asked_for_a_leader;
    r.status = 503;
    r.set_content(R"({"error":"etcdserver: no leader","code":14})", "application/json");
  });
  const int port = leaderless.bind_to_any_port("127.0.0.1");
  std::thread serving([&] { leaderless.listen_after_bind(); });
  absl::Cleanup stop = [&] {
    leaderless.stop();
    serving.join();
  };
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {absl::StrCat("http://127.0.0.1:", port), endpoint_};
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GE(asked_for_a_leader.load(), 1);
  EXPECT_TRUE((*a)->Claim(SessionKey("x")).ok());
}

// Authentication (enabled here through the gateway: the root user with the root role): a wrong
// password fails the start with etcd's refusal; with the right one claims and commits work, and
// when etcd drops the token (a simple token expires, etcd restarts; here: the user's password is
// set again, which drops its tokens) the replica authenticates again.
TEST_F(EtcdOwnershipTest, AuthenticatesAndAuthenticatesAgainWhenTheTokenIsDropped) {
  using ::testing::HasSubstr;
  ASSERT_NE(Gateway(endpoint_, "/v3/auth/user/add", R"({"name":"root","password":"s3cret"})"), "");
  ASSERT_NE(Gateway(endpoint_, "/v3/auth/user/grant", R"({"user":"root","role":"root"})"), "");
  ASSERT_NE(Gateway(endpoint_, "/v3/auth/enable", "{}"), "");
  EtcdOwnershipOptions wrong = Options("wrong");
  wrong.client.username = "root";
  wrong.client.password = "not-it";
  const absl::Status refused = EtcdOwnership::Start(wrong).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("refused to authenticate user 'root'"));
  EXPECT_THAT(refused.message(), HasSubstr("authentication failed"));
  EXPECT_THAT(refused.message(), ::testing::Not(HasSubstr("not-it")));

  // A member that answers something else than a refusal of the credentials (a leader election,
  // a learner: 503) is passed over, not taken for a wrong password.
  httplib::Server electing;
  electing.Post("/v3/auth/authenticate", [](const httplib::Request&, httplib::Response& r) {
    r.status = 503;
    r.set_content(R"({"error":"etcdserver: leader changed","code":14})", "application/json");
  });
  const int electing_port = electing.bind_to_any_port("127.0.0.1");
  std::thread serving([&] { electing.listen_after_bind(); });
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {absl::StrCat("http://127.0.0.1:", electing_port), endpoint_};
  o.client.username = "root";
  o.client.password = "s3cret";
  auto a = EtcdOwnership::Start(o);
  electing.stop();
  serving.join();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->authentications(), 1);
  const SessionKey x("x");
  ASSERT_TRUE((*a)->Claim(x).ok());
  ASSERT_TRUE((*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "", "one").ok());

  const nlohmann::json auth = nlohmann::json::parse(
      Gateway(endpoint_, "/v3/auth/authenticate", R"({"name":"root","password":"s3cret"})"),
      nullptr, false);
  ASSERT_TRUE(auth.is_object() && auth.contains("token"));
  ASSERT_NE(Gateway(endpoint_, "/v3/auth/user/changepw", R"({"name":"root","password":"s3cret"})",
                    auth["token"].get<std::string>()),
            "");
  const absl::Status again = (*a)->Claim(SessionKey("y"));
  EXPECT_TRUE(again.ok()) << again;
  const absl::Status committed = (*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "one", "two");
  EXPECT_TRUE(committed.ok()) << committed;
  EXPECT_GE((*a)->authentications(), 2);
}

// https:// endpoints: an etcd whose certificate a CA of the test's signs, and which asks for a
// client certificate (--client-cert-auth). A replica with the CA file and a client certificate
// works; without the CA file (the system's CAs do not know it) or without the client certificate
// the start fails, the first naming the certificate problem.
TEST_F(EtcdOwnershipTest, HttpsWithACaFileAndAClientCertificate) {
  using ::testing::HasSubstr;
  const std::filesystem::path tls = dir_.path() / "tls";
  std::filesystem::create_directories(tls);
  const std::string script = absl::StrCat(
      "cd '", tls.string(), "' && exec >openssl.log 2>&1 && ",
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key "
      "-out ca.pem -days 2 -subj /CN=sdm-test-ca && ",
      "for who in server client; do ",
      "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout $who.key "
      "-out $who.csr -subj /CN=127.0.0.1 && ",
      "printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\\n' "
      ">ext.cnf && ",
      "openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem "
      "-days 2 -extfile ext.cnf || exit 1; done");
  { std::ofstream(tls / "make-certs.sh") << script << "\n"; }
  ASSERT_EQ(std::system(("bash '" + (tls / "make-certs.sh").string() + "'").c_str()), 0)
      << "see " << (tls / "openssl.log");
  const std::string ca = (tls / "ca.pem").string();
  EtcdProcess etcd(tls, "https",
                   {"--cert-file", (tls / "server.pem").string(), "--key-file",
                    (tls / "server.key").string(), "--client-cert-auth", "--trusted-ca-file", ca});
  ASSERT_TRUE(etcd.started());
  EtcdOwnershipOptions o = Options("tls");
  o.client.endpoints = {etcd.endpoint()};
  o.client.ca_file = ca;
  o.client.cert_file = (tls / "client.pem").string();
  o.client.key_file = (tls / "client.key").string();
  absl::StatusOr<std::unique_ptr<EtcdOwnership>> a;
  ASSERT_TRUE(Eventually([&] {
    a = EtcdOwnership::Start(o);
    return a.ok();
  })) << a.status()
      << "; see " << etcd.log();
  const SessionKey x("x");
  ASSERT_TRUE((*a)->Claim(x).ok());
  ASSERT_TRUE((*a)->CommitSnapshot(x, (*a)->ClaimEpoch(x), "", "one").ok());

  EtcdOwnershipOptions no_ca = o;
  no_ca.client.ca_file.clear();
  const absl::Status untrusted = EtcdOwnership::Start(no_ca).status();
  EXPECT_TRUE(absl::IsUnavailable(untrusted)) << untrusted;
  EXPECT_THAT(untrusted.message(), HasSubstr("etcd's TLS certificate was not accepted"));
  EXPECT_THAT(untrusted.message(), HasSubstr("no etcd CA file given"));

  EtcdOwnershipOptions no_cert = o;
  no_cert.client.cert_file.clear();
  no_cert.client.key_file.clear();
  const absl::Status anonymous = EtcdOwnership::Start(no_cert).status();
  EXPECT_FALSE(anonymous.ok());
}

// JWT tokens (etcd --auth-token jwt): any change of users or roles makes etcd refuse the tokens
// made before it ("revision of auth store is old") until they expire, by default 5 minutes. The
// replica authenticates again. Before, every claim and commit failed until the token expired.
TEST_F(EtcdOwnershipTest, AJwtMadeOldByAnAuthChangeIsRenewed) {
  const std::filesystem::path jwt = dir_.path() / "jwt";
  std::filesystem::create_directories(jwt);
  ASSERT_EQ(std::system(absl::StrCat("cd '", jwt.string(),
                                     "' && openssl genrsa -out jwt.key 2048 >openssl.log 2>&1 && "
                                     "openssl rsa -in jwt.key -pubout -out jwt.pub >>openssl.log "
                                     "2>&1")
                            .c_str()),
            0)
      << "see " << (jwt / "openssl.log");
  EtcdProcess etcd(jwt, "http",
                   {"--auth-token", absl::StrCat("jwt,pub-key=", (jwt / "jwt.pub").string(),
                                                 ",priv-key=", (jwt / "jwt.key").string(),
                                                 ",sign-method=RS256,ttl=5m")});
  ASSERT_TRUE(etcd.started());
  ASSERT_TRUE(Eventually([&] {
    return Gateway(etcd.endpoint(), "/v3/auth/user/add",
                   R"({"name":"root","password":"s3cret"})") != "";
  })) << "see "
      << etcd.log();
  ASSERT_NE(Gateway(etcd.endpoint(), "/v3/auth/user/grant", R"({"user":"root","role":"root"})"),
            "");
  ASSERT_NE(Gateway(etcd.endpoint(), "/v3/auth/enable", "{}"), "");
  EtcdOwnershipOptions o = Options("a");
  o.client.endpoints = {etcd.endpoint()};
  o.client.username = "root";
  o.client.password = "s3cret";
  auto a = EtcdOwnership::Start(o);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->Claim(SessionKey("x")).ok());
  EXPECT_EQ((*a)->authentications(), 1);
  // An unrelated change of the auth store, by an operator with a token of their own.
  const nlohmann::json auth = nlohmann::json::parse(
      Gateway(etcd.endpoint(), "/v3/auth/authenticate", R"({"name":"root","password":"s3cret"})"),
      nullptr, false);
  ASSERT_TRUE(auth.is_object() && auth.contains("token"));
  ASSERT_NE(Gateway(etcd.endpoint(), "/v3/auth/user/add", R"({"name":"ops","password":"other"})",
                    auth["token"].get<std::string>()),
            "");
  const absl::Status claimed = (*a)->Claim(SessionKey("y"));
  EXPECT_TRUE(claimed.ok()) << claimed;
  EXPECT_GE((*a)->authentications(), 2);  // (the handoff poll may have been refused too)
}

}  // namespace
}  // namespace sdm
