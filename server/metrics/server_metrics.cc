#include "server/metrics/server_metrics.h"

#include <string>
#include <vector>

namespace sdm {
namespace {

// Latency buckets, in seconds. Time to first token includes queueing and prefill; inter-token
// latency is one decode step (sub-millisecond to a few hundred milliseconds); a request's
// duration spans a Tokenize call to a long generation.
const std::vector<double>& TimeToFirstTokenBuckets() {
  static const std::vector<double> kBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                               0.5,   1,      2.5,   5,    10,    30,   60};
  return kBuckets;
}

const std::vector<double>& InterTokenLatencyBuckets() {
  static const std::vector<double> kBuckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                               0.05,   0.1,   0.25,   0.5,   1,    2.5};
  return kBuckets;
}

const std::vector<double>& RequestDurationBuckets() {
  static const std::vector<double> kBuckets = {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1,  2.5,
                                               5,     10,    30,   60,   120, 300, 600};
  return kBuckets;
}

}  // namespace

ServerMetrics::ServerMetrics(MetricsRegistry& registry)
    : requests(registry.AddCounter("sdm_requests_total",
                                   "RPCs finished, by method and gRPC status code.",
                                   {"method", "code"})),
      prompt_tokens(registry
                        .AddCounter("sdm_prompt_tokens_total",
                                    "Prompt tokens fed to the model (including an added BOS).")
                        .WithLabels({})),
      history_tokens(registry
                         .AddCounter("sdm_history_tokens_total",
                                     "Tokens of history carried by session state when a "
                                     "Generate started: reused, not read again.")
                         .WithLabels({})),
      generated_tokens(
          registry.AddCounter("sdm_generated_tokens_total", "Tokens generated.").WithLabels({})),
      time_to_first_token(registry
                              .AddHistogram("sdm_time_to_first_token_seconds",
                                            "Time from the start of a Generate call to its first "
                                            "token, queueing and prefill included.",
                                            TimeToFirstTokenBuckets())
                              .WithLabels({})),
      inter_token_latency(
          registry
              .AddHistogram("sdm_inter_token_latency_seconds",
                            "Time between consecutive generated tokens of one stream.",
                            InterTokenLatencyBuckets())
              .WithLabels({})),
      request_duration(registry.AddHistogram("sdm_request_duration_seconds",
                                             "End-to-end duration of RPCs, by method.",
                                             RequestDurationBuckets(), {"method"})),
      requests_running(
          registry.AddGauge("sdm_requests_running", "Generate requests in the running batch.")
              .WithLabels({})),
      requests_waiting(registry
                           .AddGauge("sdm_requests_waiting",
                                     "Generate requests queued, not yet admitted to the batch.")
                           .WithLabels({})),
      batch_size(registry
                     .AddHistogram("sdm_batch_size", "Sequences in each engine step.",
                                   ExponentialBuckets(1, 2, 10))
                     .WithLabels({})),
      sessions(registry.AddGauge("sdm_sessions", "Sessions, by the tier holding their state.",
                                 {"tier"})),
      state_bytes(
          registry.AddGauge("sdm_state_bytes", "Bytes of session state, by tier.", {"tier"})),
      state_offloads(registry.AddCounter("sdm_state_offloads_total",
                                         "Session states moved down to a tier (host or disk).",
                                         {"tier"})),
      state_restores(registry.AddCounter(
          "sdm_state_restores_total",
          "Session states brought back to the engine, by the tier they came from.", {"tier"})),
      snapshot_errors(registry
                          .AddCounter("sdm_snapshot_errors_total",
                                      "Snapshots that failed to write, or failed their checks "
                                      "when read back.")
                          .WithLabels({})) {
  for (const absl::string_view tier : {kTierResident, kTierHost, kTierDisk}) {
    sessions.WithLabels({tier});
    state_bytes.WithLabels({tier});
  }
  for (const absl::string_view tier : {kTierHost, kTierDisk}) {
    state_offloads.WithLabels({tier});
    state_restores.WithLabels({tier});
  }
}

Counter& ServerMetrics::Request(absl::string_view method, absl::StatusCode code) {
  std::string code_name = absl::StatusCodeToString(code);
  if (code_name.empty()) code_name = "UNKNOWN";
  return requests.WithLabels({method, code_name});
}

}  // namespace sdm
