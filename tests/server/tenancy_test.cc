#include "server/tenancy.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(ValidateTest, SessionIds) {
  EXPECT_TRUE(ValidateSessionId("a").ok());
  EXPECT_TRUE(ValidateSessionId(std::string(128, 'a')).ok());
  EXPECT_TRUE(ValidateSessionId("A.b_c-9").ok());
  for (const std::string& bad : {std::string(), std::string(129, 'a'), std::string("a b"),
                                 std::string("a/b"), std::string("é")}) {
    const absl::Status s = ValidateSessionId(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("session_id"));
  }
  EXPECT_THAT(ValidateSessionId("a b", "new_session_id").message(),
              ::testing::HasSubstr("new_session_id"));
}

TEST(ValidateTest, Labels) {
  EXPECT_TRUE(ValidateLabels({}).ok());
  EXPECT_TRUE(ValidateLabels({{"team", "x"}, {"a.b-c_9", std::string(256, 'v')}}).ok());
  EXPECT_TRUE(ValidateLabels({{std::string(63, 'k'), ""}}).ok());
  for (const std::string& bad_key : {std::string(), std::string("Team"), std::string("9team"),
                                     std::string("te am"), std::string(64, 'k')}) {
    EXPECT_EQ(ValidateLabels({{bad_key, "v"}}).code(), absl::StatusCode::kInvalidArgument)
        << bad_key;
  }
  EXPECT_EQ(ValidateLabels({{"k", std::string(257, 'v')}}).code(),
            absl::StatusCode::kInvalidArgument);
  Labels many;
  for (int i = 0; i < 65; ++i) many[absl::StrCat("k", i)] = "v";
  EXPECT_EQ(ValidateLabels(many).code(), absl::StatusCode::kInvalidArgument);
}

TEST(MetadataTest, RoundTrips) {
  SessionMetadata m;
  m.tenant = "research";
  m.id = "chat-1";
  m.labels = {{"team", "nlp"}, {"note", "quotes \" and \\ and é"}};
  m.create_time = absl::FromUnixMillis(1'700'000'000'123);
  absl::StatusOr<SessionMetadata> back = DecodeSessionMetadata(EncodeSessionMetadata(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
}

TEST(MetadataTest, NamesTheKeyOfItsSession) {
  SessionMetadata m;
  m.tenant = "research";
  m.id = "chat-1";
  EXPECT_EQ(SessionKeyOfMetadata(EncodeSessionMetadata(m)), SessionKey("research", "chat-1"));
  EXPECT_EQ(SessionKeyOfMetadata("not json"), std::nullopt);
}

TEST(MetadataTest, RejectsWhatItDidNotWrite) {
  for (const std::string& bad :
       {std::string(), std::string("{}"), std::string("not json"), std::string("[1]"),
        std::string(R"({"v": 2, "tenant": "t", "id": "i", "labels": {}, "create_ms": 0})"),
        std::string(R"({"v": 1, "tenant": 5, "id": "i", "labels": {}, "create_ms": 0})"),
        std::string(R"({"v": 1, "tenant": "t", "id": "i", "labels": {"a": 1}, "create_ms": 0})")}) {
    EXPECT_FALSE(DecodeSessionMetadata(bad).ok()) << bad;
  }
}

TEST(PageTokenTest, RoundTripsOnlyWithTheSameSelector) {
  const Labels selector = {{"team", "nlp"}};
  const std::string token = EncodePageToken("chat-7", selector);
  absl::StatusOr<std::string> last = DecodePageToken(token, selector);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*last, "chat-7");
  const absl::Status other = DecodePageToken(token, {{"team", "vision"}}).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other.message(), ::testing::HasSubstr("label_selector"));
  EXPECT_FALSE(DecodePageToken(token, {}).ok());
  for (const std::string& bad :
       {std::string("garbage!"), std::string("cDE6eDp5"), token.substr(0, token.size() / 2)}) {
    EXPECT_EQ(DecodePageToken(bad, selector).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(NewSessionIdTest, ValidAndDistinct) {
  std::set<std::string> ids;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = NewSessionId();
    EXPECT_TRUE(ValidateSessionId(id).ok()) << id;
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 1000u);
}

}  // namespace
}  // namespace sdm
