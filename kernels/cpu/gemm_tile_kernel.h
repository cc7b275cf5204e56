// The register-blocked tile kernel (kernels/cpu/gemm_tile.h), written once over a vector type.
// Included only by the per-ISA files (gemm_avx2.cc, gemm_avx512.cc), each with its own traits
// type V in an unnamed namespace, so every instantiation is local to its file and built with that
// file's flags:
//
//   struct V {
//     using Reg = ...;                     // kLanes fp32 lanes
//     static constexpr int kLanes;         // 8 or 16 (divides kGemmPanel)
//     static constexpr int kMaxRows;       // kGemmTileRows..kGemmMaxTileRows
//     static constexpr int MaxPanels(int rows);  // panels per tile of `rows` rows: the
//                                          // rows x vectors accumulators fit the registers
//     static Reg Zero();
//     static Reg Broadcast(float x);
//     static Reg Load(const float* p);                  // kLanes floats
//     static Reg LoadFirst(const float* p, int64_t n);  // the first n < kLanes, the rest 0
//     static void Store(float* p, Reg v);
//     static void StoreFirst(float* p, Reg v, int64_t n);
//     static Reg Fma(Reg a, Reg b, Reg c);              // a * b + c, rounded once
//     static Reg WidenLow(const uint16_t* p);   // kLanes 32-bit words: their low bf16 halves
//     static Reg WidenHigh(const uint16_t* p);  // ... their high bf16 halves
//   };
//
// Only <cstdint> and this folder's interface: see kernels/cpu/gemm_tile.h.
#ifndef SDMSERVE_KERNELS_CPU_GEMM_TILE_KERNEL_H_
#define SDMSERVE_KERNELS_CPU_GEMM_TILE_KERNEL_H_

#include <cstdint>

#include "kernels/cpu/gemm_tile.h"

namespace sdm::kernels::cpu::gemm_internal {

// MR rows x NV vectors of accumulators; vector j covers columns [j kLanes, (j + 1) kLanes) of the
// tile, i.e. of panel j / (16 / kLanes). Every element: one fma chain over k in order.
template <class V, typename T, int MR, int NV>
void TileKernel(const GemmTile& t) {
  using Reg = typename V::Reg;
  constexpr int kPerPanel = kGemmPanel / V::kLanes;
  // Elements of T per vector in a panel row: kLanes floats, or kLanes pairs of bf16.
  constexpr int kStep = V::kLanes * (sizeof(T) == 2 ? 2 : 1);
  const float* x[MR];
  const T* w[NV];
  int64_t valid[NV];  // columns of vector j to keep (<= 0: none)
  Reg acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) x[i] = t.x + i * t.ldx;
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) {
    w[j] = static_cast<const T*>(t.panels) + (j / kPerPanel) * t.panel_stride +
           (j % kPerPanel) * kStep + t.k0 * kGemmPanel;
    valid[j] = t.cols - j * V::kLanes;
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      float* y = t.y + i * t.ldy + j * V::kLanes;
      acc[i][j] = t.first || valid[j] <= 0 ? V::Zero()
                  : valid[j] >= V::kLanes  ? V::Load(y)
                                           : V::LoadFirst(y, valid[j]);
    }
  }
  // One k: broadcast x[i][p] against the widened weights wk.
  auto step = [&](const Reg* wk, int64_t p) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Reg b = V::Broadcast(x[i][p]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[i][j] = V::Fma(b, wk[j], acc[i][j]);
    }
  };
  int64_t p = t.k0;
  if constexpr (sizeof(T) == 4) {
    for (int64_t o = 0; p < t.k1; ++p, o += kGemmPanel) {
      Reg wk[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) wk[j] = V::Load(w[j] + o);
      step(wk, p);
    }
  } else {
    // A pair row per two k (16 k elements from the next); an odd k1 ends on the low half alone.
    int64_t o = 0;
    for (; p + 1 < t.k1; p += 2, o += 2 * kGemmPanel) {
      Reg wk[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) wk[j] = V::WidenLow(w[j] + o);
      step(wk, p);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) wk[j] = V::WidenHigh(w[j] + o);
      step(wk, p + 1);
    }
    if (p < t.k1) {
      Reg wk[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) wk[j] = V::WidenLow(w[j] + o);
      step(wk, p);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      float* y = t.y + i * t.ldy + j * V::kLanes;
      if (valid[j] >= V::kLanes) {
        V::Store(y, acc[i][j]);
      } else if (valid[j] > 0) {
        V::StoreFirst(y, acc[i][j], valid[j]);
      }
    }
  }
}

// Dispatch on the tile's panel and row counts: one instance per (rows, panels), so a batch of one
// runs one broadcast and NV fmas per k, not kGemmTileRows.
template <class V, typename T, int MR, int NP>
void TileOfPanels(const GemmTile& t) {
  if constexpr (NP > 1) {
    if (t.num_panels < NP) return TileOfPanels<V, T, MR, NP - 1>(t);
  }
  TileKernel<V, T, MR, NP * kGemmPanel / V::kLanes>(t);
}

template <class V, typename T, int MR = V::kMaxRows>
void Tile(const GemmTile& t) {
  if constexpr (MR > 1) {
    if (t.rows < MR) return Tile<V, T, MR - 1>(t);
  }
  TileOfPanels<V, T, MR, V::MaxPanels(MR)>(t);
}

// The ISA's table (kernels/cpu/gemm_tile.h) from its traits.
template <class V>
constexpr GemmTileKernels TileKernelsOf() {
  static_assert(V::kMaxRows >= kGemmTileRows && V::kMaxRows <= kGemmMaxTileRows);
  GemmTileKernels kernels = {&Tile<V, float>, &Tile<V, uint16_t>, {}};
  for (int rows = 1; rows <= V::kMaxRows; ++rows) kernels.max_panels[rows] = V::MaxPanels(rows);
  return kernels;
}

}  // namespace sdm::kernels::cpu::gemm_internal

#endif  // SDMSERVE_KERNELS_CPU_GEMM_TILE_KERNEL_H_
