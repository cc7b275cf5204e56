// RoPE's inverse frequencies as a kernel parameter, shared by the CUDA kernels that rotate
// (ApplyRope in elementwise.cu, RopeKvAppend in attention.cu). Computed on the host by
// RopeInvFreq (kernels/common/rope_math.h, the CPU engine's powf) and passed by value, so the
// device uses bit-identical frequencies: at position p an ulp of frequency is p ulps of angle.
#ifndef SDMSERVE_KERNELS_CUDA_ROPE_FREQS_H_
#define SDMSERVE_KERNELS_CUDA_ROPE_FREQS_H_

#include <cstdint>

#include "kernels/common/rope_math.h"

namespace sdm::kernels::cuda {

// 2 KiB of kernel parameters: heads of up to 1024 dims.
inline constexpr int64_t kMaxRopePairs = 512;
struct RopeFreqs {
  float inv_freq[kMaxRopePairs];
};

// The table for heads of `head_dim` dims; false (nothing written) when they have more pairs than
// it holds.
inline bool HostRopeFreqs(int64_t head_dim, float theta, RopeFreqs* freqs) {
  const int64_t half = head_dim / 2;
  if (half > kMaxRopePairs) return false;
  for (int64_t i = 0; i < half; ++i) freqs->inv_freq[i] = RopeInvFreq(i, head_dim, theta);
  return true;
}

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_ROPE_FREQS_H_
