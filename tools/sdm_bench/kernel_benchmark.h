// `sdm-bench kernels`: CUDA microbenchmarks of the kernels a decode step is made of, against the
// device's own copy bandwidth (docs/benchmarks.md, "CUDA (no figures yet)"). Built only with CUDA
// (SDM_HAVE_CUDA); main.cc answers "built without CUDA" otherwise.
//
// Every figure is timed with cudaEvents on one stream: `warmup` untimed repetitions, then the
// median (and minimum) of `reps` timed ones. Inputs are random (fixed seed); addressing inputs are
// distinct slots per (session, head) whose rows were allocated by SdmPrepareRows from a fully
// free arena, and consecutive repetitions touch different rows and sequences (enough that the
// working set of a cycle is several times the L2 cache), so that no figure is an L2 figure.
//   - copy: device-to-device cudaMemcpy, read + write bytes / time (the ceiling);
//   - sdm step: SdmStep alone on prepared rows, SdmPrepareRows + SdmStep, and SdmDecodeStep (the
//     slots already have rows: the steady state), sdm_flagship geometry (2 heads, s = 256, hd =
//     1024, W = R = 128); bytes = per (session, head) W rows read + W rows written + R rows read, 2
//     B a value (docs/model-spec.md §9); target >= 70% of copy;
//   - attention decode: AttentionDecode over `context` cached positions per sequence,
//     baseline_1.4B geometry (16 query / 8 KV heads, head_dim 128), pages scattered at random in
//     the arena; bytes = the K and V rows read; target >= 70% of copy;
//   - park / resume: cudaMemcpyAsync of an sdm_flagship-sized state (6 layers x 2 heads x 65,536
//     slots x 1024 x 2 B = 1.61 GB) device -> pinned host and back; target >= 25 GB/s each way;
//   - gemm q,k,v / w1,w3, apart and stacked: cuBLASLt at sdm_flagship's shapes as separate GEMMs
//     and as the one GEMM over stacked weights the engine runs (engine/stacked_projection.h),
//     cycling through 8 copies of the weights; bytes = the weights; no target (the two compared).
//     Run last: its output is checked against the separate GEMMs', and a failure is returned
//     after the JSON of every figure is written.
#ifndef SDMSERVE_TOOLS_SDM_BENCH_KERNEL_BENCHMARK_H_
#define SDMSERVE_TOOLS_SDM_BENCH_KERNEL_BENCHMARK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace sdm::bench {

struct KernelBenchOptions {
  std::vector<int64_t> batches = {1, 8, 64};  // sessions (SDM) and sequences (attention)
  int64_t context = 32768;                    // attention: cached positions per sequence
  int reps = 20;
  int warmup = 3;
  int64_t copy_mb = 2048;  // each of the two buffers of the copy measurement
  uint64_t seed = 1;
  std::string json_path;     // empty: no JSON file
  std::string command_line;  // recorded in the JSON
};

// Unavailable when no CUDA device is present.
absl::Status RunKernelBenchmark(const KernelBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_KERNEL_BENCHMARK_H_
