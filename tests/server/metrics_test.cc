#include "server/metrics/metrics.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm {
namespace {

using ::sdm::testing::ParsedFamily;
using ::sdm::testing::ParsedPage;
using ::sdm::testing::ParsePrometheusText;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

ParsedPage Render(const MetricsRegistry& registry) {
  const std::string text = registry.RenderPrometheusText();
  ParsedPage page;
  std::string error;
  EXPECT_TRUE(ParsePrometheusText(text, &page, &error)) << error << "\n" << text;
  return page;
}

TEST(MetricsTest, EmptyRegistryRendersAnEmptyPage) {
  EXPECT_EQ(CreateMetricsRegistry()->RenderPrometheusText(), "");
}

TEST(MetricsTest, CounterWithoutLabelsIsExportedAtZeroAndMoves) {
  auto registry = CreateMetricsRegistry();
  Family<Counter>& family = registry->AddCounter("jobs_total", "Jobs done.");
  EXPECT_EQ(Render(*registry).Value("jobs_total"), 0);
  Counter& counter = family.WithLabels({});
  counter.Increment();
  counter.Increment(2.5);
  EXPECT_EQ(counter.Value(), 3.5);
  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Value("jobs_total"), 3.5);
  ASSERT_NE(page.Family("jobs_total"), nullptr);
  EXPECT_EQ(page.Family("jobs_total")->type, "counter");
  EXPECT_EQ(page.Family("jobs_total")->help, "Jobs done.");
}

TEST(MetricsTest, LabelledCountersAreSeparateSeries) {
  auto registry = CreateMetricsRegistry();
  Family<Counter>& requests =
      registry->AddCounter("requests_total", "Requests.", {"method", "code"});
  // A labelled family shows no series until one is used.
  const ParsedPage empty = Render(*registry);
  ASSERT_NE(empty.Family("requests_total"), nullptr);
  EXPECT_TRUE(empty.Family("requests_total")->samples.empty());

  Counter& ok = requests.WithLabels({"Generate", "OK"});
  EXPECT_EQ(&ok, &requests.WithLabels({"Generate", "OK"}));  // a stable handle
  ok.Increment();
  ok.Increment();
  requests.WithLabels({"Generate", "ABORTED"}).Increment();
  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Value("requests_total", {{"method", "Generate"}, {"code", "OK"}}), 2);
  EXPECT_EQ(page.Value("requests_total", {{"method", "Generate"}, {"code", "ABORTED"}}), 1);
  EXPECT_EQ(page.Family("requests_total")->samples.size(), 2u);
  EXPECT_THAT(requests.label_names(), ElementsAre("method", "code"));
  EXPECT_EQ(requests.name(), "requests_total");
}

TEST(MetricsTest, GaugeSetsAndAdds) {
  auto registry = CreateMetricsRegistry();
  Gauge& gauge = registry->AddGauge("queue_depth", "Queued.").WithLabels({});
  gauge.Set(5);
  gauge.Increment();
  gauge.Decrement();
  gauge.Decrement();
  gauge.Add(-10.5);
  EXPECT_EQ(gauge.Value(), -6.5);
  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Value("queue_depth"), -6.5);
  EXPECT_EQ(page.Family("queue_depth")->type, "gauge");
}

TEST(MetricsTest, HistogramBucketsAreCumulativeAndUpperInclusive) {
  auto registry = CreateMetricsRegistry();
  Histogram& histogram =
      registry->AddHistogram("latency_seconds", "Latency.", {0.1, 1, 10}).WithLabels({});
  for (const double v : {0.05, 0.1, 0.5, 1.0, 5.0, 50.0, 50.0}) histogram.Observe(v);
  histogram.Observe(std::nan(""));  // ignored
  EXPECT_EQ(histogram.Count(), 7u);
  EXPECT_DOUBLE_EQ(histogram.Sum(), 106.65);

  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Family("latency_seconds")->type, "histogram");
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "0.1"}}), 2);  // 0.05, 0.1
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "1"}}), 4);
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "10"}}), 5);
  EXPECT_EQ(page.Value("latency_seconds_bucket", {{"le", "+Inf"}}), 7);
  EXPECT_EQ(page.Value("latency_seconds_count"), 7);
  EXPECT_DOUBLE_EQ(*page.Value("latency_seconds_sum"), 106.65);
}

