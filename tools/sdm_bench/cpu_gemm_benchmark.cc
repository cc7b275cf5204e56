#include "tools/sdm_bench/cpu_gemm_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "engine/model_config.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/parallel.h"
#include "tools/sdm_bench/bench_math.h"
#include "tools/sdm_bench/system_info.h"

namespace sdm::bench {
namespace {

namespace cpu = kernels::cpu;
using Clock = std::chrono::steady_clock;

}  // namespace

absl::Status RunCpuGemmBenchmark(const CpuGemmBenchOptions& opt) {
  absl::StatusOr<ModelConfig> config = PresetConfig(opt.preset);
  if (!config.ok()) return config.status();
  int64_t attn = -1;
  for (int64_t i = 0; i < config->n_layers && attn < 0; ++i) {
    if (config->layer_types[i] == LayerType::kAttn || config->layer_types[i] == LayerType::kSwa) {
      attn = i;
    }
  }
  const int64_t d = config->dim, ffn = FfnHiddenDim(*config);
  // [n, k] of one layer's matrices.
  std::vector<std::pair<int64_t, int64_t>> layer = {{ffn, d}, {ffn, d}, {d, ffn}};
  if (attn >= 0) {
    const AttentionGeometry g = AttentionGeometryOf(*config, attn);
    layer.push_back({(g.n_heads + 2 * g.n_kv_heads) * g.head_dim, d});
    layer.push_back({d, g.n_heads * g.head_dim});
  }
  const int threads =
      opt.threads > 0 ? opt.threads : static_cast<int>(std::thread::hardware_concurrency());
  cpu::ThreadPool pool(threads);
  std::vector<cpu::GemmIsa> isas = cpu::AvailableGemmIsas();
  if (!opt.isas.empty()) {
    isas.clear();
    for (const std::string& name : opt.isas) {
      const std::optional<cpu::GemmIsa> isa = cpu::ParseGemmIsa(name);
      if (!isa.has_value() || !cpu::GemmIsaAvailable(*isa)) {
        return absl::InvalidArgumentError("--gemm_isas: " + name +
                                          " is not an available instruction set");
      }
      isas.push_back(*isa);
    }
  }

  std::printf("# sdm-bench cpu-gemm  %s\n", UtcNow().c_str());
  std::printf("# %s: dim %lld, ffn %lld; %d threads; active ISA %s; load average %s\n",
              opt.preset.c_str(), static_cast<long long>(d), static_cast<long long>(ffn), threads,
              cpu::GemmIsaName(), LoadAverageText().c_str());
  std::mt19937_64 rng(opt.seed);
  for (DType type : {DType::kF32, DType::kBf16}) {
    std::deque<cpu::PackedMatrix> mats;
    int64_t bytes = 0, fp32_bytes = 0, max_n = 0, max_k = 0;
    while (fp32_bytes < opt.megabytes * (int64_t{1} << 20)) {
      for (auto [n, k] : layer) {
        std::vector<float> w(n * k);
        FillRandom(w.data(), n * k, rng);
        mats.emplace_back(w.data(), n, k, type);
        bytes += mats.back().bytes();
        fp32_bytes += n * k * 4;
        max_n = std::max(max_n, n);
        max_k = std::max(max_k, k);
      }
    }
    for (int64_t batch : opt.batches) {
      std::vector<float> x(batch * max_k);
      FillRandom(x.data(), static_cast<int64_t>(x.size()), rng);
      std::vector<std::vector<float>> y(isas.size(), std::vector<float>(batch * max_n));
      std::vector<std::vector<double>> times(isas.size());
      for (int rep = 0; rep < opt.warmup + opt.reps; ++rep) {
        for (size_t i = 0; i < isas.size(); ++i) {
          const Clock::time_point t0 = Clock::now();
          for (const cpu::PackedMatrix& m : mats) {
            cpu::LinearInvariantWith(isas[i], x.data(), batch, m, nullptr, y[i].data(), &pool);
          }
          const double s = std::chrono::duration<double>(Clock::now() - t0).count();
          if (rep >= opt.warmup) times[i].push_back(s);
        }
      }
      // The timed loop overwrites one output per matrix: every matrix is checked here, once.
      bool same = true;
      for (const cpu::PackedMatrix& m : mats) {
        if (isas.size() < 2 || !same) break;
        const size_t out = static_cast<size_t>(batch * m.n());
        for (size_t i = 0; i < isas.size(); ++i) {
          cpu::LinearInvariantWith(isas[i], x.data(), batch, m, nullptr, y[i].data(), &pool);
          same = same && std::equal(y[i].begin(), y[i].begin() + out, y[0].begin());
        }
      }
      double avx2 = 0;
      for (size_t i = 0; i < isas.size(); ++i) {
        if (isas[i] == cpu::GemmIsa::kAvx2) avx2 = Median(times[i]);
      }
      // Against avx2 only when it ran; bit-identity only when there is something to compare.
      const char* agreement = isas.size() < 2 ? ""
                              : same          ? "; outputs bit-identical"
                                              : "; OUTPUTS DIFFER";
      for (size_t i = 0; i < isas.size(); ++i) {
        const double t = Median(times[i]);
        const std::string speed = avx2 > 0 ? absl::StrFormat("  %5.2fx avx2", avx2 / t) : "";
        std::printf("%-5s batch %3lld  %-7s  %8.3f ms  %6.1f GB/s%s  (%zu matrices, %.0f MB%s)\n",
                    type == DType::kBf16 ? "bf16" : "fp32", static_cast<long long>(batch),
                    cpu::GemmIsaName(isas[i]), t * 1e3, bytes / t / 1e9, speed.c_str(), mats.size(),
                    bytes / 1e6, agreement);
      }
      std::fflush(stdout);
      if (!same) return absl::InternalError("the instruction sets' outputs differ");
    }
  }
  std::printf("# end %s; load average %s\n", UtcNow().c_str(), LoadAverageText().c_str());
  return absl::OkStatus();
}

}  // namespace sdm::bench
