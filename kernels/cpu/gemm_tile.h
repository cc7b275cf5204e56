// The micro-kernel interface behind LinearInvariant (kernels/cpu/gemm.h), one implementation per
// instruction set (kernels/cpu/gemm_isa.h). Internal to kernels/cpu.
//
// A tile is `rows` rows of x against `num_panels` consecutive panels of a PackedMatrix over k
// values [k0, k1). Each output element's accumulator starts at 0 (`first`) or at its value in y,
// and is updated by one fused multiply-add per k in increasing order, then written back to y. So
// a driver that splits k into blocks (k0 even) and calls tiles block after block, in any grouping
// of rows and panels, computes DotInOrder for every element: every implementation gives the same
// bits.
//
// Panel layout (PackedMatrix): 16 output columns per panel, k-major. fp32: value (k, c) at
// [16 k + c]. bf16: k in pairs, each pair of a column in one 32-bit word, the even k in the low
// half: value (k, c) at [32 (k / 2) + 2 c + k % 2], an odd k's last pair padded with zero. A
// 32-bit lane load then widens 16 values of one k with a shift (even k) or a mask (odd k), without
// permutes; as the pair row of even k starts at element 16 k, both types index rows alike.
#ifndef SDMSERVE_KERNELS_CPU_GEMM_TILE_H_
#define SDMSERVE_KERNELS_CPU_GEMM_TILE_H_

// Only <cstdint>: kernels/cpu/gemm_avx512.cc, built with AVX-512 flags, includes this and must
// not instantiate inline library code that other files would share (kernels/CMakeLists.txt).
#include <cstdint>

namespace sdm::kernels::cpu {

enum class GemmIsa;  // kernels/cpu/gemm_isa.h

inline constexpr int kGemmPanel = 16;       // output columns per panel
inline constexpr int kGemmTileRows = 6;     // rows per tile when a batch takes several, every ISA
inline constexpr int kGemmMaxTileRows = 8;  // most rows of a tile that holds a whole batch

struct GemmTile {
  const float* x;  // rows [0, rows) at stride ldx; columns [k0, k1) are read
  int64_t ldx;
  int rows;              // 1..kGemmMaxTileRows where the ISA's max_panels[rows] > 0
  const void* panels;    // the first panel: float or uint16_t (bf16 bits)
  int64_t panel_stride;  // elements from one panel to the next
  int num_panels;        // 1..the ISA's max_panels[rows]
  int64_t k0, k1;        // k0 even, k0 < k1 <= the matrix's k
  bool first;            // accumulators start at 0, else at y
  float* y;  // rows at stride ldy; columns [0, cols) are read (unless first) and written
  int64_t ldy;
  int64_t cols;  // valid columns: 16 (num_panels - 1) < cols <= 16 num_panels
};

using GemmTileFn = void (*)(const GemmTile&);

struct GemmTileKernels {
  GemmTileFn f32;
  GemmTileFn bf16;
  // Panels per tile of r rows (1..4, not increasing with r), for r in 1..kGemmTileRows always;
  // up to kGemmMaxTileRows where the registers allow (AVX-512: 8 rows x 3 panels), so that a batch
  // of that many rows is one tile and reads each weight once. 0: no tile of r rows.
  int max_panels[kGemmMaxTileRows + 1];
};

// The ISA's kernels, or nullptr when this build has none (the CPU may still lack the ISA:
// GemmIsaAvailable checks both).
const GemmTileKernels* GemmTileKernelsFor(GemmIsa isa);

// Per ISA (kernels/cpu/gemm.cc, gemm_avx2.cc, gemm_avx512.cc); nullptr where not built.
const GemmTileKernels* GenericGemmTileKernels();
const GemmTileKernels* Avx2GemmTileKernels();
const GemmTileKernels* Avx512GemmTileKernels();

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_GEMM_TILE_H_
