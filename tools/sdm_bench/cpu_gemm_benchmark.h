// `sdm-bench cpu-gemm`: the CPU engine's batch-invariant GEMM alone (kernels/cpu/gemm.h), each
// instruction set's micro-kernels (kernels/cpu/gemm_isa.h) interleaved in one run
// (docs/benchmarks.md, "CPU GEMM by instruction set").
//
// Protocol: the dense matrices of a preset's decode step (per layer: the q/k/v/o projections of
// its first attention layer's shape and the three FFN matrices; layers until the packed bytes
// reach `megabytes`, so the weights stream from memory as in decode) are packed as fp32 and as
// bf16. One rep multiplies a batch of B random rows through every matrix in turn on a thread
// pool, as a decode step does. Per (dtype, batch) the ISAs alternate rep by rep, so load from
// other processes falls on all alike. Reported: the median time per rep, the packed bytes over it
// in GB/s, and each ISA's speed relative to avx2 (the pre-AVX-512 path); also whether the outputs
// of all ISAs were bit-identical (they must be).
#ifndef SDMSERVE_TOOLS_SDM_BENCH_CPU_GEMM_BENCHMARK_H_
#define SDMSERVE_TOOLS_SDM_BENCH_CPU_GEMM_BENCHMARK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace sdm::bench {

struct CpuGemmBenchOptions {
  std::string preset = "debug";
  std::vector<int64_t> batches = {1, 8};
  std::vector<std::string> isas;  // names (kernels/cpu/gemm_isa.h); empty: every available one
  int64_t megabytes = 256;        // fp32 packed bytes of the matrices (bf16: half)
  int reps = 20;
  int warmup = 3;
  int threads = 0;  // 0: one per hardware thread
  uint64_t seed = 1;
};

absl::Status RunCpuGemmBenchmark(const CpuGemmBenchOptions& options);

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_CPU_GEMM_BENCHMARK_H_
