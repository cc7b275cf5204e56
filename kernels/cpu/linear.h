// Dense layers on the CPU through OpenBLAS: y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]).
// Weights are stored [out, in] as torch.nn.Linear stores them. Call from one thread at a time
// (OpenBLAS parallelises inside).
#ifndef SDMSERVE_KERNELS_CPU_LINEAR_H_
#define SDMSERVE_KERNELS_CPU_LINEAR_H_

#include <cstdint>

namespace sdm::kernels::cpu {

// y = x w^T + bias (bias may be null). x: [m, k] row-major, w: [n, k], y: [m, n].
void Linear(const float* x, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
            float* y);

// General row-major C[m, n] = alpha * A[m, k] * B[n, k]^T + beta * C, with leading dimensions.
void GemmNT(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// C[m, n] = alpha * A[m, k] * B[k, n] + beta * C (B row-major with leading dimension ldb).
void GemmNN(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Number of threads OpenBLAS uses for one call.
void SetBlasThreads(int n);
int BlasThreads();

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_LINEAR_H_
