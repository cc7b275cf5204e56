#include "client/latency_stats.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "common/percentile.h"

namespace sdm::client {

LatencySummary Summarize(std::vector<double> samples) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  LatencySummary s{0, nan, nan, nan, nan, nan, nan};
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  s.count = static_cast<int64_t>(samples.size());
  s.mean = std::accumulate(samples.begin(), samples.end(), 0.0) / static_cast<double>(s.count);
  s.min = samples.front();
  s.p50 = PercentileOfSorted(samples, 50);
  s.p90 = PercentileOfSorted(samples, 90);
  s.p99 = PercentileOfSorted(samples, 99);
  s.max = samples.back();
  return s;
}

}  // namespace sdm::client
