// `sdm-bench decode`: steady-state decode throughput of SDM models against their full-attention
// twins, on the engine directly (no server), with random weights built in memory.
//
// The parts: this file (the models measured, the run's sequence and its record),
// decode_measure.h (prefill and the timed steps), byte_model.h (the bytes and FLOPs a step must
// move: the bandwidth floor), decode_summary.h (pair ratios from the rows) and decode_report.h
// (terminal table, JSON, CSV, report.md and plots).
//
// Models are measured in groups: a pair (an SDM model and its twin, which differs only in its
// global layers: every SDM layer becomes a full-attention layer, the SWA layers, MLPs, norms and
// embeddings are the same), or the explicit list given by --presets. Within a group the models
// are measured interleaved, context by context, batch by batch and step by step, so that the ratios
// between them come from the same seconds of a shared, noisy machine.
//
// Protocol (docs/benchmarks.md):
//  1. The machine's memory bandwidth is measured (multi-threaded memcpy and streaming read over
//     buffers far larger than the caches), at the start, before each group and at the end of the
//     run; the best read rate is the reference.
//  2. For each context length in increasing order, one session per model is prefilled with random
//     tokens up to that length: real prefill (the engine's chunked Prefill), continuing from the
//     previous length. There is no synthetic fill.
//  3. For each batch size B that fits the state budget, each model's session is cloned B times (a
//     deep copy: the same state a real prefill of each would leave; with fit_batch, a last round
//     puts each model at its own largest batch in the budget); then the models' steps
//     alternate (one step of each model in turn, one token per session): `warmup` untimed
//     rounds, then `steps` timed rounds, so that load from other processes falls on all models
//     alike. The median and p90 step times, tokens/s (B / median) and the per-mixer profile are
//     reported. A pair holds both models' clones at once: up to twice the (per-model) budget.
//  4. Each step's bytes are modelled from the config: every weight read once per step as fp32 (the
//     CPU engine's format; the embedding table only for the B rows gathered unless it is tied to
//     the output), plus per session the K and V rows of the visible positions of each attention
//     layer (all of them for full attention, the window for SWA) and per SDM layer and head
//     (2W + R) rows of hd floats (W read and written, R read; docs/model-spec.md §9). Achieved
//     bandwidth = bytes / median step time, reported as a fraction of the best streaming-read
//     rate measured in the run (the step's bytes are reads; the copy rate is reported beside it).
//  5. The step's GEMMs are also timed alone with OpenBLAS at the same shapes; the step's FLOP rate
//     is reported as a fraction of that sgemm rate (the engine itself uses its batch-invariant
//     GEMM, kernels/cpu/gemm.h, so the fraction can exceed 1).
// A batch size is skipped when B sessions' state (SessionState::ResidentBytes after the prefill)
// would exceed the state budget; the largest batch that fits is reported for every context, and
// fit_batch measures it too (at most max_batch).
//
// On the CUDA engine (device kCuda; docs/benchmarks.md, "CUDA (no figures yet)") three things
// differ:
//  - the bandwidth reference is the device's own device-to-device copy rate (cudaMemcpy between
//    two device buffers of at least 2 GiB, cudaEvent timing, median of 10 copies, read + write
//    bytes), and bytes are modelled at the CUDA engine's formats (bf16 matrices, KV and SDM rows;
//    fp32 vectors); there is no sgemm comparison;
//  - the models of a group are measured one after the other, each with the device to itself (a
//    pair's batch-64 states do not fit in one device's memory together; a dedicated device has
//    no other tenants whose load interleaving would have to share out);
//  - sessions are not cloned: a clone is a host copy (SessionState::Clone needs the host layers),
//    and B host copies of a long context would hold B x the state in host RAM. Instead each model
//    keeps a pool of sessions, each brought to every context by its own real prefill on the
//    device, whose host layers stay empty (device residency: the device copy is the truth). A
//    batch of B uses the first B sessions of the pool. The pool is as large as the largest batch
//    asked for; when the device's session memory runs out during a prefill, the pool keeps the
//    sessions that fit, less one (headroom for the decode steps' new rows and pages), and larger
//    batches are skipped with the reason. Positions advance by warmup + steps per measurement, so
//    a batch measured after another at the same context starts that many tokens later.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_DECODE_BENCHMARK_H_
#define SDMSERVE_TOOLS_SDM_BENCH_DECODE_BENCHMARK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/engine.h"
#include "engine/model_config.h"

