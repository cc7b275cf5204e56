#include "common/percentile.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace sdm {

double PercentileOfSorted(absl::Span<const double> sorted, double p) {
  if (sorted.empty()) return std::numeric_limits<double>::quiet_NaN();
  p = std::clamp(p, 0.0, 100.0);
  const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t k = static_cast<size_t>(std::floor(rank));
  if (k + 1 >= sorted.size()) return sorted.back();
  const double f = rank - static_cast<double>(k);
  return sorted[k] + (sorted[k + 1] - sorted[k]) * f;
}

double Percentile(std::vector<double> samples, double p) {
  std::sort(samples.begin(), samples.end());
  return PercentileOfSorted(samples, p);
}

}  // namespace sdm
