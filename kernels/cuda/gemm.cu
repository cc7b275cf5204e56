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
// Plans. Everything that can fail before a launch (descriptors, the heuristic, the algorithm
// check) happens in Plan, cached per problem; Linear then only calls
// cublasLtMatmul, trying the plan's algorithms in order while cuBLASLt refuses one before
// launching it (NOT_SUPPORTED, INVALID_VALUE). So a caller that plans a whole sequence first
// can only fail in it on a launch error proper.
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

struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, PreferenceDeleter>;

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

std::string ShapeText(int64_t m, int64_t n, int64_t k) {
  return "m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k);
}

}  // namespace

void BlasLtGemm::DescDeleter::operator()(cublasLtMatmulDescOpaque_t* d) const {
  cublasLtMatmulDescDestroy(d);
}
void BlasLtGemm::DescDeleter::operator()(cublasLtMatrixLayoutOpaque_t* l) const {
  cublasLtMatrixLayoutDestroy(l);
}

BlasLtGemm::~BlasLtGemm() {
  plans_.clear();  // descriptors before the handle
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

bool BlasLtGemm::Init(size_t workspace_bytes) {
  plans_.clear();
  if (handle_ != nullptr) {
    cublasLtDestroy(handle_);
    handle_ = nullptr;
  }
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

BlasLtGemm::PlanKey BlasLtGemm::KeyOf(const void* x, int64_t m, const void* w, int64_t n, int64_t k,
                                      const float* bias, const void* y) {
  return {m,
          n,
          k,
          static_cast<int64_t>(reinterpret_cast<uintptr_t>(bias)),
          AlignmentOf(x),
          AlignmentOf(w),
          AlignmentOf(y)};
}

bool BlasLtGemm::Shape(int64_t m, int64_t n, int64_t k) {
  if (handle_ == nullptr) {
    error_ = "BlasLtGemm before a successful Init";
    return false;
  }
  if (m < 0 || n < 0 || k < 0) {
    error_ = "BlasLtGemm: negative shape";
    return false;
  }
  return true;
}

const BlasLtGemm::CachedPlan* BlasLtGemm::Find(const PlanKey& key, bool make) {
  if (auto it = plans_.find(key); it != plans_.end()) return &it->second;
  const int64_t m = key[0], n = key[1], k = key[2];
  const float* bias = reinterpret_cast<const float*>(static_cast<uintptr_t>(key[3]));
  if (!make) {
    error_ = "cuBLASLt GEMM " + ShapeText(m, n, k) + " was not planned before the pass";
    return nullptr;
  }
  // Builds the descriptors of a plan; `epilogue` asks for the bias one.
  auto build = [&](CachedPlan& p, bool epilogue) -> cublasStatus_t {
    cublasLtMatmulDesc_t raw_desc = nullptr;
    cublasStatus_t s = cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    p.desc.reset(raw_desc);
    const int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    s = cublasLtMatmulDescSetAttribute(p.desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                       sizeof(trans_a));
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    s = cublasLtMatmulDescSetAttribute(p.desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                       sizeof(trans_b));
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    if (epilogue) {
      const uint32_t ep = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = CUDA_R_32F;
      s = cublasLtMatmulDescSetAttribute(p.desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, &ep,
                                         sizeof(ep));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      s = cublasLtMatmulDescSetAttribute(p.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                         &bias_type, sizeof(bias_type));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      s = cublasLtMatmulDescSetAttribute(p.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof(bias));
      if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    // See the layout comment at the top of this file.
    cublasLtMatrixLayout_t raw = nullptr;
    s = cublasLtMatrixLayoutCreate(&raw, CUDA_R_16BF, static_cast<uint64_t>(k),
                                   static_cast<uint64_t>(n), k);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    p.a.reset(raw);
    s = cublasLtMatrixLayoutCreate(&raw, CUDA_R_16BF, static_cast<uint64_t>(k),
                                   static_cast<uint64_t>(m), k);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    p.b.reset(raw);
    s = cublasLtMatrixLayoutCreate(&raw, CUDA_R_32F, static_cast<uint64_t>(n),
                                   static_cast<uint64_t>(m), n);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    p.d.reset(raw);
    return CUBLAS_STATUS_SUCCESS;
  };

  // The heuristic's best algorithms that fit the workspace and the actual pointer alignments
  // (the default preference assumes 256-byte aligned operands).
  Preference pref;
  cublasLtMatmulPreference_t raw_pref = nullptr;
  cublasStatus_t s = cublasLtMatmulPreferenceCreate(&raw_pref);
  if (s != CUBLAS_STATUS_SUCCESS) {
    error_ = "cublasLtMatmulPreferenceCreate: " + StatusText(s);
    return nullptr;
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
      return nullptr;
    }
  }
  // The bias epilogue first (when there is a bias), then the plain GEMM plus AddBias.
  cublasStatus_t last = CUBLAS_STATUS_NOT_SUPPORTED;
  for (const bool epilogue : {true, false}) {
    if (epilogue && bias == nullptr) continue;
    CachedPlan plan;
    plan.bias_epilogue = epilogue;
    last = build(plan, epilogue);
    if (last != CUBLAS_STATUS_SUCCESS) continue;
    cublasLtMatmulHeuristicResult_t results[kMaxAlgorithms] = {};
    int count = 0;
    last = cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc.get(), plan.a.get(), plan.b.get(),
                                          plan.d.get(), plan.d.get(), pref.get(), kMaxAlgorithms,
                                          results, &count);
    if (last != CUBLAS_STATUS_SUCCESS) continue;
    for (int i = 0; i < count; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      cublasLtMatmulHeuristicResult_t checked{};
      if (cublasLtMatmulAlgoCheck(handle_, plan.desc.get(), plan.a.get(), plan.b.get(),
                                  plan.d.get(), plan.d.get(), &results[i].algo,
                                  &checked) != CUBLAS_STATUS_SUCCESS ||
          checked.workspaceSize > max_workspace) {
        continue;
      }
      plan.algos[plan.num_algos++] = results[i].algo;
    }
    if (plan.num_algos > 0) return &plans_.emplace(key, std::move(plan)).first->second;
    last = CUBLAS_STATUS_NOT_SUPPORTED;
  }
  error_ =
      "cuBLASLt has no algorithm for bf16 GEMM " + ShapeText(m, n, k) + ": " + StatusText(last);
  return nullptr;
}

bool BlasLtGemm::Plan(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                      int64_t k, const float* bias, const float* y) {
  if (!Shape(m, n, k)) return false;
  if (m == 0 || n == 0 || k == 0) return true;  // no cuBLASLt call (see Run)
  return Find(KeyOf(x, m, w, n, k, bias, y), /*make=*/true) != nullptr;
}

bool BlasLtGemm::Linear(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                        int64_t k, const float* bias, float* y, cudaStream_t stream) {
  if (!Shape(m, n, k)) return false;
  if (m == 0 || n == 0 || k == 0) return Run(CachedPlan{}, x, m, w, n, k, bias, y, stream);
  const CachedPlan* plan = Find(KeyOf(x, m, w, n, k, bias, y), /*make=*/true);
  return plan != nullptr && Run(*plan, x, m, w, n, k, bias, y, stream);
}

bool BlasLtGemm::LinearPlanned(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                               int64_t k, const float* bias, float* y, cudaStream_t stream) {
  if (!Shape(m, n, k)) return false;
  if (m == 0 || n == 0 || k == 0) return Run(CachedPlan{}, x, m, w, n, k, bias, y, stream);
  const CachedPlan* plan = Find(KeyOf(x, m, w, n, k, bias, y), /*make=*/false);
  return plan != nullptr && Run(*plan, x, m, w, n, k, bias, y, stream);
}

bool BlasLtGemm::Run(const CachedPlan& plan, const __nv_bfloat16* x, int64_t m,
                     const __nv_bfloat16* w, int64_t n, int64_t k, const float* bias, float* y,
                     cudaStream_t stream) {
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
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t s = CUBLAS_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < plan.num_algos; ++i) {
    s = cublasLtMatmul(handle_, plan.desc.get(), &alpha, w, plan.a.get(), x, plan.b.get(), &beta, y,
                       plan.d.get(), y, plan.d.get(), &plan.algos[i], workspace_.get(),
                       workspace_.bytes(), stream);
    // Refused before launching: the next algorithm. Anything else is final.
    if (s != CUBLAS_STATUS_NOT_SUPPORTED && s != CUBLAS_STATUS_INVALID_VALUE) break;
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    error_ = "cublasLtMatmul " + ShapeText(m, n, k) + ": " + StatusText(s);
    return false;
  }
  if (bias != nullptr && !plan.bias_epilogue) {
    const cudaError_t err = AddBias(y, bias, m, n, stream);
    if (err != cudaSuccess) {
      error_ = "AddBias after cuBLASLt: " + CudaErrorText(err);
      return false;
    }
  }
  return true;
}

}  // namespace sdm::kernels::cuda
