// Sessions of many tenants in one SessionStateStore: what the service keeps in the store's
// per-session metadata string, and the validation of what callers send (ids, labels, ttl, page
// tokens). The store names each session by SessionKey{tenant, id} (state_store/session_key.h),
// which also gives its snapshot's file name.
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
#include "state_store/session_key.h"

namespace sdm {

// Limits on what callers send (docs/api.md); session ids: kMaxSessionIdLength.
inline constexpr size_t kMaxLabels = 64;
inline constexpr size_t kMaxLabelKeyLength = 63;
inline constexpr size_t kMaxLabelValueBytes = 256;

using Labels = std::map<std::string, std::string>;

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
  absl::Time create_time;  // kept to the millisecond (SessionCreateTimeNow)

  bool operator==(const SessionMetadata&) const = default;
};

// Now, at the precision the metadata keeps create_time in (whole milliseconds), so that
// CreateSession answers the create_time every later GetSession answers.
absl::Time SessionCreateTimeNow();

std::string EncodeSessionMetadata(const SessionMetadata& metadata);
// InvalidArgument if `text` is not metadata this module wrote.
absl::StatusOr<SessionMetadata> DecodeSessionMetadata(absl::string_view text);
// The key the metadata names (SessionStoreOptions::legacy_key: snapshots written before keys
// were typed); nullopt if it is not metadata this module wrote.
std::optional<SessionKey> SessionKeyOfMetadata(absl::string_view text);

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
