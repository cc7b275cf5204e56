#include "tools/sdm_bench/decode_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/percentile.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/weight_spec.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/linear.h"
#include "nlohmann/json.hpp"
#include "tools/sdm_bench/byte_model.h"
#include "tools/sdm_bench/decode_measure.h"
#include "tools/sdm_bench/decode_report.h"
#include "tools/sdm_bench/decode_summary.h"
#include "tools/sdm_bench/device_info.h"
#include "tools/sdm_bench/progress.h"
#include "tools/sdm_bench/system_info.h"

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// ---- Models ----

// A CPU-sized model shaped like sdm_flagship: 3:1 SWA:global (SWA at 0-2 and 4-6, global at 3
// and 7), SWA window 1024 with as many KV heads as query heads, full attention with 8 query and 4
// KV heads (GQA, as the flagship's 16/8), and SDM layers with the flagship's per-head geometry
// (s = 256, 65,536 slots of hd = 1024, W = R = 128, learned M0, normalised readings, output gate).
absl::StatusOr<ModelConfig> CpuHybridConfig() {
  absl::StatusOr<ModelConfig> c = PresetConfig("sdm_flagship");
  if (!c.ok()) return c.status();
  c->dim = 1024;
  c->n_layers = 8;
  c->n_heads = 8;
  c->n_kv_heads = 4;
  c->swa_n_heads = 8;
  c->swa_n_kv_heads = 8;
  c->swa_window = 1024;
  c->attn_at = {};
  c->swa_at = {0, 1, 2, 4, 5, 6};
  c->sdm_at = {3, 7};
  c->sdm.num_heads = 1;
  if (auto s = FinalizeModelConfig(*c); !s.ok()) return s;
  return c;
}

struct PairSpec {
  const char* name;
  const char* sdm_preset;  // nullptr: built in the tool (CpuHybridConfig)
  const char* sdm_name;
  const char* twin_preset;  // the preset the derived twin must equal (nullptr: none)
  const char* twin_name;
  std::vector<int64_t> contexts;
  const char* description;
};

const std::vector<PairSpec>& Pairs() {
  static const auto* pairs = new std::vector<PairSpec>{
      {"tiny",
       "tiny",
       "tiny",
       nullptr,
       "tiny_attn",
       {16, 64},
       "test-sized (CI smoke test): 3 SWA layers + 1 SDM layer vs the same with full attention"},
      {"debug",
       "debug_sdm",
       "debug_sdm",
       "debug",
       "debug",
       {512, 2048, 8192},
       "debug presets: 4 full-attention + 4 SDM layers vs 8 full-attention layers (dim 1024)"},
      {"cpu_hybrid",
       nullptr,
       "cpu_hybrid_sdm",
       nullptr,
       "cpu_hybrid_attn",
       {2048, 8192, 32768},
       "CPU-sized flagship shape: dim 1024, 8 layers, SWA (window 1024) at 0-2 and 4-6, global "
       "layers at 3 and 7: SDM (1 head of 65,536 slots x 1024, W = R = 128) vs full attention "
       "(8 query / 4 KV heads)"},
      {"flagship",
       "sdm_flagship",
       "sdm_flagship",
       "baseline_1.4B",
       "baseline_1.4B",
       {1024, 4096, 16384, 32768, 131072},
       "the 1.4B flagship (18 SWA + 6 SDM layers) vs baseline_1.4B (18 SWA + 6 full attention)"},
      {"7b",
       "sdm_7B",
       "sdm_7B",
       "baseline_7B",
       "baseline_7B",
       {1024, 4096, 16384, 32768, 131072},
       "sdm_7B (24 SWA + 8 SDM layers) vs baseline_7B (24 SWA + 8 full attention)"},
  };
  return *pairs;
}

std::string LayerSummary(const ModelConfig& c) {
  int attn = 0, swa = 0, sdm = 0;
  for (LayerType t : c.layer_types) {
    attn += t == LayerType::kAttn;
    swa += t == LayerType::kSwa;
    sdm += t == LayerType::kSdm;
  }
  std::vector<std::string> parts;
  if (swa > 0) parts.push_back(absl::StrCat(swa, " swa"));
  if (attn > 0) parts.push_back(absl::StrCat(attn, " attn"));
  if (sdm > 0) parts.push_back(absl::StrCat(sdm, " sdm"));
  return absl::StrCat(c.n_layers, " layers: ", absl::StrJoin(parts, " + "));
}

