// EtcdOwnership: SessionOwnership (state_store/session_ownership.h) kept in etcd, spoken through
// etcd v3's JSON gateway (/v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke, /v3/kv/txn)
// by EtcdClient (etcd_client.h: several endpoints, reused connections, authentication, TLS);
// no etcd client library. docs/replicas.md.
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
// Several endpoints (EtcdClient): a request that an endpoint does not answer (refused connection,
// timeout) goes to the next one, and may then reach etcd twice: its first copy may have been
// applied with its answer lost. Every request this class sends is safe to send twice:
// - lease grant: a lease granted to the lost copy is renewed by no one and binds no key; it
//   expires after the TTL. Keepalive, revoke (the second finds no lease: an error, ignored),
//   every range, and VerifyClaim's transaction (a compare without writes) change nothing twice.
// - the claim's transaction (create the key if absent, else read it): after the first copy
//   created the key, the second's compare fails and its failure branch reads the key as this
//   replica's under this lease, which TryClaim takes as the claim, with the revision the first
//   copy created (what it does for a key it already owns).
// - release and the unsure-key delete (SettleUnsure): delete only if the key's mod revision is
//   still the claim's; the second copy finds the key gone (or a new claim's) and does nothing.
// - commit and delete of the committed snapshot name (FencedUpdate): the second copy compares
//   the base name, which the first replaced by a new, never reused name; its refusal shows that
//   new name committed under this replica's still current claim, which FencedUpdate takes as
//   success when an attempt went unanswered (as it already took its look-up after a lost
//   answer). A second copy of a delete whose first applied is refused the same way.
// - the handoff request's put (the same value and lease): the same key twice. Its delete: a
//   second copy may delete a request another replica put meanwhile, which then goes unanswered
//   for its handoff_wait and is retried by its client (a delete arriving late does the same with
//   one endpoint).
// - authentication (etcd_client.h): a second token; the last one is used.
// A copy that etcd applies only after its retry was answered (held past the request timeout
// inside a partitioned member) is the hazard a lost answer already had with one endpoint: a claim
// that creates the key after this replica released it leaves a key it does not count as its own
// until the lease ends (or the unsure-key look-up finds it, if that runs later).
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
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/cluster/etcd_client.h"
#include "state_store/session_ownership.h"

namespace sdm {

struct EtcdOwnershipOptions {
  // The etcd cluster and how to reach it: its members' client URLs (a request that one cannot
  // answer goes to the next: etcd_client.h; the class comment says why that is safe), the
  // per-endpoint request timeout, authentication and TLS.
  EtcdClientOptions client;
  std::string replica_id;  // this replica's name (the keys' value); must be unique
  // Every key of this deployment is under it: <key_prefix>sessions/<id> (the owner),
  // <key_prefix>snapshots/<id> (the committed snapshot), <key_prefix>handoff/<id> (requests).
  // Deployments sharing one etcd need prefixes of their own (else they share session ids and
  // take each other's sessions). Starts and ends with '/'.
  std::string key_prefix = "/sdmserve/";
  absl::Duration lease_ttl = absl::Seconds(10);  // ValidateEtcdLeaseTtl
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
};

// OK, or INVALID_ARGUMENT saying why `prefix` cannot be EtcdOwnershipOptions::key_prefix.
absl::Status ValidateEtcdKeyPrefix(const std::string& prefix);
// OK, or INVALID_ARGUMENT saying why `ttl` cannot be EtcdOwnershipOptions::lease_ttl: etcd
// grants whole seconds, and a lease of under 2 s leaves no time to renew it.
absl::Status ValidateEtcdLeaseTtl(absl::Duration ttl);

class EtcdOwnership : public SessionOwnership {
 public:
  // Grants the lease and starts the keepalive thread. INVALID_ARGUMENT for bad options (the
  // endpoints: ValidateEtcdClientOptions), UNAUTHENTICATED when etcd refuses the user or password,
  // UNAVAILABLE when no endpoint answers (a TLS certificate not accepted included).
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
  // The endpoints, comma-separated (for logs).
  std::string endpoints() const;
  // Successful authentications to etcd (Start's included; 0 without a user).
  int64_t authentications() const;

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
  // POSTs `body` to the gateway path; the JSON answer as text, or UNAVAILABLE. `unanswered`:
  // EtcdClient::Post's (whether an attempt may have been applied without an answer).
  absl::StatusOr<std::string> Post(const std::string& path, const std::string& body,
                                   bool* unanswered = nullptr) const;
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
  std::unique_ptr<EtcdClient> etcd_;  // set by Start(); thread-safe
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
