// The generated API (proto/sdm/v1/sdm.proto) has the shape docs/api.md describes.
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "sdm/v1/sdm.grpc.pb.h"
#include "sdm/v1/sdm.pb.h"

namespace sdm {
namespace {

using ::google::protobuf::Descriptor;
using ::google::protobuf::FieldDescriptor;
using ::google::protobuf::MethodDescriptor;
using ::google::protobuf::ServiceDescriptor;

TEST(ProtoTest, ServiceMethods) {
  const ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName("sdm.v1.SdmService");
  ASSERT_NE(service, nullptr);
  std::set<std::string> methods;
  for (int i = 0; i < service->method_count(); ++i) {
    const MethodDescriptor* method = service->method(i);
    methods.insert(method->name());
    EXPECT_FALSE(method->client_streaming()) << method->name();
    EXPECT_EQ(method->server_streaming(), method->name() == "Generate") << method->name();
  }
  EXPECT_EQ(methods, (std::set<std::string>{"Generate", "CreateSession", "GetSession",
                                            "ListSessions", "DeleteSession", "ForkSession",
                                            "Tokenize", "Detokenize", "GetModelInfo"}));
}

TEST(ProtoTest, OptionalFieldsHavePresence) {
  v1::GenerateRequest request;
  EXPECT_FALSE(request.has_add_bos());
  EXPECT_FALSE(request.has_sampling());
  EXPECT_EQ(request.prompt_case(), v1::GenerateRequest::PROMPT_NOT_SET);
  request.set_add_bos(false);
  EXPECT_TRUE(request.has_add_bos());

  v1::SamplingParams sampling;
  EXPECT_FALSE(sampling.has_max_tokens());
  EXPECT_FALSE(sampling.has_top_p());
  sampling.set_top_p(0.9);
  EXPECT_TRUE(sampling.has_top_p());
}

TEST(ProtoTest, PromptIsTextOrTokenIds) {
  v1::GenerateRequest request;
  request.set_text("Hello");
  EXPECT_EQ(request.prompt_case(), v1::GenerateRequest::kText);
  request.mutable_token_ids()->add_ids(72);
  EXPECT_EQ(request.prompt_case(), v1::GenerateRequest::kTokenIds);
  EXPECT_FALSE(request.has_text());
}

TEST(ProtoTest, FinalChunkRoundTrips) {
  v1::GenerateResponse chunk;
  chunk.add_token_ids(257);
  chunk.set_text("");
  chunk.set_finish_reason(v1::FINISH_REASON_EOS);
  chunk.mutable_usage()->set_prompt_tokens(6);
  chunk.mutable_usage()->set_history_tokens(4096);
  chunk.mutable_usage()->set_generated_tokens(12);
  v1::GenerateResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(chunk.SerializeAsString()));
  EXPECT_EQ(parsed.finish_reason(), v1::FINISH_REASON_EOS);
  EXPECT_EQ(parsed.usage().history_tokens(), 4096);
  EXPECT_THAT(parsed.token_ids(), ::testing::ElementsAre(257));
}

TEST(ProtoTest, EnumsStartUnspecified) {
  EXPECT_EQ(v1::FinishReason_Name(v1::FinishReason(0)), "FINISH_REASON_UNSPECIFIED");
  EXPECT_EQ(v1::Tier_Name(v1::Tier(0)), "TIER_UNSPECIFIED");
  EXPECT_EQ(v1::LayerType_Name(v1::LayerType(0)), "LAYER_TYPE_UNSPECIFIED");
  const Descriptor* session = v1::Session::descriptor();
  const FieldDescriptor* labels = session->FindFieldByName("labels");
  ASSERT_NE(labels, nullptr);
  EXPECT_TRUE(labels->is_map());
}

}  // namespace
}  // namespace sdm
