// Naive host stand-in for kernels/cuda/gemm.cu (testing only): y[m, n] = x[m, k] w[n, k]^T
// (+ bias) with bf16 inputs and fp32 accumulation. Checks that every operand is a device range
// of the right size (the shapes the engine passes).
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cuda/gemm.h"

namespace sdm::kernels::cuda {

static void CheckDev(const void* p, size_t bytes, const char* what, int64_t m, int64_t n,
                     int64_t k) {
  if (!emu::IsDevicePtr(p, bytes)) {
    std::fprintf(stderr,
                 "EMU HOST FAILURE: GEMM operand %s (%zu bytes) is not a device range (m=%ld "
                 "n=%ld k=%ld)\n",
                 what, bytes, static_cast<long>(m), static_cast<long>(n), static_cast<long>(k));
    std::abort();
  }
}

// Every operand of y[m, n] = x[m, k] w[n, k]^T (+ bias) is a device range of its size.
static void CheckOperands(const void* x, int64_t m, const void* w, int64_t n, int64_t k,
                          const float* bias, const void* y) {
  CheckDev(x, m * k * 2, "x", m, n, k);
  CheckDev(w, n * k * 2, "w", m, n, k);
  CheckDev(y, m * n * 4, "y", m, n, k);
  if (bias != nullptr) CheckDev(bias, n * 4, "bias", m, n, k);
}

BlasLtGemm::~BlasLtGemm() = default;
void BlasLtGemm::DescDeleter::operator()(cublasLtMatmulDescOpaque_t*) const {}
void BlasLtGemm::DescDeleter::operator()(cublasLtMatrixLayoutOpaque_t*) const {}

// Plans are keyed as on the device (kernels/cuda/gemm.cu) so that LinearPlanned refuses exactly
// what it would refuse there; the emulator's plan holds nothing.
BlasLtGemm::PlanKey BlasLtGemm::KeyOf(const void* x, int64_t m, const void* w, int64_t n, int64_t k,
                                      const float* bias, const void* y) {
  auto align = [](const void* p) {
    int64_t a = 256;
    while (a > 1 && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) != 0) a /= 2;
    return a;
  };
  return {m,        n,        k,       static_cast<int64_t>(reinterpret_cast<uintptr_t>(bias)),
          align(x), align(w), align(y)};
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
  auto it = plans_.find(key);
  if (it != plans_.end()) return &it->second;
  if (!make) {
    error_ = "cuBLASLt GEMM m=" + std::to_string(key[0]) + " n=" + std::to_string(key[1]) +
             " k=" + std::to_string(key[2]) + " was not planned before the pass";
    return nullptr;
  }
  CachedPlan plan;
  plan.num_algos = 1;
  return &plans_.emplace(key, std::move(plan)).first->second;
}

bool BlasLtGemm::Plan(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                      int64_t k, const float* bias, const float* y) {
  if (!Shape(m, n, k)) return false;
  if (m == 0 || n == 0 || k == 0) return true;
  CheckOperands(x, m, w, n, k, bias, y);
  return Find(KeyOf(x, m, w, n, k, bias, y), /*make=*/true) != nullptr;
}

bool BlasLtGemm::LinearPlanned(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                               int64_t k, const float* bias, float* y, cudaStream_t stream) {
  if (!Shape(m, n, k)) return false;
  if (m != 0 && n != 0 && k != 0 &&
      Find(KeyOf(x, m, w, n, k, bias, y), /*make=*/false) == nullptr) {
    return false;
  }
  return Linear(x, m, w, n, k, bias, y, stream);
}

bool BlasLtGemm::Init(size_t workspace_bytes) {
  plans_.clear();
  const cudaError_t err = workspace_.Allocate(workspace_bytes);
  if (err != cudaSuccess) {
    error_ = "workspace: " + CudaErrorText(err);
    return false;
  }
  handle_ = reinterpret_cast<cublasLtHandle_t>(this);
  return true;
}

// y = x w^T (+ bias), fp32 accumulation of bf16 inputs.
static void Multiply(const __nv_bfloat16* x, int64_t m, const __nv_bfloat16* w, int64_t n,
                     int64_t k, const float* bias, float* y) {
  std::vector<float> xf(m * k), wr(k);
  for (int64_t i = 0; i < m * k; ++i) xf[i] = __bfloat162float(x[i]);
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t i = 0; i < k; ++i) wr[i] = __bfloat162float(w[c * k + i]);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = xf.data() + r * k;
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) acc += xr[i] * wr[i];
      y[r * n + c] = bias != nullptr ? acc + bias[c] : acc;
    }
  }
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
  // Checked when enqueued and again when run (a captured GEMM runs at each graph replay).
  CheckOperands(x, m, w, n, k, bias, y);
  emu::Enqueue(
      stream,
      [=] {
        CheckOperands(x, m, w, n, k, bias, y);
        Multiply(x, m, w, n, k, bias, y);
      },
      "gemm");
  return true;
}

}  // namespace sdm::kernels::cuda