// A model's entry in the run's record: its layers, parameter counts and the byte model's figures
// for one step (byte_model.h).
json ModelJson(const BenchModel& m, double elem, double row_elem) {
  const ParameterCounts p = CountParameters(m.config);
  const SdmGeometry sg = SdmGeometryOf(m.config);
  json j;
  j["name"] = m.name;
  j["role"] = m.role;
  j["layers"] = LayerSummary(m.config);
  j["dim"] = m.config.dim;
  j["parameters_total"] = p.total;
  j["parameters_without_m0"] = p.without_m0;
  j["parameters_m0"] = p.m0;
  j["weight_bytes_per_step"] = WeightBytesPerStep(m.config, elem).total();
  j["kv_bytes_per_token"] = KvBytesPerToken(m.config, elem);
  j["sdm_bytes_per_step_per_session"] = SessionBytesPerStep(m.config, 0, elem, row_elem).sdm;
  j["sdm_state_bytes_max"] = row_elem * static_cast<double>(SdmStateElements(m.config));
  j["sdm_heads"] = sg.heads;
  j["config"] = json::parse(ModelConfigToJson(m.config));
  return j;
}

// One result row: a point's timing joined with the byte model (bytes, achieved bandwidth), the
// FLOP model and the run's state (sgemm rate, state bytes, largest batch). The keys are
// RowKeys() (decode_report.h).
json ResultRow(const PointTiming& t, const std::string& group,
               const std::vector<std::string>& measured_with, int64_t ctx,
               const DecodeBenchOptions& opt, EngineDevice device, double bandwidth_gbps) {
  const bool cuda = device == EngineDevice::kCuda;
  const double elem = ElemBytes(device, opt.cpu_dtype);
  const double row_elem = RowElemBytes(device);
  const ModelRun& run = *t.point.run;
  const int64_t b = t.point.batch;
  const ModelConfig& config = run.spec->config;
  const EngineProfile& prof = t.profile;
  const double median = Percentile(t.step_seconds, 50);
  const double p90 = Percentile(t.step_seconds, 90);
  const double flops = b * DecodeFlopsPerToken(config, ctx);
  const double gflops = flops / median / 1e9;
  const double ms = 1e3 / opt.steps;
  const SessionStepBytes sb = SessionBytesPerStep(config, ctx, elem, row_elem);
  const WeightBytes wb = WeightBytesPerStep(config, elem);
  const double weight_bytes = wb.total();
  const double step_bytes = StepBytes(config, ctx, b, elem, row_elem);
  const double achieved = step_bytes / median / 1e9;
  // A mixer's achieved bandwidth: its weights plus the batch's rows, over its profiled time.
  auto mixer_gbps = [&](double weights, double per_session, double seconds) {
    return seconds > 0 ? (weights + b * per_session) / (seconds / opt.steps) / 1e9 : 0.0;
  };
  const json sgemm = cuda ? json() : json(run.sgemm_gflops.at(b));
  return json{
      {"group", group},
      {"model", run.spec->name},
      {"role", run.spec->role},
      {"device", EngineDeviceName(device)},
      {"engine", run.engine->DescribeDevice()},
      {"context", ctx},
      {"batch", b},
      {"fit_batch", b == run.fit},
      {"steps", opt.steps},
      {"measured_with", measured_with},
      {"ms_per_step_median", median * 1e3},
      {"ms_per_step_p90", p90 * 1e3},
      {"ms_per_step_min", *std::min_element(t.step_seconds.begin(), t.step_seconds.end()) * 1e3},
      {"tokens_per_s", b / median},
      {"bytes_per_step", step_bytes},
      {"weight_bytes_per_step", weight_bytes},
      {"kv_bytes_per_step_per_session", sb.kv},
      {"swa_bytes_per_step_per_session", sb.swa},
      {"sdm_bytes_per_step_per_session", sb.sdm},
      {"achieved_gbps", achieved},
      {"fraction_of_bandwidth", achieved / bandwidth_gbps},
      {"gflops", gflops},
      {"sgemm_gflops_same_shapes", sgemm},
      {"fraction_of_sgemm", cuda ? json() : json(gflops / sgemm.get<double>())},
      {"attn_ms_per_step", prof.attn_seconds * ms},
      {"swa_ms_per_step", prof.swa_seconds * ms},
      {"sdm_ms_per_step", prof.sdm_seconds * ms},
      {"ffn_ms_per_step", prof.ffn_seconds * ms},
      {"head_ms_per_step", prof.head_seconds * ms},
      {"attn_layers_gbps", mixer_gbps(wb.attn, sb.kv, prof.attn_seconds)},
      {"swa_layers_gbps", mixer_gbps(wb.swa, sb.swa, prof.swa_seconds)},
      {"sdm_layers_gbps", mixer_gbps(wb.sdm, sb.sdm, prof.sdm_seconds)},
      {"state_bytes_per_session", run.state_bytes},
      {"max_batch_in_budget", cuda ? static_cast<int64_t>(run.pool.size())
                                   : MaxBatch(opt.state_budget_gb, run.state_bytes)}};
}

}  // namespace

