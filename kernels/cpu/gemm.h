// Batch-invariant dense layers: y[m, n] = x[m, :] . w[n, :] (+ bias[n]).
//
// Every output element is one accumulator updated by a fused multiply-add for k = 0, 1, ... in
// order, whatever m, the row's position in the batch, the thread count or the blocking. So a
// session's logits do not depend on which other sessions share its decode step, and a prefill's
// projections equal a decode's bit for bit. (OpenBLAS reorders its reductions with the batch
// size: a batched session drifted from its solo run by ~1e-7, enough to flip a greedy argmax
// near a tie; docs/architecture.md.)
//
// The weights are repacked once (PackedMatrix) into panels of 16 output columns stored k-major,
// so the micro-kernel streams panels and broadcasts x: the BLIS-style layout, with the k loop
// never split out of order. The micro-kernels come in one version per instruction set (generic
// C++, AVX2, AVX-512), chosen once at startup (kernels/cpu/gemm_isa.h); all compute the same bits
// (kernels/cpu/gemm_tile.h states the contract and the panel layout).
//
// Panels hold fp32 or bf16 values (DType::kBf16: half the bytes streamed per step; k stored in
// interleaved pairs so one 32-bit load widens 16 values). bf16 weights are widened to fp32 as they
// are loaded and accumulated in fp32 in the same order, so a bf16 matrix computes bit for bit what
// the fp32 one would on the rounded weights, and is batch-invariant in the same way.
#ifndef SDMSERVE_KERNELS_CPU_GEMM_H_
#define SDMSERVE_KERNELS_CPU_GEMM_H_

#include <cstdint>
#include <memory>

#include "base/bf16.h"
#include "kernels/cpu/gemm_isa.h"
#include "kernels/cpu/parallel.h"

namespace sdm::kernels::cpu {

class PackedMatrix {
 public:
  static constexpr int64_t kPanel = 16;  // output columns per panel

  PackedMatrix() = default;
  // Packs w: [n, k] row-major (torch.nn.Linear's [out, in]), stored as `type` (bf16: rounded to
  // nearest even).
  PackedMatrix(const float* w, int64_t n, int64_t k, DType type = DType::kF32);

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  DType type() const { return type_; }
  int64_t panels() const { return (n_ + kPanel - 1) / kPanel; }
  // Elements of T from one panel to the next: 16 k (fp32), 16 k rounded up to even (bf16 pairs).
  int64_t panel_stride() const { return kPanel * (type_ == DType::kBf16 ? k_ + k_ % 2 : k_); }
  // Panel p: columns 16p..16p+15 (zero past n) in the layout of kernels/cpu/gemm_tile.h; T is
  // float for an fp32 matrix, uint16_t (bf16 bits) for a bf16 one.
  template <typename T>
  const T* panel(int64_t p) const {
    return reinterpret_cast<const T*>(data_.get()) + p * panel_stride();
  }
  // Bytes of the packed panels (64-byte aligned).
  int64_t bytes() const { return panels() * panel_stride() * DTypeBytes(type_); }

 private:
  int64_t n_ = 0;
  int64_t k_ = 0;
  DType type_ = DType::kF32;
  struct AlignedDelete {
    void operator()(float* p) const;
  };
  std::unique_ptr<float[], AlignedDelete> data_;  // fp32 values, or pairs of bf16 values
};

// y[m, n] = x[m, k] w^T + bias (bias may be null). pool may be null (single thread); panels are
// split across its threads.
void LinearInvariant(const float* x, int64_t m, const PackedMatrix& w, const float* bias, float* y,
                     ThreadPool* pool);
// The same with the micro-kernels of `isa`, which must be available (GemmIsaAvailable): for tests
// and benchmarks. LinearInvariant runs ActiveGemmIsa()'s.
void LinearInvariantWith(GemmIsa isa, const float* x, int64_t m, const PackedMatrix& w,
                         const float* bias, float* y, ThreadPool* pool);

// The order every path reproduces, for tests: sum_k fma(x[k], w[k], acc) from acc = 0.
float DotInOrder(const float* x, const float* w, int64_t k);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_GEMM_H_
