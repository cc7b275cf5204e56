// Loads that widen a kernel's stored operands to fp32: float as is, uint16_t as bf16 bits
// (base/bf16.h; shifted left by 16, which is exact). The kernels of this folder are templated on
// the element type and read through these, so their fp32 arithmetic is the same for both types.
// Internal to kernels/cpu; header-only, pure.
#ifndef SDMSERVE_KERNELS_CPU_WIDEN_H_
#define SDMSERVE_KERNELS_CPU_WIDEN_H_

#include <cstdint>

#include "base/bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace sdm::kernels::cpu {

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) { return Bf16ToFloat(x); }

#if defined(__AVX2__) && defined(__FMA__)
// Eight consecutive values at p (no alignment needed) as fp32 lanes.
inline __m256 Widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_WIDEN_H_
