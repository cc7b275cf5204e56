// `sdm-bench decode`: steady-state decode throughput of a model against batch size and context
// length, on the engine directly (no server), with random weights built in memory.
//
// Protocol (docs/benchmarks.md): one session is prefilled with random tokens to each context
// length in turn (real prefill, continuing from the previous length); for each batch size B the
// session is cloned B times (a deep copy of its KV cache and SDM rows: the same state a real
// prefill of each would leave) and the B clones decode `warmup` untimed steps, then `steps` timed
// steps of one token each. A batch size is skipped when B sessions' state would exceed the state
// budget. The GEMMs of one decode step are also timed alone with OpenBLAS at the same shapes in
// the same run; the step's FLOP rate is reported as a fraction of that sgemm rate.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_DECODE_BENCHMARK_H_
#define SDMSERVE_TOOLS_SDM_BENCH_DECODE_BENCHMARK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace sdm::bench {

struct DecodeBenchOptions {
  std::vector<std::string> presets = {"debug_sdm", "debug"};
  std::vector<int64_t> contexts = {512, 4096, 16384};
  std::vector<int64_t> batches = {1, 4, 8, 16, 32};
  int steps = 10;
  int warmup = 2;
  int threads = 0;
  double state_budget_gb = 8.0;
  uint64_t seed = 1;
  std::string json_path;  // empty: no JSON file
};

absl::Status RunDecodeBenchmark(const DecodeBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_DECODE_BENCHMARK_H_
