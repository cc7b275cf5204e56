// SDM gates on the GPU: for `rows` tokens and `heads` heads, from the a_proj / b_proj outputs
// (a, b: [rows, heads], device memory), computes the decay alpha = exp(g) with
// g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), using the same
// SDM_HOST_DEVICE math as the CPU engine (kernels/common/sdm_math.h).
#ifndef SDMSERVE_KERNELS_CUDA_SDM_GATES_H_
#define SDMSERVE_KERNELS_CUDA_SDM_GATES_H_

#include <cstdint>

namespace sdm::kernels::cuda {

#if defined(SDM_HAVE_CUDA)
// Host entry point on host buffers (copies in and out): used by the CPU-vs-GPU test.
// Returns false if a CUDA call failed.
bool SdmGatesOnDevice(const float* a, const float* b, const float* a_log, const float* dt_bias,
                      int64_t rows, int64_t heads, float* alpha, float* beta);
#endif

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_SDM_GATES_H_
