// common/json_parse.h: the parse is nlohmann's, and a key repeated within one object is named.
#include "common/json_parse.h"

#include <string>

#include "gtest/gtest.h"

namespace sdm {
namespace {

TEST(JsonParseTest, AKeyRepeatedInOneObjectIsNamed) {
  const JsonParse top = ParseJsonNoticingDuplicateKeys(R"({"a": 1, "b": 2, "a": 3})");
  EXPECT_EQ(top.duplicate_key, "a");
  EXPECT_EQ(top.duplicate_depth, 1);
  EXPECT_EQ(top.value["a"], 3);  // nlohmann's own choice, unchanged
  const JsonParse nested =
      ParseJsonNoticingDuplicateKeys(R"({"x": {"y": 1}, "z": [{"k": 1, "k": 2}]})");
  EXPECT_EQ(nested.duplicate_key, "k");
  EXPECT_EQ(nested.duplicate_depth, 2);
}

TEST(JsonParseTest, TheSameKeyInDifferentObjectsIsNoDuplicate) {
  for (const char* text : {R"({"a": {"a": 1}, "b": {"a": 2}})", R"([{"a": 1}, {"a": 2}])",
                           R"({"a": [{"a": {"a": 0}}]})", "[]", "3"}) {
    const JsonParse parsed = ParseJsonNoticingDuplicateKeys(text);
    EXPECT_FALSE(parsed.value.is_discarded()) << text;
    EXPECT_EQ(parsed.duplicate_key, "") << text;
  }
}

TEST(JsonParseTest, NotJsonIsDiscarded) {
  EXPECT_TRUE(ParseJsonNoticingDuplicateKeys(R"({"a": )").value.is_discarded());
}

TEST(JsonParseTest, DeepNestingParsesWithoutRecursion) {
  const int depth = 1'000'000;
  std::string text;
  for (int i = 0; i < depth; ++i) text += R"({"a":)";
  text += "0";
  text += std::string(depth, '}');
  const JsonParse parsed = ParseJsonNoticingDuplicateKeys(text);
  EXPECT_FALSE(parsed.value.is_discarded());
  EXPECT_EQ(parsed.duplicate_key, "");
}

}  // namespace
}  // namespace sdm
