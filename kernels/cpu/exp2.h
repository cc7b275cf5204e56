// 2^x for x <= 0, by one fixed sequence of fp32 operations that the vector form repeats lane by
// lane, so that scalar and SIMD code (and every instruction set) give the same bits. The decode
// attention's softmax weights 2^(s - m) (kernels/cpu/decode_attention.cc) use it instead of the C
// library's exp2f, which has no vector form: one call per score was a third of the kernel's
// in-cache time at GQA widths.
//
// The sequence: x below -127 (or NaN) becomes -127; n = x rounded to the nearest integer (ties to
// even); f = x - n, exact, in [-0.5, 0.5]; 2^f by Horner's rule in fused multiply-adds over the
// degree-7 Taylor polynomial of 2^f (truncation below 1e-8 relative); times 2^n, made in the
// exponent field (2^-127 is made as 0, so x <= -126.5 gives 0). Within 2 ulp of exp2f for x in
// [-126, 0] (tests/kernels/exp2_test.cc); x > 0 is outside the contract.
// Header-only, pure; internal to kernels/cpu.
#ifndef SDMSERVE_KERNELS_CPU_EXP2_H_
#define SDMSERVE_KERNELS_CPU_EXP2_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace sdm::kernels::cpu {

// ln(2)^k / k!, k = 7 .. 1.
inline constexpr float kExp2Poly[7] = {1.5252733804059840e-05f, 1.5403530393381606e-04f,
                                       1.3333558146428443e-03f, 9.6181291076284772e-03f,
                                       5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                       6.9314718055994531e-01f};

inline float Exp2NonPositive(float x) {
  if (!(x >= -127.0f)) x = -127.0f;
  const float n = std::nearbyint(x);
  const float f = x - n;
  float p = kExp2Poly[0];
  for (int k = 1; k < 7; ++k) p = std::fma(p, f, kExp2Poly[k]);
  p = std::fma(p, f, 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// Exp2NonPositive of each lane.
inline __m256 Exp2NonPositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.0f));  // NaN lanes take the second operand: -127
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int k = 1; k < 7; ++k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[k]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_EXP2_H_
