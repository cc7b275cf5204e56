// `sdm-bench cpu-attention`: the CPU decode attention kernels alone, against the machine's
// streaming-read bandwidth measured in the same run (docs/benchmarks.md, "CPU decode attention").
//
// Protocol: B sessions' KV caches (state_store/kv_cache.h, the engine's own layout: pages of whole
// rows, a ring for a window) are filled with `context` random positions of one attention layer of
// a preset; one decode query per session at the last position attends over them. The blocked
// kernel (kernels/cpu/decode_attention.h) and the per-head kernel (AttendDecodeHead, run as the
// engine ran it: one pool task per (session, head)) alternate, rep by rep, so that load from other
// processes falls on both alike. Reported per kernel: the median time, the KV bytes the queries
// must read (visible positions x 2 x row bytes) over it in GB/s, that rate as a fraction of the
// best streaming-read rate measured at the start and end, and the ratio of the two kernels' times;
// also the largest difference between their outputs (a sanity check, not a test).
#ifndef SDMSERVE_TOOLS_SDM_BENCH_CPU_ATTENTION_BENCHMARK_H_
#define SDMSERVE_TOOLS_SDM_BENCH_CPU_ATTENTION_BENCHMARK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace sdm::bench {

struct CpuAttentionBenchOptions {
  std::string preset = "debug";  // the geometry of its first global (else SWA) attention layer
  std::vector<int64_t> contexts = {8192};
  std::vector<int64_t> batches = {1, 8};
  int64_t window = 0;  // > 0: a sliding window over a ring of window + 256 slots
  int reps = 20;
  int warmup = 3;
  int threads = 0;  // 0: one per hardware thread
  uint64_t seed = 1;
  int64_t bandwidth_mb = 512;
};

absl::Status RunCpuAttentionBenchmark(const CpuAttentionBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_CPU_ATTENTION_BENCHMARK_H_
