#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/widen.h"

namespace sdm::kernels::cpu {
namespace {

constexpr int64_t kPanel = PackedMatrix::kPanel;
constexpr int64_t kRows = 6;     // x rows per micro-kernel: 12 accumulators + 2 panel vectors
constexpr int64_t kDepth = 256;  // k per block: a panel slice (16 KB) stays in L1

#if defined(__AVX2__) && defined(__FMA__)
// Rows [0, MR) of x (leading dimension ldx) times one panel -> y columns [0, nr). Continues the
// accumulators held in y (or starts them at zero when `first`) over k values [k0, k1): splitting
// k into blocks keeps each element's fma sequence in increasing k. The rows are spelled out so
// the 2 MR accumulators stay in registers; an instance per row count (a batch of one runs 2 fmas
// per panel row, not 12), each element's fma sequence the same in all of them.
template <typename T, int MR>
void MicroKernel(const float* x, int64_t ldx, const T* panel, int64_t k0, int64_t k1, bool first,
                 float* y, int64_t ldy, int64_t nr) {
  static_assert(MR >= 1 && MR <= kRows);
  const float* x0 = x;
  const float* x1 = x + (MR > 1 ? 1 : 0) * ldx;
  const float* x2 = x + (MR > 2 ? 2 : 0) * ldx;
  const float* x3 = x + (MR > 3 ? 3 : 0) * ldx;
  const float* x4 = x + (MR > 4 ? 4 : 0) * ldx;
  const float* x5 = x + (MR > 5 ? 5 : 0) * ldx;
  alignas(32) float in[kRows][kPanel];
  for (int64_t i = 0; i < MR; ++i) {
    std::fill(in[i], in[i] + kPanel, 0.0f);
    if (!first) std::copy(y + i * ldy, y + i * ldy + nr, in[i]);
  }
  __m256 a00 = _mm256_load_ps(in[0]), a01 = _mm256_load_ps(in[0] + 8);
  __m256 a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
  __m256 a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  if constexpr (MR > 1) a10 = _mm256_load_ps(in[1]), a11 = _mm256_load_ps(in[1] + 8);
  if constexpr (MR > 2) a20 = _mm256_load_ps(in[2]), a21 = _mm256_load_ps(in[2] + 8);
  if constexpr (MR > 3) a30 = _mm256_load_ps(in[3]), a31 = _mm256_load_ps(in[3] + 8);
  if constexpr (MR > 4) a40 = _mm256_load_ps(in[4]), a41 = _mm256_load_ps(in[4] + 8);
  if constexpr (MR > 5) a50 = _mm256_load_ps(in[5]), a51 = _mm256_load_ps(in[5] + 8);
  const T* w = panel + k0 * kPanel;
  for (int64_t p = k0; p < k1; ++p, w += kPanel) {
    const __m256 w0 = Widen8(w);
    const __m256 w1 = Widen8(w + 8);
    __m256 b = _mm256_broadcast_ss(x0 + p);
    a00 = _mm256_fmadd_ps(b, w0, a00);
    a01 = _mm256_fmadd_ps(b, w1, a01);
    if constexpr (MR > 1) {
      b = _mm256_broadcast_ss(x1 + p);
      a10 = _mm256_fmadd_ps(b, w0, a10);
      a11 = _mm256_fmadd_ps(b, w1, a11);
    }
    if constexpr (MR > 2) {
      b = _mm256_broadcast_ss(x2 + p);
      a20 = _mm256_fmadd_ps(b, w0, a20);
      a21 = _mm256_fmadd_ps(b, w1, a21);
    }
    if constexpr (MR > 3) {
      b = _mm256_broadcast_ss(x3 + p);
      a30 = _mm256_fmadd_ps(b, w0, a30);
      a31 = _mm256_fmadd_ps(b, w1, a31);
    }
    if constexpr (MR > 4) {
      b = _mm256_broadcast_ss(x4 + p);
      a40 = _mm256_fmadd_ps(b, w0, a40);
      a41 = _mm256_fmadd_ps(b, w1, a41);
    }
    if constexpr (MR > 5) {
      b = _mm256_broadcast_ss(x5 + p);
      a50 = _mm256_fmadd_ps(b, w0, a50);
      a51 = _mm256_fmadd_ps(b, w1, a51);
    }
  }
  _mm256_store_ps(in[0], a00), _mm256_store_ps(in[0] + 8, a01);
  if constexpr (MR > 1) _mm256_store_ps(in[1], a10), _mm256_store_ps(in[1] + 8, a11);
  if constexpr (MR > 2) _mm256_store_ps(in[2], a20), _mm256_store_ps(in[2] + 8, a21);
  if constexpr (MR > 3) _mm256_store_ps(in[3], a30), _mm256_store_ps(in[3] + 8, a31);
  if constexpr (MR > 4) _mm256_store_ps(in[4], a40), _mm256_store_ps(in[4] + 8, a41);
  if constexpr (MR > 5) _mm256_store_ps(in[5], a50), _mm256_store_ps(in[5] + 8, a51);
  for (int64_t i = 0; i < MR; ++i) std::copy(in[i], in[i] + nr, y + i * ldy);
}

template <typename T>
void MicroKernel(const float* x, int64_t ldx, int64_t mr, const T* panel, int64_t k0, int64_t k1,
                 bool first, float* y, int64_t ldy, int64_t nr) {
  switch (mr) {
    case 1:
      return MicroKernel<T, 1>(x, ldx, panel, k0, k1, first, y, ldy, nr);
    case 2:
      return MicroKernel<T, 2>(x, ldx, panel, k0, k1, first, y, ldy, nr);
    case 3:
      return MicroKernel<T, 3>(x, ldx, panel, k0, k1, first, y, ldy, nr);
    case 4:
      return MicroKernel<T, 4>(x, ldx, panel, k0, k1, first, y, ldy, nr);
    case 5:
      return MicroKernel<T, 5>(x, ldx, panel, k0, k1, first, y, ldy, nr);
    default:
      return MicroKernel<T, 6>(x, ldx, panel, k0, k1, first, y, ldy, nr);
  }
}
#else
template <typename T>
void MicroKernel(const float* x, int64_t ldx, int64_t mr, const T* panel, int64_t k0, int64_t k1,
                 bool first, float* y, int64_t ldy, int64_t nr) {
  for (int64_t i = 0; i < mr; ++i) {
    for (int64_t j = 0; j < nr; ++j) {
      float acc = first ? 0.0f : y[i * ldy + j];
      for (int64_t p = k0; p < k1; ++p)
        acc = std::fma(x[i * ldx + p], Widen(panel[p * kPanel + j]), acc);
      y[i * ldy + j] = acc;
    }
  }
}
#endif

}  // namespace

PackedMatrix::PackedMatrix(const float* w, int64_t n, int64_t k, DType type)
    : n_(n),
      k_(k),
      type_(type),
      // bf16 values are stored two to a float slot (rounded up).
      data_(std::make_unique<float[]>(
          (((n + kPanel - 1) / kPanel) * k * kPanel * DTypeBytes(type) + 3) / 4)) {
  for (int64_t p = 0; p < panels(); ++p) {
    for (int64_t c = 0; c < kPanel; ++c) {
      const int64_t row = p * kPanel + c;
      for (int64_t i = 0; i < k; ++i) {
        const float value = row < n ? w[row * k + i] : 0.0f;
        const int64_t at = (p * k + i) * kPanel + c;
        if (type == DType::kBf16) {
          reinterpret_cast<uint16_t*>(data_.get())[at] = FloatToBf16(value);
        } else {
          data_[at] = value;
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

namespace {

template <typename T>
void LinearInvariantOf(const float* x, int64_t m, const PackedMatrix& w, const float* bias,
                       float* y, ThreadPool* pool) {
  const int64_t n = w.n(), k = w.k();
  // A task is a group of panels for every row: each panel is loaded once per row block.
  constexpr int64_t kPanelsPerTask = 4;
  const int64_t tasks = (w.panels() + kPanelsPerTask - 1) / kPanelsPerTask;
  auto run = [&](int64_t t) {
    const int64_t p1 = std::min(w.panels(), (t + 1) * kPanelsPerTask);
    for (int64_t p = t * kPanelsPerTask; p < p1; ++p) {
      const int64_t c0 = p * kPanel;
      const int64_t nr = std::min(kPanel, n - c0);
      for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
        const int64_t k1 = std::min(k, k0 + kDepth);
        for (int64_t i = 0; i < m; i += kRows) {
          MicroKernel<T>(x + i * k, k, std::min(kRows, m - i), w.panel<T>(p), k0, k1, k0 == 0,
                         y + i * n + c0, n, nr);
        }
      }
      if (bias != nullptr) {
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < nr; ++j) y[i * n + c0 + j] += bias[c0 + j];
        }
      }
    }
  };
  if (pool == nullptr || tasks == 1) {
    for (int64_t t = 0; t < tasks; ++t) run(t);
  } else {
    pool->ParallelFor(tasks, run);
  }
}

}  // namespace

void LinearInvariant(const float* x, int64_t m, const PackedMatrix& w, const float* bias, float* y,
                     ThreadPool* pool) {
  if (w.type() == DType::kBf16) {
    LinearInvariantOf<uint16_t>(x, m, w, bias, y, pool);
  } else {
    LinearInvariantOf<float>(x, m, w, bias, y, pool);
  }
}

}  // namespace sdm::kernels::cpu
