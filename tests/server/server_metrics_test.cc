#include "server/metrics/server_metrics.h"

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "tests/server/metrics_test_util.h"
#include "tests/server/prometheus_text_parser.h"

namespace sdm {
namespace {

using ::sdm::testing::ParsedFamily;
using ::sdm::testing::ParsedPage;
using ::sdm::testing::ParsedSample;
using ::sdm::testing::RenderAndParse;
using ::testing::ElementsAre;

// The label names of a family's samples, `le` left out.
std::set<std::string> LabelNames(const ParsedFamily& family) {
  std::set<std::string> names;
  for (const ParsedSample& sample : family.samples) {
    for (const auto& [name, value] : sample.labels) {
      if (name != "le") names.insert(name);
    }
  }
  return names;
}

// The `le` bounds of the buckets of a histogram with one series, in page order.
std::vector<std::string> BucketBounds(const ParsedPage& page, const std::string& name) {
  std::vector<std::string> bounds;
  const ParsedFamily* family = page.Family(name);
  if (family == nullptr) return bounds;
  for (const ParsedSample& sample : family->samples) {
    if (sample.name == name + "_bucket") bounds.push_back(sample.labels.at("le"));
  }
  return bounds;
}

// The names, types, label names and help texts that docs/api.md promises operators.
TEST(ServerMetricsTest, DeclaresEveryDocumentedMetric) {
  prometheus::Registry registry(prometheus::Registry::InsertBehavior::Throw);
  ServerMetrics metrics(registry);
  // The labelled request families are exported from their first series on.
  metrics.Request("Generate", absl::StatusCode::kOk);
  metrics.RequestDuration("Generate");

  struct Declared {
    std::string type;
    std::set<std::string> labels;
    std::string help;
  };
  const std::map<std::string, Declared> expected = {
      {"sdm_requests_total",
       {"counter", {"method", "code"}, "RPCs finished, by method and gRPC status code."}},
      {"sdm_prompt_tokens_total",
       {"counter", {}, "Prompt tokens fed to the model (including an added BOS)."}},
      {"sdm_history_tokens_total",
       {"counter",
        {},
        "Tokens of history carried by session state when a Generate started: reused, not read "
        "again."}},
      {"sdm_generated_tokens_total", {"counter", {}, "Tokens generated."}},
      {"sdm_time_to_first_token_seconds",
       {"histogram",
        {},
        "Time from the start of a Generate call to its first token, queueing and prefill "
        "included."}},
      {"sdm_inter_token_latency_seconds",
       {"histogram", {}, "Time between consecutive generated tokens of one stream."}},
      {"sdm_request_duration_seconds",
       {"histogram", {"method"}, "End-to-end duration of RPCs, by method."}},
      {"sdm_requests_running", {"gauge", {}, "Generate requests in the running batch."}},
      {"sdm_requests_waiting",
       {"gauge", {}, "Generate requests queued, not yet admitted to the batch."}},
      {"sdm_batch_size", {"histogram", {}, "Sequences in each engine step."}},
      {"sdm_http_connections_refused_total",
       {"counter",
        {},
        "HTTP API connections answered 503 because no thread took them in time "
        "(--http_max_connections)."}},
      {"sdm_engine_step_failures_total",
       {"counter",
        {},
        "Engine steps that failed: their requests ended with the step's error (the log says why, "
        "once per cause)."}},
      {"sdm_sessions", {"gauge", {"tier"}, "Sessions, by the tier holding their state."}},
      {"sdm_state_bytes", {"gauge", {"tier"}, "Bytes of session state, by tier."}},
      {"sdm_state_offloads_total",
       {"counter", {"tier"}, "Session states moved down to a tier (host or disk)."}},
      {"sdm_state_restores_total",
       {"counter",
        {"tier"},
        "Session states brought back to the engine, by the tier they came from."}},
      {"sdm_snapshot_errors_total",
       {"counter", {}, "Snapshots that failed to write, or failed their checks when read back."}},
      {"sdm_persist_failures_total",
       {"counter",
        {},
        "Sessions whose snapshot writes began failing (once per session and episode; retries "
        "count in sdm_snapshot_errors_total)."}},
      {"sdm_persist_writes_total",
       {"counter",
        {},
        "Writes of changed sessions to the state directory: snapshots and deltas (--persist)."}},
      {"sdm_persist_deltas_total",
       {"counter", {}, "Of sdm_persist_writes_total, deltas appended to a session's log."}},
      {"sdm_persist_bytes_total",
       {"counter", {}, "Bytes written by the writes counted in sdm_persist_writes_total."}},
      {"sdm_sessions_unpersisted",
       {"gauge", {}, "Sessions whose latest turn is not in the state directory yet."}},
      {"sdm_persist_syncs_total",
       {"counter", {}, "Files fsynced by the background syncer (--persist_sync=write)."}},
      {"sdm_persist_waits_total",
       {"counter",
        {},
        "Turns whose acknowledgement waited for their write to the state directory (--persist "
        "turn)."}},
      {"sdm_persist_wait_seconds_total",
       {"counter",
        {},
        "Seconds the turns counted in sdm_persist_waits_total waited for their writes, in all."}},
      {"sdm_sessions_unsynced",
       {"gauge",
        {},
        "Sessions written to the state directory but not fsynced yet (--persist_sync=write)."}},
      {"sdm_persistence_healthy",
       {"gauge",
        {},
        "1 while session state can be written to the state directory, 0 while writes fail."}},
      {"sdm_persist_oldest_pending_seconds",
       {"gauge",
        {},
        "Age of the oldest unfinished write to the state directory, or of the oldest turn "
        "waiting for its write; 0: none. A stalled volume makes it grow."}},
      {"sdm_heap_in_use_bytes",
       {"gauge",
        {},
        "Bytes the process heap has allocated and not freed (glibc mallinfo2; 0 elsewhere)."}},
      {"sdm_heap_system_bytes",
       {"gauge",
        {},
        "Bytes the process heap holds from the system: arena pages and blocks mapped on their "
        "own (glibc mallinfo2)."}},
      {"sdm_heap_trims_total",
       {"counter",
        {},
        "Times the heap's free pages were handed back to the system (malloc_trim; "
        "--malloc_trim_interval)."}},
      {"sdm_resumes_staged_total",
       {"counter",
        {},
        "GPU: sessions converted for their upload when their request was submitted, not inside "
        "the step that resumes them (--resume_staging)."}},
      {"sdm_resumes_from_staged_total",
       {"counter",
        {},
        "Of sdm_resumes_staged_total, resumes whose step uploaded that image (the rest changed "
        "or ended first)."}},
      {"sdm_resume_staging_refused_total",
       {"counter",
        {},
        "GPU: sessions not converted ahead because --resume_staging had no room (their step "
        "converted them)."}},
      {"sdm_resume_staging_bytes",
       {"gauge",
        {},
        "Page-locked host memory held for sessions converted ahead, pooled buffers included (at "
        "most --resume_staging)."}},
      {"sdm_resumes_prefetched_total",
       {"counter",
        {},
        "GPU: of sdm_resumes_staged_total, sessions whose image was also copied to the device "
        "ahead of their step (--resume_prefetch)."}},
      {"sdm_resume_prefetch_bytes",
       {"gauge",
        {},
        "Device memory held for images copied ahead, pooled buffers included (at most "
        "--resume_prefetch)."}},
  };
  const ParsedPage page = RenderAndParse(registry);
  std::map<std::string, Declared> actual;
  for (const ParsedFamily& family : page.families) {
    actual[family.name] = {family.type, LabelNames(family), family.help};
  }
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, declared] : expected) {
    ASSERT_EQ(actual.count(name), 1u) << name;
    EXPECT_EQ(actual[name].type, declared.type) << name;
    EXPECT_EQ(actual[name].labels, declared.labels) << name;
    EXPECT_EQ(actual[name].help, declared.help) << name;
  }
}

