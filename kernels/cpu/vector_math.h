// Small vector kernels used per session and per head on the engine's threads. Reductions are
// vectorised with a fixed lane order, so a result depends only on its inputs (never on which
// thread or batch computed it).
#ifndef SDMSERVE_KERNELS_CPU_VECTOR_MATH_H_
#define SDMSERVE_KERNELS_CPU_VECTOR_MATH_H_

#include <cstdint>

namespace sdm::kernels::cpu {

float Dot(const float* a, const float* b, int64_t n);
// y += alpha * x
void Axpy(float alpha, const float* x, float* y, int64_t n);
// out[i] = silu(gate[i]) * up[i]
void SwiGlu(const float* gate, const float* up, float* out, int64_t n);
// x[i] *= sigmoid(g[i])
void MulSigmoid(const float* g, float* x, int64_t n);
// y[i] += x[i]
void AddInPlace(const float* x, float* y, int64_t n);
// In-place softmax of x[0..n) scaled by `scale` (max-subtracted, fp32 like torch).
void Softmax(float* x, int64_t n, float scale);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_VECTOR_MATH_H_
