#include "server/metrics/server_metrics.h"

#include <string>
#include <utility>

#include "engine/engine.h"

namespace sdm {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// Latency buckets, in seconds. Time to first token includes queueing and prefill; inter-token
// latency is one decode step (sub-millisecond to a few hundred milliseconds); a request's
// duration spans a Tokenize call to a long generation.
const prometheus::Histogram::BucketBoundaries& TimeToFirstTokenBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  return kBuckets;
}

const prometheus::Histogram::BucketBoundaries& InterTokenLatencyBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
  return kBuckets;
}

const prometheus::Histogram::BucketBoundaries& RequestDurationBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
  return kBuckets;
}

// Sequences per step: powers of two up to 512.
const prometheus::Histogram::BucketBoundaries& BatchSizeBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {1,  2,  4,   8,   16,
                                                                   32, 64, 128, 256, 512};
  return kBuckets;
}

prometheus::Labels TierLabel(absl::string_view tier) { return {{"tier", std::string(tier)}}; }

}  // namespace

ServerMetrics::ServerMetrics(prometheus::Registry& registry)
    : prompt_tokens(BuildCounter()
                        .Name("sdm_prompt_tokens_total")
                        .Help("Prompt tokens fed to the model (including an added BOS).")
                        .Register(registry)
                        .Add({})),
      history_tokens(BuildCounter()
                         .Name("sdm_history_tokens_total")
                         .Help("Tokens of history carried by session state when a Generate "
                               "started: reused, not read again.")
                         .Register(registry)
                         .Add({})),
      generated_tokens(BuildCounter()
                           .Name("sdm_generated_tokens_total")
                           .Help("Tokens generated.")
                           .Register(registry)
                           .Add({})),
      time_to_first_token(BuildHistogram()
                              .Name("sdm_time_to_first_token_seconds")
                              .Help("Time from the start of a Generate call to its first token, "
                                    "queueing and prefill included.")
                              .Register(registry)
                              .Add({}, TimeToFirstTokenBuckets())),
      inter_token_latency(BuildHistogram()
                              .Name("sdm_inter_token_latency_seconds")
                              .Help("Time between consecutive generated tokens of one stream.")
                              .Register(registry)
                              .Add({}, InterTokenLatencyBuckets())),
      requests_running(BuildGauge()
                           .Name("sdm_requests_running")
                           .Help("Generate requests in the running batch.")
                           .Register(registry)
                           .Add({})),
      requests_waiting(BuildGauge()
                           .Name("sdm_requests_waiting")
                           .Help("Generate requests queued, not yet admitted to the batch.")
                           .Register(registry)
                           .Add({})),
      batch_size(BuildHistogram()
                     .Name("sdm_batch_size")
                     .Help("Sequences in each engine step.")
                     .Register(registry)
                     .Add({}, BatchSizeBuckets())),
      engine_step_failures(BuildCounter()
                               .Name("sdm_engine_step_failures_total")
                               .Help("Engine steps that failed: their requests ended with the "
                                     "step's error (the log says why, once per cause).")
                               .Register(registry)
                               .Add({})),
      http_connections_refused(BuildCounter()
                                   .Name("sdm_http_connections_refused_total")
                                   .Help("HTTP API connections answered 503 because no thread "
                                         "took them in time (--http_max_connections).")
                                   .Register(registry)
                                   .Add({})),
      snapshot_errors(BuildCounter()
                          .Name("sdm_snapshot_errors_total")
                          .Help("Snapshots that failed to write, or failed their checks when read "
                                "back.")
                          .Register(registry)
                          .Add({})),
      persist_failures(BuildCounter()
                           .Name("sdm_persist_failures_total")
                           .Help("Sessions whose snapshot writes began failing (once per session "
                                 "and episode; retries count in sdm_snapshot_errors_total).")
                           .Register(registry)
                           .Add({})),
      persist_writes(BuildCounter()
                         .Name("sdm_persist_writes_total")
                         .Help("Writes of changed sessions to the state directory: snapshots "
                               "and deltas (--persist).")
                         .Register(registry)
                         .Add({})),
      persist_deltas(BuildCounter()
                         .Name("sdm_persist_deltas_total")
                         .Help("Of sdm_persist_writes_total, deltas appended to a session's log.")
                         .Register(registry)
                         .Add({})),
      persist_bytes(BuildCounter()
                        .Name("sdm_persist_bytes_total")
                        .Help("Bytes written by the writes counted in sdm_persist_writes_total.")
                        .Register(registry)
                        .Add({})),
      sessions_unpersisted(BuildGauge()
                               .Name("sdm_sessions_unpersisted")
                               .Help("Sessions whose latest turn is not in the state directory "
                                     "yet.")
                               .Register(registry)
                               .Add({})),
      persist_syncs(BuildCounter()
                        .Name("sdm_persist_syncs_total")
                        .Help("Files fsynced by the background syncer (--persist_sync=write).")
                        .Register(registry)
                        .Add({})),
      persist_waits(BuildCounter()
                        .Name("sdm_persist_waits_total")
                        .Help("Turns whose acknowledgement waited for their write to the state "
                              "directory (--persist turn).")
                        .Register(registry)
                        .Add({})),
      persist_wait_seconds(BuildCounter()
                               .Name("sdm_persist_wait_seconds_total")
                               .Help("Seconds the turns counted in sdm_persist_waits_total "
                                     "waited for their writes, in all.")
                               .Register(registry)
                               .Add({})),
      sessions_unsynced(BuildGauge()
                            .Name("sdm_sessions_unsynced")
                            .Help("Sessions written to the state directory but not fsynced yet "
                                  "(--persist_sync=write).")
                            .Register(registry)
                            .Add({})),
      persistence_healthy(BuildGauge()
                              .Name("sdm_persistence_healthy")
                              .Help("1 while session state can be written to the state "
                                    "directory, 0 while writes fail.")
                              .Register(registry)
                              .Add({})),
      persist_oldest_pending_seconds(
          BuildGauge()
              .Name("sdm_persist_oldest_pending_seconds")
              .Help("Age of the oldest unfinished write to the state directory, or of the oldest "
                    "turn waiting for its write; 0: none. A stalled volume makes it grow.")
              .Register(registry)
              .Add({})),
      heap_in_use_bytes(BuildGauge()
                            .Name("sdm_heap_in_use_bytes")
                            .Help("Bytes the process heap has allocated and not freed "
                                  "(glibc mallinfo2; 0 elsewhere).")
                            .Register(registry)
                            .Add({})),
      heap_system_bytes(BuildGauge()
                            .Name("sdm_heap_system_bytes")
                            .Help("Bytes the process heap holds from the system: arena pages "
                                  "and blocks mapped on their own (glibc mallinfo2).")
                            .Register(registry)
                            .Add({})),
      heap_trims(BuildCounter()
                     .Name("sdm_heap_trims_total")
                     .Help("Times the heap's free pages were handed back to the system "
                           "(malloc_trim; --malloc_trim_interval).")
                     .Register(registry)
                     .Add({})),
      resumes_staged(BuildCounter()
                         .Name("sdm_resumes_staged_total")
                         .Help("GPU: sessions converted for their upload when their request was "
                               "submitted, not inside the step that resumes them "
                               "(--resume_staging).")
                         .Register(registry)
                         .Add({})),
      resumes_from_staged(BuildCounter()
                              .Name("sdm_resumes_from_staged_total")
                              .Help("Of sdm_resumes_staged_total, resumes whose step uploaded "
                                    "that image (the rest changed or ended first).")
                              .Register(registry)
                              .Add({})),
      resume_staging_refused(BuildCounter()
                                 .Name("sdm_resume_staging_refused_total")
                                 .Help("GPU: sessions not converted ahead because "
                                       "--resume_staging had no room (their step converted "
                                       "them).")
                                 .Register(registry)
                                 .Add({})),
      resume_staging_bytes(BuildGauge()
                               .Name("sdm_resume_staging_bytes")
                               .Help("Page-locked host memory held for sessions converted ahead, "
                                     "pooled buffers included (at most --resume_staging).")
                               .Register(registry)
                               .Add({})),
      resumes_prefetched(BuildCounter()
                             .Name("sdm_resumes_prefetched_total")
                             .Help("GPU: of sdm_resumes_staged_total, sessions whose image was "
                                   "also copied to the device ahead of their step "
                                   "(--resume_prefetch).")
                             .Register(registry)
                             .Add({})),
      resume_prefetch_bytes(BuildGauge()
                                .Name("sdm_resume_prefetch_bytes")
                                .Help("Device memory held for images copied ahead, pooled "
                                      "buffers included (at most --resume_prefetch).")
                                .Register(registry)
                                .Add({})),
      requests_(BuildCounter()
                    .Name("sdm_requests_total")
                    .Help("RPCs finished, by method and gRPC status code.")
                    .Register(registry)),
      tenant_limit_refusals_(BuildCounter()
                                 .Name("sdm_tenant_limit_refusals_total")
                                 .Help("Calls refused by a tenant limit, by tenant and limit.")
                                 .Register(registry)),
      tenant_requests_(BuildGauge()
                           .Name("sdm_tenant_requests")
                           .Help("Generate calls of a tenant waiting or running.")
                           .Register(registry)),
      request_duration_(BuildHistogram()
                            .Name("sdm_request_duration_seconds")
                            .Help("End-to-end duration of RPCs, by method.")
                            .Register(registry)),
      sessions_(BuildGauge()
                    .Name("sdm_sessions")
                    .Help("Sessions, by the tier holding their state.")
                    .Register(registry)),
      state_bytes_(BuildGauge()
                       .Name("sdm_state_bytes")
                       .Help("Bytes of session state, by tier.")
                       .Register(registry)),
      state_offloads_(BuildCounter()
                          .Name("sdm_state_offloads_total")
                          .Help("Session states moved down to a tier (host or disk).")
                          .Register(registry)),
      state_restores_(
          BuildCounter()
              .Name("sdm_state_restores_total")
              .Help("Session states brought back to the engine, by the tier they came from.")
              .Register(registry)) {
  for (const absl::string_view tier : {kTierResident, kTierHost, kTierDisk, kTierDevice}) {
    Sessions(tier);
    StateBytes(tier);
  }
  for (const absl::string_view tier : {kTierHost, kTierDisk}) {
    StateOffloads(tier);
    StateRestores(tier);
  }
}