TEST(ServerMetricsTest, HistogramBucketBounds) {
  prometheus::Registry registry;
  ServerMetrics metrics(registry);
  const ParsedPage page = RenderAndParse(registry);
  EXPECT_THAT(BucketBounds(page, "sdm_time_to_first_token_seconds"),
              ElementsAre("0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
                          "1", "2.5", "5", "10", "30", "60", "+Inf"));
  EXPECT_THAT(BucketBounds(page, "sdm_inter_token_latency_seconds"),
              ElementsAre("0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
                          "0.25", "0.5", "1", "2.5", "+Inf"));
  EXPECT_THAT(BucketBounds(page, "sdm_batch_size"),
              ElementsAre("1", "2", "4", "8", "16", "32", "64", "128", "256", "512", "+Inf"));
  metrics.RequestDuration("Tokenize").Observe(0.002);
  EXPECT_THAT(BucketBounds(RenderAndParse(registry), "sdm_request_duration_seconds"),
              ElementsAre("0.001", "0.005", "0.01", "0.05", "0.1", "0.5", "1", "2.5", "5", "10",
                          "30", "60", "120", "300", "600", "+Inf"));
}

TEST(ServerMetricsTest, TierSeriesExistBeforeTheFirstSession) {
  prometheus::Registry registry;
  ServerMetrics metrics(registry);
  const ParsedPage page = RenderAndParse(registry);
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
  // No RPC has finished yet: no request series.
  EXPECT_EQ(page.Family("sdm_requests_total"), nullptr);
  EXPECT_EQ(page.Family("sdm_request_duration_seconds"), nullptr);
}

