// Token sampling on the GPU with the exact contract of engine/sampler.h's SampleToken: greedy,
// or temperature with top-k then top-p, one uniform draw u = UniformDraw(seed, draw_index)
// (kernels/common/philox.h) per row, probabilities in double. Given the same logits, the token is
// the one the CPU sampler picks.
#ifndef SDMSERVE_KERNELS_CUDA_SAMPLING_H_
#define SDMSERVE_KERNELS_CUDA_SAMPLING_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace sdm::kernels::cuda {

struct RowSampling {
  double temperature = 0.0;  // 0: greedy
  int32_t top_k = 0;         // 0: all
  double top_p = 1.0;
  uint64_t seed = 0;
  uint64_t draw_index = 0;
};

// Bytes of device scratch SampleTokens needs.
int64_t SampleTokensScratchBytes(int64_t batch, int64_t vocab);

// tokens[b] = the sampled token of logits row b ([batch, vocab]) with params[b]; params, tokens
// and scratch are device memory.
cudaError_t SampleTokens(const float* logits, int64_t batch, int64_t vocab,
                         const RowSampling* params, void* scratch, int32_t* tokens,
                         cudaStream_t stream);

}  // namespace sdm::kernels::cuda

#endif  // SDMSERVE_KERNELS_CUDA_SAMPLING_H_
