// The counter-based generator behind sampling (engine/sampler.h): Philox4x32-10 and the one
// uniform draw u = UniformDraw(seed, draw_index) a sampled token consumes. Shared by the CPU
// sampler and the CUDA sampling kernel so that both draw bit-identical numbers; integer arithmetic
// plus one exact scaling, so there is nothing for either compiler to round differently.
#ifndef SDMSERVE_KERNELS_COMMON_PHILOX_H_
#define SDMSERVE_KERNELS_COMMON_PHILOX_H_

#include <cstdint>

#include "kernels/common/host_device.h"

namespace sdm::kernels {

// Four 32-bit words (a counter or an output block); a plain array so device code can use it.
struct PhiloxBlock {
  uint32_t v[4];
};

// The Philox4x32-10 block function (Salmon et al., SC'11), as Random123 defines it: ten rounds of
// two 32x32->64 multiplications, the key bumped by the Weyl increments between rounds.
SDM_HOST_DEVICE PhiloxBlock Philox4x32_10(PhiloxBlock counter, uint32_t key0, uint32_t key1) {
  constexpr uint64_t kMul0 = 0xD2511F53;
  constexpr uint64_t kMul1 = 0xCD9E8D57;
  constexpr uint32_t kWeyl0 = 0x9E3779B9;
  constexpr uint32_t kWeyl1 = 0xBB67AE85;
  uint32_t* x = counter.v;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += kWeyl0;
      key1 += kWeyl1;
    }
    const uint64_t p0 = kMul0 * x[0];
    const uint64_t p1 = kMul1 * x[2];
    const uint32_t y0 = static_cast<uint32_t>(p1 >> 32) ^ x[1] ^ key0;
    const uint32_t y2 = static_cast<uint32_t>(p0 >> 32) ^ x[3] ^ key1;
    x[0] = y0;
    x[1] = static_cast<uint32_t>(p1);
    x[2] = y2;
    x[3] = static_cast<uint32_t>(p0);
  }
  return counter;
}

// A uniform number in [0, 1) with 53 random bits: the first two words of
// Philox4x32_10(counter = {draw_index low, draw_index high, 0, 0}, key = {seed low, seed high}),
// (x0 << 32 | x1) >> 11, times 2^-53 (exact: a 53-bit integer scaled by a power of two).
SDM_HOST_DEVICE double UniformDraw(uint64_t seed, uint64_t draw_index) {
  PhiloxBlock counter;
  counter.v[0] = static_cast<uint32_t>(draw_index);
  counter.v[1] = static_cast<uint32_t>(draw_index >> 32);
  counter.v[2] = 0;
  counter.v[3] = 0;
  const PhiloxBlock x =
      Philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = ((static_cast<uint64_t>(x.v[0]) << 32) | x.v[1]) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}

}  // namespace sdm::kernels

#endif  // SDMSERVE_KERNELS_COMMON_PHILOX_H_
