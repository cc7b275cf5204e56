#include "kernels/cpu/rope.h"

#include <cmath>

namespace sdm::kernels::cpu {

void ApplyRope(float* x, int64_t n_heads, int64_t head_dim, int64_t pos, float theta) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float freq = 1.0f / std::pow(theta, exponent);
    const float angle = static_cast<float>(pos) * freq;
    const float c = std::cos(angle);
    const float s = std::sin(angle);
    for (int64_t h = 0; h < n_heads; ++h) {
      float* p = x + h * head_dim + 2 * i;
      const float x0 = p[0], x1 = p[1];
      p[0] = x0 * c - x1 * s;
      p[1] = x0 * s + x1 * c;
    }
  }
}

}  // namespace sdm::kernels::cpu