namespace sdm::bench {

// One model of a benchmark group.
struct BenchModel {
  std::string name;  // preset name, or the pair's name for a model built in the tool
  std::string role;  // "sdm", "attention" (the twin), or "model" (explicit --presets list)
  ModelConfig config;
  CpuDecodeAttention cpu_attention = CpuDecodeAttention::kBlocked;  // EngineOptions' kernel
};

// Models measured together (interleaved) over the same contexts.
struct BenchGroup {
  std::string name;  // the pair's name, or "presets"
  std::vector<BenchModel> models;
  std::vector<int64_t> default_contexts;
  // For a pair: how the twin was checked to differ from the SDM model only in its global layers.
  std::string twin_check;
  std::string description;
};

// Names accepted by --pair.
std::vector<std::string> PairNames();

// The named pair with `overrides` (ApplyConfigOverrides assignments) applied to the SDM model
// before its twin is derived. For preset pairs (debug, flagship, 7b) it checks that the derived
// twin equals the named baseline preset.
absl::StatusOr<BenchGroup> NamedPair(absl::string_view name,
                                     const std::vector<std::string>& overrides);

// The SDM model's full-attention twin: every SDM layer becomes a full-attention layer; nothing
// else changes. Requires a finalized config.
absl::StatusOr<ModelConfig> FullAttentionTwin(const ModelConfig& sdm_config);

struct DecodeBenchOptions {
  EngineDevice device = EngineDevice::kAuto;  // resolved by ResolveBenchDevice (device_info.h)
  double device_state_gb = 0;          // CUDA: session-state memory (0: the engine's default share)
  std::vector<std::string> pairs;      // named pairs (see PairNames())
  std::vector<std::string> presets;    // an explicit group of presets (measured together)
  std::vector<std::string> overrides;  // --set key=value, applied to every model
  // CPU decode attention kernels: pairs use the first; a --presets group measures every model
  // with each (the kPerHead copy named "MODEL[per_head]").
  std::vector<CpuDecodeAttention> cpu_attention = {CpuDecodeAttention::kBlocked};
  DType cpu_dtype = EngineOptions{}.cpu_dtype;  // CPU: matrices and KV rows (EngineOptions)
  std::vector<int64_t> contexts;                // empty: each group's default contexts
  std::vector<int64_t> batches = {1, 4, 16};
  bool fit_batch = true;   // also measure the largest batch in the budget
  int64_t max_batch = 16;  // cap of the `fit` batch
  int steps = 10;
  int warmup = 2;
  int threads = 0;                                 // engine threads (0: one per hardware thread)
  int64_t prefill_chunk = 256;                     // the engine's prefill chunk (EngineOptions)
  bool cuda_graphs = EngineOptions{}.cuda_graphs;  // CUDA: decode steps as graphs (EngineOptions)
  double state_budget_gb = 4.0;  // per model (CPU; on CUDA the device's memory bounds the batch)
  uint64_t seed = 1;
  int64_t bandwidth_mb = 512;  // size of each buffer of the bandwidth measurement (CUDA: >= 2048)
  std::string json_path;       // empty: no JSON file
  std::string csv_path;        // empty: no CSV file
  std::string report_dir;      // empty: no report (report.md, results JSON/CSV, PNGs)
  std::string python = "/usr/bin/python3";
  std::string plot_script;   // empty: plot_decode.py next to the binary or in the source
  std::string command_line;  // recorded in the report
};

absl::Status RunDecodeBenchmark(const DecodeBenchOptions& options);

// `sdm-bench report --from FILE`: renders the outputs the options ask for (--json, --csv,
// --report) again from an earlier run's JSON document, with the pair summaries recomputed from
// its rows (new report layout or plots without measuring again). Only the output options and
// python/plot_script are used.
absl::Status RenderFromJson(const std::string& json_path, const DecodeBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_DECODE_BENCHMARK_H_
