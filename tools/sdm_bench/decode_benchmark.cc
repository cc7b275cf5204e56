#include "tools/sdm_bench/decode_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/weight_spec.h"
#include "kernels/cpu/linear.h"
#include "nlohmann/json.hpp"
#include "tools/sdm_bench/decode_report.h"
#include "tools/sdm_bench/device_info.h"
#include "tools/sdm_bench/progress.h"
#include "tools/sdm_bench/system_info.h"

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

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

// ---- The bytes and FLOPs of one decode step ----

// A dense layer of the decode step: y[B, n] = x[B, k] W^T.
struct GemmShape {
  const float* w;
  int64_t n, k;
};

// Every matrix product of one decode step: all 2-D weights except the embedding gather (unless
// tied, when it is also the output layer) and the SDM memory (read sparsely, not multiplied).
std::vector<GemmShape> DecodeGemms(const Model& model) {
  std::vector<GemmShape> gemms;
  for (const TensorSpec& t : ExpectedTensors(model.config)) {
    if (t.shape.size() != 2 || t.is_sdm_memory) continue;
    if (t.name == "tok_embeddings.weight" && !model.config.weight_tying) continue;
    gemms.push_back({model.weights->Get(t.name).data(), t.shape[0], t.shape[1]});
  }
  return gemms;
}

// Bytes per stored value of the matrices, KV rows and SDM rows each engine keeps: fp32 on the CPU,
// bf16 on CUDA (docs/model-spec.md §6; the CUDA engine keeps vectors (norms, biases) in fp32).
double ElemBytes(EngineDevice device) { return device == EngineDevice::kCuda ? 2.0 : 4.0; }

// Bytes of weights one decode step reads once, whatever the batch: every matrix at `elem` bytes
// per value and every vector as fp32, except the learned SDM memory (its rows are counted per
// session) and the embedding table unless tied (only the batch's rows are gathered; counted per
// session). Split by the mixer a tensor belongs to (layers.{i}.attention.*), the rest (norms, FFNs,
// output) in `other`.
struct WeightBytes {
  double attn = 0, swa = 0, sdm = 0, other = 0;
  double total() const { return attn + swa + sdm + other; }
};

WeightBytes WeightBytesPerStep(const ModelConfig& c, double elem) {
  WeightBytes w;
  for (const TensorSpec& t : ExpectedTensors(c)) {
    if (t.is_sdm_memory) continue;
    if (t.name == "tok_embeddings.weight" && !c.weight_tying) continue;
    const double bytes = (t.shape.size() == 2 ? elem : 4.0) * static_cast<double>(NumElements(t));
    int64_t layer = -1;
    if (std::sscanf(t.name.c_str(), "layers.%ld.attention.", &layer) == 1 &&
        t.name.find(".attention.") != std::string::npos && layer >= 0 && layer < c.n_layers) {
      switch (c.layer_types[layer]) {
        case LayerType::kAttn:
          w.attn += bytes;
          break;
        case LayerType::kSwa:
          w.swa += bytes;
          break;
        case LayerType::kSdm:
          w.sdm += bytes;
          break;
      }
    } else {
      w.other += bytes;
    }
  }
  return w;
}

// Bytes one session's decode step at context `ctx` must move (the token's embedding row, the K
// and V rows of the visible positions of every attention layer plus the new row, and the SDM rows
// (2W + R per head and layer)), split by kind.
struct SessionStepBytes {
  double kv = 0;   // full-attention layers
  double swa = 0;  // sliding-window layers
  double sdm = 0;  // SDM layers
  double other = 0;
  double total() const { return kv + swa + sdm + other; }
};

SessionStepBytes SessionBytesPerStep(const ModelConfig& c, int64_t ctx, double elem) {
  SessionStepBytes b;
  b.other = elem * c.dim;  // the embedding row
  const SdmGeometry sg = SdmGeometryOf(c);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] == LayerType::kSdm) {
      const int64_t w = std::min(c.sdm.num_writes, sg.slots_per_head);
      const int64_t r = std::min(c.sdm.num_reads, sg.slots_per_head);
      b.sdm += elem * sg.heads * (2 * w + r) * sg.head_width;
    } else {
      const AttentionGeometry g = AttentionGeometryOf(c, i);
      const int64_t visible = g.window > 0 ? std::min(ctx + 1, g.window) : ctx + 1;
      // K and V rows read for every visible position, plus the new K and V rows written.
      const double bytes = elem * 2 * g.n_kv_heads * g.head_dim * (visible + 1);
      (g.window > 0 ? b.swa : b.kv) += bytes;
    }
  }
  return b;
}

