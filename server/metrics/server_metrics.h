// Every metric the server exports, declared in one place with its name, unit and labels
// (docs/api.md lists them for operators). Names follow Prometheus conventions: base units in the
// name (_seconds, _bytes), counters ending in _total, the "sdm_" prefix.
//
//   sdm_requests_total{method,code}        counter    RPCs finished, by method and gRPC code
//   sdm_prompt_tokens_total                counter    prompt tokens fed to the model
//   sdm_history_tokens_total               counter    history tokens reused from session state
//   sdm_generated_tokens_total             counter    tokens generated
//   sdm_time_to_first_token_seconds        histogram  Generate start -> first token sent
//   sdm_inter_token_latency_seconds        histogram  between consecutive tokens of a stream
//   sdm_request_duration_seconds{method}   histogram  end-to-end RPC latency
//   sdm_requests_running                   gauge      sequences in the running batch
//   sdm_requests_waiting                   gauge      requests queued for admission
//   sdm_batch_size                         histogram  sequences per engine step
//   sdm_sessions{tier}                     gauge      sessions by tier (resident, host, disk)
//   sdm_state_bytes{tier}                  gauge      bytes of session state by tier
//   sdm_state_offloads_total{tier}         counter    sessions moved down to a tier
//   sdm_state_restores_total{tier}         counter    sessions brought back from a tier
//   sdm_snapshot_errors_total              counter    snapshots that failed their checks
//
// Thread-safety: the members are thread-safe metrics (server/metrics/metrics.h).
#ifndef SDMSERVE_SERVER_METRICS_SERVER_METRICS_H_
#define SDMSERVE_SERVER_METRICS_SERVER_METRICS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/metrics/metrics.h"

namespace sdm {

// Values of the `tier` label, as the API names tiers (sdm.v1.Tier).
inline constexpr absl::string_view kTierResident = "resident";
inline constexpr absl::string_view kTierHost = "host";
inline constexpr absl::string_view kTierDisk = "disk";

struct ServerMetrics {
  // Registers the families in `registry` (once per registry), and creates the tier series at 0
  // so that they are exported before the first session.
  explicit ServerMetrics(MetricsRegistry& registry);

  // The counter of one finished RPC: `method` is the RPC name ("Generate"), the code label the
  // canonical code name ("OK", "INVALID_ARGUMENT", ...).
  Counter& Request(absl::string_view method, absl::StatusCode code);

  Family<Counter>& requests;
  Counter& prompt_tokens;
  Counter& history_tokens;
  Counter& generated_tokens;
  Histogram& time_to_first_token;
  Histogram& inter_token_latency;
  Family<Histogram>& request_duration;
  Gauge& requests_running;
  Gauge& requests_waiting;
  Histogram& batch_size;
  Family<Gauge>& sessions;
  Family<Gauge>& state_bytes;
  Family<Counter>& state_offloads;
  Family<Counter>& state_restores;
  Counter& snapshot_errors;
};

}  // namespace sdm

#endif  // SDMSERVE_SERVER_METRICS_SERVER_METRICS_H_
