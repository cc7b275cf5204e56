// The fixed tree that sums the 8 lanes of a decode attention score accumulator: the two 128-bit
// halves, then lanes 0+2 and 1+3, then those two. The AVX2 and AVX-512 loops
// (kernels/cpu/decode_attention.cc, decode_attention_avx512.cc) must give the same bits, so both
// use this one definition. `static`: each file gets its own copy compiled with its own flags (an
// inline function with external linkage, compiled with AVX-512 instructions in the AVX-512 file,
// could be the copy the linker keeps for the whole program). Internal to kernels/cpu.
#ifndef SDMSERVE_KERNELS_CPU_SUM_LANES_H_
#define SDMSERVE_KERNELS_CPU_SUM_LANES_H_

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace sdm::kernels::cpu {

static inline float SumLanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace sdm::kernels::cpu

#endif
#endif  // SDMSERVE_KERNELS_CPU_SUM_LANES_H_
