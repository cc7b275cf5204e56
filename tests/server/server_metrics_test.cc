#include "server/metrics/server_metrics.h"

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm {
namespace {

using ::sdm::testing::ParsedFamily;
using ::sdm::testing::ParsedPage;
using ::sdm::testing::ParsePrometheusText;

ParsedPage Render(const MetricsRegistry& registry) {
  const std::string text = registry.RenderPrometheusText();
  ParsedPage page;
  std::string error;
  EXPECT_TRUE(ParsePrometheusText(text, &page, &error)) << error << "\n" << text;
  return page;
}

// The names, types and label names that docs/api.md promises operators.
TEST(ServerMetricsTest, DeclaresEveryDocumentedMetric) {
  auto registry = CreateMetricsRegistry();
  ServerMetrics metrics(*registry);
  const std::map<std::string, std::string> expected = {
      {"sdm_requests_total", "counter"},
      {"sdm_prompt_tokens_total", "counter"},
      {"sdm_history_tokens_total", "counter"},
      {"sdm_generated_tokens_total", "counter"},
      {"sdm_time_to_first_token_seconds", "histogram"},
      {"sdm_inter_token_latency_seconds", "histogram"},
      {"sdm_request_duration_seconds", "histogram"},
      {"sdm_requests_running", "gauge"},
      {"sdm_requests_waiting", "gauge"},
      {"sdm_batch_size", "histogram"},
      {"sdm_sessions", "gauge"},
      {"sdm_state_bytes", "gauge"},
      {"sdm_state_offloads_total", "counter"},
      {"sdm_state_restores_total", "counter"},
      {"sdm_snapshot_errors_total", "counter"},
  };
  const ParsedPage page = Render(*registry);
  std::map<std::string, std::string> actual;
  for (const ParsedFamily& family : page.families) {
    actual[family.name] = family.type;
    EXPECT_FALSE(family.help.empty()) << family.name;
  }
  EXPECT_EQ(actual, expected);
  EXPECT_THAT(metrics.requests.label_names(), ::testing::ElementsAre("method", "code"));
  EXPECT_THAT(metrics.request_duration.label_names(), ::testing::ElementsAre("method"));
}

TEST(ServerMetricsTest, TierSeriesExistBeforeTheFirstSession) {
  auto registry = CreateMetricsRegistry();
  ServerMetrics metrics(*registry);
  const ParsedPage page = Render(*registry);
  for (const char* tier : {"resident", "host", "disk"}) {
    EXPECT_EQ(page.Value("sdm_sessions", {{"tier", tier}}), 0) << tier;
    EXPECT_EQ(page.Value("sdm_state_bytes", {{"tier", tier}}), 0) << tier;
  }
  for (const char* tier : {"host", "disk"}) {
    EXPECT_EQ(page.Value("sdm_state_offloads_total", {{"tier", tier}}), 0) << tier;
    EXPECT_EQ(page.Value("sdm_state_restores_total", {{"tier", tier}}), 0) << tier;
  }
  EXPECT_EQ(page.Value("sdm_snapshot_errors_total"), 0);
  EXPECT_EQ(page.Value("sdm_time_to_first_token_seconds_count"), 0);
}

TEST(ServerMetricsTest, RecordsMove) {
  auto registry = CreateMetricsRegistry();
  ServerMetrics metrics(*registry);
  metrics.Request("Generate", absl::StatusCode::kOk).Increment();
  metrics.Request("Generate", absl::StatusCode::kInvalidArgument).Increment();
  metrics.Request("Generate", absl::StatusCode::kInvalidArgument).Increment();
  metrics.prompt_tokens.Increment(12);
  metrics.history_tokens.Increment(4096);
  metrics.generated_tokens.Increment(3);
  metrics.time_to_first_token.Observe(0.02);
  metrics.inter_token_latency.Observe(0.004);
  metrics.request_duration.WithLabels({"Generate"}).Observe(1.5);
  metrics.requests_running.Set(7);
  metrics.requests_waiting.Set(2);
  metrics.batch_size.Observe(7);
  metrics.sessions.WithLabels({kTierHost}).Set(3);
  metrics.state_bytes.WithLabels({kTierHost}).Set(3e9);
  metrics.state_offloads.WithLabels({kTierDisk}).Increment();
  metrics.state_restores.WithLabels({kTierHost}).Increment();
  metrics.snapshot_errors.Increment();

  const ParsedPage page = Render(*registry);
  EXPECT_EQ(page.Value("sdm_requests_total", {{"method", "Generate"}, {"code", "OK"}}), 1);
  EXPECT_EQ(
      page.Value("sdm_requests_total", {{"method", "Generate"}, {"code", "INVALID_ARGUMENT"}}), 2);
  EXPECT_EQ(page.Value("sdm_prompt_tokens_total"), 12);
  EXPECT_EQ(page.Value("sdm_history_tokens_total"), 4096);
  EXPECT_EQ(page.Value("sdm_generated_tokens_total"), 3);
  EXPECT_EQ(page.Value("sdm_time_to_first_token_seconds_bucket", {{"le", "0.025"}}), 1);
  EXPECT_EQ(page.Value("sdm_time_to_first_token_seconds_bucket", {{"le", "0.01"}}), 0);
  EXPECT_EQ(page.Value("sdm_inter_token_latency_seconds_count"), 1);
  EXPECT_EQ(page.Value("sdm_request_duration_seconds_count", {{"method", "Generate"}}), 1);
  EXPECT_EQ(page.Value("sdm_requests_running"), 7);
  EXPECT_EQ(page.Value("sdm_requests_waiting"), 2);
  EXPECT_EQ(page.Value("sdm_batch_size_bucket", {{"le", "8"}}), 1);
  EXPECT_EQ(page.Value("sdm_batch_size_bucket", {{"le", "4"}}), 0);
  EXPECT_EQ(page.Value("sdm_sessions", {{"tier", "host"}}), 3);
  EXPECT_EQ(page.Value("sdm_state_bytes", {{"tier", "host"}}), 3e9);
  EXPECT_EQ(page.Value("sdm_state_offloads_total", {{"tier", "disk"}}), 1);
  EXPECT_EQ(page.Value("sdm_state_restores_total", {{"tier", "host"}}), 1);
  EXPECT_EQ(page.Value("sdm_snapshot_errors_total"), 1);
}

TEST(ServerMetricsTest, UnknownStatusCodesCountAsUnknown) {
  auto registry = CreateMetricsRegistry();
  ServerMetrics metrics(*registry);
  metrics.Request("GetSession", static_cast<absl::StatusCode>(99)).Increment();
  EXPECT_EQ(Render(*registry).Value("sdm_requests_total",
                                    {{"method", "GetSession"}, {"code", "UNKNOWN"}}),
            1);
}

}  // namespace
}  // namespace sdm
