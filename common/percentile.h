// Percentiles of samples: the one convention every report of the project uses (sdm-bench's
// step times and copy rates, the load generator's latencies).
//
// Linear interpolation between the two nearest ranks (NumPy's default "linear" method,
// Hyndman & Fan's type 7): with the n samples sorted ascending as x[0..n-1], the p-th percentile
// is x[k] + (x[k+1] - x[k]) * f where p / 100 * (n - 1) = k + f. So p0 is the minimum, p100 the
// maximum, and p50 of an even count the mean of the two middle samples.
//
// Dependency-free (Abseil's span only), so that every layer may link it. Pure functions:
// thread-safe.
#ifndef SDMSERVE_COMMON_PERCENTILE_H_
#define SDMSERVE_COMMON_PERCENTILE_H_

#include <vector>

#include "absl/types/span.h"

namespace sdm {

// The p-th percentile (p in [0, 100], clamped) of `sorted`, which must be sorted ascending.
// NaN when it is empty.
double PercentileOfSorted(absl::Span<const double> sorted, double p);

// The same of unsorted `samples` (a copy is sorted).
double Percentile(std::vector<double> samples, double p);

}  // namespace sdm

#endif  // SDMSERVE_COMMON_PERCENTILE_H_
