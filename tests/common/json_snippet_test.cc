// common/json_snippet.h: what an error message quotes of a JSON value, and that it stays bounded
// (in size and in recursion) whatever the value.
#include "common/json_snippet.h"

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace sdm {
namespace {

using json = nlohmann::json;

json Parse(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << text.substr(0, 80);
  return j;
}

TEST(JsonSnippetTest, ShortValuesReadAsCompactJson) {
  for (const char* text : {"3", "-1.5", "true", "null", "\"F16\"", "[]", "{}", "[2,-1]",
                           R"({"a":[1,{"b":null}],"c":"d"})"}) {
    EXPECT_EQ(JsonSnippet(Parse(text)), text);
  }
  EXPECT_EQ(JsonSnippet(Parse(R"("tab\there")")), R"("tab\there")");
}

TEST(JsonSnippetTest, DeepContainersAreElided) {
  const std::string open(kJsonSnippetDepth, '['), close(kJsonSnippetDepth, ']');
  EXPECT_EQ(JsonSnippet(Parse(open + "1" + close)), open + "1" + close);
  EXPECT_EQ(JsonSnippet(Parse(open + "[1]" + close)), open + "[...]" + close);
  EXPECT_EQ(JsonSnippet(Parse(R"([[[[[[[[{"k":1}]]]]]]]])")), "[[[[[[[[{...}]]]]]]]]");
  // Empty containers are short whatever their depth.
  EXPECT_EQ(JsonSnippet(Parse(open + "[]" + close)), open + "[]" + close);
}

// A million levels (which json::parse reads iteratively and dump() would recurse through), and
// long flat values: the snippet is cut to size without visiting the rest.
TEST(JsonSnippetTest, HostileValuesStayBounded) {
  const json deep = Parse(std::string(1'000'000, '[') + std::string(1'000'000, ']'));
  const std::string s = JsonSnippet(deep);
  EXPECT_EQ(s, std::string(kJsonSnippetDepth, '[') + "[...]" + std::string(kJsonSnippetDepth, ']'));

  json long_array = json::array();
  for (int i = 0; i < 100000; ++i) long_array.push_back(i);
  const std::string a = JsonSnippet(long_array);
  EXPECT_EQ(a.size(), 80u);
  EXPECT_EQ(a.substr(0, 8), "[0,1,2,3");
  EXPECT_EQ(a.substr(77), "...");

  const std::string b = JsonSnippet(json(std::string(1'000'000, 'x')), 20);
  EXPECT_EQ(b, "\"" + std::string(16, 'x') + "...");
}

TEST(JsonSnippetTest, ACutNeverSplitsAUtf8Sequence) {
  // "é" is two bytes: quoted after '"a', each starts at an even byte, so a cut at byte 77 would
  // fall inside one.
  std::string text = "a";
  for (int i = 0; i < 40; ++i) text += "\xc3\xa9";
  const std::string s = JsonSnippet(json(text));
  ASSERT_EQ(s.substr(s.size() - 3), "...");
  EXPECT_LE(s.size(), 80u);
  const std::string kept = s.substr(0, s.size() - 3);
  ASSERT_EQ(kept.substr(0, 2), "\"a");
  EXPECT_EQ(kept.size() % 2, 0u);  // whole "é"s only
  for (size_t i = 2; i < kept.size(); i += 2) EXPECT_EQ(kept.substr(i, 2), "\xc3\xa9") << i;
}

TEST(JsonSnippetTest, BytesThatAreNotUtf8AreReplacedNotThrown) {
  EXPECT_EQ(JsonSnippet(json(std::string("a\xff"))), "\"a\xef\xbf\xbd\"");
}

}  // namespace
}  // namespace sdm
