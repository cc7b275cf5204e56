#include "server/grpc_status.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "sdm/v1/sdm.grpc.pb.h"

namespace sdm {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

TEST(GrpcStatusTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_THAT(TrailingMetadataFor(absl::OkStatus()), IsEmpty());
}

TEST(GrpcStatusTest, EveryCodeKeepsItsCodeAndMessage) {
  const std::pair<absl::StatusCode, grpc::StatusCode> kCodes[] = {
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const auto& [absl_code, grpc_code] : kCodes) {
    const std::string message = "session 'chat-1': " + absl::StatusCodeToString(absl_code);
    const grpc::Status status = ToGrpcStatus(absl::Status(absl_code, message));
    EXPECT_EQ(status.error_code(), grpc_code) << message;
    EXPECT_EQ(status.error_message(), message);
  }
}

TEST(GrpcStatusTest, CodesOutsideTheCanonicalSetBecomeUnknown) {
  const grpc::Status status = ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(42), "odd"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(status.error_message(), "odd");
}

TEST(GrpcStatusTest, RetryAfterTravelsWithTheStatus) {
  const absl::Status full = absl::ResourceExhaustedError("queue full: 64 requests waiting");
  EXPECT_EQ(RetryAfter(full), std::nullopt);
  const absl::Status hinted = WithRetryAfter(full, absl::Milliseconds(1500));
  EXPECT_EQ(hinted.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(hinted.message(), full.message());
  EXPECT_EQ(RetryAfter(hinted), absl::Milliseconds(1500));
  // Rounded up to a millisecond; negative is 0; a second hint replaces the first.
  EXPECT_EQ(RetryAfter(WithRetryAfter(full, absl::Microseconds(1))), absl::Milliseconds(1));
  EXPECT_EQ(RetryAfter(WithRetryAfter(full, absl::Seconds(-3))), absl::ZeroDuration());
  EXPECT_EQ(RetryAfter(WithRetryAfter(hinted, absl::Milliseconds(7))), absl::Milliseconds(7));
  // OK stays OK, without a hint.
  EXPECT_TRUE(WithRetryAfter(absl::OkStatus(), absl::Seconds(1)).ok());
  EXPECT_EQ(RetryAfter(WithRetryAfter(absl::OkStatus(), absl::Seconds(1))), std::nullopt);

  EXPECT_THAT(TrailingMetadataFor(hinted), ElementsAre(Pair("grpc-retry-pushback-ms", "1500")));
  EXPECT_THAT(TrailingMetadataFor(full), IsEmpty());
  EXPECT_EQ(ToGrpcStatus(hinted).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

// A service whose GetSession fails with whatever status the test sets, through ToGrpcStatus.
class FailingService final : public v1::SdmService::Service {
 public:
  explicit FailingService(absl::Status status) : status_(std::move(status)) {}
  grpc::Status GetSession(grpc::ServerContext* context, const v1::GetSessionRequest*,
                          v1::Session*) override {
    return ToGrpcStatus(status_, *context);
  }

 private:
  const absl::Status status_;
};

struct CallResult {
  grpc::Status status;
  std::multimap<std::string, std::string> trailers;
};

CallResult CallGetSession(const absl::Status& server_status) {
  FailingService service(server_status);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  EXPECT_NE(server, nullptr);
  EXPECT_GT(port, 0);
  auto stub = v1::SdmService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::GetSessionRequest request;
  request.set_session_id("chat-1");
  v1::Session response;
  CallResult result;
  result.status = stub->GetSession(&context, request, &response);
  for (const auto& [key, value] : context.GetServerTrailingMetadata()) {
    result.trailers.emplace(std::string(key.data(), key.size()),
                            std::string(value.data(), value.size()));
  }
  server->Shutdown();
  return result;
}

TEST(GrpcStatusTest, ClientSeesCodeMessageAndRetryPushback) {
  const CallResult result = CallGetSession(WithRetryAfter(
      absl::ResourceExhaustedError("tenant 'trial' holds 2 of 2 sessions"), absl::Seconds(2)));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(result.status.error_message(), "tenant 'trial' holds 2 of 2 sessions");
  EXPECT_THAT(result.trailers, ElementsAre(Pair("grpc-retry-pushback-ms", "2000")));
}

// UNAVAILABLE carries a hint even without one of its own (a CreateSession refused while writes
// fail, a draining server), over gRPC as over HTTP (server/http/http_status.cc: Retry-After).
TEST(GrpcStatusTest, UnavailableCarriesAPushbackOfItsOwn) {
  const absl::Status draining = absl::UnavailableError("the server is shutting down");
  EXPECT_EQ(RetryHint(draining), kUnavailableRetryAfter);
  EXPECT_EQ(RetryHint(WithRetryAfter(draining, absl::Seconds(5))), absl::Seconds(5));
  EXPECT_EQ(RetryHint(absl::NotFoundError("x")), std::nullopt);
  const CallResult result = CallGetSession(draining);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.trailers,
              ElementsAre(Pair("grpc-retry-pushback-ms",
                               absl::StrCat(absl::ToInt64Milliseconds(kUnavailableRetryAfter)))));
}

TEST(GrpcStatusTest, ClientSeesNoPushbackWithoutAHint) {
  const CallResult result = CallGetSession(absl::NotFoundError("no session 'chat-1'"));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(result.status.error_message(), "no session 'chat-1'");
  EXPECT_EQ(result.trailers.count("grpc-retry-pushback-ms"), 0u);
}

}  // namespace
}  // namespace sdm
