#include "server/malformed_requests.h"

#include <string>

namespace sdm {
namespace {

using grpc::experimental::InterceptionHookPoints;

class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  MalformedRequestInterceptor(absl::string_view method,
                              const MalformedRequestInterceptorFactory::OnRefused& on_refused)
      : method_(method), on_refused_(on_refused) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = true;
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(
          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, kMalformedRequestMessage));
      on_refused_(method_, absl::StatusCode::kInvalidArgument);
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  const MalformedRequestInterceptorFactory::OnRefused& on_refused_;
  bool unparsed_ = false;
};

}  // namespace

grpc::experimental::Interceptor* MalformedRequestInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  // Only a unary or server-streaming call's one request is parsed before its handler runs; in a
  // client stream, a null message at POST_RECV_MESSAGE is the stream's end.
  using Type = grpc::experimental::ServerRpcInfo::Type;
  if (info->type() != Type::UNARY && info->type() != Type::SERVER_STREAMING) return nullptr;
  // "/sdm.v1.SdmService/GetSession" -> "GetSession", the method label of sdm_requests_total.
  absl::string_view method = info->method() != nullptr ? info->method() : "";
  if (const size_t slash = method.rfind('/'); slash != absl::string_view::npos) {
    method.remove_prefix(slash + 1);
  }
  return new MalformedRequestInterceptor(method, on_refused_);  // gRPC owns it
}

}  // namespace sdm
