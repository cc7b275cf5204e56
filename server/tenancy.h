// Sessions of many tenants in one SessionStateStore: how a (tenant, session id) pair becomes the
// store's key, what the service keeps in the store's per-session metadata string, and the
// validation of what callers send (ids, labels, ttl, page tokens).
//
// Store keys. Users name sessions with ids of 1-128 characters of [A-Za-z0-9._-], unique within
// their tenant; tenants are 1-64 characters of the same alphabet (server/auth.h). The store's
// keys have the same alphabet and length limit, so the pair needs an encoding that is injective
// (no two pairs share a key) and fits in 128 characters:
//
//   readable: "<n>-<tenant>-<id>", n = the tenant's length in decimal, when it fits in 128
//             characters. It starts with a digit, and the length prefix makes it unambiguous:
//             the tenant is the n characters after the first '-', the id what follows the next.
//   hashed:   "h-" + 64 lowercase hex digits of SHA-256(the readable form), otherwise. It starts
//             with 'h', so it never equals a readable key; two hashed keys are equal only if
//             SHA-256 collides. The metadata (below) names the owner regardless, and every lookup
//             checks it, so even a collision could not hand a session to another tenant.
//
// The key is also the snapshot's file name on disk (docs/state-format.md).
//
// Metadata: a JSON object {"v": 1, "tenant": ..., "id": ..., "labels": {...}, "create_ms": ...}
// (create time in Unix milliseconds). The store persists it with the session's snapshot.
//
// Thread-safety: all functions are pure.
#ifndef SDMSERVE_SERVER_TENANCY_H_
#define SDMSERVE_SERVER_TENANCY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace sdm {

// Limits on what callers send (docs/api.md).
inline constexpr size_t kMaxSessionIdLength = 128;
inline constexpr size_t kMaxLabels = 64;
inline constexpr size_t kMaxLabelKeyLength = 63;
inline constexpr size_t kMaxLabelValueBytes = 256;

using Labels = std::map<std::string, std::string>;

// The store key of `tenant`'s session `session_id` (both assumed valid), as described above.
std::string SessionStoreKey(absl::string_view tenant, absl::string_view session_id);

// OK, or InvalidArgument naming `field` and saying what is allowed.
absl::Status ValidateSessionId(absl::string_view id, absl::string_view field = "session_id");
// At most kMaxLabels; keys 1-63 characters of [a-z0-9_.-] starting with a letter; values at most
// 256 bytes.
absl::Status ValidateLabels(const Labels& labels, absl::string_view field = "labels");

// What the service keeps about a session beside its state.
struct SessionMetadata {
  std::string tenant;
  std::string id;  // as the user named it
  Labels labels;
  absl::Time create_time;

  bool operator==(const SessionMetadata&) const = default;
};

std::string EncodeSessionMetadata(const SessionMetadata& metadata);
// InvalidArgument if `text` is not metadata this module wrote.
absl::StatusOr<SessionMetadata> DecodeSessionMetadata(absl::string_view text);

// ListSessions paging. A token holds the last id of the previous page and a digest of the label
// selector it was made with; it is opaque to clients (web-safe base64).
std::string EncodePageToken(absl::string_view last_id, const Labels& selector);
// The last id of the previous page. InvalidArgument for a token this module did not write, or
// one made with another selector.
absl::StatusOr<std::string> DecodePageToken(absl::string_view token, const Labels& selector);

// A new random session id ("s-" + 24 hex digits) for a request that left the id empty.
std::string NewSessionId();

}  // namespace sdm

#endif  // SDMSERVE_SERVER_TENANCY_H_