// Bytes of K and V per cached token over the full-attention layers, at `elem` bytes per value.
double KvBytesPerToken(const ModelConfig& c, double elem) {
  double bytes = 0;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] != LayerType::kAttn) continue;
    const AttentionGeometry g = AttentionGeometryOf(c, i);
    bytes += elem * 2 * g.n_kv_heads * g.head_dim;
  }
  return bytes;
}

// FLOPs of one decoded token at context `ctx`: the GEMMs, attention over the visible keys, and
// the SDM row updates and reads.
double DecodeFlopsPerToken(const ModelConfig& c, const std::vector<GemmShape>& gemms, int64_t ctx) {
  double flops = 0;
  for (const GemmShape& g : gemms) flops += 2.0 * g.n * g.k;
  const SdmGeometry sg = SdmGeometryOf(c);
  for (int64_t i = 0; i < c.n_layers; ++i) {
    if (c.layer_types[i] == LayerType::kSdm) {
      // write: decay, prediction, update (~5 flops per cell of W rows); read: 2 per cell of R.
      flops += static_cast<double>(sg.heads) * sg.head_width *
               (5.0 * c.sdm.num_writes + 2.0 * c.sdm.num_reads);
    } else {
      const AttentionGeometry g = AttentionGeometryOf(c, i);
      const int64_t visible = g.window > 0 ? std::min(ctx, g.window) : ctx;
      flops += 4.0 * visible * g.n_heads * g.head_dim;
    }
  }
  return flops;
}

// OpenBLAS sgemm rate (GFLOP/s) on exactly the step's GEMM shapes at batch `b`.
double MeasureSgemmRate(const std::vector<GemmShape>& gemms, int64_t b) {
  int64_t max_k = 0, max_n = 0;
  for (const GemmShape& g : gemms) {
    max_k = std::max(max_k, g.k);
    max_n = std::max(max_n, g.n);
  }
  std::vector<float> x(b * max_k, 0.01f), y(b * max_n);
  double flops_per_round = 0;
  for (const GemmShape& g : gemms) flops_per_round += 2.0 * b * g.n * g.k;
  auto round = [&] {
    for (const GemmShape& g : gemms) {
      kernels::cpu::Linear(x.data(), b, g.k, g.w, g.n, nullptr, y.data());
    }
  };
  round();  // warm up
  int rounds = 0;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  while (rounds < 3 || (rounds < 30 && elapsed < 0.5)) {
    round();
    ++rounds;
    elapsed = Seconds(start, Clock::now());
  }
  return flops_per_round * rounds / elapsed / 1e9;
}

