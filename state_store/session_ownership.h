// SessionOwnership: who may load and write a session when several stores (replicas, in other
// processes) share one snapshot directory (SessionStoreOptions::shared_dir, docs/replicas.md).
//
// The store asks it before it takes a session up (Create, Fork's new session, Acquire) and
// immediately before each snapshot write of a session (the fence: a store that lost a session,
// say because it was paused past its lease, must not overwrite the newer state its new owner
// wrote), and tells it when it gives a session up (Delete, Park to disk). The store never calls
// it with its own lock held, so an implementation may block on the network (an etcd client: a
// key per session bound to the replica's lease, its mod revision checked in a transaction before
// each write). The state store knows only this interface.
//
// Fenced snapshots (optional: FencesSnapshots() true; EtcdOwnership). CheckWrite followed by a
// file write is check-then-write: a store paused between the two writes after it lost the
// session. With fenced snapshots the store never overwrites a snapshot: it writes each one under
// a new unique name and the session's state becomes that file only when CommitSnapshot records
// the name, in one atomic step that also checks this store's ownership and the name its copy was
// read from. Readers read only the committed name. A stale store's file is then never committed,
// whenever it is written: it cannot replace a newer state (docs/replicas.md, "Fencing").
//
// Thread-safety: implementations must be thread-safe.
#ifndef SDMSERVE_STATE_STORE_SESSION_OWNERSHIP_H_
#define SDMSERVE_STATE_STORE_SESSION_OWNERSHIP_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "state_store/session_key.h"

namespace sdm {

class SessionOwnership {
 public:
  virtual ~SessionOwnership() = default;
  // OK once this store owns `key` (at once if it already does). UNAVAILABLE (retryable) while
  // another store owns it; the store then refuses the call with this status.
  virtual absl::Status Claim(const SessionKey& key) = 0;
  // Immediately before a snapshot write of `key`: OK while this store still owns it; otherwise
  // an error naming why (lease lost, owned by another), and the write is refused.
  virtual absl::Status CheckWrite(const SessionKey& key) = 0;
  // This store gives `key` up (it may or may not own it).
  virtual void Release(const SessionKey& key) = 0;

  // ---- Fenced snapshots (see the class comment); the defaults: none. ----
  virtual bool FencesSnapshots() const { return false; }
  // Network: the file name of `key`'s committed snapshot now ("" when none), remembered for
  // Committed(). Claim remembers it too. UNAVAILABLE when it cannot be asked.
  virtual absl::StatusOr<std::string> Observe(const SessionKey& key) {
    return absl::UnimplementedError("no fenced snapshots");
  }
  // No network (callable with the store's lock held): the name the last Claim, Observe,
  // CommitSnapshot or DeleteCommitted of `key` saw ("" when none); nullopt: never looked at.
  virtual std::optional<std::string> Committed(const SessionKey& key) const { return std::nullopt; }
  // No network: the claim under which this store holds `key` now (etcd: the mod revision of its
  // ownership key), 0 when it holds none. Claims are never reused: a value once replaced never
  // becomes current again.
  virtual int64_t ClaimEpoch(const SessionKey& key) const { return 0; }
  // Network: OK when `claim` (a ClaimEpoch) is still `key`'s current claim; FAILED_PRECONDITION
  // when it is not, UNAVAILABLE when it cannot be asked. A check only: true when answered.
  virtual absl::Status VerifyClaim(const SessionKey& key, int64_t claim) {
    return absl::UnimplementedError("no fenced snapshots");
  }
  // Atomically: if `claim` (the ClaimEpoch under which `file` was written, captured before it
  // was written) is still `key`'s current claim and `key`'s committed snapshot is still `base`
  // ("" none), records `file` as the committed one. So a file can become the state only while
  // the claim it was written under lasts: once that claim is gone, nothing can commit the file
  // and it is garbage (the store's sweep of orphan files relies on this). FAILED_PRECONDITION
  // when either comparison fails (fenced: `file` never becomes the state); UNAVAILABLE when the
  // answer is unknown (unreachable; the commit may or may not have happened).
  virtual absl::Status CommitSnapshot(const SessionKey& key, int64_t claim, const std::string& base,
                                      const std::string& file) {
    return absl::UnimplementedError("no fenced snapshots");
  }
  // The same comparisons; removes `key`'s committed snapshot (the session is deleted).
  virtual absl::Status DeleteCommitted(const SessionKey& key, const std::string& base) {
    return absl::UnimplementedError("no fenced snapshots");
  }
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_OWNERSHIP_H_
