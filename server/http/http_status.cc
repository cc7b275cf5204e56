#include "server/http/http_status.h"

#include <cmath>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "server/grpc_status.h"

namespace sdm {
namespace {

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

absl::string_view TypeOf(int http_status) {
  switch (http_status) {
    case 400:
      return "invalid_request_error";
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 409:
      return "conflict_error";
    case 429:
      return "rate_limit_error";
    case 499:
      return "cancelled";
    case 503:
      return "service_unavailable";
    case 504:
      return "timeout_error";
    default:
      // Another 4xx (405, 414, ...: the HTTP server's own) is the request's fault all the same.
      return http_status >= 400 && http_status < 500 ? "invalid_request_error" : "server_error";
  }
}

}  // namespace

std::string ErrorBody(int http_status, absl::string_view message, absl::string_view code,
                      absl::string_view param) {
  nlohmann::json error = {
      {"message", std::string(message)},
      {"type", std::string(TypeOf(http_status))},
      {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(std::string(param))},
      {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(std::string(code))}};
  return nlohmann::json{{"error", std::move(error)}}.dump(-1, ' ', false,
                                                          nlohmann::json::error_handler_t::replace);
}

HttpError ToHttpError(const absl::Status& status, absl::string_view code, absl::string_view param) {
  HttpError out;
  out.status = HttpStatusOf(status.code());
  std::string code_name(code);
  if (code_name.empty()) {
    // OpenAI's codes where clients look for them; elsewhere the gRPC code's name.
    switch (status.code()) {
      case absl::StatusCode::kUnauthenticated:
        code_name = "invalid_api_key";
        break;
      case absl::StatusCode::kResourceExhausted:
        code_name = "rate_limit_exceeded";
        break;
      default:
        code_name = absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
    }
  }
  out.body = ErrorBody(out.status, status.message(), code_name, param);
  if (const std::optional<absl::Duration> retry = RetryHint(status)) {  // as gRPC sends it
    out.retry_after_seconds = static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(*retry)));
  }
  return out;
}

}  // namespace sdm
