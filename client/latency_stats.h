// Summary statistics of latency samples, for the load generator's report.
//
// Percentiles follow the project's one convention (common/percentile.h: linear interpolation
// between the two nearest ranks, NumPy's default).
//
// Thread-compatible.
#ifndef SDMSERVE_CLIENT_LATENCY_STATS_H_
#define SDMSERVE_CLIENT_LATENCY_STATS_H_

#include <cstdint>
#include <vector>

namespace sdm::client {

struct LatencySummary {
  int64_t count = 0;
  // NaN when count is 0.
  double mean;
  double min;
  double p50;
  double p90;
  double p99;
  double max;
};

// Sorts a copy of `samples` and summarises it.
LatencySummary Summarize(std::vector<double> samples);

}  // namespace sdm::client

#endif  // SDMSERVE_CLIENT_LATENCY_STATS_H_