TEST(MetricsTest, HistogramWithLabelsAndNoBounds) {
  auto registry = CreateMetricsRegistry();
  Family<Histogram>& family = registry->AddHistogram("size_bytes", "Sizes.", {}, {"kind"});
  family.WithLabels({"a"}).Observe(3);
  family.WithLabels({"b"}).Observe(4);
  family.WithLabels({"b"}).Observe(-1);
  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Value("size_bytes_bucket", {{"kind", "a"}, {"le", "+Inf"}}), 1);
  EXPECT_EQ(page.Value("size_bytes_bucket", {{"kind", "b"}, {"le", "+Inf"}}), 2);
  EXPECT_EQ(page.Value("size_bytes_sum", {{"kind", "b"}}), 3);
  EXPECT_EQ(page.Value("size_bytes_count", {{"kind", "b"}}), 2);
}

TEST(MetricsTest, ExactRenderingOfOneOfEach) {
  auto registry = CreateMetricsRegistry();
  registry->AddCounter("c_total", "A counter.", {"k"}).WithLabels({"v"}).Increment(2);
  registry->AddGauge("g", "A gauge.").WithLabels({}).Set(0.25);
  registry->AddHistogram("h_seconds", "A histogram.", {0.5, 2}, {"k"}).WithLabels({"v"}).Observe(1);
  EXPECT_EQ(registry->RenderPrometheusText(),
            "# HELP c_total A counter.\n"
            "# TYPE c_total counter\n"
            "c_total{k=\"v\"} 2\n"
            "# HELP g A gauge.\n"
            "# TYPE g gauge\n"
            "g 0.25\n"
            "# HELP h_seconds A histogram.\n"
            "# TYPE h_seconds histogram\n"
            "h_seconds_bucket{k=\"v\",le=\"0.5\"} 0\n"
            "h_seconds_bucket{k=\"v\",le=\"2\"} 1\n"
            "h_seconds_bucket{k=\"v\",le=\"+Inf\"} 1\n"
            "h_seconds_sum{k=\"v\"} 1\n"
            "h_seconds_count{k=\"v\"} 1\n");
}

TEST(MetricsTest, EscapesLabelValuesAndHelp) {
  auto registry = CreateMetricsRegistry();
  const std::string nasty = "quote\" backslash\\ newline\n end";
  registry->AddCounter("odd_total", "Help with \\ and\nnewline \"quoted\".", {"v"})
      .WithLabels({nasty})
      .Increment();
  const std::string text = registry->RenderPrometheusText();
  EXPECT_THAT(text, HasSubstr("odd_total{v=\"quote\\\" backslash\\\\ newline\\n end\"} 1\n"));
  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Value("odd_total", {{"v", nasty}}), 1);
  EXPECT_EQ(page.Family("odd_total")->help, "Help with \\ and\nnewline \"quoted\".");
}

TEST(MetricsTest, StableOrderByNameThenLabelValues) {
  auto registry = CreateMetricsRegistry();
  Family<Gauge>& zeta = registry->AddGauge("zeta", "Z.", {"tier"});
  registry->AddCounter("alpha_total", "A.");
  Family<Gauge>& mid = registry->AddGauge("mid", "M.", {"a", "b"});
  zeta.WithLabels({"resident"}).Set(1);
  zeta.WithLabels({"disk"}).Set(2);
  zeta.WithLabels({"host"}).Set(3);
  mid.WithLabels({"y", "1"}).Set(1);
  mid.WithLabels({"x", "2"}).Set(1);
  mid.WithLabels({"x", "1"}).Set(1);
  const std::string first = registry->RenderPrometheusText();
  EXPECT_EQ(first, registry->RenderPrometheusText());
  const ParsedPage page = Render(*registry);
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
  EXPECT_THAT(pairs, ElementsAre("x1", "x2", "y1"));
}

