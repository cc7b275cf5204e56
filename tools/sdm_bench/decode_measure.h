// The measurement half of `sdm-bench decode` (decode_benchmark.h states the protocol): bringing
// sessions to a context by real prefill, timing interleaved decode steps, and timing OpenBLAS
// sgemm on a step's GEMM shapes. No byte model and no report here: callers turn the timings
// into rows (byte_model.h, decode_report.h).
//
// Thread-compatible: a ModelRun and its engine are used by one thread at a time.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_DECODE_MEASURE_H_
#define SDMSERVE_TOOLS_SDM_BENCH_DECODE_MEASURE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "nlohmann/json.hpp"
#include "state_store/session_state.h"
#include "tools/sdm_bench/decode_benchmark.h"

namespace sdm::bench {

// One dense layer of the decode step, y[B, n] = x[B, k] W^T, with W in the model's weights.
struct GemmShape {
  const float* w;
  int64_t n, k;
};

// The step's GEMMs (byte_model.h's IsDecodeGemm) with their weights.
std::vector<GemmShape> DecodeGemms(const Model& model);

// OpenBLAS sgemm rate (GFLOP/s) on exactly `gemms` at batch `b` with `threads` OpenBLAS threads
// (the CPU engine sets OpenBLAS to one thread for its own calls; the previous setting is restored
// after): one warm-up round, then rounds until at least 3 and 0.5 s (at most 30).
double MeasureSgemmRate(const std::vector<GemmShape>& gemms, int64_t b, int threads);

// The largest number of sessions of `state_bytes` each that fit in `budget_gb` (int32 max when
// a session holds nothing).
int64_t MaxBatch(double budget_gb, double state_bytes);

// One model being measured: its engine and sessions. Members are declared in the order that
// destruction needs: the sessions (pool, base) after the engine, so that they go first while
// the engine's device memory they came from still exists.
struct ModelRun {
  const BenchModel* spec = nullptr;
  std::shared_ptr<const Model> model;
  std::unique_ptr<Engine> engine;
  std::vector<GemmShape> gemms;
  std::unique_ptr<SessionState> base;  // CPU: the one prefilled session, cloned per batch
  // CUDA: sessions each prefilled on the device; a batch of B decodes the first B.
  std::vector<std::unique_ptr<SessionState>> pool;
  bool pool_limited = false;  // the device's session memory ran out once: the pool only shrinks
  std::string pool_limit;     // why
  std::map<int64_t, double> sgemm_gflops;  // by batch (CPU only)
  std::mt19937 rng;
  double state_bytes = 0;  // per session at the current context
  int64_t fit = 0;         // the largest batch whose state fits the budget (capped)
};

// CPU: brings run.base to `ctx` tokens by real prefill of random tokens (continuing from where it
// is) and appends a record of it to `prefill_log`.
absl::Status PrefillBase(ModelRun& run, int64_t ctx, nlohmann::json& prefill_log);

// CUDA: brings the first `target` sessions of the pool (created as needed) to `ctx` tokens, each
// by its own prefill on the device. When the device's session memory runs out, the pool keeps the
// sessions before the one that failed, less one more (headroom for the decode steps' new SDM rows
// and KV pages), and stays limited from then on (run.pool_limited, run.pool_limit).
absl::Status FillPool(ModelRun& run, int64_t ctx, int64_t target, nlohmann::json& prefill_log);

// One model at one batch size, within a joint measurement.
struct Point {
  ModelRun* run;
  int64_t batch;
};

// What MeasureTogether saw of one point.
struct PointTiming {
  Point point;
  std::vector<double> step_seconds;  // the timed steps, in order
  EngineProfile profile;             // the engine's profile over the timed steps
};

// Measures every point at context `ctx` together: on the CPU each model's base session is cloned
// `batch` times (on CUDA the pool's first `batch` sessions decode; the caller made sure there
// are that many), then the models' decode steps alternate (`warmup` untimed rounds, then `steps`
// timed rounds: one step of each model in turn, one random token per session), so that the load
// other processes put on a shared machine falls on all of them alike. On the CPU it first times
// sgemm at each point's batch with `sgemm_threads` OpenBLAS threads (once per run and batch, into
// run.sgemm_gflops). One timing per point, in order.
absl::StatusOr<std::vector<PointTiming>> MeasureTogether(const std::vector<Point>& points,
                                                         int64_t ctx, int warmup, int steps,
                                                         bool cuda, int sgemm_threads);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_DECODE_MEASURE_H_
