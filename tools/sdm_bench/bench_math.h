// Small helpers shared by the CPU kernel benchmarks (cpu_gemm_benchmark.cc,
// cpu_attention_benchmark.cc).
#ifndef SDMSERVE_TOOLS_SDM_BENCH_BENCH_MATH_H_
#define SDMSERVE_TOOLS_SDM_BENCH_BENCH_MATH_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace sdm::bench {

// The upper median of timings (v non-empty).
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Fills `n` floats with cheap uniform values in [-1, 1) (the kernels' speed does not depend on
// the values; a normal generator would take longer than the measurement).
inline void FillRandom(float* x, int64_t n, std::mt19937_64& rng) {
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(static_cast<int64_t>(rng() >> 40) - (int64_t{1} << 23)) / 8388608.0f;
  }
}

}  // namespace sdm::bench

#endif  // SDMSERVE_TOOLS_SDM_BENCH_BENCH_MATH_H_
