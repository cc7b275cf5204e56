// EtcdOwnership: SessionOwnership (state_store/session_ownership.h) kept in etcd, spoken through
// etcd v3's JSON gateway (/v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke, /v3/kv/txn)
// with cpp-httplib; no etcd client library. docs/replicas.md.
//
// The replica holds one lease (granted at Start(), TTL `lease_ttl`, renewed by a keepalive
// thread every TTL/3, revoked at destruction: a drained replica releases everything at once; a
// crashed one when its lease expires). It owns a session while the key
// `<prefix><SessionRecordId>` exists with its replica id as value and its lease: Claim creates
// the key in a transaction (create revision 0) or finds it already its own, and remembers the
// key's mod revision (its claim). Release deletes the key if it is still its.
//
// Fenced snapshots (FencesSnapshots() is true): the committed snapshot of a session is the value
// of `<snapshot_prefix><SessionRecordId>` (a file name; no lease: it outlives every replica).
// CommitSnapshot is one transaction: compare the ownership key's mod revision with the claim
// the file was written under AND the committed name with the one its copy was read from; only then
// put the new name. A replica that lost its lease (paused, partitioned: the key expired or another
// replica's claim replaced it) or whose copy is older than the committed state cannot pass
// both comparisons, whenever its request reaches etcd: etcd applies transactions one at a time.
// CheckWrite (the same comparison of the ownership key alone, for stores without fenced
// snapshots) is check-then-write.
//
// Handoff (a session's requests moved to this replica, its owner is alive): a Claim of a session
// another replica owns puts `<handoff_prefix><SessionRecordId>` (this replica's id, bound to its
// lease) and waits up to `handoff_wait` for the owner to give the session up, claiming again
// every 50 ms; it then answers UNAVAILABLE with a retry hint (the owner is busy, stopped or dead:
// a dead owner's sessions come free when its lease expires). Every replica looks for such requests
// every `handoff_poll` and calls its handoff handler (SetHandoffHandler: the server parks the
// session to the shared directory, which commits and releases it) for each session it owns.
// Stop() (a drain, after every session is written) revokes the lease: everything is released.
//
// Unanswered requests: a claim whose answer is lost may have created the key, and a release that
// fails leaves it, bound to this replica's live lease, while this replica does not count the
// session as its own (owned_): nobody would hand it over, and every other replica's claim would
// be refused until this one stops. Such keys are kept as unsure_; the handoff thread looks each
// up at every poll and deletes it while it is still this replica's and unclaimed here. A claim,
// a release and that look-up of one key never overlap (busy_keys_): a claim that found the key
// its own while a release of it was in flight would count a session etcd no longer gives it.
//
// Thread-safety: thread-safe.
#ifndef SDMSERVE_SERVER_CLUSTER_ETCD_OWNERSHIP_H_
#define SDMSERVE_SERVER_CLUSTER_ETCD_OWNERSHIP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "state_store/session_ownership.h"

namespace sdm {

struct EtcdOwnershipOptions {
  std::string endpoint;    // http://host:port of etcd's client URL
  std::string replica_id;  // this replica's name (the keys' value); must be unique
  // Every key of this deployment is under it: <key_prefix>sessions/<id> (the owner),
  // <key_prefix>snapshots/<id> (the committed snapshot), <key_prefix>handoff/<id> (requests).
  // Deployments sharing one etcd need prefixes of their own (else they share session ids and
  // take each other's sessions). Starts and ends with '/'.
  std::string key_prefix = "/sdmserve/";
  absl::Duration lease_ttl = absl::Seconds(10);
  absl::Duration request_timeout = absl::Seconds(2);
  // After a keepalive that failed (etcd unreachable a moment, a leader election), the next is
  // tried this soon rather than a third of the TTL later: two failures in a row would otherwise
  // let the lease expire, and every session of the replica with it.
  absl::Duration keepalive_retry = absl::Milliseconds(500);
  // How long a Claim waits for another replica to hand a session over; zero: it does not ask.
  absl::Duration handoff_wait = absl::Seconds(3);
  // How often this replica looks for requests to hand its sessions over.
  absl::Duration handoff_poll = absl::Milliseconds(100);
  // Testing only (sdm-server --testing_etcd_keep_stale_claims, deploy.etcd_fencing): when the
  // keepalive finds the lease expired, keep the claims made under it instead of forgetting them,
  // so that a stale replica's commit is not refused by this replica's own bookkeeping but sent
  // to etcd, whose transaction refuses it (the ownership key's mod revision is no longer the
  // claim's). Never set in production: it only delays the refusal by one round trip.
  bool testing_keep_stale_claims = false;
  // Testing only: asked before each request (the gateway path and the JSON body); kDropped
  // fails it before it is sent, kAnswerLost sends it and then fails as if its answer were lost
  // (etcd applied it). nullptr: none.
  enum class RequestFault { kNone, kDropped, kAnswerLost };
  std::function<RequestFault(const std::string& path, const std::string& body)>
      testing_request_fault;
};

// OK, or INVALID_ARGUMENT saying why `prefix` cannot be EtcdOwnershipOptions::key_prefix.
absl::Status ValidateEtcdKeyPrefix(const std::string& prefix);

class EtcdOwnership : public SessionOwnership {
 public:
  // Grants the lease and starts the keepalive thread; UNAVAILABLE when etcd cannot be reached.
  static absl::StatusOr<std::unique_ptr<EtcdOwnership>> Start(const EtcdOwnershipOptions& options);
  ~EtcdOwnership() override;  // Stop()
  EtcdOwnership(const EtcdOwnership&) = delete;
  EtcdOwnership& operator=(const EtcdOwnership&) = delete;

