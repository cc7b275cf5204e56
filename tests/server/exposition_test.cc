// The /metrics page of a prometheus-cpp registry (server/metrics/exposition.h), checked through
// the independent test parser: names, types, help, labels, values, histogram buckets, escaping,
// ordering, and updates racing renders.
#include "server/metrics/exposition.h"

#include <atomic>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "tests/server/metrics_test_util.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm {
namespace {

using ::prometheus::BuildCounter;
using ::prometheus::BuildGauge;
using ::prometheus::BuildHistogram;
using ::sdm::testing::ParsedFamily;
using ::sdm::testing::ParsedPage;
using ::sdm::testing::ParsePrometheusText;
using ::sdm::testing::RenderAndParse;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ExpositionTest, EmptyRegistryRendersAnEmptyPage) {
  prometheus::Registry registry;
  EXPECT_EQ(RenderPrometheusText(registry), "");
}

TEST(ExpositionTest, CounterWithoutLabelsIsExportedAtZeroAndMoves) {
  prometheus::Registry registry;
  prometheus::Counter& counter =
      BuildCounter().Name("jobs_total").Help("Jobs done.").Register(registry).Add({});
  EXPECT_EQ(RenderAndParse(registry).Value("jobs_total"), 0);
  counter.Increment();
  counter.Increment(2.5);
  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Value("jobs_total"), 3.5);
  ASSERT_NE(page.Family("jobs_total"), nullptr);
  EXPECT_EQ(page.Family("jobs_total")->type, "counter");
  EXPECT_EQ(page.Family("jobs_total")->help, "Jobs done.");
}

TEST(ExpositionTest, LabelledCountersAreSeparateSeries) {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Counter>& requests =
      BuildCounter().Name("requests_total").Help("Requests.").Register(registry);
  // A labelled family is exported from its first series on.
  EXPECT_EQ(RenderAndParse(registry).Family("requests_total"), nullptr);

  prometheus::Counter& ok = requests.Add({{"method", "Generate"}, {"code", "OK"}});
  EXPECT_EQ(&ok, &requests.Add({{"method", "Generate"}, {"code", "OK"}}));  // a stable handle
  ok.Increment();
  ok.Increment();
  requests.Add({{"method", "Generate"}, {"code", "ABORTED"}}).Increment();
  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Value("requests_total", {{"method", "Generate"}, {"code", "OK"}}), 2);
  EXPECT_EQ(page.Value("requests_total", {{"method", "Generate"}, {"code", "ABORTED"}}), 1);
  EXPECT_EQ(page.Family("requests_total")->samples.size(), 2u);
}

TEST(ExpositionTest, GaugeSetsAndAdds) {
  prometheus::Registry registry;
  prometheus::Gauge& gauge =
      BuildGauge().Name("queue_depth").Help("Queued.").Register(registry).Add({});
  gauge.Set(5);
  gauge.Increment();
  gauge.Decrement();
  gauge.Decrement();
  gauge.Decrement(10.5);
  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Value("queue_depth"), -6.5);
  EXPECT_EQ(page.Family("queue_depth")->type, "gauge");
}

TEST(ExpositionTest, HistogramBucketsAreCumulativeAndUpperInclusive) {
  prometheus::Registry registry;
  prometheus::Histogram& histogram =
      BuildHistogram()
          .Name("latency_seconds")
          .Help("Latency.")
          .Register(registry)
          .Add({}, prometheus::Histogram::BucketBoundaries{0.1, 1, 10});
  for (const double v : {0.05, 0.1, 0.5, 1.0, 5.0, 50.0, 50.0}) histogram.Observe(v);

  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Family("latency_seconds")->type, "histogram");
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "0.1"}}), 2);  // 0.05, 0.1
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "1"}}), 4);
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "10"}}), 5);
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "+Inf"}}), 7);
  EXPECT_EQ(page.Value("latency_seconds_count"), 7);
  EXPECT_DOUBLE_EQ(*page.Value("latency_seconds_sum"), 106.65);
}