TEST(MetricsTest, CollectHooksRunBeforeEachRender) {
  auto registry = CreateMetricsRegistry();
  Gauge& sessions = registry->AddGauge("sessions", "Sessions.").WithLabels({});
  int calls = 0;
  registry->AddCollectHook([&] { sessions.Set(++calls * 10); });
  EXPECT_EQ(Render(*registry).Value("sessions"), 10);
  EXPECT_EQ(Render(*registry).Value("sessions"), 20);
}

TEST(MetricsTest, ExponentialBuckets) {
  EXPECT_THAT(ExponentialBuckets(1, 2, 5), ElementsAre(1, 2, 4, 8, 16));
  EXPECT_THAT(ExponentialBuckets(0.001, 10, 3), ElementsAre(0.001, 0.01, ::testing::DoubleEq(0.1)));
  EXPECT_TRUE(ExponentialBuckets(1, 2, 0).empty());
}

TEST(MetricsDeathTest, RegistrationErrorsAreProgrammingErrors) {
  auto registry = CreateMetricsRegistry();
  registry->AddCounter("taken_total", "T.");
  EXPECT_DEATH(registry->AddCounter("taken_total", "Again."), "registered twice");
  EXPECT_DEATH(registry->AddCounter("requests", "R."), "_total");
  EXPECT_DEATH(registry->AddGauge("bytes_total", "B."), "only counters");
  EXPECT_DEATH(registry->AddGauge("bad-name", "B."), "metric names");
  EXPECT_DEATH(registry->AddGauge("g", "G.", {"__reserved"}), "label names");
  EXPECT_DEATH(registry->AddGauge("g", "G.", {"a", "a"}), "duplicate label");
  EXPECT_DEATH(registry->AddHistogram("h", "H.", {1}, {"le"}), "bucket label");
  EXPECT_DEATH(registry->AddHistogram("h", "H.", {1, 1}), "increase");
  EXPECT_DEATH(registry->AddHistogram("h", "H.", {1, INFINITY}), "finite");
  Family<Counter>& family = registry->AddCounter("two_total", "T.", {"a", "b"});
  EXPECT_DEATH(family.WithLabels({"only one"}), "number of values");
  Counter& counter = family.WithLabels({"x", "y"});
  EXPECT_DEATH(counter.Increment(-1), "check failed");
}

TEST(MetricsTest, ConcurrentUpdatesAndRendersAreExactAndWellFormed) {
  auto registry = CreateMetricsRegistry();
  Family<Counter>& tokens = registry->AddCounter("tokens_total", "Tokens.", {"worker"});
  Family<Histogram>& latency =
      registry->AddHistogram("step_seconds", "Steps.", {0.25, 0.5, 0.75}, {"worker"});
  Gauge& running = registry->AddGauge("running", "Running.").WithLabels({});
  constexpr int kThreads = 4;
  constexpr int kIterations = 20000;
  std::atomic<bool> done = false;
  std::atomic<int> renders = 0;
  std::thread renderer([&] {
    while (!done) {
      ParsedPage page;
      std::string error;
      const std::string text = registry->RenderPrometheusText();
      ASSERT_TRUE(ParsePrometheusText(text, &page, &error)) << error;
      ++renders;
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      // Every thread increments a shared series and its own, looking handles up each time.
      for (int i = 0; i < kIterations; ++i) {
        tokens.WithLabels({"shared"}).Increment();
        tokens.WithLabels({std::to_string(t)}).Increment(2);
        latency.WithLabels({"shared"}).Observe((i % 4) * 0.25);
        running.Increment();
        running.Decrement();
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  done = true;
  renderer.join();
  EXPECT_GT(renders.load(), 0);

  const ParsedPage page = Render(*registry);
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
