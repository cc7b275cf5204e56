// The test parser must reject what the format (or our stricter rules) forbid; otherwise the
// metrics tests that rely on it would prove nothing.
#include "tests/server/prometheus_text_parser.h"

#include <string>

#include "gtest/gtest.h"

namespace sdm {
namespace {

using ::sdm::testing::ParsedPage;
using ::sdm::testing::ParsePrometheusText;

TEST(PrometheusTextParserTest, AcceptsAWellFormedPage) {
  const std::string page =
      "# HELP a_total Things \\\\ done.\\nSecond line.\n"
      "# TYPE a_total counter\n"
      "a_total{x=\"1\",y=\"q\\\"\\\\\\n\"} 3\n"
      "# HELP h Latency.\n"
      "# TYPE h histogram\n"
      "h_bucket{le=\"0.5\"} 1\n"
      "h_bucket{le=\"1\"} 2\n"
      "h_bucket{le=\"+Inf\"} 3\n"
      "h_sum 4.5\n"
      "h_count 3\n";
  ParsedPage parsed;
  std::string error;
  ASSERT_TRUE(ParsePrometheusText(page, &parsed, &error)) << error;
  ASSERT_EQ(parsed.families.size(), 2u);
  EXPECT_EQ(parsed.families[0].help, "Things \\ done.\nSecond line.");
  EXPECT_EQ(parsed.Value("a_total", {{"x", "1"}, {"y", "q\"\\\n"}}), 3);
  EXPECT_EQ(parsed.Value("h_count"), 3);
}

// The format leaves the order of a histogram's lines open; prometheus-cpp writes _count and _sum
// before the buckets.
TEST(PrometheusTextParserTest, AcceptsCountAndSumBeforeTheBuckets) {
  const std::string page =
      "# HELP h Latency.\n"
      "# TYPE h histogram\n"
      "h_count{k=\"v\"} 3\n"
      "h_sum{k=\"v\"} 4.5\n"
      "h_bucket{k=\"v\",le=\"0.5\"} 1\n"
      "h_bucket{k=\"v\",le=\"+Inf\"} 3\n";
  ParsedPage parsed;
  std::string error;
  ASSERT_TRUE(ParsePrometheusText(page, &parsed, &error)) << error;
  EXPECT_EQ(parsed.Value("h_bucket", {{"k", "v"}, {"le", "0.5"}}), 1);
  EXPECT_EQ(parsed.Value("h_sum", {{"k", "v"}}), 4.5);
}

TEST(PrometheusTextParserTest, RejectsMalformedPages) {
  const char* const kBad[] = {
      "c_total 1\n",                                                       // no HELP/TYPE
      "# TYPE c_total counter\nc_total 1\n",                               // TYPE without HELP
      "# HELP c_total C.\nc_total 1\n",                                    // HELP without TYPE
      "# HELP c_total C.\n# TYPE c_total counter\nc_total 1",              // no final line feed
      "# HELP c_total C.\n# TYPE c_total counter\n\nc_total 1\n",          // empty line
      "# HELP c_total C.\n# TYPE c_total counter\n# note\nc_total 1\n",    // other comment
      "# HELP c_total C.\n# TYPE c_total counter\nother 1\n",              // sample of another name
      "# HELP c_total C.\n# TYPE c_total counter\nc_total{} 1\n",          // empty label set
      "# HELP c_total C.\n# TYPE c_total counter\nc_total{a=\"1\",} 1\n",  // trailing comma
      "# HELP c_total C.\n# TYPE c_total counter\nc_total{a=\"\\t\"} 1\n",  // bad escape
      "# HELP c_total C.\n# TYPE c_total counter\nc_total{a=\"1} 1\n",      // unterminated
      "# HELP c_total C.\n# TYPE c_total counter\nc_total 1 1700000000\n",  // timestamp
      "# HELP c_total C.\n# TYPE c_total counter\nc_total one\n",           // bad value
      "# HELP c_total C.\n# TYPE c_total counter\nc_total 1\nc_total 2\n",  // duplicate series
      "# HELP c_total C.\n# TYPE c_total widget\nc_total 1\n",              // unknown type
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",  // no +Inf
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
      "h_sum 1\nh_count 1\n",  // decreasing buckets
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n",  // +Inf
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_count 2\n",           // no _sum
      "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"2\"} 1\nh_bucket{le=\"1\"} 1\n"
      "h_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",  // le out of order
  };
  for (const char* bad : kBad) {
    ParsedPage parsed;
    std::string error;
    EXPECT_FALSE(ParsePrometheusText(bad, &parsed, &error)) << bad;
  }
}

}  // namespace
}  // namespace sdm
