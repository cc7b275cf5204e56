#include "kernels/cpu/norm.h"

#include <cmath>

#include "kernels/common/fp_math.h"

namespace sdm::kernels::cpu {

void RmsNorm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * inv) * w[i];
  }
}

void LayerNorm(float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * n;
    double mean = 0.0;
    for (int64_t i = 0; i < n; ++i) mean += xr[i];
    mean /= static_cast<double>(n);
    double var = 0.0;
    for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= static_cast<double>(n);
    const float inv = 1.0f / std::sqrt(static_cast<float>(var) + eps);
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) xr[i] = (xr[i] - m) * inv * w[i] + b[i];
  }
}

void BatchNormEval(float* x, const float* w, const float* b, const float* mean, const float* var,
                   int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * n;
    for (int64_t j = 0; j < n; ++j) {
      // The shared helper: the CUDA kernel rounds every operation the same way.
      xr[j] = BatchNormEvalValue(xr[j], mean[j], var[j], w[j], b[j], eps);
    }
  }
}

}  // namespace sdm::kernels::cpu
