#include "client/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace sdm::client {

double PercentileOfSorted(absl::Span<const double> sorted, double p) {
  if (sorted.empty()) return std::numeric_limits<double>::quiet_NaN();
  p = std::clamp(p, 0.0, 100.0);
  const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t k = static_cast<size_t>(std::floor(rank));
  if (k + 1 >= sorted.size()) return sorted.back();
  const double f = rank - static_cast<double>(k);
  return sorted[k] + (sorted[k + 1] - sorted[k]) * f;
}

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
