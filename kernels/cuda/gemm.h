// Dense layers on the GPU through cuBLASLt: y = x W^T (+ bias) with W in PyTorch's Linear layout
// [out, in], bf16 inputs and fp32 accumulation and output (docs/model-spec.md §6).
#ifndef SDMSERVE_KERNELS_CUDA_GEMM_H_
#define SDMSERVE_KERNELS_CUDA_GEMM_H_

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_util.h"

namespace sdm::kernels::cuda {

// Owns a cuBLASLt handle and its workspace. Not thread-safe: one per engine (calls on one stream).
class BlasLtGemm {
 public:
  BlasLtGemm() = default;
  ~BlasLtGemm();
  BlasLtGemm(const BlasLtGemm&) = delete;
  BlasLtGemm& operator=(const BlasLtGemm&) = delete;

  // Creates the handle and a workspace of `workspace_bytes`. Returns false and sets error().
  bool Init(size_t workspace_bytes = size_t{32} << 20);

  // y [m, n] fp32 row-major = x [m, k] bf16 row-major * w^T, w [n, k] bf16 row-major; then
  // y[r, c] += bias[c] when bias (fp32 [n]) is non-null. Returns false and sets error() on a
  // cuBLAS or launch failure. Plans the problem first when it has no plan (see Plan).
  bool Linear(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k,
              const float* bias, float* y, cudaStream_t stream);
  // Plans the problem Linear would run for these operands, enqueuing nothing: the descriptors
  // and up to kMaxAlgorithms of the heuristic's algorithms (each checked against the problem
  // with cublasLtMatmulAlgoCheck), cached by {m, n, k, bias pointer, operand alignments}. A
  // caller that must not fail part-way through a sequence of launches (the CUDA backend's
  // forward pass) plans every GEMM of the sequence first. Returns false and sets error() when
  // no algorithm fits.
  bool Plan(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k,
            const float* bias, const float* y);
  // Linear that refuses (false, error()) a problem without a plan instead of planning it.
  bool LinearPlanned(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                     int64_t k, const float* bias, float* y, cudaStream_t stream);
  // Plans cached so far.
  size_t plan_count() const { return plans_.size(); }

  const std::string& error() const { return error_; }

  static constexpr int kMaxAlgorithms = 4;

 private:
  // Owners of the cuBLASLt descriptors (released with their plan).
  struct DescDeleter {
    void operator()(cublasLtMatmulDescOpaque_t* d) const;
    void operator()(cublasLtMatrixLayoutOpaque_t* l) const;
  };
  // One problem's cached descriptors and the algorithms to try in order (the heuristic's order);
  // bias_epilogue is false when no algorithm took the bias epilogue and the bias is added by a
  // separate AddBias launch.
  struct CachedPlan {
    std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter> desc;
    std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter> a, b, d;
    std::array<cublasLtMatmulAlgo_t, kMaxAlgorithms> algos{};
    int num_algos = 0;
    bool bias_epilogue = false;
  };
  // {m, n, k, bias address (0: none), alignment of x, of w, of y} (alignments in bytes, capped
  // at 256: the heuristic's choice depends on them; see gemm.cu). The bias pointer is part of
  // the cached descriptor.
  using PlanKey = std::array<int64_t, 7>;
  static PlanKey KeyOf(const void* x, int64_t m, const void* w, int64_t n, int64_t k,
                       const float* bias, const void* y);
  // The plan of `key`, made on demand when `make` (else null and error()).
  const CachedPlan* Find(const PlanKey& key, bool make);
  bool Run(const CachedPlan& plan, const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w,
           int64_t n, int64_t k, const float* bias, float* y, cudaStream_t stream);
  bool Shape(int64_t m, int64_t n, int64_t k);

  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<unsigned char> workspace_;
  std::map<PlanKey, CachedPlan> plans_;
  std::string error_;
};

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_GEMM_H_
