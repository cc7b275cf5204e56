// The AVX-512 loops of the CPU decode attention (kernels/cpu/decode_attention_wide.h): the same
// bits as the AVX2 loops of decode_attention.cc, with two query heads of a KV group in one register
// (each half one head's 8-lane chain).
//
// Built with -mavx512f -mavx512bw -mavx512vl (kernels/CMakeLists.txt) and called only after
// GemmIsaAvailable(kAvx512) checked the CPU, so, like gemm_avx512.cc, it includes nothing but
// intrinsics and this folder's plain interface: an inline library function (std::fma, the bf16
// helpers) instantiated here could be emitted with AVX-512 instructions and picked by the linker
// for the whole program. Scalar steps use intrinsics and file-local helpers instead.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/decode_attention_wide.h"
#include "kernels/cpu/sum_lanes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

namespace sdm::kernels::cpu {
namespace {

constexpr int kRows = kDecodeRowGroup;

// One fused multiply-add in scalar: fma(a, b, c), rounded once.
float FmaScalar(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

float ToFloat(float x) { return x; }
float ToFloat(uint16_t x) {  // bf16 bits: the high half of an fp32 (exact)
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// (The maskz forms with every lane below: GCC 12's unmasked _mm512_slli_epi32,
// _mm512_cvtepu16_epi32, _mm512_broadcast_f64x4, _mm512_insertf64x4 and _mm512_extractf64x4_pd
// trip -Wmaybe-uninitialized.)

// The eight values at p in both halves (one broadcast load for fp32).
__m512 Load8Twice(const float* p) {
  return _mm512_castpd_ps(
      _mm512_maskz_broadcast_f64x4(0xff, _mm256_loadu_pd(reinterpret_cast<const double*>(p))));
}
__m512 Load8Twice(const uint16_t* p) {
  const __m256i h =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
}

__m512 Join(__m256 low, __m256 high) {
  return _mm512_castpd_ps(_mm512_maskz_insertf64x4(
      0xff, _mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}
// (GCC 12 implements this cast as an extract from an undefined register, which trips
// -Wuninitialized; it compiles to no instruction. Clang knows neither the warning nor the problem.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__m256 Low(__m512 v) { return _mm512_castps512_ps256(v); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
__m256 High(__m512 v) {
  return _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xf, _mm512_castps_pd(v), 1));
}

// Row by row, pair by pair: one chain of fused multiply-adds per (row, pair), each independent of
// the next, so the processor overlaps them while the loads walk the keys in address order (the
// hardware prefetchers follow one stream; eight rows' slices at once measured 4-18% slower at
// these shapes: docs/benchmarks.md, "Keys in address order").
template <typename T>
void DotBlockPairs(const float* q_joined, const float* q, int64_t pairs, int64_t pairs_per_kv,
                   const T* const* k, int n, int64_t hd, float* scores, int64_t score_stride) {
  const int64_t chunks = hd / 8;
  for (int i = 0; i < n; ++i) {
    for (int64_t p = 0; p < pairs; ++p) {
      const T* key = k[i] + (p / pairs_per_kv) * hd;
      const float* qp = q_joined + p * chunks * 16;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qp + c * 16), Load8Twice(key + c * 8), acc);
      }
      float a = SumLanes(Low(acc));
      float b = SumLanes(High(acc));
      const float* q_a = q + (2 * p) * hd;
      const float* q_b = q_a + hd;
      for (int64_t c = chunks * 8; c < hd; ++c) {
        const float kc = ToFloat(key[c]);
        a = FmaScalar(q_a[c], kc, a);
        b = FmaScalar(q_b[c], kc, b);
      }
      scores[(2 * p) * score_stride + i] = a;
      scores[(2 * p + 1) * score_stride + i] = b;
    }
  }
}

template <typename T>
void AccumulateRowsPair(const float* w_a, const float* w_b, const T* const* v, int n, int64_t hd,
                        float* acc_a, float* acc_b) {
  __m512 w[kRows];
  for (int i = 0; i < n; ++i) w[i] = Join(_mm256_set1_ps(w_a[i]), _mm256_set1_ps(w_b[i]));
  int64_t d = 0;
  if (n == kRows) {
    for (; d + 8 <= hd; d += 8) {
      __m512 a = Join(_mm256_loadu_ps(acc_a + d), _mm256_loadu_ps(acc_b + d));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) a = _mm512_fmadd_ps(w[i], Load8Twice(v[i] + d), a);
      _mm256_storeu_ps(acc_a + d, Low(a));
      _mm256_storeu_ps(acc_b + d, High(a));
    }
  } else {
    for (; d + 8 <= hd; d += 8) {
      __m512 a = Join(_mm256_loadu_ps(acc_a + d), _mm256_loadu_ps(acc_b + d));
      for (int i = 0; i < n; ++i) a = _mm512_fmadd_ps(w[i], Load8Twice(v[i] + d), a);
      _mm256_storeu_ps(acc_a + d, Low(a));
      _mm256_storeu_ps(acc_b + d, High(a));
    }
  }
  for (; d < hd; ++d) {
    float a = acc_a[d];
    float b = acc_b[d];
    for (int i = 0; i < n; ++i) {
      const float vd = ToFloat(v[i][d]);
      a = FmaScalar(w_a[i], vd, a);
      b = FmaScalar(w_b[i], vd, b);
    }
    acc_a[d] = a;
    acc_b[d] = b;
  }
}

}  // namespace

const DecodeWideLoops* Avx512DecodeWideLoops() {
  static constexpr DecodeWideLoops kLoops = {
      {&DotBlockPairs<float>, &AccumulateRowsPair<float>},
      {&DotBlockPairs<uint16_t>, &AccumulateRowsPair<uint16_t>}};
  return &kLoops;
}

}  // namespace sdm::kernels::cpu

#else

namespace sdm::kernels::cpu {
const DecodeWideLoops* Avx512DecodeWideLoops() { return nullptr; }
}  // namespace sdm::kernels::cpu

#endif
