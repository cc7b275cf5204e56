#include "server/grpc_status.h"

#include <cstdint>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace sdm {
namespace {

// The payload type of the retry hint: milliseconds as a decimal string.
constexpr char kRetryAfterPayloadUrl[] = "sdmserve/retry-after-ms";

grpc::StatusCode ToGrpcCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return grpc::StatusCode::OK;
    case absl::StatusCode::kCancelled:
      return grpc::StatusCode::CANCELLED;
    case absl::StatusCode::kUnknown:
      return grpc::StatusCode::UNKNOWN;
    case absl::StatusCode::kInvalidArgument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case absl::StatusCode::kDeadlineExceeded:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case absl::StatusCode::kNotFound:
      return grpc::StatusCode::NOT_FOUND;
    case absl::StatusCode::kAlreadyExists:
      return grpc::StatusCode::ALREADY_EXISTS;
    case absl::StatusCode::kPermissionDenied:
      return grpc::StatusCode::PERMISSION_DENIED;
    case absl::StatusCode::kResourceExhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case absl::StatusCode::kFailedPrecondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case absl::StatusCode::kAborted:
      return grpc::StatusCode::ABORTED;
    case absl::StatusCode::kOutOfRange:
      return grpc::StatusCode::OUT_OF_RANGE;
    case absl::StatusCode::kUnimplemented:
      return grpc::StatusCode::UNIMPLEMENTED;
    case absl::StatusCode::kInternal:
      return grpc::StatusCode::INTERNAL;
    case absl::StatusCode::kUnavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case absl::StatusCode::kDataLoss:
      return grpc::StatusCode::DATA_LOSS;
    case absl::StatusCode::kUnauthenticated:
      return grpc::StatusCode::UNAUTHENTICATED;
    default:
      return grpc::StatusCode::UNKNOWN;
  }
}

}  // namespace

absl::Status WithRetryAfter(absl::Status status, absl::Duration delay) {
  if (status.ok()) return status;
  int64_t ms = 0;
  if (delay > absl::ZeroDuration()) {
    ms = absl::ToInt64Milliseconds(absl::Ceil(delay, absl::Milliseconds(1)));
  }
  status.SetPayload(kRetryAfterPayloadUrl, absl::Cord(absl::StrCat(ms)));
  return status;
}

std::optional<absl::Duration> RetryAfter(const absl::Status& status) {
  // absl::optional: not std::optional in the Abseil of Debian 12.
  const auto payload = status.GetPayload(kRetryAfterPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  int64_t ms = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &ms) || ms < 0) return std::nullopt;
  return absl::Milliseconds(ms);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(ToGrpcCode(status.code()), std::string(status.message()));
}

grpc::Status ToGrpcStatus(const absl::Status& status, grpc::ServerContextBase& context) {
  for (const auto& [key, value] : TrailingMetadataFor(status)) {
    context.AddTrailingMetadata(key, value);
  }
  return ToGrpcStatus(status);
}

std::optional<absl::Duration> RetryHint(const absl::Status& status) {
  if (std::optional<absl::Duration> attached = RetryAfter(status)) return attached;
  if (absl::IsUnavailable(status)) return kUnavailableRetryAfter;
  return std::nullopt;
}

std::vector<std::pair<std::string, std::string>> TrailingMetadataFor(const absl::Status& status) {
  std::vector<std::pair<std::string, std::string>> metadata;
  if (status.ok()) return metadata;
  const std::optional<absl::Duration> delay = RetryHint(status);
  if (delay.has_value()) {
    metadata.emplace_back(kRetryPushbackKey, absl::StrCat(absl::ToInt64Milliseconds(*delay)));
  }
  return metadata;
}

}  // namespace sdm
