// Normalisations of the model (docs/model-spec.md §3, §5), in fp32 with double accumulation.
#ifndef SDMSERVE_KERNELS_CPU_NORM_H_
#define SDMSERVE_KERNELS_CPU_NORM_H_

#include <cstdint>

namespace sdm::kernels::cpu {

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, for `rows` rows of `n`. out may alias x.
void RmsNorm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out);

// LayerNorm over each row of n (biased variance, as torch.nn.LayerNorm). In place.
void LayerNorm(float* x, const float* w, const float* b, int64_t rows, int64_t n, float eps);

// Eval-mode BatchNorm1d over features: x[r][j] = (x - mean[j]) / sqrt(var[j] + eps) * w[j] + b[j],
// rounded as kernels/common/fp_math.h's BatchNormEvalValue specifies: bit for bit what
// cuda::BatchNormEval computes, so both backends select product keys from the same scores.
void BatchNormEval(float* x, const float* w, const float* b, const float* mean, const float* var,
                   int64_t rows, int64_t n, float eps);

}  // namespace sdm::kernels::cpu

#endif  // SDMSERVE_KERNELS_CPU_NORM_H_
