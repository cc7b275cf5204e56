#include "kernels/cpu/vector_math.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/common/sdm_math.h"

namespace sdm::kernels::cpu {

float Dot(const float* a, const float* b, int64_t n) {
  // Eight independent partial sums, combined in a fixed order: the compiler vectorises the loop
  // without reassociating beyond what is written here.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void SwiGlu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Silu(gate[i]) * up[i];
}

void MulSigmoid(const float* g, float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= Sigmoid(g[i]);
}

void AddInPlace(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void Softmax(float* x, int64_t n, float scale) {
  float max_v = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    x[i] *= scale;
    max_v = std::max(max_v, x[i]);
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_v);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace sdm::kernels::cpu