TEST(ServerMetricsTest, RecordsMove) {
  prometheus::Registry registry;
  ServerMetrics metrics(registry);
  metrics.Request("Generate", absl::StatusCode::kOk).Increment();
  metrics.Request("Generate", absl::StatusCode::kInvalidArgument).Increment();
  metrics.Request("Generate", absl::StatusCode::kInvalidArgument).Increment();
  metrics.prompt_tokens.Increment(12);
  metrics.history_tokens.Increment(4096);
  metrics.generated_tokens.Increment(3);
  metrics.time_to_first_token.Observe(0.02);
  metrics.inter_token_latency.Observe(0.004);
  metrics.RequestDuration("Generate").Observe(1.5);
  metrics.requests_running.Set(7);
  metrics.requests_waiting.Set(2);
  metrics.batch_size.Observe(7);
  metrics.Sessions(kTierHost).Set(3);
  metrics.StateBytes(kTierHost).Set(3e9);
  metrics.StateOffloads(kTierDisk).Increment();
  metrics.StateRestores(kTierHost).Increment();
  metrics.snapshot_errors.Increment();

  const ParsedPage page = RenderAndParse(registry);
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
  EXPECT_EQ(
      page.Value("sdm_request_duration_seconds_bucket", {{"method", "Generate"}, {"le", "2.5"}}),
      1);
  EXPECT_EQ(
      page.Value("sdm_request_duration_seconds_bucket", {{"method", "Generate"}, {"le", "1"}}), 0);
  EXPECT_EQ(page.Value("sdm_requests_running"), 7);
  EXPECT_EQ(page.Value("sdm_requests_waiting"), 2);
  EXPECT_EQ(page.Value("sdm_batch_size_bucket", {{"le", "8"}}), 1);
  EXPECT_EQ(page.Value("sdm_batch_size_bucket", {{"le", "4"}}), 0);
  EXPECT_EQ(page.Value("sdm_sessions", {{"tier", "host"}}), 3);
  EXPECT_EQ(page.Value("sdm_sessions", {{"tier", "resident"}}), 0);
  EXPECT_EQ(page.Value("sdm_state_bytes", {{"tier", "host"}}), 3e9);
  EXPECT_EQ(page.Value("sdm_state_offloads_total", {{"tier", "disk"}}), 1);
  EXPECT_EQ(page.Value("sdm_state_offloads_total", {{"tier", "host"}}), 0);
  EXPECT_EQ(page.Value("sdm_state_restores_total", {{"tier", "host"}}), 1);
  EXPECT_EQ(page.Value("sdm_snapshot_errors_total"), 1);
}

