// Every metric the server exports, declared in one place with its name, unit, labels and help
// (docs/api.md lists them for operators). The metrics are prometheus-cpp's, registered in a
// prometheus::Registry that the server renders on /metrics (server/metrics/exposition.h). Names
// follow Prometheus conventions: base units in the name (_seconds, _bytes), counters ending in
// _total, the "sdm_" prefix.
//
//   sdm_requests_total{method,code}        counter    RPCs finished, by method and gRPC code
//   sdm_tenant_limit_refusals_total{tenant,limit}
//                                          counter    calls refused by a tenant limit
//   sdm_tenant_requests{tenant}            gauge      a tenant's Generate calls waiting or
//                                                     running
//   sdm_prompt_tokens_total                counter    prompt tokens fed to the model
//   sdm_history_tokens_total               counter    history tokens reused from session state
//   sdm_generated_tokens_total             counter    tokens generated
//   sdm_time_to_first_token_seconds        histogram  Generate start -> first token sent
//   sdm_inter_token_latency_seconds        histogram  between consecutive tokens of a stream
//   sdm_request_duration_seconds{method}   histogram  end-to-end RPC latency
//   sdm_requests_running                   gauge      sequences in the running batch
//   sdm_requests_waiting                   gauge      requests queued for admission
//   sdm_batch_size                         histogram  sequences per engine step
//   sdm_http_connections_refused_total     counter    HTTP API connections answered 503: no
//                                                     thread took them (--http_max_connections)
//   sdm_engine_step_failures_total         counter    engine steps that failed
//   sdm_sessions{tier}                     gauge      sessions by tier (resident, host, disk)
//   sdm_state_bytes{tier}                  gauge      bytes of session state by tier
//   sdm_state_offloads_total{tier}         counter    sessions moved down to a tier
//   sdm_state_restores_total{tier}         counter    sessions brought back from a tier
//   sdm_snapshot_errors_total              counter    snapshot writes that failed (every try)
//                                                     and snapshots that failed their checks
//   sdm_persist_failures_total             counter    sessions whose writes began failing
//   sdm_persist_writes_total               counter    writes of changed sessions
//   sdm_persist_deltas_total               counter    of those, deltas appended to a log
//   sdm_persist_bytes_total                counter    their bytes
//   sdm_sessions_unpersisted               gauge      sessions whose last turn is not on disk
//   sdm_persist_syncs_total                counter    background fsyncs (--persist_sync=write)
//   sdm_sessions_unsynced                  gauge      sessions written but not fsynced yet
//   sdm_persistence_healthy                gauge      1 while sessions can be written, else 0
//   sdm_persist_oldest_pending_seconds     gauge      age of the oldest write in progress or
//                                                     turn waiting for its write
//   sdm_resumes_staged_total               counter    GPU: sessions converted for their upload
//                                                     when their request was submitted
//   sdm_resumes_from_staged_total          counter    of those, uploaded from that image
//   sdm_resume_staging_refused_total       counter    sessions not converted ahead (no room)
//   sdm_resume_staging_bytes               gauge      page-locked bytes held for them
//   sdm_resumes_prefetched_total           counter    of the staged, also copied to the device
//                                                     ahead of their step
//   sdm_resume_prefetch_bytes              gauge      device bytes held for those copies
//
// Labelled series are reached through the functions below, so that label names are spelled only
// in server_metrics.cc (prometheus-cpp families do not declare their label names: a misspelt
// name would silently start a new series).
//
// Help texts are one line without backslashes: prometheus-cpp 1.0 writes HELP lines unescaped.
//
// Thread-safety: everything is thread-safe. The unlabelled metrics are references to keep; the
// labelled accessors look the series up under the family's lock (prometheus-cpp), and the
// references they return stay valid for the registry's lifetime.
#ifndef SDMSERVE_SERVER_METRICS_SERVER_METRICS_H_
#define SDMSERVE_SERVER_METRICS_SERVER_METRICS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace sdm {

struct ResumeStagingStats;  // engine/engine.h

// Values of the `tier` label, as the API names tiers (sdm.v1.Tier).
inline constexpr absl::string_view kTierResident = "resident";
inline constexpr absl::string_view kTierHost = "host";
inline constexpr absl::string_view kTierDisk = "disk";
// Not an API tier: the resident sessions an accelerator backend holds in device memory, and
// their device bytes (state_store/session_store.h, the device tier). 0 on the CPU backend.
inline constexpr absl::string_view kTierDevice = "device";

