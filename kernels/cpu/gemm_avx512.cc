// The AVX-512 tile kernel (kernels/cpu/gemm_tile.h): a panel is one zmm register, up to 4 panels
// per tile of up to 6 rows (6 x 4 accumulators + 4 weight vectors + a broadcast in the 32 zmm
// registers) and 3 panels per tile of 7 or 8 rows (8 x 3 + 3 + 1), so a batch of up to 8 rows
// reads each weight once per call.
//
// The only file built with -mavx512f -mavx512bw -mavx512vl (kernels/CMakeLists.txt), and called
// only after GemmIsaAvailable(kAvx512) checked the CPU. So it includes nothing but intrinsics and
// this folder's plain interface: an inline library function instantiated here could be emitted
// with AVX-512 instructions and picked by the linker for the whole program.
#include <cstdint>

#include "kernels/cpu/gemm_tile.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "kernels/cpu/gemm_tile_kernel.h"

namespace sdm::kernels::cpu {
namespace {

struct Avx512 {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 8;
  static constexpr int MaxPanels(int rows) { return rows <= 6 ? 4 : 3; }
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Broadcast(float x) { return _mm512_set1_ps(x); }
  static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static __mmask16 FirstMask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
  static Reg LoadFirst(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(FirstMask(n), p); }
  static void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void StoreFirst(float* p, Reg v, int64_t n) { _mm512_mask_storeu_ps(p, FirstMask(n), v); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  // (maskz with every lane: GCC 12's _mm512_slli_epi32 trips -Wmaybe-uninitialized.)
  static Reg WidenLow(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, _mm512_loadu_si512(p), 16));
  }
  static Reg WidenHigh(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(-65536)));
  }
};

}  // namespace

const GemmTileKernels* Avx512GemmTileKernels() {
  static constexpr GemmTileKernels kKernels = gemm_internal::TileKernelsOf<Avx512>();
  return &kKernels;
}

}  // namespace sdm::kernels::cpu

#else

namespace sdm::kernels::cpu {
const GemmTileKernels* Avx512GemmTileKernels() { return nullptr; }
}  // namespace sdm::kernels::cpu

#endif
