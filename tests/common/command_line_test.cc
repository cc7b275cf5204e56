// Subcommand flag parsing (common/command_line.h) on flags declared here: the accepted forms,
// repeatable flags kept whole, and the usage errors.
#include "common/command_line.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, cl_test_name, "", "a string");
ABSL_FLAG(int64_t, cl_test_count, 1, "an integer");
ABSL_FLAG(bool, cl_test_on, false, "a boolean");
ABSL_FLAG(std::vector<std::string>, cl_test_list, {}, "a comma-separated list");
ABSL_FLAG(sdm::cli::RepeatedFlag, cl_test_set, {}, "a repeatable flag");

namespace sdm::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class CommandLineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::SetFlag(&FLAGS_cl_test_name, "");
    absl::SetFlag(&FLAGS_cl_test_count, 1);
    absl::SetFlag(&FLAGS_cl_test_on, false);
    absl::SetFlag(&FLAGS_cl_test_list, {});
    absl::SetFlag(&FLAGS_cl_test_set, {});
  }

  std::string Parse(const std::vector<std::string>& args, size_t max_positional = 0) {
    Subcommand sub;
    sub.name = "sub";
    sub.flags = {"cl_test_name", "cl_test_count", "cl_test_on", "cl_test_list", "cl_test_set"};
    sub.max_positional = max_positional;
    parsed_ = ParsedArgs();
    return SetSubcommandFlags(sub, args, &parsed_);
  }

  ParsedArgs parsed_;
};

TEST_F(CommandLineTest, AcceptsEveryForm) {
  ASSERT_EQ(
      Parse({"--cl_test_name=a", "-cl_test_count", "7", "--cl_test_on", "--cl_test_list", "x,y"}),
      "");
  EXPECT_EQ(absl::GetFlag(FLAGS_cl_test_name), "a");
  EXPECT_EQ(absl::GetFlag(FLAGS_cl_test_count), 7);
  EXPECT_TRUE(absl::GetFlag(FLAGS_cl_test_on));
  EXPECT_THAT(absl::GetFlag(FLAGS_cl_test_list), ElementsAre("x", "y"));
  EXPECT_THAT(parsed_.given.size(), 4u);
  ASSERT_EQ(Parse({"--nocl_test_on"}), "");
  EXPECT_FALSE(absl::GetFlag(FLAGS_cl_test_on));
  EXPECT_TRUE(parsed_.given.contains("cl_test_on"));
}

TEST_F(CommandLineTest, RepeatedFlagsKeepEveryOccurrenceWholeInOrder) {
  ASSERT_EQ(Parse({"--cl_test_set", "swa_at=[0,1]", "--cl_test_set=sdm_at=[2,3]"}), "");
  EXPECT_THAT(absl::GetFlag(FLAGS_cl_test_set).values, ElementsAre("swa_at=[0,1]", "sdm_at=[2,3]"));
  // A single occurrence is one value, commas and all.
  ASSERT_EQ(Parse({"--cl_test_set", "a=[1,2]"}), "");
  EXPECT_THAT(absl::GetFlag(FLAGS_cl_test_set).values, ElementsAre("a=[1,2]"));
  // Line breaks, backslashes, '=' and empty values survive (a stop string is often "\n").
  ASSERT_EQ(Parse({"--cl_test_set", "\n", "--cl_test_set", "", "--cl_test_set", "a\\b\n=c"}), "");
  EXPECT_THAT(absl::GetFlag(FLAGS_cl_test_set).values, ElementsAre("\n", "", "a\\b\n=c"));
}

TEST(RepeatedFlagTest, TextFormRoundTripsAndRejectsGarbage) {
  const RepeatedFlag flag{{"x,y", "", "\n\t\\", "=="}};
  RepeatedFlag back;
  std::string error;
  ASSERT_TRUE(AbslParseFlag(AbslUnparseFlag(flag), &back, &error)) << error;
  EXPECT_EQ(back.values, flag.values);
  EXPECT_TRUE(AbslParseFlag("", &back, &error));
  EXPECT_TRUE(back.values.empty());
  EXPECT_FALSE(AbslParseFlag("no-marker", &back, &error));
}

TEST_F(CommandLineTest, PositionalArgumentsUpToTheLimit) {
  ASSERT_EQ(Parse({"dir", "--cl_test_on", "--", "--not-a-flag"}, 2), "");
  EXPECT_THAT(parsed_.positional, ElementsAre("dir", "--not-a-flag"));
  EXPECT_THAT(Parse({"a", "b"}, 1), HasSubstr("unexpected argument 'b'"));
}

TEST_F(CommandLineTest, UsageErrorsNameTheFlag) {
  EXPECT_THAT(Parse({"--bogus", "1"}), HasSubstr("unknown flag --bogus"));
  EXPECT_THAT(Parse({"--cl_test_count", "many"}), HasSubstr("--cl_test_count"));
  EXPECT_THAT(Parse({"--cl_test_name"}), HasSubstr("needs a value"));
  EXPECT_THAT(Parse({"--nocl_test_name"}), HasSubstr("unknown flag"));  // not a boolean
}

TEST(WrapTest, BreaksAtOneHundredColumnsAndIndents) {
  const std::string word(30, 'w');
  const std::string text = word + " " + word + " " + word + " " + word;
  EXPECT_EQ(Wrap(text, 4), "    " + word + " " + word + " " + word + "\n    " + word + "\n");
}

}  // namespace
}  // namespace sdm::cli
