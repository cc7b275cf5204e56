#include "tools/sdm_bench/decode_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/weight_spec.h"
#include "kernels/cpu/linear.h"
#include "nlohmann/json.hpp"

namespace sdm::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

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
  while (rounds < 3 || elapsed < 0.5) {
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

}  // namespace

absl::Status RunDecodeBenchmark(const DecodeBenchOptions& opt) {
  nlohmann::json results = nlohmann::json::array();
  const unsigned hw = std::thread::hardware_concurrency();
  std::printf("# sdm-bench decode: %u hardware threads, engine threads %d, OpenBLAS threads %d\n",
              hw, opt.threads, kernels::cpu::BlasThreads());
  std::printf("# steps %d (after %d warm-up), state budget %.1f GB, seed %llu\n", opt.steps,
              opt.warmup, opt.state_budget_gb, static_cast<unsigned long long>(opt.seed));
  std::printf("%-10s %7s %5s %9s %9s %9s %8s %7s %8s %8s %8s %9s\n", "model", "context", "batch",
              "ms/step", "p90 ms", "tok/s", "GFLOP/s", "%sgemm", "attn ms", "sdm ms", "ffn ms",
              "MB/sess");
  for (const std::string& preset : opt.presets) {
    auto config = PresetConfig(preset);
    if (!config.ok()) return config.status();
    std::fprintf(stderr, "[%s] building random weights...\n", preset.c_str());
    std::shared_ptr<const Model> model = RandomModel(*config, opt.seed);
    EngineOptions eo;
    eo.num_threads = opt.threads;
    eo.profile = true;
    auto engine_or = Engine::Create(model, eo);
    if (!engine_or.ok()) return engine_or.status();
    Engine& engine = **engine_or;
    const std::vector<GemmShape> gemms = DecodeGemms(*model);
    std::vector<double> sgemm_rate(opt.batches.size());
    for (size_t i = 0; i < opt.batches.size(); ++i) {
      sgemm_rate[i] = MeasureSgemmRate(gemms, opt.batches[i]);
    }
    std::mt19937 rng(static_cast<uint32_t>(opt.seed));
    auto base = engine.NewSession();
    for (int64_t ctx : opt.contexts) {
      // Real prefill, continuing from the previous context length.
      const int64_t todo = ctx - base->position();
      if (todo > 0) {
        const Clock::time_point t0 = Clock::now();
        const int64_t chunk = 1024;
        for (int64_t done = 0; done < todo; done += chunk) {
          const auto toks = RandomTokens(std::min(chunk, todo - done), rng, config->vocab_size);
          if (auto s = engine.Prefill(*base, toks, false, nullptr); !s.ok()) return s;
          std::fprintf(stderr, "\r[%s] prefill %lld/%lld tokens (%.1f s)", preset.c_str(),
                       static_cast<long long>(base->position()), static_cast<long long>(ctx),
                       Seconds(t0, Clock::now()));
        }
        std::fprintf(stderr, "\n");
      }
      const double session_bytes = static_cast<double>(base->ResidentBytes());
      for (size_t bi = 0; bi < opt.batches.size(); ++bi) {
        const int64_t b = opt.batches[bi];
        if (b * session_bytes > opt.state_budget_gb * 1e9) {
          std::printf("%-10s %7lld %5lld   skipped: %.1f GB of state exceeds the budget\n",
                      preset.c_str(), static_cast<long long>(ctx), static_cast<long long>(b),
                      b * session_bytes / 1e9);
          continue;
        }
        std::vector<std::unique_ptr<SessionState>> sessions;
        std::vector<SessionState*> ptrs;
        for (int64_t i = 0; i < b; ++i) {
          sessions.push_back(base->Clone());
          ptrs.push_back(sessions.back().get());
        }
        std::vector<float> logits(b * config->vocab_size);
        std::vector<double> step_s;
        EngineProfile prof;
        for (int s = 0; s < opt.warmup + opt.steps; ++s) {
          const auto toks = RandomTokens(b, rng, config->vocab_size);
          if (s == opt.warmup) engine.ResetProfile();
          const Clock::time_point t0 = Clock::now();
          if (auto st = engine.Decode(ptrs, toks, logits); !st.ok()) return st;
          if (s >= opt.warmup) step_s.push_back(Seconds(t0, Clock::now()));
        }
        prof = engine.profile();
        const double median = Percentile(step_s, 0.5);
        const double p90 = Percentile(step_s, 0.9);
        const double flops = b * DecodeFlopsPerToken(*config, gemms, ctx);
        const double gflops = flops / median / 1e9;
        const double frac = gflops / sgemm_rate[bi];
        const double per_step = 1e3 / opt.steps;
        std::printf("%-10s %7lld %5lld %9.2f %9.2f %9.1f %8.1f %6.1f%% %8.2f %8.2f %8.2f %9.1f\n",
                    preset.c_str(), static_cast<long long>(ctx), static_cast<long long>(b),
                    median * 1e3, p90 * 1e3, b / median, gflops, 100 * frac,
                    (prof.attn_seconds + prof.swa_seconds) * per_step, prof.sdm_seconds * per_step,
                    prof.ffn_seconds * per_step, session_bytes / 1e6);
        std::fflush(stdout);
        results.push_back({{"model", preset},
                           {"context", ctx},
                           {"batch", b},
                           {"ms_per_step_median", median * 1e3},
                           {"ms_per_step_p90", p90 * 1e3},
                           {"tokens_per_s", b / median},
                           {"gflops", gflops},
                           {"sgemm_gflops_same_shapes", sgemm_rate[bi]},
                           {"fraction_of_sgemm", frac},
                           {"attn_ms_per_step", (prof.attn_seconds + prof.swa_seconds) * per_step},
                           {"sdm_ms_per_step", prof.sdm_seconds * per_step},
                           {"ffn_ms_per_step", prof.ffn_seconds * per_step},
                           {"state_bytes_per_session", session_bytes}});
      }
    }
    for (size_t i = 0; i < opt.batches.size(); ++i) {
      std::printf("# %s: OpenBLAS sgemm at the step's shapes, batch %lld: %.1f GFLOP/s\n",
                  preset.c_str(), static_cast<long long>(opt.batches[i]), sgemm_rate[i]);
    }
  }
  if (!opt.json_path.empty()) {
    std::ofstream out(opt.json_path);
    out << results.dump(2) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("could not write ", opt.json_path));
  }
  return absl::OkStatus();
}

}  // namespace sdm::bench
