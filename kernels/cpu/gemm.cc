#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cmath>
#include <new>

#include "base/check.h"
#include "kernels/cpu/gemm_tile.h"
#include "kernels/cpu/widen.h"

namespace sdm::kernels::cpu {
namespace {

constexpr int64_t kPanel = PackedMatrix::kPanel;
static_assert(kPanel == kGemmPanel);
// k per block when the rows take several tiles: the panels' slice is then read once from memory
// and again from cache for each further row block. Even, so bf16 pairs are never split.
constexpr int64_t kDepth = 256;
constexpr std::align_val_t kAlign{64};

// The reference implementation: plain loops over the layout of kernels/cpu/gemm_tile.h.
template <typename T>
float PanelValue(const T* panel, int64_t p, int64_t c) {
  if constexpr (sizeof(T) == 2) {
    return Widen(panel[(p / 2) * 2 * kPanel + 2 * c + p % 2]);
  } else {
    return panel[p * kPanel + c];
  }
}

template <typename T>
void GenericTile(const GemmTile& t) {
  for (int i = 0; i < t.rows; ++i) {
    for (int64_t c = 0; c < t.cols; ++c) {
      const T* panel = static_cast<const T*>(t.panels) + (c / kPanel) * t.panel_stride;
      float acc = t.first ? 0.0f : t.y[i * t.ldy + c];
      for (int64_t p = t.k0; p < t.k1; ++p) {
        acc = std::fma(t.x[i * t.ldx + p], PanelValue(panel, p, c % kPanel), acc);
      }
      t.y[i * t.ldy + c] = acc;
    }
  }
}

template <typename T>
void LinearInvariantOf(const GemmTileKernels& kernels, const float* x, int64_t m,
                       const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool) {
  if (m <= 0) return;
  const int64_t n = w.n(), k = w.k();
  const GemmTileFn tile = sizeof(T) == 2 ? kernels.bf16 : kernels.f32;
  // All rows in one tile where the ISA has a tile of m rows: each weight is read once, and k runs
  // in one piece (accumulators stay in registers). Else tiles of kGemmTileRows rows, k in blocks.
  const bool one_tile = m <= kGemmMaxTileRows && kernels.max_panels[m] > 0;
  const int64_t tile_rows = one_tile ? m : kGemmTileRows;
  const int64_t depth = one_tile ? k : kDepth;
  // Panels per tile (every row tile can take as many: max_panels does not increase with rows).
  const int64_t width = kernels.max_panels[std::min(m, tile_rows)];
  // A task is a group of panels for every row: each panel is loaded once per row block. A whole
  // number of tiles, about 4 panels (3 for 3-panel tiles: as many tasks per matrix as 4 would give
  // within a third, so the threads stay balanced).
  const int64_t panels_per_task = width * std::max<int64_t>(1, 4 / width);
  const int64_t tasks = (w.panels() + panels_per_task - 1) / panels_per_task;
  auto run = [&](int64_t t) {
    const int64_t p0 = t * panels_per_task;
    const int64_t p1 = std::min(w.panels(), p0 + panels_per_task);
    for (int64_t p = p0; p < p1; p += width) {
      const int64_t c0 = p * kPanel;
      const int64_t np = std::min(width, p1 - p);
      const int64_t cols = std::min(np * kPanel, n - c0);
      for (int64_t k0 = 0; k0 < k; k0 += depth) {
        for (int64_t i = 0; i < m; i += tile_rows) {
          tile({.x = x + i * k,
                .ldx = k,
                .rows = static_cast<int>(std::min(tile_rows, m - i)),
                .panels = w.panel<T>(p),
                .panel_stride = w.panel_stride(),
                .num_panels = static_cast<int>(np),
                .k0 = k0,
                .k1 = std::min(k, k0 + depth),
                .first = k0 == 0,
                .y = y + i * n + c0,
                .ldy = n,
                .cols = cols});
        }
      }
    }
    if (bias != nullptr) {
      const int64_t c0 = p0 * kPanel, c1 = std::min(n, p1 * kPanel);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = c0; j < c1; ++j) y[i * n + j] += bias[j];
      }
    }
  };
  if (pool == nullptr || tasks == 1) {
    for (int64_t t = 0; t < tasks; ++t) run(t);
  } else {
    pool->ParallelFor(tasks, run);
  }
}

// The matrix's element type picks the kernel.
void LinearInvariantWithKernels(const GemmTileKernels& kernels, const float* x, int64_t m,
                                const PackedMatrix& w, const float* bias, float* y,
                                ThreadPool* pool) {
  if (w.type() == DType::kBf16) {
    LinearInvariantOf<uint16_t>(kernels, x, m, w, bias, y, pool);
  } else {
    LinearInvariantOf<float>(kernels, x, m, w, bias, y, pool);
  }
}

}  // namespace

const GemmTileKernels* GenericGemmTileKernels() {
  static constexpr GemmTileKernels kKernels = {
      &GenericTile<float>, &GenericTile<uint16_t>, {0, 4, 4, 4, 4, 4, 4, 0, 0}};
  return &kKernels;
}

const GemmTileKernels* GemmTileKernelsFor(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kGeneric:
      return GenericGemmTileKernels();
    case GemmIsa::kAvx2:
      return Avx2GemmTileKernels();
    case GemmIsa::kAvx512:
      return Avx512GemmTileKernels();
  }
  return nullptr;
}

void PackedMatrix::AlignedDelete::operator()(float* p) const { ::operator delete[](p, kAlign); }

PackedMatrix::PackedMatrix(const float* w, int64_t n, int64_t k, DType type)
    : n_(n), k_(k), type_(type) {
  // bf16 values are stored two to a float slot (panel_stride() is even for bf16).
  const int64_t floats = panels() * panel_stride() / (type == DType::kBf16 ? 2 : 1);
  data_.reset(new (kAlign) float[std::max<int64_t>(floats, 1)]());
  for (int64_t p = 0; p < panels(); ++p) {
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t row = p * kPanel + c;
      for (int64_t i = 0; i < k; ++i) {
        const float value = row < n ? w[row * k + i] : 0.0f;
        if (type == DType::kBf16) {
          // Pairs of k: (k, c) at 32 (k / 2) + 2 c + k % 2 (kernels/cpu/gemm_tile.h).
          const int64_t at = p * panel_stride() + (i / 2) * 2 * kPanel + 2 * c + i % 2;
          reinterpret_cast<uint16_t*>(data_.get())[at] = FloatToBf16(value);
        } else {
          data_[p * panel_stride() + i * kPanel + c] = value;
        }
      }
    }
  }
}

float DotInOrder(const float* x, const float* w, int64_t k) {
  float acc = 0.0f;
  for (int64_t p = 0; p < k; ++p) acc = std::fma(x[p], w[p], acc);
  return acc;
}

void LinearInvariantWith(GemmIsa isa, const float* x, int64_t m, const PackedMatrix& w,
                         const float* bias, float* y, ThreadPool* pool) {
  SDM_CHECK(GemmIsaAvailable(isa)) << GemmIsaName(isa) << " is not available";
  LinearInvariantWithKernels(*GemmTileKernelsFor(isa), x, m, w, bias, y, pool);
}

void LinearInvariant(const float* x, int64_t m, const PackedMatrix& w, const float* bias, float* y,
                     ThreadPool* pool) {
  static const GemmTileKernels* const kernels = GemmTileKernelsFor(ActiveGemmIsa());
  LinearInvariantWithKernels(*kernels, x, m, w, bias, y, pool);
}

}  // namespace sdm::kernels::cpu