TEST(ExpositionTest, HistogramWithLabelsAndNoBounds) {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Histogram>& family =
      BuildHistogram().Name("size_bytes").Help("Sizes.").Register(registry);
  const prometheus::Histogram::BucketBoundaries none;
  family.Add({{"kind", "a"}}, none).Observe(3);
  family.Add({{"kind", "b"}}, none).Observe(4);
  family.Add({{"kind", "b"}}, none).Observe(-1);
  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Value("size_bytes_bucket", {{"kind", "a"}, {"le", "+Inf"}}), 1);
  EXPECT_EQ(page.Value("size_bytes_bucket", {{"kind", "b"}, {"le", "+Inf"}}), 2);
  EXPECT_EQ(page.Value("size_bytes_sum", {{"kind", "b"}}), 3);
  EXPECT_EQ(page.Value("size_bytes_count", {{"kind", "b"}}), 2);
}

// The whole page for one metric of each type: what a scraper reads, byte for byte. Histograms
// come as prometheus-cpp writes them: _count and _sum, then the cumulative buckets.
TEST(ExpositionTest, ExactRenderingOfOneOfEach) {
  prometheus::Registry registry;
  BuildHistogram()
      .Name("h_seconds")
      .Help("A histogram.")
      .Register(registry)
      .Add({{"k", "v"}}, prometheus::Histogram::BucketBoundaries{0.5, 2})
      .Observe(1);
  BuildGauge().Name("g").Help("A gauge.").Register(registry).Add({}).Set(0.25);
  BuildCounter()
      .Name("c_total")
      .Help("A counter.")
      .Register(registry)
      .Add({{"k", "v"}})
      .Increment(2);
  EXPECT_EQ(RenderPrometheusText(registry),
            "# HELP c_total A counter.\n"
            "# TYPE c_total counter\n"
            "c_total{k=\"v\"} 2\n"
            "# HELP g A gauge.\n"
            "# TYPE g gauge\n"
            "g 0.25\n"
            "# HELP h_seconds A histogram.\n"
            "# TYPE h_seconds histogram\n"
            "h_seconds_count{k=\"v\"} 1\n"
            "h_seconds_sum{k=\"v\"} 1\n"
            "h_seconds_bucket{k=\"v\",le=\"0.5\"} 0\n"
            "h_seconds_bucket{k=\"v\",le=\"2\"} 1\n"
            "h_seconds_bucket{k=\"v\",le=\"+Inf\"} 1\n");
}

TEST(ExpositionTest, EscapesLabelValues) {
  prometheus::Registry registry;
  const std::string nasty = "quote\" backslash\\ newline\n end";
  BuildCounter().Name("odd_total").Help("Odd.").Register(registry).Add({{"v", nasty}}).Increment();
  const std::string text = RenderPrometheusText(registry);
  EXPECT_THAT(text, HasSubstr("odd_total{v=\"quote\\\" backslash\\\\ newline\\n end\"} 1\n"));
  EXPECT_EQ(RenderAndParse(registry).Value("odd_total", {{"v", nasty}}), 1);
}

TEST(ExpositionTest, SampleValuesReadBackExactly) {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Gauge>& family =
      BuildGauge().Name("value").Help("Values.").Register(registry);
  const double values[] = {0, 3, -2.5, 0.1, 1.0 / 3.0, 3e9, 1e21, 9007199254740993.0};
  for (size_t i = 0; i < std::size(values); ++i) {
    family.Add({{"i", std::to_string(i)}}).Set(values[i]);
  }
  const ParsedPage page = RenderAndParse(registry);
  for (size_t i = 0; i < std::size(values); ++i) {
    EXPECT_EQ(page.Value("value", {{"i", std::to_string(i)}}), values[i]) << values[i];
  }
}

