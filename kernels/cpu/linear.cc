#include "kernels/cpu/linear.h"

#include <cblas.h>

namespace sdm::kernels::cpu {

void GemmNT(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

void GemmNN(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

void Linear(const float* x, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
            float* y) {
  GemmNT(m, n, k, 1.0f, x, k, w, k, 0.0f, y, n);
  if (bias != nullptr) {
    for (int64_t i = 0; i < m; ++i) {
      float* row = y + i * n;
      for (int64_t j = 0; j < n; ++j) row[j] += bias[j];
    }
  }
}

void SetBlasThreads(int n) { openblas_set_num_threads(n); }
int BlasThreads() { return openblas_get_num_threads(); }

}  // namespace sdm::kernels::cpu
