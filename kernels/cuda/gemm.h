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
  // cuBLAS or launch failure.
  bool Linear(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n, int64_t k,
              const float* bias, float* y, cudaStream_t stream);

  const std::string& error() const { return error_; }

 private:
  // The heuristic's choice for one problem, keyed by {m, n, k, alignment of bias (0: none), of x,
  // of w, of y} (alignments in bytes, capped at 256: the heuristic's choice depends on them; see
  // gemm.cu). bias_epilogue is false when no algorithm took the bias epilogue and the bias is
  // added by a separate AddBias launch.
  struct Plan {
    cublasLtMatmulAlgo_t algo;
    bool bias_epilogue;
  };
  using PlanKey = std::array<int64_t, 7>;

  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<unsigned char> workspace_;
  std::map<PlanKey, Plan> plans_;
  std::string error_;
};

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_GEMM_H_
