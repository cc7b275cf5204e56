// Summary statistics of latency samples, for the load generator's report.
//
// Percentiles interpolate linearly between the two nearest ranks (NumPy's default "linear"
// method): with the n samples sorted ascending as x[0..n-1], the p-th percentile is
// x[k] + (x[k+1] - x[k]) * f where p / 100 * (n - 1) = k + f. So p0 is the minimum, p100 the
// maximum, p50 of an even count the mean of the two middle samples.
//
// Thread-compatible.
#ifndef SDMSERVE_CLIENT_LATENCY_STATS_H_
#define SDMSERVE_CLIENT_LATENCY_STATS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace sdm::client {

// The p-th percentile (p in [0, 100], clamped) of `sorted`, which must be sorted ascending.
// NaN when it is empty.
double PercentileOfSorted(absl::Span<const double> sorted, double p);

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