TEST(ExpositionTest, StableOrderByNameThenLabelValues) {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Gauge>& zeta =
      BuildGauge().Name("zeta").Help("Z.").Register(registry);
  BuildCounter().Name("alpha_total").Help("A.").Register(registry).Add({});
  prometheus::Family<prometheus::Gauge>& mid =
      BuildGauge().Name("mid").Help("M.").Register(registry);
  for (const char* tier : {"resident", "disk", "host"}) zeta.Add({{"tier", tier}}).Set(1);
  for (const char* a : {"y", "x"}) {
    for (const char* b : {"2", "1"}) mid.Add({{"a", a}, {"b", b}}).Set(1);
  }
  const std::string first = RenderPrometheusText(registry);
  EXPECT_EQ(first, RenderPrometheusText(registry));
  const ParsedPage page = RenderAndParse(registry);
  std::vector<std::string> names;
  for (const ParsedFamily& family : page.families) names.push_back(family.name);
  EXPECT_THAT(names, ElementsAre("alpha_total", "mid", "zeta"));
  std::vector<std::string> tiers;
  for (const auto& sample : page.Family("zeta")->samples) tiers.push_back(sample.labels.at("tier"));
  EXPECT_THAT(tiers, ElementsAre("disk", "host", "resident"));
  std::vector<std::string> pairs;
  for (const auto& sample : page.Family("mid")->samples) {
    pairs.push_back(sample.labels.at("a") + sample.labels.at("b"));
  }
  EXPECT_THAT(pairs, ElementsAre("x1", "x2", "y1", "y2"));
}

TEST(ExpositionTest, ConcurrentUpdatesAndRendersAreExactAndWellFormed) {
  prometheus::Registry registry;
  prometheus::Family<prometheus::Counter>& tokens =
      BuildCounter().Name("tokens_total").Help("Tokens.").Register(registry);
  prometheus::Family<prometheus::Histogram>& latency =
      BuildHistogram().Name("step_seconds").Help("Steps.").Register(registry);
  const prometheus::Histogram::BucketBoundaries bounds = {0.25, 0.5, 0.75};
  prometheus::Gauge& running =
      BuildGauge().Name("running").Help("Running.").Register(registry).Add({});
  constexpr int kThreads = 4;
  constexpr int kIterations = 20000;
  std::atomic<bool> done = false;
  std::atomic<int> renders = 0;
  std::thread renderer([&] {
    while (!done) {
      ParsedPage page;
      std::string error;
      const std::string text = RenderPrometheusText(registry);
      ASSERT_TRUE(ParsePrometheusText(text, &page, &error)) << error;
      ++renders;
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      // Every thread increments a shared series and its own, looking handles up each time.
      for (int i = 0; i < kIterations; ++i) {
        tokens.Add({{"worker", "shared"}}).Increment();
        tokens.Add({{"worker", std::to_string(t)}}).Increment(2);
        latency.Add({{"worker", "shared"}}, bounds).Observe((i % 4) * 0.25);
        running.Increment();
        running.Decrement();
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  done = true;
  renderer.join();
  EXPECT_GT(renders.load(), 0);

  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Value("tokens_total", {{"worker", "shared"}}), kThreads * kIterations);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(page.Value("tokens_total", {{"worker", std::to_string(t)}}), 2.0 * kIterations);
  }
  const double n = kThreads * kIterations;
  EXPECT_EQ(page.Value("step_seconds_count", {{"worker", "shared"}}), n);
  EXPECT_EQ(page.Value("step_seconds_bucket", {{"worker", "shared"}, {"le", "0.25"}}), n / 2);
  EXPECT_EQ(page.Value("step_seconds_bucket", {{"worker", "shared"}, {"le", "0.5"}}), n * 3 / 4);
  EXPECT_EQ(page.Value("step_seconds_sum", {{"worker", "shared"}}), n / 4 * (0.25 + 0.5 + 0.75));
  EXPECT_EQ(page.Value("running"), 0);
}

}  // namespace
}  // namespace sdm