std::vector<int32_t> RandomTokens(int64_t n, std::mt19937& rng, int64_t vocab) {
  std::uniform_int_distribution<int32_t> tok(
      0, static_cast<int32_t>(std::min<int64_t>(vocab, 256)) - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = tok(rng);
  return t;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
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

json ModelJson(const BenchModel& m, double elem) {
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
  j["sdm_bytes_per_step_per_session"] = SessionBytesPerStep(m.config, 0, elem).sdm;
  j["sdm_state_bytes_max"] = elem * static_cast<double>(SdmStateElements(m.config));
  j["sdm_heads"] = sg.heads;
  j["config"] = json::parse(ModelConfigToJson(m.config));
  return j;
}

// ---- Running one model ----

// The largest number of sessions of `state_bytes` each that fit in `budget_gb`.
int64_t MaxBatch(double budget_gb, double state_bytes) {
  if (state_bytes <= 0) return std::numeric_limits<int32_t>::max();
  return static_cast<int64_t>(std::floor(budget_gb * 1e9 / state_bytes));
}

// Members in destruction order that matters: sessions (pool, base) are declared after the engine
// so that they go first, while the engine's device memory they came from still exists.
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

// Brings `session` to `ctx` tokens by real prefill of random tokens, in slices of 1024 (the
// engine chunks them further); `bar` counts tokens done over all the sessions of one phase.
absl::Status PrefillSession(ModelRun& run, SessionState& session, int64_t ctx, Progress& bar,
                            int64_t& done_total) {
  const int64_t slice = 1024;
  while (session.position() < ctx) {
    const int64_t n = std::min(slice, ctx - session.position());
    const auto toks = RandomTokens(n, run.rng, run.spec->config.vocab_size);
    if (auto s = run.engine->Prefill(session, toks, false, nullptr); !s.ok()) return s;
    done_total += n;
    bar.Update(done_total);
  }
  return absl::OkStatus();
}

absl::Status Prefill(ModelRun& run, int64_t ctx, json& prefill_log) {
  const int64_t todo = ctx - run.base->position();
  if (todo <= 0) return absl::OkStatus();
  const Clock::time_point t0 = Clock::now();
  Progress bar(absl::StrFormat("%s: prefill to %d", run.spec->name, ctx), todo, "tok");
  int64_t done = 0;
  if (auto s = PrefillSession(run, *run.base, ctx, bar, done); !s.ok()) return s;
  const double seconds = Seconds(t0, Clock::now());
  bar.Finish(absl::StrFormat("%s: prefill %d -> %d tokens in %.1f s (%.0f tok/s)", run.spec->name,
                             ctx - todo, ctx, seconds, todo / seconds),
             /*keep=*/true);
  prefill_log.push_back({{"model", run.spec->name},
                         {"sessions", 1},
                         {"from", ctx - todo},
                         {"to", ctx},
                         {"seconds", seconds},
                         {"tokens_per_s", todo / seconds}});
  return absl::OkStatus();
}

// CUDA: brings the first `target` sessions of the pool (created as needed) to `ctx` tokens, each
// by its own prefill on the device. When the device's session memory runs out, the pool keeps the
// sessions before the one that failed, less one more (headroom for the decode steps' new SDM rows
// and KV pages), and stays limited from then on.
absl::Status FillPool(ModelRun& run, int64_t ctx, int64_t target, json& prefill_log) {
  if (run.pool_limited) target = std::min<int64_t>(target, run.pool.size());
  int64_t todo = 0, from = ctx;
  for (int64_t i = 0; i < target; ++i) {
    const int64_t pos = i < static_cast<int64_t>(run.pool.size()) ? run.pool[i]->position() : 0;
    todo += std::max<int64_t>(0, ctx - pos);
    from = std::min(from, pos);
  }
  if (todo <= 0) return absl::OkStatus();
  const Clock::time_point t0 = Clock::now();
  Progress bar(absl::StrFormat("%s: prefill %d sessions to %d", run.spec->name, target, ctx), todo,
               "tok");
  int64_t done = 0;
  for (int64_t i = 0; i < target; ++i) {
    if (i == static_cast<int64_t>(run.pool.size())) run.pool.push_back(run.engine->NewSession());
    absl::Status s = PrefillSession(run, *run.pool[i], ctx, bar, done);
    if (s.ok()) continue;
    if (!absl::IsResourceExhausted(s)) return s;
    // Destroying a session frees its device state (its residency).
    run.pool.resize(i);
    if (run.pool.size() > 1) run.pool.pop_back();
    run.pool_limited = true;
    run.pool_limit = absl::StrFormat(
        "the device's session memory held %d sessions at %d tokens (one more is kept free for "
        "the decode steps): %s",
        i, ctx, s.message());
    std::printf("# %s: %s\n", run.spec->name.c_str(), run.pool_limit.c_str());
    break;
  }
  const double seconds = Seconds(t0, Clock::now());
  bar.Finish(
      absl::StrFormat("%s: prefill of %d sessions %d -> %d tokens: %d tokens in %.1f s "
                      "(%.0f tok/s)",
                      run.spec->name, run.pool.size(), from, ctx, done, seconds, done / seconds),
      /*keep=*/true);
  prefill_log.push_back({{"model", run.spec->name},
                         {"sessions", run.pool.size()},
                         {"from", from},
                         {"to", ctx},
                         {"seconds", seconds},
                         {"tokens_per_s", done / seconds}});
  return absl::OkStatus();
}

// One model at one batch size, within a joint measurement.
struct Point {
  ModelRun* run;
  int64_t batch;
};

// Measures every point at context `ctx` together: each model's session is cloned `batch` times,
// then the models' decode steps alternate (warm-up rounds, then timed rounds: one step of each
// model in turn), so that the load other processes put on a shared machine falls on all of them
// alike. One row per point.
absl::StatusOr<std::vector<json>> MeasureTogether(const std::vector<Point>& points,
                                                  const std::string& group, int64_t ctx,
                                                  const DecodeBenchOptions& opt,
                                                  EngineDevice device, double bandwidth_gbps) {
  const bool cuda = device == EngineDevice::kCuda;
  const double elem = ElemBytes(device);
  std::vector<std::string> names;
  for (const Point& p : points) {
    names.push_back(absl::StrFormat("%s x%d", p.run->spec->name, p.batch));
    // OpenBLAS on the host says nothing about a device's GEMMs.
    if (!cuda && !p.run->sgemm_gflops.count(p.batch)) {
      Progress bar(absl::StrFormat("%s: sgemm at batch %d", p.run->spec->name, p.batch), 1, "");
      p.run->sgemm_gflops[p.batch] = MeasureSgemmRate(p.run->gemms, p.batch);
      bar.Finish("", /*keep=*/false);
    }
  }
  struct Trial {
    ModelRun* run;
    int64_t b;
    std::vector<std::unique_ptr<SessionState>> sessions;
    std::vector<SessionState*> ptrs;
    std::vector<float> logits;
    std::vector<double> step_s;
  };
  std::vector<Trial> trials;
  for (const Point& p : points) {
    ModelRun* run = p.run;
    const int64_t b = p.batch;
    Trial t{run, b, {}, {}, std::vector<float>(b * run->spec->config.vocab_size), {}};
    if (cuda) {
      // The caller made sure the pool holds b sessions.
      for (int64_t i = 0; i < b; ++i) t.ptrs.push_back(run->pool[i].get());
    } else {
      Progress bar(absl::StrFormat("%s: %d clones at %d tokens", run->spec->name, b, ctx), 1, "");
      for (int64_t i = 0; i < b; ++i) {
        t.sessions.push_back(run->base->Clone());
        t.ptrs.push_back(t.sessions.back().get());
      }
      bar.Finish("", false);
    }
    trials.push_back(std::move(t));
  }
  Progress bar(absl::StrFormat("ctx %d: %s", ctx, absl::StrJoin(names, " + ")),
               opt.warmup + opt.steps, "steps");
  for (int s = 0; s < opt.warmup + opt.steps; ++s) {
    for (Trial& t : trials) {
      const auto toks = RandomTokens(t.b, t.run->rng, t.run->spec->config.vocab_size);
      if (s == opt.warmup) t.run->engine->ResetProfile();
      const Clock::time_point t0 = Clock::now();
      if (auto st = t.run->engine->Decode(t.ptrs, toks, t.logits); !st.ok()) return st;
      if (s >= opt.warmup) t.step_s.push_back(Seconds(t0, Clock::now()));
    }
    bar.Update(s + 1);
  }
  bar.Finish("", /*keep=*/false);

  std::vector<json> rows;
  for (const Trial& t : trials) {
    const ModelRun& run = *t.run;
    const int64_t b = t.b;
    const ModelConfig& config = run.spec->config;
    const EngineProfile prof = run.engine->profile();
    const double median = Percentile(t.step_s, 0.5);
    const double p90 = Percentile(t.step_s, 0.9);
    const double flops = b * DecodeFlopsPerToken(config, run.gemms, ctx);
    const double gflops = flops / median / 1e9;
    const double ms = 1e3 / opt.steps;
    const SessionStepBytes sb = SessionBytesPerStep(config, ctx, elem);
    const WeightBytes wb = WeightBytesPerStep(config, elem);
    const double weight_bytes = wb.total();
    const double step_bytes = weight_bytes + b * sb.total();
    const double achieved = step_bytes / median / 1e9;
    // A mixer's achieved bandwidth: its weights plus the batch's rows, over its profiled time.
    auto mixer_gbps = [&](double weights, double per_session, double seconds) {
      return seconds > 0 ? (weights + b * per_session) / (seconds / opt.steps) / 1e9 : 0.0;
    };
    const json sgemm = cuda ? json() : json(run.sgemm_gflops.at(b));
    rows.push_back(
        json{{"group", group},
             {"model", run.spec->name},
             {"role", run.spec->role},
             {"device", EngineDeviceName(device)},
             {"engine", run.engine->DescribeDevice()},
             {"context", ctx},
             {"batch", b},
             {"fit_batch", b == run.fit},
             {"steps", opt.steps},
             {"measured_with", names},
             {"ms_per_step_median", median * 1e3},
             {"ms_per_step_p90", p90 * 1e3},
             {"ms_per_step_min", *std::min_element(t.step_s.begin(), t.step_s.end()) * 1e3},
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
                                          : MaxBatch(opt.state_budget_gb, run.state_bytes)}});
  }
  return rows;
}

// Ratios of the SDM model's tokens/s to its twin's, and how each model's step time grows with
// context, for a pair group.
void Summarise(json& group, const json& rows) {
  std::string sdm, attn;
  for (const json& m : group["models"]) {
    if (m["role"] == "sdm") sdm = m["name"];
    if (m["role"] == "attention") attn = m["name"];
  }
  if (sdm.empty() || attn.empty()) return;
  std::map<std::pair<int64_t, int64_t>, json> by_sdm, by_attn;  // (context, batch) -> row
  std::map<int64_t, json> fit_sdm, fit_attn;                    // context -> row
  for (const json& r : rows) {
    if (r["group"] != group["name"]) continue;
    const auto key = std::make_pair(r["context"].get<int64_t>(), r["batch"].get<int64_t>());
    if (r["model"] == sdm) {
      by_sdm[key] = r;
      if (r["fit_batch"]) fit_sdm[key.first] = r;
    } else if (r["model"] == attn) {
      by_attn[key] = r;
      if (r["fit_batch"]) fit_attn[key.first] = r;
    }
  }
  json ratios = json::array();
  int64_t longest = -1;
  for (const auto& [key, s] : by_sdm) {
    auto it = by_attn.find(key);
    if (it == by_attn.end()) continue;
    const json& a = it->second;
    ratios.push_back(
        {{"context", key.first},
         {"batch", key.second},
         {"sdm_tokens_per_s", s["tokens_per_s"]},
         {"attention_tokens_per_s", a["tokens_per_s"]},
         {"sdm_ms_per_step", s["ms_per_step_median"]},
         {"attention_ms_per_step", a["ms_per_step_median"]},
         {"ratio", s["tokens_per_s"].get<double>() / a["tokens_per_s"].get<double>()},
         // The ratio if both steps ran at the same bandwidth: bytes per step, twin over SDM.
         {"bandwidth_floor_ratio",
          a["bytes_per_step"].get<double>() / s["bytes_per_step"].get<double>()},
         {"attention_layers_gbps", a.value("attn_layers_gbps", 0.0)},
         {"sdm_layers_gbps", s.value("sdm_layers_gbps", 0.0)}});
    longest = std::max(longest, key.first);
  }
  group["ratios"] = ratios;
  json fit = json::array();
  for (const auto& [ctx, s] : fit_sdm) {
    auto it = fit_attn.find(ctx);
    if (it == fit_attn.end()) continue;
    fit.push_back(
        {{"context", ctx},
         {"sdm_batch", s["batch"]},
         {"attention_batch", it->second["batch"]},
         {"sdm_tokens_per_s", s["tokens_per_s"]},
         {"attention_tokens_per_s", it->second["tokens_per_s"]},
         {"ratio", s["tokens_per_s"].get<double>() / it->second["tokens_per_s"].get<double>()},
         {"bandwidth_floor_ratio",
          (s["batch"].get<double>() / s["bytes_per_step"].get<double>()) /
              (it->second["batch"].get<double>() / it->second["bytes_per_step"].get<double>())}});
  }
  group["fit_ratios"] = fit;
  // Step-time growth from the shortest to the longest context, per model and batch measured at
  // both.
  json growth = json::array();
  for (const auto* table : {&by_sdm, &by_attn}) {
    if (table->empty()) continue;
    int64_t lo = table->begin()->first.first, hi = lo;
    for (const auto& [key, r] : *table) hi = std::max(hi, key.first);
    for (const auto& [key, r] : *table) {
      if (key.first != lo || lo == hi) continue;
      auto it = table->find({hi, key.second});
      if (it == table->end()) continue;
      const double a = r["ms_per_step_median"], z = it->second["ms_per_step_median"];
      growth.push_back(
          {{"model", r["model"]},
           {"batch", key.second},
           {"shortest_context", lo},
           {"longest_context", hi},
           {"ms_shortest", a},
           {"ms_longest", z},
           {"growth", z / a},
           {"global_layer_ms_shortest",
            r["role"] == "sdm" ? r["sdm_ms_per_step"] : r["attn_ms_per_step"]},
           {"global_layer_ms_longest",
            r["role"] == "sdm" ? it->second["sdm_ms_per_step"] : it->second["attn_ms_per_step"]}});
    }
  }
  group["growth"] = growth;
  json headline;
  headline["longest_common_context"] = longest;
  json at_longest = json::array();
  for (const json& r : ratios) {
    if (r["context"] == longest) at_longest.push_back(r);
  }
  headline["ratios_at_longest_context"] = at_longest;
  for (const json& f : fit) {
    if (f["context"] == longest) headline["fit_ratio_at_longest_context"] = f;
  }
  group["headline"] = headline;
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
  for (json& g : doc["groups"]) Summarise(g, doc["results"]);
  return WriteOutputs(doc, opt);
}

absl::Status RunDecodeBenchmark(const DecodeBenchOptions& opt) {
  const Clock::time_point run_start = Clock::now();
  absl::StatusOr<EngineDevice> resolved = ResolveBenchDevice(opt.device);
  if (!resolved.ok()) return resolved.status();
  const EngineDevice device = *resolved;
  const bool cuda = device == EngineDevice::kCuda;
  const double elem = ElemBytes(device);
  // ---- The groups ----
  std::vector<BenchGroup> groups;
  for (const std::string& p : opt.pairs) {
    absl::StatusOr<BenchGroup> g = NamedPair(p, opt.overrides);
    if (!g.ok()) return g.status();
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
      g.models.push_back({p, "model", *c});
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
  doc["machine"]["blas_threads"] = kernels::cpu::BlasThreads();

  std::printf(
      "# sdm-bench decode: %s, %d hardware threads; engine threads %d, OpenBLAS threads %d\n",
      doc["machine"]["cpu"].get<std::string>().c_str(),
      doc["machine"]["hardware_threads"].get<int>(), threads, kernels::cpu::BlasThreads());
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
      gj["models"].push_back(ModelJson(m, elem));
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
        eo.prefill_chunk = opt.prefill_chunk;
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
            if (auto s = Prefill(run, ctx, prefill_log); !s.ok()) return s;
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
          absl::StatusOr<std::vector<json>> measured =
              MeasureTogether(round, group.name, ctx, opt, device, bandwidth);
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
          for (json& row : *measured) {
            std::printf("%s\n", TableRow(row).c_str());
            rows.push_back(std::move(row));
          }
          std::fflush(stdout);
        }
        for (const std::string& line : skip_lines) std::printf("%s\n", line.c_str());
        std::fflush(stdout);
      }
      for (const ModelRun& run : runs) {
        for (const auto& [b, rate] : run.sgemm_gflops) {
          sgemm.push_back({{"model", run.spec->name}, {"batch", b}, {"gflops", rate}});
        }
      }
      // Leaving the phase frees its models, engines and sessions (device memory included).
    }
    gj["prefill"] = prefill_log;
    gj["capacity"] = capacity;
    gj["sgemm"] = sgemm;
    Summarise(gj, rows);
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
  doc["wall_seconds"] = Seconds(run_start, Clock::now());
  return WriteOutputs(doc, opt);
}

}  // namespace sdm::bench
