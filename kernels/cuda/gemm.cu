// cuBLASLt dense layers (kernels/cuda/gemm.h).
//
// Layout. cuBLASLt is column-major; our tensors are row-major. A row-major [r, c] matrix with
// row stride c is, byte for byte, the column-major [c, r] matrix with leading dimension c: its
// transpose. So the row-major product Y = X W^T (X [m, k], W [n, k], Y [m, n]) is computed as its
// transpose, Y^T = W X^T, in column-major terms:
//   D = Y^T: column-major [n, m], ld n            (the row-major Y, untouched)
//   A = W  : memory of row-major [n, k] is column-major [k, n], ld k; op(A) = A^T = [n, k]
//   B = X  : memory of row-major [m, k] is column-major [k, m], ld k; op(B) = B   = [k, m]
// i.e. a "TN" GEMM with cuBLAS's (M, N, K) = (n, m, k). Both operands are then read along k,
// contiguous in memory. The bias of y[r, c] += bias[c] is indexed by D's row (c < n), which is
// exactly what CUBLASLT_EPILOGUE_BIAS broadcasts (a vector of D's row count, added to every
// column), so the bias goes into the epilogue: no extra pass over y. Should the heuristic offer
// no algorithm with that epilogue (or reject the attribute), we fall back to the plain GEMM plus
// the AddBias kernel of elementwise.h.
//
// Precision: bf16 A and B, fp32 C and D, CUBLAS_COMPUTE_32F (fp32 accumulation,
// docs/model-spec.md §6), fp32 alpha = 1 and beta = 0 (C is not read).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"

