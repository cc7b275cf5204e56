// Per-tenant limits on sessions and session state, read from a JSON file:
//
//   {
//     "default": {"max_sessions": 100, "max_state_bytes": "64GiB", "max_requests": 16},
//     "tenants": {
//       "research": {"max_sessions": 1000, "max_state_bytes": null, "max_requests": 64},
//       "trial":    {"max_sessions": 2, "max_requests": 1}
//     }
//   }
//
// "default" applies to every tenant; an entry under "tenants" overrides some of its fields (a
// field left out keeps the default's value; null means unlimited). Every field and both sections
// are optional: without a file, or with "{}", a tenant's sessions are unlimited in number and
// hold at most kDefaultTenantMaxStateBytes of state ("max_state_bytes": null in "default" lifts
// it), and its requests in flight are unlimited. Counts are integers >= 0; byte
// sizes are integers >= 0 or strings of an integer and a unit (B, KB, MB, GB, TB powers of 1000;
// KiB, MiB, GiB, TiB powers of 1024). Unknown fields are rejected by name, so that a typo does not
// silently leave a tenant unlimited. Tenant names follow IsValidTenantName (server/auth.h).
//
// Enforcement is the service's: it checks what a tenant holds (the store's per-tenant counters,
// SessionStateStore::Usage()) with TenantLimits::Admit, and passes max_requests with each
// Generate to the scheduler, which counts the tenant's requests (GenerateJob::tenant_max_requests,
// server/scheduler.h); a tenant at a limit gets RESOURCE_EXHAUSTED.
//
// Thread-safety: immutable after creation; For() may run concurrently.
#ifndef SDMSERVE_SERVER_TENANT_LIMITS_H_
#define SDMSERVE_SERVER_TENANT_LIMITS_H_

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace sdm {

struct TenantLimits {
  // Sessions the tenant may hold at once; nullopt: unlimited.
  std::optional<int64_t> max_sessions;
  // Bytes of session state (Session.state_bytes summed over its sessions); nullopt: unlimited.
  std::optional<int64_t> max_state_bytes;
  // Generate requests (gRPC and HTTP, on sessions and one-shot) waiting for a place in the batch
  // or running at once; nullopt: unlimited; 0: none (PERMISSION_DENIED). Bounds what one tenant's
  // burst takes of the queue (SchedulerOptions::max_waiting is shared by every tenant).
  std::optional<int64_t> max_requests;

  // OK, or RESOURCE_EXHAUSTED naming `tenant`, what it holds and the limit, when one more
  // session (new_session) or any more state would pass these limits; PERMISSION_DENIED where
  // the limit is 0 (no retry can succeed). `sessions` and `state_bytes` are what the tenant
  // holds now.
  absl::Status Admit(absl::string_view tenant, int64_t sessions, int64_t state_bytes,
                     bool new_session) const;

  bool operator==(const TenantLimits&) const = default;
};

// Which limit refused a call (a refusal of TenantLimits::Admit, or the scheduler's of
// max_requests, carries it): "max_sessions", "max_state_bytes", "max_requests"; empty for any
// other status. The metrics count refusals by it.
std::string RefusingTenantLimit(const absl::Status& status);
// `refusal` marked as refused by the tenant limit named `limit` (for RefusingTenantLimit).
absl::Status RefusedByTenantLimit(absl::Status refusal, absl::string_view limit);

// The default's max_state_bytes when no file or no "default" entry sets it: 64 GiB of session
// state per tenant (a session's own history is bounded by ServiceOptions::max_session_tokens).
inline constexpr int64_t kDefaultTenantMaxStateBytes = int64_t{64} << 30;

class TenantLimitsConfig {
 public:
  // Every tenant: any number of sessions and requests, kDefaultTenantMaxStateBytes of state.
  TenantLimitsConfig()
      : default_{.max_sessions = std::nullopt,
                 .max_state_bytes = kDefaultTenantMaxStateBytes,
                 .max_requests = std::nullopt} {}

  // Errors (InvalidArgument, naming the field as in "tenants.trial.max_sessions"): malformed
  // JSON, unknown fields, negative or non-integer values, bad units, bad tenant names.
  static absl::StatusOr<TenantLimitsConfig> Parse(absl::string_view json_text);

  // Reads and parses a file; errors name it. NotFound when it does not exist.
  static absl::StatusOr<TenantLimitsConfig> FromFile(const std::filesystem::path& path);

  // The limits of `tenant`: its entry over the default.
  TenantLimits For(absl::string_view tenant) const;

  const TenantLimits& default_limits() const { return default_; }
  // The tenants with an entry of their own, sorted.
  std::vector<std::string> tenant_names() const;

 private:
  TenantLimits default_;
  std::map<std::string, TenantLimits, std::less<>> tenants_;
};

// "64GiB" -> 68719476736. Integers with an optional unit (see above); spaces between number and
// unit are allowed. InvalidArgument otherwise, or on overflow.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);
// The inverse for flag defaults: 4294967296 -> "4GiB", in the largest binary unit that divides
// `bytes` (plain bytes otherwise).
std::string FormatByteSize(int64_t bytes);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_TENANT_LIMITS_H_
