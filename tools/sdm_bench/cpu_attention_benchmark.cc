#include "tools/sdm_bench/cpu_attention_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/model_config.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/decode_attention.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/parallel.h"
#include "state_store/kv_cache.h"
#include "tools/sdm_bench/bench_math.h"
#include "tools/sdm_bench/system_info.h"

namespace sdm::bench {
namespace {

namespace cpu = kernels::cpu;
using Clock = std::chrono::steady_clock;

// Ring slots beyond the window, as the engine sizes them (window + prefill chunk).
constexpr int64_t kRingSlack = 256;

}  // namespace

absl::Status RunCpuAttentionBenchmark(const CpuAttentionBenchOptions& opt) {
  absl::StatusOr<ModelConfig> config = PresetConfig(opt.preset);
  if (!config.ok()) return config.status();
  // The first global attention layer (else the first sliding-window one): its heads and head_dim.
  int64_t layer = -1;
  for (LayerType type : {LayerType::kAttn, LayerType::kSwa}) {
    for (int64_t i = 0; i < config->n_layers && layer < 0; ++i) {
      if (config->layer_types[i] == type) layer = i;
    }
  }
  if (layer < 0) return absl::InvalidArgumentError(opt.preset + " has no attention layer");
  const AttentionGeometry g = AttentionGeometryOf(*config, layer);
  const int64_t row = g.n_kv_heads * g.head_dim;
  const cpu::AttentionShape shape{g.n_heads, g.n_kv_heads, g.head_dim, opt.window, row};
  const int threads =
      opt.threads > 0 ? opt.threads : static_cast<int>(std::thread::hardware_concurrency());
  cpu::ThreadPool pool(threads);

  std::printf("# sdm-bench cpu-attention  %s\n", UtcNow().c_str());
  std::printf(
      "# shape: %s layer %lld: %lld heads, %lld kv heads, head_dim %lld, window %lld; "
      "%d threads; load average %s\n",
      opt.preset.c_str(), static_cast<long long>(layer), static_cast<long long>(g.n_heads),
      static_cast<long long>(g.n_kv_heads), static_cast<long long>(g.head_dim),
      static_cast<long long>(opt.window), threads, LoadAverageText().c_str());
  const int64_t bw_bytes = opt.bandwidth_mb * (int64_t{1} << 20);
  const Bandwidth bw0 = MeasureBandwidth(bw_bytes, threads);
  std::printf("# memory bandwidth (start, %d threads): read %.1f GB/s, copy %.1f GB/s\n", threads,
              bw0.read_gbps, bw0.copy_gbps);
  std::fflush(stdout);

  struct Row {
    int64_t context, batch;
    double blocked_s, per_head_s, bytes, max_diff;
    double avx2_s;   // the blocked kernel on the AVX2 loops (0: not run, AVX2 is the active ISA)
    bool avx2_same;  // and its output bit for bit the active ISA's
  };
  // With AVX-512 active, the blocked kernel on the AVX2 loops as well, interleaved.
  const bool compare_avx2 = cpu::ActiveGemmIsa() == cpu::GemmIsa::kAvx512;
  std::vector<Row> rows;
  std::mt19937_64 rng(opt.seed);
  for (int64_t context : opt.contexts) {
    for (int64_t batch : opt.batches) {
      const int64_t ring = opt.window > 0 ? opt.window + kRingSlack : 0;
      std::vector<KvCache> caches;
      for (int64_t b = 0; b < batch; ++b) {
        caches.emplace_back(row, ring);
        for (int64_t p = 0; p < context; ++p) {
          FillRandom(caches.back().NextKeyRow(), row, rng);
          FillRandom(caches.back().NextValueRow(), row, rng);
          caches.back().Commit();
        }
      }
      const int64_t pos = context - 1;
      const int64_t visible = pos + 1 - cpu::FirstVisiblePosition(pos, opt.window);
      std::vector<float> q(batch * g.n_heads * g.head_dim);
      FillRandom(q.data(), static_cast<int64_t>(q.size()), rng);
      std::vector<float> out_blocked(q.size()), out_head(q.size()), out_avx2(q.size());
      std::vector<std::vector<cpu::KvSpan>> spans(batch);
      std::vector<cpu::DecodeQuery> queries;
      const int64_t width = g.n_heads * g.head_dim;
      for (int64_t b = 0; b < batch; ++b) {
        caches[b].ForEachSpan(cpu::FirstVisiblePosition(pos, opt.window), pos + 1,
                              [&](int64_t p, int64_t n, const float* k, const float* v) {
                                spans[b].push_back({k, v, p, n});
                              });
        queries.push_back({&q[b * width], pos, spans[b], &out_blocked[b * width]});
      }
      std::vector<cpu::DecodeQuery> queries_avx2 = queries;
      for (int64_t b = 0; b < batch; ++b) queries_avx2[b].out = &out_avx2[b * width];
      auto blocked = [&] { cpu::AttendDecodeBatch(queries, shape, &pool); };
      auto blocked_avx2 = [&] {
        cpu::AttendDecodeBatch(queries_avx2, shape, &pool, cpu::GemmIsa::kAvx2);
      };
      auto per_head = [&] {
        pool.ParallelFor(batch * g.n_heads, [&](int64_t task) {
          const int64_t b = task / g.n_heads;
          const int64_t h = task % g.n_heads;
          cpu::AttendDecodeHead(&q[b * width + h * g.head_dim], h, pos, spans[b], shape,
                                &out_head[b * width + h * g.head_dim]);
        });
      };
      auto time = [](auto&& fn) {
        const Clock::time_point t0 = Clock::now();
        fn();
        return std::chrono::duration<double>(Clock::now() - t0).count();
      };
      std::vector<double> tb, th, ta;
      for (int r = 0; r < opt.warmup + opt.reps; ++r) {
        const double b = time(blocked);
        const double h = time(per_head);
        const double a = compare_avx2 ? time(blocked_avx2) : 0.0;
        if (r >= opt.warmup) {
          tb.push_back(b);
          th.push_back(h);
          ta.push_back(a);
        }
      }
      double max_diff = 0;
      for (size_t i = 0; i < q.size(); ++i) {
        max_diff = std::max(max_diff, static_cast<double>(std::abs(out_blocked[i] - out_head[i])));
      }
      rows.push_back({context, batch, Median(tb), Median(th),
                      static_cast<double>(batch * visible * 2 * row * sizeof(float)), max_diff,
                      compare_avx2 ? Median(ta) : 0.0, out_avx2 == out_blocked});
      std::printf("# measured context %lld batch %lld\n", static_cast<long long>(context),
                  static_cast<long long>(batch));
      std::fflush(stdout);
    }
  }
  const Bandwidth bw1 = MeasureBandwidth(bw_bytes, threads);
  const double read = std::max(bw0.read_gbps, bw1.read_gbps);
  std::printf(
      "# memory bandwidth (end): read %.1f GB/s, copy %.1f GB/s; reference (best read) "
      "%.1f GB/s; load average %s\n",
      bw1.read_gbps, bw1.copy_gbps, read, LoadAverageText().c_str());
  std::printf(
      "# blocked: the active instruction set's loops (%s)%s\n", cpu::GemmIsaName(),
      compare_avx2 ? "; avx2: the same kernel on the AVX2 loops (must be the same bits)" : "");
  std::printf("%8s %6s %10s | %11s %8s %7s | %11s %8s %7s | %9s %9s", "context", "batch", "KV MB",
              "blocked ms", "GB/s", "%read", "per-head ms", "GB/s", "%read", "speedup", "max diff");
  if (compare_avx2) std::printf(" | %9s %8s %7s %9s", "avx2 ms", "GB/s", "%read", "same bits");
  std::printf("\n");
  for (const Row& r : rows) {
    const double gb_b = r.bytes / r.blocked_s / 1e9, gb_h = r.bytes / r.per_head_s / 1e9;
    std::printf("%8lld %6lld %10.1f | %11.3f %8.1f %6.0f%% | %11.3f %8.1f %6.0f%% | %8.2fx %9.2g",
                static_cast<long long>(r.context), static_cast<long long>(r.batch), r.bytes / 1e6,
                r.blocked_s * 1e3, gb_b, 100 * gb_b / read, r.per_head_s * 1e3, gb_h,
                100 * gb_h / read, r.per_head_s / r.blocked_s, r.max_diff);
    if (compare_avx2) {
      const double gb_a = r.bytes / r.avx2_s / 1e9;
      std::printf(" | %9.3f %8.1f %6.0f%% %9s", r.avx2_s * 1e3, gb_a, 100 * gb_a / read,
                  r.avx2_same ? "yes" : "NO");
    }
    std::printf("\n");
  }
  // A bit-identity check that fails is a failed run (as cpu-gemm's), the table printed first.
  for (const Row& r : rows) {
    if (compare_avx2 && !r.avx2_same) {
      return absl::InternalError(absl::StrCat("the AVX2 and AVX-512 decode attention differ at ",
                                              r.context, " positions, batch ", r.batch));
    }
  }
  return absl::OkStatus();
}

}  // namespace sdm::bench
