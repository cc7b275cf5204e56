// sdm-bench serve: a load generator for a running sdmserve server.
//
// `concurrency` workers each keep one Generate call in flight until `requests` calls have been
// made (or, with `duration`, until that much time has passed; calls in flight then finish, and
// each worker makes its first call whatever the time, so a run makes at least `concurrency`).
// Request i draws, from a generator seeded by (seed, i), its prompt length and max_tokens from
// their distributions, random prompt token ids (the tokenizer's ids other than BOS and EOS), and
// whether it reuses a session: with probability `session_reuse` it continues one of `sessions`
// sessions created at the start (a free one, chosen at random; a worker waits when all are busy,
// since a session runs one Generate at a time), otherwise it is a one-shot request. A reused
// session carries its earlier turns as history, which the server does not read again; the
// sessions are deleted at the end unless `keep_sessions`. Lengths are capped at the server's
// limits (ModelInfo.max_prompt_tokens less one for a BOS, ModelInfo.max_tokens_limit).
//
// Per request it measures, on the client's steady clock from just before the call is started:
//   - TTFT: until the first chunk that carries token ids;
//   - inter-token latency (ITL): each later chunk with n tokens, arriving g after the previous
//     chunk with tokens, contributes n samples of g / n (tokens of the first chunk beyond the
//     first one contribute none);
//   - end-to-end latency: until the call's status is received;
//   - the tokens it generated (Usage.generated_tokens) and fed.
// Throughput is the output tokens (and requests) of successful calls divided by the wall time of
// the measured phase (from its first call to its last status). Failed calls count by status code
// and contribute no samples. `warmup` calls run first and are not measured.
//
// Thread-safety: RunBenchServe uses `concurrency` threads internally (or, with async_calls, its
// own thread and gRPC's); the functions are otherwise thread-compatible.
#ifndef SDMSERVE_CLIENT_BENCH_SERVE_H_
#define SDMSERVE_CLIENT_BENCH_SERVE_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/cli.h"
#include "client/connection.h"
#include "client/distribution.h"
#include "client/latency_stats.h"
#include "nlohmann/json.hpp"
#include "sdm/v1/sdm.grpc.pb.h"

namespace sdm::client {

struct BenchServeOptions {
  int64_t concurrency = 1;
  int64_t requests = 100;                          // ignored when duration > 0
  absl::Duration duration = absl::ZeroDuration();  // > 0: run this long instead
  Distribution prompt_tokens = Distribution::Fixed(32);
  Distribution max_tokens = Distribution::Fixed(64);
  double session_reuse = 0;  // in [0, 1]
  int64_t sessions = 4;      // >= 1 when session_reuse > 0
  uint64_t seed = 1;
  int64_t warmup = 0;
  double temperature = 0;  // sampling of every request (0: greedy)
  // Every request generates its planned max_tokens (SamplingParams.ignore_eos): the planned
  // lengths are the workload, which EOS would otherwise cut short by the model's chance.
  bool ignore_eos = true;
  // One thread keeps the calls in flight on gRPC's callback API instead of `concurrency`
  // threads each making one call at a time (for bursts of many calls: client threads then do not
  // compete with the server for the CPU). One-shot calls only (session_reuse must be 0).
  bool async_calls = false;
  std::string session_prefix;  // ids are PREFIX-0 ... PREFIX-(K-1); empty: bench-<random hex>
  bool keep_sessions = false;
};

// The timing of one stream, from chunk arrival times (seconds since the call started) and the
// number of token ids each chunk carried.
struct StreamTiming {
  double ttft = -1;         // -1: no chunk carried tokens
  std::vector<double> itl;  // per token, as described above
};
StreamTiming TimeStream(absl::Span<const std::pair<double, int64_t>> chunks);

// One measured call.
struct RequestRecord {
  grpc::StatusCode code = grpc::StatusCode::OK;
  bool reused_session = false;
  int64_t prompt_tokens = 0;     // Usage.prompt_tokens (ids sent when the call failed)
  int64_t history_tokens = 0;    // Usage.history_tokens
  int64_t generated_tokens = 0;  // Usage.generated_tokens
  double ttft = -1;              // seconds; -1: none
  double e2e = 0;                // seconds
};

struct BenchServeResult {
  std::string host;
  std::string model;          // ModelInfo.name
  std::string model_summary;  // ModelInfo.summary
  BenchServeOptions options;
  double wall_seconds = 0;
  int64_t requests = 0;  // measured calls, ok or not
  int64_t ok = 0;
  std::map<std::string, int64_t> errors_by_code;  // code name -> calls
  int64_t reused = 0;                             // ok calls that continued a session
  int64_t output_tokens = 0;
  int64_t prompt_tokens = 0;
  int64_t history_tokens = 0;  // summed over ok calls
  double output_tokens_per_s = 0;
  double requests_per_s = 0;
  double prompt_tokens_per_s = 0;
  LatencySummary ttft_ms;
  LatencySummary itl_ms;
  LatencySummary e2e_ms;
  // Calls that ended with an error: the time from the call to its final status (under overload,
  // how fast the server refuses).
  LatencySummary failed_e2e_ms;
};

// Totals, rates and latency summaries (in milliseconds) of measured calls.
BenchServeResult Aggregate(absl::Span<const RequestRecord> records, std::vector<double> itl_seconds,
                           double wall_seconds);

// Checks the options. INVALID_ARGUMENT names the offending one.
absl::Status ValidateOptions(const BenchServeOptions& options);

// Runs the benchmark against `stub` (thread-safe, shared by the workers). Setup failures
// (GetModelInfo, CreateSession) are returned with their gRPC code and message, once the sessions
// created before a failed CreateSession are deleted (every one tried, even with keep_sessions;
// each deletion that fails is logged); failures of the measured calls are counted in the result.
// Progress lines go to `log`.
absl::StatusOr<BenchServeResult> RunBenchServe(sdm::v1::SdmService::StubInterface& stub,
                                               const ConnectionOptions& connection,
                                               const BenchServeOptions& options, std::ostream& log);

// The report: configuration, throughput and a latency table (mean, p50, p90, p99, max).
std::string FormatReport(const BenchServeResult& result);

// The same as JSON: {"config": {...}, "wall_seconds", "requests": {"total", "ok", "errors":
// {CODE: n}, "reused_session"}, "tokens": {...}, "throughput": {...}, "ttft_ms": {...},
// "itl_ms": {...}, "e2e_ms": {...}}; a latency summary is {"count", "mean", "min", "p50",
// "p90", "p99", "max"} with null for NaN.
nlohmann::json ToJson(const BenchServeResult& result);

// `sdm-bench serve [flags]` / `sdm-bench-serve [flags]`: parses the flags (--help lists them),
// runs, prints the report to stdout and writes --json FILE. Progress lines and errors go to
// stderr; with --json - the report does too, so that stdout holds the JSON document alone. Exit
// status 0, 1 (a setup call failed, or every measured call failed), 2 (usage).
int RunBenchServeCommand(const std::vector<std::string>& args, const ClientIo& io);

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_BENCH_SERVE_H_