  absl::Status Claim(const SessionKey& key) override;
  absl::Status CheckWrite(const SessionKey& key) override;
  void Release(const SessionKey& key) override;
  bool FencesSnapshots() const override { return true; }
  absl::StatusOr<std::string> Observe(const SessionKey& key) override;
  std::optional<std::string> Committed(const SessionKey& key) const override;
  int64_t ClaimEpoch(const SessionKey& key) const override;
  absl::Status VerifyClaim(const SessionKey& key, int64_t claim) override;
  absl::Status CommitSnapshot(const SessionKey& key, int64_t claim, const std::string& base,
                              const std::string& file) override;
  absl::Status DeleteCommitted(const SessionKey& key, const std::string& base) override;

  int64_t lease_id() const;

  // Handoff: `park` is called on the handoff thread for each session this replica owns and
  // another replica asked for; it writes the session and gives it up (the store's Park to disk,
  // which calls Release), and gives up a claim of a session it does not hold (NOT_FOUND; the
  // store's Park releases it). Another error (the session is in use) is retried at the next
  // poll. nullptr:
  // none. When this returns, the previous handler is not running and will not run again.
  void SetHandoffHandler(std::function<absl::Status(const SessionKey&)> park)
      ABSL_LOCKS_EXCLUDED(handler_mu_);
  // Stops the keepalive and handoff threads and revokes the lease: every session is released at
  // once, and later claims and commits fail. Idempotent.
  void Stop();
  // Handoffs this replica made (sessions parked and released because another one asked).
  int64_t handoffs() const;

 private:
  struct PassKey {};

 public:
  EtcdOwnership(PassKey, const EtcdOwnershipOptions& options);

 private:
  // POSTs `body` to the gateway path; the parsed JSON answer as text, or UNAVAILABLE.
  absl::StatusOr<std::string> Post(const std::string& path, const std::string& body) const;
  absl::Status Grant() ABSL_LOCKS_EXCLUDED(mu_);
  void KeepAliveLoop();
  void HandoffLoop();
  // One claim transaction. `elsewhere`: set when another replica owns the session.
  absl::Status TryClaim(const SessionKey& key, bool* elsewhere);
  // The handoff thread's look-up of a key in unsure_ (the class comment): deleted while it is
  // this replica's (and not claimed here meanwhile); forgotten once etcd answered.
  void SettleUnsure(const std::string& name);
  // Holds `name` in busy_keys_ for its lifetime (waiting until no one else holds it).
  class BusyKey;
  std::string KeyOf(const SessionKey& key) const;
  std::string SnapshotKeyOf(const SessionKey& key) const;
  std::string HandoffPrefix() const;  // of the keys requesting handoffs
  // A transaction that puts (`put`: the committed name) or deletes (nullopt) the committed
  // snapshot key if `claim` (0: this replica's claim now) and the committed name `base` are
  // current.
  absl::Status FencedUpdate(const SessionKey& key, int64_t claim, const std::string& base,
                            const std::optional<std::string>& put);

  const EtcdOwnershipOptions options_;
  mutable absl::Mutex mu_;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  // Sessions this replica claimed, by etcd key: the mod revision of its ownership key.
  std::map<std::string, int64_t> owned_ ABSL_GUARDED_BY(mu_);
  // Keys that may be bound to this replica's lease though not in owned_ (the class comment).
  std::set<std::string> unsure_ ABSL_GUARDED_BY(mu_);
  // Keys with a claim, release or settling request in flight.
  std::set<std::string> busy_keys_ ABSL_GUARDED_BY(mu_);
  // The committed snapshot's name of each session last looked at, by ownership key ("" none).
  std::map<std::string, std::string> committed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // Stop() ran
  int64_t handoffs_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex handler_mu_;  // held while the handler runs (it may take mu_)
  std::function<absl::Status(const SessionKey&)> handler_ ABSL_GUARDED_BY(handler_mu_);
  std::thread keepalive_;
  std::thread handoff_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_CLUSTER_ETCD_OWNERSHIP_H_