TEST(ServerMetricsTest, LabelledAccessorsReturnOneSeriesPerLabelValue) {
  prometheus::Registry registry;
  ServerMetrics metrics(registry);
  EXPECT_EQ(&metrics.Request("Tokenize", absl::StatusCode::kOk),
            &metrics.Request("Tokenize", absl::StatusCode::kOk));
  EXPECT_NE(&metrics.Request("Tokenize", absl::StatusCode::kOk),
            &metrics.Request("Tokenize", absl::StatusCode::kNotFound));
  EXPECT_EQ(&metrics.RequestDuration("Tokenize"), &metrics.RequestDuration("Tokenize"));
  EXPECT_NE(&metrics.RequestDuration("Tokenize"), &metrics.RequestDuration("Generate"));
  EXPECT_EQ(&metrics.Sessions(kTierDisk), &metrics.Sessions(kTierDisk));
  EXPECT_NE(&metrics.Sessions(kTierDisk), &metrics.Sessions(kTierHost));
}

TEST(ServerMetricsTest, UnknownStatusCodesCountAsUnknown) {
  prometheus::Registry registry;
  ServerMetrics metrics(registry);
  metrics.Request("GetSession", static_cast<absl::StatusCode>(99)).Increment();
  EXPECT_EQ(RenderAndParse(registry).Value("sdm_requests_total",
                                           {{"method", "GetSession"}, {"code", "UNKNOWN"}}),
            1);
}

// The engine's staging counts reach the page as the scrapes see them: counters grow by each
// scrape's increase (a count that went down adds nothing), gauges hold the last bytes.
TEST(ServerMetricsTest, ResumeStagingCountsGrowByEachScrapesIncrease) {
  prometheus::Registry registry;
  ServerMetrics metrics(registry);
  const ResumeStagingStats first = {.staged = 5,
                                    .used = 3,
                                    .refused = 2,
                                    .held_bytes = 4096,
                                    .prefetched = 4,
                                    .prefetch_held_bytes = 8192};
  metrics.RecordResumeStaging(first, ResumeStagingStats{});
  ResumeStagingStats second = first;
  second.staged = 9;
  second.used = 1;  // went down: adds nothing
  second.prefetched = 7;
  second.held_bytes = 0;
  second.prefetch_held_bytes = 1024;
  metrics.RecordResumeStaging(second, first);
  const ParsedPage page = RenderAndParse(registry);
  EXPECT_EQ(page.Value("sdm_resumes_staged_total", {}), 9);
  EXPECT_EQ(page.Value("sdm_resumes_from_staged_total", {}), 3);
  EXPECT_EQ(page.Value("sdm_resume_staging_refused_total", {}), 2);
  EXPECT_EQ(page.Value("sdm_resume_staging_bytes", {}), 0);
  EXPECT_EQ(page.Value("sdm_resumes_prefetched_total", {}), 7);
  EXPECT_EQ(page.Value("sdm_resume_prefetch_bytes", {}), 1024);
}

// The server's registry refuses a second registration of the same names.
TEST(ServerMetricsTest, RegisteringTwiceInOneRegistryThrows) {
  prometheus::Registry registry(prometheus::Registry::InsertBehavior::Throw);
  ServerMetrics metrics(registry);
  EXPECT_THROW(ServerMetrics again(registry), std::invalid_argument);
}

}  // namespace
}  // namespace sdm