prometheus::Counter& ServerMetrics::Request(absl::string_view method, absl::StatusCode code) {
  std::string code_name = absl::StatusCodeToString(code);
  if (code_name.empty()) code_name = "UNKNOWN";
  return requests_.Add({{"method", std::string(method)}, {"code", std::move(code_name)}});
}

prometheus::Counter& ServerMetrics::TenantLimitRefusals(absl::string_view tenant,
                                                        absl::string_view limit) {
  return tenant_limit_refusals_.Add(
      {{"tenant", std::string(tenant)}, {"limit", std::string(limit)}});
}

prometheus::Gauge& ServerMetrics::TenantRequests(absl::string_view tenant) {
  return tenant_requests_.Add({{"tenant", std::string(tenant)}});
}

prometheus::Histogram& ServerMetrics::RequestDuration(absl::string_view method) {
  return request_duration_.Add({{"method", std::string(method)}}, RequestDurationBuckets());
}

prometheus::Gauge& ServerMetrics::Sessions(absl::string_view tier) {
  return sessions_.Add(TierLabel(tier));
}

prometheus::Gauge& ServerMetrics::StateBytes(absl::string_view tier) {
  return state_bytes_.Add(TierLabel(tier));
}

prometheus::Counter& ServerMetrics::StateOffloads(absl::string_view tier) {
  return state_offloads_.Add(TierLabel(tier));
}

prometheus::Counter& ServerMetrics::StateRestores(absl::string_view tier) {
  return state_restores_.Add(TierLabel(tier));
}

void ServerMetrics::RecordResumeStaging(const ResumeStagingStats& now,
                                        const ResumeStagingStats& before) {
  const auto grow = [](prometheus::Counter& counter, int64_t count, int64_t previous) {
    if (count > previous) counter.Increment(static_cast<double>(count - previous));
  };
  grow(resumes_staged, now.staged, before.staged);
  grow(resumes_from_staged, now.used, before.used);
  grow(resume_staging_refused, now.refused, before.refused);
  resume_staging_bytes.Set(static_cast<double>(now.held_bytes));
  grow(resumes_prefetched, now.prefetched, before.prefetched);
  resume_prefetch_bytes.Set(static_cast<double>(now.prefetch_held_bytes));
}

}  // namespace sdm