std::vector<std::string> PairNames() {
  std::vector<std::string> names;
  for (const PairSpec& p : Pairs()) names.push_back(p.name);
  return names;
}

absl::StatusOr<ModelConfig> FullAttentionTwin(const ModelConfig& sdm_config) {
  ModelConfig twin = sdm_config;
  twin.attn_at.insert(twin.attn_at.end(), twin.sdm_at.begin(), twin.sdm_at.end());
  std::sort(twin.attn_at.begin(), twin.attn_at.end());
  twin.sdm_at.clear();
  twin.layer_types.clear();
  if (auto s = FinalizeModelConfig(twin); !s.ok()) return s;
  return twin;
}

absl::StatusOr<BenchGroup> NamedPair(absl::string_view name,
                                     const std::vector<std::string>& overrides) {
  const PairSpec* spec = nullptr;
  for (const PairSpec& p : Pairs()) {
    if (name == p.name) spec = &p;
  }
  if (spec == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("unknown pair '", name, "' (known: ", absl::StrJoin(PairNames(), ", "), ")"));
  }
  absl::StatusOr<ModelConfig> sdm =
      spec->sdm_preset != nullptr ? PresetConfig(spec->sdm_preset) : CpuHybridConfig();
  if (!sdm.ok()) return sdm.status();
  BenchGroup g;
  g.name = spec->name;
  g.description = spec->description;
  g.default_contexts = spec->contexts;
  // The twin derived before the overrides must equal the named baseline preset.
  absl::StatusOr<ModelConfig> twin = FullAttentionTwin(*sdm);
  if (!twin.ok()) return twin.status();
  if (spec->twin_preset != nullptr) {
    absl::StatusOr<ModelConfig> baseline = PresetConfig(spec->twin_preset);
    if (!baseline.ok()) return baseline.status();
    if (ModelConfigToJson(*baseline) != ModelConfigToJson(*twin)) {
      return absl::InternalError(absl::StrCat("preset ", spec->twin_preset, " is not ",
                                              spec->sdm_preset,
                                              " with its SDM layers made full attention"));
    }
    g.twin_check = absl::StrCat("preset ", spec->twin_preset, " equals ", spec->sdm_name,
                                " with every SDM layer made full attention (configs compared)");
  } else {
    g.twin_check = absl::StrCat(spec->twin_name, " is ", spec->sdm_name,
                                " with every SDM layer made full attention (built by the tool)");
  }
  if (!overrides.empty()) {
    if (auto s = ApplyConfigOverrides(*sdm, overrides); !s.ok()) return s;
    twin = FullAttentionTwin(*sdm);
    if (!twin.ok()) return twin.status();
    g.twin_check +=
        absl::StrCat("; --set applied to ", spec->sdm_name, " before deriving the twin");
  }
  g.models.push_back({spec->sdm_name, "sdm", *sdm});
  g.models.push_back({spec->twin_name, "attention", *twin});
  return g;
}

