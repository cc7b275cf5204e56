#include "kernels/cpu/rope.h"

#include <cmath>

#include "kernels/common/rope_math.h"

namespace sdm::kernels::cpu {

void ApplyRope(float* x, int64_t n_heads, int64_t head_dim, int64_t pos, float theta) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    // The angle depends on the pair index only: one cos/sin for all heads.
    const float angle = RopeAngle(pos, RopeInvFreq(i, head_dim, theta));
    const float c = std::cos(angle);
    const float s = std::sin(angle);
    for (int64_t h = 0; h < n_heads; ++h) {
      float* p = x + h * head_dim + 2 * i;
      RopeRotatePair(c, s, &p[0], &p[1]);
    }
  }
}

}  // namespace sdm::kernels::cpu
