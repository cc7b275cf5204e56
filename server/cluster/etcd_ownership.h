// EtcdOwnership: SessionOwnership (state_store/session_ownership.h) kept in etcd, spoken through
// etcd v3's JSON gateway (/v3/lease/grant, /v3/lease/keepalive, /v3/lease/revoke, /v3/kv/txn)
// with cpp-httplib; no etcd client library. docs/replicas.md.
//
// The replica holds one lease (granted at Start(), TTL `lease_ttl`, renewed by a keepalive
// thread every TTL/3, revoked at destruction: a drained replica releases everything at once; a
// crashed one when its lease expires). It owns a session while the key
// `<prefix><SessionRecordId>` exists with its replica id as value and its lease: Claim creates
// the key in a transaction (create revision 0) or finds it already its own, and remembers the
// key's mod revision. CheckWrite compares that mod revision in a transaction: a replica that
// lost the lease (paused, partitioned: the key expired) or whose key was taken over has another
// (or no) revision there, so its write is refused. Release deletes the key if it is still its.
//
// Limits: the check and the file write are two steps (a lease that expires between them is not
// caught); the files themselves carry no fencing token. Claim answers UNAVAILABLE while another
// replica owns the session: nothing asks the owner to hand it over (docs/replicas.md).
//
// Thread-safety: thread-safe.
#ifndef SDMSERVE_SERVER_CLUSTER_ETCD_OWNERSHIP_H_
#define SDMSERVE_SERVER_CLUSTER_ETCD_OWNERSHIP_H_

#include <cstdint>
#include <map>
#include <memory>
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
  std::string prefix = "/sdmserve/sessions/";
  absl::Duration lease_ttl = absl::Seconds(10);
  absl::Duration request_timeout = absl::Seconds(2);
};

class EtcdOwnership : public SessionOwnership {
 public:
  // Grants the lease and starts the keepalive thread; UNAVAILABLE when etcd cannot be reached.
  static absl::StatusOr<std::unique_ptr<EtcdOwnership>> Start(const EtcdOwnershipOptions& options);
  ~EtcdOwnership() override;  // stops the keepalive and revokes the lease
  EtcdOwnership(const EtcdOwnership&) = delete;
  EtcdOwnership& operator=(const EtcdOwnership&) = delete;

  absl::Status Claim(const SessionKey& key) override;
  absl::Status CheckWrite(const SessionKey& key) override;
  void Release(const SessionKey& key) override;

  int64_t lease_id() const;

 private:
  struct PassKey {};

 public:
  EtcdOwnership(PassKey, const EtcdOwnershipOptions& options);

 private:
  // POSTs `body` to the gateway path; the parsed JSON answer as text, or UNAVAILABLE.
  absl::StatusOr<std::string> Post(const std::string& path, const std::string& body) const;
  absl::Status Grant() ABSL_LOCKS_EXCLUDED(mu_);
  void KeepAliveLoop();
  std::string KeyOf(const SessionKey& key) const;

  const EtcdOwnershipOptions options_;
  mutable absl::Mutex mu_;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  // Sessions this replica claimed, by etcd key: the mod revision of its ownership key.
  std::map<std::string, int64_t> owned_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keepalive_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_CLUSTER_ETCD_OWNERSHIP_H_