namespace sdm::kernels::cuda {
namespace {

// Owners of the cuBLASLt descriptors (released on every exit path).
struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using MatrixLayout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

// Largest power of two (at most 256, the heuristic's default assumption) dividing the address.
int64_t AlignmentOf(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int64_t align = 256;
  while (align > 1 && a % static_cast<uintptr_t>(align) != 0) align /= 2;
  return align;
}

std::string StatusText(cublasStatus_t s) {
  return std::string(cublasLtGetStatusName(s)) + ": " + cublasLtGetStatusString(s);
}

}  // namespace

BlasLtGemm::~BlasLtGemm() {
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

bool BlasLtGemm::Init(size_t workspace_bytes) {
  if (handle_ != nullptr) {
    cublasLtDestroy(handle_);
    handle_ = nullptr;
  }
  plans_.clear();
  const cublasStatus_t s = cublasLtCreate(&handle_);
  if (s != CUBLAS_STATUS_SUCCESS) {
    handle_ = nullptr;
    error_ = "cublasLtCreate: " + StatusText(s);
    return false;
  }
  const cudaError_t err = workspace_.Allocate(workspace_bytes);
  if (err != cudaSuccess) {
    cublasLtDestroy(handle_);  // Linear refuses to run on a half-initialised object
    handle_ = nullptr;
    error_ = "cuBLASLt workspace of " + std::to_string(workspace_bytes) +
             " bytes: " + CudaErrorText(err);
    return false;
  }
  return true;
}

bool BlasLtGemm::Linear(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                        int64_t k, const float* bias, float* y, cudaStream_t stream) {
  if (handle_ == nullptr) {
    error_ = "BlasLtGemm::Linear before a successful Init";
    return false;
  }
  if (m < 0 || n < 0 || k < 0) {
    error_ = "BlasLtGemm::Linear: negative shape";
    return false;
  }
  if (m == 0 || n == 0) return true;
  if (k == 0) {
    // An empty sum: y = bias (or 0). cuBLASLt rejects k = 0.
    cudaError_t err = cudaMemsetAsync(y, 0, static_cast<size_t>(m * n) * sizeof(float), stream);
    if (err == cudaSuccess && bias != nullptr) err = AddBias(y, bias, m, n, stream);
    if (err != cudaSuccess) {
      error_ = "BlasLtGemm::Linear (k = 0): " + CudaErrorText(err);
      return false;
    }
    return true;
  }

  // Builds the descriptors of this call (host-side, cheap); `epilogue` asks for the bias one.
  MatmulDesc desc;
  MatrixLayout a_layout, b_layout, d_layout;
  auto build = [&](bool epilogue) -> cublasStatus_t {
    cublasLtMatmulDesc_t raw_desc = nullptr;
    cublasStatus_t s = cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    desc.reset(raw_desc);
    const int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    s = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                       sizeof(trans_a));
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    s = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                       sizeof(trans_b));
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    if (epilogue) {
      const uint32_t ep = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = CUDA_R_32F;
      s = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, &ep,
                                         sizeof(ep));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      s = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                         &bias_type, sizeof(bias_type));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      s = cublasLtMatmulDescSetAttribute(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof(bias));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    // See the layout comment at the top of this file.
    cublasLtMatrixLayout_t raw = nullptr;
    s = cublasLtMatrixLayoutCreate(&raw, CUDA_R_16BF, static_cast<uint64_t>(k),
                                   static_cast<uint64_t>(n), k);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    a_layout.reset(raw);
    s = cublasLtMatrixLayoutCreate(&raw, CUDA_R_16BF, static_cast<uint64_t>(k),
                                   static_cast<uint64_t>(m), k);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    b_layout.reset(raw);
    s = cublasLtMatrixLayoutCreate(&raw, CUDA_R_32F, static_cast<uint64_t>(n),
                                   static_cast<uint64_t>(m), n);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    d_layout.reset(raw);
    return CUBLAS_STATUS_SUCCESS;
  };

  const PlanKey key = {m,
                       n,
                       k,
                       bias != nullptr ? AlignmentOf(bias) : 0,
                       AlignmentOf(x),
                       AlignmentOf(w),
                       AlignmentOf(y)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    // Heuristic query, once per key: the best algorithm that fits the workspace and the actual
    // pointer alignments (the default preference assumes 256-byte aligned operands).
    Preference pref;
    cublasLtMatmulPreference_t raw_pref = nullptr;
    cublasStatus_t s = cublasLtMatmulPreferenceCreate(&raw_pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
      error_ = "cublasLtMatmulPreferenceCreate: " + StatusText(s);
      return false;
    }
    pref.reset(raw_pref);
    const uint64_t max_workspace = workspace_.bytes();
    const uint32_t align_a = static_cast<uint32_t>(key[5]);  // A is w
    const uint32_t align_b = static_cast<uint32_t>(key[4]);  // B is x
    const uint32_t align_d = static_cast<uint32_t>(key[6]);  // C and D are y
    const struct {
      cublasLtMatmulPreferenceAttributes_t attr;
      const void* value;
      size_t size;
    } prefs[] = {
        {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)},
    };
    for (const auto& p : prefs) {
      s = cublasLtMatmulPreferenceSetAttribute(pref.get(), p.attr, p.value, p.size);
      if (s != CUBLAS_STATUS_SUCCESS) {
        error_ = "cublasLtMatmulPreferenceSetAttribute: " + StatusText(s);
        return false;
      }
    }
    // Tries the bias epilogue first (when there is a bias), then the plain GEMM.
    Plan plan{};
    bool found = false;
    cublasStatus_t last = CUBLAS_STATUS_NOT_SUPPORTED;
    for (const bool epilogue : {true, false}) {
      if (epilogue && bias == nullptr) continue;
      last = build(epilogue);
      if (last != CUBLAS_STATUS_SUCCESS) continue;
      cublasLtMatmulHeuristicResult_t result{};
      int count = 0;
      last = cublasLtMatmulAlgoGetHeuristic(handle_, desc.get(), a_layout.get(), b_layout.get(),
                                            d_layout.get(), d_layout.get(), pref.get(), 1, &result,
                                            &count);
      if (last == CUBLAS_STATUS_SUCCESS && count > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
        plan = Plan{result.algo, epilogue};
        found = true;
        break;
      }
      if (last == CUBLAS_STATUS_SUCCESS) last = CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (!found) {
      error_ = "cuBLASLt has no algorithm for bf16 GEMM m=" + std::to_string(m) +
               " n=" + std::to_string(n) + " k=" + std::to_string(k) + ": " + StatusText(last);
      return false;
    }
    it = plans_.emplace(key, plan).first;
  } else {
    const cublasStatus_t s = build(it->second.bias_epilogue);
    if (s != CUBLAS_STATUS_SUCCESS) {
      error_ = "cuBLASLt descriptors: " + StatusText(s);
      return false;
    }
  }
  // `build` ran last for the plan's own epilogue choice on both paths, so desc matches the algo.

  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s = cublasLtMatmul(
      handle_, desc.get(), &alpha, w, a_layout.get(), x, b_layout.get(), &beta, y, d_layout.get(),
      y, d_layout.get(), &it->second.algo, workspace_.get(), workspace_.bytes(), stream);
  if (s != CUBLAS_STATUS_SUCCESS) {
    error_ = "cublasLtMatmul m=" + std::to_string(m) + " n=" + std::to_string(n) +
             " k=" + std::to_string(k) + ": " + StatusText(s);
    return false;
  }
  if (bias != nullptr && !it->second.bias_epilogue) {
    const cudaError_t err = AddBias(y, bias, m, n, stream);
    if (err != cudaSuccess) {
      error_ = "AddBias after cuBLASLt: " + CudaErrorText(err);
      return false;
    }
  }
  return true;
}

}  // namespace sdm::kernels::cuda
