// The one place that turns an absl::Status into an HTTP response of the OpenAI-compatible API
// (server/http/openai_server.h): its HTTP status, OpenAI's error body and a Retry-After hint.
//
//   INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION  400 invalid_request_error
//   UNAUTHENTICATED                                      401 authentication_error
//   PERMISSION_DENIED                                    403 permission_error
//   NOT_FOUND                                            404 not_found_error
//   ABORTED, ALREADY_EXISTS                              409 conflict_error
//   RESOURCE_EXHAUSTED                                   429 rate_limit_error (+ Retry-After)
//   CANCELLED                                            499 (the client went away)
//   UNAVAILABLE                                          503 service_unavailable (+ Retry-After)
//   DEADLINE_EXCEEDED                                    504 timeout_error
//   everything else (DATA_LOSS, INTERNAL, ...)           500 server_error
// Errors the HTTP server decides before any status exists (413 for a body over the size limit,
// 404 for no such endpoint, 405 for a method its path does not take, 414 for a URI too long, 400
// for a request it cannot read) use the same body through ErrorBody(); their type is
// invalid_request_error for any 4xx without one of its own above, server_error for a 5xx.
//
// Body: {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}, where code is the
// status code's name in lower case ("not_found", "invalid_argument", ...) unless given, but
// OpenAI's where clients look for it (UNAUTHENTICATED: "invalid_api_key"; RESOURCE_EXHAUSTED:
// "rate_limit_exceeded"), and param null unless given.
#ifndef SDMSERVE_SERVER_HTTP_HTTP_STATUS_H_
#define SDMSERVE_SERVER_HTTP_HTTP_STATUS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace sdm {

struct HttpError {
  int status = 500;
  std::string body;  // OpenAI's error JSON
  // Whole seconds for the Retry-After header (rounded up), when the status carries a hint.
  std::optional<int64_t> retry_after_seconds;
};

// `status` must not be OK. `code` overrides the body's code (e.g. "model_not_found"); `param`
// names the request field at fault (empty: null).
HttpError ToHttpError(const absl::Status& status, absl::string_view code = "",
                      absl::string_view param = "");

// OpenAI's error JSON for one HTTP status and message (for errors raised before a Status); an
// empty `code` or `param` is null, as OpenAI's API sends where it has none.
std::string ErrorBody(int http_status, absl::string_view message, absl::string_view code,
                      absl::string_view param = "");

}  // namespace sdm

#endif  // SDMSERVE_SERVER_HTTP_HTTP_STATUS_H_