class ServerMetrics {
 public:
  // Registers the families in `registry`, which must outlive this object, and creates the tier
  // series at 0 so that they are exported before the first session. Registering twice in one
  // registry is a programming error (prometheus-cpp throws on a registry created with
  // InsertBehavior::Throw, as the server's is; its default, Merge, shares the families).
  explicit ServerMetrics(prometheus::Registry& registry);

  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // The counter of one finished RPC: `method` is the RPC name ("Generate"), the code label the
  // canonical code name ("OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a code outside the enum).
  prometheus::Counter& Request(absl::string_view method, absl::StatusCode code);
  // The duration histogram of one RPC method.
  prometheus::Histogram& RequestDuration(absl::string_view method);
  // Calls of `tenant` refused by its `limit` (server/tenant_limits.h: "max_requests",
  // "max_sessions", "max_state_bytes"). Tenants are the key file's, so the series are few.
  prometheus::Counter& TenantLimitRefusals(absl::string_view tenant, absl::string_view limit);
  // A tenant's Generate calls waiting or running (set at scrapes from the scheduler's counts).
  prometheus::Gauge& TenantRequests(absl::string_view tenant);
  // Per tier (kTierResident, kTierHost, kTierDisk, and kTierDevice for the first two): sessions
  // and state bytes held there, and
  // session states moved down to it or brought back from it.
  prometheus::Gauge& Sessions(absl::string_view tier);
  prometheus::Gauge& StateBytes(absl::string_view tier);
  prometheus::Counter& StateOffloads(absl::string_view tier);
  prometheus::Counter& StateRestores(absl::string_view tier);

  // The unlabelled metrics.
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& history_tokens;
  prometheus::Counter& generated_tokens;
  prometheus::Histogram& time_to_first_token;
  prometheus::Histogram& inter_token_latency;
  prometheus::Gauge& requests_running;
  prometheus::Gauge& requests_waiting;
  prometheus::Histogram& batch_size;
  prometheus::Counter& engine_step_failures;
  prometheus::Counter& http_connections_refused;
  prometheus::Counter& snapshot_errors;
  prometheus::Counter& persist_failures;
  prometheus::Counter& persist_writes;
  prometheus::Counter& persist_deltas;
  prometheus::Counter& persist_bytes;
  prometheus::Gauge& sessions_unpersisted;
  prometheus::Counter& persist_syncs;
  prometheus::Counter& persist_waits;
  prometheus::Counter& persist_wait_seconds;
  prometheus::Gauge& sessions_unsynced;
  prometheus::Gauge& persistence_healthy;
  prometheus::Gauge& persist_oldest_pending_seconds;
  // The process heap at the last scrape (base/heap.h, GetHeapUsage).
  prometheus::Gauge& heap_in_use_bytes;
  prometheus::Gauge& heap_system_bytes;
  // Times HeapTrimmer handed the heap's free pages back (base/heap.h), counted at scrapes.
  prometheus::Counter& heap_trims;
  // Resumes staged ahead of their step (Engine::resume_staging_stats), counted at scrapes.
  prometheus::Counter& resumes_staged;
  prometheus::Counter& resumes_from_staged;
  prometheus::Counter& resume_staging_refused;
  prometheus::Gauge& resume_staging_bytes;
  prometheus::Counter& resumes_prefetched;
  prometheus::Gauge& resume_prefetch_bytes;

  // The six above from the engine's counts `now` and those of the previous scrape, `before`: each
  // counter grows by what its count grew (a count that went down, as after an engine restart,
  // adds nothing), the gauges take `now`'s bytes. Not thread-safe: the caller serialises scrapes.
  void RecordResumeStaging(const ResumeStagingStats& now, const ResumeStagingStats& before);

 private:
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Counter>& tenant_limit_refusals_;
  prometheus::Family<prometheus::Gauge>& tenant_requests_;
  prometheus::Family<prometheus::Histogram>& request_duration_;
  prometheus::Family<prometheus::Gauge>& sessions_;
  prometheus::Family<prometheus::Gauge>& state_bytes_;
  prometheus::Family<prometheus::Counter>& state_offloads_;
  prometheus::Family<prometheus::Counter>& state_restores_;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_METRICS_SERVER_METRICS_H_
