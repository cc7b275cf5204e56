// SessionKey: how the state store names a session, a (tenant, id) pair.
//
// Users name sessions with ids unique within their tenant. The store keeps the two apart, so no
// pair of different keys can ever meet, whatever the characters (no encoding of a pair into one
// string is needed to look a session up). Tenants are 0-64 characters and ids 1-128 characters
// of [A-Za-z0-9._-]; the empty tenant is the one of single-tenant users (tools, tests), whose
// sessions are named by their id alone.
//
// On disk a session's snapshot is `<FileStem(key)>.sdmstate` (docs/state-format.md). The stem is
// the key's record id (below) when it fits in 128 characters, else "h-" + 64 lowercase hex digits
// of SHA-256(record id). The record id is
//
//   "<id>"                  for the empty tenant, unless the id itself looks like one of the
//                           other forms (it starts with digits and a '-', or with "h-");
//   "<n>-<tenant>-<id>"     otherwise, n = the tenant's length in decimal (0 for the empty tenant).
//
// The length prefix makes it unambiguous (the tenant is the n characters after the first '-',
// the id what follows the next), so distinct keys have distinct record ids, and distinct file
// stems unless SHA-256 collides (the snapshot's record names its key, and the store checks it).
// These are the names the server wrote before keys were typed ("<n>-<tenant>-<id>" or hashed),
// so snapshots written then still resume.
//
// Thread-safety: values; all functions are pure.
#ifndef SDMSERVE_STATE_STORE_SESSION_KEY_H_
#define SDMSERVE_STATE_STORE_SESSION_KEY_H_

#include <compare>
#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sdm {

inline constexpr size_t kMaxTenantLength = 64;
inline constexpr size_t kMaxSessionIdLength = 128;

struct SessionKey {
  std::string tenant;
  std::string id;

  SessionKey() = default;
  SessionKey(absl::string_view tenant_name, absl::string_view session_id)
      : tenant(tenant_name), id(session_id) {}
  // A session of the empty tenant, named by its id alone (implicit: single-tenant callers pass
  // ids where keys are expected).
  SessionKey(const char* session_id) : id(session_id) {}         // NOLINT(runtime/explicit)
  SessionKey(const std::string& session_id) : id(session_id) {}  // NOLINT(runtime/explicit)
  SessionKey(absl::string_view session_id) : id(session_id) {}   // NOLINT(runtime/explicit)

  // Ordered by tenant, then id: a tenant's sessions are one range, in id order.
  friend bool operator==(const SessionKey&, const SessionKey&) = default;
  friend std::strong_ordering operator<=>(const SessionKey&, const SessionKey&) = default;

  template <typename H>
  friend H AbslHashValue(H h, const SessionKey& key) {
    return H::combine(std::move(h), key.tenant, key.id);
  }
};

// For messages meant for operators: "id" or "tenant/id". Users are shown key.id only.
std::string DebugString(const SessionKey& key);

// OK, or InvalidArgument saying what is allowed.
absl::Status ValidateSessionKey(const SessionKey& key);

// The forms described above. Precondition: the key is valid.
std::string SessionRecordId(const SessionKey& key);
std::string SessionFileStem(const SessionKey& key);

// The key whose record id is `record_id`; InvalidArgument unless it is a valid key's record id
// in its canonical form (SessionRecordId(result) == record_id).
absl::StatusOr<SessionKey> ParseSessionRecordId(absl::string_view record_id);

// Whether `stem` is a hashed file stem ("h-" and 64 lowercase hex digits).
bool IsHashedFileStem(absl::string_view stem);

}  // namespace sdm

#endif  // SDMSERVE_STATE_STORE_SESSION_KEY_H_
