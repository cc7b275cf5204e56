// The AVX2 + FMA tile kernel (kernels/cpu/gemm_tile.h): 8 lanes, two vectors per panel, one panel
// per tile (6 rows x 2 accumulators + 2 weight vectors + a broadcast fill the 16 ymm registers).
// Built with the library's x86-64-v3 flags; absent where they are not AVX2.
#include <cstdint>

#include "kernels/cpu/gemm_tile.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "kernels/cpu/gemm_tile_kernel.h"

namespace sdm::kernels::cpu {
namespace {

struct Avx2 {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 6;
  static constexpr int MaxPanels(int) { return 1; }
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Broadcast(float x) { return _mm256_set1_ps(x); }
  static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256i FirstMask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Reg LoadFirst(const float* p, int64_t n) { return _mm256_maskload_ps(p, FirstMask(n)); }
  static void Store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static void StoreFirst(float* p, Reg v, int64_t n) { _mm256_maskstore_ps(p, FirstMask(n), v); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg WidenLow(const uint16_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static Reg WidenHigh(const uint16_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
  }
};

}  // namespace

const GemmTileKernels* Avx2GemmTileKernels() {
  static constexpr GemmTileKernels kKernels = gemm_internal::TileKernelsOf<Avx2>();
  return &kKernels;
}

}  // namespace sdm::kernels::cpu

#else

namespace sdm::kernels::cpu {
const GemmTileKernels* Avx2GemmTileKernels() { return nullptr; }
}  // namespace sdm::kernels::cpu

#endif
