// Rotary position embedding over adjacent pairs (docs/model-spec.md §4.2), shared by CPU and CUDA
// kernels: dims 2i and 2i+1 of a head rotate by angle pos * theta^(-2i/head_dim).
//
// The inverse frequency and the angle are fp32 and computed in the order of the reference's
// precomputed table (1 / theta^(2i/head_dim), then pos * that), so that long positions, where a
// one-ulp change of the frequency moves the angle by pos ulps, round alike on every backend.
#ifndef SDMSERVE_KERNELS_COMMON_ROPE_MATH_H_
#define SDMSERVE_KERNELS_COMMON_ROPE_MATH_H_

#include <cmath>
#include <cstdint>

#include "kernels/common/fp_math.h"
#include "kernels/common/host_device.h"

namespace sdm::kernels {

// theta^(-2i/head_dim) for pair i of a head of head_dim dims.
SDM_HOST_DEVICE float RopeInvFreq(int64_t i, int64_t head_dim, float theta) {
  const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
  return 1.0f / powf(theta, exponent);
}

// Angle of a pair at position `pos` (exact in fp32 for pos < 2^24, as int32 positions are).
SDM_HOST_DEVICE float RopeAngle(int64_t pos, float inv_freq) {
  return static_cast<float>(pos) * inv_freq;
}

// Rotates the pair (x0, x1) by the angle whose cosine and sine are c and s (counter-clockwise:
// (1, 0) goes to (c, s)). Callers compute c and s once per pair index and reuse them for every
// head, since the angle does not depend on the head.
SDM_HOST_DEVICE void RopeRotatePair(float c, float s, float* x0, float* x1) {
  const float a = *x0, b = *x1;
  *x0 = a * c - b * s;
  *x1 = a * s + b * c;
}

// RopeRotatePair with each product and sum rounded separately (kernels/common/fp_math.h): what
// the CUDA kernels use, so that every kernel that rotates (ApplyRope, and RopeKvAppend, which
// rotates inside the KV append) gives the same bits whatever the compiler contracts in each.
// Not the CPU's: the backends' RoPE differs anyway, by their sines and cosines.
SDM_HOST_DEVICE void RopeRotatePairRounded(float c, float s, float* x0, float* x1) {
  const float a = *x0, b = *x1;
  *x0 = SubRn(MulRn(a, c), MulRn(b, s));
  *x1 = AddRn(MulRn(a, s), MulRn(b, c));
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_ROPE_MATH_H_
