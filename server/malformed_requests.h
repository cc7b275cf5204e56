// Requests gRPC cannot parse: a message that is not valid protobuf, or a `string` field that is
// not valid UTF-8 (proto3 requires it). gRPC refuses them before any handler runs, with
// UNIMPLEMENTED and an empty message, so the service never sees them. This server interceptor
// turns that answer into INVALID_ARGUMENT with a message saying what was wrong, and reports the
// call (its method, e.g. "GetSession", and the code) to `on_refused`, which the server counts in
// sdm_requests_total like every other call.
//
// It acts only on unary and server-streaming calls (all of sdm.v1.SdmService's) whose request
// failed to parse (the received message is null at POST_RECV_MESSAGE), and leaves every other
// call untouched.
//
// Thread-safety: the factory may be used from any thread; each interceptor belongs to one call.
#ifndef SDMSERVE_SERVER_MALFORMED_REQUESTS_H_
#define SDMSERVE_SERVER_MALFORMED_REQUESTS_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/server_interceptor.h"

namespace sdm {

class MalformedRequestInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  using OnRefused = std::function<void(absl::string_view method, absl::StatusCode code)>;

  explicit MalformedRequestInterceptorFactory(OnRefused on_refused)
      : on_refused_(std::move(on_refused)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  const OnRefused on_refused_;
};

// The message the refused call ends with.
inline constexpr char kMalformedRequestMessage[] =
    "the request could not be parsed: it is not a valid protobuf message of this method, or a "
    "string field (text, session_id, ...) is not valid UTF-8; send text as UTF-8 or the prompt "
    "as token_ids";

}  // namespace sdm

#endif  // SDMSERVE_SERVER_MALFORMED_REQUESTS_H_
