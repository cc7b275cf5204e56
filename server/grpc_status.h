// The one place where an absl::Status becomes a grpc::Status.
//
// Everything below the gRPC edge reports errors as absl::Status, whose canonical codes are the
// gRPC codes: the mapping keeps the code and the message (which must already be something a
// user can act on) and adds nothing else.
//
// A retry hint travels with the absl::Status as a payload (WithRetryAfter). When the status
// reaches a call, ToGrpcStatus(status, context) sends it to the client as the trailing metadata
// "grpc-retry-pushback-ms" (milliseconds, decimal), which gRPC clients with a retry policy honour
// and other clients can read. The service attaches it to RESOURCE_EXHAUSTED (queue full, tenant
// limit), rejected before any response is sent so that the request is safe to retry; every
// UNAVAILABLE without a hint of its own carries kUnavailableRetryAfter (RetryHint).
//
// Thread-safety: all functions are pure, except that ToGrpcStatus(status, context) writes the
// context's trailing metadata (which the call's owner does from one thread).
#ifndef SDMSERVE_SERVER_GRPC_STATUS_H_
#define SDMSERVE_SERVER_GRPC_STATUS_H_

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace sdm {

// The trailing metadata key of the retry hint (gRPC's retry design, proposal A6).
inline constexpr char kRetryPushbackKey[] = "grpc-retry-pushback-ms";

// `status` with a hint that the caller may retry after `delay` (rounded up to a millisecond;
// negative delays count as 0). Replaces an earlier hint. An OK status is returned unchanged.
absl::Status WithRetryAfter(absl::Status status, absl::Duration delay);

// The hint WithRetryAfter attached, if any (whole milliseconds).
std::optional<absl::Duration> RetryAfter(const absl::Status& status);

// The hint a client is sent, over gRPC (grpc-retry-pushback-ms) and HTTP (Retry-After) alike: the
// attached one, else kUnavailableRetryAfter for UNAVAILABLE (the server is draining, or cannot
// take the request now: try again soon, or another replica), else none.
inline constexpr absl::Duration kUnavailableRetryAfter = absl::Seconds(1);
std::optional<absl::Duration> RetryHint(const absl::Status& status);

// The status a call ends with: the same code and message. Codes outside the canonical set
// become UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The same, and the retry hint (if any) added to `context`'s trailing metadata. Call it once,
// when the call finishes.
grpc::Status ToGrpcStatus(const absl::Status& status, grpc::ServerContextBase& context);

// The trailing metadata ToGrpcStatus(status, context) adds: empty, or {kRetryPushbackKey, ms}.
std::vector<std::pair<std::string, std::string>> TrailingMetadataFor(const absl::Status& status);

}  // namespace sdm

#endif  // SDMSERVE_SERVER_GRPC_STATUS_H_
