// Test helper for kernels that read one part of a stacked projection's output
// (engine/stacked_projection.h): rows of a part sit `stride` floats apart, with other parts'
// columns between them.
#ifndef SDMSERVE_TESTS_KERNELS_STRIDED_ROWS_H_
#define SDMSERVE_TESTS_KERNELS_STRIDED_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace sdm::kernels {

// `rows` (back to back, `width` values each) copied `stride` apart, the gaps NaN: a kernel that
// reads a gap puts a NaN into its output.
inline std::vector<float> Strided(const std::vector<float>& rows, int64_t width, int64_t stride) {
  const int64_t n = static_cast<int64_t>(rows.size()) / width;
  std::vector<float> out(n * stride, std::numeric_limits<float>::quiet_NaN());
  for (int64_t r = 0; r < n; ++r) {
    std::copy(rows.begin() + r * width, rows.begin() + (r + 1) * width, out.begin() + r * stride);
  }
  return out;
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_TESTS_KERNELS_STRIDED_ROWS_H_