absl::Status RenderFromJson(const std::string& json_path, const DecodeBenchOptions& opt) {
  std::ifstream in(json_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", json_path));
  json doc = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.contains("groups") || !doc.contains("results")) {
    return absl::InvalidArgumentError(
        absl::StrCat(json_path, " is not the JSON document of an sdm-bench decode run"));
  }
  for (json& g : doc["groups"]) SummarisePair(g, doc["results"]);
  return WriteOutputs(doc, opt);
}

absl::Status RunDecodeBenchmark(const DecodeBenchOptions& opt) {
  const Clock::time_point run_start = Clock::now();
  absl::StatusOr<EngineDevice> resolved = ResolveBenchDevice(opt.device);
  if (!resolved.ok()) return resolved.status();
  const EngineDevice device = *resolved;
  const bool cuda = device == EngineDevice::kCuda;
  const double elem = ElemBytes(device, opt.cpu_dtype);
  const double row_elem = RowElemBytes(device);
  // ---- The groups ----
  std::vector<BenchGroup> groups;
  for (const std::string& p : opt.pairs) {
    absl::StatusOr<BenchGroup> g = NamedPair(p, opt.overrides);
    if (!g.ok()) return g.status();
    for (BenchModel& m : g->models) m.cpu_attention = opt.cpu_attention.front();
    groups.push_back(*std::move(g));
  }
  if (!opt.presets.empty()) {
    BenchGroup g;
    g.name = "presets";
    g.description = absl::StrCat("explicit list: ", absl::StrJoin(opt.presets, ", "));
    g.default_contexts = {512, 4096, 16384};
    for (const std::string& p : opt.presets) {
      absl::StatusOr<ModelConfig> c = PresetConfig(p);
      if (!c.ok()) return c.status();
      if (auto s = ApplyConfigOverrides(*c, opt.overrides); !s.ok()) return s;
      for (CpuDecodeAttention k : opt.cpu_attention) {
        const bool per_head = k == CpuDecodeAttention::kPerHead;
        g.models.push_back({per_head ? p + "[per_head]" : p, "model", *c, k});
      }
    }
    groups.push_back(std::move(g));
  }
  if (groups.empty())
    return absl::InvalidArgumentError("nothing to measure: no --pair or --presets");

  json doc;
  doc["tool"] = "sdm-bench decode";
  doc["schema_version"] = 1;
  doc["started_utc"] = UtcNow();
  doc["command_line"] = opt.command_line;
  doc["parameters"] = {
      {"device", EngineDeviceName(opt.device)},
      {"pair", opt.pairs},
      {"presets", opt.presets},
      {"cpu_attention",
       [&] {
         json k = json::array();
         for (CpuDecodeAttention a : opt.cpu_attention) {
           k.push_back(a == CpuDecodeAttention::kPerHead ? "per_head" : "blocked");
         }
         return k;
       }()},
      {"cpu_dtype", CpuDtypeName(opt.cpu_dtype)},
      {"set", opt.overrides},
      {"contexts", opt.contexts.empty() ? json("each pair's default") : json(opt.contexts)},
      {"batches", opt.batches},
      {"fit_batch", opt.fit_batch},
      {"max_batch", opt.max_batch},
      {"steps", opt.steps},
      {"warmup", opt.warmup},
      {"threads", opt.threads},
      {"prefill_chunk", opt.prefill_chunk},
      {"state_budget_gb", opt.state_budget_gb},
      {"device_state_gb", opt.device_state_gb},
      {"seed", opt.seed},
      {"bandwidth_mb", opt.bandwidth_mb},
      {"json", opt.json_path},
      {"csv", opt.csv_path},
      {"report", opt.report_dir}};
  doc["machine"] = MachineInfo();
  doc["build"] = BuildInfo();
  // The device: what was asked, what it resolved to, and each engine's own description (filled
  // in as the engines are created; the first one's is the run's headline).
  doc["device"] = {{"requested", EngineDeviceName(opt.device)},
                   {"resolved", EngineDeviceName(device)},
                   {"description", ""},
                   {"engines", json::array()}};
  const int threads =
      opt.threads > 0 ? opt.threads : static_cast<int>(std::thread::hardware_concurrency());
  doc["machine"]["engine_threads"] = threads;
  // OpenBLAS times the sgemm reference only (the CPU engine runs it single-threaded for its
  // prefill attention): with as many threads as the engine.
  doc["machine"]["blas_threads"] = threads;
  doc["machine"]["gemm_isa"] = kernels::cpu::GemmIsaName();

  std::printf(
      "# sdm-bench decode: %s, %d hardware threads; engine threads %d, OpenBLAS threads %d; CPU "
      "GEMM %s\n",
      doc["machine"]["cpu"].get<std::string>().c_str(),
      doc["machine"]["hardware_threads"].get<int>(), threads, threads, kernels::cpu::GemmIsaName());
  std::printf("# device: %s (--device %s)\n", EngineDeviceName(device),
              EngineDeviceName(opt.device));
  if (cuda) {
    std::printf(
        "# steps %d (after %d warm-up); models measured one after the other, sessions "
        "prefilled on the device; seed %llu\n",
        opt.steps, opt.warmup, static_cast<unsigned long long>(opt.seed));
  } else {
    std::printf("# steps %d (after %d warm-up), state budget %.1f GB, seed %llu\n", opt.steps,
                opt.warmup, opt.state_budget_gb, static_cast<unsigned long long>(opt.seed));
  }

  // ---- Bandwidth: measured at the start, before each group and at the end; the best figure
  // is the machine's (the machine is shared: a low figure means someone else was using it). On
  // the CPU a decode step's bytes are reads (weights, KV rows, SDM rows; only the W written SDM
  // rows and the new K/V rows are written), so %bw is of the streaming-read rate; the copy rate
  // (read + write bytes, the GPU convention of docs/model-spec.md §9) is reported beside it. On
  // CUDA the reference is the device's device-to-device copy rate (read + write bytes), the
  // ceiling the floor of docs/model-spec.md §9 is computed from. ----
  const int64_t bw_bytes =
      (cuda ? std::max<int64_t>(opt.bandwidth_mb, 2048) : opt.bandwidth_mb) * (int64_t{1} << 20);
  constexpr int kDeviceCopyReps = 10;
  json bw_log = json::array();
  double bandwidth = 0;
  auto measure_bandwidth = [&](const std::string& when) -> absl::Status {
    Progress bar(absl::StrCat(cuda ? "device copy bandwidth (" : "memory bandwidth (", when, ")"),
                 1, "");
    if (cuda) {
      absl::StatusOr<DeviceCopyBandwidth> bw =
          MeasureDeviceCopyBandwidth(bw_bytes, /*warmup=*/2, kDeviceCopyReps);
      bar.Finish("", false);
      if (!bw.ok()) return bw.status();
      bandwidth = std::max(bandwidth, bw->median_gbps);
      bw_log.push_back({{"when", when},
                        {"kind", "device copy"},
                        {"copy_gbps", bw->median_gbps},
                        {"copy_best_gbps", bw->best_gbps},
                        {"read_gbps", json()},
                        {"reps", bw->reps},
                        {"load_average", LoadAverage()}});
      std::printf(
          "# device copy bandwidth (%s; cudaMemcpy device to device, 2 x %lld MiB, median of %d): "
          "%.1f GB/s (read + write; best copy %.1f GB/s); best median so far %.1f GB/s\n",
          when.c_str(), static_cast<long long>(bw_bytes >> 20), bw->reps, bw->median_gbps,
          bw->best_gbps, bandwidth);
    } else {
      const Bandwidth bw = MeasureBandwidth(bw_bytes, threads);
      bar.Finish("", false);
      bandwidth = std::max(bandwidth, bw.read_gbps);
      bw_log.push_back({{"when", when},
                        {"kind", "host memory"},
                        {"copy_gbps", bw.copy_gbps},
                        {"read_gbps", bw.read_gbps},
                        {"load_average", LoadAverage()}});
      std::printf(
          "# memory bandwidth (%s; %d threads, 2 x %lld MiB): copy %.1f GB/s (read + write), "
          "read %.1f GB/s; best read so far %.1f GB/s; load average %s\n",
          when.c_str(), threads, static_cast<long long>(opt.bandwidth_mb), bw.copy_gbps,
          bw.read_gbps, bandwidth, LoadAverageText().c_str());
    }
    std::fflush(stdout);
    return absl::OkStatus();
  };
  if (auto s = measure_bandwidth("start"); !s.ok()) return s;

  // The longest position any session reaches: the largest context plus the decode steps of
  // every round measured there (CUDA page tables are sized for it).
  int64_t longest_context = 0;
  for (const BenchGroup& g : groups) {
    for (int64_t c : opt.contexts.empty() ? g.default_contexts : opt.contexts) {
      longest_context = std::max(longest_context, c);
    }
  }
  const int64_t max_position =
      longest_context + static_cast<int64_t>(opt.batches.size() + 1) * (opt.warmup + opt.steps) +
      64;

  json rows = json::array();
  json skipped = json::array();
  doc["groups"] = json::array();
  for (const BenchGroup& group : groups) {
    std::vector<int64_t> contexts = opt.contexts.empty() ? group.default_contexts : opt.contexts;
    std::sort(contexts.begin(), contexts.end());
    contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
    json gj;
    gj["name"] = group.name;
    gj["description"] = group.description;
    gj["twin_check"] = group.twin_check;
    gj["contexts"] = contexts;
    gj["models"] = json::array();
    json prefill_log = json::array();
    json capacity = json::array();
    json sgemm = json::array();

    std::printf("\n## %s: %s\n", group.name.c_str(), group.description.c_str());
    if (&group != &groups.front()) {
      if (auto s = measure_bandwidth(absl::StrCat("before ", group.name)); !s.ok()) return s;
    }
    std::printf("# %-18s %-26s %14s %14s %12s %12s %12s\n", "model", "layers", "params",
                "params w/o M0", "weights MB", "KV KB/token", "SDM MB/sess");
    for (size_t i = 0; i < group.models.size(); ++i) {
      const BenchModel& m = group.models[i];
      gj["models"].push_back(ModelJson(m, elem, row_elem));
      const json& mj = gj["models"].back();
      std::printf("# %-18s %-26s %14lld %14lld %12.1f %12.1f %12.1f\n", m.name.c_str(),
                  mj["layers"].get<std::string>().c_str(),
                  static_cast<long long>(mj["parameters_total"].get<int64_t>()),
                  static_cast<long long>(mj["parameters_without_m0"].get<int64_t>()),
                  mj["weight_bytes_per_step"].get<double>() / 1e6,
                  mj["kv_bytes_per_token"].get<double>() / 1e3,
                  mj["sdm_state_bytes_max"].get<double>() / 1e6);
    }
    if (!group.twin_check.empty()) std::printf("# twin: %s\n", group.twin_check.c_str());
    std::fflush(stdout);
    std::vector<int64_t> listed = opt.batches;
    std::sort(listed.begin(), listed.end());
    listed.erase(std::unique(listed.begin(), listed.end()), listed.end());
    // CUDA: each pool holds as many sessions as the largest batch asked for.
    const int64_t pool_target =
        std::max(listed.empty() ? int64_t{1} : listed.back(), opt.fit_batch ? opt.max_batch : 1);

    // Phases: the models measured together. On the CPU all of a group's models, interleaved; on
    // CUDA one model at a time, its engine and sessions freed before the next one's are made.
    std::vector<std::vector<size_t>> phases;
    if (cuda) {
      for (size_t i = 0; i < group.models.size(); ++i) phases.push_back({i});
    } else {
      phases.emplace_back();
      for (size_t i = 0; i < group.models.size(); ++i) phases.back().push_back(i);
    }
    bool header_printed = false;
    for (const std::vector<size_t>& phase : phases) {
      std::vector<ModelRun> runs(phase.size());
      for (size_t k = 0; k < phase.size(); ++k) {
        const size_t i = phase[k];
        ModelRun& run = runs[k];
        run.spec = &group.models[i];
        Progress bar(absl::StrCat(run.spec->name, ": random weights"), 1, "");
        run.model = RandomModel(run.spec->config, opt.seed);
        bar.Finish("", false);
        EngineOptions eo;
        eo.device = device;
        eo.num_threads = opt.threads;
        // On CUDA the per-part profile synchronises after every layer, which would distort the
        // step time: the device figures are whole steps only.
        eo.profile = !cuda;
        eo.cuda_graphs = opt.cuda_graphs;
        eo.prefill_chunk = opt.prefill_chunk;
        eo.cpu_decode_attention = run.spec->cpu_attention;
        if (!cuda) eo.cpu_dtype = opt.cpu_dtype;
        // Size the device's arenas for the longest context measured (not the default 128k).
        eo.max_context = max_position;
        if (opt.device_state_gb > 0) {
          eo.device_state_bytes = static_cast<int64_t>(opt.device_state_gb * 1e9);
        }
        auto engine = Engine::Create(run.model, eo);
        if (!engine.ok()) {
          return absl::Status(
              engine.status().code(),
              absl::StrCat(run.spec->name, ": creating the engine on ", EngineDeviceName(device),
                           ": ", engine.status().message()));
        }
        run.engine = *std::move(engine);
        const std::string described = run.engine->DescribeDevice();
        std::printf("# %s engine: %s\n", run.spec->name.c_str(), described.c_str());
        std::fflush(stdout);
        gj["models"][i]["engine"] = described;
        doc["device"]["engines"].push_back({{"model", run.spec->name}, {"engine", described}});
        if (doc["device"]["description"].get<std::string>().empty()) {
          doc["device"]["description"] = described;
        }
        run.gemms = DecodeGemms(*run.model);
        if (!cuda) run.base = run.engine->NewSession();
        run.rng.seed(static_cast<uint32_t>(opt.seed + 7919 * i));
      }
      if (!header_printed) {
        std::printf("%s\n", TableHeader().c_str());
        header_printed = true;
      }
      std::fflush(stdout);
      for (int64_t ctx : contexts) {
        for (ModelRun& run : runs) {
          int64_t fits = 0;
          if (cuda) {
            if (auto s = FillPool(run, ctx, pool_target, prefill_log); !s.ok()) return s;
            double total = 0;
            for (const auto& session : run.pool) total += session->ResidentBytes();
            run.state_bytes = run.pool.empty() ? 0 : total / run.pool.size();
            fits = static_cast<int64_t>(run.pool.size());
          } else {
            if (auto s = PrefillBase(run, ctx, prefill_log); !s.ok()) return s;
            run.state_bytes = static_cast<double>(run.base->ResidentBytes());
            fits = MaxBatch(opt.state_budget_gb, run.state_bytes);
          }
          run.fit = std::min(fits, opt.max_batch);
          json cap = {{"model", run.spec->name},
                      {"context", ctx},
                      {"state_bytes_per_session", run.state_bytes},
                      {"max_batch_in_budget", fits}};
          if (cuda) {
            cap["limited_by_device_memory"] = run.pool_limited;
            if (run.pool_limited) cap["limit"] = run.pool_limit;
          }
          capacity.push_back(cap);
        }
        // The listed batches, all models together at the same batch; then each model at the
        // largest batch it fits, all models together (a model whose largest batch is a listed
        // one is measured there once, in this last round).
        std::vector<std::vector<Point>> rounds;
        std::vector<std::string> skip_lines;  // printed after this context's measurements
        auto skip = [&](const ModelRun& run, int64_t b, const std::string& reason) {
          skip_lines.push_back(
              absl::StrFormat("%-18s %7d %5d   skipped: %s", run.spec->name, ctx, b, reason));
          skipped.push_back({{"group", group.name},
                             {"model", run.spec->name},
                             {"context", ctx},
                             {"batch", b},
                             {"reason", reason}});
        };
        for (int64_t b : listed) {
          std::vector<Point> round;
          for (ModelRun& run : runs) {
            if (opt.fit_batch && b == run.fit) continue;  // measured in the fit round
            if (cuda && b > static_cast<int64_t>(run.pool.size())) {
              skip(run, b,
                   absl::StrFormat("the device's session memory holds %d sessions at this "
                                   "context",
                                   run.pool.size()));
              continue;
            }
            if (!cuda && b * run.state_bytes > opt.state_budget_gb * 1e9) {
              skip(run, b,
                   absl::StrFormat("%.2f GB of state exceeds the %.1f GB budget (fits %d)",
                                   b * run.state_bytes / 1e9, opt.state_budget_gb,
                                   MaxBatch(opt.state_budget_gb, run.state_bytes)));
              continue;
            }
            round.push_back({&run, b});
          }
          rounds.push_back(round);
        }
        if (opt.fit_batch) {
          std::vector<Point> round;
          for (ModelRun& run : runs) {
            if (run.fit > 0) round.push_back({&run, run.fit});
          }
          rounds.push_back(round);
        }
        for (const std::vector<Point>& round : rounds) {
          if (round.empty()) continue;
          absl::StatusOr<std::vector<PointTiming>> measured =
              MeasureTogether(round, ctx, opt.warmup, opt.steps, cuda, threads);
          if (cuda && absl::IsResourceExhausted(measured.status())) {
            // Out of device memory in a step (new rows or pages): this point cannot be measured
            // here; the rest of the run goes on.
            for (const Point& p : round) {
              skip(*p.run, p.batch,
                   absl::StrCat("out of device memory during the decode steps: ",
                                measured.status().message()));
            }
            continue;
          }
          if (!measured.ok()) return measured.status();
          ClearProgressLine();
          std::vector<std::string> measured_with;
          for (const Point& p : round) {
            measured_with.push_back(absl::StrFormat("%s x%d", p.run->spec->name, p.batch));
          }
          for (const PointTiming& timing : *measured) {
            json row = ResultRow(timing, group.name, measured_with, ctx, opt, device, bandwidth);
            std::printf("%s\n", TableRow(row).c_str());
            rows.push_back(std::move(row));
          }
          std::fflush(stdout);
        }
        for (const std::string& line : skip_lines) std::printf("%s\n", line.c_str());
        std::fflush(stdout);
      }
      for (size_t k = 0; k < runs.size(); ++k) {
        const ModelRun& run = runs[k];
        for (const auto& [b, rate] : run.sgemm_gflops) {
          sgemm.push_back({{"model", run.spec->name}, {"batch", b}, {"gflops", rate}});
        }
        if (cuda) {
          // How the steps ran: one graph launch each (captured once per shape), or kernel by
          // kernel (--cuda_graphs=false, or a shape whose capture failed).
          const DecodeGraphStats g = run.engine->decode_graph_stats();
          std::printf("# %s decode graphs %s: %ld captured, %ld steps replayed, %ld refused\n",
                      run.spec->name.c_str(), opt.cuda_graphs ? "on" : "off",
                      static_cast<long>(g.captures), static_cast<long>(g.replays),
                      static_cast<long>(g.refusals));
          gj["models"][phase[k]]["decode_graphs"] = {{"enabled", opt.cuda_graphs},
                                                     {"captures", g.captures},
                                                     {"replays", g.replays},
                                                     {"refusals", g.refusals}};
        }
      }
      // Leaving the phase frees its models, engines and sessions (device memory included).
    }
    gj["prefill"] = prefill_log;
    gj["capacity"] = capacity;
    gj["sgemm"] = sgemm;
    SummarisePair(gj, rows);
    doc["groups"].push_back(gj);
    std::printf("%s", GroupSummary(gj).c_str());
    std::fflush(stdout);
  }

  std::printf("\n");
  if (auto s = measure_bandwidth("end"); !s.ok()) return s;
  // The %bw of every row is of the best bandwidth measured in the run (the terminal rows used the
  // best figure measured before them).
  for (json& r : rows) r["fraction_of_bandwidth"] = r["achieved_gbps"].get<double>() / bandwidth;
  doc["bandwidth"] = {
      {"buffer_bytes", bw_bytes},
      {"threads", threads},
      {"kind", cuda ? "device copy" : "host memory"},
      {"measurements", bw_log},
      {"reference_gbps", bandwidth},
      {"reference",
       cuda ? "the best device-to-device copy rate (cudaMemcpy, median of 10 copies, read + write "
              "bytes) over every measurement of the run"
            : "the best streaming-read rate over every measurement of the run (a decode step's "
              "bytes are reads)"}};
  doc["machine"]["load_average_end"] = LoadAverage();
  doc["machine"]["peak_rss_bytes"] = PeakRssBytes();
  doc["results"] = rows;
  doc["skipped"] = skipped;
  doc["finished_utc"] = UtcNow();
  doc["wall_seconds"] = std::chrono::duration<double>(Clock::now() - run_start).count();
  return WriteOutputs(doc, opt);
}

}  // namespace sdm::bench
