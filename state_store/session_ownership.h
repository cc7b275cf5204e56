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
// Thread-safety: implementations must be thread-safe.
#ifndef SDMSERVE_STATE_STORE_SESSION_OWNERSHIP_H_
#define SDMSERVE_STATE_STORE_SESSION_OWNERSHIP_H_

#include "absl/status/status.h"
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
};

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_OWNERSHIP_H_
